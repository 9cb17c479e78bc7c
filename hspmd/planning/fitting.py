"""Least squares with non-negative coefficients, the one fit behind the cost model's measured
constants (calibration's kernel efficiencies and overheads, per op kind and per step; mixed-length
dispatch's per-sequence cost): every coefficient is a time per unit of work, so none may be
negative. And the one summary of repeated timings (`typical`)."""

from __future__ import annotations

import statistics
from typing import Iterable, Sequence

import numpy as np

from hspmd.errors import HSPMDValueError


TRIM = 0.1  # the share of repeated timings dropped at each end before they are averaged


def typical(values: Iterable[float], trim: float = TRIM) -> float:
    """The trimmed mean of repeated timings: the lowest and highest `trim` of them dropped (a rare
    hiccup, a lucky run), the rest averaged. Not the median: a host that switches between speeds
    (this 2-core machine runs a core ~1.6x slower some seconds, at random) gives timings from
    two modes, whose median jumps from one mode to the other as their mix passes one half while
    the mean moves with the mix, so that probes and the steps they price, timed at other moments
    of one run, agree; and a job's length is its steps' mean."""
    ordered = sorted(values)
    if not ordered:
        raise HSPMDValueError("typical: no timings")
    cut = int(len(ordered) * trim)
    return statistics.fmean(ordered[cut:len(ordered) - cut])


def nonnegative_least_squares(rows: Sequence[Sequence[float]], values: Sequence[float]) -> tuple[float, ...]:
    """The coefficients c >= 0 minimising |rows @ c - values|^2 (Lawson and Hanson's active-set
    method: add the term whose gradient most wants to grow, refit the free terms, step back to
    the boundary whenever a free term would turn negative; the problem is convex, so the
    stationary point it stops at is the optimum). Columns are scaled to unit norm first, since
    a calibration mixes terms in seconds of roofline with counts of instructions. All zeros when
    no term helps."""
    a, y = np.array(rows, dtype=np.float64), np.array(values, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != y.shape[0]:
        raise HSPMDValueError(f"nonnegative_least_squares: {a.shape} rows against {y.shape} values")
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    terms = a.shape[1]
    x = np.zeros(terms)
    free = np.zeros(terms, dtype=bool)
    tolerance = 1e-12 * max(1.0, float(np.abs(a.T @ y).max(initial=0.0)))
    for _ in range(3 * terms + 3):
        gradient = a.T @ (y - a @ x)
        gradient[free] = -np.inf
        if not np.any(~free) or gradient.max() <= tolerance:
            break
        free[int(gradient.argmax())] = True
        while True:
            trial = np.zeros(terms)
            trial[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
            if np.all(trial[free] > 0):
                x = trial
                break
            blocked = free & (trial <= 0)
            step = np.min(x[blocked] / (x[blocked] - trial[blocked]))
            x = x + step * (trial - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return tuple(float(v) for v in x / norms)


__all__ = ["nonnegative_least_squares"]
