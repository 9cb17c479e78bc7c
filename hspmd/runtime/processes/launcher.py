"""`hspmd run -n N [--backend gloo|nccl|cupy] [--port P] [--pin-cpus] script.py args...`: N local ranks, one job.

Over several nodes: `hspmd run --nnodes M --node-rank K --master-addr HOST [--master-port P]
[--node-addr ADDR] [--cluster cluster.yaml] -n N script.py` on every node, with the job's secret in
HSPMD_JOB_SECRET (hspmd.runtime.processes.nodes: node 0 hosts the store, the nodes meet in a
rendezvous before any rank starts, ranks are numbered node by node).

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
import os
import sys
import threading
import time
from typing import IO, Sequence

from hspmd.arguments import ArgumentParser, non_negative_float, non_negative_int, positive_int
from hspmd.backends.from_env import BACKENDS, check_backend
from hspmd.backends.heartbeat import DEFAULT_INTERVAL_S as DEFAULT_HEARTBEAT_S
from hspmd.cluster import parse_cluster
from hspmd.cluster.emulation import CLUSTER_ENV
from hspmd.errors import LaunchError
from hspmd.limits import MAX_LOCAL_RANKS
from hspmd.runtime.processes.authority import done_key
from hspmd.runtime.processes.affinity import available_cpus, cpu_slices
from hspmd.runtime.processes.nodes import (
    DEFAULT_MASTER_PORT, DEFAULT_RENDEZVOUS_S, NodeRole, address_towards, check_bindable, check_cluster, cluster_digest,
    join_running_job, node_rendezvous,
)
from hspmd.runtime.processes.ports import LOOPBACK
from hspmd.runtime.processes.process_groups import POLL_S, StopRequest, install_stop_handlers, restore_handlers, stop_groups
from hspmd.runtime.processes.rank_watch import (
    FAILED_KEY, RankPlace, RankProcess, Restarter, current_dead, describe_exit, exit_code_of, report_failure, start_pumps,
    start_rank, wait_elastic, wait_elastic_node, wait_for_end,
)

DEFAULT_GRACE_S = 3.0
_PUMP_WAIT_S = 10.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="hspmd run",
        description="Launch N local processes of one job (rendezvous on 127.0.0.1), or this node's N of a multi-node job.",
    )
    parser.add_argument("-n", "--nproc", type=positive_int, default=None,
                        help="number of ranks to start (on this node; default with --cluster: one per device of the "
                             "cluster, or of this node's entry of it)")
    parser.add_argument("--cluster", default=None,
                        help="the cluster the job runs as (a .yaml file or a preset), passed to every rank in "
                             f"{CLUSTER_ENV}, each rank told its device type; with --nnodes node K of the cluster is node "
                             "K of the job; a file with an emulate block makes each rank run as its device type on this "
                             "host (hspmd.runtime.execution.emulation)")
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
    nodes = parser.add_argument_group("several nodes (the same command on every node, HSPMD_JOB_SECRET exported on each)")
    nodes.add_argument("--nnodes", type=positive_int, default=1, help="number of nodes of the job (default 1)")
    nodes.add_argument("--node-rank", type=non_negative_int, default=0, help="this node's index, 0..nnodes-1")
    nodes.add_argument("--master-addr", default=None, help="node 0's address: it hosts the job's store there")
    nodes.add_argument("--master-port", type=positive_int, default=None,
                       help=f"the store's port on --master-addr (default {DEFAULT_MASTER_PORT})")
    nodes.add_argument("--node-addr", default=None,
                       help="the address this node's ranks bind and advertise (default: the one that reaches --master-addr)")
    nodes.add_argument("--join", action="store_true",
                       help="with --elastic: this fresh node takes the place of lost node --node-rank in the running job, "
                            "which grows back to a strategy that uses it")
    nodes.add_argument("--rendezvous-timeout", type=non_negative_float, default=DEFAULT_RENDEZVOUS_S,
                       help=f"seconds to wait for every node (default {DEFAULT_RENDEZVOUS_S:g})")
    parser.add_argument("script", nargs="?", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    cluster_env = {}
    if args.cluster is not None:
        cluster = parse_cluster(args.cluster)  # a bad file is one line naming its key (hspmd.cli)
        if args.nproc is None and args.nnodes > 1 and args.node_rank < len(cluster.nodes):
            args.nproc = cluster.nodes[args.node_rank].devices
        args.nproc = cluster.n_devices if args.nproc is None else args.nproc
        if args.nnodes == 1 and args.nproc > cluster.n_devices:
            parser.error(f"-n {args.nproc} ranks but cluster {cluster.describe()} has {cluster.n_devices} devices")
        cluster_env[CLUSTER_ENV] = os.path.abspath(args.cluster) if os.path.isfile(args.cluster) else args.cluster
    if args.nproc is None:
        parser.error("give the number of ranks (-n N) or a cluster (--cluster FILE)")
    if args.nproc > MAX_LOCAL_RANKS:
        parser.error(f"-n {args.nproc} is over the limit of {MAX_LOCAL_RANKS} local ranks")
    for flag, port in (("--port", args.port), ("--master-port", args.master_port)):
        if port is not None and port > 65535:
            parser.error(f"{flag} must be 1-65535, got {port}")
    if args.script is None:
        parser.error("give the Python script every rank runs, e.g. hspmd run -n 2 examples/llama/train.py")
    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} does not exist")
    command = [sys.executable, args.script, *args.script_args]
    if args.elastic and args.backend != "gloo":
        parser.error("--elastic runs over gloo (the per-generation groups are gloo groups)")
    if args.max_restarts and not args.elastic:
        parser.error("--max-restarts needs --elastic (a restarted rank joins the running job)")
    role = node_role(parser, args)
    return launch(command, args.nproc, backend=args.backend, port=args.port, grace=args.grace, elastic=args.elastic,
                  max_restarts=args.max_restarts, heartbeat=args.heartbeat, pin_cpus=args.pin_cpus, env=cluster_env,
                  role=role, cluster=args.cluster, rendezvous_timeout=args.rendezvous_timeout, join=args.join)


def node_role(parser: ArgumentParser, args: argparse.Namespace) -> NodeRole | None:
    """This launcher's node of a multi-node job (None for a one-node job), its arguments and cluster
    file checked here, before anything starts."""
    if args.nnodes == 1 and args.master_addr is None:
        for flag, value in (("--node-rank", args.node_rank), ("--node-addr", args.node_addr),
                            ("--master-port", args.master_port)):
            if value:
                parser.error(f"{flag} is for jobs of several nodes: give --nnodes N and --master-addr HOST")
        return None
    if args.node_rank >= args.nnodes:
        parser.error(f"--node-rank {args.node_rank} is outside the job's nodes 0-{args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.nnodes > 1 and args.master_addr is None:
        parser.error("--nnodes needs --master-addr HOST (node 0's address, where the job's store listens)")
    if args.port is not None and args.nnodes > 1:
        parser.error("--port is for one-node jobs; give --master-port")
    if args.join and not (args.elastic and args.nnodes > 1):
        parser.error("--join is for a node of an elastic multi-node job (--elastic --nnodes N)")
    if args.elastic and args.max_restarts and args.nnodes > 1:
        parser.error("--max-restarts restarts ranks of one node; across nodes start a fresh node with --join")
    master = args.master_addr or LOOPBACK
    port = args.master_port or (args.port if args.nnodes == 1 and args.port else DEFAULT_MASTER_PORT)
    node_addr = args.node_addr or (master if args.nnodes == 1 else address_towards(master, port))
    check_bindable(node_addr)
    role = NodeRole(args.nnodes, args.node_rank, args.nproc, master, port, node_addr)
    if args.cluster is not None:
        check_cluster(parse_cluster(args.cluster), role, args.cluster)
    return role


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
    role: NodeRole | None = None,
    cluster: str | None = None,
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_S,
    secret: str | None = None,
    join: bool = False,
) -> int:
    """Run `command` as `nprocs` ranks of this node and return the job's exit code (0 when all succeed).

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
    `env`: more environment variables for every rank (e.g. HSPMD_CLUSTER from --cluster). `role`: this
    node of a multi-node job (hspmd.runtime.processes.nodes): node 0 hosts the store at the master
    address, every node takes part in the node rendezvous (bounded by `rendezvous_timeout`), its
    ranks are numbered node by node, and a failure on any node stops every node.
    `cluster`: the job's cluster (a YAML file or a preset): each rank is told its device's type
    (HSPMD_DEVICE_TYPE); a multi-node job's cluster must have its nodes and their sizes.
    `secret`: the job's secret (default: HSPMD_JOB_SECRET for a multi-node job, a fresh one otherwise).
    `join`: this node is fresh and takes the place of lost node `role.node_rank` in a running elastic job
    (its ranks start as restarted ranks: the authority takes them back, the survivors fill them)."""
    from hspmd.backends.heartbeat import HeartbeatMonitor
    from hspmd.backends.store import new_secret, secret_from_env  # imports torch: only once a job is launched

    check_backend(backend, nprocs)
    cpus = [",".join(map(str, c)) for c in cpu_slices(available_cpus(), nprocs)] if pin_cpus else [None] * nprocs
    out, err = stdout or sys.stdout, stderr or sys.stderr
    multi = role is not None and role.nnodes > 1
    if role is not None and role.nproc != nprocs:
        raise LaunchError(f"node {role.node_rank}: the role says {role.nproc} ranks per node but {nprocs} were asked for")
    spec = parse_cluster(cluster) if cluster else None
    if spec is not None and multi:
        check_cluster(spec, role, cluster)
    secret = secret or (secret_from_env().decode() if multi else new_secret())
    # an elastic multi-node job's store is hosted by its authority (`hspmd authority`), which outlives any node
    store = _job_store(role if multi else None, port, secret, rendezvous_timeout, host=not (multi and elastic))
    try:
        if multi and join:
            join_running_job(store, role, cluster_digest(cluster), current_dead(store))
        elif multi:
            node_rendezvous(store, role, cluster_digest(cluster), rendezvous_timeout, server=store.server)
    except BaseException:
        _close(store, linger=_REFUSAL_LINGER_S if multi else 0.0)
        raise
    role = role or NodeRole(1, 0, nprocs, LOOPBACK, store.port, LOOPBACK)
    types = tuple(spec.device_type(r).name if r < spec.n_devices else "" for r in role.ranks) if spec else ()
    place = RankPlace(role, store.port, secret, backend, elastic, heartbeat, types, env or {})
    monitor = HeartbeatMonitor(store, role.ranks, heartbeat) if heartbeat > 0 and not (multi and elastic) else None
    stop = StopRequest()
    previous_handlers = install_stop_handlers(stop)
    ranks: list[RankProcess] = []
    pumps: list[threading.Thread] = []
    failed: list[RankProcess] = []
    elsewhere = None
    try:
        for local in range(nprocs):
            if stop.signal:
                break
            ranks.append(start_rank(place, local, command, joining=join, cpus=cpus[local]))
        # Pumps (threads) start only after every Popen: preexec_fn is not safe once threads run.
        pumps = [pump for r in ranks for pump in start_pumps(r, out, err)]
        if not stop.signal:
            if elastic and multi:
                failed = wait_elastic_node(ranks, stop, store, err, role, joining=join)
            elif elastic:
                restart = Restarter(place, command, max_restarts, out, err, ranks, pumps, cpus)
                failed = wait_elastic(ranks, stop, store, err, restart, monitor)
            else:
                failed, elsewhere = wait_for_end(ranks, stop, monitor, store if multi else None)
    except KeyboardInterrupt:
        stop.signal = "SIGINT"
    finally:
        stop_groups([r.process for r in ranks], grace)
        restore_handlers(previous_handlers)
        # every rank is reaped: the pumps end once they have forwarded the last lines (a failing
        # rank's error among them), which on a busy machine may take a moment; one shared bound,
        # should something outside the ranks' groups still hold a pipe open
        deadline = time.monotonic() + max(grace, _PUMP_WAIT_S)
        for pump in pumps:
            pump.join(timeout=max(0.0, deadline - time.monotonic()))
        if multi:
            _end_node(store, role, stop.signal, failed, grace + rendezvous_timeout)
        _close(store)
    if stop.signal:
        err.write(f"hspmd run: interrupted ({stop.signal}); stopped all {len(ranks)} started rank(s)\n")
        err.flush()
        return 130
    if failed:
        report_failure(failed, err)
        return exit_code_of(failed[0].process.returncode)
    if elsewhere:
        err.write(f"hspmd run: node {role.node_rank} stopped its ranks: {elsewhere}\n")
        err.flush()
        return 1
    return 0


def _job_store(role: NodeRole | None, port: int | None, secret: str, timeout: float, host: bool = True):
    """The job's store: hosted here on loopback for a one-node job; for a multi-node job hosted by
    node 0 at the master address (bound to it only; by the authority instead when not `host`) and
    joined by every node's launcher."""
    from hspmd.backends.store import JobStore, open_store
    from hspmd.errors import CommunicationError

    if role is None:
        return _host_store(port, secret)
    where = f"{role.master_addr}:{role.master_port}"
    try:
        if role.node_rank == 0 and host:
            return open_store(role.master_addr, role.master_port, is_master=True, secret=secret.encode(), timeout=timeout)
        store = JobStore(role.master_addr, role.master_port, secret.encode(), timeout)
        store.confirm()
        return store
    except CommunicationError as exc:
        text = str(exc)
        if "refused this process" in text or "does not know the job's secret" in text:
            raise LaunchError(f"node {role.node_rank}: the job's store at {where} refused this node: its HSPMD_JOB_SECRET "
                              f"is not the job's") from None
        raise LaunchError(f"node {role.node_rank}: {text}") from None


# after a failed node rendezvous node 0 keeps the store this long at most, until the other nodes
# (which poll every few ms) have read why and left, so that each names the cause, not a lost store
_REFUSAL_LINGER_S = 2.0


def _close(store, linger: float = 0.0) -> None:
    """Close this launcher's side of the store; the host first waits up to `linger` seconds for
    the other connections to close."""
    if store.server is None:
        store.close()
        return
    end = time.monotonic() + linger
    while store.server.open_connections > 1 and time.monotonic() < end:
        time.sleep(POLL_S)
    store.server.close()


def _end_node(store, role: NodeRole, interrupted: str | None, failed: list, wait: float) -> None:
    """Tell the other nodes how this one ended (a failure stops them too); node 0, which hosts the
    store, waits (bounded) until every node has ended before the store goes away."""
    try:
        if (interrupted or failed) and not store.check([FAILED_KEY]):
            what = f"interrupted ({interrupted})" if interrupted else \
                f"rank {failed[0].rank} {describe_exit(failed[0].process.returncode)}"
            store.set(FAILED_KEY, f"node {role.node_rank}: {what}")
        store.set(done_key(role.node_rank), "1")
        if store.server is not None:
            end = time.monotonic() + wait
            keys = [done_key(k) for k in range(role.nnodes)]
            while not store.check(keys) and time.monotonic() < end:
                time.sleep(POLL_S * 4)
    except Exception:  # noqa: BLE001 - the store is gone: node 0 ended, nobody is left to tell
        pass


def _host_store(port: int | None, secret: str):
    """The job's store lives in the launcher, so it outlives any rank (bound to loopback, open only
    to holders of the job's secret: hspmd.backends.store)."""
    from hspmd.backends.store import open_store

    return open_store(LOOPBACK, port or 0, is_master=True, secret=secret.encode())


__all__ = ["main", "launch", "BACKENDS"]
