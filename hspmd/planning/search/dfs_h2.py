"""H2's HeteroAuto (H2 §4.3.3): depth-first search over one pipeline count for all device types and
per type a TP degree (and a CP degree, HetAuto's (c, t), where the problem offers CP) and a
recompute flag, with layer sharding and two-stage refinement.

    for d in pipeline counts:
      DFS over blocks (device types in memory-descending order): (tp, cp) with devices % (tp cp) == 0,
          stages = devices / (tp cp), recompute in {0, 1}
      leaf: shard_layers(); keep the best feasible layout

shard_layers: a block's speed is stages / per-layer time; layers go in proportion to speed
(largest remainder, at least one per stage), spread evenly over the block's stages (the UNIFORM
space of exhaustive.py); while a stage exceeds memory, one layer moves to the block with the most
headroom; then single-layer moves between blocks are taken while they lower the time (a local
refinement of the proportional split, so small instances reach the exhaustive optimum).

Two-stage refinement: stage 1 fixes d; stage 2 splits device types of more than `group_size`
devices per pipeline into groups handled as separate blocks (earlier groups of a type at least the
group size, TP x CP, of later ones) and keeps whichever stage found the faster layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hspmd.planning.search.oracle import UNIFORM, even_split
from hspmd.planning.search.space import (
    Layout, PlannedStrategy, PlanningError, PriceCache, Problem, StagePlan, planned, sync_time_of,
)


@dataclass(frozen=True)
class Block:
    """Devices of one type that form consecutive stages of a pipeline, all of one TP and CP degree."""

    device_type: str
    devices: int


@dataclass(frozen=True)
class BlockChoice:
    block: Block
    tp: int
    recompute: bool
    cp: int = 1

    @property
    def stages(self) -> int:
        return self.block.devices // (self.tp * self.cp)

    def plan(self, layers: int) -> StagePlan:
        return StagePlan(self.block.device_type, self.tp, layers, self.recompute, self.cp)


class _Search:
    def __init__(self, problem: Problem):
        self.problem = problem
        self.price = PriceCache(problem)
        self.costs: dict[tuple, tuple[float, bool, Layout]] = {}
        self.leaves = self.pruned = 0

    def layout(self, d: int, choices: list[BlockChoice], layers: list[int]) -> Layout:
        stages = tuple(
            c.plan(n)
            for c, lt in zip(choices, layers) for n in even_split(lt, c.stages)
        )
        return Layout(d, stages, self.problem.global_batch // d)

    def cost(self, d, choices, layers) -> tuple[float, bool, Layout]:
        """(time, feasible, layout) of a layering, memoised on the blocks and their layer counts
        (cheaper to hash than the layout's stages; the refinement revisits its neighbours)."""
        key = (d, tuple(choices), tuple(layers))
        hit = self.costs.get(key)
        if hit is None:
            layout = self.layout(d, choices, layers)
            p = self.price(layout)
            hit = self.costs[key] = (p.time, p.feasible, layout)
        return hit

    def shard_layers(self, d: int, choices: list[BlockChoice]) -> Layout | None:
        L, ev = self.problem.num_layers, self.problem.evaluator
        mins = [c.stages for c in choices]
        if sum(mins) > L:
            return None
        speed = [c.stages / c.plan(1).time(ev, False, False) for c in choices]
        raw = [L * s / sum(speed) for s in speed]
        layers = [max(m, int(r)) for m, r in zip(mins, raw)]
        order = sorted(range(len(raw)), key=lambda i: -(raw[i] - int(raw[i])))
        i = 0
        while sum(layers) < L:
            layers[order[i % len(order)]] += 1
            i += 1
        while sum(layers) > L:
            j = max((k for k in range(len(layers)) if layers[k] > mins[k]), key=lambda k: layers[k] - raw[k])
            layers[j] -= 1
        # Memory repair: move layers off overfull blocks to the one with the most headroom.
        for _ in range(L):
            t, feasible, layout = self.cost(d, choices, layers)
            if feasible:
                break
            over, room = self.headroom(layout, choices)
            if over is None or room is None or layers[over] <= mins[over]:
                return None
            layers[over] -= 1
            layers[room] += 1
        best, feasible, layout = self.cost(d, choices, layers)
        if not feasible:
            return None
        improved = True
        while improved:
            improved = False
            for a in range(len(layers)):
                for b in range(len(layers)):
                    if a == b or layers[a] <= mins[a]:
                        continue
                    trial = list(layers)
                    trial[a] -= 1
                    trial[b] += 1
                    t, ok, lay = self.cost(d, choices, trial)
                    if ok and (t, lay.key()) < (best, layout.key()):
                        best, layers, layout, improved = t, trial, lay, True
        return layout

    def lower_bound(self, d: int, choices: list[BlockChoice]) -> float:
        """No layering of these blocks is faster than this (so a leaf above the best is skipped
        without changing the result). Stage times are affine in their layers with non-negative
        first/last extras (Evaluator), so with t_k one layer's time on block k and S_k its stages:
        the layers cost at least L min t_k in all, the bottleneck stage at least L / sum S_k/t_k
        (a continuous layer split), links are >= 0 and the sync is known exactly."""
        L, ev = self.problem.num_layers, self.problem.evaluator
        per_layer = [c.plan(1).time(ev, False, False) for c in choices]
        bound = L * min(per_layer) + sync_time_of(ev, [c.plan(1) for c in choices for _ in range(c.stages)], d)
        if min(per_layer) > 0:
            micro_batches = self.problem.global_batch // d
            bound += (micro_batches - 1) * L / sum(c.stages / t for c, t in zip(choices, per_layer))
        return bound

    def headroom(self, layout: Layout, choices: list[BlockChoice]):
        """(block over memory, block with the most spare memory) of a priced layout."""
        p = self.price(layout)
        ev = self.problem.evaluator
        owner = [k for k, c in enumerate(choices) for _ in range(c.stages)]
        spare = [ev.capacity(s.device_type) - m for s, m in zip(layout.stages, p.stage_memory)]
        over = next((owner[i] for i, x in enumerate(spare) if x < 0), None)
        per_block = {}
        for i, x in enumerate(spare):
            per_block[owner[i]] = min(per_block.get(owner[i], x), x)
        candidates = [k for k, x in per_block.items() if x > 0 and k != over]
        room = max(candidates, key=lambda k: per_block[k]) if candidates else None
        return over, room

    def search(self, blocks: list[Block], dps) -> Layout | None:
        best: tuple[float, tuple, Layout] | None = None
        for d in dps:
            per_pipeline = [Block(b.device_type, b.devices // d) for b in blocks]

            def rec(i: int, chosen: list[BlockChoice]):
                nonlocal best
                if i == len(per_pipeline):
                    self.leaves += 1
                    if best is not None and self.lower_bound(d, chosen) > best[0] * (1 + 1e-9):
                        self.pruned += 1
                        return
                    layout = self.shard_layers(d, chosen)
                    if layout is not None:
                        p = self.price(layout)
                        cand = (p.time, layout.key(), layout)
                        if best is None or cand[:2] < best[:2]:
                            best = cand
                    return
                block = per_pipeline[i]
                for tp, cp in self.problem.groups(block.device_type):
                    if block.devices % (tp * cp):
                        continue
                    previous = next((c for c in reversed(chosen) if c.block.device_type == block.device_type), None)
                    if previous is not None and previous.tp * previous.cp < tp * cp:
                        continue  # earlier groups of a type keep at least the group size of later ones
                    for r in self.problem.recompute_options():
                        rec(i + 1, chosen + [BlockChoice(block, tp, r, cp)])

            rec(0, [])
        return None if best is None else best[2]


def split_groups(problem: Problem, d: int, group_size: int) -> list[Block]:
    """Per pipeline-count-independent blocks: each type cut into groups of `group_size` per pipeline."""
    blocks = []
    for t, n in problem.counts().items():
        per = n // d
        if per <= group_size:
            blocks.append(Block(t, n))
            continue
        while per > 0:
            take = min(group_size, per)
            blocks.append(Block(t, take * d))
            per -= take
    return blocks


def dfs(problem: Problem, group_size: int = 128, two_stage: bool = True) -> list[PlannedStrategy]:
    """HeteroAuto (module docstring): the best layout of the UNIFORM space it finds."""
    start = time.perf_counter()
    run = _Search(problem)
    blocks = [Block(t, n) for t, n in problem.counts().items()]
    best = run.search(blocks, problem.dp_degrees())
    if best is None:
        raise PlanningError("dfs: no layout fits device memory with its TP groups inside nodes")
    stage = 1
    if two_stage:
        groups = split_groups(problem, best.pipelines, group_size)
        if len(groups) > len(blocks):
            second = run.search(groups, (best.pipelines,))
            if second is not None and run.price(second).time < run.price(best).time:
                best, stage = second, 2
    provenance = {"search": "dfs", "space": UNIFORM.name, "seconds": time.perf_counter() - start,
                  "candidates": run.price.calls, "leaves": run.leaves, "pruned": run.pruned, "stage": stage}
    return [planned(problem, best, provenance)]


__all__ = ["dfs", "split_groups"]
