"""The plan executor over real gloo processes: the same per-rank code as the in-process backend.

Plans travel to the ranks as JSON (the executor runs what was read back); every rank creates the
plans' groups collectively, runs its part, and the destination pieces must reassemble the tensor.
"""

from __future__ import annotations

import pytest
import torch

from hspmd import parse, resolve, resolve_many, shard, unshard
from hspmd.comm_resolve import FusedPlan, Plan
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.backends.plan_executor import execute_fused_plan, execute_plan

WORLD = 4
CASES = [
    ("P:4@[0-3]", "D:4@[0-3]", (5, 3)),
    ("P:2,S1:2@[0-3]", "S0:2,S1:2@[0-3]", (6, 5)),
    ("HP{S1:2@[0,1] | @[2]}", "HD{S1:2@[0,1] | @[2]}", (4, 5)),
    ("H0(2:1){S1:2@[0,1] | @[3]}", "HD{S1:2@[0,1] | @[3]}", (7, 3)),
    ("HP{P:2@[0,1] | S0:2@[2,3]}", "HD{S0:2@[0,1] | S0:2@[2,3]}", (8, 2)),
    ("S0:4@[0-3]", "S1:2@[3,1]", (5, 6)),
    ("P:2@[2,3]", "S0:3@[0,1,3]", (7,)),
]
FUSED = [("S0:2@[0,1]", "S1:2@[2,3]", (4, 6)), ("D:2@[1,2]", "S0:3@[0,1,3]", (5,)), ("@[3]", "P:2@[0,1]", (3, 2))]
FUSED_DTYPES = (torch.float64, torch.bfloat16, torch.float32)  # one switch, messages mixing dtypes


def tensor(i: int, shape) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + i))


def rank_program(backend, plan_texts: list[str], fused_text: str):
    """Every rank: create all groups, run each plan on its piece, then the fused plan."""
    plans = [Plan.from_json(text) for text in plan_texts]
    fused = FusedPlan.from_json(fused_text)
    backend.prepare_groups([g for p in plans for g in p.collective_groups()])
    outs = []
    for i, plan in enumerate(plans):
        local = shard(tensor(i, plan.shape), plan.src, seed=i).get(backend.rank)
        outs.append(execute_plan(plan, backend, local))
    locals_ = {i: shard(tensor(50 + i, m.shape).to(FUSED_DTYPES[i]), m.src).get(backend.rank)
               for i, m in enumerate(fused.moves)}
    return outs, execute_fused_plan(fused, backend, {i: t for i, t in locals_.items() if t is not None})


@pytest.mark.multiprocess
def test_plans_run_on_gloo_processes_reassemble_the_tensor():
    plans = [resolve(src, dst, shape, "2x2", dtype="float64") for src, dst, shape in CASES]
    fused = resolve_many([m + (d,) for m, d in zip(FUSED, FUSED_DTYPES)], "2x2")
    results = run_multiprocess(rank_program, WORLD, [p.to_json() for p in plans], fused.to_json(), timeout=120)
    for i, plan in enumerate(plans):
        pieces = {rank: outs[i] for rank, (outs, _) in enumerate(results) if outs[i] is not None}
        assert set(pieces) == set(plan.dst.devices)
        torch.testing.assert_close(unshard(pieces, plan.dst, shape=plan.shape), tensor(i, plan.shape))
    for i, (_, dst, shape) in enumerate(FUSED):
        pieces = {rank: got[i] for rank, (_, got) in enumerate(results) if i in got}
        assert set(pieces) == set(parse(dst).devices)
        expected = tensor(50 + i, shape).to(FUSED_DTYPES[i])
        assert all(p.dtype == FUSED_DTYPES[i] for p in pieces.values())
        torch.testing.assert_close(unshard(pieces, dst, shape=shape), expected, rtol=0, atol=0)
