"""Top-tier split collectives (paper figure 6): HDim changes over an unchanged DG and DS union.

    HP -> HD   SplitAllReduce        HP -> H<d>   SplitReduceScatter        H<d> -> HD   SplitAllGather

The tensor is cut into its finest slices (every piece boundary of every subgroup, before and
after). For each slice, the devices holding it in each subgroup form a small group across
subgroups, and one collective of the plain kind runs per group; slices with the same group are
merged back into one box, so the plan has one sub-collective per distinct group and region (for
TP4 | TP2 that is four all-reduces of a quarter each, pairing each TP4 device with the TP2 device
holding the same columns). Bottom-tier sharding inside each subgroup is kept as it is.

Replicas (Duplicate axes) form parallel groups (one replica of each summand per group) when every
summand has as many replicas; otherwise one group carries them and the extra members contribute
zeros. A device that must receive a slice it does not hold joins the slice's group with a zero
input. Any subgroup sizes and split dims work: the grid has no preferred dim.
"""

from __future__ import annotations

from collections import defaultdict

from hspmd.annotations import Annotation, device_pieces
from hspmd.comm_resolve.plan import Collective, Step, Transfer
from hspmd.comm_resolve.slices import Cell, Grid, empty_box_at

KIND = {"SplitAllReduce": "all_reduce", "SplitReduceScatter": "reduce_scatter", "SplitAllGather": "all_gather"}


def _reduction_groups(by_key: dict[tuple, list[int]], needers: list[int]) -> list[tuple[tuple[int, ...], set[int], list[int]]]:
    """(members, zero-input members, receivers) per group for one slice of a reduction."""
    lists = [by_key[k] for k in sorted(by_key)]
    if len({len(l) for l in lists}) == 1:
        groups = [[l[r] for l in lists] for r in range(len(lists[0]))]
    else:
        groups = [[l[0] for l in lists]]
    zeros: list[set[int]] = [set() for _ in groups]
    receivers: list[list[int]] = [[] for _ in groups]
    group_of = {}
    for i, g in enumerate(groups):
        for d in g:
            group_of.setdefault(d, i)
    for e in needers:
        where = group_of.get(e)
        if where is None:
            where = group_of[e] = 0
            groups[0].append(e)
            zeros[0].add(e)
        receivers[where].append(e)
    return [(tuple(sorted(g)), z, r) for g, z, r in zip(groups, zeros, receivers)]


def split_step(primitive: str, src: Annotation, dst: Annotation, shape) -> Step | None:
    """The split collective from `src` to `dst` (same DG and DS union, HDim changed), or None when
    a slice would need one member to receive two different sums (then the caller reduces otherwise)."""
    kind = KIND[primitive]
    sp, dp = device_pieces(src, shape), device_pieces(dst, shape)
    grid = Grid([p.box for p in sp.values()] + [p.box for p in dp.values()], len(shape))
    src_holders = grid.holders((d, p.box) for d, p in sorted(sp.items()))
    dst_holders = grid.holders((d, p.box) for d, p in sorted(dp.items()))
    entries: dict[tuple, dict[Cell, int | None]] = defaultdict(dict)
    for cell in grid.cells(tuple((0, s) for s in shape)):
        holders = src_holders.get(cell, [])
        needers = dst_holders.get(cell, [])
        if kind == "all_gather":
            lacking = [e for e in needers if e not in holders]
            if lacking:
                entries[(tuple(sorted({holders[0], *lacking})), frozenset())][cell] = holders[0]
            continue
        by_key: dict[tuple, list[int]] = defaultdict(list)
        for d in holders:
            by_key[sp[d].summand].append(d)
        for members, zeros, receivers in _reduction_groups(by_key, needers):
            if not receivers:
                continue
            if kind == "reduce_scatter" and len(receivers) > 1:
                return None
            entries[(members, frozenset(zeros))][cell] = receivers[0] if kind == "reduce_scatter" else None
    collectives = []
    for (members, zeros), roles in sorted(entries.items(), key=lambda item: (item[0][0], sorted(item[0][1]))):
        for box in grid.merge(roles):
            collectives.extend(_collectives(kind, members, tuple(sorted(zeros)), box, roles, grid))
    transfers = _self_copies(collectives, sp, dp, grid) if kind == "all_gather" else ()
    return Step(primitive, src, dst, tuple(collectives), transfers, tuple(sorted(dp)))


def _collectives(kind, members, zeros, box, roles, grid: Grid) -> list[Collective]:
    """One collective over `box`, or one per slice when a member's part would not be one box."""
    if kind == "all_reduce":
        return [Collective(kind, members, box, (), zeros)]
    cells = list(grid.cells(box))
    cells_of: dict[int, list[Cell]] = defaultdict(list)
    for c in cells:
        cells_of[roles[c]].append(c)
    parts = []
    for m in members:
        mine = grid.merge(cells_of[m])
        if len(mine) > 1:
            return [
                Collective(kind, members, grid.cell_box(c),
                           tuple(grid.cell_box(c) if roles[c] == m else empty_box_at(grid.cell_box(c)) for m in members),
                           zeros)
                for c in cells
            ]
        parts.append(mine[0] if mine else empty_box_at(box))
    return [Collective(kind, members, box, tuple(parts), zeros)]


def _self_copies(collectives, sp, dp, grid: Grid) -> tuple[Transfer, ...]:
    """Local copies of what a device holds and needs, except what its collectives deliver."""
    covered: dict[int, set[Cell]] = defaultdict(set)
    for c in collectives:
        cells = set(grid.cells(c.box))
        for m in c.devices:
            covered[m] |= cells
    transfers = []
    for d in sorted(dp):
        if d not in sp:
            continue
        src_cells = set(grid.cells(sp[d].box))
        mine = [c for c in grid.cells(dp[d].box) if c in src_cells and c not in covered[d]]
        boxes = grid.merge(mine)
        if boxes:
            transfers.append(Transfer(d, d, tuple(boxes), (0,) * len(boxes)))
    return tuple(transfers)


__all__ = ["KIND", "split_step"]
