"""Running executable graphs on one device against any Backend (in-process threads, gloo, ...).

A scheduler drives one device with three calls, in any order that keeps P2P transfers matched
between neighbouring stages (the simplest: all forwards, then all backwards, then the update):

    state = DeviceState.initial(exe, seed)          # this device's pieces of parameters / states
    mb = run_forward(exe, backend, state, feeds, binding)    # one micro-batch; keeps activations
    run_backward(exe, backend, state, mb)                    # accumulates gradients into state
    run_update(exe, backend, state)                          # gradient sync + optimizer, once a step

Activation recomputation: run_forward(..., recompute=stage_devices) keeps only the stage's inputs
(its placeholders' pieces and what it received from other stages) and run_backward runs the
forward again before the backward, re-running the collectives inside the stage (every rank of a
stage recomputes, so they stay matched) but never a transfer to or from another stage. A
`Recompute` narrows that to some layers (the ops named `layers.<l>.`) and, selectively, to the
cheap ops (SELECTIVE_KINDS): whatever is not re-run is kept, so the re-run ops find their inputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from time import perf_counter, thread_time
from typing import Mapping, Sequence

import torch

from hspmd.annotations import Annotation, box_shape
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.dsl import initial_value
from hspmd.ir.graph import Node, Tensor
from hspmd.ir.shapes import Binding
from hspmd.backends.backend import Backend
from hspmd.backends.plan_executor import execute_plan
from hspmd.specialize import comm_plans
from hspmd.specialize.executable import ExecutableGraph, Instruction
from hspmd.runtime.execution.buckets import BucketSync, write_gradient
from hspmd.runtime.execution.emulation import emulation_of


@dataclass
class DeviceState:
    """What a device keeps across micro-batches and steps: leaf pieces (by node name), gradient
    accumulators (by tensor id), fetched values summed over micro-batches, and the step count."""

    leaves: dict[str, torch.Tensor]
    accum: dict[int, torch.Tensor] = field(default_factory=dict)
    fetched: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0

    @staticmethod
    def initial(exe: ExecutableGraph, seed: int = 0, device: torch.device | str = "cpu") -> "DeviceState":
        leaves = {}
        for node in exe.held_leaves:
            leaves[node.name] = initial_value(node, seed, exe.box(node.output, exe.binding), device)
        return DeviceState(leaves)


@dataclass
class MicroBatch:
    """One micro-batch's local values on this device (activations kept for its backward);
    `rerun`: the forward instructions to run again before the backward (activation
    recomputation; env then holds only the stage's inputs), empty otherwise."""

    binding: Binding
    env: dict[int, torch.Tensor]
    rerun: tuple[Instruction, ...] = ()


# The ops selective recomputation re-runs: norms, activation functions, rotary embeddings, casts and
# elementwise arithmetic (cheap to redo, and their outputs are as large as a matmul's); matmuls,
# attention (whose fused backward recomputes its softmax itself), collectives and transfers are kept.
SELECTIVE_KINDS = frozenset({"rms_normalize", "layer_normalize", "softmax", "silu", "relu", "rotary", "packed_rotary",
                             "cast", "add", "sub", "mul", "div", "neg", "exp", "scale", "add_scalar"})
_LAYER = re.compile(r"layers\.([0-9]+)\.")


@dataclass(frozen=True)
class Recompute:
    """What one stage recomputes: `stage` (the devices that recompute together), `layers` (None:
    the whole stage's forward; else the ops of those layers), `selective` (only SELECTIVE_KINDS)."""

    stage: frozenset[int]
    layers: frozenset[int] | None = None
    selective: bool = False

    @staticmethod
    def of(stage, layers=None, granularity: str = "full") -> "Recompute":
        return Recompute(frozenset(stage), None if layers is None else frozenset(layers), granularity == "selective")

    def chooses(self, node: Node) -> bool:
        """Whether this choice re-runs `node` (given that it may run again at all: recomputable)."""
        if self.selective and node.kind not in SELECTIVE_KINDS:
            return False
        if self.layers is None:
            return True
        layer = _LAYER.match(node.name)
        return layer is not None and int(layer.group(1)) in self.layers


def recomputable(exe: ExecutableGraph, ins: Instruction, binding: Binding, stage: frozenset[int]) -> bool:
    """Whether a forward instruction may run again in the backward: not a placeholder (its piece
    is kept), not a transfer between stages (its result is kept), not an assignment; a collective
    only if everything it touches lies inside `stage` (the devices that recompute together)."""
    node = ins.node
    if node.kind in ("placeholder", "assign") or ins.is_p2p:
        return False
    if ins.role != "collective":
        return True
    return comm_plans.touched(exe.plan(node, binding)) <= stage


class _OpContext:
    """ComputeContext of one op on one device under one binding."""

    def __init__(self, exe: ExecutableGraph, node: Node, binding: Binding, step: int):
        self.exe, self.node, self.binding, self.step, self.device = exe, node, binding, step, exe.device

    def in_box(self, i):
        return self.exe.box(self.node.inputs[i], self.binding)

    def out_box(self, i):
        return self.exe.box(self.node.outputs[i], self.binding)

    def in_shape(self, i):
        return self.binding.shape(self.node.inputs[i].shape)

    def out_shape(self, i):
        return self.binding.shape(self.node.outputs[i].shape)

    def in_ann(self, i) -> Annotation:
        return self.exe.deduced[self.node.inputs[i]]

    def out_ann(self, i) -> Annotation:
        return self.exe.deduced[self.node.outputs[i]]

    def scalar(self, value):
        return self.binding.scalar(value, self.node.name)


def _value(state: DeviceState, env: dict[int, torch.Tensor], t: Tensor) -> torch.Tensor | None:
    if t.id in env:
        return env[t.id]
    if t.node.kind in ("parameter", "state"):
        return state.leaves.get(t.node.name)
    return None


def _execute(exe: ExecutableGraph, program: Sequence[Instruction], backend: Backend, state: DeviceState,
             env: dict[int, torch.Tensor], binding: Binding, feeds: Mapping[str, torch.Tensor] | None = None,
             buckets: BucketSync | None = None) -> None:
    with torch.no_grad():  # once per program, not per op: ops compute values, never autograd graphs
        _run_program(exe, program, backend, state, env, binding, feeds, buckets)


def _run_program(exe, program, backend, state, env, binding, feeds, buckets) -> None:
    emulator = emulation_of(backend)  # an emulated device type (runtime.execution.emulation), or None
    # an emulated op's time runs from the end of the last op or communication: the loop's own work
    # for the leaves, placeholders and inputs it needed counts as the device's, waits for peers do not
    started, cpu = (perf_counter(), thread_time()) if emulator is not None else (0.0, 0.0)
    for ins in program:
        node = ins.node
        kind = node.kind
        if kind == "placeholder":
            if feeds is None or node.name not in feeds:
                raise HSPMDError(f"device {exe.device}: no value fed for placeholder {node.name}")
            value = feeds[node.name]
            expected = box_shape(exe.box(node.output, binding))
            if tuple(value.shape) != expected:
                raise ShapeError(f"device {exe.device}: placeholder {node.name} fed shape {tuple(value.shape)}, "
                                 f"its piece under {exe.deduced[node.output]} is {expected}")
            env[node.output.id] = value
        elif kind in ("parameter", "state"):
            if emulator is not None and emulator.capacity is not None:
                emulator.hold((state.leaves[node.name],), node.name)
            env[node.output.id] = state.leaves[node.name]
        elif kind == "assign":
            target, value = node.inputs
            state.leaves[target.node.name] = _value(state, env, value)
        elif node.opdef.is_comm:
            local = _value(state, env, node.inputs[0])
            if ins.role == "identity":
                out = local
            else:
                out = execute_plan(exe.plan(node, binding), backend, local, node.attrs.get("reduce", "sum"))
                if emulator is not None:
                    if emulator.capacity is not None and out is not None:
                        emulator.hold((out,), node.name)
                    started, cpu = perf_counter(), thread_time()
            if out is not None:
                env[node.output.id] = out
        else:
            inputs = [_value(state, env, t) for t in node.inputs]
            target = buckets.view(node.outputs[0].id) if buckets is not None else None
            if target is not None:
                t = node.outputs[0]
                write_gradient(node.opdef, node, _OpContext(exe, node, binding, state.step), inputs, target,
                               state.accum.pop(t.id, None))
                if emulator is not None:
                    emulator.computed(perf_counter() - started, thread_time() - cpu, (target,), node.name)
                    started, cpu = perf_counter(), thread_time()
                env[t.id] = target
                buckets.written(t.id, backend)
                continue
            outs = node.opdef.compute(node, _OpContext(exe, node, binding, state.step), inputs)
            if emulator is not None:  # waits the slower type's extra time; refuses what its memory cannot hold
                emulator.computed(perf_counter() - started, thread_time() - cpu, outs, node.name)
                started, cpu = perf_counter(), thread_time()
            for t, v in zip(node.outputs, outs):
                env[t.id] = v


def device_feeds(exe: ExecutableGraph, feeds: Mapping[str, torch.Tensor], binding: Binding) -> dict[str, torch.Tensor]:
    """This device's pieces of one micro-batch's whole placeholder values (shapes under `binding`)."""
    out = {}
    for node in exe.placeholders:
        if node.name not in feeds:
            raise HSPMDError(f"no value fed for placeholder {node.name}")
        value = feeds[node.name]
        expected = binding.shape(node.output.shape, node.name)
        if tuple(value.shape) != expected:
            raise ShapeError(f"placeholder {node.name}: fed shape {tuple(value.shape)}, the binding gives {expected}")
        out[node.name] = value[tuple(slice(a, b) for a, b in exe.box(node.output, binding))]
    return out


def run_forward(exe: ExecutableGraph, backend: Backend, state: DeviceState, feeds: Mapping[str, torch.Tensor],
                binding: Binding | None = None, fetch: Sequence[Tensor] = (),
                recompute: frozenset[int] | Recompute | None = None) -> MicroBatch:
    """One micro-batch's forward pass on this device; fetched tensors (and losses) held here are
    summed into state.fetched. `recompute`: the devices of this device's stage, to keep only the
    stage's inputs and run the forward again in run_backward (module docstring), or a Recompute
    that names some layers or the cheap ops only."""
    binding = exe.binding if binding is None else binding
    mb = MicroBatch(binding, {})
    _execute(exe, exe.forward, backend, state, mb.env, binding, feeds)
    for t in list(exe.graph.losses) + list(fetch):
        if t.id in mb.env:
            state.fetched[t.name] = state.fetched.get(t.name, 0) + mb.env[t.id]
    if recompute is not None:
        choice = recompute if isinstance(recompute, Recompute) else Recompute(frozenset(recompute))
        rerun = tuple(ins for ins in exe.forward
                      if choice.chooses(ins.node) and recomputable(exe, ins, binding, choice.stage))
        again = {t.id for ins in rerun for t in ins.node.outputs}
        mb.env = {k: v for k, v in mb.env.items() if k not in again}
        mb.rerun = rerun
    return mb


def run_backward(exe: ExecutableGraph, backend: Backend, state: DeviceState, mb: MicroBatch,
                 buckets: BucketSync | None = None) -> None:
    """The backward pass of micro-batch `mb` (after its forward again, if it was recomputed); its
    gradients are added to state.accum. `buckets` (for the step's last backward): bucketed
    gradients are summed straight into their bucket views and full buckets start their
    all-reduce as the pass goes on (hspmd.runtime.execution.buckets)."""
    if mb.rerun:
        _execute(exe, mb.rerun, backend, state, mb.env, mb.binding)
    _execute(exe, exe.backward, backend, state, mb.env, mb.binding, buckets=buckets)
    for t in exe.accumulated:
        if t.id in mb.env:
            v = mb.env[t.id]
            if buckets is not None and t.id in buckets:
                state.accum[t.id] = v  # the view, already holding every micro-batch's sum
                continue
            # the first micro-batch's gradient is taken as is, no copy: env is cleared below and no op
            # writes into its inputs, so nothing else can change it before the update reads it
            state.accum[t.id] = v if t.id not in state.accum else state.accum[t.id] + v
    mb.env.clear()


def run_update(exe: ExecutableGraph, backend: Backend, state: DeviceState, fetch: Sequence[Tensor] = (),
               carried: Mapping[str, torch.Tensor] | None = None,
               synced: Mapping[int, torch.Tensor] | None = None) -> None:
    """Once per step: gradient synchronisation and optimizer updates, then reset accumulators.
    Fetched update-phase tensors (e.g. synchronised gradients) held here go to state.fetched.
    `carried`: synchronised gradient pieces by parameter name (from synced_gradients before a
    mid-step switch), added to this step's as each is synchronised, before the optimizer reads it.
    `synced`: {comm node id: result} for synchronisations done elsewhere (BucketSync.finish):
    those instructions are skipped and their results read when the program reaches them (a
    bucket's result waits for its all-reduce then, so what comes before runs meanwhile)."""
    state.step += 1
    extra = {t.id: carried[name] for name, t in exe.graph.gradients.items() if name in carried} if carried else {}
    env = {k: v + extra[k] if k in extra else v for k, v in state.accum.items()}
    batch: list[Instruction] = []  # instructions run together, between reads of synced results
    for ins in exe.update:
        if synced is not None and ins.node.id in synced:
            _execute(exe, batch, backend, state, env, exe.binding)
            batch = []
            env[ins.node.output.id] = synced[ins.node.id]  # waits for this result alone
        else:
            batch.append(ins)
            if not any(t.id in extra for t in ins.node.outputs):
                continue
            _execute(exe, batch, backend, state, env, exe.binding)
            batch = []
        for t in ins.node.outputs:
            if t.id in extra and t.id in env:
                env[t.id] = env[t.id] + extra[t.id]
    _execute(exe, batch, backend, state, env, exe.binding)
    for t in fetch:
        if t.id in env:
            state.fetched[t.name] = env[t.id]
    state.accum.clear()


def synced_gradients(exe: ExecutableGraph, backend: Backend, state: DeviceState,
                     synced: Mapping[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The gradient-synchronisation part of the update alone (HP -> HD), then accumulators reset:
    this device's synchronised gradient pieces by parameter name, what a mid-step switch carries
    to the next strategy with the weights. Every rank runs the same subsequence of its update
    program, so collectives stay matched; each result is copied at once (a backend may reuse
    its buffers in the next collective). `synced`: as in run_update (bucketed all-reduces done)."""
    env = dict(state.accum)
    names = {t.node.id: (name, t) for name, t in exe.graph.gradients.items()}
    out = {}
    for ins in exe.update:
        if ins.node.id in names:
            if synced and ins.node.id in synced:
                env[ins.node.output.id] = synced[ins.node.id]
            else:
                _execute(exe, (ins,), backend, state, env, exe.binding)
            name, t = names[ins.node.id]
            if t.id in env:
                out[name] = env[t.id].clone()
    state.accum.clear()
    return out


__all__ = [
    "DeviceState", "MicroBatch", "Recompute", "SELECTIVE_KINDS", "device_feeds", "recomputable", "run_backward",
    "run_forward", "run_update", "synced_gradients",
]
