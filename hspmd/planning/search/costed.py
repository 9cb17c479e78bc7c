"""The searches on a real cluster and model: an `Evaluator` over the shared `CostModel`, and the
search `Problem` of a ClusterSpec (device pools by type, in memory-descending order).

Approximations (the planner's view, not the simulator's): a stage's TP all-reduces are priced on
the type's first node; an activation transfer between two stages of one type is priced between
two of its nodes when it has several (stages that share a node pay less in reality); the gradient
sync is a ring all-reduce of the average per-device parameter share over d members spread over the
nodes round-robin (one per node while there are as many nodes), each with its CP partners beside
it in its node, plus the AdamW update of that share on the slowest type. A CP stage is priced on
the type's first cp x tp devices (its CP groups in a row), an activation transfer between stages
whole (each CP device sends only its share: an upper bound for CP stages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Mapping

from hspmd.cluster import ClusterSpec
from hspmd.planning.cost import CostModel, StageShape
from hspmd.planning.ranks import DevicePool
from hspmd.planning.search.space import PlanningError, Problem


@dataclass(frozen=True)
class CostModelEvaluator:
    """Stage times, memory and link costs of `cost` for micro-batches of `mbs` samples."""

    cost: CostModel
    mbs: int = 1
    zero: bool = False
    usable: float = 1.0
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def cluster(self) -> ClusterSpec:
        return self.cost.cluster

    def _tp_group(self, device_type: str, tp: int) -> tuple[int, ...]:
        devices = self.cluster.devices_of_type(device_type)
        return devices[:tp]

    def _layer(self, device_type: str, tp: int, recompute: bool) -> float:
        key = ("layer", device_type, tp, recompute)
        if key not in self._memo:
            f, b = self.cost.layer_time(device_type, tp, self.mbs, None, recompute, self._tp_group(device_type, tp))
            self._memo[key] = f + b
        return self._memo[key]

    def _ends(self, device_type: str, tp: int, first: bool, last: bool) -> float:
        key = ("ends", device_type, tp, first, last)
        if key not in self._memo:
            extra = 0.0
            if first:
                extra += sum(self.cost.embedding_time(device_type, tp, self.mbs))
            if last:
                extra += sum(self.cost.head_time(device_type, tp, self.mbs))
            self._memo[key] = extra
        return self._memo[key]

    def _context_layer(self, device_type: str, tp: int, cp: int, recompute: bool) -> float:
        """One layer of a CP stage: its share of the tokens, its TP all-reduces and its K/V traffic."""
        key = ("context layer", device_type, tp, cp, recompute)
        if key not in self._memo:
            devices = self.cluster.devices_of_type(device_type)[:tp * cp]
            groups = [devices[i * tp:(i + 1) * tp] for i in range(cp)]
            shape = StageShape(1, tp, recompute=recompute, cp=cp)
            self._memo[key] = sum(self.cost.stage_time(device_type, shape, self.mbs, None, groups[0], groups))
        return self._memo[key]

    def _context_ends(self, device_type: str, tp: int, cp: int, first: bool, last: bool) -> float:
        key = ("context ends", device_type, tp, cp, first, last)
        if key not in self._memo:
            tokens = self.cost.model.seq_len / cp
            extra = 0.0
            if first:
                extra += sum(self.cost.embedding_time(device_type, tp, self.mbs, tokens))
            if last:
                extra += sum(self.cost.head_time(device_type, tp, self.mbs, tokens))
            self._memo[key] = extra
        return self._memo[key]

    def stage_time(self, device_type, tp, layers, recompute, first, last, cp=1):
        if cp > 1:
            return (layers * self._context_layer(device_type, tp, cp, recompute)
                    + self._context_ends(device_type, tp, cp, first, last))
        return layers * self._layer(device_type, tp, recompute) + self._ends(device_type, tp, first, last)

    def stage_memory(self, device_type, tp, layers, recompute, first, last, inflight, dp, cp=1):
        key = ("memory", tp, layers, recompute, first, last, inflight, dp, cp)
        if key not in self._memo:
            shape = StageShape(layers, tp, first, last, dp, self.zero, recompute, cp=cp)
            self._memo[key] = self.cost.memory(shape, inflight, self.mbs).total
        return self._memo[key]

    def capacity(self, device_type):
        return self.usable * self.cluster.type_named(device_type).hbm_capacity

    def link_time(self, src_type, dst_type):
        key = ("link", src_type, dst_type)
        if key not in self._memo:
            model = self.cost.model
            nbytes = self.mbs * model.seq_len * model.hidden * model.itemsize
            a = self.cluster.devices_of_type(src_type)
            b = self.cluster.devices_of_type(dst_type)
            elsewhere = [d for d in b if self.cluster.node_of(d) != self.cluster.node_of(a[0])]
            other = elsewhere or [d for d in b if d != a[0]] or [a[0]]  # one node: two of its devices
            self._memo[key] = self.cost.p2p(nbytes, (a[0], other[0]))
        return self._memo[key]

    def sync_time(self, dp, pipeline_devices: Mapping[str, int], cp=1):
        if dp * cp == 1:
            return 0.0
        key = ("sync", dp, cp, tuple(sorted(pipeline_devices.items())))
        if key not in self._memo:
            self._memo[key] = self._sync_time(dp, pipeline_devices, cp)
        return self._memo[key]

    def _sync_time(self, dp, pipeline_devices: Mapping[str, int], cp: int):
        model = self.cost.model
        share = model.parameters() / sum(pipeline_devices.values())
        by_node: dict[int, list[int]] = {}
        for d in range(self.cluster.n_devices):
            by_node.setdefault(self.cluster.node_of(d), []).append(d)
        spread = [d for column in zip_longest(*by_node.values()) for d in column if d is not None]
        members = spread[:dp]
        if cp > 1:  # each replica's CP partners are the devices after it in its node
            partners = []
            for m in members:
                node = by_node[self.cluster.node_of(m)]
                partners += [node[(node.index(m) + j) % len(node)] for j in range(cp)]
            members = list(dict.fromkeys(partners))
        allreduce = self.cost.collective("all_reduce", share * model.itemsize, members)
        update = max(self.cost.update_time(t, share) for t in pipeline_devices) if dp > 1 else 0.0
        return allreduce + update


def cluster_pools(cluster: ClusterSpec, failed=()) -> tuple[DevicePool, ...]:
    """One pool per device type (its devices grouped by node, `failed` left out), ordered by
    memory descending then name (H2 Obs. 4: the memory-richer type runs the first stages)."""
    failed = set(failed)
    pools = []
    for t in sorted(cluster.device_types, key=lambda t: (-t.hbm_capacity, t.name)):
        nodes: dict[int, list[int]] = {}
        for d in cluster.devices_of_type(t.name):
            if d not in failed:
                nodes.setdefault(cluster.node_of(d), []).append(d)
        if nodes:
            pools.append(DevicePool(t.name, tuple(tuple(n) for _, n in sorted(nodes.items()))))
    if not pools:
        raise PlanningError(f"no device of cluster {cluster.describe()} is left to plan on")
    return tuple(pools)


# A CP degree is offered to the searches only while each CP position keeps at least this many
# tokens: below it the K/V blocks are too small for the attention to pay for their transfer (HetAuto
# §7.7 finds CP chosen at 32K tokens and not at 8K), and the searches' space stays small.
MIN_CP_TOKENS = 4096


def context_degrees(seq_len: int, node_size: int, max_cp: int | None = None) -> tuple[int, ...]:
    """The CP degrees to search for a sequence of `seq_len` tokens: powers of two within a node
    that leave each CP position at least MIN_CP_TOKENS tokens, or, with `max_cp`, every power of
    two up to it (within a node) whatever the length."""
    if max_cp is not None and (isinstance(max_cp, bool) or not isinstance(max_cp, int) or max_cp < 1):
        raise PlanningError(f"max_cp must be a positive integer, got {max_cp!r}")
    limit = min(node_size, max_cp) if max_cp is not None else min(node_size, max(1, seq_len // MIN_CP_TOKENS))
    return tuple(1 << k for k in range(int(math.log2(limit)) + 1))


def cluster_problem(cost: CostModel, global_batch: int, failed=(), recompute: bool | str = True, max_tp: int | None = None,
                    evaluator=None, max_cp: int | None = None) -> Problem:
    """The search problem of planning `cost.model` on `cost.cluster` for `global_batch` samples;
    CP degrees by `context_degrees` (`max_cp` 1: none)."""
    pools = cluster_pools(cost.cluster, failed)
    degrees, contexts = {}, {}
    for p in pools:
        limit = min(p.node_size, max_tp or p.node_size)
        degrees[p.device_type] = tuple(1 << k for k in range(limit.bit_length()) if (1 << k) <= limit)
        contexts[p.device_type] = context_degrees(cost.model.seq_len, p.node_size, max_cp)
    return Problem(pools, cost.model.layers, global_batch, evaluator or CostModelEvaluator(cost), degrees, recompute,
                   contexts)


__all__ = ["CostModelEvaluator", "MIN_CP_TOKENS", "cluster_pools", "cluster_problem", "context_degrees"]
