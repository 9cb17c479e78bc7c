"""Checkpoints of the distributed trainer, on the in-process backend (one thread per rank, the
same per-rank code the gloo processes run): gathering by annotation, re-sharding under another
strategy (ZeRO-sharded optimizer states included), and errors that say what is wrong."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hspmd.errors import CheckpointError, HSPMDError, ReplicaMismatch
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.persistence.checkpoint import CheckpointReader, save_checkpoint
from hspmd.backends.local import run_on_devices
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy

CONFIG = LlamaConfig(vocab=16, hidden=16, heads=2, ffn=32, layers=2)
ZERO = "layers=2 ; 1x2: R0,1 L0-1 ; 1x1: R2 L0-1 ; zero"  # TP2 and TP1 replicas, optimizer states split
REPLICAS = "layers=2 ; 1x2: R0,1 L0-1 ; 1x1: R2 L0-1"  # every weight on [0,1] (TP2) and on [2]


def _trainer(backend, text):
    strategy = parse_strategy(text)
    model = build_llama(CONFIG, [strategy], optimizer=AdamW(lr=1e-2, zero=strategy.zero))
    layout = MicroBatchLayout.of(strategy)
    return Trainer(model.graph, 0, backend, layout, symbols={"S": 4, "T": 4 * layout.global_batch_size})


def _step(trainer):
    rows = trainer.layout.global_batch_size
    tokens = (torch.arange(rows * 4).reshape(rows, 4) * 7) % CONFIG.vocab
    return trainer.step({"tokens": tokens, "labels": tokens.roll(1, 1)})


def test_a_zero_checkpoint_reshards_into_a_pipeline_strategy(tmp_path):
    path = tmp_path / "zero.safetensors"

    def body(backend):
        zero = _trainer(backend, ZERO)
        _step(zero)
        saved = zero.state_dict()
        zero.save_checkpoint(path)
        other = _trainer(backend, "layers=2 ; 2x1: R0 L0 | R1 L1 ; 1x1: R2 L0-1")
        step = other.load_checkpoint(path)
        return saved, other.state_dict(), step

    results = run_on_devices(body, range(3))
    saved, reloaded, step = results[0]
    assert step == 1 and results[1][0] is None  # only the lowest rank gathers
    assert set(saved) == set(reloaded) and any(name.endswith("exp_avg_sq") for name in saved)
    for name, value in saved.items():
        assert torch.equal(reloaded[name], value), name


def test_load_state_dict_cuts_each_ranks_piece_of_whole_tensors():
    shared = {}

    def body(backend):
        trainer = _trainer(backend, REPLICAS)
        _step(trainer)
        gathered = trainer.state_dict()
        if gathered is not None:
            shared.update(gathered)
        backend.barrier((0, 1, 2))
        trainer.load_state_dict({k: v * 2 for k, v in shared.items()}, step=5)
        return trainer.state_dict(), trainer.steps_done

    results = run_on_devices(body, range(3))
    assert [steps for _, steps in results.values()] == [5, 5, 5]
    for name, value in shared.items():
        assert torch.equal(results[0][0][name], value * 2), name


def test_a_diverged_replica_fails_the_checkpoint_instead_of_being_dropped():
    def body(backend):
        trainer = _trainer(backend, REPLICAS)
        if backend.rank == 2:
            trainer.state.leaves["embed"] += 1
        trainer.state_dict()

    with pytest.raises(ReplicaMismatch, match="should both hold the whole tensor"):
        run_on_devices(body, range(3))


def test_checkpoint_reader_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(HSPMDError, match="does not exist"):
        CheckpointReader(tmp_path / "missing.safetensors")
    plain = tmp_path / "plain.safetensors"
    save_file({"embed": torch.zeros(2, 2)}, str(plain))
    with pytest.raises(HSPMDError, match="not an hspmd checkpoint"):
        CheckpointReader(plain)
    tagged = tmp_path / "tagged.safetensors"
    save_checkpoint(tagged, {"embed": torch.zeros(2, 2)}, 3, "llama")
    reader = CheckpointReader(tagged)
    assert reader.step == 3
    with pytest.raises(CheckpointError, match=r"'embed' has shape \(2, 2\), the model expects \(16, 16\)"):
        reader("embed", ((0, 16), (0, 16)), (16, 16))
    with pytest.raises(HSPMDError, match="no tensor 'lm_head'.*different model"):
        reader("lm_head", ((0, 16), (0, 16)), (16, 16))


def test_a_checkpoint_of_a_deeper_model_is_refused_naming_the_extra_tensors(tmp_path):
    """A 4-layer checkpoint must not load into a 2-layer model (its resumed save would then
    overwrite the file and lose layers 2-3); one of a shallower model names what it lacks."""
    from dataclasses import replace

    deep, shallow = tmp_path / "deep.safetensors", tmp_path / "shallow.safetensors"

    def body(backend):
        strategy = parse_strategy("layers=4 ; 1x1: R0 L0-3")
        layout = MicroBatchLayout.of(strategy)
        graph = build_llama(replace(CONFIG, layers=4), [strategy], optimizer=AdamW(lr=1e-2)).graph
        Trainer(graph, 0, backend, layout, symbols={"S": 4, "T": 4 * layout.global_batch_size}).save_checkpoint(deep)
        small = _trainer(backend, "layers=2 ; 1x1: R0 L0-1")
        small.save_checkpoint(shallow)
        with pytest.raises(CheckpointError) as info:
            small.load_checkpoint(deep)
        deeper = Trainer(graph, 0, backend, layout, symbols={"S": 4, "T": 4 * layout.global_batch_size})
        with pytest.raises(CheckpointError) as lacks:
            deeper.load_checkpoint(shallow)
        return str(info.value), str(lacks.value)

    extra, missing = run_on_devices(body, range(1))[0]
    assert str(deep) in extra and "does not have" in extra and "'layers.2." in extra and "more" in extra
    assert str(shallow) in missing and "lacks" in missing and "'layers.2." in missing
