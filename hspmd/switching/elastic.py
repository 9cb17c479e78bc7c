"""Elastic training: layouts and strategies that survive failed devices.

Under a strategy with several pipelines every weight is duplicated across them (HDim D, ZeRO off),
so when a device fails its pieces still live in the other pipelines. `surviving_layout` rewrites a
source annotation without the failed devices (or says which tensor is lost), and
`recover_strategy` derives a strategy for the devices that are left, in the paper's style (Table 7,
C1 -> C2: the stage that lost a GPU is split into smaller power-of-two TP stages, layers shared in
proportion to device count). The new strategy is a heuristic, not an optimum: a cost-model search
would choose the layer and micro-batch split from measured speeds.
"""

from __future__ import annotations

from fractions import Fraction
from math import lcm
from typing import Iterable

from hspmd.annotations import Annotation, split_bounds
from hspmd.errors import HSPMDError, WeightLost
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_build import balanced_layers


def surviving_layout(ann: Annotation, failed: Iterable[int], what: str = "tensor") -> Annotation:
    """`ann` restricted to subgroups without failed devices; they must still hold the whole tensor.

    An annotation cannot describe a subgroup with a hole, so this drops the healthy pieces of a
    damaged subgroup; switches do not use it (plan_switch(failed=...) keeps every surviving piece
    as a source), it serves callers that need a layout of the survivors."""
    failed = set(failed)
    if not failed & set(ann.devices):
        return ann
    alive = tuple(s for s in ann.subgroups if not failed & set(s.dg))
    if ann.hdim != "D" or not alive:
        raise WeightLost(
            f"{what}: every copy of part of it was on failed device(s) {sorted(failed & set(ann.devices))} "
            f"(layout {ann}); only layouts replicated across subgroups (HD unions, ZeRO off) survive a failure; "
            f"restore it from a checkpoint"
        )
    return Annotation(alive, "D")


def _split_power_of_two(ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Consecutive groups whose sizes are the binary digits of len(ranks), largest first: 3 -> 2 + 1."""
    groups, start = [], 0
    for bit in reversed(range(len(ranks).bit_length())):
        size = 1 << bit
        if len(ranks) & size:
            groups.append(ranks[start:start + size])
            start += size
    return groups


def _recover_pipeline(pipeline: Pipeline, failed: set[int], num_layers: int) -> Pipeline | None:
    """The pipeline without `failed`: a stage that lost devices becomes power-of-two TP stages, and
    the layers of the whole pipeline are re-split in proportion to each stage's device count."""
    if not failed & set(pipeline.ranks):
        return pipeline
    groups: list[tuple[int, ...]] = []
    for stage in pipeline.stages:
        left = tuple(r for r in stage.ranks if r not in failed)
        groups.extend([stage.ranks] if len(left) == len(stage.ranks) else _split_power_of_two(left))
    if not groups:
        return None
    layers = balanced_layers(num_layers, [len(g) for g in groups])
    return Pipeline(tuple(Stage(g, r) for g, r in zip(groups, layers)), pipeline.micro_batches,
                    pipeline.micro_batch_size)


def _bottleneck(pipeline: Pipeline) -> Fraction:
    """Layers per device of the slowest stage: a pipeline's time per sample, up to a constant."""
    return max(Fraction(len(s.layers), len(s.ranks)) for s in pipeline.stages)


def _rebalance(pipelines: list[Pipeline], total: int | None) -> list[Pipeline]:
    """Split the global batch across pipelines in proportion to their speed (micro-batches of 1)."""
    if total is None or len(pipelines) == 1:
        return pipelines
    speeds = [1 / _bottleneck(p) for p in pipelines]
    scale = lcm(*(f.denominator for f in speeds))
    weights = [int(f * scale) for f in speeds]
    samples = [b - a for a, b in split_bounds(total, weights)]
    return [Pipeline(p.stages, n, 1) for p, n in zip(pipelines, samples)]


def recover_strategy(strategy: Strategy, failed: Iterable[int]) -> Strategy:
    """A strategy on the devices left after `failed` fail, keeping the global batch; raises if no
    pipeline survives. Approximate: speeds are estimated from layers per device, not measured."""
    failed = set(failed)
    unknown = failed - set(strategy.all_ranks)
    if unknown:
        raise HSPMDError(f"failed device(s) {sorted(unknown)} are not part of strategy {strategy.name or ''}")
    pipelines = [p for p in (_recover_pipeline(p, failed, strategy.num_layers) for p in strategy.pipelines) if p]
    if not pipelines:
        raise HSPMDError(f"no device of strategy {strategy.name or ''} survives the failure of {sorted(failed)}")
    pipelines = _rebalance(pipelines, strategy.global_batch_size)
    return Strategy(tuple(pipelines), strategy.num_layers, strategy.zero, (strategy.name or "strategy") + "-recovered")


__all__ = ["WeightLost", "recover_strategy", "surviving_layout"]
