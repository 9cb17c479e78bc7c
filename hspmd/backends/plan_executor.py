"""Run a communication plan (hspmd.comm_resolve) on one rank, over any Backend.

A rank runs its part of the plan (comm_resolve/plan_part.py: a whole plan is cut to it once). The
same per-rank code serves every primitive: for each step in which the device assembles its piece,
it allocates its destination piece (empty when the step writes all of it, else zeros), runs the
sub-collectives it is a member of in the plan's global order, then does its local copies and its
messages, round by round. Results are clipped to the destination piece.

Memory: collectives write straight into views of the destination piece (Backend.*_into) and
messages are sent from views of the source and land in views of the destination wherever those
are contiguous, so during a step a device holds its source piece, its destination piece and at
most one message-sized buffer each way (`memory_bound` states it per device; tests/test_reshard_
memory.py checks it over random plans).

With torch.distributed, every rank must first create the plan's groups collectively:
`backend.prepare_groups(plan.collective_groups())`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from hspmd.annotations import Box, Piece, box_intersection, box_relative, box_shape
from hspmd.comm_resolve.plan import Collective, FusedPlan, Plan, Transfer
from hspmd.comm_resolve.plan_part import (
    Exchange, PlanPart, StepPart, keeps_own_piece, part_of, piece_of, tiled, transfers_part,
)
from hspmd.comm_resolve.slices import box_contains, box_volume
from hspmd.errors import HSPMDError, ShapeError, ShapeTypeError
from hspmd.limits import brief
from hspmd.backends.backend import IDENTITY, Backend
from hspmd.backends.local import run_on_devices


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass(frozen=True)
class Buffers:
    """How this rank makes buffers: the plan's dtype, on the device of the pieces it works with
    (the backend's device when it holds none), so a plan never moves data to another device."""

    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def for_rank(dtype: torch.dtype, backend: Backend, pieces) -> "Buffers":
        held = next((t for t in pieces if t is not None), None)
        return Buffers(dtype, held.device if held is not None else backend.device)

    def zeros(self, shape) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=self.dtype, device=self.device)

    def identity(self, shape, reduce: str) -> torch.Tensor:
        """A buffer holding the identity of `reduce` (zeros for sums and averages, ones for products)."""
        return torch.full(tuple(shape), IDENTITY.get(reduce, 0.0), dtype=self.dtype, device=self.device)

    def empty(self, shape) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=self.dtype, device=self.device)



def _check_local(local: torch.Tensor | None, piece: Piece | None, dtype: torch.dtype, device: int,
                 what: Callable[[], str]) -> None:
    """Raise ShapeError unless `local` fits `piece`; `what()` names the layout, made only for the
    error (printing an annotation on every executed plan cost more than the check)."""
    if piece is None:
        return
    if local is not None and tuple(local.shape) == tuple(piece.shape) and local.dtype == dtype:
        return
    what = what()
    if local is None:
        raise ShapeError(f"device {device} holds a piece of {what} but was given no local tensor")
    if tuple(local.shape) != tuple(piece.shape):
        raise ShapeError(f"device {device}: local tensor has shape {tuple(local.shape)}, {what} gives it {piece.shape}")
    if local.dtype != dtype:
        raise ShapeError(
            f"device {device}: local tensor is {local.dtype} but the plan was made for {dtype}; "
            f"resolve with dtype={str(local.dtype).removeprefix('torch.')!r}"
        )


def _cut(tensor: torch.Tensor, held: Box, box: Box, buf: Buffers) -> torch.Tensor:
    """`box` (global coordinates) out of a tensor holding `held`; an empty box needs no data."""
    if any(stop <= start for start, stop in box):
        return buf.zeros(box_shape(box))
    return tensor[box_relative(box, held)]


def _write(out: torch.Tensor, held: Box, region: Box, value: torch.Tensor) -> None:
    """Write the part of `value` (covering `region`) that falls inside `held`."""
    common = box_intersection(region, held)
    if common is not None:
        out[box_relative(common, held)] = value[box_relative(common, region)]


def _target(out: torch.Tensor, held: Box, region: Box, buf: Buffers) -> tuple[torch.Tensor, bool]:
    """Where a result covering `region` is written: the view of `out` when `region` lies inside
    `held` (no copy), else a buffer of its own (True: clip it into `out` afterwards)."""
    if box_contains(held, region):
        return out[box_relative(region, held)], False
    return buf.empty(box_shape(region)), True


def _run_collective(c: Collective, backend: Backend, local, src: Box | None, out, dst: Box, buf: Buffers,
                    zero: torch.Tensor | None, reduce: str = "sum") -> None:
    """Run one sub-collective straight into this rank's destination piece `out` (holding `dst`),
    reducing by `reduce`; a member without a summand contributes `zero` (one element: the
    reduction's identity) broadcast to the shape."""
    me = backend.rank
    gives_zeros = me in c.zero_inputs or src is None
    if c.kind == "all_gather":
        mine = c.parts[c.devices.index(me)]
        value = zero.expand(box_shape(mine)) if src is None else _cut(local, src, mine, buf)
        targets = [_target(out, dst, part, buf) for part in c.parts]
        backend.all_gather_into(value, c.devices, [t for t, _ in targets])
        for part, (t, own) in zip(c.parts, targets):
            if own:
                _write(out, dst, part, t)
        return
    if c.kind == "all_reduce":
        region = c.box
        value = zero.expand(box_shape(c.box)) if gives_zeros else _cut(local, src, c.box, buf)
    else:
        region = c.parts[c.devices.index(me)]
        value = [zero.expand(box_shape(p)) if gives_zeros else _cut(local, src, p, buf) for p in c.parts]
    target, own = _target(out, dst, region, buf)
    if c.kind == "all_reduce":
        backend.all_reduce_into(value, c.devices, target, reduce)
    else:
        backend.reduce_scatter_into(value, c.devices, target, reduce)
    if own:
        _write(out, dst, region, target)


def _exchange(
    copies: tuple[Transfer, ...],
    exchanges: tuple[Exchange, ...],
    backend: Backend,
    sources: Mapping[int, tuple[torch.Tensor, Box]],
    targets: Mapping[int, tuple[torch.Tensor, Box]],
    bufs: Mapping[int, Buffers],
) -> None:
    """This device's local copies, then its messages round by round (`exchanges`: its (send,
    receive) in each round it takes part in, from plan_part.transfers_part, in the rounds every
    device agrees on); `sources`/`targets` map tensor id -> (tensor, box), `bufs` tensor id -> its
    buffers (dtype). A message mixing dtypes travels as bytes. A message is sent from a view of
    its source when it is one contiguous box, and lands straight in its destination when that is
    one contiguous box: otherwise through one buffer."""
    for t in copies:
        for tid, box in zip(t.tensors, t.boxes):
            if tid in targets:
                value = _cut(sources[tid][0], sources[tid][1], box, bufs[tid])
                _write(targets[tid][0], targets[tid][1], box, value)
    for send, recv in exchanges:
        sends = {send.dst: _outgoing(send, sources, bufs)} if send is not None else {}
        landing, staged = _landing(recv, targets, bufs) if recv is not None else (None, False)
        backend.exchange_into(sends, {recv.src: landing} if recv is not None else {})
        if staged:
            _unpack(recv, landing, targets, bufs)
        del sends, landing  # before the next round's buffers exist


def _outgoing(t: Transfer, sources, bufs: Mapping[int, Buffers]) -> torch.Tensor:
    """The flat message of transfer `t`: a view of the source when it is one contiguous box of
    the wire dtype, else one buffer the boxes are copied into."""
    wire = _wire_dtype(t, bufs)
    chunks = [_cut(sources[tid][0], sources[tid][1], box, bufs[tid]) for tid, box in zip(t.tensors, t.boxes)]
    if len(chunks) == 1 and chunks[0].dtype == wire and chunks[0].is_contiguous():
        return chunks[0].view(-1)
    message = torch.empty(_wire_length(t, bufs), dtype=wire, device=_device(bufs))
    offset = 0
    for chunk in chunks:
        value = chunk if chunk.dtype == wire else _as_bytes(chunk)
        n = value.numel()
        message[offset : offset + n].view(value.shape).copy_(value)
        offset += n
    return message


def _landing(t: Transfer, targets, bufs: Mapping[int, Buffers]) -> tuple[torch.Tensor, bool]:
    """Where transfer `t` is received: its box's view of the destination when that is one
    contiguous box of one dtype (False), else a buffer unpacked afterwards (True)."""
    if len(t.boxes) == 1 and t.tensors[0] in targets:
        out, held = targets[t.tensors[0]]
        if box_contains(held, t.boxes[0]):
            view = out[box_relative(t.boxes[0], held)]
            if view.is_contiguous():
                return view.view(-1), False
    return torch.empty(_wire_length(t, bufs), dtype=_wire_dtype(t, bufs), device=_device(bufs)), True


def _unpack(t: Transfer, message: torch.Tensor, targets, bufs: Mapping[int, Buffers]) -> None:
    mixed = not _single_dtype(t, bufs)
    offset = 0
    for tid, box in zip(t.tensors, t.boxes):
        dtype = bufs[tid].dtype
        n = box_volume(box) * (_itemsize(dtype) if mixed else 1)
        chunk = message[offset : offset + n]
        offset += n
        out, held = targets[tid]
        if not mixed:
            _write(out, held, box, chunk.view(box_shape(box)))
        elif box_contains(held, box):
            region = _as_bytes(out[box_relative(box, held)])
            region.copy_(chunk.view(region.shape))
        else:
            _write(out, held, box, chunk.clone().view(dtype).view(box_shape(box)))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of `t` (last dim widened by the item size), for messages mixing dtypes."""
    t = t.unsqueeze(0) if t.dim() == 0 else t
    return (t if t.stride(-1) == 1 else t.contiguous()).view(torch.uint8)


def _device(bufs: Mapping[int, Buffers]) -> torch.device:
    return next(iter(bufs.values())).device


def _wire_length(t: Transfer, bufs: Mapping[int, Buffers]) -> int:
    return t.elements if _single_dtype(t, bufs) else _nbytes(t, bufs)


def _single_dtype(t: Transfer, bufs: Mapping[int, Buffers]) -> bool:
    return len({bufs[tid].dtype for tid in t.tensors}) <= 1


def _wire_dtype(t: Transfer, bufs: Mapping[int, Buffers]) -> torch.dtype:
    """The message's element type: its tensors' dtype, or bytes when they differ."""
    return bufs[t.tensors[0]].dtype if t.tensors and _single_dtype(t, bufs) else torch.uint8


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(t: Transfer, bufs: Mapping[int, Buffers]) -> int:
    return sum(box_volume(box) * _itemsize(bufs[tid].dtype) for tid, box in zip(t.tensors, t.boxes))


def execute_step(step: StepPart, dtype: torch.dtype, backend: Backend, local, reduce: str = "sum"):
    """One step of this rank's part of a plan: its tensor before the step in, after it out."""
    buf = Buffers.for_rank(dtype, backend, (local,))
    src_box = step.src.box if step.src is not None else None
    if not step.assembles:
        if step.exchanges:
            _exchange((), step.exchanges, backend, {0: (local, src_box)}, {}, {0: buf})
        return local if step.dst is not None else None
    out = buf.empty(step.dst.shape) if step.covered else buf.identity(step.dst.shape, reduce)
    zero = None  # the reduction's identity, one element, for a member without a value
    if any(backend.rank in c.zero_inputs or src_box is None for c in step.collectives):
        zero = buf.identity((), reduce)
    for c in step.collectives:
        _run_collective(c, backend, local, src_box, out, step.dst.box, buf, zero, reduce)
    _exchange(step.copies, step.exchanges, backend, {0: (local, src_box)}, {0: (out, step.dst.box)}, {0: buf})
    return out


def execute_plan(plan: Plan | PlanPart, backend: Backend, local: torch.Tensor | None,
                 reduce: str = "sum") -> torch.Tensor | None:
    """This rank's part of `plan` (a whole plan is cut to it first, once: plan_part.part_of): its
    source piece in, its destination piece out (None if the rank holds no destination piece).
    Partial values combine by the plan's reduction (Plan.reduction, read off its layouts);
    `reduce` names one for a plan between sum layouts (comm(..., reduce="max")), which then runs
    on all-reduces alone (Partial -> Duplicate, SplitAllReduce)."""
    me = backend.rank
    part = part_of(plan, me) if isinstance(plan, Plan) else plan
    if part.device != me:
        raise HSPMDError(f"rank {me} was given device {part.device}'s part of the plan {part.label}")
    dtype = _torch_dtype(part.dtype)
    _check_local(local, part.src, dtype, me, lambda: f"source {part.source}")
    if reduce != "sum" and part.reduction not in ("sum", reduce):
        raise HSPMDError(f"{part.label} combines partial values by {part.reduction}, and a {reduce} reduction "
                         f"was asked for; state one reduction, in the layouts (P({reduce}):n)")
    if reduce != "sum" and part.reduction == "sum" and set(part.collective_kinds) - {"all_reduce"}:
        raise HSPMDError(f"a {reduce} reduction runs on all-reduces only, and {part.label} resolves to "
                         f"{' + '.join(part.collective_kinds)}; reshard to a layout the partial values all-reduce into")
    reduce = part.reduction if reduce == "sum" else reduce
    for step in part.steps:
        local = execute_step(step, dtype, backend, local, reduce)
    return local if part.holds_result else None


def execute_fused_plan(plan: FusedPlan, backend: Backend, locals_: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """This rank's part of a fused multi-tensor plan: {tensor index: source piece} in,
    {tensor index: destination piece} out, each tensor in its own dtype. A failed device of the
    plan takes no part (its pieces are not read, it receives nothing)."""
    me = backend.rank
    if me in plan.failed:
        return {}
    device = Buffers.for_rank(torch.float32, backend, locals_.values()).device
    bufs = {tid: Buffers(_torch_dtype(m.dtype), device) for tid, m in enumerate(plan.moves)}
    copies, exchanges = transfers_part(plan.transfers, me)
    sources, targets, out = {}, {}, {}
    for tid, move in enumerate(plan.moves):
        src, dst = piece_of(move.src, move.shape, me), piece_of(move.dst, move.shape, me)
        _check_local(locals_.get(tid), src, bufs[tid].dtype, me, lambda: f"tensor {tid} ({move.src})")
        if src is not None:
            sources[tid] = (locals_[tid], src.box)
        if dst is None:
            continue
        if keeps_own_piece(copies, exchanges, tid, src, dst):
            out[tid] = locals_[tid]
        else:
            out[tid] = bufs[tid].empty(dst.shape) if _fused_covered(plan, me, tid, dst.box) else bufs[tid].zeros(dst.shape)
            targets[tid] = (out[tid], dst.box)
    _exchange(copies, exchanges, backend, sources, targets, bufs)
    return out


def _fused_covered(plan: FusedPlan, me: int, tid: int, dst: Box) -> bool:
    """True when the messages into this device write every element of tensor `tid`'s piece once."""
    regions = [box_intersection(b, dst) for t in plan.transfers if t.dst == me
               for x, b in zip(t.tensors, t.boxes) if x == tid]
    return tiled(dst, regions)


def run_plan(plan: Plan | FusedPlan, locals_: Mapping[int, object], timeout: float = 60.0) -> dict[int, object]:
    """Run `plan` in this process, one thread per device (hspmd.backends.local), and return the
    destination pieces: {device: tensor} for a Plan, {device: {tensor index: tensor}} for a FusedPlan.
    Buffers live on the device of the given pieces (e.g. `meta` to check a plan without data)."""
    _check_run_arguments(plan, locals_, timeout)
    device = _device_of(locals_)
    if isinstance(plan, FusedPlan):
        results = run_on_devices(lambda b: execute_fused_plan(plan, b, locals_.get(b.rank, {})), plan.devices, timeout,
                                 device)
        return {d: r for d, r in results.items() if r}
    results = run_on_devices(lambda b: execute_plan(plan, b, locals_.get(b.rank)), plan.devices, timeout, device)
    return {d: r for d, r in results.items() if r is not None}


def _device_of(locals_: Mapping[int, object]) -> torch.device:
    for value in locals_.values():
        for t in value.values() if isinstance(value, Mapping) else (value,):
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")


def _check_run_arguments(plan: object, locals_: object, timeout: object) -> None:
    if not isinstance(plan, (Plan, FusedPlan)):
        raise ShapeTypeError(f"run_plan needs a Plan or FusedPlan (from resolve), got {type(plan).__name__}")
    if not isinstance(locals_, Mapping):
        raise ShapeTypeError(f"run_plan needs a mapping {{device: local tensor}}, got {type(locals_).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ShapeTypeError(f"run_plan's timeout is a positive number of seconds, got {brief(timeout)}")
    for device, local in locals_.items():
        values = local.values() if isinstance(plan, FusedPlan) and isinstance(local, Mapping) else (local,)
        if not all(isinstance(v, torch.Tensor) for v in values):
            kind = "{tensor index: tensor}" if isinstance(plan, FusedPlan) else "a torch.Tensor"
            raise ShapeTypeError(f"run_plan: device {brief(device)} holds {brief(local)}, not {kind}")


def reshard_tensor(plan: Plan, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Shard the whole tensor `x` as the plan's source, run the plan in this process and return the
    destination reassembled (replicas checked): equal to `x` when the plan is right."""
    from hspmd.annotations import shard, unshard

    return unshard(run_plan(plan, shard(x, plan.src, seed=seed)), plan.dst, shape=plan.shape)


__all__ = ["execute_fused_plan", "execute_plan", "execute_step", "reshard_tensor", "run_plan"]
