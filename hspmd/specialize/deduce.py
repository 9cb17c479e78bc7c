"""The deduction pass (paper section 5.2): every tensor's annotation for one strategy.

Per op, in graph order: leaves and CommOps take their (explicit or derived) annotation; every
other op first aligns its inputs' DG unions to the largest HSize (align_hsize) and requires the
unions to be equal, else the user must insert comm(); then the op's rule deduces the DS union and
HDim of its outputs. Shapes are symbolic and were checked when the graph was built.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hspmd.annotations import Annotation, align_hsize
from hspmd.errors import AnnotationError, DeductionError, HSPMDError, HSPMDTypeError
from hspmd.ir.graph import Derived, Graph, Node, Tensor
from hspmd.limits import brief
from hspmd.ops.rules import Mismatch


@dataclass(frozen=True)
class Deduced:
    """Annotations of every tensor of `graph` under `strategy` (indexed by tensor id)."""

    graph: Graph
    strategy: int
    annotations: tuple[Annotation | None, ...]

    def __getitem__(self, tensor: Tensor) -> Annotation:
        return self.annotations[tensor.id]

    def of(self, name: str) -> Annotation:
        return self[self.graph.tensor(name)]

    def devices_of(self, tensor: Tensor) -> frozenset[int]:
        """The devices holding a piece of `tensor`, as a set."""
        return self._device_sets[tensor.id]

    @cached_property
    def _device_sets(self) -> tuple[frozenset[int], ...]:
        """Each tensor's device set. Deduction keeps one object per distinct annotation (equal
        annotations are interned), and each object makes its set once, so tensors with equal
        layouts share one set."""
        return tuple(frozenset() if a is None else a.device_set for a in self.annotations)


def _inputs_text(node: Node, anns) -> str:
    return ", ".join(f"{t.name}: {a}" for t, a in zip(node.inputs, anns))


def _leaf_annotation(node: Node, strategy: int, anns: list, own: Annotation | None) -> Annotation:
    spec = node.annotation
    if isinstance(spec, Derived):
        try:
            return spec.fn(own, tuple(anns[r.id] for r in spec.refs))
        except HSPMDError as exc:
            raise DeductionError(f"{node.kind} {node.name}: cannot derive its annotation ({spec.description}): {exc}") from exc
    if not spec or strategy >= len(spec):
        raise DeductionError(
            f"{node.kind} {node.name} has no annotation for strategy {strategy}; give one when building it "
            f"or with graph.add_strategy(...)"
        )
    return spec[strategy]


def deduce_node(node: Node, strategy: int, anns: list) -> list[Annotation]:
    """The output annotations of one node, given the annotations of everything before it."""
    if node.opdef.is_leaf:
        out = [_leaf_annotation(node, strategy, anns, None)]
    elif node.opdef.is_comm:
        out = [_leaf_annotation(node, strategy, anns, anns[node.inputs[0].id])]
    else:
        ins = [anns[t.id] for t in node.inputs]
        out = _deduce_op(node, strategy, ins)
    for t, a in zip(node.outputs, out):
        if any(a is anns[i.id] and i.ndim == t.ndim for i in node.inputs):
            continue  # an input's annotation passed through unchanged, checked when it was deduced
        try:
            a.check_rank(t.ndim, f"{node.kind} {node.name}")
        except AnnotationError as exc:
            raise DeductionError(str(exc)) from exc
    return out


def _deduce_op(node: Node, strategy: int, ins: list[Annotation]) -> list[Annotation]:
    """A compute op's outputs: its inputs aligned to one union, then its rule. An op that reads
    inputs laid out on differently ordered devices (`OpDef.unaligned`: ring attention's K/V
    chunks) checks its inputs' layouts itself."""
    aligned = ins
    if not node.opdef.unaligned:
        try:
            aligned = align_hsize(ins)
        except AnnotationError as exc:
            raise DeductionError(
                f"{node.kind} {node.name} (strategy {strategy}): inputs {_inputs_text(node, ins)} have different "
                f"HSize and cannot be regrouped ({exc}); insert comm() on an input so their device-group unions match"
            ) from exc
        if not all(a.same_dg_union(aligned[0]) for a in aligned[1:]):
            raise DeductionError(
                f"{node.kind} {node.name} (strategy {strategy}): inputs {_inputs_text(node, ins)} live on different "
                f"device-group unions; insert comm() on an input so they match"
            )
    try:
        return node.opdef.deduce(node, aligned)
    except Mismatch as exc:
        raise DeductionError(
            f"{node.kind} {node.name} (strategy {strategy}): cannot compute locally on inputs "
            f"{_inputs_text(node, ins)}: {exc}; insert comm() on an input to reshard it"
        ) from exc


def check_strategy_index(graph: Graph, strategy: object, where: str = "deduce") -> int:
    """`strategy` if it indexes one of the graph's strategies, else an error naming the valid ones."""
    if isinstance(strategy, bool) or not isinstance(strategy, int):
        raise HSPMDTypeError(f"{where}: a strategy is an index into graph {graph.name}'s strategies, "
                             f"got {brief(strategy)}")
    if not 0 <= strategy < max(graph.num_strategies, 1):
        raise DeductionError(f"{where}: graph {graph.name} has no strategy {strategy}; it has strategies "
                             f"0-{max(graph.num_strategies, 1) - 1}")
    return strategy


def deduce(graph: Graph, strategy: int = 0) -> Deduced:
    """Annotations of every tensor under `strategy` (an explicit index, never a global).

    Equal annotations are kept as one object (interned), so that what is computed from an
    annotation once (its device set, what an op deduces from it, see Annotation.derived) serves
    every tensor with that layout: a model's repeated layers then cost O(1) per op."""
    check_strategy_index(graph, strategy)
    anns: list[Annotation | None] = [None] * len(graph.tensors)
    canonical: dict[Annotation, Annotation] = {}
    seen: dict[int, tuple[Annotation, Annotation]] = {}  # id -> (object, its canonical equal)
    for node in graph.nodes:
        for t, a in zip(node.outputs, deduce_node(node, strategy, anns)):
            if id(a) not in seen:  # memoised results come back as the same object: compare them once
                seen[id(a)] = (a, canonical.setdefault(a, a))
            anns[t.id] = seen[id(a)][1]
    return Deduced(graph, strategy, tuple(anns))


__all__ = ["Deduced", "check_strategy_index", "deduce", "deduce_node"]
