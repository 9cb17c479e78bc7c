"""Elastic training: layouts and strategies that survive failed devices.

Under a strategy with several pipelines every weight is duplicated across them (HDim D, ZeRO off),
so when a device fails its pieces still live in the other pipelines. `surviving_layout` rewrites a
source annotation without the failed devices (or says which tensor is lost), and
`recover_strategy` derives a strategy for the devices that are left with the cost-model re-planner
(hspmd.planning.replan; Table 7 C1 -> C2 and Table 8 C5 -> C6 come out as in the paper).
"""

from __future__ import annotations

from typing import Iterable

from hspmd.annotations import Annotation
from hspmd.cluster import ClusterSpec, uniform
from hspmd.errors import HSPMDError, WeightLost
from hspmd.planning.model import ModelSpec
from hspmd.planning.replan import replan
from hspmd.planning.search.space import TableEvaluator
from hspmd.specialize.strategy import Strategy


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


def recover_strategy(strategy: Strategy, failed: Iterable[int], cluster: ClusterSpec | None = None,
                     model: ModelSpec | None = None, **options) -> Strategy:
    """A strategy on the devices left after `failed` fail, keeping the global batch
    (hspmd.planning.replan: damaged pipelines re-planned by HAPT's DP, the batch split by
    throughput, ties broken by least data moved); raises if no device survives. Without a
    cluster and model, every device is taken as equal and a layer's time as 1/TP (no TP degree
    above the strategy's largest): the paper's C1 -> C2 then comes out exactly."""
    failed = set(failed)
    unknown = failed - set(strategy.all_ranks)
    if unknown:
        raise HSPMDError(f"failed device(s) {sorted(unknown)} are not part of strategy {strategy.name or ''}")
    if not set(strategy.all_ranks) - failed:
        raise HSPMDError(f"no device of strategy {strategy.name or ''} survives the failure of {sorted(failed)}")
    if cluster is None:
        largest = max(s.tp for p in strategy.pipelines for s in p.stages)
        cluster = uniform(1, max(strategy.all_ranks) + 1)
        kind = cluster.device_types[0].name
        options.setdefault("evaluator", TableEvaluator({(kind, 1 << k): 1.0 / (1 << k) for k in range(largest.bit_length())},
                                                       {kind: float("inf")}))
        options.setdefault("max_tp", largest)
    batch = strategy.global_batch_size or options.pop("global_batch", None)
    plan = replan(strategy, cluster, model, failed, global_batch=batch, **options)
    return Strategy(plan.strategy.pipelines, strategy.num_layers, strategy.zero, (strategy.name or "strategy") + "-recovered")


__all__ = ["WeightLost", "recover_strategy", "surviving_layout"]
