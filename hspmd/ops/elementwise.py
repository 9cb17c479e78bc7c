"""Elementwise and broadcasting arithmetic: pass-through deduction with broadcasting, Partial
allowed exactly where the op is linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hspmd.ir.graph import Node, Tensor
from hspmd.ops.base import RuleOp, Scalar, broadcast_shapes, is_scalar, make
from hspmd.ops.rules import elementwise_rule


class Binary(RuleOp):
    def __init__(self, kind: str, fn, partial: str, linear_inputs=()):
        self.kind, self.fn, self.partial, self.linear_inputs = kind, fn, partial, linear_inputs

    def rule(self, node: Node):
        return elementwise_rule([t.shape for t in node.inputs], node.output.shape, self.partial, self.linear_inputs)

    def compute(self, node, ctx, inputs):
        return [self.fn(*inputs)]

    def gradient(self, node, grads):
        (g,) = grads
        x, y = node.inputs
        if self.kind == "add":
            gx, gy = g, g
        elif self.kind == "sub":
            gx, gy = g, neg(g)
        elif self.kind == "mul" and x.id == y.id:
            # d(x*x) = 2*g*x as one contribution, not two products summed after the fact
            return [unbroadcast(scale(mul(g, x), 2), x.shape), None]
        elif self.kind == "mul":
            gx, gy = mul(g, y), mul(g, x)
        else:
            gx = div(g, y)
            gy = neg(div(mul(g, node.output), y))
        return [unbroadcast(gx, x.shape), unbroadcast(gy, y.shape)]


ADD = Binary("add", torch.add, "all")
SUB = Binary("sub", torch.sub, "all")
MUL = Binary("mul", torch.mul, "one", (0, 1))
DIV = Binary("div", torch.div, "one", (0,))


def _binary(opdef: Binary, x: Tensor, y: Tensor) -> Tensor:
    shape = broadcast_shapes(opdef.kind, [x.shape, y.shape])
    return make(opdef, [x, y], [(shape, x.dtype)]).output


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


def _unary(opdef: Unary, x: Tensor, **attrs) -> Tensor:
    return make(opdef, [x], [(x.shape, x.dtype)], attrs=attrs).output


NEG = Unary("neg", lambda x, a, c: -x, True, lambda n, g: neg(g))
SCALE = Unary("scale", lambda x, a, c: x * c.scalar(a["factor"]), True, lambda n, g: scale(g, n.attrs["factor"]))
ADD_SCALAR = Unary("add_scalar", lambda x, a, c: x + c.scalar(a["value"]), False, lambda n, g: g)
SILU = Unary("silu", lambda x, a, c: F.silu(x), False, lambda n, g: silu_grad(n.inputs[0], g))
RELU = Unary("relu", lambda x, a, c: torch.relu(x), False, lambda n, g: relu_grad(n.inputs[0], g))
EXP = Unary("exp", lambda x, a, c: torch.exp(x), False, lambda n, g: mul(g, n.output))


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


def add(x, y):
    if is_scalar(y):
        return _unary(ADD_SCALAR, x, value=y)
    if is_scalar(x):
        return _unary(ADD_SCALAR, y, value=x)
    return _binary(ADD, x, y)


def sub(x, y):
    if is_scalar(y):
        return _unary(ADD_SCALAR, x, value=-y)
    if is_scalar(x):
        return _unary(ADD_SCALAR, neg(y), value=x)
    return _binary(SUB, x, y)


def mul(x, y):
    if is_scalar(y):
        return scale(x, y)
    if is_scalar(x):
        return scale(y, x)
    return _binary(MUL, x, y)


def div(x, y):
    if is_scalar(y):
        return scale(x, 1 / y if isinstance(y, (int, float)) else y ** -1)
    return _binary(DIV, x, y)


def neg(x: Tensor) -> Tensor:
    return _unary(NEG, x)


def scale(x: Tensor, factor: Scalar) -> Tensor:
    """x * factor, where factor may hold run-time symbols (1 / tokens per step)."""
    return _unary(SCALE, x, factor=factor)


def silu(x: Tensor) -> Tensor:
    return _unary(SILU, x)


def silu_grad(x: Tensor, g: Tensor) -> Tensor:
    return make(SILU_GRAD, [x, g], [(x.shape, x.dtype)]).output


def relu(x: Tensor) -> Tensor:
    return _unary(RELU, x)


def relu_grad(x: Tensor, g: Tensor) -> Tensor:
    return make(RELU_GRAD, [x, g], [(x.shape, x.dtype)]).output


def exp(x: Tensor) -> Tensor:
    return _unary(EXP, x)


def unbroadcast(g: Tensor | None, shape) -> Tensor | None:
    """Sum a broadcast gradient back to an input's shape."""
    from hspmd.ops.shape_ops import reduce_sum, reshape

    if g is None or tuple(g.shape) == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    dims = list(range(lead)) + [lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1]
    out = reduce_sum(g, dims, keepdim=True)
    return reshape(out, shape) if out.ndim != len(shape) else out


__all__ = ["add", "div", "exp", "mul", "neg", "relu", "scale", "silu", "silu_grad", "sub", "unbroadcast"]
