"""The one rank-assignment rule of every search: pipeline-major, one cursor per device type, and a
tensor-parallel group never crossing a node.

A search decides, per pipeline, a chain of stages (device type, TP degree); ranks come from here.
Each device type's ranks are handed out in order (its "cursor") as the stages are visited pipeline
by pipeline, stage by stage. A TP group of at most a node's size lies inside one node; a larger one
takes whole nodes. When the cursor's next ranks would straddle a node, the group takes the first
free block inside a node instead (first fit), so cursors stay deterministic.

This reproduces the rank lists of the Hetu v2 tables (5, 7, 8, 11): e.g. Table 5 with H800 ranks
0-15 and H20 ranks 16-31: `R16-19 | R20-23 | R0-3 | R4-7 ; R24-27 | R28-31 | R8-11 | R12-15`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from hspmd.errors import HSPMDError


class RankAssignmentError(HSPMDError):
    """The stages asked for more devices of a type than there are, or for a TP group no node fits."""


@dataclass(frozen=True)
class DevicePool:
    """The ranks of one device type, grouped by node (each node's ranks in order)."""

    device_type: str
    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        nodes = tuple(tuple(int(r) for r in n) for n in self.nodes)
        if not nodes or any(not n for n in nodes):
            raise RankAssignmentError(f"device pool {self.device_type!r} needs at least one non-empty node, got {self.nodes!r}")
        flat = [r for n in nodes for r in n]
        if len(set(flat)) != len(flat):
            raise RankAssignmentError(f"device pool {self.device_type!r} lists a rank twice: {flat}")
        object.__setattr__(self, "nodes", nodes)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for n in self.nodes for r in n)

    @property
    def size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def node_size(self) -> int:
        return max(len(n) for n in self.nodes)

    @classmethod
    def contiguous(cls, device_type: str, first: int, count: int, per_node: int, failed: Sequence[int] = ()) -> "DevicePool":
        """`count` ranks from `first` in nodes of `per_node`, without `failed` ranks."""
        nodes = []
        for start in range(first, first + count, per_node):
            node = tuple(r for r in range(start, min(start + per_node, first + count)) if r not in set(failed))
            if node:
                nodes.append(node)
        return cls(device_type, tuple(nodes))


def _take(pool: DevicePool, free: list[bool], tp: int) -> tuple[int, ...]:
    """The next `tp` free ranks of `pool` at the cursor (the first free one), kept inside a node."""
    ranks = pool.ranks
    node_of = [i for i, n in enumerate(pool.nodes) for _ in n]
    if tp > pool.node_size:
        # Whole nodes: the first run of completely free nodes adding up to tp devices.
        start = 0
        while start < len(pool.nodes):
            got, k = [], start
            while k < len(pool.nodes) and len(got) < tp:
                members = [i for i, nk in enumerate(node_of) if nk == k]
                if not all(free[i] for i in members):
                    break
                got.extend(members)
                k += 1
            if len(got) == tp:
                for i in got:
                    free[i] = False
                return tuple(ranks[i] for i in got)
            start += 1
        raise RankAssignmentError(
            f"no {tp // pool.node_size} free whole node(s) of {pool.device_type} left for a TP-{tp} group"
        )
    candidates = [i for i, f in enumerate(free) if f]
    if len(candidates) < tp:
        raise RankAssignmentError(
            f"the stages need more {pool.device_type} devices than the {pool.size} there are (TP-{tp} group left without devices)"
        )
    cursor = candidates[:tp]
    if len({node_of[i] for i in cursor}) == 1:
        chosen = cursor
    else:
        chosen = None
        for k, _node in enumerate(pool.nodes):
            idx = [i for i, nk in enumerate(node_of) if nk == k and free[i]]
            if len(idx) >= tp:
                chosen = idx[:tp]
                break
        if chosen is None:
            raise RankAssignmentError(
                f"no node of {pool.device_type} has {tp} free devices left for a TP-{tp} group "
                f"(a tensor-parallel group never crosses a node)"
            )
    for i in chosen:
        free[i] = False
    return tuple(ranks[i] for i in chosen)


def assign_ranks(
    layout: Sequence[Sequence[tuple[str, int]]], pools: Mapping[str, DevicePool] | Sequence[DevicePool]
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Ranks for every stage of `layout` (per pipeline, per stage: (device type, TP degree))."""
    if not isinstance(pools, Mapping):
        pools = {p.device_type: p for p in pools}
    free = {name: [True] * pool.size for name, pool in pools.items()}
    out = []
    for i, pipeline in enumerate(layout):
        stages = []
        for j, (device_type, tp) in enumerate(pipeline):
            if device_type not in pools:
                raise RankAssignmentError(
                    f"pipeline {i} stage {j} asks for device type {device_type!r}; the cluster has {', '.join(pools)}"
                )
            if not isinstance(tp, int) or tp < 1:
                raise RankAssignmentError(f"pipeline {i} stage {j}: TP degree must be a positive integer, got {tp!r}")
            stages.append(_take(pools[device_type], free[device_type], tp))
        out.append(tuple(stages))
    return tuple(out)


__all__ = ["DevicePool", "RankAssignmentError", "assign_ranks"]
