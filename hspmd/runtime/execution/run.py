"""Running executable graphs on one device against any Backend (in-process threads, gloo, ...).

An executable graph under a binding is lowered (`lower_executable`) into the interpreter's
`Passes` (hspmd.runtime.execution.interpreter, which also runs DevicePrograms); the Trainer lowers
once per binding and keeps it. For a caller that drives one device by hand, three calls in any
order that keeps P2P transfers matched between neighbouring stages (the simplest: all forwards,
then all backwards, then the update) lower and run:

    state = DeviceState.initial(exe, seed)          # this device's pieces of parameters / states
    mb = run_forward(exe, backend, state, feeds, binding)    # one micro-batch; keeps activations
    run_backward(exe, backend, state, mb)                    # accumulates gradients into state
    run_update(exe, backend, state)                          # gradient sync + optimizer, once a step

Activation recomputation: run_forward(..., recompute=stage_devices) keeps only the stage's inputs
(its placeholders' pieces and what it received from other stages) and run_backward runs the
forward again before the backward (`recomputable` says which instructions), re-running the
collectives inside the stage (every rank of a stage recomputes, so they stay matched) but never a
transfer to or from another stage. A `Recompute` narrows that to some layers (the ops named
`layers.<l>.`) and, selectively, to the cheap ops (SELECTIVE_KINDS): whatever is not re-run is
kept, so the re-run ops find their inputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from hspmd.annotations import Annotation, box_shape
from hspmd.backends.backend import Backend
from hspmd.comm_resolve.plan_part import part_of
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.graph import Node, Tensor
from hspmd.ir.shapes import Binding
from hspmd.runtime.execution.buckets import BucketSync
from hspmd.runtime.execution.interpreter import (
    ASSIGN, COMM, COMPUTE, IDENTITY, LEAF, PLACEHOLDER, Clock, DeviceState, Lowered, MicroBatch, Passes, backward,
    forward, sync_gradients, update,
)
from hspmd.specialize import comm_plans
from hspmd.specialize.executable import ExecutableGraph, Instruction


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


def rerun_instructions(exe: ExecutableGraph, binding: Binding, recompute: frozenset[int] | Recompute
                       ) -> list[Instruction]:
    """The forward instructions a stage runs again before each backward: those `recompute` (the
    stage's devices, or a Recompute) chooses and that may run again (`recomputable`)."""
    choice = recompute if isinstance(recompute, Recompute) else Recompute(frozenset(recompute))
    return [ins for ins in exe.forward if choice.chooses(ins.node) and recomputable(exe, ins, binding, choice.stage)]


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

    __slots__ = ("exe", "node", "binding", "clock", "device")

    def __init__(self, exe: ExecutableGraph, node: Node, binding: Binding, clock: Clock):
        self.exe, self.node, self.binding, self.clock, self.device = exe, node, binding, clock, exe.device

    @property
    def step(self) -> int:
        return self.clock.step

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


def _lower(exe: ExecutableGraph, ins: Instruction, binding: Binding, clock: Clock) -> Lowered:
    node = ins.node
    kind = node.kind
    inputs = [(t.id, t.node.name if t.node.kind in ("parameter", "state") else None) for t in node.inputs]
    outputs = [t.id for t in node.outputs]
    if kind == "placeholder":
        return Lowered(PLACEHOLDER, node.name, node, None, None, inputs, outputs,
                       shape=box_shape(exe.box(node.output, binding)), where=f" under {exe.deduced[node.output]}")
    if kind in ("parameter", "state"):
        return Lowered(LEAF, node.name, node, None, None, inputs, outputs)
    if kind == "assign":
        return Lowered(ASSIGN, node.inputs[0].node.name, node, None, None, inputs, outputs)
    if node.opdef.is_comm:
        if ins.role == "identity":
            return Lowered(IDENTITY, node.name, node, None, None, inputs, outputs)
        return Lowered(COMM, node.name, node, None, None, inputs, outputs,
                       plan=part_of(exe.plan(node, binding), exe.device), reduce=node.attrs.get("reduce", "sum"))
    return Lowered(COMPUTE, node.name, node, node.opdef, _OpContext(exe, node, binding, clock), inputs, outputs)


def lower_executable(exe: ExecutableGraph, binding: Binding | None = None,
                     recompute: frozenset[int] | Recompute | None = None) -> Passes:
    """`exe`'s passes under `binding` (default its own) for the interpreter; `recompute`: the
    devices of this device's stage (or a Recompute that names some layers or the cheap ops only),
    to rerun those forward instructions in the backward (rerun_instructions)."""
    binding = exe.binding if binding is None else binding
    clock = Clock()
    lowered = {id(ins): _lower(exe, ins, binding, clock) for ins in exe.instructions()}
    fwd, bwd, upd = (tuple(lowered[id(ins)] for ins in prog) for prog in (exe.forward, exe.backward, exe.update))
    passes = Passes(exe.device, fwd, bwd, upd, tuple(t.id for t in exe.accumulated),
                    tuple((t.name, t.id) for t in exe.graph.losses),
                    tuple((name, t.id, t.name) for name, t in exe.graph.gradients.items()), clock, keep=exe.fetched)
    if recompute is None:
        return passes
    return passes.recomputing([lowered[id(ins)] for ins in rerun_instructions(exe, binding, recompute)])


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
    stage's inputs and run the forward again in run_backward (module docstring)."""
    passes = lower_executable(exe, binding, recompute)
    if fetch:
        passes = Passes(passes.device, passes.forward, passes.backward, passes.update, passes.accumulated,
                        passes.fetch + tuple((t.name, t.id) for t in fetch), passes.gradients, passes.clock,
                        passes.rerun, passes.keep)
    return forward(passes, backend, state, feeds)


def run_backward(exe: ExecutableGraph, backend: Backend, state: DeviceState, mb: MicroBatch,
                 buckets: BucketSync | None = None) -> None:
    """The backward pass of micro-batch `mb` (after its forward again, if it was recomputed); its
    gradients are added to state.accum. `buckets` (for the step's last backward): as in
    hspmd.runtime.execution.interpreter.backward."""
    backward(backend, state, mb, buckets)


def run_update(exe: ExecutableGraph, backend: Backend, state: DeviceState,
               carried: Mapping[str, torch.Tensor] | None = None) -> None:
    """Once per step: gradient synchronisation and optimizer updates, then reset accumulators;
    the synchronised gradients held here go to state.fetched by parameter name. `carried`:
    synchronised gradient pieces by parameter name, added to this step's before the optimizer
    reads them."""
    update(lower_executable(exe), backend, state, carried)


def synced_gradients(exe: ExecutableGraph, backend: Backend, state: DeviceState) -> dict[str, torch.Tensor]:
    """The gradient-synchronisation part of the update alone (interpreter.sync_gradients)."""
    return sync_gradients(lower_executable(exe), backend, state)


__all__ = [
    "DeviceState", "MicroBatch", "Recompute", "SELECTIVE_KINDS", "device_feeds", "lower_executable", "recomputable",
    "rerun_instructions", "run_backward", "run_forward", "run_update", "synced_gradients",
]
