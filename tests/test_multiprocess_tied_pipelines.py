"""Tied embeddings over pipelines that run different numbers of micro-batches, on real gloo
processes: each pipeline sends the head's gradient from its last stage back to its own first stage
in every micro-batch, and the pipelines' summands meet once per step in the table's gradient sync
(Hetu's rule), so loss and weights equal one device for any micro-batch counts. A backend wrapper
counts every collective and message that joins ranks of two pipelines."""

from __future__ import annotations

import pytest
import torch

from hspmd.backends.backend import Backend
from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

pytestmark = pytest.mark.multiprocess

SEQ, LR, STEPS = 8, 1e-2, 3
# vocab 40 x hidden 16: the table's 640 elements are no other parameter's size (16, 256, 512)
CONFIG = dict(vocab=40, hidden=16, heads=2, ffn=32, tie_embeddings=True)
# pipeline 0: one micro-batch of 2 rows over 2 stages; pipeline 1: three of 1 row, its stages cut elsewhere
UNEQUAL = "layers=3 ; 1x2: R0 L0-1 | R1 L2 ; 3x1: R2 L0 | R3 L1-2"
PIPELINE_OF = {0: 0, 1: 0, 2: 1, 3: 1}
TABLE = CONFIG["vocab"] * CONFIG["hidden"]


class CountsCrossings(Backend):
    """Forwards to `inner`; records (what, elements) of each operation whose members lie in more
    than one pipeline (a collective's group, a message's peer)."""

    def __init__(self, inner: Backend):
        self.inner, self.rank, self.world_size, self.device = inner, inner.rank, inner.world_size, inner.device
        self.overlaps_collectives, self.job = inner.overlaps_collectives, inner.job
        self.crossings: list[tuple[str, int]] = []

    def _group(self, what, group, numel):
        if len({PIPELINE_OF[d] for d in group}) > 1:
            self.crossings.append((what, numel))

    def _peers(self, what, peers):
        for peer, t in peers.items():
            if PIPELINE_OF[peer] != PIPELINE_OF[self.rank]:
                self.crossings.append((what, t.numel() if isinstance(t, torch.Tensor) else int(torch.Size(t[0]).numel())))

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != "post_sends":
            return attr

        def post_sends(sends):
            self._peers("send", sends)
            return attr(sends)
        return post_sends

    def prepare_groups(self, groups):
        self.inner.prepare_groups(groups)

    def all_reduce(self, tensor, group):
        self._group("all_reduce", group, tensor.numel())
        return self.inner.all_reduce(tensor, group)

    def all_reduce_start(self, tensor, group):
        self._group("all_reduce", group, tensor.numel())
        return self.inner.all_reduce_start(tensor, group)

    def all_reduce_into(self, tensor, group, out, op="sum"):
        self._group("all_reduce", group, tensor.numel())
        self.inner.all_reduce_into(tensor, group, out, op)

    def all_gather(self, tensor, group, shapes):
        self._group("all_gather", group, tensor.numel())
        return self.inner.all_gather(tensor, group, shapes)

    def all_gather_into(self, tensor, group, outs):
        self._group("all_gather", group, tensor.numel())
        self.inner.all_gather_into(tensor, group, outs)

    def reduce_scatter(self, parts, group):
        self._group("reduce_scatter", group, sum(p.numel() for p in parts))
        return self.inner.reduce_scatter(parts, group)

    def reduce_scatter_into(self, parts, group, out):
        self._group("reduce_scatter", group, sum(p.numel() for p in parts))
        self.inner.reduce_scatter_into(parts, group, out)

    def exchange(self, sends, recvs):
        self._peers("send", sends)
        self._peers("receive", recvs)
        return self.inner.exchange(sends, recvs)

    def exchange_into(self, sends, recvs):
        self._peers("send", sends)
        self._peers("receive", recvs)
        self.inner.exchange_into(sends, recvs)

    def barrier(self, group):
        self.inner.barrier(group)

    def broadcast(self, tensor, src, group):
        self._group("broadcast", group, tensor.numel())
        return self.inner.broadcast(tensor, src, group)


def batches(steps: int):
    rows = MicroBatchLayout.of(parse_strategy(UNEQUAL)).global_batch_size
    gen = torch.Generator().manual_seed(11)
    return [(torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen),
             torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen)) for _ in range(steps)]


def tied_rank(backend: Backend, schedule: str):
    torch.set_num_threads(1)
    strategy = parse_strategy(UNEQUAL)
    model = build_llama(LlamaConfig(layers=strategy.num_layers, **CONFIG), [strategy], optimizer=AdamW(lr=LR))
    layout = MicroBatchLayout.of(strategy)
    counted = CountsCrossings(backend)
    # no gradient buckets: each parameter's sync is its own collective, so the table's can be told apart
    trainer = Trainer(model.graph, 0, counted, layout, schedule=schedule,
                      symbols={"S": SEQ, "T": layout.global_batch_size * SEQ}, bucket_cap_mb=None)
    losses, per_step = [], []
    for tokens, labels in batches(STEPS):
        counted.crossings.clear()
        losses.append(trainer.step({"tokens": tokens, "labels": labels}))
        per_step.append(list(counted.crossings))
    state = trainer.state_dict()  # whole tensors on rank 0 only
    weights = None if state is None else {k: v for k, v in state.items() if "exp_avg" not in k}
    return losses, weights, per_step


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_tied_embeddings_over_pipelines_of_unequal_micro_batch_counts_equal_one_device(schedule):
    results = run_multiprocess(tied_rank, 4, schedule, timeout=120)
    assert MicroBatchLayout.of(parse_strategy(UNEQUAL)).counts == (1, 3)
    data = batches(STEPS)
    layers = parse_strategy(UNEQUAL).num_layers
    config = LlamaConfig(layers=layers, **CONFIG)
    model = build_llama(config, [parse_strategy(f"layers={layers} ; 1x1: R0 L0-{layers - 1}")])
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    history, final = reference_training(initial, lambda step: data[step], layers, CONFIG["heads"], STEPS, lr=LR)
    losses, weights, _ = results[0]
    assert all(r[0] == losses for r in results)
    assert losses == pytest.approx([loss for loss, _ in history], rel=1e-5, abs=1e-6)
    assert "lm_head" not in final and float((final["embed"] - initial["embed"]).abs().max()) > LR / 2
    for name, value in final.items():
        assert_weights_close(weights[name], value, LR, name)
    for rank, (_, _, per_step) in enumerate(results):
        for crossings in per_step:
            assert not [c for c in crossings if c[0] in ("send", "receive")], (rank, crossings)  # no message joins pipelines
            table = [c for c in crossings if c[1] == TABLE]
            # the table's holders (each pipeline's first stage) sum its gradient across pipelines once per step
            assert table == ([("all_reduce", TABLE)] if rank in (0, 2) else []), (rank, crossings)
