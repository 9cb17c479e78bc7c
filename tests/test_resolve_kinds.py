"""Kinds of subgroups (geometry.subgroup_kinds): what the resolver works out once per kind of
subgroup of a union, the bounds' lacks and the copies of a local reshard, equals what it is device
by device (the definitions), for repeated unions and for arbitrary ones."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.annotations import box_intersection, device_pieces
from hspmd.annotations.geometry import subgroup_kinds
from hspmd.comm_resolve import resolve
from hspmd.comm_resolve.bounds import Lacks, lacks
from hspmd.comm_resolve.bsr import TensorSlices, destination_needs, plan_transfers
from hspmd.comm_resolve.gathered import gathered_within, representatives, root
from hspmd.comm_resolve.slices import box_volume
from hspmd.testing import annotations, repeated_unions, shapes


def lacks_device_by_device(before, after, shape) -> Lacks:
    """bounds' module docstring, read literally: partial pieces hold nothing and lack nothing."""
    held, missing = device_pieces(before, shape), []
    for device, piece in device_pieces(after, shape).items():
        if piece.summand:
            continue
        need = box_volume(piece.box)
        have = held.get(device)
        if need and have is not None and not have.summand:
            common = box_intersection(piece.box, have.box)
            need -= box_volume(common) if common is not None else 0
        if need:
            missing.append(need)
    sizes = [n for n in (box_volume(p.box) for p in held.values() if not p.summand) if n]
    return Lacks(max(missing, default=0), sum(missing), max(sizes, default=0), len(sizes), sum(sizes))


@st.composite
def any_pair(draw):
    ndim = draw(st.integers(1, 2))
    return draw(annotations(ndim, max_devices=8)), draw(annotations(ndim, max_devices=8)), draw(shapes(ndim))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.one_of(repeated_unions().map(lambda c: c[:3]), any_pair()))
def test_lacks_per_kind_of_subgroup_equal_lacks_device_by_device(case):
    src, dst, shape = case
    for before, after in ((src, dst), (dst, src), (src, src)):
        assert lacks(before, after, shape) == lacks_device_by_device(before, after, shape)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=repeated_unions())
def test_lacks_of_gathered_layouts_equal_lacks_device_by_device(case):
    """HetAuto's gathered layouts (each subgroup on the devices at some positions of its own) are
    kinds worked out from regions alone where both unions repeat one layout: the same lacks."""
    src, dst, shape, _ = case
    for ann in (src, dst):
        for pick in (root, representatives):
            gathered = gathered_within(ann, pick)
            for before, after in ((ann, gathered), (gathered, ann)):
                assert lacks(before, after, shape) == lacks_device_by_device(before, after, shape)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=repeated_unions())
def test_a_local_reshard_copies_what_the_bsr_table_would(case):
    """Where every device finds its piece in its own piece, the plan's copies are the BSR table's."""
    src, dst, shape, topology = case
    if src.has_partial or dst.has_partial or lacks(src, dst, shape).total:
        return
    plan = resolve(src, dst, shape, topology, via="direct")
    owners = {d: p.box for d, p in device_pieces(src, shape).items()}
    table = plan_transfers([TensorSlices(0, len(shape), owners, destination_needs(dst, shape, owners))],
                           plan.topology, 4)
    assert plan.primitives == ("LocalSplit",) and plan.steps[0].transfers == table


def test_replicas_of_a_zero_layout_change_are_one_kind():
    """HD -> H1 over 64 tensor-parallel groups (a ZeRO layout change): one kind both ways, so a
    rank's plan lists its own subgroup and the kind's first, and repeats the others."""
    groups = [f"S0:4@[{4 * k}-{4 * k + 3}]" for k in range(64)]
    replicated, zero = f"HD{{{' | '.join(groups)}}}", f"H1({':'.join(['1'] * 64)}){{{' | '.join(groups)}}}"
    whole = resolve(replicated, zero, (64, 640))
    plan = resolve(replicated, zero, (64, 640), for_devices=[42])
    assert len(set(subgroup_kinds(whole.src, whole.dst, (64, 640)))) == 1
    assert len(set(subgroup_kinds(whole.dst, whole.src, (64, 640)))) == 1
    assert plan.primitives == whole.primitives == ("LocalSplit",)
    assert {t.src for t in plan.steps[0].transfers} == {0, 1, 2, 3, 40, 41, 42, 43}
    assert len(plan.left_out) == 256 - 8 and plan.covers([42]) and not plan.covers([5])
