"""Tables 10-12 (mixed-length training) as strategies and pools: they parse, specialize for 32
ranks with micro-batch counts bound, and the selection rule maps lengths to the paper's intervals."""

import pytest

from hspmd.errors import StrategyError
from hspmd.ir import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.planning.dispatch import select_entry
from hspmd.planning.paper_pools import paper_pool
from hspmd.specialize.paper_strategies import PAPER_STRATEGIES, bind_micro_batches, paper_strategy
from hspmd.specialize.specialized import specialize_graph

K = 1024


def _shape(key):
    s = paper_strategy(key)
    return [(p.micro_batch_size, [len(st.ranks) for st in p.stages], [len(st.layers) for st in p.stages])
            for p in s.pipelines]


def test_table10_and_table12_strategy2_structure():
    assert _shape("table10_32k_long") == [(1, [16], [60])] * 2  # DP2TP16
    assert _shape("table10_32k_mid") == [(1, [8, 8], [30, 30])] * 2  # DP2TP8PP2
    assert _shape("table10_32k_short") == [(1, [4, 4], [30, 30])] * 4  # DP4TP4PP2
    assert _shape("table12_s2") == [(None, [4, 4], [30, 30])] * 4  # DP4TP4PP2, dispatched
    assert paper_strategy("table12_s2").pipelines[3].stages[1].ranks == (28, 29, 30, 31)
    assert paper_strategy("table12_s1").pipelines == paper_strategy("table11_s2").pipelines
    for band in ("mid", "short"):
        assert paper_strategy(f"table10_16k_{band}").pipelines == paper_strategy(f"table10_32k_{band}").pipelines
    for key, entry in PAPER_STRATEGIES.items():
        if entry.table in (10, 11, 12):
            assert entry.strategy.all_ranks == tuple(range(32)), key


@pytest.mark.parametrize("key", ["table11_s1", "table11_s2", "table12_s2", "table10_32k_long", "table10_32k_mid"])
def test_paper_strategies_specialize_for_32_ranks_with_counts_bound(key):
    strategy = paper_strategy(key)
    n = strategy.num_pipelines
    bound = bind_micro_batches(strategy, [3] * n, [1] * n)
    assert bound.global_batch_size == 3 * n
    config = LlamaConfig(layers=60, hidden=32, heads=16, ffn=32, vocab=32)
    model = build_llama(config, [bound], packed=True)
    spec = specialize_graph(model.graph, 0, Binding.of({"B": n, "S": 16, "T": 48 * n}, ratios=[1] * n),
                            devices=[0, 31])
    assert [len(p.stages) for p in spec.pipelines] == [len(p.stages) for p in strategy.pipelines]
    assert sorted(d for p in spec.pipelines for st in p.stages for d in st) == list(range(32))


def test_bind_micro_batches_checks_the_pipeline_count():
    with pytest.raises(StrategyError, match="5 pipelines"):
        bind_micro_batches(paper_strategy("table11_s1"), [1, 2])


def test_selection_rule_maps_lengths_to_the_paper_intervals():
    def chosen(pool, kilo):
        entries = paper_pool(pool)
        return entries[select_entry(entries, kilo * K)].name

    assert [chosen("table11", k) for k in (3, 5, 15, 17, 31)] == ["table11_s2"] * 3 + ["table11_s1"] * 2
    assert [chosen("table12", k) for k in (3, 5, 15)] == ["table12_s2", "table12_s1", "table12_s1"]
    assert [chosen("table10_32k", k) for k in (3, 5, 15, 17, 31)] == \
        ["table10_32k_short", "table10_32k_mid", "table10_32k_mid", "table10_32k_long", "table10_32k_long"]
    assert [chosen("table10_16k", k) for k in (3, 5, 15)] == ["table10_16k_short", "table10_16k_mid", "table10_16k_mid"]
    assert chosen("table11", 16) == "table11_s2" and chosen("table12", 4) == "table12_s2"  # intervals are (lo, hi]
    with pytest.raises(Exception, match="no strategy in the pool takes a sequence of 17408"):
        chosen("table12", 17)
    with pytest.raises(StrategyError, match="no paper pool"):
        paper_pool("table13")
