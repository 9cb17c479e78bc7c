"""One cost model for every planner and the simulator: compute time per layer, update time,
memory per stage, and communication on the cluster's links.

Compute (HeteroSim Table 1, a roofline per kernel class): gemm/attn kernels take
gamma * FLOPs / peak + delta, elementwise/norm/misc kernels gamma * bytes / HBM bandwidth + delta,
with gamma (>= 1: achieved fraction of peak, inverted) and delta (launch overhead, s) per device type
and class. Backward runs the model's backward kernels (x `backward_ratio`, 1 unless fitted), plus
one forward with recompute. `OpCosts` (fitted from one device's op timings) prices each compute
instruction of the kinds it lists at the simulator's level 2: a fixed time per op kind (its
dispatch and the torch kernels it launches) plus the kind's gamma x its roofline. A ProfileTable
of measured (forward, backward) per layer overrides the roofline where it has an entry (HAPT and
H2 plan from profiles).

Communication is alpha-beta on the ClusterSpec's links: a message costs alpha + B/beta; a ring
collective over n members runs at its slowest edge: all-reduce 2(n-1) alpha + 2(n-1)/n B/beta,
reduce-scatter and all-gather half of that. Memory = weights + gradients + optimizer states
(ZeRO-1 divides the optimizer states by the data-parallel degree) + activations x the schedule's
micro-batches in flight.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Mapping, Sequence

from hspmd.cluster import ClusterSpec, DeviceType, LinkClass
from hspmd.cluster.emulation import WAIT_CHUNK_S
from hspmd.errors import ClusterError
from hspmd.planning.model import KERNEL_CLASSES, Kernel, ModelSpec

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Efficiency:
    """gamma and delta per kernel class, the backward/forward ratio, and how many times the
    framework's CPU work this device type takes (`cpu_scale`: the per-step overhead and OpCosts'
    fixed times; an emulated type s times slower than the host runs that work s times slower
    too), for one device type."""

    gamma: tuple[tuple[str, float], ...] = tuple((k, 1.0) for k in KERNEL_CLASSES)
    delta: tuple[tuple[str, float], ...] = tuple((k, 0.0) for k in KERNEL_CLASSES)
    backward_ratio: float = 1.0
    cpu_scale: float = 1.0

    def __post_init__(self):
        for name, table in (("gamma", self.gamma), ("delta", self.delta)):
            table = dict(table.items() if isinstance(table, Mapping) else table)
            unknown = set(table) - set(KERNEL_CLASSES)
            if unknown:
                raise ClusterError(f"Efficiency {name}: unknown kernel class(es) {sorted(unknown)}; use {', '.join(KERNEL_CLASSES)}")
            default = 1.0 if name == "gamma" else 0.0
            full = {k: float(table.get(k, default)) for k in KERNEL_CLASSES}
            if any(v < 0 for v in full.values()) or (name == "gamma" and any(v <= 0 for v in full.values())):
                raise ClusterError(f"Efficiency {name}: values must be positive (delta >= 0), got {full}")
            object.__setattr__(self, name, tuple(full.items()))
        if not self.backward_ratio > 0:
            raise ClusterError(f"Efficiency backward_ratio must be > 0, got {self.backward_ratio}")
        if not self.cpu_scale > 0:
            raise ClusterError(f"Efficiency cpu_scale must be > 0, got {self.cpu_scale}")

    def g(self, cls: str) -> float:
        return dict(self.gamma)[cls]

    def d(self, cls: str) -> float:
        return dict(self.delta)[cls]

    def to_dict(self) -> dict:
        return {"gamma": dict(self.gamma), "delta": dict(self.delta), "backward_ratio": self.backward_ratio,
                "cpu_scale": self.cpu_scale}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Efficiency":
        return cls(tuple(dict(data.get("gamma", {})).items()), tuple(dict(data.get("delta", {})).items()),
                   float(data.get("backward_ratio", 1.0)), float(data.get("cpu_scale", data.get("step_scale", 1.0))))


def _table(items, what: str) -> tuple[tuple[str, float], ...]:
    table = tuple(sorted((str(k), float(v)) for k, v in (items.items() if isinstance(items, Mapping) else items)))
    bad = [f"{k}={v}" for k, v in table if not (v >= 0 and math.isfinite(v))]
    if bad:
        raise ClusterError(f"OpCosts {what}: values must be finite and >= 0, got {', '.join(bad)}")
    return table


# (work, fraction) pairs in a file; earlier files' "wake_ups" and "wake_ups_after_sleep" priced
# each sleep at a fixed cost and are not read
SLOWER_AFTER_SLEEP_KEY = "slower_between_sleeps"
STEP_JITTER_KEY = "step_jitter"
STEP_JITTER_OVER_KEY = "step_jitter_over"


@dataclass(frozen=True)
class OpCosts:
    """Prices per op kind, fitted from one device's op timings (hspmd.runtime.policies.calibrate):
    a compute instruction of a kind in `fixed` costs that many seconds whatever its size (the
    framework's dispatch of it and the fixed cost of each torch kernel it launches: a view costs
    less than one generic instruction, an attention backward several) plus the kind's `gamma` x
    its kernel's roofline (ops of one class differ: an optimizer update does far more per byte
    than an add); `per_pass` is the work before each pass of a micro-batch (the schedule's and
    the trainer's) and `per_step` a step's work outside the timed ops and passes. On an emulated
    type s times slower the fixed, per-pass and per-step seconds are s times as long
    (`Efficiency.cpu_scale`) and the roofline is the type's own. `after_sleep`: (work seconds,
    fraction) pairs: that much of this host's CPU work between two sleeps of an emulated device
    takes that fraction more CPU time than the fixed and gamma prices say (they were timed on
    steps that sleep only in chunks; the device sleeps off its debt before every communication
    too, and a host core that idled runs the work after it slower, the most right after waking,
    and still slower tens of milliseconds later): an artefact of emulating on this host, priced
    where cpu_scale > 1 so that level 2 predicts the emulated run (`slower_after`). `jitter`: the
    relative standard deviation of a device's work from one step to the next that is its own (not
    shared with the devices it runs beside): devices that wait for each other wait for the
    slowest of their draws, so a step is expected to take longer than its average work says
    (level 2 prices that expectation: device_sim.simulate_device_run). `jitter_over`: the host
    seconds of work over which `jitter` was measured (the step probes'); a device's longer step
    varies less (`jitter_for`); 0: `jitter` whatever the work."""

    fixed: tuple[tuple[str, float], ...]
    gamma: tuple[tuple[str, float], ...]
    per_step: float = 0.0
    per_pass: float = 0.0
    after_sleep: tuple[tuple[float, float], ...] = ()
    jitter: float = 0.0
    jitter_over: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "fixed", _table(self.fixed, "fixed"))
        object.__setattr__(self, "gamma", _table(self.gamma, "gamma"))
        if [k for k, _ in self.fixed] != [k for k, _ in self.gamma]:
            raise ClusterError(f"OpCosts: fixed and gamma must list the same op kinds, got "
                               f"{[k for k, _ in self.fixed]} and {[k for k, _ in self.gamma]}")
        for name in ("per_step", "per_pass", "jitter", "jitter_over"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ClusterError(f"OpCosts {name} must be finite and >= 0, got {getattr(self, name)}")
        after_sleep = tuple(sorted((float(s), float(f)) for s, f in self.after_sleep))
        if any(not (0 < s < math.inf and 0 <= f < math.inf) for s, f in after_sleep):
            raise ClusterError(f"OpCosts after_sleep: works must be > 0 seconds and fractions >= 0, got {after_sleep}")
        if len({s for s, _ in after_sleep}) < len(after_sleep):
            raise ClusterError(f"OpCosts after_sleep: one fraction per work, got {after_sleep}")
        object.__setattr__(self, "after_sleep", after_sleep)

    @cached_property
    def fixed_of(self) -> dict[str, float]:
        return dict(self.fixed)

    @cached_property
    def gamma_of(self) -> dict[str, float]:
        return dict(self.gamma)

    def covers(self, kind: str) -> bool:
        return kind in self.fixed_of

    def slower_after(self, work: float) -> float:
        """How much slower (a fraction) `work` seconds of this host's CPU work between two sleeps
        run: the nearest measured work's fraction below the least and above the most, linear in
        log(work) between; 0 when none was measured."""
        points = self.after_sleep
        if not points:
            return 0.0
        if work <= points[0][0]:
            return points[0][1]
        for (w0, f0), (w1, f1) in zip(points, points[1:]):
            if work <= w1:
                return f0 + (f1 - f0) * math.log(work / w0) / math.log(w1 / w0)
        return points[-1][1]

    def jitter_for(self, work: float) -> float:
        """The relative standard deviation of a device's step of `work` host seconds: `jitter`
        over the probes' `jitter_over` seconds or less, and beyond them jitter x sqrt(jitter_over /
        work), as a sum of independent stretches varies (approximate: a step's stretches are not
        wholly independent, a slow step is slow in most of its ops; Simulator accuracy)."""
        if self.jitter_over <= 0 or work <= self.jitter_over:
            return self.jitter
        return self.jitter * math.sqrt(self.jitter_over / work)

    def to_dict(self) -> dict:
        return {"fixed": dict(self.fixed), "gamma": dict(self.gamma), "per_step": self.per_step, "per_pass": self.per_pass,
                SLOWER_AFTER_SLEEP_KEY: [list(pair) for pair in self.after_sleep], STEP_JITTER_KEY: self.jitter,
                STEP_JITTER_OVER_KEY: self.jitter_over}

    @classmethod
    def from_dict(cls, data: Mapping) -> "OpCosts":
        return cls(tuple(dict(data["fixed"]).items()), tuple(dict(data["gamma"]).items()), float(data.get("per_step", 0.0)),
                   float(data.get("per_pass", 0.0)), tuple((s, f) for s, f in data.get(SLOWER_AFTER_SLEEP_KEY, ())),
                   float(data.get(STEP_JITTER_KEY, 0.0)), float(data.get(STEP_JITTER_OVER_KEY, 0.0)))


@dataclass(frozen=True)
class ProfileTable:
    """Measured (forward, backward) seconds of one layer per (device type, tp, mbs, seq). A query
    with no exact entry interpolates linearly in tokens (mbs x seq) between the entries of the same
    (device type, tp), and scales the nearest one proportionally outside them."""

    entries: tuple[tuple[tuple[str, int, int, int], tuple[float, float]], ...]

    def __post_init__(self):
        entries = self.entries.items() if isinstance(self.entries, Mapping) else self.entries
        out = []
        for key, (f, b) in entries:
            t, tp, mbs, seq = key
            if not (f >= 0 and b >= 0):
                raise ClusterError(f"profile entry {key}: times must be >= 0, got ({f}, {b})")
            out.append(((str(t), int(tp), int(mbs), int(seq)), (float(f), float(b))))
        object.__setattr__(self, "entries", tuple(sorted(out)))

    def lookup(self, device_type: str, tp: int, mbs: int, seq: int) -> tuple[float, float] | None:
        table = dict(self.entries)
        if (device_type, tp, mbs, seq) in table:
            return table[(device_type, tp, mbs, seq)]
        points = sorted((m * s, v) for (t, p, m, s), v in self.entries if t == device_type and p == tp)
        if not points:
            return None
        tokens = mbs * seq
        xs = [x for x, _ in points]
        i = bisect.bisect_left(xs, tokens)
        if 0 < i < len(points):
            (x0, (f0, b0)), (x1, (f1, b1)) = points[i - 1], points[i]
            w = (tokens - x0) / (x1 - x0)
            return f0 + w * (f1 - f0), b0 + w * (b1 - b0)
        x, (f, b) = points[0] if i == 0 else points[-1]
        return f * tokens / x, b * tokens / x


@dataclass(frozen=True)
class StageShape:
    """What a pipeline stage holds on each of its devices, for memory and time estimates."""

    layers: int
    tp: int = 1
    first: bool = False
    last: bool = False
    dp: int = 1
    zero: bool = False
    recompute: bool | str = False  # True / "full": whole layers; "selective": the cheap ops only
    cp: int = 1
    cp_share: float | None = None  # the busiest CP group's part of the sequence (None: 1 / cp)
    cp_attention: str = "ring"

    recompute_layers: int | None = None  # how many of its layers recompute (None: all of them)

    @property
    def recomputed(self) -> int:
        """The number of the stage's layers that recompute."""
        return 0 if not self.recompute else self.layers if self.recompute_layers is None else self.recompute_layers

    @property
    def share(self) -> float:
        return 1.0 / self.cp if self.cp_share is None else self.cp_share


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by kind."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class CostModel:
    """Prices `model` on `cluster`. `efficiency` maps a device type name (or "*") to its Efficiency;
    `profile` overrides layer times where it has them; `overhead` is the framework's seconds per
    program instruction (Python dispatch: matters on CPU, 0 where launches are asynchronous);
    `step_overhead` its seconds per training step outside the programs (argument checks, feeding
    the micro-batches, reading the loss), paid once per step by every device; `cp_overlap` the
    part (0-1) of a ring step's K/V transfer hidden behind that step's attention (0: hspmd's
    executor runs a ring's CommOps and blocks in turn; 1: a kernel that overlaps them); `op_costs`
    (optional) the per-op-kind prices level 2 of the simulator takes for the kinds it lists."""

    cluster: ClusterSpec
    model: ModelSpec
    efficiency: tuple[tuple[str, Efficiency], ...] = (("*", Efficiency()),)
    profile: ProfileTable | None = None
    overhead: float = 0.0
    step_overhead: float = 0.0
    cp_overlap: float = 0.0
    op_costs: OpCosts | None = None
    _eff: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        eff = dict(self.efficiency.items() if isinstance(self.efficiency, Mapping) else self.efficiency)
        object.__setattr__(self, "efficiency", tuple(sorted(eff.items())))
        object.__setattr__(self, "_eff", eff)

    # ---- compute --------------------------------------------------------------------------------

    def device(self, device: "int | str | DeviceType") -> DeviceType:
        if isinstance(device, DeviceType):
            return device
        if isinstance(device, str):
            return self.cluster.type_named(device)
        return self.cluster.device_type(device)

    def efficiency_of(self, device: DeviceType) -> Efficiency:
        eff = self._eff.get(device.name, self._eff.get("*"))
        if eff is None:
            raise ClusterError(f"cost model has no efficiency for device type {device.name!r} and no '*' default")
        return eff

    def roofline(self, kernel: Kernel, device: DeviceType) -> float:
        """One launch of `kernel` at the device's peak: FLOPs for gemm and attn, bytes otherwise."""
        if kernel.cls in ("gemm", "attn"):
            return kernel.flops / device.peak_flops(self.model.dtype)
        return kernel.bytes / device.hbm_bandwidth

    def kernel_time(self, kernel: Kernel, device: "int | str | DeviceType") -> float:
        dev = self.device(device)
        eff = self.efficiency_of(dev)
        return kernel.count * (eff.g(kernel.cls) * self.roofline(kernel, dev) + eff.d(kernel.cls))

    def op_time(self, kind: str, kernel: Kernel, device: "int | str | DeviceType") -> float:
        """One compute instruction of op `kind` running `kernel`, dispatch included: its OpCosts
        price where `op_costs` lists the kind, else the kernel's time plus one `overhead`."""
        if self.op_costs is None or not self.op_costs.covers(kind):
            return self.kernel_time(kernel, device) + self.overhead
        dev = self.device(device)
        return (self.cpu_scale(dev) * self.op_costs.fixed_of[kind]
                + kernel.count * self.op_costs.gamma_of[kind] * self.roofline(kernel, dev))

    def kernels_time(self, kernels: Sequence[Kernel], device) -> float:
        """Kernels plus the framework overhead of one instruction per launch."""
        return sum(self.kernel_time(k, device) + self.overhead * k.count for k in kernels)

    def _fwd_bwd(self, kernels_of, device: DeviceType, recompute: bool | str) -> tuple[float, float]:
        """(forward, backward); recomputation adds the forward (True, "full") or its cheap kernels
        ("selective": everything but the matmuls and attention) to the backward."""
        kernels = kernels_of(False)
        forward = self.kernels_time(kernels, device)
        backward = self.efficiency_of(device).backward_ratio * self.kernels_time(kernels_of(True), device)
        if recompute == "selective":
            return forward, backward + self.kernels_time([k for k in kernels if k.cls not in ("gemm", "attn")], device)
        return forward, backward + (forward if recompute else 0.0)

    def layer_time(self, device, tp: int = 1, mbs: int = 1, seq: int | None = None, recompute: bool = False,
                   tp_group: Sequence[int] | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of one transformer layer for one micro-batch on one device of a
        TP group of `tp`; with `tp_group` (device ids) the layer's TP all-reduces are added
        (2 in forward, 2 in backward, Megatron layout)."""
        dev = self.device(device)
        seq = seq or self.model.seq_len
        measured = self.profile.lookup(dev.name, tp, mbs, seq) if self.profile else None
        if measured is not None:  # no kernels: selective is priced as a whole forward again (an upper bound)
            f, b = measured
            b = b + (f if recompute else 0.0)
        else:
            f, b = self._fwd_bwd(lambda bwd: self.model.layer_kernels(mbs, seq, tp, bwd), dev, recompute)
        if tp_group is not None and len(tp_group) > 1:
            ar = self.collective("all_reduce", mbs * seq * self.model.hidden * self.model.itemsize, tp_group)
            f, b = f + 2 * ar, b + 2 * ar
        return f, b

    def head_time(self, device, tp: int = 1, mbs: int = 1, seq: int | None = None) -> tuple[float, float]:
        """(forward, backward) of the final norm, LM head and loss."""
        seq = seq or self.model.seq_len
        return self._fwd_bwd(lambda bwd: self.model.head_kernels(mbs, seq, tp, bwd), self.device(device), False)

    def embedding_time(self, device, tp: int = 1, mbs: int = 1, seq: int | None = None) -> tuple[float, float]:
        seq = seq or self.model.seq_len
        return self._fwd_bwd(lambda bwd: self.model.embedding_kernels(mbs, seq, tp, bwd), self.device(device), False)

    def context_time(self, device, stage: StageShape, mbs: int, seq: int,
                     cp_groups: Sequence[Sequence[int]]) -> tuple[float, float]:
        """(forward, backward) seconds one layer's attention spends crossing the stage's CP groups
        (`cp_groups`: the TP groups in CP order), per micro-batch, as hspmd.ops.context moves it:
        ring: cp - 1 K/V blocks passed to the next group forward, and in the backward the K/V
        again and as many dK/dV blocks back, each step at the ring's slowest edge, less
        `cp_overlap` of that step's attention; all_gather:
        K/V gathered forward, their gradients reduce-scattered back; all_to_all: q, k, v and the
        output moved between sequence and heads, forward and backward (an all-to-all of a
        device's piece priced as a ring all-gather of it: (cp - 1) / cp of it crosses each link).
        TP position 0 of each group stands for its column."""
        cp = len(cp_groups)
        if cp < 2:
            return 0.0, 0.0
        m, e = self.model, self.model.itemsize
        ring = [g[0] for g in cp_groups]
        local = mbs * seq * stage.share
        kv_block = 2 * local * m.kv_dim / stage.tp * e
        if stage.cp_attention == "ring":
            step = max(self.p2p(kv_block, (a, ring[(i + 1) % cp])) for i, a in enumerate(ring))
            per_block = mbs * (m.heads / stage.tp) * local * (seq / cp) * m.head_dim * 4.0
            attn = self.kernel_time(Kernel("attn", per_block, kv_block), device)
            exposed = max(0.0, step - self.cp_overlap * attn)
            return (cp - 1) * exposed, 2 * (cp - 1) * exposed
        if stage.cp_attention == "all_gather":
            whole = 2 * mbs * seq * m.kv_dim / stage.tp * e
            return self.collective("all_gather", whole, ring), self.collective("reduce_scatter", whole, ring)
        moved = local * (2 * m.q_dim + 2 * m.kv_dim) / stage.tp * e
        a2a = ring_time("all_gather", moved, [self.cluster.link(a, ring[(i + 1) % cp]) for i, a in enumerate(ring)])
        return a2a, a2a

    def stage_time(self, device, stage: StageShape, mbs: int = 1, seq: int | None = None,
                   tp_group: Sequence[int] | None = None, cp_groups: Sequence[Sequence[int]] = ()) -> tuple[float, float]:
        """(forward, backward) of a whole stage for one micro-batch; `tp_group` adds the TP
        collectives, `cp_groups` (the stage's TP groups in CP order) the context-parallel traffic.
        Under CP a device computes its share of the tokens (the busiest group's, for uneven
        shares)."""
        seq = seq or self.model.seq_len
        f, b = self._layer_of_stage(device, stage, mbs, seq, tp_group, False)
        again = stage.recomputed  # layers whose backward recomputes (all, some or none of them)
        if again:
            b = ((stage.layers - again) * b + again * self._layer_of_stage(device, stage, mbs, seq, tp_group,
                                                                           stage.recompute)[1]) / stage.layers
        cf, cb = self.context_time(device, stage, mbs, seq, cp_groups)
        f, b = stage.layers * (f + cf), stage.layers * (b + cb)
        tokens = seq * stage.share
        if stage.first:
            ef, eb = self.embedding_time(device, stage.tp, mbs, tokens)
            f, b = f + ef, b + eb
        if stage.last:
            hf, hb = self.head_time(device, stage.tp, mbs, tokens)
            f, b = f + hf, b + hb
        return f, b

    def _layer_of_stage(self, device, stage: StageShape, mbs: int, seq: int, tp_group, recompute) -> tuple[float, float]:
        """(forward, backward) of one of the stage's layers (its CP share of the tokens)."""
        if stage.cp > 1 and self.profile is None:
            f, b = self._fwd_bwd(lambda bwd: self.model.layer_kernels(mbs, seq, stage.tp, bwd, stage.share),
                                 self.device(device), recompute)
            if tp_group is not None and stage.tp > 1:
                ar = self.collective("all_reduce", mbs * seq * stage.share * self.model.hidden * self.model.itemsize,
                                     tuple(tp_group)[:stage.tp])
                f, b = f + 2 * ar, b + 2 * ar
            return f, b
        return self.layer_time(device, stage.tp, mbs, seq, recompute, tp_group)

    def stage_parameters(self, stage: StageShape) -> float:
        """Parameters on one device of the stage (matrices split over TP, norms and row-parallel
        biases replicated)."""
        m = self.model
        whole = m.replicated_layer_parameters()
        per_layer = (m.layer_parameters() - whole) / stage.tp + whole
        params = stage.layers * per_layer
        if stage.first:
            params += m.embedding_parameters() / stage.tp
        if stage.last:
            tied_copy = m.embedding_parameters() if m.tied and not stage.first else 0
            params += (m.head_parameters() + tied_copy) / stage.tp
        return params

    def update_time(self, device, parameters: float, tensors: int = 1) -> float:
        """AdamW over `parameters` fp32 values on one device: memory-bound, reads parameter, gradient
        and two moments and writes three of them (7 x 4 bytes per parameter), `tensors` launches."""
        dev = self.device(device)
        return self.kernel_time(Kernel("elementwise", 0.0, 28.0 * parameters / max(1, tensors), max(1, tensors)), dev)

    # ---- memory ---------------------------------------------------------------------------------

    def memory(self, stage: StageShape, inflight: int, mbs: int = 1, seq: int | None = None) -> Memory:
        """Per-device bytes of a stage with `inflight` micro-batches' activations alive (the
        schedule's peak_in_flight). Gradients in the model dtype; Adam moments in fp32, plus an
        fp32 master copy when the model dtype is narrower; ZeRO-1 splits the optimizer over dp."""
        m = self.model
        params = self.stage_parameters(stage)
        e = m.itemsize
        optimizer = params * (8 + (4 if e < 4 else 0))
        if stage.zero and stage.dp > 1:
            optimizer /= stage.dp
        seq = seq or m.seq_len
        again = stage.recomputed  # layers that keep only what their recomputation needs
        act = sum(count * m.layer_activation_bytes(mbs, seq, stage.tp, recompute, stage.cp, stage.share, stage.cp_attention)
                  for count, recompute in ((stage.layers - again, False), (again, stage.recompute)) if count)
        if stage.last:
            act += mbs * seq * stage.share * (m.hidden + 2 * m.vocab / stage.tp) * e
        return Memory(params * e, params * e, optimizer, act * max(0, inflight))

    # ---- communication --------------------------------------------------------------------------

    def p2p(self, nbytes: float, link: "LinkClass | tuple[int, int]") -> float:
        """One message of `nbytes` on a link (or between two devices of the cluster)."""
        if not isinstance(link, LinkClass):
            a, b = link
            return self.cluster.seconds(a, b, nbytes)
        return link.seconds(nbytes)

    def step_fixed(self, devices: Sequence[int], device: "int | None" = None) -> float:
        """What a training step costs `device` (None: a device of unit cpu_scale) once, outside its
        programs: the framework's per-step work and the all-reduce of the step loss over the
        strategy's devices."""
        return self.step_work(device) + self.step_loss(devices)

    def cpu_scale(self, device: "int | str | DeviceType") -> float:
        """How many times the framework's CPU work this device takes (its Efficiency's cpu_scale)."""
        return self.efficiency_of(self.device(device)).cpu_scale

    def pass_work(self, device: "int | str | DeviceType") -> float:
        """The framework's work before each pass (level 2, with op costs): per_pass x cpu_scale."""
        return self.op_costs.per_pass * self.cpu_scale(device) if self.op_costs is not None else 0.0

    def sleep_after(self, device: "int | str | DeviceType", compute: float) -> float:
        """Wall seconds an emulated device owes after `compute` of its own seconds of work: that
        work less the host's CPU time it took (compute / cpu_scale); 0 on a type that does not sleep."""
        scale = self.cpu_scale(device)
        return compute * (1.0 - 1.0 / scale) if scale > 1 else 0.0

    def woken_work(self, device: "int | str | DeviceType", compute: float, opening: float = 0.0,
                   idle: float | None = None) -> float:
        """What the sleeps of an emulated device add to a stretch of `compute` device seconds that
        ends in one, in the device's seconds: the stretch's work x how much slower that much host
        work between two sleeps runs (OpCosts.slower_after). A stretch whose debt (sleep_after)
        passes WAIT_CHUNK_S is slept in chunks, so its work comes in pieces of a chunk's worth.
        `opening`: the device seconds of the framework's own work that come first in the stretch
        (a pass's start, OpCosts.per_pass): the work after a sleep runs slower the sooner it
        follows the sleep, and the ops after that opening run on at the curve from there (the
        stretch adds E(h + w) - E(h), E(x) = x slower_after(x), h the opening's host seconds),
        while the opening runs at its price: measured so per kind of stretch
        (benchmarks/bench_stretches.py; Simulator accuracy in docs/design.md). `idle`: the wall
        seconds the device was idle just before the stretch (the sleep of the work before it and
        the communications since; None: as long as its own debt, as the probe sleeps): the
        wake-up costs what the curve gives for the work whose sleep is that long, and no more than
        for the stretch's own work (a stretch after a shorter idle than its own debt, such as
        1F1B's forward and backward after the short stretch that receives them, runs nearer its
        ops' prices; measured so). 0 on a type that does not sleep."""
        scale = self.cpu_scale(device)
        if self.op_costs is None or scale <= 1 or compute <= 0:
            return 0.0
        slower = self.op_costs.slower_after
        between = compute * min(1.0, WAIT_CHUNK_S / self.sleep_after(device, compute))  # a chunk's worth at most
        if between < compute:
            return compute * slower(between / scale)
        woken = compute if idle is None else min(compute, idle * scale / (scale - 1.0))  # the work whose debt is `idle`
        head, whole = min(opening, woken) / scale, woken / scale
        return scale * max(0.0, whole * slower(whole) - head * slower(head))

    def step_work(self, device: "int | None" = None, op_priced: bool = False) -> float:
        """The framework's per-step work on `device` (its type's cpu_scale x step_overhead);
        `op_priced`: for a program whose ops op_costs prices (level 2), its per-step work instead."""
        scale = 1.0 if device is None else self.cpu_scale(device)
        if op_priced and self.op_costs is not None:
            return self.op_costs.per_step * scale
        return self.step_overhead * scale

    def step_loss(self, devices: Sequence[int]) -> float:
        """The all-reduce of the step loss over the strategy's devices."""
        return self.collective("all_reduce", 8.0, tuple(devices)) if len(devices) > 1 else 0.0

    def collective(self, kind: str, nbytes: float, group: Sequence[int]) -> float:
        """A ring collective of `nbytes` (the whole tensor) over devices `group` in ring order,
        timed at its slowest edge."""
        if kind not in COLLECTIVES:
            raise ClusterError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVES)}")
        return ring_time(kind, nbytes, [self.cluster.link(a, group[(i + 1) % len(group)]) for i, a in enumerate(group)]
                         if len(group) > 1 else [], nbytes_for_bucket=nbytes / max(1, len(group)))

    def describe(self) -> str:
        return f"cost model: {self.model.describe()} on {self.cluster.describe()}"


def ring_time(kind: str, nbytes: float, edges: Sequence[LinkClass], nbytes_for_bucket: float | None = None) -> float:
    """Ring collective over n = len(edges) members: steps x worst alpha + per-member share / worst beta."""
    n = len(edges)
    if n < 2 or nbytes <= 0:
        return 0.0
    chunk = nbytes_for_bucket if nbytes_for_bucket is not None else nbytes / n
    ab = [e.alpha_beta(chunk) for e in edges]
    alpha, beta = max(a for a, _ in ab), min(b for _, b in ab)
    rounds = 2 if kind == "all_reduce" else 1
    return rounds * ((n - 1) * alpha + (n - 1) / n * nbytes / beta)


def efficiency_file(path: str | Path, efficiency: Mapping[str, Efficiency], links: Mapping[str, LinkClass] = ()) -> None:
    """Write fitted efficiencies (and links) as JSON (what `hspmd calibrate` produces)."""
    data = {"efficiency": {k: v.to_dict() for k, v in efficiency.items()},
            "links": {k: v.to_dict() for k, v in dict(links).items()}}
    Path(path).write_text(json.dumps(data, indent=2))


def read_efficiency_file(path: str | Path) -> tuple[dict[str, Efficiency], dict[str, LinkClass]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read calibration file {path}: {e}") from None
    eff = {k: Efficiency.from_dict(v) for k, v in data.get("efficiency", {}).items()}
    links = {k: LinkClass(k, float(v["bandwidth"]), float(v["latency"])) for k, v in data.get("links", {}).items()}
    return eff, links


__all__ = [
    "COLLECTIVES", "CostModel", "Efficiency", "Memory", "OpCosts", "ProfileTable", "StageShape",
    "efficiency_file", "read_efficiency_file", "ring_time",
]
