"""Mixed precision (build_llama(compute_dtype=torch.bfloat16)): bf16 compute with float32 master
weights and float32 optimizer states, against the single-device torch reference under the same
rules (reference_training(compute_dtype=torch.bfloat16): bf16 copies of the fp32 parameters, logits
back to fp32 for the loss, fp32 gradients into torch.optim.AdamW).

Two bf16 programs that sum in different orders (micro-batches, TP partial sums, another matmul
split) differ by bf16 rounding, about 1e-2 of a gradient's norm here; so the parallel comparisons
use tolerances at that scale, and the exact ones are made where the order is the same: one device,
one micro-batch gives the reference's bf16 loss to float32 precision (an fp32 run is 1e-4 away)."""

from __future__ import annotations

import pytest
import torch

from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import SGD, AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy

SEQ, STEPS, LR = 8, 3, 1e-3
OPTIONS = dict(kv_heads=2, tie_embeddings=True)
HETERO = "layers=2 ; 2x2: R0,1 L0-1 ; 2x1: R2 L0 | R3 L1"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _setup(text, optimizer=None):
    strategy = parse_strategy(text)
    config = LlamaConfig(layers=strategy.num_layers, **OPTIONS)
    model = build_llama(config, [strategy], optimizer=optimizer or AdamW(lr=LR), compute_dtype=torch.bfloat16)
    layout = MicroBatchLayout.of(strategy)
    rows = layout.global_batch_size
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, config.vocab, (rows, SEQ), generator=gen),
                torch.randint(0, config.vocab, (rows, SEQ), generator=gen)) for _ in range(STEPS)]
    return config, model, layout, batches


def _reference(config, model, batches, dtype=torch.bfloat16):
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    history, final = reference_training(initial, lambda step: batches[step], config.layers, config.heads, STEPS,
                                        lr=LR, compute_dtype=dtype)
    return initial, history, final


def test_precision_rules_in_the_graph():
    """Masters and optimizer states fp32; layer compute and its communication bf16; the loss and
    every gradient that is synchronised and applied fp32."""
    _, model, _, _ = _setup(HETERO)
    g = model.graph
    assert {n.output.dtype for n in g.nodes if n.kind in ("parameter", "state")} == {torch.float32}
    assert {n.output.dtype for n in g.nodes if n.kind == "matmul"} == {torch.bfloat16}
    assert {n.output.dtype for n in g.nodes if n.opdef.is_comm and n.name.endswith((".attn.out", ".mlp.out"))} == {
        torch.bfloat16}
    assert {t.dtype for t in g.gradients.values()} == {torch.float32}
    assert model.loss.dtype == torch.float32 and model.logits.dtype == torch.float32


def test_one_device_gives_the_references_bf16_loss():
    config, model, layout, batches = _setup("layers=2 ; 1x2: R0 L0-1")
    job = InProcessJob(model.graph, 0, layout, symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
    _, history, _ = _reference(config, model, batches)
    _, fp32, _ = _reference(config, model, batches, torch.float32)
    loss = job.step({"tokens": batches[0][0], "labels": batches[0][1]})
    assert loss == pytest.approx(history[0][0], rel=1e-6)
    assert loss != pytest.approx(fp32[0][0], rel=1e-5)  # the precision rules are what makes it equal
    gradients = job.gradients()
    for name, grad in history[0][1].items():
        assert gradients[name].dtype == torch.float32
        assert _relative(gradients[name], grad) < 3e-2, name


@pytest.mark.parametrize("text", [
    "layers=2 ; 2x1: R0 L0-1 ; 2x1: R1 L0-1",  # DP
    "layers=2 ; 2x2: R0,1 L0-1",  # TP (K/V heads sharded)
    "layers=2 ; 2x1: R0 L0 | R1 L1",  # PP (the tied table crosses stages in bf16)
    HETERO,  # TP2 next to a 2-stage pipeline
])
def test_bf16_training_matches_the_bf16_reference(text):
    config, model, layout, batches = _setup(text)
    job = InProcessJob(model.graph, 0, layout, symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
    initial, history, final = _reference(config, model, batches)
    for step in range(STEPS):
        loss = job.step({"tokens": batches[step][0], "labels": batches[step][1]})
        ref_loss, ref_grads = history[step]
        assert loss == pytest.approx(ref_loss, rel=2e-3)
        gradients = job.gradients()
        for name, grad in ref_grads.items():
            assert _relative(gradients[name], grad) < 5e-2, (step, name)
    params = job.parameters()
    for name, value in final.items():
        assert params[name].dtype == torch.float32
        # AdamW's per-element normalisation magnifies bf16 rounding in small gradient elements
        assert _relative(params[name] - initial[name], value - initial[name]) < 0.2, name


def test_master_weights_keep_updates_below_bf16_resolution():
    """SGD steps far below bf16's spacing at the weights' scale: bf16 weights could not move, the
    fp32 masters do (by exactly the fp32 update of the fp32 gradient)."""
    _, model, layout, batches = _setup("layers=2 ; 1x2: R0 L0-1", optimizer=SGD(lr=1e-5))
    job = InProcessJob(model.graph, 0, layout, symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
    before = job.parameters()
    job.step({"tokens": batches[0][0], "labels": batches[0][1]})
    gradients, after = job.gradients(), job.parameters()
    for name, w in before.items():
        if w.ndim == 2:  # (norm weights sit at 1.0, where even fp32's spacing is near these steps)
            assert (after[name] != w).float().mean() > 0.5, name
        assert torch.equal(after[name], torch.add(w, gradients[name], alpha=-1e-5)), name
        assert (after[name].bfloat16() == w.bfloat16()).float().mean() > 0.9, name


def _gloo_rank(backend, text):
    torch.set_num_threads(1)
    config, model, layout, batches = _setup(text)
    trainer = Trainer(model.graph, 0, backend, layout, symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
    losses = [trainer.step({"tokens": x, "labels": y}) for x, y in batches]
    return losses, trainer.gradients()


@pytest.mark.multiprocess
def test_bf16_on_gloo_processes_matches_the_bf16_reference():
    """bf16 activations and gradients through gloo's collectives and sends (4 real processes)."""
    results = run_multiprocess(_gloo_rank, 4, HETERO, timeout=240)
    config, model, _, batches = _setup(HETERO)
    _, history, _ = _reference(config, model, batches)
    for losses, _ in results:
        assert losses == pytest.approx([loss for loss, _ in history], rel=2e-3)
    for name, grad in history[-1][1].items():
        assert _relative(results[0][1][name], grad) < 5e-2, name
