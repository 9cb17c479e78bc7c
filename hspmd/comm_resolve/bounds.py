"""Lower bounds on the estimated time (cost.py) of plans between two layouts.

The resolver chooses among several routes by estimated time (resolver.py); building and pricing a
route costs as much as planning it, and resolve runs for every CommOp a device specializes. So a
route is built only when its bound is below the best plan so far, and the search stops once the
best plan meets the bound of every plan.

Every device of the destination must end up with the part of its value piece that its source
piece does not hold (its lack), so:

* any plan: the device receives its lack through its one receive port, and all lacks leave through
  the ports of the devices of the reshard; at no less than the smallest latency and no more than
  the greatest bandwidth of any link of the cluster;
* one BatchedSendRecv (a hop of a route): as above with only the holders of values sending, and
  every message carries at most one sender's piece, so a device lacking L bytes receives at least
  ceil(L / largest piece) messages, each paying a latency. Routes add their hops' bounds.

Partial pieces count as holding nothing and lacking nothing (a summand may stay zeros), so a bound
never exceeds the true estimate; shared-link contention only adds time.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache
from typing import NamedTuple, Sequence

from hspmd.annotations import Annotation, box_intersection, device_piece
from hspmd.annotations.geometry import region_extents, subgroup_device_pieces, subgroup_kinds
from hspmd.annotations.states import numbered
from hspmd.comm_resolve.slices import box_volume
from hspmd.comm_resolve.topology import ClusterSpec


def fastest_link(cluster: ClusterSpec) -> tuple[float, float]:
    """(least latency, greatest bandwidth) over every link class of the cluster and its buckets."""
    figures = [(l.latency, l.bandwidth) for l in cluster.links]
    figures += [(b.latency, b.bandwidth) for l in cluster.links for b in l.buckets]
    return min(a for a, _ in figures), max(b for _, b in figures)


class Lacks(NamedTuple):
    """What the bounds read of a reshard: the most and the total elements a device of the
    destination lacks, and the largest, the number and the total size of the (non-empty) value
    pieces of the source."""

    most: int
    total: int
    largest: int
    pieces: int
    held: int


@lru_cache(maxsize=256)
def _lacks(before: Annotation, after: Annotation, shape: tuple[int, ...]) -> Lacks:
    """Lacks of `after` from `before`; cached, as a pure function of immutable values that the
    floor and the routes' first hops share. Worked out once per kind of subgroup
    (subgroup_kinds): a union of hundreds of equal subgroups costs a pass over its subgroups."""
    kinds = subgroup_kinds(before, after, shape)
    lacking = [(_subgroup_lacks(before, after, shape, k), n) for k, n in _first_and_count(kinds)
               if kinds[k] is not None]
    lacking += [(_subgroup_lacks(before, after, shape, k), 1) for k, kind in enumerate(kinds) if kind is None]
    held = []  # the source's value pieces, per states and region extents
    for k, n in _first_and_count(list(zip(before.states_codes, region_extents(before, shape)))):
        values = (p for p in subgroup_device_pieces(before, k, shape).values() if not p.summand)
        held.append(([size for size in (box_volume(p.box) for p in values) if size], n))
    return Lacks(most=max((max(sizes) for sizes, _ in lacking if sizes), default=0),
                 total=sum(sum(sizes) * n for sizes, n in lacking),
                 largest=max((max(sizes) for sizes, _ in held if sizes), default=0),
                 pieces=sum(len(sizes) * n for sizes, n in held),
                 held=sum(sum(sizes) * n for sizes, n in held))


def _first_and_count(keys: Sequence) -> list[tuple[int, int]]:
    """(index of its first occurrence, occurrences) of each distinct key (in C, over the keys
    numbered)."""
    codes = numbered(keys)
    first = dict(zip(reversed(codes), range(len(codes) - 1, -1, -1)))
    return [(first[code], n) for code, n in Counter(codes).items()]


def lacks(before: Annotation, after: Annotation, shape: Sequence[int]) -> Lacks:
    """Lacks of `after` from `before` (see Lacks)."""
    return _lacks(before, after, tuple(shape))


def _subgroup_lacks(before: Annotation, after: Annotation, shape: tuple[int, ...], k: int) -> list[int]:
    """Elements each device of `after`'s subgroup k lacks: partial pieces count as holding nothing
    and lacking nothing."""
    missing = []
    for device, piece in subgroup_device_pieces(after, k, shape).items():
        if piece.summand:
            continue
        need = box_volume(piece.box)
        have = device_piece(before, shape, device)
        if need and have is not None and not have.summand:
            common = box_intersection(piece.box, have.box)
            need -= box_volume(common) if common is not None else 0
        if need:
            missing.append(need)
    return missing


def reshard_bound(src: Annotation, dst: Annotation, shape: Sequence[int], itemsize: int, cluster: ClusterSpec) -> float:
    """Seconds no plan from `src` to `dst` undercuts, whatever its steps (module docstring)."""
    need = lacks(src, dst, shape)
    if not need.total:
        return 0.0
    latency, bandwidth = fastest_link(cluster)
    relays = len(src.device_set | dst.device_set)
    return latency + max(need.most, need.total / relays) * itemsize / bandwidth


def bsr_bound(before: Annotation, after: Annotation, shape: Sequence[int], itemsize: int, cluster: ClusterSpec) -> float:
    """Seconds no single BatchedSendRecv from `before` to `after` undercuts (module docstring)."""
    need = lacks(before, after, shape)
    if not need.total:
        return 0.0
    if not need.pieces:
        return math.inf  # nothing to send from: the hop cannot be one BSR
    latency, bandwidth = fastest_link(cluster)
    most = need.most  # the receive time grows with the lack: the device lacking most bounds it
    receive = -(-most // need.largest) * latency + most * itemsize / bandwidth
    return max(receive, latency + need.total * itemsize / need.pieces / bandwidth)


def route_bound(hops: Sequence[Annotation], shape: Sequence[int], itemsize: int, cluster: ClusterSpec,
                enough: float = math.inf) -> float:
    """Seconds no route of one BatchedSendRecv per hop through the layouts `hops` undercuts, or,
    once the hops so far reach `enough`, that partial sum (the later hops only add to it: each
    hop's bound costs a pass over its devices)."""
    total = 0
    for a, b in zip(hops, hops[1:]):
        total += bsr_bound(a, b, shape, itemsize, cluster)
        if total >= enough:
            break
    return total


__all__ = ["Lacks", "bsr_bound", "fastest_link", "lacks", "reshard_bound", "route_bound"]
