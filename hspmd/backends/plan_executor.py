"""Run a communication plan (hspmd.comm_resolve) on one rank, over any Backend.

The same per-rank code serves every primitive: for each step a device that assembled_on its piece
allocates its destination piece (zeros), runs the sub-collectives it is a member of in the plan's
global order, then does its local copies and one batched exchange for its messages. Results are
clipped to the destination piece, so a device never allocates more than the boxes it touches.

With torch.distributed, every rank must first create the plan's groups collectively:
`backend.prepare_groups(plan.collective_groups())`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import torch

from hspmd.annotations import Annotation, Box, Piece, box_intersection, box_relative, box_shape, device_pieces
from hspmd.comm_resolve.collectives import tiles
from hspmd.comm_resolve.plan import Collective, FusedPlan, Plan, Step, Transfer
from hspmd.comm_resolve.slices import box_volume
from hspmd.errors import ShapeError, ShapeTypeError
from hspmd.limits import brief
from hspmd.backends.backend import Backend
from hspmd.backends.local import run_on_devices


@lru_cache(maxsize=4096)
def _pieces(ann: Annotation, shape: tuple[int, ...]) -> dict[int, Piece]:
    return device_pieces(ann, shape)


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

    def empty(self, shape) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=self.dtype, device=self.device)


def _check_local(local: torch.Tensor | None, piece: Piece | None, dtype: torch.dtype, device: int, what: str) -> None:
    if piece is None:
        return
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


def _run_collective(c: Collective, backend: Backend, local, src: Box | None, out, dst: Box, buf: Buffers) -> None:
    me = backend.rank
    gives_zeros = me in c.zero_inputs or src is None
    if c.kind == "all_reduce":
        value = buf.zeros(box_shape(c.box)) if gives_zeros else _cut(local, src, c.box, buf)
        _write(out, dst, c.box, backend.all_reduce(value.contiguous(), c.devices))
    elif c.kind == "all_gather":
        mine = c.parts[c.devices.index(me)]
        value = _cut(local, src, mine, buf) if src is not None else buf.zeros(box_shape(mine))
        shapes = [tuple(box_shape(p)) for p in c.parts]
        for part, got in zip(c.parts, backend.all_gather(value.contiguous(), c.devices, shapes)):
            _write(out, dst, part, got)
    else:
        parts = [
            buf.zeros(box_shape(p)) if gives_zeros else _cut(local, src, p, buf).contiguous()
            for p in c.parts
        ]
        _write(out, dst, c.parts[c.devices.index(me)], backend.reduce_scatter(parts, c.devices))


@lru_cache(maxsize=4096)
def _tiling_dim(parts: tuple[Box, ...], box: Box) -> int | None:
    """The dim along which `parts`, in their order, lie back to back and fill `box` exactly (each
    spanning `box` on every other dim), or None: then concatenating the parts builds `box`."""
    for d in range(len(box)):
        edge = box[d][0]
        for part in parts:
            if any(part[i] != box[i] for i in range(len(box)) if i != d) or part[d][0] != edge:
                break
            edge = part[d][1]
        else:
            if edge == box[d][1]:
                return d
    return None


@lru_cache(maxsize=4096)
def _fills(parts: tuple[Box, ...], box: Box) -> bool:
    return tiles(box, parts)


def _leading(shape: tuple[int, ...], dim: int) -> bool:
    """True when blocks along `dim` are contiguous runs of a row-major tensor of `shape`."""
    return all(n == 1 for n in shape[:dim])


def _sole_collective(step: Step, me: int) -> Collective | None:
    """The step's only collective for this device when no message or local copy touches it."""
    mine = [c for c in step.collectives if me in c.devices]
    if len(mine) != 1 or any(me in (t.src, t.dst) for t in step.transfers):
        return None
    return mine[0]


def _collective_result(c: Collective, backend: Backend, local, src: Box | None, dst: Piece, buf: Buffers):
    """The destination piece straight from the backend, when the collective's result is exactly
    that piece (no zeros to fill and no copy into them); None when it is not."""
    me = backend.rank
    gives_zeros = me in c.zero_inputs or src is None
    if c.kind == "all_reduce" and c.box == dst.box:
        value = buf.zeros(box_shape(c.box)) if gives_zeros else _cut(local, src, c.box, buf)
        return backend.all_reduce(value, c.devices)
    if c.kind == "reduce_scatter" and c.parts[c.devices.index(me)] == dst.box:
        parts = [buf.zeros(box_shape(p)) if gives_zeros else _cut(local, src, p, buf) for p in c.parts]
        return backend.reduce_scatter(parts, c.devices)
    if c.kind != "all_gather" or not _fills(c.parts, dst.box):
        return None
    mine = c.parts[c.devices.index(me)]
    value = _cut(local, src, mine, buf) if src is not None else buf.zeros(box_shape(mine))
    shapes = [tuple(box_shape(p)) for p in c.parts]
    dim = _tiling_dim(c.parts, dst.box)
    if dim is not None and _leading(dst.shape, dim):
        return backend.all_gather_joined(value.contiguous(), c.devices, shapes).reshape(dst.shape)
    out = buf.empty(dst.shape)  # every element is written: the parts tile the piece
    for part, got in zip(c.parts, backend.all_gather(value.contiguous(), c.devices, shapes)):
        _write(out, dst.box, part, got)
    return out


def _exchange(
    transfers: tuple[Transfer, ...],
    backend: Backend,
    sources: Mapping[int, tuple[torch.Tensor, Box]],
    targets: Mapping[int, tuple[torch.Tensor, Box]],
    bufs: Mapping[int, Buffers],
) -> None:
    """Local copies and one batched exchange; `sources`/`targets` map tensor id -> (tensor, box),
    `bufs` tensor id -> its buffers (dtype). A message mixing dtypes travels as bytes."""
    me = backend.rank
    sends, recvs, incoming = {}, {}, {}
    for t in transfers:
        if t.src == me and t.dst == me:
            for tid, box in zip(t.tensors, t.boxes):
                if tid in targets:
                    value = _cut(sources[tid][0], sources[tid][1], box, bufs[tid])
                    _write(targets[tid][0], targets[tid][1], box, value)
        elif t.src == me:
            wire = _wire_dtype(t, bufs)
            chunks = [_flat(_cut(sources[tid][0], sources[tid][1], box, bufs[tid]), wire)
                      for tid, box in zip(t.tensors, t.boxes)]
            device = next(iter(bufs.values())).device
            sends[t.dst] = torch.cat(chunks) if chunks else torch.zeros(0, dtype=wire, device=device)
        elif t.dst == me:
            n = t.elements if _single_dtype(t, bufs) else _nbytes(t, bufs)
            recvs[t.src] = ((n,), _wire_dtype(t, bufs))
            incoming[t.src] = t
    if not sends and not recvs:
        return
    got = backend.exchange(sends, recvs)
    for peer, t in incoming.items():
        offset, mixed = 0, not _single_dtype(t, bufs)
        for tid, box in zip(t.tensors, t.boxes):
            dtype = bufs[tid].dtype
            n = box_volume(box) * (_itemsize(dtype) if mixed else 1)
            chunk = got[peer][offset : offset + n]
            if mixed:
                chunk = chunk.clone().view(dtype)
            _write(targets[tid][0], targets[tid][1], box, chunk.reshape(box_shape(box)))
            offset += n


def _single_dtype(t: Transfer, bufs: Mapping[int, Buffers]) -> bool:
    return len({bufs[tid].dtype for tid in t.tensors}) <= 1


def _wire_dtype(t: Transfer, bufs: Mapping[int, Buffers]) -> torch.dtype:
    """The message's element type: its tensors' dtype, or bytes when they differ."""
    return bufs[t.tensors[0]].dtype if t.tensors and _single_dtype(t, bufs) else torch.uint8


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(t: Transfer, bufs: Mapping[int, Buffers]) -> int:
    return sum(box_volume(box) * _itemsize(bufs[tid].dtype) for tid, box in zip(t.tensors, t.boxes))


def _flat(value: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    flat = value.reshape(-1)
    return flat if flat.dtype == wire else flat.contiguous().view(wire)


def _only_copies_own_piece(transfers, me: int, tid: int, src: Piece | None, dst: Piece) -> bool:
    """True when the device's only part in tensor `tid` is copying its whole piece to itself."""
    mine = [(t, b) for t in transfers if me in (t.src, t.dst) for x, b in zip(t.tensors, t.boxes) if x == tid]
    return (
        src is not None and src.box == dst.box and src.summand == dst.summand and len(mine) == 1
        and mine[0][0].src == mine[0][0].dst == me and mine[0][1] == dst.box
    )


def execute_step(step: Step, shape: tuple[int, ...], dtype: torch.dtype, backend: Backend, local):
    me = backend.rank
    buf = Buffers.for_rank(dtype, backend, (local,))
    src, dst = _pieces(step.src, shape).get(me), _pieces(step.dst, shape).get(me)
    if me not in step.assembled_on:
        sending = [t for t in step.transfers if t.src == me]
        if sending:
            _exchange(tuple(sending), backend, {0: (local, src.box)}, {}, {0: buf})
        return local if dst is not None else None
    if _only_copies_own_piece(step.transfers, me, 0, src, dst) and not any(me in c.devices for c in step.collectives):
        return local
    src_box = src.box if src is not None else None
    sole = _sole_collective(step, me)
    if sole is not None:
        out = _collective_result(sole, backend, local, src_box, dst, buf)
        if out is not None:
            return out
    out = buf.zeros(dst.shape)
    for c in step.collectives:
        if me in c.devices:
            _run_collective(c, backend, local, src_box, out, dst.box, buf)
    _exchange(step.transfers, backend, {0: (local, src_box)}, {0: (out, dst.box)}, {0: buf})
    return out


def execute_plan(plan: Plan, backend: Backend, local: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of `plan`: its source piece in, its destination piece out (None if the
    rank holds no destination piece)."""
    me, dtype = backend.rank, _torch_dtype(plan.dtype)
    _check_local(local, _pieces(plan.src, plan.shape).get(me), dtype, me, f"source {plan.src}")
    for step in plan.steps:
        local = execute_step(step, plan.shape, dtype, backend, local)
    return local if me in plan.dst.devices else None


def execute_fused_plan(plan: FusedPlan, backend: Backend, locals_: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """This rank's part of a fused multi-tensor plan: {tensor index: source piece} in,
    {tensor index: destination piece} out, each tensor in its own dtype. A failed device of the
    plan takes no part (its pieces are not read, it receives nothing)."""
    me = backend.rank
    if me in plan.failed:
        return {}
    device = Buffers.for_rank(torch.float32, backend, locals_.values()).device
    bufs = {tid: Buffers(_torch_dtype(m.dtype), device) for tid, m in enumerate(plan.moves)}
    sources, targets, out = {}, {}, {}
    for tid, move in enumerate(plan.moves):
        src, dst = _pieces(move.src, move.shape).get(me), _pieces(move.dst, move.shape).get(me)
        _check_local(locals_.get(tid), src, bufs[tid].dtype, me, f"tensor {tid} ({move.src})")
        if src is not None:
            sources[tid] = (locals_[tid], src.box)
        if dst is None:
            continue
        if _only_copies_own_piece(plan.transfers, me, tid, src, dst):
            out[tid] = locals_[tid]
        else:
            out[tid] = bufs[tid].zeros(dst.shape)
            targets[tid] = (out[tid], dst.box)
    _exchange(plan.transfers, backend, sources, targets, bufs)
    return out


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
