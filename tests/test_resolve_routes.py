"""Routes the resolver can take between two layouts (HetAuto S1/S2/S3, merged AllGather) and the
choice by estimated cost; 002 App. E's 20 combinations of (inner DP, CP x TP) across two stages."""

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hspmd import parse, resolve
from hspmd.annotations import box_intersection, device_pieces
from hspmd.comm_resolve.slices import box_volume
from hspmd.backends.plan_executor import reshard_tensor
from hspmd.cluster import LinkClass, uniform
from hspmd.comm_resolve.compare import alternatives, chosen_route
from hspmd.comm_resolve.explain import main as explain_main
from hspmd.errors import UnsupportedReshard

# 002 App. E: two clusters of 16 devices, one stage each; d_inner * (c t) = 16 per stage, d1 != d2
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
    alts = alternatives(src, dst, shape, "2x2")
    assert alts["hierarchical"].primitives == ("AllGather", "AllGather", "SplitAllGather")
    assert alts["merged-allgather"].primitives == ("AllGather",)
    plan = resolve(src, dst, shape, "2x2")
    assert plan.estimated_seconds == min(alts[v].estimated_seconds for v in ("hierarchical", "merged-allgather"))
    assert chosen_route(alts, plan) == "merged-allgather"
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
    with pytest.raises(UnsupportedReshard, match="single-subgroup"):
        resolve(*MERGE, via="representatives")
    with pytest.raises(UnsupportedReshard, match="tile the tensor once"):
        resolve("D:2@[0,1]", "D:2@[0,1]", (4,), via="merged-allgather")
    with pytest.raises(UnsupportedReshard, match="partial sums"):
        resolve("P:2@[0,1]", "D:2@[2,3]", (4,), via="root")
    with pytest.raises(UnsupportedReshard, match="unknown route"):
        resolve("D:2@[0,1]", "D:2@[0,1]", (4,), via="sideways")


def test_explain_compare_prints_every_route(capsys):
    src, dst, shape = MERGE
    assert explain_main([src, dst, "--shape", "8,4", "--topology", "2x2", "--compare"]) == 0
    out = capsys.readouterr().out
    for via in ("hierarchical", "merged-allgather *", "direct", "root"):
        assert via in out
    assert "representatives: not applicable" in out
    assert explain_main([src, dst, "--shape", "8,4", "--compare", "--json"]) == 0
    assert '"chosen"' in capsys.readouterr().out
