"""Peak memory per process during one reshard, before and after the lean plan executor, on 4 gloo
processes, float32 2048 x 2048 (16 MiB whole).

Each process runs one reshard under torch.profiler (profile_memory) and reports the peak of bytes
allocated minus bytes freed by torch's CPU allocator while it runs, every thread of the process
included (gloo's own staging buffers are torch tensors made on its worker thread). Listed as held
= the process's source piece + that peak; the bound = source piece + memory_bound(plan, rank)
(destination piece + intermediate piece + one message-sized buffer each way), the maximum over the
4 processes of each. "Before" runs the same cases with hspmd from another git revision (default:
the commit before the lean executor), extracted to a temporary directory and run in a subprocess.

    python benchmarks/bench_reshard_memory.py [--before REV] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import io
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hspmd.annotations import device_pieces, shard
from hspmd.comm_resolve import resolve
from hspmd.backends.plan_executor import execute_plan
from hspmd.runtime.processes.multiprocess import run_multiprocess

try:
    from benchmarks._common import table
except ImportError:
    from _common import table

WORLD = 4
MiB = 1 << 20
SHAPE = (2048, 2048)
BEFORE = "c0b3e87"  # main before the lean executor
CASES = [
    ("S0 -> R (AllGather)", "S0:4@[0-3]", "D:4@[0-3]"),
    ("[S0,S1] -> [R,R]", "S0:2,S1:2@[0-3]", "D:2,D:2@[0-3]"),
    ("S1 -> R (AllGather, columns)", "S1:4@[0-3]", "D:4@[0-3]"),
    ("P -> R (AllReduce)", "P:4@[0-3]", "D:4@[0-3]"),
    ("P -> S0 (ReduceScatter)", "P:4@[0-3]", "S0:4@[0-3]"),
    ("P -> S1 (ReduceScatter, columns)", "P:4@[0-3]", "S1:4@[0-3]"),
    ("S0 -> S1 (all-to-all)", "S0:4@[0-3]", "S1:4@[0-3]"),
    ("[S0,S1] -> [S1,S0]", "S0:2,S1:2@[0-3]", "S1:2,S0:2@[0-3]"),
    ("S0 on [0,1] -> S1 on [2,3]", "S0:2@[0,1]", "S1:2@[2,3]"),
    ("TP3+TP1 split 3:1 -> two TP2", "H0(3:1){S1:3@[0,1,2] | @[3]}", "HD{S1:2@[0,1] | S1:2@[2,3]}"),
]


def peak_bytes(fn) -> int:
    """Peak of allocated - freed bytes (torch's CPU allocator, all threads) while fn runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def rank_main(backend, repeat: int) -> list[int]:
    """This rank's peak per case (the smallest of `repeat` runs: the profiler's own events and
    allocator noise only ever add)."""
    torch.set_num_threads(1)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    peaks = []
    for _, src, dst in CASES:
        plan = resolve(src, dst, SHAPE)
        backend.prepare_groups([g for g in plan.collective_groups() if backend.rank in g])
        local = shard(x, plan.src, seed=1).get(backend.rank)
        execute_plan(plan, backend, local)  # warm-up: groups, lazy initialisation
        runs = []
        for _ in range(repeat):
            backend.barrier(tuple(range(WORLD)))
            runs.append(peak_bytes(lambda: execute_plan(plan, backend, local)))
        peaks.append(min(runs))
    return peaks


def measure(repeat: int) -> list[list[int]]:
    """[rank][case] peak bytes with the hspmd on sys.path."""
    return run_multiprocess(rank_main, WORLD, repeat, timeout=900, comm_timeout=300)


def measure_revision(rev: str, repeat: int) -> list[list[int]]:
    """The same measurement with hspmd from git revision `rev` (extracted, run in a subprocess)."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "hspmd"], check=True, capture_output=True).stdout
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(tmp, filter="data")
        out = Path(tmp) / "peaks.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(Path(__file__).parent)])}
        subprocess.run([sys.executable, __file__, "--measure-only", str(out), "--repeat", str(repeat)], check=True,
                       env=env, cwd=tmp)
        return json.loads(out.read_text())


def piece_bytes(annotation: str, rank: int) -> int:
    piece = device_pieces(resolve(annotation, annotation, SHAPE).src, SHAPE).get(rank)
    return 0 if piece is None else torch.Size(piece.shape).numel() * 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="git revision measured as 'before' (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--measure-only", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_only:
        Path(args.measure_only).write_text(json.dumps(measure(args.repeat)))
        return 0
    from hspmd.backends.memory import memory_bound  # the current tree's bound (absent before)

    before = measure_revision(args.before, args.repeat)
    after = measure(args.repeat)
    rows, ok = [], True
    for i, (label, src, dst) in enumerate(CASES):
        plan = resolve(src, dst, SHAPE)
        srcs = [piece_bytes(src, r) for r in range(WORLD)]
        bound = max(srcs[r] + memory_bound(plan, r) for r in range(WORLD))
        held_before = max(srcs[r] + before[r][i] for r in range(WORLD))
        held_after = max(srcs[r] + after[r][i] for r in range(WORLD))
        fits = all(after[r][i] <= memory_bound(plan, r) for r in range(WORLD))
        ok &= fits
        rows.append([label, "+".join(plan.primitives), f"{max(srcs) / MiB:.1f}",
                     f"{max(piece_bytes(dst, r) for r in range(WORLD)) / MiB:.1f}", f"{bound / MiB:.1f}",
                     f"{held_before / MiB:.1f}", f"{held_after / MiB:.1f}", f"{held_after / held_before:.2f}",
                     "yes" if fits else "NO"])
    print(f"Peak memory per process during one reshard, {WORLD} gloo processes, float32 {SHAPE[0]}x{SHAPE[1]} "
          f"(16 MiB whole); max over processes; before = hspmd at {args.before}, smallest of {args.repeat} runs")
    print(table(["layout", "plan", "src MB", "dst MB", "bound MB", "before MB", "after MB", "after/before",
                 "within bound"], rows))
    print("held = source piece + peak of torch bytes allocated - freed during the reshard (all threads);\n"
          "bound = source piece + destination piece + intermediate piece + one message buffer each way")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
