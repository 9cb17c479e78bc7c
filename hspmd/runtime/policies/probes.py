"""The calibration's probes (hspmd.runtime.policies.calibrate): what each rank runs, any number
of times and interleaved with what a benchmark measures, for the fit to read: torch
micro-benchmarks, real steps of small Llamas with each op timed, the wake-up probe of an
emulated device, and gloo messages between two ranks."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, cast

import torch

from hspmd.backends.backend import Backend
from hspmd.backends.local import LocalWorld
from hspmd.cluster.emulation import WAIT_CHUNK_S
from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.emulation import EmulatedBackend, RankEmulator, emulation_of
from hspmd.runtime.policies.calibration import Calibration
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy


def median_seconds(fn: Callable[[], object], repeats: int = 7, inner: int = 1,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over `repeats` of the mean time of `inner` calls, on `clock` (wall time by default;
    time.thread_time: this thread's CPU time, what the calls cost a core of their own)."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(inner):
            fn()
        times.append((clock() - start) / inner)
    return statistics.median(times)


MATMUL_SIZES = (8, 32, 64, 96, 128, 192, 256)
ADD_SIZES = (64, 4096, 32768, 131072, 262144, 524288)
MESSAGE_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)


@dataclass(frozen=True)
class ProbeShape:
    """The executor probe's one Llama layer and micro-batch: the framework's per-instruction cost
    and the kernels' efficiency are fitted on it, so a benchmark may probe at its model's layer
    shapes (never its whole model). The default is the demo Llama's layer; much smaller layers
    leave too little kernel time to tell the efficiency from the overheads."""

    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    vocab: int = 64
    rows: int = 4
    seq: int = 32
    head_dim: int | None = None  # None: hidden // heads; a tensor-parallel shard keeps its layer's

    def config(self, layers: int) -> LlamaConfig:
        """The probe Llama of `layers` such layers."""
        return LlamaConfig(vocab=self.vocab, hidden=self.hidden, layers=layers, heads=self.heads, ffn=self.ffn,
                           head_dim=self.head_dim)


# (layers, micro-batches, micro-batch size in shape.rows) of the framework probe's steps; the last
# runs the 4x micro-batch two layers deep: one layer deep its ops price a stack's large micro-batches
# low (bench_op_prices.py; Simulator accuracy in docs/design.md)
PROBE_RUNS = ((1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 4), (2, 1, 4))


def probe_trainer(shape: ProbeShape = ProbeShape(), layers: int = 1, micro_batches: int = 1, rows: int = 1,
                  wrap: Callable[[Backend], Backend] | None = None):
    """A one-device Trainer of a small Llama at the probe's layer shapes (never a model a benchmark
    predicts), micro-batches of `rows` x shape.rows, and the global batch of one step; `wrap`
    turns its backend into another (an emulated device's)."""
    config = shape.config(layers)
    strategy = parse_strategy(f"layers={layers} ; {micro_batches}x{rows * shape.rows}: R0 L0-{layers - 1}")
    graph = build_llama(config, [strategy], optimizer=AdamW(lr=1e-3)).graph
    layout = MicroBatchLayout.of(strategy)
    step_rows = layout.global_batch_size
    backend = LocalWorld([0]).backends[0]
    trainer = Trainer(graph, 0, wrap(backend) if wrap is not None else backend, layout, schedule="1f1b",
                      symbols={"S": shape.seq, "T": step_rows * shape.seq})
    gen = torch.Generator().manual_seed(0)
    batch = {name: torch.randint(0, shape.vocab, (step_rows, shape.seq), generator=gen) for name in ("tokens", "labels")}
    return trainer, batch


# ops between the wake-up probe's sleeps: fewer than a TP layer's ops between its collectives
# (sleeps of a few ms at 8x, shorter than TP2's: the work after even a short sleep runs slower),
# to a few steps' (the 2-layer probe step runs ~200), whose sleeps at a slow type's slowdown near
# a chunk's length (a data-parallel step sleeps in chunks: its passes communicate nothing)
WAKE_INTERVALS = (4, 16, 64, 256, 640)
# timed steps per side of the wake-up probe, and at the longer intervals enough for this many
# sleeps: one step's noise (~10% of its CPU time) over a sleep or two would swamp their effect
WAKE_STEPS = 4
WAKE_SLEEPS = 4
# what Probe.once measures: the torch micro-benchmarks, the step probes (steps and their ops),
# the wake-up probe (emulated only) and the gloo messages (two ranks only)
PROBE_PARTS = ("micro", "steps", "after_sleep", "links")


@dataclass(frozen=True)
class TimedSteps:
    """Probe steps timed: a step's seconds, each op's CPU seconds by name (when recorded), and
    how many sleeps the wake-up probe asked of the device over them."""

    seconds: float
    ops: dict[str, list[float]]
    wakes: int


class WakingEmulator(RankEmulator):
    """The probes' emulated device. While `wake_every` is set it sleeps only where the wake-up
    probe asks: it settles its debt after every that many ops (sleeping, as an emulated rank does
    before each communication; no chunks) and counts those sleeps in `wakes`. Otherwise it runs
    as an emulated rank between communications does, sleeping in chunks: the op timings level 2
    prices, and the wake-up probe's plain side."""

    wake_every: int | None = None
    wakes = 0

    def computed(self, outputs=(), where: str = "") -> None:
        super().computed(outputs, where)
        if self.wake_every and self.ops % self.wake_every == 0:
            self.wakes += 1
            self.settle()


def probe_device(slowdown: float, clocks: tuple[Callable[[], float], Callable[[], float]]) -> Callable[[Backend], Backend]:
    """A `wrap` for probe_trainer: its backend as the step probes' emulated device (a
    WakingEmulator of `slowdown` on one calibrated CPU, timing on `clocks`: wall, CPU)."""
    host = Calibration(1.0, 1.0, 0.0, 0.0, 1.0).cluster(1)
    return lambda inner: EmulatedBackend(inner, host, WakingEmulator(0, "probe", slowdown, clocks=clocks), None)


class Probe:
    """One rank's micro-benchmarks, set up once and run any number of times (`once()`), so that a
    benchmark can interleave them with what it measures and both see the same machine load."""

    def __init__(self, backend: Backend | None, shape: ProbeShape = ProbeShape(), cpu_time: bool = False,
                 emulate: float | None = None, wake_at: tuple[float, ...] = ()):
        torch.set_num_threads(1)
        self.backend = backend
        # compute probes on this thread's CPU time: what emulated devices follow (runtime.execution.emulation)
        self.clock = time.thread_time if cpu_time else time.perf_counter
        self.matrices = [(torch.randn(n, n), torch.randn(n, n)) for n in MATMUL_SIZES]
        self.vectors = [(torch.randn(n), torch.randn(n)) for n in ADD_SIZES]
        if emulate is not None and not emulate > 1:
            raise HSPMDError(f"Probe(emulate={emulate}): an emulated probe needs a slowdown > 1")
        # every step probe runs on an emulated device (of slowdown 1 when not emulating: its
        # bookkeeping costs ~1 us per op), whose op hook times each op on the probe's clock
        wrap = probe_device(emulate or 1.0, (time.perf_counter, time.thread_time if emulate is not None else self.clock))
        self.emulated = emulate is not None
        # the wake-up probe's slowdowns: the reference's and the other emulated types' (`wake_at`)
        self.wake_slowdowns = tuple(sorted({emulate, *(s for s in wake_at if s > 1)})) if emulate is not None else ()
        self.trainers = [probe_trainer(shape, *run, wrap=wrap) for run in PROBE_RUNS]
        self.messages = [torch.zeros(n // 4) for n in MESSAGE_SIZES]
        self.rounds = 0

    def _timed_steps(self, trainer: Trainer, batch, steps: int, record: bool = False) -> TimedSteps:
        """`steps` probe steps after an untimed one (so they meet the caches a step of their own
        left), timed on the probe's clock or, emulated, by the CPU time the device owed (what an
        emulated rank's steps are slowed by, between its sleeps); with
        `record`, each op's CPU seconds by name. The wake-up probe's sleeps are counted over those steps."""
        device = cast(WakingEmulator, emulation_of(trainer.backend))
        trainer.step(batch)
        device.op_seconds, device.wakes = ({} if record else None), 0
        device.mark()
        before, start = device.op_cpu_s, self.clock()
        for _ in range(steps):
            trainer.step(batch)
        seconds = (device.op_cpu_s - before if self.emulated else self.clock() - start) / steps
        ops, device.op_seconds = device.op_seconds or {}, None
        return TimedSteps(seconds, ops, device.wakes)

    def _step_seconds(self, trainer: Trainer, batch) -> tuple[float, dict[str, float]]:
        """(a probe step's seconds, each op's median seconds by name): `_timed_steps` of two."""
        timed = self._timed_steps(trainer, batch, 2, record=True)
        return timed.seconds, {name: statistics.median(times) for name, times in timed.ops.items()}

    def _after_sleep(self, trainer: Trainer, batch, slowdown: float) -> list[tuple[float, float]]:
        """(work seconds, fraction) per WAKE_INTERVALS: how much more CPU time a step of an
        emulated device of `slowdown` takes when it sleeps every that many ops than the op probes'
        steps do (the reference's slowdown, sleeping in chunks: what level 2's op prices are),
        and how much of that work lay between two sleeps."""
        device = cast(WakingEmulator, emulation_of(trainer.backend))
        reference = device.slowdown
        ops = device.ops
        plain = self._timed_steps(trainer, batch, WAKE_STEPS)
        ops_per_step = (device.ops - ops) / (WAKE_STEPS + 1)
        device.slowdown, device.chunk_s = slowdown, math.inf
        points = []
        for every in WAKE_INTERVALS:
            device.wake_every = every
            device.forgive_debt()  # the first sleep is an interval's debt, not the plain side's
            steps = max(WAKE_STEPS, math.ceil(WAKE_SLEEPS * every / ops_per_step))
            waking = self._timed_steps(trainer, batch, steps)
            if waking.wakes:
                points.append((plain.seconds * steps / waking.wakes, waking.seconds / plain.seconds - 1.0))
        device.wake_every, device.slowdown, device.chunk_s = None, reference, WAIT_CHUNK_S
        device.forgive_debt()
        return points

    def once(self, parts: tuple[str, ...] = PROBE_PARTS) -> dict:
        """Raw seconds of the probes in `parts` (PROBE_PARTS: all of them), measured once (short
        inner loops); "rank" and "round" say whose and which call it was (the step probes of two
        ranks' same round ran at once: step_jitter). A record of some parts only is another
        sample of those (calibrate.fit takes each key's typical value over the records that
        have it): the step probes cost ~0.6 s at 8x, the wake-up probe several seconds, so a
        benchmark can sample the op prices more often than the rest."""
        unknown = sorted(set(parts) - set(PROBE_PARTS))
        if unknown:
            raise HSPMDError(f"Probe.once(parts={parts!r}): unknown part(s) {unknown}; the parts are {', '.join(PROBE_PARTS)}")
        clock = self.clock
        self.rounds += 1
        out: dict = {"rank": self.backend.rank if self.backend is not None else 0, "round": self.rounds}
        if "micro" in parts:
            out |= {"matmul": [median_seconds(lambda: a @ b, 1, max(1, 20000 // (a.shape[0] ** 2)), clock) for a, b in self.matrices],
                    "add": [median_seconds(lambda: a + b, 1, max(1, 200000 // a.shape[0]), clock) for a, b in self.vectors]}
        if "steps" in parts:
            out |= {"steps": [], "ops": []}
            for trainer, batch in self.trainers:
                seconds, ops = self._step_seconds(trainer, batch)
                out["steps"].append(seconds)
                out["ops"].append(ops)
        if "after_sleep" in parts and self.emulated:
            trainer, batch = self.trainers[PROBE_RUNS.index((2, 1, 1))]
            out["after_sleep"] = {s: self._after_sleep(trainer, batch, s) for s in self.wake_slowdowns}
        if "links" in parts and self.backend is not None and self.backend.world_size >= 2:
            out["pingpong"], out["allreduce"] = self._links()
        return out

    def _links(self) -> tuple[list[float], list[float]]:
        """(half a gloo round trip, a 2-rank all-reduce) seconds per MESSAGE_SIZES, with rank 1 - this one."""
        backend, peer, group = self.backend, 1 - self.backend.rank, (0, 1)
        backend.barrier(group)
        pings, reduces = [], []
        for x in self.messages:
            shape = (tuple(x.shape), x.dtype)

            def round_trip():
                if backend.rank == 0:
                    backend.exchange({peer: x}, {})
                    backend.exchange({}, {peer: shape})
                else:
                    backend.exchange({peer: backend.exchange({}, {peer: shape})[peer]}, {})

            pings.append(median_seconds(round_trip, 1, 3) / 2)
            reduces.append(median_seconds(lambda: backend.all_reduce(x, group), 1, 3))
        return pings, reduces


__all__ = ["ADD_SIZES", "MATMUL_SIZES", "MESSAGE_SIZES", "PROBE_PARTS", "PROBE_RUNS", "Probe", "ProbeShape", "TimedSteps", "WAKE_INTERVALS",
           "WakingEmulator", "median_seconds", "probe_device", "probe_trainer"]
