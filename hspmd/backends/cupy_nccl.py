"""Backend over NCCL through CuPy, on CUDA torch tensors (the `gpu` extra: pip install 'hspmd[gpu]').

Each group gets its own NcclCommunicator. The group's first rank (lowest id) draws the NCCL unique
id and publishes it in a torch.distributed store under a key per group; the other members read it
there. NCCL kernels read and write the tensors' memory in place (zero copy: the device pointers are
handed to NCCL) and are enqueued on torch's current CUDA stream, so they are ordered after the
kernels that produced their inputs and before those that consume their outputs: no extra
synchronisation, and calls return before the transfer completes, like torch's own collectives.

Group creation rule: a communicator is created by its members only (ncclCommInitRank is a
rendezvous of the members), at the group's first use or in `prepare_groups`. That is safe because
members issue collectives on a group in the same global order (the Backend contract), and
`prepare_groups` creates the union of every rank's groups in one sorted order. The world
communicator, used for `exchange`, is created by the constructor: construction is collective.
"""

from __future__ import annotations

from math import prod

import time
from datetime import timedelta
from typing import Iterable, Mapping, Sequence

import torch

from hspmd.errors import CommunicationError, HSPMDError
from hspmd.backends.backend import Backend, Group, Shape, failures_as
from hspmd.backends.wire import decode_groups, decode_unique_id, encode_groups, encode_unique_id

try:
    import cupy
    from cupy.cuda import nccl
except ImportError:
    cupy = nccl = None

DEFAULT_TIMEOUT_S = 300.0


def cupy_available() -> bool:
    return nccl is not None


class CupyNcclBackend(Backend):
    """One rank's NCCL collectives on CUDA tensors of the current device (device id == rank).

    `store` is any torch.distributed Store every rank can reach (e.g. a TCPStore hosted by rank 0);
    `timeout` bounds communicator creation and `barrier`. Store keys live under `namespace`, which
    every rank passes the same; a second backend on the same store needs a namespace of its own
    (nothing is counted behind the caller's back). NCCL collectives themselves have no timeout
    here: a peer that dies mid-collective is noticed at the next barrier."""

    def __init__(
        self, store, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT_S, namespace: str = "hspmd/cupy_nccl"
    ):
        if nccl is None:
            raise HSPMDError(
                "CupyNcclBackend needs CuPy with NCCL, which is not installed: "
                "pip install 'hspmd[gpu]' (CuPy for CUDA 12), or use TorchDistBackend"
            )
        if not torch.cuda.is_available():
            raise HSPMDError("CupyNcclBackend needs a CUDA GPU and none is visible: use TorchDistBackend with gloo")
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._store = store
        self._namespace = namespace
        from hspmd.backends.store import job_from_env

        self.job = job_from_env()
        self._comms: dict[tuple[int, ...], object] = {}
        self._prepare_calls = 0
        self._world = self._communicator(tuple(range(world_size)), "creating the world communicator")

    @classmethod
    def from_env(cls, timeout: float = DEFAULT_TIMEOUT_S, namespace: str = "hspmd/cupy_nccl") -> "CupyNcclBackend":
        """Build from the torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
        Reuses torch.distributed's store when a process group is initialised; otherwise joins the
        job's store (hspmd.backends.store) on MASTER_ADDR:MASTER_PORT, hosted by `hspmd run` or
        else by rank 0. Collective: every rank calls it."""
        import torch.distributed as dist

        from hspmd.backends.store import hosts_store, open_store, secret_from_env
        from hspmd.backends.torch_join import launch_env, store_address

        rank, world_size, local_rank = launch_env("hspmd run -n N --backend nccl script.py")
        if nccl is not None and torch.cuda.is_available():
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        if dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        else:
            host, port = store_address()
            store = open_store(host, port, hosts_store(rank), secret_from_env(), timeout)
        return cls(store, rank, world_size, timeout, namespace)

    # communicators ------------------------------------------------------------------------------

    def prepare_groups(self, groups: Iterable[Group]) -> None:
        """Publish this rank's groups in the store, read everyone's, create the ones this rank is in,
        in one sorted order shared by all ranks (so overlapping creations cannot deadlock)."""
        call = self._prepare_calls
        self._prepare_calls += 1
        mine = sorted({tuple(sorted(self._check_group(tuple(g), "prepare_groups", False))) for g in groups})
        prefix = f"{self._namespace}/prepare/{call}"
        self._store.set(f"{prefix}/{self.rank}", encode_groups(mine))
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        self._wait_for(keys, "prepare_groups")
        union = sorted({tuple(sorted(k)) for r, key in enumerate(keys)
                        for k in decode_groups(self._store.get(key), self.world_size, f"rank {r} (store key {key})")})
        for members in union:
            if self.rank in members:
                self._communicator(members, "prepare_groups")

    def _communicator(self, group: Group, op: str):
        members = tuple(sorted(self._check_group(group, op, True)))
        if members not in self._comms:
            key = f"{self._namespace}/comm/{'-'.join(map(str, members))}"
            with failures_as(f"{op}: creating the NCCL communicator of group {list(members)} failed on rank {self.rank}"):
                if self.rank == members[0]:
                    self._store.set(key, encode_unique_id(nccl.get_unique_id()))
                self._wait_for([key], op)
                unique_id = decode_unique_id(self._store.get(key), f"rank {members[0]} (store key {key})")
                with cupy.cuda.Device(self.device.index):
                    self._comms[members] = nccl.NcclCommunicator(len(members), unique_id, members.index(self.rank))
        return self._comms[members]

    def _wait_for(self, keys: list[str], op: str) -> None:
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - re-raised typed
            raise CommunicationError(
                f"{op} on rank {self.rank}: peers did not publish {keys[0]} within {self.timeout:g}s "
                f"(a rank crashed or never called it): {exc}"
            ) from exc

    def _check_group(self, group: Group, op: str, require_member: bool) -> Group:
        if not group or len(set(group)) != len(group) or any(not 0 <= r < self.world_size for r in group):
            raise CommunicationError(
                f"{op} on rank {self.rank}: group {list(group)} must list distinct ranks in [0, {self.world_size})"
            )
        if require_member and self.rank not in group:
            raise CommunicationError(f"rank {self.rank} called {op} on group {list(group)} it is not in")
        return group

    def _on_device(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if tensor.device != self.device:
            raise CommunicationError(
                f"{op} on rank {self.rank}: tensor is on {tensor.device}, this backend works on {self.device}; "
                "move it there first (or use TorchDistBackend with gloo for CPU tensors)"
            )
        return tensor.detach().contiguous()

    def _call(self, op: str, group: Sequence[int], launch) -> None:
        with failures_as(f"{op} on group {list(group)} failed on rank {self.rank}"):
            launch(torch.cuda.current_stream(self.device).cuda_stream)

    # collectives --------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        comm = self._communicator(group, "all_reduce")
        src = self._on_device(tensor, "all_reduce")
        out = torch.empty_like(src)
        dtype = _reduce_dtype(src.dtype, "all_reduce")
        self._call("all_reduce", group, lambda s: comm.allReduce(
            src.data_ptr(), out.data_ptr(), src.numel(), dtype, nccl.NCCL_SUM, s))
        return out

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        comm = self._communicator(group, "all_gather")
        shapes = [tuple(s) for s in shapes]
        if len(shapes) != len(group) or tuple(tensor.shape) != shapes[group.index(self.rank)]:
            raise CommunicationError(
                f"all_gather on rank {self.rank}: got tensor of shape {tuple(tensor.shape)} and shapes {shapes} "
                f"for group {list(group)}; pass one shape per member, this rank's equal to its tensor's"
            )
        src = self._on_device(tensor, "all_gather")
        sizes = [prod(s) for s in shapes]
        width = max(sizes)
        if width == 0 or len(group) == 1:
            return [src.clone()] if len(group) == 1 else [src.new_empty(s) for s in shapes]
        flat = torch.zeros(width, dtype=src.dtype, device=self.device)
        flat[: src.numel()] = src.reshape(-1)
        gathered = torch.empty(len(group), width, dtype=src.dtype, device=self.device)
        nbytes = width * src.element_size()
        self._call("all_gather", group, lambda s: comm.allGather(
            flat.data_ptr(), gathered.data_ptr(), nbytes, nccl.NCCL_UINT8, s))
        row = {r: i for i, r in enumerate(sorted(group))}
        return [gathered[row[r], :n].reshape(shape) for r, n, shape in zip(group, sizes, shapes)]

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        """NCCL reduceScatter over parts padded to the largest part (its counts must be equal)."""
        comm = self._communicator(group, "reduce_scatter")
        if len(parts) != len(group):
            raise CommunicationError(
                f"reduce_scatter on rank {self.rank}: {len(parts)} parts for group {list(group)}; pass one per member"
            )
        parts = [self._on_device(p, "reduce_scatter") for p in parts]
        mine = parts[group.index(self.rank)]
        width = max(p.numel() for p in parts)
        if width == 0 or len(group) == 1:
            return mine.clone()
        by_rank = dict(zip(group, parts))
        stacked = torch.zeros(len(group), width, dtype=mine.dtype, device=self.device)
        for row, r in enumerate(sorted(group)):
            stacked[row, : by_rank[r].numel()] = by_rank[r].reshape(-1)
        out = torch.empty(width, dtype=mine.dtype, device=self.device)
        dtype = _reduce_dtype(mine.dtype, "reduce_scatter")
        self._call("reduce_scatter", group, lambda s: comm.reduceScatter(
            stacked.data_ptr(), out.data_ptr(), width, dtype, nccl.NCCL_SUM, s))
        return out[: mine.numel()].reshape(mine.shape)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        comm = self._communicator(group, "broadcast")
        if src not in group:
            raise CommunicationError(f"broadcast on rank {self.rank}: source {src} is not in group {list(group)}")
        out = self._on_device(tensor, "broadcast").clone()
        if out.numel() and len(group) > 1:
            root = sorted(group).index(src)
            nbytes = out.numel() * out.element_size()
            self._call("broadcast", group, lambda s: comm.broadcast(
                out.data_ptr(), out.data_ptr(), nbytes, nccl.NCCL_UINT8, root, s))
        return out

    def barrier(self, group: Group) -> None:
        """Waits (up to the timeout) for a one-number all_reduce, so a dead peer surfaces here."""
        self.all_reduce(torch.zeros(1, device=self.device), group)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout
        while not done.query():
            if time.monotonic() > deadline:
                raise CommunicationError(
                    f"barrier on group {list(group)} timed out on rank {self.rank} after {self.timeout:g}s: "
                    "a member crashed or never called it"
                )
            time.sleep(0.001)

    def exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, tuple[Shape, torch.dtype]]
    ) -> dict[int, torch.Tensor]:
        """All sends and receives go in one NCCL group call on the world communicator, which NCCL
        schedules without deadlock whatever the pattern. Bytes are sent as-is, so any dtype works."""
        for peer in (*sends, *recvs):
            if not 0 <= peer < self.world_size:
                raise CommunicationError(f"exchange on rank {self.rank}: peer {peer} is not in [0, {self.world_size})")
        if (self.rank in sends) != (self.rank in recvs):
            raise CommunicationError(f"exchange on rank {self.rank}: a message to itself must appear in both sends and recvs")
        outgoing = {p: self._on_device(t, "exchange") for p, t in sends.items()}
        out = {p: torch.empty(tuple(shape), dtype=dtype, device=self.device) for p, (shape, dtype) in recvs.items()}
        if self.rank in outgoing:
            mine = outgoing.pop(self.rank)
            if mine.shape != out[self.rank].shape or mine.dtype != out[self.rank].dtype:
                raise CommunicationError(
                    f"exchange on rank {self.rank}: sends itself {tuple(mine.shape)} {mine.dtype} but expects "
                    f"{tuple(out[self.rank].shape)} {out[self.rank].dtype}"
                )
            out[self.rank].copy_(mine)
        wire_sends = [(p, t) for p, t in sorted(outgoing.items()) if t.numel()]
        wire_recvs = [(p, t) for p, t in sorted(out.items()) if p != self.rank and t.numel()]
        if wire_sends or wire_recvs:
            self._call("exchange", sorted({p for p, _ in wire_sends + wire_recvs}),
                       lambda s: self._grouped_p2p(wire_sends, wire_recvs, s))
        return out

    def _grouped_p2p(self, wire_sends, wire_recvs, stream: int) -> None:
        nccl.groupStart()
        try:
            for peer, t in wire_sends:
                self._world.send(t.data_ptr(), t.numel() * t.element_size(), nccl.NCCL_UINT8, peer, stream)
            for peer, t in wire_recvs:
                self._world.recv(t.data_ptr(), t.numel() * t.element_size(), nccl.NCCL_UINT8, peer, stream)
        finally:
            nccl.groupEnd()

    def close(self) -> None:
        """Destroy this rank's communicators (after the work enqueued on them has finished)."""
        torch.cuda.current_stream(self.device).synchronize()
        for comm in self._comms.values():
            comm.destroy()
        self._comms.clear()



def _reduce_dtype(dtype: torch.dtype, op: str) -> int:
    table = {
        torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16", torch.float32: "NCCL_FLOAT32",
        torch.float64: "NCCL_FLOAT64", torch.int8: "NCCL_INT8", torch.uint8: "NCCL_UINT8",
        torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64",
    }
    code = getattr(nccl, table.get(dtype, ""), None)
    if code is None:
        raise CommunicationError(f"{op}: NCCL (through this CuPy) cannot sum {dtype} tensors; cast them first")
    return code


__all__ = ["CupyNcclBackend", "cupy_available"]
