"""A gloo backend over one *generation* of an elastic job: the ranks alive at that moment.

torch.distributed's default world cannot lose a member: every group is carved out of it, and a dead
rank leaves it unusable. An elastic job instead builds, for each generation g, fresh gloo process
groups straight from the rendezvous store under the prefix ``g{g}/`` (the trick torchft's
reconfigurable ProcessGroupGloo uses too): only the members of a group take part in creating it,
nothing waits on a dead rank, and the previous generation's groups are abandoned.

Device ids stay the job's global ranks (a strategy keeps naming the same devices after a failure);
each group maps them to its own member indices.

Failure handling: any error of a collective or transfer raises PeerLost. ``abort()`` (thread-safe,
called by the job's membership watcher when the store announces a new generation) makes every
pending and later operation of this generation raise PeerLost, so a rank blocked on a live peer
that already gave up is freed at once instead of waiting for the timeout. The abandoned gloo
operations stay pending in the background (gloo cannot cancel them); their groups are never used
again.
"""

from __future__ import annotations

from math import prod

import queue
import threading
import time
from datetime import timedelta
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from hspmd.backends.backend import Backend, Group, Shape, failures_as
from hspmd.backends.heartbeat import PROGRESS
from hspmd.backends.torch_dist import _checked_self_message, _padded_flat
from hspmd.backends.torch_join import node_gloo
from hspmd.errors import CommunicationError

_P2P_TAG = 0


class PeerLost(CommunicationError):
    """A collective or transfer of this generation failed: a peer died or gave up (it saw a death)."""


class GenerationBackend(Backend):
    """Rank `rank`'s collectives among `members` (global ranks), generation `generation` of a job
    whose rendezvous store is `store`. Construction creates the generation's group of all members
    (collective over `members` only)."""

    def __init__(self, store: dist.Store, generation: int, members: Sequence[int], rank: int, world_size: int,
                 timeout: float = 300.0, superseded=None):
        if rank not in members:
            raise CommunicationError(f"rank {rank} is not a member of generation {generation} ({list(members)})")
        self.store, self.generation = store, generation
        self.members = tuple(sorted(members))
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=timeout)
        self._groups: dict[tuple[int, ...], object] = {}
        self._lock = threading.Lock()
        self.aborted = False
        # superseded(): whether a newer generation was announced (checked while groups form, before
        # anyone else knows this backend to abort it)
        self._superseded = superseded or (lambda: False)
        self._waiter: queue.SimpleQueue = queue.SimpleQueue()
        # kept here: torch holds only the C++ side of a Python store, which must outlive every group
        self._rendezvous_store = _AbortableStore(store, self)
        threading.Thread(target=_wait_forever, args=(self._waiter,), daemon=True,
                         name=f"hspmd-gen{generation}-waiter").start()
        self._group(self.members, "start")

    # groups -------------------------------------------------------------------------------------

    def _create(self, key: tuple[int, ...]):
        prefix = f"g{self.generation}/{'-'.join(map(str, key))}/"
        with failures_as(f"rank {self.rank}: could not form group {list(key)} of generation {self.generation}", PeerLost):
            store = dist.PrefixStore(prefix, self._rendezvous_store)
            return node_gloo(store, key.index(self.rank), len(key), self.timeout)

    def _group(self, group: Sequence[int], op: str):
        key = tuple(sorted(group))
        if self.rank not in key or not set(key) <= set(self.members):
            raise CommunicationError(f"{op} on rank {self.rank}: group {list(group)} must contain it and only members "
                                     f"of generation {self.generation} ({list(self.members)})")
        if self.aborted:
            raise PeerLost(f"{op} on rank {self.rank}: generation {self.generation} was aborted")
        pg = self._groups.get(key)
        if pg is None and len(key) > 1:
            pg = self._create(key)
            with self._lock:
                self._groups[key] = pg
        return key, pg

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        """Create this rank's groups in one global (sorted) order: each group needs only its own
        members, and creating them in the same order on every rank cannot deadlock."""
        for key in sorted({tuple(sorted(g)) for g in groups if self.rank in g}):
            self._group(key, "prepare_groups")

    def abort(self) -> None:
        """Give this generation up (from any thread): pending and later operations raise PeerLost."""
        with self._lock:
            self.aborted = True

    def _wait(self, works, op: str, group: Sequence[int]) -> None:
        """Wait for `works` on this backend's waiter thread while watching for abort(): gloo's own
        wait cannot be interrupted (abort() does not wake it, a wait with a timeout breaks the
        connection, and transfers do not report completion without it). An abandoned wait leaves
        the daemon waiter blocked in a group that is never used again."""
        done, failure = threading.Event(), []
        self._waiter.put((works, done, failure))
        deadline = time.monotonic() + self.timeout.total_seconds()
        PROGRESS.enter()  # the rank's beats say it waits inside a communication (hspmd.backends.heartbeat)
        while not done.wait(0.05):
            if self.aborted:
                raise PeerLost(f"{op} on group {list(group)} abandoned on rank {self.rank}: generation "
                               f"{self.generation} was aborted (a rank of the job failed)")
            if time.monotonic() > deadline:
                raise PeerLost(f"{op} on group {list(group)} timed out on rank {self.rank} after "
                               f"{self.timeout.total_seconds():g}s (generation {self.generation})")
        PROGRESS.leave()
        if failure:
            exc = failure[0]
            raise PeerLost(f"{op} on group {list(group)} failed on rank {self.rank} (generation {self.generation}): "
                           f"{type(exc).__name__}: {str(exc)[:300]}") from exc

    def _run(self, op: str, group: Sequence[int], start):
        try:
            work = start()
        except Exception as exc:  # noqa: BLE001
            raise PeerLost(f"{op} on group {list(group)} failed on rank {self.rank} (generation {self.generation}): "
                           f"{type(exc).__name__}: {str(exc)[:300]}") from exc
        self._wait([work], op, group)

    # collectives --------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        key, pg = self._group(group, "all_reduce")
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        if len(key) > 1:
            self._run("all_reduce", group, lambda: pg.allreduce([out]))
        return out

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        key, pg = self._group(group, "all_gather")
        shapes = [tuple(s) for s in shapes]
        if len(shapes) != len(group) or tuple(tensor.shape) != shapes[list(group).index(self.rank)]:
            raise CommunicationError(f"all_gather on rank {self.rank}: tensor {tuple(tensor.shape)} and shapes {shapes} "
                                     f"do not fit group {list(group)}")
        if len(key) == 1:
            return [tensor.detach().clone()]
        sizes = [prod(s) for s in shapes]
        width = max(sizes)
        if width == 0:
            return [torch.empty(s, dtype=tensor.dtype) for s in shapes]
        gathered = [torch.empty(width, dtype=tensor.dtype) for _ in key]
        self._run("all_gather", group, lambda: pg.allgather([gathered], [_padded_flat(tensor, width)]))
        by_rank = dict(zip(key, gathered))
        return [by_rank[r][:n].reshape(s) for r, n, s in zip(group, sizes, shapes)]

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        """An all-reduce of the joined parts, keeping this rank's slice (twice a true
        reduce-scatter's traffic; simple and supported by every gloo build)."""
        key, pg = self._group(group, "reduce_scatter")
        if len(parts) != len(group):
            raise CommunicationError(f"reduce_scatter on rank {self.rank}: {len(parts)} parts for group {list(group)}")
        me = list(group).index(self.rank)
        if len(key) == 1:
            return parts[0].detach().clone()
        flat = torch.cat([p.detach().reshape(-1) for p in parts])
        if flat.numel():
            self._run("reduce_scatter", group, lambda: pg.allreduce([flat]))
        start = sum(p.numel() for p in parts[:me])
        return flat[start:start + parts[me].numel()].reshape(parts[me].shape).clone()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        key, pg = self._group(group, "broadcast")
        if src not in key:
            raise CommunicationError(f"broadcast on rank {self.rank}: source {src} is not in group {list(group)}")
        out = tensor.detach().clone().contiguous()
        if len(key) > 1 and out.numel():
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = key.index(src), 0
            self._run("broadcast", group, lambda: pg.broadcast([out], opts))
        return out

    def barrier(self, group: Group) -> None:
        self.all_reduce(torch.zeros(1), group)

    # point to point -----------------------------------------------------------------------------

    def _post(self, sends: Mapping[int, torch.Tensor], op: str) -> tuple[list, list[torch.Tensor]]:
        key, pg = self._group(self.members, op)
        works, kept = [], []
        for peer in sorted(sends):
            tensor = sends[peer].detach().contiguous()
            if tensor.numel():
                if peer not in key:
                    raise PeerLost(f"{op} on rank {self.rank}: peer {peer} is not alive in generation {self.generation}")
                try:
                    works.append(pg.send([tensor], key.index(peer), _P2P_TAG))
                except Exception as exc:  # noqa: BLE001
                    raise PeerLost(f"{op} to rank {peer} failed on rank {self.rank}: {exc}") from exc
                kept.append(tensor)
        return works, kept

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, tuple[Shape, torch.dtype]]) -> dict[int, torch.Tensor]:
        if (self.rank in sends) != (self.rank in recvs):
            raise CommunicationError(f"exchange on rank {self.rank}: a message to itself must appear in both sends and recvs")
        out = {}
        if self.rank in sends:
            out[self.rank] = _checked_self_message(sends[self.rank], *recvs[self.rank], rank=self.rank)
        works, _kept = self._post({p: t for p, t in sends.items() if p != self.rank}, "exchange")
        key, pg = self._group(self.members, "exchange")
        for peer in sorted(recvs):
            if peer == self.rank:
                continue
            shape, dtype = recvs[peer]
            out[peer] = torch.empty(tuple(shape), dtype=dtype)
            if out[peer].numel():
                if peer not in key:
                    raise PeerLost(f"exchange on rank {self.rank}: peer {peer} is not alive in generation {self.generation}")
                try:
                    works.append(pg.recv([out[peer]], key.index(peer), _P2P_TAG))
                except Exception as exc:  # noqa: BLE001
                    raise PeerLost(f"exchange from rank {peer} failed on rank {self.rank}: {exc}") from exc
        self._wait(works, "exchange", sorted({*sends, *recvs}))
        return out

    def post_sends(self, sends: Mapping[int, torch.Tensor]) -> "_PendingSends":
        works, kept = self._post(sends, "post_sends")
        return _PendingSends(self, works, kept, sorted(sends))


class _AbortableStore(dist.Store):
    """The job's store as a group's rendezvous sees it, its waits cut into short slices so that
    `abort()` frees a rank waiting for a peer that will never come (a member frozen or stuck
    while the group forms), rather than the store's whole timeout later."""

    _SLICE = timedelta(seconds=0.1)

    def __init__(self, store: dist.Store, backend: "GenerationBackend"):
        super().__init__()
        self._store, self._backend = store, backend
        self.set_timeout(store.timeout)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        end = time.monotonic() + (timeout or self.timeout).total_seconds()
        while True:
            if self._backend.aborted or self._backend._superseded():
                raise PeerLost(f"rank {self._backend.rank}: generation {self._backend.generation} was aborted while "
                               f"its groups formed")
            if self._store.check(list(keys)):
                return
            if time.monotonic() > end:
                raise CommunicationError(f"timed out waiting for store key(s) {list(keys)[:4]}")
            try:
                self._store.wait(list(keys), self._SLICE)
            except CommunicationError:
                pass

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store.get(key)

    def set(self, key: str, value) -> None:
        self._store.set(key, value)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key, value)

    def check(self, keys) -> bool:
        return self._store.check(list(keys))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()


def _wait_forever(jobs: queue.SimpleQueue) -> None:
    while True:
        works, done, failure = jobs.get()
        try:
            for work in works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
            failure.append(exc)
        done.set()


class _PendingSends:
    def __init__(self, backend: GenerationBackend, works: list, tensors: list[torch.Tensor], peers: list[int]):
        self._backend, self._works, self._tensors, self._peers = backend, works, tensors, peers

    def done(self) -> bool:
        """True once every send has completed (its buffer may be dropped); never waits."""
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        self._backend._wait(self._works, "post_sends (wait)", self._peers)
        self._works, self._tensors = [], []


__all__ = ["GenerationBackend", "PeerLost"]
