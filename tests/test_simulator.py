"""Simulator levels 0 and 1: the exact identities and paper formulas they must reproduce."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from hspmd.cluster import parse_cluster
from hspmd.errors import HSPMDError
from hspmd.planning import MODELS, CostModel
from hspmd.planning.simulator import SimLink, SimPipeline, SimStage, closed_form, simulate_pipelines
from hspmd.planning.strategy_sim import estimate_strategy, plan_run, simulate_strategy
from hspmd.specialize.paper_strategies import paper_strategy
from hspmd.specialize.strategy_text import parse_strategy


def chain(times, m, links=(), schedule="1f1b"):
    stages = tuple(SimStage((i,), f, b) for i, (f, b) in enumerate(times))
    return SimPipeline(stages, tuple(SimLink(c, c) for c in links), m, schedule)


@settings(max_examples=60)
@given(st.integers(1, 6), st.integers(1, 24), st.floats(0.1, 5.0), st.floats(0.1, 5.0))
def test_uniform_1f1b_is_m_plus_s_minus_1_times_f_plus_b(s, m, f, b):
    result = simulate_pipelines([chain([(f, b)] * s, m)])
    assert result.iteration == pytest.approx((m + s - 1) * (f + b), rel=1e-12)
    assert closed_form([f + b] * s, m) == pytest.approx(result.iteration, rel=1e-12)


@pytest.mark.parametrize("c", [0.0, 0.5, 1.5, 2.9, 3.0])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_hapt_eq8_period(c, k):
    f, b, m = 1.0, 2.0, 200
    result = simulate_pipelines([chain([(f, b), (f, b)], m, [c], f"1f1b:{k},1")])
    period = max(f + b, 2 * (f + b + c) / k)
    assert result.iteration / m == pytest.approx(period, rel=0.02)


@pytest.mark.parametrize("c", [0.0, 0.5, 1.5, 2.9, 3.0])
def test_eq10_k_is_the_smallest_bubble_free_warmup(c):
    f, b, m = 1.0, 2.0, 200
    warm = simulate_pipelines([chain([(f, b), (f, b)], m, [c], "h1f1b")]).warmup[0][0]
    assert warm == 1 + (1 if c == 0 else 2 if c <= 1.5 else 3)  # K = N_1 = 1 + delta
    bubble_free = lambda k: simulate_pipelines([chain([(f, b)] * 2, m, [c], f"1f1b:{k},1")]).iteration / m < (f + b) * 1.02  # noqa: E731
    assert bubble_free(warm) and not bubble_free(warm - 1)


def test_hapt_three_stage_policies():
    f, b, m = 1.0, 2.0, 60
    times, links = [(f, b)] * 3, [2.5, 0.0]   # c1 in (t/2, t], c2 ~ 0
    runs = {p: simulate_pipelines([chain(times, m, links, p)]) for p in ("1f1b", "eager", "h1f1b", "virtual")}
    assert runs["h1f1b"].warmup[0] == (5, 2, 1) and runs["eager"].warmup[0] == (5, 3, 1)
    assert runs["h1f1b"].iteration <= runs["eager"].iteration < runs["1f1b"].iteration
    assert runs["h1f1b"].iteration / m == pytest.approx(f + b, rel=0.1)
    # H-1F1B keeps fewer micro-batches alive than Eager on stage 2
    stage = lambda r, s: max(sum(1 for i in r.stages[(0, s)] if i.kind == "F" and i.start <= t.start) -  # noqa: E731
                             sum(1 for i in r.stages[(0, s)] if i.kind == "B" and i.end <= t.start) for t in r.stages[(0, s)])
    assert stage(runs["h1f1b"], 1) == 2 and stage(runs["eager"], 1) == 3


@settings(max_examples=40)
@given(st.floats(0.0, 3.0))
def test_virtual_1f1b_never_slower_than_1f1b_and_bubble_free_up_to_half(c):
    f, b, m = 1.0, 2.0, 40
    times = [(f, b)] * 3
    v = simulate_pipelines([chain(times, m, [c, c], "virtual")]).iteration
    plain = simulate_pipelines([chain(times, m, [c, c], "1f1b")]).iteration
    assert v <= plain + 1e-9
    if 0.05 * (f + b) < c <= (f + b) / 2:  # a slow link (above eq. 2's epsilon) that delta = 2 hides
        assert v <= (m + 2) * (f + b) + 4 * c + 1e-9


def test_closed_form_bounds_random_pipelines():
    rng = random.Random(0)
    worst = 0.0
    for _ in range(200):
        s = rng.randint(2, 6)
        m = rng.choice([s, 2 * s, 4 * s, 8 * s])
        base = rng.uniform(0.5, 2.0)
        times = [(base * rng.uniform(0.7, 1.3), 2 * base * rng.uniform(0.7, 1.3)) for _ in range(s)]
        sim = simulate_pipelines([chain(times, m)]).iteration
        bound = closed_form([f + b for f, b in times], m)
        assert sim <= bound * (1 + 1e-12)
        if m >= 4 * s:
            worst = max(worst, bound / sim - 1)
    assert worst <= 0.06


def test_shared_link_serialises_transfers():
    def two(resource):
        link = SimLink(2.0, 2.0, resource)
        stages = lambda o: (SimStage((o,), 1.0, 2.0), SimStage((o + 1,), 1.0, 2.0))  # noqa: E731
        return [SimPipeline(stages(0), (link,), 20, "1f1b:4,1"), SimPipeline(stages(2), (link,), 20, "1f1b:4,1")]
    separate = simulate_pipelines(two(None)).iteration
    shared = simulate_pipelines(two("wan")).iteration
    assert shared > separate * 1.2


def test_breakdown_memory_and_sync():
    st0 = SimStage((0, 1), 1.0, 2.0, 0.25, 0.5, sync=3.0, update=1.0, static_memory=100.0, activation_memory=10.0)
    st1 = SimStage((2,), 1.0, 2.0, sync=0.5, update=1.0, static_memory=50.0, activation_memory=10.0)
    result = simulate_pipelines([SimPipeline((st0, st1), (SimLink(),), 4)], [((0, 0), (0, 1))])
    assert result.iteration == pytest.approx(5 * 3.0 + 3.0 + 1.0)  # pipeline, then one sync of the group, update
    for _rank, b in result.per_rank.items():
        assert b.compute + b.comm + b.idle == pytest.approx(result.iteration)
    assert result.per_rank[0].comm == pytest.approx(4 * 0.75 + 3.0)
    assert result.peak_memory == {0: 120.0, 1: 120.0, 2: 60.0}


def test_deadlocking_input_is_refused():
    with pytest.raises(HSPMDError, match="increases"):
        simulate_pipelines([chain([(1, 2)] * 2, 4, [], "1f1b:1,2")])
    with pytest.raises(HSPMDError, match="needs 1 links"):
        SimPipeline((SimStage((0,), 1, 2),) * 2, (SimLink(), SimLink()), 3)


def test_paper_strategies_simulate_and_the_slow_type_is_the_bottleneck():
    cost = CostModel(parse_cluster("hetu-h800-h20"), MODELS["llama-32b-hetu"])
    strategy = paper_strategy("table5_32b_16h800_16h20")
    result = simulate_strategy(strategy, cost)
    assert result.iteration > 0 and set(result.per_rank) == set(strategy.all_ranks)
    run = plan_run(strategy, cost)
    assert estimate_strategy(strategy, cost) == pytest.approx(result.iteration, rel=0.1)
    # Hetu v2 Table 5 gives H800 stages more layers: per-layer, H20 stages are slower
    for pipe, sp in zip(run.pipelines, strategy.pipelines):
        for sim_stage, stage in zip(pipe.stages, sp.stages):
            assert sim_stage.devices == stage.ranks


def test_uniform_strategy_level1_matches_closed_form_without_sync():
    cost = CostModel(parse_cluster("hetu-h800-h20"), MODELS["llama-32b-hetu"].with_(layers=4))
    strategy = parse_strategy("layers=4 ; 8x1: R0 L0 | R1 L1 | R2 L2 | R3 L3")
    run = plan_run(strategy, cost)
    assert len(run.sync_groups) == 0
    result = simulate_strategy(strategy, cost)
    t = [s.forward + s.backward for s in run.pipelines[0].stages]
    links = [l.forward for l in run.pipelines[0].links]
    assert result.iteration <= closed_form(t, 8, links, 0, max(s.update for s in run.pipelines[0].stages)) + 1e-12



def test_the_pipeline_formula_with_links_is_an_estimate_not_a_bound():
    """One formula prices pipelines for the searches and for level 0, links included; with a link
    slower than a stage it is not an upper bound of level 1 (plain 1F1B stalls a round trip per
    warm-up window), which the simulator's docstring says."""
    from hspmd.planning.search.space import StagePlan, price_pipeline

    f, b, c, m = 1 / 3, 2 / 3, 10.0, 8
    level1 = simulate_pipelines([chain([(f, b)] * 2, m, [c])]).iteration
    level0 = closed_form([f + b] * 2, m, [c])
    assert level1 == pytest.approx(98.0) and level0 == pytest.approx(2 + 2 * c + (m - 1) * c) and level0 < level1

    class Flat:  # every stage takes f + b, every link c: the search's price must be level 0's
        def stage_time(self, *args):
            return f + b

        def stage_memory(self, *args):
            return 0.0

        def capacity(self, device_type):
            return 1.0

        def link_time(self, a, b):
            return c

    stages = [StagePlan("x", 1, 1, False)] * 2
    assert price_pipeline(Flat(), stages, m, 1).time == pytest.approx(level0)
    with pytest.raises(HSPMDError, match="link times"):
        closed_form([1.0, 1.0], 4, [1.0, 2.0])
