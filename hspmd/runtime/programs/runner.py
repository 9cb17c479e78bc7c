"""Running a DeviceProgram (hspmd.specialize.program) on a Backend, without the IR graph.

    runner = ProgramRunner(read_program("out/", backend.rank), backend)   # collective (groups)
    loss = runner.step({"tokens": x, "labels": y})                       # the global batch
    runner.pieces()                                                      # {name: (box, tensor)}

The program is lowered once (`lower_program`: each op looked up by kind in hspmd.ops.registry and
given a context over the program's tensor table, each CommOp its plan part) and run by the
interpreter the Trainer runs (hspmd.runtime.execution.interpreter): the schedule's order of
forward and backward passes, recomputation where the program names it, gradients accumulated
over micro-batches, the program's gradient buckets filled by the last backward and all-reduced
while it goes on, the update once a step, the loss summed over its holders.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import torch

from hspmd.annotations import Annotation, Box, box_shape, parse
from hspmd.backends.backend import Backend
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.init import initializer_from_key, make_piece
from hspmd.ops.registry import operator
from hspmd.runtime.execution.buckets import BucketSync
from hspmd.runtime.execution.interpreter import (
    ASSIGN, COMM, COMPUTE, IDENTITY, LEAF, PLACEHOLDER, Clock, DeviceState, Lowered, Passes, run_step, step_loss,
)
from hspmd.specialize.program import DeviceProgram, Op

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32}


@lru_cache(maxsize=4096)
def _annotation(text: str) -> Annotation:
    return parse(text)


class _Context:
    """ComputeContext of one op (hspmd.ops.base) read from the program's tensor table."""

    __slots__ = ("program", "op", "clock", "device", "binding")

    def __init__(self, program: DeviceProgram, op: Op, clock: Clock):
        self.program, self.op, self.clock = program, op, clock
        self.device, self.binding = program.device, program.binding

    @property
    def step(self) -> int:
        return self.clock.step

    def in_box(self, i: int) -> Box:
        return self.program.tensor(self.op.inputs[i]).box

    def out_box(self, i: int) -> Box:
        return self.program.tensor(self.op.outputs[i]).box

    def in_shape(self, i: int) -> tuple[int, ...]:
        return self.program.tensor(self.op.inputs[i]).shape

    def out_shape(self, i: int) -> tuple[int, ...]:
        return self.program.tensor(self.op.outputs[i]).shape

    def in_ann(self, i: int) -> Annotation:
        return _annotation(self.program.tensor(self.op.inputs[i]).annotation)

    def out_ann(self, i: int) -> Annotation:
        return _annotation(self.program.tensor(self.op.outputs[i]).annotation)

    def scalar(self, value) -> float:
        return self.binding.scalar(value, self.op.name)


def lower_program(program: DeviceProgram) -> Passes:
    """The program's passes for the interpreter (hspmd.runtime.execution.interpreter)."""
    clock = Clock()
    leaf_of = {leaf.tensor: leaf.name for leaf in program.leaves}

    def lower(op: Op) -> Lowered:
        inputs = [(t, leaf_of.get(t)) for t in op.inputs]
        if op.kind == "placeholder":
            t = program.tensor(op.outputs[0])
            return Lowered(PLACEHOLDER, op.name, op, None, None, inputs, op.outputs, shape=tuple(box_shape(t.box)),
                           where=f" under {t.annotation}")
        if op.kind in ("parameter", "state"):
            return Lowered(LEAF, op.name, op, None, None, inputs, op.outputs)
        if op.kind == "assign":
            return Lowered(ASSIGN, leaf_of[op.inputs[0]], op, None, None, inputs, op.outputs)
        opdef = operator(op.kind)
        if opdef.is_comm:
            if op.role == "identity":
                return Lowered(IDENTITY, op.name, op, None, None, inputs, op.outputs)
            return Lowered(COMM, op.name, op, None, None, inputs, op.outputs, plan=program.plans[op.plan],
                           reduce=op.attrs.get("reduce", "sum"))
        return Lowered(COMPUTE, op.name, op, opdef, _Context(program, op, clock), inputs, op.outputs)

    forward = tuple(lower(op) for op in program.forward)
    loss = () if program.loss is None else ((program.tensor(program.loss).name, program.loss),)
    passes = Passes(program.device, forward, tuple(lower(op) for op in program.backward),
                    tuple(lower(op) for op in program.update), program.accumulated, loss,
                    tuple((name, t, name) for name, t in program.gradients), clock)
    recomputed = () if program.place is None else program.place.recomputed
    return passes.recomputing([forward[i] for i in recomputed]) if recomputed else passes


def leaf_pieces(program: DeviceProgram, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """This device's initial parameter and state pieces, from their initialisation keys."""
    out = {}
    for leaf in program.leaves:
        t = program.tensor(leaf.tensor)
        if t.box is None:
            raise HSPMDError(f"program of device {program.device}: {leaf.kind} {leaf.name} has no box here")
        init = initializer_from_key(dict(leaf.init))
        out[leaf.name] = make_piece(init, t.shape, t.box, leaf.seed, _DTYPES[t.dtype], device)
    return out


class ProgramRunner:
    """One rank's training loop over its program. Construction is collective (it prepares the
    step's collective groups on backends that need them), like the Trainer's. `state`: the
    leaves and step to start from (default: the program's initial pieces)."""

    def __init__(self, program: DeviceProgram, backend: Backend, state: DeviceState | None = None):
        if program.device != backend.rank:
            raise HSPMDError(f"rank {backend.rank} was given the program of device {program.device}")
        self.program, self.backend = program, backend
        self.state = DeviceState(leaf_pieces(program, backend.device)) if state is None else state
        self.passes = lower_program(program)
        self.buckets = None if program.buckets is None or program.idle else BucketSync(program.buckets, backend.device)
        self.last_run = None  # the last step's ScheduleRun
        self.measure = False  # count the activation bytes held after each action (ScheduleRun.peak_held_bytes)
        backend.prepare_groups(program.groups)

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        return self.state.leaves

    @property
    def step_count(self) -> int:
        return self.state.step

    @property
    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's synchronised gradient pieces held here, by parameter name."""
        fetched = self.state.fetched
        return {name: fetched[name] for name, _ in self.program.gradients if name in fetched}

    # ---- a step --------------------------------------------------------------------------------------

    def _micro_batch_feeds(self, batch: Mapping[str, torch.Tensor], m: int) -> dict[str, torch.Tensor]:
        device = self.backend.device
        return {feed.name: batch[feed.name][tuple(slice(a, b) for a, b in feed.box)].to(device, non_blocking=True)
                for feed in self.program.feeds[m]}

    def _check_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        names = {f.name for mb in self.program.feeds for f in mb}
        for name in sorted(names):
            if name not in batch:
                raise HSPMDError(f"step(): the batch has no {name!r}")
            value = batch[name]
            if value.dim() == 0 or value.shape[0] != self.program.global_batch:
                raise ShapeError(f"step(): {name} has shape {tuple(value.shape)} but its dim 0 must be the global "
                                 f"batch size {self.program.global_batch}")

    def step(self, batch: Mapping[str, torch.Tensor]) -> float | None:
        """One training step on the global batch (every rank passes the same one); returns the step
        loss on every rank of the strategy (None on an idle rank or without a loss)."""
        program = self.program
        self._check_batch(batch)
        if program.idle:
            self.state.step += 1  # counts the job's steps, as an idle Trainer does
            return None
        passes = self.passes
        self.last_run, _ = run_step(program.place.order, self.backend, self.state, lambda m: passes,
                                    lambda m: self._micro_batch_feeds(batch, m), passes, self.buckets,
                                    measure=self.measure)
        if not program.step_loss:
            return None
        local = self.state.fetched.get(passes.fetch[0][0]) if passes.fetch else None
        return step_loss(self.backend, local, program.loss_summand, program.devices)

    def pieces(self) -> dict[str, tuple[Box, torch.Tensor]]:
        """This device's parameter and state pieces with their boxes (global coordinates)."""
        boxes = {leaf.name: self.program.tensor(leaf.tensor).box for leaf in self.program.leaves}
        return {name: (boxes[name], value) for name, value in self.state.leaves.items()}

    def gradient_pieces(self) -> dict[str, tuple[Box, torch.Tensor]]:
        """The last step's synchronised gradient pieces held here, with their boxes: copies (a
        bucketed gradient lives in its bucket, which the next step's backward writes again)."""
        ids = dict(self.program.gradients)
        return {name: (self.program.tensor(ids[name]).box, value.clone()) for name, value in self.gradients.items()}


__all__ = ["ProgramRunner", "leaf_pieces", "lower_program"]
