"""Which primitives the resolver picks (paper figures 4-7), and that each plan is right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hspmd import resolve
from hspmd.comm_resolve.verify import check_plan
from hspmd.errors import AnnotationError, ClusterError, ShapeError, UnsupportedReshard
from hspmd.backends.plan_executor import reshard_tensor


def planned(src, dst, shape, **kwargs):
    """The plan, after checking its structure and that running it reproduces a random tensor."""
    plan = resolve(src, dst, shape, dtype="float64", **kwargs)
    check_plan(plan)
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(reshard_tensor(plan, x, seed=3), x)
    return plan


def groups_of(step):
    return sorted(sorted(c.devices) for c in step.collectives)


@pytest.mark.parametrize("members", [[0, 1], [0, 1, 2], [0, 1, 2, 3], [3, 1, 7]])
def test_partial_to_duplicate_on_one_group_is_one_allreduce_and_nothing_else(members):
    devices = "[" + ",".join(map(str, members)) + "]"
    plan = planned(f"P:{len(members)}@{devices}", f"D:{len(members)}@{devices}", (5, 3))
    assert plan.primitives == ("AllReduce",)
    (step,) = plan.steps
    assert [c.kind for c in step.collectives] == ["all_reduce"]
    assert step.collectives[0].devices == tuple(members) and not step.transfers


@pytest.mark.parametrize(
    "src, dst, primitive",
    [
        ("P:4@[0-3]", "D:4@[0-3]", "AllReduce"),
        ("P:4@[0-3]", "S0:4@[0-3]", "ReduceScatter"),
        ("P:4@[0-3]", "S1:4@[0-3]", "ReduceScatter"),
        ("S0:4@[0-3]", "D:4@[0-3]", "AllGather"),
        ("S1:4@[0-3]", "D:4@[0-3]", "AllGather"),
        ("D:4@[0-3]", "S1:4@[0-3]", "LocalSplit"),
        ("S0:4@[0-3]", "P:4@[0-3]", "LocalSplit"),
        ("D:4@[0-3]", "P:4@[0-3]", "LocalSplit"),
        ("S0:4@[0-3]", "S1:4@[0-3]", "BatchedSendRecv"),
        ("S0:4@[0-3]", "S0:4@[0-3]", "Identity"),
        ("S0:4@[0-3]", "S0:4@[4-7]", "SendRecv"),
        ("P:4@[0-3]", "P:4@[4-7]", "SendRecv"),
    ],
)
def test_figure5_one_group_ds_changes(src, dst, primitive):
    plan = planned(src, dst, (6, 5))
    assert plan.primitives == (primitive,)
    if primitive in ("LocalSplit", "Identity"):
        assert plan.messages == 0 and plan.total_bytes == 0


def test_sendrecv_moves_each_piece_to_its_new_device():
    plan = planned("S0:2@[0,1]", "S0:2@[2,3]", (4, 2))
    assert plan.primitives == ("SendRecv",)
    assert sorted((t.src, t.dst) for t in plan.steps[0].transfers) == [(0, 2), (1, 3)]


def test_duplicate_moved_to_overlapping_devices_sends_only_the_missing_copy():
    plan = planned("D:3@[0,1,2]", "D:3@[1,2,3]", (4, 2))
    assert plan.primitives == ("SendRecv",)
    assert plan.messages == 1 and plan.bytes_received[3] == 4 * 2 * 8


@pytest.mark.parametrize(
    "src, dst, kind, groups",
    [
        ("P:2,S1:2@[0-3]", "S0:2,S1:2@[0-3]", "ReduceScatter", [[0, 2], [1, 3]]),
        ("S0:2,S1:2@[0-3]", "D:2,S1:2@[0-3]", "AllGather", [[0, 2], [1, 3]]),
        ("P:2,S1:2@[0-3]", "D:2,S1:2@[0-3]", "AllReduce", [[0, 2], [1, 3]]),
        ("S1:2,P:2@[0-3]", "S1:2,D:2@[0-3]", "AllReduce", [[0, 1], [2, 3]]),
        ("D:2,P:2@[0-3]", "D:2,S0:2@[0-3]", "ReduceScatter", [[0, 1], [2, 3]]),
    ],
)
def test_dp_times_tp_transitions_use_collectives_over_the_dp_groups(src, dst, kind, groups):
    plan = planned(src, dst, (6, 8))
    assert plan.primitives == (kind,)
    assert groups_of(plan.steps[0]) == groups


def test_dp_tp_partial_gradients_to_duplicated_weights_need_two_collectives():
    plan = planned("P:2,S0:2@[0-3]", "D:2,D:2@[0-3]", (6, 8))
    assert set(plan.primitives) <= {"AllReduce", "AllGather", "ReduceScatter"}
    assert plan.messages == 0


def test_per_pipeline_partial_gradients_tp4_tp2_to_duplicate_is_split_allreduce():
    plan = planned("HP{S1:4@[0-3] | S1:2@[4,5]}", "HD{S1:4@[0-3] | S1:2@[4,5]}", (8, 6))
    assert plan.primitives == ("SplitAllReduce",)
    (step,) = plan.steps
    assert {c.kind for c in step.collectives} == {"all_reduce"}
    assert groups_of(step) == [[0, 4], [1, 4], [2, 5], [3, 5]]
    assert not step.transfers


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_split_collectives_over_tp4_tp2_tp1_on_any_split_dim(dim):
    shape = (8, 4, 6)
    subs = f"S{dim}:4@[0-3] | S{dim}:2@[4,5] | @[6]"
    ar = planned(f"HP{{{subs}}}", f"HD{{{subs}}}", shape)
    assert ar.primitives == ("SplitAllReduce",)
    assert groups_of(ar.steps[0]) == [[0, 4, 6], [1, 4, 6], [2, 5, 6], [3, 5, 6]]
    other = (dim + 1) % 3
    rs = planned(f"HP{{{subs}}}", f"H{other}(4:2:1){{{subs}}}", shape)
    assert rs.primitives == ("SplitReduceScatter",)
    assert {c.kind for c in rs.steps[0].collectives} == {"reduce_scatter"}
    ag = planned(f"H{other}(4:2:1){{{subs}}}", f"HD{{{subs}}}", shape, via="hierarchical")
    assert ag.primitives == ("SplitAllGather",)
    assert {c.kind for c in ag.steps[0].collectives} == {"all_gather"}
    # by default the one BatchedSendRecv wins: each device receives every piece it lacks at once,
    # where the ring AllGathers of the slices it joins run one after another
    chosen = planned(f"H{other}(4:2:1){{{subs}}}", f"HD{{{subs}}}", shape)
    assert chosen.primitives == ("BatchedSendRecv",) and chosen.estimated_seconds < ag.estimated_seconds


def test_figure7_reduce_scatter_and_identity_then_split_allreduce():
    plan = planned("HP{P:2@[0,1] | S0:2@[2,3]}", "HD{S0:2@[0,1] | S0:2@[2,3]}", (8, 6))
    assert plan.primitives == ("ReduceScatter", "Identity", "SplitAllReduce")
    rs, identity, split = plan.steps
    assert (rs.subgroup, identity.subgroup) == (0, 1)
    assert groups_of(rs) == [[0, 1]] and groups_of(split) == [[0, 2], [1, 3]]
    assert (rs.round, identity.round, split.round) == (0, 0, 1)
    assert str(rs.dst) == "HP{S0:2@[0,1] | S0:2@[2,3]}"


def test_hdim_split_to_duplicate_with_uneven_ratios():
    plan = planned("H0(2:1){S1:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}", (7, 5))
    assert plan.primitives == ("SplitAllGather",)


def test_runtime_ratios_are_bound_by_arguments():
    plan = planned("H0{@[0] | @[1]}", "H0{@[0] | @[1]}", (6,), src_ratios=(1, 2), dst_ratios=(2, 1))
    assert str(plan.src) == "H0(1:2){@[0] | @[1]}" and "BatchedSendRecv" in plan.primitives


def test_partial_without_a_collective_path_is_reduced_first_or_refused_in_strict_mode():
    plan = planned("P:2@[0,1]", "S0:3@[1,2,3]", (6, 2))
    assert plan.primitives == ("ReduceScatter", "BatchedSendRecv")
    with pytest.raises(UnsupportedReshard) as refusal:
        resolve("P:2@[0,1]", "S0:3@[1,2,3]", (6, 2), reduce_partial=False)
    assert "P:2@[0,1] -> S0:3@[1-3]" in str(refusal.value)


def test_top_tier_partial_to_other_devices_reduces_across_subgroups_first():
    plan = planned("HP{S0:2@[0,1] | @[2]}", "S1:2@[3,4]", (4, 6))
    assert plan.primitives[0] == "SplitReduceScatter" and plan.primitives[-1] == "BatchedSendRecv"
    with pytest.raises(UnsupportedReshard):
        resolve("HP{S0:2@[0,1] | @[2]}", "S1:2@[3,4]", (4, 6), reduce_partial=False)


def test_partial_destination_is_reached_without_reduction():
    plan = planned("S0:2@[0,1]", "HP{@[2] | S1:2@[3,4]}", (4, 6))
    assert plan.primitives == ("BatchedSendRecv",)
    assert sum(plan.bytes_received.values()) == 4 * 6 * 8


@pytest.mark.parametrize(
    "src, dst, shape, error, words",
    [
        ("S2:2@[0,1]", "@[0]", (4, 4), AnnotationError, "split dim 2"),
        ("S0:2@[0,1]", "@[0]", (4, -1), ShapeError, "non-negative"),
        ("H0{@[0] | @[1]}", "@[0]", (4,), ShapeError, "src_ratios"),
        ("S0:2@[0,1]", "S0:2@[0,1", (4,), AnnotationError, "close"),
    ],
)
def test_impossible_reshards_raise_clear_errors(src, dst, shape, error, words):
    with pytest.raises(error) as info:
        resolve(src, dst, shape)
    assert words in str(info.value)


def test_devices_outside_the_topology_and_unknown_dtypes_are_errors():
    with pytest.raises(ClusterError, match="device 9 is not in cluster 2x4"):
        resolve("S0:2@[0,9]", "@[0]", (4,), "2x4")
    with pytest.raises(ShapeError, match="unknown dtype"):
        resolve("S0:2@[0,1]", "@[0]", (4,), dtype="float13")


def test_plans_are_pure_functions_of_their_inputs():
    """Another interpreter (other hash seed, nothing cached) plans the same reshard identically."""
    args = ("HP{P:2@[0,1] | S0:2@[2,3]}", "HD{S0:2@[0,1] | S0:2@[2,3]}", (8, 6))
    here = resolve(*args, "2x2").to_json()
    code = f"from hspmd.comm_resolve import resolve; print(resolve(*{args!r}, '2x2').to_json())"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    there = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(there) == json.loads(here)
    assert [s["primitive"] for s in json.loads(here)["steps"]] == ["ReduceScatter", "Identity", "SplitAllReduce"]
