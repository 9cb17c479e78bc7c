"""Calibrating the cost model on this machine (HeteroSim's self-calibration, on CPU processes).

    torch micro-benchmarks   matmuls of growing size: time = F / peak + c (least squares);
                             additions of growing size: time = bytes / bandwidth + c (the
                             intercepts c are dropped: too noisy; a kernel's fixed time is
                             measured with the per-instruction overhead below, where it is paid)
    framework overhead       real Trainer steps on one device of small Llamas (not the model
    and kernel efficiency    being predicted: 1 layer x 1 micro-batch, 1 x 2, 2 x 1, and 1 x 1
                             and 2 x 1 with micro-batches 4x as large) at the probe's layer
                             shapes; least squares: measured = gamma x roofline of the step's kernels
                             + overhead x dispatched instructions (ops and communication;
                             leaves, assignments and identity comms are nearly free)
                             + step overhead (checks, feeds, reading the loss). gamma is how
                             much slower a model's kernels run than the micro-benchmarks'
                             roofline (odd shapes, broadcasts, ops made of several kernels); the
                             larger micro-batch is what tells it apart from the overhead
    per op kind              the same steps' ops, each timed on its own (the emulator's op hook):
                             least squares over every op of the five probes: an op's time = a
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

import math
import statistics
from dataclasses import dataclass, replace
from typing import Mapping

from hspmd.backends.backend import Backend
from hspmd.cluster import ClusterSpec
from hspmd.errors import HSPMDError
from hspmd.planning import CostModel, ModelSpec, OpCosts
from hspmd.planning.device_sim import DISPATCHED, op_kernel
from hspmd.planning.fitting import nonnegative_least_squares, typical
from hspmd.planning.strategy_sim import simulate_strategy
from hspmd.runtime.execution.emulation import BETWEEN_PASSES
from hspmd.runtime.policies.calibration import Calibration
from hspmd.runtime.policies.probes import ADD_SIZES, MATMUL_SIZES, MESSAGE_SIZES, PROBE_PARTS, PROBE_RUNS, Probe, ProbeShape, probe_trainer
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer


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


def step_jitter(probes: list[dict]) -> float:
    """OpCosts.jitter from the step probes of ranks that ran them at once (the same "round"): in
    each round, each probe step's seconds on each rank relative to the ranks' mean; the pooled
    variance of those deviations (n - 1 per round and probe) is a rank's own variance from step
    to step, whatever load all ranks share. 0 without two ranks in some round. Approximate: a
    probe step is shorter than a training step, and its seconds are the mean of two steps."""
    rounds: dict[object, list[list[float]]] = {}
    for p in probes:
        if "round" in p and "rank" in p and "steps" in p:
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


def jitter_span(steps: list[float]) -> float:
    """OpCosts.jitter_over: the host seconds of work the step jitter was measured over, from the
    step probes' typical seconds: their harmonic mean, as step_jitter pools the probes' relative
    variances and a probe of w seconds varies as 1 / w (OpCosts.jitter_for)."""
    positive = [s for s in steps if s > 0]
    return len(positive) / sum(1.0 / s for s in positive) if positive else 0.0


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


def fit(probes: list[dict], shape: ProbeShape = ProbeShape()) -> Calibration:
    """Fit a Calibration to several Probe.once() results, each entry their typical value
    (fitting.typical: a trimmed mean; module docstring) over the results that measured it (a
    result of some of the probes' parts is one more sample of those)."""
    def having(key: str, needed: bool = True) -> list[dict]:
        found = [p for p in probes if key in p]
        if needed and not found:
            raise HSPMDError(f"calibration: none of the {len(probes)} probe results measured {key!r} "
                             f"(Probe.once parts {', '.join(PROBE_PARTS)}: the fit needs micro and steps)")
        return found

    def typical_of(key: str) -> list[float]:
        sampled = having(key)
        return [typical(p[key][i] for p in sampled) for i in range(len(sampled[0][key]))]

    slope_f, _ = fit_line([2.0 * n ** 3 for n in MATMUL_SIZES], typical_of("matmul"))
    slope_b, _ = fit_line([12.0 * n for n in ADD_SIZES], typical_of("add"))
    rates = Calibration(1.0 / slope_f, 1.0 / slope_b, overhead=0.0, link_latency=1e-5, link_bandwidth=1e9)
    probe_model = ModelSpec("probe", 1, shape.hidden, shape.ffn, shape.heads, shape.heads, shape.vocab, shape.seq, "float32")
    rate_cost = rates.cost_model(probe_model, 1)
    stepped = having("steps")
    runs = PROBE_RUNS[:min(len(p["steps"]) for p in stepped)]  # records from before a run was added hold the first ones
    steps = [typical(p["steps"][i] for p in stepped) for i in range(len(runs))]
    trainers = [probe_trainer(shape, *run)[0] for run in runs]
    gamma, overhead, step_overhead = fit_steps([step_work(t, rate_cost) for t in trainers], steps)
    fitted = replace(rates, overhead=overhead, step_overhead=step_overhead, gamma=gamma)
    timed_runs = having("ops", needed=False)
    if timed_runs:
        timed = [{name: typical(p["ops"][i][name] for p in timed_runs if name in p["ops"][i])
                  for name in timed_runs[0]["ops"][i]} for i in range(len(runs))]
        costs = fit_op_costs([op_work(t, rate_cost) for t in trainers], timed, steps,
                             [1 + 2 * micro_batches for _, micro_batches, _ in runs])
        woken = having("after_sleep", needed=False)
        if woken:  # emulated step probes: how much slower the work after a sleep runs
            costs = replace(costs, after_sleep=after_sleep_curve([p["after_sleep"] for p in woken]))
        costs = replace(costs, jitter=step_jitter(probes), jitter_over=jitter_span(steps))
        fitted = replace(fitted, op_costs=costs)
    if not having("pingpong", needed=False):
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


__all__ = ["OpWork", "StepWork", "after_sleep_curve", "calibrate", "emulated_reference", "emulated_slowdowns", "fit",
           "fit_line", "fit_op_costs", "fit_steps", "jitter_span", "op_work", "simulated_step", "step_jitter", "step_work"]
