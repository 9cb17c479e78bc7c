"""The paper's strategy pools for mixed-length training (003 Tables 10-12) as dispatch pools.

Each pool lists strategies with the upper bound of the step's longest sequence they serve
(PAPER_POOLS, transcribed in hspmd.specialize.paper_strategies); what a pipeline costs comes from
a caller's function (calibrated on this machine, or derived from the cost model)."""

from __future__ import annotations

from typing import Callable, Sequence

from hspmd.planning.dispatch import PipelineCost, PoolEntry
from hspmd.specialize.paper_strategies import PAPER_POOLS, paper_strategy
from hspmd.specialize.strategy import Strategy, closest_hint
from hspmd.errors import StrategyError

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


__all__ = ["PipelineCosts", "bound_only", "paper_pool", "paper_pool_strategies"]
