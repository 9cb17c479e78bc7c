"""Joining a torch.distributed job from torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK), as `hspmd run` and torchrun set them: the job's authenticated store
(backends/store.py), init_process_group over it with gloo bound to this node's address where the
launcher named one, and the TorchDistBackend (torch_dist.py) on the world so joined.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hspmd.errors import HSPMDError
from hspmd.backends.backend import failures_as
from hspmd.backends.heartbeat import HEARTBEAT_ENV, start_beating
from hspmd.backends.store import STORE_PORT_ENV, hosts_store, open_store, secret_from_env
from hspmd.backends.torch_dist import DEFAULT_TIMEOUT_S, TorchDistBackend, TorchDistWorld

SUPPORTED_BACKENDS = ("gloo", "nccl")
NODE_ADDR_ENV = "HSPMD_NODE_ADDR"  # set by `hspmd run`: the address this node's ranks bind and advertise
_NODE_GLOO = "hspmd_node_gloo"  # gloo over this node's address, registered with torch.distributed


def launch_env(how_to_start: str) -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun-style variables; a clear error naming the
    missing ones and how to start the script when they are not set."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise HSPMDError(
            f"environment variables {', '.join(missing)} are not set: start the script with "
            f"`{how_to_start}` (or torchrun)"
        )
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def init_from_env(
    backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, rendezvous_timeout: float | None = None
) -> TorchDistBackend:
    """Join the job described by torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK), as set by `hspmd run` and by torchrun.

    `backend` defaults to $HSPMD_BACKEND, else gloo. `timeout` bounds every collective and group
    creation, so a crashed or missing peer turns into a CommunicationError, never a hang;
    `rendezvous_timeout` (default: `timeout`) bounds the wait for all ranks to start."""
    backend = (backend or os.environ.get("HSPMD_BACKEND") or "gloo").lower()
    if backend not in SUPPORTED_BACKENDS:
        raise HSPMDError(f"unknown backend {backend!r}: use one of {', '.join(SUPPORTED_BACKENDS)}")
    rank, world_size, local_rank = launch_env("hspmd run -n N script.py")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise HSPMDError("backend 'nccl' needs a CUDA GPU and none is visible: use --backend gloo")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    store = None
    if not dist.is_initialized():
        store = _join(backend, rank, world_size, timeout, timeout if rendezvous_timeout is None else rendezvous_timeout)
    return TorchDistBackend(timeout=timeout, world=TorchDistWorld(store))


def store_address() -> tuple[str, int]:
    """Where rank 0 hosts the job's store: MASTER_ADDR:MASTER_PORT, or under torchrun (whose own,
    unauthenticated store holds MASTER_PORT) HSPMD_STORE_PORT, default MASTER_PORT + 1."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or STORE_PORT_ENV in os.environ:
        port = int(os.environ.get(STORE_PORT_ENV, port + 1))
    return host, port


def _join(backend: str, rank: int, world_size: int, timeout: float, rendezvous_timeout: float):
    """init_process_group over the job's store (hspmd.backends.store: bound to MASTER_ADDR only,
    clients prove HSPMD_JOB_SECRET) hosted by rank 0 or, under `hspmd run`, by the launcher; then
    the rendezvous uses `timeout` too. With HSPMD_HEARTBEAT_S the rank beats (backends.heartbeat).
    Returns the store, which must live as long as the world (TorchDistWorld keeps it)."""
    host, port = store_address()
    address = f"{host}:{port}"
    secret = secret_from_env()
    with failures_as(f"rank {rank} of {world_size} could not join the job at {address} with {backend} within "
                     f"{rendezvous_timeout:g}s"):
        store = open_store(host, port, hosts_store(rank), secret, rendezvous_timeout)
        interval = float(os.environ.get(HEARTBEAT_ENV, "0") or 0)
        if interval > 0:
            start_beating(store.connect_again(secret), rank, interval)
        dist.init_process_group(_gloo_name(backend), store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
    return store


def node_address() -> str:
    """The address this node's ranks bind ($HSPMD_NODE_ADDR), '' when the launcher gave none."""
    return os.environ.get(NODE_ADDR_ENV, "")


def node_gloo(store, rank: int, size: int, timeout: timedelta):
    """A gloo process group whose connections listen on and advertise this node's address (gloo
    otherwise picks the address of GLOO_SOCKET_IFNAME's interface or of the host name)."""
    address = node_address()
    if not address:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _gloo_name(backend: str) -> str:
    """The torch.distributed backend to initialise: gloo bound to the node's address when the
    launcher named one (registered once per process; new_group then uses it too), else `backend`."""
    if backend != "gloo" or not node_address():
        return backend
    if _NODE_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(_NODE_GLOO, node_gloo, devices=["cpu"])
    return _NODE_GLOO


__all__ = ["NODE_ADDR_ENV", "SUPPORTED_BACKENDS", "init_from_env", "launch_env", "node_address", "node_gloo", "store_address"]
