"""Heartbeats through the job's store: find a rank that stopped long before a collective times out.

A rank blocked in a collective whose peer hangs would wait for the whole collective timeout (300 s
by default) and then blame itself. Instead each rank runs a daemon thread that increments its key
`hspmd/heartbeat/<rank>` every interval/4 seconds over its own store connection; the thread runs
while the rank's main thread waits inside a collective (the wait releases the GIL), so only a rank
that is frozen (stopped, swapped out, wedged in a call holding the GIL) or dead stops beating. The
launcher watches the counters (HeartbeatMonitor) and names the rank whose counter stood still for
`interval` seconds (default 30; HSPMD_HEARTBEAT_S, `hspmd run --heartbeat`).

A rank that reached the end of its script marks itself leaving before it exits: tearing down its
process groups and the interpreter can take seconds on a loaded host, during which the beating
thread is gone. A leaving rank is given LEAVING_GRACE_S (or `interval` if longer) to exit before it
counts as stopped, so a finished rank is not killed for a slow exit, and one that hangs at exit is
still named.
"""

from __future__ import annotations

import atexit
import threading
import time

DEFAULT_INTERVAL_S = 30.0
TIE_S = 0.005  # last completions this close count as one moment (HeartbeatMonitor.stuck)
HEARTBEAT_ENV = "HSPMD_HEARTBEAT_S"
LEAVING_GRACE_S = 30.0


BEAT_PREFIX = "hspmd/heartbeat/"


def beat_key(rank: int) -> str:
    return f"{BEAT_PREFIX}{rank}"


def progress_key(rank: int) -> str:
    return f"hspmd/progress/{rank}"


def leaving_key(rank: int) -> str:
    return f"hspmd/leaving/{rank}"


class Progress:
    """A rank's communication progress, which its beats carry: how many communications it has
    completed, and whether it is waiting inside one now. Liveness alone cannot tell a rank stuck
    with a beating heartbeat thread; progress compared across ranks can (HeartbeatMonitor.stuck)."""

    def __init__(self):
        self.completed = 0
        self.waiting = False
        self.last = time.time()  # wall-clock time of the last completed communication

    def enter(self) -> None:
        self.waiting = True

    def leave(self) -> None:
        self.completed += 1
        self.waiting = False
        self.last = time.time()

    def text(self) -> str:
        return f"{self.completed} {int(self.waiting)} {self.last:.6f}"


PROGRESS = Progress()  # this process's (one rank per process)


def start_beating(store, rank: int, interval: float, progress: Progress | None = PROGRESS) -> threading.Thread:
    """Increment this rank's heartbeat every interval/4 s until the store goes away; each beat also
    publishes the rank's `progress` when it changed. At interpreter exit the rank marks itself
    leaving (module docstring)."""

    def beat() -> None:
        sent = None
        while True:
            try:
                store.add(beat_key(rank), 1)
                if progress is not None and progress.text() != sent:
                    sent = progress.text()
                    store.set(progress_key(rank), sent)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            time.sleep(interval / 4)

    def leave() -> None:
        try:
            store.set(leaving_key(rank), "1")
        except Exception:  # noqa: BLE001 - the store is gone: nobody is watching
            pass

    thread = threading.Thread(target=beat, daemon=True, name=f"hspmd-heartbeat-{rank}")
    thread.start()
    atexit.register(leave)
    return thread


class HeartbeatMonitor:
    """The launcher's side: which ranks have beaten, and which stopped beating for `interval` s.
    A rank is watched from its first beat on (start-up, e.g. importing torch, is not timed)."""

    def __init__(self, store, ranks: range | list[int], interval: float, check_every: float = 1.0):
        self.store, self.ranks, self.interval, self.check_every = store, list(ranks), interval, check_every
        self._count: dict[int, int] = {}
        self._seen: dict[int, float] = {}
        self._checked = 0.0
        self._before: dict[int, int] = {}  # a restarted slot: its predecessor's count, not yet a beat
        self._progress: dict[int, tuple] = {}
        self._moved = time.monotonic()

    def restarted(self, rank: int) -> None:
        """A new process took `rank`'s slot: watch it from its own first beat (it keeps the key's count)."""
        self.store.delete_key(leaving_key(rank))
        self._before[rank] = int(self.store.add(beat_key(rank), 0))
        self._count.pop(rank, None)

    def stuck(self, after: float, now: float | None = None) -> list[int]:
        """Ranks that hold the job up although they beat: when no rank's progress (hspmd.backends.
        heartbeat.Progress) has moved for `after` seconds while some rank waits inside a
        communication, the ranks not waiting inside one (stuck elsewhere: a hung kernel, a
        deadlock, a loop), else those whose last completed communication is the oldest (within
        `TIE_S`: the others went on until they needed it). [] while anything moves, or before every
        rank has published progress. Approximate: ranks' clocks are compared (NTP-close across
        hosts), and a rank computing alone for `after` seconds while the others wait is named too."""
        now = time.monotonic() if now is None else now
        seen = {}
        for rank in self.ranks:
            key = progress_key(rank)
            if not self.store.check([key]):
                return []
            done, waiting, last = self.store.get(key).split()
            seen[rank] = (int(done), int(waiting), float(last))
        if seen != self._progress:
            self._progress, self._moved = seen, now
            return []
        if now - self._moved < after:
            return []
        if not any(waiting for _, waiting, _ in seen.values()):
            return []  # nobody waits on anybody: the job is between steps (or finished), not stuck
        idle = [r for r, (_, waiting, _) in seen.items() if not waiting]
        if idle:
            return idle
        oldest = min(last for _, _, last in seen.values())
        return [r for r, (_, _, last) in seen.items() if last - oldest <= TIE_S]

    def stopped(self, now: float | None = None) -> list[tuple[int, float]]:
        """[(rank, seconds since its last beat)] of the ranks that stopped beating (a leaving rank:
    for LEAVING_GRACE_S, or `interval` if longer)."""
        now = time.monotonic() if now is None else now
        if now - self._checked < self.check_every:
            return []
        self._checked = now
        out = []
        for rank in self.ranks:
            count = int(self.store.add(beat_key(rank), 0))
            if count == self._before.get(rank, 0):
                continue
            if count != self._count.get(rank):
                self._count[rank], self._seen[rank] = count, now
            elif now - self._seen[rank] > self.interval:
                if now - self._seen[rank] <= LEAVING_GRACE_S and self.store.check([leaving_key(rank)]):
                    continue
                out.append((rank, now - self._seen[rank]))
        return out


__all__ = ["BEAT_PREFIX", "DEFAULT_INTERVAL_S", "HEARTBEAT_ENV", "LEAVING_GRACE_S", "PROGRESS", "HeartbeatMonitor", "Progress",
           "beat_key", "leaving_key", "progress_key", "start_beating"]
