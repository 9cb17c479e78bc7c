"""Layouts of a tensor split along its sequence dim (context parallelism), as pure functions.

A tensor whose dim `dim` is split is cut into *chunks* along it: the top tier's pieces (when
HDim is `dim`) times each subgroup's own `S<dim>` axes. Chunk g of a union is held by the devices
whose seq coordinate is g: its index in the top tier times the subgroup's seq splits, plus its
index in the mixed radix of the subgroup's `S<dim>` axes. Where HDim is another dim (or D, P),
each subgroup is a ring of its own.

Ring attention passes K/V chunks around that ring: `ring_shift(ann, dim, j)` is the layout in
which the device that holds chunk r under `ann` holds chunk r - j (mod the ring size), every other
coordinate kept, so resharding a tensor from `ann` to `ring_shift(ann, dim, j)` sends each chunk
j places along the ring (one message per device). The slots keep their sizes, so uneven splits
(top-tier ratios) shift too: a device then receives a chunk of another size.
"""

from __future__ import annotations

from math import prod

from hspmd.annotations.states import DeviceGroup, DistributedStates, Duplicate, Partial, Split, Subgroup
from hspmd.annotations.union import Annotation
from hspmd.errors import AnnotationError


def _seq_axes(ds: DistributedStates, dim: int) -> list[int]:
    return [i for i, a in enumerate(ds.axes) if isinstance(a, Split) and a.dim == dim]


def ring_size(ann: Annotation, dim: int) -> int:
    """How many chunks of `dim` each ring has (1: the dim is whole on every device). Subgroups
    of one ring must split `dim` alike."""
    counts = {ds.split_count(dim) for ds in ann.distinct_states}
    if len(counts) > 1:
        raise AnnotationError(f"{ann}: subgroups split dim {dim} into different counts {sorted(counts)}; "
                              f"a sequence ring needs one count per subgroup")
    inner = counts.pop()
    return inner * ann.hsize if ann.hdim == dim else inner


def _coordinates(ds: DistributedStates, position: int) -> list[int]:
    coords = []
    for a in reversed(ds.axes):
        position, c = divmod(position, a.n)
        coords.append(c)
    return coords[::-1]


def ring_shift(ann: Annotation, dim: int, j: int) -> Annotation:
    """`ann` with every chunk of `dim` moved j places back along its ring (see the module
    docstring); `ann` itself where the shift is a whole number of turns."""
    size = ring_size(ann, dim)
    if j % size == 0:
        return ann
    across = ann.hdim == dim and ann.hsize > 1
    if across and len(set(ann.distinct_states)) > 1 or across and len({len(dg) for dg in ann.dg_union}) > 1:
        raise AnnotationError(f"{ann}: a ring across subgroups needs every subgroup to have the same states and size")
    holder: dict[tuple, int] = {}  # (ring, chunk, other coordinates) -> device
    slots: list[list[tuple]] = []
    for k, sub in enumerate(ann.subgroups):
        seq = _seq_axes(sub.ds, dim)
        inner = prod(sub.ds.axes[i].n for i in seq)
        keys = []
        for p, device in enumerate(sub.dg.devices):
            coords = _coordinates(sub.ds, p)
            i = 0
            for axis in seq:
                i = i * sub.ds.axes[axis].n + coords[axis]
            ring, chunk = (0, k * inner + i) if across else (k, i)
            other = tuple(c for a, c in enumerate(coords) if a not in seq)
            holder[(ring, chunk, other)] = device
            keys.append((ring, chunk, other))
        slots.append(keys)
    subgroups = tuple(
        Subgroup(DeviceGroup(tuple(holder[(ring, (chunk + j) % size, other)] for ring, chunk, other in keys)), sub.ds)
        for sub, keys in zip(ann.subgroups, slots))
    return Annotation(subgroups, ann.hdim, ann.ratios)


def whole_along(ann: Annotation, dim: int) -> Annotation:
    """`ann` with `dim` whole on every device: its splits become replicas (what an all-gather along
    `dim` inside each subgroup, and across them where HDim is `dim`, gives)."""
    subgroups = tuple(Subgroup(s.dg, DistributedStates(tuple(
        Duplicate(a.n) if isinstance(a, Split) and a.dim == dim else a for a in s.ds.axes))) for s in ann.subgroups)
    if ann.hdim == dim:
        return Annotation(subgroups, "D")
    return Annotation(subgroups, ann.hdim, ann.ratios)


def partial_along(ann: Annotation, dim: int) -> Annotation:
    """`ann` with every split of `dim` read as partial summands (the layout of the gradient of a
    tensor gathered whole along `dim`: each device holds its contribution to every row)."""
    subgroups = tuple(Subgroup(s.dg, DistributedStates(tuple(
        Partial(a.n) if isinstance(a, Split) and a.dim == dim else a for a in s.ds.axes))) for s in ann.subgroups)
    if ann.hdim == dim:
        return Annotation(subgroups, "P")
    return Annotation(subgroups, ann.hdim, ann.ratios)


def moved_split(ann: Annotation, src: int, dst: int) -> Annotation:
    """`ann` with every split of dim `src` (both tiers, same counts and ratios) splitting `dst`
    instead: all-to-all (Ulysses) attention moves the sequence split to the heads and back."""
    subgroups = tuple(Subgroup(s.dg, DistributedStates(tuple(
        Split(dst, a.n) if isinstance(a, Split) and a.dim == src else a for a in s.ds.axes))) for s in ann.subgroups)
    return Annotation(subgroups, dst if ann.hdim == src else ann.hdim, ann.ratios)


__all__ = ["moved_split", "partial_along", "ring_shift", "ring_size", "whole_along"]
