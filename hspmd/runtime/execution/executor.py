"""Run one stage's schedule (hspmd.specialize.schedules) on a Backend: the forward and backward passes
of this device's executable graph, micro-batch by micro-batch, in the schedule's order.

Stage-to-stage sends are posted without waiting for the receiver (`NonBlockingSends`): with
blocking sends, 1F1B's steady state (stage s sends micro-batch m+1's activation while stage s+1
sends micro-batch m's gradient back) deadlocks. A send's buffer is kept only until its receiver
has it: sends the backend reports complete are dropped after every action (gloo reports a send
only once it is waited for), those of F(m) are completed right after B(m) (its gradient came
back, so the later stages have received F(m)'s outputs), and those of a backward right after the
next backward (by then the earlier stages, which wait for that gradient and need nothing else
from this stage to get there, have taken it); whatever is left is completed at the end.
The update (gradient synchronisation + optimizer) is not part of a schedule: it runs once per
step, after every stage's schedule, through hspmd.runtime.execution.run.run_update.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from hspmd.ir.shapes import Binding
from hspmd.backends.backend import Backend, Group, Pending, Shape
from hspmd.specialize.schedules import FORWARD, Action, check_order
from hspmd.specialize.executable import ExecutableGraph
from hspmd.runtime.execution.buckets import BucketSync
from hspmd.runtime.execution.run import DeviceState, MicroBatch, run_backward, run_forward
from hspmd.runtime.execution.trace import Tracer


class NonBlockingSends(Backend):
    """A backend whose exchanges post their sends and only wait for their receives.

    Uses the wrapped backend's `post_sends(sends) -> handle with wait()` where it has one (the
    torch.distributed backend); backends without it must already send without blocking (the
    in-process backend posts into mailboxes). `wait_sends()` completes everything posted."""

    def __init__(self, inner: Backend):
        self.inner, self.rank, self.world_size, self.device = inner, inner.rank, inner.world_size, inner.device
        self.overlaps_collectives = inner.overlaps_collectives
        self.emulator = getattr(inner, "emulator", None)  # an emulated device's (runtime.execution.emulation)
        self._post = getattr(inner, "post_sends", None)
        self._pending: list[tuple[object, object, int]] = []  # (tag, handle, bytes)
        self.tag: object = None  # what the sends posted now belong to (run_schedule: the action)
        self._previous_backward: object = None

    def _start(self, sends: Mapping[int, torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in sends.values())
        self._pending.append((self.tag, self._post(dict(sends)), nbytes))

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, tuple[Shape, torch.dtype]]) -> dict[int, torch.Tensor]:
        if self._post is None or self.rank in sends:
            return self.inner.exchange(sends, recvs)
        if sends:
            self._start(sends)
        return self.inner.exchange({}, recvs) if recvs else {}

    @property
    def pending(self) -> int:
        """Posted sends whose buffers are still held (their receivers may not have them yet)."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return sum(n for _, _, n in self._pending)

    def release_completed(self) -> None:
        """Drop the sends that have completed (without waiting for any)."""
        self._pending = [p for p in self._pending if not (hasattr(p[1], "done") and p[1].done())]

    def action_done(self, kind: str, micro_batch: int) -> None:
        """After a schedule action: once B(m) ran, F(m)'s sends have arrived (the gradient came
        back, so later stages have its outputs) and so have the previous backward's (the earlier
        stage needs nothing more from this one to take them); drop those and any completed."""
        if kind != FORWARD:
            self.complete((FORWARD, micro_batch))
            if self._previous_backward is not None:
                self.complete(self._previous_backward)
            self._previous_backward = (kind, micro_batch)
        self.release_completed()

    def complete(self, tag: object) -> None:
        """Complete the sends posted under `tag` (their receivers are known to have them) and drop them."""
        for t, handle, _ in self._pending:
            if t == tag:
                handle.wait()
        self._pending = [p for p in self._pending if p[0] != tag]

    def exchange_into(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        if self._post is None and sends:
            # the in-process backend's exchange posts copies without waiting (exchange_into would wait)
            got = self.inner.exchange(sends, {p: (tuple(t.shape), t.dtype) for p, t in recvs.items()})
            for peer, out in recvs.items():
                out.copy_(got[peer])
        elif self._post is None or self.rank in sends:
            self.inner.exchange_into(sends, recvs)
        else:
            if sends:
                self._start(sends)
            if recvs:
                self.inner.exchange_into({}, recvs)

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for _, handle, _ in pending:
            handle.wait()

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        self.inner.prepare_groups(groups)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        return self.inner.all_reduce(tensor, group)

    def all_reduce_start(self, tensor: torch.Tensor, group: Group) -> Pending:
        return self.inner.all_reduce_start(tensor, group)

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        return self.inner.all_gather(tensor, group, shapes)

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor, op: str = "sum") -> None:
        self.inner.all_reduce_into(tensor, group, out, op)

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        self.inner.all_gather_into(tensor, group, outs)

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor,
                            op: str = "sum") -> None:
        self.inner.reduce_scatter_into(parts, group, out, op)

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        return self.inner.reduce_scatter(parts, group)

    def barrier(self, group: Group) -> None:
        self.inner.barrier(group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        return self.inner.broadcast(tensor, src, group)


@dataclass(frozen=True)
class ScheduleRun:
    """What running one stage's order measured, after each action: micro-batches run; the most
    whose activations were held at once (peak_in_flight); the most posted sends whose buffers
    were held at once (peak_pending_sends); and the most bytes held at once by both, counted from
    the tensors themselves (activation storages, shared ones once, weights and fed inputs
    excluded; send buffers); and the wall seconds from the first action to the last send
    completed (what a pipeline's share of a step costs, without the gradient sync and update)."""

    micro_batches: int
    peak_in_flight: int
    peak_pending_sends: int = 0
    peak_held_bytes: int = 0
    seconds: float = 0.0


def run_schedule(exe: ExecutableGraph, backend: Backend, state: DeviceState, order: Sequence[Action],
                 feeds: Callable[[int], Mapping[str, torch.Tensor]],
                 binding: Binding | Callable[[int], Binding] | None = None,
                 tracer: Tracer | None = None, buckets: BucketSync | None = None,
                 recompute: frozenset[int] | None = None) -> ScheduleRun:
    """Run `order` on this device: F(m) runs the forward pass of micro-batch m fed by feeds(m)
    (this device's pieces), B(m) its backward pass; gradients accumulate in `state`. Sends posted
    along the way are completed before returning. A `tracer` records one event per action.
    `buckets`: the last backward of the order fills them and starts their all-reduces
    (hspmd.runtime.execution.buckets); the update then reads them, each waited for when read (BucketSync.finish).
    `recompute`: the devices of this device's stage, to recompute every micro-batch's forward in
    its backward (hspmd.runtime.execution.run)."""
    began = time.perf_counter()
    micro_batches = len({a.micro_batch for a in order})
    check_order(order, micro_batches)
    sender = NonBlockingSends(backend)
    live: dict[int, MicroBatch] = {}
    given = {_storage(t) for t in state.leaves.values()}  # weights and fed inputs: not the stage's buffers
    peak = peak_sends = peak_bytes = 0
    last_backward = max((i for i, a in enumerate(order) if a.kind != FORWARD), default=-1)
    for i, action in enumerate(order):
        m = action.micro_batch
        sender.tag = (action.kind, m)
        with tracer.span(str(action), "compute", micro_batch=m) if tracer else nullcontext():
            if action.kind == FORWARD:
                fed = feeds(m)
                given.update(_storage(t) for t in fed.values())
                live[m] = run_forward(exe, sender, state, fed, binding(m) if callable(binding) else binding,
                                      recompute=recompute)
            else:
                run_backward(exe, sender, state, live.pop(m), buckets if i == last_backward else None)
        sender.action_done(action.kind, m)
        peak = max(peak, sum(1 for mb in live.values() if mb.env))
        peak_sends = max(peak_sends, sender.pending)
        peak_bytes = max(peak_bytes, _activation_bytes(live.values(), given) + sender.pending_bytes)
    with tracer.span("wait sends", "comm") if tracer else nullcontext():
        sender.wait_sends()
    return ScheduleRun(micro_batches, peak, peak_sends, peak_bytes, time.perf_counter() - began)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _activation_bytes(micro_batches: Iterable[MicroBatch], given: set[int]) -> int:
    """Bytes of the distinct storages the micro-batches' values hold, `given` ones excluded."""
    seen: dict[int, int] = {}
    for mb in micro_batches:
        for t in mb.env.values():
            key = _storage(t)
            if key not in given:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


__all__ = ["NonBlockingSends", "ScheduleRun", "run_schedule"]
