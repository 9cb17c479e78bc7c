"""Least squares with non-negative coefficients, the one fit behind the cost model's measured
constants (calibration's kernel efficiencies and overheads, per op kind and per step; mixed-length
dispatch's per-sequence cost): every coefficient is a time per unit of work, so none may be
negative."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hspmd.errors import HSPMDValueError


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
