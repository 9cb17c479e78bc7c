"""Worked examples (paper figures 2, 3, 10), error messages, and symbolic shapes."""

import pytest
import sympy
import torch

from hspmd.annotations import (
    Annotation,
    DeviceGroup,
    DistributedStates,
    Hierarchy,
    Split,
    Subgroup,
    align_hsize,
    device_pieces,
    expand_hsize,
    infer_shape,
    parse,
    parse_hierarchy,
    shard,
    split_bounds,
    subgroup_pieces,
    unshard,
)
from hspmd.errors import AnnotationError, AnnotationTypeError, ParseError, ShapeError


def boxes(ann, shape, ratios=None):
    return {d: p.box for d, p in device_pieces(parse(ann), shape, ratios).items()}


def test_split_rule_is_balanced_floor_and_allows_empty_pieces():
    assert split_bounds(7, [1, 1]) == [(0, 3), (3, 7)]
    assert split_bounds(2, [1, 1, 1, 1]) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    assert split_bounds(9, [2, 1]) == [(0, 6), (6, 9)]


def test_figure2_left_dp_times_tp_on_four_devices():
    """DS {D:2, S1:2} on DG [0,1,2,3]: devices 0,1 and 2,3 hold the two column halves."""
    ann = parse("D:2,S1:2@[0-3]")
    assert boxes(ann, (4, 6)) == {
        0: ((0, 4), (0, 3)),
        1: ((0, 4), (3, 6)),
        2: ((0, 4), (0, 3)),
        3: ((0, 4), (3, 6)),
    }


def test_figure2_right_hetero_tp_with_batch_split_two_to_one():
    """TP2 on [0,1] and TP1 on [2], the batch split 2:1 toward the faster group."""
    act = parse("H0(2:1){D:2@[0,1] | @[2]}")
    assert act.hsize == 2 and act.hdim == 0 and act.ratios == (2, 1)
    assert boxes(act, (6, 4)) == {0: ((0, 4), (0, 4)), 1: ((0, 4), (0, 4)), 2: ((4, 6), (0, 4))}
    weight = parse("HD{S1:2@[0,1] | @[2]}")
    assert boxes(weight, (4, 8)) == {0: ((0, 4), (0, 4)), 1: ((0, 4), (4, 8)), 2: ((0, 4), (0, 8))}


def test_figure3_union_of_tp4_and_tp2_replicas_and_partial_gradients():
    weight = parse("HD{S1:4@[0-3] | S1:2@[4,5]}")
    assert [len(g) for g in weight.dg_union] == [4, 2]
    assert boxes(weight, (2, 8))[3] == ((0, 2), (6, 8))
    assert boxes(weight, (2, 8))[5] == ((0, 2), (4, 8))
    grad = parse("HP{S1:4@[0-3] | S1:2@[4,5]}")
    pieces = device_pieces(grad, (2, 8))
    assert pieces[0].summand == (0, 0) and pieces[4].summand == (1, 0)
    x = torch.randn(2, 8, dtype=torch.float64)
    locals_ = shard(x, grad, seed=3)
    assert not torch.allclose(locals_[0], x[:, 0:2])
    torch.testing.assert_close(locals_[0] + locals_[4][:, 0:2], x[:, 0:2])
    torch.testing.assert_close(unshard(locals_, grad), x)


def test_figure10_align_to_the_largest_hsize():
    spmd = parse("S0:2,S1:2@[0-3]")
    union = parse("H0{S1:2@[0,1] | S1:2@[2,3]}").with_ratios((1, 1))
    aligned = align_hsize([spmd, union])
    assert aligned == [union, union]
    assert expand_hsize(parse("D:2,P:2@[0-3]"), 2) == parse("HD{P:2@[0,1] | P:2@[2,3]}")
    with pytest.raises(AnnotationError, match="insert comm"):
        expand_hsize(parse("S1:4@[0-3]"), 2)


def test_hsize_one_needs_no_ceremony():
    assert parse("H0(3){S0:2@[0,1]}") == parse("S0:2@[0,1]")
    assert parse("HP{@[1]}") == parse("@[1]")
    assert parse("S0:1,D:2@[0,1]") == parse("D:2@[0,1]")
    assert Annotation((Subgroup(DeviceGroup((0, 1)), DistributedStates((Split(0, 2),))),)) == parse("S0:2@[0,1]")


def test_hierarchy_holds_one_annotation_per_strategy():
    h = parse_hierarchy("S0:2@[0,1] ; H0(1:1){@[0] | @[1]}")
    assert len(h) == 2 and h[1].hsize == 2
    assert parse_hierarchy(str(h)) == h
    assert len(h.with_strategy(parse("@[0]"))) == 3
    with pytest.raises(AnnotationError, match="strategy 5 does not exist"):
        h[5]
    assert isinstance(h, Hierarchy)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("S0:2@[0-2]", "product of the axis counts must equal the group size"),
        ("HD{D:2@[0,1] | @[1]}", "must be disjoint"),
        ("D:2@[3,3]", "more than once"),
        ("H0(2:1:1){@[0] | @[1]}", "one ratio per subgroup"),
        ("HD(2:1){@[0] | @[1]}", "need a tensor-dim HDim"),
        ("S0:0@[0]", "must be positive"),
        ("S0:2@[3-2]", "runs backwards"),
        ("Q:2@[0,1]", "expected an axis"),
        ("S0:2@[0,1", "expected ']'"),
        ("", "empty annotation"),
    ],
)
def test_invalid_annotations_name_the_problem(text, fragment):
    with pytest.raises(ParseError) as info:
        parse(text)
    assert fragment in str(info.value)
    assert "^" in str(info.value)


def test_parse_error_points_at_the_offending_character():
    with pytest.raises(ParseError) as info:
        parse("HD{S1:4@[0-3] | S1:2@[4,5] x}")
    assert info.value.position == 27


def test_split_dim_outside_rank_and_unbound_ratios():
    with pytest.raises(AnnotationError, match="outside a rank-1 tensor"):
        device_pieces(parse("S1:2@[0,1]"), (4,))
    with pytest.raises(ShapeError, match="bound at run time"):
        device_pieces(parse("H0{@[0] | @[1]}"), (4,))
    assert boxes("H0{@[0] | @[1]}", (4,), ratios=(3, 1)) == {0: ((0, 3),), 1: ((3, 4),)}


def test_symbolic_shapes_follow_the_same_rule():
    b = sympy.Symbol("B", positive=True, integer=True)
    pieces = device_pieces(parse("H0(2:1){S0:2@[0,1] | @[2]}"), (b, 4))
    first_cut = sympy.floor(2 * b / 3)
    assert sympy.simplify(pieces[2].box[0][0] - first_cut) == 0
    assert pieces[2].box[0][1] == b
    concrete = {d: tuple(int(sympy.sympify(v).subs(b, 10)) for v in p.box[0]) for d, p in pieces.items()}
    assert concrete == {d: p.box[0] for d, p in device_pieces(parse("H0(2:1){S0:2@[0,1] | @[2]}"), (10, 4)).items()}


def test_unshard_reads_run_time_ratios_off_the_locals():
    x = torch.arange(20.0).reshape(10, 2)
    ann = parse("H0{S0:2@[0,1] | @[2]}")
    locals_ = shard(x, ann, ratios=(7, 3))
    assert locals_[2].shape == (3, 2)
    torch.testing.assert_close(unshard(locals_, ann), x)


def test_partial_needs_floating_point():
    with pytest.raises(ShapeError, match="floating-point"):
        shard(torch.arange(4), parse("P:2@[0,1]"))


def test_geometry_and_algebra_refuse_bad_arguments_with_named_errors():
    """Inputs that used to end in ZeroDivisionError, TypeError, IndexError or AttributeError."""
    with pytest.raises(ShapeError, match="split weights must sum to a positive number"):
        split_bounds(4, [0, 0])
    with pytest.raises(AnnotationError, match="hsize must be at least 1"):
        expand_hsize(parse("D:4@[0-3]"), 0)
    with pytest.raises(AnnotationTypeError, match="hsize must be an int"):
        expand_hsize(parse("D:4@[0-3]"), "2")
    with pytest.raises(AnnotationError, match="at least one annotation"):
        align_hsize([])
    with pytest.raises(ShapeError, match="splits dim 3, outside a rank-1 region"):
        subgroup_pieces(Subgroup((0, 1), DistributedStates((Split(3, 2),))), ((0, 4),))
    with pytest.raises(ShapeError, match="is negative"):
        device_pieces(parse("S0:2@[0,1]"), (sympy.Integer(-3),))
    assert device_pieces(parse("S0:2@[0,1]"), (sympy.Symbol("n"),))  # a symbol of unknown sign is fine


def test_infer_shape_takes_annotation_text_like_shard_and_unshard():
    locals_ = {0: torch.zeros(3, 2), 1: torch.zeros(1, 2)}
    assert infer_shape(locals_, "H0{@[0] | @[1]}") == infer_shape(locals_, parse("H0{@[0] | @[1]}")) == ((4, 2), (3, 1))


def test_a_union_shared_by_threads_copies_what_it_knows_while_they_memoise():
    """Annotations are immutable and shared (the in-process backend's device threads resolve plans
    on the same unions), but each memoises answers in place: with_subgroups and pickling read
    that memo while another thread may add to it, so they read a copy (a dict changing size
    mid-iteration raised from deep inside a resolve). A race: without the copy this fails in most
    runs (4 of 5 here), not every one."""
    import pickle
    import sys
    import threading

    union = parse("HP{S0:2@[0,1] | S0:2@[2,3]}")
    sub = union.subgroups[1]
    failures: list[BaseException] = []
    done = threading.Event()

    memoised = [0]

    def memoise():
        while not done.is_set() and memoised[0] < 4000:
            n = memoised[0]
            union._memo(("derived", ("regions", n)), lambda: n)  # a new region key, as a resolve derives them
            memoised[0] += 1

    def copy():
        try:
            for _ in range(400):
                union.with_subgroup(1, Subgroup(sub.dg, sub.ds))
                pickle.dumps(union)
        except BaseException as e:  # noqa: BLE001 - any failure in the thread is the test's
            failures.append(e)
        finally:
            done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=memoise), threading.Thread(target=copy)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
        done.set()
    assert not failures, failures
    assert memoised[0] > 100  # the other thread did memoise meanwhile
