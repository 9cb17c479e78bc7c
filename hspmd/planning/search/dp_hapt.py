"""HAPT's planner (HAPT §5.2, Alg. 1): dynamic programming over stages, sub-meshes and t_max.

For a fixed bound t_max on every stage time and link time, F(q, k, rem) is the least
sum_i (t_i + 2 c_i) over ways to run layers k..L-1 as stages on exactly the devices `rem` (a count
per device type, types in the problem's order, so a type's stages follow the previous type's).
The stage starting at layer k runs on the first type with devices left, with any profiled TP
degree, any layer count and recompute choice; `q` is the number of stages from it to the end,
capped at M (the micro-batches): it fixes the stage's in-flight micro-batches min(q, M) for the
memory check (HAPT eq. 24 with 1F1B's warm-up). The recursion returns, per suffix, the Pareto front
over (q, sum) rather than one entry per q. Then

    T(t_max) = min_q F(q, 0, all devices) + (M - 1) t_max + sync(d),   T* = min over t_max.

Because the true bottleneck of the optimum is one of the candidate t_max values (the distinct stage
and link times), T* is the exact optimum of the GENERAL space under the shared objective.
Pruning (HAPT's t_S / t_E): candidates are visited in increasing order from the smallest feasible
one (found by bisection); once (M - 1) t_max + sync(d) passes the best T found, no larger t_max can
win, since sum(t + 2c) >= 0. Run once per pipeline count d on one pipeline's device budget;
d identical pipelines are emitted (HAPT §5.2, "Emission").

Context parallelism (HetAuto's c of (d, c, t)): the DP runs once per (d, c), its stages splitting
the sequence c ways on the types that offer c (Problem.groups(t, c)) and not at all on the others;
the sync is then fixed by (d, c) (the parameter shards are the type's devices / its CP degree), so
T* is exact over the GENERAL space with one CP degree per pipeline (as exhaustive enumerates it).
"""

from __future__ import annotations

import math
import sys
import time
from functools import lru_cache

from hspmd.planning.search.dfs_h2 import dfs
from hspmd.planning.search.oracle import GENERAL
from hspmd.planning.search.space import Layout, PlannedStrategy, PlanningError, Problem, StagePlan, planned, price

INF = math.inf


class _Dp:
    """The recursion for one pipeline count d and CP degree c."""

    def __init__(self, problem: Problem, d: int, c: int = 1):
        self.problem, self.d, self.c = problem, d, c
        self.micro = problem.global_batch // d
        self.types = problem.types
        self.budget = tuple(problem.counts()[t] // d for t in self.types)
        self.ev = problem.evaluator
        self.stage_cache: dict = {}
        self.times: dict[tuple, list[float]] = {}  # (type, tp, cp, first, last) -> time by layer count, no recompute

    def time_table(self, t: str, tp: int, cp: int, first: bool, last: bool) -> list[float]:
        """Stage times for 0..L layers (the recursion reads them millions of times at scale)."""
        key = (t, tp, cp, first, last)
        table = self.times.get(key)
        if table is None:
            table = self.times[key] = [StagePlan(t, tp, n, False, cp).time(self.ev, first, last)
                                       for n in range(self.problem.num_layers + 1)]
        return table

    def stage(self, plan: StagePlan, first: bool, last: bool, q: int) -> float:
        """A stage's time, or INF when it does not fit in memory."""
        key = (plan, first, last, q)
        hit = self.stage_cache.get(key)
        if hit is None:
            inflight = min(q, self.micro)
            mem = plan.memory(self.ev, first, last, inflight, self.d)
            hit = plan.time(self.ev, first, last) if mem <= self.ev.capacity(plan.device_type) else INF
            self.stage_cache[key] = hit
        return hit

    def cp_of(self, t: str) -> int:
        return self.c if self.c in self.problem.cp_degrees[t] else 1

    def possible(self) -> bool:
        """Whether every type's devices per pipeline split into groups of its CP degree."""
        return all(n % self.cp_of(t) == 0 for t, n in zip(self.types, self.budget))

    def sync(self) -> float:
        """The gradient sync of every layout of this (d, c) (module docstring)."""
        shards = {t: n // self.cp_of(t) for t, n in zip(self.types, self.budget)}
        return self.ev.sync_time(self.d, shards, **({"cp": self.c} if self.c > 1 else {}))

    def candidates(self) -> list[float]:
        """Every stage time and link time a layout could have: the t_max values to try."""
        L = self.problem.num_layers
        values = set()
        for t, n in zip(self.types, self.budget):
            for tp, cp in self.problem.groups(t, self.c):
                if tp * cp > n:
                    continue
                for rec in self.problem.recompute_options():
                    for layers in range(1, L + 1):
                        for first in (False, True):
                            for last in (False, True):
                                values.add(StagePlan(t, tp, layers, rec, cp).time(self.ev, first, last))
        for a in self.types:
            for b in self.types:
                values.add(self.ev.link_time(a, b))
        return sorted(v for v in values if v < INF)

    def solve(self, t_max: float):
        """(F, layout stages) minimising sum(t + 2c) with every t, c <= t_max; (INF, None) if none."""
        L, M = self.problem.num_layers, self.micro
        types, c = self.types, self.c
        groups = {t: self.problem.groups(t, c) for t in types}
        recompute = self.problem.recompute_options()
        ev = self.ev

        @lru_cache(maxsize=None)
        def G(k: int, rem: tuple[int, ...]) -> tuple:
            """The Pareto front of (stages from k to the end capped at M, least sum, stages) for the
            suffix starting at layer k on devices `rem`: fewer stages after a stage mean fewer
            micro-batches in flight on it, so a front entry is kept only if no entry has both
            fewer-or-equal stages and a smaller-or-equal sum."""
            ti = next((i for i, n in enumerate(rem) if n), None)
            if ti is None:
                return ((0, 0.0, ()),) if k == L else ()
            if k == L:
                return ()
            t = types[ti]
            best: dict[int, tuple[float, tuple]] = {}
            for tp, cp in groups[t]:
                if tp * cp > rem[ti]:
                    continue
                after = rem[:ti] + (rem[ti] - tp * cp,) + rem[ti + 1:]
                nxt = next((i for i, n in enumerate(after) if n), None)
                c = 0.0 if nxt is None else ev.link_time(t, types[nxt])
                if c > t_max:
                    continue
                inner, final = self.time_table(t, tp, cp, k == 0, False), self.time_table(t, tp, cp, k == 0, True)
                for layers in range(1, L - k + 1):
                    last = k + layers == L
                    if (final if last else inner)[layers] > t_max:
                        break  # stage time grows with its layers
                    if last != (nxt is None):
                        continue
                    sub = G(k + layers, after)
                    if not sub:
                        continue
                    for rec in recompute:
                        plan = StagePlan(t, tp, layers, rec, cp)
                        for n, value, rest in sub:
                            q = min(n + 1, M)
                            st = self.stage(plan, k == 0, last, q)
                            if st > t_max:
                                continue
                            total = st + 2 * c + value
                            if q not in best or total < best[q][0]:
                                best[q] = (total, (plan,) + rest)
            front, lowest = [], INF
            for q in sorted(best):
                value, stages = best[q]
                if value < lowest:
                    front.append((q, value, stages))
                    lowest = value
            return tuple(front)

        front = G(0, self.budget)
        G.cache_clear()
        if not front:
            return INF, None
        _, value, stages = min(front, key=lambda e: e[1])
        return value, stages


def dp(problem: Problem, prune: bool = True, top: int = 1) -> list[PlannedStrategy]:
    """HAPT's DP over every pipeline count d (module docstring); best first. With `prune`, the
    H2 search's answer (a layout of a smaller space) is the first incumbent: no t_max above
    (incumbent - sync) / (M - 1) can beat it, so only smaller candidates are solved."""
    start = time.perf_counter()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * problem.num_layers + 1000))
    results: list[tuple[float, tuple, Layout]] = []
    solved = 0
    best = INF
    if prune:
        try:
            best = dfs(problem)[0].predicted_time
        except PlanningError:
            best = INF
    try:
        for d, c in ((d, c) for d in problem.dp_degrees() for c in problem.pipeline_cps()):
            run = _Dp(problem, d, c)
            if not run.possible():
                continue
            sync = run.sync()
            cands = run.candidates()
            if prune and best < INF and run.micro > 1:
                bound = (best - sync) / (run.micro - 1)
                cands = [c for c in cands if c <= bound * (1 + 1e-12)]
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
            for t_max in cands[lo:]:
                if prune and (run.micro - 1) * t_max + sync > best * (1 + 1e-12):
                    break
                solved += 1
                value, stages = run.solve(t_max)
                if value == INF:
                    continue
                layout = Layout(d, stages, run.micro)
                priced = price(problem, layout)
                if not priced.feasible:  # its TP groups cannot be placed inside nodes
                    continue
                best = min(best, priced.time)
                results.append((priced.time, layout.key(), layout))
    finally:
        sys.setrecursionlimit(limit)
    if not results:
        raise PlanningError("dp: no layout fits device memory with its TP groups inside nodes")
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
