"""Where an emulated step's device CPU goes, stretch by stretch, against level 2's prices.

Level 2 prices an emulated device's step as its ops' prices plus, for every stretch of work
between two sleeps, how much slower the wake-up probe measured that much work to run after a
sleep (CostModel.woken_work). bench_calibration.py --split-wake splits a strategy's device-CPU
error into those two parts; this splits it by stretch. Each rank records every op's owed CPU
seconds in order, with where it communicated and where it slept a chunk of its debt
(RankEmulator.timeline); each stretch (the work between two such marks) is priced op by op
with the calibration fitted to probes interleaved with the steps (all of them, once a round,
on both ranks), and by the after-sleep curve at its priced length. Per strategy, rank and kind
of stretch (what it follows: a communication, a chunk slept, the step's start; whether a pass's
own work or an op comes first in it) it prints how many a step has, their priced
length, the ops' and the between-pass work's owed CPU against their prices, and what the
stretch measured over its prices against what the curve adds at its length and what level 2
adds (the curve from the end of a pass's own work where that opens the stretch).

`--unslept` runs the ranks sleeping in chunks alone (RankEmulator.sleeps_at_communications off):
what the op prices are measured in, so what is left over them is what a communication's own
wait does to the work after it, without a sleep before it.

    python benchmarks/bench_stretches.py --strategies "DP2,TP2,PP2 1F1B,PP2 GPipe" --rounds 8 --pin-cpus
    python benchmarks/bench_stretches.py --reprice benchmarks/saved/stretches/vm2core-8-rounds.json.gz

Timing-sensitive: not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _calibration_accuracy import CONFIG, PAIRS, PROBE, SEQ, STRATEGIES, emulated_pair, read_saved, specialized  # noqa: E402
from _common import ms, table  # noqa: E402
from bench_calibration import demo_batch, start_turn, trainer_for  # noqa: E402
from hspmd.errors import HSPMDError  # noqa: E402
from hspmd.models.llama import LlamaConfig  # noqa: E402
from hspmd.planning import CostModel, from_llama_config  # noqa: E402
from hspmd.planning.device_sim import op_kernel  # noqa: E402
from hspmd.runtime.execution.emulation import BETWEEN_PASSES, CHUNK_SLEPT, COMMUNICATED, emulated, emulation_of  # noqa: E402
from hspmd.runtime.policies.calibrate import emulated_slowdowns, fit  # noqa: E402
from hspmd.runtime.policies.probes import Probe  # noqa: E402
from hspmd.runtime.processes.multiprocess import run_multiprocess  # noqa: E402

STEP_START = "the step's start"


@dataclass(frozen=True)
class Stretch:
    """The work a device did between two of its timeline's marks: what it followed (COMMUNICATED,
    CHUNK_SLEPT or STEP_START), whether it opened with a pass's own work, its ops' (name, CPU
    seconds) in order, and the between-pass work it held (CPU seconds, how many passes)."""

    after: str
    opens_pass: bool
    ops: tuple[tuple[str, float], ...]
    passes: float
    pass_count: int
    idle: float | None = None  # wall seconds from the mark it follows to its first work (None: not recorded)

    @property
    def kind(self) -> str:
        follows = {COMMUNICATED: "after a communication", CHUNK_SLEPT: "after a chunk slept"}.get(self.after, "at the step's start")
        return f"{follows}, {'a pass start first' if self.opens_pass else 'an op first'}"


def split_stretches(timeline: list[tuple[str, float]]) -> list[Stretch]:
    """A step's timeline (RankEmulator.timeline) cut at its marks into the stretches between them;
    a mark with no work since the one before (several communications in a row) cuts nothing."""
    out: list[Stretch] = []
    after, ops, passes, count, opens, idle = STEP_START, [], 0.0, 0, None, None

    def close() -> None:
        if ops or count:
            out.append(Stretch(after, bool(opens), tuple(ops), passes, count, idle))

    for name, seconds in timeline:
        if name in (COMMUNICATED, CHUNK_SLEPT):
            first = bool(ops or count) or after == STEP_START  # the first of marks in a row: the idle runs from it
            close()
            if first:
                idle = seconds if seconds > 0 else None  # 0: a run saved before marks kept their idle
            after, ops, passes, count, opens = name, [], 0.0, 0, None
        elif name == BETWEEN_PASSES:
            passes, count = passes + seconds, count + 1
            opens = True if opens is None else opens
        else:
            ops.append((name, seconds))
            opens = False if opens is None else opens
    close()
    return out


def measure(backend, names: list[str], rounds: int, kind: str, dilation: float, unslept: bool) -> dict:
    """This rank's probes (all of them, once a round) and per strategy and round its timed step's
    timeline, each timed step after an untimed one of its own."""
    torch.set_num_threads(1)
    cluster = emulated_pair(kind, dilation)
    probe = Probe(backend, PROBE, cpu_time=True, emulate=cluster.type_slowdown(cluster.emulation.reference),
                  wake_at=emulated_slowdowns(cluster))
    trainers = {name: trainer_for(emulated(backend, cluster), *STRATEGIES[name]) for name in names}
    batch = demo_batch()
    probes, timelines = [], {name: [] for name in names}
    for _ in range(rounds):
        probes.append(probe.once())
        for name, trainer in trainers.items():
            device = emulation_of(trainer.backend)
            device.sleeps_at_communications = not unslept
            start_turn(backend, device)
            trainer.step(batch)
            start_turn(backend, device)
            device.timeline = []
            trainer.step(batch)
            timelines[name].append(device.timeline)
            device.timeline = None
            device.sleeps_at_communications = True
    return {"probes": probes, "timelines": timelines}


def op_prices(name: str, cost: CostModel) -> dict[int, dict[str, float]]:
    """Per device of strategy `name`, each op's level-2 price by name, in host CPU seconds."""
    _, _, spec = specialized(name)
    prices: dict[int, dict[str, float]] = {}
    for d, exe in spec.executables.items():
        prices[d] = {}
        for program in (exe.forward, exe.backward, exe.update):
            for ins in program:
                kernel = op_kernel(exe, ins, spec.binding)
                if kernel is not None:
                    prices[d][ins.node.name] = cost.op_time(ins.node.kind, kernel, d) / cost.cpu_scale(d)
    return prices


@dataclass
class KindTotals:
    """One kind of stretch's sums over a strategy's timed steps on one rank (CPU seconds)."""

    stretches: int = 0
    ops: float = 0.0
    ops_priced: float = 0.0
    unpriced: float = 0.0  # ops with no level-2 price (none expected: counted so a gap shows)
    passes: float = 0.0
    passes_priced: float = 0.0
    curve: float = 0.0  # what the after-sleep curve adds at each stretch's priced length
    level2: float = 0.0  # what level 2 adds (CostModel.woken_work: from the end of a pass's opening work)
    idle: float = 0.0  # the wall seconds idle before the stretches that recorded it
    idled: int = 0  # how many did
    at_idle: float = 0.0  # what level 2 adds to those given their measured idle
    at_idle_work: float = 0.0  # their priced work

    def add(self, stretch: Stretch, prices: dict[str, float], cost: CostModel, device: int, after: float | None) -> float:
        """Count `stretch`, which follows the sleep of `after` priced host seconds of work (None:
        at the step's start); returns its own priced host seconds."""
        priced = [prices[n] for n, _ in stretch.ops if n in prices]
        per_pass = cost.op_costs.per_pass
        self.stretches += 1
        self.ops += sum(s for n, s in stretch.ops if n in prices)
        self.unpriced += sum(s for n, s in stretch.ops if n not in prices)
        self.ops_priced += sum(priced)
        self.passes += stretch.passes
        self.passes_priced += stretch.pass_count * per_pass
        work = sum(priced) + stretch.pass_count * per_pass
        if work > 0:
            scale = cost.cpu_scale(device)
            self.curve += work * cost.op_costs.slower_after(work)
            opening = per_pass * scale if stretch.opens_pass else 0.0
            idle = None if after is None else cost.sleep_after(device, after * scale)
            self.level2 += cost.woken_work(device, work * scale, opening=opening, idle=idle) / scale
            if stretch.idle is not None:
                self.idle += stretch.idle
                self.idled += 1
                self.at_idle += cost.woken_work(device, work * scale, opening=opening, idle=stretch.idle) / scale
                self.at_idle_work += work
        return work


def totals_by_kind(timelines: list[list[tuple[str, float]]], prices: dict[str, float], cost: CostModel,
                   device: int) -> dict[str, KindTotals]:
    """Each kind of stretch's totals over the steps' `timelines` of `device`."""
    out: dict[str, KindTotals] = {}
    for timeline in timelines:
        before = None
        for stretch in split_stretches(timeline):
            work = out.setdefault(stretch.kind, KindTotals()).add(stretch, prices, cost, device, before)
            before = work
    return out


def report(probes: list[dict], timelines: list[dict], kind: str, dilation: float) -> dict:
    """Fit the probes, price every rank's stretches (`timelines`: per rank, per strategy its
    steps') and print them; returns the figures."""
    calibration = fit(probes, PROBE)
    names = list(timelines[0])
    print("calibration:", calibration.describe())
    cost = calibration.cost_model_for(emulated_pair(kind, dilation), from_llama_config(LlamaConfig(**CONFIG), SEQ))
    rows, figures = [], {}
    for name in names:
        prices = op_prices(name, cost)
        for rank, mine in enumerate(timelines):
            steps = len(mine[name])
            for what, t in sorted(totals_by_kind(mine[name], prices[rank], cost, rank).items()):
                work = t.ops_priced + t.passes_priced
                over = (t.ops + t.passes) / work - 1 if work else 0.0
                rows.append([name, rank, what, f"{t.stretches / steps:g}", ms(work / t.stretches),
                             ms(t.ops / steps), f"{t.ops / t.ops_priced - 1:+.1%}" if t.ops_priced else "-",
                             ms(t.passes / steps), ms(t.passes_priced / steps), f"{over:+.1%}", f"{t.curve / work:+.1%}" if work else "-",
                             f"{t.level2 / work:+.1%}" if work else "-",
                             ms(t.idle / t.idled) if t.idled else "-",
                             f"{t.at_idle / t.at_idle_work:+.1%}" if t.at_idle_work else "-",
                             ms(t.unpriced / steps)])
                figures.setdefault(name, {}).setdefault(str(rank), {})[what] = {**vars(t), "steps": steps}
    print(table(["strategy", "rank", "stretch", "per step", "priced ms each", "ops ms/step", "ops over price",
                 "passes ms/step", "priced", "measured over priced", "curve adds", "level 2 adds", "idle ms before", "at that idle",
                 "unpriced ms"], rows))
    return {"calibration": calibration.to_dict(), "stretches": figures}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="DP2,TP2,PP2 1F1B,PP2 GPipe", help=f"comma-separated, of: {', '.join(STRATEGIES)}")
    p.add_argument("--kind", default="homogeneous", choices=sorted(PAIRS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dilation", type=float, default=8.0, help="the fast type's slowdown (bench_calibration's)")
    p.add_argument("--unslept", action="store_true", help="the ranks sleep in chunks alone, not before communicating")
    p.add_argument("--pin-cpus", action="store_true", help="pin each rank to its own CPU")
    p.add_argument("--json", default=None, help="write the figures, probes and timelines here")
    p.add_argument("--reprice", default=None, metavar="JSON",
                   help="price a run saved with --json (or gzipped: .json.gz) again: its probes fitted and its "
                        "stretches priced as the code is now")
    args = p.parse_args(argv)
    if args.reprice:
        saved = read_saved(args.reprice)[0]
        print(f"== re-priced: {args.reprice} ({saved['kind']}, {'unslept' if saved['unslept'] else 'slept'})")
        report(saved["probes"], saved["timelines"], saved["kind"], saved["dilation"])
        return 0
    names = [n.strip() for n in args.strategies.split(",")]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise HSPMDError(f"--strategies: unknown {unknown}; the strategies are {', '.join(STRATEGIES)}")
    if args.rounds < 1:
        raise HSPMDError(f"--rounds must be at least 1, got {args.rounds}")
    results = run_multiprocess(measure, 2, names, args.rounds, args.kind, args.dilation, args.unslept,
                               timeout=3600, pin_cpus=args.pin_cpus)
    regime = "sleeping in chunks alone" if args.unslept else "sleeping before each communication"
    print(f"== emulated pair, {args.kind}, dilation {args.dilation:g}, {regime}, {args.rounds} rounds")
    probes, timelines = results[0]["probes"] + results[1]["probes"], [r["timelines"] for r in results]
    figures = report(probes, timelines, args.kind, args.dilation)
    if args.json:
        Path(args.json).write_text(json.dumps({**figures, "unslept": args.unslept, "kind": args.kind, "dilation": args.dilation,
                                               "probes": probes, "timelines": timelines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
