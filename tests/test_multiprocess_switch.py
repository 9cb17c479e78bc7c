"""Hot strategy switching on real gloo processes: train under a heterogeneous strategy, switch
every weight and optimizer state to another strategy in one fused BSR (a planned switch, or the
recovery after a rank's GPU fails), keep training; the loss curve and final weights equal
single-device training."""

import pytest
import torch

from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.switching import recover_strategy
from test_multiprocess_training import CONFIG, HETERO, LR, SEQ, assert_matches_reference, batches

pytestmark = pytest.mark.multiprocess

PP4_SAME_BATCH = "layers=4 ; 7x1: R0 L0 | R1 L1 | R2 L2 | R3 L3"  # the 7 rows per step of HETERO


def switch_rank(backend, steps_before: int, steps_after: int):
    torch.set_num_threads(1)
    first, second = parse_strategy(HETERO), parse_strategy(PP4_SAME_BATCH)
    model = build_llama(LlamaConfig(layers=first.num_layers, **CONFIG), [first, second], optimizer=AdamW(lr=LR))
    layout = MicroBatchLayout.of(first)
    assert MicroBatchLayout.of(second).global_batch_size == layout.global_batch_size
    data = batches(HETERO, steps_before + steps_after, seed=5)
    trainer = Trainer(model.graph, 0, backend, layout, symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
    losses = [trainer.step({"tokens": x, "labels": y}) for x, y in data[:steps_before]]
    trainer = trainer.switch(1, second)
    losses += [trainer.step({"tokens": x, "labels": y}) for x, y in data[steps_before:]]
    return losses, trainer.state_dict(), trainer.steps_done


def test_hot_switch_between_strategies_keeps_training_exact():
    results = run_multiprocess(switch_rank, 4, 2, 2, timeout=120)
    losses, params, steps = results[0]
    assert steps == 4 and all(r[0] == losses for r in results)
    weights = {k: v for k, v in params.items() if "exp_avg" not in k}
    assert_matches_reference(losses, weights, batches(HETERO, 4, seed=5), layers=4)


def failure_rank(backend, steps_before: int, steps_after: int):
    """Rank 3's GPU fails after `steps_before` steps: the survivors recover without it."""
    torch.set_num_threads(1)
    first = parse_strategy(HETERO)
    second = recover_strategy(first, [3])
    model = build_llama(LlamaConfig(layers=first.num_layers, **CONFIG), [first, second], optimizer=AdamW(lr=LR))
    layout = MicroBatchLayout.of(first)
    data = batches(HETERO, steps_before + steps_after, seed=6)
    trainer = Trainer(model.graph, 0, backend, layout, symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
    losses = [trainer.step({"tokens": x, "labels": y}) for x, y in data[:steps_before]]
    trainer = trainer.switch(1, second, failed=(3,))
    losses += [trainer.step({"tokens": x, "labels": y}) for x, y in data[steps_before:]]
    return losses, trainer.state_dict(), trainer.idle, trainer.describe()


def test_a_failed_gpu_is_left_out_and_training_continues_exactly():
    results = run_multiprocess(failure_rank, 4, 2, 2, timeout=120)
    losses, params, idle, _ = results[0]
    assert [r[2] for r in results] == [False, False, False, True]
    assert results[3][0][2:] == [None, None] and "idle" in results[3][3]
    assert all(r[0] == losses for r in results[:3])
    weights = {k: v for k, v in params.items() if "exp_avg" not in k}
    assert_matches_reference(losses, weights, batches(HETERO, 4, seed=6), layers=4)
