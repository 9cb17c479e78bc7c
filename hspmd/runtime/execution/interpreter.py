"""The one interpreter of a rank's work: its forward, backward and update passes, a stage's
schedule of them, and the step loss.

A rank's work comes in two forms, an executable graph under a binding (hspmd.specialize.executable,
what the Trainer specializes) and a DeviceProgram (hspmd.specialize.program, plain data read from
JSON). Both are *lowered* into the same `Passes` (hspmd.runtime.execution.run.lower_executable,
hspmd.runtime.programs.runner.lower_program): each op resolved once, before the first step, to what
runs it (its compute function and context, its comm plan part, the leaf or feed it reads) with
tensor ids in place of tensors, so a step looks nothing up by name or kind. Everything after that
is this module's, for both forms:

    mb = forward(passes, backend, state, feeds)          # one micro-batch; activations kept
    backward(passes, backend, state, mb)                  # gradients summed into state.accum
    update(passes, backend, state)                        # gradient sync + optimizer, once a step
    run = run_schedule(order, backend, state, passes_of, feeds)   # a stage's F/B order
    loss = step_loss(backend, local, summand, devices)    # the step loss on every rank

Activation recomputation: a `Passes` lowered for a recomputing stage names the forward ops that
run again before the backward (`rerun`); forward() then keeps only what they do not make (the
stage's inputs: its fed pieces and what other stages sent), backward() runs them again first,
collectives inside the stage included (every rank of a stage recomputes, so they stay matched),
never a transfer between stages.

Stage-to-stage sends are posted without waiting for the receiver (`NonBlockingSends`): with
blocking sends, 1F1B's steady state (stage s sends micro-batch m+1's activation while stage s+1
sends micro-batch m's gradient back) deadlocks. A send's buffer is kept only until its receiver
has it: sends the backend reports complete are dropped after every action (gloo reports a send
only once it is waited for), those of F(m) are completed right after B(m) (its gradient came
back, so the later stages have received F(m)'s outputs), and those of a backward right after the
next backward (by then the earlier stages, which wait for that gradient and need nothing else
from this stage to get there, have taken it); whatever is left is completed at the end.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Mapping, Sequence

import torch

from hspmd.backends.backend import Backend, Group, Pending, Shape
from hspmd.backends.plan_executor import execute_plan
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.dsl import initial_value
from hspmd.runtime.execution.buckets import BucketSync, write_gradient
from hspmd.runtime.execution.emulation import emulation_of
from hspmd.runtime.execution.trace import Tracer
from hspmd.specialize.schedules import FORWARD, Action, check_order

PLACEHOLDER, LEAF, ASSIGN, COMM, IDENTITY, COMPUTE = range(6)
"""What a lowered op does: take its fed piece, take a leaf piece, write a leaf, run a comm plan,
pass its input on (a comm whose plan moves nothing here), compute."""


@dataclass
class DeviceState:
    """What a device keeps across micro-batches and steps: leaf pieces (by node name), gradient
    accumulators (by tensor id), fetched values (the loss summed over micro-batches, synchronised
    gradients, by name), and the step count."""

    leaves: dict[str, torch.Tensor]
    accum: dict[int, torch.Tensor] = field(default_factory=dict)
    fetched: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0

    @staticmethod
    def initial(exe, seed: int = 0, device: torch.device | str = "cpu") -> "DeviceState":
        """The initial pieces of the leaves an executable graph holds (hspmd.ir.init)."""
        return DeviceState({node.name: initial_value(node, seed, exe.box(node.output, exe.binding), device)
                            for node in exe.held_leaves})


class Clock:
    """The step count the ops' contexts read (the optimizer's bias correction): one per lowering,
    set from the DeviceState before each pass, so a lowered op serves every step."""

    __slots__ = ("step",)

    def __init__(self):
        self.step = 0


class Lowered:
    """One op resolved for running: `code` (module constants), `name` (the placeholder, leaf or
    assigned leaf it concerns), `node` and `ctx` (what `compute(node, ctx, inputs)` takes: an IR
    node or a program op and a ComputeContext), `inputs` ((tensor id, leaf name or None) pairs:
    a leaf is read from the state when no op of the pass put it in the environment), `outputs`,
    `plan` (this device's part of a comm's plan), `reduce`, `shape` (a placeholder's piece)."""

    __slots__ = ("code", "name", "node", "opdef", "compute", "ctx", "inputs", "outputs", "out", "plan", "reduce",
                 "shape", "where")

    def __init__(self, code: int, name: str, node, opdef, ctx, inputs: Sequence[tuple[int, str | None]],
                 outputs: Sequence[int], plan=None, reduce: str = "sum", shape: tuple[int, ...] | None = None,
                 where: str = ""):
        self.code, self.name, self.node, self.opdef, self.ctx = code, name, node, opdef, ctx
        self.compute = opdef.compute if opdef is not None else None
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.out = self.outputs[0] if self.outputs else None
        self.plan, self.reduce, self.shape, self.where = plan, reduce, shape, where


@dataclass(frozen=True)
class Passes:
    """A rank's work lowered (module docstring): the three passes, the forward ops recomputed in
    the backward (`rerun`, empty without recomputation), the tensors summed over micro-batches
    (`accumulated`), the fetched forward values (the loss: (name, id)), the synchronised
    gradients ((parameter name, tensor id, the name state.fetched keeps it under)), and the clock
    its contexts read."""

    device: int
    forward: tuple[Lowered, ...]
    backward: tuple[Lowered, ...]
    update: tuple[Lowered, ...]
    accumulated: tuple[int, ...]
    fetch: tuple[tuple[str, int], ...]
    gradients: tuple[tuple[str, int, str], ...]
    clock: Clock
    rerun: tuple[Lowered, ...] = ()
    keep: frozenset[int] = frozenset()  # forward values kept for the caller besides what later passes read

    def recomputing(self, rerun: Sequence[Lowered]) -> "Passes":
        return Passes(self.device, self.forward, self.backward, self.update, self.accumulated, self.fetch,
                      self.gradients, self.clock, tuple(rerun), self.keep)

    @cached_property
    def kept_after_forward(self) -> frozenset[int]:
        """The forward values a micro-batch keeps for later: what the backward and update ops read,
        the accumulated and fetched tensors and `keep`; the rest (values only the forward reads,
        e.g. ring attention's received K/V) is dropped when the forward ends."""
        ids = {t for op in self.backward + self.update for t, _ in op.inputs}
        return frozenset(ids | set(self.accumulated) | {t for _, t in self.fetch} | self.keep)


@dataclass
class MicroBatch:
    """One micro-batch's local values on this device (activations kept for its backward) and the
    passes it runs under (its binding's); with recomputation env holds only the stage's inputs."""

    passes: Passes
    env: dict[int, torch.Tensor]


def run_ops(ops: Sequence[Lowered], backend: Backend, state: DeviceState, env: dict[int, torch.Tensor],
            feeds: Mapping[str, torch.Tensor] | None = None, fill: BucketSync | None = None,
            read: BucketSync | None = None, extra: Mapping[int, torch.Tensor] | None = None) -> None:
    """Run `ops` over `env` (tensor id -> this device's value). `fill`: the step's last backward's
    buckets, which bucketed gradients are written into (with the earlier micro-batches' sum from
    state.accum) and started from; `read`: the buckets after finish(), whose synchronised
    gradients the update takes in place of running their plans (each waited for when read);
    `extra`: values added to these tensors as soon as they are made (gradients carried over a
    switch)."""
    leaves = state.leaves
    emulator = emulation_of(backend)  # an emulated device type (runtime.execution.emulation), or None
    holds = emulator is not None and emulator.capacity is not None
    if emulator is not None:
        emulator.pass_started()
    with torch.no_grad():  # once per pass, not per op: ops compute values, never autograd graphs
        for op in ops:
            code = op.code
            if code == COMPUTE:
                inputs = [env[t] if t in env else (leaves.get(n) if n is not None else None) for t, n in op.inputs]
                target = fill.view(op.out) if fill is not None else None
                if target is not None:
                    write_gradient(op.opdef, op.node, op.ctx, inputs, target, state.accum.pop(op.out, None))
                    if emulator is not None:
                        emulator.computed((target,), op.name)
                    env[op.out] = target
                    fill.written(op.out, backend)
                    continue
                outs = op.compute(op.node, op.ctx, inputs)
                if emulator is not None:  # owes the slower type's extra time; refuses what its memory cannot hold
                    emulator.computed(outs, op.name)
                if len(op.outputs) == 1:
                    env[op.out] = outs[0]
                else:
                    for t, v in zip(op.outputs, outs):
                        env[t] = v
                continue
            if code == LEAF:
                if holds:
                    emulator.hold((leaves[op.name],), op.name)
                env[op.out] = leaves[op.name]
                continue
            if code == COMM or code == IDENTITY:
                t, n = op.inputs[0]
                if read is not None and t in read:
                    out = read.gradient(t)  # waits for its buckets alone
                else:
                    local = env[t] if t in env else (leaves.get(n) if n is not None else None)
                    if code == IDENTITY:
                        out = local
                    else:  # the plan's own Python is the host's work, not the emulated device's
                        with emulator.host_work() if emulator is not None else nullcontext():
                            out = execute_plan(op.plan, backend, local, op.reduce)
                    if holds and code == COMM and out is not None:
                        emulator.hold((out,), op.name)
                if out is not None:
                    if extra and op.out in extra:
                        out = out + extra[op.out]
                    env[op.out] = out
                continue
            if code == PLACEHOLDER:
                if feeds is None or op.name not in feeds:
                    raise HSPMDError(f"device {backend.rank}: no value fed for placeholder {op.name}")
                value = feeds[op.name]
                if tuple(value.shape) != op.shape:
                    raise ShapeError(f"device {backend.rank}: placeholder {op.name} fed shape {tuple(value.shape)}, "
                                     f"its piece{op.where} is {op.shape}")
                env[op.out] = value
                continue
            # ASSIGN
            t, n = op.inputs[1]
            leaves[op.name] = env[t] if t in env else (leaves.get(n) if n is not None else None)


def forward(passes: Passes, backend: Backend, state: DeviceState, feeds: Mapping[str, torch.Tensor]) -> MicroBatch:
    """One micro-batch's forward pass; fetched values held here (the loss) are summed into
    state.fetched; with recomputation, only what the backward's rerun does not make is kept."""
    mb = MicroBatch(passes, {})
    passes.clock.step = state.step
    run_ops(passes.forward, backend, state, mb.env, feeds)
    for name, t in passes.fetch:
        if t in mb.env:
            state.fetched[name] = state.fetched.get(name, 0) + mb.env[t]
    if passes.rerun:
        for op in passes.rerun:
            for t in op.outputs:
                mb.env.pop(t, None)
    elif passes.backward:
        kept = passes.kept_after_forward
        mb.env = {t: v for t, v in mb.env.items() if t in kept}
    return mb


def backward(backend: Backend, state: DeviceState, mb: MicroBatch, buckets: BucketSync | None = None) -> None:
    """The backward pass of `mb` (after its forward again, if recomputed); its gradients are added
    to state.accum. `buckets` (for the step's last backward): bucketed gradients are summed
    straight into their bucket views, full buckets start their all-reduce as the pass goes on."""
    passes = mb.passes
    passes.clock.step = state.step
    if passes.rerun:
        run_ops(passes.rerun, backend, state, mb.env)
    run_ops(passes.backward, backend, state, mb.env, fill=buckets)
    accum, env = state.accum, mb.env
    for t in passes.accumulated:
        if t in env:
            v = env[t]
            if buckets is not None and t in buckets:
                accum[t] = v  # the view, already holding every micro-batch's sum
            else:
                # the first micro-batch's gradient is taken as is, no copy: env is cleared below and no op
                # writes into its inputs, so nothing else can change it before the update reads it
                accum[t] = v if t not in accum else accum[t] + v
    env.clear()


def update(passes: Passes, backend: Backend, state: DeviceState, carried: Mapping[str, torch.Tensor] | None = None,
           read: BucketSync | None = None) -> None:
    """Once a step: gradient synchronisation and optimizer, then the accumulators reset; the
    synchronised gradients held here go to state.fetched by parameter name. `carried`:
    synchronised gradient pieces by parameter name (sync_gradients before a mid-step switch),
    added to this step's as each is made, before the optimizer reads it. `read`: the finished
    buckets (their gradients are read in place of running their plans)."""
    state.step += 1
    passes.clock.step = state.step
    extra = {t: carried[name] for name, t, _ in passes.gradients if name in carried} if carried else None
    env = dict(state.accum) if not extra else {k: v + extra[k] if k in extra else v for k, v in state.accum.items()}
    run_ops(passes.update, backend, state, env, read=read, extra=extra)
    for _, t, fetched in passes.gradients:
        if t in env:
            state.fetched[fetched] = env[t]
    state.accum.clear()


def sync_gradients(passes: Passes, backend: Backend, state: DeviceState,
                   read: BucketSync | None = None) -> dict[str, torch.Tensor]:
    """The gradient-synchronisation part of the update alone (HP -> HD), then the accumulators
    reset: this device's synchronised gradient pieces by parameter name, what a mid-step switch
    carries to the next strategy with the weights. Every rank runs the same subsequence of its
    update, so collectives stay matched; each result is copied at once (a backend may reuse its
    buffers in the next collective)."""
    env = dict(state.accum)
    names = {t: name for name, t, _ in passes.gradients}
    out = {}
    for op in passes.update:
        if op.out in names and op.code in (COMM, IDENTITY):
            run_ops((op,), backend, state, env, read=read)
            if op.out in env:
                out[names[op.out]] = env[op.out].clone()
    state.accum.clear()
    return out


def step_loss(backend: Backend, local: torch.Tensor | None, summand: bool, devices: Group) -> float:
    """The step loss on every rank of `devices`: the sum of the summands' values (one holder per
    distinct piece); a rank that holds no summand adds zero."""
    device = backend.device
    value = local.detach().reshape(()).to(device, torch.float64) if summand and local is not None else \
        torch.zeros((), dtype=torch.float64, device=device)
    total = backend.all_reduce(value, devices)
    return float("nan") if total.is_meta else float(total)  # a stand-in device holds no values


class NonBlockingSends(Backend):
    """A backend whose exchanges post their sends and only wait for their receives.

    Uses the wrapped backend's `post_sends(sends) -> handle with wait()` where it has one (the
    torch.distributed backend); backends without it must already send without blocking (the
    in-process backend posts into mailboxes). `wait_sends()` completes everything posted."""

    def __init__(self, inner: Backend):
        self.inner, self.rank, self.world_size, self.device = inner, inner.rank, inner.world_size, inner.device
        self.overlaps_collectives = inner.overlaps_collectives
        self.emulator = emulation_of(inner)  # an emulated device's (runtime.execution.emulation)
        self._post = getattr(inner, "post_sends", None)
        self._pending: list[tuple[object, object, int]] = []  # (tag, handle, bytes)
        self.tag: object = None  # what the sends posted now belong to (run_schedule: the action)
        self._previous_backward: object = None

    def _start(self, sends: Mapping[int, torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in sends.values())
        self._pending.append((self.tag, self._post(dict(sends)), nbytes))

    def exchange(self, sends: Mapping[int, torch.Tensor],
                 recvs: Mapping[int, tuple[Shape, torch.dtype]]) -> dict[int, torch.Tensor]:
        if self._post is None or self.rank in sends:
            return self.inner.exchange(sends, recvs)
        if sends:
            self._start(sends)
        return self.inner.exchange({}, recvs) if recvs else {}

    @property
    def pending(self) -> int:
        """Posted sends whose buffers are still held (their receivers may not have them yet)."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return sum(n for _, _, n in self._pending)

    def release_completed(self) -> None:
        """Drop the sends that have completed (without waiting for any)."""
        if self._pending:
            self._pending = [p for p in self._pending if not (hasattr(p[1], "done") and p[1].done())]

    def action_done(self, kind: str, micro_batch: int) -> None:
        """After a schedule action: once B(m) ran, F(m)'s sends have arrived (the gradient came
        back, so later stages have its outputs) and so have the previous backward's (the earlier
        stage needs nothing more from this one to take them); drop those and any completed."""
        if kind != FORWARD:
            self.complete((FORWARD, micro_batch))
            if self._previous_backward is not None:
                self.complete(self._previous_backward)
            self._previous_backward = (kind, micro_batch)
        self.release_completed()

    def complete(self, tag: object) -> None:
        """Complete the sends posted under `tag` (their receivers are known to have them) and drop them."""
        if not self._pending:
            return
        for t, handle, _ in self._pending:
            if t == tag:
                handle.wait()
        self._pending = [p for p in self._pending if p[0] != tag]

    def exchange_into(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        if self._post is None and sends:
            # the in-process backend's exchange posts copies without waiting (exchange_into would wait)
            got = self.inner.exchange(sends, {p: (tuple(t.shape), t.dtype) for p, t in recvs.items()})
            for peer, out in recvs.items():
                out.copy_(got[peer])
        elif self._post is None or self.rank in sends:
            self.inner.exchange_into(sends, recvs)
        else:
            if sends:
                self._start(sends)
            if recvs:
                self.inner.exchange_into({}, recvs)

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for _, handle, _ in pending:
            handle.wait()

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        self.inner.prepare_groups(groups)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        return self.inner.all_reduce(tensor, group)

    def all_reduce_start(self, tensor: torch.Tensor, group: Group) -> Pending:
        return self.inner.all_reduce_start(tensor, group)

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        return self.inner.all_gather(tensor, group, shapes)

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor, op: str = "sum") -> None:
        self.inner.all_reduce_into(tensor, group, out, op)

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        self.inner.all_gather_into(tensor, group, outs)

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor,
                            op: str = "sum") -> None:
        self.inner.reduce_scatter_into(parts, group, out, op)

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        return self.inner.reduce_scatter(parts, group)

    def barrier(self, group: Group) -> None:
        self.inner.barrier(group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        return self.inner.broadcast(tensor, src, group)


@dataclass(frozen=True)
class ScheduleRun:
    """What running one stage's order measured, after each action: micro-batches run; the most
    whose activations were held at once (peak_in_flight); the most posted sends whose buffers
    were held at once (peak_pending_sends); and the most bytes held at once by both, counted from
    the tensors themselves (activation storages, shared ones once, weights and fed inputs
    excluded; send buffers); and the wall seconds from the first action to the last send
    completed (what a pipeline's share of a step costs, without the gradient sync and update)."""

    micro_batches: int
    peak_in_flight: int
    peak_pending_sends: int = 0
    peak_held_bytes: int = 0
    seconds: float = 0.0


def run_schedule(order: Sequence[Action], backend: Backend, state: DeviceState, passes: Callable[[int], Passes],
                 feeds: Callable[[int], Mapping[str, torch.Tensor]], tracer: Tracer | None = None,
                 buckets: BucketSync | None = None, measure: bool = True) -> ScheduleRun:
    """Run `order` on this device: F(m) runs the forward pass of micro-batch m under passes(m)
    fed by feeds(m) (this device's pieces), B(m) its backward pass; gradients accumulate in
    `state`. Sends posted along the way are completed before returning. A `tracer` records one
    event per action. `buckets`: the last backward of the order fills them and starts their
    all-reduces (hspmd.runtime.execution.buckets). `measure`: count the activation bytes held
    after each action (ScheduleRun.peak_held_bytes; it walks every kept tensor)."""
    began = time.perf_counter()
    micro_batches = len({a.micro_batch for a in order})
    check_order(order, micro_batches)
    sender = NonBlockingSends(backend)
    live: dict[int, MicroBatch] = {}
    given = {_storage(t) for t in state.leaves.values()} if measure else set()  # not the stage's buffers
    peak = peak_sends = peak_bytes = 0
    last_backward = max((i for i, a in enumerate(order) if a.kind != FORWARD), default=-1)
    for i, action in enumerate(order):
        m = action.micro_batch
        sender.tag = (action.kind, m)
        with tracer.span(str(action), "compute", micro_batch=m) if tracer else nullcontext():
            if action.kind == FORWARD:
                fed = feeds(m)
                if measure:
                    given.update(_storage(t) for t in fed.values())
                live[m] = forward(passes(m), sender, state, fed)
            else:
                backward(sender, state, live.pop(m), buckets if i == last_backward else None)
        sender.action_done(action.kind, m)
        peak = max(peak, sum(1 for mb in live.values() if mb.env))
        peak_sends = max(peak_sends, sender.pending)
        if measure:
            peak_bytes = max(peak_bytes, _activation_bytes(live.values(), given) + sender.pending_bytes)
    with tracer.span("wait sends", "comm") if tracer else nullcontext():
        sender.wait_sends()
    return ScheduleRun(micro_batches, peak, peak_sends, peak_bytes, time.perf_counter() - began)


def run_step(order: Sequence[Action], backend: Backend, state: DeviceState, passes: Callable[[int], Passes],
             feeds: Callable[[int], Mapping[str, torch.Tensor]], last: Passes, buckets: BucketSync | None = None,
             tracer: Tracer | None = None, carried: Mapping[str, torch.Tensor] | None = None,
             sync_only: bool = False, measure: bool = True) -> tuple[ScheduleRun, dict[str, torch.Tensor] | None]:
    """One step of this rank: its stage's `order` (run_schedule), then the update of `last` (the
    passes under the step's own binding) reading the gradient buckets as it reaches them, then
    every bucket settled. `sync_only`: the gradient synchronisation without the optimizer (a
    bucket of a step that continues under another strategy); its synchronised gradients by
    parameter name are returned with the ScheduleRun (else None). On an error the all-reduces
    under way are dropped with the step (the next begin() forgets them)."""
    state.fetched.clear()
    if buckets is not None:
        buckets.begin()
        buckets.tracer = tracer
    run = run_schedule(order, backend, state, passes, feeds, tracer, buckets, measure)
    synced = None
    with tracer.span("update", "update") if tracer else nullcontext():
        if buckets is not None:
            buckets.finish(backend)  # starts every bucket not started yet
        if sync_only:
            synced = sync_gradients(last, backend, state, buckets)
        else:
            update(last, backend, state, carried, buckets)
        if buckets is not None:
            buckets.settle()
    return run, synced


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _activation_bytes(micro_batches: Iterable[MicroBatch], given: set[int]) -> int:
    """Bytes of the distinct storages the micro-batches' values hold, `given` ones excluded."""
    seen: dict[int, int] = {}
    for mb in micro_batches:
        for t in mb.env.values():
            key = _storage(t)
            if key not in given:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


__all__ = [
    "ASSIGN", "COMM", "COMPUTE", "Clock", "DeviceState", "IDENTITY", "LEAF", "Lowered", "MicroBatch",
    "NonBlockingSends", "PLACEHOLDER", "Passes", "ScheduleRun", "backward", "forward", "run_ops", "run_schedule", "run_step",
    "step_loss", "sync_gradients", "update",
]
