"""Routes the resolver can take between two layouts (HetAuto S1/S2/S3, merged AllGather) and the
choice by estimated cost; HetAuto App. E's 20 combinations of (inner DP, CP x TP) across two stages."""

import itertools
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from test_resolve_property import reshards

from hspmd import parse, resolve, shard, unshard
from hspmd.annotations import box_intersection, device_pieces
from hspmd.backends.plan_executor import reshard_tensor, run_plan
from hspmd.cluster import ClusterSpec, DeviceType, LinkClass, Node, uniform
from hspmd.comm_resolve import Plan
from hspmd.comm_resolve.bounds import reshard_bound, route_bound
from hspmd.comm_resolve.compare import TWO_HOP, alternatives, chosen_route
from hspmd.comm_resolve.explain import main as explain_main
from hspmd.comm_resolve.resolver import VIAS, cheaper, subgroup_by_subgroup
from hspmd.comm_resolve.slices import box_volume
from hspmd.comm_resolve.verify import check_plan
from hspmd.errors import UnsupportedReshard

# HetAuto App. E: two clusters of 16 devices, one stage each; d_inner * (c t) = 16 per stage, d1 != d2
DEGREES = (1, 2, 4, 8, 16)
COMBOS = [(d1, d2) for d1, d2 in itertools.product(DEGREES, DEGREES) if d1 != d2]
CLUSTERS = uniform(2, 16)  # "inter-node" is the slow cross-cluster link here
SHAPE = (16, 64, 4)  # [b', s, h]


def _stage(d: int, first: int) -> str:
    return f"S0:{d},S1:{16 // d}@[{first}-{first + 15}]"


def _cross(plan) -> list:
    return [t for s in plan.steps for t in s.transfers if t.src != t.dst and (t.src < 16) != (t.dst < 16)]


def _overlapping_pairs(src: str, dst: str) -> int:
    a, b = device_pieces(parse(src), SHAPE), device_pieces(parse(dst), SHAPE)
    return sum(1 for p in a.values() for q in b.values()
               if (box := box_intersection(p.box, q.box)) is not None and box_volume(box) > 0)


def test_app_e_has_20_combinations():
    assert len(COMBOS) == 20


@pytest.mark.parametrize("d1,d2", COMBOS)
def test_message_counts_of_s1_s2_s3(d1, d2):
    src, dst = _stage(d1, 0), _stage(d2, 16)
    s1 = resolve(src, dst, SHAPE, CLUSTERS, via="direct")
    s2 = resolve(src, dst, SHAPE, CLUSTERS, via="root")
    s3 = resolve(src, dst, SHAPE, CLUSTERS, via="representatives")
    assert len(_cross(s1)) == s1.messages == _overlapping_pairs(src, dst)
    assert len(_cross(s2)) == 1
    # S3: representatives hold [b', s/(ct), h]; their cross-stage messages are those layouts' overlaps
    assert len(_cross(s3)) == _overlapping_pairs(f"S1:{16 // d1}@[0-{16 // d1 - 1}]", f"S1:{16 // d2}@[16-{15 + 16 // d2}]")
    assert len(_cross(s3)) == max(16 // d1, 16 // d2)
    slow = {p.bytes_by_link.get("inter-node") for p in (s1, s2, s3)}
    assert slow == {box_volume(tuple((0, n) for n in SHAPE)) * 4}


def test_s3_sends_ct_messages_when_sequence_layouts_match():
    plan = resolve("S0:2,S1:4@[0-7]", "S0:4,S1:4@[16-31]", SHAPE, CLUSTERS, via="representatives")
    assert len(_cross(plan)) == 4


@settings(max_examples=12)
@given(st.sampled_from(COMBOS), st.sampled_from(["direct", "root", "representatives"]))
def test_every_route_moves_the_values(combo, via):
    d1, d2 = combo
    plan = resolve(_stage(d1, 0), _stage(d2, 16), SHAPE, CLUSTERS, via=via)
    x = torch.randn(SHAPE)
    assert torch.equal(reshard_tensor(plan, x), x)


MERGE = ("H0(1:1){S0:2@[0,1] | S0:2@[2,3]}", "HD{D:2@[0,1] | D:2@[2,3]}", (8, 4))


def test_consecutive_allgathers_merge_when_cheaper():
    src, dst, shape = MERGE
    alts = alternatives(src, dst, shape)  # one node: every link alike
    assert alts["hierarchical"].primitives == ("AllGather", "AllGather", "SplitAllGather")
    assert alts["merged-allgather"].primitives == ("AllGather",)
    plan = resolve(src, dst, shape)
    assert plan.estimated_seconds < alts["hierarchical"].estimated_seconds
    # on equal links the ring and the one BatchedSendRecv tie; the tie goes to the earlier route
    assert alts["direct"].estimated_seconds == pytest.approx(plan.estimated_seconds, rel=1e-12)
    assert chosen_route(alts, plan) == "merged-allgather"
    x = torch.randn(shape)
    assert torch.equal(reshard_tensor(plan, x), x)


def test_across_nodes_fewer_slow_messages_win():
    # 2 nodes of 2, 16 B pieces (latency-bound): 3 steps of rings (45 us) > one ring across the
    # nodes (30 us) > one BatchedSendRecv, 2 of each device's 3 messages across (25 us) > HetAuto's
    # root inside each node: gather, one message across, broadcast (20 us)
    src, dst, shape = MERGE
    alts = alternatives(src, dst, shape, "2x2")
    times = [alts[v].estimated_seconds for v in ("hierarchical", "merged-allgather", "direct", "root")]
    assert times == sorted(times, reverse=True)
    plan = resolve(src, dst, shape, "2x2")
    assert chosen_route(alts, plan) == "root"
    x = torch.randn(shape)
    assert torch.equal(reshard_tensor(plan, x), x)


def test_hierarchical_kept_when_the_merge_costs_more():
    # one slow pair on the merged ring (3 -> 0); the per-subgroup gathers and the SplitAllGather avoid it
    slow = uniform(1, 4, intra=LinkClass("fast", 100e9, 1e-6)).with_pairs({(0, 3): LinkClass("slow", 1e9, 1e-6)})
    src, dst, shape = MERGE[0], MERGE[1], (1024, 256)
    alts = alternatives(src, dst, shape, slow)
    plan = resolve(src, dst, shape, slow)
    assert alts["merged-allgather"].estimated_seconds > alts["hierarchical"].estimated_seconds
    assert chosen_route(alts, plan) == "hierarchical"
    x = torch.randn(shape)
    assert torch.equal(reshard_tensor(plan, x), x)


def test_routes_that_do_not_apply_say_why():
    with pytest.raises(UnsupportedReshard, match="tile the tensor once"):
        resolve("D:2@[0,1]", "D:2@[0,1]", (4,), via="merged-allgather")
    with pytest.raises(UnsupportedReshard, match="partial sums"):
        resolve("P:2@[0,1]", "D:2@[2,3]", (4,), via="root")
    with pytest.raises(UnsupportedReshard, match="destination .* holds partial sums"):
        resolve("D:2@[0,1]", "P:2@[2,3]", (4,), via="representatives")
    with pytest.raises(UnsupportedReshard, match="unknown route"):
        resolve("D:2@[0,1]", "D:2@[0,1]", (4,), via="sideways")


def test_root_and_representatives_gather_inside_each_subgroup():
    """HetAuto gathers inside an outer-DP partition (an hspmd subgroup), never across them."""
    src, dst = "H0(1:1){S0:2,S1:2@[0-3] | S0:2,S1:2@[4-7]}", "H0(1:1){S1:4@[8-11] | S1:4@[12-15]}"
    for via in ("root", "representatives"):
        plan = resolve(src, dst, (8, 8), CLUSTERS, via=via)
        gather = plan.steps[0]
        assert all((t.src < 4) == (t.dst < 4) for t in gather.transfers), via
        x = torch.randn((8, 8))
        assert torch.equal(reshard_tensor(plan, x), x)


def test_explain_compare_prints_every_route(capsys):
    src, dst, shape = MERGE
    assert explain_main([src, dst, "--shape", "8,4", "--topology", "2x2", "--compare"]) == 0
    out = capsys.readouterr().out
    for via in ("hierarchical", "merged-allgather", "direct", "root *", "representatives"):
        assert via in out
    assert explain_main([src, dst, "--shape", "8,4", "--compare", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "merged-allgather" and set(data["alternatives"]) == set(VIAS)


# the default picks the cheapest route ------------------------------------------------------------


def two_sites(nodes: int = 2, per_node: int = 4, cross: LinkClass = LinkClass("wan", 1.25e9, 1e-3)) -> ClusterSpec:
    """Two sites (HetAuto's clusters) of `nodes` nodes each, NVLink inside a node, InfiniBand
    between nodes of a site and a slow, high-latency link between the sites."""
    gpu = DeviceType("gpu", (("float32", 20e12),), 2e12, 80e9)
    nvlink, ib = LinkClass("nvlink", 300e9, 3e-6), LinkClass("ib", 12.5e9, 6e-6)
    sites = (Node("gpu", per_node, "a"),) * nodes + (Node("gpu", per_node, "b"),) * nodes
    return ClusterSpec(sites, (gpu,), (nvlink, ib, cross), (("gpu", "nvlink"),), (("*", "ib"),), cross.name)


SHARED_WAN = LinkClass("wan", 1.25e9, 100e-6, shared=True)
BUCKETED = uniform(2, 8, inter=LinkClass("ib", 50e9, 6e-6, ((4096, 2e-6, 5e9),)))  # small messages: less latency, slower
PROPERTY_CLUSTERS = [None, "4x4", "h800-h20:1+1", BUCKETED, two_sites(), two_sites(4, 2, SHARED_WAN)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reshards(), st.sampled_from(PROPERTY_CLUSTERS), st.integers(0, 2**16))
def test_the_default_plan_is_the_cheapest_route(case, cluster, seed):
    src, dst, shape = case
    plan = resolve(src, dst, shape, cluster, dtype="float64")
    alts = alternatives(src, dst, shape, cluster, dtype="float64")
    times = {via: p.estimated_seconds for via, p in alts.items() if isinstance(p, Plan)}
    via = chosen_route(alts, plan)  # the pick is one of the routes --compare lists
    order = (*VIAS, TWO_HOP)  # a two-hop plan is listed where resolve picks one
    if subgroup_by_subgroup(src, dst, shape):  # the top tier stays: each subgroup on its own, whatever the prices
        assert plan == alts["hierarchical"]
    else:
        assert plan.estimated_seconds == pytest.approx(min(times.values()), rel=1e-8, abs=1e-15)
        assert not any(cheaper(t, times[via]) for v, t in times.items() if order.index(v) < order.index(via))
    assert resolve(src, dst, shape, cluster, dtype="float64") == plan  # the same on every device
    # the bounds that let resolve skip routes are below what the routes cost
    floor = reshard_bound(src, dst, shape, 8, plan.topology)
    for via, p in alts.items():
        if isinstance(p, Plan):
            assert floor <= p.estimated_seconds * (1 + 1e-9), via
        if via in ("direct", "root", "representatives") and isinstance(p, Plan) and p.steps[0].src == src:
            hops = [s.src for s in p.steps] + [p.steps[-1].dst]
            assert route_bound(hops, shape, 8, plan.topology) <= p.estimated_seconds * (1 + 1e-9), via
    check_plan(plan)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    result = run_plan(plan, shard(x, src, seed=seed))
    torch.testing.assert_close(unshard(result, dst, shape=shape), x, rtol=1e-9, atol=1e-9)


def test_the_root_route_wins_across_a_slow_high_latency_link():
    """Stage 1 (inner DP 4, 2 nodes of site a) to stage 2 (sequence split 8, site b) of a small
    activation: one message over the 1 ms link beats four per device (HetAuto's S2)."""
    src, dst, shape = "S0:4,S1:2@[0-7]", "S1:8@[8-15]", (4, 64, 16)
    alts = alternatives(src, dst, shape, two_sites(), dtype="bfloat16")
    plan = resolve(src, dst, shape, two_sites(), dtype="bfloat16")
    assert chosen_route(alts, plan) == "root"
    hierarchical = alts["hierarchical"]
    assert _between_sites(plan, 8) == 1 < _between_sites(hierarchical, 8)
    assert plan.estimated_seconds < hierarchical.estimated_seconds
    x = torch.randn(shape, dtype=torch.bfloat16)
    assert torch.equal(reshard_tensor(plan, x), x)


def _between_sites(plan, first_of_b: int) -> int:
    """Messages between the two sites (devices below `first_of_b` are site a)."""
    return sum(1 for s in plan.steps for t in s.transfers if (t.src < first_of_b) != (t.dst < first_of_b))


def test_representatives_win_across_a_shared_slow_link():
    """HetAuto App. E's clusters (one ~10 Gb/s pipe between them), inner DP 4 x CT 4 -> inner DP 8 x
    CT 2, a 16 MB activation: S1's 32 messages queue on the pipe; S3 sends 4 (HetAuto's pick)."""
    src, dst, shape = "S0:4,S1:4@[0-15]", "S0:8,S1:2@[16-31]", (16, 512, 1024)
    alts = alternatives(src, dst, shape, "hetauto-a100-2x16", dtype="bfloat16")
    plan = resolve(src, dst, shape, "hetauto-a100-2x16", dtype="bfloat16")
    assert chosen_route(alts, plan) == "representatives"
    assert _between_sites(plan, 16) == 4 < _between_sites(alts["hierarchical"], 16) == 32
    assert plan.estimated_seconds < alts["root"].estimated_seconds < alts["hierarchical"].estimated_seconds
    assert plan.bytes_by_link["wan-10g"] == alts["hierarchical"].bytes_by_link["wan-10g"]  # the tensor once
    x = torch.randn(shape).to(torch.bfloat16)
    assert torch.equal(reshard_tensor(plan, x), x)


def test_large_tensors_across_the_shared_link_keep_the_direct_plan():
    """App. E's own size (1 GiB): the pipe's bandwidth dominates, S1 = hierarchical is cheapest in
    this model (the paper measured S1 slow and unstable there: congestion beyond the latencies the
    pipe queues is not modelled)."""
    src, dst, shape = "S0:4,S1:4@[0-15]", "S0:8,S1:2@[16-31]", (16, 8192, 4096)
    plan = resolve(src, dst, shape, "hetauto-a100-2x16", dtype="bfloat16")
    assert plan.primitives == ("BatchedSendRecv",) and _between_sites(plan, 16) == 32


def test_a_union_that_keeps_its_top_tier_never_sends_across_subgroups():
    """The tied head of `1x1: R0,1 L0 | R2-5 L1 ; 1x1: R6 L0 | R7-10 L1`: the table goes from each
    pipeline's first stage to its own last stage (Hetu v2 §4.1), though the direct BSR, which would
    feed pipeline 1's last stage from device 1, is priced lower; --compare still lists it."""
    src, dst, shape = "HD{S0:2@[0,1] | @[6]}", "HD{S0:4@[2-5] | S0:4@[7-10]}", (64, 32)
    alts = alternatives(src, dst, shape)
    plan = resolve(src, dst, shape)
    assert subgroup_by_subgroup(src, dst, shape)
    assert alts["direct"].estimated_seconds < alts["hierarchical"].estimated_seconds
    assert chosen_route(alts, plan) == "hierarchical"
    pipeline = {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 1, 8: 1, 9: 1, 10: 1}
    moved = [t for s in plan.steps for t in s.transfers if t.src != t.dst]
    assert moved and all(pipeline[t.src] == pipeline[t.dst] for t in moved)
    assert any(pipeline[t.src] != pipeline[t.dst] for s in alts["direct"].steps for t in s.transfers)
    assert not subgroup_by_subgroup("H0(1:2){@[0] | @[1]}", "H0(2:1){@[0] | @[1]}", (3, 2))  # regions change
