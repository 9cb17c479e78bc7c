"""How the gradients of one all-reduce group are grouped into buckets: pure sizing, shared by the
runtime (hspmd.runtime.execution.buckets runs them) and the simulator (hspmd.planning.device_sim prices
them), so that both see the same buckets."""

from __future__ import annotations

from typing import Sequence

DEFAULT_BUCKET_CAP_MB = 25.0
MiB = 1 << 20
MIN_BUCKETS = 4  # per group, where the cap allows: the first can start while the backward still runs
MIN_BUCKET_BYTES = MiB


def chain_cap(total_bytes: float, cap_bytes: float) -> float:
    """The cap a group's buckets fill to: `cap_bytes`, or less when the group's gradients fit in
    fewer than MIN_BUCKETS buckets of it (a model smaller than the cap would otherwise sync in one
    bucket after the whole backward, with nothing left to overlap), but never under
    MIN_BUCKET_BYTES (each all-reduce pays a latency)."""
    return min(cap_bytes, max(MIN_BUCKET_BYTES, -(-total_bytes // MIN_BUCKETS)))


def fill_buckets(sizes: Sequence[float], cap_bytes: float) -> list[list[int]]:
    """Indices of `sizes` (bytes, in the order the gradients become final) per bucket, filled
    greedily to chain_cap(sum(sizes), cap_bytes); a gradient larger than it is a bucket alone."""
    cap = chain_cap(sum(sizes), cap_bytes)
    buckets: list[list[int]] = []
    size = 0.0
    for i, nbytes in enumerate(sizes):
        if buckets and buckets[-1] and size + nbytes <= cap:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


__all__ = ["DEFAULT_BUCKET_CAP_MB", "MiB", "MIN_BUCKETS", "MIN_BUCKET_BYTES", "chain_cap", "fill_buckets"]
