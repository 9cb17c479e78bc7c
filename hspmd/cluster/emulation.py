"""Emulating a cluster's device types and links on this host: what a cluster file asks for.

A cluster file with an `emulate` block says that a run on this one host plays its devices: every
rank is the device of its id, and this host's CPU process stands for the `reference` device type.

    emulate:
      reference: fast           # the device type this host stands for (runs at host speed)
      dtype: float32            # whose peak FLOP/s give each type's slowdown (default: float32)
      slowdown: {slow: 2.5}     # optional: a type's slowdown given outright instead
      memory_scale: 1.0e-6      # host bytes per byte of a type's hbm_capacity; omit: memory not emulated
      links: true               # messages between nodes take their link class's time (default true)
      host_link: {bandwidth: 2.0e9, latency: 3.0e-5}   # this host's own transfer (default: free)

A type's slowdown is the reference's peak FLOP/s over its own (>= 1: this host cannot run faster
than itself, so a type faster than the reference is an error naming it), unless `slowdown` gives
it. Giving the reference itself a slowdown s > 1 dilates time: every rank then computes 1/s of
the time and waits the rest, so ranks that share fewer cores than they are stop competing for
them (the host's scheduler would otherwise set the pace, not the emulated devices). The values here are pure
data; hspmd.runtime.execution.emulation runs them. Everything is off unless a file asks for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from hspmd.errors import ClusterError

CLUSTER_ENV = "HSPMD_CLUSTER"  # the cluster file `hspmd run --cluster` gives every rank of a job
# an emulated rank sleeps off its compute debt once it reaches this many seconds, and before it
# communicates (hspmd.runtime.execution.emulation; level 2 prices the work slowed after the sleeps with it)
WAIT_CHUNK_S = 0.25
EMULATE_KEYS = ("reference", "dtype", "slowdown", "memory_scale", "links", "host_link")


@dataclass(frozen=True)
class Emulation:
    """How a run on this host emulates a cluster (module docstring). `slowdowns`: explicit
    (type, slowdown) pairs; `host_link`: (latency s, bandwidth bytes/s) of this host's own
    transfers, subtracted from a collective's modelled link time (None: taken as free)."""

    reference: str
    dtype: str = "float32"
    slowdowns: tuple[tuple[str, float], ...] = ()
    memory_scale: float | None = None
    links: bool = True
    host_link: tuple[float, float] | None = None

    def __post_init__(self):
        if not isinstance(self.reference, str) or not self.reference:
            raise ClusterError("emulate.reference: name the device type this host stands for")
        pairs = dict(self.slowdowns.items() if isinstance(self.slowdowns, Mapping) else self.slowdowns)
        for name, value in pairs.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
                raise ClusterError(f"emulate.slowdown.{name}: must be a number >= 1 (this host cannot run faster than "
                                   f"itself), got {value!r}")
        object.__setattr__(self, "slowdowns", tuple(sorted((str(k), float(v)) for k, v in pairs.items())))
        if self.memory_scale is not None and (isinstance(self.memory_scale, bool) or not self.memory_scale > 0
                                              or not math.isfinite(self.memory_scale)):
            raise ClusterError(f"emulate.memory_scale: must be a finite number > 0, got {self.memory_scale!r}")
        if not isinstance(self.links, bool):
            raise ClusterError(f"emulate.links: expected true or false, got {self.links!r}")
        if self.host_link is not None:
            latency, bandwidth = self.host_link
            if not (latency >= 0 and bandwidth > 0):
                raise ClusterError(f"emulate.host_link: latency >= 0 and bandwidth > 0, got {self.host_link!r}")

    def to_dict(self) -> dict:
        out: dict = {"reference": self.reference, "dtype": self.dtype, "links": self.links}
        if self.slowdowns:
            out["slowdown"] = dict(self.slowdowns)
        if self.memory_scale is not None:
            out["memory_scale"] = self.memory_scale
        if self.host_link is not None:
            out["host_link"] = {"latency": self.host_link[0], "bandwidth": self.host_link[1]}
        return out

    @classmethod
    def from_dict(cls, data: object) -> "Emulation":
        if not isinstance(data, Mapping):
            raise ClusterError(f"emulate must be a mapping with keys {', '.join(EMULATE_KEYS)}, got {data!r}")
        unknown = sorted(set(map(str, data)) - set(EMULATE_KEYS))
        if unknown:
            raise ClusterError(f"emulate: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(EMULATE_KEYS)}")
        slowdown = data.get("slowdown", {}) or {}
        if not isinstance(slowdown, Mapping):
            raise ClusterError(f"emulate.slowdown must map device types to slowdowns, got {slowdown!r}")
        host = data.get("host_link")
        if host is not None:
            if not isinstance(host, Mapping) or set(host) - {"latency", "bandwidth"} or "bandwidth" not in host:
                raise ClusterError(f"emulate.host_link must be {{bandwidth: B, latency: A}}, got {host!r}")
            host = (as_number(host.get("latency", 0.0), "emulate.host_link.latency"),
                    as_number(host["bandwidth"], "emulate.host_link.bandwidth"))
        scale = data.get("memory_scale")
        return cls(str(data.get("reference", "") or ""), str(data.get("dtype", "float32")),
                   tuple((str(k), as_number(v, f"emulate.slowdown.{k}")) for k, v in slowdown.items()),
                   None if scale is None else as_number(scale, "emulate.memory_scale"), data.get("links", True), host)


def as_number(value: Any, key: str) -> float:
    """A number read from a cluster file (`key` names where); a bool or text is a ClusterError."""
    if isinstance(value, bool):
        raise ClusterError(f"{key} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ClusterError(f"{key} must be a number, got {value!r}") from None


def check_emulation(emulation: Emulation, types: Mapping, name: str) -> None:
    """Every name the block uses is a device type of the cluster, and every type's slowdown is >= 1."""
    for type_name in (emulation.reference, *dict(emulation.slowdowns)):
        if type_name not in types:
            raise ClusterError(f"cluster {name!r}: emulate names device type {type_name!r}, which is not in device_types "
                               f"({', '.join(sorted(types))})")
    for type_name in types:
        slowdown_of(emulation, types, type_name, name)


def slowdown_of(emulation: Emulation, types: Mapping, type_name: str, name: str = "") -> float:
    """How many times slower than this host a device of `type_name` runs (>= 1)."""
    given = dict(emulation.slowdowns)
    if type_name in given:
        return given[type_name]
    reference = types[emulation.reference].peak_flops(emulation.dtype)
    ratio = reference / types[type_name].peak_flops(emulation.dtype)
    if ratio < 1 - 1e-9:
        raise ClusterError(f"cluster {name!r}: device type {type_name!r} is {1 / ratio:.3g}x faster than the emulation's "
                           f"reference {emulation.reference!r} ({emulation.dtype}); this host stands for the reference "
                           f"and cannot run faster than itself: make the fastest type the reference")
    return max(1.0, ratio)


__all__ = ["CLUSTER_ENV", "EMULATE_KEYS", "Emulation", "as_number", "check_emulation", "slowdown_of"]
