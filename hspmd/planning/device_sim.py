"""Simulator level 2: specialize()'s per-device programs, op by op, with their resolved plans
(HeteroSim's segment graph; in hspmd the specialized per-device graph already is that IR).

Every compute instruction becomes a kernel from the local shapes of its tensors on that device:
matmul -> gemm (2 x output x inner FLOPs), causal attention -> attn (4 b h s^2 d forward, twice that
backward), RMS normalisation -> norm, views (reshape, transpose, expand) -> misc (launch overhead
only), every other op -> elementwise (bytes read + written). A CommOp costs this device's busy time
in its plan on the cluster's links (comm_resolve.cost's ring model): collectives and local
assembled_on inside the phase, stage-to-stage transfers as the link between stages. Per micro-batch
forward and backward times per device, the update phase (gradient sync + optimizer), and the
transfer times then run through the level-1 event simulation on the discovered pipelines; a
stage's time is its slowest device's (TP devices meet in collectives). Peak memory per device is
what hspmd's interpreter holds running the program (planning/device_memory.py).

On an emulated device type that sleeps (cpu_scale > 1), each phase also pays for its sleeps: the
debt of each stretch of work is slept in chunks and before the communication ending the stretch,
and the host runs the work between two sleeps slower, by how much the calibration measured for
that much work (CostModel.woken_work), from the end of a pass's own work where that opens the
stretch, and as the work whose debt the idle before it is where that idle is shorter than its
own debt (the sleep of the stretch before it, the communications since and the wait for a
slower stage: _idle_before, peer_lags); a pass's work after its last communication runs on into
the next pass the schedule runs (cycle_stretches).

Where the op costs have a jitter (a device's work varies from step to step on its own), the
step is the mean over draws of each device's work slowed by its own factor (simulate_device_run):
devices that wait for each other wait for the slowest draw.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from hspmd.comm_resolve.bucketing import DEFAULT_BUCKET_CAP_MB, MiB, fill_buckets
from hspmd.comm_resolve.cost import DTYPE_SIZES, dtype_name
from hspmd.errors import HSPMDError
from hspmd.ir.shapes import Binding
from hspmd.planning.cost import CostModel
from hspmd.planning.device_memory import DeviceMemory, device_memory
from hspmd.planning.model import Kernel
from hspmd.planning.simulator import SimLink, SimPipeline, SimResult, SimStage, simulate_pipelines
from hspmd.specialize.executable import ExecutableGraph, Instruction
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.planning.model import ModelSpec
from hspmd.specialize.specialized import Specialized, specialize_graph
from hspmd.specialize.strategy import Strategy

BUCKET_BYTES = DEFAULT_BUCKET_CAP_MB * MiB  # the trainer's default gradient bucket cap
DISPATCHED = ("compute", "collective", "send", "recv", "send+recv", "local")  # roles that cost the framework a dispatch
COMMUNICATING = ("collective", "send", "recv", "send+recv")  # roles that call a peer (an emulated device sleeps first)
VIEWS = ("reshape", "transpose", "expand_as", "expand", "view", "squeeze", "unsqueeze", "fill_like", "zeros_like")


def _shape(exe: ExecutableGraph, tensor, binding: Binding) -> tuple[int, ...] | None:
    box = exe.box(tensor, binding)
    return None if box is None else tuple(hi - lo for lo, hi in box)


def _bytes(exe: ExecutableGraph, tensors, binding: Binding) -> float:
    total = 0.0
    for t in tensors:
        shape = _shape(exe, t, binding)
        if shape is not None:
            total += math.prod(shape) * DTYPE_SIZES[dtype_name(t.dtype)]
    return total


def op_kernel(exe: ExecutableGraph, ins: Instruction, binding: Binding) -> Kernel | None:
    """The kernel one compute instruction runs on this device (None for leaves and comms)."""
    node = ins.node
    if ins.role != "compute":
        return None
    kind = node.kind
    moved = _bytes(exe, node.inputs, binding) + _bytes(exe, node.outputs, binding)
    if kind == "matmul":
        out, a = _shape(exe, node.output, binding), _shape(exe, node.inputs[0], binding)
        return Kernel("gemm", 2.0 * math.prod(out) * a[-1], moved)
    if kind == "token_contraction":  # x[..., K]^T g[..., N]: every token's K x N products
        x, g = _shape(exe, node.inputs[0], binding), _shape(exe, node.inputs[1], binding)
        return Kernel("gemm", 2.0 * math.prod(x) * g[-1], moved)
    if kind.startswith("causal_attention"):
        q = _shape(exe, node.inputs[0], binding)  # (b, heads, s, d)
        b, h, s, d = q
        return Kernel("attn", (8.0 if kind.endswith("_grad") else 4.0) * b * h * s * s * d, moved)
    if kind.startswith("attention_block"):  # the device's queries over the keys it holds at this ring step
        (b, h, sq, d), sk = _shape(exe, node.inputs[0], binding), _shape(exe, node.inputs[1], binding)[2]
        return Kernel("attn", (8.0 if kind.endswith("_grad") else 4.0) * b * h * sq * sk * d, moved)
    if kind.startswith("rms_normalize"):
        return Kernel("norm", 0.0, moved)
    if kind in VIEWS:
        return Kernel("misc", 0.0, 0.0)
    if kind == "embedding":  # reads only the looked-up rows
        return Kernel("misc", 0.0, 2 * _bytes(exe, node.outputs, binding) + _bytes(exe, node.inputs[:1], binding))
    if kind.startswith("embedding"):
        return Kernel("misc", 0.0, moved)
    return Kernel("elementwise", 0.0, moved)


@dataclass(frozen=True)
class DeviceCost:
    """One device's seconds per micro-batch (forward, backward; of which communication), its
    update phase, and its outgoing stage-to-stage transfer seconds per direction. `update_tail`:
    the update's work after its last communication (an emulated device sleeps it off before the
    step loss's all-reduce), of which `update_tail_opening` is the update pass's own work coming
    first (an update with no communication of its own; CostModel.woken_work's opening)."""

    forward: float
    backward: float
    forward_comm: float
    backward_comm: float
    update: float
    update_comm: float
    send_forward: float
    send_backward: float
    kernels: int
    update_tail: float = 0.0
    update_tail_opening: float = 0.0

    def slowed(self, factor: float) -> "DeviceCost":
        """These costs with the device's work (not its communication) `factor` times as long."""
        if factor == 1.0:
            return self
        return replace(self, forward=self.forward_comm + factor * (self.forward - self.forward_comm),
                       backward=self.backward_comm + factor * (self.backward - self.backward_comm),
                       update=self.update_comm + factor * (self.update - self.update_comm), update_tail=factor * self.update_tail,
                       update_tail_opening=factor * self.update_tail_opening)


def cycle_stretches(passes: Sequence[Sequence[float]]) -> list[list[tuple[int, int, float]]]:
    """The stretches of work between sleeps of passes that repeat in this order: each pass is its
    segments of work between its communications (a pass with k communications has k + 1), and
    a pass's last segment runs on unslept into the next pass's first (the last into the first:
    the cycle repeats). Each stretch is its (pass index, segment index, work) pieces; with no
    communication at all the whole cycle is one stretch."""
    pieces = [(p, j, work) for p, segments in enumerate(passes) for j, work in enumerate(segments)]
    cuts = [i for i, (p, j, _) in enumerate(pieces) if j < len(passes[p]) - 1]
    if not cuts:
        return [pieces]
    start = cuts[-1] + 1
    rotated = pieces[start:] + pieces[:start]
    stretches: list[list[tuple[int, int, float]]] = [[]]
    for p, j, work in rotated:
        stretches[-1].append((p, j, work))
        if j < len(passes[p]) - 1:
            stretches.append([])
    return [stretch for stretch in stretches if stretch]


WAITING = ("recv", "send+recv", "collective")  # communications that wait for a peer (a send leaves at once)


@dataclass(frozen=True)
class PassSegments:
    """One pass of a device's program as an emulated device runs it: its work between
    communications (`work`, device seconds; a pass with k communications has k + 1 segments, the
    pass's own work at the head of the first) and the wall seconds it is idle in each of those k
    communications (`idle`: its own time in it, and its share of the wait for later peers)."""

    work: tuple[float, ...]
    idle: tuple[float, ...]


def _idle_before(cost: CostModel, device: int, stretches: Sequence[Sequence[tuple[int, int, float]]], i: int,
                 passes: Sequence[PassSegments]) -> float | None:
    """The wall seconds `device` is idle before stretch `i` of a cycle (cycle_stretches of
    `passes`): the sleep of the last stretch before it that has work and the communications
    since. None for a cycle of one stretch, which sleeps its own debt."""
    if len(stretches) < 2:
        return None
    idle = 0.0
    for back in range(1, len(stretches) + 1):
        before = stretches[i - back]
        p, j, _ = before[-1]
        idle += passes[p].idle[j] if j < len(passes[p].idle) else 0.0
        work = sum(w for _, _, w in before)
        if work > 0:
            return cost.sleep_after(device, work) + idle
    return idle


def _woken_passes(cost: CostModel, device: int, forward: PassSegments, backward: PassSegments,
                  alternating: bool) -> tuple[float, float]:
    """What an emulated device's sleeps add to a micro-batch's forward and backward: every
    stretch between sleeps runs its fraction slower (CostModel.woken_work), shared by the passes
    in proportion to their work in it; a stretch whose first work is a pass's own opens with it
    (`opening`), and one after an idle shorter than its own debt wakes as that idle's work does
    (`idle`, _idle_before). `alternating`: a micro-batch's forward and backward take turns
    (1F1B), so each pass's tail runs on into the other's head; otherwise (GPipe) a pass runs on
    into the next of its kind."""
    added = [0.0, 0.0]
    cycles = [((forward, backward), (0, 1))] if alternating else [((forward,), (0,)), ((backward,), (1,))]
    for passes, which in cycles:
        stretches = cycle_stretches([p.work for p in passes])
        for i, stretch in enumerate(stretches):
            work = sum(w for _, _, w in stretch)
            if work > 0:
                _, first, _ = next(piece for piece in stretch if piece[2] > 0)
                woken = cost.woken_work(device, work, opening=cost.pass_work(device) if first == 0 else 0.0,
                                        idle=_idle_before(cost, device, stretches, i, passes))
                for p, _, w in stretch:
                    added[which[p]] += woken * w / work
    return added[0], added[1]


@dataclass(frozen=True)
class ProgramWalk:
    """One device's program walked once, before what an emulated device's sleeps add: per phase
    (forward, backward, update) its (seconds with communication, communication, outgoing sends),
    its work between communications, each cutting communication's seconds and whether it
    waits for a peer (WAITING); and its kernels."""

    device: int
    totals: Mapping[str, tuple[float, float, float]]
    segments: Mapping[str, tuple[float, ...]]
    comm: Mapping[str, tuple[float, ...]]
    waiting: Mapping[str, tuple[bool, ...]]
    kernels: int


def walk_program(exe: ExecutableGraph, cost: CostModel, binding: Binding, comm: bool = True,
                 bucket_bytes: float | None = BUCKET_BYTES) -> ProgramWalk:
    """Price one device's program op by op and its communications from their resolved plans
    (device_cost's arguments), cutting each phase at the communications an emulated device
    sleeps before; walked once, priced with its sleeps by walk_cost (device_costs prices a walk
    twice where a device waits for its peers)."""
    cluster = cost.cluster
    d = exe.device
    totals, segments, comms, waiting = {}, {}, {}, {}
    kernels = 0
    for phase in ("forward", "backward", "update"):
        compute = comm_time = send = 0.0
        program = getattr(exe, phase)
        compute += cost.overhead * sum(1 for ins in program if ins.role in DISPATCHED and ins.role != "compute")
        compute += cost.pass_work(d)
        # an emulated device sleeps off its debt before each communication: the phase's work
        # between its communications, in order (what the sleeps add is priced by walk_cost)
        stretch, between, cuts, waits = compute, [], [], []
        bucketed: dict[tuple[int, ...], list[float]] = {}
        for ins in program:
            kernel = op_kernel(exe, ins, binding)
            if kernel is not None:
                seconds = cost.op_time(ins.node.kind, kernel, d)
                compute += seconds
                stretch += seconds
                kernels += 1
                continue
            if not comm or not ins.node.opdef.is_comm or ins.role in ("identity", "leaf"):
                continue
            plan = exe.plan(ins.node, binding)
            itemsize = plan.itemsize
            if phase == "update" and bucket_bytes is not None and plan.why_not_all_reduces() is None:
                for c in plan.steps[0].collectives:
                    if d in c.devices:
                        bucketed.setdefault(c.devices, []).append(math.prod(b - a for a, b in c.box) * itemsize)
                continue
            spent = comm_time + send
            for step in plan.steps:
                if ins.is_p2p:
                    own = sum(cluster.seconds(t.src, t.dst, t.elements * itemsize) for t in step.transfers
                              if t.src == d and t.src != t.dst)
                    send += own
                else:
                    comm_time += step.traffic(cluster, itemsize).busy.get(d, 0.0)
            if ins.role in COMMUNICATING:
                between.append(stretch)
                cuts.append(comm_time + send - spent)
                waits.append(ins.role in WAITING)
                stretch = 0.0
        for group, sizes in bucketed.items():  # the update lists them in the order the backward makes them
            buckets = fill_buckets(sizes, bucket_bytes)
            comm_time += sum(cost.collective("all_reduce", sum(sizes[i] for i in bucket), group) for bucket in buckets)
        segments[phase], comms[phase], waiting[phase] = tuple(between + [stretch]), tuple(cuts), tuple(waits)
        totals[phase] = (compute + comm_time, comm_time, send)
    return ProgramWalk(d, totals, segments, comms, waiting, kernels)


def device_cost(exe: ExecutableGraph, cost: CostModel, binding: Binding, comm: bool = True,
                bucket_bytes: float | None = BUCKET_BYTES, alternating: bool = True, lag: float = 0.0) -> DeviceCost:
    """Price one device's program (module docstring); comm=False zeroes every communication.
    bucket_bytes: gradient syncs that are one all-reduce of the device's own piece are priced as
    the trainer runs them, joined per group into all-reduces of at most this many bytes (one
    latency per bucket rather than per gradient); None prices each on its own. `alternating`
    and `lag`: walk_cost's."""
    return walk_cost(walk_program(exe, cost, binding, comm, bucket_bytes), cost, alternating, lag)


def walk_cost(walk: ProgramWalk, cost: CostModel, alternating: bool = True, lag: float = 0.0) -> DeviceCost:
    """A walked program's DeviceCost with what an emulated device's sleeps add. `alternating`:
    the schedule runs a micro-batch's forward and backward in turns (1F1B; GPipe does not),
    which decides which work an emulated device runs between two sleeps. `lag`: the wall seconds
    a micro-batch's passes wait for later peers (peer_lags), shared by their communications that
    wait (WAITING): it lengthens the idle before the work after them, not the step."""
    d, segments = walk.device, walk.segments
    share = lag / max(1, sum(walk.waiting["forward"]) + sum(walk.waiting["backward"]))
    forward, backward = (PassSegments(segments[p], tuple(t + share * w for t, w in zip(walk.comm[p], walk.waiting[p])))
                         for p in ("forward", "backward"))
    woken_f, woken_b = _woken_passes(cost, d, forward, backward, alternating)
    # the update's stretches before its communications; its tail is slept before the step loss (plan_device_run)
    woken_u = sum(cost.woken_work(d, work, opening=cost.pass_work(d) if i == 0 else 0.0)
                  for i, work in enumerate(segments["update"][:-1]))
    (f, fc, fs), (b, bc, bs), (u, uc, _) = walk.totals["forward"], walk.totals["backward"], walk.totals["update"]
    opening = cost.pass_work(d) if len(segments["update"]) == 1 else 0.0
    return DeviceCost(f + woken_f, b + woken_b, fc, bc, u + woken_u, uc, fs, bs, walk.kernels, segments["update"][-1], opening)


def peer_lags(spec: Specialized, costs: Mapping[int, DeviceCost]) -> dict[int, float]:
    """Per device, the wall seconds a micro-batch's passes wait for its peers in the pipeline's
    steady state: the slowest stage's forward and backward less its own (a stage runs at its
    slowest device's pace, and a pipeline at its slowest stage's). Approximate: the warm-up and
    cool-down, and when in the step the waits fall, are level 1's (simulate_pipelines)."""
    lags = {}
    for layout in spec.pipelines:
        pace = max(costs[d].forward + costs[d].backward for devices in layout.stages for d in devices)
        for devices in layout.stages:
            for d in devices:
                lags[d] = pace - (costs[d].forward + costs[d].backward)
    return lags


def device_costs(spec: Specialized, cost: CostModel, schedule: str = "1f1b", comm: bool = True) -> dict[int, DeviceCost]:
    """Every device's DeviceCost under `schedule`: priced once, and again on an emulated type
    that sleeps with what it waits for its peers (peer_lags) in the idle before its work."""
    alternating = schedule != "gpipe"
    walks = {d: walk_program(exe, cost, spec.binding, comm) for d, exe in spec.executables.items()}
    costs = {d: walk_cost(walk, cost, alternating) for d, walk in walks.items()}
    if not comm:
        return costs
    lags = peer_lags(spec, costs)
    return {d: walk_cost(walk, cost, alternating, lags.get(d, 0.0))
            if lags.get(d, 0.0) > 0 and cost.cpu_scale(d) > 1 and cost.op_costs is not None else costs[d]
            for d, walk in walks.items()}


def device_memories(spec: Specialized) -> dict[int, DeviceMemory]:
    """Every device's memory model (planning/device_memory.py)."""
    return {d: device_memory(exe, spec.binding) for d, exe in spec.executables.items()}


def step_tail_work(cost: CostModel, device: int, costs: DeviceCost, factor: float = 1.0) -> float:
    """A device's per-step work (its type's, `factor` times as long) with what the sleep before
    the step loss's all-reduce adds to it: that all-reduce is one more communication, so an
    emulated device sleeps off the update's tail and the step's own work before it, one stretch
    (CostModel.woken_work, opening with the update pass's own work where the update has no
    communication of its own)."""
    own = factor * cost.step_work(device, op_priced=True)
    return own + cost.woken_work(device, costs.update_tail + own, costs.update_tail_opening)


def stage_pipelines(spec: Specialized, cost: CostModel, costs: Mapping[int, DeviceCost], memory: Mapping[int, DeviceMemory],
                    micro_batches: Mapping[int, int] | int, schedule: str = "1f1b", comm: bool = True,
                    slowed: Mapping[int, float] | None = None) -> tuple[tuple[SimPipeline, ...], tuple]:
    """The devices' costs aggregated into the discovered pipelines' stages (a stage's time is its
    slowest device's), and the update's sync groups. `slowed`: per device, a factor on its work
    (not its communication) this step. `micro_batches`: per discovered pipeline index (or one count for all)."""
    slowed = slowed or {}
    costs = {d: c.slowed(slowed.get(d, 1.0)) for d, c in costs.items()}
    loss = cost.step_loss(tuple(sorted(costs)) if comm else ())
    pipelines = []
    for p, layout in enumerate(spec.pipelines):
        m = micro_batches if isinstance(micro_batches, int) else micro_batches[p]
        stages, links = [], []
        for s, devices in enumerate(layout.stages):
            cs = [costs[d] for d in devices]
            update = max(c.update for c in cs)
            update_comm = max(c.update_comm for c in cs)
            held = [memory[d] for d in devices]  # the interpreter's bytes: static + in flight x kept + a pass's values
            step_work = max(step_tail_work(cost, d, costs[d], slowed.get(d, 1.0)) for d in devices)
            stages.append(SimStage(tuple(devices), max(c.forward for c in cs), max(c.backward for c in cs),
                                   max(c.forward_comm for c in cs), max(c.backward_comm for c in cs),
                                   sync=update_comm, update=update - update_comm + loss + step_work,
                                   static_memory=max(h.static + h.transient(m) for h in held),
                                   activation_memory=max(h.kept for h in held)))
            if s + 1 < len(layout.stages):
                nxt = [costs[d] for d in layout.stages[s + 1]]
                links.append(SimLink(max(c.send_forward for c in cs), max(c.send_backward for c in nxt)))
        pipelines.append(SimPipeline(tuple(stages), tuple(links), m, schedule))
    # the update phase's collectives span pipelines: one group of every stage's first device
    keys = tuple((p, s) for p, layout in enumerate(spec.pipelines) for s in range(len(layout.stages)))
    groups = (keys,) if len(spec.pipelines) > 1 else ()
    return tuple(pipelines), groups


def plan_device_run(spec: Specialized, cost: CostModel, micro_batches: Mapping[int, int] | int,
                    schedule: str = "1f1b", comm: bool = True) -> tuple[tuple[SimPipeline, ...], tuple, dict[int, DeviceCost]]:
    """Level-2 simulator input: per-device costs aggregated into the discovered pipelines' stages.
    `micro_batches`: per discovered pipeline index (or one count for all)."""
    costs, memory = device_costs(spec, cost, schedule, comm), device_memories(spec)
    pipelines, groups = stage_pipelines(spec, cost, costs, memory, micro_batches, schedule, comm)
    return pipelines, groups, costs


JITTER_SAMPLES = 128  # draws of every device's step work when the op costs have a jitter
JITTER_SEED = 0


def jitter_draws(jitter: Mapping[int, float], samples: int = JITTER_SAMPLES) -> list[dict[int, float]]:
    """`samples` (even) draws of a factor per device, log-normal with the device's relative
    standard deviation in `jitter`, in antithetic pairs and scaled so that each device's factors
    average exactly 1 (a device alone, or far busier than the rest, is expected at its average
    work, not at its draws' sampling error); the same normal draws for the same devices on every
    call (common random numbers: two strategies compared meet the same luck), a device's
    whoever runs beside it."""
    rng = random.Random(JITTER_SEED)
    devices = sorted(jitter)
    width = max(devices, default=-1) + 1
    normal = [[rng.gauss(0.0, 1.0) for _ in range(width)] for _ in range(samples // 2)]
    normal += [[-z for z in row] for row in normal]
    sigmas = {d: math.sqrt(math.log1p(jitter[d] * jitter[d])) for d in devices}
    factors = {d: [math.exp(sigmas[d] * row[d]) for row in normal] for d in devices}
    means = {d: statistics.fmean(f) for d, f in factors.items()}
    return [{d: factors[d][k] / means[d] for d in devices} for k in range(len(normal))]


def host_step_work(spec: Specialized, cost: CostModel, costs: Mapping[int, DeviceCost],
                   micro_batches: Mapping[int, int] | int) -> dict[int, float]:
    """Per device, the host CPU seconds of one step's work (`costs`: level 2's DeviceCost per
    device): its passes' and update's work and the per-step work, with what its sleeps add to
    each (not their communication), / cpu_scale: what an emulated rank's step owes, as level 2
    runs it (stage_pipelines)."""
    out = {}
    for p, pipeline in enumerate(spec.pipelines):
        m = micro_batches if isinstance(micro_batches, int) else micro_batches[p]
        for devices in pipeline.stages:
            for d in devices:
                c = costs[d]
                work = m * (c.forward - c.forward_comm + c.backward - c.backward_comm) + c.update - c.update_comm
                out[d] = (work + step_tail_work(cost, d, c)) / cost.cpu_scale(d)
    return out


def simulate_device_run(spec: Specialized, cost: CostModel, micro_batches: Mapping[int, int] | int,
                        schedule: str = "1f1b", comm: bool = True,
                        slowed: Mapping[int, float] | None = None) -> tuple[SimResult, dict[int, DeviceCost]]:
    """Level 2 of one step and the devices' costs. Where the op costs have a jitter (a device's
    work varies from step to step on its own, the less the longer its step: OpCosts.jitter_for),
    devices that wait for each other wait for the slowest draw: the iteration is then the mean
    over jitter_draws of the step simulated with every device's work so slowed (the intervals
    and breakdowns are the average work's). `slowed`: per device, a factor on its work (not its
    communication) in every draw: the step as it would run were those devices' work that much
    longer (bench_calibration.py: level 2 given each rank's measured work, so that what the
    schedule and communications miss is told from what the op prices miss)."""
    if not spec.pipelines:
        raise HSPMDError("level 2 (simulate_device_run): the specialization has no pipelines")
    slowed = dict(slowed or {})
    unknown = sorted(set(slowed) - set(spec.executables))
    if unknown or any(not (0 < f < math.inf) for f in slowed.values()):
        raise HSPMDError(f"level 2 (simulate_device_run): slowed must map this specialization's devices "
                         f"{sorted(spec.executables)} to positive factors, got {slowed}")
    costs, memory = device_costs(spec, cost, schedule, comm), device_memories(spec)
    result = simulate_pipelines(*stage_pipelines(spec, cost, costs, memory, micro_batches, schedule, comm, slowed))
    if cost.op_costs is not None and cost.op_costs.jitter > 0:
        work = host_step_work(spec, cost, costs, micro_batches)
        spread = {d: cost.op_costs.jitter_for(work[d] * slowed.get(d, 1.0)) for d in costs}
        steps = [simulate_pipelines(*stage_pipelines(spec, cost, costs, memory, micro_batches, schedule, comm,
                                                     {d: f * slowed.get(d, 1.0) for d, f in factors.items()})).iteration
                 for factors in jitter_draws(spread)]
        result = replace(result, iteration=statistics.fmean(steps))
    return result, costs


def simulate_specialized(spec: Specialized, cost: CostModel, micro_batches: Mapping[int, int] | int,
                         schedule: str = "1f1b", comm: bool = True) -> SimResult:
    """Level 2 simulation of one step of a specialized graph (simulate_device_run)."""
    return simulate_device_run(spec, cost, micro_batches, schedule, comm)[0]


def specialize_llama(strategy: Strategy, model: ModelSpec, seq: int | None = None) -> tuple[Specialized, dict[int, int]]:
    """The DSL Llama of `model` specialized under `strategy` for one micro-batch per pipeline, and
    the micro-batch count of each discovered pipeline (level 2 needs the real programs)."""
    if model.mlp != "swiglu":
        raise HSPMDError(f"level 2 simulates hspmd's DSL Llama; model {model.name} has a {model.mlp} MLP")
    seq = seq or model.seq_len
    config = LlamaConfig(vocab=model.vocab, hidden=model.hidden, layers=model.layers, heads=model.heads, ffn=model.ffn,
                         kv_heads=model.kv_heads, head_dim=model.head_dim, tie_embeddings=model.tied)
    sizes = tuple(p.micro_batch_size or 1 for p in strategy.pipelines)
    counts = tuple(p.micro_batches or 1 for p in strategy.pipelines)
    binding = Binding.of({"B": sum(sizes), "S": seq, "T": sum(s * c for s, c in zip(sizes, counts)) * seq}, ratios=sizes)
    spec = specialize_graph(build_llama(config, [strategy]).graph, 0, binding)
    by_rank = {r: i for i, p in enumerate(strategy.pipelines) for r in p.ranks}
    return spec, {k: counts[by_rank[layout.stages[0][0]]] for k, layout in enumerate(spec.pipelines)}


def simulate_llama(strategy: Strategy, cost: CostModel, schedule: str = "1f1b", seq: int | None = None,
                   comm: bool = True) -> SimResult:
    """Level 2 for a strategy of the cost model's (Llama) model."""
    spec, counts = specialize_llama(strategy, cost.model, seq)
    return simulate_specialized(spec, cost, counts, schedule, comm)


__all__ = [
    "DISPATCHED", "DeviceCost", "JITTER_SAMPLES", "VIEWS", "device_cost", "device_costs", "device_memories", "host_step_work",
    "jitter_draws", "op_kernel", "plan_device_run", "simulate_device_run", "simulate_llama", "simulate_specialized",
    "specialize_llama", "stage_pipelines", "step_tail_work",
]
