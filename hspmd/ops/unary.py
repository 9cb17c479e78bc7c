"""Pointwise ops of one tensor (same shape in and out): neg, scale, add_scalar, silu, relu, the
one-kernel gradients of silu and relu, and cast (dtype conversion, for mixed precision). Below shape_ops and the broadcasting
arithmetic, which use them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hspmd.errors import ShapeError
from hspmd.ir.graph import Node, Tensor
from hspmd.ops.base import RuleOp, Scalar, make
from hspmd.ops.rules import elementwise_rule


class Unary(RuleOp):
    """f(x) elementwise; `linear` ops keep Partial; `fn(x, attrs, ctx)`."""

    def __init__(self, kind: str, fn, linear: bool, grad=None):
        self.kind, self.fn, self.linear, self.grad = kind, fn, linear, grad

    def rule(self, node: Node):
        return elementwise_rule([node.inputs[0].shape], node.output.shape, "all" if self.linear else "none")

    def compute(self, node, ctx, inputs):
        return [self.fn(inputs[0], node.attrs, ctx)]

    def gradient(self, node, grads):
        (g,) = grads
        return [self.grad(node, g)]

    def describe(self, node):
        return ", ".join(f"{k}={v}" for k, v in node.attrs.items())


def apply_unary(opdef: Unary, x: Tensor, **attrs) -> Tensor:
    return make(opdef, [x], [(x.shape, x.dtype)], attrs=attrs).output


NEG = Unary("neg", lambda x, a, c: -x, True, lambda n, g: neg(g))
SCALE = Unary("scale", lambda x, a, c: x * c.scalar(a["factor"]), True, lambda n, g: scale(g, n.attrs["factor"]))
ADD_SCALAR = Unary("add_scalar", lambda x, a, c: x + c.scalar(a["value"]), False, lambda n, g: g)
SILU = Unary("silu", lambda x, a, c: F.silu(x), False, lambda n, g: silu_grad(n.inputs[0], g))
RELU = Unary("relu", lambda x, a, c: torch.relu(x), False, lambda n, g: relu_grad(n.inputs[0], g))


class SiluGrad(RuleOp):
    """g * silu'(x): linear in g only."""

    kind = "silu_grad"

    def rule(self, node):
        return elementwise_rule([t.shape for t in node.inputs], node.output.shape, "one", (1,))

    def compute(self, node, ctx, inputs):
        x, g = inputs
        s = torch.sigmoid(x)
        return [g * s * (1 + x * (1 - s))]


SILU_GRAD = SiluGrad()


class ReluGrad(RuleOp):
    """g where x > 0, else 0, in one kernel: linear in g only."""

    kind = "relu_grad"

    def rule(self, node):
        return elementwise_rule([t.shape for t in node.inputs], node.output.shape, "one", (1,))

    def compute(self, node, ctx, inputs):
        x, g = inputs
        return [torch.ops.aten.threshold_backward(g, x, 0)]


RELU_GRAD = ReluGrad()


def neg(x: Tensor) -> Tensor:
    return apply_unary(NEG, x)


def scale(x: Tensor, factor: Scalar) -> Tensor:
    """x * factor, where factor may hold run-time symbols (1 / tokens per step)."""
    return apply_unary(SCALE, x, factor=factor)


def silu(x: Tensor) -> Tensor:
    return apply_unary(SILU, x)


def silu_grad(x: Tensor, g: Tensor) -> Tensor:
    return make(SILU_GRAD, [x, g], [(x.shape, x.dtype)]).output


def relu(x: Tensor) -> Tensor:
    return apply_unary(RELU, x)


def relu_grad(x: Tensor, g: Tensor) -> Tensor:
    return make(RELU_GRAD, [x, g], [(x.shape, x.dtype)]).output


FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# A cast rounds each value alone, so it keeps every layout; on Partial summands it rounds each summand
# rather than the sum (the same rounding a mixed-precision reduction does).
CAST = Unary("cast", lambda x, a, c: x.to(FLOAT_DTYPES[a["dtype"]]), True,
             lambda n, g: cast(g, n.inputs[0].dtype))


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x converted to the floating dtype `dtype`; its gradient is converted back to x's dtype
    (so fp32 master weights cast to bf16 for compute receive fp32 gradients)."""
    names = {v: k for k, v in FLOAT_DTYPES.items()}
    if dtype not in names or x.dtype not in names:
        raise ShapeError(f"cast: {x.name} is {x.dtype}; only float dtypes convert ({', '.join(FLOAT_DTYPES)}), "
                         f"asked for {dtype}")
    if dtype == x.dtype:
        return x
    return make(CAST, [x], [(x.shape, dtype)], attrs={"dtype": names[dtype]}).output


__all__ = ["cast", "neg", "relu", "relu_grad", "scale", "silu", "silu_grad"]
