"""The issue's whole path on 4 real gloo processes: a Hugging Face Llama with GQA (one K/V head,
replicated under TP2), tied embeddings and Llama 3.1 RoPE scaling goes in under a heterogeneous
strategy (a TP2 pipeline next to a 2-stage pipeline), its loss and gradients equal transformers',
it trains, is saved, exported, and transformers loads the export with hspmd's logits."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from hspmd.backends.backend import Backend  # noqa: E402
from hspmd.models.hf_llama import hf_names, read_hf_config  # noqa: E402
from hspmd.models.llama import build_llama  # noqa: E402
from hspmd.ops import AdamW  # noqa: E402
from hspmd.runtime.execution.batches import MicroBatchLayout  # noqa: E402
from hspmd.runtime.persistence.checkpoint import CheckpointReader  # noqa: E402
from hspmd.runtime.persistence.hf_checkpoint import HFCheckpoint, export_checkpoint  # noqa: E402
from hspmd.runtime.processes.multiprocess import run_multiprocess  # noqa: E402
from hspmd.runtime.training.trainer import Trainer  # noqa: E402
from hspmd.specialize.strategy_text import parse_strategy  # noqa: E402

from test_hf_llama import LLAMA31, S, hf_reference, hspmd_one_device, make_hf_model  # noqa: E402

pytestmark = pytest.mark.multiprocess

HETERO = "layers=2 ; 2x2: R0,1 L0-1 ; 2x1: R2 L0 | R3 L1"  # 6 sequences a step, split 4:2
ROWS = 6


def rank_main(backend: Backend, hf_dir: str, checkpoint: str, z: torch.Tensor):
    """Import, train 2 AdamW steps on z, save; the first step's loss and synchronised gradients."""
    torch.set_num_threads(1)
    config = read_hf_config(hf_dir)
    strategy = parse_strategy(HETERO)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=1e-2))
    layout = MicroBatchLayout.of(strategy)
    trainer = Trainer(model.graph, 0, backend, layout, symbols={"S": S, "T": ROWS * S})
    assert trainer.load_checkpoint(HFCheckpoint(hf_dir)) == 0
    loss = trainer.step({"tokens": z[:, :S], "labels": z[:, 1:]})
    grads = trainer.gradients()
    trainer.step({"tokens": z[:, :S], "labels": z[:, 1:]})
    trainer.save_checkpoint(checkpoint)
    return loss, grads


def test_hf_llama_in_heterogeneous_training_and_out(tmp_path):
    hf_dir, checkpoint = tmp_path / "hf", tmp_path / "run" / "checkpoint.safetensors"
    hf = make_hf_model(hf_dir, num_key_value_heads=1, head_dim=12, tie_word_embeddings=True, rope_scaling=LLAMA31)
    z = torch.randint(0, 64, (ROWS, S + 1), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_loss, ref_grads = hf_reference(hf, z)

    results = run_multiprocess(rank_main, 4, str(hf_dir), str(checkpoint), z, timeout=300)
    losses = [loss for loss, _ in results]
    assert losses == pytest.approx([ref_loss] * 4, rel=1e-5)
    config, grads = read_hf_config(hf_dir), results[0][1]
    names = hf_names(config)
    assert {names[n].name for n in grads} == set(ref_grads)
    for name, g in grads.items():
        ours = g.t() if names[name].transposed else g
        ref = ref_grads[names[name].name]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()), msg=name)

    # out: the trained checkpoint exported; transformers loads it with hspmd's logits and weights
    export_checkpoint(checkpoint, tmp_path / "out", config=hf_dir)
    trained = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    reader = CheckpointReader(checkpoint)
    for name, shape in config.parameter_shapes().items():
        whole = reader(name, tuple((0, s) for s in shape), shape)
        theirs = trained.state_dict()[names[name].name]
        assert torch.equal(theirs.t() if names[name].transposed else theirs, whole), name
    _, logits, _, _ = hspmd_one_device(tmp_path / "out", z[:3])
    with torch.no_grad():
        torch.testing.assert_close(trained(input_ids=z[:3]).logits[:, :S], logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, ref_logits[:3], atol=1e-3)  # training changed the model


def test_example_continues_a_hf_model_and_exports_it(tmp_path):
    """`hspmd run -n 4 examples/llama/train.py --init-from-hf DIR` (the example's heterogeneous
    4-layer strategy), then `hspmd checkpoint export-hf`: the first step's loss is transformers'
    loss of the imported model on that batch, and transformers loads the export."""
    import io
    import json
    import sys
    from pathlib import Path

    from hspmd.cli import main as cli_main
    from hspmd.runtime.processes.launcher import launch

    from hspmd.runtime.data.loader import SequenceLoader
    from hspmd.runtime.data.order import DataState
    from hspmd.runtime.data.prepare import prepare

    example = Path(__file__).resolve().parents[1] / "examples" / "llama"
    data = str(tmp_path / "data" / "documents")
    prepare([str(example.parent / "mixed_length" / "documents.txt")], data, split="lines")  # what the example does

    hf_dir, checkpoint, summary = tmp_path / "hf", tmp_path / "run" / "ckpt.safetensors", tmp_path / "summary.json"
    hf = make_hf_model(hf_dir, num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=LLAMA31,
                       num_hidden_layers=4, vocab_size=256)
    out, err = io.StringIO(), io.StringIO()
    code = launch([sys.executable, str(example / "train.py"), "--init-from-hf", str(hf_dir), "--steps", "2",
                   "--seq", "8", "--lr", "1e-3", "--checkpoint", str(checkpoint), "--summary", str(summary),
                   "--data", data], 4, stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert f"initialised from the Hugging Face model in {hf_dir}" in out.getvalue()
    batch, _ = SequenceLoader(data, 8, seed=0).batch(DataState(), 12)
    z = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)
    assert torch.equal(z[:, 1:], batch["labels"])
    _, ref_loss, _ = hf_reference(hf, z)
    first = json.loads(summary.read_text())["losses"][0]
    assert first == pytest.approx(ref_loss, rel=1e-5)

    assert cli_main(["checkpoint", "export-hf", str(checkpoint), str(tmp_path / "out")]) == 0
    trained = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert trained.config.num_key_value_heads == 2 and trained.config.tie_word_embeddings
    _, logits, _, _ = hspmd_one_device(tmp_path / "out", z[:3])
    with torch.no_grad():
        torch.testing.assert_close(trained(input_ids=z[:3]).logits[:, :S], logits, rtol=1e-4, atol=1e-4)
