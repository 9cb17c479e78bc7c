"""A small Llama written once in the DSL; its parallelism comes only from annotations.

Every tensor-parallel boundary and every layer boundary carries a CommOp, whatever the strategy:
under a strategy where it changes nothing it resolves to identity, so one graph carries several
strategies (and strategies can be added later with graph.add_strategy(llama_annotations(...))).

Megatron layout per layer: q/k/v, gate and up weights column-parallel (split on out_features),
o and down row-parallel (split on in_features), so the block output is Partial and its CommOp is an
AllReduce, or a ReduceScatter to a sequence-split layout with sequence parallelism (then the
block input's CommOp is an AllGather). Weights are stored [in_features, out_features].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import sympy
import torch

from hspmd.annotations import Annotation, DistributedStates, Duplicate, Split, Subgroup
from hspmd.errors import HSPMDError
from hspmd.ir import Graph, Tensor, comm, normal, ones, parameter, placeholder, symbols
from hspmd.ops import (
    AdamW,
    Optimizer,
    causal_attention,
    cross_entropy,
    embedding,
    matmul,
    reshape,
    rmsnorm,
    rotary,
    scale,
    swiglu,
    transpose,
)

COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")
NORMS = ("attn_norm", "mlp_norm")


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    rope_base: float = 10000.0
    eps: float = 1e-6
    init_std: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def __post_init__(self):
        if self.hidden % self.heads or self.head_dim % 2:
            raise HSPMDError(f"LlamaConfig: hidden {self.hidden} must split into {self.heads} heads of even size")

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden, self.ffn
        shapes = {"embed": (self.vocab, h)}
        for l in range(self.layers):
            p = f"layers.{l}."
            shapes.update({p + "attn_norm": (h,), p + "wq": (h, h), p + "wk": (h, h), p + "wv": (h, h),
                           p + "wo": (h, h), p + "mlp_norm": (h,), p + "w_gate": (h, f), p + "w_up": (h, f),
                           p + "w_down": (f, h)})
        shapes.update({"final_norm": (h,), "lm_head": (h, self.vocab)})
        return shapes


def _sequence_split(ann: Annotation, dim: int = 1) -> Annotation:
    """A per-stage duplicated activation with each TP group splitting the sequence instead."""
    subs = tuple(Subgroup(s.dg, DistributedStates(tuple(Split(dim, a.n) if isinstance(a, Duplicate) else a
                                                        for a in s.ds.axes))) for s in ann.subgroups)
    return Annotation(subs, ann.hdim, ann.ratios)


def llama_annotations(config: LlamaConfig, strategy, sequence_parallel: bool = False,
                      vocab_parallel: bool = True) -> dict[str, Annotation]:
    """Every leaf and CommOp annotation of the model under a Strategy (hspmd.specialize.strategy):
    {node name: annotation}, usable by build_llama and by graph.add_strategy."""
    if strategy.num_layers != config.layers:
        raise HSPMDError(f"strategy covers {strategy.num_layers} layers but the model has {config.layers}")
    last = config.layers - 1
    act = [strategy.activation_annotation(l) for l in range(config.layers)]
    resid = [_sequence_split(a) if sequence_parallel else a for a in act]
    kind = "vocab" if vocab_parallel else "replicated"
    out = {"tokens": act[0], "labels": act[last], "embed": strategy.embedding_annotation(kind),
           "embed.out": resid[0], "lm_head": strategy.lm_head_annotation(kind),
           "final_norm": strategy.lm_head_annotation("replicated"), "final.in": act[last], "logits.out": act[last]}
    for l in range(config.layers):
        p = f"layers.{l}."
        for name in COLUMN:
            out[p + name] = strategy.param_annotation(l, "column")
        for name in ROW:
            out[p + name] = strategy.param_annotation(l, "row")
        for name in NORMS:
            out[p + name] = strategy.param_annotation(l, "replicated")
        out[p + "attn.in"] = act[l]
        out[p + "mlp.in"] = act[l]
        out[p + "attn.out"] = resid[l]
        out[p + "mlp.out"] = resid[l]
        if l < last:
            out[p + "out"] = resid[l + 1]
    return out


@dataclass
class LlamaGraph:
    graph: Graph
    tokens: Tensor
    labels: Tensor
    loss: Tensor
    config: LlamaConfig
    batch: sympy.Symbol
    seq: sympy.Symbol
    tokens_per_step: sympy.Symbol


def _annotations_per_strategy(strategies: Sequence[object], config: LlamaConfig, sequence_parallel, vocab_parallel):
    out = []
    for s in strategies:
        out.append(dict(s) if isinstance(s, Mapping) else
                   llama_annotations(config, s, sequence_parallel, vocab_parallel))
    return out


def build_llama(config: LlamaConfig, strategies: Sequence[object], optimizer: Optimizer | None = None,
                sequence_parallel: bool = False, vocab_parallel: bool = True) -> LlamaGraph:
    """The training graph of the model: loss = sum of token cross-entropies / T (T = tokens per
    step, a run-time symbol, so micro-batches and pipelines of any sizes add up to the mean).

    strategies: one entry per strategy, a Strategy or an explicit {node name: annotation} map.
    optimizer: default AdamW(lr=1e-3), with ZeRO-1 if a strategy asks for it."""
    per = _annotations_per_strategy(strategies, config, sequence_parallel, vocab_parallel)

    def ann(name: str):
        missing = [i for i, p in enumerate(per) if name not in p]
        if missing:
            raise HSPMDError(f"build_llama: no annotation for {name!r} in strategy {missing[0]}")
        return [p[name] for p in per]

    g = Graph("llama")
    B, S, T = symbols("B S T")
    h, nh, hd = config.hidden, config.heads, config.head_dim
    init = normal(config.init_std)

    def param(name, shape, initializer=init):
        return parameter(g, name, shape, init=initializer, annotation=ann(name))

    tokens = placeholder(g, "tokens", (B, S), torch.int64, annotation=ann("tokens"))
    labels = placeholder(g, "labels", (B, S), torch.int64, annotation=ann("labels"))
    x = comm(embedding(tokens, param("embed", (config.vocab, h))), ann("embed.out"), name="embed.out")
    for l in range(config.layers):
        p = f"layers.{l}."
        with g.scope(f"layers.{l}"):
            a = comm(rmsnorm(x, param(p + "attn_norm", (h,), ones()), config.eps), ann(p + "attn.in"), name=p + "attn.in")

            def heads(w):
                t = reshape(matmul(a, param(p + w, (h, h))), (B, S, nh, hd))
                return t

            q = transpose(rotary(heads("wq"), 1, config.rope_base), 1, 2)
            k = transpose(rotary(heads("wk"), 1, config.rope_base), 1, 2)
            v = transpose(heads("wv"), 1, 2)
            o = reshape(transpose(causal_attention(q, k, v), 1, 2), (B, S, h))
            x = x + comm(matmul(o, param(p + "wo", (h, h))), ann(p + "attn.out"), name=p + "attn.out")
            m = comm(rmsnorm(x, param(p + "mlp_norm", (h,), ones()), config.eps), ann(p + "mlp.in"), name=p + "mlp.in")
            ff = swiglu(matmul(m, param(p + "w_gate", (h, config.ffn))), matmul(m, param(p + "w_up", (h, config.ffn))))
            x = x + comm(matmul(ff, param(p + "w_down", (config.ffn, h))), ann(p + "mlp.out"), name=p + "mlp.out")
            if l < config.layers - 1:
                x = comm(x, ann(p + "out"), name=p + "out")
    f = comm(rmsnorm(x, param("final_norm", (h,), ones()), config.eps), ann("final.in"), name="final.in")
    logits = comm(matmul(f, param("lm_head", (h, config.vocab))), ann("logits.out"), name="logits.out")
    loss = scale(cross_entropy(logits, labels, reduction="sum"), sympy.Integer(1) / T)
    zero = any(getattr(s, "zero", False) for s in strategies)
    (optimizer or AdamW(lr=1e-3, zero=zero)).minimize(loss)
    return LlamaGraph(g, tokens, labels, loss, config, B, S, T)


__all__ = ["LlamaConfig", "LlamaGraph", "build_llama", "llama_annotations"]
