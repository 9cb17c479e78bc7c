"""Every Backend method over real gloo processes gives what the in-process reference backend gives.

One per-rank program exercises all methods (uneven shapes, subset groups in any member order,
overlapping groups, asymmetric and partial point-to-point patterns); it runs once on threads
(LocalBackend) and once on 4 spawned gloo processes, and the per-rank results must be identical.
Inputs are integer-valued so sums are exact whatever order a backend adds in.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest
import torch

from hspmd.errors import CommunicationError, HSPMDError
from hspmd.backends.backend import Backend
from hspmd.backends.local import run_on_devices
from hspmd.runtime.processes.multiprocess import run_multiprocess

WORLD = 4


def data(rank: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct small integers for each (rank, tag), so every misplaced piece shows."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n) + 100 * rank + 1000 * tag).reshape(shape).to(dtype)


# Groups each rank uses in the first phase; every rank passes only its own to prepare_groups.
FIRST_GROUPS = [(3, 1), (0, 1, 2), (1, 2, 3), (2, 0, 3), (1, 3)]
SECOND_GROUPS = [(3, 0), (2, 3)]


def backend_program(backend: Backend) -> dict[str, Any]:
    r = backend.rank
    world = tuple(range(WORLD))
    out: dict[str, Any] = {}
    backend.prepare_groups([g for g in FIRST_GROUPS if r in g])

    out["all_reduce_world"] = backend.all_reduce(data(r, 1, (2, 3)), (3, 1, 0, 2))
    if r in (3, 1):
        out["all_reduce_pair"] = backend.all_reduce(data(r, 2, (4,), torch.int64), (3, 1))
    # overlapping groups, used in one consistent order by the ranks they share
    if r in (0, 1, 2):
        out["all_reduce_012"] = backend.all_reduce(data(r, 3, (3,), torch.float64), (0, 1, 2))
    if r in (1, 2, 3):
        out["all_reduce_123"] = backend.all_reduce(data(r, 4, (2,)), (1, 2, 3))
    if r in (0, 1, 2):
        out["all_gather_012"] = backend.all_gather(data(r, 5, (r + 1,)), (0, 1, 2), [(1,), (2,), (3,)])
    out["all_reduce_single"] = backend.all_reduce(data(r, 6, (2,)), (r,))

    out["all_gather_world"] = backend.all_gather(
        data(r, 7, (r + 1, 2)), (2, 0, 3, 1), [(3, 2), (1, 2), (4, 2), (2, 2)]
    )
    if r in (2, 0, 3):  # uneven, with an empty member and a different rank of tensor order
        shapes = {2: (2, 3), 0: (0, 3), 3: (1, 3)}
        out["all_gather_empty_member"] = backend.all_gather(
            data(r, 8, shapes[r], torch.int64), (2, 0, 3), [shapes[2], shapes[0], shapes[3]]
        )

    part_shapes = [(1,), (3,), (2, 2), (0,)]  # member i of (1, 3, 0, 2) gets part_shapes[i]
    out["reduce_scatter_world"] = backend.reduce_scatter(
        [data(r, 9 + i, s) for i, s in enumerate(part_shapes)], (1, 3, 0, 2)
    )
    if r in (3, 1):
        out["reduce_scatter_pair"] = backend.reduce_scatter([data(r, 13, (2,)), data(r, 14, (5,))], (3, 1))

    out["broadcast_world"] = backend.broadcast(data(r, 15, (2, 2), torch.float64), 2, world)
    if r in (1, 2, 3):
        out["broadcast_subset"] = backend.broadcast(data(r, 16, (3,)), 3, (2, 3, 1))

    backend.barrier(world)
    if r in (1, 3):
        backend.barrier((1, 3))

    # rank 0 only sends, rank 3 only receives, ranks 1 and 2 do both; shapes and dtypes differ
    asym_sends = {0: {1: data(0, 17, (2, 2)), 3: data(0, 18, (3,), torch.int64)}, 1: {2: data(1, 19, (1,))},
                  2: {3: data(2, 20, (2,))}, 3: {}}
    asym_recvs = {0: {}, 1: {0: ((2, 2), torch.float32)}, 2: {1: ((1,), torch.float32)},
                  3: {0: ((3,), torch.int64), 2: ((2,), torch.float32)}}
    out["exchange_asymmetric"] = backend.exchange(asym_sends[r], asym_recvs[r])

    # both ring directions at once: every rank sends to and receives from both neighbours
    right, left = (r + 1) % WORLD, (r - 1) % WORLD
    out["exchange_ring"] = backend.exchange(
        {right: data(r, 21, (r + 1,)), left: data(r, 22, (2,))},
        {left: ((left + 1,), torch.float32), right: ((2,), torch.float32)},
    )

    # partial pattern: 1 and 3 swap, 0 only talks to itself, 2 takes no part at all
    if r in (1, 3):
        peer = 4 - r
        out["exchange_swap"] = backend.exchange({peer: data(r, 23, (2, 1))}, {peer: ((2, 1), torch.float32)})
    if r == 0:
        out["exchange_self"] = backend.exchange({0: data(0, 24, (3,))}, {0: ((3,), torch.float32)})
    # an empty message and a rank with nothing to do
    if r in (0, 2):
        out["exchange_empty_message"] = backend.exchange(
            {2: data(0, 25, (0, 4))} if r == 0 else {}, {0: ((0, 4), torch.float32)} if r == 2 else {}
        )
    if r == 1:
        out["exchange_nothing"] = backend.exchange({}, {})

    # a later phase with new groups (as after a strategy switch)
    backend.prepare_groups([g for g in SECOND_GROUPS if r in g])
    if r in (3, 0):
        out["all_reduce_second_phase"] = backend.all_reduce(data(r, 26, (2,)), (3, 0))
    if r in (2, 3):
        out["all_gather_second_phase"] = backend.all_gather(data(r, 27, (r,)), (2, 3), [(2,), (3,)])
    return out


def misuse_messages(backend: Backend) -> dict[str, str]:
    """Mistakes that each rank detects on its own, before touching the network, so none desyncs."""
    r = backend.rank
    attempts = {
        "unprepared": lambda: backend.all_reduce(torch.ones(1), (0, 2) if r == 2 else (0, 1, 3)),
        "not_a_member": lambda: backend.all_reduce(torch.ones(1), tuple(x for x in range(WORLD) if x != r)),
        "wrong_shape": lambda: backend.all_gather(torch.ones(2), (0, 1, 2, 3), [(1,)] * WORLD),
        "bad_peer": lambda: backend.exchange({WORLD + 3: torch.ones(1)}, {}),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except CommunicationError as exc:
            messages[name] = str(exc)
    return messages


def program_and_misuse(backend: Backend) -> tuple[dict[str, Any], dict[str, str]]:
    results = backend_program(backend)
    messages = misuse_messages(backend)
    backend.barrier(tuple(range(WORLD)))
    return results, messages


def assert_same(got: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape)), where
        assert torch.equal(got, expected), f"{where}: {got} != {expected}"
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(expected), f"{where}: keys {sorted(got)}"
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    else:
        assert isinstance(got, list) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]")


@pytest.fixture(scope="module")
def reference() -> dict[int, dict[str, Any]]:
    return run_on_devices(backend_program, range(WORLD))


@pytest.fixture(scope="module")
def gloo_run() -> list[tuple[dict[str, Any], dict[str, str]]]:
    return run_multiprocess(program_and_misuse, WORLD, timeout=120, comm_timeout=30)


def test_reference_program_is_meaningful(reference):
    """Guards the comparison below against a program that silently computes nothing."""
    assert torch.equal(reference[0]["all_reduce_world"], sum(data(r, 1, (2, 3)) for r in range(WORLD)))
    assert [t.shape for t in reference[1]["all_gather_world"]] == [(3, 2), (1, 2), (4, 2), (2, 2)]
    assert torch.equal(reference[3]["exchange_asymmetric"][2], data(2, 20, (2,)))
    assert torch.equal(reference[0]["reduce_scatter_world"], sum(data(r, 11, (2, 2)) for r in range(WORLD)))
    assert "exchange_swap" not in reference[2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", range(WORLD))
def test_gloo_processes_match_the_in_process_backend(rank, reference, gloo_run):
    results, _ = gloo_run[rank]
    assert_same(results, reference[rank], f"rank {rank}")


@pytest.mark.multiprocess
def test_local_mistakes_raise_communication_errors_that_say_what_to_do(gloo_run):
    for rank, (_, messages) in enumerate(gloo_run):
        assert "prepare_groups" in messages["unprepared"]
        assert "not in" in messages["not_a_member"] and f"rank {rank}" in messages["not_a_member"]
        assert "one shape per member" in messages["wrong_shape"]
        assert f"peer {WORLD + 3}" in messages["bad_peer"]


def raise_on_rank_one(backend: Backend) -> None:
    if backend.rank == 1:
        raise ValueError("rank one cannot go on")
    backend.all_reduce(torch.ones(3), (0, 1))


def wait_for_a_peer_that_never_comes(backend: Backend) -> None:
    if backend.rank == 0:
        backend.all_reduce(torch.ones(3), (0, 1))
    else:
        time.sleep(60)


@pytest.mark.multiprocess
def test_a_raising_rank_fails_the_job_with_its_traceback():
    # the job's limit (60 s) is far below the collective timeout (300 s): had rank 0 waited for its
    # peer's collective to time out, the job would end with a timeout error, not rank 1's own
    with pytest.raises(HSPMDError) as info:
        run_multiprocess(raise_on_rank_one, 2, timeout=60, comm_timeout=300)
    message = str(info.value)
    assert message.startswith("rank 1 failed")
    assert "ValueError: rank one cannot go on" in message
    assert "raise_on_rank_one" in message  # the traceback, not just the message


@pytest.mark.multiprocess
def test_a_collective_nobody_joins_times_out_with_a_communication_error():
    # the collective timeout (1 s) must fire well before the job's limit (60 s), whose error differs
    with pytest.raises(HSPMDError) as info:
        run_multiprocess(wait_for_a_peer_that_never_comes, 2, timeout=60, comm_timeout=1)
    message = str(info.value)
    assert message.startswith("rank 0 failed")
    assert "CommunicationError: all_reduce on group [0, 1] failed on rank 0" in message


def sum_of_many_tensors(backend: Backend, tensors: list[torch.Tensor]) -> float:
    return float(sum(t.sum() for t in tensors)) + backend.rank


@pytest.mark.multiprocess
def test_hundreds_of_tensor_arguments_reach_every_rank():
    """Arguments travel as plain pickled bytes: one file descriptor per tensor would run out."""
    tensors = [torch.full((2,), float(i)) for i in range(300)]
    expected = float(sum(2 * i for i in range(300)))
    assert run_multiprocess(sum_of_many_tensors, 2, tensors, timeout=60) == [expected, expected + 1]


def test_backend_refuses_to_start_without_torch_distributed():
    from hspmd.backends.torch_dist import TorchDistBackend

    with pytest.raises(CommunicationError, match="init_from_env"):
        TorchDistBackend()


def test_init_from_env_names_the_missing_variables(monkeypatch):
    from hspmd.backends.torch_join import init_from_env

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(HSPMDError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*hspmd run"):
        init_from_env("gloo")


CUPY_MISSING = importlib.util.find_spec("cupy") is None


@pytest.mark.skipif(not CUPY_MISSING, reason="CuPy is installed")
def test_cupy_backend_without_cupy_says_to_install_the_gpu_extra():
    from hspmd.backends.cupy_nccl import CupyNcclBackend

    with pytest.raises(HSPMDError, match=r"hspmd\[gpu\]"):
        CupyNcclBackend(store=None, rank=0, world_size=1)


def test_cupy_backend_joins_the_store_hspmd_run_hosts(monkeypatch):
    """Under `hspmd run` the launcher hosts the job's store: rank 0 must join it, not bind its port."""
    from hspmd.backends.cupy_nccl import CupyNcclBackend
    from hspmd.backends.store import LOOPBACK, SECRET_ENV, STORE_HOSTED_ENV, new_secret, open_store

    secret = new_secret()
    hosted = open_store(LOOPBACK, 0, is_master=True, secret=secret.encode())
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": LOOPBACK,
           "MASTER_PORT": str(hosted.port), STORE_HOSTED_ENV: "1", SECRET_ENV: secret}
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    class Joined(CupyNcclBackend):
        def __init__(self, store, *args):
            self.store = store

    try:
        joined = Joined.from_env(timeout=10)
        joined.store.set("hello", "world")
        assert hosted.get("hello") == b"world"
    finally:
        hosted.server.close()


def test_cupy_backend_logic_matches_the_in_process_backend_on_a_fake_nccl(reference, monkeypatch):
    """CupyNcclBackend's own logic (store rendezvous of unique ids, union of prepared groups, member
    order, padding, byte views, grouped point-to-point) over a CPU stand-in for cupy.cuda.nccl."""
    import threading

    import torch.distributed as dist

    import fake_nccl
    from hspmd.backends import cupy_nccl

    monkeypatch.setattr(cupy_nccl, "nccl", fake_nccl.nccl)
    monkeypatch.setattr(cupy_nccl, "cupy", fake_nccl.cupy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake_nccl.Stream())
    monkeypatch.setattr(torch.cuda, "Event", fake_nccl.Event)
    store = dist.HashStore()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def rank_thread(rank: int) -> None:
        try:
            backend = cupy_nccl.CupyNcclBackend(store, rank, WORLD, timeout=20, namespace="fake")
            backend.device = torch.device("cpu")  # the fake "device memory" is CPU memory
            results[rank] = backend_program(backend)
            backend.barrier(tuple(range(WORLD)))
            backend.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for rank in range(WORLD):
        assert_same(results[rank], reference[rank], f"rank {rank}")


def _gpu_ranks_available(n: int) -> bool:
    return not CUPY_MISSING and torch.cuda.is_available() and torch.cuda.device_count() >= n


class _OnCuda(Backend):
    """Feeds the CPU-written program's tensors to a CUDA backend."""

    def __init__(self, inner: Backend):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def prepare_groups(self, groups):
        self.inner.prepare_groups(groups)

    def all_reduce(self, tensor, group):
        return self.inner.all_reduce(tensor.cuda(), group)

    def all_gather(self, tensor, group, shapes):
        return self.inner.all_gather(tensor.cuda(), group, shapes)

    def reduce_scatter(self, parts, group):
        return self.inner.reduce_scatter([p.cuda() for p in parts], group)

    def exchange(self, sends, recvs):
        return self.inner.exchange({p: t.cuda() for p, t in sends.items()}, recvs)

    def barrier(self, group):
        self.inner.barrier(group)

    def broadcast(self, tensor, src, group):
        return self.inner.broadcast(tensor.cuda(), src, group)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return [_to_cpu(v) for v in value]


def torch_nccl_rank(backend: Backend) -> dict[str, Any]:
    """The reference program on TorchDistBackend over NCCL (CUDA tensors), results moved to the CPU."""
    return _to_cpu(backend_program(_OnCuda(backend)))


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= WORLD), reason=f"needs {WORLD} CUDA GPUs"
)
def test_torch_nccl_matches_the_in_process_backend(reference):
    results = run_multiprocess(torch_nccl_rank, WORLD, backend="nccl", timeout=180)
    for rank in range(WORLD):
        assert_same(results[rank], reference[rank], f"rank {rank}")


def cupy_rank(backend: Backend) -> dict[str, Any]:
    """The reference program on CupyNcclBackend (CUDA tensors), results moved to the CPU."""
    from hspmd.backends.cupy_nccl import CupyNcclBackend

    nccl_backend = CupyNcclBackend.from_env(timeout=60)
    try:
        return _to_cpu(backend_program(_OnCuda(nccl_backend)))
    finally:
        nccl_backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ranks_available(WORLD), reason=f"needs CuPy and {WORLD} CUDA GPUs")
def test_cupy_nccl_matches_the_in_process_backend(reference):
    results = run_multiprocess(cupy_rank, WORLD, timeout=180)
    for rank in range(WORLD):
        assert_same(results[rank], reference[rank], f"rank {rank}")


def groups_follow_the_world_object(backend: Backend) -> tuple[float, str]:
    """Groups belong to the TorchDistWorld a backend is given (no process-wide table): a second
    backend over the same world uses a group the first prepared; one over a fresh world has none."""
    from hspmd.backends.torch_dist import TorchDistBackend, TorchDistWorld

    backend.prepare_groups([(0, 1)])
    shared = TorchDistBackend(timeout=30, world=backend.world)  # construction is collective: every rank
    fresh = TorchDistBackend(timeout=30, world=TorchDistWorld())
    if backend.rank == 2:
        return 0.0, ""
    total = float(shared.all_reduce(torch.tensor([backend.rank + 1.0]), (0, 1))[0])
    try:
        fresh.all_reduce(torch.tensor([1.0]), (0, 1))
        message = ""
    except CommunicationError as exc:
        message = str(exc)
    return total, message


@pytest.mark.multiprocess
def test_process_groups_belong_to_the_world_object_they_were_prepared_on():
    results = run_multiprocess(groups_follow_the_world_object, 3, timeout=60)
    assert [r[0] for r in results] == [3.0, 3.0, 0.0]
    assert all("prepare_groups" in r[1] for r in results[:2])


def test_a_libraries_failure_becomes_one_typed_error_and_hspmds_own_passes():
    """failures_as: any other exception inside is raised again as the given CommunicationError
    (the operation named, then the failure's type and message, then the hint), chained to it; an
    HSPMDError is already typed and passes unchanged; nothing raised, nothing changes."""
    from hspmd.backends.backend import failures_as
    from hspmd.backends.generation import PeerLost
    from hspmd.errors import CommunicationError, HSPMDError

    with pytest.raises(CommunicationError, match=r"^all_reduce on rank 3: RuntimeError: timed out\n\(hint\)$") as info:
        with failures_as("all_reduce on rank 3", hint="\n(hint)"):
            raise RuntimeError("timed out")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(PeerLost, match="form group: ValueError: bad"):
        with failures_as("form group", PeerLost):
            raise ValueError("bad")
    own = HSPMDError("already typed")
    with pytest.raises(HSPMDError) as info:
        with failures_as("anything"):
            raise own
    assert info.value is own
    with failures_as("nothing"):
        done = True
    assert done
