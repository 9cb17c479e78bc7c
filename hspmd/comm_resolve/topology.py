"""The cluster model the resolver plans against: devices in nodes, one link class per device pair.

A link class has a name, a bandwidth (bytes/s, one direction) and a latency (s). Devices are laid
out node by node (node 0 holds devices 0..n0-1, and so on); a pair of devices in one node uses that
node's intra-node link, a pair in different nodes the inter-node link, and any pair can be
overridden. The BSR planner picks senders by bandwidth; plans report bytes per link class and an
alpha-beta time estimate from these numbers.

Presets (the figures are nominal per-direction rates, rounded; they rank links, they do not
predict a real cluster to the microsecond):

    Topology.nodes(2, 4)          generic: 2 nodes of 4 devices ("2x4" in text)
    Topology.nvlink_ib(4, 8)      NVLink inside a node, InfiniBand NDR between nodes ("nvlink-ib:4x8")
    Topology.h800_h20(2, 4)       2 H800 nodes then 4 H20 nodes, 8 GPUs each ("h800-h20:2+4"):
                                  each GPU type has its own NVLink rate; a link class per type
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from hspmd.errors import AnnotationError


@dataclass(frozen=True)
class Link:
    """One link class: bandwidth in bytes/s per direction, latency in seconds."""

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self):
        if not self.name:
            raise AnnotationError("a link class needs a name")
        if not self.bandwidth > 0 or self.latency < 0:
            raise AnnotationError(
                f"link {self.name!r}: bandwidth must be > 0 and latency >= 0, got {self.bandwidth}, {self.latency}"
            )

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


LOCAL = Link("local", float("inf"), 0.0)
GENERIC_INTRA = Link("intra-node", 100e9, 5e-6)
GENERIC_INTER = Link("inter-node", 12.5e9, 10e-6)
NVLINK = Link("nvlink", 300e9, 3e-6)
INFINIBAND = Link("infiniband", 50e9, 6e-6)
NVLINK_H800 = Link("nvlink-h800", 200e9, 3e-6)
NVLINK_H20 = Link("nvlink-h20", 450e9, 3e-6)
ROCE = Link("roce", 25e9, 8e-6)


@dataclass(frozen=True)
class Topology:
    """Devices 0..N-1 in nodes of `node_sizes`; `intra[i]` is node i's link; `inter` joins nodes;
    `pairs` overrides the link of specific (unordered) device pairs."""

    node_sizes: tuple[int, ...]
    intra: tuple[Link, ...]
    inter: Link
    pairs: tuple[tuple[tuple[int, int], Link], ...] = ()
    name: str = ""
    _node_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _pair_map: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        sizes = tuple(self.node_sizes)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise AnnotationError(f"node sizes must be positive integers, got {list(sizes)}")
        intra = tuple(self.intra)
        if len(intra) == 1 and len(sizes) > 1:
            intra = intra * len(sizes)
        if len(intra) != len(sizes):
            raise AnnotationError(f"{len(intra)} intra-node links given for {len(sizes)} nodes; give one per node")
        pairs = tuple(((min(a, b), max(a, b)), link) for (a, b), link in self.pairs)
        object.__setattr__(self, "node_sizes", sizes)
        object.__setattr__(self, "intra", intra)
        object.__setattr__(self, "pairs", tuple(sorted(pairs, key=lambda p: p[0])))
        object.__setattr__(self, "_node_of", tuple(n for n, size in enumerate(sizes) for _ in range(size)))
        object.__setattr__(self, "_pair_map", dict(self.pairs))
        for (a, b), _ in self.pairs:
            self.check_devices((a, b), "a pair override")

    # presets --------------------------------------------------------------------------------------

    @classmethod
    def nodes(cls, n_nodes: int, per_node: int, intra: Link = GENERIC_INTRA, inter: Link = GENERIC_INTER) -> "Topology":
        return cls((per_node,) * n_nodes, (intra,), inter, name=f"{n_nodes}x{per_node}")

    @classmethod
    def single_node(cls, n_devices: int) -> "Topology":
        return cls.nodes(1, max(1, n_devices))

    @classmethod
    def nvlink_ib(cls, n_nodes: int, per_node: int = 8) -> "Topology":
        return cls((per_node,) * n_nodes, (NVLINK,), INFINIBAND, name=f"nvlink-ib:{n_nodes}x{per_node}")

    @classmethod
    def h800_h20(cls, n_h800_nodes: int, n_h20_nodes: int, per_node: int = 8) -> "Topology":
        """H800 nodes first (devices 0..), then H20 nodes; nodes are joined by RoCE."""
        n = n_h800_nodes + n_h20_nodes
        intra = (NVLINK_H800,) * n_h800_nodes + (NVLINK_H20,) * n_h20_nodes
        return cls((per_node,) * n, intra, ROCE, name=f"h800-h20:{n_h800_nodes}+{n_h20_nodes}")

    @classmethod
    def parse(cls, text: "str | Topology") -> "Topology":
        """`2x4`, `nvlink-ib:4x8`, `h800-h20:2+4` (8 GPUs per node) or `h800-h20:2+4x4`."""
        if isinstance(text, Topology):
            return text
        spec = str(text).strip().lower()
        if m := re.fullmatch(r"(\d+)x(\d+)", spec):
            return cls.nodes(int(m[1]), int(m[2]))
        if m := re.fullmatch(r"nvlink-ib:(\d+)x(\d+)", spec):
            return cls.nvlink_ib(int(m[1]), int(m[2]))
        if m := re.fullmatch(r"h800-h20:(\d+)\+(\d+)(?:x(\d+))?", spec):
            return cls.h800_h20(int(m[1]), int(m[2]), int(m[3] or 8))
        raise AnnotationError(
            f"unknown topology {text!r}: write NODESxPER_NODE (e.g. 2x4), nvlink-ib:NODESxPER_NODE "
            f"or h800-h20:H800_NODES+H20_NODES[xPER_NODE]"
        )

    # queries --------------------------------------------------------------------------------------

    @property
    def n_devices(self) -> int:
        return len(self._node_of)

    def node_of(self, device: int) -> int:
        self.check_devices((device,))
        return self._node_of[device]

    def check_devices(self, devices, where: str = "") -> None:
        for d in devices:
            if not 0 <= d < len(self._node_of):
                at = f" ({where})" if where else ""
                raise AnnotationError(
                    f"device {d} is not in topology {self.describe()} (devices 0-{len(self._node_of) - 1}){at}; "
                    f"pass a larger topology"
                )

    def link(self, a: int, b: int) -> Link:
        if a == b:
            return LOCAL
        override = self._pair_map.get((min(a, b), max(a, b)))
        if override is not None:
            return override
        na, nb = self._node_of[a], self._node_of[b]
        return self.intra[na] if na == nb else self.inter

    def bandwidth(self, a: int, b: int) -> float:
        return self.link(a, b).bandwidth

    def with_pairs(self, pairs: Mapping[tuple[int, int], Link]) -> "Topology":
        """The same cluster with some device pairs on their own link class."""
        return Topology(self.node_sizes, self.intra, self.inter, self.pairs + tuple(pairs.items()), self.name)

    def describe(self) -> str:
        return self.name or f"{len(self.node_sizes)} nodes of {list(self.node_sizes)}"

    def __str__(self) -> str:
        return self.describe()

    # serialisation --------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        link = lambda l: {"name": l.name, "bandwidth": l.bandwidth, "latency": l.latency}  # noqa: E731
        return {
            "name": self.name,
            "node_sizes": list(self.node_sizes),
            "intra": [link(l) for l in self.intra],
            "inter": link(self.inter),
            "pairs": [{"devices": list(p), **link(l)} for p, l in self.pairs],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Topology":
        link = lambda d: Link(d["name"], float(d["bandwidth"]), float(d["latency"]))  # noqa: E731
        return cls(
            tuple(data["node_sizes"]),
            tuple(link(l) for l in data["intra"]),
            link(data["inter"]),
            tuple(((p["devices"][0], p["devices"][1]), link(p)) for p in data.get("pairs", ())),
            data.get("name", ""),
        )


def default_topology(devices) -> Topology:
    """One node holding every device the plan touches (all links equal)."""
    return Topology.single_node(max(devices, default=0) + 1)


__all__ = ["Link", "Topology", "default_topology", "LOCAL", "NVLINK", "INFINIBAND", "NVLINK_H800", "NVLINK_H20"]
