"""hspmd.runtime: the communication backends and the launcher.

backend      the Backend interface every executor is written against
local        in-process backend (one thread per device), the reference semantics
torch_dist   torch.distributed backend (gloo on CPU, NCCL on CUDA) and init_from_env()
cupy_nccl    NCCL through CuPy on CUDA tensors (the `gpu` extra)
multiprocess run_multiprocess(): one function on N real gloo/NCCL processes, results per rank
launcher     `hspmd run -n N script.py`: N local ranks with torchrun-style variables
"""
