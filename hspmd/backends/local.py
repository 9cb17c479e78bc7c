"""In-process backend: one thread per device, collectives through shared memory.

It runs exactly the per-rank code that the multi-process backends run, so fast property tests
exercise the real executors. It is for tests and planning checks, not for training speed.
"""

from __future__ import annotations

import secrets
import threading
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import torch

from hspmd.errors import CommunicationError, HSPMDError
from hspmd.backends.backend import Backend, Group, Shape, accumulate, check_reduction, finish_reduction

T = TypeVar("T")


class LocalWorld:
    """Shared state of one in-process job: rendezvous slots for collectives and mailboxes for P2P."""

    def __init__(self, devices: Iterable[int], timeout: float = 60.0, device: torch.device | str = "cpu"):
        self.devices = tuple(sorted(set(devices)))
        self.timeout = timeout
        self.device = torch.device(device)
        self._cond = threading.Condition()
        self._slots: dict[tuple, dict[int, object]] = {}
        self._reads: dict[tuple, int] = {}
        self._mail: dict[tuple, object] = {}  # (src, dst, n): (tensor, sender waits for a copy); ("copied", ...)
        self.failed: str | None = None
        self._communications = 0  # collectives and messages entered so far, by any device
        self.job = secrets.token_hex(8)
        self.backends = {rank: LocalBackend(self, rank) for rank in self.devices}

    def run(self, fn: Callable[[Backend], T]) -> dict[int, T]:
        """Run fn(backend) on one thread per device, each with its own rank's backend (the same
        backend on every call, so a job may call run() once per step); return {device: result}.

        If any device raises, the others are released (they see CommunicationError), the world
        stays failed, and the first original error is re-raised: a bug in one device's program
        never hangs the caller. A call that every device refused with an HSPMDError before any of
        them communicated (a bad argument, checked alike everywhere) leaves the world usable."""
        results: dict[int, T] = {}
        errors: dict[int, BaseException] = {}

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.backends[rank])
            except BaseException as exc:  # noqa: BLE001 - forwarded to the caller below
                errors[rank] = exc
                self.fail(f"device {rank} raised {type(exc).__name__}: {exc}")

        if self.failed is not None:
            raise CommunicationError(f"this in-process job failed earlier: {self.failed}")
        communications = self._communications
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in self.devices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            primary = [e for e in errors.values() if not isinstance(e, CommunicationError)]
            refused_alike = (len(errors) == len(self.devices) and self._communications == communications
                             and all(isinstance(e, HSPMDError) for e in primary) and len(primary) == len(errors))
            if refused_alike:
                self.failed = None
            raise (primary or list(errors.values()))[0]
        return results

    def fail(self, reason: str) -> None:
        with self._cond:
            if self.failed is None:
                self.failed = reason
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        if not self._cond.wait_for(lambda: ready() or self.failed is not None, timeout=self.timeout):
            self.failed = self.failed or f"timeout in {what}"
            self._cond.notify_all()
            raise CommunicationError(f"{what} timed out after {self.timeout}s: a member never joined")
        if not ready():
            raise CommunicationError(f"{what} aborted: {self.failed}")

    def rendezvous(self, key: tuple, group: Group, rank: int, value: object) -> dict[int, object]:
        """Deposit `value`; return every member's value once all have deposited."""
        with self._cond:
            self._communications += 1
            slot = self._slots.setdefault(key, {})
            slot[rank] = value
            self._cond.notify_all()
            self._wait(lambda: len(slot) == len(group), f"collective {key[0]} on group {list(group)}")
            self._reads[key] = self._reads.get(key, 0) + 1
            if self._reads[key] == len(group):
                del self._slots[key], self._reads[key]
            return dict(slot)

    def post(self, key: tuple, value: object) -> None:
        with self._cond:
            self._communications += 1
            self._mail[key] = value
            self._cond.notify_all()

    def take(self, key: tuple) -> object:
        with self._cond:
            self._wait(lambda: key in self._mail, f"receive on device {key[-2]} from device {key[-3]}")
            return self._mail.pop(key)


class LocalBackend(Backend):
    def __init__(self, world: LocalWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, len(world.devices)
        self.device, self.job = world.device, world.job
        self._group_calls: dict[Group, int] = {}
        self._sent: dict[int, int] = {}  # messages sent to each peer so far
        self._received: dict[int, int] = {}  # messages received from each peer so far

    def _key(self, kind: str, group: Group) -> tuple:
        if self.rank not in group:
            raise CommunicationError(f"device {self.rank} called {kind} on group {list(group)} it is not in")
        n = self._group_calls.get(group, 0)
        self._group_calls[group] = n + 1
        return (kind, group, n)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        values = self.world.rendezvous(self._key("all_reduce", group), group, self.rank, tensor)
        return sum((values[r] for r in group[1:]), values[group[0]].clone())

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        values = self.world.rendezvous(self._key("all_gather", group), group, self.rank, tensor)
        out = [values[r].clone() for r in group]
        for r, t, s in zip(group, out, shapes):
            if tuple(t.shape) != tuple(s):
                raise CommunicationError(f"all_gather: device {r} sent shape {tuple(t.shape)}, expected {tuple(s)}")
        return out

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        values = self.world.rendezvous(self._key("reduce_scatter", group), group, self.rank, list(parts))
        me = group.index(self.rank)
        return sum((values[r][me] for r in group[1:]), values[group[0]][me].clone())

    def _done(self, group: Group) -> None:
        """Wait until every member has read every input of the collective just run (and dropped
        its references), so that no caller changes an input another member still reads, and an
        input is freed when its owner drops it."""
        self.world.rendezvous(self._key("done", group), group, self.rank, None)

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor, op: str = "sum") -> None:
        check_reduction(op, "all_reduce", self.rank)
        values = self.world.rendezvous(self._key("all_reduce", group), group, self.rank, tensor)
        out.copy_(values[group[0]])
        for r in group[1:]:
            accumulate(out, values[r], op)
        finish_reduction(out, op, len(group))
        del values
        self._done(group)

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        values = self.world.rendezvous(self._key("all_gather", group), group, self.rank, tensor)
        for r, out in zip(group, outs):
            if tuple(values[r].shape) != tuple(out.shape):
                raise CommunicationError(f"all_gather: device {r} sent shape {tuple(values[r].shape)}, "
                                         f"expected {tuple(out.shape)}")
            out.copy_(values[r])
        del values
        self._done(group)

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor,
                            op: str = "sum") -> None:
        check_reduction(op, "reduce_scatter", self.rank)
        values = self.world.rendezvous(self._key("reduce_scatter", group), group, self.rank, list(parts))
        me = group.index(self.rank)
        out.copy_(values[group[0]][me])
        for r in group[1:]:
            accumulate(out, values[r][me], op)
        finish_reduction(out, op, len(group))
        del values
        self._done(group)

    def exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, tuple[Shape, torch.dtype]]
    ) -> dict[int, torch.Tensor]:
        """Sends post a copy and return at once (a send never waits for its receiver)."""
        for peer, tensor in sends.items():
            self.world.post(self._next(self._sent, self.rank, peer), (tensor.clone(), False))
        return {peer: self._receive(peer, shape, dtype, None) for peer, (shape, dtype) in recvs.items()}

    def exchange_into(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """Sends post the tensor itself, without a copy, and wait until the receiver has copied it
        into its buffer (as a wire transfer would): no buffer beyond the caller's."""
        posted = []
        for peer, tensor in sends.items():
            key = self._next(self._sent, self.rank, peer)
            self.world.post(key, (tensor, True))
            posted.append(key)
        for peer, out in recvs.items():
            self._receive(peer, tuple(out.shape), out.dtype, out)
        for key in posted:
            self.world.take(("copied", *key))

    def _next(self, counts: dict[int, int], src: int, dst: int) -> tuple[int, int, int]:
        """The mailbox key of the next message from src to dst (counted per peer)."""
        peer = dst if src == self.rank else src
        n = counts.get(peer, 0)
        counts[peer] = n + 1
        return (src, dst, n)

    def _receive(self, peer: int, shape, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
        key = self._next(self._received, peer, self.rank)
        got, acknowledge = self.world.take(key)
        if tuple(got.shape) != tuple(shape) or got.dtype != dtype:
            raise CommunicationError(
                f"device {self.rank} expected {tuple(shape)} {dtype} from device {peer}, got {tuple(got.shape)} {got.dtype}"
            )
        if out is not None:
            out.copy_(got)
        elif acknowledge:
            out = got.clone()
        else:
            out = got  # the sender's copy
        del got
        if acknowledge:  # the sender's tensor is no longer referenced here
            self.world.post(("copied", *key), None)
        return out

    def barrier(self, group: Group) -> None:
        self.world.rendezvous(self._key("barrier", group), group, self.rank, None)


def run_on_devices(fn: Callable[[Backend], T], devices: Iterable[int], timeout: float = 60.0,
                   device: torch.device | str = "cpu") -> dict[int, T]:
    """Run fn(backend) once on one thread per device of a fresh in-process world, buffers on
    `device` (LocalWorld.run)."""
    return LocalWorld(devices, timeout, device).run(fn)


__all__ = ["LocalWorld", "LocalBackend", "run_on_devices"]
