"""Least squares with non-negative coefficients, the one fit behind the cost model's measured
constants (calibration's kernel efficiency and overheads, mixed-length dispatch's per-sequence
cost): every coefficient is a time per unit of work, so none may be negative."""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np


def nonnegative_least_squares(rows: Sequence[Sequence[float]], values: Sequence[float]) -> tuple[float, ...]:
    """The coefficients c >= 0 minimising |rows @ c - values|^2: the best fit over the subsets of
    terms whose unconstrained fit is non-negative (an exhaustive active-set search, meant for a
    handful of terms: 2^terms - 1 subsets). All zeros when no subset fits non-negatively."""
    x, y = np.array(rows, dtype=np.float64), np.array(values, dtype=np.float64)
    terms = x.shape[1]
    best, best_error = np.zeros(terms), float(np.sum(y * y))
    for subset in itertools.chain.from_iterable(itertools.combinations(range(terms), k) for k in range(1, terms + 1)):
        cols = list(subset)
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if np.all(coef >= 0):
            error = float(np.sum((x[:, cols] @ coef - y) ** 2))
            if error < best_error:
                best, best_error = np.zeros(terms), error
                best[cols] = coef
    return tuple(float(v) for v in best)


__all__ = ["nonnegative_least_squares"]
