"""What a calibration of this host measured and fitted (hspmd.runtime.policies.calibrate), and the
cluster and cost models it prices: this host's CPU processes, or a cluster emulated on it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from hspmd.cluster import ClusterSpec, DeviceType, LinkClass, Node
from hspmd.errors import HSPMDError
from hspmd.planning import CostModel, Efficiency, ModelSpec, OpCosts
from hspmd.planning.model import KERNEL_CLASSES


@dataclass(frozen=True)
class Calibration:
    """What `hspmd calibrate` measured and fitted."""

    peak_flops: float
    bandwidth: float
    overhead: float
    link_latency: float
    link_bandwidth: float
    step_overhead: float = 0.0
    gamma: float = 1.0
    op_costs: OpCosts | None = None

    def device_type(self) -> DeviceType:
        return DeviceType("cpu", (("float32", self.peak_flops),), self.bandwidth, 16e9)

    def efficiency(self) -> Efficiency:
        return Efficiency(gamma=tuple((cls, self.gamma) for cls in KERNEL_CLASSES))

    def link(self) -> LinkClass:
        return LinkClass("gloo", self.link_bandwidth, self.link_latency)

    def cluster(self, devices: int) -> ClusterSpec:
        """One node of `devices` calibrated CPU processes joined by the fitted gloo link."""
        return ClusterSpec((Node("cpu", devices),), (self.device_type(),), (self.link(),), (("cpu", "gloo"),),
                           (("*", "gloo"),), name=f"calibrated-cpu:{devices}")

    def cost_model(self, model: ModelSpec, devices: int) -> CostModel:
        return CostModel(self.cluster(devices), model, {"*": self.efficiency()}, overhead=self.overhead,
                         step_overhead=self.step_overhead, op_costs=self.op_costs)

    def cost_model_for(self, cluster: ClusterSpec, model: ModelSpec) -> CostModel:
        """The cost model of `cluster` emulated on this host (hspmd.runtime.execution.emulation): this
        fit is the emulation's reference type; a type s times slower has the fitted rates / s,
        pays (s - 1) x the per-instruction overhead per kernel as its delta and s x the per-step
        overhead and the op costs' fixed times (emulation slows all of a rank's CPU time between
        communications: ops, dispatch and the trainer's work alike); memory is its capacity x
        memory_scale; links inside a node are this host's fitted link (not emulated), between
        nodes the file's."""
        emulation = cluster.emulation
        if emulation is None:
            raise HSPMDError(f"cluster {cluster.describe()} has no emulate block: it is not run on this host")
        types, efficiency = [], {}
        for t in cluster.device_types:
            s = cluster.type_slowdown(t.name)
            memory = t.hbm_capacity * emulation.memory_scale if emulation.memory_scale is not None else t.hbm_capacity
            types.append(DeviceType(t.name, ((model.dtype, self.peak_flops / s),), self.bandwidth / s, memory))
            efficiency[t.name] = Efficiency(gamma=tuple((cls, self.gamma) for cls in KERNEL_CLASSES),
                                            delta=tuple((cls, (s - 1.0) * self.overhead) for cls in KERNEL_CLASSES),
                                            cpu_scale=s)
        host = self.link()
        links = tuple(l for l in cluster.links if l.name != host.name) + (host,)
        nodes = tuple(replace(n, intra=None) for n in cluster.nodes)
        # links not emulated (emulate.links false): every message is this host's own transfer
        inter, cross = (cluster.inter, cluster.cross) if emulation.links else ((("*", host.name),), None)
        spec = ClusterSpec(nodes, tuple(types), links, tuple((t.name, host.name) for t in types), inter,
                           cross, (), cluster.name, emulation)
        return CostModel(spec, model, efficiency, overhead=self.overhead, step_overhead=self.step_overhead,
                         op_costs=self.op_costs)

    def to_dict(self) -> dict:
        return {"peak_flops": self.peak_flops, "bandwidth": self.bandwidth, "overhead": self.overhead,
                "step_overhead": self.step_overhead, "gamma": self.gamma, "link_latency": self.link_latency,
                "link_bandwidth": self.link_bandwidth,
                **({"op_costs": self.op_costs.to_dict()} if self.op_costs is not None else {})}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """Older files' per-kernel deltas are ignored (that time is now part of `overhead`); their
        missing step overhead and gamma take the values of an unfitted model, and without op
        costs level 2 prices every instruction at `overhead`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise HSPMDError(f"cannot read calibration file {path}: {type(e).__name__}: {e}") from None
        return cls.from_dict(data, f"calibration file {path}")

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "calibration") -> "Calibration":
        """A Calibration from to_dict()'s form (a file's, or one a benchmark saved beside its
        measurements), checked: errors name `where`."""
        try:
            cal = cls(float(d["peak_flops"]), float(d["bandwidth"]), float(d["overhead"]), float(d["link_latency"]),
                      float(d["link_bandwidth"]), float(d.get("step_overhead", 0.0)), float(d.get("gamma", 1.0)),
                      OpCosts.from_dict(d["op_costs"]) if "op_costs" in d else None)
        except HSPMDError as e:
            raise HSPMDError(f"{where}: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HSPMDError(f"cannot read {where}: {type(e).__name__}: {e}") from None
        rates = {"peak_flops": cal.peak_flops, "bandwidth": cal.bandwidth, "link_bandwidth": cal.link_bandwidth,
                 "gamma": cal.gamma}
        costs = {"overhead": cal.overhead, "step_overhead": cal.step_overhead, "link_latency": cal.link_latency}
        bad = [f"{k}={v}" for k, v in rates.items() if not math.isfinite(v) or v <= 0]
        bad += [f"{k}={v}" for k, v in costs.items() if not math.isfinite(v) or v < 0]
        if bad:
            raise HSPMDError(f"{where}: {', '.join(bad)} (rates must be positive, times non-negative)")
        return cal

    def _describe_op_costs(self) -> str:
        if self.op_costs is None:
            return ""
        costs = self.op_costs
        fixed = costs.fixed_of.values()
        parts = [f"{len(fixed)} kinds, fixed {min(fixed) * 1e6:.1f}-{max(fixed) * 1e6:.1f} us",
                 f"{costs.per_pass * 1e3:.2f} ms/pass", f"{costs.per_step * 1e3:.2f} ms/step"]
        if costs.after_sleep:
            parts.append("emulated work between sleeps " + ", ".join(f"{f:+.0%} over {w * 1e3:.1f} ms"
                                                                       for w, f in costs.after_sleep))
        if costs.jitter:
            over = f" over {costs.jitter_over * 1e3:.1f} ms of work (less beyond)" if costs.jitter_over else ""
            parts.append(f"step jitter {costs.jitter:.1%}{over}")
        return f" (per op: {', '.join(parts)})"

    def describe(self) -> str:
        return (f"cpu: matmul {self.peak_flops / 1e9:.2f} GFLOP/s, elementwise {self.bandwidth / 1e9:.2f} GB/s, "
                f"model kernels x{self.gamma:.2f}, executor "
                f"{self.overhead * 1e6:.1f} us/instruction + {self.step_overhead * 1e3:.2f} ms/step"
                f"{self._describe_op_costs()}; "
                f"gloo link alpha {self.link_latency * 1e6:.1f} us, "
                f"beta {self.link_bandwidth / 1e9:.3f} GB/s")


__all__ = ["Calibration"]
