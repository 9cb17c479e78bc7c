"""Specialization time of a Llama-32B-shaped graph (60 layers, hidden 5120, 40 heads, FFN 27648,
vocab 152064) under the paper's Table 5 strategy (16 H800 + 32 H20 = 48 devices, four 3-stage
pipelines, ZeRO-1), and per-rank time at 1,024 ranks (64 pipelines of 4 TP4 stages, ZeRO-1).

Phases: deduction (once per strategy, shared by every rank), then per rank: instantiation
(pruning + CommOp substitution, resolving the plans of the rank's CommOps) and pipeline
discovery (resolving every per-micro-batch CommOp of the graph). "cold" = a rank that resolves
everything itself; "warm" = later ranks of one process that share the plan cache.
The paper reports graph specialization within 10 s (dominated by operator instantiation)."""

from __future__ import annotations

import time

from hspmd.ir import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.specialize.deduce import deduce
from hspmd.specialize.executable import instantiate, live_nodes
from hspmd.specialize.paper_strategies import paper_strategy
from hspmd.specialize.pipelines import discover_pipelines, expected_pipelines
from hspmd.specialize.specialized import all_devices, per_micro_batch_pattern
from hspmd.specialize.strategy_build import uniform_strategy

LLAMA_32B = LlamaConfig(vocab=152064, hidden=5120, layers=60, heads=40, ffn=27648)


def _clock(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench(strategy, label: str, ranks_to_time) -> None:
    model, t_build = _clock(lambda: build_llama(LLAMA_32B, [strategy]))
    deduced, t_deduce = _clock(lambda: deduce(model.graph, 0))
    ratios = strategy.micro_batch_ratios
    binding = Binding.of({"B": sum(ratios), "S": 4096, "T": 4096 * strategy.global_batch_size}, ratios=ratios)
    live = live_nodes(model.graph)
    devices = all_devices(deduced)
    plans: dict = {}

    def discover():
        groups, edges = per_micro_batch_pattern(deduced, binding, live, None, plans)
        return discover_pipelines(groups, edges, devices)

    (cold_exe, t_cold_inst) = _clock(lambda: instantiate(deduced, ranks_to_time[0], binding, live=live, plans=plans))
    pipelines, t_discover = _clock(discover)
    assert [p.stages for p in pipelines] == [p.stages for p in expected_pipelines(strategy)]
    warm = []
    for r in ranks_to_time[1:]:
        _, t = _clock(lambda: instantiate(deduced, r, binding, live=live, plans=plans))
        warm.append(t)
    print(f"\n{label}: {len(model.graph.nodes)} ops, {len(devices)} devices, {len(pipelines)} pipelines")
    print(f"  build graph (not part of specialization)     {t_build:8.3f} s")
    print(f"  deduction (once per strategy)                {t_deduce:8.3f} s")
    print(f"  rank {ranks_to_time[0]}: instantiation + resolution (cold)   {t_cold_inst:8.3f} s")
    print(f"  pipeline discovery (all per-micro-batch comms) {t_discover:6.3f} s")
    print(f"  one rank, cold: deduction + instantiation + discovery = {t_deduce + t_cold_inst + t_discover:.3f} s")
    if warm:
        print(f"  {len(warm)} more ranks, warm plan cache: total {sum(warm):.3f} s, mean {sum(warm) / len(warm):.4f} s/rank")
        total = t_deduce + t_cold_inst + t_discover + sum(warm)
        print(f"  all {len(ranks_to_time)} ranks in one process: {total:.3f} s")
    print(f"  ops kept on rank {ranks_to_time[0]}: {len(cold_exe.instructions())} of {len(model.graph.nodes)}")


def main() -> int:
    table5 = paper_strategy("table5_32b_16h800_32h20")
    bench(table5, "Llama-32B, Table 5 (16 H800 + 32 H20)", list(range(48)))
    big = uniform_strategy(60, dp=64, tp=4, pp=4, micro_batches=4, micro_batch_size=1, zero=True, name="1024")
    bench(big, "Llama-32B, 1,024 ranks (DP64 x TP4 x PP4)", [0, 517, 1023])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
