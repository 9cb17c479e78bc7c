"""The paper's strategy pools for mixed-length training (Hetu v2 Tables 10-12) as dispatch pools.

Each pool lists strategies with the upper bound of the step's longest sequence they serve
(PAPER_POOLS, transcribed in hspmd.specialize.paper_strategies); what a pipeline costs comes from
a caller's function (calibrated on this machine, or derived from the cost model)."""

from __future__ import annotations

from typing import Callable, Sequence

from hspmd.errors import HSPMDError, StrategyError, closest_hint
from hspmd.planning.cost import StageShape
from hspmd.planning.dispatch import PipelineCost, PoolEntry, fit_sequence_cost
from hspmd.specialize.paper_strategies import PAPER_POOLS, paper_strategy
from hspmd.specialize.strategy import Strategy

PipelineCosts = Callable[[Strategy, int], Sequence[PipelineCost]]


def bound_only(strategy: Strategy, max_seq_len: int) -> tuple[PipelineCost, ...]:
    """Costs that know nothing but the interval: every pipeline holds max_seq_len tokens and a
    sequence costs its token count (enough to test the selection rule, not to dispatch well)."""
    return tuple(PipelineCost(0.0, 1.0, 0.0, max_seq_len, len(p.stages)) for p in strategy.pipelines)


def paper_pool(pool: str, costs: PipelineCosts = bound_only) -> tuple[PoolEntry, ...]:
    """One PoolEntry per strategy of paper pool `pool` ('table11', 'table12', 'table10_32k',
    'table10_16k'); entry.strategy is the strategy's position in the pool (its graph index when
    the graph is built with paper_pool_strategies(pool))."""
    if pool not in PAPER_POOLS:
        raise StrategyError(f"no paper pool {pool!r}; {closest_hint(pool, list(PAPER_POOLS))}")
    entries = []
    for i, (key, bound) in enumerate(PAPER_POOLS[pool]):
        strategy = paper_strategy(key)
        entries.append(PoolEntry(key, i, bound, tuple(costs(strategy, bound))))
    return tuple(entries)


def paper_pool_strategies(pool: str) -> list[Strategy]:
    if pool not in PAPER_POOLS:
        raise StrategyError(f"no paper pool {pool!r}; {closest_hint(pool, list(PAPER_POOLS))}")
    return [paper_strategy(key) for key, _ in PAPER_POOLS[pool]]


def model_costs(cost_model, device: str, lengths=(1024, 2048, 4096, 8192, 16384, 32768), step: int = 512,
                micro_batch_constant: float = 0.0, zero: bool = True, recompute: bool = True) -> PipelineCosts:
    """Pipeline costs priced by a CostModel (hspmd.planning.cost): per pipeline, a s^2 + b s fitted
    to its bottleneck stage's forward + backward time (with its TP all-reduces) at `lengths`, and
    the token limit the largest multiple of `step` whose activations (1F1B: stage j keeps
    stages - j micro-batches) fit every stage's device memory. An L0 estimate, not the simulator.
    zero: optimizer states sharded over the pipelines (ZeRO-1); Tables 11/12 do not say, but without
    it a TP4 pipeline of the 32B model does not fit a 96 GB H20 at all."""

    def costs(strategy: Strategy, bound: int) -> tuple[PipelineCost, ...]:
        out = []
        capacity = cost_model.device(device).hbm_capacity
        for pipeline in strategy.pipelines:
            n = len(pipeline.stages)
            shapes = [StageShape(len(st.layers), st.tp, j == 0, j == n - 1, strategy.num_pipelines, zero, recompute)
                      for j, st in enumerate(pipeline.stages)]

            def seconds(s):
                return max(sum(cost_model.stage_time(device, shape, 1, s, st.ranks))
                           for shape, st in zip(shapes, pipeline.stages))

            def fits(s):
                return all(cost_model.memory(shape, n - j, 1, s).total <= capacity for j, shape in enumerate(shapes))

            a, b = fit_sequence_cost(list(lengths), [seconds(s) for s in lengths])
            limit = 0
            while fits(limit + step) and limit < 4 * max(lengths):
                limit += step
            if limit == 0:
                raise HSPMDError(f"{strategy.name}: pipeline {pipeline} cannot hold {step} tokens in {device} memory")
            out.append(PipelineCost(a, b, micro_batch_constant, limit, n))
        return tuple(out)

    return costs


__all__ = ["PipelineCosts", "bound_only", "model_costs", "paper_pool", "paper_pool_strategies"]
