"""Does the simulator predict real step times? (HeteroSim's validation, on this machine.)

1. Measure: the demo's Llama (hidden 64, 4 heads, FFN 128, 4 layers, 32-character sequences,
   16 sequences per step) on 2 gloo processes under 8 strategies (DP, TP, PP 1F1B and GPipe,
   uneven PP and DP, and two other micro-batch sizes); every strategy is built once and the
   strategies take turns round by round, so load drifts hit all of them alike; in its turn a
   strategy runs an untimed step and then the timed one, so that the timed step meets the caches
   its own last step left, as in training (timed right after the other strategies' steps, the
   demo Llama's step cost ~12% more CPU time; `--cold` times it so); the typical step of the
   slowest rank per strategy (fitting.typical: the rounds' trimmed mean; a job's length is its
   steps' mean, and this host switches between speeds, which a median would jump between).
   `--pin-cpus` pins each rank to its own CPU (hspmd.runtime.processes.affinity).
2. Calibrate in the same run: before each round, both ranks run the calibration probes (torch
   matmul / add micro-benchmarks, real steps of 1-2 layer probe models for the executor's overheads
   and the kernels' efficiency, each of their ops timed for the per-op-kind costs level 2 prices,
   a gloo ping-pong and all-reduce; hspmd.runtime.policies.calibrate), so the
   fit sees the machine load the steps see (this machine is shared); the step probes (the op
   prices) also run before every strategy's turn and the wake-up probe twice a round, so they
   sample the host's speed about as often as the steps do (`--round-probes-only`: all of them
   once a round); the fit takes the typical value over both ranks' probes. `--calibration
   FILE` uses a saved fit instead.
3. Predict the same steps with the calibrated cost model: simulator level 2 (the specialized
   programs, op by op, with their resolved plans) and level 1 (stage times from ModelSpec).

Reports each strategy's measured and predicted time, the mean absolute percentage error (goal
<= 15%) and Spearman's rank correlation (goal >= 0.8), over all strategies and over the four of
the calibration set (DP2, PP2 1F1B, TP2, PP2 GPipe; its goal there: MAPE <= 25%), and how far
the run's own noise moves what it measured (measurement_noise: a MAPE near it is within the
noise), and how far the calibration's own sampling moves the predictions (calibration_noise:
fits to the probe rounds drawn again). Timing-sensitive: not part of `make test` (run `make
calibration`). `--json FILE` also writes the figures, each timed step's figures per rank and
both ranks' probes; `--repredict FILE` (.json, or .json.gz) predicts such a saved run again
with the simulator as it is now (`--refit`: and the calibration fitted again from its probes,
with its calibration noise).

`--emulate homogeneous,heterogeneous` runs the same 8 strategies as emulated device types
(hspmd.runtime.execution.emulation) instead: two ranks of one type, or rank 0 of a fast type and
rank 1 of a type 2.5x slower, time dilated (`--dilation D`: the fast type is this host D times
slowed, so that the ranks compute a small share of the time and the emulated devices, not the
shared host's scheduler, set the pace). Run it with `--pin-cpus`: unpinned, the two ranks migrate and share caches
(DP2's device CPU 27.0 ms a step against 22.8-26.2 ms pinned). Each strategy's trainer has its own emulated device, so
its live bytes are its own. The probes then run on CPU time (what emulated devices follow), the step
probes as an emulated device of the reference type (their CPU time counted between its chunk
sleeps, as the strategies' steps run between communications; they also time how much slower
the work between two sleeps runs, by how much work that is, which level 2 prices per stretch
of work between sleeps), and the prediction is Calibration.cost_model_for(the emulated
cluster). Besides step times (goals MAPE <= 8%, Spearman >= 0.9) it reports every rank's
device CPU beside what level 2 prices it (device_sim.host_step_work), and every rank's peak live bytes,
counted exactly in one untimed step after the timed ones, against level 2's memory model of the
interpreter (goal: within 10%; planning/device_memory.py) and level 1's (a layer's kept activations, as autograd frees the rest).
`--split-wake` also times each strategy's step a second time with its ranks sleeping in chunks
alone, not before each communication (`RankEmulator.sleeps_at_communications`: the regime the op
probes time their ops in), and splits every rank's device CPU error into its op prices' (level 2
without the after-sleep pricing against the chunked step) and its after-sleep pricing's (what
the sleeps before communications add, priced against measured).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import ms, table  # noqa: E402
from hspmd.cluster import cluster_from_yaml  # noqa: E402
from hspmd.errors import HSPMDError  # noqa: E402
from hspmd.runtime.execution.emulation import SWEEP_EVERY, emulated, emulation_of  # noqa: E402
from hspmd.ir.shapes import Binding  # noqa: E402
from hspmd.models.llama import LlamaConfig, build_llama  # noqa: E402
from hspmd.planning import from_llama_config  # noqa: E402
from hspmd.planning.device_sim import host_step_work, simulate_device_run  # noqa: E402
from hspmd.planning.fitting import typical  # noqa: E402
from hspmd.planning.device_memory import device_memory  # noqa: E402
from hspmd.planning.strategy_sim import simulate_strategy  # noqa: E402
from hspmd.runtime.execution.batches import MicroBatchLayout  # noqa: E402
from hspmd.runtime.policies.calibrate import emulated_slowdowns, fit  # noqa: E402
from hspmd.runtime.policies.calibration import Calibration  # noqa: E402
from hspmd.runtime.policies.probes import Probe, ProbeShape  # noqa: E402
from hspmd.runtime.processes.multiprocess import run_multiprocess  # noqa: E402
from hspmd.runtime.execution.trace import Tracer, write_trace  # noqa: E402
from hspmd.runtime.training.trainer import Trainer  # noqa: E402
from hspmd.specialize.specialized import specialize_graph  # noqa: E402
from hspmd.specialize.strategy_text import parse_strategy  # noqa: E402

SEQ = 32
CONFIG = dict(vocab=64, hidden=64, heads=4, ffn=128, layers=4)
# the executor probe runs ONE layer of the demo's shapes (hidden, heads, FFN, a micro-batch of 4 x 32),
# not the 4-layer model predicted below: per-layer profiling, as HeteroSim profiles operators
PROBE = ProbeShape(hidden=CONFIG["hidden"], heads=CONFIG["heads"], ffn=CONFIG["ffn"], vocab=CONFIG["vocab"], rows=4, seq=SEQ)
STRATEGIES = {  # name: (strategy text, schedule); the last two vary the micro-batch size, as a search does
    "DP2": ("layers=4 ; 2x4: R0 L0-3 ; 2x4: R1 L0-3", "1f1b"),
    "TP2": ("layers=4 ; 4x4: R0,1 L0-3", "1f1b"),
    "PP2 1F1B": ("layers=4 ; 4x4: R0 L0-1 | R1 L2-3", "1f1b"),
    "PP2 GPipe": ("layers=4 ; 4x4: R0 L0-1 | R1 L2-3", "gpipe"),
    "PP2 3:1 layers": ("layers=4 ; 4x4: R0 L0-2 | R1 L3", "1f1b"),
    "DP2 3:1 batches": ("layers=4 ; 3x4: R0 L0-3 ; 1x4: R1 L0-3", "1f1b"),
    "DP2 1x8": ("layers=4 ; 1x8: R0 L0-3 ; 1x8: R1 L0-3", "1f1b"),
    "PP2 1F1B 8x2": ("layers=4 ; 8x2: R0 L0-1 | R1 L2-3", "1f1b"),
}

# two emulated ranks of this host (time dilated by DILATION, the slow type 2.5x the fast); links are
# this host's own (not emulated): the strategies differ in compute, schedule and memory here
EMULATED = """
name: emulated-pair-{kind}
device_types:
  fast: {{flops: {{float32: 1.0e9}}, hbm_bandwidth: 4.0e9, hbm_capacity: 1.0e9}}
  slow: {{flops: {{float32: 4.0e8}}, hbm_bandwidth: 1.6e9, hbm_capacity: 1.0e9}}
links:
  host: {{bandwidth: 1.0e9, latency: 1.0e-5}}
nodes: {nodes}
intra: {{fast: host, slow: host}}
inter: host
emulate: {{reference: fast, slowdown: {{fast: {fast}, slow: {slow}}}, memory_scale: 1.0, links: false}}
"""
PAIRS = {"homogeneous": "[{type: fast, devices: 2}]",
         "heterogeneous": "[{type: fast, devices: 1}, {type: slow, devices: 1}]"}


def emulated_pair(kind: str, dilation: float):
    return cluster_from_yaml(EMULATED.format(kind=kind, nodes=PAIRS[kind], fast=dilation, slow=2.5 * dilation))


TRACED_STEPS = 7  # with --trace: the median one of these is written
NOISE_RESAMPLES = 1000  # bootstrap draws of the rounds for the measurement's own noise
CALIBRATION_RESAMPLES = 16  # ... for the calibration's (each draw a fit and a prediction, ~1.5 s)
# the calibration set's acceptance set: DP2, PP2 1F1B, TP2, PP2 GPipe
PLANNING_FOUR = ["DP2", "PP2 1F1B", "TP2", "PP2 GPipe"]


def trainer_for(backend, text: str, schedule: str) -> Trainer:
    strategy = parse_strategy(text)
    model = build_llama(LlamaConfig(**CONFIG), [strategy])
    layout = MicroBatchLayout.of(strategy)
    return Trainer(model.graph, 0, backend, layout, schedule=schedule,
                   symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})


def measure_rank(backend, rounds: int, warmup: int, traced: bool = False, cluster=None, steady: bool = True,
                 turn_probes: bool = True, split_wake: bool = False):
    """This rank's step seconds, CPU seconds, traced steps and probes per strategy; with an emulated
    `cluster`, every trainer on its own emulated device, and each strategy's peak live bytes.
    `steady`: each timed step follows an untimed step of the same strategy (training's steady
    state); otherwise it follows the other strategies' steps, on caches they left (~12% more CPU
    time for the demo Llama's step here). `turn_probes`: the step probes (the op prices) also run
    before every strategy's turn, and the wake-up probe again mid-round, not only with the other
    probes once a round: a round's probes sample this host's speed at one moment, and the fit's
    prices move with the few moments sampled (docs/design.md, Simulator accuracy: the probes'
    few moments). `split_wake` (emulated): each timed step is followed by one with the rank
    sleeping in chunks alone, whose device CPU is recorded apart (module docstring)."""
    torch.set_num_threads(1)
    # on an emulated cluster the step probes run as an emulated device of the reference type (CPU time between sleeps)
    reference = None if cluster is None else cluster.type_slowdown(cluster.emulation.reference)
    probe = Probe(backend, PROBE, cpu_time=cluster is not None, emulate=reference, wake_at=emulated_slowdowns(cluster))
    probes = []
    trainers = {name: trainer_for(emulated(backend, cluster), text, schedule) for name, (text, schedule) in STRATEGIES.items()}
    gen = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, CONFIG["vocab"], (16, SEQ), generator=gen),
             "labels": torch.randint(0, CONFIG["vocab"], (16, SEQ), generator=gen)}
    world = tuple(range(backend.world_size))
    times = {name: [] for name in trainers}
    cpu = {name: [] for name in trainers}
    parts = {name: [] for name in trainers}  # per timed step: (compute waits, link waits, device CPU)
    chunked = {name: [] for name in trainers}  # with split_wake: the device CPU of a step slept in chunks alone
    for r in range(warmup + rounds):
        if r >= warmup:  # calibration probes interleaved with the steps: both see the same load
            probes.append(probe.once())
        for turn, (name, trainer) in enumerate(trainers.items()):
            device = emulation_of(trainer.backend)
            if r >= warmup and turn_probes:  # the op prices sampled before every turn, not once a round,
                middle = turn == len(trainers) // 2  # and the wake-up probe (seconds) twice a round
                probes.append(probe.once(parts=("steps", "after_sleep") if middle else ("steps",)))
            start_turn(backend, device)
            if steady:  # an untimed step of this strategy first: the timed one runs on its caches, as training does
                trainer.step(batch)
                backend.barrier(world)
            before = device.stats() if device is not None else None
            if device is not None:
                device.mark()  # nor is the wait at the barrier before the timed step
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.step(batch)
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
                cpu[name].append(time.process_time() - start_cpu)
                if device is not None:
                    after = device.stats()
                    parts[name].append(tuple(getattr(after, field) - getattr(before, field)
                                             for field in ("compute_wait_s", "link_wait_s", "op_cpu_s")))
            if r >= warmup and split_wake and device is not None:
                chunked[name].append(chunked_step_cpu(backend, trainer, batch, device))
    peaks = {}
    for name, trainer in trainers.items():  # one untimed step counting every value's bytes exactly
        device = emulation_of(trainer.backend)
        if device is not None and device.capacity is not None:
            start_turn(backend, device)
            device.sweep_every, device.peak_bytes = 1, 0
            trainer.step(batch)
            peaks[name] = (device.stats().peak_bytes, device.live_bytes)  # the peak, and what stays between steps
            device.sweep_every = SWEEP_EVERY
    events = {name: [] for name in trainers}
    for _ in range(TRACED_STEPS if traced else 0):  # traced steps per strategy, for `hspmd show`
        for name, trainer in trainers.items():
            backend.barrier(world)
            trainer.tracer = Tracer(backend.rank, origin=0.0)  # epoch microseconds: one clock for both ranks
            device = emulation_of(trainer.backend)
            if device is not None:  # emulated waits in the same trace (category "emulated")
                device.tracer = trainer.tracer
                device.mark()
            trainer.step(batch)
            events[name].append(trainer.tracer.events)
            trainer.tracer = None
            if device is not None:
                device.tracer = None
    return times, cpu, events, probes, peaks, parts, chunked


def start_turn(backend, device) -> None:
    """The ranks together (a barrier), and the emulated `device`'s turn starting now: neither the
    wait at the barrier (the ranks end a probe apart) nor debt or credit left from before is its
    work (counted, its steps would sleep that much less)."""
    backend.barrier(tuple(range(backend.world_size)))
    if device is not None:
        device.forgive_debt()
        device.mark()


def chunked_step_cpu(backend, trainer: Trainer, batch, device) -> float:
    """The device CPU of one step of `trainer` with its rank sleeping in chunks alone (and its peer
    too: both ranks call this together), the debt left after it forgiven."""
    start_turn(backend, device)
    before = device.op_cpu_s
    device.sleeps_at_communications = False
    try:
        trainer.step(batch)
    finally:
        device.sleeps_at_communications = True
    seconds = device.op_cpu_s - before
    start_turn(backend, device)
    return seconds


def wake_split_rows(device_cpu: dict[tuple[str, int], float], chunked: dict[tuple[str, int], float],
                    priced: dict[tuple[str, int], float], bare: dict[tuple[str, int], float]) -> list[list[str]]:
    """Per (strategy, rank): the device CPU measured as run and slept in chunks alone, what the
    sleeps before communications added (measured, and as level 2 prices it: with its after-sleep
    pricing against without), and the op prices' error (level 2 without that pricing against the
    chunked step): where a device CPU error sits."""
    return [[n, str(rank), ms(device_cpu[n, rank]), ms(chunked[n, rank]),
             f"{device_cpu[n, rank] / chunked[n, rank] - 1:+.1%}", f"{priced[n, rank] / bare[n, rank] - 1:+.1%}",
             f"{bare[n, rank] / chunked[n, rank] - 1:+.1%}", f"{priced[n, rank] / device_cpu[n, rank] - 1:+.1%}"]
            for n, rank in chunked]


WAKE_SPLIT_HEADERS = ["strategy", "rank", "device CPU ms", "in chunks ms", "after-sleep", "level 2 after-sleep",
                      "op prices' error", "level 2 error"]


def print_wake_split(calibration: Calibration, cluster, predicted: dict, device_cpu: dict[tuple[str, int], float],
                     chunked: dict[tuple[str, int], float]) -> None:
    """The split of every rank's device CPU error (wake_split_rows) beside level 2 as `predicted`."""
    costs = calibration.op_costs
    bare = predict(replace(calibration, op_costs=replace(costs, after_sleep=())) if costs is not None else calibration, cluster)
    print(table(WAKE_SPLIT_HEADERS, wake_split_rows(device_cpu, chunked, {(n, r): predicted[n][3][r] for n, r in chunked},
                                                    {(n, r): bare[n][3][r] for n, r in chunked})))


def typical_step(per_rank_steps: list[list[list[dict]]]) -> list[list[dict]]:
    """Of the traced steps (per rank, per step: events), the one whose span over both ranks is the
    median: a picture of a typical step rather than of whatever the last one met."""
    def span(step: int) -> float:
        spans = [e for rank in per_rank_steps for e in rank[step]]
        return max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)

    steps = sorted(range(len(per_rank_steps[0])), key=span)
    return [rank[steps[len(steps) // 2]] for rank in per_rank_steps]


def predict(calibration: Calibration, cluster=None) -> dict[str, tuple[float, float, dict[int, float], dict[int, float]]]:
    """(level 2, level 1) predicted step seconds per strategy, per rank level 2's peak and static
    bytes (the interpreter's, planning/device_memory.py) and level 1's peak (a layer's kept
    activations), and per rank the device CPU level 2 prices (device_sim.host_step_work); on an emulated
    `cluster`, as its types run on this host (Calibration.cost_model_for)."""
    config = LlamaConfig(**CONFIG)
    spec_model = from_llama_config(config, SEQ)
    cost = calibration.cost_model_for(cluster, spec_model) if cluster is not None else calibration.cost_model(spec_model, 2)
    out = {}
    for name, (text, schedule) in STRATEGIES.items():
        strategy = parse_strategy(text)
        layout = MicroBatchLayout.of(strategy)
        binding = Binding.of({"B": sum(layout.sizes), "S": SEQ, "T": layout.global_batch_size * SEQ}, ratios=layout.sizes)
        spec = specialize_graph(build_llama(config, [strategy]).graph, 0, binding)
        level2, costs = simulate_device_run(spec, cost, dict(enumerate(layout.counts)), schedule)
        level1 = simulate_strategy(strategy, cost, schedule)
        out[name] = (level2.iteration, level1.iteration,
                     {d: (level2.peak_memory.get(d, 0.0), device_memory(exe, spec.binding).static, level1.peak_memory.get(d, 0.0))
                      for d, exe in spec.executables.items()}, host_step_work(spec, cost, costs, dict(enumerate(layout.counts))))
    return out


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for position, i in enumerate(order):
            r[i] = float(position)
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Per round, the slowest rank's seconds (a step ends with its slowest rank)."""
    return [max(round_) for round_ in zip(*per_rank)]


def measurement_noise(per_round: dict[str, list[float]], resamples: int = NOISE_RESAMPLES) -> float:
    """How far this run's own noise moves what it measured: the MAPE (%) of each strategy's
    typical step against the typical step of its rounds drawn again with replacement, the median
    over `resamples` such draws (a bootstrap, seeded). A prediction's MAPE near it cannot be told
    from noise; a goal under it needs more rounds (the noise shrinks as 1 / sqrt(rounds))."""
    rng = random.Random(0)
    measured = {n: typical(steps) for n, steps in per_round.items()}
    draws = []
    for _ in range(resamples):
        draws.append(100 * statistics.mean(
            abs(typical(rng.choices(steps, k=len(steps))) - measured[n]) / measured[n] for n, steps in per_round.items()))
    return statistics.median(draws)


def probe_rounds(probes: list[dict]) -> list[list[dict]]:
    """The probes grouped by the round they ran in: per rank in the order they ran, a record of
    every probe (one with the micro-benchmarks) starts a round, and the records of some parts
    after it (the turn probes) belong to it; the ranks' k-th rounds together."""
    rounds: dict[int, list[dict]] = {}
    for rank in sorted({p["rank"] for p in probes}):
        k = -1
        for p in sorted((p for p in probes if p["rank"] == rank), key=lambda p: p["round"]):
            k += "matmul" in p
            rounds.setdefault(max(k, 0), []).append(p)
    return [rounds[k] for k in sorted(rounds)]


def calibration_noise(probes: list[dict], cluster, resamples: int | None = None, base: dict[str, float] | None = None) -> float:
    """How far the calibration's own sampling moves level 2's predictions: the MAPE (%) of the
    predictions of a fit to this run's probe rounds drawn again with replacement (probe_rounds;
    a bootstrap, seeded) against the fit to all of them, the median over `resamples` draws. The
    probes sample this host's speed at a few moments; a prediction's miss near this is the
    calibration's noise, on top of the steps' (measurement_noise). `resamples`: CALIBRATION_RESAMPLES;
    `base`: level 2's step per strategy from the fit to all the probes, when the caller has it."""
    resamples = resamples or CALIBRATION_RESAMPLES
    rng = random.Random(0)
    rounds = probe_rounds(probes)
    if base is None:
        base = {n: p[0] for n, p in predict(fit(probes, PROBE), cluster).items()}
    draws = []
    for _ in range(resamples):
        drawn = [dict(p, round=(i, p["round"])) for i, k in enumerate(rng.choices(range(len(rounds)), k=len(rounds)))
                 for p in rounds[k]]
        predicted = predict(fit(drawn, PROBE), cluster)
        draws.append(100 * statistics.mean(abs(predicted[n][0] - base[n]) / base[n] for n in base))
    return statistics.median(draws)


def step_accuracy(measured: dict, predicted: dict, emulated: bool, per_round: dict[str, list[float]] | None = None) -> dict:
    """Print and return level 2's and level 1's MAPE and Spearman over all strategies and over
    the calibration set, and (`per_round`: each strategy's step per round) the measurement's
    own noise."""
    figures: dict = {}
    goal = "(goal <= 8%, >= 0.9)" if emulated else "(goal <= 15%, >= 0.8)"
    for label, names in (("all", list(STRATEGIES)), ("the calibration set", PLANNING_FOUR)):
        for level in (0, 1):
            mape = 100 * statistics.mean(abs(predicted[n][level] - measured[n]) / measured[n] for n in names)
            rho = spearman([measured[n] for n in names], [predicted[n][level] for n in names])
            figures[f"{label} level {2 - level}"] = {"mape": mape, "spearman": rho}
            print(f"{label} ({len(names)} strategies), level {2 - level}: MAPE {mape:.1f}%, Spearman {rho:.2f}"
                  f"{' ' + goal if level == 0 and label == 'all' else ''}")
    if per_round:
        rounds = min(len(steps) for steps in per_round.values())
        noise = measurement_noise(per_round)
        figures["noise"] = {"mape": noise, "rounds": rounds}
        print(f"measurement noise: the typical steps of {rounds} rounds move {noise:.1f}% (MAPE, bootstrap): "
              f"a level 2 MAPE near that is within this run's noise")
    return figures


def report_calibration_noise(figures: dict, probes: list[dict], cluster, predicted: dict) -> None:
    """Print calibration_noise and add it to `figures` (`predicted`: predict() from the fit to all `probes`)."""
    noise = calibration_noise(probes, cluster, base={n: p[0] for n, p in predicted.items()})
    rounds = len(probe_rounds(probes))
    figures["calibration_noise"] = {"mape": noise, "rounds": rounds, "draws": CALIBRATION_RESAMPLES}
    print(f"calibration noise: fits to the {rounds} probe rounds drawn again move level 2's predictions "
          f"{noise:.1f}% (MAPE, {CALIBRATION_RESAMPLES} draws): a level 2 MAPE near that is within the calibration's noise")


def rank_breakdown(steps: list[float], parts: list[tuple[float, float, float]]) -> tuple[float, float, float, float]:
    """One rank's typical (step, compute waits, link waits, device CPU) seconds over its timed steps
    (fitting.typical, as the steps are summarised: a mean would let one stalled round, a step of
    several times the others', stand for the whole run)."""
    wait, link, device_cpu = (typical(part) for part in zip(*parts))
    return typical(steps), wait, link, device_cpu


def saved_device_cpu(saved: dict) -> list[tuple[str, int, float]]:
    """(strategy, rank, measured device CPU seconds) of a saved emulated run: from its timed steps'
    parts where it kept them (rank_breakdown), else the figure it saved (runs from before the
    parts were kept, summarised by their mean)."""
    if saved.get("parts"):
        return [(n, rank, rank_breakdown(saved["steps"][n][rank], parts)[3])
                for n, by_rank in saved["parts"].items() for rank, parts in enumerate(by_rank) if parts]
    out = []
    for n, by_rank in saved.get("figures", {}).get("device_cpu", {}).items():
        ranks = {int(r): v for r, v in by_rank.items() if r.isdigit()} or {by_rank["rank"]: by_rank}
        out += [(n, rank, v["measured"]) for rank, v in sorted(ranks.items())]
    return out


def read_saved(path: str) -> list[dict]:
    """The sets a run saved with --json (.json, or gzipped .json.gz) holds."""
    try:
        data = json.loads(gzip.decompress(Path(path).read_bytes()) if path.endswith(".gz") else Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read it as a saved run: {type(e).__name__}: {e}") from None
    return data if isinstance(data, list) else [data]


class SavedSet(NamedTuple):
    """One saved set, ready to predict again: its cluster's name and cluster (None: plain gloo
    processes), the calibration (as saved, or fitted again from its probes), the probes, each
    strategy's slowest-rank step per round (None: saved before the rounds were kept) and its
    measured step as the bench measures it now (typical) or, for older runs, as saved."""

    name: str | None
    cluster: object
    calibration: Calibration
    probes: list[dict]
    per_round: dict[str, list[float]] | None
    measured: dict[str, float]


def saved_set(path: str, saved: dict, refit: bool = False) -> SavedSet:
    """A set of the run saved at `path`, read for predicting again (`refit`: its calibration
    fitted again, by this calibration code, from the probes it saved)."""
    name = saved.get("cluster")
    kind = name.removeprefix("emulated-pair-") if name else None
    if kind is not None and kind not in PAIRS:
        raise SystemExit(f"{path}: a set of cluster {name!r}, not one of this benchmark's")
    cluster = emulated_pair(kind, saved.get("dilation", 8.0)) if kind else None
    try:
        if refit and not saved.get("probes"):
            raise SystemExit(f"--refit: {path} saved no probes (a run from before they were saved)")
        probes = saved.get("probes") or []
        if probes and "rank" not in probes[0]:  # saved before probes said whose they were: rank 0's rounds, then rank 1's
            probes = [{**p, "rank": 2 * i // len(probes), "round": i % (len(probes) // 2)} for i, p in enumerate(probes)]
        calibration = (fit(probes, PROBE) if refit
                       else Calibration.from_dict(saved["calibration"], f"{path}: calibration"))
        per_round = {n: slowest_rank(saved["steps"][n]) for n in STRATEGIES} if saved.get("steps") else None
        measured = ({n: typical(steps) for n, steps in per_round.items()} if per_round
                    else {n: float(saved["measured"][n]) for n in STRATEGIES})
    except (HSPMDError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"{path}: not a saved run of this benchmark: {type(e).__name__}: {e}") from None
    return SavedSet(name, cluster, calibration, probes, per_round, measured)


def repredict(path: str, refit: bool = False) -> list[dict]:
    """Predict the measurements a run saved with --json again, with this simulator and the
    calibration fitted in that run (`refit`: fitted again, by this calibration code, from the
    probes the run saved): a change to the cost model or the fit is checked against the same
    measurements (no new run, no new noise). Prints step times and, emulated, every rank's device
    CPU against what level 2 now prices it (benchmarks/calibration_summary.py: the mean errors
    over many saved runs)."""
    out = []
    for saved in read_saved(path):
        name, cluster, calibration, probes, per_round, measured = saved_set(path, saved, refit)
        predicted = predict(calibration, cluster)
        print(f"\n== re-predicted: {name or 'plain gloo processes'} ({path}{', calibration fitted again' if refit else ''})")
        print("calibration:", calibration.describe())
        print(table(["strategy", "measured ms", "level 2 ms", "error", "level 1 ms", "error"],
                    [[n, ms(measured[n]), ms(predicted[n][0]), f"{(predicted[n][0] - measured[n]) / measured[n]:+.1%}",
                      ms(predicted[n][1]), f"{(predicted[n][1] - measured[n]) / measured[n]:+.1%}"] for n in STRATEGIES]))
        figures = step_accuracy(measured, predicted, emulated=cluster is not None, per_round=per_round)
        if refit:
            report_calibration_noise(figures, probes, cluster, predicted)
        rows = []
        for n, rank, device_cpu in saved_device_cpu(saved):
            priced = predicted[n][3].get(rank, 0.0)
            rows.append([n, rank, ms(device_cpu), ms(priced), f"{(priced - device_cpu) / device_cpu:+.1%}"])
        if rows:
            print(table(["strategy", "rank", "device CPU ms", "level 2 CPU ms", "error"], rows))
        if saved.get("chunked") and cluster is not None:
            print_wake_split(calibration, cluster, predicted, {(n, rank): cpu for n, rank, cpu in saved_device_cpu(saved)},
                             {(n, rank): typical(steps) for n, by_rank in saved["chunked"].items() for rank, steps in enumerate(by_rank)})
        out.append({"cluster": name, "figures": figures})
    return out


def host_name() -> str:
    """This host as a saved run names it: its CPU model and how many CPUs this process may use
    (calibration_summary.py groups saved runs by host: a miss that is one host's is not another's)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return f"{model or platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"


def run_set(args, cluster=None) -> dict:
    """Measure, calibrate and predict the 8 strategies, plain or on an emulated `cluster`; print and
    return the figures."""
    split = bool(args.split_wake) and cluster is not None
    results = run_multiprocess(measure_rank, 2, args.rounds, args.warmup, bool(args.trace), cluster, not args.cold,
                               not args.round_probes_only, split, timeout=3600, pin_cpus=args.pin_cpus)
    calibration = Calibration.load(args.calibration) if args.calibration else fit(results[0][3] + results[1][3], PROBE)
    title = "plain gloo processes" if cluster is None else f"emulated: {cluster.describe()}"
    print(f"\n== {title} ({args.rounds} rounds + {args.warmup} warm-up)")
    print("calibration:", calibration.describe())
    if args.save_calibration and cluster is None:
        calibration.save(args.save_calibration)
    per_rank = [r[0] for r in results]
    cpu = {name: typical(slowest_rank([r[1][name] for r in results])) for name in STRATEGIES}
    if args.trace:
        folder = Path(args.trace) / ("plain" if cluster is None else cluster.name)
        folder.mkdir(parents=True, exist_ok=True)
        for name in STRATEGIES:
            write_trace(folder / (name.replace(" ", "_").replace(":", "-") + ".json"), typical_step([r[2][name] for r in results]))
    per_round = {name: slowest_rank([r[name] for r in per_rank]) for name in STRATEGIES}
    measured = {name: typical(steps) for name, steps in per_round.items()}
    spread = {name: (min(steps), max(steps)) for name, steps in per_round.items()}
    predicted = predict(calibration, cluster)
    rows = [[name, ms(measured[name]), f"{ms(spread[name][0])}-{ms(spread[name][1])}", ms(cpu[name]),
             ms(predicted[name][0]), f"{(predicted[name][0] - measured[name]) / measured[name]:+.1%}",
             ms(predicted[name][1]), f"{(predicted[name][1] - measured[name]) / measured[name]:+.1%}"] for name in STRATEGIES]
    print(table(["strategy", "measured ms", "min-max", "cpu ms", "level 2 ms", "error", "level 1 ms", "error"], rows))
    figures = step_accuracy(measured, predicted, emulated=cluster is not None, per_round=per_round)
    if not args.calibration:
        report_calibration_noise(figures, results[0][3] + results[1][3], cluster, predicted)
    memory = {}
    if cluster is not None:
        slow = max(range(2), key=cluster.slowdown)
        rows = []
        breakdown = {(name, rank): rank_breakdown(r[0][name], r[5][name]) for name in STRATEGIES for rank, r in enumerate(results)}
        for name in STRATEGIES:
            for rank in range(len(results)):
                step, wait, link, device_cpu = breakdown[name, rank]
                priced = predicted[name][3].get(rank, 0.0)
                rows.append([name, rank, ms(step), ms(device_cpu), ms(priced), f"{(priced - device_cpu) / device_cpu:+.1%}",
                             ms(device_cpu * cluster.slowdown(rank)), ms(wait), ms(step - wait - link)])
                figures.setdefault("device_cpu", {}).setdefault(name, {})[rank] = {"measured": device_cpu, "level2": priced}
            figures["device_cpu"][name]["slowest"] = slow
        if split:
            print_wake_split(calibration, cluster, predicted, {key: parts[3] for key, parts in breakdown.items()},
                             {(n, rank): typical(r[6][n]) for n in STRATEGIES for rank, r in enumerate(results)})
        print(table(["strategy", "rank", "step ms", "device CPU ms", "level 2 CPU ms", "error", "x slowdown",
                     "compute waits", "rest"], rows))
        rows, errors = [], []
        mib = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
        for name in STRATEGIES:
            for rank, r in enumerate(results):
                (got, kept), (model, static, layers) = r[4][name], predicted[name][2].get(rank, (0.0, 0.0, 0.0))
                errors.append(abs(model - got) / got)
                memory[f"{name} rank {rank}"] = {"measured": got, "model": model, "measured_static": kept, "model_static": static,
                                                 "level1": layers}
                rows.append([name, rank, mib(got), mib(model), f"{(model - got) / got:+.1%}", mib(kept), mib(static),
                             mib(layers)])
        print(table(["strategy", "rank", "peak live MiB", "level 2 model MiB", "error", "kept between steps",
                     "model static", "level 1 model MiB"], rows))
        print(f"peak memory per rank: largest error {100 * max(errors):.1f}%, mean {100 * statistics.mean(errors):.1f}% "
              f"(goal: within 10%)")
        figures["memory"] = {"max_error": max(errors), "mean_error": statistics.mean(errors)}
    return {"cluster": None if cluster is None else cluster.name, "dilation": args.dilation, "host": host_name(),
            "calibration": calibration.to_dict(), "measured": measured,
            "spread": spread, "cpu": cpu, "predicted_level2": {n: p[0] for n, p in predicted.items()},
            "predicted_level1": {n: p[1] for n, p in predicted.items()}, "memory": memory, "figures": figures,
            # the raw measurements, for --repredict: per rank and timed step its seconds and, emulated,
            # (compute waits, link waits, device CPU); both ranks' probes, which --refit fits again
            "steps": {n: [r[0][n] for r in results] for n in STRATEGIES},
            "parts": {n: [r[5][n] for r in results] for n in STRATEGIES} if cluster is not None else {},
            "chunked": {n: [r[6][n] for r in results] for n in STRATEGIES} if split else {},
            "probes": results[0][3] + results[1][3]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibration", default=None, help="use this calibration file instead of calibrating now")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--save-calibration", default=None, help="write the fitted calibration here (for hspmd show)")
    p.add_argument("--pin-cpus", action="store_true", help="pin each rank to its own CPU")
    p.add_argument("--cold", action="store_true",
                   help="time each strategy's step right after the other strategies' (no untimed step of its own first)")
    p.add_argument("--round-probes-only", action="store_true",
                   help="run every probe once a round, not the step probes also before every strategy's turn "
                        "and the wake-up probe again mid-round")
    p.add_argument("--split-wake", action="store_true",
                   help="emulated: also time each step slept in chunks alone, and split every rank's device CPU error "
                        "into its op prices' and its after-sleep pricing's")
    p.add_argument("--trace", default=None, help="write a typical traced step per strategy here (NAME.json per strategy)")
    p.add_argument("--emulate", default=None,
                   help="homogeneous, heterogeneous or both (comma-separated): emulated device types instead of plain ranks")
    p.add_argument("--dilation", type=float, default=8.0,
                   help="with --emulate: how many times slower than this host the fast type runs (default 8)")
    p.add_argument("--repredict", default=None, metavar="JSON",
                   help="predict a run saved with --json (or gzipped: .json.gz) again with this simulator and that run's "
                        "calibration (no new run)")
    p.add_argument("--refit", action="store_true", help="with --repredict: fit the calibration again from the run's saved probes")
    args = p.parse_args(argv)
    if args.repredict:
        repredict(args.repredict, args.refit)
        return 0
    kinds = [k for k in (args.emulate or "").split(",") if k]
    unknown = sorted(set(kinds) - set(PAIRS))
    if unknown:
        p.error(f"--emulate: unknown {', '.join(unknown)}; choose from {', '.join(PAIRS)}")
    sets = [run_set(args, emulated_pair(k, args.dilation)) for k in kinds] if kinds else [run_set(args)]
    if args.json:
        Path(args.json).write_text(json.dumps(sets if kinds else sets[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
