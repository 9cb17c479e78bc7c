"""hspmd.runtime: everything that runs specialized programs, in six sub-layers (bottom first; each
imports only itself and the ones before it, which tests/test_layers.py checks):

execution    one device's passes, a stage's schedule, gradient buckets, batch layout, feed checks, traces
persistence  checkpoints (single file, sharded, Hugging Face), integrity, the checkpoint command
processes    real processes: the launcher, rank guard, membership, multiprocess runs, ports, affinity
training     Trainer (one rank over any backend) and InProcessJob (every rank as a thread)
programs     per-device programs as data: compiling them, running them, the compile / run-programs commands
policies     policies over the trainer: elastic recovery, mixed-length training, calibration
"""
