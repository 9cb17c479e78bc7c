"""Mixed-length training of a small Llama on 4 ranks: each step's strategy from a pool, chosen by
the step's longest sequence; sequences dispatched to the strategy's pipelines by a cost model and
packed into rows (Hetu v2 §7.3, Hetu-B); or, with --buckets, length buckets run one after
another inside each step (Hetu-A / HotSPa).

    hspmd run -n 4 examples/mixed_length/train.py [--steps 8] [--tokens 256] [--buckets] [--data PREFIX]

The data: the shipped long-tailed documents (documents.txt, one per line), prepared as bytes into
token files at start (or --data: files from `hspmd data prepare`); each epoch shuffles them, and a
step takes whole documents (hspmd.runtime.data.loader.DocumentLoader) until --tokens labels. Every
rank knows each sequence's length from the index and reads only the sequences dispatched to its
pipeline.

The pool mirrors the paper's Table 11 on 4 ranks. A rank holds the activations of at most UNIT
(48) tokens per micro-batch (a stand-in for GPU memory; tensor parallelism shares them), so a
sequence of up to 4 x UNIT tokens needs TP4, up to 2 x UNIT DP2TP2 (two tensor-parallel
pipelines) or the heterogeneous TP2+2TP1 (one TP2 pipeline for the longer sequences next to two
single-rank ones for the short), up to UNIT DP4 (four single-rank pipelines, the most data
parallelism). The paper's rule takes the entry with the smallest length bound (DP2TP2 before
TP2+2TP1 on a tie); --calibrate chooses by predicted time. The per-sequence
costs a s^2 + b s (+ c per micro-batch) below are rough starting figures; --calibrate measures them
and the price of a switch on this machine first, and then picks each step's strategy by predicted
time.
Rank 0 prints each step's strategy, dispatch (pipeline: [packed lengths] per micro-batch) and switches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hspmd.backends.from_env import backend_from_env  # noqa: E402
from hspmd.models.llama import LlamaConfig, build_llama  # noqa: E402
from hspmd.ops import AdamW  # noqa: E402
from hspmd.planning.dispatch import PipelineCost, PoolEntry  # noqa: E402
from hspmd.runtime.data.loader import DocumentLoader  # noqa: E402
from hspmd.runtime.data.order import DataState  # noqa: E402
from hspmd.runtime.data.prepare import prepared_now  # noqa: E402
from hspmd.runtime.data.tokens import TokenFiles  # noqa: E402
from hspmd.runtime.policies.mixed import MixedLengthTrainer  # noqa: E402
from hspmd.specialize.strategy_text import parse_strategy  # noqa: E402

UNIT = 48
WIDE = "name=TP4 ; layers=2 ; ?x?: R0,1,2,3 L0-1"
MIDDLE = "name=DP2TP2 ; layers=2 ; ?x?: R0,1 L0-1 ; ?x?: R2,3 L0-1"
MIXED = "name=TP2+2TP1 ; layers=2 ; ?x?: R0,1 L0-1 ; ?x?: R2 L0-1 ; ?x?: R3 L0-1"
NARROW = "name=DP4 ; layers=2 ; ?x?: R0 L0-1 ; ?x?: R1 L0-1 ; ?x?: R2 L0-1 ; ?x?: R3 L0-1"
TP4 = PipelineCost(a=2e-5, b=2e-4, c=0.12, max_tokens=4 * UNIT)
TP2 = PipelineCost(a=2e-5, b=2e-4, c=0.06, max_tokens=2 * UNIT)
TP1 = PipelineCost(a=2e-5, b=2e-4, c=0.03, max_tokens=UNIT)
POOL = (PoolEntry("TP4", 0, 4 * UNIT, (TP4,)), PoolEntry("DP2TP2", 1, 2 * UNIT, (TP2, TP2)),
        PoolEntry("DP4", 2, UNIT, (TP1,) * 4), PoolEntry("TP2+2TP1", 3, 2 * UNIT, (TP2, TP1, TP1)))
CALIBRATION_LENGTHS = (8, 16, 32, 48, 64, 96, 128, 192)
CONFIG = dict(layers=2, hidden=64, heads=4, ffn=128)
DOCUMENTS = Path(__file__).resolve().parent / "documents.txt"


def token_files(data: str | None) -> TokenFiles:
    """--data's token files, or the shipped documents prepared now as bytes in a scratch directory
    of this rank's, removed at once (the open memory maps keep the files readable)."""
    return TokenFiles(data) if data else prepared_now([DOCUMENTS])


def build(vocab: int, more: tuple[str, ...] = ()):
    """The packed model over the pool's strategies (graph indices 0-3, POOL's order), then `more`."""
    return build_llama(LlamaConfig(vocab=vocab, **CONFIG),
                       [parse_strategy(t) for t in (WIDE, MIDDLE, NARROW, MIXED, *more)], optimizer=AdamW(lr=3e-3),
                       packed=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="tokens per step (whole documents, at least this many)")
    p.add_argument("--buckets", action="store_true", help="Hetu-A: length buckets inside each step")
    p.add_argument("--data", default=None, metavar="PREFIX", help="prepared token files (default: the shipped documents)")
    p.add_argument("--seed", type=int, default=0, help="seeds the data order")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the pool's costs and the switch price here first; choose strategies by cost")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    backend = backend_from_env()
    files = token_files(args.data)
    loader, state = DocumentLoader(files, longest=4 * UNIT, seed=args.seed), DataState()
    model = build(files.vocab)
    trainer = MixedLengthTrainer(model.graph, POOL, backend, symbols={"S": 16, "T": 16}, passes=20,
                                 by_cost=args.calibrate)
    lead = backend.rank == 0
    if args.calibrate:
        pool = trainer.calibrate(CALIBRATION_LENGTHS)
        if lead:
            for entry in pool:
                cost = entry.pipelines[0]
                print(f"calibrated {entry.name}: {cost.a:.3g} s^2 + {cost.b:.3g} s + {cost.c:.3g} seconds per "
                      f"micro-batch, {entry.sync * 1e3:.0f} ms per step")
            print(f"calibrated switch: {trainer.switch_seconds * 1e3:.0f} ms")
    for i in range(args.steps):
        samples, state = loader.step(state, args.tokens)
        began = time.perf_counter()
        loss = (trainer.step_buckets if args.buckets else trainer.step)(samples)
        seconds = time.perf_counter() - began
        if lead:
            report = trainer.history[-1]
            switched = ", ".join(f"{a} -> {b}" for a, b in report.switches) or "none"
            print(f"step {i + 1}: {len(samples)} sequences, longest {max(samples.lengths)}, "
                  f"loss {loss:.4f}, {seconds:.2f}s, switches: {switched}")
            for k, d, lengths in zip(report.entries, report.dispatches, report.lengths):
                print(f"  {POOL[k].name}:")
                print("    " + d.describe(lengths).replace("\n", "\n    "))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
