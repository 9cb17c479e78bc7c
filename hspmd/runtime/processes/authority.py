"""The membership authority of an elastic job over several nodes: `hspmd authority`.

On one host the launcher is the authority (it sees its ranks exit). Over several nodes the
authority must outlive any training node, so it is a process of its own, started before the nodes
on a host of the user's choice (like torchft's Lighthouse), with the job's secret exported:

    hspmd authority --addr HOST --port P [--heartbeat S] [--stuck S]     # once
    hspmd run --elastic --nnodes N --node-rank K --master-addr HOST --master-port P -n R ...   # every node

It hosts the job's store (hspmd.backends.store: bound to HOST, every message authenticated) and is
the only writer of generations (hspmd.runtime.processes.membership.announce_death), so announcements never
race. It learns the job's shape from the node rendezvous and declares a rank dead when

  * its heartbeat connection closes (its process ended: a SIGKILLed node's ranks all at once;
    the store server reports the closed connection, no beat needs to be missed),
  * its node's launcher reports its exit (`elastic/exit/<rank>`),
  * its heartbeat stands still for `--heartbeat` seconds (a frozen process or a cut network),
  * it holds everyone up while it beats: no rank's communication progress has moved for `--stuck`
    seconds and it is the one not waiting, or the one behind (HeartbeatMonitor.stuck),

and announces each set of deaths (and of restarted ranks that are ready) as one new generation,
naming the nodes that lost all their ranks under ``elastic/why/<g>``. A rank declared dead that
still runs (frozen, stuck) is SIGKILLed by its own node's launcher, which watches the generations.
The survivors recover as on one host (hspmd.runtime.policies.elastic).
"""

from __future__ import annotations

import json
import sys
import time
from typing import IO, Sequence

from hspmd.arguments import ArgumentParser, non_negative_float, positive_int
from hspmd.errors import LaunchError
from hspmd.backends.heartbeat import BEAT_PREFIX, HeartbeatMonitor
from hspmd.runtime.processes.membership import GENERATION_KEY, announce_death, finished_key, ready_key, why_key
from hspmd.runtime.processes.nodes import DEFAULT_RENDEZVOUS_S, JOB_KEY, node_key

_POLL_S = 0.02
DEFAULT_STUCK_S = 30.0


def exit_key(rank: int) -> str:
    return f"elastic/exit/{rank}"


def done_key(node: int) -> str:
    return f"nodes/done/{node}"


class Authority:
    """Polls the store it hosts and announces generations (module docstring). `store` is a
    JobStore with its `server`; `world_size` ranks, `nproc` per node."""

    def __init__(self, store, world_size: int, nproc: int, heartbeat: float, stuck: float, err: IO[str]):
        self.store, self.world_size, self.nproc, self.stuck, self.err = store, world_size, nproc, stuck, err
        self.prefix = BEAT_PREFIX
        self.monitor = HeartbeatMonitor(store, range(world_size), heartbeat, check_every=min(0.25, heartbeat / 4)) \
            if heartbeat > 0 else None
        self.dead: set[int] = set()
        self.announced: list[dict] = []

    @property
    def alive(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.dead]

    def poll(self) -> None:
        """One look at the store: announce what died (or came back) since the last look."""
        found: dict[int, str] = {}
        for key in self.store.server.take_closed_keys():
            rank = int(key[len(self.prefix):])
            if rank not in self.dead and not self.store.check([finished_key(rank)]):
                found.setdefault(rank, "its process ended (its connection to the store closed)")
        for rank in self.alive:
            if rank not in found and self.store.check([exit_key(rank)]) and not self.store.check([finished_key(rank)]):
                found[rank] = self.store.get(exit_key(rank)).decode()
        if self.monitor is not None:
            self.monitor.ranks = [r for r in self.alive if not self.store.check([finished_key(r)])]
            for rank, silent in self.monitor.stopped():
                found.setdefault(rank, f"no heartbeat for {silent:.1f}s (frozen, or its node cut off)")
            if self.stuck > 0 and not found:
                for rank in self.monitor.stuck(self.stuck):
                    found.setdefault(rank, f"alive but no communication progress anywhere for {self.stuck:g}s while "
                                           f"its peers wait (stuck)")
        ready = {r for r in self.dead if self.store.check([ready_key(r)])}
        # a fresh node's ranks are taken back together, once all of them are ready (one generation,
        # one fused BSR fills them), not one by one as each finishes importing
        joined = sorted(r for r in ready
                        if all(q in ready for q in self._node_ranks(r // self.nproc) if q in self.dead))
        if found or joined:
            self._announce(found, joined)

    def _node_ranks(self, node: int) -> range:
        return range(node * self.nproc, (node + 1) * self.nproc)

    def _announce(self, found: dict[int, str], joined: list[int]) -> None:
        for rank in joined:
            self.store.delete_key(ready_key(rank))
            self.store.delete_key(exit_key(rank))
            if self.monitor is not None:
                self.monitor.restarted(rank)
        self.dead = (self.dead | set(found)) - set(joined)
        nodes = sorted({r // self.nproc for r in found})
        lost = [k for k in nodes if all(r in self.dead for r in self._node_ranks(k))]
        why = "; ".join(f"rank {r} on node {r // self.nproc}: {text}" for r, text in sorted(found.items()))
        record = {"ranks": sorted(found), "lost_nodes": lost, "joined": joined, "why": why, "time": time.time()}
        generation = int(self.store.add(GENERATION_KEY, 0)) + 1
        self.store.set(why_key(generation), json.dumps(record))
        announce_death(self.store, sorted(self.dead), joined=joined)
        self.announced.append(record)
        said = (f"node(s) {lost} lost; " if lost else "") + (why or "")
        if joined:
            said += (" " if said else "") + f"rank(s) {joined} joined"
        self.err.write(f"hspmd authority: {said}; survivors continue as generation {generation}\n")
        self.err.flush()

    def finished(self) -> bool:
        """Every node's launcher has ended, or every rank is dead."""
        nodes = range(self.world_size // self.nproc)
        ended = [k for k in nodes if self.store.check([done_key(k)])
                 or all(r in self.dead for r in range(k * self.nproc, (k + 1) * self.nproc))]
        return len(ended) == len(nodes)


def serve(host: str, port: int, heartbeat: float, stuck: float, rendezvous_timeout: float,
          err: IO[str] | None = None, secret: str | None = None, ready=None) -> int:
    """Host the job's store at host:port and be its authority until every node has ended.
    `ready`: called with the store once it listens (tests)."""
    from hspmd.backends.store import open_store, secret_from_env

    err = err or sys.stderr
    key = secret.encode() if secret else secret_from_env()
    store = open_store(host, port, is_master=True, secret=key, timeout=rendezvous_timeout)
    store.server.track_prefix = BEAT_PREFIX
    try:
        if ready is not None:
            ready(store)
        end = time.monotonic() + rendezvous_timeout
        while not store.check([JOB_KEY]):
            if time.monotonic() > end:
                raise LaunchError(f"hspmd authority at {host}:{store.port}: node 0 never published the job within "
                                  f"{rendezvous_timeout:g}s")
            time.sleep(_POLL_S * 5)
        job = json.loads(store.get(JOB_KEY).decode())
        nnodes, nproc = job["nnodes"], job["nproc"]
        while not store.check([node_key(k) for k in range(nnodes)]):
            if time.monotonic() > end:
                raise LaunchError(f"hspmd authority at {host}:{store.port}: not every node joined within "
                                  f"{rendezvous_timeout:g}s")
            time.sleep(_POLL_S * 5)
        authority = Authority(store, nnodes * nproc, nproc, heartbeat, stuck, err)
        while not authority.finished():
            authority.poll()
            time.sleep(_POLL_S)
        return 0
    finally:
        store.server.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="hspmd authority",
                            description="Host an elastic multi-node job's store and announce its generations.")
    parser.add_argument("--addr", required=True, help="the address to listen on (the nodes' --master-addr)")
    parser.add_argument("--port", type=positive_int, required=True, help="the port (the nodes' --master-port)")
    parser.add_argument("--heartbeat", type=non_negative_float, default=30.0,
                        help="seconds without a rank's heartbeat before it is declared dead (default 30; 0: off)")
    parser.add_argument("--stuck", type=non_negative_float, default=DEFAULT_STUCK_S,
                        help=f"seconds without communication progress anywhere before the rank holding the job up is "
                             f"declared dead (default {DEFAULT_STUCK_S:g}; 0: off)")
    parser.add_argument("--rendezvous-timeout", type=non_negative_float, default=DEFAULT_RENDEZVOUS_S,
                        help=f"seconds to wait for the nodes (default {DEFAULT_RENDEZVOUS_S:g})")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return serve(args.addr, args.port, args.heartbeat, args.stuck, args.rendezvous_timeout)


__all__ = ["Authority", "DEFAULT_STUCK_S", "done_key", "exit_key", "main", "serve"]
