"""The exhaustive search: every layout of a search space, priced; the oracle for small instances.

A `Space` says which layouts a search visits, so each search is checked against the exhaustive
optimum of its own space:

    GENERAL  per-stage TP degree, free layer split, per-stage recompute, fixed type order (HAPT);
             one CP degree per pipeline (on the types that offer it; dp_hapt.py says why)
    UNIFORM  one (TP, CP) group and recompute flag per device type, the type's layers spread evenly
             over its stages (earlier stages take the smaller share), fixed type order (H2)
    PERMUTED one (TP, CP) group and recompute flag per device type, free layer split, any order of
             the device types (HetAuto's principles P1-P4)

CP degrees come only from `Problem.cp_degrees` (none by default).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from hspmd.planning.search.space import Layout, PlannedStrategy, PlanningError, PriceCache, Problem, StagePlan, planned


@dataclass(frozen=True)
class Space:
    per_stage_tp: bool
    even_layers: bool
    per_stage_recompute: bool
    any_order: bool
    name: str


GENERAL = Space(True, False, True, False, "general")
UNIFORM = Space(False, True, False, False, "uniform")
PERMUTED = Space(False, False, False, True, "permuted")
SPACES = {s.name: s for s in (GENERAL, UNIFORM, PERMUTED)}


def compositions(total: int, parts: int, low: int = 1) -> Iterator[tuple[int, ...]]:
    """Ordered tuples of `parts` integers >= low summing to `total`."""
    if parts == 0:
        if total == 0:
            yield ()
        return
    for first in range(low, total - low * (parts - 1) + 1):
        for rest in compositions(total - first, parts - 1, low):
            yield (first,) + rest


def group_sequences(groups: Sequence[tuple[int, int]], devices: int, per_stage: bool
                    ) -> Iterator[tuple[tuple[int, int], ...]]:
    """The (tp, cp) groups of one device type's stages using exactly `devices` devices."""
    if not per_stage:
        for tp, cp in groups:
            if devices % (tp * cp) == 0:
                yield ((tp, cp),) * (devices // (tp * cp))
        return

    def rec(left: int) -> Iterator[tuple[tuple[int, int], ...]]:
        if left == 0:
            yield ()
            return
        for tp, cp in groups:
            if tp * cp <= left:
                for rest in rec(left - tp * cp):
                    yield ((tp, cp),) + rest

    yield from rec(devices)


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """`layers` over `stages` as evenly as possible, the earlier stages taking the smaller share
    (they hold more micro-batches in flight under 1F1B)."""
    base, extra = divmod(layers, stages)
    return (base,) * (stages - extra) + (base + 1,) * extra


def type_orders(problem: Problem, space: Space) -> Iterator[tuple[str, ...]]:
    return itertools.permutations(problem.types) if space.any_order else iter([problem.types])


def layouts(problem: Problem, space: Space) -> Iterator[Layout]:
    """Every layout of `space` (module docstring) on `problem`."""
    L = problem.num_layers
    counts = problem.counts()
    pipeline_cps: tuple[int | None, ...] = problem.pipeline_cps() if space.per_stage_tp else (None,)
    for d, c in itertools.product(problem.dp_degrees(), pipeline_cps):
        micro = problem.global_batch // d
        for order in type_orders(problem, space):
            per_type = [list(group_sequences(problem.groups(t, c), counts[t] // d, space.per_stage_tp)) for t in order]
            for tps in itertools.product(*per_type):
                types = [t for t, seq in zip(order, tps) for _ in seq]
                flat = [group for seq in tps for group in seq]
                if len(flat) > L:
                    continue
                if space.even_layers:
                    splits = (
                        tuple(x for lt, seq in zip(per, tps) for x in even_split(lt, len(seq)))
                        for per in compositions_by_type(L, [len(seq) for seq in tps])
                    )
                else:
                    splits = compositions(L, len(flat))
                for split in splits:
                    if space.per_stage_recompute:
                        flags = itertools.product(problem.recompute_options(), repeat=len(flat))
                    else:
                        flags = (
                            tuple(r for r, seq in zip(per, tps) for _ in seq)
                            for per in itertools.product(problem.recompute_options(), repeat=len(tps))
                        )
                    for rec in flags:
                        stages = tuple(StagePlan(t, tp, n, r, cp) for t, (tp, cp), n, r in zip(types, flat, split, rec))
                        yield Layout(d, stages, micro)


def compositions_by_type(layers: int, stages_per_type: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Layer counts per device type, each at least its stage count, summing to `layers`."""
    offsets = [s - 1 for s in stages_per_type]
    for c in compositions(layers - sum(offsets), len(stages_per_type)):
        yield tuple(x + o for x, o in zip(c, offsets))


def exhaustive(problem: Problem, space: Space = GENERAL, top: int = 1, limit: int = 2_000_000) -> list[PlannedStrategy]:
    """The `top` cheapest feasible layouts of `space`, best first (ties by canonical key)."""
    start = time.perf_counter()
    price = PriceCache(problem)
    found: list[tuple[float, tuple, Layout]] = []
    seen = 0
    for layout in layouts(problem, space):
        seen += 1
        if seen > limit:
            raise PlanningError(f"exhaustive search over {space.name} passed {limit} layouts; use dp, dfs or mcts")
        priced = price(layout)
        if priced.feasible:
            found.append((priced.time, layout.key(), layout))
    if not found:
        raise PlanningError(f"no layout of the {space.name} space fits device memory ({seen} tried)")
    found.sort(key=lambda x: (x[0], x[1]))
    seconds = time.perf_counter() - start
    provenance = {"search": "exhaustive", "space": space.name, "seconds": seconds, "candidates": seen}
    return [planned(problem, layout, provenance) for _, _, layout in found[:top]]


__all__ = ["GENERAL", "PERMUTED", "SPACES", "Space", "UNIFORM", "compositions", "even_split", "exhaustive", "layouts", "group_sequences"]
