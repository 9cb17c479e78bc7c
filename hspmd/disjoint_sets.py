"""Union-find over device ids: pipeline discovery joins the devices of collective groups into
stages, a plan's message rounds group its messages by the devices they connect."""

from __future__ import annotations

from typing import Sequence


class DisjointSets:
    """Sets of ints, each named by one of its members (its root). A member met first in a join
    joins the set at once (the usual case: groups of devices are disjoint)."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def add(self, d: int) -> None:
        self.parent.setdefault(d, d)

    def find(self, d: int) -> int:
        parent = self.parent
        while parent[d] != d:
            parent[d] = d = parent[parent[d]]
        return d

    def join(self, members: Sequence[int]) -> None:
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

    def classes(self) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
        """(the members of each set by its root, in ascending order; each member's root)."""
        root_of = {d: self.find(d) for d in self.parent}
        members: dict[int, list[int]] = {}
        for d, root in root_of.items():
            members.setdefault(root, []).append(d)
        return {root: tuple(sorted(ds)) for root, ds in members.items()}, root_of


__all__ = ["DisjointSets"]
