"""Mixed-length training (Hetu v2 §7.3): per-step strategies from a pool, dispatch, packed rows
and switches (Hetu-B), and length buckets inside a step (Hetu-A). Per-step loss and final weights
equal a single-device torch run over the same sequences, each alone, token-weighted."""

import pytest
import torch

from hspmd.backends.local import LocalWorld
from hspmd.errors import HSPMDError
from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.planning.dispatch import PipelineCost, PoolEntry
from hspmd.runtime.policies.mixed import MixedLengthTrainer
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

LR = 1e-2
CONFIG = dict(layers=2, vocab=32, hidden=16, heads=2, ffn=32)
# S1: a TP2 pipeline on ranks 0,1 for long sequences + single-rank pipelines 2 and 3; S2: PP2 pipelines 0->1, 2->3
S1 = "layers=2 ; ?x?: R0,1 L0-1 ; ?x?: R2 L0-1 ; ?x?: R3 L0-1"
S2 = "layers=2 ; ?x?: R0 L0 | R1 L1 ; ?x?: R2 L0 | R3 L1"
THRESHOLD = 12
POOL = (
    PoolEntry("S1", 0, 32, (PipelineCost(1e-3, 0.5, 0.5, 32), PipelineCost(2e-3, 1.0, 0.5, 12),
                            PipelineCost(2e-3, 1.0, 0.5, 12))),
    PoolEntry("S2", 1, THRESHOLD, (PipelineCost(2e-3, 0.5, 0.5, 16, 2), PipelineCost(2e-3, 0.5, 0.5, 16, 2))),
)
# per step: lengths; the longest alternates around the threshold (S1, S2, S1, S1, S2, S1)
STEPS = ([20, 5, 3, 7, 4], [10, 6, 3, 8, 2], [13, 9, 2, 2, 11, 4], [25, 3], [12, 12, 1], [30, 6, 5, 9])
EXPECTED = ["S1", "S2", "S1", "S1", "S2", "S1"]


def sequences(steps=STEPS, seed=11):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lengths in steps:
        step = []
        for n in lengths:
            ids = torch.randint(0, CONFIG["vocab"], (n + 1,), generator=gen)
            step.append((ids[:-1], ids[1:]))
        out.append(step)
    return out


# S3: PP2 pipeline 0->1 and a single-rank pipeline on rank 2; rank 3 is idle under it
S3 = "layers=2 ; ?x?: R0 L0 | R1 L1 ; ?x?: R2 L0-1"
POOL_LEAVING_OUT = (POOL[0], PoolEntry("S3", 1, THRESHOLD, (PipelineCost(2e-3, 0.5, 0.5, 16, 2),
                                                               PipelineCost(2e-3, 1.0, 0.5, 12))))


def _graph(strategies=(S1, S2)):
    return build_llama(LlamaConfig(**CONFIG), [parse_strategy(s) for s in strategies], optimizer=AdamW(lr=LR),
                       packed=True)


def mixed_rank(backend, buckets: bool, pool=POOL, strategies=(S1, S2)):
    torch.set_num_threads(1)
    model = _graph(strategies)
    trainer = MixedLengthTrainer(model.graph, pool, backend, symbols={"S": 8, "T": 8}, passes=10)
    data = sequences()
    losses = [(trainer.step_buckets if buckets else trainer.step)(samples) for samples in data]
    history = [([pool[k].name for k in r.entries], list(r.switches)) for r in trainer.history]
    return losses, trainer.parameters(), history


def _reference():
    model = _graph()
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    data = sequences()
    return reference_training(initial, lambda s: list(data[s]), CONFIG["layers"], CONFIG["heads"], len(data), lr=LR)


def _check(results):
    losses, params, history = results[0]
    assert all(r[0] == losses for r in results.values())  # the same loss on every rank
    ref_history, final = _reference()
    for step, (loss, (ref_loss, _)) in enumerate(zip(losses, ref_history)):
        assert loss == pytest.approx(ref_loss, abs=1e-5, rel=1e-5), step
    for name, value in final.items():
        assert_weights_close(params[name], value, LR, name)
    return history


def test_per_step_strategies_in_process():
    results = LocalWorld(range(4), 120).run(lambda b: mixed_rank(b, False))
    history = _check(results)
    assert [names[0] for names, _ in history] == EXPECTED
    switches = [sw for _, sw in history]
    # a switch exactly where the chosen strategy changes, none elsewhere
    assert switches == [[], [("S1", "S2")], [("S2", "S1")], [], [("S1", "S2")], [("S2", "S1")]]


def test_length_buckets_inside_a_step_in_process():
    # Hetu-A: buckets by length, gradient accumulation across strategies, moved with the weights
    results = LocalWorld(range(4), 120).run(lambda b: mixed_rank(b, True))
    history = _check(results)
    for (names, _switches), lengths in zip(history, STEPS):
        wanted = {"S1" if s > THRESHOLD else "S2" for s in lengths}
        assert set(names) == wanted and len(names) == len(wanted)
    total = sum(len(sw) for _, sw in history)
    # each step's first bucket runs under the strategy the last step ended with where it has one
    assert total == sum(len(n) for n, _ in history) - 1 - sum(
        1 for (names, _), (prev, _) in zip(history[1:], history) if names[0] == prev[-1])


def test_length_buckets_with_a_strategy_that_leaves_a_rank_out():
    # rank 3 is idle under S3's buckets: active then idle (step 0: S1 first), idle then active
    # (step 2: S3, the current strategy, first); every rank still gets the whole step loss
    results = LocalWorld(range(4), 120).run(lambda b: mixed_rank(b, True, POOL_LEAVING_OUT, (S1, S3)))
    history = _check(results)
    orders = [names for names, _ in history]
    assert ["S1", "S3"] in orders and ["S3", "S1"] in orders


def _switching_rank(backend):
    torch.set_num_threads(1)
    trainer = MixedLengthTrainer(_graph().graph, POOL, backend, symbols={"S": 8, "T": 8}, passes=10)
    data = sequences()
    trainer.step(data[0])  # S1
    s1 = trainer.trainer
    trainer.step(data[1])  # S1 -> S2: planned
    first, s2 = trainer.trainer.last_switch, trainer.trainer
    released = not s1.state.leaves  # the S1 trainer gave its weights away and keeps only its program
    trainer.step(data[2])  # S2 -> S1: planned, into the S1 trainer built before
    back = trainer.trainer is s1 and not s2.state.leaves and bool(s1.state.leaves)
    trainer.step(data[4])  # S1 -> S2 again: the kept plan, the kept trainer
    again = trainer.trainer.last_switch
    refused = []
    for bad in ({"plan": again}, {"reuse": s2}):  # for other strategies: refused before anything moves
        try:
            trainer.trainer.switch(0, trainer._layout(0), **bad)
        except HSPMDError as e:
            refused.append(str(e))
    return first is again and trainer.trainer is s2, released and back, sorted(trainer._switch_plans), refused, \
        trainer.parameters()


def test_a_switch_back_reuses_its_plan_and_trainer_and_ones_for_other_strategies_are_refused():
    results = LocalWorld(range(4), 120).run(_switching_rank)
    same, reused, keys, refused, params = results[0]
    assert same and reused and keys == [(0, 1, False), (1, 0, False)]
    for r in results.values():
        assert len(r[3]) == 2 and "not a switch plan from strategy 1 to 0" in r[3][0]
        assert "not one of strategy 0" in r[3][1]
    assert params is not None  # the refused switches left a working trainer (parameters gathered)


@pytest.mark.multiprocess
def test_per_step_strategies_on_four_gloo_processes():
    results = run_multiprocess(mixed_rank, 4, False, timeout=240)
    history = _check(dict(enumerate(results)))
    assert [names[0] for names, _ in history] == EXPECTED
    assert [sw for _, sw in history] == [[], [("S1", "S2")], [("S2", "S1")], [], [("S1", "S2")], [("S2", "S1")]]


@pytest.mark.multiprocess
def test_length_buckets_on_four_gloo_processes():
    results = run_multiprocess(mixed_rank, 4, True, timeout=240)
    _check(dict(enumerate(results)))


def _calibrating_rank(backend):
    torch.set_num_threads(1)
    model = _graph()
    trainer = MixedLengthTrainer(model.graph, POOL, backend, symbols={"S": 8, "T": 8}, passes=10, by_cost=True)
    trainer.step(sequences()[0])
    before = trainer.parameters()
    pool = trainer.calibrate(lengths=(2, 4, 8, 12), repeats=1)
    after = trainer.parameters()
    losses = [trainer.step(samples) for samples in sequences()[1:3]]
    return pool, trainer.switch_seconds, before, after, losses, trainer.current


def test_calibration_measures_every_entry_without_changing_the_weights():
    results = LocalWorld(range(4), 120).run(_calibrating_rank)
    pool, switch_seconds, before, after, losses, current = results[0]
    assert all(r[0] == pool and r[1] == switch_seconds and r[4] == losses for r in results.values())
    assert [e.name for e in pool] == [e.name for e in POOL]
    assert current == 0  # calibration ends where it began (step 0 chose S1)
    for entry, old in zip(pool, POOL):
        assert [p.max_tokens for p in entry.pipelines] == [p.max_tokens for p in old.pipelines]
        assert all(p.a >= 0 and p.b >= 0 and p.c >= 0 for p in entry.pipelines) and entry.sync >= 0
        assert any(p.sequence(12) + p.c > 0 for p in entry.pipelines)  # something was measured
        assert (entry.pipelines[0].a, entry.pipelines[0].b) != (old.pipelines[0].a, old.pipelines[0].b)
    assert switch_seconds > 0
    for name, value in before.items():  # forward, backward and sync only: no update, no drift
        assert torch.equal(value, after[name]), name
