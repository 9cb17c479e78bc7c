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
  output. The block reads K/V on differently ordered devices than Q (`OpDef.unaligned`). The
  result (`ring_result`) has its own gradient: backward CommOps send K/V around again and
  `ring_attention_grad` gives each step's dq, dk, dv from the final output and lse (the
  flash-attention backward), dK/dV going home by CommOps; so the forward keeps no received chunk,
  block or merge (the executor drops forward values nothing later reads) and activation memory
  per rank is 1/CP. A graph built for R steps runs under any strategy with a ring of at most R
  chunks: step j >= the ring size of a strategy is a block of no keys (an identity CommOp, no
  traffic).
- all_gather: K/V are gathered whole along the sequence (one CommOp), each device attends its own
  query rows to all keys; dK/dV come back as partial sums over the sequence split (a
  reduce-scatter).
- all_to_all (Ulysses): Q, K, V move their sequence split to the heads (an all-to-all), attention
  runs over the whole sequence on a share of the heads, and the output moves back.

all_gather keeps the gathered K/V (whole sequence) for its backward; all_to_all a heads-split copy
of q, k, v and the output. hspmd's executor runs a ring's CommOps and blocks in turn: the transfer
is not overlapped with the previous block's compute as ring kernels do.
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
from hspmd.ops.elementwise import add
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


def ring_block_gradients(q, qpos, qseg, out, lse, dout, k, v, kpos, kseg):
    """dq (this block's part), dk, dv of one ring step from the final output and its lse (the
    flash-attention backward: P = exp(scores - lse), dS = P (dP - rowsum(dO O))), float32."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf = q.float(), k.float(), v.float()
    visible = kpos[..., 0].unsqueeze(-2) <= qpos[..., 0].unsqueeze(-1)
    if qseg is not None:
        visible = visible & (kseg[..., 0].unsqueeze(-2) == qseg[..., 0].unsqueeze(-1))
    p = torch.exp(torch.matmul(qf, kf.transpose(-1, -2)) * scale - lse) * visible
    dp = torch.matmul(dout, vf.transpose(-1, -2))
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, \
        torch.matmul(p.transpose(-1, -2), dout)


def _ring_inputs(node, inputs):
    """(q, qpos, qseg, acc, dout, [(k, v, kpos, kseg) per step]) of a ring_attention_grad node."""
    segmented, steps = node.attrs["segmented"], node.attrs["steps"]
    per = 4 if segmented else 3
    head = 5 if segmented else 4
    q, qpos = inputs[0], inputs[1]
    qseg = inputs[2] if segmented else None
    acc, dout = inputs[head - 2], inputs[head - 1]
    blocks = []
    for j in range(steps):
        k, v, kpos, *rest = inputs[head + per * j: head + per * (j + 1)]
        blocks.append((k, v, kpos, rest[0] if rest else None))
    return q, qpos, qseg, acc, dout, blocks


class RingResult(OpDef):
    """The ring's output (the merged blocks' o), whose gradient runs the ring again in the
    backward: K/V and their token maps are sent around once more by backward CommOps and each
    step's dq, dk, dv come from the final output and lse (ring_attention_grad), so the forward
    keeps no received chunk, block or merge (inputs: acc, q, k, v, positions[, segments])."""

    kind = "ring_result"

    def deduce(self, node, anns):
        return [anns[0]]

    def compute(self, node, ctx, inputs):
        return [inputs[0][..., :-1]]

    def gradient(self, node, grads):
        (g,) = grads
        acc, q, k, v, positions = node.inputs[:5]
        segs = tuple(node.inputs[5:6])
        steps = node.attrs["steps"]
        inputs = [q, positions, *segs, acc, g]
        for step in range(steps):
            if step == 0:
                inputs += [k, v, positions, *segs]
            else:
                inputs += [_moved(t, lambda a, step=step: ring_step_layout(a, step), f"ring{step}.again")
                           for t in (k, v, positions, *segs)]
        shapes = [(q.shape, q.dtype)] + [(k.shape, k.dtype)] * steps + [(v.shape, v.dtype)] * steps
        outs = make(RING_ATTENTION_GRAD, inputs, shapes, attrs={"steps": steps, "segmented": bool(segs)}).outputs
        dq, dks, dvs = outs[0], outs[1:1 + steps], outs[1 + steps:]

        def back(parts, like):
            total = parts[0]
            for step, part in enumerate(parts[1:], 1):
                home = comm(part, Derived((like,), lambda own, refs: refs[0], f"layout of {like.name}"),
                            name=like.graph.unique_name(f"{like.node.name}.ring{step}.grad"))
                total = add(total, home)
            return total

        return [None, dq, back(dks, k), back(dvs, v), None] + [None] * len(segs)


class RingAttentionGrad(OpDef):
    """dq, and dk, dv at every ring step (on that step's layout), of ring attention."""

    kind = "ring_attention_grad"
    unaligned = True

    def deduce(self, node, anns):
        steps, segmented = node.attrs["steps"], node.attrs["segmented"]
        head, per = (5, 4) if segmented else (4, 3)
        q, qpos = anns[0], anns[1]
        if token_layout(q) != qpos:
            raise Mismatch(f"positions {qpos} do not lie like the queries' tokens {token_layout(q)}")
        ks, vs = [], []
        for step in range(steps):
            k, v, kpos, *segs = anns[head + per * step: head + per * (step + 1)]
            want, want_pos = ring_step_layout(q, step), ring_step_layout(qpos, step)
            if k != want or v != want or kpos != want_pos or any(s != want_pos for s in segs):
                raise Mismatch(f"ring step {step}: k/v must lie as {want} and their tokens as {want_pos}, got {k}, {kpos}")
            ks.append(k)
            vs.append(v)
        return [q] + ks + vs

    def compute(self, node, ctx, inputs):
        q, qpos, qseg, acc, dout, blocks = _ring_inputs(node, inputs)
        ring = ring_size(ctx.in_ann(0), SEQ_DIM)
        out, lse, dout = acc[..., :-1], acc[..., -1:], dout.float()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dks, dvs = [], []
        for step, (k, v, kpos, kseg) in enumerate(blocks):
            if step >= ring:  # past this strategy's ring: the step saw no keys
                dks.append(torch.zeros_like(k))
                dvs.append(torch.zeros_like(v))
                continue
            gq, gk, gv = ring_block_gradients(q, qpos, qseg, out, lse, dout, k, v, kpos, kseg)
            dq += gq.to(dq.device)
            dks.append(gk.to(k.dtype))
            dvs.append(gv.to(v.dtype))
        return [dq.to(q.dtype)] + dks + dvs

    def describe(self, node):
        return f"{node.attrs['steps']} ring steps"


def _merge(inputs, attrs, ctx):
    return merge_blocks(inputs[0], inputs[1])


def _output(inputs, attrs, ctx):
    return inputs[0][..., :-1]


ATTENTION_BLOCK, ATTENTION_BLOCK_GRAD = AttentionBlock(), AttentionBlockGrad()
RING_RESULT, RING_ATTENTION_GRAD = RingResult(), RingAttentionGrad()
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
    out = make(RING_RESULT, [acc, q, k, v, positions, *segs], [(q.shape, torch.float32)], attrs={"steps": ring_steps}).output
    return cast(out, q.dtype) if q.dtype != torch.float32 else out


__all__ = ["MODES", "block_attention", "context_attention", "head_tail_order", "in_token_order", "merge_blocks",
           "ring_step_layout", "token_layout"]
