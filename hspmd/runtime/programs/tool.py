"""`hspmd compile` and `hspmd run-programs`: per-device programs of the tiny Llama as files.

    hspmd compile "layers=4 ; 4x1: R0 L0-1 | R1 L2-3" --out progs/    # progs/rank0.json, ... + job.json
    hspmd compile ... --print 1                                        # also print rank 1's program
    hspmd compile ... --ranks 8-15                                     # one node's programs (+ job.json)
    hspmd run-programs progs/ --steps 3                                # one gloo process per rank

Each rank of `run-programs` reads its own program file and nothing else of the model (no graph is
built); every rank draws the same synthetic global batch per step from `--seed`. `job.json` holds
what the launcher needs: the world size and the batch's shape and vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from hspmd.arguments import ArgumentParser, non_negative_int, positive_int, rank_list
from hspmd.backends.backend import Backend
from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.persistence.integrity import atomic_write
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.programs.runner import ProgramRunner
from hspmd.runtime.programs.compiling import iter_programs, read_program, write_programs
from hspmd.specialize.program import ProgramError
from hspmd.specialize.strategy_files import strategy_from
from hspmd.specialize.strategy_text import format_strategy

JOB_FILE = "job.json"
JOB_SCHEMA = "hspmd.program-job/1"


def compile_main(argv: Sequence[str]) -> int:
    p = ArgumentParser(prog="hspmd compile", description="write one program (JSON) per rank of the tiny Llama")
    p.add_argument("strategy", help="strategy text, a strategy file, or a paper strategy name")
    p.add_argument("--out", required=True, help="directory for rank<N>.json and job.json")
    p.add_argument("--schedule", default=None,
                   help="gpipe, 1f1b, eager or h1f1b:N1,N2,... (default: each pipeline's own in the strategy, else 1f1b)")
    p.add_argument("--seq", type=positive_int, default=8, help="sequence length")
    p.add_argument("--vocab", type=positive_int, default=32)
    p.add_argument("--hidden", type=positive_int, default=16)
    p.add_argument("--heads", type=positive_int, default=2)
    p.add_argument("--ffn", type=positive_int, default=32)
    p.add_argument("--seed", type=non_negative_int, default=0, help="initialisation seed")
    p.add_argument("--ranks", type=rank_list, default=None, metavar="LIST",
                   help="only these ranks' programs, e.g. 8-15 or 0,4-7 (each node compiles its own); default all")
    p.add_argument("--print", type=non_negative_int, default=None, dest="show", metavar="RANK",
                   help="print this rank's program")
    args = p.parse_args(list(argv))
    strategy = strategy_from(args.strategy)
    config = LlamaConfig(layers=strategy.num_layers, vocab=args.vocab, hidden=args.hidden, heads=args.heads,
                         ffn=args.ffn)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=1e-2))
    layout = MicroBatchLayout.of(strategy)
    symbols = {model.seq.name: args.seq, model.tokens_per_step.name: layout.global_batch_size * args.seq}
    shown, world = None, max(strategy.all_ranks) + 1
    programs = iter_programs(model.graph, 0, strategy, args.schedule, symbols, seed=args.seed, world_size=world,
                             ranks=args.ranks)
    for rank, prog in programs:
        (path,) = write_programs([(rank, prog)], args.out)  # one program in memory at a time
        where = "idle" if prog.idle else f"stage {prog.place.stage + 1}/{len(prog.place.stages)} of pipeline " \
                                          f"{prog.place.pipeline}"
        print(f"rank {rank}: {where}, {len(prog.forward)}+{len(prog.backward)}+{len(prog.update)} ops, "
              f"{len(prog.plans)} plans, {len(prog.leaves)} pieces -> {path} ({path.stat().st_size} bytes)")
        shown = prog if rank == args.show else shown
    job = {"schema": JOB_SCHEMA, "world_size": world, "global_batch": layout.global_batch_size,
           "seq": args.seq, "vocab": args.vocab, "strategy": format_strategy(strategy)}
    data = json.dumps(job, indent=2).encode()
    atomic_write(Path(args.out) / JOB_FILE, lambda tmp: Path(tmp).write_bytes(data))
    if args.show is not None:
        if shown is None:
            raise HSPMDError(f"--print {args.show}: not a rank compiled here (the job has ranks 0-{world - 1})")
        print(shown)
    return 0


def _job(directory: str) -> dict:
    path = Path(directory) / JOB_FILE
    try:
        job = json.loads(path.read_bytes())
    except OSError as exc:
        raise ProgramError(f"{path}: cannot read the job file ({exc.strerror or exc}); write it with hspmd compile") \
            from None
    except ValueError as exc:
        raise ProgramError(f"{path}: not JSON ({exc})") from None
    if not isinstance(job, dict) or job.get("schema") != JOB_SCHEMA:
        raise ProgramError(f"{path}: not a {JOB_SCHEMA} file")
    for key in ("world_size", "global_batch", "seq", "vocab"):
        value = job.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProgramError(f"{path}: field {key} must be a positive integer, got {value!r}")
    return job


def synthetic_batches(job: dict, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (job["global_batch"], job["seq"])
    return [{"tokens": torch.randint(0, job["vocab"], shape, generator=gen),
             "labels": torch.randint(0, job["vocab"], shape, generator=gen)} for _ in range(steps)]


def program_rank(backend: Backend, directory: str, job: dict, steps: int, seed: int) -> list[float | None]:
    """One rank: its program file alone, `steps` steps on the synthetic batches."""
    torch.set_num_threads(1)
    runner = ProgramRunner(read_program(directory, backend.rank), backend)
    return [runner.step(batch) for batch in synthetic_batches(job, steps, seed)]


def run_main(argv: Sequence[str]) -> int:
    p = ArgumentParser(prog="hspmd run-programs", description="run a directory of programs, one process per rank")
    p.add_argument("directory", help="a directory written by hspmd compile")
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the synthetic batches")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds for the whole job")
    args = p.parse_args(list(argv))
    job = _job(args.directory)
    for rank in range(job["world_size"]):  # refuse a damaged file here, with its field named, before launching
        read_program(args.directory, rank)
    losses = run_multiprocess(program_rank, job["world_size"], args.directory, job, args.steps, args.seed,
                              backend=args.backend, timeout=args.timeout)
    lead = next((r for r in losses if r[0] is not None), losses[0])
    for step, loss in enumerate(lead):
        print(f"step {step}: loss {loss:.6f}")
    return 0


__all__ = ["compile_main", "program_rank", "run_main", "synthetic_batches"]
