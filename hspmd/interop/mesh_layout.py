"""DTensor layouts as plain data, and the exact translation between them and hspmd annotations.

A `MeshLayout` is what a DTensor's spec says about where data lies: the mesh (its shape and the
global rank at each coordinate, row-major), one placement per mesh dim (`("S", d)`, `("R",)`,
`("P",)`: Shard, Replicate, Partial sum) and the shard order (per sharded tensor dim, the mesh dims
that split it, first split first). Its geometry is DTensor's: each split is `torch.chunk`'s, pieces
of ceil(L/n) with the last ones shorter or empty, nested in shard order (`layout_pieces`; tested
against torch's `compute_local_shape_and_global_offset`).

hspmd's own split rule floors (annotations/geometry.py), so the two agree exactly where every
nested split divides. Where one tensor dim does not, the layout is stated exactly as a union split
on that dim in the chunk sizes (`H<d>(c0:c1:...)`, each subgroup the devices holding one chunk:
the top tier's weights are the lengths, so its cuts are the chunk bounds); the subgroups' states
are the other mesh dims. What hspmd cannot state is refused by name (`InteropError`): uneven splits
on two tensor dims, chunks left empty (a top-tier weight is positive), and, the other way, unions
whose subgroups differ (heterogeneous unions: a mesh places every device alike) and floor splits
that are no torch.chunk split. Every translation is checked piece by piece before it is returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import permutations, product
from math import prod

from hspmd.annotations.geometry import Piece, device_pieces
from hspmd.annotations.states import (
    DeviceGroup,
    DistributedStates,
    Duplicate,
    Partial,
    Split,
    Subgroup,
)
from hspmd.annotations.union import Annotation
from hspmd.errors import InteropError
from hspmd.limits import brief

Placement = tuple  # ("S", tensor dim) | ("R",) | ("P",)
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class MeshLayout:
    """A DTensor layout: mesh shape, the rank at each mesh coordinate (row-major), a placement per mesh
    dim and the shard order ((tensor dim, (mesh dims, first split first)), ...; dims absent split none)."""

    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[Placement, ...]
    shard_order: tuple[tuple[int, tuple[int, ...]], ...]

    def __post_init__(self):
        if len(self.placements) != len(self.mesh_shape):
            raise InteropError(f"{len(self.placements)} placements for a {len(self.mesh_shape)}-dim mesh {self.mesh_shape}")
        if prod(self.mesh_shape) != len(self.ranks):
            raise InteropError(f"a mesh of shape {self.mesh_shape} has {prod(self.mesh_shape)} ranks, got {len(self.ranks)}")
        for p in self.placements:
            if p[0] not in ("S", "R", "P") or (p[0] == "S") != (len(p) == 2):
                raise InteropError(f"a placement is ('S', dim), ('R',) or ('P',), got {brief(p)}")
        sharded = sorted(i for i, p in enumerate(self.placements) if p[0] == "S")
        ordered = sorted(m for _, mesh_dims in self.shard_order for m in mesh_dims)
        if ordered != sharded or any(self.placements[m] != ("S", d) for d, ms in self.shard_order for m in ms):
            raise InteropError(f"shard order {self.shard_order} does not list each sharding mesh dim of "
                               f"{self.placements} once, under the tensor dim it shards")

    @classmethod
    def default_order(cls, mesh_shape, ranks, placements) -> MeshLayout:
        """The layout with DTensor's default shard order (mesh dims left to right)."""
        dims: dict[int, list[int]] = {}
        for m, p in enumerate(placements):
            if p[0] == "S":
                dims.setdefault(p[1], []).append(m)
        return cls(tuple(mesh_shape), tuple(ranks), tuple(placements), tuple((d, tuple(ms)) for d, ms in sorted(dims.items())))

    def coordinates(self):
        return product(*map(range, self.mesh_shape))

    def is_default_order(self) -> bool:
        return all(list(ms) == sorted(ms) for _, ms in self.shard_order)

    def __str__(self) -> str:
        names = {"R": "R", "P": "P"}
        text = ",".join(f"S({p[1]})" if p[0] == "S" else names[p[0]] for p in self.placements)
        order = "" if self.is_default_order() else " order " + ";".join(f"{d}:{list(ms)}" for d, ms in self.shard_order)
        return f"[{text}] on mesh {self.mesh_shape}{order}"


def chunk(lo: int, hi: int, n: int, k: int) -> tuple[int, int]:
    """Piece k of [lo, hi) split as torch.chunk splits it into n: ceil-sized pieces, the last ones
    shorter or empty."""
    length = hi - lo
    size = -(-length // n)
    return lo + min(k * size, length), lo + min((k + 1) * size, length)


def layout_pieces(layout: MeshLayout, shape: Sequence[int]) -> dict[int, tuple[Box, tuple[int, ...]]]:
    """{rank: (box, summand)} of a DTensor layout: the box each rank holds (nested torch.chunk splits in
    shard order) and its summand (the coordinates on the Partial mesh dims; () if none)."""
    partial = [m for m, p in enumerate(layout.placements) if p[0] == "P"]
    out = {}
    for rank, coord in zip(layout.ranks, layout.coordinates()):
        box = [(0, n) for n in shape]
        for d, mesh_dims in layout.shard_order:
            if d >= len(shape):
                raise InteropError(f"{layout} shards dim {d} of a rank-{len(shape)} tensor")
            for m in mesh_dims:
                box[d] = chunk(*box[d], layout.mesh_shape[m], coord[m])
        out[rank] = (tuple(box), tuple(coord[m] for m in partial))
    return out


def _key(box: Box) -> tuple:
    """A box as compared across the two geometries: empty pieces are equal where their shapes are
    (the two rules put an empty piece at different offsets; the local tensors are the same)."""
    return box if all(b > a for a, b in box) else ("empty", tuple(b - a for a, b in box))


def mismatch(expected: Mapping[int, tuple[Box, tuple]], pieces: Mapping[int, Piece]) -> str | None:
    """Where hspmd's pieces differ from a DTensor layout's, in words, or None where every rank holds
    the same box and ranks hold one summand in one exactly where they do in the other."""
    if set(expected) != set(pieces):
        return f"the layouts are on ranks {sorted(expected)} and {sorted(pieces)}"
    forward: dict = {}
    backward: dict = {}
    for rank, (box, summand) in sorted(expected.items()):
        theirs, mine = (_key(box), summand), (_key(pieces[rank].box), pieces[rank].summand)
        if theirs[0] != mine[0]:
            return f"rank {rank} holds box {box} under DTensor's torch.chunk rule but {pieces[rank].box} under hspmd's"
        if forward.setdefault(theirs, mine) != mine or backward.setdefault(mine, theirs) != theirs:
            return f"rank {rank} holds a summand of box {box} that other ranks share in one layout and not in the other"
    return None


def _axis(placement: Placement, n: int):
    kind = placement[0]
    return Split(placement[1], n) if kind == "S" else Duplicate(n) if kind == "R" else Partial(n)


def _uneven_dims(layout: MeshLayout, shape: Sequence[int]) -> list[int]:
    """Tensor dims whose nested splits do not all divide (L divisible by the product of the counts)."""
    return [d for d, ms in layout.shard_order if shape[d] % prod(layout.mesh_shape[m] for m in ms)]


def _axis_order(layout: MeshLayout) -> list[int]:
    """Mesh dims in the order hspmd's axes list them: mesh order, except that the mesh dims splitting
    one tensor dim take the places of those mesh dims in shard order (hspmd nests splits of one dim
    outermost first)."""
    order = list(range(len(layout.mesh_shape)))
    for _, mesh_dims in layout.shard_order:
        for slot, m in zip(sorted(mesh_dims), mesh_dims):
            order[slot] = m
    return order


def _ranks_over(layout: MeshLayout, dims: Sequence[int], fixed: Mapping[int, int]) -> tuple[int, ...]:
    """The ranks at every coordinate of mesh dims `dims` (mixed radix, the first outermost), the
    other mesh dims at `fixed`."""
    strides = [prod(layout.mesh_shape[m + 1:]) for m in range(len(layout.mesh_shape))]
    base = sum(strides[m] * c for m, c in fixed.items())
    return tuple(layout.ranks[base + sum(strides[m] * c for m, c in zip(dims, coord))]
                 for coord in product(*(range(layout.mesh_shape[m]) for m in dims)))


def annotation_of(layout: MeshLayout, shape: Sequence[int]) -> Annotation:
    """The hspmd annotation whose every rank holds exactly what it holds under the DTensor `layout`
    for a tensor of `shape` (module docstring); InteropError where hspmd cannot state it."""
    shape = tuple(shape)
    if not layout.is_default_order():
        uneven_ordered = [d for d in _uneven_dims(layout, shape) if list(dict(layout.shard_order)[d]) !=
                          sorted(dict(layout.shard_order)[d])]
        if uneven_ordered:
            raise InteropError(
                f"{layout} splits dim {uneven_ordered[0]} (length {shape[uneven_ordered[0]]}) unevenly in a shard order other "
                f"than the mesh's: torch 2.13's _StridedShard then places pieces otherwise than that order (some not "
                f"contiguous), so hspmd refuses to guess them")
    uneven = _uneven_dims(layout, shape)
    order = _axis_order(layout)
    if not uneven:
        axes = DistributedStates(tuple(_axis(layout.placements[m], layout.mesh_shape[m]) for m in order))
        annotation = Annotation((Subgroup(DeviceGroup(_ranks_over(layout, order, {})), axes),))
    elif len(uneven) == 1:
        annotation = _chunk_union(layout, shape, uneven[0], order)
    else:
        raise InteropError(
            f"{layout} splits dims {uneven} of shape {shape} unevenly (torch.chunk sizes on each); hspmd states an "
            f"uneven split on one dim (a union in the chunk sizes), not on two")
    wrong = mismatch(layout_pieces(layout, shape), device_pieces(annotation, shape))
    if wrong:
        raise InteropError(f"{layout} of shape {shape} has no hspmd annotation: {annotation} comes closest, but {wrong}")
    return annotation


def _chunk_union(layout: MeshLayout, shape: tuple[int, ...], dim: int, order: list[int]) -> Annotation:
    """The union split on `dim` in DTensor's chunk sizes: one subgroup per chunk (the ranks at one
    coordinate of the mesh dims splitting `dim`), laid out over the other mesh dims."""
    splitting = dict(layout.shard_order)[dim]
    others = [m for m in order if m not in splitting]
    states = DistributedStates(tuple(_axis(layout.placements[m], layout.mesh_shape[m]) for m in others))
    chunks = []
    for coord in product(*(range(layout.mesh_shape[m]) for m in splitting)):
        lo, hi = 0, shape[dim]
        for m, c in zip(splitting, coord):
            lo, hi = chunk(lo, hi, layout.mesh_shape[m], c)
        ranks = _ranks_over(layout, others, dict(zip(splitting, coord)))
        if hi == lo:
            raise InteropError(
                f"{layout} leaves rank(s) {list(ranks)} an empty chunk of dim {dim} (length {shape[dim]}): torch.chunk "
                f"gives the last ranks nothing where hspmd's union splits give every subgroup a positive share")
        chunks.append((lo, hi, ranks))
    chunks.sort()
    subgroups = tuple(Subgroup(DeviceGroup(ranks), states) for _, _, ranks in chunks)
    return Annotation(subgroups, dim, tuple(hi - lo for lo, hi, _ in chunks))


def mesh_of(annotation: Annotation) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(mesh shape, ranks row-major) of the mesh an annotation lies on without a given one: the
    subgroups (if more than one) along the first mesh dim, each subgroup's axes along the others.
    InteropError for a heterogeneous union (subgroups of different states or sizes)."""
    if annotation.uniform_states is None:
        raise InteropError(
            f"{annotation} is a heterogeneous union (its subgroups differ in states or size): a DTensor mesh places "
            f"every device alike, so it has no DTensor equivalent")
    states, _ = annotation.uniform_states
    sizes = tuple(a.n for a in states.axes)
    top = (annotation.hsize,) if annotation.hsize > 1 else ()
    return (top + sizes) or (1,), annotation.devices


def _factorings(n: int, parts: int):
    """Ordered factorings of n into `parts` factors above 1."""
    if parts == 1:
        if n > 1:
            yield (n,)
        return
    for f in range(2, n + 1):
        if n % f == 0:
            for rest in _factorings(n // f, parts - 1):
                yield (f,) + rest


def layout_on_a_mesh_of(annotation: Annotation, shape: Sequence[int]) -> MeshLayout:
    """A DTensor layout of `annotation` on a mesh made from it: `mesh_of`'s, else (a union split
    in chunk sizes, from nested uneven splits) the subgroups along two or three mesh dims of the
    union's size, each tried in turn; InteropError naming the first failure if none states it."""
    mesh_shape, ranks = mesh_of(annotation)
    try:
        return layout_of(annotation, shape, mesh_shape, ranks)
    except InteropError as first:
        if annotation.hsize == 1:
            raise
        inner = mesh_shape[1:]
        for parts in (2, 3):
            for top in _factorings(annotation.hsize, parts):
                try:
                    return layout_of(annotation, shape, top + inner, ranks)
                except InteropError:
                    continue
        raise first


def layout_of(annotation: Annotation, shape: Sequence[int], mesh_shape: Sequence[int], ranks: Sequence[int]) -> MeshLayout:
    """The DTensor layout on the given mesh whose ranks hold exactly what they hold under `annotation`
    for a tensor of `shape`: each mesh dim's placement read off two neighbouring ranks, then the
    shard orders tried (default first) until every rank's piece matches; InteropError if none does."""
    shape, mesh_shape, ranks = tuple(shape), tuple(mesh_shape), tuple(ranks)
    if annotation.uniform_states is None:
        mesh_of(annotation)  # raises, naming the heterogeneous union
    if sorted(ranks) != sorted(annotation.devices):
        raise InteropError(f"{annotation} is on devices {sorted(annotation.devices)} but the mesh has ranks {sorted(ranks)}")
    pieces = device_pieces(annotation, shape)
    strides = [prod(mesh_shape[m + 1:]) for m in range(len(mesh_shape))]
    first = pieces[ranks[0]]
    placements = []
    for m, n in enumerate(mesh_shape):
        if n == 1:
            placements.append(("R",))
            continue
        other = pieces[ranks[strides[m]]]
        differ = [d for d, (a, b) in enumerate(zip(first.box, other.box)) if a != b]
        if not differ:
            placements.append(("R",) if other.summand == first.summand else ("P",))
        elif len(differ) == 1:
            placements.append(("S", differ[0]))
        else:
            raise InteropError(f"{annotation}: ranks {ranks[0]} and {ranks[strides[m]]}, neighbours along mesh dim {m}, "
                               f"hold boxes that differ on dims {differ}; no DTensor placement does that")
    default = MeshLayout.default_order(mesh_shape, ranks, placements)
    orders = [permutations(ms) for _, ms in default.shard_order]
    first_wrong = None
    for choice in product(*orders):
        layout = MeshLayout(mesh_shape, ranks, tuple(placements), tuple((d, ms) for (d, _), ms in zip(default.shard_order, choice)))
        wrong = mismatch(layout_pieces(layout, shape), pieces)
        if wrong is None:
            if not layout.is_default_order() and any(
                    list(ms) != sorted(ms) for d, ms in layout.shard_order if d in _uneven_dims(layout, shape)):
                raise InteropError(f"{annotation} of shape {shape} is {layout}, an uneven split in a shard order other than "
                                   f"the mesh's, which torch 2.13's _StridedShard places otherwise")
            return layout
        first_wrong = first_wrong or wrong
    raise InteropError(f"{annotation} of shape {shape} has no DTensor layout on mesh {mesh_shape}: {first_wrong}")


__all__ = ["MeshLayout", "annotation_of", "chunk", "layout_of", "layout_on_a_mesh_of", "layout_pieces", "mesh_of", "mismatch"]
