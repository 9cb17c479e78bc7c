"""A small Llama written once in the DSL; its parallelism comes only from annotations.

Every tensor-parallel boundary and every layer boundary carries a CommOp, whatever the strategy:
under a strategy where it changes nothing it resolves to identity, so one graph carries several
strategies (and strategies can be added later with graph.add_strategy(llama_annotations(...))).

Megatron layout per layer: q/k/v, gate and up weights column-parallel (split on out_features),
o and down row-parallel (split on in_features), so the block output is Partial and its CommOp is an
AllReduce, or a ReduceScatter to a sequence-split layout with sequence parallelism (then the
block input's CommOp is an AllGather). Weights are stored [in_features, out_features].

Grouped-query attention (kv_heads < heads): wk and wv are column-parallel where the stage's TP
degree divides kv_heads, and replicated (each TP rank computes every K/V head) where it does not;
K/V heads are then repeated to one per Q head and pass a CommOp to Q's head-split layout, which is
identity in the first case and a local slice (its gradient an AllGather) in the second. Tied
embeddings: the LM head is the embedding table moved by a CommOp to the last stage's vocab-split
layout (a SendRecv between pipeline stages, identity without pipelining) and transposed, so the
table's gradient sums the lookup's and the head's contributions on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import sympy
import torch

from hspmd.annotations import Annotation, DistributedStates, Duplicate, Split, Subgroup
from hspmd.errors import HSPMDError
from hspmd.ir import Tensor, comm, normal, ones, parameter, placeholder, symbols
from hspmd.models.llama_annotations import activation_annotation, embedding_annotation, lm_head_annotation, param_annotation
from hspmd.ops import (
    AdamW,
    Graph,
    Optimizer,
    cast,
    causal_attention,
    context_attention,
    cross_entropy,
    embedding,
    matmul,
    repeat_interleave,
    reshape,
    rmsnorm,
    rotary,
    scale,
    swiglu,
    transpose,
    vocab_parallel_cross_entropy,
)
from hspmd.ops.nn import IGNORE_INDEX, RopeScaling

COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")
NORMS = ("attn_norm", "mlp_norm")
MAX_INDEX = 2**31  # bound on positions and segment ids in a packed row (any real row is far shorter)


@dataclass(frozen=True)
class LlamaConfig:
    """kv_heads (default heads) < heads is grouped-query attention; head_dim defaults to
    hidden / heads; tie_embeddings makes the LM head the transposed embedding table (no lm_head
    parameter); rope_scaling rescales RoPE's frequencies (e.g. Llama 3.1's rule); pad_token (Hugging
    Face's pad_token_id) is the embedding row that gets no gradient from the lookup."""

    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    rope_base: float = 10000.0
    eps: float = 1e-6
    init_std: float = 0.1
    kv_heads: int | None = None
    head_dim: int | None = None
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = field(default=None)
    pad_token: int | None = None

    def __post_init__(self):
        for name in ("vocab", "hidden", "layers", "heads", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HSPMDError(f"LlamaConfig: {name} must be a positive integer, got {value!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise HSPMDError(f"LlamaConfig: hidden {self.hidden} does not split into {self.heads} heads; "
                             f"give head_dim explicitly")
        object.__setattr__(self, "head_dim", self.hidden // self.heads if self.head_dim is None else self.head_dim)
        object.__setattr__(self, "kv_heads", self.heads if self.kv_heads is None else self.kv_heads)
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise HSPMDError(f"LlamaConfig: head_dim must be a positive even integer (RoPE rotates pairs), got {self.head_dim!r}")
        if not isinstance(self.kv_heads, int) or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise HSPMDError(f"LlamaConfig: kv_heads {self.kv_heads!r} must be a positive divisor of heads {self.heads} "
                             f"(each K/V head serves an equal group of Q heads)")
        if self.pad_token is not None and (not isinstance(self.pad_token, int) or isinstance(self.pad_token, bool)
                                           or not 0 <= self.pad_token < self.vocab):
            raise HSPMDError(f"LlamaConfig: pad_token {self.pad_token!r} must be a token of the vocabulary "
                             f"(0..{self.vocab - 1}) or None")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise HSPMDError(f"LlamaConfig: rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f, q, kv = self.hidden, self.ffn, self.q_width, self.kv_width
        shapes = {"embed": (self.vocab, h)}
        for l in range(self.layers):
            p = f"layers.{l}."
            shapes.update({p + "attn_norm": (h,), p + "wq": (h, q), p + "wk": (h, kv), p + "wv": (h, kv),
                           p + "wo": (q, h), p + "mlp_norm": (h,), p + "w_gate": (h, f), p + "w_up": (h, f),
                           p + "w_down": (f, h)})
        shapes["final_norm"] = (h,)
        if not self.tie_embeddings:
            shapes["lm_head"] = (h, self.vocab)
        return shapes


def _split_replicas(ann: Annotation, dim: int) -> Annotation:
    """The same union with each subgroup's replica (Duplicate) axes splitting `dim` instead."""
    subs = tuple(Subgroup(s.dg, DistributedStates(tuple(Split(dim, a.n) if isinstance(a, Duplicate) else a
                                                        for a in s.ds.axes))) for s in ann.subgroups)
    return Annotation(subs, ann.hdim, ann.ratios)


def _replicate_unless_divides(ann: Annotation, dim: int, size: int) -> Annotation:
    """Splits of `dim` into a number of parts that does not divide `size` become replicas (GQA's
    K/V heads under a TP degree above, or not dividing, kv_heads)."""
    def axis(a):
        return Duplicate(a.n) if isinstance(a, Split) and a.dim == dim and size % a.n else a

    subs = tuple(Subgroup(s.dg, DistributedStates(tuple(map(axis, s.ds.axes)))) for s in ann.subgroups)
    return Annotation(subs, ann.hdim, ann.ratios)


def _moved_split(ann: Annotation, src: int, dst: int) -> Annotation:
    """The same union with splits of dim `src` splitting dim `dst` (a transposed weight's layout)."""
    subs = tuple(Subgroup(s.dg, DistributedStates(tuple(Split(dst, a.n) if isinstance(a, Split) and a.dim == src else a
                                                        for a in s.ds.axes))) for s in ann.subgroups)
    return Annotation(subs, ann.hdim, ann.ratios)


class _SharedByPlacement:
    """One annotation object per (where a layer lives, kind): layers placed on the same stages get
    the same (immutable) value, built once. Besides saving the building, it lets specialization
    recognise repeated layers by identity instead of comparing unions of hundreds of subgroups."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.placement: dict[int, tuple[int, ...]] = {}
        self.values: dict[tuple, Annotation] = {}

    def __call__(self, layer: int, kind: str, build) -> Annotation:
        if layer not in self.placement:
            self.placement[layer] = tuple(self.strategy.stage_of(layer, i) for i in range(len(self.strategy.pipelines)))
        key = (self.placement[layer], kind)
        if key not in self.values:
            self.values[key] = build()
        return self.values[key]


def llama_annotations(config: LlamaConfig, strategy, sequence_parallel: bool = False,
                      vocab_parallel: bool = True) -> dict[str, Annotation]:
    """Every leaf and CommOp annotation of the model under a Strategy (hspmd.specialize.strategy):
    {node name: annotation}, usable by build_llama and by graph.add_strategy."""
    if strategy.num_layers != config.layers:
        raise HSPMDError(f"strategy covers {strategy.num_layers} layers but the model has {config.layers}")
    last = config.layers - 1
    shared = _SharedByPlacement(strategy)
    act = [shared(l, "activation", lambda l=l: activation_annotation(strategy, l)) for l in range(config.layers)]
    resid = [shared(l, "residual", lambda a=a: _split_replicas(a, 1)) if sequence_parallel else a
             for l, a in enumerate(act)]
    kind = "vocab" if vocab_parallel else "replicated"
    out = {"tokens": act[0], "labels": act[last], "embed": embedding_annotation(strategy, kind),
           "embed.out": resid[0], "final_norm": lm_head_annotation(strategy, "replicated"), "final.in": act[last],
           "logits.out": act[last], "positions": act[0], "segments": act[0]}
    head = lm_head_annotation(strategy, kind)
    if config.tie_embeddings:
        out["lm_head.tied"] = _moved_split(head, 1, 0)
    else:
        out["lm_head"] = head
    for l in range(config.layers):
        p = f"layers.{l}."
        column = shared(l, "column", lambda l=l: param_annotation(strategy, l, "column"))
        for name in COLUMN:
            out[p + name] = column
        if config.kv_heads != config.heads:
            kv = shared(l, "kv", lambda: _replicate_unless_divides(column, 1, config.kv_heads))
            for name in ("wk", "wv"):
                out[p + name] = kv
        for name in ROW:
            out[p + name] = shared(l, "row", lambda l=l: param_annotation(strategy, l, "row"))
        for name in NORMS:
            out[p + name] = shared(l, "replicated", lambda l=l: param_annotation(strategy, l, "replicated"))
        out[p + "attn.in"] = act[l]
        out[p + "positions"] = act[l]
        out[p + "segments"] = act[l]
        out[p + "mlp.in"] = act[l]
        out[p + "attn.out"] = resid[l]
        out[p + "mlp.out"] = resid[l]
        if config.kv_heads != config.heads:
            out[p + "k.heads"] = out[p + "v.heads"] = shared(l, "kv.heads", lambda l=l: _split_replicas(act[l], 2))
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
    logits: Tensor | None = None
    positions: Tensor | None = None
    segments: Tensor | None = None


def _annotations_per_strategy(strategies: Sequence[object], config: LlamaConfig, sequence_parallel, vocab_parallel):
    out = []
    for s in strategies:
        out.append(dict(s) if isinstance(s, Mapping) else
                   llama_annotations(config, s, sequence_parallel, vocab_parallel))
    return out


def _context_choice(strategies: Sequence[object], context: str | None, ring_steps: int | None) -> tuple[str | None, int]:
    """(attention mode, ring steps) of the graph: the strategies' cp_attention where any has context
    parallelism (they must agree), or `context`; ring steps: the largest CP degree."""
    with_cp = [s for s in strategies if getattr(s, "max_cp", 1) > 1]
    modes = sorted({s.cp_attention for s in with_cp} | ({context} if context is not None else set()))
    if len(modes) > 1:
        raise HSPMDError(f"build_llama: the strategies' context-parallel attention differs ({', '.join(modes)}); "
                         f"one graph runs one kind (give each kind its own graph)")
    steps = max([getattr(s, "max_cp", 1) for s in strategies] + [ring_steps or 1])
    return (modes[0] if modes else None), steps


def build_llama(config: LlamaConfig, strategies: Sequence[object], optimizer: Optimizer | None = None,
                sequence_parallel: bool = False, vocab_parallel: bool = True,
                compute_dtype: torch.dtype = torch.float32, packed: bool = False,
                context: str | None = None, ring_steps: int | None = None) -> LlamaGraph:
    """The training graph of the model: loss = sum of token cross-entropies / T (T = tokens per
    step, a run-time symbol, so micro-batches and pipelines of any sizes add up to the mean).
    Labels equal to IGNORE_INDEX (padding) count for nothing.

    packed: rows hold several sequences back to back; two more placeholders, `positions` (each
    token's index in its own sequence, for RoPE) and `segments` (which sequence of the row it
    belongs to, for the block-diagonal causal mask), both [B, S] integers, reach every layer.

    context: attention over a sequence split across devices (hspmd.ops.context: ring, all_gather,
    all_to_all), taken from the strategies' cp_attention when one has context parallelism (CP);
    the `positions` placeholder ([B, S], each token's position) then reaches every layer, for RoPE
    and the mask, so tokens may be fed in any order (`ops.context.head_tail_order` balances the
    ring's causal work). ring_steps: the largest CP degree the graph will run (default: the
    strategies' largest), for explicit annotation maps.

    strategies: one entry per strategy, a Strategy or an explicit {node name: annotation} map.
    optimizer: default AdamW(lr=1e-3), with ZeRO-1 if a strategy asks for it.
    compute_dtype: mixed precision (e.g. torch.bfloat16): parameters and optimizer states stay
    float32 (master weights), each use casts its parameter to compute_dtype, so activations,
    their gradients and the layers' communication are in compute_dtype; the logits return to
    float32 for the loss, and each parameter's gradient returns to float32 at its cast, before
    micro-batch accumulation, gradient synchronisation and the optimizer."""
    per = _annotations_per_strategy(strategies, config, sequence_parallel, vocab_parallel)

    def ann(name: str):
        missing = [i for i, p in enumerate(per) if name not in p]
        if missing:
            raise HSPMDError(f"build_llama: no annotation for {name!r} in strategy {missing[0]}")
        return [p[name] for p in per]

    g = Graph("llama")
    B, S, T = symbols("B S T")
    h, nh, kvh, hd = config.hidden, config.heads, config.kv_heads, config.head_dim
    init = normal(config.init_std)

    def param(name, shape, initializer=init):
        return cast(parameter(g, name, shape, init=initializer, annotation=ann(name)), compute_dtype)

    tokens = placeholder(g, "tokens", (B, S), torch.int64, annotation=ann("tokens"), values=(0, config.vocab, ()))
    labels = placeholder(g, "labels", (B, S), torch.int64, annotation=ann("labels"),
                         values=(0, config.vocab, (IGNORE_INDEX,)))
    mode, steps = _context_choice(strategies, context, ring_steps)
    positions = segments = pos = seg = token_pos = None
    if packed or mode is not None:
        positions = placeholder(g, "positions", (B, S), torch.int64, annotation=ann("positions"),
                                values=(0, MAX_INDEX, ()))
    if packed:
        segments = placeholder(g, "segments", (B, S), torch.int64, annotation=ann("segments"),
                               values=(0, MAX_INDEX, ()))
    table = param("embed", (config.vocab, h))
    x = comm(embedding(tokens, table, config.pad_token), ann("embed.out"), name="embed.out")
    for l in range(config.layers):
        p = f"layers.{l}."
        with g.scope(f"layers.{l}"):
            a = comm(rmsnorm(x, param(p + "attn_norm", (h,), ones()), config.eps), ann(p + "attn.in"), name=p + "attn.in")
            if positions is not None:
                layer_pos = comm(positions, ann(p + "positions"), name=p + "positions")
                pos, token_pos = reshape(layer_pos, (B, S, 1, 1)), reshape(layer_pos, (B, 1, S, 1))
            if packed:
                seg = reshape(comm(segments, ann(p + "segments"), name=p + "segments"), (B, 1, S, 1))

            def heads(w, count):
                return reshape(matmul(a, param(p + w, (h, count * hd))), (B, S, count, hd))

            def shared(t, name):
                """K/V heads repeated to one per Q head, laid out like Q's heads."""
                if kvh == nh:
                    return t
                return comm(repeat_interleave(t, nh // kvh, 2), ann(p + name), name=p + name)

            q = transpose(rotary(heads("wq", nh), 1, config.rope_base, config.rope_scaling, pos), 1, 2)
            k = transpose(shared(rotary(heads("wk", kvh), 1, config.rope_base, config.rope_scaling, pos), "k.heads"), 1, 2)
            v = transpose(shared(heads("wv", kvh), "v.heads"), 1, 2)
            attended = causal_attention(q, k, v, seg) if mode is None else \
                context_attention(q, k, v, token_pos, seg, mode=mode, ring_steps=steps)
            o = reshape(transpose(attended, 1, 2), (B, S, nh * hd))
            x = x + comm(matmul(o, param(p + "wo", (nh * hd, h))), ann(p + "attn.out"), name=p + "attn.out")
            m = comm(rmsnorm(x, param(p + "mlp_norm", (h,), ones()), config.eps), ann(p + "mlp.in"), name=p + "mlp.in")
            ff = swiglu(matmul(m, param(p + "w_gate", (h, config.ffn))), matmul(m, param(p + "w_up", (h, config.ffn))))
            x = x + comm(matmul(ff, param(p + "w_down", (config.ffn, h))), ann(p + "mlp.out"), name=p + "mlp.out")
            if l < config.layers - 1:
                x = comm(x, ann(p + "out"), name=p + "out")
    f = comm(rmsnorm(x, param("final_norm", (h,), ones()), config.eps), ann("final.in"), name="final.in")
    if config.tie_embeddings:
        head = transpose(comm(table, ann("lm_head.tied"), name="lm_head.tied"), 0, 1)
    else:
        head = param("lm_head", (h, config.vocab))
    if vocab_parallel:  # the loss over the vocabulary-split logits: no rank gathers the vocabulary
        logits = cast(matmul(f, head), torch.float32)
        token_losses = vocab_parallel_cross_entropy(logits, labels)
    else:
        logits = cast(comm(matmul(f, head), ann("logits.out"), name="logits.out"), torch.float32)
        token_losses = cross_entropy(logits, labels, reduction="sum")
    loss = scale(token_losses, sympy.Integer(1) / T)
    zero = any(getattr(s, "zero", False) for s in strategies)
    (optimizer or AdamW(lr=1e-3, zero=zero)).minimize(loss)
    return LlamaGraph(g, tokens, labels, loss, config, B, S, T, logits, positions, segments)


__all__ = ["LlamaConfig", "LlamaGraph", "RopeScaling", "build_llama", "llama_annotations"]
