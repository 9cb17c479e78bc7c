"""Strategy searches against the exhaustive oracle of their own space (HAPT §5.2, C, D)."""

import pytest

from hspmd.planning.search import GENERAL, PERMUTED, UNIFORM, PlanningError, dfs, dp, exhaustive, mcts, price
from hspmd.planning.search.dfs_h2 import split_groups
from hspmd.planning.search.mcts_hetauto import reward
from hspmd.planning.search.space import Priced, price_strategy
from hspmd.specialize.schedules import warmup_vector
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from tests.planning_instances import capacity_of, hapt_problem, random_problem, tight_memory_problem


def best_time(results):
    return results[0].predicted_time


def assert_fits(problem, planned):
    for rank, used in planned.peak_memory.items():
        assert used <= capacity_of(problem, rank)
    assert sorted(planned.peak_memory) == list(planned.strategy.all_ranks)
    assert parse_strategy(format_strategy(planned.strategy)) == planned.strategy


def test_dp_equals_brute_force_on_the_hapt_instance():
    problem = hapt_problem()
    oracle = exhaustive(problem, GENERAL)[0]
    for prune in (True, False):
        found = dp(problem, prune=prune)[0]
        assert found.predicted_time == pytest.approx(oracle.predicted_time, rel=1e-12)
        assert_fits(problem, found)
    # Not a trivial instance: the optimum uses both meshes and more than two stages are priced.
    assert {s.device_type for s in oracle.layout.stages} == {"A", "B"}


@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_exhaustive(seed):
    problem = random_problem(seed)
    oracle = exhaustive(problem, GENERAL)
    found = dp(problem)
    assert best_time(found) == pytest.approx(best_time(oracle), rel=1e-12)
    assert_fits(problem, found[0])
    assert found[0].predicted_time == price(problem, found[0].layout).time


def test_dp_pruning_changes_nothing():
    problem = random_problem(11, layers=6)
    assert best_time(dp(problem, prune=True)) == pytest.approx(best_time(dp(problem, prune=False)), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_dfs_equals_exhaustive_on_three_types(seed):
    # H2 §5, scaled down: three types of decreasing memory, TP up to a node.
    problem = random_problem(seed, types=(("X", 4, 4), ("Y", 4, 4), ("Z", 4, 4)), layers=12, batch=16)
    oracle = exhaustive(problem, UNIFORM)
    found = dfs(problem)
    assert best_time(found) == pytest.approx(best_time(oracle), rel=1e-12)
    assert_fits(problem, found[0])


def test_two_stage_never_worse_than_one_stage():
    for seed in range(20):
        problem = random_problem(seed, types=(("A", 4, 2), ("B", 2, 2)), layers=6, batch=4)
        one = dfs(problem, two_stage=False)[0]
        two = dfs(problem, group_size=2)[0]
        assert two.predicted_time <= one.predicted_time
    assert len(split_groups(problem, 1, 2)) == 3


def test_mcts_finds_the_optimum_in_18_of_20_seeds():
    # HetAuto §5: 8 + 8 devices, L = 8, B = 16, 3000 iterations.
    problem = random_problem(100, types=(("A", 8, 8), ("B", 8, 8)), layers=8, batch=16)
    optimum = best_time(exhaustive(problem, PERMUTED))
    times = [best_time(mcts(problem, iterations=3000, seed=seed)) for seed in range(20)]
    assert sum(t == pytest.approx(optimum, rel=1e-12) for t in times) >= 18
    assert all(t <= optimum * 1.02 for t in times)
    assert min(times) >= optimum * (1 - 1e-12)


def test_small_lambda_is_no_better_on_average():
    # At the 3000-iteration budget. (At 300 iterations lambda = 0.1 did better on this instance:
    # the claim holds only once the budget lets lambda = 10 explore.)
    problem = random_problem(7, types=(("A", 8, 8), ("B", 8, 8)), layers=8, batch=16, recompute=False)
    small = [best_time(mcts(problem, iterations=3000, seed=s, exploration=0.1)) for s in range(3)]
    large = [best_time(mcts(problem, iterations=3000, seed=s, exploration=10.0)) for s in range(3)]
    assert sum(large) <= sum(small) * (1 + 1e-12)


def test_infeasible_reward_is_zero():
    assert reward(Priced(3.0, (1.0,), (1.0,), False)) == 0.0
    assert reward(Priced(3.0, (1.0,), (1.0,), True)) == 0.25


def test_no_layout_fits_is_a_clear_error():
    problem = random_problem(0)
    tiny = type(problem.evaluator)(**{**problem.evaluator.__dict__, "capacities": {"A": 1.0, "B": 1.0}})
    problem = type(problem)(problem.pools, problem.num_layers, problem.global_batch, tiny)
    for search in (dp, dfs, mcts, exhaustive):
        with pytest.raises(PlanningError, match="memory|feasible"):
            search(problem)


@pytest.mark.parametrize("search", [dp, dfs, mcts])
def test_searches_recompute_where_memory_needs_it_and_the_strategy_says_so(search):
    with pytest.raises(PlanningError, match="fit|feasible"):
        search(tight_memory_problem(recompute=False))
    problem = tight_memory_problem()
    planned = search(problem)[0]
    assert_fits(problem, planned)
    flags = [s.recompute for s in planned.strategy.pipelines[0].stages]
    assert flags == [s.recompute for s in planned.layout.stages] and any(flags)
    # the strategy alone (its own recompute flags) prices as the search predicted
    assert price_strategy(problem, planned.strategy).time == pytest.approx(planned.predicted_time)
    assert "recompute" in format_strategy(planned.strategy)


def test_plans_carry_an_h1f1b_warmup_where_it_beats_1f1b_and_fits():
    problem = random_problem(2)  # slow links between the two types: 1F1B leaves bubbles
    for search in (dp, dfs):
        planned = search(problem)[0]
        assert planned.schedule == "h1f1b"
        seconds = planned.provenance["pipeline_seconds"]
        assert seconds["h1f1b"] < seconds["1f1b"]
        stages = planned.layout.stages
        times = [problem.evaluator.stage_time(s.device_type, s.tp, s.layers, s.recompute, i == 0, i == len(stages) - 1)
                 for i, s in enumerate(stages)]
        links = [problem.evaluator.link_time(a.device_type, b.device_type) for a, b in zip(stages, stages[1:])]
        vector = warmup_vector("h1f1b", times, links)
        assert vector != warmup_vector("1f1b", times, links)
        for pipeline, in_flight in zip(planned.strategy.pipelines, planned.warmup):
            assert (pipeline.schedule, pipeline.warmup) == ("h1f1b", vector)
            assert in_flight == tuple(min(n, pipeline.micro_batches) for n in vector)
        assert_fits(problem, planned)  # memory at the larger in-flight counts
    # cheap links (or no memory to spare): the trainer's 1F1B, no schedule in the strategy
    for problem in (tight_memory_problem(), hapt_problem()):
        planned = dp(problem)[0]
        assert planned.schedule == "1f1b" and {p.schedule for p in planned.strategy.pipelines} == {None}


@pytest.mark.parametrize("search", [dp, dfs])
def test_searches_place_tp_groups_inside_nodes_that_are_not_powers_of_two(search):
    from hspmd.planning.ranks import DevicePool
    from hspmd.planning.search import Problem, TableEvaluator
    evaluator = TableEvaluator({("A", 1): 1.0, ("A", 2): 0.3}, {"A": 1e15})
    problem = Problem((DevicePool("A", ((0, 1, 2), (3, 4, 5))),), 6, 4, evaluator)
    found = search(problem)[0]
    node_of = {r: k for k, node in enumerate(problem.pools[0].nodes) for r in node}
    for stage in (s for p in found.strategy.pipelines for s in p.stages):
        assert len({node_of[r] for r in stage.ranks}) == 1
    assert sum(s.tp for s in found.layout.stages) * found.layout.pipelines <= 6


def test_mcts_never_returns_worse_than_the_layout_it_was_handed():
    """Warm-started from DFS's answer (as `hspmd plan` runs it), MCTS with almost no budget keeps
    that answer, and with a full budget returns nothing worse."""
    problem = random_problem(3)
    guided = dfs(problem)[0]
    starved = mcts(problem, iterations=1, seed=0, warm_start=guided.layout)[0]
    assert starved.predicted_time == pytest.approx(guided.predicted_time) and starved.provenance["warm_start_kept"]
    full = mcts(problem, iterations=3000, seed=0, warm_start=guided.layout)[0]
    assert full.predicted_time <= guided.predicted_time + 1e-12
