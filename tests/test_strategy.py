"""Strategy values: validation (each error names its field), structure queries, annotations, generators."""

import pytest

from hspmd.annotations import Annotation, device_pieces, parse
from hspmd.errors import HSPMDError, StrategyError
from hspmd.models.llama_annotations import (
    activation_annotation, embedding_annotation, gradient_annotation, lm_head_annotation, param_annotation,
    partial_over_pipelines,
)
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_fields import StrategyFieldError
from hspmd.specialize.strategy_build import balanced_layers, uniform_strategy, weighted_pipeline
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.specialize.strategy_render import describe_strategy

C2 = parse_strategy(
    "name=c2 ; 33x1: R0-3 L0-14 | R4-7 L15-29 | R8-11 L30-44 | R12-15 L45-59 ; "
    "31x1: R16-19 L0-15 | R20-23 L16-31 | R24-27 L32-47 | R28-29 L48-55 | R30 L56-59"
)


def two_stage(**changes):
    fields = dict(pipelines=(Pipeline((Stage((0, 1), (0, 3)), Stage((2,), (4, 5))), 4, 2),), num_layers=6)
    fields.update(changes)
    return Strategy(**fields)


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "make, path, words",
    [
        (lambda: Stage((), (0, 1)), ("ranks",), "at least one rank"),
        (lambda: Stage((0, 0, 1), (0, 1)), ("ranks",), "more than once"),
        (lambda: Stage((0, -1), (0, 1)), ("ranks",), "non-negative"),
        (lambda: Stage("0-3", (0, 1)), ("ranks",), "sequence"),
        (lambda: Stage((0, True), (0, 1)), ("ranks",), "integers"),
        (lambda: Stage((0,), (3, 1)), ("layers",), "first <= last"),
        (lambda: Stage((0,), range(0, 6, 2)), ("layers",), "step 1"),
        (lambda: Stage((0,), range(3, 3)), ("layers",), "non-empty"),
        (lambda: Stage((0,), "0-3"), ("layers",), "range or a (first, last)"),
        (lambda: Stage((0, 1, 2, 3), (0, 1), tp=2), ("tp",), "must equal its rank count"),
        (lambda: Stage((0, 1), (0, 1), tp=0), ("tp",), "positive"),
        (lambda: Pipeline((), 1, 1), ("stages",), "non-empty"),
        (lambda: Pipeline((Stage((0,), (1, 5)),), 1, 1), ("stages", 0, "layers"), "must start at layer 0"),
        (lambda: Pipeline((Stage((0,), (0, 2)), Stage((1,), (4, 5))), 1, 1), ("stages", 1, "layers"), "must start at 3"),
        (lambda: Pipeline((Stage((0,), (0, 2)), Stage((1, 0), (3, 5))), 1, 1), ("stages", 1, "ranks"), "rank 0"),
        (lambda: Pipeline((Stage((0,), (0, 2)),), 0, 1), ("micro_batches",), "positive"),
        (lambda: Pipeline((Stage((0,), (0, 2)),), 2, "1"), ("micro_batch_size",), "integer"),
        (lambda: Pipeline(((0,),), 2, 1), ("stages", 0), "must be a Stage"),
        (lambda: two_stage(num_layers=7), ("pipelines", 0, "stages", 1, "layers"), "7 layers"),
        (lambda: two_stage(num_layers=0), ("num_layers",), "positive"),
        (lambda: two_stage(zero="yes"), ("zero",), "true or false"),
        (lambda: two_stage(name="a;b"), ("name",), "';'"),
        (lambda: two_stage(pipelines=()), ("pipelines",), "non-empty"),
        (
            lambda: Strategy(
                (Pipeline((Stage((0, 1), (0, 5)),), 1, 1), Pipeline((Stage((1, 2), (0, 5)),), 1, 1)), 6
            ),
            ("pipelines", 1, "stages", 0, "ranks"),
            "pipelines[0].stages[0]",
        ),
    ],
)
def test_invalid_values_name_the_field(make, path, words):
    with pytest.raises(StrategyFieldError) as info:
        make()
    assert info.value.path == path
    assert words in str(info.value)
    assert isinstance(info.value, StrategyError) and isinstance(info.value, HSPMDError)


def test_values_are_normalised_hashable_and_equal_by_meaning():
    a = Stage([3, 1, 2], (0, 4))
    b = Stage((3, 1, 2), range(0, 5), tp=3)
    assert a == b and hash(a) == hash(b) and a.tp == 3 and a.ranks == (3, 1, 2)
    written_apart = parse_strategy("layers=6 ; 4x2: R0,1 L0-3 | R2 L4-5")  # two_stage() in the text syntax
    assert two_stage() == written_apart and hash(two_stage()) == hash(written_apart)
    assert two_stage() != parse_strategy("layers=6 ; 4x2: R1,0 L0-3 | R2 L4-5"), "TP order is part of the value"
    assert Strategy(two_stage().pipelines, 6, name="  x ").name == "x"
    assert len({C2, C2, parse_strategy("1x1: R0 L0-59")}) == 2


# ---- structure --------------------------------------------------------------------------------

def test_structure_queries():
    assert C2.all_ranks == tuple(range(31)) and C2.num_pipelines == 2
    assert C2.global_batch_size == 64 and C2.micro_batch_ratios == (1, 1)
    assert [C2.stage_of(50, p) for p in (0, 1)] == [3, 3]
    assert [C2.stage_of(59, p) for p in (0, 1)] == [3, 4]
    assert C2.stage_holding(56, 1) == Stage((30,), (56, 59))
    assert C2.locate(29) == (1, 3) and C2.locate(0) == (0, 0)
    for layer in range(C2.num_layers):
        for p in range(2):
            assert layer in C2.stage_holding(layer, p).layers
    with pytest.raises(StrategyError, match="rank 31 is not used"):
        C2.locate(31)
    with pytest.raises(StrategyError, match="layers 0-59"):
        C2.stage_of(60, 0)
    with pytest.raises(StrategyError, match="pipelines 0-1"):
        C2.stage_of(3, 2)


def test_describe_lists_every_stage():
    text = describe_strategy(C2)
    assert "c2: 60 layers, 31 devices, 2 pipeline(s), ZeRO off" in text
    for p in C2.pipelines:
        for s in p.stages:
            assert f"{s.layers.start}-{s.layers.stop - 1}" in text
    assert "33 x bs 1" in text and "31 x bs 1" in text and "28,29" in text
    runtime = describe_strategy(parse_strategy("?x?: R0 L0-3 ; 2x?: R1 L0-3"))
    assert "run time x bs run time" in runtime and "2 x bs run time" in runtime


# ---- annotations ------------------------------------------------------------------------------

def test_param_annotations_of_c2():
    assert str(param_annotation(C2, 50, "column")) == "HD{S1:4@[12-15] | S1:2@[28,29]}"
    assert str(param_annotation(C2, 50, "row")) == "HD{S0:4@[12-15] | S0:2@[28,29]}"
    assert str(param_annotation(C2, 57, "replicated")) == "HD{D:4@[12-15] | @[30]}"
    assert str(param_annotation(C2, 15, "column")) == "HD{S1:4@[4-7] | S1:4@[16-19]}"
    assert str(gradient_annotation(C2, 50, "column")) == "HP{S1:4@[12-15] | S1:2@[28,29]}"
    assert param_annotation(C2, 50, "column") == parse("HD{S1:4@[12-15] | S1:2@[28,29]}")


def test_param_annotation_shards_a_weight_as_the_convention_says():
    """(in, out) weight: column parallel gives each TP rank a slice of out_features (dim 1)."""
    pieces = device_pieces(param_annotation(C2, 50, "column"), (8, 12))
    assert pieces[12].box == ((0, 8), (0, 3)) and pieces[15].box == ((0, 8), (9, 12))
    assert pieces[28].box == ((0, 8), (0, 6)) and pieces[29].box == ((0, 8), (6, 12))
    rows = device_pieces(param_annotation(C2, 50, "row"), (8, 12))
    assert rows[29].box == ((4, 8), (0, 12))


def test_embedding_lm_head_and_activation_annotations():
    assert str(embedding_annotation(C2, "vocab")) == "HD{S0:4@[0-3] | S0:4@[16-19]}"
    assert str(embedding_annotation(C2, "replicated")) == "HD{D:4@[0-3] | D:4@[16-19]}"
    assert str(lm_head_annotation(C2, "vocab")) == "HD{S1:4@[12-15] | @[30]}"
    act = activation_annotation(C2, 50)
    assert str(act) == "H0(1:1){D:4@[12-15] | D:2@[28,29]}"
    assert activation_annotation(C2, 20, pipeline_dim=1).hdim == 1
    uneven = parse_strategy("4x3: R0,1 L0-3 ; 4x1: R2 L0-1 | R3 L2-3")
    assert str(activation_annotation(uneven, 3)) == "H0(3:1){D:2@[0,1] | @[3]}"
    pieces = device_pieces(activation_annotation(uneven, 3), (8, 5))
    assert pieces[0].box == ((0, 6), (0, 5)) and pieces[3].box == ((6, 8), (0, 5))
    runtime = parse_strategy("?x?: R0-1 L0-3 ; ?x?: R2 L0-3")
    assert activation_annotation(runtime, 0).ratios is None and activation_annotation(runtime, 0).hdim == 0


def test_single_pipeline_annotations_are_plain_spmd():
    s = uniform_strategy(8, dp=1, tp=2, pp=2, micro_batches=4)
    assert str(param_annotation(s, 5, "column")) == "S1:2@[2,3]"
    assert str(gradient_annotation(s, 5, "column")) == "S1:2@[2,3]"
    assert str(activation_annotation(s, 0)) == "D:2@[0,1]"


@pytest.mark.parametrize("call, hint", [
    (lambda: param_annotation(C2, 3, "colum"), "'column'"),
    (lambda: param_annotation(C2, 3, "rows"), "'row'"),
    (lambda: embedding_annotation(C2, "vocabulary"), "'vocab'"),
    (lambda: lm_head_annotation(C2, "zzz"), "valid: 'vocab', 'replicated'"),
    (lambda: activation_annotation(C2, 3, pipeline_dim=-1), "tensor dim"),
    (lambda: param_annotation(C2, "3", "row"), "layer '3'"),
])
def test_annotation_argument_errors(call, hint):
    with pytest.raises(StrategyError) as info:
        call()
    assert hint in str(info.value)


def test_partial_over_pipelines_keeps_subgroups():
    ann = param_annotation(C2, 10, "row")
    grad = partial_over_pipelines(ann)
    assert grad.subgroups == ann.subgroups and grad.hdim == "P" and isinstance(grad, Annotation)


# ---- generators -------------------------------------------------------------------------------

def test_uniform_strategy_grid():
    s = uniform_strategy(60, dp=2, tp=4, pp=4, micro_batches=16, micro_batch_size=2, zero=True, name="g")
    assert [[st.ranks for st in p.stages] for p in s.pipelines][1][2] == (24, 25, 26, 27)
    assert [st.layers for st in s.pipelines[0].stages] == [range(0, 15), range(15, 30), range(30, 45), range(45, 60)]
    assert s.zero and s.global_batch_size == 64 and s.name == "g"
    shifted = uniform_strategy(6, dp=1, tp=1, pp=3, micro_batches=2, first_rank=10)
    assert shifted.all_ranks == (10, 11, 12)
    with pytest.raises(StrategyError, match="pp must be a positive integer"):
        uniform_strategy(6, dp=1, tp=1, pp=0, micro_batches=2)


def test_balanced_layers_follow_weights():
    assert balanced_layers(60, [4, 4, 4, 2, 1]) == (range(0, 16), range(16, 32), range(32, 48), range(48, 56), range(56, 60))
    assert [len(r) for r in balanced_layers(10, [1, 1, 1])] == [3, 3, 4]
    with pytest.raises(StrategyError, match="without a layer"):
        balanced_layers(2, [1, 1, 1])
    with pytest.raises(StrategyError, match="positive integers"):
        balanced_layers(10, [1, 0])


def test_weighted_pipeline_defaults_to_tp_degree_weights():
    p = weighted_pipeline(60, ["16-19", "20-23", "24-27", "28-29", [30]], 31, 1)
    assert p == C2.pipelines[1]
    with pytest.raises(StrategyFieldError) as info:
        weighted_pipeline(6, ["0-1", "2-x"], 1, 1)
    assert info.value.path == ("stages", 1, "ranks")
    with pytest.raises(StrategyFieldError, match="2 weights given for 3 stages"):
        weighted_pipeline(6, ["0", "1", "2"], 1, 1, weights=[1, 2])
