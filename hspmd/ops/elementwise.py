"""Broadcasting arithmetic (add, sub, mul, div) and exp: pass-through deduction with broadcasting,
Partial allowed exactly where the op is linear; a broadcast input's gradient is summed back by
`unbroadcast` (shape_ops)."""

from __future__ import annotations

import torch

from hspmd.ir.graph import Node, Tensor
from hspmd.ops.base import RuleOp, broadcast_shapes, is_scalar, make
from hspmd.ops.rules import elementwise_rule
from hspmd.ops.shape_ops import unbroadcast
from hspmd.ops.unary import ADD_SCALAR, Unary, apply_unary, neg, scale


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


EXP = Unary("exp", lambda x, a, c: torch.exp(x), False, lambda n, g: mul(g, n.output))


def add(x, y):
    if is_scalar(y):
        return apply_unary(ADD_SCALAR, x, value=y)
    if is_scalar(x):
        return apply_unary(ADD_SCALAR, y, value=x)
    return _binary(ADD, x, y)


def sub(x, y):
    if is_scalar(y):
        return apply_unary(ADD_SCALAR, x, value=-y)
    if is_scalar(x):
        return apply_unary(ADD_SCALAR, neg(y), value=x)
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


def exp(x: Tensor) -> Tensor:
    return apply_unary(EXP, x)


__all__ = ["add", "div", "exp", "mul", "sub"]
