"""Plans for unions of repeated subgroups: steps planned once and moved onto the other subgroups
(comm_resolve/relabel.py) equal the steps planned subgroup by subgroup, for any device order,
region offsets, partial sums and cluster layout (a renaming that would change a tie-break or a
link must not be used)."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.annotations.states import order_pattern
from hspmd.cluster import LinkClass, uniform
from hspmd.comm_resolve import relabel, resolve
from hspmd.comm_resolve.plan_part import part_of
from hspmd.comm_resolve.verify import check_plan
from hspmd.errors import CommunicationError, HSPMDError
from hspmd.specialize import comm_plans
from hspmd.testing import plan_every_subgroup, repeated_unions


def _planned_alone(monkeypatch):
    """resolve with every subgroup planned on its own (no two frames ever equal)."""
    def plan(*args, **kwargs):
        with monkeypatch.context() as m:
            plan_every_subgroup(m)
            return resolve(*args, **kwargs)
    return plan


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=repeated_unions())
def test_moved_steps_equal_the_steps_planned_subgroup_by_subgroup(case, monkeypatch):
    src, dst, shape, topology = case
    try:
        alone = _planned_alone(monkeypatch)(src, dst, shape, topology)
    except HSPMDError as exc:
        with pytest.raises(type(exc)):
            resolve(src, dst, shape, topology)
        return
    assert resolve(src, dst, shape, topology) == alone


def test_a_union_of_equal_subgroups_plans_one_and_moves_it(monkeypatch):
    groups = " | ".join(f"P:4@[{4 * k}-{4 * k + 3}]" for k in range(8))
    calls = []
    real = relabel.moved_steps
    monkeypatch.setattr(relabel, "moved_steps", lambda *a: calls.append(a[2]) or real(*a))
    plan = resolve(f"HD{{{groups}}}", f"HD{{{groups.replace('P', 'D')}}}", (8, 4))
    assert plan.primitives == ("AllReduce",) * 8
    assert calls == list(range(1, 8))
    assert [c.devices for s in plan.steps for c in s.collectives] == [tuple(range(4 * k, 4 * k + 4)) for k in range(8)]


def test_subgroups_on_other_links_are_planned_on_their_own():
    assert relabel.same_links((0, 1), (2, 3), uniform(2, 2))
    assert not relabel.same_links((0, 1), (1, 2), uniform(2, 2))
    assert order_pattern((5, 3, 9)) == (1, 0, 2) == order_pattern((7, 2, 8))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=repeated_unions(), data=st.data())
def test_a_plan_resolved_for_some_devices_is_the_whole_plan_for_them(case, data):
    """Every device the plan is resolved for, and every device whose steps it keeps, gets the
    whole plan's part; the cost, and everyone's groups, roles and pipeline pattern (the left-out
    subgroups renamed from their templates) are the whole plan's; a left-out device's part is
    refused by name rather than cut wrong."""
    src, dst, shape, topology = case
    try:
        whole = resolve(src, dst, shape, topology)
    except HSPMDError as exc:
        with pytest.raises(type(exc)):
            resolve(src, dst, shape, topology, for_devices=[src.devices[0]])
        return
    focus = data.draw(st.lists(st.sampled_from(whole.devices), max_size=3, unique=True))
    plan = resolve(src, dst, shape, topology, for_devices=focus)
    assert not whole.left_out and plan.covers(focus)
    assert plan.estimated_seconds == whole.estimated_seconds
    for d in whole.devices:
        if plan.covers([d]):
            assert part_of(plan, d) == part_of(whole, d), d
        else:
            with pytest.raises(CommunicationError, match=f"device {d}'s steps are left out"):
                part_of(plan, d)
    assert comm_plans.groups_of(plan) == comm_plans.groups_of(whole)
    assert comm_plans.roles_of(plan) == comm_plans.roles_of(whole)
    everyone = comm_plans.roles_of(whole)
    extra = data.draw(st.lists(st.sampled_from(whole.devices), max_size=2, unique=True))  # covered or not
    for devices in (tuple(focus), tuple(dict.fromkeys(focus + extra)), (max(whole.devices) + 1,)):
        assert comm_plans.roles_for(plan, devices) == {d: everyone.get(d, "local") for d in devices}
    assert comm_plans.touched(plan) == comm_plans.touched(whole)
    assert [set(p) for p in comm_plans.pattern(plan)] == [set(p) for p in comm_plans.pattern(whole)]


def test_a_plan_for_one_device_of_many_equal_subgroups_lists_two_of_them():
    groups = " | ".join(f"S0:4@[{4 * k}-{4 * k + 3}]" for k in range(64))
    src, dst = f"HD{{{groups}}}", f"HD{{{groups.replace('S0', 'D')}}}"
    whole = resolve(src, dst, (64,))
    plan = resolve(src, dst, (64,), for_devices=[42])
    assert len(whole.steps) == 64
    assert [c.devices for s in plan.steps for c in s.collectives] == [(0, 1, 2, 3), (40, 41, 42, 43)]
    assert plan.left_out == frozenset(range(256)) - {0, 1, 2, 3, 40, 41, 42, 43}
    assert part_of(plan, 42) == part_of(whole, 42)
    assert plan.covers([1, 43]) and not plan.covers([1, 44]) and not plan.covers(None)
    with pytest.raises(HSPMDError, match="for_devices must be device ids"):
        resolve(src, dst, (64,), for_devices=["42"])


def test_a_subgroup_moving_over_a_shared_link_is_kept():
    """Messages over a shared link queue on one pipe across subgroups: leaving some out would
    understate the step's time, so a plan for one device keeps every such subgroup."""
    wan = uniform(2, 2, inter=LinkClass("wan", 1.25e9, 100e-6, shared=True))
    src = "H0(1:1){D:1@[0] | D:1@[1]}"
    dst = "H0(1:1){D:1@[2] | D:1@[3]}"
    whole = resolve(src, dst, (4, 2), wan)
    plan = resolve(src, dst, (4, 2), wan, for_devices=[0])
    assert plan == whole and plan.estimated_seconds == whole.estimated_seconds
    assert resolve(src, dst, (4, 2), for_devices=[0]).left_out == {1, 3}


@pytest.mark.parametrize("src, dst, shape, topology, via", [
    ("HD{@[15] | @[4] | @[6]}", "HD{@[9] | @[14] | @[12]}", (8,), "h800-h20:1+1", None),
    ("HD{S1:2@[11,6] | @[4] | @[7]}", "HD{S1:2@[11,6] | @[4] | @[7]}", (7, 3), None, "direct"),
])
def test_check_plan_accepts_a_plan_resolved_for_some_devices(src, dst, shape, topology, via):
    """A focused plan lists no steps for the devices it leaves out (Step.repeats): check_plan
    checks the listed devices and does not expect the left-out ones to be written."""
    plan = resolve(src, dst, shape, topology, for_devices=[4], via=via)
    assert plan.left_out
    check_plan(plan)
    broken = replace(plan, steps=tuple(replace(s, collectives=(), transfers=()) for s in plan.steps))
    with pytest.raises(CommunicationError, match="assembled_on its piece but nothing is written"):
        check_plan(broken)  # a listed device still is checked
