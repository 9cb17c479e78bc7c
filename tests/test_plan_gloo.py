"""Resolver plans run over real gloo processes give what they give in-process, and reassemble.

A fixed batch of (src, dst, shape) cases -- hand-picked ones that force every primitive, plus
cases drawn with a seeded random.Random from the annotation building blocks (uneven shapes, empty
dims, heterogeneous unions, different device sets) -- is resolved once, then run in ONE
multi-process job (spawning a job per case would cost seconds each): every rank prepares the union
of the plans' groups once, then runs each plan in the same order. Each rank's destination piece
must equal the in-process run's (`run_plan`), and the pieces must unshard to the tensor. Two more
cases go through HetAuto's root and representatives routes across a shared slow link.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from hspmd import resolve, shard, unshard
from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Duplicate, Partial, Split, Subgroup
from hspmd.comm_resolve.plan import PRIMITIVES, Plan
from hspmd.backends.backend import Backend
from hspmd.backends.local import run_on_devices
from hspmd.cluster import cluster_from_yaml
from hspmd.errors import ShapeError
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.backends.plan_executor import execute_plan, run_plan

WORLD = 4
RANDOM_CASES = 96
SEED = 20240605

# (src, dst, shape): each primitive at least once, on 4 devices, mostly uneven shapes.
HAND_PICKED = [
    ("S0:4@[0-3]", "S0:4@[0-3]", (6, 5)),                                        # Identity
    ("D:4@[0-3]", "S1:4@[0-3]", (5, 7)),                                         # LocalSplit
    ("S0:2@[0,1]", "S0:2@[2,3]", (5, 3)),                                        # SendRecv
    ("P:2,S1:2@[0-3]", "D:2,S1:2@[0-3]", (6, 7)),                                # AllReduce over DP groups
    ("P:4@[0-3]", "S0:4@[0-3]", (7, 3)),                                         # ReduceScatter, uneven
    ("S1:4@[0-3]", "D:4@[0-3]", (3, 6)),                                         # AllGather, uneven
    ("HP{S1:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}", (5, 7)),                  # SplitAllReduce
    ("HP{S0:2@[0,1] | @[2]}", "H1(2:1){S0:2@[0,1] | @[2]}", (5, 7)),             # SplitReduceScatter
    ("H0(2:1){S1:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}", (7, 5)),             # SplitAllGather
    ("S0:4@[0-3]", "S1:4@[0-3]", (6, 5)),                                        # BatchedSendRecv
    ("HP{P:2@[0,1] | S0:2@[2,3]}", "HD{S0:2@[0,1] | S0:2@[2,3]}", (7, 6)),       # RS + Identity + SplitAR
    ("P:2@[0,1]", "S0:3@[1,2,3]", (7, 2)),                                       # reduce first, then BSR
    ("HD{S1:2@[0,1] | @[2]}", "H0(1:2){@[3] | S0:2@[1,2]}", (5, 4)),             # heterogeneous union BSR
    ("S0:3@[2,0,1]", "H1(3:1){D:2@[1,3] | @[0]}", (4, 9)),                       # uneven HSize, other devices
    ("S0:2,S1:2@[0-3]", "S1:2,S0:2@[3,2,1,0]", (5, 5)),                          # 2-D mesh, reversed order
    ("D:2@[0,1]", "D:3@[1,2,3]", (0, 4)),                                        # empty tensor
]


# HetAuto's routes (HetAuto App. E) across a slow link shared by two sites of 2 devices: the default
# picks the root route (one message across) for these small tensors; representatives forced.
TWO_SITES = cluster_from_yaml("""
device_types: {gpu: {flops: {float32: 2e13}, hbm_bandwidth: 2e12, hbm_capacity: 8e10}}
links: {nvlink: {bandwidth: 3e11, latency: 3e-6}, wan: {bandwidth: 1.25e9, latency: 1e-4, shared: true}}
nodes: [{type: gpu, devices: 2, site: a}, {type: gpu, devices: 2, site: b}]
intra: {gpu: nvlink}
inter: wan
cross: wan
""")
ACROSS_SITES = [
    ("S0:2@[0,1]", "S1:2@[2,3]", (6, 5), None),
    ("S1:2@[0,1]", "S0:2@[2,3]", (5, 6), "representatives"),
]


def _draw_states(rng: random.Random, size: int, ndim: int) -> DistributedStates:
    """Axes whose counts multiply to `size`: a random ordered factorisation with random kinds."""
    axes, rest = [], size
    while rest > 1:
        n = rng.choice([d for d in range(2, rest + 1) if rest % d == 0])
        kind = rng.choice("SDP")
        axes.append(Split(rng.randrange(ndim), n) if kind == "S" else Partial(n) if kind == "P" else Duplicate(n))
        rest //= n
    return DistributedStates(tuple(axes))


def _draw_annotation(rng: random.Random, ndim: int) -> Annotation:
    """A union over a random subset of the world in random order (the same recipe as
    hspmd.testing.annotations, drawn from a seeded generator so the batch is fixed)."""
    chosen = rng.sample(range(WORLD), rng.randint(1, WORLD))
    hsize = rng.randint(1, min(3, len(chosen)))
    cuts = sorted(rng.sample(range(1, len(chosen)), hsize - 1))
    bounds = [0, *cuts, len(chosen)]
    subgroups = tuple(
        Subgroup(DeviceGroup(tuple(chosen[a:b])), _draw_states(rng, b - a, ndim)) for a, b in zip(bounds, bounds[1:])
    )
    hdim = rng.choice(["D", "P", *range(ndim)])
    ratios = tuple(rng.randint(1, 3) for _ in subgroups) if isinstance(hdim, int) else None
    return Annotation(subgroups, hdim, ratios)


def _same_union_other_hdim(rng: random.Random, ann: Annotation, ndim: int) -> Annotation:
    """The same device groups with a redrawn top tier and bottom tier: the split-collective path."""
    subs = tuple(Subgroup(s.dg, _draw_states(rng, len(s.dg.devices), ndim)) for s in ann.subgroups)
    hdim = rng.choice(["D", "P", *range(ndim)])
    ratios = tuple(rng.randint(1, 3) for _ in subs) if isinstance(hdim, int) else None
    return Annotation(subs, hdim, ratios)


def build_cases() -> list[tuple[str, str, tuple[int, ...]]]:
    rng = random.Random(SEED)
    cases = list(HAND_PICKED)
    while len(cases) < len(HAND_PICKED) + RANDOM_CASES:
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 6, 7]) if rng.random() < 0.15 else rng.randint(2, 9) for _ in range(ndim))
        src = _draw_annotation(rng, ndim)
        dst = _same_union_other_hdim(rng, src, ndim) if rng.random() < 0.4 else _draw_annotation(rng, ndim)
        cases.append((str(src), str(dst), shape))
    return cases


def case_input(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(index))


def case_locals(index: int, plan: Plan) -> dict[int, torch.Tensor]:
    """The case's tensor sharded as the plan's source (random Partial summands, seeded)."""
    return shard(case_input(index, plan.shape), plan.src, seed=index)


def run_cases_on_rank(backend: Backend, plans: list[Plan]) -> list[Any]:
    """Every plan, in order, on this rank: its destination piece per case (None where it has none).
    Ranks rebuild their inputs from the seeds: passing hundreds of tensors to the ranks as
    arguments would exceed what the fork server can hand over."""
    me = backend.rank
    backend.prepare_groups(sorted({g for plan in plans for g in plan.collective_groups() if me in g}))
    return [execute_plan(plan, backend, case_locals(i, plan).get(me)) for i, plan in enumerate(plans)]


@pytest.fixture(scope="module")
def cases():
    plans = [resolve(src, dst, shape, dtype="float64") for src, dst, shape in build_cases()]
    plans += [resolve(src, dst, shape, TWO_SITES, dtype="float64", via=via) for src, dst, shape, via in ACROSS_SITES]
    return plans, [case_locals(i, plan) for i, plan in enumerate(plans)]


@pytest.fixture(scope="module")
def gloo_results(cases):
    plans, _ = cases
    per_rank = run_multiprocess(run_cases_on_rank, WORLD, plans, timeout=120, comm_timeout=30)
    return [{rank: per_rank[rank][i] for rank in range(WORLD) if per_rank[rank][i] is not None} for i in range(len(plans))]


def test_the_batch_exercises_every_primitive(cases):
    plans, _ = cases
    used = {p for plan in plans for p in plan.primitives}
    assert used >= set(PRIMITIVES), f"missing: {sorted(set(PRIMITIVES) - used)}"
    assert any(0 in plan.shape for plan in plans) and any(plan.src.hsize > 1 for plan in plans)
    assert any(set(plan.src.devices).isdisjoint(plan.dst.devices) for plan in plans)
    root, representatives = plans[-2:]
    assert [len(s.transfers) for s in root.steps] == [2, 1, 2]  # gather onto 0, 0 -> 2, scatter from 2
    assert [len(s.transfers) for s in representatives.steps] == [2, 2]  # 0, 1 -> 2, then 2 -> 2, 3


@pytest.mark.multiprocess
def test_every_plan_through_gloo_equals_the_in_process_run_and_reassembles(cases, gloo_results):
    plans, inputs = cases
    for index, (plan, locals_, got) in enumerate(zip(plans, inputs, gloo_results)):
        where = f"case {index}: {plan.src} -> {plan.dst} {plan.shape} ({', '.join(plan.primitives)})"
        expected = run_plan(plan, locals_)
        assert sorted(got) == sorted(expected) == sorted(plan.dst.devices), where
        for device, piece in expected.items():
            assert got[device].shape == piece.shape, f"{where}, device {device}"
            torch.testing.assert_close(got[device], piece, rtol=1e-12, atol=1e-12, msg=f"{where}, device {device}")
        torch.testing.assert_close(unshard(got, plan.dst, shape=plan.shape), case_input(index, plan.shape), msg=where)


@pytest.mark.parametrize("local, says", [
    (None, r"device 1 holds a piece of source S0:2@\[0,1\] but was given no local tensor"),
    (torch.zeros(3), r"device 1: local tensor has shape \(3,\), source S0:2@\[0,1\] gives it \(2,\)"),
    (torch.zeros(2, dtype=torch.float64), r"device 1: local tensor is torch.float64 but the plan was made for"),
])
def test_a_local_piece_that_does_not_fit_the_plan_names_the_layout(local, says):
    plan = resolve("S0:2@[0,1]", "D:2@[0,1]", (4,))

    def rank(backend):
        if backend.rank == 0:
            return None
        with pytest.raises(ShapeError, match=says):
            execute_plan(plan, backend, local)
        return True

    assert run_on_devices(rank, [0, 1])[1] is True
