"""The one description of the hardware: device types, nodes, and link classes with alpha-beta costs.

A ClusterSpec lays devices out node by node (node 0 holds devices 0..n0-1, and so on), every node
holding devices of one type and belonging to a site (a homogeneous sub-cluster; HAPT's "mesh",
HetAuto's "cluster"). The link between two devices is, in order of precedence:

    a pair override            (`pairs`)
    the node's own link        (`Node.intra`), else the device type's intra-node link (`intra`)
    the site's inter-node link (`inter`, per site, else its "*" entry) when both nodes share a site
    the cross-site link        (`cross`, else the inter-node link)

A link class costs a message of B bytes alpha + B / beta (latency in s, bandwidth in bytes/s, one
direction), optionally per size bucket (HeteroSim's piecewise alpha-beta). Each device has its own
port on a link class, unless the class is `shared`: then all its messages between two sites (or
nodes) share one pipe per direction (a WAN link between clusters). Values are frozen; the
planners and the simulator take them as data. Figures in the presets are nominal and rounded.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, Iterable, Mapping

from hspmd.cluster.emulation import Emulation, check_emulation, slowdown_of
from hspmd.errors import ClusterError
from hspmd.limits import MAX_DEVICES, check_limit

DTYPES = ("float64", "float32", "tfloat32", "bfloat16", "float16", "float8")


def _positive(value: Any, where: str, allow_zero: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool):
        raise ClusterError(f"{where}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ClusterError(f"{where}: expected a number, got {value!r}") from None
    if math.isnan(number) or (math.isinf(number) and not allow_inf) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterError(f"{where}: must be a finite number {bound}, got {value!r}")
    return number


@dataclass(frozen=True)
class Bucket:
    """Alpha-beta for messages of at most `up_to` bytes."""

    up_to: float
    latency: float
    bandwidth: float


@dataclass(frozen=True)
class LinkClass:
    """One link class: `bandwidth` (beta, bytes/s per direction) and `latency` (alpha, s); `buckets`
    (sorted by size) override both for messages up to their size. `shared`: the bandwidth is one
    pipe per direction between two places (ClusterSpec.pipe), which every message of the class
    between them shares, e.g. the WAN link between two clusters; otherwise each device has its
    own port on the link (a NIC or NVLink per GPU)."""

    name: str
    bandwidth: float
    latency: float
    buckets: tuple[Bucket, ...] = ()
    shared: bool = False

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ClusterError("a link class needs a name")
        if not isinstance(self.shared, bool):
            raise ClusterError(f"link {self.name!r} shared: expected true or false, got {self.shared!r}")
        _positive(self.bandwidth, f"link {self.name!r} bandwidth", allow_inf=True)
        _positive(self.latency, f"link {self.name!r} latency", allow_zero=True)
        buckets = tuple(sorted((b if isinstance(b, Bucket) else Bucket(*b) for b in self.buckets), key=lambda b: b.up_to))
        for b in buckets:
            _positive(b.up_to, f"link {self.name!r} bucket size")
            _positive(b.bandwidth, f"link {self.name!r} bucket bandwidth")
            _positive(b.latency, f"link {self.name!r} bucket latency", allow_zero=True)
        object.__setattr__(self, "buckets", buckets)

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        return self.bandwidth

    def alpha_beta(self, nbytes: float = math.inf) -> tuple[float, float]:
        """(latency, bandwidth) for a message of `nbytes` (the bucket it falls in)."""
        if self.buckets:
            i = bisect.bisect_left([b.up_to for b in self.buckets], nbytes)
            if i < len(self.buckets):
                return self.buckets[i].latency, self.buckets[i].bandwidth
        return self.latency, self.bandwidth

    def seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        alpha, beta = self.alpha_beta(nbytes)
        return alpha + nbytes / beta

    def to_dict(self) -> dict:
        out: dict[str, object] = {"bandwidth": self.bandwidth, "latency": self.latency}
        if self.shared:
            out["shared"] = True
        if self.buckets:
            out["buckets"] = [{"up_to": b.up_to, "latency": b.latency, "bandwidth": b.bandwidth} for b in self.buckets]
        return out


LOCAL = LinkClass("local", math.inf, 0.0)


@dataclass(frozen=True)
class DeviceType:
    """Peak dense FLOP/s per dtype, HBM bandwidth (bytes/s) and capacity (bytes), copy engines."""

    name: str
    flops: tuple[tuple[str, float], ...]
    hbm_bandwidth: float
    hbm_capacity: float
    copy_engines: int = 2

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ClusterError("a device type needs a name")
        flops = dict(self.flops.items() if isinstance(self.flops, Mapping) else self.flops)
        if not flops:
            raise ClusterError(f"device type {self.name!r}: give peak flops for at least one dtype")
        for dtype, value in flops.items():
            if dtype not in DTYPES:
                raise ClusterError(f"device type {self.name!r} flops: unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
            _positive(value, f"device type {self.name!r} flops.{dtype}")
        object.__setattr__(self, "flops", tuple(sorted((k, float(v)) for k, v in flops.items())))
        _positive(self.hbm_bandwidth, f"device type {self.name!r} hbm_bandwidth")
        _positive(self.hbm_capacity, f"device type {self.name!r} hbm_capacity")
        if isinstance(self.copy_engines, bool) or not isinstance(self.copy_engines, int) or self.copy_engines < 1:
            raise ClusterError(f"device type {self.name!r} copy_engines: must be an integer >= 1, got {self.copy_engines!r}")

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Peak FLOP/s for `dtype`; float16 and bfloat16 stand in for each other, float32 falls
        back to tfloat32."""
        table = dict(self.flops)
        for name in (dtype, {"bfloat16": "float16", "float16": "bfloat16", "float32": "tfloat32"}.get(dtype)):
            if name in table:
                return table[name]
        raise ClusterError(f"device type {self.name!r} has no peak flops for {dtype!r} (it has {', '.join(table)})")

    def to_dict(self) -> dict:
        return {"flops": dict(self.flops), "hbm_bandwidth": self.hbm_bandwidth, "hbm_capacity": self.hbm_capacity,
                "copy_engines": self.copy_engines}


@dataclass(frozen=True)
class Node:
    """One node: `devices` devices of type `device_type` at `site`; `intra` names a link class that
    overrides the device type's intra-node link for this node."""

    device_type: str
    devices: int
    site: str = ""
    intra: str | None = None

    def __post_init__(self):
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ClusterError(f"a node of {self.device_type!r} needs a positive integer device count, got {self.devices!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """Devices 0..N-1 in `nodes`; `links` are the named link classes; `intra` maps device type ->
    link name, `inter` site -> link name ("*" for every site), `cross` names the cross-site link,
    `pairs` overrides the link of specific unordered device pairs; `emulation`, when given, says
    how a run on this one host emulates the cluster (hspmd.cluster.emulation)."""

    nodes: tuple[Node, ...]
    device_types: tuple[DeviceType, ...]
    links: tuple[LinkClass, ...]
    intra: tuple[tuple[str, str], ...]
    inter: tuple[tuple[str, str], ...]
    cross: str | None = None
    pairs: tuple[tuple[tuple[int, int], str], ...] = ()
    name: str = ""
    emulation: Emulation | None = None
    _node_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _types: dict = field(init=False, repr=False, compare=False)
    _links: dict = field(init=False, repr=False, compare=False)
    _pair_map: dict = field(init=False, repr=False, compare=False)
    _only_link: LinkClass | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        nodes = tuple(self.nodes)
        if not nodes:
            raise ClusterError(f"cluster {self.name!r}: nodes: give at least one node")
        check_limit(len(nodes), MAX_DEVICES, "the number of nodes of a cluster")
        check_limit(sum(n.devices for n in nodes), MAX_DEVICES, "the number of devices of a cluster")
        types = {t.name: t for t in self.device_types}
        links = {l.name: l for l in self.links}
        if len(types) != len(self.device_types):
            raise ClusterError(f"cluster {self.name!r}: device_types: a name is used twice")
        if len(links) != len(self.links):
            raise ClusterError(f"cluster {self.name!r}: links: a name is used twice")
        intra = tuple(sorted(dict(self.intra).items()))
        inter = tuple(sorted(dict(self.inter).items()))
        pairs = tuple(sorted(((min(a, b), max(a, b)), l) for (a, b), l in self.pairs))

        def known_link(name, where):
            if name not in links:
                raise ClusterError(f"cluster {self.name!r}: {where} names link {name!r}, which is not in links "
                                   f"({', '.join(sorted(links)) or 'none'})")

        for i, node in enumerate(nodes):
            if node.device_type not in types:
                raise ClusterError(f"cluster {self.name!r}: nodes[{i}].type {node.device_type!r} is not in device_types "
                                   f"({', '.join(sorted(types)) or 'none'})")
            if node.intra is not None:
                known_link(node.intra, f"nodes[{i}].intra")
            elif node.devices > 1 and node.device_type not in dict(intra):
                raise ClusterError(f"cluster {self.name!r}: intra has no link for device type {node.device_type!r} "
                                   f"(nodes[{i}] has {node.devices} devices)")
        for t, l in intra:
            known_link(l, f"intra.{t}")
        for s, l in inter:
            known_link(l, f"inter.{s}")
        if self.cross is not None:
            known_link(self.cross, "cross")
        sites = {n.site for n in nodes}
        by_site = dict(inter)
        for s in sites:
            if s not in by_site and "*" not in by_site and len(nodes) > 1:
                raise ClusterError(f"cluster {self.name!r}: inter has no link for site {s!r}; give one or a '*' entry")
        if len(sites) > 1 and self.cross is None and "*" not in by_site:
            raise ClusterError(f"cluster {self.name!r}: cross: nodes sit at {len(sites)} sites; name the cross-site link")
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "device_types", tuple(self.device_types))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "intra", intra)
        object.__setattr__(self, "inter", inter)
        object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "_node_of", tuple(chain.from_iterable(map(repeat, range(len(nodes)), (n.devices for n in nodes)))))
        object.__setattr__(self, "_types", types)
        object.__setattr__(self, "_links", links)
        object.__setattr__(self, "_pair_map", dict(pairs))
        one_link = len(nodes) == 1 and not pairs  # link() answers at once: planners ask it per slice
        object.__setattr__(self, "_only_link", self.node_link(0) if one_link else None)
        for (a, b), l in pairs:
            self.check_devices((a, b), "a pair override")
            known_link(l, f"pairs ({a}, {b})")
        if self.emulation is not None:
            if not isinstance(self.emulation, Emulation):
                raise ClusterError(f"cluster {self.name!r}: emulation must be an Emulation, got {self.emulation!r}")
            check_emulation(self.emulation, types, self.name)

    # ---- queries ------------------------------------------------------------------------------

    @property
    def n_devices(self) -> int:
        return len(self._node_of)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(n.devices for n in self.nodes)

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n.site for n in self.nodes))

    def check_devices(self, devices: Iterable[int], where: str = "") -> None:
        for d in devices:
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < len(self._node_of):
                at = f" ({where})" if where else ""
                raise ClusterError(f"device {d!r} is not in cluster {self.describe()} (devices 0-{len(self._node_of) - 1})"
                                   f"{at}; pass a larger cluster")

    def node_of(self, device: int) -> int:
        self.check_devices((device,))
        return self._node_of[device]

    def device_type(self, device: int) -> DeviceType:
        return self._types[self.nodes[self.node_of(device)].device_type]

    def type_named(self, name: str) -> DeviceType:
        if name not in self._types:
            raise ClusterError(f"cluster {self.describe()} has no device type {name!r} ({', '.join(self._types)})")
        return self._types[name]

    def link_named(self, name: str) -> LinkClass:
        if name not in self._links:
            raise ClusterError(f"cluster {self.describe()} has no link class {name!r} ({', '.join(self._links)})")
        return self._links[name]

    def devices_of_type(self, name: str) -> tuple[int, ...]:
        return tuple(d for d, n in enumerate(self._node_of) if self.nodes[n].device_type == name)

    def node_link(self, node: int) -> LinkClass:
        """The link between two devices of node `node`."""
        n = self.nodes[node]
        name = n.intra if n.intra is not None else dict(self.intra).get(n.device_type)
        return LOCAL if name is None else self._links[name]

    @property
    def only_link(self) -> LinkClass | None:
        """The link between every two distinct devices when there is one (one node, no per-pair
        links), else None: a planner pricing a ring of hundreds of devices then asks once."""
        return self._only_link

    def link(self, a: int, b: int) -> LinkClass:
        """The link class between devices a and b (LOCAL for a device with itself)."""
        n = len(self._node_of)
        if not (type(a) is int and type(b) is int and 0 <= a < n and 0 <= b < n):  # planners ask this per slice
            self.check_devices((a, b))
        if a == b:
            return LOCAL
        if self._only_link is not None:
            return self._only_link
        override = self._pair_map.get((min(a, b), max(a, b)))
        if override is not None:
            return self._links[override]
        na, nb = self._node_of[a], self._node_of[b]
        if na == nb:
            return self.node_link(na)
        sa, sb = self.nodes[na].site, self.nodes[nb].site
        by_site = dict(self.inter)
        if sa == sb:
            return self._links[by_site.get(sa, by_site.get("*"))]
        return self._links[self.cross if self.cross is not None else by_site["*"]]

    def pipe(self, a: int, b: int) -> tuple | None:
        """The shared pipe a message from a to b goes through, or None when their link class is not
        shared: one per link class and direction between the two devices' sites (when they
        differ) or nodes."""
        link = self.link(a, b)
        if not link.shared:
            return None
        na, nb = self._node_of[a], self._node_of[b]
        sa, sb = self.nodes[na].site, self.nodes[nb].site
        return (link.name, "site", sa, sb) if sa != sb else (link.name, "node", na, nb)

    def alpha_beta(self, a: int, b: int, nbytes: float = math.inf) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of the a-b link for a message of `nbytes`."""
        return self.link(a, b).alpha_beta(nbytes)

    def bandwidth(self, a: int, b: int) -> float:
        return self.link(a, b).bandwidth

    def seconds(self, a: int, b: int, nbytes: float) -> float:
        """Time of one message of `nbytes` from a to b."""
        return 0.0 if a == b else self.link(a, b).seconds(nbytes)

    def slowdown(self, device: int) -> float:
        """How many times slower than this host `device` runs under the cluster's emulation (1 without one)."""
        return self.type_slowdown(self.device_type(device).name)

    def type_slowdown(self, name: str) -> float:
        """How many times slower than this host a device of type `name` runs under the emulation (1 without one)."""
        self.type_named(name)
        return 1.0 if self.emulation is None else slowdown_of(self.emulation, self._types, name, self.name)

    def emulated_memory(self, device: int) -> float | None:
        """Host bytes `device` may hold under the cluster's emulation (its type's capacity x memory_scale),
        or None where memory is not emulated."""
        if self.emulation is None or self.emulation.memory_scale is None:
            return None
        return self.device_type(device).hbm_capacity * self.emulation.memory_scale

    def with_emulation(self, emulation: Emulation | None) -> "ClusterSpec":
        """The same cluster, emulated on this host as `emulation` says (None: not emulated)."""
        return ClusterSpec(self.nodes, self.device_types, self.links, self.intra, self.inter, self.cross, self.pairs,
                           self.name, emulation)

    def with_pairs(self, pairs: Mapping[tuple[int, int], LinkClass]) -> "ClusterSpec":
        """The same cluster with some device pairs on their own link class."""
        links = dict(self._links)
        for link in pairs.values():
            links.setdefault(link.name, link)
        return ClusterSpec(self.nodes, self.device_types, tuple(links.values()), self.intra, self.inter, self.cross,
                           self.pairs + tuple((p, l.name) for p, l in pairs.items()), self.name, self.emulation)

    def describe(self) -> str:
        if self.name:
            return self.name
        return " + ".join(f"{n.devices} {n.device_type}" for n in self.nodes)

    def __str__(self) -> str:
        return self.describe()

    def summary(self) -> str:
        """A few lines: nodes by type and site, and every link class."""
        lines = [f"cluster {self.describe()}: {self.n_devices} devices in {len(self.nodes)} node(s)"]
        start = 0
        for i, n in enumerate(self.nodes):
            t = self._types[n.device_type]
            lines.append(f"  node {i} [{n.site or '-'}] devices {start}-{start + n.devices - 1}: {n.device_type} "
                         f"({t.peak_flops(t.flops[0][0]) / 1e12:g} TFLOP/s {t.flops[0][0]}, "
                         f"{t.hbm_capacity / 1e9:g} GB, {t.hbm_bandwidth / 1e12:g} TB/s), intra {self.node_link(i).name}")
            start += n.devices
        for l in self.links:
            lines.append(f"  link {l.name}: {l.bandwidth / 1e9:g} GB/s, {l.latency * 1e6:g} us" + (", shared" if l.shared else ""))
        if self.emulation is not None:
            e = self.emulation
            slow = ", ".join(f"{t.name} x{slowdown_of(e, self._types, t.name, self.name):.3g}" for t in self.device_types)
            memory = "not emulated" if e.memory_scale is None else f"capacity x {e.memory_scale:g}"
            lines.append(f"  emulated on this host as {e.reference}: compute {slow}; memory {memory}; "
                         f"links between nodes {'emulated' if e.links else 'not emulated'}")
        return "\n".join(lines)


__all__ = ["Bucket", "ClusterSpec", "DTYPES", "DeviceType", "LOCAL", "LinkClass", "Node"]
