"""Memory during a reshard: each device allocates at most its destination piece, the step's source
piece when an earlier step made it, and one message-sized buffer each way (memory_bound), measured
by counting the live bytes of the storages each rank creates (LiveBytes), over random resolver
plans in-process and the issue's cases on gloo processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd import device_pieces, parse, shard, unshard
from hspmd.backends.backend import Backend
from hspmd.backends.local import LocalWorld
from hspmd.backends.memory import LiveBytes, memory_bound
from hspmd.backends.plan_executor import execute_fused_plan, execute_plan
from hspmd.comm_resolve import resolve, resolve_many
from hspmd.runtime.processes.multiprocess import run_multiprocess
from test_resolve_property import reshards

SHAPE = (64, 48)
FLOAT = 4


def _measured(plan, locals_, execute, device="cpu"):
    """{device: (result, LiveBytes)} of running `plan` in-process, each rank tracking itself."""
    def body(backend: Backend):
        with LiveBytes() as live:
            out = execute(plan, backend, locals_.get(backend.rank))
        return out, live

    return LocalWorld(plan.devices, device=device).run(body)


def _bytes(annotation, shape, device) -> int:
    piece = device_pieces(annotation, shape).get(device)
    return 0 if piece is None else torch.Size(piece.shape).numel() * FLOAT


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reshards(), st.sampled_from([None, "2x8", "h800-h20:1+1"]), st.integers(1, 4))
def test_every_resolver_plan_keeps_the_memory_bound(case, topology, scale):
    src, dst, shape = case
    shape = tuple(n * scale for n in shape)
    x = torch.randn(shape)
    plan = resolve(src, dst, shape, topology, dtype="float32")
    runs = _measured(plan, shard(x, src, seed=1), execute_plan)
    for device, (_, live) in runs.items():
        assert live.peak <= memory_bound(plan, device), (device, live.peak, memory_bound(plan, device), plan.primitives)
    result = {d: out for d, (out, _) in runs.items() if out is not None}
    torch.testing.assert_close(unshard(result, dst, shape=shape), x, rtol=1e-5, atol=1e-5)


def test_a_fused_plan_keeps_the_memory_bound():
    moves = [(parse("S0:2@[0,1]"), parse("S1:2@[2,3]"), (40, 24)), (parse("D:2@[0,1]"), parse("S0:4@[0-3]"), (32, 8)),
             (parse("S1:4@[0-3]"), parse("S0:2,S1:2@[0-3]"), (16, 16))]
    plan = resolve_many(moves, None)
    wholes = [torch.randn(shape) for _, _, shape in moves]
    locals_ = {}
    for tid, ((src, _, _), x) in enumerate(zip(moves, wholes)):
        for d, t in shard(x, src).items():
            locals_.setdefault(d, {})[tid] = t
    runs = _measured(plan, locals_, lambda p, b, mine: execute_fused_plan(p, b, mine or {}))
    for device, (_, live) in runs.items():
        assert live.peak <= memory_bound(plan, device)
    for tid, ((_, dst, shape), x) in enumerate(zip(moves, wholes)):
        pieces = {d: out[tid] for d, (out, _) in runs.items() if tid in out}
        torch.testing.assert_close(unshard(pieces, dst, shape=shape), x)


# The issue's cases (there on 16 MB: AllGather peaked at 48 MB, [S0,S1] -> [R,R] at 64 MB): with the
# in-process backend nothing is staged, so each rank allocates exactly its new pieces.
EXACT = [
    ("S0:4@[0-3]", "D:4@[0-3]", lambda d: _bytes(parse("D:4@[0-3]"), SHAPE, d)),  # AllGather: the destination
    ("P:4@[0-3]", "D:4@[0-3]", lambda d: _bytes(parse("D:4@[0-3]"), SHAPE, d)),  # AllReduce
    ("P:4@[0-3]", "S0:4@[0-3]", lambda d: _bytes(parse("S0:4@[0-3]"), SHAPE, d)),  # ReduceScatter
    # two AllGathers: the intermediate [S0, R] piece and the destination, nothing else
    ("S0:2,S1:2@[0-3]", "D:2,D:2@[0-3]",
     lambda d: _bytes(parse("S0:2,D:2@[0-3]"), SHAPE, d) + _bytes(parse("D:4@[0-3]"), SHAPE, d)),
]


@pytest.mark.parametrize("src,dst,expected", EXACT, ids=[f"{s}->{d}" for s, d, _ in EXACT])
def test_the_issues_cases_allocate_only_their_pieces_in_process(src, dst, expected):
    plan = resolve(src, dst, SHAPE)
    x = torch.randn(SHAPE)
    runs = _measured(plan, shard(x, plan.src, seed=2), execute_plan)
    assert {d: live.peak for d, (_, live) in runs.items()} == {d: expected(d) for d in runs}
    torch.testing.assert_close(unshard({d: out for d, (out, _) in runs.items()}, plan.dst, shape=SHAPE), x)


def test_the_tracker_sees_what_a_zero_fill_then_copy_allocates():
    """The measure can fail: an executor that zero-fills and then copies a whole gathered tensor
    in (what the old AllGather did) shows three destination pieces' worth."""
    with LiveBytes() as live:
        out = torch.zeros(SHAPE)
        gathered = [torch.randn(16, 48) for _ in range(4)]
        joined = torch.cat(gathered)
        out.copy_(joined)
        del gathered, joined
    assert live.peak == 3 * 64 * 48 * FLOAT and live.live == 64 * 48 * FLOAT
    del out


def test_buffers_follow_the_device_under_the_tracker():
    """LiveBytes counts meta storages too: the bound holds on the stand-in device."""
    plan = resolve("S0:2,S1:2@[0-3]", "D:4@[0-3]", SHAPE)
    locals_ = {d: torch.empty_like(t, device="meta") for d, t in shard(torch.zeros(SHAPE), plan.src).items()}
    runs = _measured(plan, locals_, execute_plan, device="meta")
    for device, (out, live) in runs.items():
        assert out.device.type == "meta" and 0 < live.peak <= memory_bound(plan, device)


# ---- gloo: the torch.distributed backend stages at most one piece each way ------------------------

GLOO_CASES = [
    ("S0:4@[0-3]", "D:4@[0-3]"), ("S1:4@[0-3]", "D:4@[0-3]"), ("P:4@[0-3]", "D:4@[0-3]"),
    ("P:4@[0-3]", "S0:4@[0-3]"), ("P:4@[0-3]", "S1:4@[0-3]"), ("S0:2,S1:2@[0-3]", "D:2,D:2@[0-3]"),
    ("S0:4@[0-3]", "S1:4@[0-3]"), ("S0:2@[0,1]", "S1:2@[2,3]"), ("H0(3:1){S1:3@[0,1,2] | @[3]}", "HD{S1:2@[0,1] | S1:2@[2,3]}"),
]


def gloo_rank(backend: Backend, native: bool):
    torch.set_num_threads(1)
    backend.native_in_place = native
    out = []
    for src, dst in GLOO_CASES:
        plan = resolve(src, dst, SHAPE)
        backend.prepare_groups([g for g in plan.collective_groups() if backend.rank in g])
        local = shard(torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)), plan.src, seed=4).get(backend.rank)
        with LiveBytes() as live:
            result = execute_plan(plan, backend, local)
        out.append((result, live.peak, memory_bound(plan, backend.rank)))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("native", [False, True], ids=["point-to-point", "one-buffer collectives"])
def test_gloo_reshards_keep_the_memory_bound(native):
    """Point to point is what gloo runs; the one-buffer collectives (NCCL's path) are forced here
    to check their results (gloo stages them on its own thread, which LiveBytes does not see)."""
    per_rank = run_multiprocess(gloo_rank, 4, native, timeout=120)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    for i, (src, dst) in enumerate(GLOO_CASES):
        results = {rank: r[i][0] for rank, r in enumerate(per_rank) if r[i][0] is not None}
        torch.testing.assert_close(unshard(results, parse(dst), shape=SHAPE), x, rtol=1e-5, atol=1e-5)
        for rank, r in enumerate(per_rank):
            assert r[i][1] <= r[i][2], (src, dst, rank, r[i][1], r[i][2])
