"""Gradient buckets (hspmd.runtime.execution.buckets): the plan respects the cap and the backward's order and
is the same on every member of a group; training with buckets of any cap gives bitwise the same
gradients and weights as synchronising each gradient in the update (in-process), and equals the
single-device reference on gloo processes, where every bucket's all-reduce is issued inside the
step's last backward (recorded event order)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.backends.backend import Backend
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.comm_resolve.bucketing import MiB, chain_cap
from hspmd.runtime.execution.buckets import BucketSync
from hspmd.specialize.bucket_plan import Bucket, BucketPlan, BucketSlot, plan_buckets
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.execution.trace import Tracer
from hspmd.runtime.training.trainer import Trainer, trainer_binding
from hspmd.specialize.specialized import all_devices, specialize_graph
from hspmd.specialize.deduce import deduce
from hspmd.specialize.strategy_text import parse_strategy
from tests.test_multiprocess_training import assert_matches_reference

SEQ, LR = 8, 1e-2
CONFIG = dict(vocab=32, hidden=16, heads=2, ffn=32)
DP_TP = "layers=2 ; 2x1: R0,1 L0-1 ; 2x1: R2,3 L0-1"                 # DP2 x TP2, 2 micro-batches each
DP_PP = "layers=2 ; 2x1: R0 L0 | R1 L1 ; 2x1: R2 L0 | R3 L1"          # DP2 x PP2
MIXED = "layers=2 ; 2x1: R0,1 L0-1 ; 2x1: R2,3 L0 | R4,5 L1"          # TP2 x 1 stage next to TP2 x 2 stages
HETERO = "layers=4 ; 2x2: R0,1 L0-3 ; 3x1: R2 L0-1 | R3 L2-3"         # TP2 next to TP1: split syncs


def model(text: str, tied: bool = False):
    strategy = parse_strategy(text)
    config = LlamaConfig(layers=strategy.num_layers, tie_embeddings=tied, **CONFIG)
    built = build_llama(config, [strategy], optimizer=AdamW(lr=LR))
    return built.graph, MicroBatchLayout.of(strategy)


def symbols(layout: MicroBatchLayout) -> dict[str, int]:
    return {"S": SEQ, "T": layout.global_batch_size * SEQ}


def executables(text: str):
    graph, layout = model(text)
    deduced = deduce(graph, 0)
    binding = trainer_binding(graph, layout, symbols(layout))
    return specialize_graph(graph, 0, binding, all_devices(deduced), deduced=deduced).executables


EXES = {text: executables(text) for text in (DP_TP, DP_PP, MIXED, HETERO)}


def made_order(exe) -> list[int]:
    return [t.id for ins in exe.backward for t in ins.node.outputs]


@settings(max_examples=60)
@given(text=st.sampled_from([DP_TP, DP_PP, MIXED, HETERO]), cap=st.integers(1, 40_000) | st.integers(MiB, 64 * MiB),
       data=st.data())
def test_buckets_respect_the_cap_and_fill_in_backward_order(text, cap, data):
    exes = EXES[text]
    exe = exes[data.draw(st.sampled_from(sorted(exes)))]
    plan = plan_buckets(exe, cap)
    order = made_order(exe)
    chains: dict = {}
    for bucket in plan.buckets:
        assert [s.offset for s in bucket.slots] == [sum(s.numel for s in bucket.slots[:i]) for i in range(len(bucket.slots))]
        chains.setdefault((bucket.group, bucket.dtype), []).append(bucket)
    for chain in chains.values():
        slots = [s for b in chain for s in b.slots]
        assert [order.index(s.tensor_id) for s in slots] == sorted(order.index(s.tensor_id) for s in slots)
        # the group's cap: the one given, lowered (not under 1 MiB) so that a small model gets >= 4 buckets
        total = sum(b.nbytes for b in chain)
        group_cap = chain_cap(total, cap)
        assert group_cap <= cap and (group_cap == cap or group_cap >= MiB)
        assert group_cap == cap or total <= 4 * cap
        for bucket in chain:
            assert bucket.nbytes <= group_cap or len(bucket.slots) == 1
        for before, after in zip(chain, chain[1:]):  # greedy: a bucket closes only when the next gradient overflows it
            first = after.slots[0].numel * torch.empty((), dtype=after.dtype).element_size()
            assert before.nbytes + first > group_cap
    # buckets are listed in the order the backward completes them
    last = [max(order.index(s.tensor_id) for s in b.slots) for b in plan.buckets]
    assert last == sorted(last)
    # every gradient with an all-reduce plan is bucketed (the strategies here have no other kind): one
    # slot per all-reduce it takes part in, whose boxes tile the device's piece (split: several)
    slots: dict = {}
    for b in plan.buckets:
        for s in b.slots:
            slots.setdefault(s.gradient, []).append((b.group, s))
    assert not plan.kept
    syncing = [ins for ins in exe.update if ins.node.id in {t.node.id for t in exe.graph.gradients.values()}
               and ins.role != "identity"]
    assert len(slots) + len(plan.kept) == len(syncing) and slots
    for _gradient, mine in slots.items():
        groups = [g for g, _ in mine]
        assert len(groups) == len(set(groups))  # one slot per all-reduce
        if len(mine) == 1:
            assert mine[0][1].box is None
        else:
            boxes = [s.box for _, s in mine]
            assert all(box is not None for box in boxes)
            piece = [max(hi for _, hi in dims) for dims in zip(*boxes)]
            assert sum(s.numel for _, s in mine) == torch.Size(piece).numel()


@pytest.mark.parametrize("text", [DP_TP, DP_PP, MIXED, HETERO])
@pytest.mark.parametrize("cap", [1, 3000, 64 * MiB])
def test_every_member_of_a_group_plans_the_same_buckets(text, cap):
    by_group: dict = {}
    for device, exe in EXES[text].items():
        for bucket in plan_buckets(exe, cap).buckets:
            assert device in bucket.group
            key = (bucket.group, bucket.dtype)
            by_group.setdefault(key, {}).setdefault(device, []).append(
                [(s.gradient, s.shape, s.offset) for s in bucket.slots])
    for key, members in by_group.items():
        assert set(members) == set(key[0]), key
        assert len({repr(v) for v in members.values()}) == 1, key


def test_a_model_smaller_than_the_cap_still_gets_several_buckets_of_at_least_one_mib():
    assert chain_cap(16 * MiB, 25 * MiB) == 4 * MiB  # the benchmark's medium MLP: 4 buckets, not 1
    assert chain_cap(200 * MiB, 25 * MiB) == 25 * MiB  # a large model: the cap as given
    assert chain_cap(100_000, 25 * MiB) == MiB  # a tiny one: one bucket (no 25 KB all-reduces)
    assert chain_cap(100_000, 3000) == 3000  # a cap below the floor is the caller's choice


def test_split_synchronisations_join_buckets_one_slot_per_all_reduce():
    exe = EXES[HETERO][2]  # rank 2 holds whole layers 0-1 that pipeline A splits over ranks 0, 1
    plan = plan_buckets(exe, 64 * MiB)
    assert not plan.kept
    # a norm weight: ranks 0 and 1 hold the same replica, one of them gives zeros in its bucket
    zeros = [(d, s.gradient) for d, e in EXES[HETERO].items() for b in plan_buckets(e, 64 * MiB).buckets
             for s in b.slots if s.zero]
    assert zeros and all("norm" in name for _, name in zeros) and {d for d, _ in zeros} <= {0, 1}
    assert {b.group for b in plan.buckets} == {(0, 2), (1, 2), (0, 1, 2)}  # halves; norms (rank 0 or 1 gives zeros)
    split = [s for b in plan.buckets for s in b.slots if s.box is not None]
    assert split and all(s.gradient in {t.gradient for t in split} for s in split)
    # a column-split weight: rank 2 reduces its left half with rank 0 and its right half with rank 1
    halves = {}
    for b in plan.buckets:
        for s in b.slots:
            halves.setdefault(s.gradient, {})[b.group] = s.box
    assert any(len(h) == 2 and h[(0, 2)] != h[(1, 2)] for h in halves.values())
    # the predicates: a split all-reduce is all-reduces but not one all-reduce per device
    sync = next(ins for ins in exe.update if ins.role == "collective")
    plan_ = exe.plan(sync.node, exe.binding)
    assert plan_.why_not_all_reduces() is None and "two all-reduces" in plan_.why_not_one_all_reduce()
    dp = EXES[DP_TP][0]
    sync = next(ins for ins in dp.update if ins.role == "collective")
    assert dp.plan(sync.node, dp.binding).why_not_one_all_reduce() is None


@pytest.mark.parametrize("tied", [False, True])
def test_the_update_follows_the_order_the_backward_finalises_gradients(tied):
    # what is synchronised first is updated first, so the update of the first buckets' parameters
    # can run while the last buckets are on the wire (a tied embedding's gradient is final last)
    graph, _ = model(DP_TP, tied)
    update = [n for n in graph.nodes if n.phase == "update" and n.name.endswith(".grad_sync")]
    made = [n.inputs[0].node.id for n in update]  # the node making each gradient, in update order
    assert made == sorted(made) and len(update) == len(graph.gradients) > 2
    for exe in EXES[DP_TP].values():
        position = {t: i for i, t in enumerate(made_order(exe))}
        order = [position[ins.node.inputs[0].id] for ins in exe.update
                 if ins.node.name.endswith(".grad_sync") and ins.node.inputs[0].id in position]
        assert order == sorted(order) and len(order) > 2


class _Recorded:
    """A started all-reduce whose wait() is logged."""

    def __init__(self, log: list, k: int, tensor: torch.Tensor):
        self.log, self.k, self.tensor = log, k, tensor

    def wait(self) -> torch.Tensor:
        self.log.append(self.k)
        return self.tensor


class _Overlapping(Backend):
    """A rank whose all_reduce_start returns at once, logging starts and waits (buckets alone)."""

    rank, world_size, overlaps_collectives = 0, 2, True

    def __init__(self):
        self.started, self.waited = [], []

    def all_reduce_start(self, tensor, group):
        self.started.append(len(self.started))
        return _Recorded(self.waited, self.started[-1], tensor)

    all_reduce = all_gather = reduce_scatter = send = recv = barrier = exchange = None


def test_reading_a_synced_gradient_waits_for_its_buckets_alone():
    slots = [BucketSlot(f"w{k}", tensor_id=10 + k, sync_node_id=20 + k, shape=(2, 3), offset=0) for k in range(3)]
    plan = BucketPlan(MiB, tuple(Bucket((0, 1), torch.float32, (slot,)) for slot in slots), ())
    sync, backend = BucketSync(plan, "cpu"), _Overlapping()
    for k in range(3):
        sync.view(10 + k).fill_(k)
        sync.written(10 + k, backend)
    assert backend.started == [0, 1, 2] and backend.waited == []  # all started inside the backward
    synced = sync.finish(backend)
    assert sorted(synced) == [20, 21, 22] and 21 in synced and 23 not in synced
    assert backend.waited == []  # nothing waited for yet, not even by asking what is there
    assert torch.equal(synced[21], torch.full((2, 3), 1.0)) and backend.waited == [1]
    assert torch.equal(synced[21], torch.full((2, 3), 1.0)) and backend.waited == [1]  # once
    synced[20]
    assert backend.waited == [1, 0]
    synced.settle()  # what the update did not read is waited for before the next backward writes it
    assert backend.waited == [1, 0, 2]
    synced.settle()
    assert backend.waited == [1, 0, 2]
    sync.begin()
    for k in range(3):  # a step that fails before its update: the next begin() drops what it left under way
        sync.written(10 + k, backend)
    sync.begin()
    assert len(backend.started) == 6 and backend.waited == [1, 0, 2]


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), float("inf"), True, "25"])
def test_a_bad_cap_is_refused_clearly(cap):
    graph, layout = model(DP_TP)
    with pytest.raises(HSPMDError, match="bucket_cap_mb"):
        InProcessJob(graph, 0, layout, symbols=symbols(layout), bucket_cap_mb=cap)


def batches(layout: MicroBatchLayout, steps: int, seed: int):
    rows = layout.global_batch_size
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen),
             "labels": torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen)} for _ in range(steps)]


def in_process_run(text: str, cap, schedule: str, tied: bool):
    graph, layout = model(text, tied)
    job = InProcessJob(graph, 0, layout, schedule=schedule, symbols=symbols(layout), bucket_cap_mb=cap)
    grads = []
    for batch in batches(layout, 2, seed=5):
        job.step(batch)
        grads.append(job.gradients())
    return grads, job.parameters()


@pytest.mark.parametrize("text,schedule,tied", [(DP_TP, "1f1b", False), (DP_PP, "gpipe", False),
                                                (DP_PP, "1f1b", True), (MIXED, "1f1b", False), (HETERO, "1f1b", False)])
def test_buckets_of_any_cap_give_bitwise_the_unbucketed_result(text, schedule, tied):
    want_grads, want_params = in_process_run(text, None, schedule, tied)
    for cap in (1e-6, 2e-3, 25):  # one gradient per bucket, a few per bucket, one bucket per group
        grads, params = in_process_run(text, cap, schedule, tied)
        for got, want in zip(grads, want_grads):
            assert set(got) == set(want)
            for name in want:
                assert torch.equal(got[name], want[name]), (cap, name)
        for name in want_params:
            assert torch.equal(params[name], want_params[name]), (cap, name)


# ---- gloo processes -------------------------------------------------------------------------------

def gloo_rank(backend: Backend, text: str, caps):
    torch.set_num_threads(1)
    graph, layout = model(text)
    data = batches(layout, 2, seed=9)
    out = {}
    for cap in caps:
        trainer = Trainer(graph, 0, backend, layout, schedule="1f1b", symbols=symbols(layout), bucket_cap_mb=cap)
        losses = [trainer.step(data[0])]
        trainer.tracer = Tracer(backend.rank)
        losses.append(trainer.step(data[1]))
        names = [e["name"] for e in trainer.tracer.events]
        buckets = len(trainer.buckets.plan.buckets) if trainer.buckets else 0
        out[cap] = (losses, trainer.state_dict(), trainer.gradients(), names, trainer.tracer.events, buckets)
    return out


def assert_caps_match_reference(results, text: str, caps, same_gradient) -> None:
    """Every cap's losses and final weights equal the single-device reference, and its gradients
    equal (by `same_gradient`) those of the unbucketed run."""
    graph, layout = model(text)
    data = [(b["tokens"], b["labels"]) for b in batches(layout, 2, seed=9)]
    baseline = results[0][None]
    for cap in caps:
        losses, params, grads = results[0][cap][:3]
        assert_matches_reference(losses, params, data, layers=parse_strategy(text).num_layers)
        for name, g in baseline[2].items():
            assert same_gradient(grads[name], g), (cap, name)


@pytest.mark.multiprocess
def test_gloo_buckets_equal_one_device_and_start_inside_the_backward():
    caps = (None, 1e-6, 2e-3, 25)
    results = run_multiprocess(gloo_rank, 4, DP_TP, caps, timeout=180)
    assert_caps_match_reference(results, DP_TP, caps, torch.equal)  # the same sums in the same order
    for rank, result in enumerate(results):
        assert result[None][5] == 0 and not any(n.startswith("all-reduce bucket") for n in result[None][3])
        for cap, expected in ((1e-6, 10), (2e-3, 2), (25, 1)):
            names, events, count = result[cap][3], result[cap][4], result[cap][5]
            assert count >= expected
            started = [i for i, n in enumerate(names) if n.startswith("all-reduce bucket")]
            last_backward = max(i for i, n in enumerate(names) if n.startswith("B"))
            # events are recorded as they end: every bucket's all-reduce was issued before the step's
            # last backward ended, and inside it (its span nests in the backward's span)
            assert len(started) == count and max(started) < last_backward, (rank, cap, names)
            b = events[last_backward]
            assert all(b["ts"] <= events[i]["ts"] and events[i]["ts"] + events[i]["dur"] <= b["ts"] + b["dur"]
                       for i in started)
            assert names.index("update") > last_backward


@pytest.mark.multiprocess
def test_gloo_split_buckets_of_a_heterogeneous_strategy_equal_one_device():
    # TP2 next to a TP1 pipeline of two stages: every gradient sync is a split all-reduce, now in
    # buckets (rank 2 and 3 copy each half into the bucket of its all-reduce and back)
    caps = (None, 2e-3, 25)
    results = run_multiprocess(gloo_rank, 4, HETERO, caps, timeout=180)
    assert_caps_match_reference(results, HETERO, caps, lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-7))
    assert all(result[25][5] >= 1 for result in results)
