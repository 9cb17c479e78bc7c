"""What one call of `resolve` works on: the reshard (a value: its two layouts, shape, cluster and
options) and the call's working state (the messages planned per hop, the fallbacks taken), with
the small step helpers the decision ladder (resolver.py) and the scaling path (scaling.py) share.

The reshard is immutable and compared by value; the working state is a plain object owned by one
call, never hashed, compared or shared between calls."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from hspmd.annotations import Annotation, Box
from hspmd.annotations.geometry import kept_regions
from hspmd.comm_resolve.plan import Step, Transfer
from hspmd.comm_resolve.topology import ClusterSpec
from hspmd.errors import UnsupportedReshard


@dataclass(frozen=True)
class Reshard:
    """The reshard being resolved: its two layouts, shape, topology and options, shared by every route."""

    src: Annotation
    dst: Annotation
    shape: tuple[int, ...]
    topology: ClusterSpec
    itemsize: int
    reduce_partial: bool
    focus: frozenset[int] | None = None  # resolved for these devices (None: every device)

    def leaves_out(self, devices: Iterable[int]) -> bool:
        """Whether a repeated subgroup on `devices` may be left out of the plan (it holds none of
        the devices the plan is resolved for)."""
        return self.focus is not None and self.focus.isdisjoint(devices)

    def refuse(self, why: str) -> UnsupportedReshard:
        values = "sums" if self.src.reduction == "sum" else f"partial {self.src.reduction} values"
        return UnsupportedReshard(
            f"cannot reshard {self.src} -> {self.dst} (shape {self.shape}): {why}, which BatchedSendRecv cannot "
            f"carry, and no collective path exists; reduce the {values} first (e.g. comm() to a split or "
            f"duplicate layout on the same devices) or resolve with reduce_partial=True"
        )


class Resolution:
    """One resolve call's working state beside its Reshard (whose fields it repeats, read on every
    step): the BatchedSendRecv messages already planned, by hop (routes share hops: the direct
    route is often the hierarchical plan's BSR), and the fallbacks the decision ladder took, in
    order (each once), for the plan that contains them (explain.py prints them)."""

    __slots__ = ("reshard", "src", "dst", "shape", "topology", "itemsize", "reduce_partial", "focus", "planned",
                 "fallbacks")

    def __init__(self, reshard: Reshard):
        self.reshard = reshard
        self.src, self.dst, self.shape = reshard.src, reshard.dst, reshard.shape
        self.topology, self.itemsize = reshard.topology, reshard.itemsize
        self.reduce_partial, self.focus = reshard.reduce_partial, reshard.focus
        self.planned: dict[tuple, tuple[tuple[Transfer, ...], tuple]] = {}
        self.fallbacks: list[str] = []

    def leaves_out(self, devices: Iterable[int]) -> bool:
        return self.reshard.leaves_out(devices)

    def refuse(self, why: str) -> UnsupportedReshard:
        return self.reshard.refuse(why)

    def fall_back(self, why: str) -> None:
        """Record that a tier of the ladder could not give its primitive and a later one serves."""
        if why not in self.fallbacks:
            self.fallbacks.append(why)


def regions(ann: Annotation, ctx: Resolution) -> tuple[Box, ...]:
    """Each subgroup's region of the tensor (ctx.shape is checked against both layouts by resolve)."""
    return kept_regions(ann, ctx.shape)


def identity(union: Annotation, k: int) -> Step:
    return Step("Identity", union, union, subgroup=k)


def shifted(steps: list[Step], by: int) -> list[Step]:
    return [replace(s, round=s.round + by) for s in steps]


def in_sequence(steps: list[Step]) -> list[Step]:
    return [replace(s, round=i) for i, s in enumerate(steps)]


def next_round(steps: list[Step]) -> int:
    return max((s.round + 1 for s in steps if s.primitive != "Identity"), default=0)


__all__ = ["Reshard", "Resolution", "identity", "in_sequence", "next_round", "regions", "shifted"]
