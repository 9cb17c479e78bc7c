"""Helpers every op module shares: building nodes, scalar arguments, the local-compute context."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import sympy
import torch

from hspmd.annotations import Annotation
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.graph import Node, OpDef, Tensor
from hspmd.ir.shapes import Binding, Shape, format_shape, same_dim
from hspmd.ops.rules import PositionRule, deduce_union

Scalar = int | float | sympy.Expr


class ComputeContext(Protocol):
    """What an op sees of its device when it computes (given by the executor)."""

    device: int
    binding: Binding
    step: int

    def in_box(self, i: int) -> tuple[tuple[int, int], ...]: ...
    def out_box(self, i: int) -> tuple[tuple[int, int], ...]: ...
    def in_shape(self, i: int) -> tuple[int, ...]: ...
    def out_shape(self, i: int) -> tuple[int, ...]: ...
    def in_ann(self, i: int) -> Annotation: ...
    def out_ann(self, i: int) -> Annotation: ...
    def scalar(self, value: Scalar) -> float: ...


class RuleOp(OpDef):
    """An op whose outputs all take the annotation one position rule deduces."""

    def rule(self, node: Node) -> PositionRule:
        raise HSPMDError(f"op kind {self.kind} defines no position rule")

    def deduce(self, node: Node, anns: Sequence[Annotation]) -> list[Annotation]:
        ann = deduce_union(anns, self.rule(node))
        return [ann] * len(node.outputs)


def is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, sympy.Expr)) and not isinstance(value, bool)


def make(opdef: OpDef, inputs: Sequence[Tensor], out_specs: Sequence[tuple[Shape, torch.dtype]],
         attrs: dict | None = None, name: str | None = None) -> Node:
    if not inputs:
        raise HSPMDError(f"{opdef.kind} needs at least one graph tensor input")
    for t in inputs:
        if not isinstance(t, Tensor):
            raise HSPMDError(f"{opdef.kind}: expected graph tensors, got {t!r}")
    return inputs[0].graph.add_node(opdef, inputs, out_specs, name=name, attrs=attrs)


def broadcast_shapes(op: str, shapes: Sequence[Shape]) -> Shape:
    """numpy broadcasting on symbolic shapes; a symbol never broadcasts against another."""
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        dims = [s[i - ndim + len(s)] for s in shapes if i - ndim + len(s) >= 0]
        real = [d for d in dims if d != 1]
        if not real:
            out.append(1)
            continue
        for d in real[1:]:
            if not same_dim(real[0], d):
                raise ShapeError(
                    f"{op}: shapes {', '.join(map(format_shape, shapes))} do not broadcast "
                    f"(dim {i}: {real[0]} vs {d})"
                )
        out.append(real[0])
    return tuple(out)


def normalize_dim(dim: int, ndim: int, op: str) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ShapeError(f"{op}: dim {dim} is out of range for a rank-{ndim} tensor")
    return dim % ndim if ndim else 0


__all__ = ["ComputeContext", "RuleOp", "Scalar", "broadcast_shapes", "is_scalar", "make", "normalize_dim"]
