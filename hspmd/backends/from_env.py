"""Joining a job with the backend its launcher chose: `hspmd run --backend gloo|nccl|cupy` sets
HSPMD_BACKEND, and every rank calls backend_from_env().

    gloo   torch.distributed over gloo, CPU tensors (TorchDistBackend)
    nccl   torch.distributed over NCCL, each rank on CUDA device LOCAL_RANK (TorchDistBackend)
    cupy   NCCL through CuPy on CUDA torch tensors (CupyNcclBackend; the `gpu` extra)

check_backend() is what the launcher asks before it starts any rank, so that a machine that
cannot run the backend gets one clear line instead of N ranks failing the same way.
"""

from __future__ import annotations

import os

import torch

from hspmd.errors import HSPMDError
from hspmd.backends.backend import Backend
from hspmd.backends.cupy_nccl import CupyNcclBackend, cupy_available
from hspmd.backends.torch_dist import DEFAULT_TIMEOUT_S
from hspmd.backends.torch_join import init_from_env

BACKENDS = ("gloo", "nccl", "cupy")
BACKEND_ENV = "HSPMD_BACKEND"


def check_backend(name: str, local_ranks: int, cuda_devices: int | None = None, has_cupy: bool | None = None) -> None:
    """A one-line HSPMDError when this machine cannot run `local_ranks` ranks over backend `name`:
    an unknown name, NCCL or CuPy without a CUDA GPU or with fewer GPUs than ranks (NCCL wants a
    device per rank), CuPy not installed. `cuda_devices`, `has_cupy`: what this machine has
    (found out when not given)."""
    if name not in BACKENDS:
        raise HSPMDError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "gloo":
        return
    if name == "cupy" and not (cupy_available() if has_cupy is None else has_cupy):
        raise HSPMDError("backend 'cupy' needs CuPy with NCCL, which is not installed: "
                         "pip install 'hspmd[gpu]', or use --backend nccl (or gloo without a GPU)")
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_devices is None else cuda_devices
    if gpus == 0:
        raise HSPMDError(f"backend {name!r} needs a CUDA GPU and none is visible: use --backend gloo")
    if gpus < local_ranks:
        raise HSPMDError(f"backend {name!r} runs one rank per GPU: {local_ranks} local ranks but {gpus} GPU(s) "
                         f"visible; start at most {gpus} or use --backend gloo")


def backend_from_env(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> Backend:
    """This rank's backend in a job started by `hspmd run` (or torchrun): `backend`, else
    $HSPMD_BACKEND, else gloo. Collective: every rank calls it at the same point."""
    name = (backend or os.environ.get(BACKEND_ENV) or "gloo").lower()
    check_backend(name, 1)
    if name == "cupy":
        return CupyNcclBackend.from_env(timeout)
    return init_from_env(name, timeout)


__all__ = ["BACKENDS", "BACKEND_ENV", "backend_from_env", "check_backend"]
