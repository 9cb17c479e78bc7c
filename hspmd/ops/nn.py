"""Neural-network ops of a Llama-style model: embedding, softmax, rmsnorm / layernorm, rotary
embedding, causal attention, SwiGLU, cross-entropy. Fused backward ops compute their local
gradient on the local pieces, in closed form (RMS norm, RoPE, causal attention) or with torch
autograd through the forward; their deduction rules say where that is exact."""

from __future__ import annotations

import functools
import math
from dataclasses import astuple, dataclass

import torch
import torch.nn.functional as F

from hspmd.annotations import Duplicate, Partial, Split
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.graph import Node, Tensor
from hspmd.ir.shapes import format_shape, same_dim
from hspmd.ops.base import RuleOp, make, normalize_dim
from hspmd.ops.elementwise import add, mul
from hspmd.ops.rules import Mismatch, elementwise_rule
from hspmd.ops.unary import silu


# ---------------------------------------------------------------- embedding


class Embedding(RuleOp):
    """table[ids]; a vocab-split table gives Partial outputs (rows outside the piece read as 0).
    attrs["padding_idx"] (optional): that row gets no gradient from the lookup, as torch's
    nn.Embedding(padding_idx=) and so Hugging Face's pad_token_id."""

    kind = "embedding"

    def rule(self, node: Node):
        last = node.output.ndim - 1

        def rule(axes):
            ia, ta = axes
            if isinstance(ia, Partial):
                raise Mismatch("token ids cannot be partial")
            if isinstance(ia, Split):
                if not isinstance(ta, Duplicate):
                    raise Mismatch("ids are split while the table is not whole at the same axis")
                return Split(ia.dim, ia.n), 0
            if isinstance(ta, Split):
                return (Partial(ta.n), None) if ta.dim == 0 else (Split(last, ta.n), 1)
            return ta, None

        return rule

    def compute(self, node, ctx, inputs):
        ids, table = inputs
        v0, v1 = ctx.in_box(1)[0]
        if (v0, v1) == (0, ctx.in_shape(1)[0]):
            return [F.embedding(ids, table)]
        inside = (ids >= v0) & (ids < v1)
        out = F.embedding((ids - v0).clamp(0, max(v1 - v0 - 1, 0)), table) if v1 > v0 else \
            torch.zeros(tuple(ids.shape) + (table.shape[1],), dtype=table.dtype, device=table.device)
        return [out * inside.unsqueeze(-1).to(out.dtype)]

    def gradient(self, node, grads):
        ids, table = node.inputs
        g = make(EMBEDDING_GRAD, [ids, grads[0], table], [(table.shape, table.dtype)], attrs=dict(node.attrs)).output
        return [None, g]

    def describe(self, node):
        pad = node.attrs.get("padding_idx")
        return "" if pad is None else f"padding_idx={pad}"


class EmbeddingGrad(RuleOp):
    """Scatter-add of output gradients into the table's rows (inputs: ids, grad, table); the row
    attrs["padding_idx"], where this piece holds it, stays zero."""

    kind = "embedding_grad"

    def rule(self, node: Node):
        glast = node.inputs[1].ndim - 1

        def rule(axes):
            ia, ga, ta = axes
            if isinstance(ia, Split) and isinstance(ga, Split) and ia.dim == ga.dim and isinstance(ta, Duplicate):
                return Partial(ia.n), None
            if isinstance(ia, Duplicate):
                if isinstance(ta, Split) and ta.dim == 0 and isinstance(ga, Duplicate):
                    return Split(0, ta.n), 2
                if isinstance(ta, Split) and ta.dim == 1 and isinstance(ga, Split) and ga.dim == glast:
                    return Split(1, ta.n), 2
                if isinstance(ta, Duplicate) and not isinstance(ga, Split):
                    return ga, None
            raise Mismatch(f"ids {ia}, gradient {ga} and table {ta} do not line up")

        return rule

    def compute(self, node, ctx, inputs):
        ids, g, table = inputs
        v0, v1 = ctx.in_box(2)[0]
        out = torch.zeros(tuple(table.shape), dtype=g.dtype, device=g.device)
        if v1 <= v0:
            return [out]
        flat_ids, flat_g = ids.reshape(-1), g.reshape(-1, g.shape[-1])
        inside = ((flat_ids >= v0) & (flat_ids < v1)).unsqueeze(-1).to(g.dtype)
        # rows outside this piece add zero at a clamped index: no data-dependent shapes (no host sync)
        out.index_add_(0, (flat_ids - v0).clamp(0, v1 - v0 - 1), flat_g * inside)
        pad = node.attrs.get("padding_idx")
        if pad is not None and v0 <= pad < v1:
            out[pad - v0].zero_()
        return [out]

    def describe(self, node):
        pad = node.attrs.get("padding_idx")
        return "" if pad is None else f"padding_idx={pad}"


EMBEDDING, EMBEDDING_GRAD = Embedding(), EmbeddingGrad()


def embedding(ids: Tensor, table: Tensor, padding_idx: int | None = None) -> Tensor:
    """table[ids]; the row `padding_idx` (if given) gets no gradient from this lookup."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"embedding: ids {ids.name} must be an integer tensor, got {ids.dtype}")
    if table.ndim != 2:
        raise ShapeError(f"embedding: table {table.name} must be [vocab, hidden], got {format_shape(table.shape)}")
    if padding_idx is not None and (not isinstance(padding_idx, int) or isinstance(padding_idx, bool)
                                    or not 0 <= padding_idx < table.shape[0]):
        raise ShapeError(f"embedding: padding_idx {padding_idx!r} is not a row of table {table.name} "
                         f"({format_shape(table.shape)})")
    attrs = None if padding_idx is None else {"padding_idx": padding_idx}
    return make(EMBEDDING, [ids, table], [(tuple(ids.shape) + (table.shape[1],), table.dtype)], attrs=attrs).output


# ---------------------------------------------------------------- fused local ops with autograd


class Fused(RuleOp):
    """An op computed by `forward(inputs, attrs, ctx)`, elementwise-like deduction with `whole_dims`
    (negative = from the end) kept whole, and a backward op `<kind>_grad` that takes (inputs...,
    grad) and returns one gradient per differentiable input: `vjp(inputs, grad, attrs, ctx)` in
    closed form when given, else autograd through `forward` (which recomputes the forward and
    pays autograd's bookkeeping: 0.2-0.3 ms a call on this CPU for the demo Llama's RoPE and RMS
    norm, whatever the size)."""

    def __init__(self, kind: str, forward, whole_dims=(), linear: bool = False, diff_inputs=(0,), vjp=None):
        self.kind, self.forward, self.whole_dims = kind, forward, whole_dims
        self.linear, self.diff_inputs, self.vjp = linear, diff_inputs, vjp
        self.backward = FusedGrad(self) if diff_inputs else None

    def rule(self, node: Node):
        return elementwise_rule([t.shape for t in node.inputs], node.output.shape,
                                "all" if self.linear else "none", whole_dims=self.whole(node))

    def whole(self, node: Node) -> tuple[int, ...]:
        return self.whole_dims(node.attrs) if callable(self.whole_dims) else self.whole_dims

    def compute(self, node, ctx, inputs):
        return [self.forward(inputs, node.attrs, ctx)]

    def gradient(self, node, grads):
        (g,) = grads
        outs = make(self.backward, list(node.inputs) + [g],
                    [(node.inputs[i].shape, node.inputs[i].dtype) for i in self.diff_inputs],
                    attrs=node.attrs).outputs
        grads_in = [None] * len(node.inputs)
        for i, t in zip(self.diff_inputs, outs):
            grads_in[i] = t
        return grads_in

    def describe(self, node):
        return ", ".join(f"{k}={v}" for k, v in node.attrs.items())


class FusedGrad(RuleOp):
    """Vector-Jacobian product of a Fused op on the local pieces (linear in the gradient input)."""

    def __init__(self, op: Fused):
        self.op, self.kind = op, op.kind + "_grad"

    def rule(self, node: Node):
        n = len(node.inputs)
        return elementwise_rule([t.shape for t in node.inputs], node.inputs[0].shape, "one", (n - 1,),
                                whole_dims=self.op.whole(node))

    def compute(self, node, ctx, inputs):
        *xs, g = inputs
        if self.op.vjp is not None:
            return list(self.op.vjp(xs, g, node.attrs, ctx))
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(i in self.op.diff_inputs) for i, x in enumerate(xs)]
            y = self.op.forward(leaves, node.attrs, ctx)
            wanted = [leaves[i] for i in self.op.diff_inputs]
            out = torch.autograd.grad(y, wanted, g, allow_unused=True)
        return [o if o is not None else torch.zeros_like(w) for o, w in zip(out, wanted)]


def _softmax(inputs, attrs, ctx):
    return torch.softmax(inputs[0], dim=attrs["dim"])


def _rms_normalize(inputs, attrs, ctx):
    x = inputs[0]
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + attrs["eps"])


def _rms_normalize_vjp(inputs, g, attrs, ctx):
    """y = x r with r = (mean(x^2) + eps)^(-1/2): dx = r g - r^3 x mean(g x)."""
    x = inputs[0]
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + attrs["eps"])
    return [r * g - r.pow(3) * x * (g * x).mean(-1, keepdim=True)]


def _layer_normalize(inputs, attrs, ctx):
    x = inputs[0]
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + attrs["eps"])


ROPE_SCALING_KINDS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are rescaled for a longer context than pretraining saw.
    linear: every frequency / factor. llama3 (Llama 3.1): wavelengths shorter than
    original_max_position / high_freq_factor are kept, longer than original_max_position /
    low_freq_factor divided by factor, and those between interpolated smoothly."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_SCALING_KINDS:
            raise HSPMDError(f"RoPE scaling {self.kind!r} is not supported; supported: {', '.join(ROPE_SCALING_KINDS)}")
        if not self.factor > 0 or (self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0):
            raise HSPMDError(f"RoPE scaling {self}: needs factor > 0 and high_freq_factor > low_freq_factor > 0")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        if self.kind == "linear":
            return inv_freq / self.factor
        wavelength = 2 * math.pi / inv_freq
        long_limit = self.original_max_position / self.low_freq_factor
        short_limit = self.original_max_position / self.high_freq_factor
        smooth = (self.original_max_position / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelength > long_limit, inv_freq / self.factor, between)
        return torch.where(wavelength < short_limit, inv_freq, scaled)


def rope_inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """base^(-2i/head_dim) for i < head_dim/2, in float64, rescaled by `scaling`."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return scaling.scale(inv) if scaling is not None else inv


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float, dtype,
                  scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = rope_inverse_frequencies(head_dim, base, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@functools.lru_cache(maxsize=64)
def _position_tables(start: int, length: int, head_dim: int, base: float, dtype, scaling: RopeScaling | None,
                     device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions start..start+length-1 (read-only: every call's shapes share them).
    Kept, as every layer of every micro-batch asks for the same ones and computing them in float64
    cost ~0.15 ms a call on this CPU."""
    return rotary_tables(torch.arange(start, start + length, device=device), head_dim, base, dtype, scaling)


def _rotary_tables_for(inputs, attrs, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin shaped to multiply this piece of x: from positions given per token (packed
    rows, restarting at each sequence), or from x's place along the sequence dim."""
    x = inputs[0]
    scaling = RopeScaling(*attrs["scaling"]) if attrs.get("scaling") else None
    if len(inputs) == 2:
        inv = rope_inverse_frequencies(x.shape[-1], attrs["base"], scaling).to(x.device)
        angles = inputs[1].to(torch.float64) * inv
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    seq_dim = attrs["seq_dim"]
    start = ctx.in_box(0)[seq_dim][0]
    cos, sin = _position_tables(start, x.shape[seq_dim], x.shape[-1], attrs["base"], x.dtype, scaling, str(x.device))
    view = [1] * x.dim()
    view[seq_dim], view[-1] = x.shape[seq_dim], x.shape[-1]
    return cos.reshape(view), sin.reshape(view)


def _rotary(inputs, attrs, ctx):
    x = inputs[0]
    cos, sin = _rotary_tables_for(inputs, attrs, ctx)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _rotary_vjp(inputs, g, attrs, ctx):
    """y = x cos + rot(x) sin with rot(x) = [-x2, x1]; rot's transpose maps [z1, z2] to [z2, -z1]:
    dx = g cos + rot^T(g sin) (positions get no gradient)."""
    cos, sin = _rotary_tables_for(inputs, attrs, ctx)
    half = g.shape[-1] // 2
    z = g * sin
    return [g * cos + torch.cat([z[..., half:], -z[..., :half]], dim=-1)]


def _attention_probabilities(inputs) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) over the keys a query may see: earlier ones, and with packed rows
    (a fourth input of sequence ids) only those of its own sequence (block-diagonal causal)."""
    q, k = inputs[:2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = q.shape[-2]
    hidden = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    if len(inputs) == 4:
        ids = inputs[3][..., 0]
        hidden = hidden | (ids.unsqueeze(-1) != ids.unsqueeze(-2))
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)


def _causal_attention(inputs, attrs, ctx):
    return torch.matmul(_attention_probabilities(inputs), inputs[2])


def _causal_attention_vjp(inputs, g, attrs, ctx):
    """o = p v with p = softmax(s), s = q k^T / sqrt(d): dv = p^T g, dp = g v^T,
    ds = p (dp - rowsum(dp p)), dq = ds k / sqrt(d), dk = ds^T q / sqrt(d) (hidden keys have p = 0,
    so ds = 0 there)."""
    q, k, v = inputs[:3]
    p = _attention_probabilities(inputs)
    dp = torch.matmul(g, v.transpose(-1, -2))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return [torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), torch.matmul(p.transpose(-1, -2), g)]


SOFTMAX = Fused("softmax", _softmax, whole_dims=lambda attrs: (attrs["dim"],))
RMS_NORMALIZE = Fused("rms_normalize", _rms_normalize, whole_dims=(-1,), vjp=_rms_normalize_vjp)
LAYER_NORMALIZE = Fused("layer_normalize", _layer_normalize, whole_dims=(-1,))
ROTARY = Fused("rotary", _rotary, whole_dims=(-1,), linear=True, vjp=_rotary_vjp)
CAUSAL_ATTENTION = Fused("causal_attention", _causal_attention, whole_dims=(-2, -1), diff_inputs=(0, 1, 2),
                         vjp=_causal_attention_vjp)
PACKED_ROTARY = Fused("packed_rotary", _rotary, whole_dims=(-1,), vjp=_rotary_vjp)
PACKED_ATTENTION = Fused("packed_attention", _causal_attention, whole_dims=(-2, -1), diff_inputs=(0, 1, 2),
                         vjp=_causal_attention_vjp)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    dim = normalize_dim(dim, x.ndim, "softmax")
    return make(SOFTMAX, [x], [(x.shape, x.dtype)], attrs={"dim": dim}).output


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """x / rms(x) * weight over the last dim (which must be whole on each device)."""
    return mul(make(RMS_NORMALIZE, [x], [(x.shape, x.dtype)], attrs={"eps": eps}).output, weight)


def layernorm(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    y = mul(make(LAYER_NORMALIZE, [x], [(x.shape, x.dtype)], attrs={"eps": eps}).output, weight)
    return add(y, bias) if bias is not None else y


def rotary(x: Tensor, seq_dim: int = 1, base: float = 10000.0, scaling: RopeScaling | None = None,
           positions: Tensor | None = None) -> Tensor:
    """Rotary position embedding (rotate-half form) of x[..., head_dim]; `scaling` rescales the
    frequencies. Without `positions`, a token's position is its global index along `seq_dim`, so
    a sequence split stays exact. With `positions` (integers shaped like x with size 1 on its head
    dims, e.g. [batch, seq, 1, 1]), each token takes its own: packed rows restart them at every
    sequence."""
    seq_dim = normalize_dim(seq_dim, x.ndim, "rotary")
    if isinstance(x.shape[-1], int) and x.shape[-1] % 2:
        raise ShapeError(f"rotary: head dim {x.shape[-1]} of {x.name} must be even")
    attrs = {"seq_dim": seq_dim, "base": base, "scaling": astuple(scaling) if scaling else None}
    if positions is None:
        return make(ROTARY, [x], [(x.shape, x.dtype)], attrs=attrs).output
    _check_token_map("rotary", "positions", positions, x, keep=range(x.ndim - 2))
    return make(PACKED_ROTARY, [x, positions], [(x.shape, x.dtype)], attrs=attrs).output


def _check_token_map(op: str, what: str, t: Tensor, like: Tensor, keep) -> None:
    """`t` must be an integer tensor shaped like `like` on the dims in `keep` and 1 elsewhere."""
    want = tuple(d if i in keep else 1 for i, d in enumerate(like.shape))
    if t.dtype not in (torch.int64, torch.int32) or t.ndim != like.ndim or \
            not all(same_dim(a, b) for a, b in zip(t.shape, want)):
        raise ShapeError(f"{op}: {what} {t.name} must be an integer tensor of shape {format_shape(want)}, "
                         f"got {format_shape(t.shape)} {t.dtype}")


def causal_attention(q: Tensor, k: Tensor, v: Tensor, segments: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v on [batch, heads, seq, head_dim]; batch and heads
    may be split, the sequence and head dims must be whole on each device. `segments`
    ([batch, 1, seq, 1] integers) marks which sequence of a packed row each token belongs to: the
    mask is then block-diagonal causal, no token attending across a sequence boundary."""
    for t in (k, v):
        if t.ndim != 4 or q.ndim != 4 or not all(same_dim(a, b) for a, b in zip(q.shape, t.shape)):
            raise ShapeError(f"causal_attention: q {format_shape(q.shape)}, k/v {format_shape(t.shape)} must be "
                             f"equal [batch, heads, seq, head_dim]")
    if segments is None:
        return make(CAUSAL_ATTENTION, [q, k, v], [(q.shape, q.dtype)]).output
    _check_token_map("causal_attention", "segments", segments, q, keep=(0, 2))
    return make(PACKED_ATTENTION, [q, k, v, segments], [(q.shape, q.dtype)]).output


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return mul(silu(gate), up)


# ---------------------------------------------------------------- cross entropy


IGNORE_INDEX = -100


class CrossEntropy(RuleOp):
    """Sum (or mean over the global token count) of token losses; the class dim must be whole.
    Tokens labelled IGNORE_INDEX (padding) add nothing to the loss or its gradient."""

    kind = "cross_entropy"

    def rule(self, node: Node):
        last = node.inputs[0].ndim - 1
        with_grad = len(node.inputs) == 3

        def rule(axes):
            la, ya = axes[0], axes[1]
            ga = axes[2] if with_grad else Duplicate(la.n)
            if isinstance(la, Split) and la.dim == last:
                raise Mismatch("the class dim of the logits is split; gather it with comm() first")
            if isinstance(la, Partial) or isinstance(ya, Partial):
                raise Mismatch("logits and labels must not be partial")
            if isinstance(la, Split) or isinstance(ya, Split):
                if not (isinstance(la, Split) and isinstance(ya, Split) and la.dim == ya.dim):
                    raise Mismatch("logits and labels must be split alike")
                if isinstance(ga, Partial):
                    raise Mismatch("the loss gradient is partial where logits are split")
                return (Split(la.dim, la.n), 0) if with_grad else (Partial(la.n), None)
            return ga, None

        return rule

    def _count(self, node, ctx) -> float:
        if node.attrs["reduction"] == "sum":
            return 1.0
        n = 1
        for d in ctx.in_shape(1):
            n *= d
        return float(max(n, 1))

    def compute(self, node, ctx, inputs):
        logits, labels = inputs[0], inputs[1]
        flat = logits.reshape(-1, logits.shape[-1])
        if len(inputs) == 2:
            loss = F.cross_entropy(flat, labels.reshape(-1), reduction="sum", ignore_index=IGNORE_INDEX) if flat.shape[0] else \
                torch.zeros((), dtype=logits.dtype, device=logits.device)
            return [loss / self._count(node, ctx)]
        g = inputs[2]
        probs = torch.softmax(flat, dim=-1)
        ids = labels.reshape(-1)
        counted = (ids != IGNORE_INDEX).unsqueeze(-1)
        # minus one at each counted label, zero rows for ignored ones (no data-dependent shapes)
        probs.scatter_add_(-1, ids.clamp(min=0).unsqueeze(-1), -counted.to(probs.dtype))
        probs = probs * counted
        return [(probs * (g / self._count(node, ctx))).reshape(logits.shape)]

    def gradient(self, node, grads):
        logits, labels = node.inputs
        g = make(CROSS_ENTROPY_GRAD, [logits, labels, grads[0]], [(logits.shape, logits.dtype)], attrs=node.attrs)
        return [g.output, None]

    def describe(self, node):
        return f"reduction={node.attrs['reduction']}"


class CrossEntropyGrad(CrossEntropy):
    kind = "cross_entropy_grad"


CROSS_ENTROPY, CROSS_ENTROPY_GRAD = CrossEntropy(), CrossEntropyGrad()


def cross_entropy(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Scalar loss of logits [..., classes] against integer labels [...]."""
    if reduction not in ("sum", "mean"):
        raise ShapeError(f"cross_entropy: reduction must be 'sum' or 'mean', got {reduction!r}")
    if labels.ndim != logits.ndim - 1 or not all(same_dim(a, b) for a, b in zip(logits.shape, labels.shape)):
        raise ShapeError(f"cross_entropy: labels {format_shape(labels.shape)} must match logits "
                         f"{format_shape(logits.shape)} without the class dim")
    return make(CROSS_ENTROPY, [logits, labels], [((), logits.dtype)], attrs={"reduction": reduction}).output


__all__ = [
    "IGNORE_INDEX", "RopeScaling", "causal_attention", "cross_entropy", "embedding", "layernorm", "rmsnorm", "rope_inverse_frequencies",
    "rotary", "rotary_tables", "softmax", "swiglu",
]
