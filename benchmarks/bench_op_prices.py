"""Are the op prices right at every model depth and micro-batch size? (level 2 on one device.)

The calibration prices each op kind from probe steps of 1- and 2-layer Llamas at micro-batches of
4 and 16 sequences (runtime/policies/probes.py), and level 2 prices every program with those
prices. This benchmark checks that scaling on its own: one process, one emulated device of the
reference type (slowdown 8, sleeping in chunks, as the op probes run), no communication and no
sleep before one. Round by round it runs the calibration's step probes and then, interleaved,
steps of the demo's Llama layer stacked `--layers` deep at each micro-batch layout of `--shapes`
(`2x4`: two micro-batches of 4 sequences); the fit to all the rounds' probes prices each (level
2's host work of a step: its ops, its passes' and the step's own work) against the CPU time the
device owed for it (typical over the rounds, with min-max). What is left is the op prices' own
error by depth and micro-batch size, apart from the emulator's sleeps and the links
(bench_calibration.py --emulate measures those together, on two ranks).

    python benchmarks/bench_op_prices.py --layers 1,2,4,8 --shapes 1x4,2x4,1x8,1x16 --rounds 8

Timing-sensitive: not part of `make test`. Pinned to one CPU (`--cpu`, default the last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import ms, table  # noqa: E402
from hspmd.errors import HSPMDError  # noqa: E402
from hspmd.ir.shapes import Binding  # noqa: E402
from hspmd.models.llama import build_llama  # noqa: E402
from hspmd.planning import from_llama_config  # noqa: E402
from hspmd.planning.device_sim import host_step_work, simulate_device_run  # noqa: E402
from hspmd.planning.fitting import typical  # noqa: E402
from hspmd.runtime.execution.batches import MicroBatchLayout  # noqa: E402
from hspmd.runtime.execution.emulation import emulation_of  # noqa: E402
from hspmd.runtime.policies.calibrate import fit  # noqa: E402
from hspmd.runtime.policies.calibration import Calibration  # noqa: E402
from hspmd.runtime.policies.probes import Probe, ProbeShape, probe_device, probe_trainer  # noqa: E402
from hspmd.specialize.specialized import specialize_graph  # noqa: E402
from hspmd.specialize.strategy_text import parse_strategy  # noqa: E402

SLOWDOWN = 8.0  # the reference type's, as bench_calibration's emulated pairs run it
TIMED_STEPS = 2  # per configuration and round, after an untimed one (as the probes time theirs)


def layout_of(text: str, shape: ProbeShape) -> tuple[int, int]:
    """(micro-batches, micro-batch size in shape.rows) of a layout `MxN` (N sequences a micro-batch)."""
    try:
        count, size = (int(v) for v in text.split("x"))
    except ValueError:
        raise HSPMDError(f"--shapes: {text!r} is not MxN (M micro-batches of N sequences)") from None
    if count < 1 or size < shape.rows or size % shape.rows:
        raise HSPMDError(f"--shapes: {text!r}: a micro-batch must be a multiple of the probe's {shape.rows} sequences")
    return count, size // shape.rows


def stack_shape(width: str | None, shape: ProbeShape) -> ProbeShape:
    """The measured stack's layer: the probes' `shape`, or narrowed to `width` "HEADS,FFN" (a
    tensor-parallel rank's shard: its heads and FFN units divide the layer's)."""
    if width is None:
        return shape
    try:
        heads, ffn = (int(v) for v in width.split(","))
    except ValueError:
        raise HSPMDError(f"--width: {width!r} is not HEADS,FFN (two integers)") from None
    if not (0 < heads <= shape.heads and shape.heads % heads == 0 and 0 < ffn <= shape.ffn and shape.ffn % ffn == 0):
        raise HSPMDError(f"--width {width}: the heads and FFN units must divide the layer's {shape.heads} and {shape.ffn}")
    return replace(shape, heads=heads, ffn=ffn, head_dim=shape.hidden // shape.heads)


def owed_cpu(trainer, batch) -> float:
    """The device CPU seconds one step owes (its ops, passes and the trainer's work), over
    TIMED_STEPS steps after an untimed one; the debt is dropped unslept after each side."""
    device = emulation_of(trainer.backend)
    trainer.step(batch)
    device.forgive_debt()
    before = device.op_cpu_s
    for _ in range(TIMED_STEPS):
        trainer.step(batch)
    device.forgive_debt()
    return (device.op_cpu_s - before) / TIMED_STEPS


def priced(calibration: Calibration, shape: ProbeShape, layers: int, count: int, rows: int) -> tuple[float, float]:
    """(level 2's host seconds of one step, its peak live bytes) of the probe Llama `layers` deep
    with `count` micro-batches of `rows` x shape.rows sequences, on one device of this calibration."""
    config = shape.config(layers)
    strategy = parse_strategy(f"layers={layers} ; {count}x{rows * shape.rows}: R0 L0-{layers - 1}")
    layout = MicroBatchLayout.of(strategy)
    binding = Binding.of({"B": sum(layout.sizes), "S": shape.seq, "T": layout.global_batch_size * shape.seq},
                         ratios=layout.sizes)
    spec = specialize_graph(build_llama(config, [strategy]).graph, 0, binding)
    cost = calibration.cost_model(from_llama_config(config, shape.seq), 1)
    counts = dict(enumerate(layout.counts))
    result, costs = simulate_device_run(spec, cost, counts, "1f1b")
    return host_step_work(spec, cost, costs, counts)[0], result.peak_memory.get(0, 0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="1,2,4,8", help="model depths (comma-separated)")
    p.add_argument("--shapes", default="1x4,2x4,1x8,1x16", help="micro-batch layouts MxN (comma-separated)")
    p.add_argument("--width", default=None, metavar="HEADS,FFN",
                   help="the stack's layer narrowed to HEADS heads and FFN hidden units (2,64: a TP2 rank's shard "
                        "of the demo's layer, without its collectives); the probes keep the demo's layer")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--cpu", type=int, default=None, help="the CPU to pin to (default: the last this process may use)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))})
    shape = ProbeShape()
    try:
        configs = [(int(depth), text, *layout_of(text, shape)) for depth in args.layers.split(",") for text in args.shapes.split(",")]
        stack = stack_shape(args.width, shape)
    except ValueError as e:
        p.error(str(e))
    probe = Probe(None, shape, cpu_time=True, emulate=SLOWDOWN)
    device = probe_device(SLOWDOWN, (time.perf_counter, time.thread_time))  # the op probes' regime: chunks alone
    trainers = {(depth, text): probe_trainer(stack, depth, count, rows, wrap=device) for depth, text, count, rows in configs}
    probes, measured = [], {key: [] for key in trainers}
    for round_ in range(args.rounds):
        probes.append({**probe.once(parts=("micro", "steps")), "rank": 0, "round": round_})
        for key, (trainer, batch) in trainers.items():
            measured[key].append(owed_cpu(trainer, batch))
    calibration = fit(probes, shape)
    print("calibration:", calibration.describe())
    rows, figures = [], []
    for depth, text, count, size in configs:
        steps = measured[depth, text]
        got = typical(steps)
        price, peak = priced(calibration, stack, depth, count, size)
        rows.append([depth, text, f"{peak / 2**20:.2f}", ms(got), f"{ms(min(steps))}-{ms(max(steps))}", ms(price),
                     f"{(price - got) / got:+.1%}"])
        figures.append({"layers": depth, "shape": text, "peak_bytes": peak, "measured": got, "steps": steps, "level2": price})
    print(table(["layers", "micro-batches", "peak live MiB", "device CPU ms", "min-max", "level 2 ms", "error"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": calibration.to_dict(), "configs": figures, "probes": probes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
