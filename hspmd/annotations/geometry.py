"""Shard geometry: which piece of the global tensor each device holds, and in which role.

The one splitting rule, used everywhere (top tier, bottom tier, the resolver's slice grids):
a dim of length L split with weights w_0..w_{n-1} (W = sum) gives piece k the half-open range
    [floor(L * (w_0+..+w_{k-1}) / W), floor(L * (w_0+..+w_k) / W)).
Plain splits use equal weights. Pieces differ by at most one element per unit weight, a dim
smaller than its shard count gives empty pieces, and the rule holds for sympy symbols too.

Splits nest: the top tier splits the tensor into subgroup regions, and each Split axis of a
subgroup's DS, outermost first, splits the piece left by the axes before it (so S0:2,S0:2 is
"halves of halves", which differs from S0:4 only when the dim does not divide).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from math import prod
from operator import itemgetter
from typing import Iterable, Sequence, Union

import sympy

from hspmd.annotations.states import DistributedStates, Partial, Split, Subgroup, numbered
from hspmd.annotations.union import Annotation
from hspmd.errors import ShapeError, ShapeTypeError
from hspmd.limits import MAX_DIMS, MAX_RATIO, brief, check_limit

Length = Union[int, sympy.Expr]
Range = tuple[Length, Length]
Box = tuple[Range, ...]


def _floor_div(a: Length, b: int) -> Length:
    if isinstance(a, int):
        return a // b
    return sympy.floor(sympy.sympify(a) / b)


def split_bounds(length: Length, weights: Sequence[int]) -> list[Range]:
    """The ranges of a dim of `length` split by `weights` (see the module docstring)."""
    total = sum(weights)
    if total <= 0:  # (checked only here: weights are checked where users give them, check_ratios)
        raise ShapeError(f"split weights must sum to a positive number, got {brief(list(weights))}")
    if isinstance(length, int):  # (the usual case: no symbolic floor per weight)
        cuts = [0] + [length * c // total for c in accumulate(weights)]
    else:
        cuts = [0] + [_floor_div(length * c, total) for c in accumulate(weights)]
    return list(zip(cuts, cuts[1:]))


def box_shape(box: Box) -> tuple[Length, ...]:
    return tuple(stop - start for start, stop in box)


def box_intersection(a: Box, b: Box) -> Box | None:
    """The common sub-box, or None when it is empty (int boxes only; a loop, as planners call it
    for every pair of pieces)."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        start, stop = (a0 if a0 > b0 else b0), (a1 if a1 < b1 else b1)
        if stop <= start:
            return None
        out.append((start, stop))
    return tuple(out)


def box_relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that cut `inner` (global coordinates) out of a tensor holding `outer`."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


@dataclass(frozen=True)
class Piece:
    """What one device holds: the global box, and `summand` = () for the value itself or
    (subgroup, bottom-tier summand index) for a partial summand. Devices holding equal pieces are
    replicas and must hold equal values."""

    box: Box
    summand: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[Length, ...]:
        return box_shape(self.box)

    @property
    def is_partial(self) -> bool:
        return bool(self.summand)


def _digits(index: int, radix: Sequence[int]) -> list[int]:
    """Mixed-radix digits of `index`, most significant (outermost axis) first."""
    out = []
    for n in reversed(radix):
        out.append(index % n)
        index //= n
    return out[::-1]


def _combine(digits: Sequence[int], radix: Sequence[int]) -> int:
    value = 0
    for d, n in zip(digits, radix):
        value = value * n + d
    return value


def check_shape(ann: Annotation, shape: Sequence[Length], where: str = "") -> tuple[Length, ...]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ShapeTypeError(f"a shape is a sequence of non-negative integers, got {brief(shape)}")
    shape = tuple(shape)
    check_limit(len(shape), MAX_DIMS, "the tensor rank", where)
    for i, s in enumerate(shape):
        if isinstance(s, bool) or not isinstance(s, (int, sympy.Expr)):
            raise ShapeTypeError(f"dim {i} of shape {shape} must be an integer (or a sympy symbol), got {brief(s)}")
        if s.is_negative if isinstance(s, sympy.Expr) else s < 0:  # a negative sympy constant too
            raise ShapeError(f"dim {i} of shape {shape} is negative")
    ann.check_rank(len(shape), where)
    return shape


def check_ratios(ratios: Sequence[int] | None) -> tuple[int, ...] | None:
    """Run-time top-tier ratios as a tuple of positive integers (None stays None); subgroup_regions
    checks their count where they are used."""
    if ratios is None:
        return None
    if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__iter__"):
        raise ShapeTypeError(f"ratios must be a sequence of positive integers, got {brief(ratios)}")
    ratios = tuple(ratios)
    for r in ratios:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ShapeTypeError(f"ratios must be positive integers, got {brief(r)} in {brief(ratios)}")
        if r < 1:
            raise ShapeError(f"ratios must be positive integers, got {brief(r)} in {brief(ratios)}: a zero or negative weight has no piece")
        check_limit(r, MAX_RATIO, "a split ratio")
    return ratios


def subgroup_regions(ann: Annotation, shape: Sequence[Length], ratios: Sequence[int] | None = None) -> list[Box]:
    """The global box each subgroup covers (its top-tier piece).

    `ratios` binds a run-time HDim split (`H0{...}`); it is ignored when the annotation has its own.
    Kept with the annotation: planners ask for one subgroup's region of a large union per step."""
    return list(_kept_regions(ann, check_shape(ann, shape), check_ratios(ratios)))


def _kept_regions(ann: Annotation, shape: tuple[Length, ...], ratios: tuple[int, ...] | None) -> tuple[Box, ...]:
    return ann.derived(("regions", shape, ratios), lambda: _regions(ann, shape, ratios))


def _regions(ann: Annotation, shape: tuple[Length, ...], ratios: tuple[int, ...] | None) -> tuple[Box, ...]:
    if not isinstance(ann.hdim, int):
        return _top_tier_regions(ann.hdim, None, ann.hsize, shape)
    weights = ann.ratios or ratios
    if weights is None:
        raise ShapeError(
            f"{ann} splits dim {ann.hdim} across subgroups in ratios bound at run time; "
            f"pass ratios=(...) or bind them with annotation.with_ratios(...)"
        )
    if len(weights) != ann.hsize:
        raise ShapeError(f"{len(weights)} ratios given for {ann}, which has HSize {ann.hsize}")
    return _top_tier_regions(ann.hdim, tuple(weights), ann.hsize, shape)


@lru_cache(maxsize=256)
def _top_tier_regions(hdim, weights: tuple[int, ...] | None, hsize: int, shape: tuple[Length, ...]) -> tuple[Box, ...]:
    """Each subgroup's region: a function of the top tier and the shape alone, so the many
    layouts of a plan through one union share one tuple."""
    whole = tuple((0, s) for s in shape)
    if not isinstance(hdim, int):
        return (whole,) * hsize
    head, tail = whole[:hdim], whole[hdim + 1:]
    return tuple(head + (rng,) + tail for rng in split_bounds(shape[hdim], weights or (1,) * hsize))


def split_index(sub: Subgroup, index: int, dim: int) -> tuple[int, int]:
    """(piece index, piece count) along `dim` of the device at `index` in the subgroup's DG."""
    digits = _digits(index, [a.n for a in sub.ds.axes])
    on_dim = [(d, a.n) for d, a in zip(digits, sub.ds.axes) if isinstance(a, Split) and a.dim == dim]
    return _combine([d for d, _ in on_dim], [n for _, n in on_dim]), prod(n for _, n in on_dim)


def summand_index(sub: Subgroup, index: int) -> int | None:
    """Bottom-tier summand index of the device at `index`, None when the subgroup has no Partial."""
    return _summand(_digits(index, [a.n for a in sub.ds.axes]), sub.ds.axes)


def _summand(digits: Sequence[int], axes) -> int | None:
    kinds = [(d, a.n) for d, a in zip(digits, axes) if isinstance(a, Partial)]
    return _combine([d for d, _ in kinds], [n for _, n in kinds]) if kinds else None


def subgroup_pieces(sub: Subgroup, region: Box) -> dict[int, Piece]:
    """Bottom tier: each device's piece of `region` under the subgroup's distributed states;
    a partial piece's summand is (bottom-tier summand index,)."""
    return {device: Piece(box, () if j is None else (j,)) for device, (box, j) in _placed_pieces(sub, region)}


def _placed_pieces(sub: Subgroup, region: Box):
    """(device, (box, summand index or None)) of each device of the subgroup in `region`."""
    relative = _relative_pieces(sub.ds, tuple(stop - start for start, stop in region))
    return zip(sub.dg.devices, ((_moved_to(box, region), j) for box, j in relative))


def _moved_to(box: Box, region: Box) -> Box:
    """A box relative to the region's start, in global coordinates."""
    return tuple((a + start, b + start) for (a, b), (start, _) in zip(box, region))


@lru_cache(maxsize=4096)
def _relative_pieces(ds: DistributedStates, extents: tuple[Length, ...]) -> tuple[tuple[Box, int | None], ...]:
    """(box, summand index) per device index of a subgroup with states `ds` covering a region of
    `extents` at the origin. A piece depends on the region only through its extents (splits cut
    each range relative to its start), so the subgroups of a union share one computation and
    only shift it to their region: what keeps device_pieces linear with a small constant for
    unions of hundreds of subgroups. (Cached, so the rank check below runs once per states and extents.)"""
    if ds.split_dims and max(ds.split_dims) >= len(extents):
        raise ShapeError(f"{ds} splits dim {max(ds.split_dims)}, outside a rank-{len(extents)} region")
    radix = [a.n for a in ds.axes]
    out = []
    for index in range(ds.size):
        box = [(0, e) for e in extents]
        digits = _digits(index, radix)
        for digit, axis in zip(digits, ds.axes):
            if isinstance(axis, Split):
                start, stop = box[axis.dim]
                lo, hi = split_bounds(stop - start, [1] * axis.n)[digit]
                box[axis.dim] = (start + lo, start + hi)
        out.append((tuple(box), _summand(digits, ds.axes)))
    return tuple(out)


def _union_pieces(ann: Annotation, k: int, region: Box) -> dict[int, Piece]:
    """Subgroup k's pieces as members of the union (summands named (k, j))."""
    return {device: Piece(box, _union_summand(ann, k, j)) for device, (box, j) in _placed_pieces(ann.subgroups[k], region)}


def _union_summand(ann: Annotation, k: int, j: int | None) -> tuple[int, ...]:
    return (k, j or 0) if ann.hdim == "P" or j is not None else ()


def device_pieces(ann: Annotation, shape: Sequence[Length], ratios: Sequence[int] | None = None) -> dict[int, Piece]:
    """{device: Piece} for every device of the union.

    A partial summand is named (subgroup k, bottom-tier summand j): summing over j gives subgroup
    k's value of its region, and under HDim P summing over k gives the tensor."""
    if not isinstance(ann, Annotation):
        raise ShapeTypeError(f"device_pieces needs an Annotation (parse text first), got {brief(ann)}")
    return dict(_device_pieces(ann, check_shape(ann, shape), check_ratios(ratios)))


@lru_cache(maxsize=64)
def _device_pieces(ann: Annotation, shape: tuple[Length, ...], ratios: tuple[int, ...] | None) -> dict[int, Piece]:
    """device_pieces, cached: a pure function of immutable values that a resolver asks for
    several times per plan (and for the same layouts across plans). Callers get a copy, so the
    cached dict is never modified; the size bound keeps memory small for unions of many devices."""
    out: dict[int, Piece] = {}
    placed: dict[tuple, tuple] = {}  # (states, region) -> ((box, summand index), ...) in device order
    values: dict[tuple, tuple[Piece, ...]] = {}  # the same as value pieces
    for k, region in enumerate(subgroup_regions(ann, shape, ratios)):
        sub = ann.subgroups[k]
        key = (sub.ds, region)  # subgroups of equal states on one region (HD, HP unions) share boxes
        if key not in placed:
            placed[key] = tuple(p for _, p in _placed_pieces(sub, region))
        if ann.hdim == "P" or sub.ds.partial_count > 1:  # summands are named after their subgroup
            out.update(zip(sub.dg.devices, (Piece(box, (k, j or 0)) for box, j in placed[key])))
            continue
        if key not in values:
            values[key] = tuple(Piece(box) for box, _ in placed[key])
        out.update(zip(sub.dg.devices, values[key]))
    return out


def device_pieces_of(ann: Annotation, shape: Sequence[Length], devices: Iterable[int],
                     ratios: Sequence[int] | None = None) -> dict[int, Piece]:
    """device_pieces restricted to `devices` (those of the union, in the order given), each worked
    out from its own subgroup (device_piece): a planner asking for one subgroup's devices of a
    large union pays for those, not for the union."""
    if not isinstance(ann, Annotation):
        raise ShapeTypeError(f"device_pieces needs an Annotation (parse text first), got {brief(ann)}")
    shape = check_shape(ann, shape)
    pieces = ((d, device_piece(ann, shape, d, ratios)) for d in devices)
    return {d: p for d, p in pieces if p is not None}


def device_piece(ann: Annotation, shape: Sequence[Length], device: int,
                 ratios: Sequence[int] | None = None) -> Piece | None:
    """`device`'s piece (None: it holds none), worked out from its own subgroup. Unions made from one
    another subgroup by subgroup keep their device index and regions (Annotation.with_subgroup),
    so reading one device's piece of each of a plan's hundreds of intermediate layouts costs a
    subgroup each, where device_pieces would pass over every device of each."""
    if device not in ann.device_set:
        return None
    k = ann.subgroup_of(device)
    sub, region = ann.subgroups[k], _kept_regions(ann, check_shape(ann, shape), check_ratios(ratios))[k]
    box, j = _relative_pieces(sub.ds, tuple(stop - start for start, stop in region))[sub.dg.devices.index(device)]
    return Piece(_moved_to(box, region), _union_summand(ann, k, j))


def subgroup_kinds(before: Annotation, after: Annotation, shape: Sequence[Length]) -> tuple[int | None, ...]:
    """Per subgroup of `after`, a number equal for two subgroups exactly where, position by
    position in their device groups, the pieces they hold in `after` and their devices' pieces in
    `before` are the same up to a shift of their regions. The kind is made of the subgroup's
    states and region extents, with the states and region extents of the subgroup of `before`
    holding all its devices, their positions there and the offset between the two regions
    (_relative_start), or with nothing when `before` holds none of its devices; None where its
    devices lie otherwise in `before` (in several subgroups, or some outside it). A planner then
    works out one subgroup per kind of a union of hundreds, in a pass over subgroups."""
    return _subgroup_kinds(before, after, check_shape(after, shape))


@lru_cache(maxsize=64)
def _subgroup_kinds(before: Annotation, after: Annotation, shape: tuple[Length, ...]) -> tuple[int | None, ...]:
    after_regions = _kept_regions(after, shape, None)
    before_regions = _kept_regions(before, check_shape(before, shape), None)
    after_extents, before_extents = region_extents(after, shape), region_extents(before, shape)
    aligned = before.same_dg_union(after)  # the usual case: subgroup k on the same devices in both
    if before.uniform_states and after.uniform_states and (aligned or _picked_alike(before, after)):
        # every subgroup alike in both layouts, on the same devices or (HetAuto's gathered layouts)
        # on those at the same positions of the source's subgroup k: the regions tell kinds apart
        split0, split = before.uniform_states[0].split_dims, after.uniform_states[0].split_dims
        starts = _relative_starts(split0, before_regions, split, after_regions)
        return numbered(list(zip(after_extents, before_extents, starts)))  # (of ints: hashed in C)
    held = before.device_set
    if held.isdisjoint(after.devices):  # (a move onto other devices: only the states and extents tell)
        return numbered(list(zip(after.states_codes, after_extents)))
    kinds: list[int | None] = []
    numbers: dict[tuple, int] = {}
    last: tuple[tuple | None, int | None] = (None, None)
    for k, (sub, region, extents) in enumerate(zip(after.subgroups, after_regions, after_extents)):
        devices = sub.dg.devices
        if aligned:
            j, positions = k, None
        elif held.isdisjoint(devices):
            j = None
        else:
            j = before.subgroup_of(devices[0]) if devices[0] in held else None
            other = None if j is None else before.subgroups[j].dg.devices
            if other == devices:
                positions = None
            elif other is not None and all(d in held and before.subgroup_of(d) == j for d in devices):
                index = {d: i for i, d in enumerate(other)}
                positions = tuple(index[d] for d in devices)
            else:
                kinds.append(None)
                continue
        source: tuple = ()  # (before holds none of its devices)
        if j is not None:
            ds = before.subgroups[j].ds
            start = _relative_start(ds.split_dims, before_regions[j], sub.ds.split_dims, region)
            source = (ds, before_extents[j], positions, start)
        kind = (sub.ds, extents, source)
        if kind != last[0]:  # (consecutive subgroups are mostly alike: compared, not hashed)
            last = (kind, numbers.setdefault(kind, len(numbers)))
        kinds.append(last[1])
    return tuple(kinds)


def kept_regions(ann: Annotation, shape: tuple[Length, ...]) -> tuple[Box, ...]:
    """subgroup_regions for a shape already checked against `ann` and ratios bound: the tuple kept
    with the annotation, not a copy (planners read one subgroup's region per step of a pass over
    hundreds)."""
    return _kept_regions(ann, shape, None)


def _picked_alike(before: Annotation, after: Annotation) -> bool:
    """Whether every subgroup k of `after` is on the devices at one list of positions of subgroup
    k of `before` (compared in C, group by group)."""
    if before.hsize != after.hsize:
        return False
    index = {d: i for i, d in enumerate(before.dg_key[0])}
    first = after.dg_key[0]
    if not all(d in index for d in first):
        return False
    picked, mine = itemgetter(*(index[d] for d in first)), itemgetter(*range(len(first)))
    return list(map(picked, before.dg_key)) == list(map(mine, after.dg_key))


def region_extents(ann: Annotation, shape: tuple[Length, ...]) -> tuple[tuple[Length, ...], ...]:
    """Each subgroup's region extents (box_shape of subgroup_regions), kept with the annotation;
    worked out one dim at a time (a comprehension per dim, not a call per subgroup)."""
    def compute():
        regions = _kept_regions(ann, shape, None)
        if regions.count(regions[0]) == len(regions):  # HD / HP: one region for all
            return (box_shape(regions[0]),) * len(regions)
        columns = [[stop - start for start, stop in column] for column in zip(*regions)]
        return tuple(zip(*columns))
    return ann.derived(("extents", shape), compute)


def _relative_start(split0: tuple[int, ...], region0: Box, split: tuple[int, ...], region: Box) -> tuple:
    """How far `region` starts from `region0`, dim by dim, or None on a dim where that changes
    no intersection of a piece of one with a piece of the other: one layout does not split the
    dim (`split0`, `split`: the dims each splits) and its region's range holds the other's (its
    pieces span the whole range there), as the DP replicas of a ZeRO layout change have."""
    if region0 == region:  # (the usual case: both layouts' subgroup k covers the same box)
        return _start_in_place(split0, split, len(region))
    return tuple(None if (d not in split0 and a0 <= a and b <= b0) or (d not in split and a <= a0 and b0 <= b)
                 else a - a0 for d, ((a0, b0), (a, b)) in enumerate(zip(region0, region)))


def _relative_starts(split0: tuple[int, ...], regions0: Sequence[Box], split: tuple[int, ...],
                     regions: Sequence[Box]) -> list[tuple]:
    """_relative_start of regions0[k] and regions[k] for every k, one dim at a time (a comprehension
    per dim rather than a call per subgroup of a union of hundreds)."""
    if regions0 == regions:
        return [_start_in_place(split0, split, len(regions[0]))] * len(regions) if regions else []
    columns = []
    for d in range(len(regions[0]) if regions else 0):
        whole0, whole = d not in split0, d not in split
        columns.append([None if (whole0 and a0 <= a and b <= b0) or (whole and a <= a0 and b0 <= b) else a - a0
                        for (a0, b0), (a, b) in zip([r[d] for r in regions0], [r[d] for r in regions])])
    return list(zip(*columns)) if columns else [()] * len(regions)


@lru_cache(maxsize=256)
def _start_in_place(split0: tuple[int, ...], split: tuple[int, ...], ndim: int) -> tuple:
    """_relative_start of two equal regions: a dim either layout leaves whole holds the other's."""
    return tuple(0 if d in split0 and d in split else None for d in range(ndim))


def region_shift(region0: Box, region: Box) -> tuple[Length, ...]:
    """How far `region` starts from `region0`, dim by dim."""
    return tuple(b - a for (a, _), (b, _) in zip(region0, region))


def subgroup_device_pieces(
    ann: Annotation, k: int, shape: Sequence[Length], ratios: Sequence[int] | None = None
) -> dict[int, Piece]:
    """device_pieces restricted to subgroup k's devices, without computing the other subgroups'
    (a planner working inside one subgroup of a large union needs only these)."""
    return _union_pieces(ann, k, subgroup_regions(ann, shape, ratios)[k])


__all__ = [
    "Box",
    "Piece",
    "device_piece",
    "split_bounds",
    "box_shape",
    "box_intersection",
    "box_relative",
    "subgroup_regions",
    "subgroup_pieces",
    "split_index",
    "summand_index",
    "device_pieces",
    "device_pieces_of",
    "subgroup_device_pieces",
    "subgroup_kinds",
    "region_shift",
    "check_shape",
    "check_ratios",
]
