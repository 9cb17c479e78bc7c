"""Activation recomputation (Stage.recompute) and per-pipeline schedules (Pipeline.schedule) as the
runtime runs them: a recomputed stage keeps only its inputs between a micro-batch's forward and
backward and runs the forward again in the backward. Loss, every synchronised gradient and the
updated weights equal the run without recomputation and the single-device torch reference; the
activation bytes kept per stage really shrink."""

from __future__ import annotations

import pytest
import torch

from hspmd.errors import HSPMDError
from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.specialize.strategy import Strategy
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

SEQ, STEPS, LR = 8, 2, 1e-2
CONFIG = dict(vocab=32, hidden=16, heads=2, ffn=32)
# TP2 stage then a TP1 stage (two-way resharding between them), a second pipeline of one stage
MIXED = "layers=4 ; 3x1 h1f1b=3,1: R0,1 L0-1 {a} | R2 L2-3 {b} ; 2x1: R3 L0-3 {c}"


def strategy_of(flags: str) -> Strategy:
    a, b, c = ("recompute" if f == "1" else "" for f in flags)
    return parse_strategy(MIXED.format(a=a, b=b, c=c))


def data(strategy: Strategy):
    rows = strategy.global_batch_size
    gen = torch.Generator().manual_seed(11)
    return [(torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen),
             torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen)) for _ in range(STEPS)]


def train(strategy: Strategy, schedule: str | None = None):
    model = build_llama(LlamaConfig(layers=strategy.num_layers, **CONFIG), [strategy], optimizer=AdamW(lr=LR))
    job = InProcessJob(model.graph, 0, strategy, schedule, symbols={"S": SEQ, "T": strategy.global_batch_size * SEQ})
    history = []
    for tokens, labels in data(strategy):
        loss = job.step({"tokens": tokens, "labels": labels})
        history.append((loss, job.gradients()))
    runs = {rank: t.last_run for rank, t in job.trainers.items()}
    return history, job.parameters(), runs, job


def reference(strategy: Strategy):
    model = build_llama(LlamaConfig(layers=strategy.num_layers, **CONFIG), [strategy])
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    batches = data(strategy)
    return reference_training(initial, lambda step: batches[step], strategy.num_layers, CONFIG["heads"], STEPS, lr=LR)


@pytest.fixture(scope="module")
def plain():
    return train(strategy_of("000"))


@pytest.mark.parametrize("flags", ["111", "100", "010"])
def test_recomputed_stages_train_exactly_like_kept_activations_and_like_one_device(plain, flags):
    strategy = strategy_of(flags)
    history, params, runs, job = train(strategy)
    base_history, base_params, base_runs, _ = plain
    ref_history, ref_final = reference(strategy)
    for (loss, grads), (base_loss, base_grads), (ref_loss, ref_grads) in zip(history, base_history, ref_history):
        # recomputation runs the same ops on the same values: equal to the bit
        assert loss == base_loss
        assert set(grads) == set(base_grads) == set(ref_grads)
        for name, grad in grads.items():
            assert torch.equal(grad, base_grads[name]), name
            scale = float(ref_grads[name].abs().max())
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-4 * scale, msg=name)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for name, value in ref_final.items():
        assert torch.equal(params[name], base_params[name]), name
        assert_weights_close(params[name], value, LR, name)
    recomputing = {r for p in strategy.pipelines for s in p.stages if s.recompute for r in s.ranks}
    assert {r for r, t in job.trainers.items() if t.recompute is not None} == recomputing
    for rank, run in runs.items():
        assert run.peak_in_flight == base_runs[rank].peak_in_flight
        if rank in recomputing:
            # only the stage's inputs (tokens/labels pieces, received activations) stay: far less
            assert run.peak_held_bytes * 4 < base_runs[rank].peak_held_bytes, rank
        else:
            assert run.peak_held_bytes == base_runs[rank].peak_held_bytes, rank


def test_the_pipeline_schedule_of_the_strategy_runs_unless_the_trainer_names_one(plain):
    _, _, runs, job = plain
    # pipeline 0: h1f1b with warm-up (3, 1); pipeline 1 has none: the trainer's default, 1f1b
    assert [job.trainers[r].schedule for r in range(4)] == ["h1f1b:3,1"] * 3 + ["1f1b"]
    assert [runs[r].peak_in_flight for r in range(4)] == [3, 3, 1, 1]
    history, _, gpipe_runs, gpipe_job = train(strategy_of("000"), schedule="gpipe")
    assert {t.schedule for t in gpipe_job.trainers.values()} == {"gpipe"}
    assert [gpipe_runs[r].peak_in_flight for r in range(4)] == [3, 3, 3, 2]
    assert [loss for loss, _ in history] == pytest.approx([loss for loss, _ in plain[0]], rel=1e-6)


def test_a_strategy_that_is_not_the_graphs_is_refused():
    built = strategy_of("100")
    other = parse_strategy("layers=4 ; 3x1 1f1b=2,1: R0 L0-2 recompute | R1,2 L3 ; 2x1: R3 L0-3")
    model = build_llama(LlamaConfig(layers=4, **CONFIG), [built], optimizer=AdamW(lr=LR))
    with pytest.raises(HSPMDError, match=r"declares stages .* but the graph runs stages"):
        InProcessJob(model.graph, 0, other, symbols={"S": SEQ, "T": 5 * SEQ}, timeout=10)
    # the layer split differs but the stage devices agree: flags apply, as the devices run them
    InProcessJob(model.graph, 0, parse_strategy("layers=4 ; 3x1: R0,1 L0 recompute | R2 L1-3 ; 2x1: R3 L0-3"),
                 symbols={"S": SEQ, "T": 5 * SEQ}, timeout=10)


# ---- real processes ------------------------------------------------------------------------------

def gloo_rank(backend, texts):
    from hspmd.runtime.training.trainer import Trainer

    torch.set_num_threads(1)
    out = {}
    for key, text in texts.items():
        strategy = parse_strategy(text)
        model = build_llama(LlamaConfig(layers=strategy.num_layers, **CONFIG), [strategy], optimizer=AdamW(lr=LR))
        trainer = Trainer(model.graph, 0, backend, strategy, symbols={"S": SEQ, "T": strategy.global_batch_size * SEQ})
        losses = [trainer.step({"tokens": x, "labels": y}) for x, y in data(strategy)]
        grads = trainer.gradients()
        state = trainer.state_dict()
        params = None if state is None else {n.name: state[n.name] for n in model.graph.parameters}
        out[key] = (losses, grads, params, trainer.last_run)
    return out


@pytest.mark.multiprocess
def test_recompute_on_four_gloo_processes_equals_kept_activations_and_one_device():
    from hspmd.runtime.processes.multiprocess import run_multiprocess

    texts = {"plain": MIXED.format(a="", b="", c=""), "recompute": MIXED.format(a="recompute", b="recompute", c="")}
    results = run_multiprocess(gloo_rank, 4, texts, timeout=180)
    losses, grads, params, _ = results[0]["recompute"]
    base_losses, base_grads, base_params, _ = results[0]["plain"]
    assert all(r["recompute"][0] == losses for r in results)
    assert losses == base_losses
    assert all(torch.equal(grads[k], base_grads[k]) for k in grads) and set(grads) == set(base_grads)
    assert all(torch.equal(params[k], base_params[k]) for k in params)
    ref_history, ref_final = reference(strategy_of("110"))
    assert losses == pytest.approx([loss for loss, _ in ref_history], rel=1e-5, abs=1e-6)
    for name, value in ref_final.items():
        assert_weights_close(params[name], value, LR, name)
    for rank in range(3):  # the recomputed stages keep far fewer activation bytes; rank 3 does not recompute
        assert results[rank]["recompute"][3].peak_held_bytes * 4 < results[rank]["plain"][3].peak_held_bytes
    assert results[3]["recompute"][3].peak_held_bytes == results[3]["plain"][3].peak_held_bytes
