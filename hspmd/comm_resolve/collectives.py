"""Bottom-tier collectives inside one sharding subgroup whose device group stays (paper figure 5).

Both distributed states are first written over a common refined radix (D:4 is D:2,D:2; S0:4 is
S0:2,S0:2 when the dim divides evenly, checked, since splits nest), so that each axis of one lines
up with an axis of the other. Each position where they
differ is one change, done by one primitive over the groups of devices that differ only in that
position's digit:

    P -> D   AllReduce          P -> S   ReduceScatter        S -> D   AllGather
    D -> S   LocalSplit (each device keeps its sub-box)
    S -> P, D -> P   LocalSplit (each device keeps its part of the value, the reduction's identity
                     elsewhere: 0 for sum, 1 for prod); under max, min and avg (no identity for
                     avg) D -> P keeps the whole value on every member and S -> P is no local step
    S(d) -> S(d')   no collective (an all-to-all): the caller falls back to BSR

Every step is checked geometrically (the parts must tile the box: with several splits of one dim
only some orders work), and the changes are tried in an order that shrinks data first (local
splits, reduce-scatters) and grows it last (all-gathers); the first order where every step is
valid wins.
"""

from __future__ import annotations

from math import prod
from typing import Sequence

from hspmd.annotations import (
    Annotation,
    Axis,
    Box,
    DistributedStates,
    Duplicate,
    Partial,
    Split,
    Subgroup,
    box_intersection,
)
from hspmd.annotations.algebra import common_refinement
from hspmd.annotations.states import IDEMPOTENT
from hspmd.annotations.geometry import subgroup_device_pieces
from hspmd.comm_resolve.plan import Collective, Step, Transfer
from hspmd.comm_resolve.slices import box_contains, box_volume

_ORDER = {("D", "S"): 0, ("P", "S"): 1, ("P", "D"): 2, ("S", "D"): 3, ("S", "P"): 4, ("D", "P"): 5}
_PRIMITIVE = {
    ("P", "D"): "AllReduce", ("P", "S"): "ReduceScatter", ("S", "D"): "AllGather",
    ("D", "S"): "LocalSplit", ("S", "P"): "LocalSplit", ("D", "P"): "LocalSplit",
}


def _kind(axis: Axis) -> str:
    return "S" if isinstance(axis, Split) else "D" if isinstance(axis, Duplicate) else "P"


def refine(a: Sequence[Axis], b: Sequence[Axis]) -> tuple[list[Axis], list[Axis]] | None:
    """Both axis lists over the common refinement of their radices, or None if there is none."""
    refined = common_refinement([a, b])
    return None if refined is None else tuple([axis for axis, _ in r] for r in refined)


def _groups(devices: Sequence[int], radix: Sequence[int], position: int) -> list[tuple[int, ...]]:
    """Devices that differ only in the digit at `position` (mixed radix, outermost first),
    ordered by that digit."""
    stride, n = prod(radix[position + 1 :]), radix[position]
    by_rest: dict[int, list[int]] = {}
    for index, device in enumerate(devices):
        by_rest.setdefault(index - (index // stride % n) * stride, []).append(device)
    return [tuple(members) for _, members in sorted(by_rest.items())]


def tiles(box: Box, parts: Sequence[Box]) -> bool:
    """The parts are disjoint, inside `box`, and cover it."""
    full = [p for p in parts if box_volume(p) > 0]
    if any(not box_contains(box, p) for p in full):
        return False
    if sum(box_volume(p) for p in full) != box_volume(box):
        return False
    return disjoint(full)


def disjoint(boxes: Sequence[Box]) -> bool:
    """No two of the (non-empty) boxes overlap. A sweep along the dim where they start at the most
    places compares each box only with those still open there: n slices of one dim (a gather over
    hundreds of data-parallel members) cost n log n, not n^2 pairs."""
    if len(boxes) < 2 or not boxes[0]:
        return len(boxes) < 2
    dim = max(range(len(boxes[0])), key=lambda d: len({b[d][0] for b in boxes}))
    open_: list[Box] = []
    for b in sorted(boxes, key=lambda b: b[dim][0]):
        open_ = [o for o in open_ if o[dim][1] > b[dim][0]]  # ended before b starts: meets no later box either
        if any(box_intersection(o, b) is not None for o in open_):
            return False
        open_.append(b)
    return True


def _replace(union: Annotation, k: int, ds: DistributedStates) -> Annotation:
    return union.with_subgroup(k, Subgroup(union.subgroups[k].dg, ds))


def change_step(union: Annotation, k: int, axes: list[Axis], position: int, new_axis: Axis, shape) -> Step | None:
    """One change at `position` of subgroup k's (refined) axes, or None when it is not valid."""
    before = _replace(union, k, DistributedStates(tuple(axes)))
    after_axes = axes[:position] + [new_axis] + axes[position + 1 :]
    after = _replace(union, k, DistributedStates(tuple(after_axes)))
    change = (_kind(axes[position]), _kind(new_axis))
    src, dst = subgroup_device_pieces(before, k, shape), subgroup_device_pieces(after, k, shape)
    devices = union.subgroups[k].dg.devices
    collectives, transfers = [], []
    for group in _groups(devices, [ax.n for ax in axes], position):
        first = group[0]
        if change == ("P", "D"):
            if box_volume(src[first].box) > 0:
                collectives.append(Collective("all_reduce", group, src[first].box))
        elif change == ("P", "S"):
            parts = tuple(dst[d].box for d in group)
            if not tiles(src[first].box, parts):
                return None
            if box_volume(src[first].box) > 0:
                collectives.append(Collective("reduce_scatter", group, src[first].box, parts))
        elif change == ("S", "D"):
            parts = tuple(src[d].box for d in group)
            if not tiles(dst[first].box, parts):
                return None
            if box_volume(dst[first].box) > 0:
                collectives.append(Collective("all_gather", group, dst[first].box, parts))
        elif change == ("D", "S"):
            for d in group:
                if not box_contains(src[d].box, dst[d].box):
                    return None
                transfers.append(Transfer(d, d, (dst[d].box,), (0,)))
        elif change == ("S", "P"):
            if new_axis.reduce in IDEMPOTENT or not tiles(dst[first].box, [src[d].box for d in group]):
                return None
            transfers.extend(Transfer(d, d, (src[d].box,), (0,)) for d in group)
        else:
            keeping = group if new_axis.reduce in IDEMPOTENT else group[:1]
            transfers.extend(Transfer(d, d, (src[d].box,), (0,)) for d in keeping)
    return Step(_PRIMITIVE[change], before, after, tuple(collectives), tuple(transfers), devices, k)


def _merge_local(first: Step, second: Step) -> Step:
    """Two consecutive local steps as one: what survives both copies is their intersection."""
    boxes: dict[int, list[Box]] = {}
    for t1 in first.transfers:
        for t2 in second.transfers:
            if t1.src == t2.src:
                for b1 in t1.boxes:
                    for b2 in t2.boxes:
                        common = box_intersection(b1, b2)
                        if common is not None:
                            boxes.setdefault(t1.src, []).append(common)
    transfers = tuple(Transfer(d, d, tuple(bs), (0,) * len(bs)) for d, bs in sorted(boxes.items()))
    return Step("LocalSplit", first.src, second.dst, (), transfers, first.assembled_on, first.subgroup)


def _same_layout(union: Annotation, k: int, ds: DistributedStates, axes: list[Axis], shape) -> bool:
    """Refining a split changes its pieces when the dim does not divide (splits nest): check
    (only subgroup k differs between the two unions, so only its pieces are compared)."""
    if list(ds.axes) == axes:
        return True
    return subgroup_device_pieces(_replace(union, k, ds), k, shape) == subgroup_device_pieces(
        _replace(union, k, DistributedStates(tuple(axes))), k, shape
    )


def collective_steps(union: Annotation, k: int, target: DistributedStates, shape) -> list[Step] | None:
    """Steps turning subgroup k's distributed states into `target` (same device group) by
    collectives and local splits only, or None when no such sequence exists."""
    source = union.subgroups[k].ds
    refined = refine(source.axes, target.axes)
    if refined is None:
        return None
    axes, goal = refined
    if not (_same_layout(union, k, source, axes, shape) and _same_layout(union, k, target, goal, shape)):
        return None
    changes = [p for p, (a, b) in enumerate(zip(axes, goal)) if a != b]
    if any((_kind(axes[p]), _kind(goal[p])) not in _ORDER for p in changes):
        return None
    changes.sort(key=lambda p: (_ORDER[(_kind(axes[p]), _kind(goal[p]))], -p))

    def search(current: list[Axis], left: list[int]) -> list[Step] | None:
        if not left:
            return []
        for p in left:
            step = change_step(union, k, current, p, goal[p], shape)
            if step is None:
                continue
            rest = search(current[:p] + [goal[p]] + current[p + 1 :], [q for q in left if q != p])
            if rest is not None:
                return [step] + rest
        return None

    steps = search(list(axes), changes)
    if steps is None or not steps:
        return steps
    merged = [steps[0]]
    for step in steps[1:]:
        if step.primitive == merged[-1].primitive == "LocalSplit":
            merged[-1] = _merge_local(merged[-1], step)
        else:
            merged.append(step)
    exact = _replace(union, k, target)
    last = merged[-1]
    merged[-1] = Step(last.primitive, last.src, exact, last.collectives, last.transfers, last.assembled_on, k)
    first = merged[0]
    merged[0] = Step(first.primitive, union, first.dst, first.collectives, first.transfers, first.assembled_on, k)
    return merged


def reduction_targets(ds: DistributedStates, region: Box) -> list[DistributedStates]:
    """Non-partial states to reduce subgroup states into, best first: each Partial becomes a split
    of the largest dim not split yet (a reduce-scatter), a duplicate (all-reduce) last."""
    extents = [stop - start for start, stop in region]
    dims = sorted(range(len(region)), key=lambda d: (d in ds.split_dims, -extents[d], d))
    swap = lambda make: DistributedStates(tuple(make(a.n) if isinstance(a, Partial) else a for a in ds.axes))  # noqa: E731
    return [swap(lambda n, d=d: Split(d, n)) for d in dims] + [swap(Duplicate)]


__all__ = ["change_step", "collective_steps", "reduction_targets", "refine", "tiles"]
