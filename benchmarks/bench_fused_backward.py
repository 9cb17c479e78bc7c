"""Closed-form backward ops against autograd through a recomputed forward, on one CPU device.

RMS norm, RoPE and causal attention are Fused ops (hspmd.ops.nn): their backward op either runs a
closed-form vector-Jacobian product (`vjp`) or recomputes the forward under autograd and asks
torch.autograd.grad, which pays autograd's bookkeeping and, for RoPE, the position tables again
(0.2-0.45 ms a call here, whatever the size). This benchmark times one-device Trainer steps of a
small Llama (the demo's layer shapes) both ways, the sides interleaved step by step: median CPU
seconds of a step, its spread, and the ratio per pair. The losses of both sides are compared too.

    python benchmarks/bench_fused_backward.py [--steps 30] [--layers 4] [--micro-batches 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

from _common import table
from hspmd.ops import nn
from hspmd.runtime.policies.probes import ProbeShape, probe_trainer

CLOSED_FORM = (nn.RMS_NORMALIZE, nn.ROTARY, nn.PACKED_ROTARY, nn.CAUSAL_ATTENTION, nn.PACKED_ATTENTION)


@contextmanager
def autograd_backward():
    """The Fused ops' backward through autograd (their vjp set aside) while inside."""
    kept = [op.vjp for op in CLOSED_FORM]
    for op in CLOSED_FORM:
        op.vjp = None
    try:
        yield
    finally:
        for op, vjp in zip(CLOSED_FORM, kept):
            op.vjp = vjp


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sides = {"closed form": probe_trainer(ProbeShape(), args.layers, args.micro_batches),
             "autograd": probe_trainer(ProbeShape(), args.layers, args.micro_batches)}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(args.steps + 2):
        for name, (trainer, batch) in sides.items():
            with autograd_backward() if name == "autograd" else nullcontext():
                start = time.thread_time()
                loss = trainer.step(batch)
                spent = time.thread_time() - start
            losses[name].append(float(loss))
            if step >= 2:  # the first steps build the programs' caches
                seconds[name].append(spent)
    ratios = sorted(a / b for a, b in zip(seconds["closed form"], seconds["autograd"]))
    print(table(["backward", "step CPU ms (median)", "min-max"], [
        [name, f"{1e3 * statistics.median(ts):.2f}", f"{1e3 * min(ts):.2f}-{1e3 * max(ts):.2f}"] for name, ts in seconds.items()]))
    print(f"closed form / autograd: {statistics.median(ratios):.2f}x (per-pair {ratios[0]:.2f}-{ratios[-1]:.2f}, "
          f"{len(ratios)} interleaved pairs; {args.layers} layers x {args.micro_batches} micro-batches of "
          f"{ProbeShape().rows}x{ProbeShape().seq} tokens)")
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses["closed form"], losses["autograd"]))
    print(f"losses: largest relative difference {drift:.1e} over {len(losses['autograd'])} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
