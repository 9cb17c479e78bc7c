"""Re-planning after devices fail or join (Hetu v2 §7.2, Tables 6-8; Hetu v2 §7.2).

`replan(strategy, cluster, model, failed=(), added=())` prices two kinds of candidates with the
searches' objective; among those within `tolerance` (2%) of the fastest it keeps the one whose
switch moves the least data:

- *repair*: pipelines that lost nothing stay as they are; each damaged pipeline is re-planned by
  HAPT's DP on its surviving devices (its own stage count, TP degrees and layer split). Stages of
  one device type may be reordered among themselves at equal time; the order moving the least
  data wins. Only without joining devices.
- *fresh*: the DP and H2 searches over every device left (what C2 -> C3 and C3 -> C4 need).

The global batch is split across pipelines in proportion to their steady-state throughput
(1 / the bottleneck stage time), largest remainder: the paper's rule (C2: 64 x 4 / 7.75 -> 33/31).
Data moved is estimated per layer as the share of it a device must receive (1/tp of the layer,
less what it held before), times the layer's bytes (approximate: TP shard positions ignored).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from hspmd.annotations import split_bounds
from hspmd.cluster import ClusterSpec
from hspmd.errors import HSPMDError
from hspmd.planning.cost import CostModel
from hspmd.planning.model import ModelSpec
from hspmd.planning.ranks import DevicePool, assign_ranks
from hspmd.planning.search.costed import CostModelEvaluator, cluster_pools
from hspmd.planning.search.dfs_h2 import dfs
from hspmd.planning.search.dp_hapt import dp
from hspmd.planning.search.space import (
    Evaluator,
    PlannedStrategy,
    PlanningError,
    Problem,
    StagePlan,
    price_pipeline,
    price_strategy,
    scheduled,
    strategy_stages,
)
from hspmd.specialize.strategy import Pipeline, Stage, Strategy

TIME_RESOLUTION_S = 1e-3
"""Candidate times closer than this count as equal, so that the fewer moved bytes (then wider TP)
decide between them: pipeline times are estimates, and sub-millisecond differences are noise."""


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    time: float
    moved: float
    kind: str


def proportional_batches(total: int, bottlenecks: Sequence[float]) -> list[int]:
    """Samples per pipeline in proportion to 1 / bottleneck (largest remainder, at least one each)."""
    if total < len(bottlenecks):
        raise PlanningError(f"a global batch of {total} sample(s) cannot give each of {len(bottlenecks)} pipelines one")
    weights = [1.0 / b for b in bottlenecks]
    scale = 10**6 / max(weights)
    counts = [b - a for a, b in split_bounds(total, [max(1, round(w * scale)) for w in weights])]
    for i, c in enumerate(counts):
        if c == 0:
            j = max(range(len(counts)), key=lambda k: counts[k])
            counts[i], counts[j] = 1, counts[j] - 1
    return counts


def moved_share(old: Strategy, new: Strategy) -> float:
    """Layers' worth of data the devices of `new` must receive (module docstring)."""
    held: dict[tuple[int, int], float] = {}
    for p in old.pipelines:
        for s in p.stages:
            for r in s.ranks:
                for layer in s.layers:
                    held[(r, layer)] = 1.0 / s.tp
    moved = 0.0
    for p in new.pipelines:
        for s in p.stages:
            for r in s.ranks:
                for layer in s.layers:
                    moved += max(0.0, 1.0 / s.tp - held.get((r, layer), 0.0))
    return moved


def _pipeline(stages: Sequence[StagePlan], ranks: Sequence[tuple[int, ...]], micro: int) -> Pipeline:
    out, first = [], 0
    for s, group in zip(stages, ranks):
        out.append(Stage(group, range(first, first + s.layers), cp=s.cp, **Stage.recompute_fields(s.recompute)))
        first += s.layers
    return Pipeline(tuple(out), micro, 1)


def _orders(stages: tuple[StagePlan, ...], limit: int = 720) -> Iterable[tuple[StagePlan, ...]]:
    """The stage order itself, then reorderings of stages within each device-type block."""
    yield stages
    blocks, start = [], 0
    for k in range(1, len(stages) + 1):
        if k == len(stages) or stages[k].device_type != stages[start].device_type:
            blocks.append(stages[start:k])
            start = k
    choices = [sorted(set(itertools.permutations(b))) if len(b) <= 6 else [b] for b in blocks]
    for n, combo in enumerate(itertools.product(*choices)):
        if n >= limit:
            return
        yield tuple(s for b in combo for s in b)


class _Replanner:
    def __init__(self, strategy: Strategy, evaluator: Evaluator, pools: Sequence[DevicePool], global_batch: int,
                 tp_degrees, recompute: bool):
        self.old, self.ev, self.pools = strategy, evaluator, tuple(pools)
        self.batch, self.tp_degrees, self.recompute = global_batch, tp_degrees, recompute
        self.type_of = {r: p.device_type for p in self.pools for r in p.ranks}
        self.alive = set(self.type_of)
        self.refusals: list[str] = []  # why searches found nothing, for the error if no candidate is left

    def problem(self, pools, batch: int) -> Problem:
        degrees = {p.device_type: self.tp_degrees[p.device_type] for p in pools}
        return Problem(tuple(pools), self.old.num_layers, batch, self.ev, degrees, self.recompute)

    def finish(self, pipelines: list[tuple[tuple[StagePlan, ...], tuple[tuple[int, ...], ...]]], kind: str) -> Candidate:
        """Split the batch by throughput, build the strategy, price it and measure data moved."""
        bottlenecks = [max(price_pipeline(self.ev, stages, 1, len(pipelines)).stage_times) for stages, _ in pipelines]
        counts = proportional_batches(self.batch, bottlenecks)
        strategy = Strategy(tuple(_pipeline(st, rk, m) for (st, rk), m in zip(pipelines, counts)),
                            self.old.num_layers, False, (self.old.name or "strategy") + "-replanned")
        problem = self.problem(self.pools, self.batch)
        priced = price_strategy(problem, strategy)
        return Candidate(strategy, priced.time if priced.feasible else float("inf"), moved_share(self.old, strategy), kind)

    def repair(self) -> list[Candidate]:
        kept, damaged = [], []
        for p in self.old.pipelines:
            (kept if set(p.ranks) <= self.alive else damaged).append(p)
        if not damaged:
            return []
        problem_all = self.problem(self.pools, self.batch)
        kept_plans = [(stages, tuple(s.ranks for s in p.stages)) for p, stages in
                      zip(kept, strategy_stages(problem_all, Strategy(tuple(kept), self.old.num_layers)) if kept else [])]
        repaired = []
        for p in damaged:
            survivors = [r for r in p.ranks if r in self.alive]
            if not survivors:
                continue
            pools = []
            for pool in self.pools:
                nodes = tuple(tuple(r for r in node if r in survivors) for node in pool.nodes)
                nodes = tuple(n for n in nodes if n)
                if nodes:
                    pools.append(DevicePool(pool.device_type, nodes))
            share = max(1, p.samples_per_step or self.batch // len(self.old.pipelines))
            try:
                layout = dp(self.problem(pools, share))[0].layout
            except PlanningError as exc:
                self.refusals.append(f"repairing pipeline {self.old.pipelines.index(p)}: {exc}")
                return []
            best = None
            for order in _orders(layout.stages):
                found = self.score(order, pools, share)
                if found and (best is None or found[:3] < best[:3]):
                    best = found
            if best is None:
                return []
            best = self.shift_layers(best, pools, share)
            repaired.append((best[3], best[4]))
        if not kept_plans and not repaired:
            return []
        order = {id(p): i for i, p in enumerate(self.old.pipelines)}
        merged = sorted([(order[id(p)], plan) for p, plan in zip(kept, kept_plans)] +
                        [(order[id(p)], plan) for p, plan in zip([d for d in damaged if any(r in self.alive for r in d.ranks)], repaired)])
        return [self.finish([plan for _, plan in merged], "repair")]

    def score(self, stages, pools, share):
        """(time in ms, data moved, TP degrees descending first, stages, ranks) of one pipeline: the
        sort key of the repair (ties on time and data go to larger TP groups first, as the paper
        writes them); None if it cannot be placed or does not fit."""
        try:
            ranks = assign_ranks([[(s.device_type, s.devices) for s in stages]], pools)[0]
        except HSPMDError:
            return None
        priced = price_pipeline(self.ev, stages, share, len(self.old.pipelines))
        if not priced.feasible:
            return None
        moved = moved_share(self.old, Strategy((_pipeline(stages, ranks, share),), self.old.num_layers))
        return (round(priced.time / TIME_RESOLUTION_S) if priced.time else 0, moved, tuple(-s.tp for s in stages), stages, ranks)

    def shift_layers(self, best, pools, share):
        """Move stage boundaries one layer at a time while the time does not grow and less data
        moves: among equal-time splits, the one closest to the old strategy."""
        improved = True
        while improved:
            improved = False
            stages = best[3]
            for i in range(len(stages) - 1):
                for delta in (-1, 1):
                    a, b = stages[i].layers + delta, stages[i + 1].layers - delta
                    if a < 1 or b < 1:
                        continue
                    trial = list(stages)
                    trial[i] = replace(stages[i], layers=a)
                    trial[i + 1] = replace(stages[i + 1], layers=b)
                    found = self.score(tuple(trial), pools, share)
                    if found and found[0] <= best[0] and found[1] < best[1] - 1e-12:
                        best, improved = found, True
                        break
                if improved:
                    break
        return best

    def fresh(self) -> list[Candidate]:
        problem = self.problem(self.pools, self.batch)
        out = []
        for search in (lambda: dp(problem, top=4), lambda: dfs(problem)):
            try:
                found = search()
            except PlanningError as exc:
                self.refusals.append(str(exc))
                continue
            for planned in found:
                pipelines = [(planned.layout.stages, tuple(s.ranks for s in p.stages)) for p in planned.strategy.pipelines]
                out.append(self.finish(pipelines, "fresh"))
        return out


def replan(strategy: Strategy, cluster: ClusterSpec, model: ModelSpec | None = None, failed: Iterable[int] = (),
           added: Iterable[int] = (), *, evaluator: Evaluator | None = None, global_batch: int | None = None,
           max_tp: int | None = None, recompute: bool = False, tolerance: float = 0.02) -> PlannedStrategy:
    """A strategy for the devices of `strategy` less `failed`, plus `added` (devices of `cluster`
    joining with no state), keeping the global batch (module docstring). `evaluator` overrides the
    cost model of `model` on `cluster` (e.g. profile tables). Candidates within `tolerance` of the
    fastest count as equal-time (the objective is an estimate, and the switch itself costs what
    the objective leaves out); among them the least data moved wins."""
    failed, added = set(failed), set(added)
    unknown = failed - set(strategy.all_ranks)
    if unknown:
        raise HSPMDError(f"replan: failed device(s) {sorted(unknown)} are not part of strategy {strategy.name or ''}")
    available = (set(strategy.all_ranks) | added) - failed
    if not available:
        raise HSPMDError(f"replan: no device of strategy {strategy.name or ''} survives the failure of {sorted(failed)}")
    outside = sorted(r for r in available if r >= cluster.n_devices)
    if outside:
        raise HSPMDError(f"replan: device(s) {outside} are not in cluster {cluster.describe()}")
    if evaluator is None:
        if model is None:
            raise HSPMDError("replan: give a model (or an evaluator) to price strategies")
        evaluator = CostModelEvaluator(CostModel(cluster, model))
    batch = global_batch or strategy.global_batch_size
    if not batch:
        raise HSPMDError("replan: the strategy binds its batches at run time; pass global_batch")
    unused = set(range(cluster.n_devices)) - available
    pools = cluster_pools(cluster, unused)
    degrees = {}
    for p in pools:
        limit = min(p.node_size, max_tp or p.node_size)
        degrees[p.device_type] = tuple(1 << k for k in range(limit.bit_length()) if (1 << k) <= limit)
    planner = _Replanner(strategy, evaluator, pools, batch, degrees, recompute)
    candidates = (planner.repair() if not added else []) + planner.fresh()
    fastest = min((c.time for c in candidates), default=float("inf"))
    if fastest == float("inf"):
        why = "".join(f"; {r}" for r in dict.fromkeys(planner.refusals))
        raise PlanningError(f"replan: no strategy on devices {sorted(available)} fits device memory{why}")
    tied = [c for c in candidates if c.time <= fastest * (1 + tolerance)]
    chosen = min(tied, key=lambda c: (c.moved, c.kind != "repair"))
    problem = planner.problem(pools, batch)
    strategy, policy, in_flight, peak, seconds = scheduled(problem, chosen.strategy)
    provenance = {"search": "replan", "kind": chosen.kind, "moved_layers": chosen.moved, "candidates": len(candidates),
                  "failed": sorted(failed), "added": sorted(added), "pipeline_seconds": seconds}
    return PlannedStrategy(strategy, policy, in_flight, chosen.time, peak, provenance)


__all__ = ["moved_share", "proportional_batches", "replan"]
