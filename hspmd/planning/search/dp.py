"""HAPT's planner (000 §5.2, Alg. 1): dynamic programming over stages, sub-meshes and t_max.

For a fixed bound t_max on every stage time and link time, F(q, k, rem) is the least
sum_i (t_i + 2 c_i) over ways to run layers k..L-1 as stages on exactly the devices `rem` (a count
per device type, types in the problem's order, so a type's stages follow the previous type's).
The stage starting at layer k runs on the first type with devices left, with any profiled TP
degree, any layer count and recompute choice; `q` is the number of stages from it to the end,
capped at M (the micro-batches): it fixes the stage's in-flight micro-batches min(q, M) for the
memory check (HAPT eq. 24 with 1F1B's warm-up). Then

    T(t_max) = min_q F(q, 0, all devices) + (M - 1) t_max + sync(d),   T* = min over t_max.

Because the true bottleneck of the optimum is one of the candidate t_max values (the distinct stage
and link times), T* is the exact optimum of the GENERAL space under the shared objective.
Pruning (HAPT): candidates are visited in increasing order from the smallest feasible one (found by
bisection); once (M - 1) t_max + F_inf + sync(d) reaches the best T found (F_inf: the unconstrained
minimum), no larger t_max can win. Run once per pipeline count d on one pipeline's device budget;
d identical pipelines are emitted (PLANNING B2, "Emission").
"""

from __future__ import annotations

import bisect
import math
import sys
import time
from functools import lru_cache

from hspmd.planning.search.exhaustive import GENERAL
from hspmd.planning.search.space import Layout, PlannedStrategy, PlanningError, Problem, StagePlan, planned, price

INF = math.inf


class _Dp:
    """The recursion for one pipeline count d."""

    def __init__(self, problem: Problem, d: int):
        self.problem, self.d = problem, d
        self.micro = problem.global_batch // d
        self.types = problem.types
        self.budget = tuple(problem.counts()[t] // d for t in self.types)
        self.ev = problem.evaluator
        self.stage_cache: dict = {}

    def stage(self, t: str, tp: int, layers: int, rec: bool, first: bool, last: bool, q: int) -> float:
        """A stage's time, or INF when it does not fit in memory."""
        key = (t, tp, layers, rec, first, last, q)
        hit = self.stage_cache.get(key)
        if hit is None:
            inflight = min(q, self.micro)
            mem = self.ev.stage_memory(t, tp, layers, rec, first, last, inflight, self.d)
            hit = self.ev.stage_time(t, tp, layers, rec, first, last) if mem <= self.ev.capacity(t) else INF
            self.stage_cache[key] = hit
        return hit

    def candidates(self) -> list[float]:
        """Every stage time and link time a layout could have: the t_max values to try."""
        L = self.problem.num_layers
        values = set()
        for t, n in zip(self.types, self.budget):
            for tp in self.problem.tp_degrees[t]:
                if tp > n:
                    continue
                for rec in self.problem.recompute_options():
                    for layers in range(1, L + 1):
                        for first in (False, True):
                            for last in (False, True):
                                values.add(self.ev.stage_time(t, tp, layers, rec, first, last))
        for a in self.types:
            for b in self.types:
                values.add(self.ev.link_time(a, b))
        return sorted(v for v in values if v < INF)

    def solve(self, t_max: float):
        """(F, layout stages) minimising sum(t + 2c) with every t, c <= t_max; (INF, None) if none."""
        L, M = self.problem.num_layers, self.micro
        types, degrees = self.types, self.problem.tp_degrees
        recompute = self.problem.recompute_options()
        ev = self.ev

        @lru_cache(maxsize=None)
        def F(q: int, k: int, rem: tuple[int, ...]):
            # q: stages from this one to the end, capped at M (M means "M or more").
            if k == L:
                return (0.0, ()) if q == 0 and not any(rem) else (INF, ())
            if q == 0:
                return (INF, ())
            ti = next((i for i, n in enumerate(rem) if n), None)
            if ti is None:
                return (INF, ())
            t = types[ti]
            best, choice = INF, ()
            next_qs = (q - 1,) if q < M else (M, M - 1)
            for tp in degrees[t]:
                if tp > rem[ti]:
                    continue
                after = rem[:ti] + (rem[ti] - tp,) + rem[ti + 1:]
                nxt = next((i for i, n in enumerate(after) if n), None)
                c = 0.0 if nxt is None else ev.link_time(t, types[nxt])
                if c > t_max:
                    continue
                for layers in range(1, L - k + 1):
                    last = k + layers == L
                    if last != (nxt is None):
                        continue
                    for rec in recompute:
                        st = self.stage(t, tp, layers, rec, k == 0, last, q)
                        if st > t_max:
                            continue
                        for nq in next_qs:
                            if last and nq != 0:
                                continue
                            sub, rest = F(nq, k + layers, after)
                            total = st + 2 * c + sub
                            if total < best:
                                best, choice = total, (StagePlan(t, tp, layers, rec),) + rest
                    if ev.stage_time(t, tp, layers, False, k == 0, last) > t_max:
                        break  # stage time grows with its layers
            return best, choice

        best, stages = INF, None
        for q in range(1, M + 1):
            value, choice = F(q, 0, self.budget)
            if value < best:
                best, stages = value, choice
        F.cache_clear()
        return best, stages


def dp(problem: Problem, prune: bool = True, top: int = 1) -> list[PlannedStrategy]:
    """HAPT's DP over every pipeline count d (module docstring); best first."""
    start = time.perf_counter()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * problem.num_layers + 1000))
    results: list[tuple[float, tuple, Layout]] = []
    solved = 0
    try:
        for d in problem.dp_degrees():
            run = _Dp(problem, d)
            sync = problem.evaluator.sync_time(d, dict(zip(run.types, run.budget)))
            cands = run.candidates()
            if not cands:
                continue
            lo = 0
            if prune:
                # Bisect the smallest feasible t_max (feasibility is monotone in t_max).
                hi = len(cands) - 1
                solved += 1
                if run.solve(cands[hi])[0] == INF:
                    continue
                while lo < hi:
                    mid = (lo + hi) // 2
                    solved += 1
                    if run.solve(cands[mid])[0] < INF:
                        hi = mid
                    else:
                        lo = mid + 1
                solved += 1
                f_inf = run.solve(cands[-1])[0]
            best = INF
            for t_max in cands[lo:]:
                if prune and (run.micro - 1) * t_max + f_inf + sync >= best and best < INF:
                    break
                solved += 1
                value, stages = run.solve(t_max)
                if value == INF:
                    continue
                layout = Layout(d, stages, run.micro)
                true_time = price(problem, layout).time
                best = min(best, value + (run.micro - 1) * t_max + sync)
                results.append((true_time, layout.key(), layout))
    finally:
        sys.setrecursionlimit(limit)
    if not results:
        raise PlanningError("dp: no layout fits device memory")
    results.sort(key=lambda x: (x[0], x[1]))
    unique, seen = [], set()
    for _, key, layout in results:
        if key not in seen:
            seen.add(key)
            unique.append(layout)
    provenance = {"search": "dp", "space": GENERAL.name, "seconds": time.perf_counter() - start, "candidates": solved,
                  "prune": prune}
    return [planned(problem, layout, provenance) for layout in unique[:top]]


__all__ = ["dp"]
