"""Training-step time of hspmd against a hand-written torch.distributed Megatron MLP, DP2 x TP2.

The model: L residual blocks x <- x + relu(x @ W1) @ W2 with W1 column-parallel and W2
row-parallel, loss = mean((x - target)^2), plain SGD. Four gloo processes, ranks 0,1 and 2,3 are
the TP groups, 0,2 and 1,3 the DP groups. hspmd runs the graph written once from one device's view
with annotations (specialized per rank, driven by run_forward / run_backward / run_update over
TorchDistBackend); the baseline is written by hand: an all_reduce on the TP group in the row
layer's forward and in the column layer's input backward (Megatron's f and g), then the gradient
all_reduce over the DP group. Both start from the same weights, see the same batches, and must
report the same loss at every step.

Both run side by side in one job, interleaved step by step (alternating which goes first) so
machine noise hits both alike. A step's time is the slowest rank's, each step starting on a world
barrier; the figure is the median over the timed steps, after warm-up.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hspmd.ir import Binding, comm, initial_value, parameter, placeholder
from hspmd.ops import SGD, Graph, relu
from hspmd.backends.backend import Backend
from hspmd.runtime.multiprocess import run_multiprocess
from hspmd.runtime.run import DeviceState, device_feeds, run_backward, run_forward, run_update
from hspmd.specialize.specialized import specialize_graph

try:
    from benchmarks._common import ms, slowest_rank_median, table, timed_on_world
except ImportError:
    from _common import ms, slowest_rank_median, table, timed_on_world

WORLD, DP, TP = 4, 2, 2
ACT, COLUMN, ROW = "S0:2,D:2@[0-3]", "D:2,S1:2@[0-3]", "D:2,S0:2@[0-3]"
LR = 0.05


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


def build_mlp(c: Config):
    """The model from one device's view; its DP x TP layout comes only from the annotations."""
    g = Graph("megatron_mlp")
    x = placeholder(g, "x", (c.batch, c.hidden), annotation=ACT)
    target = placeholder(g, "target", (c.batch, c.hidden), annotation=ACT)
    for l in range(c.layers):
        w1 = parameter(g, f"w1.{l}", (c.hidden, c.ffn), annotation=COLUMN)
        w2 = parameter(g, f"w2.{l}", (c.ffn, c.hidden), annotation=ROW)
        block_in = comm(x, ACT, name=f"in.{l}")
        x = x + comm(relu(block_in @ w1) @ w2, ACT, name=f"out.{l}")
    d = x - target
    loss = (d * d).mean()
    SGD(lr=LR).minimize(loss)
    return g, loss


def batch(c: Config, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(c.batch, c.hidden, generator=gen), "target": torch.randn(c.batch, c.hidden, generator=gen)}


class HspmdRank:
    """This rank's executable graph and state; step() runs forward, backward and update."""

    def __init__(self, backend: Backend, c: Config):
        self.backend, self.config = backend, c
        graph, self.loss = build_mlp(c)
        self.spec = specialize_graph(graph, 0, Binding(), devices=[backend.rank])
        self.exe = self.spec.executables[backend.rank]
        self.state = DeviceState.initial(self.exe)
        self.initial = {n.name: initial_value(n) for n in graph.parameters}
        comms = [ins.node for prog in (self.exe.forward, self.exe.backward, self.exe.update) for ins in prog
                 if ins.node.opdef.is_comm and ins.role != "identity"]
        groups = {g for node in comms for g in self.exe.plan(node, self.spec.binding).collective_groups()}
        backend.prepare_groups(sorted(g for g in groups if backend.rank in g))

    def step(self, feeds: dict[str, torch.Tensor]) -> float:
        self.state.fetched.clear()
        mb = run_forward(self.exe, self.backend, self.state, feeds)
        run_backward(self.exe, self.backend, self.state, mb)
        run_update(self.exe, self.backend, self.state)
        return float(self.state.fetched[self.loss.name])


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


class TorchRank:
    """The same model written by hand against torch.distributed."""

    def __init__(self, rank: int, c: Config, initial: dict[str, torch.Tensor]):
        self.config = c
        self.dp_rank, self.tp_rank = divmod(rank, TP)
        groups = {}
        for members in ([0, 1], [2, 3], [0, 2], [1, 3]):  # every rank creates every group, same order
            groups[tuple(members)] = dist.new_group(members)
        self.tp_group = groups[tuple(r for r in range(WORLD) if r // TP == self.dp_rank)]
        self.dp_group = groups[tuple(r for r in range(WORLD) if r % TP == self.tp_rank)]
        cols = slice(self.tp_rank * c.ffn // TP, (self.tp_rank + 1) * c.ffn // TP)
        self.w1 = [initial[f"w1.{l}"][:, cols].clone().requires_grad_() for l in range(c.layers)]
        self.w2 = [initial[f"w2.{l}"][cols, :].clone().requires_grad_() for l in range(c.layers)]
        self.rows = slice(self.dp_rank * c.batch // DP, (self.dp_rank + 1) * c.batch // DP)

    def step(self, whole: dict[str, torch.Tensor]) -> float:
        c = self.config
        x, target = whole["x"][self.rows], whole["target"][self.rows]
        for w1, w2 in zip(self.w1, self.w2):
            h = torch.relu(_CopyToTensorParallel.apply(x, self.tp_group) @ w1)
            x = x + _ReduceFromTensorParallel.apply(h @ w2, self.tp_group)
        loss = ((x - target) ** 2).sum() / (c.batch * c.hidden)  # this DP rank's summand of the mean
        loss.backward()
        with torch.no_grad():
            for w in (*self.w1, *self.w2):
                dist.all_reduce(w.grad, group=self.dp_group)
                w -= LR * w.grad
                w.grad = None
        return float(loss.detach())


def rank_main(backend: Backend, c: Config, warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    hspmd = HspmdRank(backend, c)
    baseline = TorchRank(backend.rank, c, hspmd.initial)
    out = {"hspmd": [], "torch": [], "hspmd_loss": [], "torch_loss": []}
    for i in range(warmup + steps):
        whole = batch(c, i)
        mine = device_feeds(hspmd.exe, whole, hspmd.spec.binding)
        runs = [("hspmd", lambda: hspmd.step(mine)), ("torch", lambda: baseline.step(whole))]
        for name, run in runs if i % 2 == 0 else runs[::-1]:
            seconds, loss = timed_on_world(backend, run)
            out[f"{name}_loss"].append(loss)
            if i >= warmup:
                out[name].append(seconds)
    return out


def close(a: list[float], b: list[float]) -> bool:
    """Equal to float32 rounding (the two add and multiply in different orders)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for x, y in zip(a, b))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    rows, ok = [], True
    for c in CONFIGS:
        start = time.perf_counter()
        per_rank = run_multiprocess(rank_main, WORLD, c, args.warmup, args.steps, timeout=600, comm_timeout=120)
        # the loss is Partial over DP (each DP group holds its rows' summand): add ranks 0 and 2
        hspmd_loss = [a + b for a, b in zip(per_rank[0]["hspmd_loss"], per_rank[2]["hspmd_loss"])]
        torch_loss = [a + b for a, b in zip(per_rank[0]["torch_loss"], per_rank[2]["torch_loss"])]
        same = close(hspmd_loss, torch_loss) and all(close(r["hspmd_loss"], r["torch_loss"]) for r in per_rank)
        ok &= same
        h = slowest_rank_median([r["hspmd"] for r in per_rank])
        t = slowest_rank_median([r["torch"] for r in per_rank])
        rows.append([c.name, f"B{c.batch} H{c.hidden} F{c.ffn} L{c.layers}", ms(h), ms(t), f"{h / t:.3f}",
                     f"{hspmd_loss[0]:.5f} -> {hspmd_loss[-1]:.5f}", "yes" if same else "NO",
                     f"{time.perf_counter() - start:.0f}s"])
    print(f"DP{DP} x TP{TP} Megatron MLP, {WORLD} gloo processes, 1 thread each; median of {args.steps} steps "
          f"after {args.warmup} warm-up (slowest rank per step)")
    print(table(["config", "shape", "hspmd ms", "torch ms", "ratio", "loss first -> last", "same loss", "wall"], rows))
    print("goal: ratio <= 1.15")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
