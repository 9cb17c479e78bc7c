"""Finest-grained slices: the grid cut at every boundary of every piece involved in a reshard.

The paper's planners (split collectives, BSR) reason per slice: within one grid cell every device
either holds all of it or none of it, so ownership and need are per cell. Cells are index tuples
into the per-dim cut lists; `Grid.merge` turns a set of cells back into few disjoint boxes so that
plans and messages stay short. Uneven, non-power-of-two and empty pieces need no special case: a
cut is a cut.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import product
from math import prod
from typing import Iterable, Sequence

from hspmd.annotations import Box

Cell = tuple[int, ...]


def box_volume(box: Box) -> int:
    """Elements in `box` (0 when empty); a loop, as planners call it for every piece and cell."""
    volume = 1
    for start, stop in box:
        if stop <= start:
            return 0
        volume *= stop - start
    return volume


def box_contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def empty_box_at(box: Box) -> Box:
    """A zero-volume box anchored at `box`'s corner (a member that contributes or receives nothing)."""
    return ((box[0][0], box[0][0]),) + tuple(box[1:]) if box else box


class Grid:
    """The cut lists of one tensor's finest slices (cells are index tuples)."""

    def __init__(self, boxes: Iterable[Box], ndim: int):
        cuts: list[set[int]] = [set() for _ in range(ndim)]
        for box in set(boxes):  # a union's devices repeat few boxes
            if box_volume(box) == 0:
                continue
            for dim, (start, stop) in enumerate(box):
                cuts[dim].add(start)
                cuts[dim].add(stop)
        self.cuts = [sorted(c) for c in cuts]
        self.ndim = ndim
        # per dim, each cell index's (start, stop) and width: planners read them per cell
        self._spans = [list(zip(c, c[1:])) for c in self.cuts]
        self._widths = [[b - a for a, b in zip(c, c[1:])] for c in self.cuts]

    def ranges(self, box: Box) -> tuple[range, ...]:
        """Cell index ranges per dim covered by `box` (whose bounds are cuts of this grid)."""
        if box_volume(box) == 0:
            return tuple(range(0) for _ in box)
        return tuple(
            range(bisect_left(c, start), bisect_left(c, stop)) for c, (start, stop) in zip(self.cuts, box)
        )

    def cells(self, box: Box) -> Iterable[Cell]:
        return product(*self.ranges(box))

    def holders(self, boxes: Iterable[tuple[int, Box]]) -> dict[Cell, list[int]]:
        """{cell: devices whose box covers it}, devices in the order given. Walks each distinct
        box's own cells once (replicas share a box), so it costs the distinct boxes' cell count
        plus the devices, rather than cells x devices."""
        by_box: dict[Box, list[tuple[int, int]]] = {}
        for i, (device, box) in enumerate(boxes):
            by_box.setdefault(box, []).append((i, device))
        out: dict[Cell, list[tuple[int, int]]] = {}
        mixed = set()
        for box, members in by_box.items():
            for cell in self.cells(box):
                if cell in out:
                    out[cell] = out[cell] + members  # a new list: `members` is shared by the box's cells
                    mixed.add(cell)
                else:
                    out[cell] = members
        return {cell: [d for _, d in (sorted(m) if cell in mixed else m)] for cell, m in out.items()}

    def coarse_cells(self, coarse: "Grid") -> Iterable[tuple[Cell, Cell | None]]:
        """(cell, the cell of `coarse` containing it, or None outside it) for every cell of this
        grid, whose cuts must include the coarse grid's. Ownership read on a coarse grid (cut
        only where the owners' pieces are) is then looked up once per coarse cell, not walked
        over every fine cell each owner covers."""
        per_dim = []
        for fine, cuts in zip(self.cuts, coarse.cuts):
            index = [bisect_right(cuts, start) - 1 for start in fine[:-1]]
            per_dim.append([i if 0 <= i < len(cuts) - 1 else None for i in index])
        cells = product(*(range(len(c) - 1) for c in self.cuts))
        return zip(cells, (None if None in outer else outer for outer in product(*per_dim)))  # same order

    def cell_box(self, cell: Cell) -> Box:
        return tuple(map(list.__getitem__, self._spans, cell))

    def cell_volume(self, cell: Cell) -> int:
        return prod(map(list.__getitem__, self._widths, cell))

    def index_box(self, lo: Sequence[int], hi: Sequence[int]) -> Box:
        return tuple((c[a], c[b]) for c, a, b in zip(self.cuts, lo, hi))

    def merge(self, cells: Iterable[Cell]) -> list[Box]:
        """Disjoint boxes covering exactly `cells` (greedy growth, last dim first)."""
        remaining = set(cells)
        if len(remaining) == 1:  # the common case of fine grids (e.g. an all-to-all's messages)
            return [self.cell_box(next(iter(remaining)))]
        if not remaining:
            return []
        lo, hi = [min(i) for i in zip(*remaining)], [max(i) + 1 for i in zip(*remaining)]
        if len(remaining) == prod(b - a for a, b in zip(lo, hi)):  # one full box: what growing it finds
            return [self.index_box(lo, hi)]
        return self.grown(remaining)

    def grown(self, remaining: set[Cell]) -> list[Box]:
        """merge by greedy growth from the smallest cell left, last dim first (empties `remaining`)."""
        boxes = []
        for start in sorted(remaining):
            if start not in remaining:
                continue
            lo, hi = list(start), [i + 1 for i in start]
            for dim in reversed(range(self.ndim)):
                while True:
                    slab = [range(lo[d], hi[d]) if d != dim else range(hi[dim], hi[dim] + 1) for d in range(self.ndim)]
                    if hi[dim] < len(self.cuts[dim]) - 1 and all(c in remaining for c in product(*slab)):
                        hi[dim] += 1
                    else:
                        break
            remaining.difference_update(product(*(range(a, b) for a, b in zip(lo, hi))))
            boxes.append(self.index_box(lo, hi))
        return boxes


def in_ranges(cell: Cell, ranges: tuple[range, ...]) -> bool:
    return all(r.start <= i < r.stop for i, r in zip(cell, ranges))


__all__ = ["Cell", "Grid", "box_contains", "box_volume", "empty_box_at", "in_ranges"]
