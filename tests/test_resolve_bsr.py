"""Batched send-receive (paper 4.3, figure 8) and its fused multi-tensor form (6.2)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd import device_pieces, parse, resolve, resolve_many, run_plan, shard, unshard
from hspmd.annotations import box_intersection
from hspmd.cluster import uniform
from hspmd.cluster.presets import GENERIC_INTER
from hspmd.comm_resolve.fused import required_bytes, send_lower_bound
from hspmd.comm_resolve.slices import box_volume
from hspmd.comm_resolve.verify import check_plan, peak_elements
from hspmd.errors import HSPMDError, HSPMDTypeError, UnsupportedReshard
from hspmd.backends.plan_executor import reshard_tensor

FIGURE8_SRC = "HD{D:2@[1,2] | S0:2@[9,10] | S0:4@[12-15]}"
FIGURE8_DST = "H0(1:1:2){@[1] | @[8] | @[0]}"


def senders_of(plan, receiver):
    """{row range received: sender} for a 1-D-split destination (local copies included)."""
    return {
        box[0]: t.src for s in plan.steps for t in s.transfers if t.dst == receiver for box in t.boxes
    }


def test_figure8_sender_choices():
    """Rows 0-1 go to GPU1, which owns them (local copy); rows 1-2 to GPU8: owned by GPU1, GPU2 and
    GPU9, and GPU9 shares GPU8's node (faster link); rows 2-3 and 3-4 to GPU0, owned by GPU1 and GPU2
    on GPU0's node (equal bandwidth): GPU1 sends the first, then GPU2, the less loaded, the second."""
    plan = resolve(FIGURE8_SRC, FIGURE8_DST, (4, 3), uniform(2, 8))
    check_plan(plan)
    assert plan.primitives == ("BatchedSendRecv",)
    assert senders_of(plan, 1) == {(0, 1): 1}
    assert senders_of(plan, 8) == {(1, 2): 9}
    assert senders_of(plan, 0) == {(2, 3): 1, (3, 4): 2}
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(reshard_tensor(resolve(FIGURE8_SRC, FIGURE8_DST, (4, 3), "2x8", dtype="float64"), x), x)


def test_a_slow_pair_link_moves_the_choice_to_another_owner():
    slow = uniform(2, 8).with_pairs({(2, 0): GENERIC_INTER})
    plan = resolve(FIGURE8_SRC, FIGURE8_DST, (4, 3), slow)
    assert senders_of(plan, 0) == {(2, 4): 1}  # both slices from GPU1, merged into one box


def _lacking_elements(src, dst, shape):
    """Per destination device: elements of its piece its source piece does not cover."""
    sp, dp = device_pieces(parse(src), shape), device_pieces(parse(dst), shape)
    out = {}
    for d, piece in dp.items():
        held = box_intersection(piece.box, sp[d].box) if d in sp else None
        out[d] = box_volume(piece.box) - (box_volume(held) if held else 0)
    return out


layouts = st.sampled_from(
    ["S0:2@[0,1]", "S1:3@[1,2,3]", "D:2,S0:2@[0-3]", "S0:2,S1:2@[2,3,4,5]", "HD{S0:2@[0,1] | S1:2@[2,3]}",
     "H1(1:2){S0:3@[0,1,2] | D:2@[4,5]}", "H0(3:1:1){S1:2@[5,6] | @[0] | @[3]}", "@[7]", "D:3@[0,2,4]"]
)


@settings(max_examples=150, deadline=None)
@given(layouts, layouts, st.tuples(st.integers(1, 9), st.integers(1, 9)))
def test_bsr_volume_is_the_lower_bound(src, dst, shape):
    """Every element a device needs and lacks is received exactly once, nothing else is sent."""
    plan = resolve(src, dst, shape, "2x4", dtype="float64")
    check_plan(plan)
    if plan.primitives != ("BatchedSendRecv",):
        return
    lacking = _lacking_elements(src, dst, shape)
    assert {d: n // 8 for d, n in plan.bytes_received.items() if n} == {d: n for d, n in lacking.items() if n}
    assert sum(plan.bytes_sent.values()) == sum(lacking.values()) * 8


def test_no_device_allocates_more_than_its_own_pieces():
    """Buffers (collective boxes, messages, intermediate pieces) never exceed the larger of a
    device's source and destination pieces: the whole tensor appears only where a piece is whole."""
    shape = (16, 12)
    for src, dst in [("S0:4@[0-3]", "S1:4@[4-7]"), ("P:4@[0-3]", "S1:4@[4-7]"), ("S0:2,P:2@[0-3]", "S1:4@[2-5]"),
                     ("HP{S1:4@[0-3] | S1:2@[4,5]}", "H0(2:1){S1:4@[0-3] | S1:2@[4,5]}")]:
        plan = resolve(src, dst, shape)
        pieces = [device_pieces(plan.src, shape), device_pieces(plan.dst, shape)]
        for d, peak in peak_elements(plan).items():
            assert peak <= max(box_volume(p[d].box) for p in pieces if d in p), (src, dst, d)
        assert max(peak_elements(plan).values()) < 16 * 12 or src.startswith("P:4")


MOVES = [
    ("S0:2@[0,1]", "S0:2@[2,3]", (6, 4)),
    ("S1:2@[0,1]", "S1:2@[2,3]", (4, 6)),
    ("D:2@[0,1]", "S0:2@[2,3]", (5,)),
    ("HD{S0:2@[0,1] | S0:2@[2,3]}", "@[3]", (4, 2)),
]


def test_fused_plan_has_one_message_per_device_pair_and_is_correct():
    plan = resolve_many(MOVES, "2x2", dtype="float64")
    pairs = [(t.src, t.dst) for t in plan.transfers if t.src != t.dst]
    assert len(pairs) == len(set(pairs)) == plan.messages
    per_tensor = sum(resolve(*m, "2x2").messages for m in MOVES)
    assert plan.messages < per_tensor
    xs = [torch.randn(m[2], dtype=torch.float64) for m in MOVES]
    locals_: dict[int, dict[int, torch.Tensor]] = {}
    for i, (x, (src, _, _)) in enumerate(zip(xs, MOVES)):
        for d, t in shard(x, src).items():
            locals_.setdefault(d, {})[i] = t
    out = run_plan(plan, locals_)
    for i, (x, (_, dst, shape)) in enumerate(zip(xs, MOVES)):
        got = {d: out[d][i] for d in parse(dst).devices}
        assert torch.equal(unshard(got, dst, shape=shape), x)


def test_fused_plan_balances_senders_across_tensors_and_meets_the_volume_bound():
    same = [("D:2@[0,1]", "@[2]", (8,))] * 4
    plan = resolve_many(same, "1x3")
    sent = plan.bytes_sent
    assert sent[0] == sent[1] == 2 * 8 * 4
    assert sent[0] == send_lower_bound(plan) == max(sent.values())
    assert required_bytes(plan)[2] == plan.bytes_received[2]


def test_fused_plan_refuses_partial_sources_and_round_trips_json():
    try:
        resolve_many([("S0:2@[0,1]", "@[2]", (4,)), ("P:2@[0,1]", "@[2]", (4,))])
    except UnsupportedReshard as refusal:
        assert "tensor 1" in str(refusal) and "P:2@[0,1]" in str(refusal)
    else:
        raise AssertionError("a partial source went through BSR")
    plan = resolve_many(MOVES, "2x2")
    assert type(plan).from_json(plan.to_json()) == plan


def test_demand_and_send_lower_bound_by_hand():
    """Owner sets and the min-max send bound on cases worked by hand (float32; rows of 1 element)."""
    from hspmd.comm_resolve.bsr import TensorSlices, demand_by_owner_set, max_send_lower_bound

    whole = ((0, 8),)
    # device 0 already owns what it needs; device 2 takes 8 elements from {0, 1}: 16 bytes each at best
    a = TensorSlices(0, 1, {0: whole, 1: whole}, {0: [whole], 2: [whole]})
    assert demand_by_owner_set([a], 4) == {frozenset({0, 1}): 32}
    assert max_send_lower_bound([a], 4) == 16
    # halves owned by 0 and 1, the whole by 2; device 3 needs it all: 32 bytes over 3 senders, but 2
    # is the only one for both halves' rest: the best cap is 11 (0: 11, 1: 11, 2: 5 + 5)
    b = TensorSlices(1, 1, {0: ((0, 4),), 1: ((4, 8),), 2: whole}, {3: [whole]})
    assert demand_by_owner_set([b], 4) == {frozenset({0, 2}): 16, frozenset({1, 2}): 16}
    assert max_send_lower_bound([b], 4) == 11
    # on two nodes of two ({0, 1}, {2, 3}) only 2 shares 3's node: the fastest owners are {2}
    nodes = uniform(2, 2)
    assert demand_by_owner_set([b], 4, nodes) == {frozenset({2}): 32}
    assert max_send_lower_bound([b], 4, nodes) == 32
    # per-tensor item sizes add up per owner set
    assert demand_by_owner_set([a, TensorSlices(2, 1, {0: whole, 1: whole}, {2: [((0, 3),)]})], [4, 4, 2]) == {
        frozenset({0, 1}): 32 + 6}
    assert max_send_lower_bound([TensorSlices(3, 1, {0: whole}, {0: [whole]})], 4) == 0  # nothing to move


def test_unowned_boxes_are_the_needed_parts_nobody_holds():
    from hspmd.comm_resolve.bsr import TensorSlices, unowned_boxes

    fam = TensorSlices(0, 2, {0: ((0, 2), (0, 4)), 1: ((2, 3), (0, 2))}, {2: [((0, 4), (0, 4))], 3: [((1, 1), (0, 4))]})
    lost = unowned_boxes(fam)
    assert sum(box_volume(b) for b in lost) == 16 - 8 - 2
    assert all(box_intersection(b, o) is None for b in lost for o in fam.owners.values())
    assert unowned_boxes(TensorSlices(1, 1, {0: ((0, 4),)}, {1: [((1, 3),)]})) == []


def test_destination_needs_by_hand():
    """Values: every device its non-empty box (only the chosen devices); partial summands: one
    summand per group that adds up to the tensor, the one an owner already holds."""
    from hspmd.comm_resolve.bsr import destination_needs

    whole = ((0, 4),)
    assert destination_needs(parse("S0:2@[0,1]"), (4,), {}) == {0: [((0, 2),)], 1: [((2, 4),)]}
    assert destination_needs(parse("S0:2@[0,1]"), (4,), {}, devices=[1]) == {1: [((2, 4),)]}
    uneven = destination_needs(parse("S0:4@[0-3]"), (2,), {})  # two rows over four devices: two get none
    pieces = device_pieces(parse("S0:4@[0-3]"), (2,))
    assert uneven == {d: [p.box] for d, p in pieces.items() if box_volume(p.box) > 0} and len(uneven) == 2
    # P:2 over [0, 1]: one summand carries the value; device 1 owns it already, device 0 stays zero
    assert destination_needs(parse("P:2@[0,1]"), (4,), {1: whole}) == {1: [whole]}
    # HP: the subgroups' summands add up together: one of them carries it; HD of partial subgroups: one per subgroup
    assert destination_needs(parse("HP{@[0] | @[1]}"), (4,), {1: whole}) == {1: [whole]}
    both = destination_needs(parse("HD{P:2@[0,1] | P:2@[2,3]}"), (4,), {1: whole, 2: ((0, 2),)})
    assert both == {1: [whole], 2: [whole]}


@pytest.mark.parametrize("moves, failed, error, words", [
    (5, (), HSPMDTypeError, "moves must be a collection"),
    (None, (), HSPMDTypeError, "moves must be a collection"),
    ([("S0:2@[0,1]", "@[2]", (4,))], "0", HSPMDTypeError, "failed must be device ids"),  # not the set {'0'}
    ([("S0:2@[0,1]", "@[2]", (4,))], 1, HSPMDTypeError, "failed must be device ids"),
    ([("S0:2@[0,1]", "@[2]", (4,))], [-1], HSPMDError, "device id -1 is outside"),
    ([("S0:2@[0,1]", "@[2]", (4,))], [True], HSPMDTypeError, "failed must be device ids"),
])
def test_resolve_many_checks_its_moves_and_failed_devices(moves, failed, error, words):
    with pytest.raises(error, match=words):
        resolve_many(moves, failed=failed)
