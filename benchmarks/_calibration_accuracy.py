"""The calibration benchmark's strategies and what its accuracy is measured by: level 2's and
level 1's predictions of the 8 strategies, MAPE and Spearman, the run's own noise and the
calibration's, the split of a device CPU error into op prices and after-sleep pricing, and the
saved runs read and predicted again (bench_calibration.py measures; calibration_summary.py
averages the saved runs' errors; both read them here).
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from _common import ms, table
from hspmd.cluster import cluster_from_yaml
from hspmd.errors import HSPMDError
from hspmd.ir.shapes import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.planning import from_llama_config
from hspmd.planning.device_memory import device_memory
from hspmd.planning.device_sim import device_costs, host_step_work, simulate_device_run
from hspmd.planning.fitting import typical
from hspmd.planning.strategy_sim import simulate_strategy
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.policies.calibrate import fit
from hspmd.runtime.policies.calibration import Calibration
from hspmd.runtime.policies.probes import ProbeShape
from hspmd.specialize.specialized import specialize_graph
from hspmd.specialize.strategy_text import parse_strategy

SEQ = 32
CONFIG = dict(vocab=64, hidden=64, heads=4, ffn=128, layers=4)
# the executor probes run one or two layers of the demo's shapes (hidden, heads, FFN, micro-batches of 4
# x 32 and 4x that), not the 4-layer model predicted below: per-layer profiling, as HeteroSim profiles operators
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


NOISE_RESAMPLES = 1000  # bootstrap draws of the rounds for the measurement's own noise
CALIBRATION_RESAMPLES = 16  # ... for the calibration's (each draw a fit and a prediction, ~1.5 s)
# the calibration set's acceptance set: DP2, PP2 1F1B, TP2, PP2 GPipe
PLANNING_FOUR = ["DP2", "PP2 1F1B", "TP2", "PP2 GPipe"]


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


def specialized(name: str):
    """(strategy, micro-batch layout, specialized programs) of STRATEGIES[name] on the demo Llama."""
    strategy = parse_strategy(STRATEGIES[name][0])
    layout = MicroBatchLayout.of(strategy)
    binding = Binding.of({"B": sum(layout.sizes), "S": SEQ, "T": layout.global_batch_size * SEQ}, ratios=layout.sizes)
    return strategy, layout, specialize_graph(build_llama(LlamaConfig(**CONFIG), [strategy]).graph, 0, binding)


def predict(calibration: Calibration, cluster=None) -> dict[str, tuple[float, float, dict[int, float], dict[int, float]]]:
    """(level 2, level 1) predicted step seconds per strategy, per rank level 2's peak and static
    bytes (the interpreter's, planning/device_memory.py) and level 1's peak (a layer's kept
    activations), and per rank the device CPU level 2 prices (device_sim.host_step_work); on an emulated
    `cluster`, as its types run on this host (Calibration.cost_model_for)."""
    spec_model = from_llama_config(LlamaConfig(**CONFIG), SEQ)
    cost = calibration.cost_model_for(cluster, spec_model) if cluster is not None else calibration.cost_model(spec_model, 2)
    out = {}
    for name, (_, schedule) in STRATEGIES.items():
        strategy, layout, spec = specialized(name)
        level2, costs = simulate_device_run(spec, cost, dict(enumerate(layout.counts)), schedule)
        level1 = simulate_strategy(strategy, cost, schedule)
        out[name] = (level2.iteration, level1.iteration,
                     {d: (level2.peak_memory.get(d, 0.0), device_memory(exe, spec.binding).static, level1.peak_memory.get(d, 0.0))
                      for d, exe in spec.executables.items()}, host_step_work(spec, cost, costs, dict(enumerate(layout.counts))))
    return out


def given_device_cpu(calibration: Calibration, cluster, device_cpu: dict[tuple[str, int], float]) -> dict[str, float]:
    """Level 2's step per strategy were each rank's work what it measured (`device_cpu`: per
    (strategy, rank) its device CPU seconds, as rank_breakdown summarises them): every device's
    work scaled by its measured over its priced device CPU (simulate_device_run's `slowed`). Its
    error against the measured step is what the schedule, the communications and the waits
    miss; the rest of level 2's error is what the op prices and the after-sleep pricing miss."""
    cost = calibration.cost_model_for(cluster, from_llama_config(LlamaConfig(**CONFIG), SEQ))
    out = {}
    for name, (_, schedule) in STRATEGIES.items():
        _, layout, spec = specialized(name)
        counts = dict(enumerate(layout.counts))
        priced = host_step_work(spec, cost, device_costs(spec, cost, schedule), counts)
        slowed = {d: device_cpu[name, d] / priced[d] for d in priced if (name, d) in device_cpu and priced[d] > 0}
        out[name] = simulate_device_run(spec, cost, counts, schedule, slowed=slowed)[0].iteration
    return out


def print_cpu_split(calibration: Calibration, cluster, measured: dict[str, float], predicted: dict,
                    device_cpu: dict[tuple[str, int], float]) -> dict:
    """Print level 2's step error beside its error given every rank's measured device CPU
    (given_device_cpu) and return both MAPEs (percent)."""
    given = given_device_cpu(calibration, cluster, device_cpu)
    rows = [[n, ms(measured[n]), f"{predicted[n][0] / measured[n] - 1:+.1%}", ms(given[n]), f"{given[n] / measured[n] - 1:+.1%}"]
            for n in STRATEGIES]
    print(table(["strategy", "measured ms", "level 2 error", "given device CPU ms", "error"], rows))
    figures = {"level2": 100 * statistics.mean(abs(predicted[n][0] / measured[n] - 1) for n in STRATEGIES),
               "given_device_cpu": 100 * statistics.mean(abs(given[n] / measured[n] - 1) for n in STRATEGIES)}
    print(f"level 2 MAPE {figures['level2']:.1f}%; given each rank's measured device CPU {figures['given_device_cpu']:.1f}% "
          f"(the rest is the device CPU's pricing)")
    return figures


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
            figures["cpu_split"] = print_cpu_split(calibration, cluster, measured, predicted,
                                                   {(n, rank): cpu for n, rank, cpu in saved_device_cpu(saved)})
        if saved.get("chunked") and cluster is not None:
            print_wake_split(calibration, cluster, predicted, {(n, rank): cpu for n, rank, cpu in saved_device_cpu(saved)},
                             {(n, rank): typical(steps) for n, by_rank in saved["chunked"].items() for rank, steps in enumerate(by_rank)})
        out.append({"cluster": name, "figures": figures})
    return out
