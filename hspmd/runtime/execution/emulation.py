"""Running as an emulated device type on this host: compute slowdown, device memory, slow links.

A cluster with an `emulate` block (hspmd.cluster.emulation) makes each rank the device its id has
there, this host standing for the block's reference type. `emulated(backend, cluster)` wraps a
rank's backend in an `EmulatedBackend` carrying that rank's `RankEmulator`; without a block it
returns the backend unchanged, so emulation is off unless a cluster file asks for it.

    compute   a rank whose type is s times slower than the reference owes s x the CPU time its
              thread spends between communications (what that work costs a core of its own, so
              other processes sharing the host do not stretch it: the ops, the interpreter's loop,
              the schedule and the trainer's per-step work alike) less the wall time that took.
              The emulator keeps the marks: `computed` (the interpreter's op loop, after each op)
              adds the work since the last mark to the debt, every call into the backend settles
              it, and the time spent inside a communication is not compute (the marks restart when
              it returns), nor is the host's Python that drives a communication plan
              (`host_work`: the cost model prices a communication's dispatch once, not per
              device type). The debt is waited off with time.sleep (not a busy loop: the host's
              cores stay free for the other ranks) once it reaches WAIT_CHUNK_S, and always before
              the rank communicates, so what it sends leaves when it would have on the slower
              device; oversleeping, or work the busy host made slower than the emulated device,
              is credit (up to WAIT_CHUNK_S) against the work that follows. The chunk is long
              because the host runs the work after a sleep slower (cold caches, a core that
              idled), in CPU time, which the slowdown then multiplies: measured here, a small
              op costs 10 us of CPU back to back and 32 us after a 1 ms sleep, and a one-device
              Llama step at slowdown 20 took 2.2x its plain CPU time with 1 ms chunks, 1.3x with
              50 ms and 1.05x with 200 ms (1.03x sleeping only before communicating). Ranks run one
              intra-op thread (the launcher's default), whose CPU time is the op's.
    memory    op outputs, received pieces and leaves are counted by storage while they live; a
              value that would take the rank over its type's hbm_capacity x memory_scale raises
              DeviceOutOfMemory (rank, type, bytes) before it is stored, as a GPU's allocator
              refuses before a kernel writes. Liveness is checked by sweeping the storages' weak
              references when the running count passes the capacity and every SWEEP_EVERY values
              (so `peak_bytes` is sampled, not exact).
    links     a message between devices on different nodes carries no extra bytes: its sender
              stamps the wall time it leaves into a board shared by the job's ranks (a file mapped
              by every process of this host), and the receiver, once it has the message, waits
              until stamp + the link class's alpha + bytes / beta (the host's own transfer counts
              towards that). A collective whose group spans nodes waits, after it returns, its
              ring time on the cluster's links less its ring time on `host_link`.

Not emulated: kernel classes at different ratios (one slowdown per type), shared-pipe contention,
overlap of a slower device's compute with its own transfers beyond what non-blocking sends give,
and the update phase's memory is checked op by op (an update over capacity stops between ops).
Emulated waits are counted apart from real work (`EmulationStats`) and recorded in a Tracer under
the category "emulated".
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hspmd.backends.backend import Backend, Group, Pending, Shape
from hspmd.cluster import ClusterSpec, LinkClass, parse_cluster
from hspmd.cluster.emulation import CLUSTER_ENV, WAIT_CHUNK_S
from hspmd.errors import DeviceOutOfMemory, HSPMDError
from hspmd.planning.cost import ring_time
from hspmd.runtime.execution.trace import Tracer

SWEEP_EVERY = 32  # values counted between liveness sweeps of the memory table
BETWEEN_PASSES = "(between passes)"  # op_seconds' entry for the work before each pass's first op
# a timeline's marks (RankEmulator.timeline): where the device settled its debt before communicating,
# and where it slept a chunk of its debt between two ops; a mark's seconds are the wall time from
# it to the device's next work (its sleep, the communication and the host's work around it)
COMMUNICATED = "(communicated)"
CHUNK_SLEPT = "(chunk slept)"
BOARD_SLOTS = 1024  # stamps per ordered rank pair kept at once (a sender may be this many messages ahead)


class EmulationError(HSPMDError):
    """Emulation cannot be set up or lost track of a message's stamp (names the ranks)."""


@dataclass(frozen=True)
class EmulationStats:
    """What emulation added on one rank: seconds waited for compute (slower type) and links, the
    ops slowed, and the sampled peak of live bytes against the capacity (None: not emulated)."""

    rank: int
    device_type: str
    slowdown: float
    compute_wait_s: float
    link_wait_s: float
    ops: int
    peak_bytes: int
    capacity: float | None
    op_cpu_s: float = 0.0  # CPU seconds of the ops themselves (what the slowdown multiplied)


class RankEmulator:
    """One rank's emulated device: compute debt and its clock marks, memory table, and the tracer
    its waits go to. `clocks`: (wall, this thread's CPU) seconds."""

    def __init__(self, rank: int, device_type: str, slowdown: float, capacity: float | None = None,
                 tracer: Tracer | None = None,
                 clocks: tuple[Callable[[], float], Callable[[], float]] = (time.perf_counter, time.thread_time)):
        self.rank, self.device_type, self.slowdown, self.capacity = rank, device_type, slowdown, capacity
        self.tracer = tracer
        self._wall, self._cpu = clocks
        self._host = 0  # inside host_work: CPU time that is not the device's
        self._debt = 0.0
        self.compute_wait_s = 0.0
        self.compute_sleeps = 0  # how many sleeps compute_wait_s took
        self.chunk_s = WAIT_CHUNK_S  # the debt slept off between communications (a probe may lift it)
        # False: the debt is slept in chunks alone, not before each communication (settle)
        self.sleeps_at_communications = True
        self.link_wait_s = 0.0
        self.ops = 0
        self.op_cpu_s = 0.0
        self._storages: dict[StorageWeakRef, int] = {}
        self._counted = 0
        self._since_sweep = 0
        self.sweep_every = SWEEP_EVERY  # 1: an exact peak (a benchmark's untimed memory pass)
        self.peak_bytes = 0
        self.op_seconds: dict[str, list[float]] | None = None  # a dict: each op's CPU seconds by name (calibration)
        # a list: each op's and pass start's (name, CPU seconds) in order, with the COMMUNICATED and
        # CHUNK_SLEPT marks between (bench_stretches.py: the work between two sleeps, as level 2 prices it)
        self.timeline: list[tuple[str, float]] | None = None
        self._open_marks: list[tuple[list, int, float]] = []  # timeline marks awaiting their idle: (timeline, index, wall)
        self._stretch_wall = 0.0  # when the last stretch _accrue closed began
        self.mark()

    # ---- compute ---------------------------------------------------------------------------------

    def mark(self) -> None:
        """Start a stretch of compute now (after a communication returns: its time is not compute)."""
        self._wall_mark, self._cpu_mark = self._wall(), self._cpu()

    @contextmanager
    def host_work(self) -> Iterator[None]:
        """A stretch that is the host's work, not the device's (running a communication plan: the
        Python that drives a collective runs on the host whatever the device): its CPU time is
        not owed; communications inside it still wait off the debt owed before it."""
        self._accrue()
        self._host += 1
        try:
            yield
        finally:
            self._host -= 1
            self.mark()

    def _accrue(self) -> float:
        """Owe s x the CPU time since the mark less the wall time since it; restart the marks.
        Returns that CPU time (the stretch's)."""
        wall, cpu = self._wall(), self._cpu()
        self._stretch_wall = self._wall_mark
        stretch = cpu - self._cpu_mark
        if self.slowdown > 1.0 and not self._host:
            self.op_cpu_s += stretch
            self._debt += self.slowdown * stretch - (wall - self._wall_mark)
        self._wall_mark, self._cpu_mark = wall, cpu
        return stretch

    def pass_started(self) -> None:
        """Before a pass's first op: owe the work since the mark now (the schedule's and trainer's
        between passes), so that the first op's own time (`op_seconds`) is its alone; that work
        is recorded under BETWEEN_PASSES."""
        self._record(BETWEEN_PASSES, self._accrue())

    def _record(self, where: str, stretch: float) -> None:
        """Keep a stretch's CPU seconds under `where` in op_seconds and the timeline, where set."""
        if self.op_seconds is not None:
            self.op_seconds.setdefault(where, []).append(stretch)
        if self.timeline is not None:
            for timeline, index, wall in self._open_marks:
                if timeline is self.timeline:
                    timeline[index] = (timeline[index][0], self._stretch_wall - wall)
            self._open_marks.clear()
            self.timeline.append((where, stretch))

    def _mark_timeline(self, mark: str) -> None:
        """Put `mark` on the timeline, where set; its idle seconds are filled in at the next work."""
        if self.timeline is not None:
            self._open_marks.append((self.timeline, len(self.timeline), self._wall()))
            self.timeline.append((mark, 0.0))

    def computed(self, outputs: Iterable[object] = (), where: str = "") -> None:
        """After one op: count its outputs against the device's memory (raising DeviceOutOfMemory
        before the caller stores them) and owe what the emulated device takes for the work since
        the last mark beyond the wall time already spent (module docstring). With `op_seconds`
        set, that CPU time (the op's, with the loop's and this bookkeeping's since the last
        op: what the device owes for it) is recorded under `where`. The memory table's work
        runs after the stretch is closed and the next starts after it, so the device owes none
        of it, its clock reads included (a thread's CPU clock is a system call)."""
        if self.slowdown > 1.0:
            self.ops += 1
        stretch = self._accrue()
        if self.capacity is not None:  # the table's bookkeeping starts after the op's stretch ends
            try:
                self._hold(outputs, where)
            finally:
                self._cpu_mark = self._cpu()
        self._record(where, stretch)
        if self._debt >= self.chunk_s:
            self._mark_timeline(CHUNK_SLEPT)
            self._sleep(self._debt, "emulated compute")
            self.mark()

    def settle(self) -> None:
        """Owe the work since the mark and wait off the debt (before every communication). A
        negative debt (a sleep the busy host ended late, or work it made slower than the emulated
        device) is credit against the next work, up to WAIT_CHUNK_S: the host's lateness is not
        the emulated device's, and a rank that drops it at every communication falls behind by
        the host's wake-up latency once per message. With `sleeps_at_communications` off the
        debt is only owed here and slept in chunks, as the op probes' steps sleep: a diagnostic
        regime (bench_calibration --split-wake) whose device CPU is the ops' as the op prices
        measured them, so what the sleeps before communications add is measured apart; its
        messages no longer leave when the emulated device's would."""
        self._accrue()
        self._mark_timeline(COMMUNICATED)
        if self._debt > 0 and self.sleeps_at_communications:
            self._sleep(self._debt, "emulated compute")
        self._debt = max(self._debt, -WAIT_CHUNK_S)
        self.mark()

    def forgive_debt(self) -> None:
        """Drop what the device owes, unslept (a calibration probe timing work that must not sleep)."""
        self._debt = 0.0

    def _sleep(self, seconds: float, name: str) -> None:
        start = time.perf_counter()
        began_us = self.tracer.now_us() if self.tracer is not None else 0.0
        time.sleep(seconds)
        slept = time.perf_counter() - start
        if name == "emulated compute":
            self._debt -= slept  # oversleeping is credit against the next work's debt
            self.compute_wait_s += slept
            self.compute_sleeps += 1
        else:
            self.link_wait_s += slept
        if self.tracer is not None:
            self.tracer.events.append({"name": name, "cat": "emulated", "ph": "X", "ts": began_us, "dur": slept * 1e6,
                                       "pid": self.rank, "tid": 0})

    def wait_until(self, deadline: float) -> None:
        """Wait (link emulation) until wall time `deadline` (time.time() seconds); restart the marks."""
        remaining = deadline - time.time()
        if remaining > 0:
            self._sleep(remaining, "emulated link")
        self.mark()

    def wait_link(self, seconds: float) -> None:
        """Wait what an emulated link adds (after a communication returned); restart the marks."""
        if seconds > 0:
            self._sleep(seconds, "emulated link")
        self.mark()

    # ---- memory ----------------------------------------------------------------------------------

    def hold(self, values: Iterable[object], where: str = "") -> None:
        """Count `values`' storages as live on this device; raise DeviceOutOfMemory if they do not fit.
        The table's bookkeeping is the emulator's, not the device's: the CPU mark moves past the
        CPU time it takes (so that time is not owed, and the stretch it interrupts, say a leaf's
        handling before the op that reads it, stays one stretch as without a memory table), and
        its wall time counts as time the device's debt already spent."""
        start = self._cpu()
        try:
            self._hold(values, where)
        finally:
            self._cpu_mark += self._cpu() - start

    def _hold(self, values: Iterable[object], where: str) -> None:
        new: list[tuple[StorageWeakRef, int]] = []
        for v in values:
            if isinstance(v, torch.Tensor):
                storage = v.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in self._storages:
                    new.append((ref, storage.nbytes()))
        if not new:
            return
        adding = sum(n for _, n in new)
        self._since_sweep += len(new)
        if self._counted + adding > self.capacity or self._since_sweep >= self.sweep_every:
            self._sweep()
            if self._counted + adding > self.capacity:
                raise DeviceOutOfMemory(self.rank, self.device_type, self._counted + adding, self.capacity, where)
        for ref, n in new:
            self._storages[ref] = n
        self._counted += adding

    def _sweep(self) -> None:
        for ref in [r for r in self._storages if r.expired()]:
            del self._storages[ref]
        self._counted = sum(self._storages.values())
        self._since_sweep = 0
        self.peak_bytes = max(self.peak_bytes, self._counted)

    @property
    def live_bytes(self) -> int:
        self._sweep()
        return self._counted

    def stats(self) -> EmulationStats:
        if self.capacity is not None:
            self._sweep()
        return EmulationStats(self.rank, self.device_type, self.slowdown, self.compute_wait_s, self.link_wait_s,
                              self.ops, self.peak_bytes, self.capacity, self.op_cpu_s)


class StampBoard:
    """Per ordered rank pair, the wall time each message left, in a float64 tensor every rank of
    the job maps (a file of this host, or one tensor shared by the in-process ranks). Slot k % SLOTS
    of (src, dst) holds (k + 1, time) of src's k-th stamped message to dst."""

    def __init__(self, table: torch.Tensor, rank: int):
        self.table, self.rank = table, rank
        world = table.shape[0]
        self._sent = [0] * world
        self._got = [0] * world

    @staticmethod
    def shape(world: int) -> tuple[int, int, int, int]:
        return (world, world, BOARD_SLOTS, 2)

    def stamp(self, peer: int, when: float) -> None:
        k = self._sent[peer]
        self._sent[peer] = k + 1
        self.table[self.rank, peer, k % BOARD_SLOTS, 1] = when
        self.table[self.rank, peer, k % BOARD_SLOTS, 0] = k + 1

    def left_at(self, peer: int) -> float:
        """When the next message from `peer` (already received) left it."""
        k = self._got[peer]
        self._got[peer] = k + 1
        seq, when = self.table[peer, self.rank, k % BOARD_SLOTS].tolist()
        if int(seq) != k + 1:
            raise EmulationError(f"rank {self.rank}: link emulation expected the stamp of message {k + 1} from rank "
                                 f"{peer}, found {int(seq)} (a sender ran more than {BOARD_SLOTS} messages ahead)")
        return when


def shared_board(backend: Backend) -> torch.Tensor:
    """The job's stamp table, mapped from one file of this host: rank 0 makes it and sends its
    name; every rank maps it; rank 0 removes the name once all have (the mappings stay)."""
    world = backend.world_size
    size = math.prod(StampBoard.shape(world))
    everyone = tuple(range(world))
    name = torch.zeros(256, dtype=torch.uint8)
    if backend.rank == 0:
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="hspmd-emulation-", dir=where)
        os.ftruncate(fd, size * 8)
        os.close(fd)
        encoded = path.encode()
        if len(encoded) > 255:
            raise EmulationError(f"emulation board path too long: {path}")
        name[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    if world > 1:
        name = backend.broadcast(name, 0, everyone)
    path = bytes(name[name != 0].tolist()).decode()
    table = torch.from_file(path, shared=True, size=size, dtype=torch.float64).view(StampBoard.shape(world))
    if world > 1:
        backend.barrier(everyone)
    if backend.rank == 0:
        os.unlink(path)
    return table


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Emulated:
    """A started all-reduce whose wait() also waits what the emulated links add."""

    def __init__(self, pending: Pending, emulator: RankEmulator, extra: float):
        self.pending, self.emulator, self.extra = pending, emulator, extra

    def wait(self) -> torch.Tensor:
        out = self.pending.wait()
        self.emulator.wait_link(self.extra)
        self.extra = 0.0
        return out


class _Marked:
    """Posted sends whose wait() restarts the rank's compute marks (waiting is not compute)."""

    def __init__(self, handle, emulator: RankEmulator):
        self.handle, self.emulator = handle, emulator

    def wait(self):
        out = self.handle.wait()
        self.emulator.mark()
        return out


class EmulatedBackend(Backend):
    """A rank's backend as its emulated device: every call first settles the rank's compute debt;
    messages and collectives between nodes then take their emulated link time (module docstring).
    Same bytes, same results: only waits are added."""

    def __init__(self, inner: Backend, cluster: ClusterSpec, emulator: RankEmulator, board: StampBoard | None):
        self.inner, self.cluster, self.emulator, self.board = inner, cluster, emulator, board
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
        self.overlaps_collectives = inner.overlaps_collectives
        self.job = inner.job
        self._links = cluster.emulation is not None and cluster.emulation.links
        host = cluster.emulation.host_link if cluster.emulation is not None else None
        self._host = None if host is None else LinkClass("host", host[1], host[0])
        if hasattr(inner, "post_sends"):
            self.post_sends = self._post_sends

    def __getattr__(self, name: str):  # shutdown, world, ...: the inner backend's
        if name in ("inner", "post_sends"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- messages --------------------------------------------------------------------------------

    def _emulated_peer(self, peer: int) -> bool:
        return self._links and peer != self.rank and self.cluster.node_of(peer) != self.cluster.node_of(self.rank)

    def _stamp(self, sends: Mapping[int, torch.Tensor]) -> None:
        self.emulator.settle()
        now = time.time()
        for peer in sends:
            if self._emulated_peer(peer):
                self.board.stamp(peer, now)

    def _arrive(self, got: Mapping[int, torch.Tensor]) -> None:
        """Wait until the latest emulated message of `got` would have arrived; restart the marks."""
        deadline = 0.0
        for peer, t in got.items():
            if self._emulated_peer(peer):
                left = self.board.left_at(peer)
                deadline = max(deadline, left + self.cluster.link(peer, self.rank).seconds(_nbytes((t,))))
        self.emulator.wait_until(deadline) if deadline else self.emulator.mark()

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, tuple[Shape, torch.dtype]]) -> dict[int, torch.Tensor]:
        self._stamp(sends)
        got = self.inner.exchange(sends, recvs)
        self._arrive(got)
        return got

    def exchange_into(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        self._stamp(sends)
        self.inner.exchange_into(sends, recvs)
        self._arrive(recvs)

    def _post_sends(self, sends: Mapping[int, torch.Tensor]):
        self._stamp(sends)
        handle = _Marked(self.inner.post_sends(sends), self.emulator)
        self.emulator.mark()
        return handle

    # ---- collectives -----------------------------------------------------------------------------

    def _extra(self, kind: str, nbytes: int, group: Group) -> float:
        """What the group's links add over this host's own transfer for one collective."""
        if not self._links or len(group) < 2 or len({self.cluster.node_of(d) for d in group}) < 2:
            return 0.0
        edges = [self.cluster.link(a, group[(i + 1) % len(group)]) for i, a in enumerate(group)]
        modelled = ring_time(kind, nbytes, edges, nbytes / len(group))
        host = ring_time(kind, nbytes, [self._host] * len(group), nbytes / len(group)) if self._host else 0.0
        return max(0.0, modelled - host)

    def _collective(self, kind: str, nbytes: int, group: Group, call):
        self.emulator.settle()
        out = call()
        self.emulator.wait_link(self._extra(kind, nbytes, group))
        return out

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        self.emulator.settle()
        self.inner.prepare_groups(groups)
        self.emulator.mark()

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        return self._collective("all_reduce", _nbytes((tensor,)), group, lambda: self.inner.all_reduce(tensor, group))

    def all_reduce_start(self, tensor: torch.Tensor, group: Group) -> Pending:
        self.emulator.settle()
        pending = _Emulated(self.inner.all_reduce_start(tensor, group), self.emulator,
                            self._extra("all_reduce", _nbytes((tensor,)), group))
        self.emulator.mark()
        return pending

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        nbytes = sum(math.prod(s) for s in shapes) * tensor.element_size()
        return self._collective("all_gather", nbytes, group, lambda: self.inner.all_gather(tensor, group, shapes))

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        return self._collective("reduce_scatter", _nbytes(parts), group, lambda: self.inner.reduce_scatter(parts, group))

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor, op: str = "sum") -> None:
        self._collective("all_reduce", _nbytes((tensor,)), group, lambda: self.inner.all_reduce_into(tensor, group, out, op))

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        self._collective("all_gather", _nbytes(outs), group, lambda: self.inner.all_gather_into(tensor, group, outs))

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor, op: str = "sum") -> None:
        self._collective("reduce_scatter", _nbytes(parts), group,
                         lambda: self.inner.reduce_scatter_into(parts, group, out, op))

    def barrier(self, group: Group) -> None:
        self.emulator.settle()
        self.inner.barrier(group)
        self.emulator.mark()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        return self._collective("all_gather", _nbytes((tensor,)), group, lambda: self.inner.broadcast(tensor, src, group))


def emulator_for(cluster: ClusterSpec, rank: int, tracer: Tracer | None = None) -> RankEmulator:
    """Rank `rank`'s emulated device on `cluster` (which must carry an emulation)."""
    if cluster.emulation is None:
        raise EmulationError(f"cluster {cluster.describe()} has no emulate block")
    cluster.check_devices((rank,), "an emulated rank")
    return RankEmulator(rank, cluster.device_type(rank).name, cluster.slowdown(rank), cluster.emulated_memory(rank), tracer)


def emulated(backend: Backend, cluster: ClusterSpec | None, board: torch.Tensor | None = None) -> Backend:
    """`backend` as rank `backend.rank` of `cluster` emulated on this host, or `backend` itself when
    the cluster asks for no emulation. Collective over the job when links are emulated (the ranks
    share one stamp board: `board`, else a file of this host made here). The cluster must have a
    device for every rank."""
    if cluster is None or cluster.emulation is None:
        return backend
    if cluster.n_devices < backend.world_size:
        raise EmulationError(f"cluster {cluster.describe()} has {cluster.n_devices} devices but the job has "
                             f"{backend.world_size} ranks: give a cluster with a device for every rank")
    stamps = None
    if cluster.emulation.links and len(cluster.nodes) > 1:
        table = shared_board(backend) if board is None else board
        stamps = StampBoard(table, backend.rank)
    return EmulatedBackend(backend, cluster, emulator_for(cluster, backend.rank), stamps)


def emulation_of(backend: Backend) -> RankEmulator | None:
    """The backend's emulated device, or None (what the interpreter's op loop asks)."""
    return getattr(backend, "emulator", None)


def cluster_from_env() -> ClusterSpec | None:
    """The cluster `hspmd run --cluster C` gave the job (HSPMD_CLUSTER), or None."""
    text = os.environ.get(CLUSTER_ENV)
    return parse_cluster(text) if text else None


__all__ = [
    "BETWEEN_PASSES", "CHUNK_SLEPT", "COMMUNICATED", "EmulatedBackend", "EmulationError", "EmulationStats", "RankEmulator", "StampBoard",
    "cluster_from_env", "emulated", "emulation_of", "emulator_for", "shared_board",
]
