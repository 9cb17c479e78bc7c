"""A device's part of a plan (hspmd.comm_resolve.plan_part): exactly that device's collectives and
messages, in the plan's order and message rounds, with its pieces; plain data that round-trips and
runs like the whole plan; and a part names the device's own groups only, however many subgroups
the plan spans."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd import device_pieces, shard, unshard
from hspmd.backends.local import run_on_devices
from hspmd.backends.plan_executor import execute_plan
from hspmd.comm_resolve import resolve
from hspmd.comm_resolve.plan_part import PlanPart, message_rounds, part_of
from hspmd.errors import HSPMDError
from test_resolve_property import reshards


def _exchanges_in(plan, device):
    """The device's (send, receive) per message round of each step, from the whole plan."""
    out = []
    for step in plan.steps:
        for round_ in message_rounds(step.transfers):
            send = next((t for t in round_ if t.src == device), None)
            receive = next((t for t in round_ if t.dst == device), None)
            if send is not None or receive is not None:
                out.append((send, receive))
    return out


def _keeps_its_tensor(step, device, shape) -> bool:
    """The step only copies the device's whole piece onto itself (a part leaves such steps out)."""
    src, dst = device_pieces(step.src, shape).get(device), device_pieces(step.dst, shape).get(device)
    mine = [t for t in step.transfers if device in (t.src, t.dst)]
    return (src == dst and src is not None and not any(device in c.devices for c in step.collectives)
            and len(mine) == 1 and mine[0].src == mine[0].dst and mine[0].boxes == (dst.box,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reshards(), st.sampled_from([None, "2x8", "h800-h20:1+1"]))
def test_a_part_is_exactly_the_devices_share_of_the_plan(case, topology):
    src, dst, shape = case
    plan = resolve(src, dst, shape, topology)
    for device in sorted(set(plan.devices) | {max(plan.devices) + 1}):  # and one outside the plan
        part = part_of(plan, device)
        assert part.device == device and part.shape == plan.shape and part.dtype == plan.dtype
        assert part.src == device_pieces(plan.src, shape).get(device)
        assert part.holds_result == (device in plan.dst.devices)
        assert [c for s in part.steps for c in s.collectives] == \
               [c for s in plan.steps for c in s.collectives if device in c.devices]
        assert [e for s in part.steps for e in s.exchanges] == _exchanges_in(plan, device)
        assert [t for s in part.steps for t in s.copies] == \
               [t for s in plan.steps if device in s.assembled_on and not _keeps_its_tensor(s, device, shape)
                for t in s.transfers if t.src == t.dst == device]
        assert len(part.steps) <= len(plan.steps)
        assert PlanPart.from_dict(json.loads(json.dumps(part.to_dict()))) == part
        assert part_of(plan, device) is part  # cut once per plan and device


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reshards(), st.sampled_from([None, "2x8"]))
def test_parts_read_back_from_json_reshard_the_tensor(case, topology):
    src, dst, shape = case
    plan = resolve(src, dst, shape, topology)
    parts = {d: PlanPart.from_dict(json.loads(json.dumps(part_of(plan, d).to_dict()))) for d in plan.devices}
    x = torch.randn(shape)
    locals_ = shard(x, src, seed=3)
    results = run_on_devices(lambda b: execute_plan(parts[b.rank], b, locals_.get(b.rank)), plan.devices)
    out = {d: r for d, r in results.items() if r is not None}
    torch.testing.assert_close(unshard(out, dst, shape=shape), x)


def test_a_part_of_a_data_parallel_plan_holds_its_own_subgroup_alone():
    """Gradients partial in each of 64 TP2 subgroups, all-reduced in each: the plan is 64 steps
    naming 128 devices; a device's part is one step naming its pair."""
    subgroups = " | ".join(f"P:2@[{2 * i},{2 * i + 1}]" for i in range(64))
    plan = resolve(f"HD{{{subgroups}}}", f"HD{{{subgroups.replace('P:2', 'D:2')}}}", (16, 8))
    assert len(plan.steps) == 64
    part = part_of(plan, 37)
    assert [s.primitive for s in part.steps] == ["AllReduce"]
    assert [c.devices for c in part.steps[0].collectives] == [(36, 37)]
    assert len(json.dumps(part.to_dict())) * 20 < len(plan.to_json())


def test_a_part_runs_on_its_own_device_only():
    plan = resolve("S0:2@[0,1]", "D:2@[0,1]", (4, 2))
    part = part_of(plan, 0)
    with pytest.raises(HSPMDError, match="rank 1 was given device 0's part"):
        run_on_devices(lambda b: execute_plan(part, b, torch.zeros(2, 2)), (0, 1), timeout=5)


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.update(schema="hspmd.plan-part/0"), "schema"),
    (lambda d: d["steps"][0]["collectives"][0].update(devices=[5, 6]), "without device 0"),
    (lambda d: d["steps"][0].update(assembles="yes"), "assembles must be true or false"),
    (lambda d: d["src"].update(box=[[3, 1], [0, 2]]), "ends before it starts"),
    (lambda d: d.update(device=True), "device must be an integer"),
])
def test_a_damaged_part_is_refused_saying_what_is_wrong(damage, message):
    data = part_of(resolve("S0:2@[0,1]", "D:2@[0,1]", (4, 2)), 0).to_dict()
    damage(data)
    with pytest.raises(ValueError, match=message):
        PlanPart.from_dict(data)
