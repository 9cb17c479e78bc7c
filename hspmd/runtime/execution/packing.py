"""Packed rows: several sequences back to back in one row of a micro-batch (pure data prep).

A sequence is a pair (tokens, labels) of equal-length 1-D integer tensors. A packed row carries,
besides tokens and labels, each token's position inside its own sequence (RoPE restarts there)
and a segment id (which sequence it belongs to; attention never crosses a segment boundary).
Padding, when a row must reach a fixed length, is one more segment whose labels are IGNORE_INDEX,
so it changes neither the loss nor any gradient of the real tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hspmd.errors import HSPMDError
from hspmd.ops.nn import IGNORE_INDEX

Sample = tuple[torch.Tensor, torch.Tensor]
PACKED_FIELDS = ("tokens", "labels", "positions", "segments")


def check_sample(sample: Sample, where: str) -> int:
    """The length of one (tokens, labels) sequence, after checking its form."""
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise HSPMDError(f"{where}: a sequence is a (tokens, labels) pair, got {type(sample).__name__}")
    tokens, labels = sample
    if tokens.dim() != 1 or tuple(labels.shape) != tuple(tokens.shape) or len(tokens) == 0:
        raise HSPMDError(f"{where}: tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} must be "
                         f"equal non-empty 1-D tensors")
    return len(tokens)


def pack_row(samples: Sequence[Sample], length: int | None = None) -> dict[str, torch.Tensor]:
    """One row [1, length] holding `samples` in order (length: default their total; more pads)."""
    if not samples:
        raise HSPMDError("pack_row: no sequences to pack")
    lengths = [check_sample(s, f"pack_row sequence {i}") for i, s in enumerate(samples)]
    total = sum(lengths)
    length = total if length is None else length
    if length < total:
        raise HSPMDError(f"pack_row: {len(samples)} sequences of {total} tokens do not fit in a row of {length}")
    parts = {k: [] for k in PACKED_FIELDS}
    for i, ((tokens, labels), n) in enumerate(zip(samples, lengths)):
        parts["tokens"].append(tokens.to(torch.int64))
        parts["labels"].append(labels.to(torch.int64))
        parts["positions"].append(torch.arange(n))
        parts["segments"].append(torch.full((n,), i, dtype=torch.int64))
    if length > total:
        pad = length - total
        parts["tokens"].append(torch.zeros(pad, dtype=torch.int64))
        parts["labels"].append(torch.full((pad,), IGNORE_INDEX, dtype=torch.int64))
        parts["positions"].append(torch.arange(pad))
        parts["segments"].append(torch.full((pad,), len(samples), dtype=torch.int64))
    return {k: torch.cat(v).unsqueeze(0) for k, v in parts.items()}


def pad_rows(samples: Sequence[Sample], length: int) -> dict[str, torch.Tensor]:
    """The padding baseline: one sequence per row, each padded to `length` ([len(samples), length])."""
    rows = [pack_row([s], length) for s in samples]
    return {k: torch.cat([r[k] for r in rows]) for k in PACKED_FIELDS}


def counted_tokens(samples: Sequence[Sample]) -> int:
    """Tokens whose label counts in the loss (the T of a token-weighted step)."""
    return sum(int((labels != IGNORE_INDEX).sum()) for _, labels in samples)


__all__ = ["PACKED_FIELDS", "Sample", "check_sample", "counted_tokens", "pack_row", "pad_rows"]
