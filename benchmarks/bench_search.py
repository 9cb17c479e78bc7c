"""Strategy-search benchmark: search seconds on the 48-GPU Table 5 cluster and a 3-type 768-GPU
cluster (goal: under 30 s on 2 cores), each search's predicted iteration time against the
exhaustive optimum (small instances, where it is computable) and the uniform Megatron baseline.

    python benchmarks/bench_search.py [--skip-768] [--repeat 3]

Times are medians of --repeat runs (a search is deterministic, so only its wall time varies).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import table  # noqa: E402

from hspmd.cluster import ClusterSpec, Node  # noqa: E402
from hspmd.cluster.presets import A100_80, H20, H800, NVLINK_H20, NVLINK_H800, ROCE, hetu_h800_h20  # noqa: E402
from hspmd.cluster.spec import LinkClass  # noqa: E402
from hspmd.planning import CostModel, model_named  # noqa: E402
from hspmd.planning.search import GENERAL, PERMUTED, UNIFORM, dfs, dp, exhaustive, mcts  # noqa: E402
from hspmd.planning.search.command import uniform_baseline  # noqa: E402
from hspmd.planning.search.costed import cluster_problem  # noqa: E402
from hspmd.planning.strategy_sim import simulate_strategy  # noqa: E402
from hspmd.specialize.paper_strategies import paper_strategy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from planning_instances import random_problem  # noqa: E402

SEARCHES = {"dp": lambda p: dp(p)[0], "dfs": lambda p: dfs(p)[0],
            # as `hspmd plan` runs it: warm-started from DFS's answer (its time counted here)
            "mcts": lambda p: mcts(p, iterations=3000, warm_start=dfs(p)[0].layout)[0]}


def three_types_768() -> ClusterSpec:
    nvl_a = LinkClass("nvlink-a100", 300e9, 3e-6)
    nodes = (Node("H800", 8),) * 32 + (Node("H20", 8),) * 32 + (Node("A100", 8),) * 32
    return ClusterSpec(nodes, (H800, H20, A100_80), (NVLINK_H800, NVLINK_H20, nvl_a, ROCE),
                       (("H800", NVLINK_H800.name), ("H20", NVLINK_H20.name), ("A100", nvl_a.name)),
                       (("*", ROCE.name),), None, (), "h800-h20-a100:256x3")


def timed(fn, repeat):
    """Median wall and CPU seconds of fn() (CPU time is what a busy shared machine does not inflate)."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), out


def cluster_rows(name, cost, batch, repeat, searches, paper=None):
    problem = cluster_problem(cost, batch)
    base = uniform_baseline(problem)
    rows = []
    for s in searches:
        seconds, cpu, plan = timed(lambda: SEARCHES[s](problem), repeat)
        sim = simulate_strategy(plan.strategy, cost).iteration
        rows.append([name, s, f"{seconds:.2f}", f"{cpu:.2f}", f"{plan.predicted_time:.4g}", f"{sim:.4g}",
                     f"{base[1].time / plan.predicted_time:.2f}x" if base else "-",
                     f"{simulate_strategy(paper, cost).iteration / sim:.2f}x" if paper is not None else "-"])
    return rows


def oracle_rows(seeds):
    rows = []
    for space, search in ((GENERAL, "dp"), (UNIFORM, "dfs"), (PERMUTED, "mcts")):
        ratios = []
        for seed in seeds:
            problem = random_problem(seed)
            best = exhaustive(problem, space)[0].predicted_time
            ratios.append(SEARCHES[search](problem).predicted_time / best)
        rows.append([search, space.name, len(seeds), f"{min(ratios):.4f}", f"{statistics.median(ratios):.4f}", f"{max(ratios):.4f}"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--skip-768", action="store_true")
    args = p.parse_args(argv)
    rows = cluster_rows("hetu-h800-h20 (48)", CostModel(hetu_h800_h20(), model_named("llama-32b-hetu")), 64, args.repeat,
                        ("dfs", "dp", "mcts"), paper_strategy("table5_32b_16h800_32h20"))
    if not args.skip_768:
        rows += cluster_rows("3 types (768)", CostModel(three_types_768(), model_named("h2-100b")), 1536, args.repeat,
                             ("dfs", "dp", "mcts"))
    print(table(["cluster", "search", "search s", "cpu s", "predicted s", "simulated s", "vs uniform", "vs Table 5 (sim)"], rows))
    print()
    print(table(["search", "space", "instances", "min/optimum", "median", "max"], oracle_rows(range(5))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
