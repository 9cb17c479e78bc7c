"""Every op kind by name: what an interpreter of per-device programs (hspmd.specialize.program)
calls, holding only the kind's name and attributes, never the graph node that made it.

A read-only table built once from the op definitions below it; adding an op kind means adding it
here (tests/test_device_programs.py checks that every kind a Llama step uses is listed)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from hspmd.errors import HSPMDError
from hspmd.ir.dsl import COMM, PARAMETER, PLACEHOLDER, STATE
from hspmd.ir.graph import OpDef
from hspmd.ops import context, elementwise, linalg, nn, optim, shape_ops, unary, vocab

_DEFINITIONS: tuple[OpDef, ...] = (
    PLACEHOLDER, PARAMETER, STATE, COMM,
    elementwise.ADD, elementwise.SUB, elementwise.MUL, elementwise.DIV, elementwise.EXP, unary.ADD_SCALAR,
    unary.NEG, unary.SCALE, unary.SILU, unary.SILU_GRAD, unary.RELU, unary.RELU_GRAD, unary.CAST,
    shape_ops.SUM, shape_ops.MEAN, shape_ops.RESHAPE, shape_ops.TRANSPOSE, shape_ops.EXPAND_AS,
    shape_ops.FILL_LIKE, shape_ops.REPEAT_INTERLEAVE, shape_ops.GROUP_SUM,
    linalg.MATMUL, linalg.TOKEN_CONTRACTION,
    nn.EMBEDDING, nn.EMBEDDING_GRAD, nn.CROSS_ENTROPY, nn.CROSS_ENTROPY_GRAD,
    nn.SOFTMAX, nn.RMS_NORMALIZE, nn.LAYER_NORMALIZE, nn.ROTARY, nn.CAUSAL_ATTENTION, nn.PACKED_ROTARY,
    nn.PACKED_ATTENTION, vocab.CLASS_MAX, vocab.CLASS_STATS, vocab.CLASS_STATS_GRAD, vocab.TOKEN_LOSS,
    vocab.TOKEN_LOSS_GRAD, context.ATTENTION_BLOCK, context.ATTENTION_BLOCK_GRAD, context.ATTENTION_MERGE, context.ATTENTION_OUTPUT,
    context.RING_RESULT, context.RING_ATTENTION_GRAD,
    optim.ADAMW_UPDATE, optim.SGD_UPDATE, optim.ASSIGN,
)


def _table(definitions: tuple[OpDef, ...]) -> Mapping[str, OpDef]:
    table: dict[str, OpDef] = {}
    for op in definitions:
        for each in (op, getattr(op, "backward", None)):
            if each is None:
                continue
            if table.setdefault(each.kind, each) is not each:
                raise HSPMDError(f"two op definitions share the kind {each.kind!r}")
    return MappingProxyType(table)


OPERATORS: Mapping[str, OpDef] = _table(_DEFINITIONS)


def operator(kind: str) -> OpDef:
    """The op definition of `kind`; an HSPMDError names the unknown kind."""
    if kind not in OPERATORS:
        raise HSPMDError(f"unknown op kind {kind!r}; known kinds: {', '.join(sorted(OPERATORS))}")
    return OPERATORS[kind]


__all__ = ["OPERATORS", "operator"]
