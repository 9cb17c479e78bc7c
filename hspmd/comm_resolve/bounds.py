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
from functools import lru_cache
from typing import Sequence

from hspmd.annotations import Annotation, box_intersection, device_pieces
from hspmd.comm_resolve.slices import box_volume
from hspmd.comm_resolve.topology import ClusterSpec


def fastest_link(cluster: ClusterSpec) -> tuple[float, float]:
    """(least latency, greatest bandwidth) over every link class of the cluster and its buckets."""
    figures = [(l.latency, l.bandwidth) for l in cluster.links]
    figures += [(b.latency, b.bandwidth) for l in cluster.links for b in l.buckets]
    return min(a for a, _ in figures), max(b for _, b in figures)


@lru_cache(maxsize=256)
def _lacks(before: Annotation, after: Annotation, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(elements each device of `after` lacks, sizes of the value pieces of `before`); cached, as
    a pure function of immutable values that the floor and the routes' first hops share."""
    held = device_pieces(before, shape)
    lacks = []
    for device, piece in device_pieces(after, shape).items():
        if piece.summand:  # partial
            continue
        need = box_volume(piece.box)
        have = held.get(device)
        if need and have is not None and not have.summand:
            common = box_intersection(piece.box, have.box)
            need -= box_volume(common) if common is not None else 0
        if need:
            lacks.append(need)
    sizes = [box_volume(p.box) for p in held.values() if not p.summand]
    return tuple(lacks), tuple(n for n in sizes if n)


def reshard_bound(src: Annotation, dst: Annotation, shape: Sequence[int], itemsize: int, cluster: ClusterSpec) -> float:
    """Seconds no plan from `src` to `dst` undercuts, whatever its steps (module docstring)."""
    lacks, _ = _lacks(src, dst, tuple(shape))
    if not lacks:
        return 0.0
    latency, bandwidth = fastest_link(cluster)
    relays = len(set(src.devices) | set(dst.devices))
    return latency + max(max(lacks), sum(lacks) / relays) * itemsize / bandwidth


def bsr_bound(before: Annotation, after: Annotation, shape: Sequence[int], itemsize: int, cluster: ClusterSpec) -> float:
    """Seconds no single BatchedSendRecv from `before` to `after` undercuts (module docstring)."""
    lacks, pieces = _lacks(before, after, tuple(shape))
    if not lacks:
        return 0.0
    if not pieces:
        return math.inf  # nothing to send from: the hop cannot be one BSR
    latency, bandwidth = fastest_link(cluster)
    largest = max(pieces)
    receive = max(-(-lack // largest) * latency + lack * itemsize / bandwidth for lack in lacks)
    return max(receive, latency + sum(lacks) * itemsize / len(pieces) / bandwidth)


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


__all__ = ["bsr_bound", "fastest_link", "reshard_bound", "route_bound"]
