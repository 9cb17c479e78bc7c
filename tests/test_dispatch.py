"""Per-step dispatch (hspmd.planning.dispatch): the exhaustive oracle bound, invariants as
properties (every sequence exactly once, no micro-batch over its limit, determinism), selection."""

import itertools
import random

import pytest
from hypothesis import given, settings, strategies as st

from hspmd.errors import HSPMDError
from hspmd.planning.dispatch import (
    PipelineCost,
    PoolEntry,
    dispatch,
    fit_sequence_cost,
    pack_micro_batches,
    packed_pipeline_time,
    select_entry,
)


def _instance(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 10)
    lengths = [rng.choice([rng.randint(1, 64), rng.randint(64, 512)]) for _ in range(n)]
    pipes = []
    for _p in range(3):
        pipes.append(PipelineCost(a=rng.uniform(0, 2e-3), b=rng.uniform(0.2, 2.0), c=rng.uniform(0, 20),
                                  max_tokens=rng.randint(128, 1024), stages=rng.randint(1, 3)))
    longest = max(lengths)
    if max(p.max_tokens for p in pipes) < longest:
        pipes[0] = PipelineCost(pipes[0].a, pipes[0].b, pipes[0].c, longest, pipes[0].stages)
    return pipes, lengths


def _optimum(pipes, lengths):
    """Exhaustive over every feasible assignment; each pipeline's time by the same packer
    (memoised per subset), so this is the best assignment the dispatcher could have found."""
    n = len(lengths)
    memo = {}

    def t(p, mask):
        if (p, mask) not in memo:
            memo[p, mask] = packed_pipeline_time(pipes[p], [lengths[i] for i in range(n) if mask >> i & 1])
        return memo[p, mask]

    choices = [[p for p in range(3) if lengths[i] <= pipes[p].max_tokens] for i in range(n)]
    best = float("inf")
    for combo in itertools.product(*choices):
        masks = [0, 0, 0]
        for i, p in enumerate(combo):
            masks[p] |= 1 << i
        best = min(best, max(t(p, masks[p]) for p in range(3)))
    return best


def test_within_15_percent_of_the_exhaustive_optimum_over_20_seeds():
    ratios = []
    for seed in range(20):
        pipes, lengths = _instance(seed)
        got = dispatch([PoolEntry("s", 0, 10 ** 6, tuple(pipes))], lengths, seed=seed)
        opt = _optimum(pipes, lengths)
        ratios.append(got.makespan / opt)
        assert got.makespan <= 1.15 * opt + 1e-9, (seed, got.makespan, opt)
    assert min(ratios) >= 1.0 - 1e-9  # the oracle is a true lower bound for the same packer


def _check_invariants(d, pipes, lengths):
    seen = sorted(i for mbs in d.micro_batches for mb in mbs for i in mb)
    assert seen == list(range(len(lengths)))  # every sequence exactly once
    for p, mbs in enumerate(d.micro_batches):
        for mb in mbs:
            assert mb and sum(lengths[i] for i in mb) <= pipes[p].max_tokens
            assert all(d.assignment[i] == p for i in mb)


@settings(max_examples=60)
@given(st.data())
def test_dispatch_invariants(data):
    P = data.draw(st.integers(1, 4))
    pipes = [PipelineCost(a=data.draw(st.floats(0, 1e-2)), b=data.draw(st.floats(0, 3)), c=data.draw(st.floats(0, 10)),
                          max_tokens=data.draw(st.integers(1, 300)), stages=data.draw(st.integers(1, 4)))
             for _ in range(P)]
    limit = max(p.max_tokens for p in pipes)
    lengths = data.draw(st.lists(st.integers(1, limit), min_size=1, max_size=25))
    seed = data.draw(st.integers(0, 3))
    pool = [PoolEntry("s", 0, limit, tuple(pipes))]
    d = dispatch(pool, lengths, seed=seed, passes=5)
    _check_invariants(d, pipes, lengths)
    assert d == dispatch(pool, lengths, seed=seed, passes=5)  # deterministic per seed
    for p, mbs in enumerate(d.micro_batches):
        assert d.times[p] == pytest.approx(pipes[p].time([[lengths[i] for i in mb] for mb in mbs]))


def test_long_sequences_go_to_the_long_pipeline_and_load_balances():
    long = PipelineCost(a=0.0, b=2.0, c=0.0, max_tokens=1000)
    short = PipelineCost(a=0.0, b=1.0, c=0.0, max_tokens=100)
    d = dispatch([PoolEntry("s", 0, 1000, (long, short, short))], [900, 50, 50, 50, 50, 40, 30])
    assert d.assignment[0] == 0
    assert all(p in (1, 2) for p in d.assignment[1:])  # the long pipeline is busy for 1800 already
    assert max(d.times[1:]) <= 140


def test_micro_batch_count_trades_warm_up_against_per_micro_batch_cost():
    # 4 stages: more, smaller micro-batches shorten the (pp-1) warm-up; a large c prefers fewer
    many = pack_micro_batches(PipelineCost(0.0, 1.0, 0.0, 64, stages=4), [16] * 8)
    few = pack_micro_batches(PipelineCost(0.0, 1.0, 500.0, 64, stages=4), [16] * 8)
    assert len(many) > len(few) == 2


def test_selection_by_longest_sequence_and_memory():
    pipes_long = (PipelineCost(0, 1, 0, 32), PipelineCost(0, 1, 0, 8))
    pipes_short = (PipelineCost(0, 1, 0, 16), PipelineCost(0, 1, 0, 16))
    pool = [PoolEntry("S1", 0, 32, pipes_long), PoolEntry("S2", 1, 16, pipes_short)]
    assert [select_entry(pool, s) for s in (3, 16, 17, 32)] == [1, 1, 0, 0]
    with pytest.raises(HSPMDError, match="no strategy in the pool takes a sequence of 33"):
        select_entry(pool, 33)
    # a bound the pipelines cannot hold (memory) is not chosen
    assert select_entry([PoolEntry("S2", 1, 64, pipes_short), PoolEntry("S1", 0, 128, pipes_long)], 20) == 1


def test_bad_input_is_named():
    with pytest.raises(HSPMDError, match="max_tokens"):
        PipelineCost(0, 1, 0, 0)
    with pytest.raises(HSPMDError, match=r"PipelineCost\.a"):
        PipelineCost(-1, 1, 0, 4)
    pool = [PoolEntry("s", 0, 8, (PipelineCost(0, 1, 0, 8),))]
    with pytest.raises(HSPMDError, match="no sequences"):
        dispatch(pool, [])
    with pytest.raises(HSPMDError, match="positive"):
        dispatch(pool, [3, 0])
    for lengths in ([10.7, 2], ["x"], [True]):  # never truncated or read as a number
        with pytest.raises(HSPMDError, match="positive integers"):
            dispatch(pool, lengths)
    for entry in (1, -1):
        with pytest.raises(HSPMDError, match="index into the pool of 1"):
            dispatch(pool, [3], entry=entry)
    with pytest.raises(HSPMDError, match=r"PipelineCost\.a must be a finite"):
        PipelineCost(float("inf"), 1, 0, 4)


def test_micro_batching_tries_sixteen_bin_counts_from_the_fewest():
    from hspmd.planning.dispatch import pack_micro_batches
    # 51 unit sequences fit one micro-batch; with many stages, a smaller largest bin wins: 17 bins
    # of 3 would, but the counts tried are 1 ... 16 (Hetu v2 §7.3), where 13 bins of at most 4 do.
    deep = PipelineCost(0, 1, 0, 51, stages=1000)
    assert len(pack_micro_batches(deep, [1] * 51)) == 13


def test_fit_sequence_cost_recovers_a_quadratic():
    a, b = fit_sequence_cost([8, 16, 32, 64], [3e-4 * s * s + 0.02 * s for s in (8, 16, 32, 64)])
    assert a == pytest.approx(3e-4) and b == pytest.approx(0.02)
    with pytest.raises(HSPMDError, match="two different lengths"):
        fit_sequence_cost([8, 8], [1.0, 1.0])


def test_fit_with_a_constant_recovers_it_and_keeps_every_coefficient_non_negative():
    lengths = [4, 8, 16, 32, 64]
    a, b, c = fit_sequence_cost(lengths, [2e-4 * s * s + 0.01 * s + 0.3 for s in lengths], constant=True)
    assert (a, b, c) == (pytest.approx(2e-4), pytest.approx(0.01), pytest.approx(0.3))
    # falling times: the unconstrained fit has a negative slope; the kept fit is the constant alone
    falling = [1.0, 0.9, 0.8, 0.7, 0.6]
    a, b, c = fit_sequence_cost(lengths, falling, constant=True)
    assert a == 0 and b == 0 and c == pytest.approx(sum(falling) / len(falling))


def test_choosing_by_cost_takes_the_cheaper_entry_unless_the_switch_costs_more_than_it_gains():
    slow_wide = PoolEntry("wide", 0, 64, (PipelineCost(0, 1.0, 0, 64),))
    fast_narrow = PoolEntry("narrow", 1, 16, (PipelineCost(0, 0.25, 0, 16),) * 2)
    pool = [slow_wide, fast_narrow]
    lengths = [8, 8, 4, 4]  # wide: 24 s; narrow: two pipelines of 3 s
    assert dispatch(pool, lengths).entry == 1  # the paper's rule: the narrowest bound that fits
    assert dispatch(pool, lengths, by_cost=True).entry == 1
    assert dispatch(pool, lengths, by_cost=True, current=0, switch_seconds=30.0).entry == 0
    assert dispatch(pool, lengths, by_cost=True, current=0, switch_seconds=10.0).entry == 1
    assert dispatch(pool, [20, 4], by_cost=True, current=1, switch_seconds=1e9).entry == 0  # only one fits
