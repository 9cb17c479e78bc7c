"""Dynamic graph switching (paper section 6): move every parameter and optimizer state of a graph
from one strategy's layout to another's in ONE fused batched send-receive.

The two strategies are annotations of the same graph, so a switch is pure data: for each leaf,
(src annotation, dst annotation, shape). `plan_switch` turns that into a SwitchPlan (one merged
BSR table, senders balanced over all tensors, one message per device pair); `execute_switch` runs
this rank's part on any Backend. Nothing is recomputed and no weight is lost: every destination
piece is copied from a surviving source piece, and after a failure every piece a living device
still holds is a source (a TP group that lost one member still serves the other members' pieces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from hspmd.annotations import parse
from hspmd.comm_resolve import FusedPlan, resolve_many
from hspmd.errors import HSPMDError, WeightLost
from hspmd.limits import device_id_set
from hspmd.ir.graph import Graph
from hspmd.backends.backend import Backend
from hspmd.backends.plan_executor import execute_fused_plan
from hspmd.specialize.deduce import Deduced, check_strategy_index, deduce

LEAF_KINDS = ("parameter", "state")


def checked_failed(failed: object, where: str = "plan_switch") -> frozenset[int]:
    """The failed ranks a switch is told about, as a set of device ids."""
    return device_id_set(failed, f"{where}: failed")


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
    dtypes: Mapping[str, object] | None = None,
    deduced: Iterable[Deduced] = (),
    **choices,
) -> SwitchPlan:
    """The fused plan moving every leaf of `kinds` from `src_strategy` to `dst_strategy`, each in
    its graph dtype or the one `dtypes` names for it (leaves stored in another dtype, e.g. bf16
    weights next to fp32 optimizer states).

    `failed` devices are never used as senders (their pieces come from whatever living devices
    hold them, down to single devices) and must not appear in the destination strategy; WeightLost
    names the leaves whose values only failed devices held. `deduced`: deductions of this graph
    already made (e.g. a trainer's), used instead of deducing those strategies again. `choices`
    (order=, heuristics=) go to resolve_many."""
    src, dst = _deductions(graph, (src_strategy, dst_strategy), deduced)
    leaves = {}
    for node in graph.nodes_of_kind(*kinds):
        t = node.output
        shape = tuple(t.shape)
        if src[t] != dst[t] and not all(isinstance(s, int) for s in shape):
            raise HSPMDError(f"{node.kind} {node.name} has a symbolic shape {shape}; switching needs concrete shapes")
        dtype = (dtypes or {}).get(node.name, t.dtype)
        leaves[f"{node.kind} {node.name}"] = (node.name, src[t], dst[t], shape, dtype)
    return _plan(leaves, src_strategy, dst_strategy, checked_failed(failed), topology, choices)


GRADIENT_PREFIX = "grad:"


def gradient_leaves(gradients: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Synchronised gradient pieces by parameter name, named as plan_switch_with_gradients moves them."""
    return {GRADIENT_PREFIX + name: v for name, v in gradients.items()}


def _deductions(graph: Graph, strategies: Iterable[int], made: Iterable[Deduced]) -> list[Deduced]:
    known = {d.strategy: d for d in made if isinstance(d, Deduced) and d.graph is graph}
    checked = [check_strategy_index(graph, k, "plan_switch") for k in strategies]
    return [known[k] if k in known else deduce(graph, k) for k in checked]


def plan_switch_with_gradients(graph: Graph, src_strategy: int, dst_strategy: int, *, failed: Iterable[int] = (),
                               topology=None, deduced: Iterable[Deduced] = (), **choices) -> SwitchPlan:
    """plan_switch that also moves each parameter's synchronised gradient (graph.gradients, named
    GRADIENT_PREFIX + parameter name) in the same fused plan: a switch in the middle of a step
    whose gradients accumulate across strategies (Hetu-A's length buckets)."""
    src, dst = _deductions(graph, (src_strategy, dst_strategy), deduced)
    leaves = {}
    for node in graph.nodes_of_kind(*LEAF_KINDS):
        t = node.output
        leaves[f"{node.kind} {node.name}"] = (node.name, src[t], dst[t], _concrete(t), t.dtype)
    for name, t in graph.gradients.items():
        leaves[f"gradient {name}"] = (GRADIENT_PREFIX + name, src[t], dst[t], _concrete(t), t.dtype)
    return _plan(leaves, src_strategy, dst_strategy, checked_failed(failed), topology, choices)


def _concrete(t) -> tuple[int, ...]:
    shape = tuple(t.shape)
    if not all(isinstance(s, int) for s in shape):
        raise HSPMDError(f"{t.name} has a symbolic shape {shape}; switching needs concrete shapes")
    return shape


def plan_layout_switch(
    layouts: Mapping[str, tuple],
    *,
    failed: Iterable[int] = (),
    topology=None,
    src_strategy: int = 0,
    dst_strategy: int = 1,
    **choices,
) -> SwitchPlan:
    """plan_switch for leaves given directly as {name: (src annotation, dst annotation, shape[,
    dtype])} (e.g. hspmd.models.llama.llama_annotations of two strategies), without building a
    graph; dtype defaults to float32."""
    leaves = {}
    for name, (a, b, shape, *dtype) in layouts.items():
        leaves[name] = (name, parse(a), parse(b), tuple(shape), dtype[0] if dtype else "float32")
    return _plan(leaves, src_strategy, dst_strategy, checked_failed(failed), topology, choices)


def _plan(leaves, src_strategy: int, dst_strategy: int, failed: frozenset, topology, choices) -> SwitchPlan:
    names, moves = [], []
    for what, (name, before, after, shape, dtype) in leaves.items():
        lost = failed & set(after.devices)
        if lost:
            raise HSPMDError(
                f"strategy {dst_strategy} places {what} on failed device(s) {sorted(lost)}: "
                f"switch to a strategy without them (see hspmd.switching.recover_strategy)"
            )
        if before == after:
            continue
        names.append(name)
        moves.append((before, after, shape, dtype))
    try:
        fused = resolve_many(moves, topology, failed=failed, **choices)
    except WeightLost as exc:
        lost = {names[i]: boxes for i, boxes in exc.lost.items()}
        raise WeightLost(
            f"switching strategy {src_strategy} -> {dst_strategy} after device(s) {sorted(failed)} failed: "
            f"only they held parts of {', '.join(lost)}; only values replicated on living devices survive "
            f"(HD unions, ZeRO off); restore them from a checkpoint", lost,
        ) from None
    return SwitchPlan(src_strategy, dst_strategy, tuple(names), fused)


def execute_switch(plan: SwitchPlan, backend: Backend, leaves: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's leaves after the switch: {name: piece} in the destination layout.

    `leaves` holds this rank's source pieces; leaves the plan does not move are kept as they are
    (their layout is unchanged), moved leaves this rank no longer holds are dropped."""
    index = {name: i for i, name in enumerate(plan.names)}
    moved = execute_fused_plan(plan.fused, backend, {index[n]: v for n, v in leaves.items() if n in index})
    kept = {n: v for n, v in leaves.items() if n not in index}
    return kept | {plan.names[i]: v for i, v in moved.items()}


__all__ = [
    "GRADIENT_PREFIX", "LEAF_KINDS", "SwitchPlan", "checked_failed", "execute_switch", "gradient_leaves", "plan_layout_switch",
    "plan_switch", "plan_switch_with_gradients",
]
