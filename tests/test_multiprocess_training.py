"""Distributed training on real gloo processes equals single-device training (the plain-torch
reference): the loss of every step and the final weights, under GPipe and 1F1B, for DP x TP x PP
and for a heterogeneous 4-rank strategy; a checkpoint written under one strategy resumes under
another; non-blocking sends; a rank that fails mid-step fails the job with its own error."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from hspmd.errors import HSPMDError
from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.backends.backend import Backend
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.interpreter import NonBlockingSends
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

pytestmark = pytest.mark.multiprocess

SEQ, LR = 8, 1e-2
CONFIG = dict(vocab=32, hidden=16, heads=2, ffn=32)
HETERO = "layers=4 ; 2x2: R0,1 L0-3 ; 3x1: R2 L0-1 | R3 L2-3"  # TP2 pipeline 2x2 + 2-stage pipeline 3x1
PP4 = "layers=4 ; 6x1: R0 L0 | R1 L1 | R2 L2 | R3 L3"  # 4 stages, 6 micro-batches
DP_TP_PP = "layers=2 ; 3x1: R0,1 L0 | R2,3 L1 ; 3x1: R4,5 L0 | R6,7 L1"


def batches(strategy_text: str, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = MicroBatchLayout.of(parse_strategy(strategy_text)).global_batch_size
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen),
             torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen)) for _ in range(steps)]


def make_trainer(backend: Backend, text: str, schedule: str) -> Trainer:
    strategy = parse_strategy(text)
    model = build_llama(LlamaConfig(layers=strategy.num_layers, **CONFIG), [strategy], optimizer=AdamW(lr=LR))
    layout = MicroBatchLayout.of(strategy)
    return Trainer(model.graph, 0, backend, layout, schedule=schedule,
                              symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})


def train(trainer: Trainer, data) -> list[float]:
    return [trainer.step({"tokens": x, "labels": y}) for x, y in data]


def reference(data, layers: int):
    model = build_llama(LlamaConfig(layers=layers, **CONFIG), [parse_strategy(f"layers={layers} ; 1x1: R0 L0-{layers - 1}")])
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    history, final = reference_training(initial, lambda step: data[step], layers, CONFIG["heads"], len(data), lr=LR)
    return [loss for loss, _ in history], final, initial


def assert_matches_reference(losses, params, data, layers):
    ref_losses, ref_params, initial = reference(data, layers)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    # training moved the weights, so equal final weights mean something
    assert max(float((ref_params[k] - initial[k]).abs().max()) for k in initial) > LR
    for name, value in ref_params.items():
        assert_weights_close(params[name], value, LR, name)


def _weights(state_dict):
    return None if state_dict is None else {k: v for k, v in state_dict.items() if "exp_avg" not in k}


# ---- DP x TP x PP on 8 ranks ----------------------------------------------------------------------

def dp_tp_pp_rank(backend: Backend, steps: int):
    torch.set_num_threads(1)
    data = batches(DP_TP_PP, steps, seed=1)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        trainer = make_trainer(backend, DP_TP_PP, schedule)
        out[schedule] = (train(trainer, data), _weights(trainer.state_dict()), trainer.last_run.peak_in_flight)
    return out


def test_dp_tp_pp_on_eight_processes_equals_one_device_under_both_schedules():
    results = run_multiprocess(dp_tp_pp_rank, 8, 3, timeout=120)
    data = batches(DP_TP_PP, 3, seed=1)
    for schedule in ("gpipe", "1f1b"):
        losses = [r[schedule][0] for r in results]
        assert all(l == losses[0] for l in losses)  # the step loss is identical on every rank
        assert_matches_reference(losses[0], results[0][schedule][1], data, layers=2)
    # stage 0 ranks (0, 1, 4, 5) keep 2 micro-batches alive under 1F1B, all 3 under GPipe
    assert [r["1f1b"][2] for r in results] == [2, 2, 1, 1, 2, 2, 1, 1]
    assert {r["gpipe"][2] for r in results} == {3}


# ---- heterogeneous strategy, schedules, checkpoint across strategies on 4 ranks -------------------

def hetero_rank(backend: Backend, path: str):
    torch.set_num_threads(1)
    out = {}
    gpipe_run = make_trainer(backend, HETERO, "gpipe")
    out["gpipe"] = (train(gpipe_run, batches(HETERO, 3, seed=2)), _weights(gpipe_run.state_dict()))
    # 1F1B: two steps under HETERO, checkpoint, then two more under PP4 from the checkpoint
    first = make_trainer(backend, HETERO, "1f1b")
    losses = train(first, batches(HETERO, 2, seed=3))
    first.save_checkpoint(path)
    second = make_trainer(backend, PP4, "1f1b")
    resumed_at = second.load_checkpoint(path)
    losses += train(second, batches(PP4, 2, seed=4))
    out["1f1b"] = (losses, second.state_dict(), resumed_at, second.last_run.peak_in_flight, second.steps_done)
    return out


def test_heterogeneous_strategy_and_a_resume_under_another_strategy_equal_one_device():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.safetensors")
        results = run_multiprocess(hetero_rank, 4, path, timeout=120)
    assert_matches_reference(results[0]["gpipe"][0], results[0]["gpipe"][1], batches(HETERO, 3, seed=2), layers=4)
    losses, state, resumed_at, _, steps = results[0]["1f1b"]
    assert all(r["1f1b"][0] == losses for r in results)
    data = batches(HETERO, 2, seed=3) + batches(PP4, 2, seed=4)  # different batch sizes per step are fine
    assert_matches_reference(losses, state, data, layers=4)
    assert (resumed_at, steps) == (2, 4)
    assert any("exp_avg_sq" in name for name in state)  # optimizer states are checkpointed too
    # PP4 with 6 micro-batches under 1F1B: stage s keeps min(4 - s, 6) alive
    assert [r["1f1b"][3] for r in results] == [4, 3, 2, 1]


# ---- non-blocking sends ---------------------------------------------------------------------------

def both_send_first(backend: Backend, elements: int):
    """Both ranks send a large message before receiving: with sends that wait for their receiver
    (and messages bigger than the socket buffers) this pattern deadlocks."""
    peer = 1 - backend.rank
    sender = NonBlockingSends(backend)
    sender.exchange({peer: torch.full((elements,), float(backend.rank))}, {})
    got = sender.exchange({}, {peer: ((elements,), torch.float32)})[peer]
    sender.wait_sends()
    return float(got[0]), float(got[-1])


def test_neighbours_that_both_send_first_do_not_deadlock():
    results = run_multiprocess(both_send_first, 2, 8_000_000, timeout=60, comm_timeout=20)
    assert results == [(1.0, 1.0), (0.0, 0.0)]


# ---- failures -------------------------------------------------------------------------------------

class FailsMidStep(NonBlockingSends):
    """Rank 2 raises on its 3rd point-to-point exchange: in the middle of a step, while its peers
    wait for it inside communication."""

    def __init__(self, inner: Backend):
        super().__init__(inner)
        self.exchanges = 0

    def exchange(self, sends, recvs):
        self.exchanges += 1
        if self.rank == 2 and self.exchanges == 3:
            raise RuntimeError("injected failure in rank 2's pipeline stage")
        return super().exchange(sends, recvs)


def failing_rank(backend: Backend):
    torch.set_num_threads(1)
    trainer = make_trainer(FailsMidStep(backend), HETERO, "1f1b")
    return train(trainer, batches(HETERO, 3, seed=5))


def test_a_rank_failing_mid_step_fails_the_job_with_its_error_within_seconds():
    # the job's own limit (60 s) is far below the collective timeout (300 s): had the survivors waited
    # for their peers to time out, the job would end with a timeout error instead of rank 2's own
    with pytest.raises(HSPMDError) as info:
        run_multiprocess(failing_rank, 4, timeout=60, comm_timeout=300)
    message = str(info.value)
    assert message.startswith("rank 2 failed")
    assert "injected failure in rank 2's pipeline stage" in message and "Traceback" in message


def test_a_failure_report_names_every_failed_ranks_error():
    """The cause's whole traceback first; each other failed rank by its error's line, not a hint
    after it (two ranks that both timed out say on which operation each waited)."""
    from hspmd.runtime.processes.multiprocess import _failure_message

    def report(error):
        return f"Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n{error}\n(a peer rank may have crashed)\n"

    both = {0: (True, report("CommunicationError: all_reduce (wait) on group [0, 1] failed on rank 0")),
            1: (True, report("CommunicationError: recv from 0 failed on rank 1"))}
    message = _failure_message(both)
    assert message.startswith("rank 0 failed (ranks [1] failed too") and "all_reduce (wait)" in message
    assert message.endswith("rank 1: CommunicationError: recv from 0 failed on rank 1")
    cause = {**both, 2: (False, report("HSPMDError: out of memory"))}
    message = _failure_message(cause)
    assert message.startswith("rank 2 failed (ranks [0, 1] failed too") and "HSPMDError: out of memory" in message
    assert "rank 0: CommunicationError: all_reduce (wait)" in message and "rank 1: CommunicationError: recv" in message
    assert _failure_message({3: (False, "rank 3 exited with code 9 without a report")}) == (
        "rank 3 failed:\nrank 3 exited with code 9 without a report")
