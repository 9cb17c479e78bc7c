"""Each op's local compute and IR gradient against torch autograd, on one device."""

import pytest
import torch
import torch.nn.functional as F

import hspmd.ops as O
from hspmd.ir import Binding, placeholder, symbols
from hspmd.ops import Graph
from hspmd.ops.nn import RopeScaling, rope_inverse_frequencies
from hspmd.backends.local import run_on_devices
from hspmd.specialize.deduce import deduce
from hspmd.specialize.executable import instantiate
from hspmd.runtime.execution.interpreter import run_ops
from hspmd.runtime.execution.run import DeviceState, run_forward


def _run_single(graph, feeds, fetch, binding=Binding()):
    exe = instantiate(deduce(graph, 0), 0, binding, fetches=fetch)
    state = DeviceState.initial(exe)

    def body(backend):
        mb = run_forward(exe, backend, state, feeds, binding)
        env = mb.env
        run_ops(mb.passes.backward, backend, state, env)
        return {t.name: env[t.id] for t in fetch}

    return run_on_devices(body, [0])[0]


def _rope_ref(x, seq_dim, factor=1.0):
    s, d = x.shape[seq_dim], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) / factor
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    shape = [1] * x.dim()
    shape[seq_dim], shape[-1] = s, d
    cos, sin = ang.cos().float().reshape(shape), ang.sin().float().reshape(shape)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def _attn_ref(q, k, v):
    s = q.shape[-2]
    a = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return a.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v


CASES = {
    "add_broadcast": ([(3, 4, 5), (5,)], lambda a, b: a + b, lambda a, b: a + b),
    "sub": ([(3, 4), (3, 4)], lambda a, b: a - b, lambda a, b: a - b),
    "mul_broadcast": ([(3, 4), (1, 4)], lambda a, b: a * b, lambda a, b: a * b),
    "div": ([(3, 4), (3, 4)], lambda a, b: a / (b * b + 1.0), lambda a, b: a / (b * b + 1.0)),
    "scale_neg": ([(3, 4)], lambda a: -(a * 0.5) - 2.0, lambda a: -(a * 0.5) - 2.0),
    "matmul_3d": ([(2, 3, 4), (4, 5)], lambda a, b: a @ b, lambda a, b: a @ b),
    "matmul_batched": ([(2, 3, 4), (2, 4, 5)], lambda a, b: a @ b, lambda a, b: a @ b),
    "sum_mean": ([(3, 4, 5)], lambda a: a.sum(1) + a.mean((0, 1), keepdim=True).sum(0),
                 lambda a: a.sum(1) + a.mean((0, 1), keepdim=True).sum(0)),
    "reshape_transpose": ([(2, 3, 4)], lambda a: O.transpose(O.reshape(a, (6, 2, 2)), 0, 2) * 3.0,
                          lambda a: a.reshape(6, 2, 2).transpose(0, 2) * 3.0),
    "silu_relu_exp": ([(3, 4)], lambda a: O.silu(a) + O.relu(a) * O.exp(a * 0.1),
                      lambda a: F.silu(a) + torch.relu(a) * torch.exp(a * 0.1)),
    "softmax": ([(3, 4)], lambda a: O.softmax(a, 0), lambda a: torch.softmax(a, 0)),
    "rmsnorm": ([(2, 3, 8), (8,)], lambda a, w: O.rmsnorm(a, w), lambda a, w: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * w),
    "layernorm": ([(2, 3, 8), (8,), (8,)], lambda a, w, b: O.layernorm(a, w, b), lambda a, w, b: F.layer_norm(a, (8,), w, b)),
    "rotary": ([(2, 5, 3, 8)], lambda a: O.rotary(a, 1), lambda a: _rope_ref(a, 1)),
    "cast_bf16_round_trip": ([(3, 4)], lambda a: O.cast(O.cast(a, torch.bfloat16) * 2.0, torch.float32),
                             lambda a: (a.bfloat16() * 2.0).float()),
    "rotary_linear_scaling": ([(2, 5, 3, 8)], lambda a: O.rotary(a, 1, scaling=RopeScaling("linear", 4.0)),
                              lambda a: _rope_ref(a, 1, factor=4.0)),
    "repeat_interleave_group_sum": ([(2, 3, 4), (2, 6, 4)],
                                    lambda a, b: O.repeat_interleave(a, 2, 1) * O.repeat_interleave(O.group_sum(b, 2, 1), 2, 1),
                                    lambda a, b: a.repeat_interleave(2, 1) * b.unflatten(1, (3, 2)).sum(2).repeat_interleave(2, 1)),
    "attention": ([(2, 2, 5, 4)] * 3, lambda q, k, v: O.causal_attention(q, k, v), _attn_ref),
    "swiglu": ([(3, 4), (3, 4)], lambda a, b: O.swiglu(a, b), lambda a, b: F.silu(a) * b),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_value_and_gradient_match_torch(case):
    shapes, ours, theirs = CASES[case]
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    g = Graph()
    xs = [placeholder(g, f"x{i}", s, annotation="@[0]") for i, s in enumerate(shapes)]
    y = ours(*xs)
    weight = placeholder(g, "weight", y.shape, annotation="@[0]")
    loss = O.reduce_sum(y * weight)
    grads = O.gradients(loss, xs)
    w_value = torch.randn(tuple(y.shape), generator=gen)
    got = _run_single(g, {**{f"x{i}": v for i, v in enumerate(values)}, "weight": w_value}, [y] + grads)
    leaves = [v.clone().requires_grad_(True) for v in values]
    ref = theirs(*leaves)
    (ref * w_value).sum().backward()
    torch.testing.assert_close(got[y.name], ref.detach(), rtol=1e-5, atol=1e-5)
    for _x, leaf, gx in zip(xs, leaves, grads):
        torch.testing.assert_close(got[gx.name], leaf.grad, rtol=1e-4, atol=1e-5)


def test_embedding_and_cross_entropy_gradients_match_torch():
    (B,) = symbols("B")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 10, (B_value := 4, 3), generator=gen)
    labels = torch.randint(0, 10, (B_value, 3), generator=gen)
    table = torch.randn(10, 6, generator=gen)
    head = torch.randn(6, 10, generator=gen)
    g = Graph()
    t_ids = placeholder(g, "ids", (B, 3), torch.int64, annotation="@[0]")
    t_lab = placeholder(g, "labels", (B, 3), torch.int64, annotation="@[0]")
    t_tab = placeholder(g, "table", (10, 6), annotation="@[0]")
    t_head = placeholder(g, "head", (6, 10), annotation="@[0]")
    loss = O.cross_entropy(O.embedding(t_ids, t_tab) @ t_head, t_lab, reduction="mean")
    g_tab, g_head = O.gradients(loss, [t_tab, t_head])
    got = _run_single(g, {"ids": ids, "labels": labels, "table": table, "head": head}, [loss, g_tab, g_head],
                      Binding.of({"B": B_value}))
    tab, hd = table.clone().requires_grad_(True), head.clone().requires_grad_(True)
    ref = F.cross_entropy((tab[ids] @ hd).reshape(-1, 10), labels.reshape(-1))
    ref.backward()
    torch.testing.assert_close(got[loss.name], ref.detach())
    torch.testing.assert_close(got[g_tab.name], tab.grad)
    torch.testing.assert_close(got[g_head.name], hd.grad)


def test_llama3_rope_scaling_keeps_short_divides_long_and_blends_between():
    """Llama 3.1's rule on the inverse frequencies, band by band (original context 32 positions,
    low/high frequency factors 1 and 4: wavelengths below 8 kept, above 32 divided by 8)."""
    base = rope_inverse_frequencies(16, 10000.0)
    scaled = rope_inverse_frequencies(16, 10000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 32))
    wavelength = 2 * torch.pi / base
    short, long = wavelength < 8, wavelength > 32
    assert short.any() and long.any() and (~short & ~long).any()
    torch.testing.assert_close(scaled[short], base[short])
    torch.testing.assert_close(scaled[long], base[long] / 8)
    middle = ~short & ~long
    assert ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()


class _Piece:
    """A local piece starting at `start` along every dim (as a context-parallel rank's)."""

    def __init__(self, shape, start):
        self.shape, self.start = shape, start

    def in_box(self, i):
        return tuple((self.start, self.start + n) for n in self.shape)


@pytest.mark.parametrize("op_name, attrs, shape, start", [
    ("RMS_NORMALIZE", {"eps": 1e-6}, (3, 5, 16), 0),
    ("ROTARY", {"base": 10000.0, "seq_dim": 2}, (2, 3, 7, 8), 0),
    ("ROTARY", {"base": 10000.0, "seq_dim": 1, "scaling": ("linear", 4.0)}, (2, 9, 4), 5),  # a later sequence piece
    ("PACKED_ROTARY", {"base": 500.0}, (2, 6, 8), 0),
    ("CAUSAL_ATTENTION", {}, (2, 3, 7, 8), 0),
    ("PACKED_ATTENTION", {}, (2, 3, 9, 4), 0),
])
def test_closed_form_gradients_equal_autograd_through_the_forward(op_name, attrs, shape, start):
    """RMS norm's and RoPE's backward ops run a closed-form vector-Jacobian product, not autograd
    through a recomputed forward; both give the same gradient (float64, to rounding)."""
    import hspmd.ops.nn as nn

    op = getattr(nn, op_name)
    assert op.vjp is not None
    gen = torch.Generator().manual_seed(len(shape) + start)
    x = torch.randn(*shape, dtype=torch.float64, generator=gen)
    g = torch.randn(*shape, dtype=torch.float64, generator=gen)
    xs = [x] + [torch.randn(*shape, dtype=torch.float64, generator=gen) for i in op.diff_inputs[1:]]
    extra = []
    if op_name == "PACKED_ROTARY":  # positions per token
        extra = [torch.randint(0, 6, shape[:-1] + (1,), generator=gen)]
    elif op_name == "PACKED_ATTENTION":  # sequence ids per token, sorted: packed sequences side by side
        extra = [torch.randint(0, 3, shape[:-1] + (1,), generator=gen).sort(dim=-2).values]
    ctx = _Piece(shape, start)
    closed = op.vjp(xs + extra, g, attrs, ctx)
    with torch.enable_grad():
        leaves = [t.clone().requires_grad_(True) for t in xs]
        auto = torch.autograd.grad(op.forward(leaves + extra, attrs, ctx), leaves, g)
    assert len(closed) == len(op.diff_inputs)
    for mine, theirs in zip(closed, auto):
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
        assert mine.abs().max() > 0.01  # not a vacuous zero gradient
