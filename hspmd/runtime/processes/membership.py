"""Membership of an elastic job: which ranks are alive, and a backend over them.

The *authority* (the launcher of `hspmd run --elastic`, which hosts the rendezvous store and sees
every rank's process exit) announces each death as a new *generation*: it writes the cumulative set
of dead ranks under ``elastic/dead/{g}`` and then bumps the counter ``elastic/generation``. It plays
the part of torchft's Lighthouse (a quorum service), but from process exits rather than
heartbeats, so a death is known within one poll of the launcher (50 ms). Every rank has a
`Membership`: the store client, the current generation's backend (fresh gloo groups among the
living ranks, hspmd.backends.generation) and a watcher thread that aborts that backend the moment
a newer generation is announced, so no survivor stays blocked on a peer that gave up.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Sequence

import torch.distributed as dist

from hspmd.backends.generation import GenerationBackend, PeerLost
from hspmd.backends.heartbeat import HEARTBEAT_ENV, start_beating
from hspmd.backends.store import JobStore, secret_from_env
from hspmd.errors import HSPMDError

GENERATION_KEY = "elastic/generation"
ELASTIC_ENV = "HSPMD_ELASTIC"
JOIN_ENV = "HSPMD_JOIN"  # set by the launcher on a restarted rank (--max-restarts)
HISTORY = 4
_POLL_S = 0.02


def dead_key(generation: int) -> str:
    return f"elastic/dead/{generation}"


def joined_key(generation: int) -> str:
    return f"elastic/joined/{generation}"


def finished_key(rank: int) -> str:
    return f"elastic/finished/{rank}"


def why_key(generation: int) -> str:
    """What a multi-node job's authority records about a generation (hspmd.runtime.processes.authority)."""
    return f"elastic/why/{generation}"


def ready_key(rank: int) -> str:
    return f"elastic/ready/{rank}"


def announce_death(store: dist.Store, dead: Sequence[int], joined: Sequence[int] = ()) -> int:
    """The authority's side: start the next generation without `dead` (all ranks dead so far);
    `joined`: ranks that are back as fresh processes with no state (they receive their pieces)."""
    generation = int(store.add(GENERATION_KEY, 0)) + 1
    store.set(joined_key(generation), json.dumps(sorted(set(joined))))
    store.set(dead_key(generation), json.dumps(sorted(set(dead))))
    store.add(GENERATION_KEY, 1)
    return generation


def killed_key(rank: int) -> str:
    return f"elastic/killed/{rank}"


def killed_note(store: dist.Store, rank: int) -> str:
    """Where an injected fault killed `rank` (hspmd.runtime.policies.elastic.FaultInjector), or ''."""
    return store.get(killed_key(rank)).decode() if store.check([killed_key(rank)]) else ""


def killed_at(store: dist.Store, rank: int) -> float | None:
    """The wall-clock time (time.time()) an injected fault killed `rank`, if one did."""
    key = killed_key(rank) + "/time"
    return float(store.get(key)) if store.check([key]) else None


def is_elastic() -> bool:
    """True in the ranks of `hspmd run --elastic`."""
    return os.environ.get(ELASTIC_ENV) == "1"


class Membership:
    """One rank's view of the living ranks of an elastic job, and a backend over them."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float = 300.0,
                 rendezvous_timeout: float = 60.0, joining: bool = False):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        secret = secret_from_env()
        self.store = JobStore(host, port, secret, rendezvous_timeout)
        self._watch_store = JobStore(host, port, secret, rendezvous_timeout)  # the watcher's own connection
        interval = float(os.environ.get(HEARTBEAT_ENV, "0") or 0)
        if interval > 0:  # beats (with this rank's progress) on a connection of their own, whose close is its death
            start_beating(JobStore(host, port, secret, rendezvous_timeout), rank, interval)
        self.generation, self.dead, self.joined, self.rejoined = 0, frozenset(), frozenset(), frozenset()
        self.joining = joining
        if joining:
            # a restarted process: say it is ready, then wait for the generation that takes it back
            start = int(self.store.add(GENERATION_KEY, 0))
            self.store.set(ready_key(rank), "1")
            self._await_generation(start, 300.0, "the launcher never took this restarted rank back")
            self.backend = GenerationBackend(self.store, self.generation, self.alive, rank, world_size, timeout,
                                             self._superseded_after(self.generation))
        else:
            self.backend = GenerationBackend(self.store, 0, range(world_size), rank, world_size, timeout,
                                             self._superseded_after(0))
        self._closed = False
        threading.Thread(target=self._watch, daemon=True, name="hspmd-membership").start()

    def _superseded_after(self, generation: int):
        """Whether a generation newer than `generation` was announced (a backend still forming its
        groups gives up on members that died meanwhile instead of waiting out its timeout)."""
        return lambda: int(self.store.add(GENERATION_KEY, 0)) > generation

    @property
    def original(self) -> tuple[int, ...]:
        """Living ranks that never restarted (they hold the job's whole history, e.g. for reports)."""
        return tuple(r for r in self.alive if r not in self.rejoined)

    @staticmethod
    def from_env(timeout: float = 300.0) -> "Membership":
        """Join the elastic job described by the torchrun-style variables `hspmd run --elastic` sets."""
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing or not is_elastic():
            raise HSPMDError("Membership.from_env(): start the script with `hspmd run -n N --elastic script.py` "
                             f"(missing: {', '.join(missing) or ELASTIC_ENV + '=1'})")
        return Membership(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                          int(os.environ["MASTER_PORT"]), timeout, joining=os.environ.get(JOIN_ENV) == "1")

    @property
    def alive(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world_size) if r not in self.dead)

    def _watch(self) -> None:
        while not self._closed:
            try:
                announced = int(self._watch_store.add(GENERATION_KEY, 0))
            except Exception:  # noqa: BLE001 - the store is gone: the launcher ended the job
                self.backend.abort()
                return
            if announced > self.backend.generation:
                self.backend.abort()
            time.sleep(_POLL_S)

    def next_generation(self, deadline_s: float = 60.0) -> GenerationBackend:
        """After a failure: wait for the authority to announce the next generation (a death is
        announced within a poll of the launcher), then form its groups among the living ranks."""
        self.backend.abort()
        self._await_generation(self.generation, deadline_s, "a collective failed but no rank death was announced; "
                                                            "is the job running under `hspmd run --elastic`?")
        self.backend = GenerationBackend(self.store, self.generation, self.alive, self.rank, self.world_size, self.timeout,
                                         self._superseded_after(self.generation))
        return self.backend

    def _await_generation(self, after: int, deadline_s: float, why: str) -> None:
        end = time.monotonic() + deadline_s
        while True:
            announced = int(self.store.add(GENERATION_KEY, 0))
            if announced > after:
                break
            if time.monotonic() > end:
                raise HSPMDError(f"rank {self.rank}: {why} (waited {deadline_s:g}s)")
            time.sleep(_POLL_S)
        self.generation = announced
        self.dead = frozenset(json.loads(self.store.get(dead_key(announced))))
        self.joined = frozenset(json.loads(self.store.get(joined_key(announced))))
        self.rejoined |= self.joined
        if self.rank in self.dead:
            raise HSPMDError(f"rank {self.rank} was declared dead by the launcher (generation {announced})")

    def announcements(self, generations: range) -> tuple[tuple[int, ...], float | None]:
        """What the authority of a multi-node job (hspmd.runtime.processes.authority) recorded for the
        generations in `generations` up to the current one: the nodes lost whole and when the
        first was announced (time.time()); ((), None) on one host."""
        lost, first = set(), None
        for g in range(generations.start, self.generation + 1):
            key = why_key(g)
            if self.store.check([key]):
                record = json.loads(self.store.get(key))
                lost |= set(record["lost_nodes"])
                first = record["time"] if first is None else min(first, record["time"])
        return tuple(sorted(lost)), first

    def agree(self, name: str, value: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every living rank's `value` of `name` in this generation (a store round, no collective,
        so it works before any group exists); raises PeerLost if a newer generation starts. Values
        are tuples of ints, compared as tuples (a version is (steps, switches))."""
        prefix = f"g{self.generation}/agree/{name}/"
        self.store.set(prefix + str(self.rank), ",".join(str(int(v)) for v in value))
        keys = [prefix + str(r) for r in self.alive]
        while True:
            if int(self.store.add(GENERATION_KEY, 0)) > self.generation:
                raise PeerLost(f"rank {self.rank}: another rank failed while agreeing on {name}")
            if self.store.check(keys):
                return [tuple(int(v) for v in self.store.get(k).decode().split(",")) for k in keys]
            time.sleep(_POLL_S)

    def close(self) -> None:
        """This rank is done: say so (its connections closing is then an exit, not a death) and stop watching."""
        self._closed = True
        try:
            self.store.set(finished_key(self.rank), "1")
        except Exception:  # noqa: BLE001 - the store is gone: the job is over anyway
            pass


__all__ = ["ELASTIC_ENV", "GENERATION_KEY", "Membership", "announce_death", "JOIN_ENV", "dead_key", "is_elastic", "joined_key",
    "ready_key", "killed_at", "killed_key", "killed_note", "finished_key", "why_key"]
