"""Reductions and layout ops: sum / mean (a split reduced dim becomes Partial), reshape / view
(splits follow the leading dim of each merged or split group), transpose, expand, fill_like,
repeat_interleave / group_sum (grouped-query attention's K/V heads shared by groups of Q heads)."""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import sympy
import torch

from hspmd.annotations import Duplicate, Partial, Split
from hspmd.errors import ShapeError
from hspmd.ir.graph import Node, Tensor
from hspmd.ir.shapes import Shape, as_shape, format_shape, numel, same_dim
from hspmd.ops.base import RuleOp, make, normalize_dim
from hspmd.ops.rules import Mismatch
from hspmd.ops.unary import scale


def _dims(dims, ndim: int, op: str) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({normalize_dim(d, ndim, op) for d in dims}))


class Reduce(RuleOp):
    """sum / mean over `dims`; mean divides by the global count, so it stays exact when split."""

    def __init__(self, kind: str):
        self.kind = kind

    def rule(self, node: Node):
        dims, keep = node.attrs["dims"], node.attrs["keepdim"]

        def rule(axes):
            (a,) = axes
            if isinstance(a, Split):
                if a.dim in dims:
                    return Partial(a.n), None
                return Split(a.dim if keep else a.dim - sum(1 for d in dims if d < a.dim), a.n), 0
            return a, None

        return rule

    def compute(self, node, ctx, inputs):
        (x,) = inputs
        dims, keep = node.attrs["dims"], node.attrs["keepdim"]
        out = x.sum(dim=dims, keepdim=keep) if dims else x.clone()
        if self.kind == "mean":
            full = ctx.in_shape(0)
            count = 1
            for d in dims:
                count *= full[d]
            out = out / max(count, 1)
        return [out]

    def gradient(self, node, grads):
        (g,) = grads
        x = node.inputs[0]
        dims, keep = node.attrs["dims"], node.attrs["keepdim"]
        if not keep:
            kept = tuple(1 if i in dims else d for i, d in enumerate(x.shape))
            g = reshape(g, kept)
        g = expand_as(g, x)
        if self.kind == "mean":
            count = numel(tuple(x.shape[d] for d in dims))
            g = scale(g, 1 / count if isinstance(count, int) else sympy.Integer(1) / count)
        return [g]

    def describe(self, node):
        return f"dims={list(node.attrs['dims'])}{', keepdim' if node.attrs['keepdim'] else ''}"


SUM, MEAN = Reduce("sum"), Reduce("mean")


def _reduce(opdef, x: Tensor, dims, keepdim: bool) -> Tensor:
    dims = _dims(dims, x.ndim, opdef.kind)
    shape = tuple(1 if i in dims else d for i, d in enumerate(x.shape)) if keepdim else \
        tuple(d for i, d in enumerate(x.shape) if i not in dims)
    return make(opdef, [x], [(shape, x.dtype)], attrs={"dims": dims, "keepdim": keepdim}).output


def reduce_sum(x: Tensor, dims=None, keepdim: bool = False) -> Tensor:
    return _reduce(SUM, x, dims, keepdim)


def mean(x: Tensor, dims=None, keepdim: bool = False) -> Tensor:
    return _reduce(MEAN, x, dims, keepdim)


@lru_cache(maxsize=4096)
def _quotient(a, b):
    return sympy.cancel(a / b)


@lru_cache(maxsize=4096)
def _ratio(a, b) -> tuple:
    num, den = sympy.fraction(sympy.cancel(sympy.sympify(b) / sympy.sympify(a)))
    return num, den


def reshape_groups(src: Shape, dst: Shape, op: str = "reshape") -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal size (size-1 dims stand alone)."""
    if not same_dim(numel(src), numel(dst)):
        raise ShapeError(f"{op}: cannot view {format_shape(src)} ({numel(src)} elements) as {format_shape(dst)} ({numel(dst)})")
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj = [i], [j]
        pa, pb = src[i], dst[j]
        i, j = i + 1, j + 1
        while not same_dim(pa, pb):
            num, den = _ratio(pa, pb)
            if den == 1 and i < len(src):
                pa, i = pa * src[i], i + 1
                gi.append(i - 1)
            elif num == 1 and j < len(dst):
                pb, j = pb * dst[j], j + 1
                gj.append(j - 1)
            else:
                raise ShapeError(f"{op}: cannot match dims of {format_shape(src)} with {format_shape(dst)}")
        groups.append((gi, gj))
    return groups


class Reshape(RuleOp):
    kind = "reshape"

    def rule(self, node: Node):
        lead = {g[0][0]: g[1][0] for g in node.attrs["groups"] if g[0] and g[1]}

        def rule(axes):
            (a,) = axes
            if isinstance(a, Split):
                if a.dim not in lead:
                    raise Mismatch(
                        f"dim {a.dim} is split but is not the leading dim of its reshape group; "
                        f"only the outermost dim of a merged or split run may be split"
                    )
                return Split(lead[a.dim], a.n), 0
            return a, None

        return rule

    def compute(self, node, ctx, inputs):
        (x,) = inputs
        box = ctx.out_box(0)
        local = tuple(b - a for a, b in box)
        if x.numel() != torch.Size(local).numel():
            raise ShapeError(
                f"reshape {node.name}: this device's piece {tuple(x.shape)} cannot become {local}: the split "
                f"does not divide the merged dims evenly at this binding; choose sizes divisible by the split count"
            )
        return [x.reshape(local)]

    def gradient(self, node, grads):
        return [reshape(grads[0], node.inputs[0].shape)]

    def describe(self, node):
        return "to " + format_shape(node.output.shape)


RESHAPE = Reshape()


def reshape(x: Tensor, shape: Sequence[object]) -> Tensor:
    shape = list(shape)
    if sum(1 for d in shape if isinstance(d, int) and d == -1) == 1:
        known = numel(tuple(d for d in shape if not (isinstance(d, int) and d == -1)))
        shape[shape.index(-1)] = _quotient(sympy.sympify(numel(x.shape)), sympy.sympify(known))
    shape = as_shape(shape, f"reshape of {x.name}")
    if tuple(shape) == tuple(x.shape):
        return x
    groups = reshape_groups(x.shape, shape)
    return make(RESHAPE, [x], [(shape, x.dtype)], attrs={"groups": groups}).output


class Transpose(RuleOp):
    kind = "transpose"

    def rule(self, node: Node):
        a0, b0 = node.attrs["dims"]

        def rule(axes):
            (a,) = axes
            if isinstance(a, Split) and a.dim in (a0, b0):
                return Split(b0 if a.dim == a0 else a0, a.n), 0
            return a, (0 if isinstance(a, Split) else None)

        return rule

    def compute(self, node, ctx, inputs):
        # A view: matmul reads transposed operands directly, and every consumer accepts strides.
        return [inputs[0].transpose(*node.attrs["dims"])]

    def gradient(self, node, grads):
        return [transpose(grads[0], *node.attrs["dims"])]

    def describe(self, node):
        return f"dims={node.attrs['dims']}"


TRANSPOSE = Transpose()


def transpose(x: Tensor, a: int, b: int) -> Tensor:
    a, b = normalize_dim(a, x.ndim, "transpose"), normalize_dim(b, x.ndim, "transpose")
    shape = list(x.shape)
    shape[a], shape[b] = shape[b], shape[a]
    return make(TRANSPOSE, [x], [(tuple(shape), x.dtype)], attrs={"dims": (a, b)}).output


class ExpandAs(RuleOp):
    """Broadcast the size-1 dims of g (same rank) to the shape of `like`, laid out as `like`'s
    gradient: where `like` is split along a broadcast dim, each device makes only its piece."""

    kind = "expand_as"

    def rule(self, node: Node):
        grown = {i for i, d in enumerate(node.inputs[0].shape) if d == 1 and node.output.shape[i] != 1}

        def rule(axes):
            ga, la = axes
            if isinstance(la, Split):
                if la.dim in grown:
                    if not isinstance(ga, Duplicate):
                        raise Mismatch(f"the gradient is {ga} where the expanded dim {la.dim} is split")
                    return Split(la.dim, la.n), 1
                if isinstance(ga, Split) and ga.dim == la.dim:
                    return Split(ga.dim, ga.n), 0
                raise Mismatch(f"the gradient is {ga} where dim {la.dim} is split")
            if isinstance(ga, Split):
                raise Mismatch(f"the gradient is split along dim {ga.dim} where the target is whole")
            return ga, None

        return rule

    def compute(self, node, ctx, inputs):
        box = ctx.out_box(0)
        # A broadcast view (stride 0): consumers compute out of place, so nothing writes through it.
        return [inputs[0].expand(tuple(b - a for a, b in box))]

    def gradient(self, node, grads):
        return [unbroadcast(grads[0], node.inputs[0].shape), None]


EXPAND_AS = ExpandAs()


def expand_as(g: Tensor, like: Tensor) -> Tensor:
    """g (size-1 or missing leading dims) broadcast to like's shape and gradient layout."""
    if tuple(g.shape) == tuple(like.shape):
        return g
    if g.ndim != like.ndim:
        g = reshape(g, (1,) * (like.ndim - g.ndim) + tuple(g.shape))
    return make(EXPAND_AS, [g, like], [(like.shape, g.dtype)]).output


class FillLike(RuleOp):
    """A constant with x's shape, laid out as x's gradient would be (Partial read as Duplicate):
    the seed of autodiff."""

    kind = "fill_like"

    def rule(self, node):
        def rule(axes):
            (a,) = axes
            if isinstance(a, Partial):
                return Duplicate(a.n), None
            return a, (0 if isinstance(a, Split) else None)

        return rule

    def compute(self, node, ctx, inputs):
        box = ctx.out_box(0)
        return [torch.full(tuple(b - a for a, b in box), float(node.attrs["value"]), dtype=inputs[0].dtype,
                           device=inputs[0].device)]


FILL_LIKE = FillLike()


def fill_like(x: Tensor, value: float = 1.0) -> Tensor:
    return make(FILL_LIKE, [x], [(x.shape, x.dtype)], attrs={"value": value}).output


def unbroadcast(g: Tensor | None, shape) -> Tensor | None:
    """Sum a broadcast gradient back to an input's shape."""
    if g is None or tuple(g.shape) == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    dims = list(range(lead)) + [lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1]
    out = reduce_sum(g, dims, keepdim=True)
    return reshape(out, shape) if out.ndim != len(shape) else out


class Regroup(RuleOp):
    """repeat_interleave (each slice along `dim` repeated `repeats` times in place) and its
    adjoint group_sum (each run of `repeats` slices summed). Both are linear and keep every layout:
    a split of `dim` into whole groups maps piece i to piece i (K/V head j serves Q heads
    j*r..j*r+r-1), which compute checks against the boxes the executor gives."""

    def __init__(self, kind: str):
        self.kind = kind

    def rule(self, node: Node):
        dim, repeats = node.attrs["dim"], node.attrs["repeats"]
        groups = node.inputs[0].shape[dim] if self.kind == "repeat_interleave" else node.output.shape[dim]

        def rule(axes):
            (a,) = axes
            if isinstance(a, Split) and a.dim == dim and isinstance(groups, int) and groups % a.n:
                raise Mismatch(f"dim {dim} has {groups} groups of {repeats}, which do not split {a.n} ways")
            return a, (0 if isinstance(a, Split) else None)

        return rule

    def compute(self, node, ctx, inputs):
        (x,) = inputs
        dim, r = node.attrs["dim"], node.attrs["repeats"]
        (i0, i1), (o0, o1) = ctx.in_box(0)[dim], ctx.out_box(0)[dim]
        up = self.kind == "repeat_interleave"
        if ((i0 * r, i1 * r) if up else (i0, i1)) != ((o0, o1) if up else (o0 * r, o1 * r)):
            raise ShapeError(f"{self.kind} {node.name}: this device holds [{i0}, {i1}) of dim {dim} in and "
                             f"[{o0}, {o1}) out, which are not the same groups of {r}")
        if up:
            return [x.repeat_interleave(r, dim=dim)]
        return [x.unflatten(dim, (x.shape[dim] // r, r)).sum(dim + 1)]

    def gradient(self, node, grads):
        other = group_sum if self.kind == "repeat_interleave" else repeat_interleave
        return [other(grads[0], node.attrs["repeats"], node.attrs["dim"])]

    def describe(self, node):
        return f"dim={node.attrs['dim']}, repeats={node.attrs['repeats']}"


REPEAT_INTERLEAVE, GROUP_SUM = Regroup("repeat_interleave"), Regroup("group_sum")


def repeat_interleave(x: Tensor, repeats: int, dim: int) -> Tensor:
    """Each slice of x along `dim` repeated `repeats` times in a row (torch.repeat_interleave)."""
    dim = normalize_dim(dim, x.ndim, "repeat_interleave")
    if not isinstance(repeats, int) or repeats < 1:
        raise ShapeError(f"repeat_interleave: repeats must be a positive integer, got {repeats!r}")
    if repeats == 1:
        return x
    shape = list(x.shape)
    shape[dim] = shape[dim] * repeats
    return make(REPEAT_INTERLEAVE, [x], [(tuple(shape), x.dtype)], attrs={"dim": dim, "repeats": repeats}).output


def group_sum(x: Tensor, repeats: int, dim: int) -> Tensor:
    """Sum of each run of `repeats` consecutive slices along `dim` (the adjoint of repeat_interleave)."""
    dim = normalize_dim(dim, x.ndim, "group_sum")
    if not isinstance(repeats, int) or repeats < 1:
        raise ShapeError(f"group_sum: repeats must be a positive integer, got {repeats!r}")
    if repeats == 1:
        return x
    size = x.shape[dim]
    if isinstance(size, int) and size % repeats:
        raise ShapeError(f"group_sum: dim {dim} of {x.name} has size {size}, not a multiple of {repeats}")
    shape = list(x.shape)
    shape[dim] = size // repeats if isinstance(size, int) else size / repeats
    return make(GROUP_SUM, [x], [(tuple(shape), x.dtype)], attrs={"dim": dim, "repeats": repeats}).output


__all__ = [
    "expand_as", "fill_like", "group_sum", "mean", "reduce_sum", "repeat_interleave", "reshape", "reshape_groups",
    "transpose", "unbroadcast",
]
