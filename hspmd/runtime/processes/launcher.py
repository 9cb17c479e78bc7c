"""`hspmd run -n N [--backend gloo|nccl|cupy] [--port P] [--pin-cpus] script.py args...`: N local ranks, one job.

Each rank is `python script.py args...` with the torchrun variables set (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT) plus HSPMD_BACKEND,
so the same script also runs under torchrun; a script joins with hspmd.backends.from_env.backend_from_env()
(gloo, NCCL through torch, or NCCL through CuPy). A backend this machine cannot run (NCCL or CuPy
without a GPU, CuPy not installed) is refused in one line before any rank starts. Every rank runs in its own process group (session),
so stopping a rank also stops whatever it started. The job fails fast: when one rank exits
non-zero its error is shown and the others are stopped (SIGTERM, then SIGKILL after a grace
period); Ctrl-C or SIGTERM to the launcher stops every rank as well.

The launcher hosts the job's store (hspmd.backends.store: loopback only, a per-job secret in
HSPMD_JOB_SECRET), watches the ranks' heartbeats (hspmd.backends.heartbeat: a frozen rank is named
after --heartbeat seconds, 30 by default, not left to time out its peers' collectives after 300 s)
and starts each rank under rank_guard.py, which kills the rank's whole process group if the
launcher itself is SIGKILLed.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from hspmd.arguments import ArgumentParser, non_negative_float, non_negative_int, positive_int
from hspmd.backends.from_env import BACKENDS, check_backend
from hspmd.backends.heartbeat import DEFAULT_INTERVAL_S as DEFAULT_HEARTBEAT_S
from hspmd.cluster.emulation import CLUSTER_ENV
from hspmd.limits import MAX_LOCAL_RANKS
from hspmd.runtime.processes.affinity import CPUS_ENV, available_cpus, cpu_slices
from hspmd.runtime.processes.ports import LOOPBACK

DEFAULT_GRACE_S = 3.0
_KILL_WAIT_S = 5.0
_PUMP_WAIT_S = 10.0
_TAIL_LINES = 25
_POLL_S = 0.05


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="hspmd run",
        description="Launch N local processes of one job (rendezvous on 127.0.0.1).",
    )
    parser.add_argument("-n", "--nproc", type=positive_int, default=None,
                        help="number of ranks to start (default with --cluster: one per device of the cluster)")
    parser.add_argument("--cluster", default=None,
                        help="the cluster the job runs as (a .yaml file or a preset), passed to every rank in "
                             f"{CLUSTER_ENV}; a file with an emulate block makes each rank run as its device type "
                             "on this host (hspmd.runtime.execution.emulation)")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo",
                        help="gloo (CPU), nccl (torch.distributed on GPUs) or cupy (NCCL through CuPy); sets HSPMD_BACKEND")
    parser.add_argument("--port", type=positive_int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--grace", type=non_negative_float, default=DEFAULT_GRACE_S,
                        help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--heartbeat", type=non_negative_float, default=DEFAULT_HEARTBEAT_S,
                        help="seconds without a rank's heartbeat before it is declared stopped and the job ended "
                             f"(with --elastic: the rank is killed and the others go on) (default {DEFAULT_HEARTBEAT_S:g}; 0: off)")
    parser.add_argument("--elastic", action="store_true",
                        help="a rank that dies does not end the job: the launcher hosts the store and announces "
                             "each death to the survivors, which recover without it (hspmd.runtime.policies.elastic)")
    parser.add_argument("--max-restarts", type=non_negative_int, default=0,
                        help="with --elastic: restart a dead rank's slot up to this many times in all; the new "
                             "process joins the running job and receives its pieces from the survivors")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="give each rank its own CPUs (contiguous slices; round-robin when ranks outnumber CPUs)")
    parser.add_argument("script", nargs="?", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    cluster_env = {}
    if args.cluster is not None:
        from hspmd.cluster import parse_cluster

        cluster = parse_cluster(args.cluster)  # a bad file is one line naming its key (hspmd.cli)
        args.nproc = cluster.n_devices if args.nproc is None else args.nproc
        if args.nproc > cluster.n_devices:
            parser.error(f"-n {args.nproc} ranks but cluster {cluster.describe()} has {cluster.n_devices} devices")
        cluster_env[CLUSTER_ENV] = os.path.abspath(args.cluster) if os.path.isfile(args.cluster) else args.cluster
    if args.nproc is None:
        parser.error("give the number of ranks (-n N) or a cluster (--cluster FILE)")
    if args.nproc > MAX_LOCAL_RANKS:
        parser.error(f"-n {args.nproc} is over the limit of {MAX_LOCAL_RANKS} local ranks")
    if args.port is not None and args.port > 65535:
        parser.error(f"--port must be 1-65535, got {args.port}")
    if args.script is None:
        parser.error("give the Python script every rank runs, e.g. hspmd run -n 2 examples/llama/train.py")
    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} does not exist")
    command = [sys.executable, args.script, *args.script_args]
    if args.elastic and args.backend != "gloo":
        parser.error("--elastic runs over gloo (the per-generation groups are gloo groups)")
    if args.max_restarts and not args.elastic:
        parser.error("--max-restarts needs --elastic (a restarted rank joins the running job)")
    return launch(command, args.nproc, backend=args.backend, port=args.port, grace=args.grace, elastic=args.elastic,
                  max_restarts=args.max_restarts, heartbeat=args.heartbeat, pin_cpus=args.pin_cpus, env=cluster_env)


def launch(
    command: Sequence[str],
    nprocs: int,
    backend: str = "gloo",
    port: int | None = None,
    grace: float = DEFAULT_GRACE_S,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    elastic: bool = False,
    max_restarts: int = 0,
    heartbeat: float = DEFAULT_HEARTBEAT_S,
    pin_cpus: bool = False,
    env: dict[str, str] | None = None,
) -> int:
    """Run `command` as ranks 0..nprocs-1 and return the job's exit code (0 when all succeed).

    Output lines are forwarded prefixed with `[rank k]`. The first rank to exit non-zero decides
    the exit code; the others are stopped and the failing rank's last stderr lines are repeated.
    `elastic`: the launcher hosts the rendezvous store and announces each rank's death there (a
    new generation) instead of stopping the others; the job succeeds when a rank finishes.
    `max_restarts`: how many dead ranks may be restarted in all (elastic only); a restarted rank
    joins the running job (HSPMD_JOIN=1) and the survivors take it back.
    The launcher hosts the job's store (loopback, per-job secret) and, unless `heartbeat` is 0,
    ends the job naming a rank whose heartbeat stood still for `heartbeat` seconds (a frozen rank,
    found long before its peers' collectives time out; an elastic job kills it and goes on). Every rank runs under rank_guard.py, so
    no rank or grandchild outlives a launcher that is SIGKILLed. `pin_cpus`: each rank (and a
    restarted one in its slot) runs on its own CPUs (hspmd.runtime.processes.affinity.cpu_slices).
    `env`: more environment variables for every rank (e.g. HSPMD_CLUSTER from --cluster)."""
    from hspmd.backends.heartbeat import HeartbeatMonitor
    from hspmd.backends.store import new_secret  # imports torch: only once a job is launched

    check_backend(backend, nprocs)
    cpus = [",".join(map(str, c)) for c in cpu_slices(available_cpus(), nprocs)] if pin_cpus else [None] * nprocs

    out, err = stdout or sys.stdout, stderr or sys.stderr
    secret = new_secret()
    store = _host_store(port, secret)
    port = store.port
    monitor = HeartbeatMonitor(store, range(nprocs), heartbeat) if heartbeat > 0 else None
    stop = _StopRequest()
    previous_handlers = _install_stop_handlers(stop)
    ranks: list[_Rank] = []
    pumps: list[threading.Thread] = []
    failed: list[_Rank] = []
    try:
        for rank in range(nprocs):
            if stop.signal:
                break
            ranks.append(_start_rank(rank, command, nprocs, backend, port, secret, elastic, heartbeat, cpus=cpus[rank],
                                     extra=env))
        # Pumps (threads) start only after every Popen: preexec_fn is not safe once threads run.
        pumps = [pump for r in ranks for pump in _start_pumps(r, out, err)]
        if not stop.signal:
            if elastic:
                restart = _Restarter(command, nprocs, backend, port, secret, heartbeat, max_restarts, out, err, ranks,
                                     pumps, cpus, env)
                failed = _wait_elastic(ranks, stop, store, err, restart, monitor)
            else:
                failed = _wait_for_end(ranks, stop, monitor)
    except KeyboardInterrupt:
        stop.signal = "SIGINT"
    finally:
        _stop_all(ranks, grace)
        _restore_handlers(previous_handlers)
        # every rank is reaped: the pumps end once they have forwarded the last lines (a failing
        # rank's error among them), which on a busy machine may take a moment; one shared bound,
        # should something outside the ranks' groups still hold a pipe open
        deadline = time.monotonic() + max(grace, _PUMP_WAIT_S)
        for pump in pumps:
            pump.join(timeout=max(0.0, deadline - time.monotonic()))
        store.server.close()
    if stop.signal:
        err.write(f"hspmd run: interrupted ({stop.signal}); stopped all {len(ranks)} started rank(s)\n")
        err.flush()
        return 130
    if failed:
        _report_failure(failed, err)
        return _exit_code(failed[0].process.returncode)
    return 0


class _Rank:
    def __init__(self, rank: int, process: subprocess.Popen):
        self.rank, self.process = rank, process
        self.silent_for: float | None = None  # seconds without a heartbeat, when that ended the job
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)


def _host_store(port: int | None, secret: str):
    """The job's store lives in the launcher, so it outlives any rank (bound to loopback, open only
    to holders of the job's secret: hspmd.backends.store)."""
    from hspmd.backends.store import open_store

    return open_store(LOOPBACK, port or 0, is_master=True, secret=secret.encode())


def _start_rank(rank: int, command: Sequence[str], nprocs: int, backend: str, port: int, secret: str,
                elastic: bool = False, heartbeat: float = 0.0, joining: bool = False, cpus: str | None = None,
                extra: dict[str, str] | None = None) -> _Rank:
    env = {**os.environ, **(extra or {})}
    # Like torchrun: one intra-op thread per rank unless the user says otherwise, so N ranks on
    # few cores do not oversubscribe them (4 ranks on 2 cores were ~25x slower without it).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
        HSPMD_BACKEND=backend, PYTHONUNBUFFERED="1", HSPMD_ELASTIC="1" if elastic else "0", HSPMD_JOB_SECRET=secret,
        HSPMD_STORE_HOSTED="1", HSPMD_HEARTBEAT_S=f"{heartbeat:g}", HSPMD_JOIN="1" if joining else "0",
    )
    # gloo's own connections between ranks listen on loopback too (the job is local)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.pop(CPUS_ENV, None)
    if cpus is not None:  # the guard pins itself before it starts the rank, which inherits it
        env[CPUS_ENV] = cpus
    process = subprocess.Popen(
        [sys.executable, _GUARD, str(os.getpid()), *command], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    return _Rank(rank, process)


_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_guard.py")


_write_lock = threading.Lock()


def _start_pumps(rank: _Rank, out: IO[str], err: IO[str]) -> list[threading.Thread]:
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


def _wait_for_end(ranks: list[_Rank], stop: "_StopRequest", monitor=None) -> list[_Rank]:
    """Block until every rank succeeded (returns []), some failed or stopped beating (returns them,
    first one first) or a stop signal arrived (returns [])."""
    while not stop.signal:
        codes = [r.process.poll() for r in ranks]
        failed = [r for r, code in zip(ranks, codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            return failed
        for rank, silent in monitor.stopped() if monitor is not None else ():
            ranks[rank].silent_for = silent
            failed.append(ranks[rank])
        if failed:
            return failed
        time.sleep(_POLL_S)
    return []


class _Restarter:
    """Restarts dead ranks' slots (up to `budget` in all) as joining processes."""

    def __init__(self, command, nprocs, backend, port, secret, heartbeat, budget, out, err, ranks, pumps, cpus, extra=None):
        self.command, self.nprocs, self.backend, self.port, self.secret = command, nprocs, backend, port, secret
        self.heartbeat, self.cpus, self.extra = heartbeat, cpus, extra
        self.budget, self.out, self.err, self.ranks, self.pumps = budget, out, err, ranks, pumps

    def __call__(self, rank: int) -> _Rank | None:
        if self.budget <= 0:
            return None
        self.budget -= 1
        fresh = _start_rank(rank, self.command, self.nprocs, self.backend, self.port, self.secret, elastic=True,
                            heartbeat=self.heartbeat, joining=True, cpus=self.cpus[rank], extra=self.extra)
        self.ranks.append(fresh)
        self.pumps.extend(_start_pumps(fresh, self.out, self.err))
        return fresh


def _wait_elastic(ranks: list[_Rank], stop: "_StopRequest", store, err: IO[str], restart: _Restarter,
                  monitor=None) -> list[_Rank]:
    """Announce every rank that exits non-zero as dead (hspmd.runtime.processes.membership.announce_death),
    restart its slot while the budget lasts (the new process says when it is ready; then a new
    generation takes it back), and keep going while any rank runs. A rank that stopped beating
    (`monitor`) is SIGKILLed, so that its death is announced like any other rather than its peers
    waiting out their collectives' timeout. Returns [] if some rank finished, else the failed
    ranks, the last to fail first (the survivors' own error, e.g. a weight that no living rank holds)."""
    from hspmd.runtime.processes.membership import announce_death, killed_note, ready_key  # torch only for elastic jobs

    dead: list[_Rank] = []
    dead_ranks: set[int] = set()
    joining: dict[int, _Rank] = {}
    while not stop.signal:
        for rank, silent in monitor.stopped() if monitor is not None else ():
            for r in ranks:
                if r.rank == rank and r.process.poll() is None:
                    err.write(f"hspmd run: rank {rank} stopped responding (no heartbeat for {silent:.0f}s: frozen or "
                              f"hung); killed it so that the others go on without it\n")
                    err.flush()
                    _signal_group(r.process.pid, signal.SIGKILL)
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
            err.write(f"hspmd run: rank(s) {[r.rank for r in newly]} died ({_describe(newly[0].process.returncode)}{where}); "
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
        time.sleep(_POLL_S)
    return []


def _stop_all(ranks: list[_Rank], grace: float) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after `grace` seconds, reap all.
    Groups of ranks that already exited are signalled too, so nothing they started outlives the job."""
    for r in ranks:
        _signal_group(r.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_group_alive(r.process.pid) for r in ranks):
        for r in ranks:
            r.process.poll()
        time.sleep(_POLL_S)
    for r in ranks:
        _signal_group(r.process.pid, signal.SIGKILL)
        r.process.wait()
    # a rank is the guard's child: once the guard is reaped, wait (bounded) for the rest of each group
    deadline = time.monotonic() + _KILL_WAIT_S
    while time.monotonic() < deadline and any(_group_alive(r.process.pid) for r in ranks):
        time.sleep(_POLL_S)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """True while a process of group `pgid` runs (zombies, dead but not yet reaped, do not count)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


class _StopRequest:
    """Set by a signal handler; polled by the launcher loop, so a signal never interrupts the
    start-up or the clean-up of the ranks half-way."""

    signal: str | None = None


def _install_stop_handlers(stop: _StopRequest) -> dict[int, object]:
    """Turn SIGINT / SIGTERM / SIGHUP into a clean stop of all ranks (only possible from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def request(signum, frame):
        stop.signal = stop.signal or signal.Signals(signum).name

    return {sig: signal.signal(sig, request) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def _restore_handlers(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _report_failure(failed: list[_Rank], err: IO[str]) -> None:
    first = failed[0]
    others = ", ".join(str(r.rank) for r in failed[1:])
    also = f" (rank {others} failed at the same time)" if others else ""
    what = (f"stopped responding (no heartbeat for {first.silent_for:.0f}s: frozen or hung; its peers wait in "
            f"collectives for it)" if first.silent_for is not None else f"exited with {_describe(first.process.returncode)}")
    lines = [
        f"hspmd run: rank {first.rank} {what}{also}; stopped the other ranks.",
        f"hspmd run: last lines of rank {first.rank}'s stderr:",
        *(f"  {line}" for line in first.stderr_tail),
    ]
    err.write("\n".join(lines) + "\n")
    err.flush()


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:  # e.g. a real-time signal, which has no name
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


__all__ = ["main", "launch", "BACKENDS"]
