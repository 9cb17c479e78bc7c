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
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _calibration_accuracy import (CONFIG, PAIRS, PROBE, SEQ, STRATEGIES, emulated_pair, predict, print_cpu_split,  # noqa: E402
                                   print_wake_split, rank_breakdown, report_calibration_noise, repredict, slowest_rank, step_accuracy)
from _common import ms, table  # noqa: E402
from hspmd.runtime.execution.emulation import SWEEP_EVERY, emulated, emulation_of  # noqa: E402
from hspmd.models.llama import LlamaConfig, build_llama  # noqa: E402
from hspmd.planning.fitting import typical  # noqa: E402
from hspmd.runtime.execution.batches import MicroBatchLayout  # noqa: E402
from hspmd.runtime.policies.calibrate import emulated_slowdowns, fit  # noqa: E402
from hspmd.runtime.policies.calibration import Calibration  # noqa: E402
from hspmd.runtime.policies.probes import Probe  # noqa: E402
from hspmd.runtime.processes.multiprocess import run_multiprocess  # noqa: E402
from hspmd.runtime.execution.trace import Tracer, write_trace  # noqa: E402
from hspmd.runtime.training.trainer import Trainer  # noqa: E402
from hspmd.specialize.strategy_text import parse_strategy  # noqa: E402

TRACED_STEPS = 7  # with --trace: the median one of these is written


def trainer_for(backend, text: str, schedule: str) -> Trainer:
    strategy = parse_strategy(text)
    model = build_llama(LlamaConfig(**CONFIG), [strategy])
    layout = MicroBatchLayout.of(strategy)
    return Trainer(model.graph, 0, backend, layout, schedule=schedule,
                   symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})


def demo_batch() -> dict[str, torch.Tensor]:
    """The one step's batch every strategy trains on: 16 sequences of SEQ tokens, seeded."""
    gen = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, CONFIG["vocab"], (16, SEQ), generator=gen),
            "labels": torch.randint(0, CONFIG["vocab"], (16, SEQ), generator=gen)}


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
    batch = demo_batch()
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


def typical_step(per_rank_steps: list[list[list[dict]]]) -> list[list[dict]]:
    """Of the traced steps (per rank, per step: events), the one whose span over both ranks is the
    median: a picture of a typical step rather than of whatever the last one met."""
    def span(step: int) -> float:
        spans = [e for rank in per_rank_steps for e in rank[step]]
        return max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)

    steps = sorted(range(len(per_rank_steps[0])), key=span)
    return [rank[steps[len(steps) // 2]] for rank in per_rank_steps]


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
        figures["cpu_split"] = print_cpu_split(calibration, cluster, measured, predicted,
                                               {key: parts[3] for key, parts in breakdown.items()})
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
