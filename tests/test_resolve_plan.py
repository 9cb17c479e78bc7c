"""Plans as data: topology model, traffic and time estimates, JSON, text, and `hspmd explain`."""

from __future__ import annotations

import json

import pytest
import torch

from hspmd import Plan, parse_cluster, resolve, resolve_many
from hspmd.comm_resolve.plan import FusedPlan
from hspmd.cluster import ClusterSpec, LinkClass, Node, cluster_from_dict, cluster_to_dict, uniform
from hspmd.cluster.presets import GENERIC, GENERIC_INTER, GENERIC_INTRA, INFINIBAND, NVLINK
from hspmd.cli import main as cli_main
from hspmd.comm_resolve.explain import main as explain_main
from hspmd.errors import ClusterError, HSPMDError, HSPMDTypeError, PlanError, ShapeError
from hspmd.backends.local import run_on_devices
from hspmd.backends.plan_executor import execute_plan


def test_topology_presets_and_text():
    t = parse_cluster("2x4")
    assert t == uniform(2, 4) and t.n_devices == 8 and t.node_of(5) == 1
    assert t.link(0, 3).name == "intra-node" and t.link(3, 4).name == "inter-node" and t.link(2, 2).name == "local"
    assert t.bandwidth(0, 1) > t.bandwidth(0, 7)
    ib = parse_cluster("nvlink-ib:4x8")
    assert ib.link(8, 15) == NVLINK and ib.link(7, 8) == INFINIBAND and ib.n_devices == 32
    mixed = parse_cluster("h800-h20:1+1x2")
    assert [mixed.link(0, 1).name, mixed.link(2, 3).name, mixed.link(1, 2).name] == ["nvlink-h800", "nvlink-h20", "roce"]
    assert mixed.bandwidth(2, 3) > mixed.bandwidth(0, 1) > mixed.bandwidth(1, 2)
    custom = t.with_pairs({(5, 1): NVLINK})
    assert custom.link(1, 5) == NVLINK and cluster_from_dict(cluster_to_dict(custom)) == custom
    assert resolve("S0:2@[1,5]", "@[1]", (4,), custom).bytes_by_link == {"nvlink": 8}


@pytest.mark.parametrize("text", ["2x", "fat-tree", "h800-h20:2"])
def test_unknown_topologies_are_errors(text):
    with pytest.raises(ClusterError, match="unknown cluster"):
        resolve("@[0]", "@[0]", (1,), text)


def test_ring_allgather_traffic_and_time():
    """4 members, 2 floats each: every member sends the 3 chunks but its successor's (24 B);
    on 2 nodes of 2 the ring 0-1-2-3-0 crosses nodes twice."""
    topo = uniform(2, 2)
    plan = resolve("S0:4@[0-3]", "D:4@[0-3]", (8,), topo, via="hierarchical")
    assert plan.primitives == ("AllGather",)
    assert plan.bytes_sent == {d: 24 for d in range(4)} == plan.bytes_received
    assert plan.bytes_by_link == {"inter-node": 48, "intra-node": 48}
    expected = 3 * GENERIC_INTER.latency + 24 / GENERIC_INTER.bandwidth
    assert plan.estimated_seconds == pytest.approx(expected)
    # the default BatchedSendRecv: each device receives 1 piece over its node's link and 2 across
    bsr = resolve("S0:4@[0-3]", "D:4@[0-3]", (8,), topo)
    assert bsr.primitives == ("BatchedSendRecv",)
    expected = GENERIC_INTRA.seconds(8) + 2 * GENERIC_INTER.seconds(8)
    assert bsr.estimated_seconds == pytest.approx(expected) and expected < plan.estimated_seconds


def _two_sites(shared: bool) -> ClusterSpec:
    """Sites a = [0, 1] and b = [2, 3], one node each, joined by a 1 GB/s, 100 us link."""
    wan = LinkClass("wan", 1e9, 1e-4, shared=shared)
    nodes = (Node("gpu", 2, "a"), Node("gpu", 2, "b"))
    return ClusterSpec(nodes, (GENERIC,), (GENERIC_INTRA, wan), (("gpu", GENERIC_INTRA.name),),
                       (("*", GENERIC_INTRA.name),), "wan")


def test_messages_across_a_shared_link_queue_on_its_pipe():
    wan = _two_sites(True).link_named("wan")
    for shared, queued in ((False, 1), (True, 2)):
        plan = resolve("S0:2@[0,1]", "S0:2@[2,3]", (8,), _two_sites(shared), via="direct")  # 0 -> 2, 1 -> 3: 16 B
        assert plan.messages == 2 and plan.estimated_seconds == pytest.approx(queued * wan.seconds(16))
    # so by default one message crosses: gather onto 0, 0 -> 2, 2 -> 3 (HetAuto's root)
    root = resolve("S0:2@[0,1]", "S0:2@[2,3]", (8,), _two_sites(True))
    assert [(t.src, t.dst) for s in root.steps for t in s.transfers if (t.src < 2) != (t.dst < 2)] == [(0, 2)]
    # a ring 0 -> 2 -> 1 -> 3 -> 0 crosses twice each way: 2 x 24 B share each direction's pipe
    for shared, on_pipe in ((False, 24), (True, 48)):
        ring = resolve("S0:4@[0,2,1,3]", "D:4@[0,2,1,3]", (8,), _two_sites(shared), via="hierarchical")
        assert ring.primitives == ("AllGather",)
        assert ring.estimated_seconds == pytest.approx(3 * wan.latency + on_pipe / wan.bandwidth)


def test_allreduce_and_sendrecv_traffic():
    ar = resolve("P:2@[0,1]", "D:2@[0,1]", (8,), dtype="float64")
    assert ar.bytes_sent == {0: 64, 1: 64}
    topo = uniform(2, 2)
    sr = resolve("S0:2@[0,1]", "S0:2@[2,3]", (8,), topo)
    assert sr.bytes_sent == {0: 16, 1: 16, 2: 0, 3: 0} and sr.bytes_by_link == {"inter-node": 32}
    assert sr.estimated_seconds == pytest.approx(GENERIC_INTER.latency + 16 / GENERIC_INTER.bandwidth)


def test_phases_of_different_subgroups_overlap_in_the_estimate():
    plan = resolve("HD{P:2@[0,1] | P:2@[2,3]}", "HD{D:2@[0,1] | D:2@[2,3]}", (1024,))
    assert plan.primitives == ("AllReduce", "AllReduce")
    assert plan.estimated_seconds == pytest.approx(max(plan.step_seconds()))


@pytest.mark.parametrize(
    "src, dst, shape",
    [("HP{P:2@[0,1] | S0:2@[2,3]}", "HD{S0:2@[0,1] | S0:2@[2,3]}", (8, 6)), ("P:2@[0,1]", "S1:3@[1,2,3]", (4, 5)),
     ("H0(2:1){S1:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}", (7, 5))],
)
def test_plans_round_trip_through_json(src, dst, shape):
    plan = resolve(src, dst, shape, "2x2")
    data = json.loads(plan.to_json())
    assert data["schema"] == "hspmd.plan/1"
    assert [s["primitive"] for s in data["steps"]] == list(plan.primitives)
    assert all(isinstance(g, list) for s in data["steps"] for g in s["groups"])
    assert data["bytes_sent"] == {str(d): n for d, n in plan.bytes_sent.items()}
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_text_names_steps_groups_and_traffic():
    text = str(resolve("HP{S1:4@[0-3] | S1:2@[4,5]}", "HD{S1:4@[0-3] | S1:2@[4,5]}", (8, 6)))
    assert "SplitAllReduce" in text and "[0,4] [1,4] [2,5] [3,5]" in text
    assert "bytes sent" in text and "estimated time" in text


def test_executor_rejects_locals_that_do_not_match_the_plan():
    plan = resolve("S0:2@[0,1]", "D:2@[0,1]", (4, 3))
    good = {0: torch.zeros(2, 3), 1: torch.zeros(2, 3)}
    with pytest.raises(ShapeError, match="resolve with dtype='float64'"):
        run_on_devices(lambda b: execute_plan(plan, b, good[b.rank].double()), [0, 1], timeout=5)
    with pytest.raises(ShapeError, match="shape"):
        run_on_devices(lambda b: execute_plan(plan, b, torch.zeros(3, 3)), [0, 1], timeout=5)


def test_explain_json_has_the_documented_schema(capsys):
    assert explain_main(["P:2,S1:2@[0-3]", "S0:2,S1:2@[0-3]", "--shape", "8,6", "--topology", "2x2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"][0]["primitive"] == "ReduceScatter"
    assert data["steps"][0]["groups"] == [[0, 2], [1, 3]]
    assert set(data["bytes_sent"]) == set(data["bytes_received"]) == {"0", "1", "2", "3"}
    assert data["estimated_seconds"] > 0


def test_explain_prints_a_readable_plan_through_the_hspmd_command(capsys):
    assert cli_main(["explain", "HP{P:2@[0,1] | S0:2@[2,3]}", "HD{S0:2@[0,1] | S0:2@[2,3]}", "--shape", "8,6",
                     "--details"]) == 0
    out = capsys.readouterr().out
    for word in ("ReduceScatter", "Identity", "SplitAllReduce", "bytes per device", "estimated time", "all_reduce"):
        assert word in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["S0:2@[0,1", "@[0]", "--shape", "4"], "close the device list"),
        (["S0:2@[0,1]", "@[0]", "--shape", "4,x"], "comma-separated integers"),
        (["S0:2@[0,1]", "@[0]"], "--shape"),
        (["P:2@[0,1]", "@[2]", "--shape", "4", "--strict"], "partial sums"),
        (["S0:2@[0,9]", "@[0]", "--shape", "4", "--topology", "1x4"], "not in cluster"),
    ],
)
def test_explain_errors_exit_2_with_a_message_and_no_traceback(argv, words, capsys):
    assert explain_main(argv) == 2
    captured = capsys.readouterr()
    assert words in captured.err and "Traceback" not in captured.err and captured.out == ""


def test_resolve_refuses_contradicting_ratios_negative_devices_and_a_non_bool_flag():
    """Arguments resolve used to ignore or misread: ratios other than the layout's own, a negative
    device id in for_devices, reduce_partial='no' (which is truthy)."""
    plan = resolve("H0(1:1){@[0] | @[1]}", "@[2]", (6,), src_ratios=(1, 1))  # the same ratios: fine
    assert plan.src.ratios == (1, 1)
    with pytest.raises(ShapeError, match=r"src_ratios=\(5, 1\) contradicts .* ratios are 1:1"):
        resolve("H0(1:1){@[0] | @[1]}", "@[2]", (6,), src_ratios=(5, 1))
    with pytest.raises(HSPMDError, match="for_devices: device id -1"):
        resolve("S0:2@[0,1]", "D:2@[0,1]", (4,), for_devices=[-1])
    with pytest.raises(HSPMDTypeError, match="reduce_partial must be True or False"):
        resolve("P:2@[0,1]", "S0:2@[2,3]", (4,), reduce_partial="no")


def _damaged(data: dict, path: tuple, value) -> dict:
    """A deep copy of `data` with the field at `path` set to `value` (deleted for _MISSING)."""
    data = json.loads(json.dumps(data))
    *parents, last = path
    at = data
    for key in parents:
        at = at[key]
    if value is _MISSING:
        del at[last]
    else:
        at[last] = value
    return data


_MISSING = object()


@pytest.mark.parametrize("path, value, words", [
    (("src",), _MISSING, "plan field src: missing"),
    (("schema",), "hspmd.plan/0", "plan field schema: expected 'hspmd.plan/1'"),
    (("schema",), _MISSING, "plan field schema: missing"),
    (("shape",), "ab", "plan field shape: expected a list"),
    (("shape",), [], "plan field src: .*outside a rank-0 tensor"),
    (("dtype",), "foo", "plan field dtype: expected a string among"),
    (("src",), "S0:2@[0", "plan field src: "),
    (("steps", 0, "primitive"), "Teleport", r"steps\[0\].primitive: expected a string among"),
    (("steps", 0, "collectives", 0, "box"), [[0]], r"steps\[0\].collectives\[0\].box\[0\]: expected a range"),
    (("steps", 0, "collectives", 0, "devices"), [0, -1], r"collectives\[0\].devices\[1\]: expected an integer >= 0"),
    (("steps", 0, "repeats"), [[0]], r"steps\[0\].repeats\[0\]: expected \[template devices, devices\]"),
    (("topology",), "2x2", "plan field topology: "),
])
def test_a_damaged_plan_is_refused_naming_the_field(path, value, words):
    data = resolve("S0:2@[0,1]", "D:2@[0,1]", (4,)).to_dict()
    with pytest.raises(PlanError, match=words):
        Plan.from_dict(_damaged(data, path, value))


def test_plan_json_that_is_not_a_plan_is_refused():
    with pytest.raises(PlanError, match="not JSON"):
        Plan.from_json("xx")
    with pytest.raises(PlanError, match="plan field schema: missing"):
        Plan.from_json("{}")
    with pytest.raises(PlanError, match=r"\(top\): expected an object"):
        Plan.from_json("[1]")
    with pytest.raises(PlanError, match="FusedPlan.from_json: plan field schema: missing"):
        FusedPlan.from_json("{}")
    fused = resolve_many([("S0:2@[0,1]", "@[2]", (4,), "bfloat16"), ("D:2@[0,1]", "S0:2@[2,3]", (6,))]).to_dict()
    assert fused["dtype"] == "mixed" and FusedPlan.from_dict(fused).dtype == "mixed"
    for path, value, words in [(("schema",), "hspmd.plan/1", "expected 'hspmd.fused-plan/1'"),
                               (("tensors", 1, "dtype"), "foo", r"tensors\[1\].dtype: expected a string among"),
                               (("tensors", 0, "shape"), [4, "x"], r"tensors\[0\].shape\[1\]: expected an integer"),
                               (("steps",), [], "expected one BatchedSendRecv step"),
                               (("failed",), [-1], r"failed\[0\]: expected an integer >= 0")]:
        with pytest.raises(PlanError, match=words):
            FusedPlan.from_dict(_damaged(fused, path, value))
