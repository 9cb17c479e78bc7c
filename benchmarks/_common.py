"""Helpers shared by the multi-process benchmarks: aligned per-rank timing and plain-text tables.

Benchmarks import hspmd through its submodules only (never `from hspmd import ...`), so they run
from any directory whatever the install mode.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from hspmd.backends.backend import Backend


def timed_on_world(backend: Backend, fn: Callable[[], object]) -> tuple[float, object]:
    """Seconds this rank spends in fn(), every rank starting together (a world barrier first)."""
    backend.barrier(tuple(range(backend.world_size)))
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def slowest_rank_median(per_rank: Sequence[Sequence[float]]) -> float:
    """Median over repetitions of the slowest rank's time: a step or reshard ends when its last rank does."""
    return statistics.median(max(times) for times in zip(*per_rank))


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


__all__ = ["ms", "slowest_rank_median", "table", "timed_on_world"]
