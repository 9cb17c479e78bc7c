"""Deduction rules of the op library (paper section 5.2, figures 10 and 11)."""

import pytest
import torch

import hspmd.ops as O
from hspmd.annotations import parse
from hspmd.comm_resolve import resolve
from hspmd.errors import DeductionError
from hspmd.ir import comm, parameter, placeholder, symbols
from hspmd.ops import Graph
from hspmd.specialize.deduce import deduce

B, S = symbols("B S")


def _deduce(build, **anns):
    g = Graph()
    out = build(g)
    return str(deduce(g, 0)[out])


def _mm(x_shape, x_ann, w_shape, w_ann):
    def build(g):
        x = placeholder(g, "x", x_shape, annotation=x_ann)
        w = parameter(g, "w", w_shape, annotation=w_ann)
        return x @ w

    return _deduce(build)


@pytest.mark.parametrize(
    "x_ann, w_ann, expected",
    [
        ("D:2@[0,1]", "S1:2@[0,1]", "S2:2@[0,1]"),  # column parallel
        ("S2:2@[0,1]", "S0:2@[0,1]", "P:2@[0,1]"),  # row parallel: K split in both
        ("S0:2@[0,1]", "D:2@[0,1]", "S0:2@[0,1]"),  # data parallel
        ("S0:2,D:2@[0-3]", "D:2,S1:2@[0-3]", "S0:2,S2:2@[0-3]"),  # DP x TP
        ("D:4@[0-3]", "D:2,S1:2@[0-3]", "D:2,S2:2@[0-3]"),  # refinement of D:4
        ("P:2@[0,1]", "D:2@[0,1]", "P:2@[0,1]"),  # linear in x
        # figure 11: top-tier HDim 0 with a duplicated (HDim D) weight keeps HDim 0
        ("H0(2:1){D:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}", "H0(2:1){S2:2@[0,1] | @[2]}"),
        ("H0(2:1){D:2@[0,1] | @[2]}", "D:3@[0-2]", None),  # HSize 1 D:3 cannot regroup into [0,1] | [2]
    ],
)
def test_matmul_rules(x_ann, w_ann, expected):
    if expected is None:
        with pytest.raises(DeductionError, match="matmul matmul"):
            _mm((B, S, 8), x_ann, (8, 4), w_ann)
    else:
        assert _mm((B, S, 8), x_ann, (8, 4), w_ann) == expected


def test_hsize_one_annotation_is_regrouped_to_the_largest_hsize():
    # figure 10: D:2,S1:2 over [0-3] is the union HD{S1:2@[0,1] | S1:2@[2,3]}
    got = _mm((B, 8), "H0(1:1){D:2@[0,1] | D:2@[2,3]}", (8, 4), "D:2,S1:2@[0-3]")
    assert got == "H0(1:1){S1:2@[0,1] | S1:2@[2,3]}"


@pytest.mark.parametrize(
    "x_ann, w_ann, message",
    [
        ("S2:2@[0,1]", "D:2@[0,1]", "contracted dim K is split in one input"),
        ("S0:2@[0,1]", "S1:2@[0,1]", "x is split along output dim 0 and w along output dim 2"),
        ("P:2@[0,1]", "P:2@[0,1]", "both inputs are partial"),
        ("D:2@[0,1]", "D:2@[2,3]", "different device-group unions"),
        ("S0:2@[0,1]", "S1:2@[1,0]", "different device-group unions"),
        # K split across subgroups 1:2 in x and 1:1 in w: the pieces a contraction pairs differ
        ("H2(1:2){D:2@[0,1] | @[2]}", "H0(1:1){D:2@[0,1] | @[2]}", "split across subgroups in different ratios"),
    ],
)
def test_matmul_mismatches_name_the_op_and_say_insert_comm(x_ann, w_ann, message):
    with pytest.raises(DeductionError, match=message) as info:
        _mm((B, S, 8), x_ann, (8, 4), w_ann)
    assert "matmul" in str(info.value) and "insert comm()" in str(info.value)


@pytest.mark.parametrize(
    "x_ann, w_ann, expected",
    [
        ("S0:2@[0,1]", "S0:2@[0,1]", "S0:2@[0,1]"),  # batch pieces paired
        ("S0:2@[0,1]", "D:2@[0,1]", None),  # a whole w would broadcast against x's batch piece
        ("D:2@[0,1]", "S0:2@[0,1]", None),
        ("S1:2@[0,1]", "D:2@[0,1]", "S1:2@[0,1]"),  # M is x's alone
        ("D:2@[0,1]", "S2:2@[0,1]", "S2:2@[0,1]"),  # N is w's alone
        ("H0(1:1){D:2@[0,1] | @[2]}", "HD{D:2@[0,1] | @[2]}", None),  # the same across subgroups
    ],
)
def test_batched_matmul_needs_a_batch_split_in_both_inputs(x_ann, w_ann, expected):
    if expected is None:
        with pytest.raises(DeductionError, match="batch dim 0 is split in one input but not in the other"):
            _mm((4, 3, 8), x_ann, (4, 8, 5), w_ann)
    else:
        assert _mm((4, 3, 8), x_ann, (4, 8, 5), w_ann) == expected


@pytest.mark.parametrize(
    "a, b, op, expected",
    [
        ("P:2@[0,1]", "P:2@[0,1]", "add", "P:2@[0,1]"),
        ("P:2@[0,1]", "D:2@[0,1]", "add", None),
        ("P:2@[0,1]", "D:2@[0,1]", "mul", "P:2@[0,1]"),
        ("P:2@[0,1]", "P:2@[0,1]", "mul", None),
        ("S1:2@[0,1]", "S1:2@[0,1]", "sub", "S1:2@[0,1]"),
        ("S0:2@[0,1]", "S1:2@[0,1]", "add", None),
        ("HP{@[0] | @[1]}", "HP{@[0] | @[1]}", "add", "HP{@[0] | @[1]}"),
    ],
)
def test_elementwise_partial_rules(a, b, op, expected):
    def build(g):
        x = placeholder(g, "x", (4, 6), annotation=a)
        y = placeholder(g, "y", (4, 6), annotation=b)
        return getattr(O, op)(x, y)

    if expected is None:
        with pytest.raises(DeductionError, match=op):
            _deduce(build)
    else:
        assert _deduce(build) == expected


def test_broadcast_input_may_be_duplicated_along_a_split_dim():
    def build(g):
        x = placeholder(g, "x", (B, S, 8), annotation="S0:2,S2:2@[0-3]")
        bias = parameter(g, "b", (8,), annotation="D:2,S0:2@[0-3]")
        return x + bias

    assert _deduce(build) == "S0:2,S2:2@[0-3]"


def test_nonlinear_ops_reject_partial_and_norms_reject_a_split_hidden_dim():
    def relu_of_partial(g):
        return O.relu(placeholder(g, "x", (4, 4), annotation="P:2@[0,1]"))

    with pytest.raises(DeductionError, match="relu relu.*not linear"):
        _deduce(relu_of_partial)

    def norm_of_split(g):
        x = placeholder(g, "x", (B, 8), annotation="S1:2@[0,1]")
        return O.rmsnorm(x, parameter(g, "w", (8,), annotation="S0:2@[0,1]"))

    with pytest.raises(DeductionError, match="needs dim 1 whole"):
        _deduce(norm_of_split)


@pytest.mark.parametrize(
    "ann, dims, keep, expected",
    [
        ("S0:2@[0,1]", (0,), False, "P:2@[0,1]"),
        ("S1:2@[0,1]", (0,), False, "S0:2@[0,1]"),
        ("S1:2@[0,1]", (0,), True, "S1:2@[0,1]"),
        ("H0(1:2){@[0] | D:2@[1,2]}", None, False, "HP{@[0] | D:2@[1,2]}"),
    ],
)
def test_reductions_turn_split_reduced_dims_into_partial(ann, dims, keep, expected):
    def build(g):
        return O.reduce_sum(placeholder(g, "x", (4, 6), annotation=ann), dims, keep)

    assert _deduce(build) == expected


@pytest.mark.parametrize(
    "ann, shape, expected",
    [
        ("S2:2@[0,1]", (B, S, 2, 4), "S2:2@[0,1]"),  # split hidden -> split heads
        ("S0:2@[0,1]", (B * S, 8), "S0:2@[0,1]"),  # split batch -> split merged rows
        ("S1:2@[0,1]", (B * S, 8), None),  # seq is not the leading dim of the merge
    ],
)
def test_reshape_rules(ann, shape, expected):
    def build(g):
        return O.reshape(placeholder(g, "x", (B, S, 8), annotation=ann), shape)

    if expected is None:
        with pytest.raises(DeductionError, match="not the leading dim"):
            _deduce(build)
    else:
        assert _deduce(build) == expected


def test_transpose_moves_splits_and_attention_needs_whole_sequence():
    def build(g):
        return O.transpose(placeholder(g, "x", (B, S, 4, 8), annotation="S2:2@[0,1]"), 1, 2)

    assert _deduce(build) == "S1:2@[0,1]"

    def attn(g):
        q = placeholder(g, "q", (B, 4, S, 8), annotation="S2:2@[0,1]")
        return O.causal_attention(q, q, q)

    with pytest.raises(DeductionError, match="causal_attention"):
        _deduce(attn)


def test_vocab_parallel_embedding_is_partial_and_cross_entropy_needs_whole_classes():
    def emb(g):
        ids = placeholder(g, "ids", (B, S), torch.int64, annotation="H0(2:1){D:2@[0,1] | @[2]}")
        table = parameter(g, "e", (16, 8), annotation="HD{S0:2@[0,1] | @[2]}")
        return O.embedding(ids, table)

    assert _deduce(emb) == "H0(2:1){P:2@[0,1] | @[2]}"

    def ce(g):
        logits = placeholder(g, "l", (B, S, 16), annotation="S2:2@[0,1]")
        labels = placeholder(g, "y", (B, S), torch.int64, annotation="D:2@[0,1]")
        return O.cross_entropy(logits, labels)

    with pytest.raises(DeductionError, match="class dim of the logits is split"):
        _deduce(ce)


def test_comm_changes_the_union_and_its_gradient_reverses_it():
    g = Graph()
    x = placeholder(g, "x", (4, 8), annotation="S0:2@[0,1]")
    w = parameter(g, "w", (8, 8), annotation="@[2]")
    moved = comm(x, "@[2]", name="to2")
    loss = O.reduce_sum(moved @ w)
    (gx,) = O.gradients(loss, [x])
    d = deduce(g, 0)
    assert str(d[moved]) == "@[2]"
    assert str(d[gx]) == "S0:2@[0,1]"  # the reverse reshard lands the gradient on x's layout


def test_gradient_contributions_in_different_layouts_are_aligned():
    g = Graph()
    x = placeholder(g, "x", (B, 8), annotation="D:2@[0,1]")
    w = parameter(g, "w", (8, 8), annotation="S1:2@[0,1]")
    v = parameter(g, "v", (8, 8), annotation="S0:2@[0,1]")
    y = x + comm((x @ w) @ v, "D:2@[0,1]", name="reduce")  # residual: whole + partial gradient
    (gx,) = O.gradients(O.reduce_sum(y), [x])
    d = deduce(g, 0)
    aligned = [n for n in g.nodes if n.kind == "comm" and ".align" in n.name]
    assert len(aligned) == 2
    assert {str(d[n.inputs[0]]) for n in aligned} == {"D:2@[0,1]", "P:2@[0,1]"}
    assert str(d[gx]) == "D:2@[0,1]"


def test_zero_annotation_shards_replicas():
    assert str(O.zero_annotation(parse("D:2,S1:2@[0-3]"), 2)) == "S0:2,S1:2@[0-3]"
    het = O.zero_annotation(parse("HD{S1:2@[0,1] | @[2]}"), 2)
    assert str(het) == "H0(1:1){S1:2@[0,1] | @[2]}"


@pytest.mark.parametrize("ann, ndim, expected", [
    ("HD{S0:2@[0,1] | S0:2@[2,3]}", 2, "H1(1:1){S0:2@[0,1] | S0:2@[2,3]}"),  # row-parallel: shard the columns
    ("HD{S1:2@[0,1] | S1:2@[2,3]}", 2, "H0(1:1){S1:2@[0,1] | S1:2@[2,3]}"),
    ("HD{D:2@[0,1] | D:2@[2,3]}", 1, "HD{S0:2@[0,1] | S0:2@[2,3]}"),  # a 1-D norm on TP2: sharded in TP only
    ("HD{D:2@[0,1] | D:2@[2,3]}", 2, "H1(1:1){S0:2@[0,1] | S0:2@[2,3]}"),
    ("HD{@[0] | @[1]}", 1, "H0(1:1){@[0] | @[1]}"),  # a 1-D norm on TP1: sharded across pipelines
])
def test_zero_shards_lie_inside_each_devices_bottom_tier_piece(ann, ndim, expected):
    assert str(O.zero_annotation(parse(ann), ndim)) == expected


def test_zero_gradient_sync_is_one_reduce_scatter_per_bottom_tier_position():
    subgroups = " | ".join(f"S0:4@[{4 * k}-{4 * k + 3}]" for k in range(8))
    plan = resolve(parse(f"HP{{{subgroups}}}"), O.zero_annotation(parse(f"HD{{{subgroups}}}"), 2), (64, 32))
    assert plan.primitives == ("SplitReduceScatter",)
    groups = [c.devices for s in plan.steps for c in s.collectives]
    assert sorted(groups) == [tuple(range(j, 32, 4)) for j in range(4)]


@pytest.mark.parametrize(
    "ann, heads, expected",
    [
        ("S2:2@[0,1]", 4, "S2:2@[0,1]"),  # 4 K/V heads split 2 ways: each half serves its Q heads
        ("D:2@[0,1]", 4, "D:2@[0,1]"),
        ("S0:2@[0,1]", 3, "S0:2@[0,1]"),
        ("P:2@[0,1]", 3, "P:2@[0,1]"),  # linear
        ("S2:2@[0,1]", 3, None),  # 3 K/V heads do not split 2 ways into whole groups
    ],
)
def test_repeat_interleave_keeps_layouts_of_whole_groups(ann, heads, expected):
    def build(g):
        return O.repeat_interleave(placeholder(g, "k", (B, S, heads, 8), annotation=ann), 2, 2)

    if expected is None:
        with pytest.raises(DeductionError, match="repeat_interleave"):
            _deduce(build)
    else:
        assert _deduce(build) == expected
