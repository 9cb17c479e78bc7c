"""Level 2's memory model: the bytes one device's program holds as hspmd's interpreter runs it.

Level 1 counts what a layer keeps for its backward (ModelSpec.layer_activation_bytes), as an
autograd framework frees the rest. hspmd's interpreter (runtime/execution/interpreter.py) keeps
every value a pass makes in the pass's environment until the pass ends, then keeps of a forward
only what a later pass reads; this module counts the same values from the specialized program,
by storage (a view, an identity communication or a leaf's read adds no bytes), so that a
prediction can be checked against the bytes an emulated device counts (runtime.execution.emulation):

    static     leaves (parameters, optimizer states) and, with data-parallel gradient buckets,
               the buckets' gradients: what stays between steps
    forward    every value one micro-batch's forward makes
    kept       what its backward (or the step) reads of them: held while the micro-batch is in flight
    backward   every value one micro-batch's backward makes
    gradients  the gradients accumulated over the step's micro-batches (not in a bucket)
    update     every value the update makes (the new parameters and states, before they replace the old)

A device with k micro-batches in flight then peaks at static + k x kept + the larger of the
transients: a forward (forward - kept beyond the k - 1 others'), a backward (its values, plus the
accumulated gradients when a step has several micro-batches) and the update (its values and the
gradients, less the kept that are gone by then). Approximate: every pass's values are taken as
live at once (the environment's peak at its end), placeholders' batch pieces are ignored (views of
the fed batch), and sends' buffers held until their receiver takes them are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hspmd.comm_resolve.cost import DTYPE_SIZES, dtype_name
from hspmd.ir.shapes import Binding
from hspmd.specialize.executable import ExecutableGraph

# ops whose output shares its input's storage (torch views)
SHARING = ("reshape", "transpose", "expand_as", "expand", "view", "squeeze", "unsqueeze")


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device's program (module docstring)."""

    static: float
    forward: float
    kept: float
    backward: float
    gradients: float
    update: float

    def transient(self, micro_batches: int) -> float:
        """What a pass adds on top of static + in-flight x kept, at its largest."""
        accumulated = self.gradients if micro_batches > 1 else 0.0
        return max(self.forward - self.kept, self.backward + accumulated, self.update + self.gradients - self.kept, 0.0)

    def peak(self, in_flight: int, micro_batches: int) -> float:
        return self.static + in_flight * self.kept + self.transient(micro_batches)


def device_memory(exe: ExecutableGraph, binding: Binding) -> DeviceMemory:
    """Count one device's program (module docstring)."""
    sizes: dict[int, float] = {}

    def size(t) -> float:
        if t.id not in sizes:
            box = exe.box(t, binding)
            sizes[t.id] = 0.0 if box is None else math.prod(hi - lo for lo, hi in box) * DTYPE_SIZES[dtype_name(t.dtype)]
        return sizes[t.id]

    root: dict[int, int] = {}  # tensor id -> the id of the tensor whose storage it uses
    made: dict[str, dict[int, float]] = {"leaf": {}, "forward": {}, "backward": {}, "update": {}}
    bucketed = 0.0
    for phase in ("forward", "backward", "update"):
        for ins in getattr(exe, phase):
            node = ins.node
            shares = ins.role == "identity" or (ins.role == "compute" and node.kind in SHARING)
            for t in node.outputs:
                if shares and node.inputs:
                    root[t.id] = root.get(node.inputs[0].id, node.inputs[0].id)
                elif ins.role == "leaf":
                    root[t.id] = t.id
                    if node.kind != "placeholder":
                        made["leaf"][t.id] = size(t)
                elif ins.role != "assign":
                    root[t.id] = t.id
                    made[phase][t.id] = size(t)
            if phase == "update" and node.opdef.is_comm and ins.role == "collective":
                plan = exe.plan(node, binding)
                if plan.why_not_all_reduces() is None:  # the trainer's gradient buckets hold these between steps
                    bucketed += sum(size(t) for t in node.inputs)
    forward = made["forward"]
    read_later = {root.get(t.id, t.id) for ins in exe.backward + exe.update for t in ins.node.inputs}
    read_later |= {root.get(t, t) for t in exe.fetched}
    kept = sum(n for t, n in forward.items() if t in read_later)
    read_by_update = {root.get(t.id, t.id) for ins in exe.update for t in ins.node.inputs}
    gradients = sum(n for t, n in made["backward"].items() if t in read_by_update)
    return DeviceMemory(sum(made["leaf"].values()) + bucketed, sum(forward.values()), kept,
                        sum(made["backward"].values()), max(0.0, gradients - bucketed), sum(made["update"].values()))


__all__ = ["DeviceMemory", "SHARING", "device_memory"]
