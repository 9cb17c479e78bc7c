"""Gradient synchronisation in size-capped buckets, started while the backward still runs.

The buckets are planned by hspmd.specialize.bucket_plan (pure data). `BucketSync`, one per
trainer or program runner, runs them. Each bucket is one flat buffer kept across steps; a
gradient that is one slot is a view of it, so the all-reduce needs no copy in or out; a gradient of
several slots (split) has a buffer of its own, kept too, whose boxes are copied into their buckets
when it is final and back when they are reduced. In the step's last backward the op that makes a
bucketed gradient writes it straight into its view (ops with `compute_into`, e.g. matmul; any other
op's result is copied in; with several micro-batches the accumulation `earlier + last` is the
write). Once a bucket's last gradient is in, and the buckets before it on the same group have
started, its all-reduce starts without blocking (Backend.all_reduce_start) and runs while the
backward goes on. The update reads the summed views in place of running those gradients' plans,
each read waiting only for its own buckets (`SyncedGradients`); since the optimizer adds its updates
in the order the backward finalises the gradients (hspmd.ops.optim), the first buckets' parameters
are updated while the last buckets are still being reduced; `settle` then waits for any bucket
the update did not read, before the next backward writes its buffer. On a backend whose start blocks until
the peers join (`overlaps_collectives` False: the in-process backend), every bucket starts at the
update instead: a blocking start mid-backward could wait on a peer that first needs this rank's
later sends (a weight tied across pipeline stages).

The synchronised gradients the update reads (and a trainer's fetched gradients) are views of the
buffers: valid until the next step's backward writes them again.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hspmd.errors import HSPMDError
from hspmd.backends.backend import Backend, Group, Pending
from hspmd.comm_resolve.bucketing import DEFAULT_BUCKET_CAP_MB, MiB
from hspmd.specialize.bucket_plan import BucketPlan
from hspmd.runtime.execution.trace import Tracer


def cap_bytes_of(cap_mb: float) -> int:
    """A bucket cap given in MiB (a trainer option) as bytes; a clear error for a bad value."""
    if isinstance(cap_mb, bool) or not isinstance(cap_mb, (int, float)) or not 0 < cap_mb < float("inf"):
        raise HSPMDError(f"bucket_cap_mb must be a positive number of MiB (or None to synchronise each gradient "
                         f"after the backward), got {cap_mb!r}")
    return max(1, int(cap_mb * MiB))


class BucketSync:
    """One device's bucket buffers (kept across steps) and the all-reduces of the step under way."""

    def __init__(self, plan: BucketPlan, device: torch.device | str):
        self.plan = plan
        self.tracer: Tracer | None = None
        self.buffers = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in plan.buckets]
        self._views: dict[int, torch.Tensor] = {}  # where the backward writes each gradient
        self._bucket_of: dict[int, list[int]] = {}
        self._copies: dict[int, list[tuple[torch.Tensor, tuple[slice, ...]]]] = {}  # split: (slot view, box)
        self._zeros: dict[int, list[torch.Tensor]] = {}  # slot views this device fills with zeros
        self._tensor_of_sync: dict[int, int] = {}  # sync node id -> the gradient it synchronises
        chains: dict[tuple[Group, torch.dtype], list[int]] = {}
        for k, (bucket, buffer) in enumerate(zip(plan.buckets, self.buffers)):
            chains.setdefault((bucket.group, bucket.dtype), []).append(k)
            for s in bucket.slots:
                slot = buffer[s.offset: s.offset + s.numel].view(s.shape)
                self._bucket_of.setdefault(s.tensor_id, []).append(k)
                self._tensor_of_sync[s.sync_node_id] = s.tensor_id
                if s.zero:
                    self._zeros.setdefault(s.tensor_id, []).append(slot)
                if s.box is None:
                    self._views[s.tensor_id] = slot
                else:
                    self._copies.setdefault(s.tensor_id, []).append((slot, tuple(slice(a, b) for a, b in s.box)))
        for tensor_id, copies in self._copies.items():  # a split gradient's own buffer: its whole piece
            shape = tuple(max(box[d].stop for _, box in copies) for d in range(copies[0][0].dim()))
            self._views[tensor_id] = torch.empty(shape, dtype=copies[0][0].dtype, device=device)
        self._chains = [chains[key] for key in sorted(chains, key=lambda key: (key[0], str(key[1])))]  # one order everywhere
        self._chain_of = {k: i for i, chain in enumerate(self._chains) for k in chain}
        self.begin()

    def begin(self) -> None:
        """Start a step: no gradient written, no bucket started (all-reduces a failed step left
        under way are dropped, as the step's values are)."""
        self._missing = [len(b.slots) for b in self.plan.buckets]
        self._next = [0] * len(self._chains)  # per chain: the first bucket not started yet
        self._pending: list[Pending | None] = [None] * len(self.plan.buckets)
        self._ready: set[int] = set()  # gradients whose buckets are waited for (and copied back, if split)

    def __contains__(self, tensor_id: int) -> bool:
        return tensor_id in self._views

    def view(self, tensor_id: int) -> torch.Tensor | None:
        """Where the backward writes this gradient (None: not bucketed)."""
        return self._views.get(tensor_id)

    def written(self, tensor_id: int, backend: Backend) -> None:
        """The gradient is final in its view: start every bucket of its chain that is full, in
        order, if the backend's start does not block (else they all start in finish())."""
        for slot, box in self._copies.get(tensor_id, ()):
            slot.copy_(self._views[tensor_id][box])
        for slot in self._zeros.get(tensor_id, ()):
            slot.zero_()
        for k in self._bucket_of[tensor_id]:
            self._missing[k] -= 1
            if backend.overlaps_collectives:
                self._start(self._chain_of[k], backend, only_full=True)

    def _start(self, c: int, backend: Backend, only_full: bool) -> None:
        chain = self._chains[c]
        while self._next[c] < len(chain):
            k = chain[self._next[c]]
            if self._missing[k]:
                if only_full:
                    return
                names = [s.gradient for s in self.plan.buckets[k].slots]
                raise HSPMDError(f"device {backend.rank}: {self._missing[k]} gradient(s) of bucket {k} ({names}) were "
                                 f"not made in this step's last backward")
            bucket = self.plan.buckets[k]
            if self.tracer is not None:
                with self.tracer.span(f"all-reduce bucket {k}", "comm", group=list(bucket.group), bytes=bucket.nbytes):
                    self._pending[k] = backend.all_reduce_start(self.buffers[k], bucket.group)
            else:
                self._pending[k] = backend.all_reduce_start(self.buffers[k], bucket.group)
            self._next[c] += 1

    def finish(self, backend: Backend) -> "SyncedGradients":
        """Start every bucket not started yet, in order: {sync node id: this device's synchronised
        piece}, what the update reads in place of those plans. A read waits only for the buckets
        of that gradient, so the update of the gradients synchronised first runs while the last
        buckets are still on the wire."""
        for c in range(len(self._chains)):
            self._start(c, backend, only_full=False)
        return SyncedGradients(self)

    def gradient(self, tensor_id: int) -> torch.Tensor:
        """Gradient `tensor_id` summed over its group: its buckets alone waited for, split boxes
        copied back (after finish())."""
        if tensor_id not in self._ready:
            for k in self._bucket_of[tensor_id]:
                if self._pending[k] is not None:
                    self._pending[k].wait()
                    self._pending[k] = None
            for slot, box in self._copies.get(tensor_id, ()):
                self._views[tensor_id][box].copy_(slot)
            self._ready.add(tensor_id)
        return self._views[tensor_id]

    def settle(self) -> None:
        """Wait for every bucket still under way (the update read them all: normally none), so that
        the next step's backward writes no buffer that is on the wire."""
        for tensor_id in self._bucket_of:
            self.gradient(tensor_id)


class SyncedGradients(Mapping[int, torch.Tensor]):
    """The bucketed gradients of one step by sync node id; reading one waits for its buckets alone."""

    def __init__(self, sync: BucketSync):
        self._sync = sync

    def __getitem__(self, sync_node_id: int) -> torch.Tensor:
        return self._sync.gradient(self._sync._tensor_of_sync[sync_node_id])

    def __contains__(self, sync_node_id: object) -> bool:  # without waiting (Mapping's reads the value)
        return sync_node_id in self._sync._tensor_of_sync

    def __iter__(self):
        return iter(self._sync._tensor_of_sync)

    def __len__(self) -> int:
        return len(self._sync._tensor_of_sync)

    def settle(self) -> None:
        self._sync.settle()


def write_gradient(opdef, node, ctx, inputs, target: torch.Tensor, earlier: torch.Tensor | None) -> None:
    """Make the single output of `node` (an IR node or a program's op, computed by `opdef`)
    straight into `target` (plus `earlier`, the sum over the step's earlier micro-batches): through
    the op's compute_into where it has one, else a copy. Runs inside the executor (under no_grad)."""
    if earlier is None and opdef.compute_into(node, ctx, inputs, target):
        return
    (value,) = opdef.compute(node, ctx, inputs)
    if tuple(value.shape) != tuple(target.shape):
        raise HSPMDError(f"device {ctx.device}: the gradient {node.name} makes has shape {tuple(value.shape)} but "
                         f"its bucket slot is {tuple(target.shape)}")
    if earlier is None:
        target.copy_(value)
    else:
        torch.add(earlier, value, out=target)


__all__ = ["BucketSync", "DEFAULT_BUCKET_CAP_MB", "SyncedGradients", "cap_bytes_of", "write_gradient"]
