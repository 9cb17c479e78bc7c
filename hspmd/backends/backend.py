"""The primitive interface every communication backend implements, seen from one rank.

Plans (hspmd.comm_resolve) and executable graphs are run by code written once against this
interface; the in-process backend (threads, one per device), torch.distributed (gloo / NCCL) and
CuPy NCCL differ only here. Groups are ordered tuples of global device ids (device id == rank).
Every member of a group calls the same method with the same group, in the same global order.
Uneven pieces are allowed: callers pass every member's shape, so no backend ever needs to gather
a whole tensor on one device.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Iterable, Iterator, Mapping, Protocol, Sequence

import torch

from hspmd.annotations import REDUCTIONS
from hspmd.annotations.reference import combine
from hspmd.errors import CommunicationError, HSPMDError

Group = tuple[int, ...]
Shape = tuple[int, ...]

IDENTITY = {"sum": 0.0, "prod": 1.0, "max": float("-inf"), "min": float("inf")}
"""The element each reduction leaves a value unchanged with (avg has none: a plan never gives an
avg reduction an empty input)."""


def check_reduction(op: str, what: str, rank: int) -> None:
    """Raise CommunicationError unless `op` is a reduction (annotations.REDUCTIONS)."""
    if op not in REDUCTIONS:
        raise CommunicationError(f"{what} on rank {rank}: op must be one of {', '.join(REDUCTIONS)}, got {op!r}")


def accumulate(out: torch.Tensor, value: torch.Tensor, op: str) -> None:
    """`out` combined in place with `value` under `op` (avg accumulates a sum: divide afterwards,
    finish_reduction)."""
    if op in ("sum", "avg"):
        out.add_(value)
    elif op == "prod":
        out.mul_(value)
    elif op == "max":
        torch.maximum(out, value, out=out)
    else:
        torch.minimum(out, value, out=out)


def finish_reduction(out: torch.Tensor, op: str, members: int) -> None:
    """What an accumulated reduction still needs: an avg's sum divided by the member count."""
    if op == "avg":
        out.div_(members)


class Pending(Protocol):
    """A collective under way: wait() blocks until it is done and returns its result."""

    def wait(self) -> torch.Tensor: ...


class Done:
    """A collective that finished when it was started."""

    def __init__(self, result: torch.Tensor):
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


class Backend(abc.ABC):
    """One rank's handle on the collectives of a job."""

    rank: int
    world_size: int
    device: torch.device = torch.device("cpu")  # where this rank's buffers live
    # True when all_reduce_start returns before the peers join (torch.distributed). Gradient
    # buckets start during the backward only then: a blocking start could wait on a peer that
    # first needs this rank's later sends (a weight tied across pipeline stages).
    overlaps_collectives: bool = False
    # The same on every rank of a job and different between jobs ("" where unknown): a sharded
    # checkpoint tells this job's rank files from those an earlier job left in the same directory.
    job: str = ""

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        """Set up communicators for `groups` before their first use. Collective over the whole job:
        every rank calls it at the same point, passing the groups it will use (lists may differ).
        Backends whose groups need no setup do nothing."""
        return None

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        """Sum of `tensor` over the group, returned to every member (input is not modified)."""

    def all_reduce_start(self, tensor: torch.Tensor, group: Group) -> "Pending":
        """Start summing the contiguous `tensor` over the group in place; wait() on the result
        returns it summed. Until then the caller must neither read nor write it. Lets gradient
        buckets be reduced while the backward goes on. This default reduces at once (a copy of the
        input goes in, since other members may still read what this one passed) and writes the sum
        back: backends that can overlap communication override it."""
        tensor.copy_(self.all_reduce(tensor.clone(), group))
        return Done(tensor)

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        """Every member's tensor, in group order; shapes[i] is member i's shape (may differ)."""


    @abc.abstractmethod
    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        """parts[i] is this rank's summand of member i's result; returns the sum of this rank's parts
        from all members. Part shapes may differ between members but agree across ranks."""

    @abc.abstractmethod
    def exchange(
        self,
        sends: Mapping[int, torch.Tensor],
        recvs: Mapping[int, tuple[Shape, torch.dtype]],
    ) -> dict[int, torch.Tensor]:
        """Batched point-to-point: send sends[peer] to each peer, receive recvs[peer] from each peer.
        Deadlock-free whatever the pattern (the backend batches / orders the operations)."""

    # Writing into the caller's buffers. A plan executor passes views of its destination piece, so
    # a reshard holds no intermediate whole tensor. `out` must not overlap the inputs. These
    # defaults go through the methods above (correct, but they allocate the result once more);
    # the in-process and torch.distributed backends override them to write in place.

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor, op: str = "sum") -> None:
        """The group's reduction `op` (annotations.REDUCTIONS: sum, max, min, avg, prod) of
        `tensor` written into `out` (same shape; any strides). The default reduces other than
        the sum gather every member's tensor first."""
        check_reduction(op, "all_reduce", self.rank)
        if op == "sum":
            out.copy_(self.all_reduce(tensor, group))
        else:
            shapes = [tuple(tensor.shape)] * len(group)
            out.copy_(combine(self.all_gather(tensor.contiguous(), group, shapes), op))

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        """Member i's tensor written into outs[i] (its shape is member i's; any strides)."""
        for out, got in zip(outs, self.all_gather(tensor, group, [tuple(o.shape) for o in outs])):
            out.copy_(got)

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor,
                            op: str = "sum") -> None:
        """This rank's reduce_scatter result (the reduction `op` of every member's part for it)
        written into `out`. The default reduces other than the sum gather every member's parts."""
        check_reduction(op, "reduce_scatter", self.rank)
        if op == "sum":
            out.copy_(self.reduce_scatter(parts, group))
            return
        joined = torch.cat([p.detach().reshape(-1) for p in parts])
        me = group.index(self.rank)
        start = sum(p.numel() for p in parts[:me])
        gathered = self.all_gather(joined, group, [tuple(joined.shape)] * len(group))
        mine = [g[start : start + parts[me].numel()].reshape(parts[me].shape) for g in gathered]
        out.copy_(combine(mine, op))

    def exchange_into(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """`exchange` receiving into the caller's buffers: recvs[peer] is filled with peer's message."""
        got = self.exchange(sends, {peer: (tuple(t.shape), t.dtype) for peer, t in recvs.items()})
        for peer, out in recvs.items():
            out.copy_(got[peer])

    @abc.abstractmethod
    def barrier(self, group: Group) -> None:
        """Returns once every member of the group has called it."""

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        """`src`'s tensor to every member (others pass a buffer of the right shape and dtype)."""
        shapes = [tuple(tensor.shape)] * len(group)
        return self.all_gather(tensor, group, shapes)[group.index(src)]


@contextlib.contextmanager
def failures_as(what: str, error: type[CommunicationError] = CommunicationError, hint: str = "") -> Iterator[None]:
    """Every failure inside but hspmd's own raised again as `error`: `what`, the failure's type and
    message, then `hint` (a communication library's errors become one typed error that names
    the operation, the group and the rank; an HSPMDError already does)."""
    try:
        yield
    except HSPMDError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised typed
        raise error(f"{what}: {type(exc).__name__}: {exc}{hint}") from exc
