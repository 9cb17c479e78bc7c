"""`hspmd plan`: search a strategy for a model on a cluster, compare the searches with the uniform
Megatron-style baseline a user would otherwise write, print the chosen strategy and save it.

    hspmd plan --cluster hetu-h800-h20 --model llama-32b-hetu --global-batch 64 [--search all]
               [--out plan.yaml] [--png plan.png] [--iterations 3000] [--seed 0] [--max-tp 8] [--max-cp 4] [--no-recompute]
               [--seq 32768] [--calibration calibration.json]

With --calibration (the file `hspmd calibrate` writes) on a cluster file with an `emulate` block,
ops are priced with this host's measured costs (rates, kernel efficiency, per-instruction and
per-step overheads, the gloo link), the other device types at the file's ratios: the plan is made
for the run `hspmd run --cluster` will measure. The calibration is read through a
`calibrated(path, cluster, model)` the caller passes (the runtime's Calibration, above this layer).

The file written by --out is a strategy file (hspmd.specialize.strategy_files) that
`examples/llama/train.py --strategy-file plan.yaml` trains; it carries the plan's recompute flags
and schedules. The terminal gets a compact strategy map; --png draws the picture through a
`draw(strategy, cost, path)` the caller passes (hspmd.show.draw_plan from `hspmd plan`: pictures
are drawn above the planning layer).

Which strategy is chosen: the searches rank candidates by their objective (the pipeline formula,
cheap enough to price thousands), which can disagree with the level-1 simulator on the final few
(per-op overheads, a schedule's bubbles). The searches' answers and the uniform split are
therefore simulated once more and the fastest simulated one is chosen (`choose`): a search's plan
that the simulator rates slower than the uniform split is not written.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from typing import Callable, Mapping

from rich.console import Console
from rich.table import Table

from hspmd.cluster import ClusterSpec, parse_cluster
from hspmd.errors import HSPMDError, error_line
from hspmd.planning.cost import CostModel
from hspmd.planning.model import ModelSpec, model_named
from hspmd.planning.strategy_sim import simulate_strategy
from hspmd.planning.search.costed import cluster_problem
from hspmd.planning.search.dfs_h2 import dfs
from hspmd.planning.search.dp_hapt import dp
from hspmd.planning.search.mcts_hetauto import mcts
from hspmd.planning.search.space import PlannedStrategy, PlanningError, Priced, Problem, price_strategy
from hspmd.specialize.strategy import Strategy, format_ranks, parse_index_list
from hspmd.specialize.strategy_build import uniform_strategy
from hspmd.specialize.strategy_files import save_strategy
from hspmd.specialize.strategy_render import strategy_map_text
from hspmd.specialize.strategy_text import format_strategy

SEARCH_NAMES = ("dp", "dfs", "mcts")


def uniform_baseline(problem: Problem) -> tuple[Strategy, Priced] | None:
    """The fastest feasible DPxTPxPP Megatron-style strategy over all devices in rank order (the
    fastest infeasible one if none fits): what a user tunes by hand without a planner."""
    ranks = sorted(r for p in problem.pools for r in p.ranks)
    n = len(ranks)
    node = min(p.node_size for p in problem.pools)
    best = None
    for tp in (1, 2, 4, 8, 16):
        if tp > node or n % tp:
            continue
        for pp in range(1, min(problem.num_layers, n // tp) + 1):
            if (n // tp) % pp:
                continue
            dp = n // (tp * pp)
            if problem.global_batch % dp:
                continue
            base = uniform_strategy(problem.num_layers, dp=dp, tp=tp, pp=pp,
                                    micro_batches=problem.global_batch // dp, micro_batch_size=1, name=f"uniform-dp{dp}tp{tp}pp{pp}")
            renumbered = Strategy.from_dict(_renumber(base.to_dict(), ranks))
            try:
                priced = price_strategy(problem, renumbered)
            except PlanningError:
                continue
            key = (not priced.feasible, priced.time)
            if best is None or key < best[0]:
                best = (key, renumbered, priced)
    return None if best is None else (best[1], best[2])


def _renumber(data: dict, ranks: list[int]) -> dict:
    for p in data["pipelines"]:
        for s in p["stages"]:
            s["ranks"] = format_ranks([ranks[i] for i in parse_index_list(s["ranks"])])
    return data


def run_searches(problem: Problem, names, iterations: int = 3000, seed: int = 0) -> dict[str, PlannedStrategy | str]:
    """Each named search's best strategy, or the reason it found none. MCTS is warm-started from
    DFS's answer (run for it when DFS is not asked for), so it never returns a worse layout."""
    out: dict[str, PlannedStrategy | str] = {}
    for name in sorted(names, key=lambda n: n != "dfs"):  # DFS first: MCTS starts from its answer
        try:
            if name == "dp":
                out[name] = dp(problem)[0]
            elif name == "dfs":
                out[name] = dfs(problem)[0]
            else:
                guided = out.get("dfs")
                if guided is None:
                    try:
                        guided = dfs(problem)[0]
                    except PlanningError:
                        guided = None
                warm = guided.layout if isinstance(guided, PlannedStrategy) else None
                out[name] = mcts(problem, iterations=iterations, seed=seed, warm_start=warm)[0]
        except PlanningError as exc:
            out[name] = str(exc)
    return {name: out[name] for name in names}


def comparison_table(problem: Problem, results, baseline, simulated: Mapping[str, float] | None = None) -> str:
    """Predicted (the searches' objective) and, given `simulated` (simulated_times), the level-1
    simulator's iteration times."""
    table = Table(title="strategy searches (predicted: pipeline formula; simulated: level-1 simulator)", title_justify="left")
    for column in ("search", "predicted (s)", "simulated (s)", "vs uniform", "peak memory (GiB)", "fits", "search (s)",
                   "stages x pipelines"):
        table.add_column(column)

    def shown(name: str) -> str:
        return f"{simulated[name]:.4g}" if simulated is not None and name in simulated else "-"

    ref = baseline[1].time if baseline else None
    if baseline:
        strategy, priced = baseline
        table.add_row(f"uniform ({strategy.name})", f"{priced.time:.4g}", shown("uniform"), "1.00x",
                      f"{max(priced.stage_memory) / 2**30:.1f}", "yes" if priced.feasible else "NO", "-",
                      f"{len(strategy.pipelines[0].stages)} x {strategy.num_pipelines}")
    for name, r in results.items():
        if isinstance(r, str):
            table.add_row(name, "-", "-", "-", "-", "-", "-", r)
            continue
        speed = f"{ref / r.predicted_time:.2f}x" if ref else "-"
        table.add_row(name, f"{r.predicted_time:.4g}", shown(name), speed, f"{max(r.peak_memory.values()) / 2**30:.1f}",
                      "yes", f"{r.provenance['seconds']:.2f}", f"{len(r.strategy.pipelines[0].stages)} x {r.strategy.num_pipelines}")
    buffer = io.StringIO()
    Console(file=buffer, width=140, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


def best_result(results) -> PlannedStrategy:
    """The search answer with the least predicted time (the searches' own objective)."""
    found = [r for r in results.values() if not isinstance(r, str)]
    if not found:
        raise PlanningError("no search found a strategy that fits device memory: " +
                            "; ".join(f"{k}: {v}" for k, v in results.items()))
    return min(found, key=lambda r: r.predicted_time)


def simulated_times(results, baseline: tuple[Strategy, Priced] | None, cost: CostModel) -> dict[str, float]:
    """The level-1 simulator's iteration time of each search's answer and of the uniform split
    ("uniform"), each simulated once for the table and the choice."""
    strategies = {name: r.strategy for name, r in results.items() if not isinstance(r, str)}
    if baseline is not None:
        strategies["uniform"] = baseline[0]
    return {name: simulate_strategy(strategy, cost).iteration for name, strategy in strategies.items()}


def choose(results, baseline: tuple[Strategy, Priced] | None,
           simulated: Mapping[str, float]) -> tuple[str, PlannedStrategy | Strategy]:
    """(name, choice): of the searches' answers and the uniform split (when it fits), the one
    the level-1 simulator rates fastest (`simulated`: simulated_times); on a tie a search's answer,
    in the searches' order. Raises PlanningError when no search found a strategy that fits."""
    best_result(results)  # the error naming every search's reason when none found one
    candidates: dict[str, PlannedStrategy | Strategy] = {name: r for name, r in results.items() if not isinstance(r, str)}
    if baseline is not None and baseline[1].feasible:
        candidates["uniform"] = baseline[0]
    name = min(candidates, key=lambda n: simulated[n])
    return name, candidates[name]


Calibrated = Callable[[str, ClusterSpec, ModelSpec], CostModel]


def plan_cost(cluster: ClusterSpec, model: ModelSpec, calibration: str | None = None,
              calibrated: Calibrated | None = None) -> CostModel:
    """What `hspmd plan` prices with: the cluster file's own figures, or, given a calibration file,
    this host's measured costs for a cluster emulated on it (`calibrated` reads the file)."""
    if calibration is None:
        return CostModel(cluster, model)
    if calibrated is None:
        raise HSPMDError("--calibration needs a calibration reader: run it as `hspmd plan` (hspmd.cli)")
    if cluster.emulation is None:
        raise HSPMDError(f"--calibration {calibration}: it measured this host, but cluster {cluster.describe()} has no "
                         f"emulate block (it is not run on this host); plan on the file's own figures instead")
    return calibrated(calibration, cluster, model)


def main(argv: list[str] | None = None, draw: Callable[[Strategy, CostModel, str], None] | None = None,
         calibrated: Calibrated | None = None) -> int:
    p = argparse.ArgumentParser(prog="hspmd plan", description="Search a parallel strategy for a model on a cluster.")
    p.add_argument("--cluster", required=True, help="a preset (hetu-h800-h20, ...), a shape (h800-h20:2+4) or a .yaml file")
    p.add_argument("--model", required=True, help="a model preset (llama-32b-hetu, llama-30b, gpt-13b, h2-100b, llama-tiny)")
    p.add_argument("--global-batch", type=int, required=True, help="samples per step")
    p.add_argument("--search", default="all", choices=SEARCH_NAMES + ("all",))
    p.add_argument("--out", default=None, help="write the chosen strategy here (.yaml, .yml or .json)")
    p.add_argument("--png", default=None, help="draw the chosen strategy's map and simulated timeline here")
    p.add_argument("--iterations", type=int, default=3000, help="MCTS iteration budget")
    p.add_argument("--seed", type=int, default=0, help="MCTS seed")
    p.add_argument("--max-tp", type=int, default=None, help="largest TP degree to consider (default: a node)")
    p.add_argument("--seq", type=int, default=None, help="sequence length in tokens (default: the model's)")
    p.add_argument("--max-cp", type=int, default=None,
                   help="largest context-parallel degree to consider (default: by sequence length, "
                        "at least 4096 tokens per CP position; 1: none)")
    p.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    p.add_argument("--calibration", default=None,
                   help="price ops with this host's measured costs (`hspmd calibrate`'s file; an emulated cluster only)")
    p.add_argument("--selective-recompute", action="store_true",
                   help="stages may also recompute only the cheap ops (norms, activations), keeping matmul outputs")
    args = p.parse_args(argv)
    try:
        if args.png and draw is None:
            raise HSPMDError("--png needs a drawing function: run it as `hspmd plan` (hspmd.cli)")
        model = model_named(args.model)
        if args.seq is not None:
            if args.seq < 1:
                raise HSPMDError(f"--seq must be positive, got {args.seq}")
            model = model.with_(seq_len=args.seq)
        cost = plan_cost(parse_cluster(args.cluster), model, args.calibration, calibrated)
        if args.global_batch < 1:
            raise HSPMDError(f"--global-batch must be positive, got {args.global_batch}")
        recompute = False if args.no_recompute else "selective" if args.selective_recompute else True
        problem = cluster_problem(cost, args.global_batch, recompute=recompute, max_tp=args.max_tp, max_cp=args.max_cp)
        names = SEARCH_NAMES if args.search == "all" else (args.search,)
        start = time.perf_counter()
        results = run_searches(problem, names, args.iterations, args.seed)
        baseline = uniform_baseline(problem)
        print(cost.describe())
        simulated = simulated_times(results, baseline, cost)
        print(comparison_table(problem, results, baseline, simulated))
        name, choice = choose(results, baseline, simulated)
        elapsed = time.perf_counter() - start
        if isinstance(choice, PlannedStrategy):
            strategy = choice.strategy
            print(f"chosen: {name} ({elapsed:.1f} s in all; simulated {simulated[name]:.4g} s), "
                  f"schedule {choice.schedule}, warm-up {list(choice.warmup[0])}")
        else:
            strategy = choice
            searched = min(v for k, v in simulated.items() if k != "uniform")  # a search found one: best_result
            print(f"chosen: the uniform split {strategy.name} ({elapsed:.1f} s in all): the simulator rates it "
                  f"{simulated[name]:.4g} s against the searches' best {searched:.4g} s")
        recompute = [i for i, s in enumerate(strategy.pipelines[0].stages) if s.recompute]
        if recompute:
            print(f"recompute activations in stage(s) {recompute} of every pipeline (the strategy says so per stage)")
        print(format_strategy(strategy))
        print(strategy_map_text(strategy, lambda rank: cost.cluster.device_type(rank).name))
        if args.out:
            save_strategy(strategy, args.out)
            print(f"wrote {args.out}")
        if args.png:
            draw(strategy, cost, args.png)
            print(f"wrote {args.png}")
    except HSPMDError as exc:
        print(f"hspmd: error: {error_line(exc)}", file=sys.stderr)
        return 2
    return 0


__all__ = ["Calibrated", "best_result", "choose", "comparison_table", "main", "plan_cost", "run_searches",
           "simulated_times", "uniform_baseline"]
