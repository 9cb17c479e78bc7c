"""Pure functions between annotations (figure 10 of the paper: aligning HSize for deduction)."""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from typing import Sequence

from hspmd.annotations.states import Axis, DeviceGroup, DistributedStates, Partial, Split, Subgroup
from hspmd.annotations.union import Annotation
from hspmd.errors import AnnotationError, AnnotationTypeError
from hspmd.limits import brief


def expand_hsize(ann: Annotation, hsize: int) -> Annotation:
    """The same layout written as a union of `hsize` subgroups, by lifting the outermost DS axis
    of an HSize-1 annotation to the top tier: S_d:h -> H_d(1:..:1), D:n -> HD, P:n -> HP.

    Exact for every shape (splits nest, so an outer S_d:h equals a top-tier split with equal
    ratios). Raises AnnotationError when the outermost axis cannot be lifted."""
    if isinstance(hsize, bool) or not isinstance(hsize, int):
        raise AnnotationTypeError(f"expand_hsize: hsize must be an int, got {brief(hsize)}")
    if hsize < 1:
        raise AnnotationError(f"expand_hsize: hsize must be at least 1 (a union has subgroups), got {hsize}")
    if hsize == ann.hsize:
        return ann
    if ann.hsize != 1:
        raise AnnotationError(f"cannot regroup {ann} (HSize {ann.hsize}) into HSize {hsize}; insert comm() instead")
    (sub,) = ann.subgroups
    if not sub.ds.axes:
        raise AnnotationError(f"{ann} has no axis to lift into {hsize} subgroups; insert comm() instead")
    outer, inner = sub.ds.axes[0], sub.ds.axes[1:]
    if isinstance(outer, Split) and outer.n != hsize or outer.n % hsize:
        raise AnnotationError(
            f"the outermost axis {outer} of {ann} does not split into {hsize} subgroups; insert comm() instead"
        )
    if isinstance(outer, Partial) and outer.reduce != "sum":
        raise AnnotationError(f"the outermost axis {outer} of {ann} cannot become a top-tier P (HP sums its subgroups); "
                              f"insert comm() instead")
    rest = outer.n // hsize
    if rest > 1:
        inner = (replace(outer, n=rest),) + inner
    step = len(sub.dg) // hsize
    devices = sub.dg.devices
    subgroups = tuple(
        Subgroup(DeviceGroup(devices[k * step : (k + 1) * step]), DistributedStates(inner)) for k in range(hsize)
    )
    if isinstance(outer, Split):
        return Annotation(subgroups, outer.dim, (1,) * hsize)
    return Annotation(subgroups, "P" if isinstance(outer, Partial) else "D")


def align_hsize(anns: list[Annotation]) -> list[Annotation]:
    """Bring every annotation to the largest HSize among them (deduction's first step)."""
    if not anns:
        raise AnnotationError("align_hsize needs at least one annotation, got none")
    target = max(a.hsize for a in anns)
    return [expand_hsize(a, target) for a in anns]


def common_refinement(axis_lists: Sequence[Sequence[Axis]]) -> tuple[tuple[tuple[Axis, int], ...], ...] | None:
    """Every axis list cut at the union of all lists' cut points (the running products of their
    counts), each refined axis paired with the index of the axis it came from: [S0:4] and [D:2, D:2]
    give ((S0:2, 0), (S0:2, 0)) and ((D:2, 0), (D:2, 1)). None where the cut points do not nest
    (one list's count does not divide the next cut of another), so no common refinement exists."""
    cuts = {1}
    for axes in axis_lists:
        cuts.update(accumulate((a.n for a in axes), lambda x, y: x * y))
    chain = sorted(cuts)
    if any(hi % lo for lo, hi in zip(chain, chain[1:])):
        return None
    out = []
    for axes in axis_lists:
        refined, start = [], 1
        for index, axis in enumerate(axes):
            stop, prev = start * axis.n, start
            for c in (c for c in chain if start < c <= stop):
                refined.append((replace(axis, n=c // prev), index))
                prev = c
            start = stop
        out.append(tuple(refined))
    return tuple(out)


__all__ = ["common_refinement", "expand_hsize", "align_hsize"]
