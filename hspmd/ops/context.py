"""Attention over a sequence split across devices (context parallelism, CP), built from
annotations, CommOps and three local ops, so that deduction, gradients, the resolver's plans and
the cost model see it like any other layer.

Every token carries its position (and, for packed rows, its segment) as a tensor: a key is
visible to a query when it lies in the same segment at a position not after the query's. The
mask therefore depends on the tokens, not on where they lie, so a sequence may be laid out in
any order: load-balanced ring attention feeds each rank a head chunk and a tail chunk
(`runtime/execution/packing.head_tail_order`), and RoPE takes the same positions.

`attention_block` attends the query rows a device holds to the key rows it holds and returns
[o | lse] (the block's softmax-normalised output and the log of its softmax denominator, float32;
rows that see no key have lse = -inf); `attention_merge` combines two such blocks by their
log-sum-exp (online softmax); `attention_output` drops the lse column. Three ways to lay the keys
out, one per `mode` of `context_attention`:

- ring: K/V (and their positions, segments) pass around the ring of sequence chunks
  (`annotations.sequence.ring_shift`): step j is a CommOp to the layout in which each device holds
  the chunk j places back, one message per device, and each step's block merges into the running
  output. The block reads K/V on differently ordered devices than Q (`OpDef.unaligned`); its
  gradient sends dK/dV back the same way (the CommOp's gradient). A graph built for R steps runs
  under any strategy with a ring of at most R chunks: step j >= the ring size of a strategy is a
  block of no keys (an identity CommOp, no traffic).
- all_gather: K/V are gathered whole along the sequence (one CommOp), each device attends its own
  query rows to all keys; dK/dV come back as partial sums over the sequence split (a
  reduce-scatter).
- all_to_all (Ulysses): Q, K, V move their sequence split to the heads (an all-to-all), attention
  runs over the whole sequence on a share of the heads, and the output moves back.

Approximate: the ring keeps every step's received K/V chunk until the backward (autodiff keeps
the forward's tensors), so K/V activation memory is the whole sequence's per rank, as with
all_gather; Q, the output and everything outside attention are 1/CP. Recomputing the ring in the
backward (what ring-attention kernels do) would need the CommOps replayed in the backward pass.
"""

from __future__ import annotations

import math

import torch

from hspmd.annotations import Annotation, split_bounds
from hspmd.annotations.sequence import moved_split, partial_along, ring_shift, ring_size, whole_along
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir import Derived, comm
from hspmd.ir.graph import Node, OpDef, Tensor
from hspmd.ir.shapes import format_shape, same_dim
from hspmd.ops.base import make
from hspmd.ops.nn import Fused
from hspmd.ops.rules import Mismatch
from hspmd.ops.unary import cast

SEQ_DIM = 2  # q, k, v are [batch, heads, seq, head_dim]; positions and segments [batch, 1, seq, 1]
MODES = ("ring", "all_gather", "all_to_all")


def ring_step_layout(ann: Annotation, step: int) -> Annotation:
    """Where K/V lie at ring step `step`: `ann` shifted `step` chunks back, or `ann` itself once
    the step is past the ring (such a step attends to no keys)."""
    return ring_shift(ann, SEQ_DIM, step) if step < ring_size(ann, SEQ_DIM) else ann


def token_layout(ann: Annotation) -> Annotation:
    """The layout of a token map ([batch, 1, seq, 1]) beside a [batch, heads, seq, head_dim]
    tensor laid out as `ann`: the same batch and sequence pieces, whole on the other dims."""
    return whole_along(whole_along(ann, 1), 3)


# ---------------------------------------------------------------- local compute


def _dead_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A block whose rows see no key: o = 0, lse = -inf (still a function of q, k, v for autograd)."""
    shape = tuple(q.shape[:-1]) + (1,)
    touch = 0.0 * (q.float().sum() + k.float().sum() + v.float().sum())
    zeros = torch.zeros(tuple(q.shape), dtype=torch.float32, device=q.device)
    return torch.cat([zeros, torch.full(shape, float("-inf"), device=q.device)], -1) + touch


def block_attention(q, k, v, qpos, kpos, qseg=None, kseg=None) -> torch.Tensor:
    """[o | lse] of q's rows over k's rows, float32, masked by positions and segments."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _dead_block(q, k, v)
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    visible = kpos[..., 0].unsqueeze(-2) <= qpos[..., 0].unsqueeze(-1)
    if qseg is not None:
        visible = visible & (kseg[..., 0].unsqueeze(-2) == qseg[..., 0].unsqueeze(-1))
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1, keepdim=True).detach()  # a shift: the result does not depend on it
    dead = torch.isinf(top)
    top = torch.where(dead, torch.zeros_like(top), top)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    total = torch.where(dead, torch.ones_like(total), total)
    out = torch.matmul(weights, vf) / total
    lse = torch.where(dead, torch.full_like(top, float("-inf")), top + torch.log(total))
    return torch.cat([out, lse], -1)


def merge_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two blocks of the same query rows over disjoint keys as one (online softmax)."""
    lse_a, lse_b = a[..., -1:], b[..., -1:]
    lse = torch.logaddexp(lse_a, lse_b)
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = a[..., :-1] * torch.exp(lse_a - shift) + b[..., :-1] * torch.exp(lse_b - shift)
    return torch.cat([out, lse], -1)


def _block_inputs(inputs):
    q, k, v, qpos, kpos = inputs[:5]
    segs = inputs[5:7] if len(inputs) >= 7 else (None, None)
    return q, k, v, qpos, kpos, segs[0], segs[1]


# ---------------------------------------------------------------- ops


def _check_layouts(node: Node, anns) -> Annotation:
    """q's layout, after checking that k/v and the token maps lie where the block's mode needs."""
    q, k, v, qpos, kpos = anns[:5]
    step, gather = node.attrs["step"], node.attrs["gather"]
    for a in (q, qpos):
        for s in a.distinct_states:
            if s.partial_count > 1:
                raise Mismatch("attention inputs must not hold partial sums")
    if q.hdim == "P" or any(3 in s.split_dims for s in q.distinct_states):
        raise Mismatch("the head dim of q must be whole and q must not hold partial sums")
    want_k = whole_along(q, SEQ_DIM) if gather else ring_step_layout(q, step)
    want_pos = whole_along(qpos, SEQ_DIM) if gather else ring_step_layout(qpos, step)
    if token_layout(q) != qpos:
        raise Mismatch(f"positions {qpos} do not lie like the queries' tokens {token_layout(q)}")
    what = "gathered whole along the sequence" if gather else f"ring step {step}"
    for name, a, want in (("k", k, want_k), ("v", v, want_k), ("key positions", kpos, want_pos)):
        if a != want:
            raise Mismatch(f"{name} at {what} must be laid out as {want}, got {a}")
    if len(anns) >= 7:
        if anns[5] != qpos or anns[6] != kpos:
            raise Mismatch(f"segments {anns[5]}, {anns[6]} must lie like the positions {qpos}, {kpos}")
    return q


class AttentionBlock(OpDef):
    """[o | lse] of each device's query rows over the key rows it holds (attrs: step, gather)."""

    kind = "attention_block"
    unaligned = True

    def deduce(self, node, anns):
        return [_check_layouts(node, anns)]

    def compute(self, node, ctx, inputs):
        q, k, v, qpos, kpos, qseg, kseg = _block_inputs(inputs)
        if not node.attrs["gather"] and node.attrs["step"] >= ring_size(ctx.in_ann(0), SEQ_DIM):
            return [_dead_block(q, k, v)]
        return [block_attention(q, k, v, qpos, kpos, qseg, kseg)]

    def gradient(self, node, grads):
        (g,) = grads
        q, k, v = node.inputs[:3]
        outs = make(ATTENTION_BLOCK_GRAD, list(node.inputs) + [g], [(t.shape, t.dtype) for t in (q, k, v)],
                    attrs=node.attrs).outputs
        return list(outs) + [None] * (len(node.inputs) - 3)

    def describe(self, node):
        return "gathered keys" if node.attrs["gather"] else f"ring step {node.attrs['step']}"


class AttentionBlockGrad(OpDef):
    """dq, dk, dv of an attention block: dq lies like q, dk/dv like k/v, or, for keys gathered
    whole, as partial sums over the queries' sequence split."""

    kind = "attention_block_grad"
    unaligned = True

    def deduce(self, node, anns):
        q = _check_layouts(node, anns[:-1])
        if node.attrs["gather"]:
            dk = partial_along(q, SEQ_DIM)
            return [q, dk, dk]
        return [q, anns[1], anns[2]]

    def compute(self, node, ctx, inputs):
        *xs, g = inputs
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(i < 3) for i, x in enumerate(xs)]
            y = ATTENTION_BLOCK.compute(node, ctx, leaves)[0]
            out = torch.autograd.grad(y, leaves[:3], g, allow_unused=True)
        return [o if o is not None else torch.zeros_like(x) for o, x in zip(out, xs[:3])]

    def describe(self, node):
        return ATTENTION_BLOCK.describe(node)


def _merge(inputs, attrs, ctx):
    return merge_blocks(inputs[0], inputs[1])


def _output(inputs, attrs, ctx):
    return inputs[0][..., :-1]


ATTENTION_BLOCK, ATTENTION_BLOCK_GRAD = AttentionBlock(), AttentionBlockGrad()
ATTENTION_MERGE = Fused("attention_merge", _merge, whole_dims=(-1,), diff_inputs=(0, 1))
ATTENTION_OUTPUT = Fused("attention_output", _output, whole_dims=(-1,), linear=True)


# ---------------------------------------------------------------- token order


def head_tail_order(length: int, ring: int) -> torch.Tensor:
    """A token order that balances a causal ring: the sequence is cut into 2 * ring chunks and
    ring position r takes chunk r and chunk 2 * ring - 1 - r, so every even share of the
    reordered sequence holds one early and one late chunk (equal causal work where 2 * ring
    divides the length, near it otherwise). Feed tokens, labels and positions in this order."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0 or \
            isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
        raise HSPMDError(f"head_tail_order: needs a length >= 0 and a ring size >= 1, got {length!r}, {ring!r}")
    bounds = split_bounds(length, [1] * (2 * ring))
    return torch.cat([torch.arange(*bounds[c]) for r in range(ring) for c in (r, 2 * ring - 1 - r)])


def in_token_order(batch: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """`batch` ({name: [rows, seq] tensor}) with its tokens in `order` along the sequence, and
    `positions` (each token's index, unless the batch gives them, e.g. packed rows) moved alike."""
    rows, length = next(iter(batch.values())).shape[:2]
    out = dict(batch)
    out.setdefault("positions", torch.arange(length).expand(rows, length).contiguous())
    return {name: t[:, order] for name, t in out.items()}


# ---------------------------------------------------------------- DSL


def _moved(x: Tensor, fn, what: str) -> Tensor:
    return comm(x, Derived((x,), lambda own, refs: fn(own), what), name=x.graph.unique_name(f"{x.node.name}.{what}"))


def _block(q, k, v, qpos, kpos, segs, step: int, gather: bool) -> Tensor:
    inputs = [q, k, v, qpos, kpos] + list(segs)
    shape = tuple(q.shape[:-1]) + (q.shape[-1] + 1,)
    return make(ATTENTION_BLOCK, inputs, [(shape, torch.float32)], attrs={"step": step, "gather": gather}).output


def _finish(acc: Tensor, dtype: torch.dtype) -> Tensor:
    shape = tuple(acc.shape[:-1]) + (acc.shape[-1] - 1,)
    out = make(ATTENTION_OUTPUT, [acc], [(shape, torch.float32)]).output
    return cast(out, dtype) if dtype != torch.float32 else out


def _check_inputs(q, k, v, positions, segments, mode, ring_steps):
    for t in (k, v):
        if t.ndim != 4 or q.ndim != 4 or not all(same_dim(a, b) for a, b in zip(q.shape, t.shape)):
            raise ShapeError(f"context_attention: q {format_shape(q.shape)}, k/v {format_shape(t.shape)} must be "
                             f"equal [batch, heads, seq, head_dim]")
    want = (q.shape[0], 1, q.shape[2], 1)
    for what, t in (("positions", positions), ("segments", segments)):
        if t is None and what == "segments":
            continue
        if t is None or t.dtype not in (torch.int64, torch.int32) or t.ndim != 4 or \
                not all(same_dim(a, b) for a, b in zip(t.shape, want)):
            got = "none" if t is None else f"{format_shape(t.shape)} {t.dtype}"
            raise ShapeError(f"context_attention: {what} must be an integer tensor of shape {format_shape(want)}, got {got}")
    if mode not in MODES:
        raise HSPMDError(f"context_attention: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(ring_steps, bool) or not isinstance(ring_steps, int) or ring_steps < 1:
        raise HSPMDError(f"context_attention: ring_steps must be a positive integer (the largest CP degree), got {ring_steps!r}")


def context_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, segments: Tensor | None = None,
                      mode: str = "ring", ring_steps: int = 1) -> Tensor:
    """Causal attention of q, k, v ([batch, heads, seq, head_dim], laid out alike) whose sequence
    may be split across devices; `positions` (and `segments` for packed rows) are [batch, 1, seq, 1]
    integers laid out like q's tokens. mode: ring (`ring_steps` = the largest ring size among the
    graph's strategies), all_gather or all_to_all (see the module docstring). Exact under every
    layout: the result equals single-device causal attention of the tokens by their positions."""
    _check_inputs(q, k, v, positions, segments, mode, ring_steps)
    segs = () if segments is None else (segments,)
    if mode == "all_to_all":
        def heads(t):
            return _moved(t, lambda a: moved_split(a, SEQ_DIM, 1), "heads")

        def tokens(t):
            return _moved(t, lambda a: whole_along(a, SEQ_DIM), "whole")

        pos, seg = tokens(positions), tuple(tokens(s) for s in segs)
        out = _finish(_block(heads(q), heads(k), heads(v), pos, pos, seg + seg, 0, False), q.dtype)
        return comm(out, Derived((q,), lambda own, refs: refs[0], f"layout of {q.name}"),
                    name=q.graph.unique_name(f"{q.node.name}.sequence"))
    if mode == "all_gather":
        def whole(t):
            return _moved(t, lambda a: whole_along(a, SEQ_DIM), "gathered")

        acc = _block(q, whole(k), whole(v), positions, whole(positions), segs + tuple(whole(s) for s in segs), 0, True)
        return _finish(acc, q.dtype)
    acc = None
    for step in range(ring_steps):
        if step == 0:
            kj, vj, pj, sj = k, v, positions, segs
        else:
            def shifted(t, step=step):
                return _moved(t, lambda a: ring_step_layout(a, step), f"ring{step}")

            kj, vj, pj, sj = shifted(k), shifted(v), shifted(positions), tuple(shifted(s) for s in segs)
        block = _block(q, kj, vj, positions, pj, segs + sj, step, False)
        acc = block if acc is None else make(ATTENTION_MERGE, [acc, block], [(block.shape, torch.float32)]).output
    return _finish(acc, q.dtype)


__all__ = ["MODES", "block_attention", "context_attention", "head_tail_order", "in_token_order", "merge_blocks",
           "ring_step_layout", "token_layout"]
