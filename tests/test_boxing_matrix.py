"""Exhaustive boxing matrix (after OneFlow's boxing test): every pair of S0, S1, D, P layouts over
device sets [0,1], [0,1,2], [1,2,3], [0,1,2,3], same sets and different sets alike, on an uneven
shape. Each plan (the default, chosen by cost, and the hierarchical one) must be structurally sound
and reproduce the tensor; on one device set the hierarchical primitive must be the one of paper
figure 5; a Partial source on other devices is reduced where it lies first, and refused in
paper-strict mode."""

from __future__ import annotations

import itertools

import pytest
import torch

from hspmd import resolve
from hspmd.comm_resolve.verify import check_plan
from hspmd.errors import UnsupportedReshard
from hspmd.backends.plan_executor import reshard_tensor

DEVICE_SETS = ["[0,1]", "[0,1,2]", "[1,2,3]", "[0,1,2,3]"]
KINDS = ["S0", "S1", "D", "P"]
SHAPE = (5, 7)
SAME_SET = {
    ("P", "D"): "AllReduce", ("P", "S0"): "ReduceScatter", ("P", "S1"): "ReduceScatter",
    ("S0", "D"): "AllGather", ("S1", "D"): "AllGather",
    ("D", "S0"): "LocalSplit", ("D", "S1"): "LocalSplit", ("D", "P"): "LocalSplit",
    ("S0", "P"): "LocalSplit", ("S1", "P"): "LocalSplit",
    ("S0", "S1"): "BatchedSendRecv", ("S1", "S0"): "BatchedSendRecv",
}


def layout(kind: str, devices: str) -> str:
    return f"{kind}:{devices.count(',') + 1}@{devices}"


CASES = [
    (layout(a, da), layout(b, db), a, b, da, db)
    for (a, da), (b, db) in itertools.product(itertools.product(KINDS, DEVICE_SETS), repeat=2)
]


@pytest.mark.parametrize("src, dst, a, b, da, db", CASES, ids=[f"{c[0]}->{c[1]}" for c in CASES])
def test_boxing(src, dst, a, b, da, db):
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(len(CASES)))
    chosen = resolve(src, dst, SHAPE, "2x2", dtype="float64")
    plan = resolve(src, dst, SHAPE, "2x2", dtype="float64", via="hierarchical")
    for p in (chosen, plan):
        check_plan(p)
        torch.testing.assert_close(reshard_tensor(p, x, seed=7), x)
    assert chosen.estimated_seconds <= plan.estimated_seconds
    if da == db:
        assert plan.primitives == (SAME_SET.get((a, b), "Identity"),)
    elif a != "P":
        same_layout = a == b and da.count(",") == db.count(",")
        assert plan.primitives == ("SendRecv" if same_layout else "BatchedSendRecv",)
    elif b == "P" and da.count(",") == db.count(","):
        assert plan.primitives == ("SendRecv",)
    else:
        assert plan.primitives[0] in ("ReduceScatter", "AllReduce") and len(plan.primitives) == 2
        with pytest.raises(UnsupportedReshard):
            resolve(src, dst, SHAPE, reduce_partial=False)
