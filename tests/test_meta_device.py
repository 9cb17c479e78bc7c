"""Device correctness on a stand-in device: plans run on `meta` tensors (no data; any CPU buffer
mixed in fails or shows up on the wrong device) keep every buffer and result on that device; a
sharded checkpoint saves and loads there without making a single tensor that holds data."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hspmd import device_pieces, shard
from hspmd.backends.plan_executor import run_plan
from hspmd.comm_resolve import resolve, resolve_many
from hspmd.errors import CheckpointError, HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.persistence import sharded_checkpoint
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.specialize.strategy_text import parse_strategy
from test_resolve_property import reshards

META = torch.device("meta")


def _meta(pieces):
    return {d: torch.empty_like(t, device=META) for d, t in pieces.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reshards(), st.sampled_from([None, "2x8", "h800-h20:1+1"]))
def test_every_resolver_plan_keeps_the_device(case, topology):
    src, dst, shape = case
    plan = resolve(src, dst, shape, topology, dtype="float32")
    result = run_plan(plan, _meta(shard(torch.zeros(shape), src)))
    assert set(result) == set(dst.devices)
    expected = device_pieces(dst, shape)
    for device, piece in result.items():
        assert piece.device == META, f"device {device}'s result left the stand-in device"
        assert tuple(piece.shape) == tuple(expected[device].shape)


def test_a_fused_plan_keeps_the_device():
    from hspmd import parse

    moves = [(parse("S0:2@[0,1]"), parse("S1:2@[2,3]"), (4, 6)), (parse("D:2@[0,1]"), parse("S0:4@[0-3]"), (8, 2))]
    plan = resolve_many(moves, None)
    locals_ = {}
    for tid, (src, _, shape) in enumerate(moves):
        for d, t in shard(torch.zeros(shape), src).items():
            locals_.setdefault(d, {})[tid] = torch.empty_like(t, device=META)
    out = run_plan(plan, locals_)
    assert {d for d in out} == {0, 1, 2, 3}
    assert all(t.device == META for pieces in out.values() for t in pieces.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_training_step_and_a_switch_stay_on_the_stand_in_device(schedule):
    first = parse_strategy("layers=2 ; 2x1: R0,1 L0 | R2 L1 ; 2x1: R3 L0-1")
    second = parse_strategy("layers=2 ; 1x2: R0,1 L0-1 ; 2x1: R2 L0 | R3 L1")
    config = LlamaConfig(layers=2, hidden=16, ffn=32, vocab=32, heads=2)
    model = build_llama(config, [first, second], optimizer=AdamW(lr=1e-3))
    rows = first.global_batch_size
    batch = {"tokens": torch.randint(0, config.vocab, (rows, 6)), "labels": torch.randint(0, config.vocab, (rows, 6))}
    job = InProcessJob(model.graph, 0, first, schedule=schedule, symbols={"S": 6, "T": rows * 6}, device=META)
    loss = job.step(batch)
    assert math.isnan(loss)  # a stand-in device holds no values
    leaves = [t for trainer in job.trainers.values() for t in trainer.state.leaves.values()]
    assert leaves and all(t.device == META for t in leaves)
    job.switch(1, second)
    job.step(batch)
    leaves = [t for trainer in job.trainers.values() for t in trainer.state.leaves.values()]
    assert leaves and all(t.device == META for t in leaves)


class CpuTensors(TorchDispatchMode):
    """Records every op (in the thread that entered it) that makes a tensor holding data."""

    def __init__(self):
        super().__init__()
        self.made: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and not t.is_meta for t in tree_leaves(out)):
            self.made.append(str(func))
        return out


def _watched(fn):
    """fn() with this thread's data-holding tensor creations recorded: (result, ops that made one)."""
    with CpuTensors() as watch:
        result = fn()
    return result, watch.made


def test_a_sharded_checkpoint_saves_and_loads_on_the_stand_in_device_without_making_cpu_tensors(tmp_path, monkeypatch):
    first = parse_strategy("layers=2 ; 2x1: R0,1 L0 | R2 L1 ; 2x1: R3 L0-1")
    second = parse_strategy("layers=2 ; 1x2: R0,1 L0-1 ; 2x1: R2 L0 | R3 L1")
    config = LlamaConfig(layers=2, hidden=16, ffn=32, vocab=32, heads=2)
    graph = build_llama(config, [first, second], optimizer=AdamW(lr=1e-3)).graph
    rows = first.global_batch_size
    batch = {"tokens": torch.randint(0, config.vocab, (rows, 6)), "labels": torch.randint(0, config.vocab, (rows, 6))}
    symbols = {"S": 6, "T": rows * 6}

    # the watch sees the data path: a real (CPU) job's save makes CPU tensors
    real = InProcessJob(graph, 0, first, symbols=symbols)
    made = real.world.run(lambda b: _watched(lambda: real.trainers[b.rank].save_sharded(tmp_path / "real", False))[1])
    assert any(made.values())

    for name in ("save_checkpoint", "CheckpointReader"):  # no tensor bytes written or read on the stand-in path
        monkeypatch.setattr(sharded_checkpoint, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} called"))
    job = InProcessJob(graph, 0, first, symbols=symbols, device=META)
    job.step(batch)
    saved = job.world.run(lambda b: _watched(lambda: job.trainers[b.rank].save_sharded(tmp_path / "ckpt", False)))
    assert all(made == [] for _, made in saved.values()), saved
    folder = tmp_path / "ckpt" / "step-00000001"
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "rank-0.json", "rank-1.json", "rank-2.json",
                                                        "rank-3.json"]
    index = json.loads((folder / "index.json").read_text())
    assert index["stand_in"] is True and index["step"] == 1

    # load under the other strategy, still on the stand-in device: pieces of the right shape, no CPU tensor
    other = InProcessJob(graph, 1, second, symbols=symbols, device=META)
    loaded = other.world.run(lambda b: _watched(lambda: other.trainers[b.rank].load_checkpoint(tmp_path / "ckpt")))
    assert all(step == 1 and made == [] for step, made in loaded.values()), loaded
    for trainer in other.trainers.values():
        for node in trainer.exe.held_leaves:
            piece = trainer.state.leaves[node.name]
            box = trainer.exe.box(node.output, trainer.exe.binding)
            assert piece.device == META and tuple(piece.shape) == tuple(b - a for a, b in box)
    other.step(batch)

    # a stand-in checkpoint has no values: a device with data refuses it in one line
    cpu = InProcessJob(graph, 1, second, symbols=symbols)
    with pytest.raises(CheckpointError, match="stand-in"):
        cpu.world.run(lambda b: cpu.trainers[b.rank].load_checkpoint(tmp_path / "ckpt"))
    with pytest.raises(HSPMDError, match="stand-in"):
        sharded_checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "whole.safetensors")
    with pytest.raises(HSPMDError, match="save_sharded"):
        job.world.run(lambda b: job.trainers[b.rank].save_checkpoint(tmp_path / "whole.safetensors"))


def test_unshard_makes_the_whole_tensor_where_the_pieces_are():
    """A whole tensor gathered from pieces on a device (a GPU; here `meta`) is made on that device:
    adding device pieces into a CPU tensor failed (found by `make gpu-check` gathering a GPU
    trainer's state dict)."""
    from hspmd.annotations.reference import shard, unshard

    pieces = shard(torch.arange(8.0).reshape(4, 2), "S0:2@[0,2]")
    whole = unshard({d: t.to("meta") for d, t in pieces.items()}, "S0:2@[0,2]")
    assert whole.device.type == "meta" and tuple(whole.shape) == (4, 2)
