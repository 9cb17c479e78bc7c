"""matmul / linear: x[..., M, K] @ w[K, N] (or batched with equal batch dims).

Deduction (paper figure 11): a split of M or the batch dims carries to the output, a split of N
carries to the output's last dim, a split of K in both inputs makes the output Partial; a batched
w's batch dim must be split in both inputs alike; HDim is
the same rule on the top tier (x's HDim 0 with a duplicated weight keeps HDim 0)."""

from __future__ import annotations

import torch

from hspmd.annotations import Duplicate, Partial, Split
from hspmd.errors import ShapeError
from hspmd.ir.graph import Node, Tensor
from hspmd.ir.shapes import format_shape, same_dim
from hspmd.ops.base import RuleOp, make
from hspmd.ops.elementwise import add
from hspmd.ops.rules import Mismatch
from hspmd.ops.shape_ops import transpose


class MatMul(RuleOp):
    kind = "matmul"

    def rule(self, node: Node):
        x, w = node.inputs
        nd = node.output.ndim

        def role(i: int, dim: int):
            """('K', None) for the contracted dim, else ('out', output dim)."""
            t = node.inputs[i]
            if i == 0:
                if dim == t.ndim - 1:
                    return "K", None
                return "out", dim + nd - t.ndim
            if dim == t.ndim - 2:
                return "K", None
            if dim == t.ndim - 1:
                return "out", nd - 1
            return "out", dim + nd - t.ndim

        def rule(axes):
            xa, wa = axes
            n = xa.n
            xr = role(0, xa.dim) if isinstance(xa, Split) else None
            wr = role(1, wa.dim) if isinstance(wa, Split) else None
            if xr and xr[0] == "K" or wr and wr[0] == "K":
                if xr == ("K", None) and wr == ("K", None):
                    return Partial(n), None
                raise Mismatch("the contracted dim K is split in one input but not in the other")
            if xr and wr:
                if xr[1] == wr[1]:
                    return Split(xr[1], n), 0
                raise Mismatch(f"x is split along output dim {xr[1]} and w along output dim {wr[1]} at one axis")
            if xr or wr:
                if w.ndim > 2 and (xr or wr)[1] < nd - 2:
                    raise Mismatch(f"batch dim {(xr or wr)[1]} is split in one input but not in the other "
                                   "(a batched matmul pairs each input's batch pieces)")
                other = wa if xr else xa
                if isinstance(other, Partial):
                    raise Mismatch("one input holds pieces where the other holds partial summands")
                return Split((xr or wr)[1], n), 0 if xr else 1
            if isinstance(xa, Partial) and isinstance(wa, Partial):
                raise Mismatch("both inputs are partial at one axis (a product of sums is not a sum of products)")
            if isinstance(xa, Partial) or isinstance(wa, Partial):
                return Partial(n), None
            return Duplicate(n), None

        return rule

    def compute(self, node, ctx, inputs):
        x, w = inputs
        return [torch.matmul(x, w)]

    def compute_into(self, node, ctx, inputs, out):
        x, w = inputs
        if x.dim() != 2 or w.dim() != 2 or tuple(out.shape) != (x.shape[0], w.shape[1]) or out.dtype != x.dtype:
            return False
        torch.matmul(x, w, out=out)
        return True

    def gradient(self, node, grads):
        (g,) = grads
        x, w = node.inputs
        gx = matmul(g, transpose(w, -1, -2))
        if w.ndim == 2 and x.ndim > 2:
            gw = make(TOKEN_CONTRACTION, [x, g], [(w.shape, g.dtype)]).output
        else:
            gw = matmul(transpose(x, -1, -2), g)
        return [gx, gw]


class TokenContraction(RuleOp):
    """A 2-D weight's gradient: x[..., K]^T g[..., N] summed over every leading (token) dim, one
    GEMM. Any leading dim may be split (batch across pipelines, sequence across CP groups) when
    both inputs split it alike: each device then holds a partial sum. A split of K or N carries to
    the output's dim 0 or 1. (Flattening the tokens first, as a reshape, would need the split dim
    to lead the merged run, which a sequence split does not.)"""

    kind = "token_contraction"

    def rule(self, node: Node):
        last = node.inputs[0].ndim - 1

        def rule(axes):
            xa, ga = axes
            n = xa.n
            xs = isinstance(xa, Split)
            gs = isinstance(ga, Split)
            if xs and xa.dim < last or gs and ga.dim < last:
                if xs and gs and xa.dim == ga.dim:
                    return Partial(n), None
                raise Mismatch("a token dim is split in one input but not alike in the other")
            if isinstance(xa, Partial) and isinstance(ga, Partial):
                raise Mismatch("both inputs are partial at one axis (a product of sums is not a sum of products)")
            if xs and gs:
                raise Mismatch("x is split along K and the gradient along N at one axis")
            if xs or gs:
                if isinstance(xa, Partial) or isinstance(ga, Partial):
                    raise Mismatch("one input holds pieces where the other holds partial summands")
                return (Split(0, n), 0) if xs else (Split(1, n), 1)
            if isinstance(xa, Partial) or isinstance(ga, Partial):
                return Partial(n), None
            return Duplicate(n), None

        return rule

    def compute(self, node, ctx, inputs):
        x, g = inputs
        return [torch.matmul(x.reshape(-1, x.shape[-1]).transpose(0, 1), g.reshape(-1, g.shape[-1]))]

    def compute_into(self, node, ctx, inputs, out):
        x, g = inputs
        if out.dtype != g.dtype or out.dtype != x.dtype:
            return False
        torch.matmul(x.reshape(-1, x.shape[-1]).transpose(0, 1), g.reshape(-1, g.shape[-1]), out=out)
        return True


MATMUL, TOKEN_CONTRACTION = MatMul(), TokenContraction()


def matmul(x: Tensor, w: Tensor) -> Tensor:
    if x.ndim < 2 or w.ndim < 2:
        raise ShapeError(f"matmul {x.name} @ {w.name}: both inputs need rank >= 2, got {x.ndim} and {w.ndim}")
    if w.ndim != 2 and w.ndim != x.ndim:
        raise ShapeError(
            f"matmul {x.name} @ {w.name}: w must be 2-D or have x's rank, got {format_shape(w.shape)}"
        )
    if not same_dim(x.shape[-1], w.shape[-2]):
        raise ShapeError(
            f"matmul {x.name} {format_shape(x.shape)} @ {w.name} {format_shape(w.shape)}: "
            f"contracted dims {x.shape[-1]} and {w.shape[-2]} differ"
        )
    if w.ndim > 2:
        for a, b in zip(x.shape[:-2], w.shape[:-2]):
            if not same_dim(a, b):
                raise ShapeError(f"matmul {x.name} @ {w.name}: batch dims {format_shape(x.shape[:-2])} and "
                                 f"{format_shape(w.shape[:-2])} differ")
    shape = tuple(x.shape[:-1]) + (w.shape[-1],)
    return make(MATMUL, [x, w], [(shape, x.dtype)]).output


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ w (+ bias), with w stored [in_features, out_features]."""
    y = matmul(x, w)
    if bias is not None:
        y = add(y, bias)
    return y


__all__ = ["linear", "matmul"]
