"""The same small Llama in plain torch on one device: the independent reference that every
parallel strategy is checked against (it shares nothing with hspmd but the parameter names).

Grouped-query attention follows from the shapes of wk/wv, head_dim from wq's, tied embeddings
from a missing lm_head; rope_scaling is a plain dict like Hugging Face's (rope_type linear or
llama3 with factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inverse_frequencies(d, base, scaling):
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if not scaling:
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    old, low, high = scaling["original_max_position_embeddings"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for f in inv.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < old / high:
            out.append(f)
        elif wavelength > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def _rope(x, base, scaling=None):
    """x: [batch, seq, heads, head_dim]; rotate-half form with positions 0..seq-1."""
    s, d = x.shape[1], x.shape[-1]
    inv = _inverse_frequencies(d, base, scaling)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(x.dtype)[None, :, None, :], ang.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(params: dict[str, torch.Tensor], tokens: torch.Tensor, layers: int, heads: int,
                     eps: float = 1e-6, rope_base: float = 10000.0, rope_scaling: dict | None = None):
    b, s = tokens.shape
    x = params["embed"][tokens]
    for l in range(layers):
        def p(n):
            return params[f"layers.{l}.{n}"]
        h = _rmsnorm(x, p("attn_norm"), eps)
        hd = p("wq").shape[1] // heads
        kv = p("wk").shape[1] // hd
        q = _rope((h @ p("wq")).view(b, s, heads, hd), rope_base, rope_scaling).transpose(1, 2)
        k = _rope((h @ p("wk")).view(b, s, kv, hd), rope_base, rope_scaling).transpose(1, 2)
        v = (h @ p("wv")).view(b, s, kv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + o @ p("wo")
        m = _rmsnorm(x, p("mlp_norm"), eps)
        x = x + (F.silu(m @ p("w_gate")) * (m @ p("w_up"))) @ p("w_down")
    head = params["lm_head"] if "lm_head" in params else params["embed"].t()
    return _rmsnorm(x, params["final_norm"], eps) @ head


def reference_loss(params: dict[str, torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor, layers: int,
                   heads: int, eps: float = 1e-6, rope_base: float = 10000.0, tokens_per_step: int | None = None,
                   rope_scaling: dict | None = None, compute_dtype: torch.dtype = torch.float32):
    """Sum of token cross-entropies / tokens_per_step (default: the tokens given). Mixed precision:
    the parameters are used as compute_dtype copies, the logits return to float32 for the loss."""
    compute = {k: v.to(compute_dtype) for k, v in params.items()}
    logits = reference_logits(compute, tokens, layers, heads, eps, rope_base, rope_scaling).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return loss / (tokens_per_step or tokens.numel())


def reference_sequences_loss(params: dict[str, torch.Tensor], samples, layers: int, heads: int, **kw):
    """Token-weighted loss of separate sequences [(tokens, labels) 1-D pairs], each run alone:
    the sum of every token's cross-entropy over the total token count."""
    total = sum(len(t) for t, _ in samples)
    return sum(reference_loss(params, t[None], y[None], layers, heads, tokens_per_step=total, **kw) for t, y in samples)


def reference_training(params: dict[str, torch.Tensor], batches, layers: int, heads: int, steps: int,
                       lr: float, betas=(0.9, 0.999), eps_adam: float = 1e-8, weight_decay: float = 0.0,
                       rope_scaling: dict | None = None, compute_dtype: torch.dtype = torch.float32):
    """Train with torch.optim.AdamW; `batches(step)` gives (tokens, labels) of the whole step, or a
    list of separate (tokens, labels) sequences (token-weighted, see reference_sequences_loss).
    Returns per step (loss, {name: grad}) and the final parameters."""
    ps = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(list(ps.values()), lr=lr, betas=betas, eps=eps_adam, weight_decay=weight_decay)
    history = []
    for step in range(steps):
        batch = batches(step)
        opt.zero_grad()
        if isinstance(batch, list):
            loss = reference_sequences_loss(ps, batch, layers, heads, rope_scaling=rope_scaling, compute_dtype=compute_dtype)
        else:
            loss = reference_loss(ps, batch[0], batch[1], layers, heads, rope_scaling=rope_scaling,
                                  compute_dtype=compute_dtype)
        loss.backward()
        history.append((loss.item(), {k: v.grad.clone() for k, v in ps.items()}))
        opt.step()
    return history, {k: v.detach().clone() for k, v in ps.items()}


__all__ = ["reference_logits", "reference_loss", "reference_sequences_loss", "reference_training"]
