"""Memory of running plans: the bound a device keeps while it runs one, and a tracker that
measures it.

`memory_bound(plan, device)` is what a device may allocate running a plan with the plan executor
(hspmd.backends.plan_executor), on top of the source piece its caller holds: per step, its
destination piece, the step's source piece when an earlier step of the plan made it, and the
largest message it sends plus the largest it receives (a device stages at most one message each
way at a time). For a one-step plan that is the issue's "source piece + destination piece + the
largest message", with the send and the receive of a round counted apart.

`LiveBytes` counts, on the thread that enters it, the bytes of tensor storages created while it
is active and still alive, checked after every torch operation: the in-process backend runs each
rank on its own thread, so each rank measures itself. Storages made by C++ worker threads (gloo's
own collective buffers) are not seen; benchmarks/bench_reshard_memory.py measures those with
torch's profiler.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hspmd.annotations import device_pieces
from hspmd.comm_resolve.plan import DTYPE_SIZES, FusedPlan, Plan, Step, Transfer
from hspmd.comm_resolve.slices import box_volume


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created on this thread while active that are still alive (`live`),
    the most at once (`peak`) and the largest single storage (`largest`)."""

    def __init__(self):
        super().__init__()
        self._storages: dict[StorageWeakRef, int] = {}
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in self._storages and ref not in inputs:  # views and in-place results are not new
                    self._storages[ref] = storage.nbytes()
                    self.largest = max(self.largest, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    @property
    def live(self) -> int:
        for ref in [r for r in self._storages if r.expired()]:
            del self._storages[ref]
        return sum(self._storages.values())


def memory_bound(plan: Plan | FusedPlan, device: int) -> int:
    """Bytes `device` may allocate while it runs `plan` (see the module docstring)."""
    if isinstance(plan, FusedPlan):
        sizes = [DTYPE_SIZES[m.dtype] for m in plan.moves]
        pieces = sum(_piece_bytes(m.dst, m.shape, device, size) for m, size in zip(plan.moves, sizes))
        return pieces + _largest_messages(plan.transfers, device, sizes)
    size = DTYPE_SIZES[plan.dtype]
    bound = 0
    for k, step in enumerate(plan.steps):
        held = _piece_bytes(step.src, plan.shape, device, size) if k else 0
        made = _piece_bytes(step.dst, plan.shape, device, size) if device in step.assembled_on else 0
        staged = max(_largest_collective_parts(step, device, size), _largest_messages(step.transfers, device, [size]))
        bound = max(bound, held + made + staged)
    return bound


def _piece_bytes(annotation, shape, device: int, size: int) -> int:
    piece = device_pieces(annotation, tuple(shape)).get(device)
    return 0 if piece is None else box_volume(piece.box) * size


def _largest_collective_parts(step: Step, device: int, size: int) -> int:
    """A collective member stages at most one part it sends and one it receives at a time, plus
    the one zero element a member without a summand broadcasts as its contribution."""
    out = 0
    for c in step.collectives:
        if device in c.devices:
            parts = c.parts if c.parts else (c.box,)
            out = max(out, 2 * max(box_volume(p) for p in parts) * size + size)
    return out


def _largest_messages(transfers: tuple[Transfer, ...], device: int, sizes) -> int:
    def nbytes(t: Transfer) -> int:
        return sum(box_volume(b) * sizes[tid if len(sizes) > 1 else 0] for tid, b in zip(t.tensors, t.boxes))

    sent = [nbytes(t) for t in transfers if t.src == device != t.dst]
    received = [nbytes(t) for t in transfers if t.dst == device != t.src]
    return max(sent, default=0) + max(received, default=0)


__all__ = ["LiveBytes", "memory_bound"]
