"""Property test of the resolver and the plan executor against the reference shard/unshard.

Random (src, dst) pairs on 1-16 devices: uneven shapes (dims smaller than shard counts included),
heterogeneous unions, every HDim, different device sets, several topologies (sender choice), and
destinations derived from the source (same DG union, same DS union, moved devices) so that every branch of the decision order
is exercised. Every plan is structurally checked, read back from its JSON, and run with the
threaded in-process backend (hspmd.run_plan);
its result must unshard to the original tensor. A refusal (paper-strict mode) must be an
UnsupportedReshard of a Partial source.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hspmd import Annotation, DistributedStates, Duplicate, Partial, Split, Subgroup, shard, unshard
from hspmd.comm_resolve import Plan, resolve
from hspmd.comm_resolve.verify import check_plan
from hspmd.errors import UnsupportedReshard
from hspmd.backends.plan_executor import run_plan

MAX_DEVICES = 16


def _factorisations(n: int) -> list[list[int]]:
    if n == 1:
        return [[]]
    return [[f] + rest for f in range(2, n + 1) if n % f == 0 for rest in _factorisations(n // f)]


@st.composite
def distributed_states(draw, size: int, ndim: int) -> DistributedStates:
    factors = draw(st.sampled_from(_factorisations(size)))
    axes = []
    for f in factors:
        kind = draw(st.sampled_from("SSDP"))
        axes.append(Split(draw(st.integers(0, ndim - 1)), f) if kind == "S" else Duplicate(f) if kind == "D" else Partial(f))
    return DistributedStates(tuple(axes))


@st.composite
def unions(draw, devices: list[int], ndim: int, hsize: int | None = None) -> Annotation:
    hsize = hsize or draw(st.integers(1, min(3, len(devices))))
    cuts = sorted(draw(st.sets(st.integers(1, len(devices) - 1), min_size=hsize - 1, max_size=hsize - 1))) if hsize > 1 else []
    bounds = [0] + cuts + [len(devices)]
    groups = [devices[a:b] for a, b in zip(bounds, bounds[1:])]
    return _union(draw, groups, ndim)


def _union(draw, groups: list[list[int]], ndim: int, hdim=None) -> Annotation:
    subs = tuple(Subgroup(tuple(g), draw(distributed_states(len(g), ndim))) for g in groups)
    if hdim is None:
        hdim = draw(st.sampled_from(["D", "P"] + list(range(ndim))))
    ratios = tuple(draw(st.integers(1, 3)) for _ in subs) if isinstance(hdim, int) else None
    return Annotation(subs, hdim, ratios)


def _device_set(draw) -> list[int]:
    n = draw(st.integers(2, 8) | st.integers(1, MAX_DEVICES))
    return draw(st.lists(st.integers(0, MAX_DEVICES - 1), min_size=n, max_size=n, unique=True))


@st.composite
def reshards(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7) | st.integers(1, 3), min_size=ndim, max_size=ndim)))
    src = draw(unions(_device_set(draw), ndim))
    mode = draw(st.sampled_from(["independent", "same-dg-union", "same-hdim", "hdim-change", "moved", "same-devices"]))
    groups = [list(s.dg) for s in src.subgroups]
    if mode == "independent":
        dst = draw(unions(_device_set(draw), ndim))
    elif mode == "same-dg-union":
        dst = _union(draw, groups, ndim)
    elif mode == "same-hdim":
        dst = _union(draw, groups, ndim, hdim=src.hdim)
        if isinstance(src.hdim, int):
            dst = Annotation(dst.subgroups, src.hdim, src.ratios)
    elif mode == "hdim-change":
        hdim = draw(st.sampled_from(["D", "P"] + list(range(ndim))))
        ratios = tuple(draw(st.integers(1, 3)) for _ in groups) if isinstance(hdim, int) else None
        dst = Annotation(src.subgroups, hdim, ratios)
    elif mode == "moved":
        moved = draw(st.lists(st.integers(0, MAX_DEVICES - 1), min_size=len(src.devices), max_size=len(src.devices), unique=True))
        mapping = dict(zip(src.devices, moved))
        subs = tuple(Subgroup(tuple(mapping[d] for d in s.dg), s.ds) for s in src.subgroups)
        dst = Annotation(subs, src.hdim, src.ratios)
    else:
        dst = draw(unions(list(draw(st.permutations(src.devices))), ndim))
    assume(src != dst or draw(st.integers(0, 9)) == 0)
    return src, dst, shape


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reshards(), st.integers(0, 2**16), st.sampled_from([None, "2x8", "4x4", "h800-h20:1+1"]))
def test_every_plan_reproduces_the_tensor(case, seed, topology):
    src, dst, shape = case
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    plan = resolve(src, dst, shape, topology, dtype="float64")
    check_plan(plan)
    assert Plan.from_json(plan.to_json()) == plan
    result = run_plan(plan, shard(x, src, seed=seed))
    assert set(result) == set(dst.devices)
    torch.testing.assert_close(unshard(result, dst, shape=shape), x, rtol=1e-9, atol=1e-9)
    try:
        strict = resolve(src, dst, shape, topology, dtype="float64", reduce_partial=False)
    except UnsupportedReshard as refusal:
        assert src.has_partial, f"refused a reshard without Partial: {refusal}"
        assert str(src) in str(refusal) and str(dst) in str(refusal)
    else:
        assert strict == plan
