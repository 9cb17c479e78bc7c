"""Dynamic graph switching (paper section 6): move every parameter and optimizer state of a graph
from one strategy's layout to another's in ONE fused batched send-receive.

The two strategies are annotations of the same graph, so a switch is pure data: for each leaf,
(src annotation, dst annotation, shape). `plan_switch` turns that into a SwitchPlan (one merged
BSR table, senders balanced over all tensors, one message per device pair); `execute_switch` runs
this rank's part on any Backend. Nothing is recomputed and no weight is lost: every destination
piece is copied from a surviving source piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from hspmd.comm_resolve import FusedPlan, resolve_many
from hspmd.errors import HSPMDError
from hspmd.ir.graph import Graph
from hspmd.backends.backend import Backend
from hspmd.backends.plan_executor import execute_fused_plan
from hspmd.specialize.deduce import deduce
from hspmd.switching.elastic import surviving_layout

LEAF_KINDS = ("parameter", "state")


@dataclass(frozen=True)
class SwitchPlan:
    """A fused plan plus the leaf name of each of its tensors (tensor i is names[i])."""

    src_strategy: int
    dst_strategy: int
    names: tuple[str, ...]
    fused: FusedPlan

    @property
    def devices(self) -> tuple[int, ...]:
        return self.fused.devices

    def explain(self) -> str:
        head = (f"switch strategy {self.src_strategy} -> {self.dst_strategy}: {len(self.names)} tensors, "
                f"{self.fused.messages} fused messages")
        return head + "\n" + self.fused.explain()

    def __str__(self) -> str:
        return self.explain()


def plan_switch(
    graph: Graph,
    src_strategy: int,
    dst_strategy: int,
    *,
    failed: Iterable[int] = (),
    topology=None,
    kinds: tuple[str, ...] = LEAF_KINDS,
) -> SwitchPlan:
    """The fused plan moving every leaf of `kinds` from `src_strategy` to `dst_strategy`.

    `failed` devices are never used as senders (their pieces come from surviving replicas) and
    must not appear in the destination strategy."""
    failed = frozenset(failed)
    src, dst = deduce(graph, src_strategy), deduce(graph, dst_strategy)
    names, moves = [], []
    for node in graph.nodes_of_kind(*kinds):
        t = node.output
        before, after = src[t], dst[t]
        lost = failed & set(after.devices)
        if lost:
            raise HSPMDError(
                f"strategy {dst_strategy} places {node.kind} {node.name} on failed device(s) {sorted(lost)}: "
                f"switch to a strategy without them (see hspmd.switching.recover_strategy)"
            )
        before = surviving_layout(before, failed, f"{node.kind} {node.name}")
        if before == after:
            continue
        shape = tuple(t.shape)
        if not all(isinstance(s, int) for s in shape):
            raise HSPMDError(f"{node.kind} {node.name} has a symbolic shape {shape}; switching needs concrete shapes")
        names.append(node.name)
        moves.append((before, after, shape))
    return SwitchPlan(src_strategy, dst_strategy, tuple(names), resolve_many(moves, topology))


def execute_switch(plan: SwitchPlan, backend: Backend, leaves: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's leaves after the switch: {name: piece} in the destination layout.

    `leaves` holds this rank's source pieces; leaves the plan does not move are kept as they are
    (their layout is unchanged), moved leaves this rank no longer holds are dropped."""
    index = {name: i for i, name in enumerate(plan.names)}
    moved = execute_fused_plan(plan.fused, backend, {index[n]: v for n, v in leaves.items() if n in index})
    kept = {n: v for n, v in leaves.items() if n not in index}
    return kept | {plan.names[i]: v for i, v in moved.items()}


__all__ = ["LEAF_KINDS", "SwitchPlan", "execute_switch", "plan_switch"]
