"""Reverse-mode autodiff that builds the backward graph in the IR (phase "backward").

Every op's gradient is built from IR ops, so backward tensors get their annotations from the
same deduction pass as the forward. Where a tensor feeds several consumers, its gradient
contributions may come back in different layouts (one Partial from a tensor-parallel branch, one
whole from the residual path); each contribution then passes a CommOp whose target is derived at
deduction time: unchanged when all contributions agree, else the tensor's gradient layout (its
annotation with Partial read as Duplicate, except that summands per subgroup of a tensor replicated
over its subgroups stay summands: `ir.dsl.summand_gradient_annotation`), which the resolver lowers
to e.g. an AllReduce.
"""

from __future__ import annotations

from typing import Sequence

from hspmd.annotations import Annotation
from hspmd.errors import HSPMDError
from hspmd.ir.dsl import comm, summand_gradient_annotation
from hspmd.ir.graph import Derived, Graph, Tensor
from hspmd.ops.elementwise import add
from hspmd.ops.shape_ops import fill_like


def _aligned_target(own: Annotation | None, refs: tuple[Annotation, ...]) -> Annotation:
    forward, contributions = refs[0], refs[1:]
    if all(c == contributions[0] for c in contributions):
        return own
    return summand_gradient_annotation(forward, contributions)


def _accumulate(x: Tensor, contributions: list[Tensor]) -> Tensor:
    if len(contributions) == 1:
        return contributions[0]
    rule = Derived((x,) + tuple(contributions), _aligned_target, f"gradient layout of {x.name} if contributions differ")
    aligned = [comm(c, rule, name=x.graph.unique_name(f"{x.node.name}.align")) for c in contributions]
    total = aligned[0]
    for c in aligned[1:]:
        total = add(total, c)
    return total


def _requires_grad(graph: Graph, wrt: Sequence[Tensor]) -> set[int]:
    needed = {t.id for t in wrt}
    for node in graph.nodes:
        if any(t.id in needed for t in node.inputs):
            needed.update(t.id for t in node.outputs if t.dtype.is_floating_point)
    return needed


def gradients(loss: Tensor, wrt: Sequence[Tensor]) -> list[Tensor | None]:
    """d loss / d t for each t in `wrt` as graph tensors (None if the loss does not depend on t)."""
    graph = loss.graph
    if loss.ndim != 0:
        raise HSPMDError(f"gradients: the loss {loss.name} must be a scalar, got shape {loss.shape}")
    needed = _requires_grad(graph, wrt)
    if loss.id not in needed:
        raise HSPMDError(f"gradients: loss {loss.name} does not depend on any of {[t.name for t in wrt]}")
    pending: dict[int, list[Tensor]] = {}
    done: dict[int, Tensor] = {}
    last = loss.node.id
    with graph.phase("backward"), graph.scope("grad"):
        pending[loss.id] = [fill_like(loss, 1.0)]
        for node in reversed(graph.nodes[: last + 1]):
            if not any(t.id in pending for t in node.outputs):
                continue
            out_grads = []
            for t in node.outputs:
                out_grads.append(_accumulate(t, pending.pop(t.id)) if t.id in pending else None)
                if out_grads[-1] is not None:
                    done[t.id] = out_grads[-1]
            if node.opdef.is_leaf:
                continue
            in_grads = node.opdef.gradient(node, out_grads)
            for t, g in zip(node.inputs, in_grads):
                if g is not None and t.id in needed:
                    pending.setdefault(t.id, []).append(g)
    return [done.get(t.id) for t in wrt]


__all__ = ["gradients"]
