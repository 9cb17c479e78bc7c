"""Running a DeviceProgram (hspmd.specialize.program) on a Backend, without the IR graph.

    runner = ProgramRunner(read_program("out/", backend.rank), backend)   # collective (groups)
    loss = runner.step({"tokens": x, "labels": y})                       # the global batch
    runner.pieces()                                                      # {name: (box, tensor)}

The interpreter mirrors hspmd.runtime.execution.run and the Trainer's step: the schedule's order of forward
and backward passes (sends posted without waiting and kept only until received, as
hspmd.runtime.execution.executor does), gradients accumulated over micro-batches, the program's gradient
buckets filled by the last backward and all-reduced while it goes on (hspmd.runtime.execution.buckets;
the update reads each when it reaches it), the update once a step, the loss summed over its
holders. Ops are looked up by kind (hspmd.ops.registry) and computed with the program's attributes
and boxes; CommOps run this device's parts of their plans (hspmd.backends.plan_executor).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

import torch

from hspmd.annotations import Annotation, Box, box_shape, parse
from hspmd.backends.backend import Backend
from hspmd.backends.plan_executor import execute_plan
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.init import initializer_from_key, make_piece
from hspmd.ops.registry import operator
from hspmd.runtime.execution.buckets import BucketSync, write_gradient
from hspmd.runtime.execution.executor import NonBlockingSends
from hspmd.specialize.program import DeviceProgram, Op
from hspmd.specialize.schedules import FORWARD

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32}


@lru_cache(maxsize=4096)
def _annotation(text: str) -> Annotation:
    return parse(text)


class _Context:
    """ComputeContext of one op (hspmd.ops.base) read from the program's tensor table."""

    def __init__(self, program: DeviceProgram, op: Op, step: int):
        self.program, self.op, self.step = program, op, step
        self.device, self.binding = program.device, program.binding

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
    step's collective groups on backends that need them), like the Trainer's."""

    def __init__(self, program: DeviceProgram, backend: Backend):
        if program.device != backend.rank:
            raise HSPMDError(f"rank {backend.rank} was given the program of device {program.device}")
        self.program, self.backend = program, backend
        self.leaves = leaf_pieces(program, backend.device)
        self.step_count = 0
        self.gradients: dict[str, torch.Tensor] = {}
        self._leaf_of = {leaf.tensor: leaf.name for leaf in program.leaves}
        self.buckets = None if program.buckets is None or program.idle else BucketSync(program.buckets, backend.device)
        backend.prepare_groups(program.groups)

    # ---- one op sequence ---------------------------------------------------------------------------

    def _value(self, env: dict[int, torch.Tensor], t: int) -> torch.Tensor | None:
        if t in env:
            return env[t]
        name = self._leaf_of.get(t)
        return None if name is None else self.leaves.get(name)

    def _execute(self, ops: Sequence[Op], backend: Backend, env: dict[int, torch.Tensor],
                 feeds: Mapping[int, torch.Tensor] | None = None, accum: dict[int, torch.Tensor] | None = None,
                 fill: BucketSync | None = None, read: BucketSync | None = None) -> None:
        """Run `ops` over `env`. `fill`: the last backward's buckets, which bucketed gradients are
        summed into (with their `accum` of earlier micro-batches); `read`: the buckets after
        finish(), whose synchronised gradients the update takes in place of running their plans."""
        program = self.program
        for op in ops:
            if op.kind == "placeholder":
                (t,) = op.outputs
                if feeds is None or t not in feeds:
                    raise HSPMDError(f"device {program.device}: no value fed for placeholder {op.name}")
                env[t] = feeds[t]
            elif op.kind in ("parameter", "state"):
                env[op.outputs[0]] = self.leaves[op.name]
            elif op.kind == "assign":
                target, value = op.inputs
                self.leaves[self._leaf_of[target]] = self._value(env, value)
            elif op.kind == "comm" and read is not None and op.inputs[0] in read:
                env[op.outputs[0]] = read.gradient(op.inputs[0])  # waits for its buckets alone
            elif op.kind == "comm":
                local = self._value(env, op.inputs[0])
                out = local if op.role == "identity" else execute_plan(program.plans[op.plan], backend, local,
                                                                       op.attrs.get("reduce", "sum"))
                if out is not None:
                    env[op.outputs[0]] = out
            else:
                inputs = [self._value(env, t) for t in op.inputs]
                opdef, ctx = operator(op.kind), _Context(program, op, self.step_count)
                target = fill.view(op.outputs[0]) if fill is not None else None
                if target is not None:
                    with torch.no_grad():
                        write_gradient(opdef, op, ctx, inputs, target, accum.pop(op.outputs[0], None))
                    env[op.outputs[0]] = target
                    fill.written(op.outputs[0], backend)
                    continue
                with torch.no_grad():
                    outs = opdef.compute(op, ctx, inputs)
                for t, v in zip(op.outputs, outs):
                    env[t] = v

    # ---- a step --------------------------------------------------------------------------------------

    def _micro_batch_feeds(self, batch: Mapping[str, torch.Tensor], m: int) -> dict[int, torch.Tensor]:
        out = {}
        for feed in self.program.feeds[m]:
            value = batch[feed.name][tuple(slice(a, b) for a, b in feed.box)]
            expected = box_shape(self.program.tensor(feed.tensor).box)
            if tuple(value.shape) != tuple(expected):
                raise ShapeError(f"device {self.program.device}: placeholder {feed.name} of micro-batch {m} has shape "
                                 f"{tuple(value.shape)}, its piece is {tuple(expected)}")
            out[feed.tensor] = value.to(self.backend.device, non_blocking=True)
        return out

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
        if program.idle:
            return None
        self._check_batch(batch)
        sender = NonBlockingSends(self.backend)
        live: dict[int, dict[int, torch.Tensor]] = {}
        accum: dict[int, torch.Tensor] = {}
        loss = None
        buckets = self.buckets
        if buckets is not None:
            buckets.begin()  # drops what a failed step left under way
        last_backward = max((i for i, a in enumerate(program.place.order) if a.kind != FORWARD), default=-1)
        for i, action in enumerate(program.place.order):
            m = action.micro_batch
            sender.tag = (action.kind, m)
            if action.kind == FORWARD:
                env: dict[int, torch.Tensor] = {}
                self._execute(program.forward, sender, env, self._micro_batch_feeds(batch, m))
                if program.loss is not None and program.loss in env:
                    loss = env[program.loss] if loss is None else loss + env[program.loss]
                live[m] = env
            else:
                env = live.pop(m)
                fill = buckets if i == last_backward else None
                self._execute(program.backward, sender, env, accum=accum, fill=fill)
                for t in program.accumulated:
                    if t in env:
                        bucketed = fill is not None and t in fill  # its view holds every micro-batch's sum
                        accum[t] = env[t] if bucketed or t not in accum else accum[t] + env[t]
            sender.action_done(action.kind, m)
        sender.wait_sends()
        self.step_count += 1
        env = dict(accum)
        if buckets is not None:
            buckets.finish(self.backend)  # starts any bucket not started yet
        self._execute(program.update, self.backend, env, read=buckets)
        if buckets is not None:
            buckets.settle()
        self.gradients = {name: env[t] for name, t in program.gradients if t in env}
        return self._reduce_loss(loss)

    def _reduce_loss(self, local: torch.Tensor | None) -> float | None:
        if not self.program.step_loss:
            return None
        device = self.backend.device
        value = local.detach().reshape(()).to(device, torch.float64) if self.program.loss_summand and local is not None \
            else torch.zeros((), dtype=torch.float64, device=device)
        total = self.backend.all_reduce(value, self.program.devices)
        return float("nan") if total.is_meta else float(total)

    def pieces(self) -> dict[str, tuple[Box, torch.Tensor]]:
        """This device's parameter and state pieces with their boxes (global coordinates)."""
        boxes = {leaf.name: self.program.tensor(leaf.tensor).box for leaf in self.program.leaves}
        return {name: (boxes[name], value) for name, value in self.leaves.items()}

    def gradient_pieces(self) -> dict[str, tuple[Box, torch.Tensor]]:
        """The last step's synchronised gradient pieces held here, with their boxes: copies (a
        bucketed gradient lives in its bucket, which the next step's backward writes again)."""
        ids = dict(self.program.gradients)
        return {name: (self.program.tensor(ids[name]).box, value.clone()) for name, value in self.gradients.items()}


__all__ = ["ProgramRunner", "leaf_pieces"]
