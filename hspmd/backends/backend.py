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
from typing import Iterable, Mapping, Protocol, Sequence

import torch

Group = tuple[int, ...]
Shape = tuple[int, ...]


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

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        """Set up communicators for `groups` before their first use. Collective over the whole job:
        every rank calls it at the same point, passing the groups it will use (lists may differ).
        Backends whose groups need no setup do nothing."""

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

    def all_gather_joined(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> torch.Tensor:
        """Every member's tensor flattened and joined in group order, as one 1-D tensor: a gather
        along a leading dim is then the destination itself. Backends that can gather straight
        into one buffer override it to skip the copy."""
        return torch.cat([t.reshape(-1) for t in self.all_gather(tensor, group, shapes)])

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

    @abc.abstractmethod
    def barrier(self, group: Group) -> None:
        """Returns once every member of the group has called it."""

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        """`src`'s tensor to every member (others pass a buffer of the right shape and dtype)."""
        shapes = [tuple(tensor.shape)] * len(group)
        return self.all_gather(tensor, group, shapes)[group.index(src)]
