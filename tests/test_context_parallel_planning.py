"""Context parallelism in the cost model, memory model and simulator: per-device compute and
activations follow the device's share of the sequence, the ring / all-gather / all-to-all traffic
is priced per layer (the ring's partly hidden behind attention with cp_overlap), the weight
gradients' all-reduce over the CP groups joins the stage's sync, and each CP group is priced on
its own device type with its own share (unequal devices get tokens by speed); the searches choose
CP where the sequence is long enough for it to pay."""

from __future__ import annotations

import pytest

from hspmd.cluster import h800_h20
from hspmd.cluster.presets import parse_cluster
from hspmd.planning.cost import CostModel, StageShape
from hspmd.planning.model import MODELS
from hspmd.planning.search import GENERAL, PERMUTED, SEARCHES, UNIFORM, PlanningError, exhaustive
from hspmd.planning.search.command import main as plan_main
from hspmd.planning.search.costed import cluster_problem, context_degrees
from hspmd.planning.search.space import price_strategy
from hspmd.planning.strategy_sim import balanced_cp_shares, plan_run, simulate_strategy
from hspmd.specialize.strategy_text import parse_strategy

LONG = 32768


def _cost(**options):
    return CostModel(parse_cluster("nvlink-ib:2x4"), MODELS["llama-32b-hetu"].with_(layers=4), **options)


def _stage(text, seq=LONG, cost=None):
    return plan_run(parse_strategy(text), cost or _cost(), seq=seq).pipelines[0].stages[0]


def test_compute_and_activations_follow_the_share_of_the_sequence():
    one, cp2, cp4 = (_stage(t) for t in ("1x1: R0 L0-3", "1x1: R0,1 L0-3 cp2", "1x1: R0-3 L0-3 cp4"))
    assert cp2.forward - cp2.forward_comm == pytest.approx((one.forward - one.forward_comm) / 2, rel=0.05)
    assert cp4.forward - cp4.forward_comm == pytest.approx((one.forward - one.forward_comm) / 4, rel=0.05)
    assert cp2.activation_memory < one.activation_memory / 2 and cp4.activation_memory < cp2.activation_memory
    uneven = _stage("1x1: R0,1 L0-3 cp2=3,1")  # priced at the group holding 3/4 of the tokens
    assert uneven.forward > cp2.forward * 1.4 and uneven.activation_memory > cp2.activation_memory


def test_each_mode_prices_its_own_traffic():
    ring, a2a, gather = (_stage(f"1x1: R0-3 L0-3 cp4 ; cp_attention={m}") for m in ("ring", "all_to_all", "all_gather"))
    for s in (ring, a2a, gather):
        assert s.forward_comm > 0 and s.backward_comm > 0
    across = _stage("1x1: R0,4 L0-3 cp2")  # the two CP groups on different nodes: the ring crosses the network
    assert across.forward_comm > _stage("1x1: R0,1 L0-3 cp2").forward_comm
    hidden = _stage("1x1: R0-3 L0-3 cp4", cost=_cost(cp_overlap=1.0))
    assert hidden.forward_comm < ring.forward_comm
    # memory: the ring keeps its merged output only, all_to_all a heads-split copy, all_gather K/V whole
    assert ring.activation_memory < a2a.activation_memory < gather.activation_memory
    assert ring.backward_comm > ring.forward_comm  # the backward sends K/V around again, and dK/dV back


def test_cp_gradient_all_reduce_joins_the_stage_sync():
    assert _stage("1x1: R0 L0-3").sync == 0.0
    assert _stage("1x1: R0,1 L0-3 cp2").sync > 0.0
    result = simulate_strategy(parse_strategy("2x1 1f1b: R0,1 L0-1 cp2 | R2,3 L2-3 cp2"), _cost(), seq=LONG)
    plain = simulate_strategy(parse_strategy("2x1 1f1b: R0 L0-1 | R2 L2-3"), _cost(), seq=LONG)
    assert 0 < result.iteration < plain.iteration


def test_stage_shape_share():
    assert StageShape(1, cp=4).share == 0.25 and StageShape(1, cp=2, cp_share=0.75).share == 0.75


def test_unequal_devices_in_a_cp_group_get_tokens_by_speed():
    """An H800 and an H20 as one CP stage: the faster device takes more tokens, and the step the
    simulator prices for those shares is faster than the even split (the H20 no longer the
    straggler)."""
    cost = CostModel(h800_h20(1, 1, per_node=1), MODELS["llama-32b-hetu"].with_(layers=4, dtype="bfloat16"))
    even = parse_strategy("1x1: R0,1 L0-3 cp2")
    shares = balanced_cp_shares(cost, even.pipelines[0].stages[0], 16384)
    assert sum(shares) == 16384 and shares[0] > 2 * shares[1]
    tuned = parse_strategy(f"1x1: R0,1 L0-3 cp2={shares[0]},{shares[1]}")
    fast, slow = (simulate_strategy(s, cost, seq=16384).iteration for s in (tuned, even))
    assert fast < 0.8 * slow
    flipped = parse_strategy(f"1x1: R0,1 L0-3 cp2={shares[1]},{shares[0]}")  # the H20 given the larger share
    assert simulate_strategy(flipped, cost, seq=16384).iteration > slow


def _searched(seq, batch, layers=8, cluster="nvlink-ib:2x4", **options):
    """The model at `seq` tokens on `cluster`, its problem (CP degrees as cluster_problem offers
    them, or per `options`) and every search's best plan."""
    cost = CostModel(parse_cluster(cluster), MODELS["llama-32b-hetu"].with_(layers=layers, dtype="bfloat16", seq_len=seq))
    problem = cluster_problem(cost, batch, **options)
    return cost, problem, {name: search(problem)[0] for name, search in SEARCHES.items()}


def test_the_searches_choose_cp_for_a_long_sequence():
    """32K tokens, 4 sequences on 8 devices (HetAuto §7.7's setting in small): without CP every
    layout must recompute to fit; with CP offered, each search picks stages that split the
    sequence, priced faster, and the level-1 simulator of the strategies agrees."""
    assert context_degrees(32768, 4) == (1, 2, 4) and context_degrees(8192, 8) == (1, 2) and context_degrees(2048, 8) == (1,)
    cost, problem, plans = _searched(32768, 4)
    _, _, without = _searched(32768, 4, max_cp=1)
    assert problem.cp_degrees["gpu"] == (1, 2, 4)
    for name, plan in plans.items():
        assert plan.strategy.max_cp > 1, name
        assert all(s.recompute for p in without[name].strategy.pipelines for s in p.stages)  # CP1 fits only so
        assert plan.predicted_time < 0.9 * without[name].predicted_time, name
        fast, slow = (simulate_strategy(p.strategy, cost).iteration for p in (plan, without[name]))
        assert fast < 0.9 * slow, name
    assert plans["dp"].predicted_time == pytest.approx(exhaustive(problem, GENERAL)[0].predicted_time)


def test_the_searches_keep_cp1_for_a_short_sequence():
    """8K tokens (CP2 offered by length) and 4K tokens (CP up to 4 offered by hand): splitting the
    sequence does not pay for its K/V traffic, so no search takes it (HetAuto §7.7: CP=1 at 8K)."""
    for seq, batch, options in ((8192, 4, {}), (4096, 8, {"max_cp": 4})):
        _, problem, plans = _searched(seq, batch, **options)
        assert max(problem.cp_degrees["gpu"]) > 1
        for name, plan in plans.items():
            assert plan.strategy.max_cp == 1, (seq, name)


def test_cp_stages_in_the_search_space_are_priced_like_the_strategy():
    """A planned CP layout's strategy keeps its CP groups inside a node, CP-major, and prices the
    same through price_strategy (the searches' objective over any Strategy)."""
    _, problem, plans = _searched(32768, 4)
    plan = plans["dp"]
    for p in plan.strategy.pipelines:
        for s in p.stages:
            assert len({r // 4 for r in s.ranks}) == 1 and s.cp * s.tp == len(s.ranks)
    assert price_strategy(problem, plan.strategy).time == pytest.approx(plan.predicted_time)
    with pytest.raises(PlanningError, match="max_cp must be a positive integer"):
        cluster_problem(CostModel(parse_cluster("2x4"), MODELS["llama-tiny"]), 4, max_cp=0)


def test_plan_command_takes_a_sequence_length_and_a_cp_limit(capsys):
    assert plan_main(["--cluster", "nvlink-ib:1x4", "--model", "llama-tiny", "--global-batch", "4", "--seq", "0"]) == 2
    assert "--seq must be positive" in capsys.readouterr().err
    assert plan_main(["--cluster", "nvlink-ib:1x4", "--model", "llama-tiny", "--global-batch", "4", "--max-cp", "0"]) == 2
    assert "max_cp must be a positive integer" in capsys.readouterr().err
    assert plan_main(["--cluster", "nvlink-ib:1x4", "--model", "llama-tiny", "--global-batch", "4", "--seq", "64",
                      "--max-cp", "4", "--search", "dfs"]) == 0
    assert "seq 64" in capsys.readouterr().out


@pytest.mark.parametrize("cluster, seq, layers, batch", [
    ("h800-h20:1+1x4", 16384, 4, 2), ("h800-h20:1+1x4", 65536, 4, 2), ("nvlink-ib:2x4", 32768, 6, 4)])
def test_each_search_equals_the_exhaustive_optimum_of_its_space_with_cp(cluster, seq, layers, batch):
    """With CP degrees offered: dp is exact over GENERAL (one CP degree per pipeline), dfs reaches
    UNIFORM's optimum and mcts PERMUTED's, and the optima split the sequence."""
    _, problem, plans = _searched(seq, batch, layers, cluster)
    optimum = {space: exhaustive(problem, space)[0] for space in (GENERAL, UNIFORM, PERMUTED)}
    for name, space in (("dp", GENERAL), ("dfs", UNIFORM), ("mcts", PERMUTED)):
        assert plans[name].predicted_time == pytest.approx(optimum[space].predicted_time, rel=1e-12), name
    assert optimum[GENERAL].strategy.max_cp > 1


def test_where_activations_forbid_cp1_the_searches_split_the_sequence():
    """No recompute, 32K and 64K tokens: no CP1 layout fits a device's memory, so every search
    fails without CP and finds a CP layout with it (CP4 at 64K)."""
    for seq, cp in ((32768, 2), (65536, 4)):
        cost = CostModel(parse_cluster("nvlink-ib:2x4"),
                         MODELS["llama-32b-hetu"].with_(layers=8, dtype="bfloat16", seq_len=seq))
        for name, search in SEARCHES.items():
            with pytest.raises(PlanningError):
                search(cluster_problem(cost, 4, recompute=False, max_cp=1))
            assert search(cluster_problem(cost, 4, recompute=False))[0].strategy.max_cp == cp, (seq, name)
