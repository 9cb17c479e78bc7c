"""hspmd.backends: the per-rank communication interface and the plan executor.

backend        the Backend interface every executor is written against
local          in-process backend (one thread per device), the reference semantics
torch_dist     torch.distributed backend (gloo on CPU, NCCL on CUDA)
torch_join     init_from_env(): joining a torch.distributed job from torchrun-style variables
cupy_nccl      NCCL through CuPy on CUDA tensors (the `gpu` extra)
from_env       backend_from_env(): the backend `hspmd run --backend gloo|nccl|cupy` chose
plan_executor  one rank's part of a resolver plan (or a fused multi-tensor plan) on any backend
"""
