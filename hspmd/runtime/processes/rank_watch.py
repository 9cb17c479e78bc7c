"""A node's rank processes: started with the job's environment, their output forwarded line by
line with their rank, and watched until the job ends: a plain job fails fast, an elastic job
announces a dead rank and restarts its slot, an elastic job over nodes reports to the job's
authority (hspmd.runtime.processes.authority). hspmd.runtime.processes.launcher decides which."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Mapping, Sequence

from hspmd.runtime.processes.affinity import CPUS_ENV
from hspmd.runtime.processes.authority import exit_key
from hspmd.runtime.processes.nodes import DEVICE_TYPE_ENV, NNODES_ENV, NODE_ADDR_ENV, NODE_ENV, NodeRole, interface_of
from hspmd.runtime.processes.process_groups import POLL_S, StopRequest, signal_group

_TAIL_LINES = 25
_NODES_POLL_S = 0.25


@dataclass(frozen=True)
class RankPlace:
    """What every rank of this node is told: the job's shape and store, this node, the backend;
    `device_types`: each local rank's device type ("" without a cluster); `extra`: more
    environment variables for every rank."""

    role: NodeRole
    port: int
    secret: str
    backend: str
    elastic: bool
    heartbeat: float
    device_types: tuple[str, ...]
    extra: Mapping[str, str]


class RankProcess:
    """One rank's process, with the last lines of its stderr (repeated when it fails)."""

    def __init__(self, rank: int, process: subprocess.Popen):
        self.rank, self.process = rank, process
        self.silent_for: float | None = None  # seconds without a heartbeat, when that ended the job
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)


FAILED_KEY = "nodes/failed"  # a multi-node job's store: why a node ended it (read by every node)


def start_rank(place: RankPlace, local: int, command: Sequence[str], joining: bool = False,
               cpus: str | None = None) -> RankProcess:
    """Start this node's rank `local` under rank_guard.py with the job's environment (torchrun's
    variables and hspmd's), in its own session; `joining`: it takes a dead rank's place in a
    running job; `cpus`: the CPUs it is pinned to."""
    role = place.role
    rank = role.global_rank(local)
    env = {**os.environ, **place.extra}
    # Like torchrun: one intra-op thread per rank unless the user says otherwise, so N ranks on
    # few cores do not oversubscribe them (4 ranks on 2 cores were ~25x slower without it).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=str(role.node_rank), WORLD_SIZE=str(role.world_size),
        LOCAL_WORLD_SIZE=str(role.nproc), MASTER_ADDR=role.master_addr, MASTER_PORT=str(place.port),
        HSPMD_BACKEND=place.backend, PYTHONUNBUFFERED="1", HSPMD_ELASTIC="1" if place.elastic else "0",
        HSPMD_JOB_SECRET=place.secret, HSPMD_STORE_HOSTED="1", HSPMD_HEARTBEAT_S=f"{place.heartbeat:g}",
        HSPMD_JOIN="1" if joining else "0",
        **{NODE_ENV: str(role.node_rank), NNODES_ENV: str(role.nnodes), NODE_ADDR_ENV: role.node_addr,
           DEVICE_TYPE_ENV: place.device_types[local] if place.device_types else ""},
    )
    # gloo's and NCCL's own connections listen on this node's interface (loopback for a local job);
    # gloo binds the node's address itself (hspmd.backends.torch_dist reads HSPMD_NODE_ADDR)
    interface = interface_of(role.node_addr) or "lo"
    env.setdefault("GLOO_SOCKET_IFNAME", interface)
    env.setdefault("NCCL_SOCKET_IFNAME", interface)
    env.pop(CPUS_ENV, None)
    if cpus is not None:  # the guard pins itself before it starts the rank, which inherits it
        env[CPUS_ENV] = cpus
    process = subprocess.Popen(
        [sys.executable, _GUARD, str(os.getpid()), *command], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    return RankProcess(rank, process)


_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_guard.py")


_write_lock = threading.Lock()


def start_pumps(rank: RankProcess, out: IO[str], err: IO[str]) -> list[threading.Thread]:
    pumps = [
        threading.Thread(target=_pump, args=(rank.process.stdout, out, rank.rank, None), daemon=True),
        threading.Thread(target=_pump, args=(rank.process.stderr, err, rank.rank, rank.stderr_tail), daemon=True),
    ]
    for pump in pumps:
        pump.start()
    return pumps


def _pump(pipe: IO[bytes], sink: IO[str], rank: int, tail: collections.deque | None) -> None:
    """Forward one child stream line by line, prefixed with its rank."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if tail is not None:
                tail.append(line)
            with _write_lock:
                sink.write(f"[rank {rank}] {line}\n")
                sink.flush()


def wait_for_end(ranks: list[RankProcess], stop: StopRequest, monitor=None, store=None) -> tuple[list[RankProcess], str | None]:
    """Block until every rank succeeded (returns [], None), some failed or stopped beating (returns
    them, first one first), a stop signal arrived, or (`store`: a multi-node job) another node
    reported a failure (returns [] and what it reported)."""
    by_rank = {r.rank: r for r in ranks}
    checked = 0.0
    while not stop.signal:
        codes = [r.process.poll() for r in ranks]
        failed = [r for r, code in zip(ranks, codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            return failed, None
        for rank, silent in monitor.stopped() if monitor is not None else ():
            by_rank[rank].silent_for = silent
            failed.append(by_rank[rank])
        if failed:
            return failed, None
        if store is not None and time.monotonic() - checked > _NODES_POLL_S:
            checked = time.monotonic()
            try:
                if store.check([FAILED_KEY]):
                    return [], store.get(FAILED_KEY).decode()
            except Exception:  # noqa: BLE001 - node 0's launcher and its store are gone
                return [], "the job's store (node 0) is gone"
        time.sleep(POLL_S)
    return [], None


class Restarter:
    """Restarts dead ranks' slots (up to `budget` in all) as joining processes."""

    def __init__(self, place: RankPlace, command, budget, out, err, ranks, pumps, cpus):
        self.place, self.command, self.cpus = place, command, cpus
        self.budget, self.out, self.err, self.ranks, self.pumps = budget, out, err, ranks, pumps

    def __call__(self, rank: int) -> RankProcess | None:
        if self.budget <= 0:
            return None
        self.budget -= 1
        local = rank - self.place.role.global_rank(0)
        fresh = start_rank(self.place, local, self.command, joining=True, cpus=self.cpus[local])
        self.ranks.append(fresh)
        self.pumps.extend(start_pumps(fresh, self.out, self.err))
        return fresh


def current_dead(store) -> set[int]:
    """The ranks the job's current generation counts as dead."""
    from hspmd.runtime.processes.membership import GENERATION_KEY, dead_key

    generation = int(store.add(GENERATION_KEY, 0))
    return set(json.loads(store.get(dead_key(generation)))) if generation else set()


def wait_elastic_node(ranks: list[RankProcess], stop: StopRequest, store, err: IO[str], role: NodeRole,
                      joining: bool = False) -> list[RankProcess]:
    """This node's part of an elastic multi-node job: report each local rank that exits non-zero to
    the authority (hspmd.runtime.processes.authority), SIGKILL a local rank the authority declared
    dead while it still runs (frozen, stuck), and return once every local rank has ended: [] when
    each finished or was declared dead, else the others (the last to fail first)."""
    from hspmd.runtime.processes.membership import GENERATION_KEY, dead_key

    reported: set[int] = set()
    dead: set[int] = set()
    generation = 0
    # a rank is killed for being declared dead only once it was alive in the job (a joining node's
    # ranks count as dead until the authority takes them back)
    members: set[int] = set() if joining else {r.rank for r in ranks}
    while not stop.signal:
        codes = [r.process.poll() for r in ranks]
        try:
            for r, code in zip(ranks, codes):
                if code not in (None, 0) and r.rank not in reported:
                    reported.add(r.rank)
                    store.set(exit_key(r.rank), f"its process exited with {describe_exit(code)}")
            announced = int(store.add(GENERATION_KEY, 0))
            if announced > generation:
                generation, dead = announced, set(json.loads(store.get(dead_key(announced))))
                members |= {r.rank for r in ranks if r.rank not in dead}
                for r in ranks:
                    if r.rank in dead and r.rank in members and r.process.poll() is None:
                        err.write(f"hspmd run: node {role.node_rank}: rank {r.rank} was declared dead (generation "
                                  f"{generation}) but still runs; killed it\n")
                        err.flush()
                        signal_group(r.process.pid, signal.SIGKILL)
                        r.process.wait()
        except Exception as exc:  # noqa: BLE001 - the authority is gone: nobody coordinates the job any more
            err.write(f"hspmd run: node {role.node_rank}: lost the job's authority ({exc}); stopping\n")
            return [r for r in ranks if r.process.poll() is None] or ranks
        if all(code is not None for code in codes):
            return [r for r, code in zip(ranks, codes) if code != 0 and r.rank not in dead][::-1]
        time.sleep(POLL_S)
    return []


def wait_elastic(ranks: list[RankProcess], stop: StopRequest, store, err: IO[str], restart: Restarter,
                 monitor=None) -> list[RankProcess]:
    """Announce every rank that exits non-zero as dead (hspmd.runtime.processes.membership.announce_death),
    restart its slot while the budget lasts (the new process says when it is ready; then a new
    generation takes it back), and keep going while any rank runs. A rank that stopped beating
    (`monitor`) is SIGKILLed, so that its death is announced like any other rather than its peers
    waiting out their collectives' timeout. Returns [] if some rank finished, else the failed
    ranks, the last to fail first (the survivors' own error, e.g. a weight that no living rank holds)."""
    from hspmd.runtime.processes.membership import announce_death, killed_note, ready_key  # torch only for elastic jobs

    dead: list[RankProcess] = []
    dead_ranks: set[int] = set()
    joining: dict[int, RankProcess] = {}
    while not stop.signal:
        for rank, silent in monitor.stopped() if monitor is not None else ():
            for r in ranks:
                if r.rank == rank and r.process.poll() is None:
                    err.write(f"hspmd run: rank {rank} stopped responding (no heartbeat for {silent:.0f}s: frozen or "
                              f"hung); killed it so that the others go on without it\n")
                    err.flush()
                    signal_group(r.process.pid, signal.SIGKILL)
                    r.process.wait()
        codes = [r.process.poll() for r in ranks]
        newly = [r for r, code in zip(ranks, codes) if code not in (None, 0) and r not in dead]
        if newly:
            dead += newly
            dead_ranks |= {r.rank for r in newly}
            for r in newly:
                joining.pop(r.rank, None)
            generation = announce_death(store, sorted(dead_ranks))
            where = "".join(f"; rank {r.rank} killed itself at {note}" for r in newly if (note := killed_note(store, r.rank)))
            err.write(f"hspmd run: rank(s) {[r.rank for r in newly]} died ({describe_exit(newly[0].process.returncode)}{where}); "
                      f"survivors continue as generation {generation}\n")
            err.flush()
            for r in newly:
                if any(s.rank != r.rank and s.process.poll() is None for s in ranks) and (fresh := restart(r.rank)):
                    joining[r.rank] = fresh
                    if monitor is not None:
                        monitor.restarted(r.rank)
                    err.write(f"hspmd run: restarted rank {r.rank} ({restart.budget} restart(s) left); it joins when ready\n")
        ready = [rank for rank in joining if store.check([ready_key(rank)])]
        if ready:
            for rank in ready:
                store.delete_key(ready_key(rank))
                del joining[rank]
                dead_ranks.discard(rank)
            generation = announce_death(store, sorted(dead_ranks), joined=ready)
            err.write(f"hspmd run: rank(s) {ready} joined the job as generation {generation}\n")
            err.flush()
        if all(code is not None for code in codes):
            return [] if any(code == 0 for code in codes) else dead[::-1]
        time.sleep(POLL_S)
    return []


def report_failure(failed: list[RankProcess], err: IO[str]) -> None:
    first = failed[0]
    others = ", ".join(str(r.rank) for r in failed[1:])
    also = f" (rank {others} failed at the same time)" if others else ""
    what = (f"stopped responding (no heartbeat for {first.silent_for:.0f}s: frozen or hung; its peers wait in "
            f"collectives for it)" if first.silent_for is not None else f"exited with {describe_exit(first.process.returncode)}")
    lines = [
        f"hspmd run: rank {first.rank} {what}{also}; stopped the other ranks.",
        f"hspmd run: last lines of rank {first.rank}'s stderr:",
        *(f"  {line}" for line in first.stderr_tail),
    ]
    err.write("\n".join(lines) + "\n")
    err.flush()


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:  # e.g. a real-time signal, which has no name
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def exit_code_of(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


__all__ = ["FAILED_KEY", "RankPlace", "RankProcess", "Restarter", "current_dead", "describe_exit", "exit_code_of",
           "report_failure", "start_pumps", "start_rank", "wait_elastic", "wait_elastic_node", "wait_for_end"]
