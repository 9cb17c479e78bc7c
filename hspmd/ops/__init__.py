"""The op library: local compute on torch tensors, a deduction rule and a gradient per op."""

from hspmd.ir.graph import TENSOR_METHODS
from hspmd.ops.autodiff import gradients
from hspmd.ops.elementwise import add, div, exp, mul, sub
from hspmd.ops.linalg import linear, matmul
from hspmd.ops.nn import (
    causal_attention,
    cross_entropy,
    embedding,
    layernorm,
    rmsnorm,
    rotary,
    softmax,
    swiglu,
)
from hspmd.ops.optim import SGD, AdamW, Optimizer, zero_annotation
from hspmd.ops.rules import Mismatch
from hspmd.ops.shape_ops import (
    expand_as, fill_like, group_sum, mean, reduce_sum, repeat_interleave, reshape, transpose, unbroadcast,
)
from hspmd.ops.unary import cast, neg, relu, scale, silu

TENSOR_METHODS.update(
    add=add, sub=sub, mul=mul, div=div, neg=neg, matmul=matmul, sum=reduce_sum, mean=mean, reshape=reshape,
    transpose=transpose,
)

__all__ = [
    "AdamW", "Mismatch", "Optimizer", "SGD", "add", "cast", "causal_attention", "cross_entropy", "div", "embedding",
    "exp",
    "expand_as", "fill_like", "gradients", "group_sum", "layernorm", "linear", "matmul", "mean", "mul", "neg",
    "reduce_sum", "relu", "repeat_interleave", "reshape", "rmsnorm", "rotary", "scale", "silu", "softmax", "sub",
    "swiglu", "transpose", "unbroadcast", "zero_annotation",
]
