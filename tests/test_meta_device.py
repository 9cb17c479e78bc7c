"""Device correctness on a stand-in device: plans run on `meta` tensors (no data; any CPU buffer
mixed in fails or shows up on the wrong device) keep every buffer and result on that device."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd import device_pieces, shard
from hspmd.backends.plan_executor import run_plan
from hspmd.comm_resolve import resolve, resolve_many
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.inprocess import InProcessJob
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
