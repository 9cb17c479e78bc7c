"""The one non-negative least-squares fit behind the cost model's measured constants, against an
exhaustive search over which terms are free (the optimum of a convex problem is the best of the
subsets whose unconstrained fit is non-negative)."""

import itertools
import statistics
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.errors import HSPMDError
from hspmd.planning.fitting import nonnegative_least_squares, typical


def best_over_subsets(rows, values) -> float:
    x, y = np.array(rows, dtype=np.float64), np.array(values, dtype=np.float64)
    best = float(y @ y)
    for k in range(1, x.shape[1] + 1):
        for cols in map(list, itertools.combinations(range(x.shape[1]), k)):
            coef = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            if np.all(coef >= 0):
                best = min(best, float(np.sum((x[:, cols] @ coef - y) ** 2)))
    return best


@st.composite
def problems(draw):
    """A design of 1-5 terms on very different scales (seconds of roofline beside counts) and
    values, noisy or made from non-negative coefficients."""
    terms, n = draw(st.integers(1, 5)), draw(st.integers(1, 10))
    scales = [draw(st.sampled_from([1e-6, 1.0, 1e3])) for _ in range(terms)]
    entry = st.floats(-2, 2, allow_nan=False).map(lambda v: round(v, 3))
    rows = [[draw(entry) * s for s in scales] for _ in range(n)]
    if draw(st.booleans()):
        values = [draw(entry) for _ in range(n)]
    else:
        truth = [draw(st.floats(0, 3)) for _ in range(terms)]
        values = [sum(a * b for a, b in zip(r, truth)) for r in rows]
    return rows, values


def test_the_fit_is_the_best_non_negative_one():
    counts: Counter = Counter()

    @settings(max_examples=400, deadline=None)
    @given(problems())
    def case(problem):
        rows, values = problem
        coef = np.array(nonnegative_least_squares(rows, values))
        assert coef.shape == (len(rows[0]),) and np.all(coef >= 0)
        error = float(np.sum((np.array(rows) @ coef - np.array(values)) ** 2))
        best = best_over_subsets(rows, values)
        assert error <= best + 1e-9 * max(1.0, best), (error, best)
        counts["bound"] += bool(np.any(coef == 0) and np.any(coef > 0))
        counts["all free"] += bool(np.all(coef > 0))

    case()
    assert counts["bound"] >= 40 and counts["all free"] >= 40, counts


def test_a_shapeless_design_is_refused():
    with pytest.raises(HSPMDError, match="rows against"):
        nonnegative_least_squares([[1.0, 2.0]], [1.0, 2.0])


def test_repeated_timings_are_summarised_by_their_trimmed_mean():
    """typical: the lowest and highest tenth dropped, the rest averaged; a host switching between
    two speeds gives two modes, whose median jumps between them as the mix passes one half while
    the typical value moves with the mix."""
    assert typical([5.0, 1.0, 2.0, 3.0, 4.0]) == pytest.approx(3.0)
    assert typical([1.0] * 9 + [100.0]) == pytest.approx(1.0)  # a hiccup: dropped
    assert typical([1.0, 3.0], trim=0.0) == pytest.approx(2.0)
    fast_heavy, slow_heavy = [1.0] * 11 + [1.6] * 9, [1.0] * 9 + [1.6] * 11
    assert statistics.median(slow_heavy) - statistics.median(fast_heavy) == pytest.approx(0.6)
    assert typical(slow_heavy) - typical(fast_heavy) == pytest.approx(0.6 * 2 / 16)
    with pytest.raises(HSPMDError, match="no timings"):
        typical([])
