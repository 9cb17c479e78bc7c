"""Generators of Llama strategies: the homogeneous DPxTPxPP grid and pipelines whose layers are
split across stages in proportion to stage weights (e.g. their compute), by the one splitting rule
of hspmd.annotations.geometry.split_bounds."""

from __future__ import annotations

from typing import Sequence

from hspmd.annotations import split_bounds
from hspmd.errors import StrategyError
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_fields import StrategyFieldError, field_context, is_int, parse_index_list


def balanced_layers(num_layers: int, weights: Sequence[int]) -> tuple[range, ...]:
    """Contiguous layer ranges, stage k getting a share of `num_layers` proportional to weights[k]."""
    if not is_int(num_layers) or num_layers < 1:
        raise StrategyError(f"num_layers must be a positive integer, got {num_layers!r}")
    if not weights or any(not is_int(w) or w < 1 for w in weights):
        raise StrategyError(f"stage weights must be positive integers, got {list(weights)!r}")
    ranges = tuple(range(a, b) for a, b in split_bounds(num_layers, list(weights)))
    empty = [k for k, r in enumerate(ranges) if len(r) == 0]
    if empty:
        raise StrategyError(
            f"{num_layers} layers split by weights {list(weights)} leave stage(s) {empty} without a layer; "
            f"use fewer stages or less uneven weights"
        )
    return ranges


def weighted_pipeline(
    num_layers: int,
    stage_ranks: Sequence[Sequence[int] | str],
    micro_batches: int | None,
    micro_batch_size: int | None,
    weights: Sequence[int] | None = None,
) -> Pipeline:
    """A pipeline over the given TP groups ('0-3' or rank lists), layers split by `weights`
    (default: each stage's TP degree, i.e. layers proportional to device count)."""
    groups = []
    for j, ranks in enumerate(stage_ranks):
        with field_context("stages", j, "ranks"):
            groups.append(parse_index_list(ranks) if isinstance(ranks, str) else tuple(ranks))
    weights = [len(g) for g in groups] if weights is None else list(weights)
    if len(weights) != len(groups):
        raise StrategyFieldError(("weights",), f"{len(weights)} weights given for {len(groups)} stages; give one per stage")
    layers = balanced_layers(num_layers, weights)
    return Pipeline(tuple(Stage(g, r) for g, r in zip(groups, layers)), micro_batches, micro_batch_size)


def uniform_strategy(
    num_layers: int,
    *,
    dp: int,
    tp: int,
    pp: int,
    micro_batches: int | None,
    micro_batch_size: int | None = 1,
    first_rank: int = 0,
    zero: bool = False,
    name: str = "",
) -> Strategy:
    """Megatron-style DPxTPxPP: `dp` identical pipelines of `pp` TP-`tp` stages over consecutive
    ranks (pipeline-major, then stage), layers split as evenly as possible."""
    for label, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not is_int(value) or value < 1:
            raise StrategyError(f"{label} must be a positive integer, got {value!r}")
    pipelines = []
    for i in range(dp):
        base = first_rank + i * pp * tp
        groups = [tuple(range(base + s * tp, base + (s + 1) * tp)) for s in range(pp)]
        with field_context("pipelines", i):
            pipelines.append(weighted_pipeline(num_layers, groups, micro_batches, micro_batch_size, [1] * pp))
    return Strategy(tuple(pipelines), num_layers, zero, name)
