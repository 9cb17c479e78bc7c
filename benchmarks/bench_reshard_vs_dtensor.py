"""Resharding time of hspmd (a resolved plan executed over TorchDistBackend) against DTensor's
`redistribute`, on 4 gloo processes, side by side in one job.

Part 1: layouts both can express, on a 1-D mesh of 4 and a 2x2 mesh, at 1 MiB and 16 MiB (float32).
Both start from the very same local tensors (hspmd's `shard`, Partial summands included) and must
end with the same local tensors. Each repetition starts on a world barrier; a reshard's time is
its slowest rank's; the figure is the median over repetitions (hspmd and DTensor interleaved,
alternating which goes first). The plan is resolved and its groups created once, before timing
(as DTensor caches its mesh groups); the one-off resolution time is listed too.

Part 2: layouts DTensor cannot express (heterogeneous unions, uneven HSize, moves between device
sets): hspmd's time only.

Part 3: multi-hop cases, layouts DTensor can express where hspmd's cost model prices a route through
an intermediate layout (comm_resolve/multihop.py) below every direct route: hspmd's default plan,
the best direct plan (resolve(..., multi_hop=False)) and DTensor, interleaved the same way.

Part 4: peak memory per process during one reshard, for every layout: the peak of bytes allocated
minus bytes freed by torch's CPU allocator while the reshard runs (torch.profiler memory events),
i.e. the largest extra tensor memory the reshard ever holds on top of its input. Gloo's internal
buffers are not torch tensors and are not counted. It is checked against the destination piece:
no process may hold the whole tensor when its destination piece is not the whole tensor.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.profiler import ProfilerActivity, profile

from hspmd.annotations import device_pieces, shard
from hspmd.comm_resolve import resolve
from hspmd.backends.backend import Backend
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.backends.plan_executor import execute_plan

try:
    from benchmarks._common import ms, slowest_rank_median, table, timed_on_world
except ImportError:
    from _common import ms, slowest_rank_median, table, timed_on_world

WORLD = 4
MiB = 1 << 20

# (label, hspmd src, hspmd dst, mesh shape, DTensor src placements, DTensor dst placements)
COMPARABLE = [
    ("S0 -> S1 (all-to-all)", "S0:4@[0-3]", "S1:4@[0-3]", (4,), "S0", "S1"),
    ("S0 -> R (AllGather)", "S0:4@[0-3]", "D:4@[0-3]", (4,), "S0", "R"),
    ("P -> R (AllReduce)", "P:4@[0-3]", "D:4@[0-3]", (4,), "P", "R"),
    ("P -> S0 (ReduceScatter)", "P:4@[0-3]", "S0:4@[0-3]", (4,), "P", "S0"),
    ("R -> S1 (local split)", "D:4@[0-3]", "S1:4@[0-3]", (4,), "R", "S1"),
    ("2x2 [S0,S1] -> [R,S1]", "S0:2,S1:2@[0-3]", "D:2,S1:2@[0-3]", (2, 2), "S0,S1", "R,S1"),
    ("2x2 [P,S1] -> [R,S1]", "P:2,S1:2@[0-3]", "D:2,S1:2@[0-3]", (2, 2), "P,S1", "R,S1"),
    ("2x2 [R,P] -> [R,S0]", "D:2,P:2@[0-3]", "D:2,S0:2@[0-3]", (2, 2), "R,P", "R,S0"),
    ("2x2 [S0,S1] -> [S1,S0]", "S0:2,S1:2@[0-3]", "S1:2,S0:2@[0-3]", (2, 2), "S0,S1", "S1,S0"),
    ("2x2 [S0,S1] -> [R,R]", "S0:2,S1:2@[0-3]", "D:2,D:2@[0-3]", (2, 2), "S0,S1", "R,R"),
]

# (label, src, dst): what DTensor has no placement for.
HSPMD_ONLY = [
    ("S0 -> TP2 + TP1 replicas", "S0:4@[0-3]", "HD{S1:2@[0,1] | @[2]}"),
    ("split 2:1 over TP2 and TP1", "S1:4@[0-3]", "H0(2:1){S0:2@[0,1] | @[2]}"),
    ("TP2+TP1 partial -> replicas (SplitAllReduce)", "HP{S1:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}"),
    ("TP2+TP1 split 2:1 -> replicas (SplitAllGather)", "H0(2:1){S1:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}"),
    ("uneven HSize 3:1 -> two TP2 groups", "H0(3:1){S1:3@[0,1,2] | @[3]}", "HD{S1:2@[0,1] | S1:2@[2,3]}"),
    ("S0 on [0,1] -> S0 on [2,3] (SendRecv)", "S0:2@[0,1]", "S0:2@[2,3]"),
    ("S0 on 3 devices -> S1 on 4", "S0:3@[0,1,2]", "S1:4@[0-3]"),
]

# (label, hspmd src, hspmd dst, mesh shape, DTensor src placements, DTensor dst placements): pairs whose
# default plan passes an intermediate layout at 1 MiB, 16 MiB or both (the table says which plan ran).
MULTI_HOP = [
    ("2x2 [S0,S0] -> [S1,S1]", "S0:2,S0:2@[0-3]", "S1:2,S1:2@[0-3]", (2, 2), "S0,S0", "S1,S1"),
    ("2x2 [S0,S0] -> [R,S1]", "S0:2,S0:2@[0-3]", "D:2,S1:2@[0-3]", (2, 2), "S0,S0", "R,S1"),
    ("2x2 [S0,S0] -> [S1,R]", "S0:2,S0:2@[0-3]", "S1:2,D:2@[0-3]", (2, 2), "S0,S0", "S1,R"),
]

MEMORY_HEADER = ["peak MB", "buffer MB", "piece MB", "no whole"]
SIZES = {"1MB": (512, 512), "16MB": (2048, 2048)}


def placements(text: str):
    kinds = {"R": Replicate(), "P": Partial()}
    return [kinds[p] if p in kinds else Shard(int(p[1:])) for p in text.split(",")]


def whole(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def memory_profile(fn) -> tuple[int, int, object]:
    """(peak of allocated - freed bytes, largest single allocation, fn's result) of torch's CPU
    allocator while fn runs (see the module docstring)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    held = peak = largest = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
        largest = max(largest, event.self_cpu_memory_usage)
    return peak, largest, out


class HspmdReshard:
    """One layout change on this rank: plan resolved and groups prepared once, then run."""

    def __init__(self, backend: Backend, src: str, dst: str, shape, x: torch.Tensor, multi_hop: bool = True):
        self.backend = backend
        start = time.perf_counter()
        self.plan = resolve(src, dst, shape, multi_hop=multi_hop)
        self.resolve_s = time.perf_counter() - start
        backend.prepare_groups([g for g in self.plan.collective_groups() if backend.rank in g])
        self.local = shard(x, self.plan.src, seed=1).get(backend.rank)

    def __call__(self):
        return execute_plan(self.plan, self.backend, self.local)


def measure_comparable(backend: Backend, reps: dict[str, int], warmup: int) -> list[dict]:
    meshes = {(4,): init_device_mesh("cpu", (4,)), (2, 2): init_device_mesh("cpu", (2, 2))}
    out = []
    for size, shape in SIZES.items():
        x = whole(shape)
        for label, src, dst, mesh_shape, src_p, dst_p in COMPARABLE:
            ours = HspmdReshard(backend, src, dst, shape, x)
            mesh = meshes[mesh_shape]
            theirs = DTensor.from_local(ours.local, mesh, placements(src_p), run_check=False, shape=shape,
                                        stride=x.stride())
            target = placements(dst_p)
            runs = [("hspmd", ours), ("dtensor", lambda: theirs.redistribute(mesh, target).to_local())]
            times = {"hspmd": [], "dtensor": []}
            for i in range(warmup + reps[size]):
                for name, run in runs if i % 2 == 0 else runs[::-1]:
                    seconds, result = timed_on_world(backend, run)
                    if i >= warmup:
                        times[name].append(seconds)
            same = torch.allclose(ours(), theirs.redistribute(mesh, target).to_local(), rtol=1e-5, atol=1e-5)
            out.append({"size": size, "label": label, "times": times, "same": same, "resolve_s": ours.resolve_s,
                        **memory(backend, ours, shape)})
    return out


def memory(backend: Backend, reshard: HspmdReshard, shape) -> dict:
    """This rank's memory during one reshard, and the sizes of its source and destination pieces
    (a Partial summand counts as a whole-shaped piece: it is one)."""
    backend.barrier(tuple(range(WORLD)))
    peak, largest, _ = memory_profile(reshard)
    shape = tuple(shape)
    pieces = [device_pieces(ann, shape).get(backend.rank) for ann in (reshard.plan.src, reshard.plan.dst)]
    return {"peak": peak, "largest": largest, "whole_bytes": torch.Size(shape).numel() * 4,
            "piece_bytes": max((torch.Size(p.shape).numel() * 4 for p in pieces if p is not None), default=0),
            "whole_piece": any(p is not None and tuple(p.shape) == shape for p in pieces)}


def measure_hspmd_only(backend: Backend, reps: dict[str, int], warmup: int) -> list[dict]:
    out = []
    for size, shape in SIZES.items():
        x = whole(shape)
        for label, src, dst in HSPMD_ONLY:
            ours = HspmdReshard(backend, src, dst, shape, x)
            times = []
            for i in range(warmup + reps[size]):
                seconds, _ = timed_on_world(backend, ours)
                if i >= warmup:
                    times.append(seconds)
            out.append({"size": size, "label": label, "times": {"hspmd": times}, "resolve_s": ours.resolve_s,
                        "primitives": "+".join(ours.plan.primitives), **memory(backend, ours, shape)})
    return out


def measure_multi_hop(backend: Backend, reps: dict[str, int], warmup: int) -> list[dict]:
    mesh = init_device_mesh("cpu", (2, 2))
    out = []
    for size, shape in SIZES.items():
        x = whole(shape)
        for label, src, dst, _, src_p, dst_p in MULTI_HOP:
            ours, direct = HspmdReshard(backend, src, dst, shape, x), HspmdReshard(backend, src, dst, shape, x, False)
            theirs = DTensor.from_local(ours.local, mesh, placements(src_p), run_check=False, shape=shape,
                                        stride=x.stride())
            target = placements(dst_p)
            runs = [("hspmd", ours), ("direct", direct), ("dtensor", lambda: theirs.redistribute(mesh, target).to_local())]
            times = {name: [] for name, _ in runs}
            for i in range(warmup + reps[size]):
                for name, run in runs[i % 3:] + runs[: i % 3]:
                    seconds, _ = timed_on_world(backend, run)
                    if i >= warmup:
                        times[name].append(seconds)
            expected = theirs.redistribute(mesh, target).to_local()
            same = all(torch.allclose(r(), expected, rtol=1e-5, atol=1e-5) for r in (ours, direct))
            out.append({"size": size, "label": label, "times": times, "same": same,
                        "plans": ("+".join(ours.plan.primitives), "+".join(direct.plan.primitives)),
                        "estimates": (ours.plan.estimated_seconds, direct.plan.estimated_seconds)})
    return out


def rank_main(backend: Backend, reps: dict[str, int], warmup: int) -> tuple[list[dict], list[dict], list[dict]]:
    torch.set_num_threads(1)
    return (measure_comparable(backend, reps, warmup), measure_hspmd_only(backend, reps, warmup),
            measure_multi_hop(backend, reps, warmup))


def memory_cells(per_rank: list[dict]) -> tuple[list[str], bool]:
    """[peak MB, largest buffer MB, largest own piece MB] over the processes, and whether no process
    allocated a whole-tensor buffer unless its source or destination piece is whole-shaped."""
    cells = [f"{max(r[key] for r in per_rank) / MiB:.2f}" for key in ("peak", "largest", "piece_bytes")]
    ok = all(r["whole_piece"] or r["largest"] < r["whole_bytes"] for r in per_rank)
    return cells, ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps-1mb", type=int, default=15)
    parser.add_argument("--reps-16mb", type=int, default=5)
    args = parser.parse_args(argv)
    reps = {"1MB": args.reps_1mb, "16MB": args.reps_16mb}
    start = time.perf_counter()
    per_rank = run_multiprocess(rank_main, WORLD, reps, args.warmup, timeout=900, comm_timeout=300)
    comparable = list(zip(*[r[0] for r in per_rank]))
    only = list(zip(*[r[1] for r in per_rank]))
    multi = list(zip(*[r[2] for r in per_rank]))

    rows, ok, memory_ok = [], True, True
    for cases in comparable:
        c = cases[0]
        h = slowest_rank_median([r["times"]["hspmd"] for r in cases])
        d = slowest_rank_median([r["times"]["dtensor"] for r in cases])
        same = all(r["same"] for r in cases)
        memory_columns, fits = memory_cells(cases)
        ok &= same
        memory_ok &= fits
        rows.append([c["size"], c["label"], ms(h), ms(d), f"{h / d:.2f}", "yes" if same else "NO",
                     f"{max(r['resolve_s'] for r in cases) * 1e3:.1f}", *memory_columns, "yes" if fits else "NO"])
    print(f"Reshard, {WORLD} gloo processes, float32; median of the slowest rank over "
          f"{reps['1MB']} (1MB) / {reps['16MB']} (16MB) repetitions after {args.warmup} warm-up")
    print(table(["size", "layout", "hspmd ms", "DTensor ms", "ratio", "same", "resolve ms", *MEMORY_HEADER], rows))
    print("goal: ratio <= 1.0\n")

    rows = []
    for cases in only:
        c = cases[0]
        h = slowest_rank_median([r["times"]["hspmd"] for r in cases])
        memory_columns, fits = memory_cells(cases)
        memory_ok &= fits
        rows.append([c["size"], c["label"], c["primitives"], ms(h), *memory_columns, "yes" if fits else "NO"])
    print("Layouts DTensor cannot express (heterogeneous / uneven HSize / other device sets): hspmd only")
    print(table(["size", "layout", "plan", "hspmd ms", *MEMORY_HEADER], rows))
    rows = []
    for cases in multi:
        c = cases[0]
        h, direct, d = (slowest_rank_median([r["times"][k] for r in cases]) for k in ("hspmd", "direct", "dtensor"))
        same = all(r["same"] for r in cases)
        ok &= same
        rows.append([c["size"], c["label"], c["plans"][0], c["plans"][1],
                     f"{c['estimates'][0] * 1e6:.1f} / {c['estimates'][1] * 1e6:.1f}", ms(h), ms(direct), ms(d),
                     f"{h / direct:.2f}", f"{h / d:.2f}", "yes" if same else "NO"])
    print("Multi-hop: hspmd's default plan (through an intermediate where it is priced lower) against the best direct "
          "plan and DTensor")
    print(table(["size", "layout", "hspmd plan", "direct plan", "est. us (plan / direct)", "hspmd ms", "direct ms",
                 "DTensor ms", "vs direct", "vs DTensor", "same"], rows))
    print("\nhspmd memory per process during one reshard (max over the 4 processes; whole tensor = 1 or 16 MiB):\n"
          "  peak MiB: peak of torch bytes allocated minus freed (on top of the input)\n"
          "  buffer MiB: the largest single allocation; piece MiB: the process's larger of source/destination piece\n"
          "  no whole: no process allocated a whole-tensor buffer unless its own source or destination piece is\n"
          f"  whole-shaped (Partial summands are): {'yes' if memory_ok else 'NO'}")
    print(f"wall {time.perf_counter() - start:.0f}s")
    return 0 if ok and memory_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
