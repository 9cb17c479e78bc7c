"""Union-find over orderable keys: pipeline discovery joins the devices of collective groups into
stages, a plan's message rounds group its messages by the devices they connect, the simulator
joins the (pipeline, stage) pairs that hold a layer in common."""

from __future__ import annotations

from typing import Any, Generic, Protocol, Sequence, TypeVar



class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=_Ordered)  # hashable and ordered: a set is named by its least member that joined another set


class DisjointSets(Generic[K]):
    """Sets of keys, each named by one of its members (its root). A member met first in a join
    joins the set at once (the usual case: groups of devices are disjoint)."""

    def __init__(self) -> None:
        self.parent: dict[K, K] = {}

    def add(self, d: K) -> None:
        self.parent.setdefault(d, d)

    def find(self, d: K) -> K:
        parent = self.parent
        while parent[d] != d:
            parent[d] = d = parent[parent[d]]
        return d

    def join(self, members: Sequence[K]) -> None:
        """Put `members` (at least one) in one set."""
        parent = self.parent
        self.add(members[0])
        root = self.find(members[0])
        for d in members[1:]:
            if d not in parent:
                parent[d] = root
                continue
            other = self.find(d)
            if other != root:
                root, other = min(root, other), max(root, other)
                parent[other] = root

    def classes(self) -> tuple[dict[K, tuple[K, ...]], dict[K, K]]:
        """(the members of each set by its root, in ascending order; each member's root)."""
        root_of = {d: self.find(d) for d in self.parent}
        members: dict[K, list[K]] = {}
        for d, root in root_of.items():
            members.setdefault(root, []).append(d)
        return {root: tuple(sorted(ds)) for root, ds in members.items()}, root_of


__all__ = ["DisjointSets"]
