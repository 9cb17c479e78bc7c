"""Backend over torch.distributed: gloo for CPU tensors, NCCL (through torch) for CUDA tensors.

Group creation rule
-------------------
torch.distributed creates a process group through ``dist.new_group``, which every rank of the world
must call, non-members included, in the same order (torch names groups by a per-process counter;
even its member-local mode hashes in the number of groups the process already has, so members with
different histories disagree). Hence groups are never created behind the caller's back:

* ``prepare_groups(groups)`` is collective over the whole world: every rank calls it at the same
  point, each passing the groups *it* will use (the lists may differ, as heterogeneous per-device
  programs do). The lists are all-gathered, and the union is created in one sorted order on every
  rank. Call it again (collectively) when a program switches to new groups.
* The whole world and single-rank groups need no preparation. Any other group used before it was
  prepared raises CommunicationError saying to call prepare_groups; it never hangs.

Torch orders members by rank; results are put back into the caller's group order.
"""

from __future__ import annotations

from math import prod

import atexit
from datetime import timedelta
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from hspmd.errors import CommunicationError
from hspmd.backends.backend import (Backend, Done, Group, Pending, Shape, accumulate, check_reduction, failures_as,
                                    finish_reduction)
from hspmd.backends.store import job_from_env
from hspmd.backends.wire import decode_groups, encode_groups

DEFAULT_TIMEOUT_S = 300.0

# One-buffer collectives: renamed in recent torch (the old names warn), the old names before.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "prod": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.SUM}  # avg: the sum, divided afterwards
_REAL_ONLY = frozenset({"max", "min", "prod"})  # torch.distributed reduces complex tensors by sum alone


class TorchDistWorld:
    """The torch.distributed world this process joined and what must live as long as it: the
    process groups (each set of ranks created once, shared by every backend given this world) and
    the job's store. `torch_join.init_from_env` makes one; pass it to further backends to share its groups.

    Until `release()` the world is registered with atexit: a script that never calls shutdown()
    still destroys its process groups before interpreter finalisation (groups torn down during
    finalisation can abort the process, failing a finished run)."""

    def __init__(self, store=None):
        if not dist.is_initialized():
            raise CommunicationError(
                "torch.distributed is not initialised: call hspmd.backends.torch_join.init_from_env() "
                "in a script started by `hspmd run` or torchrun, or dist.init_process_group() first"
            )
        self.group = dist.group.WORLD
        self.groups: dict[tuple[int, ...], object] = {}
        self.store = store
        atexit.register(self.release)

    def release(self) -> None:
        """Drop the groups and destroy the world (idempotent). Process groups must not outlive
        destroy_process_group: one torn down later, at interpreter exit, can abort the process."""
        atexit.unregister(self.release)
        self.groups, self.group = {}, None
        if dist.is_initialized():
            dist.destroy_process_group()


class TorchDistBackend(Backend):
    """One rank's collectives over an initialised torch.distributed world (device id == rank).

    Construction is collective: every rank constructs its backend at the same point, which runs one
    tiny all_reduce on the world so that dead peers are found at start-up and NCCL's world
    communicator exists before any point-to-point exchange."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S, device: torch.device | str | None = None,
                 world: TorchDistWorld | None = None):
        self.world = TorchDistWorld() if world is None else world
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timedelta(seconds=timeout)
        self.dist_backend = str(dist.get_backend()).lower()
        self.device = torch.device(device) if device is not None else _default_device(self.dist_backend)
        self._native_reduce_scatter = True
        # NCCL's one-buffer collectives write in place; gloo's stage the whole result (see *_into)
        self.native_in_place = "nccl" in self.dist_backend
        self.job = job_from_env()
        self.barrier(tuple(range(self.world_size)))

    # groups -------------------------------------------------------------------------------------

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        """Create the process groups that any rank needs (see the module docstring for the rule)."""
        mine = sorted({self._check_group(tuple(g), "prepare_groups", require_member=False) for g in groups})
        world = tuple(range(self.world_size))
        new = sum(1 for key in mine if key not in self.world.groups and len(key) not in (1, self.world_size))
        with self._wrapped("prepare_groups", world):
            anyone = torch.tensor([new], dtype=torch.int64, device=self.device)
            dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
            if int(anyone.item()) == 0:  # every rank has all it needs (e.g. a strategy entered before): done
                return
            everyone = self._all_gather_bytes(encode_groups(mine))
            keys = {tuple(sorted(k)) for r, data in enumerate(everyone) for k in decode_groups(data, self.world_size, f"rank {r}")}
            for key in sorted(keys):
                if key not in self.world.groups and len(key) not in (1, self.world_size):
                    self.world.groups[key] = dist.new_group(list(key), timeout=self.timeout)

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, as uint8 tensors over the world (plain bytes: nothing is unpickled)."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        width = max(1, max(int(s.item()) for s in sizes))
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        return [bytes(t[: int(s.item())].cpu().numpy()) for t, s in zip(gathered, sizes)]

    def _process_group(self, group: Group, op: str):
        key = self._check_group(group, op, require_member=True)
        if len(key) == self.world_size:
            return self.world.group
        if len(key) > 1 and key not in self.world.groups:
            raise CommunicationError(
                f"{op} on rank {self.rank}: group {list(group)} was never prepared; call "
                "backend.prepare_groups(groups) on every rank (collectively, each passing the groups it "
                "uses) before the first collective on it"
            )
        return self.world.groups.get(key)

    def _check_group(self, group: Group, op: str, require_member: bool) -> tuple[int, ...]:
        key = tuple(sorted(group))
        if not group or len(set(group)) != len(group) or any(not 0 <= r < self.world_size for r in group):
            raise CommunicationError(
                f"{op} on rank {self.rank}: group {list(group)} must list distinct ranks in [0, {self.world_size})"
            )
        if require_member and self.rank not in group:
            raise CommunicationError(f"rank {self.rank} called {op} on group {list(group)} it is not in")
        return key

    def _wrapped(self, op: str, group: Sequence[int]):
        """Every torch.distributed failure inside re-raised as a CommunicationError naming it."""
        return failures_as(f"{op} on group {list(group)} failed on rank {self.rank}", hint=(
            "\n(a peer rank may have crashed, timed out, or called a different operation; see its own error)"))

    # collectives --------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        pg = self._process_group(group, "all_reduce")
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        if len(group) > 1:
            with self._wrapped("all_reduce", group):
                dist.all_reduce(out, group=pg)
        return out

    overlaps_collectives = True

    def all_reduce_start(self, tensor: torch.Tensor, group: Group) -> "Pending":
        """An asynchronous in-place all_reduce (async_op=True): no copy in or out."""
        pg = self._process_group(group, "all_reduce")
        if len(group) == 1:
            return Done(tensor)
        with self._wrapped("all_reduce", group):
            work = dist.all_reduce(tensor, group=pg, async_op=True)
        return StartedAllReduce(self, work, tensor, tuple(group))

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        pg = self._process_group(group, "all_gather")
        shapes = [tuple(s) for s in shapes]
        me = group.index(self.rank)
        if len(shapes) != len(group) or tuple(tensor.shape) != shapes[me]:
            raise CommunicationError(
                f"all_gather on rank {self.rank}: got tensor of shape {tuple(tensor.shape)} and shapes {shapes} "
                f"for group {list(group)}; pass one shape per member, this rank's equal to its tensor's"
            )
        if len(group) == 1:
            return [tensor.detach().clone()]
        sizes = [prod(s) for s in shapes]
        width = max(sizes)
        if width == 0:
            return [torch.empty(s, dtype=tensor.dtype, device=tensor.device) for s in shapes]
        flat = _padded_flat(tensor, width)
        gathered = [torch.empty(width, dtype=tensor.dtype, device=tensor.device) for _ in group]
        with self._wrapped("all_gather", group):
            dist.all_gather(gathered, flat, group=pg)
        by_rank = dict(zip(sorted(group), gathered))
        return [by_rank[r][:n].reshape(s) for r, n, s in zip(group, sizes, shapes)]

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        """Uses the backend's reduce_scatter on parts padded to the largest part. Where the backend has
        none (gloo before torch 2.6 or so) it all-reduces the concatenated parts and keeps this rank's
        slice: about twice the traffic of a true reduce_scatter, and every rank holds the whole sum."""
        pg = self._process_group(group, "reduce_scatter")
        if len(parts) != len(group):
            raise CommunicationError(
                f"reduce_scatter on rank {self.rank}: {len(parts)} parts for group {list(group)}; pass one per member"
            )
        me = group.index(self.rank)
        if len(group) == 1:
            return parts[0].detach().clone()
        if self._native_reduce_scatter:
            try:
                return self._reduce_scatter_native(parts, group, pg, me)
            except CommunicationError as exc:
                if not _is_unsupported(exc.__cause__):
                    raise
                self._native_reduce_scatter = False
        return self._reduce_scatter_by_all_reduce(parts, group, pg, me)

    def _reduce_scatter_native(self, parts, group, pg, me) -> torch.Tensor:
        width = max(p.numel() for p in parts)
        if width == 0:
            return torch.empty_like(parts[me])
        if list(group) == sorted(group) and all(p.numel() == width for p in parts):
            # equal parts in rank order: one flat input (reduce_scatter_tensor), faster than a list
            out = torch.empty(width, dtype=parts[me].dtype, device=parts[me].device)
            with self._wrapped("reduce_scatter", group):
                _REDUCE_SCATTER_SINGLE(out, _joined(parts), group=pg)
            return out.reshape(parts[me].shape)
        by_rank = dict(zip(group, parts))
        inputs = [_padded_flat(by_rank[r], width) for r in sorted(group)]
        out = torch.empty(width, dtype=parts[me].dtype, device=parts[me].device)
        with self._wrapped("reduce_scatter", group):
            dist.reduce_scatter(out, inputs, group=pg)
        return out[: parts[me].numel()].reshape(parts[me].shape)

    def _reduce_scatter_by_all_reduce(self, parts, group, pg, me) -> torch.Tensor:
        flat = torch.cat([p.detach().reshape(-1) for p in parts])
        if flat.numel():
            with self._wrapped("reduce_scatter", group):
                dist.all_reduce(flat, group=pg)
        start = sum(p.numel() for p in parts[:me])
        return flat[start : start + parts[me].numel()].reshape(parts[me].shape).clone()

    # into the caller's buffers (Backend.*_into) -----------------------------------------------------
    # NCCL's one-buffer collectives write straight into the destination. Gloo's stage the whole
    # result in a buffer of their own (a gathered tensor, a joined input), so under gloo, and
    # wherever the pieces are not one rank-ordered run of equal blocks, pieces travel point to
    # point, landing in the caller's views: all at once when every view is contiguous, else in
    # n-1 rounds (round k: to the member k places after, from the member k places before) with
    # at most one piece-sized buffer in and one out.

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor, op: str = "sum") -> None:
        """Any reduction (annotations.REDUCTIONS): avg as the sum divided by the member count, and
        max, min and prod of complex tensors, which torch.distributed refuses, by gathering."""
        pg = self._process_group(group, "all_reduce")
        check_reduction(op, "all_reduce", self.rank)
        if op in _REAL_ONLY and tensor.is_complex():
            return super().all_reduce_into(tensor, group, out, op)
        target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        target.copy_(tensor)
        if len(group) > 1 and target.numel():
            with self._wrapped("all_reduce", group):
                dist.all_reduce(target, op=_REDUCE_OPS[op], group=pg)
            finish_reduction(target, op, len(group))
        if target is not out:
            out.copy_(target)

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        pg = self._process_group(group, "all_gather")
        me = group.index(self.rank)
        if len(outs) != len(group) or tuple(tensor.shape) != tuple(outs[me].shape):
            raise CommunicationError(
                f"all_gather on rank {self.rank}: tensor of shape {tuple(tensor.shape)} and {len(outs)} outputs "
                f"{[tuple(o.shape) for o in outs]} for group {list(group)}; pass one output per member"
            )
        joined = _flat_view(outs) if self.native_in_place and list(group) == sorted(group) else None
        if joined is not None and len({o.numel() for o in outs}) == 1 and len(group) > 1:
            if joined.numel():
                with self._wrapped("all_gather", group):
                    _ALL_GATHER_SINGLE(joined, tensor.detach().reshape(-1).contiguous(), group=pg)
            return
        outs[me].copy_(tensor)
        mine = tensor.detach().contiguous()
        if all(o.is_contiguous() for o in outs):  # nothing to stage: every piece at once
            ops = [dist.P2POp(dist.isend, mine, peer, group=pg) for peer in group if peer != self.rank and mine.numel()]
            ops += [dist.P2POp(dist.irecv, out, peer, group=pg) for peer, out in zip(group, outs)
                    if peer != self.rank and out.numel()]
            if ops:
                with self._wrapped("all_gather", group):
                    for work in dist.batch_isend_irecv(ops):
                        work.wait(self.timeout)
            return
        for to, frm in _rounds(group, me):
            target = outs[frm]
            landing = target if target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype, device=target.device)
            self._p2p_round("all_gather", group, pg, mine, group[to], landing, group[frm])
            if landing is not target:
                target.copy_(landing)
            del landing  # before the next round's

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor,
                            op: str = "sum") -> None:
        """Any reduction, as all_reduce_into; where no one-buffer collective serves, each member's
        part travels point to point and is combined here."""
        pg = self._process_group(group, "reduce_scatter")
        check_reduction(op, "reduce_scatter", self.rank)
        if len(parts) != len(group):
            raise CommunicationError(
                f"reduce_scatter on rank {self.rank}: {len(parts)} parts for group {list(group)}; pass one per member"
            )
        me = group.index(self.rank)
        joined = _flat_view(parts) if self.native_in_place and list(group) == sorted(group) else None
        native = not (op in _REAL_ONLY and out.is_complex())
        if joined is not None and native and len({p.numel() for p in parts}) == 1 and out.is_contiguous() and len(group) > 1:
            if joined.numel():
                with self._wrapped("reduce_scatter", group):
                    _REDUCE_SCATTER_SINGLE(out.view(-1), joined, op=_REDUCE_OPS[op], group=pg)
                finish_reduction(out, op, len(group))
            return
        out.copy_(parts[me])
        if len(group) == 1:
            return
        landing = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        for to, frm in _rounds(group, me):
            self._p2p_round("reduce_scatter", group, pg, parts[to].detach().contiguous(), group[to], landing,
                            group[frm])
            accumulate(out, landing, op)
        finish_reduction(out, op, len(group))

    def _p2p_round(self, op: str, group: Group, pg, send: torch.Tensor, to: int, into: torch.Tensor, frm: int) -> None:
        """Send `send` (contiguous) to rank `to` while receiving rank `frm`'s message into `into` (contiguous)."""
        ops = [dist.P2POp(dist.isend, send, to, group=pg)] if send.numel() else []
        if into.numel():
            ops.append(dist.P2POp(dist.irecv, into, frm, group=pg))
        if ops:
            with self._wrapped(op, group):
                for work in dist.batch_isend_irecv(ops):
                    work.wait(self.timeout)

    def exchange_into(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """`exchange`, receiving straight into the caller's buffers where they are contiguous."""
        landing = {p: t if t.is_contiguous() or p == self.rank else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                   for p, t in recvs.items()}
        got = self._exchange(sends, {p: (tuple(t.shape), t.dtype) for p, t in recvs.items()}, landing)
        for peer, out in recvs.items():
            if got[peer] is not out:
                out.copy_(got[peer])

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        pg = self._process_group(group, "broadcast")
        if src not in group:
            raise CommunicationError(f"broadcast on rank {self.rank}: source {src} is not in group {list(group)}")
        out = tensor.detach().clone().contiguous()
        if len(group) > 1 and out.numel():
            with self._wrapped("broadcast", group):
                dist.broadcast(out, src=src, group=pg)
        return out

    def barrier(self, group: Group) -> None:
        """An all_reduce of one number on this backend's device (NCCL's barrier guesses devices)."""
        pg = self._process_group(group, "barrier")
        if len(group) > 1:
            with self._wrapped("barrier", group):
                dist.all_reduce(torch.zeros(1, device=self.device), group=pg)

    # point to point -----------------------------------------------------------------------------

    def exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, tuple[Shape, torch.dtype]]
    ) -> dict[int, torch.Tensor]:
        """All sends and receives are posted together (batch_isend_irecv) and then awaited, so no
        pattern can deadlock. Empty tensors and messages to this rank itself never touch the wire."""
        return self._exchange(sends, recvs, {})

    def _exchange(self, sends, recvs, landing: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        for peer in (*sends, *recvs):
            if not 0 <= peer < self.world_size:
                raise CommunicationError(f"exchange on rank {self.rank}: peer {peer} is not in [0, {self.world_size})")
        if (self.rank in sends) != (self.rank in recvs):
            raise CommunicationError(
                f"exchange on rank {self.rank}: a message to itself must appear in both sends and recvs"
            )
        out: dict[int, torch.Tensor] = {}
        ops = []
        for peer in sorted(sends):
            tensor = sends[peer]
            if peer == self.rank:
                out[peer] = _checked_self_message(tensor, *recvs[peer], rank=self.rank)
            elif tensor.numel():
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), peer))
        for peer in sorted(recvs):
            if peer == self.rank:
                continue
            shape, dtype = recvs[peer]
            out[peer] = landing[peer] if peer in landing else torch.empty(tuple(shape), dtype=dtype, device=self.device)
            if out[peer].numel():
                ops.append(dist.P2POp(dist.irecv, out[peer], peer))
        if ops:
            peers = sorted({op.peer for op in ops})
            with self._wrapped("exchange", peers):
                for work in dist.batch_isend_irecv(ops):
                    work.wait(self.timeout)
        return out

    def post_sends(self, sends: Mapping[int, torch.Tensor]) -> "PendingSends":
        """Start sends without waiting for their receivers; `.wait()` on the result completes them.
        Pipeline schedules need this: two neighbouring stages that both send before they receive
        (1F1B's steady state) deadlock when a send waits for its matching receive."""
        ops = []
        for peer in sorted(sends):
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise CommunicationError(f"post_sends on rank {self.rank}: peer {peer} must be another rank in [0, {self.world_size})")
            if sends[peer].numel():
                ops.append(dist.P2POp(dist.isend, sends[peer].detach().contiguous(), peer))
        peers = sorted(sends)
        with self._wrapped("post_sends", peers):
            works = dist.batch_isend_irecv(ops) if ops else []
        return PendingSends(self, works, [op.tensor for op in ops], peers)

    def shutdown(self) -> None:
        """Leave the job (collective: every rank calls it). The world barrier first keeps rank 0,
        which hosts the rendezvous store that group creation needs, alive until all ranks are done."""
        if dist.is_initialized():
            self.barrier(tuple(range(self.world_size)))
        self.world.release()


class StartedAllReduce:
    """An in-place all_reduce in flight (from TorchDistBackend.all_reduce_start)."""

    def __init__(self, backend: TorchDistBackend, work, tensor: torch.Tensor, group: Group):
        self._backend, self._work, self._tensor, self._group = backend, work, tensor, group

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with self._backend._wrapped("all_reduce (wait)", self._group):
                self._work.wait(self._backend.timeout)
            self._work = None
        return self._tensor


class PendingSends:
    """Sends in flight (from TorchDistBackend.post_sends); keeps their tensors alive until wait()."""

    def __init__(self, backend: TorchDistBackend, works: list, tensors: list[torch.Tensor], peers: list[int]):
        self._backend, self._works, self._tensors, self._peers = backend, works, tensors, peers

    def done(self) -> bool:
        """True once every send has completed (its buffer may be dropped); never waits."""
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        with self._backend._wrapped("post_sends (wait)", self._peers):
            for work in self._works:
                work.wait(self._backend.timeout)
        self._works, self._tensors = [], []


def _default_device(dist_backend: str) -> torch.device:
    if "nccl" in dist_backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")



def _padded_flat(tensor: torch.Tensor, width: int) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == width:
        return flat.contiguous()
    padded = torch.zeros(width, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    return padded


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts flattened and joined: a flat view when they already lie back to back in one
    buffer (row blocks of one tensor, as a reduce-scatter of a contiguous piece cuts them), else a copy."""
    flat = _flat_view(parts)
    return flat if flat is not None else torch.cat([q.detach().reshape(-1) for q in parts])


def _flat_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over the parts when they lie back to back, in order, in one buffer; else None."""
    first = parts[0].detach()
    end = first.data_ptr()
    for p in parts:
        if not p.is_contiguous() or p.dtype != first.dtype or p.data_ptr() != end or (
            p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        ):
            return None
        end += p.numel() * p.element_size()
    return first.as_strided((sum(p.numel() for p in parts),), (1,))


def _rounds(group: Group, me: int) -> list[tuple[int, int]]:
    """(index sent to, index received from) per round of a pairwise exchange over the group."""
    n = len(group)
    return [((me + k) % n, (me - k) % n) for k in range(1, n)]


def _checked_self_message(tensor: torch.Tensor, shape: Shape, dtype: torch.dtype, rank: int) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise CommunicationError(
            f"exchange on rank {rank}: sends itself {tuple(tensor.shape)} {tensor.dtype} but expects "
            f"{tuple(shape)} {dtype}"
        )
    return tensor.detach().clone()


def _is_unsupported(exc: BaseException | None) -> bool:
    text = str(exc).lower()
    return exc is not None and ("does not support" in text or "not supported" in text)


__all__ = ["DEFAULT_TIMEOUT_S", "PendingSends", "TorchDistBackend", "TorchDistWorld"]
