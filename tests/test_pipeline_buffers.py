"""What a pipeline stage holds while it runs its schedule: 1F1B keeps a posted send only until its
receiver has it (not to the end of the order), and the in-flight figures are measured on the
buffers themselves (activation storages, send buffers), in-process and on gloo processes."""

from __future__ import annotations

import pytest
import torch

from hspmd.backends.backend import Backend
from hspmd.backends.local import run_on_devices
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import SGD
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy

SEQ = 4
PP3 = "layers=3 ; 6x1: R0 L0 | R1 L1 | R2 L2"  # 3 stages, 6 micro-batches


def _run(backend: Backend, text: str, schedule: str):
    torch.set_num_threads(1)
    strategy = parse_strategy(text)
    layout = MicroBatchLayout.of(strategy)
    config = LlamaConfig(layers=strategy.num_layers, hidden=16, ffn=32, vocab=16, heads=2)
    model = build_llama(config, [strategy], optimizer=SGD(lr=0.1))
    trainer = Trainer(model.graph, 0, backend, strategy, schedule=schedule,
                      symbols={"S": SEQ, "T": SEQ * layout.global_batch_size})
    tokens = torch.arange(SEQ * layout.global_batch_size).reshape(-1, SEQ) % config.vocab
    loss = trainer.step({"tokens": tokens, "labels": tokens.flip(1)})
    run = trainer.last_run
    return trainer.stage, run.peak_in_flight, run.peak_pending_sends, run.peak_held_bytes, loss


def test_held_bytes_are_measured_on_the_activations_and_scale_with_the_micro_batches_in_flight():
    """Equal micro-batches hold equal activations: with one micro-batch a stage holds a + c bytes
    (c: what all micro-batches share, the RoPE tables and causal mask), with all 6 in flight under
    GPipe 6a + c, so under 1F1B, with 3 - stage in flight, it must hold exactly (3 - stage) a + c:
    the figure comes from the tensors, and shrinks with them."""
    one = run_on_devices(lambda b: _run(b, PP3.replace("6x1", "1x1"), "gpipe"), range(3))
    out = {s: run_on_devices(lambda b: _run(b, PP3, s), range(3)) for s in ("gpipe", "1f1b")}
    for rank in range(3):
        stage, gpipe_count, _, gpipe_bytes, _ = out["gpipe"][rank]
        _, count, pending, held, _ = out["1f1b"][rank]
        single = one[rank][3]
        assert (gpipe_count, count, one[rank][1]) == (6, 3 - stage, 1)
        assert pending == 0  # the in-process backend's sends are copies in the receiver's mailbox
        per_micro_batch, rest = divmod(gpipe_bytes - single, 5)
        assert rest == 0 and per_micro_batch > 0
        assert held == single + (count - 1) * per_micro_batch
    assert out["gpipe"][0][4] == pytest.approx(out["1f1b"][0][4], rel=1e-6)


def gloo_rank(backend: Backend):
    return _run(backend, PP3, "1f1b")


@pytest.mark.multiprocess
def test_1f1b_keeps_sends_only_until_received_on_gloo():
    """Stage s posts one activation send per forward and one gradient send per backward; a
    forward's are completed after its micro-batch's backward, a backward's after the next
    backward, so at most 3 - s + 1 are held at once (before: all 6 or 12, until the end)."""
    results = run_multiprocess(gloo_rank, 3, timeout=120)
    for stage, count, pending, held, _ in results:
        assert count == 3 - stage
        assert pending <= count + (stage > 0)
        assert held > 0
    assert results[0][2] >= 1  # stage 0 did hold posted sends: the count is of real buffers
    assert len({r[4] for r in results}) == 1
