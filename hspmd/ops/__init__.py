"""The op library: local compute on torch tensors, a deduction rule and a gradient per op."""

from types import MappingProxyType

from hspmd.ir.graph import Graph as _BaseGraph
from hspmd.ops.autodiff import gradients
from hspmd.ops.context import context_attention
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
from hspmd.ops.vocab import vocab_parallel_cross_entropy

# What tensor operator methods call (x + y, x @ w, x.sum(...)): a read-only table each Graph holds.
TENSOR_OPERATORS = MappingProxyType(dict(
    add=add, sub=sub, mul=mul, div=div, neg=neg, matmul=matmul, sum=reduce_sum, mean=mean, reshape=reshape,
    transpose=transpose,
))


class Graph(_BaseGraph):
    """A graph whose tensors have the standard operator methods (TENSOR_OPERATORS): the one to
    build models with (hspmd.Graph)."""

    def __init__(self, name: str = "graph"):
        super().__init__(name, TENSOR_OPERATORS)


__all__ = [
    "AdamW", "Graph", "Mismatch", "TENSOR_OPERATORS", "Optimizer", "SGD", "add", "cast", "causal_attention", "context_attention",
    "cross_entropy", "div", "embedding",
    "exp",
    "expand_as", "fill_like", "gradients", "group_sum", "layernorm", "linear", "matmul", "mean", "mul", "neg",
    "reduce_sum", "relu", "repeat_interleave", "reshape", "rmsnorm", "rotary", "scale", "silu", "softmax", "sub",
    "swiglu", "transpose", "unbroadcast", "vocab_parallel_cross_entropy", "zero_annotation",
]
