"""Fuzz tests of the training entry points: the trainer's constructor, its step, its switch, the
switch planner and the micro-batch layout. A fuzzed call either works (and then gives what the
reference gives) or raises an HSPMDError before it changes anything: after a refused call the job's
weights are exactly what they were, and the next valid call works.

The job is one tiny Llama on 4 in-process ranks, built once per module (the checks are about
argument handling, not numerics; the equivalence suites cover those)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fuzzing import DEADLINE
from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.switching import plan_switch

CONFIG = LlamaConfig(layers=2, hidden=8, ffn=16, vocab=16, heads=2)
SEQ = 4
STRATEGIES = [parse_strategy("layers=2 ; 2x1: R0,1 L0 | R2,3 L1"),
              parse_strategy("layers=2 ; 1x2: R0,1 L0-1 ; 1x2: R2,3 L0-1")]
SETTINGS = settings(max_examples=60, deadline=DEADLINE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Values that break naive argument handling: wrong types, bools posing as ints, huge, negative.
JUNK = st.sampled_from([None, True, -1, 0, 2, 10**30, 1.5, float("nan"), "1", "x", b"0", (), (0,), [1, 2], {}, object()])


@pytest.fixture(scope="module")
def model():
    return build_llama(CONFIG, STRATEGIES, optimizer=AdamW(lr=1e-2))


@pytest.fixture(scope="module")
def job(model):
    return InProcessJob(model.graph, 0, STRATEGIES[0], symbols={"S": SEQ, "T": _rows() * SEQ}, timeout=30)


def _rows(strategy=STRATEGIES[0]) -> int:
    return strategy.global_batch_size


def _batch(rows: int = None, seq: int = SEQ, seed: int = 0) -> dict[str, torch.Tensor]:
    rows = _rows() if rows is None else rows
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, CONFIG.vocab, (rows, seq), generator=g),
            "labels": torch.randint(0, CONFIG.vocab, (rows, seq), generator=g)}


def _refused(call) -> bool:
    """True if `call` raised an HSPMDError; any other exception fails the test."""
    try:
        call()
    except HSPMDError as e:
        assert str(e).strip(), "an HSPMDError without a message"
        event(f"refused: {type(e).__name__}")
        return True
    event("accepted")
    return False


def _weights(job) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in job.parameters().items()}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@st.composite
def broken_batches(draw):
    """A valid batch with one or two faults: a missing or extra key, a wrong dtype, shape, value
    range, a non-tensor, NaN, an empty tensor."""
    batch = _batch(seed=draw(st.integers(0, 3)))
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(["tokens", "labels"]))
        fault = draw(st.sampled_from(["missing", "extra", "float", "bool", "rows", "seq", "dims", "scalar",
                                      "negative", "too_large", "list", "numpy", "empty", "none", "huge", "keep"]))
        value = _batch()[key]
        if fault == "missing":
            batch.pop(key, None)
        elif fault == "extra":
            batch["positions"] = value
        elif fault == "float":
            batch[key] = value.float() + 0.5
        elif fault == "bool":
            batch[key] = value > 3
        elif fault == "rows":
            batch[key] = value[: draw(st.integers(0, value.shape[0] - 1))]
        elif fault == "seq":
            batch[key] = value[:, : draw(st.integers(0, SEQ - 1))]
        elif fault == "dims":
            batch[key] = value.unsqueeze(-1)
        elif fault == "scalar":
            batch[key] = torch.tensor(3)
        elif fault == "negative":
            batch[key] = value - CONFIG.vocab - 200
        elif fault == "too_large":
            batch[key] = value + CONFIG.vocab
        elif fault == "list":
            batch[key] = value.tolist()
        elif fault == "numpy":
            batch[key] = value.numpy()
        elif fault == "empty":
            batch[key] = value[:0, :0]
        elif fault == "none":
            batch[key] = None
        elif fault == "huge":
            batch[key] = torch.full_like(value, 2**62)
    return batch


@SETTINGS
@given(broken_batches())
def test_a_broken_batch_is_refused_before_anything_changes(job, batch):
    before = _weights(job)
    if _refused(lambda: job.step(batch)):
        assert _same(_weights(job), before), "a refused step changed the weights"
    else:
        loss = job.step(_batch())
        assert math.isfinite(loss)


@SETTINGS
@given(st.one_of(JUNK, st.lists(st.integers(-2, 4), max_size=3), st.tuples(st.integers(-3, 3), st.integers(-3, 3))),
       st.one_of(JUNK, st.lists(st.integers(-2, 4), max_size=3), st.tuples(st.integers(-3, 3), st.integers(-3, 3))))
def test_micro_batch_layouts_are_valid_or_refused(counts, sizes):
    try:
        layout = MicroBatchLayout(counts, sizes)
    except HSPMDError:
        event("refused")
        return
    event("accepted")
    assert all(isinstance(c, int) and c >= 1 for c in layout.counts + layout.sizes)
    assert layout.global_batch_size == sum(c * s for c, s in zip(layout.counts, layout.sizes))


@st.composite
def trainer_arguments(draw):
    """Constructor arguments with one fault: a strategy index, a layout, a schedule, symbols, a seed."""
    arguments = {"strategy": 0, "layout": STRATEGIES[0], "schedule": "1f1b", "symbols": {"S": SEQ, "T": 8 * SEQ},
                 "seed": 0}
    key = draw(st.sampled_from(sorted(arguments)))
    if key == "strategy":
        value = draw(JUNK | st.integers(-3, 5))
    elif key == "layout":
        value = draw(JUNK | st.builds(MicroBatchLayout, st.tuples(st.integers(1, 3)), st.tuples(st.integers(1, 3)))
                     | st.just(STRATEGIES[1]) | st.just(MicroBatchLayout((1, 1), (1, 1))))
    elif key == "schedule":
        value = draw(JUNK | st.sampled_from(["gpipe", "1F1B", "", "h1f1b:5,2,1", "h1f1b:", "h1f1b:0", "h1f1b:x",
                                             "h1f1b:1,1,1", "eager", "virtual", "h1f1b:99999999999999999999"]))
    elif key == "symbols":
        value = draw(JUNK | st.dictionaries(st.sampled_from(["S", "T", "B", "Q", ""]), JUNK | st.integers(-2, 64),
                                            max_size=3))
    else:
        value = draw(JUNK | st.integers(-(2**70), 2**70))
    return {**arguments, key: value}


@SETTINGS
@given(trainer_arguments())
def test_trainer_arguments_give_a_trainer_or_an_hspmd_error(model, arguments):
    made = []

    def build():
        made.append(InProcessJob(model.graph, arguments["strategy"], arguments["layout"], arguments["schedule"],
                                 arguments["symbols"], arguments["seed"], timeout=30))

    if not _refused(build):
        trainer = made[0].trainers[0]
        batch = _batch(trainer.layout.global_batch_size, trainer.binding.mapping.get("S", SEQ))
        losses = []
        if not _refused(lambda: losses.append(made[0].step(batch))):  # e.g. T left unbound: refused by name
            assert math.isfinite(losses[0])


@st.composite
def switch_arguments(draw):
    arguments = {"strategy": 1, "layout": STRATEGIES[1], "schedule": None, "failed": ()}
    key = draw(st.sampled_from(sorted(arguments)))
    if key == "strategy":
        value = draw(JUNK | st.integers(-3, 5))
    elif key == "layout":
        value = draw(JUNK | st.just(STRATEGIES[0]) | st.just(MicroBatchLayout((1,), (2,))))
    elif key == "schedule":
        value = draw(JUNK | st.sampled_from(["gpipe", "bogus", "h1f1b:3"]))
    else:
        value = draw(JUNK | st.lists(st.integers(-2, 6) | JUNK, max_size=3))
    return {**arguments, key: value}


@SETTINGS
@given(switch_arguments())
def test_switch_arguments_switch_or_refuse_losing_nothing(job, arguments):
    before = _weights(job)
    switched = []

    def switch():
        switched.append(job.switch(arguments["strategy"], arguments["layout"], arguments["schedule"],
                                   arguments["failed"]))

    if _refused(switch):
        assert _same(_weights(job), before), "a refused switch changed the weights"
        job.step(_batch())
    else:
        assert _same(_weights(job), before), "a switch changed the weights"
        back = job.switch(0, STRATEGIES[0], "1f1b")
        assert _same(_weights(back), before)


@SETTINGS
@given(st.integers(0, 1) | JUNK | st.integers(-2, 3), st.integers(0, 1) | JUNK | st.integers(-2, 3),
       st.just(()) | JUNK | st.lists(st.integers(-2, 6) | JUNK, max_size=3))
def test_plan_switch_arguments_give_a_plan_or_an_hspmd_error(model, src, dst, failed):
    plans = []
    if not _refused(lambda: plans.append(plan_switch(model.graph, src, dst, failed=failed))):
        leaves = model.graph.nodes_of_kind("parameter", "state")
        assert (plans[0].src_strategy, plans[0].dst_strategy) == (src, dst)
        assert set(plans[0].names) <= {n.name for n in leaves}
        assert bool(plans[0].names) == (src != dst), "a switch between different strategies moves leaves"
