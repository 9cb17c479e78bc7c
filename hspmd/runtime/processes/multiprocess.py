"""Run one function on N real processes joined by torch.distributed, and collect what each returns.

Tests and tools use it to check that per-rank programs behave the same over real gloo processes as
over the in-process backend. It never hangs: a rank that raises, crashes or outlives the deadline
ends the whole job and the caller gets an HSPMDError carrying the failing rank's traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import secrets
import time
import traceback
from typing import Any, Callable

from hspmd.errors import CommunicationError, HSPMDError
from hspmd.runtime.processes.affinity import available_cpus, cpu_slices, pin
from hspmd.runtime.processes.ports import LOOPBACK, free_port

# After a CommunicationError, how long to wait for the other ranks' reports: it may only be the
# echo of a peer's own failure, and the caller wants that original error.
_REPORT_GRACE_S = 2.0
_TERMINATE_GRACE_S = 3.0
# Ranks start at different times (each imports torch); a short comm_timeout must not cut that off.
_RENDEZVOUS_S = 60.0


def run_multiprocess(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    comm_timeout: float = 30.0,
    pin_cpus: bool = False,
) -> list[Any]:
    """Run fn(backend, *args) on ranks 0..nprocs-1 and return their results, indexed by rank.

    `fn` must be importable by name and `args` and the results picklable (ranks are forked from a
    fork server, not from the caller). `backend` is the torch.distributed backend name; `timeout`
    bounds the whole job, `comm_timeout` each collective; `pin_cpus` gives each rank its own CPUs
    (hspmd.runtime.processes.affinity). Raises HSPMDError naming the failing
    rank, with its traceback, if any rank fails."""
    if nprocs < 1:
        raise HSPMDError(f"run_multiprocess needs nprocs >= 1, got {nprocs}")
    ctx = _context()
    reports: Any = ctx.Queue()
    port = free_port()
    secret = secrets.token_hex(32)  # the job store's per-job secret (hspmd.backends.store)
    # Plain pickle copies tensors into the bytes; multiprocessing's own pickler would share each one
    # through a file descriptor, and a few hundred tensors exhaust the fds one message may carry.
    job = pickle.dumps((fn, args))
    cpus = cpu_slices(available_cpus(), nprocs) if pin_cpus else [None] * nprocs
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(job, rank, nprocs, port, secret, backend, comm_timeout, reports, cpus[rank]),
            name=f"hspmd-rank-{rank}",
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    succeeded = False
    try:
        results = _collect(procs, reports, timeout)
        succeeded = True
        return results
    finally:
        _stop(procs, graceful=succeeded)
        reports.close()


def _context():
    """Fork ranks from a fork server that has imported torch once (never from the caller, whose
    threads fork would copy mid-flight): each rank then starts in a fraction of a second."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "hspmd.backends.torch_dist"])
    return ctx


def _collect(procs: list, reports: Any, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: dict[int, tuple[bool, str]] = {}
    exited_silently: dict[int, float] = {}
    first_failure_at: float | None = None
    while len(results) + len(failures) < len(procs):
        now = time.monotonic()
        if any(not is_comm for is_comm, _ in failures.values()):
            break
        if first_failure_at is not None and now - first_failure_at > _REPORT_GRACE_S:
            break
        if now > deadline:
            if failures:
                break
            silent = [r for r in range(len(procs)) if r not in results]
            raise HSPMDError(
                f"multi-process job timed out after {timeout:g}s: ranks {silent} never finished "
                "(does a rank wait on a collective its peers never call?)"
            )
        try:
            rank, ok, payload = reports.get(timeout=0.05)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if proc.exitcode is None or rank in results or rank in failures:
                    continue
                since = exited_silently.setdefault(rank, now)
                if now - since > _REPORT_GRACE_S:
                    failures[rank] = (False, f"rank {rank} exited with code {proc.exitcode} without a report")
                    first_failure_at = first_failure_at or now
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            first_failure_at = first_failure_at or time.monotonic()
    if failures:
        raise HSPMDError(_failure_message(failures))
    return [results[r] for r in range(len(procs))]


def _failure_message(failures: dict[int, tuple[bool, str]]) -> str:
    """The first reported failure that is not a CommunicationError is the cause, with its whole
    traceback; the rest most likely follow from it, each named by its error's last line (where
    every rank failed communicating, which waited for what tells a deadlock from a dead peer)."""
    original = [r for r, (is_comm, _) in failures.items() if not is_comm]
    rank = (original or list(failures))[0]
    others = sorted(set(failures) - {rank})
    also = f" (ranks {others} failed too, most likely as a consequence)" if others else ""
    lines = "".join(f"\nrank {r}: {_last_line(failures[r][1])}" for r in others)
    return f"rank {rank} failed{also}:\n{failures[rank][1]}{lines}"


def _last_line(report: str) -> str:
    """A failure report's error line: the last line that says which error, not a hint after it."""
    lines = [line for line in report.strip().splitlines() if line.strip()]
    named = [line for line in lines if not line.startswith((" ", "(")) and ":" in line]
    return (named or lines or ["(no report)"])[-1]


def _stop(procs: list, graceful: bool) -> None:
    """Let finished ranks exit on their own (graceful), else SIGTERM now; SIGKILL after a grace."""
    end = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        if graceful:
            proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _rank_main(job, rank, nprocs, port, secret, backend, comm_timeout, reports, cpus) -> None:
    """Body of one rank: join the world, run fn, report (ok, result) or (False, traceback).
    (`job` is pickled by this process's parent over multiprocessing's pipe, never read from the network.)"""
    if cpus is not None:  # before the backend starts its threads, so that they inherit it
        pin(cpus)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), HSPMD_BACKEND=backend, HSPMD_JOB_SECRET=secret,
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from hspmd.backends.torch_join import init_from_env

    comm = None
    try:
        fn, args = pickle.loads(job)
        comm = init_from_env(backend, timeout=comm_timeout, rendezvous_timeout=max(comm_timeout, _RENDEZVOUS_S))
        result = pickle.dumps(fn(comm, *args))
        reports.put((rank, True, result))
    except BaseException as exc:  # noqa: BLE001 - forwarded to the parent
        text = "".join(traceback.format_exception(exc))
        reports.put((rank, False, (isinstance(exc, CommunicationError), text)))
        return
    comm.shutdown()


__all__ = ["run_multiprocess"]
