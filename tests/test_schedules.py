"""Pipeline schedules as pure data, the micro-batch layout, and the executor on the in-process
backend (threads): orders, memory bounds, deadlock freedom, and what the executor really keeps."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import SGD
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.backends.local import run_on_devices
from hspmd.specialize.schedules import (
    BACKWARD,
    FORWARD,
    Action,
    check_order,
    describe_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    pipeline_schedule,
    render_timeline,
    schedule_for,
    simulate,
)
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy

shapes = st.integers(1, 6).flatmap(lambda s: st.tuples(st.just(s), st.integers(0, s - 1), st.integers(1, 9)))


def _text(order):
    return " ".join(map(str, order))


def test_one_f_one_b_orders_match_the_textbook():
    assert _text(one_f_one_b(4, 0, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert _text(one_f_one_b(4, 2, 6)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert _text(one_f_one_b(4, 3, 6)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert _text(one_f_one_b(4, 0, 2)) == "F0 F1 B0 B1"  # fewer micro-batches than warm-up slots
    assert _text(gpipe(3, 1, 3)) == "F0 F1 F2 B0 B1 B2"


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_one_f_one_b_warm_up_steady_and_peak(shape):
    stages, stage, m = shape
    order = one_f_one_b(stages, stage, m)
    check_order(order, m)
    warmup = min(stages - stage - 1, m)
    assert all(a.kind == FORWARD for a in order[:warmup])
    steady = order[warmup : warmup + 2 * (m - warmup)]
    assert [a.kind for a in steady] == [FORWARD, BACKWARD] * (m - warmup)
    assert all(a.kind == BACKWARD for a in order[warmup + 2 * (m - warmup) :])
    assert peak_in_flight(order) == min(stages - stage, m)
    assert peak_in_flight(gpipe(stages, stage, m)) == m


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.sampled_from(["gpipe", "1f1b"]))
def test_every_schedule_runs_without_deadlock_and_1f1b_is_never_slower(stages, m, name):
    timeline = simulate(pipeline_schedule(name, stages, m))
    assert timeline.makespan >= 3 * m  # stage 0 alone does m forwards and m backwards
    assert simulate(pipeline_schedule("1f1b", stages, m)).makespan <= simulate(pipeline_schedule("gpipe", stages, m)).makespan


def test_simulate_names_the_stages_of_a_deadlocking_order():
    # stage 0 wants B0 before sending F1; stage 1 wants F1 before sending B0's gradient
    orders = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
              [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
    with pytest.raises(HSPMDError, match=r"deadlocks: stage 0 at B0, stage 1 at F1"):
        simulate(orders)


def test_timeline_rendering_shows_each_stage_and_the_bubble():
    text = render_timeline(simulate(pipeline_schedule("1f1b", 2, 3)))
    rows = text.splitlines()
    assert [r.split("|")[0] for r in rows] == ["stage 0 ", "stage 1 "]
    assert rows[1].split("|")[1].startswith("   F0 B0 ..")  # stage 1 idles one unit, then alternates
    assert "bubble" in describe_schedule("gpipe", 3, 4) and "peak in flight 4" in describe_schedule("gpipe", 3, 4)


@pytest.mark.parametrize(
    "order, message",
    [
        ([Action("B", 0), Action("F", 0)], "before F0"),
        ([Action("F", 0), Action("F", 0), Action("B", 0)], "second time"),
        ([Action("F", 0)], "never runs B0"),
        ([Action("F", 2), Action("B", 2)], "outside"),
    ],
)
def test_check_order_rejects_broken_orders(order, message):
    with pytest.raises(HSPMDError, match=message):
        check_order(order, 1)


def test_schedule_errors_name_the_fix():
    with pytest.raises(HSPMDError, match="did you mean '1f1b'"):
        schedule_for("1fb1", 2, 0, 2)
    with pytest.raises(HSPMDError, match="stage 3 does not exist"):
        one_f_one_b(3, 3, 2)
    with pytest.raises(HSPMDError, match="micro_batches must be an integer >= 1"):
        gpipe(2, 0, 0)


def test_layout_splits_the_global_batch_pipeline_by_pipeline():
    layout = MicroBatchLayout((2, 3), (2, 1))
    assert layout.global_batch_size == 7
    assert [layout.rows(0, m) for m in range(2)] == [(0, 2), (2, 4)]
    assert [layout.rows(1, m) for m in range(3)] == [(4, 5), (5, 6), (6, 7)]
    assert layout.pipeline_rows(1) == (4, 7)
    assert str(layout) == "global batch 7 = pipeline 0: 2 x 2 + pipeline 1: 3 x 1"
    assert MicroBatchLayout.of(parse_strategy("layers=2 ; 2x2: R0,1 L0-1 ; 3x1: R2 L0 | R3 L1")) == layout
    with pytest.raises(HSPMDError, match="micro-batches 0-2, not 3"):
        layout.rows(1, 3)
    with pytest.raises(HSPMDError, match="one count and one size per pipeline"):
        MicroBatchLayout((1, 2), (1,))


def _peaks_on_threads(backend, text, schedule):
    strategy = parse_strategy(text)
    layout = MicroBatchLayout.of(strategy)
    model = build_llama(LlamaConfig(layers=strategy.num_layers, hidden=16, ffn=32, vocab=16), [strategy], optimizer=SGD(lr=0.1))
    trainer = Trainer(model.graph, 0, backend, strategy, schedule=schedule, symbols={"S": 4, "T": 4 * layout.global_batch_size})
    tokens = torch.arange(4 * layout.global_batch_size).reshape(-1, 4) % 16
    loss = trainer.step({"tokens": tokens, "labels": tokens.flip(1)})
    return trainer.stage, trainer.last_run.peak_in_flight, loss


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_executor_keeps_exactly_the_schedules_peak_of_micro_batches_alive(schedule):
    """Three stages, five micro-batches: the executor's measured peak is the schedule's bound."""
    results = run_on_devices(lambda b: _peaks_on_threads(b, "layers=3 ; 5x1: R0 L0 | R1 L1 | R2 L2", schedule), range(3))
    for stage, peak, _ in results.values():
        assert peak == (min(3 - stage, 5) if schedule == "1f1b" else 5)
    assert len({loss for _, _, loss in results.values()}) == 1


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 5), m=st.integers(1, 8), f=st.integers(1, 3), b=st.integers(1, 4),
       name=st.sampled_from(["gpipe", "1f1b"]))
def test_simulated_gpipe_and_1f1b_take_the_textbook_time_and_bubble(stages, m, f, b, name):
    """On the ideal machine both schedules take (m + p - 1)(f + b) with bubble (p - 1) / (m + p - 1)
    (Narayanan et al.); every stage runs each action once, F(m) of stage s at the earliest s*f."""
    timeline = simulate(pipeline_schedule(name, stages, m), forward_cost=f, backward_cost=b)
    assert timeline.makespan == (m + stages - 1) * (f + b)
    assert timeline.bubble_fraction() == pytest.approx((stages - 1) / (m + stages - 1))
    for s, starts in enumerate(timeline.starts):
        assert sorted(str(a) for _, a in starts) == sorted([f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)])
        first_forward = min(t for t, a in starts if a.kind == "F")
        assert first_forward == s * f
        last_backward_end = max(t for t, a in starts if a.kind == "B") + b
        assert last_backward_end == timeline.makespan - s * b


def test_peak_in_flight_and_the_rendered_timeline_by_hand():
    assert peak_in_flight([Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 0), Action(FORWARD, 2),
                           Action(FORWARD, 3)]) == 3
    # GPipe, 2 stages, 2 micro-batches, F=1, B=2: stage 1 runs F0 F1 at 1, 2, B0 B1 at 3, 5; stage 0
    # waits for them: B0 at 5, B1 at 7; 9 units, 6 of 18 stage-units idle
    timeline = simulate(pipeline_schedule("gpipe", 2, 2))
    assert render_timeline(timeline) == "stage 0 |F0 F1          B0 .. B1 ..\nstage 1 |   F0 F1 B0 .. B1 .."
    text = describe_schedule("gpipe", 2, 2)
    assert text.splitlines()[0] == "gpipe: 2 stage(s), 2 micro-batch(es)"
    assert "  stage 1: F0 F1 B0 B1   (peak in flight 2)" in text
    assert text.endswith("makespan 9 units (F=1, B=2), bubble 33%")


def test_schedule_checks_name_what_is_wrong():
    F, B = FORWARD, BACKWARD
    with pytest.raises(HSPMDError, match=r"step 2 \(F3\) names a micro-batch outside 0-2"):
        check_order([Action(F, 0), Action(B, 0), Action(F, 3)], 3)
    check_order([Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)], 2)
    with pytest.raises(HSPMDError, match="warm-up vector after ':' must be integers separated by commas"):
        schedule_for("h1f1b:2,x", 2, 0, 4)
    from hspmd.specialize.schedules import check_warmup

    for bad in ([2.0, 1], [True, 1], [2, 0]):
        with pytest.raises(HSPMDError):
            check_warmup(bad, 2)
    assert check_warmup([2, 1], 2) == (2, 1)
    # a finished stage next to two that wait for each other: the stuck ones are named
    with pytest.raises(HSPMDError, match=r"deadlocks: stage 1 at B0, stage 2 at F0 wait"):
        simulate([[Action(F, 0)], [Action(B, 0), Action(F, 0)], [Action(F, 0), Action(B, 0)]])
    empty = simulate([])
    assert (empty.makespan, empty.bubble_fraction()) == (0, 0.0)


def test_schedule_arguments_are_checked_by_name():
    with pytest.raises(HSPMDError, match="stages"):
        gpipe(0, 0, 2)
    with pytest.raises(HSPMDError, match="stage"):
        gpipe(2, -1, 2)
    with pytest.raises(HSPMDError):
        gpipe(2.0, 0, 2)
    for bad in (2.0, 0, True):
        with pytest.raises(HSPMDError, match="warm-up must be an integer >= 1"):
            one_f_one_b(2, 0, 4, warmup=bad)
    with pytest.raises(HSPMDError, match="did you mean 'eager'"):
        schedule_for("eagr", 2, 0, 2)
    assert schedule_for("h1f1b:3,2,1", 3, 0, 4) == schedule_for("1f1b", 3, 0, 4)  # 1F1B's own vector
    # ten micro-batches: two-character and three-character actions line up left
    row = render_timeline(simulate(pipeline_schedule("gpipe", 1, 11))).splitlines()[0]
    assert row.startswith("stage 0 |F0  F1  ") and "F10 B0  ..." in row
