"""Warm-up vectors (HAPT eq. 2/10, Eager-1F1B, Virtual-1F1B) and 1F1B with any valid vector:
HAPT's worked example, deadlock freedom and peak in-flight micro-batches for every non-increasing
vector, and a gloo run under each policy equal to the single-device reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hspmd.errors import HSPMDError
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.execution.trace import Tracer
from hspmd.specialize.schedules import (
    check_order, check_warmup, one_f_one_b, peak_in_flight, schedule_for, simulate, warmup_vector,
)
from tests.test_multiprocess_training import assert_matches_reference, batches, make_trainer, train


def test_hapt_three_stage_example():
    t = [3.0, 3.0, 3.0]
    for c1 in (1.51, 2.0, 3.0):  # c1 in (t_max/2, t_max], c2 ~ 0
        assert warmup_vector("h1f1b", t, [c1, 0.0]) == (5, 2, 1)
        assert warmup_vector("eager", t, [c1, 0.0]) == (5, 3, 1)
    assert warmup_vector("1f1b", t, [2.0, 0.0]) == (3, 2, 1)
    assert warmup_vector("virtual", t, [2.0, 0.0]) == (4, 2, 1)


def test_h1f1b_deltas_follow_eq2_and_eq10():
    t = [2.0, 4.0]
    assert [warmup_vector("h1f1b", t, [c])[0] - 1 for c in (0.0, 0.2, 0.21, 2.0, 2.01, 4.0, 6.0)] == [1, 1, 2, 2, 3, 3, 4]


def test_classic_1f1b_is_unchanged():
    for stages in range(1, 5):
        for m in range(1, 7):
            for s in range(stages):
                w = min(stages - s - 1, m)
                old = [("F", i) for i in range(w)]
                for i in range(m - w):
                    old += [("F", w + i), ("B", i)]
                old += [("B", i) for i in range(m - w, m)]
                assert [(a.kind, a.micro_batch) for a in one_f_one_b(stages, s, m)] == old
                assert schedule_for("1f1b", stages, s, m) == one_f_one_b(stages, s, m)


@settings(max_examples=150)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(1, 12), st.integers(1, 3), st.integers(1, 4))
def test_any_non_increasing_vector_runs_without_deadlock(steps, m, f, b):
    vector = []
    for d in reversed(steps):
        vector.insert(0, (vector[0] if vector else 1) + (d if vector else 0))
    vector = check_warmup(vector, len(vector))
    orders = [one_f_one_b(len(vector), s, m, n) for s, n in enumerate(vector)]
    for order, n in zip(orders, vector):
        check_order(order, m)
        assert peak_in_flight(order) == min(n, m)
    timeline = simulate(orders, f, b)  # raises on deadlock
    assert timeline.makespan >= m * (f + b)


def test_a_rising_vector_is_refused_and_a_truly_rising_order_deadlocks():
    with pytest.raises(HSPMDError, match="increases after stage 0"):
        check_warmup((1, 2), 2)
    with pytest.raises(HSPMDError, match="one integer >= 1 per stage"):
        check_warmup((2, 0), 2)
    with pytest.raises(HSPMDError, match="deadlocks"):
        simulate([one_f_one_b(2, 0, 4, 1), one_f_one_b(2, 1, 4, 3)])


def test_schedule_names():
    assert schedule_for("h1f1b:5,2,1", 3, 0, 8) == one_f_one_b(3, 0, 8, 5)
    assert schedule_for("eager", 3, 1, 8) == one_f_one_b(3, 1, 8, 3)
    with pytest.raises(HSPMDError, match="warmup_vector"):
        schedule_for("h1f1b", 3, 0, 8)
    with pytest.raises(HSPMDError, match="one integer >= 1 per stage"):
        schedule_for("1f1b:2,1", 3, 0, 8)
    with pytest.raises(HSPMDError, match="unknown pipeline schedule"):
        schedule_for("zb-v", 3, 0, 8)
    with pytest.raises(HSPMDError, match="unknown warm-up policy"):
        warmup_vector("lazy", [1.0])
    with pytest.raises(HSPMDError, match="link time"):
        warmup_vector("h1f1b", [1.0, 1.0], [1.0, 2.0])


# ---- every policy trains equal to the reference on real gloo processes ----------------------------

PP3 = "layers=3 ; 6x1: R0 L0 | R1 L1 | R2 L2"
POLICIES = ("1f1b", "eager", "h1f1b:5,2,1", "virtual:4,2,1", "1f1b:6,6,6")


def policies_rank(backend):
    torch.set_num_threads(1)
    out = {}
    for policy in POLICIES:
        trainer = make_trainer(backend, PP3, policy)
        data = batches(PP3, 2, seed=7)
        losses = train(trainer, data[:1])
        trainer.tracer = Tracer(backend.rank)  # the second step is traced
        losses += train(trainer, data[1:])
        names = [e["name"] for e in trainer.tracer.events]
        out[policy] = (losses, trainer.state_dict(), trainer.last_run.peak_in_flight, names, list(map(str, trainer.order)))
    return out


@pytest.mark.multiprocess
def test_every_warmup_policy_trains_equal_to_one_device():
    results = run_multiprocess(policies_rank, 3, timeout=180)
    data = batches(PP3, 2, seed=7)
    peaks = {"1f1b": [3, 2, 1], "eager": [5, 3, 1], "h1f1b:5,2,1": [5, 2, 1], "virtual:4,2,1": [4, 2, 1],
             "1f1b:6,6,6": [6, 6, 6]}
    for policy in POLICIES:
        losses = results[0][policy][0]
        assert all(r[policy][0] == losses for r in results)
        assert_matches_reference(losses, {k: v for k, v in results[0][policy][1].items() if "exp_avg" not in k}, data, 3)
        assert [r[policy][2] for r in results] == peaks[policy]
        for r in results:  # the trace holds the schedule's actions in order, then the update
            assert r[policy][3] == r[policy][4] + ["wait sends", "update"]


def test_warmup_vector_edges():
    """Zero-time stages are allowed; omitted link times are zero (no slow link: deltas of 1);
    `eps` decides which links are slow; errors name the policy hint and the expected count."""
    assert warmup_vector("1f1b", [0.0, 1.0]) == (2, 1)
    assert warmup_vector("h1f1b", [1.0, 1.0, 1.0]) == (3, 2, 1)
    assert warmup_vector("h1f1b", [1.0, 1.0], [0.04]) == (2, 1)            # 0.04 <= 0.05 t_max: fast
    assert warmup_vector("h1f1b", [1.0, 1.0], [0.04], eps=0.01) == (3, 1)  # slow, <= t_max / 2: delta 2
    with pytest.raises(HSPMDError, match="did you mean '1f1b'"):
        warmup_vector("1fib", [1.0])
    with pytest.raises(HSPMDError, match=r"give 1 non-negative link time\(s\) for 2 stages"):
        warmup_vector("1f1b", [1.0, 1.0], [0.1, 0.1])
