"""Calibrating the cost model on this machine (HeteroSim's self-calibration, on CPU processes).

    torch micro-benchmarks   matmuls of growing size: time = F / peak + c (least squares);
                             additions of growing size: time = bytes / bandwidth + c (the
                             intercepts c are dropped: too noisy; a kernel's fixed time is
                             measured with the per-instruction overhead below, where it is paid)
    framework overhead       real Trainer steps on one device of small Llamas (not the model
    and kernel efficiency    being predicted: 1 layer x 1 micro-batch, 1 x 2, 2 x 1, and 1 x 1
                             with micro-batches 4x as large) at the probe's layer shapes; least
                             squares: measured = gamma x roofline of the step's kernels
                             + overhead x dispatched instructions (ops and communication;
                             leaves, assignments and identity comms are nearly free)
                             + step overhead (checks, feeds, reading the loss). gamma is how
                             much slower a model's kernels run than the micro-benchmarks'
                             roofline (odd shapes, broadcasts, ops made of several kernels); the
                             larger micro-batch is what tells it apart from the overhead
    per op kind              the same steps' ops, each timed on its own (the emulator's op hook):
                             least squares over every op of the four probes: an op's time = a
                             fixed time of its kind (its dispatch and the torch kernels it
                             launches: a view is cheaper than the mean instruction, attention's
                             backward several times dearer) + gamma of its kind x its roofline;
                             the work before each pass is timed apart (per pass), and what a step
                             takes beyond its ops and passes is the per-step work (OpCosts:
                             level 2 of the simulator prices each op so)
    work after a sleep       emulated step probes only: a step that sleeps off its debt every
                             4, 16, 64, 256 and 640 ops (as an emulated rank does before each
                             communication) against one that does not, at each emulated type's
                             slowdown: how much more CPU time the work between two sleeps
                             takes than the other step probes' work (the reference's slowdown,
                             sleeping in chunks of WAIT_CHUNK_S, as an emulated rank does
                             between communications: what the op prices are), as a fraction,
                             by how much work that is (a core that idled runs the work after it
                             slower, the most right after waking, and still slower tens of
                             milliseconds later)
    step jitter              the same step probes, on two ranks at once: how far each rank's
                             step strays from the ranks' mean, pooled (a device's own variance
                             from step to step, which level 2 draws from: devices that wait for
                             each other wait for the slowest)
    gloo ping-pong and       2 processes, messages of 1 KB - 4 MB: half a round trip =
    all-reduce               alpha + bytes / beta, an all-reduce = 2 alpha + bytes / beta
                             (one least-squares fit over both)

Everything runs on both processes at once, as in training (they share the machine's cores).

The result is a device type "cpu" (peak = the fitted matmul rate, bandwidth = the fitted add rate),
the fitted gamma (every kernel class), the per-instruction and per-step overheads and one link
class; saved as JSON and turned back into a ClusterSpec + CostModel for predictions. Timings use
one thread per process, like the trainers. Each measurement is the median of its repeats within a
probe and, over the probes, their trimmed mean (fitting.typical); they move with machine load.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, cast

import torch

from hspmd.backends.backend import Backend
from hspmd.backends.local import LocalWorld
from hspmd.cluster import ClusterSpec, DeviceType, LinkClass, Node
from hspmd.cluster.emulation import WAIT_CHUNK_S
from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.planning import CostModel, Efficiency, ModelSpec, OpCosts
from hspmd.planning.model import KERNEL_CLASSES
from hspmd.planning.device_sim import DISPATCHED, op_kernel
from hspmd.planning.fitting import nonnegative_least_squares, typical
from hspmd.planning.strategy_sim import simulate_strategy
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.emulation import BETWEEN_PASSES, EmulatedBackend, RankEmulator, emulation_of
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy


@dataclass(frozen=True)
class Calibration:
    """What `hspmd calibrate` measured and fitted."""

    peak_flops: float
    bandwidth: float
    overhead: float
    link_latency: float
    link_bandwidth: float
    step_overhead: float = 0.0
    gamma: float = 1.0
    op_costs: OpCosts | None = None

    def device_type(self) -> DeviceType:
        return DeviceType("cpu", (("float32", self.peak_flops),), self.bandwidth, 16e9)

    def efficiency(self) -> Efficiency:
        return Efficiency(gamma=tuple((cls, self.gamma) for cls in KERNEL_CLASSES))

    def link(self) -> LinkClass:
        return LinkClass("gloo", self.link_bandwidth, self.link_latency)

    def cluster(self, devices: int) -> ClusterSpec:
        """One node of `devices` calibrated CPU processes joined by the fitted gloo link."""
        return ClusterSpec((Node("cpu", devices),), (self.device_type(),), (self.link(),), (("cpu", "gloo"),),
                           (("*", "gloo"),), name=f"calibrated-cpu:{devices}")

    def cost_model(self, model: ModelSpec, devices: int) -> CostModel:
        return CostModel(self.cluster(devices), model, {"*": self.efficiency()}, overhead=self.overhead,
                         step_overhead=self.step_overhead, op_costs=self.op_costs)

    def cost_model_for(self, cluster: ClusterSpec, model: ModelSpec) -> CostModel:
        """The cost model of `cluster` emulated on this host (hspmd.runtime.execution.emulation): this
        fit is the emulation's reference type; a type s times slower has the fitted rates / s,
        pays (s - 1) x the per-instruction overhead per kernel as its delta and s x the per-step
        overhead and the op costs' fixed times (emulation slows all of a rank's CPU time between
        communications: ops, dispatch and the trainer's work alike); memory is its capacity x
        memory_scale; links inside a node are this host's fitted link (not emulated), between
        nodes the file's."""
        emulation = cluster.emulation
        if emulation is None:
            raise HSPMDError(f"cluster {cluster.describe()} has no emulate block: it is not run on this host")
        types, efficiency = [], {}
        for t in cluster.device_types:
            s = cluster.type_slowdown(t.name)
            memory = t.hbm_capacity * emulation.memory_scale if emulation.memory_scale is not None else t.hbm_capacity
            types.append(DeviceType(t.name, ((model.dtype, self.peak_flops / s),), self.bandwidth / s, memory))
            efficiency[t.name] = Efficiency(gamma=tuple((cls, self.gamma) for cls in KERNEL_CLASSES),
                                            delta=tuple((cls, (s - 1.0) * self.overhead) for cls in KERNEL_CLASSES),
                                            cpu_scale=s)
        host = self.link()
        links = tuple(l for l in cluster.links if l.name != host.name) + (host,)
        nodes = tuple(replace(n, intra=None) for n in cluster.nodes)
        # links not emulated (emulate.links false): every message is this host's own transfer
        inter, cross = (cluster.inter, cluster.cross) if emulation.links else ((("*", host.name),), None)
        spec = ClusterSpec(nodes, tuple(types), links, tuple((t.name, host.name) for t in types), inter,
                           cross, (), cluster.name, emulation)
        return CostModel(spec, model, efficiency, overhead=self.overhead, step_overhead=self.step_overhead,
                         op_costs=self.op_costs)

    def to_dict(self) -> dict:
        return {"peak_flops": self.peak_flops, "bandwidth": self.bandwidth, "overhead": self.overhead,
                "step_overhead": self.step_overhead, "gamma": self.gamma, "link_latency": self.link_latency,
                "link_bandwidth": self.link_bandwidth,
                **({"op_costs": self.op_costs.to_dict()} if self.op_costs is not None else {})}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """Older files' per-kernel deltas are ignored (that time is now part of `overhead`); their
        missing step overhead and gamma take the values of an unfitted model, and without op
        costs level 2 prices every instruction at `overhead`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise HSPMDError(f"cannot read calibration file {path}: {type(e).__name__}: {e}") from None
        return cls.from_dict(data, f"calibration file {path}")

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "calibration") -> "Calibration":
        """A Calibration from to_dict()'s form (a file's, or one a benchmark saved beside its
        measurements), checked: errors name `where`."""
        try:
            cal = cls(float(d["peak_flops"]), float(d["bandwidth"]), float(d["overhead"]), float(d["link_latency"]),
                      float(d["link_bandwidth"]), float(d.get("step_overhead", 0.0)), float(d.get("gamma", 1.0)),
                      OpCosts.from_dict(d["op_costs"]) if "op_costs" in d else None)
        except HSPMDError as e:
            raise HSPMDError(f"{where}: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HSPMDError(f"cannot read {where}: {type(e).__name__}: {e}") from None
        rates = {"peak_flops": cal.peak_flops, "bandwidth": cal.bandwidth, "link_bandwidth": cal.link_bandwidth,
                 "gamma": cal.gamma}
        costs = {"overhead": cal.overhead, "step_overhead": cal.step_overhead, "link_latency": cal.link_latency}
        bad = [f"{k}={v}" for k, v in rates.items() if not math.isfinite(v) or v <= 0]
        bad += [f"{k}={v}" for k, v in costs.items() if not math.isfinite(v) or v < 0]
        if bad:
            raise HSPMDError(f"{where}: {', '.join(bad)} (rates must be positive, times non-negative)")
        return cal

    def _describe_op_costs(self) -> str:
        if self.op_costs is None:
            return ""
        costs = self.op_costs
        fixed = costs.fixed_of.values()
        parts = [f"{len(fixed)} kinds, fixed {min(fixed) * 1e6:.1f}-{max(fixed) * 1e6:.1f} us",
                 f"{costs.per_pass * 1e3:.2f} ms/pass", f"{costs.per_step * 1e3:.2f} ms/step"]
        if costs.after_sleep:
            parts.append("emulated work between sleeps " + ", ".join(f"{f:+.0%} over {w * 1e3:.1f} ms"
                                                                       for w, f in costs.after_sleep))
        if costs.jitter:
            parts.append(f"step jitter {costs.jitter:.1%}")
        return f" (per op: {', '.join(parts)})"

    def describe(self) -> str:
        return (f"cpu: matmul {self.peak_flops / 1e9:.2f} GFLOP/s, elementwise {self.bandwidth / 1e9:.2f} GB/s, "
                f"model kernels x{self.gamma:.2f}, executor "
                f"{self.overhead * 1e6:.1f} us/instruction + {self.step_overhead * 1e3:.2f} ms/step"
                f"{self._describe_op_costs()}; "
                f"gloo link alpha {self.link_latency * 1e6:.1f} us, "
                f"beta {self.link_bandwidth / 1e9:.3f} GB/s")


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


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares slope and intercept (the intercept clamped at 0)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if slope <= 0:
        raise HSPMDError(f"calibration: time does not grow with size ({list(zip(xs, ys))}); the machine is too noisy")
    return slope, max(0.0, intercept)


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


# (layers, micro-batches, micro-batch size in shape.rows) of the framework probe's steps
PROBE_RUNS = ((1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 4))


def probe_trainer(shape: ProbeShape = ProbeShape(), layers: int = 1, micro_batches: int = 1, rows: int = 1,
                  wrap: Callable[[Backend], Backend] | None = None):
    """A one-device Trainer of a small Llama at the probe's layer shapes (never a model a benchmark
    predicts), micro-batches of `rows` x shape.rows, and the global batch of one step; `wrap`
    turns its backend into another (an emulated device's)."""
    config = LlamaConfig(vocab=shape.vocab, hidden=shape.hidden, layers=layers, heads=shape.heads, ffn=shape.ffn)
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


@dataclass(frozen=True)
class StepWork:
    """What one step of a probe trainer asks of the machine."""

    roofline: float  # seconds of its kernels' FLOPs and bytes at the micro-benchmarks' rates
    instructions: int  # dispatched by the executor


def step_work(trainer: Trainer, cost: CostModel) -> StepWork:
    """`cost`: the micro-benchmarks' rates, gamma = 1 and no per-kernel delta."""
    exe, binding, micro_batches = trainer.exe, trainer.binding, trainer.layout.counts[0]
    roofline, instructions = 0.0, 0
    for program, times in ((exe.forward + exe.backward, micro_batches), (exe.update, 1)):
        kernels = (op_kernel(exe, i, binding) for i in program)
        roofline += times * sum(cost.kernel_time(k, exe.device) for k in kernels if k is not None)
        instructions += times * sum(1 for ins in program if ins.role in DISPATCHED)
    return StepWork(roofline, instructions)


def fit_steps(work: list[StepWork], seconds: list[float]) -> tuple[float, float, float]:
    """(gamma, per-instruction, per-step seconds) with seconds = gamma x roofline + overhead x
    instructions + per-step: least squares with all three >= 0 (the best of the fits that leave
    out any of them), refused when gamma is not positive (kernel time that does not grow with the
    work: noise). A zero overhead is kept: a busy machine can slow the larger probe enough that
    gamma takes all the time (seen under a parallel test run)."""
    best = nonnegative_least_squares([[w.roofline, float(w.instructions), 1.0] for w in work], seconds)
    if best[0] <= 0:
        raise HSPMDError(f"calibration: step times {[round(t, 6) for t in seconds]} do not grow with the work "
                         f"{work}; the machine is too noisy, or the probe's layers too small to time their kernels")
    gamma, overhead, per_step = best
    return gamma, overhead, per_step


@dataclass(frozen=True)
class OpWork:
    """One compute op of a probe step: its name and kind, its kernel's class and roofline seconds
    at the micro-benchmarks' rates, and how many times a step runs it."""

    name: str
    kind: str
    cls: str
    roofline: float
    calls: int


def op_work(trainer: Trainer, cost: CostModel) -> tuple[OpWork, ...]:
    """The compute ops one step of a probe trainer runs (`cost`: the micro-benchmarks' rates)."""
    exe, binding, micro_batches = trainer.exe, trainer.binding, trainer.layout.counts[0]
    device = cost.device(exe.device)
    ops: dict[str, OpWork] = {}
    for program, times in ((exe.forward + exe.backward, micro_batches), (exe.update, 1)):
        for ins in program:
            kernel = op_kernel(exe, ins, binding)
            if kernel is not None:
                ops[ins.node.name] = OpWork(ins.node.name, ins.node.kind, kernel.cls,
                                            kernel.count * cost.roofline(kernel, device), times)
    return tuple(ops.values())


def fit_op_costs(work: list[tuple[OpWork, ...]], timed: list[Mapping[str, float]], steps: list[float],
                 passes_per_step: list[int]) -> OpCosts:
    """OpCosts from per-op timings: every timed op of every probe run is a row of one
    non-negative least squares, its seconds = fixed[kind] + gamma[kind] x roofline (the probes'
    micro-batches of 1x and 4x the rows are what tell the two apart); the work before a pass is
    the median of what was timed there (BETWEEN_PASSES); the per-step work is the median over
    the runs of a step's seconds less its ops and passes so priced (not below 0)."""
    passes = [t[BETWEEN_PASSES] for t in timed if BETWEEN_PASSES in t]
    per_pass = statistics.median(passes) if passes else 0.0
    rows = [(w, timed[i][w.name]) for i, run in enumerate(work) for w in run if w.name in timed[i]]
    if not rows:
        raise HSPMDError("calibration: no probe op was timed (the step probes ran no op the trainers list)")
    kinds = sorted({w.kind for w, _ in rows})
    column = {k: i for i, k in enumerate(kinds)}
    n = len(kinds)
    design = []
    for w, _ in rows:
        row = [0.0] * (2 * n)
        row[column[w.kind]], row[n + column[w.kind]] = 1.0, w.roofline
        design.append(row)
    coefficients = nonnegative_least_squares(design, [t for _, t in rows])
    fixed, gamma = dict(zip(kinds, coefficients[:n])), dict(zip(kinds, coefficients[n:]))
    priced = [sum(w.calls * (fixed[w.kind] + gamma[w.kind] * w.roofline) for w in run if w.kind in fixed)
              + per_pass * pass_count for run, pass_count in zip(work, passes_per_step)]
    per_step = max(0.0, statistics.median(s - p for s, p in zip(steps, priced)))
    return OpCosts(tuple(fixed.items()), tuple(gamma.items()), per_step, per_pass)


# ops between the wake-up probe's sleeps: fewer than a TP layer's ops between its collectives
# (sleeps of a few ms at 8x, shorter than TP2's: the work after even a short sleep runs slower),
# to a few steps' (the 2-layer probe step runs ~200), whose sleeps at a slow type's slowdown near
# a chunk's length (a data-parallel step sleeps in chunks: its passes communicate nothing)
WAKE_INTERVALS = (4, 16, 64, 256, 640)
# timed steps per side of the wake-up probe, and at the longer intervals enough for this many
# sleeps: one step's noise (~10% of its CPU time) over a sleep or two would swamp their effect
WAKE_STEPS = 4
WAKE_SLEEPS = 4


@dataclass(frozen=True)
class TimedSteps:
    """Probe steps timed: a step's seconds, each op's CPU seconds by name (when recorded), and
    how many sleeps the wake-up probe asked of the device over them."""

    seconds: float
    ops: dict[str, list[float]]
    wakes: int


def step_jitter(probes: list[dict]) -> float:
    """OpCosts.jitter from the step probes of ranks that ran them at once (the same "round"): in
    each round, each probe step's seconds on each rank relative to the ranks' mean; the pooled
    variance of those deviations (n - 1 per round and probe) is a rank's own variance from step
    to step, whatever load all ranks share. 0 without two ranks in some round. Approximate: a
    probe step is shorter than a training step, and its seconds are the mean of two steps."""
    rounds: dict[object, list[list[float]]] = {}
    for p in probes:
        if "round" in p and "rank" in p:
            rounds.setdefault(p["round"], []).append(p["steps"])
    squares, freedom = 0.0, 0
    for steps in rounds.values():
        if len(steps) < 2:
            continue
        for values in zip(*steps):
            mean = statistics.mean(values)
            if mean > 0:
                squares += sum((v / mean - 1.0) ** 2 for v in values)
                freedom += len(values) - 1
    return math.sqrt(squares / freedom) if freedom else 0.0


def after_sleep_curve(runs: list[Mapping[float, list[tuple[float, float]]]]) -> tuple[tuple[float, float], ...]:
    """OpCosts.after_sleep from the wake-up probes of several rounds (each: slowdown -> (work
    between sleeps, fraction) per interval): per slowdown and interval the typical work and
    fraction (fitting.typical; the fraction not below 0), sorted by work and made non-increasing
    in it (isotonic least squares: the work right after waking runs slowest, so more work between
    sleeps cannot run slower on average; a rise is noise); equal works (two slowdowns' probes)
    share one point."""
    points = []
    for slowdown in runs[0]:
        for i in range(min(len(run.get(slowdown, ())) for run in runs)):
            work = typical(run[slowdown][i][0] for run in runs)
            if work > 0:
                points.append((work, max(0.0, typical(run[slowdown][i][1] for run in runs))))
    points.sort()
    blocks: list[list[float]] = []  # pool adjacent violators: [mean, count] of each run of pooled points
    for _, fraction in points:
        blocks.append([fraction, 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (a, n), (b, m) = blocks.pop(-2), blocks.pop()
            blocks.append([(a * n + b * m) / (n + m), n + m])
    fractions = [mean for mean, count in blocks for _ in range(int(count))]
    merged: dict[float, list[float]] = {}
    for (work, _), fraction in zip(points, fractions):
        merged.setdefault(work, []).append(fraction)
    return tuple((work, statistics.mean(f)) for work, f in merged.items())


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
        host = Calibration(1.0, 1.0, 0.0, 0.0, 1.0).cluster(1)
        clocks = (time.perf_counter, time.thread_time if emulate is not None else self.clock)
        wrap = lambda inner: EmulatedBackend(  # noqa: E731
            inner, host, WakingEmulator(0, "probe", emulate or 1.0, clocks=clocks), None)
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

    def once(self) -> dict:
        """Raw seconds of every probe, measured once (short inner loops); "rank" and "round" say
        whose and which call it was (the step probes of two ranks' same round ran at once: step_jitter)."""
        clock = self.clock
        self.rounds += 1
        out: dict = {"rank": self.backend.rank if self.backend is not None else 0, "round": self.rounds}
        out |= {"matmul": [median_seconds(lambda: a @ b, 1, max(1, 20000 // (a.shape[0] ** 2)), clock) for a, b in self.matrices],
                "add": [median_seconds(lambda: a + b, 1, max(1, 200000 // a.shape[0]), clock) for a, b in self.vectors],
                "steps": [], "ops": []}
        for trainer, batch in self.trainers:
            seconds, ops = self._step_seconds(trainer, batch)
            out["steps"].append(seconds)
            out["ops"].append(ops)
        if self.emulated:
            trainer, batch = self.trainers[PROBE_RUNS.index((2, 1, 1))]
            out["after_sleep"] = {s: self._after_sleep(trainer, batch, s) for s in self.wake_slowdowns}
        if self.backend is not None and self.backend.world_size >= 2:
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
            out["pingpong"], out["allreduce"] = pings, reduces
        return out


def fit(probes: list[dict], shape: ProbeShape = ProbeShape()) -> Calibration:
    """Fit a Calibration to several Probe.once() results, each entry their typical value
    (fitting.typical: a trimmed mean; module docstring)."""
    typical_of = lambda key: [typical(p[key][i] for p in probes) for i in range(len(probes[0][key]))]  # noqa: E731
    slope_f, _ = fit_line([2.0 * n ** 3 for n in MATMUL_SIZES], typical_of("matmul"))
    slope_b, _ = fit_line([12.0 * n for n in ADD_SIZES], typical_of("add"))
    rates = Calibration(1.0 / slope_f, 1.0 / slope_b, overhead=0.0, link_latency=1e-5, link_bandwidth=1e9)
    probe_model = ModelSpec("probe", 1, shape.hidden, shape.ffn, shape.heads, shape.heads, shape.vocab, shape.seq, "float32")
    rate_cost = rates.cost_model(probe_model, 1)
    trainers = [probe_trainer(shape, *run)[0] for run in PROBE_RUNS]
    gamma, overhead, step_overhead = fit_steps([step_work(t, rate_cost) for t in trainers], typical_of("steps"))
    fitted = replace(rates, overhead=overhead, step_overhead=step_overhead, gamma=gamma)
    if "ops" in probes[0]:
        timed = [{name: typical(p["ops"][i][name] for p in probes if name in p["ops"][i])
                  for name in probes[0]["ops"][i]} for i in range(len(PROBE_RUNS))]
        costs = fit_op_costs([op_work(t, rate_cost) for t in trainers], timed, typical_of("steps"),
                             [1 + 2 * micro_batches for _, micro_batches, _ in PROBE_RUNS])
        if "after_sleep" in probes[0]:  # emulated step probes: how much slower the work after a sleep runs
            costs = replace(costs, after_sleep=after_sleep_curve([p["after_sleep"] for p in probes]))
        costs = replace(costs, jitter=step_jitter(probes))
        fitted = replace(fitted, op_costs=costs)
    if "pingpong" not in probes[0]:
        return fitted
    xs = [float(n) for n in MESSAGE_SIZES] + [n / 2 for n in MESSAGE_SIZES]
    ys = typical_of("pingpong") + [t / 2 for t in typical_of("allreduce")]  # 2-process all-reduce: 2 alpha + B / beta
    slope, alpha = fit_line(xs, ys)
    return replace(fitted, link_latency=alpha, link_bandwidth=1.0 / slope)


def _calibrate_rank(backend: Backend, repeats: int, cpu_time: bool = False, emulate: float | None = None,
                    wake_at: tuple[float, ...] = ()) -> list[dict]:
    probe = Probe(backend, cpu_time=cpu_time, emulate=emulate, wake_at=wake_at)
    return [probe.once() for _ in range(repeats)]


def calibrate(repeats: int = 7, cpu_time: bool = False, emulate: float | None = None,
              wake_at: tuple[float, ...] = ()) -> Calibration:
    """Probe `repeats` times on 2 gloo processes (both busy at once, as in training) and fit.
    `cpu_time`: compute probes on each thread's CPU time, not wall time: the rates of a core of
    one's own, which emulated device types follow whatever else the host runs (links stay wall time).
    `emulate`: the step probes run as an emulated device this many times slower (Probe), the
    reference type of the cluster the fit will price, so their CPU time is counted as its steps'
    is;
    `wake_at`: the other emulated types' slowdowns, at which the wake-up probe runs too.
    The fit takes both ranks' probes (their typical values; their differences are the step jitter)."""
    results = run_multiprocess(_calibrate_rank, 2, repeats, cpu_time, emulate, wake_at, timeout=600)
    return fit(results[0] + results[1])


def emulated_slowdowns(cluster: ClusterSpec | None) -> tuple[float, ...]:
    """The slowdowns above 1 of an emulated cluster's device types (those whose devices sleep)."""
    if cluster is None or cluster.emulation is None:
        return ()
    return tuple(sorted({s for s in (cluster.type_slowdown(t.name) for t in cluster.device_types) if s > 1}))


def emulated_reference(cluster: ClusterSpec | None) -> float | None:
    """The slowdown an emulated cluster gives its reference type (this host), when above 1: what
    `calibrate(emulate=...)` runs the step probes at; None for a cluster not emulated at 1x or at all."""
    if cluster is None or cluster.emulation is None:
        return None
    slowdown = cluster.type_slowdown(cluster.emulation.reference)
    return slowdown if slowdown > 1 else None


def simulated_step(strategy, cluster: ClusterSpec, model: ModelSpec, calibration: Calibration | None = None,
                   schedule: str = "1f1b") -> tuple[float, str]:
    """(seconds, source) of one step of `strategy` on `cluster` by the level-1 simulator: with a
    calibration and an emulated cluster, as this host runs it (Calibration.cost_model_for); else
    from the cluster file's own figures (nominal rooflines, no overheads)."""
    if calibration is not None and cluster.emulation is not None:
        cost, source = calibration.cost_model_for(cluster, model), "level-1 simulator, this host's calibration"
    else:
        cost, source = CostModel(cluster, model), "level-1 simulator, the cluster file's nominal figures"
    return simulate_strategy(strategy, cost, schedule).iteration, source


__all__ = ["Calibration", "OpWork", "Probe", "ProbeShape", "StepWork", "calibrate", "emulated_reference",
           "emulated_slowdowns", "fit",
           "fit_line", "fit_op_costs", "fit_steps", "median_seconds", "op_work", "simulated_step", "step_work",
           "after_sleep_curve"]
