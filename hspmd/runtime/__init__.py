"""hspmd.runtime: the communication backends and the launcher.

backend      the Backend interface every executor is written against
local        in-process backend (one thread per device), the reference semantics
torch_dist   torch.distributed backend (gloo on CPU, NCCL on CUDA) and init_from_env()
cupy_nccl    NCCL through CuPy on CUDA tensors (the `gpu` extra)
multiprocess run_multiprocess(): one function on N real gloo/NCCL processes, results per rank
launcher     `hspmd run -n N script.py`: N local ranks with torchrun-style variables
plan_executor  one rank's part of a resolver plan (or a fused multi-tensor plan) on any backend
schedules    GPipe and 1F1B as pure data (per-stage orders), their simulation and checks
executor     runs a stage's schedule on a backend (non-blocking sends, measured in-flight peak)
batches      how a global batch is laid out over pipelines and micro-batches
trainer      DistributedTrainer: one rank's specialized graph, schedule, gradient sync, checkpoints
checkpoint   safetensors checkpoints that load under any strategy
"""
