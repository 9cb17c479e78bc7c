"""The hardware the resolver plans against is hspmd.cluster's ClusterSpec (one description of
the hardware for the resolver, the cost model and the simulator). The BSR planner picks senders by
link bandwidth; plans report bytes per link class and an alpha-beta time from its link classes.

`topology` arguments accept a ClusterSpec, any text `hspmd.cluster.parse_cluster` reads (`2x4`,
`nvlink-ib:4x8`, `h800-h20:2+4[xM]`, a preset such as `hetu-h800-h20`, a .yaml file) or None (one
node holding every device the plan touches: all links equal).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterable

from hspmd.cluster import ClusterSpec, parse_cluster, single_node


def cluster_for(topology: "ClusterSpec | str | None", devices: Iterable[int],
                where: "str | Callable[[], str]" = "") -> ClusterSpec:
    """The ClusterSpec named by `topology` (see the module docstring), checked to hold `devices`
    (the device ids of annotations, integers already: only their range is checked).
    `where` may be a function giving the text, called only for the error (printing a union of
    thousands of devices for every plan would cost more than planning it)."""
    devices = frozenset(devices)
    cluster = _one_node(max(devices, default=0) + 1) if topology is None else parse_cluster(topology)
    if devices and (min(devices) < 0 or max(devices) >= cluster.n_devices):  # ids of annotations: ints
        cluster.check_devices(sorted(devices), where() if callable(where) else where)
    return cluster


@lru_cache(maxsize=64)
def _one_node(n_devices: int) -> ClusterSpec:
    """single_node, made once per size (an immutable value; every plan of a job asks for it)."""
    return single_node(n_devices)


__all__ = ["ClusterSpec", "cluster_for"]
