"""Training-step time and memory of hspmd against hand-written torch.distributed, DP2 x TP2 MLP.

The model: L residual blocks x <- x + relu(x @ W1) @ W2 with W1 column-parallel and W2
row-parallel, loss = mean((x - target)^2), plain SGD. Four gloo processes, ranks 0,1 and 2,3 are
the TP groups, 0,2 and 1,3 the DP groups. hspmd runs the graph written once from one device's view
with annotations, through its Trainer (specialized per rank, gradients all-reduced in size-capped
buckets that start during the backward, hspmd.runtime.execution.buckets). Three torch.distributed baselines: an
all_reduce on the TP group in the row layer's forward and in the column layer's input backward
(Megatron's f and g), then the gradient all_reduce over the DP group either
  "torch"          after the backward, one blocking all_reduce per weight (the plain loop), or
  "torch overlap"  started without blocking as each weight's gradient is accumulated during the
                   backward (a post-accumulate-grad hook, DDP's idea without its buckets), waited
                   before the update, or
  "torch DDP"      torch.nn.parallel.DistributedDataParallel over the DP group (its C++ reducer,
                   25 MiB buckets with gradients as bucket views), the loss scaled by DP so that
                   its average is the same sum (exact: a power of two).
Every step returns the global loss (an all_reduce of the DP summands). All start from the same
weights, see the same batches, and must report the same loss at every step.

All sides (hspmd once per bucket cap given, default 25 MiB and 0.05 MiB, and the three baselines)
run side by side in one job, interleaved step by step (A B C D E, then B C D E A, ...) so that machine
noise hits them alike. A step's time is the slowest rank's, each step starting on a world
barrier. Reported: the median of the per-step ratios hspmd / baseline with their spread (min-max
and interquartile range), medians in ms, the median per-step ratio of CPU time (all ranks), and the peak resident memory of each
process (VmHWM,
Linux) when each side runs alone in fresh processes (in one process, memory one side freed
and the allocator kept would hide the other's).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hspmd.ir import comm, initial_value, parameter, placeholder, symbols
from hspmd.ops import SGD, Graph, relu
from hspmd.backends.backend import Backend
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.buckets import DEFAULT_BUCKET_CAP_MB
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer

try:
    from benchmarks._common import ms, table, timed_on_world
except ImportError:
    from _common import ms, table, timed_on_world

WORLD, DP, TP = 4, 2, 2
ACT, COLUMN, ROW = "S0:2,D:2@[0-3]", "D:2,S1:2@[0-3]", "D:2,S0:2@[0-3]"
LR = 0.05
BASELINES = ("torch", "torch overlap", "torch DDP")


@dataclass(frozen=True)
class Config:
    name: str
    batch: int
    hidden: int
    ffn: int
    layers: int


CONFIGS = (
    Config("small (overhead-bound)", batch=16, hidden=64, ffn=256, layers=4),
    Config("medium", batch=64, hidden=512, ffn=2048, layers=4),
)


def build_mlp(c: Config) -> Graph:
    """The model from one device's view; its DP x TP layout comes only from the annotations."""
    g = Graph("megatron_mlp")
    (rows,) = symbols("B")  # the batch size: the trainer binds it to the micro-batch size
    x = placeholder(g, "x", (rows, c.hidden), annotation=ACT)
    target = placeholder(g, "target", (rows, c.hidden), annotation=ACT)
    for l in range(c.layers):
        w1 = parameter(g, f"w1.{l}", (c.hidden, c.ffn), annotation=COLUMN)
        w2 = parameter(g, f"w2.{l}", (c.ffn, c.hidden), annotation=ROW)
        block_in = comm(x, ACT, name=f"in.{l}")
        x = x + comm(relu(block_in @ w1) @ w2, ACT, name=f"out.{l}")
    d = x - target
    loss = (d * d).mean()
    SGD(lr=LR).minimize(loss)
    return g


def batch(c: Config, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(c.batch, c.hidden, generator=gen), "target": torch.randn(c.batch, c.hidden, generator=gen)}


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input gradient is the sum over the TP group (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sum over the TP group forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _TorchMLP(torch.nn.Module):
    """One rank's Megatron MLP: column-parallel w1, row-parallel w2, f and g around them."""

    def __init__(self, w1: list[torch.Tensor], w2: list[torch.Tensor], tp_group):
        super().__init__()
        self.w1 = torch.nn.ParameterList(torch.nn.Parameter(w) for w in w1)
        self.w2 = torch.nn.ParameterList(torch.nn.Parameter(w) for w in w2)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w1, w2 in zip(self.w1, self.w2):
            h = torch.relu(_CopyToTensorParallel.apply(x, self.tp_group) @ w1)
            x = x + _ReduceFromTensorParallel.apply(h @ w2, self.tp_group)
        return x


class TorchRank:
    """The same model written by hand against torch.distributed; `mode` is how the DP gradients
    are summed: "blocking" after the backward, "overlap" each as soon as it is accumulated, "ddp"
    by DistributedDataParallel."""

    def __init__(self, rank: int, c: Config, initial: dict[str, torch.Tensor], groups: dict, mode: str):
        self.config, self.mode = c, mode
        self.dp_rank, self.tp_rank = divmod(rank, TP)
        tp_group = groups[tuple(r for r in range(WORLD) if r // TP == self.dp_rank)]
        self.dp_group = groups[tuple(r for r in range(WORLD) if r % TP == self.tp_rank)]
        cols = slice(self.tp_rank * c.ffn // TP, (self.tp_rank + 1) * c.ffn // TP)
        self.model = _TorchMLP([initial[f"w1.{l}"][:, cols].clone() for l in range(c.layers)],
                               [initial[f"w2.{l}"][cols, :].clone() for l in range(c.layers)], tp_group)
        self.weights = [*self.model.w1, *self.model.w2]
        self.rows = slice(self.dp_rank * c.batch // DP, (self.dp_rank + 1) * c.batch // DP)
        self.works: list = []
        self.forward = self.model
        if mode == "overlap":
            for w in self.weights:
                w.register_post_accumulate_grad_hook(self._start)
        elif mode == "ddp":
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, process_group=self.dp_group, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB, gradient_as_bucket_view=True)

    def _start(self, w: torch.Tensor) -> None:
        self.works.append(dist.all_reduce(w.grad, group=self.dp_group, async_op=True))

    def step(self, whole: dict[str, torch.Tensor]) -> float:
        c = self.config
        x, target = whole["x"][self.rows], whole["target"][self.rows]
        loss = ((self.forward(x) - target) ** 2).sum() / (c.batch * c.hidden)  # this DP rank's summand of the mean
        (loss * DP if self.mode == "ddp" else loss).backward()  # DDP averages: DP x summand averages to the sum
        with torch.no_grad():
            for work in self.works:
                work.wait()
            self.works = []
            for w in self.weights:
                if self.mode == "blocking":
                    dist.all_reduce(w.grad, group=self.dp_group)
                w -= LR * w.grad
                w.grad = None
            total = loss.detach().to(torch.float64)
            dist.all_reduce(total, group=self.dp_group)
        return float(total)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def hspmd_side(cap_mb: float) -> str:
    return f"hspmd, buckets {cap_mb:g} MiB"


def make_sides(backend: Backend, c: Config, caps: tuple[float, ...], names: tuple[str, ...]) -> dict:
    """{side name: its step function} on this rank (construction is collective: all ranks, same names)."""
    graph = build_mlp(c)
    sides = {}
    for cap in caps:
        if hspmd_side(cap) in names:
            trainer = Trainer(graph, 0, backend, MicroBatchLayout((1,), (c.batch,)), schedule="gpipe", symbols={},
                              bucket_cap_mb=cap)
            sides[hspmd_side(cap)] = trainer.step
    groups = {}
    for members in ([0, 1], [2, 3], [0, 2], [1, 3]):  # every rank creates every group, same order
        groups[tuple(members)] = dist.new_group(members)
    initial = {n.name: initial_value(n) for n in graph.parameters}
    for name, mode in zip(BASELINES, ("blocking", "overlap", "ddp")):
        if name in names:
            sides[name] = TorchRank(backend.rank, c, initial, groups, mode).step
    return sides


def rank_main(backend: Backend, c: Config, warmup: int, steps: int, caps: tuple[float, ...]) -> dict:
    torch.set_num_threads(1)
    names = tuple(hspmd_side(cap) for cap in caps) + BASELINES
    sides = make_sides(backend, c, caps, names)
    out = {name: {"seconds": [], "cpu": [], "loss": []} for name in names}
    for i in range(warmup + steps):
        whole = batch(c, i)
        runs = [(name, sides[name]) for name in names]
        k = i % len(runs)
        for name, run in runs[k:] + runs[:k]:
            cpu = time.process_time()
            seconds, loss = timed_on_world(backend, lambda: run(whole))
            cpu = time.process_time() - cpu
            out[name]["loss"].append(loss)
            if i >= warmup:
                out[name]["seconds"].append(seconds)
                out[name]["cpu"].append(cpu)
    return out


def memory_main(backend: Backend, c: Config, side: str, steps: int, caps: tuple[float, ...]) -> tuple[int, int]:
    """(peak resident bytes of this fresh process, the part above its size before the side was
    built): one side alone, so that neither's buffers or freed-but-kept memory count for the other."""
    torch.set_num_threads(1)
    start = _status_kib("VmRSS")
    step = make_sides(backend, c, caps, (side,))[side]
    for i in range(steps):
        step(batch(c, i))
    peak = _status_kib("VmHWM")
    return peak * 1024, (peak - start) * 1024


def profile_main(backend: Backend, c: Config, steps: int, cap_mb: float, top: int) -> str:
    """cProfile of this rank's hspmd steps alone (after 3 untimed ones): the functions that take the time."""
    torch.set_num_threads(1)
    trainer = Trainer(build_mlp(c), 0, backend, MicroBatchLayout((1,), (c.batch,)), schedule="gpipe", symbols={},
                      bucket_cap_mb=cap_mb)
    data = [batch(c, i) for i in range(steps)]
    for whole in data[:3]:
        trainer.step(whole)
    profile = cProfile.Profile()
    profile.enable()
    for whole in data:
        trainer.step(whole)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def close(a: list[float], b: list[float]) -> bool:
    """Equal to float32 rounding (the two add and multiply in different orders)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for x, y in zip(a, b))


def spread(values: list[float]) -> tuple[float, float, float, float, float]:
    """(median, min, max, first quartile, third quartile)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), min(values), max(values), q1, q3


def mib(n: float) -> str:
    return f"{n / (1 << 20):.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-cap-mb", default=f"{DEFAULT_BUCKET_CAP_MB:g},0.05",
                        help="bucket caps in MiB, comma-separated: one hspmd side per cap")
    parser.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))),
                        help="indices of the configurations to run, e.g. 0 or 0,1")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="instead: cProfile every rank's hspmd steps and print its TOP functions by own time")
    args = parser.parse_args(argv)
    caps = tuple(float(c) for c in args.bucket_cap_mb.split(","))
    if args.profile:
        for c in (CONFIGS[int(i)] for i in args.configs.split(",")):
            for rank, text in enumerate(run_multiprocess(profile_main, WORLD, c, args.steps, caps[0],
                                                         args.profile, timeout=900, comm_timeout=120)):
                print(f"==== {c.name}, rank {rank}: {args.steps} hspmd steps ====")
                print(text)
        return 0
    rows, memory, ok = [], [], True
    for c in (CONFIGS[int(i)] for i in args.configs.split(",")):
        start = time.perf_counter()
        per_rank = run_multiprocess(rank_main, WORLD, c, args.warmup, args.steps, caps, timeout=900, comm_timeout=120)
        names = [name for name in per_rank[0]]
        losses = {name: per_rank[0][name]["loss"] for name in names}
        same = all(close(r[name]["loss"], losses["torch"]) for r in per_rank for name in names)
        ok &= same
        step = {name: [max(ts) for ts in zip(*(r[name]["seconds"] for r in per_rank))] for name in names}
        cpu = {name: [sum(ts) for ts in zip(*(r[name]["cpu"] for r in per_rank))] for name in names}
        for side in (hspmd_side(cap) for cap in caps):
            for base in BASELINES:
                med, lo, hi, q1, q3 = spread([h / t for h, t in zip(step[side], step[base])])
                cpu_ratio = statistics.median(h / t for h, t in zip(cpu[side], cpu[base]))
                rows.append([c.name, side, base, ms(statistics.median(step[side])), ms(statistics.median(step[base])),
                             f"{med:.3f}", f"{lo:.2f}-{hi:.2f}", f"{q1:.3f}-{q3:.3f}", f"{cpu_ratio:.3f}",
                             "yes" if same else "NO", f"{time.perf_counter() - start:.0f}s"])
        for name in names:
            peaks = run_multiprocess(memory_main, WORLD, c, name, 3, caps, timeout=900, comm_timeout=120)
            memory.append([c.name, name, " ".join(mib(p[1]) for p in peaks), " ".join(mib(p[0]) for p in peaks)])
    print(f"DP{DP} x TP{TP} Megatron MLP, {WORLD} gloo processes, 1 thread each; {args.steps} steps after "
          f"{args.warmup} warm-up, every side once per step in rotating order; a step's time is its slowest rank's")
    print(table(["config", "hspmd", "baseline", "hspmd ms", "baseline ms", "ratio (median)", "min-max", "IQR",
                 "CPU ratio", "same loss", "wall"], rows))
    print("ratio: per step, hspmd's time / the baseline's (slowest rank each); CPU ratio: the median per-step ratio "
          "of CPU seconds summed over the ranks' processes (less sensitive to a busy machine)")
    print("goal: median ratio <= 1.05")
    print()
    print("peak memory per process (ranks 0-3), each side alone in fresh processes for 3 steps: above the "
          "process's size before the side was built, and in all")
    print(table(["config", "side", "peak above start, MiB", "peak resident, MiB"], memory))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
