"""hspmd.runtime: everything that runs specialized programs.

run          one device's forward / backward / update over its executable graph, on any Backend
inprocess    InProcessJob: the Trainer with every rank as a thread, over the in-process backend
executor     runs a stage's schedule on a backend (non-blocking sends, measured in-flight peak)
buckets      gradient buckets: size-capped flat buffers all-reduced while the backward goes on
batches      how a global batch is laid out over pipelines and micro-batches
trainer      Trainer: one rank's specialized graph, schedule, gradient sync, checkpoints
checkpoint   safetensors checkpoints that load under any strategy
integrity    per-tensor checksums, durable atomic writes, stale temporaries removed (for every checkpoint format)
multiprocess run_multiprocess(): one function on N real gloo/NCCL processes, results per rank
launcher     `hspmd run -n N script.py`: N local ranks with torchrun-style variables
"""
