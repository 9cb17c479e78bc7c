"""Train a small Llama on the shipped corpus with a heterogeneous strategy on 4 ranks.

    hspmd run -n 4 examples/llama/train.py [--steps 60] [--schedule 1f1b|gpipe] [--resume]
    torchrun --nproc-per-node 4 examples/llama/train.py
    hspmd run -n 4 examples/llama/train.py --data data/corpus     # files from `hspmd data prepare`

The data: without --data, each rank prepares the shipped documents (examples/mixed_length/
documents.txt, one per line) as bytes into token files at start (hspmd.runtime.data); every epoch
shuffles the documents and cuts them, back to back, into sequences of --seq tokens. Each rank reads
only its pipeline's rows of each step (hspmd.runtime.data.loader.SequenceLoader); the loader's
position is saved in every checkpoint, so --resume, a planned switch or a recovery continues with
exactly the next samples, under any strategy and world size. --record-samples DIR makes each rank
append the sample ids it trains per step to DIR/rank<N>.jsonl.

Default strategy (compact syntax of hspmd.specialize.strategy_text):

    pipeline 0: ranks 0,1 as one tensor-parallel stage (TP2) holding all 4 layers,
                2 micro-batches of 4 sequences per step
    pipeline 1: rank 2 (layers 0-1) -> rank 3 (layers 2-3), two pipeline stages,
                2 micro-batches of 2 sequences per step

so the global batch of 12 sequences is split 2:1 toward the faster (TP2) pipeline. Gradients of
the two pipelines are synchronised once per step. The model is written once, for one device; only
its annotations come from the strategy.

Rank 0 prints the strategy, the pipelines hspmd discovers from the specialized graphs, a progress
bar with the loss, and saves a safetensors checkpoint (whole tensors, loadable under any strategy);
--resume continues from it. --summary FILE writes a JSON summary (used by `hspmd demo`).
A config.json beside the checkpoint describes the model, so `hspmd checkpoint export-hf CHECKPOINT DIR`
turns it into a directory that transformers' LlamaForCausalLM.from_pretrained loads.

Under `hspmd run --cluster C` the job runs as cluster C: a cluster file with an emulate block makes
every rank run as its device type on this host (slower compute, its memory, slow links between
nodes: hspmd.runtime.execution.emulation), and rank 0 ends with the measured step time next to
the simulated one (--calibration FILE from `hspmd calibrate`: as this host runs it; else the
file's nominal figures) and each rank's emulated waits. --trace FILE writes a Chrome trace of
every rank, the emulated waits under their own category.

--init-from-hf DIR continues training a local Hugging Face Llama (config.json + safetensors shards,
never downloaded): the model takes DIR's configuration, every rank reads only its own slices of
the weights, and the optimizer starts fresh. The strategy must have the model's layer count, and
the model's vocabulary must cover the data's ids (256 for the shipped bytes; ids are the data's
own, not DIR's tokenizer's unless --data was prepared with `--tokenizer DIR`).

Strategies change while training, without a restart: --switch 20=STRATEGY hot-switches every
weight and optimizer state after step 20 (one fused batched send-receive). Under
`hspmd run -n 4 --elastic`, a rank whose process dies does not end the job: --kill 50=3 makes rank 3
SIGKILL itself inside step 50; the others notice, re-form their groups without it, derive a
strategy without it (hspmd.switching.recover_strategy), take its pieces from replicas in the other
pipeline, redo step 50 and finish (hspmd.runtime.policies.elastic). The summary lists the failures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.progress_bar import ProgressBar
from rich.table import Table

from hspmd.errors import HSPMDError
from hspmd.models.hf_llama import hf_config, read_hf_config, read_hf_config_json
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.planning import from_llama_config
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.emulation import EmulatedBackend, cluster_from_env, emulated
from hspmd.runtime.execution.trace import Tracer, write_trace
from hspmd.runtime.policies.calibrate import simulated_step
from hspmd.runtime.policies.calibration import Calibration
from hspmd.runtime.persistence.hf_checkpoint import HFCheckpoint
from hspmd.backends.from_env import backend_from_env
from hspmd.runtime.policies.elastic import ElasticTrainer, KillPoint, cluster_recovery
from hspmd.runtime.data.loader import SequenceLoader, saved_state
from hspmd.runtime.data.order import DataState
from hspmd.runtime.data.prepare import prepared_now
from hspmd.runtime.data.tokens import TokenFiles
from hspmd.runtime.processes.membership import Membership, is_elastic
from hspmd.runtime.processes.nodes import RankPlace
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.strategy_files import load_strategy
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from hspmd.specialize.strategy_render import describe_strategy

DEFAULT_STRATEGY = "name=hetero-4 ; layers=4 ; 2x4: R0,1 L0-3 ; 2x2: R2 L0-1 | R3 L2-3"
DEFAULT_CHECKPOINT = os.path.join("runs", "llama", "checkpoint.safetensors")
DOCUMENTS = Path(__file__).resolve().parents[1] / "mixed_length" / "documents.txt"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small Llama with a heterogeneous hspmd strategy.")
    p.add_argument("--steps", type=int, default=60, help="train until this many steps are done (default 60)")
    p.add_argument("--schedule", default=None,
                   help="pipeline schedule for every pipeline: gpipe, 1f1b, eager or POLICY:N1,N2,... (default: each "
                        "pipeline's own schedule in the strategy, else 1f1b)")
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, help="strategy in hspmd's compact syntax")
    p.add_argument("--strategy-file", default=None,
                   help="a strategy file (.yaml/.json), e.g. what `hspmd plan --out plan.yaml` wrote; wins over --strategy")
    p.add_argument("--switch", action="append", default=[], metavar="STEP=STRATEGY",
                   help="after STEP, hot-switch to STRATEGY (same global batch); may repeat")
    p.add_argument("--kill", action="append", default=[], metavar="STEP=RANK[:CALL]",
                   help="under `hspmd run --elastic`: that rank SIGKILLs itself inside step STEP (at its CALL-th "
                        "communication of the step, default 1); the others recover and finish; may repeat")
    p.add_argument("--stall", action="append", default=[], metavar="STEP=RANK[:CALL]",
                   help="under --elastic: that rank hangs for good at that point, alive and beating (the authority of "
                        "a multi-node job names it by its stalled progress); may repeat")
    p.add_argument("--seq", type=int, default=32, help="sequence length in tokens (bytes of the shipped corpus)")
    p.add_argument("--data", default=None, metavar="PREFIX",
                   help="train on these prepared token files (`hspmd data prepare`); default: the shipped documents")
    p.add_argument("--record-samples", default=None, metavar="DIR",
                   help="each rank appends the sample ids it trains per step to DIR/rank<N>.jsonl")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the batches")
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="safetensors file written at the end")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--bf16", action="store_true",
                   help="mixed precision: bf16 compute, fp32 master weights and optimizer states")
    p.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="start from a local Hugging Face Llama directory (its config and weights)")
    p.add_argument("--sharded", action="store_true",
                   help="--checkpoint is a directory: every rank writes its own pieces in the background "
                        "(hspmd checkpoint inspect/verify/consolidate read it); --resume loads either kind")
    p.add_argument("--summary", default=None, help="rank 0 writes a JSON summary of the run here")
    p.add_argument("--log-every", type=int, default=1, help="without a terminal, print every N-th step (default 1)")
    p.add_argument("--calibration", default=None,
                   help="`hspmd calibrate`'s file: the simulated step time printed beside the measured one is this "
                        "host's (under hspmd run --cluster with an emulate block)")
    p.add_argument("--trace", default=None, help="write a Chrome trace of every rank's steps here")
    return p.parse_args(argv)


def parse_switches(switches):
    """[(step, Strategy)] from --switch STEP=STRATEGY texts, in step order."""
    parsed = []
    for text in switches:
        step, sep, value = text.partition("=")
        if not sep or not step.strip().isdigit():
            raise HSPMDError(f"--switch {text!r}: write STEP=STRATEGY, e.g. --switch 20='layers=4 ; 6x2: R0 L0-3 ; ...'")
        parsed.append((int(step), parse_strategy(value)))
    return sorted(parsed, key=lambda e: e[0])


def token_files(args) -> TokenFiles:
    """--data's token files, or the shipped documents prepared now as bytes, in a scratch directory
    of this rank's that is removed at once (the open memory maps keep the files readable)."""
    return TokenFiles(args.data) if args.data else prepared_now([DOCUMENTS])


class SampleRecord:
    """--record-samples: this rank's trained sample ids per step, one JSON line each."""

    def __init__(self, directory: str | None, rank: int):
        self.path = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, f"rank{rank}.jsonl")

    def add(self, step: int, trainer: Trainer, batch, loss) -> None:
        if self.path is None:
            return
        rows = list(trainer.layout.pipeline_rows(trainer.pipeline)) if not trainer.idle else None
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "pipeline": batch.pipeline, "rows": rows, "ids": list(batch.ids),
                                "fields": sorted(batch.rows), "loss": loss}) + "\n")


def model_config(args, files: TokenFiles, strategy) -> LlamaConfig:
    """The command line's model, or the Hugging Face directory's (checked against the strategy and data)."""
    if not args.init_from_hf:
        return LlamaConfig(vocab=files.vocab, hidden=args.hidden, layers=strategy.num_layers, heads=args.heads,
                           ffn=args.ffn)
    config = read_hf_config(args.init_from_hf)
    if config.layers != strategy.num_layers:
        raise HSPMDError(f"--init-from-hf {args.init_from_hf}: the model has {config.layers} layers but the strategy "
                         f"covers {strategy.num_layers}; give a --strategy with layers={config.layers}")
    if config.vocab < files.vocab:
        raise HSPMDError(f"--init-from-hf {args.init_from_hf}: the model's vocabulary of {config.vocab} is smaller than "
                         f"the data's {files.vocab} ids ({files.tokenizer})")
    return config


def write_model_config(checkpoint: str, config: LlamaConfig, original: dict | None = None) -> None:
    """config.json beside the checkpoint, for `hspmd checkpoint export-hf` (keeping every field of the
    model's `original` config.json that hspmd does not determine)."""
    directory = os.path.dirname(os.path.abspath(checkpoint))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(config, original=original), f, indent=2, sort_keys=True)


def strategy_of(args: argparse.Namespace):
    """The strategy to train: --strategy-file if given (its text is then reported), else --strategy."""
    if args.strategy_file:
        strategy = load_strategy(args.strategy_file)
        args.strategy = format_strategy(strategy)
        return strategy
    return parse_strategy(args.strategy)


def limit_threads() -> None:
    """Several ranks share this machine's cores: torch's default of one thread per core in every
    rank oversubscribes them many times over (torchrun sets OMP_NUM_THREADS=1 for the same reason)."""
    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


class StepReport:
    """Rank 0's progress: a live rich bar on a terminal, one line with a bar per step otherwise
    (under `hspmd run` the output goes through a pipe, prefixed with the rank)."""

    def __init__(self, console: Console, start: int, total: int, every: int = 1):
        self.console, self.total, self.every = console, total, max(1, every)
        self.live = console.is_terminal
        if self.live:
            self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=console)
            self.task = self.progress.add_task("train", total=total, completed=start, loss="-")
            self.progress.start()

    def update(self, step: int, loss: float, seconds: float) -> None:
        if self.live:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}")
            return
        if step % self.every and step != self.total:
            return
        row = Table.grid(padding=(0, 1))
        row.add_row(f"step {step:>4}/{self.total}", ProgressBar(total=self.total, completed=step, width=30),
                    f"loss {loss:.4f}", f"{seconds:.2f}s")
        self.console.print(row)

    def close(self) -> None:
        if self.live:
            self.progress.stop()


def say_place(place: RankPlace) -> None:
    """Each rank of a job over several nodes (or with a cluster file) says where it runs."""
    if place.nnodes > 1 or place.device_type:
        kind = f" ({place.device_type})" if place.device_type else ""
        print(f"rank {place.rank} runs on node {place.node} of {place.nnodes} at {place.node_addr}{kind}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    limit_threads()
    if is_elastic():
        return main_elastic(args)
    if args.kill:
        raise HSPMDError("--kill needs an elastic job: start it with `hspmd run -n N --elastic examples/llama/train.py`")
    cluster = cluster_from_env()
    backend = emulated(backend_from_env(), cluster)
    rank = backend.rank
    say_place(RankPlace.from_env())
    console = Console(width=100, highlight=False, soft_wrap=True)
    say = console.print if rank == 0 else (lambda *a, **k: None)

    files = token_files(args)
    strategy = strategy_of(args)
    layout = MicroBatchLayout.of(strategy)
    config = model_config(args, files, strategy)
    switches = parse_switches(args.switch)
    strategies = [strategy] + [s for _, s in switches]
    events = {step: (i + 1, "planned switch") for i, (step, _) in enumerate(switches)}
    model = build_llama(config, strategies, optimizer=AdamW(lr=args.lr),
                        compute_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    rows = layout.global_batch_size
    trainer = Trainer(model.graph, 0, backend, strategy, schedule=args.schedule,
                                 symbols={"S": args.seq, "T": rows * args.seq}, seed=args.seed)

    say(describe_strategy(strategy).rstrip())
    loader = SequenceLoader(files, args.seq, args.seed)
    say(f"{layout} sequences of {args.seq} tokens")
    say(f"data: {files.documents} documents, {files.tokens} tokens ({files.tokenizer}), {loader.samples_per_epoch} "
        f"sequences per epoch; model {config}")
    say("pipelines discovered from the specialized graphs:")
    for i, p in enumerate(trainer.specialized.pipelines):
        say(f"  {i}: {p}")
    print(trainer.describe(), flush=True)

    if args.resume and args.init_from_hf:
        raise HSPMDError("--resume and --init-from-hf both say where the weights come from; give one")
    start = trainer.load_checkpoint(args.checkpoint) if args.resume else 0
    data = DataState()
    if args.resume:
        data = saved_state(args.checkpoint) or loader.skip(DataState(), start * rows)
        say(f"resumed from {args.checkpoint} at step {start}; data at epoch {data.epoch}, sample {data.sample}")
    record = SampleRecord(args.record_samples, rank)
    if args.init_from_hf:
        trainer.load_checkpoint(HFCheckpoint(args.init_from_hf, config))
        say(f"initialised from the Hugging Face model in {args.init_from_hf}")
    if rank == 0:
        write_model_config(args.checkpoint, config, read_hf_config_json(args.init_from_hf) if args.init_from_hf else None)
    tracer = Tracer(rank) if args.trace else None
    trainer.tracer = tracer
    if isinstance(backend, EmulatedBackend):
        backend.emulator.tracer = tracer
    losses: list[float] = []
    step_seconds: list[float] = []
    pending = []
    step_end_times: list[float] = []
    began = time.monotonic()
    report = StepReport(console, start, args.steps, args.log_every) if rank == 0 else None
    for step in range(start, args.steps):
        tick = time.monotonic()
        batch, data = loader.share(trainer, data)
        loss = trainer.step(batch)
        step_seconds.append(time.monotonic() - tick)
        record.add(step + 1, trainer, batch, loss)
        step_end_times.append(time.time())
        if loss is not None:
            losses.append(loss)
        if report is not None and loss is not None:
            report.update(step + 1, loss, time.monotonic() - tick)
        if step + 1 in events:
            if report is not None:
                report.close()
            index, why = events[step + 1]
            tick = time.monotonic()
            trainer = trainer.switch(index, strategies[index])
            plan = trainer.last_switch
            say(f"after step {step + 1}: {why}; now {format_strategy(strategies[index])}")
            say(f"  one fused BSR moved {len(plan.names)} parameters and optimizer states in {plan.fused.messages} "
                f"messages, {sum(plan.fused.bytes_sent.values()) / 2**20:.2f} MiB, {time.monotonic() - tick:.2f}s "
                f"(no restart, no checkpoint)")
            print(trainer.describe(), flush=True)
            report = StepReport(console, step + 1, args.steps, args.log_every) if rank == 0 else None
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            if args.sharded:
                pending.append(trainer.save_sharded(args.checkpoint, data=data.to_json()))  # training goes on meanwhile
            else:
                trainer.save_checkpoint(args.checkpoint, data=data.to_json())
    if report is not None:
        report.close()
    if args.sharded:
        for save in pending + [trainer.save_sharded(args.checkpoint, data=data.to_json())]:
            if save is not None:
                save.wait()
    else:
        trainer.save_checkpoint(args.checkpoint, data=data.to_json())
    seconds = time.monotonic() - began
    if losses:
        say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {start + 1}-{args.steps} "
            f"({seconds:.1f}s, {seconds / len(losses):.2f}s/step)")
    say(f"checkpoint: {os.path.abspath(args.checkpoint)} (step {trainer.steps_done})")
    timing = step_report(args, strategy, config, cluster, step_seconds, backend, say)
    if args.trace:
        gather_trace(args.trace, tracer, backend)
        say(f"trace: {os.path.abspath(args.trace)} (emulated waits under the category 'emulated')")
    if rank == trainer.devices[0] and args.summary:  # the lowest rank still training
        with open(args.summary, "w", encoding="utf-8") as f:
            json.dump({"losses": losses, "start_step": start, "steps": args.steps, "seconds": seconds,
                       "checkpoint": os.path.abspath(args.checkpoint), "schedule": args.schedule,
                       "world_size": backend.world_size, "strategy": args.strategy,
                       "step_end_times": step_end_times, "step_seconds": step_seconds, **timing,
                       "data": data.to_json()}, f, indent=1)
    backend.shutdown()
    return 0


def step_report(args, strategy, config, cluster, step_seconds, backend, say) -> dict:
    """Measured step time (median of the steps after the first, with its spread) next to the
    simulated one, and every rank's emulated waits (gathered, so rank 0 prints them all)."""
    measured = sorted(step_seconds[1:] or step_seconds)
    out: dict = {}
    if measured:
        median = measured[len(measured) // 2]
        out["measured_step_s"] = median
        line = f"step time: measured {median:.4f}s (median of {len(measured)} steps, {measured[0]:.4f}-{measured[-1]:.4f})"
        if cluster is not None:
            calibration = Calibration.load(args.calibration) if args.calibration else None
            model = from_llama_config(config, seq_len=args.seq)
            try:
                simulated, source = simulated_step(strategy, cluster, model, calibration, args.schedule or "1f1b")
            except HSPMDError as exc:  # e.g. a cluster file without the model dtype's peak: the run still reports
                line += f"; not simulated ({exc})"
            else:
                out["simulated_step_s"] = simulated
                line += f", simulated {simulated:.4f}s ({source}): measured/simulated {median / simulated:.2f}"
        say(line)
    if isinstance(backend, EmulatedBackend):
        stats = backend.emulator.stats()
        mine = torch.tensor([stats.compute_wait_s, stats.link_wait_s, float(stats.ops), float(stats.peak_bytes)],
                            dtype=torch.float64)
        everyone = tuple(range(backend.world_size))
        rows = backend.inner.all_gather(mine, everyone, [(4,)] * len(everyone))
        out["emulation"] = []
        for r, row in enumerate(rows):
            compute, link, ops, peak = row.tolist()
            kind = cluster.device_type(r).name
            capacity = cluster.emulated_memory(r)
            memory = f", peak {peak / 2**20:.2f} of {capacity / 2**20:.2f} MiB" if capacity is not None else ""
            say(f"  rank {r} emulated {kind} x{cluster.slowdown(r):.3g}: waited {compute:.3f}s for compute "
                f"({int(ops)} ops), {link:.3f}s for links{memory}")
            out["emulation"].append({"rank": r, "device_type": kind, "compute_wait_s": compute, "link_wait_s": link,
                                     "ops": int(ops), "peak_bytes": int(peak), "capacity": capacity})
    return out


def gather_trace(path: str, tracer, backend) -> None:
    """Every rank writes its events beside `path`; rank 0 joins them into one Chrome trace."""
    with open(f"{path}.rank{backend.rank}", "w", encoding="utf-8") as f:
        json.dump(tracer.events, f)
    backend.barrier(tuple(range(backend.world_size)))
    if backend.rank == 0:
        per_rank = []
        for r in range(backend.world_size):
            with open(f"{path}.rank{r}", encoding="utf-8") as f:
                per_rank.append(json.load(f))
            os.remove(f"{path}.rank{r}")
        write_trace(path, per_rank)


def main_elastic(args) -> int:
    """Under `hspmd run --elastic`: ranks may die (for real, e.g. --kill); the survivors recover
    (hspmd.runtime.policies.elastic) and finish the run. The lowest surviving rank reports and writes the summary.
    The process ends with os._exit: gloo operations abandoned at a failure stay pending, and their
    destructors would hold (or abort) the process at interpreter exit."""
    code = 1
    try:
        code = train_elastic(args)
    except HSPMDError as exc:
        print(f"error: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def train_elastic(args) -> int:
    if args.resume:
        raise HSPMDError("--resume is for plain jobs (an elastic job survives deaths without a restart)")
    if args.init_from_hf:
        raise HSPMDError("--init-from-hf is for plain jobs; start without --elastic")
    membership = Membership.from_env()
    say_place(RankPlace.from_env())
    files = token_files(args)
    strategy = strategy_of(args)
    rows = MicroBatchLayout.of(strategy).global_batch_size
    config = model_config(args, files, strategy)
    if membership.rank == min(membership.alive):
        write_model_config(args.checkpoint, config)
    switches = parse_switches(args.switch)
    console = Console(width=100, highlight=False, soft_wrap=True)

    def say(*a):
        if membership.original and membership.rank == min(membership.original):
            console.print(*a)

    dtype = torch.bfloat16 if args.bf16 else torch.float32

    def build(strategies):
        return build_llama(config, list(strategies), optimizer=AdamW(lr=args.lr), compute_dtype=dtype).graph

    cluster = cluster_from_env()
    recovery = None
    if cluster is not None:  # recover on the real hardware: planning.replan with the job's cluster and model
        calibration = Calibration.load(args.calibration) if args.calibration else None
        recovery = cluster_recovery(cluster, from_llama_config(config, seq_len=args.seq), calibration)
    options = dict(schedule=args.schedule, symbols={"S": args.seq, "T": rows * args.seq}, seed=args.seed,
                   plan_recovery=recovery,
                   kills=[KillPoint.parse(k) for k in args.kill] + [KillPoint.parse(k, stall=True) for k in args.stall],
                   describe=format_strategy, sharded=args.sharded,
                   data=SequenceLoader(files, args.seq, args.seed))
    record = SampleRecord(args.record_samples, membership.rank)
    if membership.joining:  # a restarted rank (--max-restarts): take its pieces from the survivors
        trainer = ElasticTrainer.join(build, membership, **options)
        print(f"rank {membership.rank}: restarted, joined at step {trainer.steps_done} under "
              f"{format_strategy(trainer.strategy)}", flush=True)
    else:
        trainer = ElasticTrainer(build, strategy, membership, **options)
    say(describe_strategy(strategy).rstrip())
    say(f"elastic job: {membership.world_size} ranks; a rank that dies is left out and the others continue")
    began = time.monotonic()
    tick = [time.monotonic()]
    step_end_times = {}

    def on_step(step, loss):
        record.add(step, trainer.trainer, trainer.last_batch, loss)
        step_end_times[step] = time.time()
        if loss is not None and (step % max(1, args.log_every) == 0 or step == args.steps):
            say(f"step {step:>4}/{args.steps}  loss {loss:.4f}  {time.monotonic() - tick[0]:.2f}s")
        tick[0] = time.monotonic()

    def on_failure(failure):
        if failure.ranks:
            say(f"rank(s) {list(failure.ranks)} died in step {failure.step}; survivors {list(membership.alive)} recovered "
                f"in {failure.recovery_seconds:.2f}s, redo step {failure.step} under {failure.strategy}")
        if failure.joined:
            say(f"restarted rank(s) {list(failure.joined)} joined in step {failure.step} ({failure.recovery_seconds:.2f}s); "
                f"now {failure.strategy}")
        plan = trainer.trainer.last_switch
        if failure.restored_from:
            say(f"  no living replica held some pieces: every rank loaded its pieces from {failure.restored_from} "
                f"(no restart); training goes back to step {failure.step - 1}")
        else:
            say(f"  one fused BSR moved {len(plan.names)} tensors in {plan.fused.messages} messages, "
                f"{sum(plan.fused.bytes_sent.values()) / 2**20:.2f} MiB")

    def on_switch(step, strategy):
        plan = trainer.trainer.last_switch
        say(f"after step {step}: planned switch; now {format_strategy(strategy)}")
        say(f"  one fused BSR moved {len(plan.names)} parameters and optimizer states in {plan.fused.messages} "
            f"messages, {sum(plan.fused.bytes_sent.values()) / 2**20:.2f} MiB (no restart, no checkpoint)")

    losses = trainer.train(args.steps, None, switches, args.save_every, args.checkpoint, on_step, on_failure, on_switch)
    trainer.save(args.checkpoint)
    seconds = time.monotonic() - began
    say(f"finished {args.steps} steps on ranks {list(membership.alive)} in {seconds:.1f}s; "
        f"checkpoint {os.path.abspath(args.checkpoint)}")
    if membership.original and membership.rank == min(membership.original) and args.summary:
        with open(args.summary, "w", encoding="utf-8") as f:
            json.dump({"losses": [losses[k] for k in sorted(losses)], "start_step": 0, "steps": args.steps,
                       "seconds": seconds, "checkpoint": os.path.abspath(args.checkpoint), "schedule": args.schedule,
                       "world_size": membership.world_size, "strategy": args.strategy,
                       "final_strategy": format_strategy(trainer.strategy), "survivors": list(membership.alive),
                       "step_end_times": [step_end_times[k] for k in sorted(step_end_times)],
                       "failures": [f.as_json() for f in trainer.failures], "data": trainer.data_state.to_json()},
                      f, indent=1)
    membership.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HSPMDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
