"""HetAuto's planner (HetAuto Alg. 1): Monte Carlo tree search over a decision tree of layouts.

The tree (HetAuto Fig. 3, principles P1-P4 of its Table 5): root -> pipeline count d (the
micro-batches follow: global batch / d, size 1) -> order of the device types -> per type, in that
order, (TP degree, CP degree, recompute flag) (HetAuto's intra-stage (c, t); CP only where the
problem offers it), which fixes its stage count -> per stage, its layer count
(non-uniform splits allowed; each stage keeps at least one layer). Constraint-aware pruning: only
actions that leave every later stage at least one layer, groups (TP x CP) that divide the type's devices.
A stage whose memory overflows ends the rollout with reward 0 (HetAuto's OOM check per cluster).

Each iteration SELECTs children by UCB(s, a) = Q/N(s, a) + lambda * sqrt(ln N(s) / N(s, a)),
EXPANDs one untried action at random, SIMULATEs a random rollout to a leaf, and BACKPROPAGATEs the
reward r = 1 / (1 + latency in s) (0 if infeasible). The best leaf seen is the answer, or the
`warm_start` layout (another search's answer) where no leaf beats it: with a budget far below
the tree's size a random search can miss what a guided one finds, and a planner should never
return worse than what it was handed. Prices are
memoised; a subtree all of whose leaves were visited is marked exhausted and no longer selected
(so a budget as large as the tree enumerates it). Deterministic for a given seed and budget.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import replace

from hspmd.planning.search.oracle import PERMUTED
from hspmd.planning.search.space import Layout, PlannedStrategy, PlanningError, PriceCache, Problem, StagePlan, planned


def reward(priced) -> float:
    """HetAuto's reward: 1 / (1 + latency in s); exactly 0 for a layout that overflows memory."""
    return 1.0 / (1.0 + priced.time) if priced.feasible else 0.0


class _Node:
    __slots__ = ("n", "q", "children", "untried", "exhausted")

    def __init__(self, untried):
        self.n, self.q, self.children, self.untried = 0, 0.0, {}, list(untried)
        self.exhausted = not self.untried


class _Tree:
    """Decisions as a path; `actions(path)` lists the legal next ones ([] at a leaf)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.counts = problem.counts()
        self.orders = list(itertools.permutations(problem.types))
        self.price = PriceCache(problem)

    def _types_and_stages(self, path):
        d, order = path[0], path[1]
        blocks = path[2:2 + len(order)]
        return d, order, blocks

    def actions(self, path: tuple) -> list:
        p = self.problem
        if not path:
            return list(p.dp_degrees())
        if len(path) == 1:
            return list(range(len(self.orders)))
        d, order = path[0], self.orders[path[1]]
        k = len(path) - 2
        if k < len(order):
            t = order[k]
            per = self.counts[t] // d
            return [(tp, cp, r) for tp, cp in p.groups(t) if per % (tp * cp) == 0 for r in p.recompute_options()]
        stages = self.stage_types(path)
        done = path[2 + len(order):]
        if len(done) == len(stages):
            return []
        left = p.num_layers - sum(done)
        after = len(stages) - len(done) - 1
        if after == 0:
            return [left]
        return list(range(1, left - after + 1))

    def stage_types(self, path: tuple) -> list[StagePlan]:
        """Each stage's plan with no layers yet."""
        d, order = path[0], self.orders[path[1]]
        out = []
        for t, (tp, cp, r) in zip(order, path[2:2 + len(order)]):
            out += [StagePlan(t, tp, 0, r, cp)] * (self.counts[t] // d // (tp * cp))
        return out

    def valid_prefix(self, path: tuple) -> bool:
        """False if the block choices leave more stages than layers, or the newest stage overflows."""
        if len(path) < 2:
            return True
        order = self.orders[path[1]]
        if len(path) == 2 + len(order):
            return len(self.stage_types(path)) <= self.problem.num_layers
        if len(path) <= 2 + len(order):
            return True
        stages = self.stage_types(path)
        done = path[2 + len(order):]
        i = len(done) - 1
        stage = replace(stages[i], layers=done[i])
        ev = self.problem.evaluator
        micro = self.problem.global_batch // path[0]
        mem = stage.memory(ev, i == 0, i == len(stages) - 1, min(len(stages) - i, micro), path[0])
        return mem <= ev.capacity(stage.device_type)

    def layout(self, path: tuple) -> Layout:
        d, order = path[0], self.orders[path[1]]
        stages = tuple(replace(s, layers=n) for s, n in zip(self.stage_types(path), path[2 + len(order):]))
        return Layout(d, stages, self.problem.global_batch // d)


def mcts(problem: Problem, iterations: int = 3000, seed: int = 0, exploration: float = 10.0,
         warm_start: Layout | None = None) -> list[PlannedStrategy]:
    """HetAuto's MCTS (module docstring); returns the best leaf found, or `warm_start` where it is
    feasible and no leaf found beats it."""
    start = time.perf_counter()
    rng = random.Random(seed)
    tree = _Tree(problem)
    nodes: dict[tuple, _Node] = {}

    def node(path):
        if path not in nodes:
            nodes[path] = _Node(tree.actions(path) if tree.valid_prefix(path) else [])
        return nodes[path]

    best: tuple[float, tuple, Layout] | None = None
    if warm_start is not None and (handed := tree.price(warm_start)).feasible:
        best = (handed.time, warm_start.key(), warm_start)

    def evaluate(path) -> float:
        nonlocal best
        if not tree.valid_prefix(path) or tree.actions(path):
            return 0.0
        layout = tree.layout(path)
        priced = tree.price(layout)
        if priced.feasible and (best is None or (priced.time, layout.key()) < best[:2]):
            best = (priced.time, layout.key(), layout)
        return reward(priced)

    root = node(())
    for _ in range(iterations):
        if root.exhausted:
            break
        path, visited = (), [root]
        current = root
        # SELECT
        while not current.untried and current.children:
            live = [(a, c) for a, c in current.children.items() if not c.exhausted]
            if not live:
                break
            log_n = math.log(max(current.n, 1))
            a, current = max(live, key=lambda ac: ac[1].q / ac[1].n + exploration * math.sqrt(log_n / ac[1].n)
                             if ac[1].n else math.inf)
            path = path + (a,)
            visited.append(current)
        # EXPAND
        if current.untried:
            a = current.untried.pop(rng.randrange(len(current.untried)))
            path = path + (a,)
            current.children[a] = child = node(path)
            visited.append(child)
            current = child
        # SIMULATE
        rollout = path
        while tree.valid_prefix(rollout):
            options = tree.actions(rollout)
            if not options:
                break
            rollout = rollout + (rng.choice(options),)
        gain = evaluate(rollout)
        # BACKPROPAGATE (and mark finished subtrees)
        for v in visited:
            v.n += 1
            v.q += gain
        for v in reversed(visited):
            if not v.untried and all(c.exhausted for c in v.children.values()):
                v.exhausted = True
            else:
                break
    if best is None:
        raise PlanningError(f"mcts: no feasible layout in {iterations} iterations (seed {seed})")
    provenance = {"search": "mcts", "space": PERMUTED.name, "seconds": time.perf_counter() - start,
                  "candidates": tree.price.calls, "iterations": iterations, "seed": seed, "lambda": exploration,
                  "warm_start_kept": warm_start is not None and best[2] is warm_start}
    return [planned(problem, best[2], provenance)]


__all__ = ["mcts", "reward"]
