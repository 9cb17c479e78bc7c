"""Hypothesis strategies for annotations, for hspmd's own tests and for users who property-test
their resolutions: `annotations(ndim)` draws valid unions (1-16 devices, up to 4 subgroups,
uneven axis mixes, any device order), `repeated_unions()` draws reshards between unions of
repeated subgroups (what data-parallel replicas make), `shapes(ndim)` draws tiny and uneven
shapes; `plan_every_subgroup` switches off the resolver's reuse of steps across subgroups (the
reference that reuse must equal)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Duplicate, Partial, Split, Subgroup
from hspmd.cluster import uniform


@st.composite
def distributed_states(draw, size: int, ndim: int, allow_partial: bool = True, reduce: str = "sum") -> DistributedStates:
    """Axes whose counts multiply to `size`, drawn as a random ordered factorisation; Partial
    axes combine by `reduce`."""
    axes = []
    rest = size
    while rest > 1:
        n = draw(st.sampled_from([d for d in range(2, rest + 1) if rest % d == 0]))
        kinds = ["S", "D"] + (["P"] if allow_partial else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "S" and ndim > 0:
            axes.append(Split(draw(st.integers(0, ndim - 1)), n))
        elif kind == "P":
            axes.append(Partial(n, reduce))
        else:
            axes.append(Duplicate(n))
        rest //= n
    return DistributedStates(tuple(axes))


@st.composite
def annotations(
    draw,
    ndim: int,
    max_devices: int = 16,
    max_hsize: int = 4,
    allow_partial: bool = True,
    devices: tuple[int, ...] | None = None,
    bound_ratios: bool = True,
    reduce: str = "sum",
) -> Annotation:
    """A valid union over a random subset (or, if given, exactly `devices`) of range(max_devices),
    its Partial axes combining by `reduce` (a top-tier P, which sums, only where that is "sum")."""
    if devices is None:
        pool = draw(st.permutations(range(max_devices)))
        total = draw(st.integers(1, max_devices))
        chosen = list(pool[:total])
    else:
        chosen = list(devices)
    hsize = draw(st.integers(1, min(max_hsize, len(chosen))))
    cuts = sorted(draw(st.lists(st.integers(1, len(chosen) - 1), min_size=hsize - 1, max_size=hsize - 1, unique=True))) if hsize > 1 else []
    bounds = [0] + cuts + [len(chosen)]
    subgroups = tuple(
        Subgroup(DeviceGroup(tuple(chosen[a:b])), draw(distributed_states(b - a, ndim, allow_partial, reduce)))
        for a, b in zip(bounds, bounds[1:])
    )
    hdims = ["D"] + (["P"] if allow_partial and reduce == "sum" else []) + list(range(ndim))
    hdim = draw(st.sampled_from(hdims))
    ratios = None
    if isinstance(hdim, int) and (bound_ratios or draw(st.booleans())):
        ratios = tuple(draw(st.lists(st.integers(1, 3), min_size=len(subgroups), max_size=len(subgroups))))
    return Annotation(subgroups, hdim, ratios)


@st.composite
def repeated_unions(draw):
    """(src, dst, shape, topology): unions of 2-5 subgroups sharing one or two layouts, devices in
    any order (sometimes not order-preserving between subgroups), HDim D / P / a dim with equal or
    uneven ratios; the destination keeps the device groups (bottom-tier and top-tier routes) or
    moves to others, overlapping half of them or none (SendRecv / BSR between groups); one or more
    nodes."""
    ndim = draw(st.integers(1, 2))
    size = draw(st.sampled_from([1, 2, 4]))
    hsize = draw(st.integers(2, 5))
    pool = draw(st.permutations(range(size * hsize)))
    if draw(st.booleans()):
        pool = sorted(pool)
    groups = [tuple(pool[k * size:(k + 1) * size]) for k in range(hsize)]
    layouts = [draw(distributed_states(size, ndim)) for _ in range(2)]
    targets = [draw(distributed_states(size, ndim)) for _ in range(2)]
    if ndim == 2 and draw(st.booleans()):  # splits moved to the other dim: an all-to-all inside each subgroup
        targets = [DistributedStates(tuple(Split(1 - a.dim, a.n) if isinstance(a, Split) else a for a in ds.axes))
                   for ds in layouts]
    pick = [draw(st.integers(0, 1)) if draw(st.booleans()) else 0 for _ in range(hsize)]

    moved = groups
    if draw(st.booleans()):  # the destination moves to other devices (SendRecv / BSR between groups)
        start = draw(st.sampled_from([size * hsize // 2, size * hsize]))  # half of them overlapping, or none
        others = draw(st.permutations(range(start, start + size * hsize)))
        if draw(st.booleans()):
            others = sorted(others)
        moved = [tuple(others[k * size:(k + 1) * size]) for k in range(hsize)]

    def union(states, hdim, on):
        ratios = None
        if isinstance(hdim, int):
            ratios = tuple(draw(st.sampled_from([(1,) * hsize, tuple(draw(st.integers(1, 3)) for _ in range(hsize))])))
        return Annotation(tuple(Subgroup(g, states[p]) for g, p in zip(on, pick)), hdim, ratios)

    hdims = ["D", "P"] + list(range(ndim))
    src = union(layouts, draw(st.sampled_from(hdims)), groups)
    dst = union(targets, draw(st.sampled_from(hdims)) if draw(st.booleans()) else src.hdim, moved)
    if dst.hdim == src.hdim:
        dst = Annotation(dst.subgroups, src.hdim, src.ratios)
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    devices = max(src.devices + dst.devices) + 1
    nodes = draw(st.sampled_from([1, 2, devices]))
    topology = uniform(nodes, devices // nodes) if devices % nodes == 0 else None
    return src, dst, shape, topology


def plan_every_subgroup(patch) -> None:
    """Switch off the resolver's reuse of steps across subgroups (comm_resolve/relabel.py): with
    `patch` (a pytest MonkeyPatch or its context), every subgroup gets a frame of its own, so
    each is planned on its own, as the reference that reuse must equal."""
    from hspmd.comm_resolve import relabel
    patch.setattr(relabel, "frames_moved", lambda union, target, moving, extents: [object() for _ in moving])
    patch.setattr(relabel, "frames_in_place", lambda union, target, extents: [object() for _ in union.subgroups])


def shapes(ndim: int, max_len: int = 7):
    """Tiny shapes, often uneven or smaller than a shard count (0-length dims included)."""
    return st.tuples(*[st.integers(0, max_len) for _ in range(ndim)])


def assert_weights_close(actual: torch.Tensor, expected: torch.Tensor, lr: float, name: str = "") -> None:
    """Weights after Adam-family steps equal a reference's. Adam scales each element's step to about
    `lr`, so float32 rounding of a near-zero gradient (other summation order) can move a rare element
    by a fraction of `lr`; a wrong gradient moves most elements by about `lr`. Hence: every element
    within lr/10, and all but 1% within float32 tolerance (rtol 1e-4, atol 1e-5)."""
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=0.1 * lr, msg=lambda m: f"{name}: {m}")
    loose = (actual - expected).abs() > 1e-5 + 1e-4 * expected.abs()
    if int(loose.sum()) > 0.01 * max(expected.numel(), 1):
        raise AssertionError(f"{name}: {int(loose.sum())} of {expected.numel()} elements differ beyond float32 tolerance")
