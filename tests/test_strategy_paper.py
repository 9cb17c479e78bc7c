"""The paper's appendix strategies: structure, cluster consistency, generators reproduce the regular ones."""

import pytest

from hspmd.errors import StrategyError
from hspmd.specialize.paper_strategies import PAPER_STRATEGIES, paper_strategy
from hspmd.specialize.strategy_build import uniform_strategy, weighted_pipeline
from hspmd.models.llama_annotations import param_annotation


def shape(key):
    """Per pipeline: (micro-batches, micro-batch size, stage sizes)."""
    s = PAPER_STRATEGIES[key].strategy
    return [(p.micro_batches, p.micro_batch_size, [len(st.ranks) for st in p.stages]) for p in s.pipelines]


@pytest.mark.parametrize(
    "key, expected",
    [
        ("table7_c1", [(16, 2, [4, 4, 4, 4])] * 2),
        ("table7_c2", [(33, 1, [4, 4, 4, 4]), (31, 1, [4, 4, 4, 2, 1])]),
        ("table7_c3", [(32, 1, [4, 4, 4])] * 2),
        ("table8_c4", [(32, 1, [4] * 6)] * 2),
        ("table8_c5", [(32, 1, [4] * 5)] * 2),
        ("table8_c6", [(33, 1, [4] * 5), (31, 1, [4, 4, 4, 4, 2, 1])]),
        ("table8_c7", [(32, 1, [4] * 4)] * 2),
        ("table5_32b_16h800_16h20", [(32, 1, [4] * 4)] * 2),
        ("table5_32b_16h800_24h20", [(32, 1, [4] * 5)] * 2),
        ("table5_32b_16h800_32h20", [(16, 1, [4] * 3)] * 4),
        ("table5_70b_16h800_16h20", [(64, 1, [8] * 4)]),
        ("table5_70b_16h800_24h20", [(64, 1, [8] * 5)]),
        ("table5_70b_16h800_32h20", [(32, 1, [8] * 3)] * 2),
        ("table11_s1", [(None, None, [16])] + [(None, None, [4])] * 4),
        ("table11_s2", [(None, None, [8])] + [(None, None, [4, 4])] * 3),
    ],
)
def test_structure(key, expected):
    assert shape(key) == expected


@pytest.mark.parametrize("key", list(PAPER_STRATEGIES))
def test_device_counts_match_the_cluster_heading(key):
    entry = PAPER_STRATEGIES[key]
    assert entry.gpu_counts() == entry.cluster_counts()
    assert entry.strategy.num_layers == {"32B": 60, "70B": 80}[entry.model]
    assert entry.strategy.name == key
    sizes = [p.samples_per_step for p in entry.strategy.pipelines]
    assert entry.strategy.global_batch_size == (None if entry.table in (10, 11, 12) else 64), sizes
    assert entry.strategy.zero == (entry.table == 5)


def test_c2_layer_split_and_weights():
    c2 = paper_strategy("table7_c2")
    assert [(st.first_layer, st.last_layer) for st in c2.pipelines[1].stages] == [(0, 15), (16, 31), (32, 47), (48, 55), (56, 59)]
    assert c2.pipelines[1].stages[4].ranks == (30,)
    assert weighted_pipeline(60, ["16-19", "20-23", "24-27", "28-29", "30"], 31, 1) == c2.pipelines[1]
    assert str(param_annotation(c2, 50, "column")) == "HD{S1:4@[12-15] | S1:2@[28,29]}"


def test_c6_failed_gpu_is_unused():
    c6 = PAPER_STRATEGIES["table8_c6"]
    assert 15 not in c6.strategy.all_ranks and c6.gpu_kind(14) == "H800" and c6.gpu_kind(16) == "H20"
    assert [(st.first_layer, st.last_layer) for st in c6.strategy.pipelines[1].stages][-3:] == [(18, 39), (40, 52), (53, 59)]


def test_regular_strategies_equal_the_uniform_generator():
    c1 = uniform_strategy(60, dp=2, tp=4, pp=4, micro_batches=16, micro_batch_size=2, name="table7_c1")
    c3 = uniform_strategy(60, dp=2, tp=4, pp=3, micro_batches=32, micro_batch_size=1, name="table7_c3")
    assert paper_strategy("table7_c1") == c1 and paper_strategy("table7_c3") == c3


def test_repeated_and_shared_entries():
    t11, t12 = paper_strategy("table11_s2"), paper_strategy("table12_s1")
    assert t11.pipelines == t12.pipelines and t11.name != t12.name
    t5, c5 = paper_strategy("table5_32b_16h800_24h20"), paper_strategy("table8_c5")
    assert t5.pipelines == c5.pipelines and t5.zero and not c5.zero


def test_h800_stages_hold_more_layers():
    for key, entry in PAPER_STRATEGIES.items():
        if entry.table not in (5, 8):
            continue
        stages = [st for p in entry.strategy.pipelines for st in p.stages]
        load = {kind: [len(st.layers) / st.tp for st in stages if entry.gpu_kind(st.ranks[0]) == kind] for kind in ("H800", "H20")}
        assert min(load["H800"]) > max(load["H20"]), key


def test_unknown_key_suggests():
    with pytest.raises(StrategyError, match="did you mean 'table7_c2'"):
        paper_strategy("table7_C2")
