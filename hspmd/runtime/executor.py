"""Run one stage's schedule (hspmd.specialize.schedules) on a Backend: the forward and backward passes
of this device's executable graph, micro-batch by micro-batch, in the schedule's order.

Stage-to-stage sends are posted without waiting for the receiver (`NonBlockingSends`), and are
completed once the whole order has run: with blocking sends, 1F1B's steady state (stage s sends
micro-batch m+1's activation while stage s+1 sends micro-batch m's gradient back) deadlocks.
The update (gradient synchronisation + optimizer) is not part of a schedule: it runs once per
step, after every stage's schedule, through hspmd.runtime.run.run_update.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from hspmd.ir.shapes import Binding
from hspmd.backends.backend import Backend, Group, Pending, Shape
from hspmd.specialize.schedules import FORWARD, Action, check_order
from hspmd.specialize.executable import ExecutableGraph
from hspmd.runtime.buckets import BucketSync
from hspmd.runtime.run import DeviceState, MicroBatch, run_backward, run_forward
from hspmd.runtime.trace import Tracer


class NonBlockingSends(Backend):
    """A backend whose exchanges post their sends and only wait for their receives.

    Uses the wrapped backend's `post_sends(sends) -> handle with wait()` where it has one (the
    torch.distributed backend); backends without it must already send without blocking (the
    in-process backend posts into mailboxes). `wait_sends()` completes everything posted."""

    def __init__(self, inner: Backend):
        self.inner, self.rank, self.world_size, self.device = inner, inner.rank, inner.world_size, inner.device
        self._post = getattr(inner, "post_sends", None)
        self._pending: list = []

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, tuple[Shape, torch.dtype]]) -> dict[int, torch.Tensor]:
        if self._post is None or self.rank in sends:
            return self.inner.exchange(sends, recvs)
        if sends:
            self._pending.append(self._post(dict(sends)))
        return self.inner.exchange({}, recvs) if recvs else {}

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
                self._pending.append(self._post(dict(sends)))
            if recvs:
                self.inner.exchange_into({}, recvs)

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        self.inner.prepare_groups(groups)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        return self.inner.all_reduce(tensor, group)

    def all_reduce_start(self, tensor: torch.Tensor, group: Group) -> Pending:
        return self.inner.all_reduce_start(tensor, group)

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        return self.inner.all_gather(tensor, group, shapes)

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor) -> None:
        self.inner.all_reduce_into(tensor, group, out)

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        self.inner.all_gather_into(tensor, group, outs)

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor) -> None:
        self.inner.reduce_scatter_into(parts, group, out)

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        return self.inner.reduce_scatter(parts, group)

    def barrier(self, group: Group) -> None:
        self.inner.barrier(group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        return self.inner.broadcast(tensor, src, group)


@dataclass(frozen=True)
class ScheduleRun:
    """What running one stage's order measured: micro-batches run and the most kept alive at once."""

    micro_batches: int
    peak_in_flight: int


def run_schedule(exe: ExecutableGraph, backend: Backend, state: DeviceState, order: Sequence[Action],
                 feeds: Callable[[int], Mapping[str, torch.Tensor]],
                 binding: Binding | Callable[[int], Binding] | None = None,
                 tracer: Tracer | None = None, buckets: BucketSync | None = None) -> ScheduleRun:
    """Run `order` on this device: F(m) runs the forward pass of micro-batch m fed by feeds(m)
    (this device's pieces), B(m) its backward pass; gradients accumulate in `state`. Sends posted
    along the way are completed before returning. A `tracer` records one event per action.
    `buckets`: the last backward of the order fills them and starts their all-reduces
    (hspmd.runtime.buckets); the update then waits for them (BucketSync.finish)."""
    micro_batches = len({a.micro_batch for a in order})
    check_order(order, micro_batches)
    sender = NonBlockingSends(backend)
    live: dict[int, MicroBatch] = {}
    peak = 0
    last_backward = max((i for i, a in enumerate(order) if a.kind != FORWARD), default=-1)
    for i, action in enumerate(order):
        m = action.micro_batch
        with tracer.span(str(action), "compute", micro_batch=m) if tracer else nullcontext():
            if action.kind == FORWARD:
                live[m] = run_forward(exe, sender, state, feeds(m), binding(m) if callable(binding) else binding)
                peak = max(peak, len(live))
            else:
                run_backward(exe, sender, state, live.pop(m), buckets if i == last_backward else None)
    with tracer.span("wait sends", "comm") if tracer else nullcontext():
        sender.wait_sends()
    return ScheduleRun(micro_batches, peak)


__all__ = ["NonBlockingSends", "ScheduleRun", "run_schedule"]
