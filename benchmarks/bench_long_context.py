"""One long sequence under context parallelism (hspmd.ops.context): memory per rank for CP1/2/4 and
step time of ring vs all-to-all vs all-gather-KV attention, on the in-process backend (one thread
per rank, CPU).

Memory: a tiny Llama (2 layers, hidden 64, 4 heads) trains one sequence of --seq tokens; per rank
we read the activation bytes the schedule kept between forward and backward (ScheduleRun,
measured on the tensors) and the peak bytes of storages alive during the step (LiveBytes, every
allocation on the rank's thread), each as a ratio to CP1, beside the cost model's activation
prediction for the same stage (CostModel.memory; at CP1 it counts the S x S softmax probabilities
that hspmd's attention recomputes rather than keeps, so it over-predicts CP1).

Time: CP4 under each attention mode, the modes interleaved step by step (--reps rounds); the
median over rounds of each step's wall time and the spread (min-max), as a ratio to the ring's
median. In-process ranks share two CPU cores here, so the times say what hspmd's executor does
with the modes' op counts and messages on this machine, not what GPUs with NVLink would see.

    PYTHONPATH=$PWD python benchmarks/bench_long_context.py --seq 1024 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import table  # noqa: E402

from hspmd.backends.memory import LiveBytes  # noqa: E402
from hspmd.cluster.presets import parse_cluster  # noqa: E402
from hspmd.models.llama import LlamaConfig, build_llama  # noqa: E402
from hspmd.ops import AdamW  # noqa: E402
from hspmd.ops.context import head_tail_order, in_token_order  # noqa: E402
from hspmd.planning.cost import CostModel  # noqa: E402
from hspmd.planning.model import from_llama_config  # noqa: E402
from hspmd.planning.strategy_sim import plan_run  # noqa: E402
from hspmd.runtime.execution.batches import MicroBatchLayout  # noqa: E402
from hspmd.runtime.training.inprocess import InProcessJob  # noqa: E402
from hspmd.specialize.strategy_text import parse_strategy  # noqa: E402

CONFIG = LlamaConfig(vocab=64, hidden=64, layers=2, heads=4, ffn=128)


def _strategy(cp: int, mode: str = "ring") -> str:
    ranks = "0" if cp == 1 else f"0-{cp - 1}"
    return f"1x1: R{ranks} L0-1" + (f" cp{cp}" if cp > 1 else "") + (f" ; cp_attention={mode}" if mode != "ring" else "")


def _job(text: str, seq: int) -> tuple[InProcessJob, dict[str, torch.Tensor]]:
    strategy = parse_strategy(text)
    model = build_llama(CONFIG, [strategy], optimizer=AdamW(lr=1e-3), context="ring" if strategy.max_cp == 1 else None)
    job = InProcessJob(model.graph, 0, MicroBatchLayout.of(strategy), symbols={"S": seq, "T": seq})
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, CONFIG.vocab, (1, seq), generator=gen) for _ in range(2))
    return job, in_token_order({"tokens": tokens, "labels": labels}, head_tail_order(seq, strategy.max_cp))


def _measured_step(job: InProcessJob, batch) -> tuple[dict[int, int], dict[int, int]]:
    def rank(backend):
        trainer = job.trainers[backend.rank]
        with LiveBytes() as live:
            trainer.step(batch)
        return trainer.last_run.peak_held_bytes, live.peak

    out = job.world.run(rank)
    return {r: v[0] for r, v in out.items()}, {r: v[1] for r, v in out.items()}


def memory_table(seq: int) -> str:
    cost = CostModel(parse_cluster("nvlink-ib:1x8"), from_llama_config(CONFIG, seq))
    rows, base = [], None
    for cp in (1, 2, 4):
        job, batch = _job(_strategy(cp), seq)
        held, live = _measured_step(job, batch)
        predicted = plan_run(parse_strategy(_strategy(cp)), cost, seq=seq).pipelines[0].stages[0].activation_memory
        worst = (max(held.values()), max(live.values()), predicted)
        base = base or worst
        rows.append([f"CP{cp}", f"{worst[0] / 2**20:.1f}", f"{worst[0] / base[0]:.2f}", f"{worst[1] / 2**20:.1f}",
                     f"{worst[1] / base[1]:.2f}", f"{worst[2] / 2**20:.1f}", f"{1 / cp:.2f}"])
    return table(["layout", "held MiB/rank", "held vs CP1", "peak live MiB/rank", "peak vs CP1", "model held MiB/rank",
                  "1/CP"], rows)


def time_table(seq: int, reps: int, cp: int = 4) -> str:
    modes = ("ring", "all_to_all", "all_gather")
    jobs = {m: _job(_strategy(cp, m), seq) for m in modes}
    for job, batch in jobs.values():  # warm-up: first steps make the optimizer state
        job.step(batch)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):
        for m in modes:  # interleaved: each round times every mode once
            job, batch = jobs[m]
            start = time.perf_counter()
            job.step(batch)
            times[m].append(time.perf_counter() - start)
    ring = statistics.median(times["ring"])
    rows = [[m, f"{statistics.median(t) * 1e3:.0f}", f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}",
             f"{statistics.median(t) / ring:.2f}"] for m, t in times.items()]
    return table([f"CP{cp} attention", "median ms/step", "spread (min-max)", "vs ring"], rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"one sequence of {args.seq} tokens, {CONFIG.layers} layers, hidden {CONFIG.hidden}, {CONFIG.heads} heads")
    print(memory_table(args.seq))
    print()
    print(time_table(args.seq, args.reps))


if __name__ == "__main__":
    main()
