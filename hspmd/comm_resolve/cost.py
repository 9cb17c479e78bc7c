"""Traffic and time of plan steps: bytes per device and per link class, alpha-beta estimates.

Collectives are costed as rings over their members in group order (the NCCL-style algorithm):
member i sends to member i+1. A reduce-scatter member never sends its own final chunk, an
all-gather member never sends its successor's chunk, an all-reduce is a reduce-scatter into n
even chunks followed by an all-gather. Time of a ring = (ring steps) x (worst edge latency) +
(worst edge bytes / its bandwidth). A batched send-receive costs, per device, the sum over its
messages of latency + bytes / bandwidth, and the step lasts as long as its busiest sender or
receiver. Collectives a device joins run one after another; a step lasts as long as its busiest
device; steps of one round (disjoint subgroups) overlap, rounds add up.

Contention: a device's messages queue on its own send and receive ports (above). On a `shared`
link class (ClusterSpec.pipe: one pipe per direction between two sites or nodes, e.g. the WAN
between two clusters) they also queue on the pipe, first come first served as in the
simulator's shared link resources: a message holds it for latency + bytes / bandwidth, and a ring
step pushes all its edges' bytes on the pipe through the one bandwidth. A step lasts at least as
long as its busiest pipe. So many small messages across a shared link (HetAuto's S1, which the
paper found slow and unstable) pay every latency one after another, where a route sending few
messages across pays it once. Not modelled: overlap with compute, switch-level congestion inside
a site, protocol effects of many concurrent flows beyond their latencies.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from hspmd.comm_resolve.slices import box_volume
from hspmd.cluster import LinkClass
from hspmd.comm_resolve.topology import ClusterSpec
from hspmd.errors import ShapeError, ShapeTypeError
from hspmd.limits import brief

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}


def dtype_name(dtype: object) -> str:
    """Canonical dtype name ("float32") from a name, "torch.float32" or a torch.dtype."""
    if isinstance(dtype, (int, float, bool)) or dtype is None:
        raise ShapeTypeError(f"a dtype is a name such as 'float32' or a torch.dtype, got {brief(dtype)}")
    name = str(dtype).removeprefix("torch.")
    aliases = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32"}
    name = aliases.get(name, name)
    if name not in DTYPE_SIZES:
        raise ShapeError(f"unknown dtype {brief(dtype)}; use one of {', '.join(sorted(DTYPE_SIZES))}")
    return name


@dataclass
class Traffic:
    """Accumulated bytes sent/received per device and per link class, and per-device busy time.
    `tables=False` keeps the times alone (pricing a plan needs no byte tables, and at thousands of
    devices filling them cost as much as the times)."""

    tables: bool = True
    sent: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    by_link: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_by_link: dict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))
    busy: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    pipes: dict[tuple, float] = field(default_factory=lambda: defaultdict(float))  # busy time per shared pipe

    def edge(self, topology: ClusterSpec, a: int, b: int, nbytes: int, link: LinkClass | None = None) -> None:
        """Count `nbytes` from a to b (`link`: their link class, when the caller has it already)."""
        if a == b or nbytes <= 0 or not self.tables:
            return
        self.sent[a] += nbytes
        self.received[b] += nbytes
        name = (link or topology.link(a, b)).name
        self.by_link[name] += nbytes
        self.sent_by_link[(a, name)] += nbytes

    @property
    def seconds(self) -> float:
        return max(max(self.busy.values(), default=0.0), max(self.pipes.values(), default=0.0))


def collective_traffic(traffic: Traffic, topology: ClusterSpec, itemsize: int, kind: str, devices, box, parts) -> None:
    """Add one ring collective's edge bytes and its duration to every member's busy time."""
    n = len(devices)
    if n < 2:
        return
    if kind == "all_reduce":
        total = box_volume(box) * itemsize
        per_edge = [2 * (n - 1) * total // n] * n
        steps = 2 * (n - 1)
    else:
        sizes = [box_volume(p) * itemsize for p in parts]
        total = sum(sizes)
        skip = [sizes[(i + 1) % n] for i in range(n)] if kind == "all_gather" else sizes
        per_edge = [total - s for s in skip]
        steps = n - 1
    link = topology.only_link
    if link is not None and not link.shared and not traffic.tables:  # one link for every edge: no walk
        seconds = steps * link.latency + max(per_edge) / link.bandwidth
        for d in devices:
            traffic.busy[d] += seconds
        return
    worst_latency, worst_transfer = 0.0, 0.0
    on_pipes: dict[tuple, int] = defaultdict(int)
    for i, a in enumerate(devices):
        b = devices[(i + 1) % n]
        link = topology.link(a, b)
        traffic.edge(topology, a, b, per_edge[i], link)
        worst_latency = max(worst_latency, link.latency)
        worst_transfer = max(worst_transfer, per_edge[i] / link.bandwidth)
        if link.shared and per_edge[i] > 0:
            on_pipes[(topology.pipe(a, b), link.bandwidth)] += per_edge[i]
    for (pipe, bandwidth), nbytes in on_pipes.items():  # edges sharing a pipe split its bandwidth
        worst_transfer = max(worst_transfer, nbytes / bandwidth)
        traffic.pipes[pipe] += nbytes / bandwidth
    seconds = steps * worst_latency + worst_transfer
    for d in devices:
        traffic.busy[d] += seconds


def itemsize_of(itemsize: "int | Sequence[int]") -> Callable[[int], int]:
    """tensor number -> bytes per element, from one size for all or a sequence indexed by tensor."""
    if isinstance(itemsize, int):
        return lambda tensor: itemsize
    sizes = tuple(itemsize)
    return lambda tensor: sizes[tensor]


def transfer_traffic(traffic: Traffic, topology: ClusterSpec, itemsize, transfers: Iterable) -> None:
    """Add messages; each device is busy for the larger of its send and its receive time.
    `itemsize`: bytes per element, or a sequence of them indexed by a box's tensor number."""
    sizes = itemsize_of(itemsize)
    send_time: dict[int, float] = defaultdict(float)
    recv_time: dict[int, float] = defaultdict(float)
    for t in transfers:
        if t.src == t.dst:
            continue
        if len(t.boxes) == 1 == len(t.tensors):  # the usual message: one box
            nbytes = box_volume(t.boxes[0]) * sizes(t.tensors[0])
        else:
            nbytes = sum(box_volume(b) * sizes(k) for b, k in zip(t.boxes, t.tensors))
        link = topology.link(t.src, t.dst)
        traffic.edge(topology, t.src, t.dst, nbytes, link)
        seconds = link.seconds(nbytes)
        send_time[t.src] += seconds
        recv_time[t.dst] += seconds
        if link.shared:
            traffic.pipes[topology.pipe(t.src, t.dst)] += seconds
    for d in set(send_time) | set(recv_time):
        traffic.busy[d] += max(send_time[d], recv_time[d])


__all__ = ["DTYPE_SIZES", "Traffic", "collective_traffic", "dtype_name", "itemsize_of", "transfer_traffic"]
