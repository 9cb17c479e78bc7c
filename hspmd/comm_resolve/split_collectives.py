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
from itertools import repeat
from operator import itemgetter

from hspmd.annotations import Annotation, Box, Split, box_intersection, device_pieces, split_bounds, subgroup_regions
from hspmd.comm_resolve.plan import Collective, Step, Transfer
from hspmd.comm_resolve.slices import Cell, Grid, box_contains, empty_box_at, in_ranges

KIND = {"SplitAllReduce": "all_reduce", "SplitReduceScatter": "reduce_scatter", "SplitAllGather": "all_gather"}


def _reduction_base(by_key: dict[tuple, list[int]]) -> tuple[list[list[int]], dict[int, int], list[tuple[int, ...]]]:
    """The groups of one slice's holders (one replica of each summand per group when every
    summand has as many replicas, else one group of the first replicas), each device's group,
    and each group's sorted members. Depends on the holders only: computed once per set."""
    lists = [by_key[k] for k in sorted(by_key)]
    if len({len(l) for l in lists}) == 1:
        groups = [[l[r] for l in lists] for r in range(len(lists[0]))]
    else:
        groups = [[l[0] for l in lists]]
    group_of: dict[int, int] = {}
    for i, g in enumerate(groups):
        for d in g:
            group_of.setdefault(d, i)
    return groups, group_of, [tuple(sorted(g)) for g in groups]


def _reduction_groups(base, needers: list[int]) -> list[tuple[tuple[int, ...], frozenset[int], list[int]]]:
    """(members, zero-input members, receivers) per group that receives part of one slice: a
    needer joins its own group, or the first group with a zero input."""
    groups, group_of, members = base
    zeros: list[int] = []
    receivers: dict[int, list[int]] = {}
    for e in needers:
        where = group_of.get(e)
        if where is None:
            where = 0
            zeros.append(e)
        receivers.setdefault(where, []).append(e)
    out = []
    for i in sorted(receivers):
        group = tuple(sorted(members[0] + tuple(zeros))) if i == 0 and zeros else members[i]
        out.append((group, frozenset(zeros) if i == 0 else frozenset(), receivers[i]))
    return out


def _gather_group(holders: list[int], needers: list[int],
                  needer_set: tuple[frozenset[int], tuple[int, ...]]) -> tuple[tuple[int, ...], int] | None:
    """(members, sender) of one slice's all-gather: the first holder and every needer lacking
    the slice; None when nobody lacks it. A lone holder that needs the slice too (a shard
    gathered by every replica) makes the members the needers, given as a set and sorted once
    per destination piece rather than per slice."""
    if len(holders) == 1 and holders[0] in needer_set[0]:
        return (needer_set[1], holders[0]) if len(needers) > 1 else None
    have = set(holders)
    lacking = [e for e in needers if e not in have]
    return (tuple(sorted({holders[0], *lacking})), holders[0]) if lacking else None


def _slice_roles(kind: str, sp, dp, grid: Grid, ndim: int):
    """(cell, entry) for every cell of `grid`: entry is [(members, zeros, receiver or None)] of
    the collectives that cell joins. Holders and needers are read on grids cut only by the source
    and only by the destination pieces, and each distinct (holders, needers) pair is worked out
    once, so a union of hundreds of subgroups costs its cell count, not cells x members."""
    src_grid, dst_grid = Grid([p.box for p in sp.values()], ndim), Grid([p.box for p in dp.values()], ndim)
    src_holders = src_grid.holders((d, p.box) for d, p in sorted(sp.items()))
    dst_holders = dst_grid.holders((d, p.box) for d, p in sorted(dp.items()))
    bases: dict[Cell | None, tuple] = {}
    needer_sets: dict[Cell | None, tuple[frozenset[int], tuple[int, ...]]] = {}
    worked: dict[tuple, list | None] = {}
    for (cell, src_cell), (_, dst_cell) in zip(grid.coarse_cells(src_grid), grid.coarse_cells(dst_grid)):
        key = (src_cell, dst_cell)
        if key not in worked:
            holders = src_holders.get(src_cell, [])
            needers = dst_holders.get(dst_cell, [])
            if kind == "all_gather":
                if dst_cell not in needer_sets:
                    needer_sets[dst_cell] = (frozenset(needers), tuple(sorted(needers)))
                group = _gather_group(holders, needers, needer_sets[dst_cell])
                worked[key] = [] if group is None else [(group[0], frozenset(), group[1])]
            else:
                if src_cell not in bases:
                    by_key: dict[tuple, list[int]] = defaultdict(list)
                    for d in holders:
                        by_key[sp[d].summand].append(d)
                    bases[src_cell] = _reduction_base(by_key)
                groups = _reduction_groups(bases[src_cell], needers)
                if kind == "reduce_scatter" and any(len(r) > 1 for _, _, r in groups):
                    worked[key] = None
                else:
                    worked[key] = [(m, z, r[0] if kind == "reduce_scatter" else None) for m, z, r in groups]
        yield cell, worked[key]


def split_step(primitive: str, src: Annotation, dst: Annotation, shape) -> Step | None:
    """The split collective from `src` to `dst` (same DG and DS union, HDim changed), or None when
    a slice would need one member to receive two different sums (then the caller reduces otherwise)."""
    aligned = _aligned_step(primitive, src, dst, shape)
    return aligned if aligned is not None else _cell_step(primitive, src, dst, shape)


def _aligned_step(primitive: str, src: Annotation, dst: Annotation, shape) -> Step | None:
    """The common large case without walking its cells: every subgroup splits one dim in one Split
    axis (TP), the top tier splits another dim (or none) and no piece is empty. Then position i of
    every subgroup holds the same rows, so each position is one collective over its devices, box
    the rows over the whole of the other dims, a member's part its own piece: what `_cell_step`
    gives (tests/test_scale_fast_paths.py compares both). None where it does not apply."""
    kind = KIND[primitive]
    uniform = src.uniform_states
    if src.hsize < 2 or uniform is None or uniform != dst.uniform_states or len(uniform[0].axes) != 1:
        return None
    axis = uniform[0].axes[0]
    sliced = {"all_reduce": None, "reduce_scatter": dst, "all_gather": src}[kind]
    if not isinstance(axis, Split) or (sliced is not None and sliced.hdim == axis.dim) or 0 in shape:
        return None
    rows = split_bounds(shape[axis.dim], [1] * axis.n)
    slabs = [None] * src.hsize if sliced is None else [r[sliced.hdim] for r in subgroup_regions(sliced, shape)]
    if any(a == b for a, b in rows) or any(s is not None and s[0] == s[1] for s in slabs):
        return None
    whole = tuple((0, n) for n in shape)
    collectives = []
    for i, row in enumerate(rows):
        box = whole[:axis.dim] + (row,) + whole[axis.dim + 1:]
        column = list(map(itemgetter(i), src.dg_key))  # position i of every subgroup
        order = sorted(range(len(column)), key=column.__getitem__)
        parts = ()
        if sliced is not None:
            before, after = box[:sliced.hdim], box[sliced.hdim + 1:]  # each part: the box, its member's slab on hdim
            parts = tuple(zip(*map(repeat, before), map(slabs.__getitem__, order), *map(repeat, after)))
        collectives.append(Collective(kind, tuple(map(column.__getitem__, order)), box, parts, ()))
    collectives.sort(key=lambda c: c.devices)
    return Step(primitive, src, dst, tuple(collectives), (), tuple(sorted(dst.devices)))


def _cell_step(primitive: str, src: Annotation, dst: Annotation, shape) -> Step | None:
    """split_step over the finest slices (module docstring)."""
    kind = KIND[primitive]
    sp, dp = device_pieces(src, shape), device_pieces(dst, shape)
    grid = Grid([p.box for p in sp.values()] + [p.box for p in dp.values()], len(shape))
    entries: dict[tuple, dict[Cell, int | None]] = defaultdict(dict)
    for cell, roles in _slice_roles(kind, sp, dp, grid, len(shape)):
        if roles is None:
            return None
        for members, zeros, receiver in roles:
            entries[(members, zeros)][cell] = receiver
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
    """Local copies of what a device holds and needs, except what its collectives deliver (cell by
    cell, unless one of its collectives' boxes holds all of it: the usual case, checked first)."""
    boxes: dict[int, list[Box]] = defaultdict(list)
    for c in collectives:
        for m in c.devices:
            boxes[m].append(c.box)
    transfers = []
    for d in sorted(dp):
        both = box_intersection(sp[d].box, dp[d].box) if d in sp else None
        if both is None or any(box_contains(box, both) for box in boxes[d]):
            continue
        covered = [grid.ranges(box) for box in boxes[d]]
        copied = grid.merge(c for c in grid.cells(both) if not any(in_ranges(c, r) for r in covered))
        if copied:
            transfers.append(Transfer(d, d, tuple(copied), (0,) * len(copied)))
    return tuple(transfers)


__all__ = ["KIND", "split_step"]
