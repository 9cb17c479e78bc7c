"""Mixed-length training throughput: dispatch + packing over a strategy pool, against padding every
sequence to the step's longest, and against one fixed strategy (the pool's widest, TP4, the only
one that holds the corpus's longest sequences; dispatch + packing, no switching).

Part 1 (measured): the tiny Llama of examples/mixed_length on 4 gloo processes over the shipped
long-tailed corpus; the pool's costs and the price of a switch are first calibrated on this
machine (MixedLengthTrainer.calibrate), then the three modes train side by side in one run,
interleaved step by step (ABC, then CBA, ...), each on the same sequences, in several passes over
the same steps; a step's time is its slowest rank's; tokens/s counts real tokens only. Reported:
tokens/s per pass and mode (tokens over seconds), the median (min-max) over passes of the ratios,
and the median (min-max) of the per-step ratios.

Part 2 (measured, context parallelism): today's pool plus CP entries (CP4: one pipeline whose
packed rows are split along the sequence over 4 ranks; DP2CP2: two CP2 pipelines; CP2TP2: CP2 of
TP2 groups), chosen per step by predicted time, against today's pool and against each static CP
strategy that holds the corpus's longest sequences (CP4, CP2TP2; the best of them is the
baseline), all calibrated once on this machine and interleaved step by step (ABCD, then DCBA, ...).
Beside each measured tokens/s, the predicted one: the calibrated dispatcher's makespan of each
step (per-sequence costs a s^2 + b s + c per pipeline, the entry's sync, the measured switch
price when the step switches), summed over the pass.

Part 3 (predicted): the paper's setting, 32B Llama on 32 H20 (Hetu v2 §7.3), priced by the
cost model (hspmd.planning.cost) in the dispatcher's closed form (L0, not the event simulator):
long-tailed steps of ~200K tokens up to 32K, Table 11's pool (Hetu-B) against Table 10's
homogeneous strategies (Hetu-A buckets within the step, and DP2TP16 for everything).

    python benchmarks/bench_mixed_length.py [--steps 12] [--passes 3] [--skip-measured] [--skip-cp]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "mixed_length"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table, timed_on_world  # noqa: E402
from longtail import LongTailCorpus  # noqa: E402
from train import CALIBRATION_LENGTHS, POOL, TP2, TP4, UNIT, build  # noqa: E402  (the example's pool and model)
from hspmd.cluster import h800_h20  # noqa: E402
from hspmd.planning.cost import CostModel  # noqa: E402
from hspmd.planning.dispatch import PoolEntry, dispatch, select_entry  # noqa: E402
from hspmd.planning.model import MODELS  # noqa: E402
from hspmd.planning.paper_pools import model_costs, paper_pool  # noqa: E402
from hspmd.runtime.execution.batches import MicroBatchLayout  # noqa: E402
from hspmd.runtime.policies.mixed import MixedLengthTrainer  # noqa: E402
from hspmd.runtime.processes.multiprocess import run_multiprocess  # noqa: E402
from hspmd.runtime.execution.packing import counted_tokens, pack_row  # noqa: E402
from hspmd.runtime.training.trainer import Trainer  # noqa: E402

MODES = ("dispatch", "padding", "fixed")
TOKENS = 256


def bench_rank(backend, steps: int, warmup: int, passes: int):
    torch.set_num_threads(1)
    corpus = LongTailCorpus()
    model = build(corpus.vocab)
    symbols = {"S": 16, "T": 16}
    pooled = MixedLengthTrainer(model.graph, POOL, backend, symbols=symbols, passes=20, by_cost=True)
    fixed = MixedLengthTrainer(model.graph, POOL[:1], backend, symbols=symbols, passes=20)
    calibrated = pooled.calibrate(CALIBRATION_LENGTHS)
    fixed.pool = calibrated[:1]
    pipelines = len(POOL[0].pipelines)
    padded = Trainer(model.graph, POOL[0].strategy, backend, MicroBatchLayout((1,) * pipelines, (1,) * pipelines),
                     symbols=symbols)

    def pad_step(samples):
        longest = max(len(t) for t, _ in samples)
        rows = [[pack_row([s], longest) for s in samples[p::pipelines]] for p in range(pipelines)]
        return padded.step_rows(rows, {"T": counted_tokens(samples)})

    run = {"dispatch": pooled.step, "fixed": fixed.step, "padding": pad_step}
    for i in range(warmup):
        for mode in MODES:
            run[mode](corpus.step(steps + i, TOKENS))
    times = {m: [[] for _ in range(passes)] for m in MODES}
    for r in range(passes):
        for i in range(steps):
            samples = corpus.step(i, TOKENS)
            order = MODES if (r * steps + i) % 2 == 0 else MODES[::-1]
            for mode in order:
                seconds, _ = timed_on_world(backend, lambda: run[mode](samples))
                times[mode][r].append(seconds)
    tokens = [counted_tokens(corpus.step(i, TOKENS)) for i in range(steps)]
    chosen = [POOL[report.entries[0]].name for report in pooled.history[warmup:warmup + steps]]
    return times, tokens, chosen, calibrated, pooled.switch_seconds


def measured(steps: int, warmup: int, passes: int) -> None:
    results = run_multiprocess(bench_rank, 4, steps, warmup, passes, timeout=1800)
    tokens, chosen, calibrated, switch_seconds = results[0][1:]
    print("per-sequence costs calibrated on this machine (a s^2 + b s + c per micro-batch of the first pipeline, "
          "slowest rank; sync per step):")
    print(table(["strategy", "a", "b", "c", "sync per step"],
                [[e.name, f"{e.pipelines[0].a:.3g}", f"{e.pipelines[0].b:.3g}", f"{e.pipelines[0].c:.3g}",
                  f"{e.sync:.3g}"] for e in calibrated]))
    print(f"measured switch (fused BSR, planned): {switch_seconds * 1e3:.0f} ms; dispatch picks each step's strategy "
          f"by predicted time plus the switch it needs")
    # a step's time is its slowest rank's; a pass's throughput is its tokens over its seconds
    slowest = {m: [[max(res[0][m][r][k] for res in results) for k in range(steps)] for r in range(passes)] for m in MODES}
    rate = {m: [sum(tokens) / sum(slowest[m][r]) for r in range(passes)] for m in MODES}
    print(f"tiny Llama (examples/mixed_length), 4 gloo processes, {steps} steps of >= {TOKENS} tokens, {passes} "
          f"passes interleaved step by step (+{warmup} warm-up steps); strategies chosen in the first pass: "
          f"{' '.join(chosen)}")
    print(table(["mode", "tokens/s (median of passes)"], [[m, f"{statistics.median(rate[m]):.0f}"] for m in MODES]))
    for other in ("padding", "fixed"):
        ratios = [a / b for a, b in zip(rate["dispatch"], rate[other])]
        per_step = [b / a for r in range(passes) for a, b in zip(slowest["dispatch"][r], slowest[other][r])]
        print(f"dispatch / {other}: tokens/s {statistics.median(ratios):.2f}x median over {passes} passes "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}); per step {statistics.median(per_step):.2f}x median "
              f"(min {min(per_step):.2f}, max {max(per_step):.2f})")


CP_STRATEGIES = ("name=CP4 ; layers=2 ; ?x?: R0-3 L0-1 cp4",
                 "name=DP2CP2 ; layers=2 ; ?x?: R0,1 L0-1 cp2 ; ?x?: R2,3 L0-1 cp2",
                 "name=CP2TP2 ; layers=2 ; ?x?: R0-3 L0-1 cp2")
# graph indices after the example's four; a CP group shares a sequence's activations as TP does
CP_ENTRIES = (PoolEntry("CP4", 4, 4 * UNIT, (TP4,)), PoolEntry("DP2CP2", 5, 2 * UNIT, (TP2, TP2)),
              PoolEntry("CP2TP2", 6, 4 * UNIT, (TP4,)))
STATIC_CP = ("CP4", "CP2TP2")
CP_MODES = ("pool+CP", "pool", *STATIC_CP)


def cp_rank(backend, steps: int, warmup: int, passes: int):
    torch.set_num_threads(1)
    corpus = LongTailCorpus()
    model = build(corpus.vocab, CP_STRATEGIES)
    symbols = {"S": 16, "T": 16}
    with_cp = MixedLengthTrainer(model.graph, POOL + CP_ENTRIES, backend, symbols=symbols, passes=20, by_cost=True)
    calibrated = with_cp.calibrate(CALIBRATION_LENGTHS)
    switch = with_cp.switch_seconds
    named = {e.name: e for e in calibrated}
    trainers = {"pool+CP": with_cp,
                "pool": MixedLengthTrainer(model.graph, calibrated[:len(POOL)], backend, symbols=symbols, passes=20,
                                           by_cost=True, switch_seconds=switch)}
    for name in STATIC_CP:
        trainers[name] = MixedLengthTrainer(model.graph, (named[name],), backend, symbols=symbols, passes=20)
    for i in range(warmup):
        for mode in CP_MODES:
            trainers[mode].step(corpus.step(steps + i, TOKENS))
    times = {m: [[] for _ in range(passes)] for m in CP_MODES}
    for r in range(passes):
        for i in range(steps):
            samples = corpus.step(i, TOKENS)
            order = CP_MODES if (r * steps + i) % 2 == 0 else CP_MODES[::-1]
            for mode in order:
                seconds, _ = timed_on_world(backend, lambda: trainers[mode].step(samples))
                times[mode][r].append(seconds)
    predicted = {m: [[t.history[warmup + r * steps + i].dispatches[0].makespan
                      + (switch if t.history[warmup + r * steps + i].switches else 0.0) for i in range(steps)]
                     for r in range(passes)] for m, t in trainers.items()}
    chosen = {m: [t.pool[report.entries[0]].name + ("*" if report.switches else "")
                  for report in t.history[warmup:warmup + steps]] for m, t in trainers.items() if m in ("pool+CP", "pool")}
    longest = [max(len(x) for x, _ in corpus.step(i, TOKENS)) for i in range(steps)]
    tokens = [counted_tokens(corpus.step(i, TOKENS)) for i in range(steps)]
    return times, predicted, tokens, chosen, calibrated, switch, longest


def measured_cp(steps: int, warmup: int, passes: int) -> None:
    results = run_multiprocess(cp_rank, 4, steps, warmup, passes, timeout=3600)
    predicted, tokens, chosen, calibrated, switch, longest = results[0][1:]
    print("\nwith context parallelism: per-sequence costs calibrated on this machine (first pipeline, slowest rank):")
    print(table(["strategy", "a", "b", "c", "sync per step"],
                [[e.name, f"{e.pipelines[0].a:.3g}", f"{e.pipelines[0].b:.3g}", f"{e.pipelines[0].c:.3g}",
                  f"{e.sync:.3g}"] for e in calibrated]))
    slowest = {m: [[max(res[0][m][r][k] for res in results) for k in range(steps)] for r in range(passes)]
               for m in CP_MODES}
    rate = {m: [sum(tokens) / sum(slowest[m][r]) for r in range(passes)] for m in CP_MODES}
    guess = {m: [sum(tokens) / sum(predicted[m][r]) for r in range(passes)] for m in CP_MODES}
    print(f"tiny Llama, 4 gloo processes, {steps} steps of >= {TOKENS} tokens, {passes} passes interleaved step by "
          f"step (+{warmup} warm-up steps), switch {switch * 1e3:.0f} ms")
    print("per step (first pass; * after a switch): the entries chosen, measured seconds (median of passes), predicted")
    med = {m: [statistics.median(slowest[m][r][k] for r in range(passes)) for k in range(steps)] for m in CP_MODES}
    print(table(["step", "longest", "pool+CP", "s", "predicted", "pool", "s", "predicted"],
                [[k, longest[k], chosen["pool+CP"][k], f"{med['pool+CP'][k]:.3f}", f"{predicted['pool+CP'][0][k]:.3f}",
                  chosen["pool"][k], f"{med['pool'][k]:.3f}", f"{predicted['pool'][0][k]:.3f}"] for k in range(steps)]))
    print(table(["mode", "tokens/s measured (median of passes)", "tokens/s predicted"],
                [[m, f"{statistics.median(rate[m]):.0f}", f"{statistics.median(guess[m]):.0f}"] for m in CP_MODES]))
    best = max(STATIC_CP, key=lambda m: statistics.median(rate[m]))
    for other in ("pool", best):
        ratios = [a / b for a, b in zip(rate["pool+CP"], rate[other])]
        expected = statistics.median(guess["pool+CP"]) / statistics.median(guess[other])
        print(f"pool+CP / {other}{' (the best static CP)' if other == best else ''}: tokens/s "
              f"{statistics.median(ratios):.2f}x median over {passes} passes (min {min(ratios):.2f}, "
              f"max {max(ratios):.2f}); predicted {expected:.2f}x")


def long_tailed_step(rng: random.Random, tokens: int = 200_000, longest: int = 32 * 1024) -> list[int]:
    """Lengths of one step: a Pareto tail from 256 tokens, capped at `longest`, ~`tokens` in all."""
    out = []
    while sum(out) < tokens:
        out.append(min(longest, int(256 / (1.0 - rng.random()) ** (1 / 0.9))))
    return out


def predicted(steps: int = 20) -> None:
    cost = CostModel(h800_h20(0, 4), MODELS["llama-32b-hetu"].with_(dtype="bfloat16"))
    costs = model_costs(cost, "H20")
    hetu_b, table10 = paper_pool("table11", costs), paper_pool("table10_32k", costs)
    rng = random.Random(0)
    totals = {"Hetu-B, Table 11 pool": 0.0, "Hetu-A, Table 10 buckets": 0.0, "Table 10 DP2TP16 only": 0.0}
    for i in range(steps):
        lengths = long_tailed_step(rng)
        totals["Hetu-B, Table 11 pool"] += dispatch(hetu_b, lengths, seed=i, passes=5).makespan
        buckets: dict[int, list[int]] = {}
        for s in lengths:
            buckets.setdefault(select_entry(table10, s), []).append(s)
        totals["Hetu-A, Table 10 buckets"] += sum(dispatch(table10, b, seed=i, passes=5, entry=k).makespan
                                                  for k, b in buckets.items())
        totals["Table 10 DP2TP16 only"] += dispatch(table10, lengths, seed=i, passes=5, entry=0).makespan
    base = totals["Table 10 DP2TP16 only"]
    print(f"\npredicted, 32B Llama on 32 H20, {steps} long-tailed steps of ~200K tokens (<= 32K each); "
          f"cost model in the dispatcher's closed form, no switching overhead counted:")
    print(table(["strategy", "s/step", "speed-up vs DP2TP16"],
                [[k, f"{v / steps:.2f}", f"{base / v:.2f}x"] for k, v in totals.items()]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--skip-measured", action="store_true", help="skip part 1 (the pool against padding and TP4)")
    p.add_argument("--skip-cp", action="store_true", help="skip part 2 (the pool with CP entries)")
    args = p.parse_args(argv)
    if not args.skip_measured:
        measured(args.steps, args.warmup, args.passes)
    if not args.skip_cp:
        measured_cp(args.steps, args.warmup, args.passes)
    predicted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
