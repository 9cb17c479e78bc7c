"""Recovery from a real rank death: elastic (hspmd run --elastic) against checkpoint-restart.

8 gloo processes train the demo's Llama (hidden 64, 4 layers) under a heterogeneous 8-rank
strategy; rank 7 SIGKILLs itself inside step K.

* elastic: the survivors recover in place; measured from the kill (the dying rank writes the
  time to the store) to the end of the redone step K on the survivors.
* restart (the usual torchrun answer): stop everything, relaunch the 7 survivors under the recovered
  strategy, load the last checkpoint, redo the lost step. Best case for it: the checkpoint is from
  step K-1 (saved every step) and detecting the death and stopping the job cost nothing; measured
  from the relaunch to the end of step K.

Runs interleave (elastic, restart, elastic, restart, ...) and the table reports medians, the ratio
of medians and the spread of per-pair ratios. It also prints the bytes the recovery's fused BSR
moved against the lower bound (every byte a survivor needs under the new strategy and did not
hold before).

    python benchmarks/bench_recovery.py [--reps 2]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import table
from hspmd.annotations import device_pieces
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.data.prepare import BYTES_VOCAB
from hspmd.runtime.processes.launcher import launch
from hspmd.specialize.deduce import deduce
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from hspmd.switching import plan_switch, recover_strategy

SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "llama" / "train.py")
STRATEGY = "name=hetero-8 ; layers=4 ; 2x4: R0,1 L0-1 | R2,3 L2-3 ; 2x2: R4 L0 | R5 L1 | R6 L2 | R7 L3"
KILL_STEP, KILL_RANK, STEPS = 6, 7, 7
MODEL = ["--hidden", "64", "--heads", "4", "--ffn", "128", "--seq", "32", "--log-every", "100"]


def run(tmp: Path, name: str, nprocs: int, args: list[str], elastic: bool) -> dict:
    summary = tmp / f"{name}.json"
    out = io.StringIO()
    code = launch([sys.executable, SCRIPT, *MODEL, "--summary", str(summary), *args], nprocs, stdout=out, stderr=out,
                  elastic=elastic)
    if code != 0:
        raise SystemExit(f"bench_recovery: {name} failed (exit code {code}):\n{out.getvalue()[-3000:]}")
    return json.loads(summary.read_text())


def elastic_seconds(tmp: Path, rep: int) -> tuple[float, float]:
    s = run(tmp, f"elastic{rep}", 8, ["--strategy", STRATEGY, "--steps", str(STEPS), "--kill", f"{KILL_STEP}={KILL_RANK}",
                                       "--checkpoint", str(tmp / f"elastic{rep}.safetensors")], elastic=True)
    (failure,) = s["failures"]
    assert failure["ranks"] == [KILL_RANK] and failure["step"] == KILL_STEP, failure
    return s["step_end_times"][KILL_STEP - 1] - failure["killed_at"], failure["recovery_seconds"]


def restart_seconds(tmp: Path, rep: int, checkpoint: Path, recovered: str) -> float:
    mine = tmp / f"restart{rep}.safetensors"
    shutil.copy(checkpoint, mine)
    began = time.time()
    s = run(tmp, f"restart{rep}", 7, ["--strategy", recovered, "--steps", str(KILL_STEP), "--resume",
                                      "--checkpoint", str(mine)], elastic=False)
    return s["step_end_times"][-1] - began


def bytes_against_lower_bound(recovered, vocab: int) -> tuple[int, int]:
    """(bytes the recovery plan sends, bytes survivors must receive at the least)."""
    config = LlamaConfig(vocab=vocab, hidden=64, layers=4, heads=4, ffn=128)
    strategies = [parse_strategy(STRATEGY), recovered]
    graph = build_llama(config, strategies, optimizer=AdamW(lr=1e-2)).graph
    plan = plan_switch(graph, 0, 1, failed=[KILL_RANK])
    src, dst = deduce(graph, 0), deduce(graph, 1)
    bound = 0
    for node in graph.nodes_of_kind("parameter", "state"):
        t = node.output
        shape = tuple(t.shape)
        before, after = device_pieces(src[t], shape), device_pieces(dst[t], shape)
        size = t.dtype.itemsize
        for device, piece in after.items():
            need = _volume(piece.box)
            if device in before and device != KILL_RANK:
                need -= _volume(_intersect(piece.box, before[device].box))
            bound += need * size
    return sum(plan.fused.bytes_sent.values()), bound


def _volume(box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def _intersect(x, y):
    return tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="elastic/restart pairs (interleaved)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    recovered = recover_strategy(parse_strategy(STRATEGY), [KILL_RANK])
    recovered_text = format_strategy(recovered)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # the restart's checkpoint: the state after step K-1 (not timed)
        checkpoint = tmp / "before-kill.safetensors"
        run(tmp, "prepare", 8, ["--strategy", STRATEGY, "--steps", str(KILL_STEP - 1), "--checkpoint", str(checkpoint)],
            elastic=False)
        elastic, inside, restart = [], [], []
        for rep in range(args.reps):
            seconds, recovery = elastic_seconds(tmp, rep)
            elastic.append(seconds)
            inside.append(recovery)
            restart.append(restart_seconds(tmp, rep, checkpoint, recovered_text))
    sent, bound = bytes_against_lower_bound(recovered, BYTES_VOCAB)  # the example trains on bytes
    ratios = [e / r for e, r in zip(elastic, restart)]
    print(f"8 gloo processes, demo Llama (hidden 64, 4 layers), {STRATEGY}; rank {KILL_RANK} SIGKILLed in step {KILL_STEP}")
    print(f"recovered strategy: {recovered_text}")
    print(table(["", "median s", "runs"], [
        ["elastic: kill -> step redone", f"{statistics.median(elastic):.2f}", " ".join(f"{x:.2f}" for x in elastic)],
        ["  of which recovery (groups, agreement, BSR)", f"{statistics.median(inside):.2f}",
         " ".join(f"{x:.2f}" for x in inside)],
        ["restart: relaunch -> step redone", f"{statistics.median(restart):.2f}", " ".join(f"{x:.2f}" for x in restart)],
    ]))
    print(f"elastic / restart: median {statistics.median(elastic) / statistics.median(restart):.2f} "
          f"(per pair {min(ratios):.2f}-{max(ratios):.2f}); goal: under 10 s and at most 0.5")
    print(f"bytes moved by the recovery BSR: {sent / 2**20:.3f} MiB; lower bound {bound / 2**20:.3f} MiB "
          f"(ratio {sent / bound:.2f})" if bound else f"bytes moved: {sent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
