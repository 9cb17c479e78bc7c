"""Are the planner's heterogeneous decisions faster when measured? (emulated device types on this host)

Every comparison runs the tiny Llama on 4 gloo processes as the emulated cluster
examples/clusters/emulated-two-types.yaml: ranks 0, 1 are the "fast" type, ranks 2, 3 the "slow"
one (2.5x slower compute, hspmd.runtime.execution.emulation), the two nodes joined by a slower
link. Time is dilated (--dilation D, default 12: the fast type is this host D times slowed, the
others at their ratio to it), so that ranks compute a small share of the time and the emulated
devices, not the host's scheduler, set the pace: D must exceed the host's load per core, which
the bench prints (2 cores shared by 8 jobs run 8-16 processes per core). The cost model is
this host's calibration on CPU time, made in the same run (the step probes as the emulated reference
type, D times slowed), with the other types at the file's ratios (Calibration.cost_model_for). A
part's table of where the time went shows, for the
slowest type's ranks, the emulated compute and link waits, the ops' CPU time x slowdown (what
the calibration prices) and the rest of the step. Within a part every side is built once and the steps run
round-robin (ABC, then CBA, ...), so load drifts hit all sides alike; a step's time is its slowest
rank's, every rank starting together. Reported: per side the median step (min-max), and per
comparison the measured ratio (median over rounds of the per-round ratio, min-max) beside the
simulated one (level-1 simulator on the calibrated cost model).

1. planned vs uniform vs hand: the strategies the searches (dp, dfs, mcts; hspmd.planning.search)
   pick on the calibrated cost model, against the best uniform DPxTPxPP split (`hspmd plan`'s
   baseline) and a paper-style hand strategy (data parallel, the batch split by speed: 3:3:1:1).
2. mixed-length dispatch (hspmd.planning.dispatch over MixedLengthTrainer): long-tailed steps of
   packed sequences over 4 data-parallel pipelines, with each pipeline's costs calibrated on the
   emulated run (so the slow ones get fewer tokens) against the same dispatch told every pipeline
   costs what the fast ones do (speeds ignored).
3. H-1F1B vs 1F1B across a slow emulated link (the nodes' link at 40 ms latency): two 2-stage
   pipelines whose stages sit on different nodes, H-1F1B's warm-up vector chosen by the level-1
   simulator.

4. (plan3) part 1 on examples/clusters/emulated-three-types.yaml: 8 ranks over three nodes of
   three types (2 fast, 2 at 1.5x, 4 at 2.5x slower), global batch 16.
5. (cp) hetero context parallelism: one sequence of CP_SEQ tokens (a 2-layer Llama of hidden 256)
   split across a CP4 group of the
   two fast and the two slow ranks, evenly (in the ring's head + tail order) against shares by
   speed (strategy_sim.balanced_cp_shares on the calibrated cost model: the fast ranks take more
   tokens; in token order).
6. (recovery) after losing a rank of the fast type from the two pipelines of part 3, the
   hardware-aware re-plan (cluster_recovery: planning.replan on the cluster file, priced by the
   calibration) against the equal-devices re-plan (recover_strategy without a cluster), measured
   on the survivors (the lost rank idles; the switch itself is not timed).

Timing-sensitive, not part of `make test`:

    python benchmarks/bench_hetero.py [--calibration cal.json] [--rounds 9] [--parts plan,dispatch,h1f1b,plan3,cp,recovery]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import table, timed_on_world  # noqa: E402
from hspmd.cluster import LinkClass, load_cluster  # noqa: E402
from hspmd.models.llama import LlamaConfig, build_llama  # noqa: E402
from hspmd.ops import AdamW  # noqa: E402
from hspmd.planning import from_llama_config  # noqa: E402
from hspmd.planning.dispatch import PipelineCost, PoolEntry  # noqa: E402
from hspmd.planning.dispatch import dispatch as plan_dispatch  # noqa: E402
from hspmd.planning.search.command import run_searches, uniform_baseline  # noqa: E402
from hspmd.planning.search.costed import cluster_problem  # noqa: E402
from hspmd.ops.context import head_tail_order, in_token_order  # noqa: E402
from hspmd.planning.strategy_sim import balanced_cp_shares, simulate_strategy  # noqa: E402
from hspmd.runtime.execution.batches import MicroBatchLayout  # noqa: E402
from hspmd.runtime.execution.emulation import emulated  # noqa: E402
from hspmd.runtime.policies.calibrate import calibrate  # noqa: E402
from hspmd.runtime.policies.calibration import Calibration  # noqa: E402
from hspmd.runtime.policies.elastic import cluster_recovery  # noqa: E402
from hspmd.runtime.policies.mixed import MixedLengthTrainer  # noqa: E402
from hspmd.runtime.processes.multiprocess import run_multiprocess  # noqa: E402
from hspmd.runtime.training.trainer import Trainer  # noqa: E402
from hspmd.specialize.strategy_text import format_strategy, parse_strategy  # noqa: E402
from hspmd.switching.recovery import recover_strategy  # noqa: E402

CLUSTER = ROOT / "examples" / "clusters" / "emulated-two-types.yaml"
THREE_TYPES = ROOT / "examples" / "clusters" / "emulated-three-types.yaml"
SEQ = 32
CONFIG = dict(vocab=64, hidden=64, heads=4, ffn=128, layers=4)
GLOBAL_BATCH = 8
SLOW_LINK_LATENCY = 0.040
PIPELINES_ACROSS = "layers=4 ; 8x1 {schedule}: R0 L0-2 | R2 L3 ; 8x1 {schedule}: R1 L0-2 | R3 L3"
DISPATCH_STRATEGY = "name=DP4 ; layers=2 ; ?x?: R0 L0-1 ; ?x?: R1 L0-1 ; ?x?: R2 L0-1 ; ?x?: R3 L0-1"
MAX_TOKENS = 64
DISPATCH_TOKENS = 512
DISPATCH_LENGTHS = (8, 16, 32, 48, 64)


def spread(values) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def batch(step: int, rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"tokens": torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen),
            "labels": torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen)}


def interleaved(backend, sides: dict, rounds: int, warmup: int, data, warm_on_rounds: bool = False) -> dict[str, list[float]]:
    """Each side's step seconds on this rank, sides run round-robin (reversed every other round);
    with an emulated backend, also each side's per-step means of what the rank waited and the
    CPU time of its ops (under the key (name, "parts")). `warm_on_rounds`: warm up on the rounds'
    own data (mixed lengths: what each step's bindings resolve is then cached on both sides)."""
    names = list(sides)
    for i in range(rounds if warm_on_rounds else warmup):
        for name in names:
            sides[name](data(i if warm_on_rounds else 10_000 + i))
    times: dict = {name: [] for name in names}
    emulator = getattr(backend, "emulator", None)
    parts = {name: [0.0, 0.0, 0.0] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            before = emulator.stats() if emulator is not None else None
            seconds, _ = timed_on_world(backend, lambda: sides[name](data(r)))
            times[name].append(seconds)
            if emulator is not None:
                after = emulator.stats()
                for k, field in enumerate(("compute_wait_s", "link_wait_s", "op_cpu_s")):
                    parts[name][k] += (getattr(after, field) - getattr(before, field)) / rounds
    for name in names:
        times[(name, "parts")] = parts[name]
    return times


# ---- 1. planned vs uniform vs hand ---------------------------------------------------------------

def strategies_rank(backend, cluster, texts: dict[str, str], rounds: int, warmup: int):
    """One rank's step times of each strategy (all of one global batch) on the emulated cluster."""
    torch.set_num_threads(1)
    backend = emulated(backend, cluster)
    sides, rows = {}, None
    for name, text in texts.items():
        strategy = parse_strategy(text)
        rows = MicroBatchLayout.of(strategy).global_batch_size
        model = build_llama(LlamaConfig(**CONFIG), [strategy], optimizer=AdamW(lr=1e-3))
        trainer = Trainer(model.graph, 0, backend, strategy, symbols={"S": SEQ, "T": rows * SEQ})
        sides[name] = trainer.step
    return interleaved(backend, sides, rounds, warmup, lambda i: batch(i, rows))


def slowest(results, name: str) -> list[float]:
    return [max(per_rank[name][k] for per_rank in results) for k in range(len(results[0][name]))]


def breakdown(results, texts, cluster) -> str:
    """Where a step's time went on each rank of the slowest type (per-step means): emulated
    compute waits, emulated link waits, the ops' own CPU time and the slowdown times it (what the
    emulated device's compute should take, which the calibration prices), and the rest of the
    measured step (real op wall time, the framework outside ops, gloo, waiting for peers)."""
    slowest_type = max(range(cluster.n_devices), key=cluster.slowdown)
    ranks = [r for r in range(cluster.n_devices) if cluster.slowdown(r) == cluster.slowdown(slowest_type)]
    rows = []
    for name in texts:
        for r in ranks:
            wait, link, cpu = results[r][(name, "parts")]
            step = statistics.mean(results[r][name])
            rows.append([name, r, f"{step:.3f}", f"{wait:.3f}", f"{link:.3f}", f"{cpu:.4f}",
                         f"{cpu * cluster.slowdown(r):.3f}", f"{step - wait - link:.3f}"])
    return table(["strategy", "rank", "step s (mean)", "compute waits", "link waits", "op CPU s", "x slowdown",
                  "rest"], rows)


def report(results, simulated: dict[str, float], baseline: str) -> list[list[str]]:
    rows = []
    base = slowest(results, baseline)
    for name in simulated:
        mine = slowest(results, name)
        ratios = [b / m for b, m in zip(base, mine)]
        rows.append([name, spread(mine), f"{simulated[name]:.3f}", f"{spread(ratios)}x",
                     f"{simulated[baseline] / simulated[name]:.2f}x"])
    return rows


def _unnamed(text: str) -> dict:
    data = parse_strategy(text).to_dict()
    data.pop("name", None)
    return data


def hand_strategy(cluster, global_batch: int) -> tuple[str, str]:
    """The paper-style hand strategy: every device a data-parallel pipeline of the whole model, the
    batch split by speed as one would by hand: one sequence each, then each next one to the device
    that would finish its share soonest (its sequences x its slowdown). (name, text)"""
    rows = [1] * cluster.n_devices
    for _ in range(global_batch - cluster.n_devices):
        d = min(range(cluster.n_devices), key=lambda d: ((rows[d] + 1) * cluster.slowdown(d), d))
        rows[d] += 1
    layers = CONFIG["layers"] - 1
    split = ":".join(map(str, rows))
    return (f"hand (HetDP {split})",
            f"name=hand-hetdp ; layers={CONFIG['layers']} ; " + " ; ".join(f"{r}x1: R{d} L0-{layers}" for d, r in enumerate(rows)))


def print_comparison(title: str, kind: str, texts: dict[str, str], results, simulated: dict[str, float], baseline: str,
                     versus: str) -> None:
    """One part's report: its title, each side's strategy text, and the measured step (median and
    spread) beside the simulated one, both as speedups over `baseline`."""
    print(f"\n{title}")
    for name, text in texts.items():
        print(f"  {name}: {text}")
    print(table([kind, "measured step s, median (min-max)", "simulated s", f"measured speedup vs {versus}",
                 "simulated speedup"], report(results, simulated, baseline)))


def part_plan(cluster, cal: Calibration, rounds: int, warmup: int, iterations: int, global_batch: int) -> None:
    model = from_llama_config(LlamaConfig(**CONFIG), seq_len=SEQ, name="llama-tiny")
    cost = cal.cost_model_for(cluster, model)
    problem = cluster_problem(cost, global_batch, recompute=False)
    found = run_searches(problem, ("dp", "dfs", "mcts"), iterations=iterations)
    base = uniform_baseline(problem)
    hand_name, hand_text = hand_strategy(cluster, global_batch)
    texts = {f"uniform ({base[0].name})": format_strategy(base[0]), hand_name: hand_text}
    picked = {}
    for name, result in found.items():
        if isinstance(result, str):
            print(f"{name}: no strategy ({result})")
            continue
        text = format_strategy(result.strategy)
        same = next((k for k, v in texts.items() if _unnamed(v) == _unnamed(text)), None)
        picked[name] = same or f"{name} plan"
        if same is None:
            texts[f"{name} plan"] = text
    simulated = {name: simulate_strategy(parse_strategy(text), cost).iteration for name, text in texts.items()}
    results = run_multiprocess(strategies_rank, cluster.n_devices, cluster, texts, rounds, warmup, timeout=1800)
    baseline = next(iter(texts))
    print(f"\n1. on {cluster.describe()} ({cluster.n_devices} ranks): the planned strategy against the best uniform "
          f"split and a hand strategy (global batch {global_batch}, {rounds} rounds + {warmup} warm-up)")
    for name, text in texts.items():
        print(f"  {name}: {text}")
    print("  searches: " + ", ".join(f"{k} -> {v}" for k, v in picked.items()))
    print(table(["strategy", "measured step s, median (min-max)", "simulated s", "measured speedup vs uniform",
                 "simulated speedup"], report(results, simulated, baseline)))
    print(breakdown(results, texts, cluster))
    base = slowest(results, baseline)
    for name in sorted(set(picked.values())):
        sim_gain = simulated[baseline] / simulated[name] - 1
        measured_gain = statistics.median(b / m for b, m in zip(base, slowest(results, name))) - 1
        if sim_gain >= 0.10:
            print(f"  goal for {name}: simulated gain {sim_gain:.0%} -> measured {measured_gain:.0%} "
                  f"({'met' if measured_gain > 0 and measured_gain >= 0.8 * sim_gain else 'NOT met'}: faster, and >= 80% "
                  f"of the simulated gain)")
        else:
            print(f"  {name}: simulated gain {sim_gain:.0%} (< 10%: no goal), measured {measured_gain:.0%}")


# ---- 2. mixed-length dispatch ---------------------------------------------------------------------

def long_tailed(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = random.Random(step)
    out, total = [], 0
    while total < DISPATCH_TOKENS:
        n = min(MAX_TOKENS, max(4, int(rng.paretovariate(1.2) * 6)))
        tokens = torch.tensor([rng.randrange(CONFIG["vocab"]) for _ in range(n + 1)])
        out.append((tokens[:-1], tokens[1:]))
        total += n
    return out


def dispatch_rank(backend, cluster, rounds: int, warmup: int):
    torch.set_num_threads(1)
    backend = emulated(backend, cluster)
    model = build_llama(LlamaConfig(**{**CONFIG, "layers": 2}), [parse_strategy(DISPATCH_STRATEGY)],
                        optimizer=AdamW(lr=1e-3), packed=True)
    guess = PipelineCost(a=1e-6, b=1e-4, c=0.01, max_tokens=MAX_TOKENS)
    pool = (PoolEntry("DP4", 0, MAX_TOKENS, (guess,) * 4),)
    aware = MixedLengthTrainer(model.graph, pool, backend, symbols={"S": 16, "T": 16}, passes=20)
    calibrated = aware.calibrate(DISPATCH_LENGTHS)
    fast = calibrated[0].pipelines[0]
    blind = MixedLengthTrainer(model.graph, (PoolEntry("DP4", 0, MAX_TOKENS, (fast,) * 4, calibrated[0].sync),),
                               backend, symbols={"S": 16, "T": 16}, passes=20)
    times = interleaved(backend, {"speed-aware": aware.step, "speeds ignored": blind.step}, rounds, warmup, long_tailed,
                        warm_on_rounds=True)
    shares = []
    for trainer in (aware, blind):
        d = trainer.history[-1].dispatches[0]
        lengths = trainer.history[-1].lengths[0]
        shares.append([sum(lengths[i] for mb in mbs for i in mb) for mbs in d.micro_batches])
    return times, [(p.a, p.b, p.c) for p in calibrated[0].pipelines], shares, calibrated[0], fast


def part_dispatch(cluster, rounds: int, warmup: int) -> None:
    results = run_multiprocess(dispatch_rank, 4, cluster, rounds, warmup, timeout=1800)
    times = [r[0] for r in results]
    costs, shares, entry, fast = results[0][1:]
    aware, blind = slowest(times, "speed-aware"), slowest(times, "speeds ignored")
    ratios = [b / a for a, b in zip(aware, blind)]
    predicted = []
    for r in range(rounds):
        lengths = [len(t) for t, _ in long_tailed(r)]
        blind_d = plan_dispatch((PoolEntry("DP4", 0, MAX_TOKENS, (fast,) * 4, entry.sync),), lengths, passes=20)
        # the blind dispatch's assignment priced with the real (calibrated) costs
        real = [sum(entry.pipelines[p].micro_batch([lengths[i] for i in mb]) for mb in mbs)
                for p, mbs in enumerate(blind_d.micro_batches)]
        aware_d = plan_dispatch((entry,), lengths, passes=20)
        predicted.append((max(real) + entry.sync) / aware_d.makespan)
    print(f"\n2. mixed-length dispatch over 4 data-parallel pipelines (2 fast, 2 slow), steps of >= {DISPATCH_TOKENS} "
          f"long-tailed tokens ({rounds} rounds, after a warm-up pass over the same steps)")
    print("  calibrated per-pipeline costs (a s^2 + b s + c): " + "; ".join(f"{a:.2g} {b:.2g} {c:.2g}" for a, b, c in costs))
    print(f"  tokens per pipeline in the last step: speed-aware {shares[0]}, speeds ignored {shares[1]}")
    print(table(["dispatch", "measured step s, median (min-max)"], [["speed-aware", spread(aware)],
                                                                    ["speeds ignored", spread(blind)]]))
    print(f"  speed-aware vs speeds ignored: measured {spread(ratios)}x, predicted by the dispatcher's costs "
          f"{statistics.median(predicted):.2f}x")


# ---- 3. H-1F1B vs 1F1B across a slow link --------------------------------------------------------

def part_h1f1b(cluster, cal: Calibration, rounds: int, warmup: int) -> None:
    slow_net = LinkClass("net", 5e7, SLOW_LINK_LATENCY)
    links = tuple(slow_net if link.name == "net" else link for link in cluster.links)
    slow = type(cluster)(cluster.nodes, cluster.device_types, links, cluster.intra, cluster.inter, cluster.cross,
                         cluster.pairs, cluster.name + "-slow-link", cluster.emulation)
    model = from_llama_config(LlamaConfig(**CONFIG), seq_len=SEQ, name="llama-tiny")
    cost = cal.cost_model_for(slow, model)
    base = PIPELINES_ACROSS.format(schedule="1f1b")
    candidates = {k: PIPELINES_ACROSS.format(schedule=f"h1f1b={k},1") for k in range(3, 9)}
    simulated = {k: simulate_strategy(parse_strategy(t), cost).iteration for k, t in candidates.items()}
    best = min(simulated, key=lambda k: (simulated[k], k))
    texts = {"1F1B": base, f"H-1F1B (warm-up {best},1)": candidates[best]}
    sims = {name: simulate_strategy(parse_strategy(t), cost).iteration for name, t in texts.items()}
    results = run_multiprocess(strategies_rank, 4, slow, texts, rounds, warmup, timeout=1800)
    print_comparison(f"3. H-1F1B vs 1F1B, two 2-stage pipelines across the nodes' link at {SLOW_LINK_LATENCY * 1e3:.0f} ms "
                     f"({rounds} rounds + {warmup} warm-up)", "schedule", texts, results, sims, "1F1B", "1F1B")


# ---- 5. hetero context parallelism ---------------------------------------------------------------

CP_SEQ = 1024
# wider than CONFIG: at hidden 64 a CP rank's step is mostly per-op overhead, which fewer tokens do not shrink
CP_CONFIG = dict(vocab=64, hidden=256, heads=4, ffn=512, layers=2)
CP_EVEN = "layers=2 ; 1x1: R0-3 L0-1 cp4"


def cp_rank(backend, cluster, texts: dict[str, str], rounds: int, warmup: int):
    """One rank's step times of each CP strategy on one sequence of CP_SEQ tokens (even shares in
    the ring's balanced order, uneven ones in token order)."""
    torch.set_num_threads(1)
    backend = emulated(backend, cluster)
    sides = {}
    for name, text in texts.items():
        strategy = parse_strategy(text)
        model = build_llama(LlamaConfig(**CP_CONFIG), [strategy], optimizer=AdamW(lr=1e-3))
        trainer = Trainer(model.graph, 0, backend, strategy, symbols={"S": CP_SEQ, "T": CP_SEQ})
        even = strategy.pipelines[0].stages[0].cp_shares is None
        order = head_tail_order(CP_SEQ, strategy.max_cp) if even else torch.arange(CP_SEQ)
        sides[name] = lambda rows, t=trainer, o=order: t.step(in_token_order(rows, o))

    def data(i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        return {k: torch.randint(0, CP_CONFIG["vocab"], (1, CP_SEQ), generator=gen) for k in ("tokens", "labels")}

    return interleaved(backend, sides, rounds, warmup, data)


def part_cp(cluster, cal: Calibration, rounds: int, warmup: int) -> None:
    cluster = cluster.with_emulation(replace(cluster.emulation, memory_scale=4.0))  # CP_CONFIG's model is larger
    model = from_llama_config(LlamaConfig(**CP_CONFIG), seq_len=CP_SEQ, name="llama-cp")
    cost = cal.cost_model_for(cluster, model)
    shares = balanced_cp_shares(cost, parse_strategy(CP_EVEN).pipelines[0].stages[0], CP_SEQ)
    texts = {"even shares": CP_EVEN, f"shares by speed {':'.join(map(str, shares))}": CP_EVEN.replace(
        "cp4", "cp4=" + ",".join(map(str, shares)))}
    sims = {name: simulate_strategy(parse_strategy(t), cost, seq=CP_SEQ).iteration for name, t in texts.items()}
    results = run_multiprocess(cp_rank, 4, cluster, texts, rounds, warmup, timeout=1800)
    print_comparison(f"5. hetero CP: one {CP_SEQ}-token sequence over a CP4 group of 2 fast and 2 slow ranks "
                     f"({rounds} rounds + {warmup} warm-up)", "shares", texts, results, sims, "even shares", "even")
    print(breakdown(results, texts, cluster))


# ---- 6. recovery on mixed hardware -------------------------------------------------------------------

def part_recovery(cluster, cal: Calibration, rounds: int, warmup: int, failed: int = 0) -> None:
    """After rank `failed` (of the fast type) is lost from two 2-stage pipelines across the nodes,
    the hardware-aware re-plan (runtime.policies.elastic.cluster_recovery: planning.replan on the
    cluster, priced by this host's calibration) against the equal-devices one (recover_strategy
    without a cluster), each measured on the survivors (the lost rank idles) under emulation."""
    model = from_llama_config(LlamaConfig(**CONFIG), seq_len=SEQ, name="llama-tiny")
    cost = cal.cost_model_for(cluster, model)
    start = parse_strategy(PIPELINES_ACROSS.format(schedule="1f1b"))
    aware = cluster_recovery(cluster, model, cal)(start, {failed})
    equal = recover_strategy(start, {failed})
    texts = {"equal devices": format_strategy(equal), "hardware-aware": format_strategy(aware)}
    sims = {name: simulate_strategy(parse_strategy(t), cost).iteration for name, t in texts.items()}
    results = run_multiprocess(strategies_rank, cluster.n_devices, cluster, texts, rounds, warmup, timeout=1800)
    print_comparison(f"6. recovery after losing rank {failed} ({cluster.device_type(failed).name}) of "
                     f"{format_strategy(start)} ({rounds} rounds + {warmup} warm-up)", "re-plan", texts, results, sims,
                     "equal devices", "equal devices")


def dilated(cluster, dilation: float):
    """The cluster with its reference type `dilation` times slower than this host and every other
    type at its own ratio to the reference (hspmd.cluster.emulation): a dilation above the host's
    contention (runnable processes per core) keeps the emulated devices, not the host's
    scheduler, setting the pace."""
    emulation = cluster.emulation
    ref = cluster.type_slowdown(emulation.reference)
    slowdowns = tuple((t.name, cluster.type_slowdown(t.name) * dilation / ref) for t in cluster.device_types)
    return cluster.with_emulation(replace(emulation, slowdowns=slowdowns))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", default=None,
                   help="`hspmd calibrate --cpu-time`'s file (default: calibrate here first, on CPU time)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iterations", type=int, default=300, help="MCTS iterations")
    p.add_argument("--dilation", type=float, default=12.0,
                   help="how many times slower than this host the fastest type runs (default 12; keep it above the "
                        "host's load per core, else the scheduler sets the pace)")
    p.add_argument("--parts", default="plan,dispatch,h1f1b,plan3,cp,recovery",
                   help="plan (two types), dispatch, h1f1b, plan3 (the 8-rank three-type cluster), cp (hetero CP), recovery")
    args = p.parse_args(argv)
    cluster = dilated(load_cluster(CLUSTER), args.dilation)
    cal = Calibration.load(args.calibration) if args.calibration else calibrate(3, cpu_time=True, emulate=args.dilation)
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    print(f"host load: {load:.1f} runnable processes per core (1-minute average); dilation {args.dilation:g}")
    print(cluster.summary())
    print("this host (reference type): " + cal.describe())
    parts = set(args.parts.split(","))
    if "plan" in parts:
        part_plan(cluster, cal, args.rounds, args.warmup, args.iterations, GLOBAL_BATCH)
    if "plan3" in parts:
        part_plan(dilated(load_cluster(THREE_TYPES), args.dilation), cal, args.rounds, args.warmup, args.iterations,
                  2 * GLOBAL_BATCH)
    if "dispatch" in parts:
        part_dispatch(cluster, args.rounds, args.warmup)
    if "h1f1b" in parts:
        part_h1f1b(cluster, cal, args.rounds, args.warmup)
    if "cp" in parts:
        part_cp(cluster, cal, args.rounds, args.warmup)
    if "recovery" in parts:
        part_recovery(cluster, cal, args.rounds, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
