"""Route choice never joins what a strategy keeps apart: on random heterogeneous strategies (TP 1/2/4
per stage, uneven stage cuts, gappy shuffled ranks, tied and untied embeddings), pipeline discovery
on the specialized Llama, whose CommOps the resolver priced, finds exactly the strategy's pipelines.
A tied head crosses from each pipeline's first stage to its own last stage; a cheaper-priced route
that fed one pipeline's last stage from another pipeline's first stage made them one pipeline."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.ir import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.specialize.pipelines import expected_pipelines
from hspmd.specialize.specialized import specialize_graph
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_text import parse_strategy


@st.composite
def heterogeneous(draw):
    """2-3 pipelines of 1-3 stages (the first of 2 or more), TP 1, 2 or 4 per stage (the tiny Llama's
    4 heads), 2-4 layers, 1-3 micro-batches of 1-2 rows per pipeline."""
    layers = draw(st.integers(2, 4))
    plans = []
    for i in range(draw(st.integers(2, 3))):
        n = draw(st.integers(2 if i == 0 else 1, min(3, layers)))  # the first pipeline has 2 or more stages
        cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=n - 1, max_size=n - 1, unique=True)))
        plans.append((draw(st.lists(st.sampled_from((1, 2, 4)), min_size=n, max_size=n)), [0] + cuts + [layers]))
    total = sum(sum(tps) for tps, _ in plans)
    ranks = iter(draw(st.permutations(range(total + draw(st.integers(0, 2)))))[:total])
    pipelines = tuple(
        Pipeline(tuple(Stage(tuple(next(ranks) for _ in range(tp)), range(a, b)) for tp, a, b in zip(tps, cuts, cuts[1:])),
                 draw(st.integers(1, 3)), draw(st.integers(1, 2)))
        for tps, cuts in plans)
    return Strategy(pipelines, layers)


def discovered(strategy: Strategy, tied: bool):
    config = LlamaConfig(layers=strategy.num_layers, hidden=32, heads=4, ffn=64, vocab=64, tie_embeddings=tied)
    model = build_llama(config, [strategy])
    ratios = strategy.micro_batch_ratios
    binding = Binding.of({"B": sum(ratios), "S": 8, "T": 64}, ratios=ratios)
    return specialize_graph(model.graph, 0, binding, devices=[strategy.all_ranks[0]]).pipelines


def stages(pipelines):
    """Each pipeline's stages in order (a tied head adds a link from the first stage to the last)."""
    return [p.stages for p in pipelines]


def test_the_strategy_that_joined_two_pipelines_through_its_tied_head():
    strategy = parse_strategy("layers=2 ; 1x1: R0,1 L0 | R2-5 L1 ; 1x1: R6 L0 | R7-10 L1")
    assert stages(discovered(strategy, tied=True)) == stages(expected_pipelines(strategy))


def test_discovered_pipelines_are_the_strategys_on_random_heterogeneous_strategies():
    accepted = []

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(heterogeneous())
    def check(strategy):
        for tied in (False, True):  # every strategy both ways, so neither kind can come out too rare
            assert stages(discovered(strategy, tied)) == stages(expected_pipelines(strategy)), f"{strategy} tied={tied}"
            accepted.append((tied, max(len(p.stages) for p in strategy.pipelines),
                             len({s.tp for p in strategy.pipelines for s in p.stages})))

    check()
    # not vacuous: tied and untied, multi-stage pipelines, and TP degrees that differ inside one strategy
    assert sum(t for t, _, _ in accepted) >= 20 and sum(not t for t, _, _ in accepted) >= 20
    assert sum(stages > 1 and tps > 1 for _, stages, tps in accepted) >= 15
