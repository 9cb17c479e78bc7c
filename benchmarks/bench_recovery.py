"""Recovery from a real rank death and a real node loss: elastic against checkpoint-restart.

Rank row: 8 gloo processes (one `hspmd run --elastic`) train the demo's Llama (hidden 64, 4 layers)
under a heterogeneous 8-rank strategy; rank 7 SIGKILLs itself inside step K.

Node row: three "nodes" on this machine, `hspmd run --elastic --nnodes 3 --node-rank K` on 127.0.0.1,
.2 and .3 (2 ranks each) around an `hspmd authority` process, a strategy whose pipeline spans nodes
0 and 2; once node 0 reports step K-1, node 2's launcher and both its ranks are SIGKILLed together.

* elastic: the survivors recover in place; measured from the kill (the dying rank writes the
  time to the store; for the node, the bench notes it just before its kill) to the end of the
  redone step K on the survivors. The summary's detection time (the authority's announcement) and
  recovery time (groups, agreement, BSR) are shown beside it.
* restart (the usual torchrun answer): stop everything, relaunch the survivors (7 ranks; 2 nodes of
  2 ranks) under the recovered strategy, load the last checkpoint, redo the lost step. Best case for
  it: the checkpoint is from step K-1 (saved every step) and detecting the death and stopping the
  job cost nothing; measured from the relaunch to the end of step K.

Runs interleave (elastic, restart, elastic, restart, ...) and the table reports medians, the ratio
of medians and the spread of per-pair ratios. It also prints the bytes the recovery's fused BSR
moved against the lower bound (every byte a survivor needs under the new strategy and did not
hold before).

    python benchmarks/bench_recovery.py [--reps 2] [--rows rank,node]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import table
from hspmd.annotations import device_pieces
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.data.prepare import BYTES_VOCAB
from hspmd.runtime.processes.launcher import launch
from hspmd.runtime.processes.loopback import end_node, node_command, signal_node, start_authority, start_node
from hspmd.runtime.processes.ports import free_port
from hspmd.specialize.deduce import deduce
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from hspmd.switching import plan_switch, recover_strategy

SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "llama" / "train.py")
STRATEGY = "name=hetero-8 ; layers=4 ; 2x4: R0,1 L0-1 | R2,3 L2-3 ; 2x2: R4 L0 | R5 L1 | R6 L2 | R7 L3"
KILL_STEP, KILL_RANK, STEPS = 6, 7, 7
MODEL = ["--hidden", "64", "--heads", "4", "--ffn", "128", "--seq", "32", "--log-every", "100"]
# node row: pipeline 0 is a TP2 stage on node 0 handing off to a TP2 stage on node 2, pipeline 1 is node 1's
NODE_STRATEGY = "name=hetero-3-nodes ; layers=4 ; 2x4: R0,1 L0-1 | R4,5 L2-3 ; 2x2: R2 L0-1 | R3 L2-3"
NODES, PER_NODE, LOST_NODE, NODE_HEARTBEAT = 3, 2, 2, 2.0


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


def node_elastic_seconds(tmp: Path, rep: int) -> tuple[float, float, float, str]:
    """(kill -> redone step, kill -> the authority's announcement, recovery, recovered strategy) of
    one three-node run losing node 2 whole after node 0 reported step K-1."""
    port, job_secret = free_port(), os.urandom(32).hex()
    summary = tmp / f"node-elastic{rep}.json"
    script = [SCRIPT, *MODEL[:-2], "--log-every", "1", "--strategy", NODE_STRATEGY, "--steps", str(STEPS), "--summary",
              str(summary), "--checkpoint", str(tmp / f"node-elastic{rep}.safetensors")]
    authority = start_authority(port, job_secret, NODE_HEARTBEAT)
    nodes = [start_node(node_command(k, NODES, port, PER_NODE, script, elastic=True, heartbeat=NODE_HEARTBEAT), job_secret)
             for k in range(NODES)]
    reported = threading.Event()
    lines: list[str] = []

    def watch() -> None:
        for line in nodes[0].stdout:
            lines.append(line)
            if f"step {KILL_STEP - 1:>4}/" in line:
                reported.set()

    threading.Thread(target=watch, daemon=True).start()
    guards: list[int] = []
    try:
        if not reported.wait(600):
            raise SystemExit(f"bench_recovery: node 0 never reported step {KILL_STEP - 1}:\n" + "".join(lines)[-3000:])
        struck = time.time()
        guards = signal_node(nodes[LOST_NODE].pid, signal.SIGKILL)
        survivors = [p for k, p in enumerate(nodes) if k != LOST_NODE]
        errors = [p.communicate(timeout=600)[1] for p in survivors]
        authority.communicate(timeout=60)
        if any(p.returncode != 0 for p in survivors):
            raise SystemExit("bench_recovery: a surviving node failed:\n" + "".join(lines)[-2000:] + "\n".join(errors)[-3000:])
    finally:
        end_node(nodes[LOST_NODE].pid, guards)
        for p in [*nodes, authority]:
            if p.poll() is None:
                p.kill()
            p.wait()
    s = json.loads(summary.read_text())
    failures = s["failures"]  # one generation, or two when the ranks' connections closed in two polls
    lost = [LOST_NODE * PER_NODE + r for r in range(PER_NODE)]
    assert sorted(r for f in failures for r in f["ranks"]) == lost, failures
    assert any(f["lost_nodes"] == [LOST_NODE] for f in failures), failures
    redone = failures[-1]["step"]
    return (s["step_end_times"][redone - 1] - struck, failures[0]["detected_at"] - struck,
            sum(f["recovery_seconds"] for f in failures), s["final_strategy"])


def node_restart_seconds(tmp: Path, rep: int, checkpoint: Path, recovered: str) -> float:
    """Relaunch the two surviving nodes (2 ranks each, renumbered 0-3: the lost node was the last)
    under the recovered strategy from the checkpoint of step K-1; seconds to the end of step K."""
    mine = tmp / f"node-restart{rep}.safetensors"
    shutil.copy(checkpoint, mine)
    summary = tmp / f"node-restart{rep}.json"
    script = [SCRIPT, *MODEL, "--strategy", recovered, "--steps", str(KILL_STEP), "--resume", "--checkpoint", str(mine),
              "--summary", str(summary)]
    port, job_secret = free_port(), os.urandom(32).hex()
    began = time.time()
    nodes = [start_node(node_command(k, NODES - 1, port, PER_NODE, script), job_secret) for k in range(NODES - 1)]
    try:
        outputs = [p.communicate(timeout=600) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in nodes):
        raise SystemExit("bench_recovery: the restart failed:\n" + "\n".join(o + e for o, e in outputs)[-3000:])
    return json.loads(summary.read_text())["step_end_times"][-1] - began


def bytes_against_lower_bound(strategy: str, failed: list[int], recovered, vocab: int) -> tuple[int, int]:
    """(bytes the recovery plan sends, bytes survivors must receive at the least)."""
    config = LlamaConfig(vocab=vocab, hidden=64, layers=4, heads=4, ffn=128)
    strategies = [parse_strategy(strategy), recovered]
    graph = build_llama(config, strategies, optimizer=AdamW(lr=1e-2)).graph
    plan = plan_switch(graph, 0, 1, failed=failed)
    src, dst = deduce(graph, 0), deduce(graph, 1)
    bound = 0
    for node in graph.nodes_of_kind("parameter", "state"):
        t = node.output
        shape = tuple(t.shape)
        before, after = device_pieces(src[t], shape), device_pieces(dst[t], shape)
        size = t.dtype.itemsize
        for device, piece in after.items():
            need = _volume(piece.box)
            if device in before and device not in failed:
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


def spread(values: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in values)


def rank_row(tmp: Path, reps: int) -> list[list[str]]:
    recovered = recover_strategy(parse_strategy(STRATEGY), [KILL_RANK])
    recovered_text = format_strategy(recovered)
    # the restart's checkpoint: the state after step K-1 (not timed)
    checkpoint = tmp / "before-kill.safetensors"
    run(tmp, "prepare", 8, ["--strategy", STRATEGY, "--steps", str(KILL_STEP - 1), "--checkpoint", str(checkpoint)],
        elastic=False)
    elastic, inside, restart = [], [], []
    for rep in range(reps):
        seconds, recovery = elastic_seconds(tmp, rep)
        elastic.append(seconds)
        inside.append(recovery)
        restart.append(restart_seconds(tmp, rep, checkpoint, recovered_text))
    sent, bound = bytes_against_lower_bound(STRATEGY, [KILL_RANK], recovered, BYTES_VOCAB)  # the example trains on bytes
    print(f"rank row: 8 gloo processes, demo Llama (hidden 64, 4 layers), {STRATEGY}; rank {KILL_RANK} SIGKILLed in "
          f"step {KILL_STEP}; recovered strategy: {recovered_text}; {moved(sent, bound)}")
    return rows("rank", elastic, None, inside, restart, goal=2.0)


def node_row(tmp: Path, reps: int) -> list[list[str]]:
    checkpoint = tmp / "node-before-kill.safetensors"
    run(tmp, "node-prepare", NODES * PER_NODE, ["--strategy", NODE_STRATEGY, "--steps", str(KILL_STEP - 1), "--checkpoint",
                                                str(checkpoint)], elastic=False)
    elastic, detected, inside, restart = [], [], [], []
    recovered_text = ""
    for rep in range(reps):
        seconds, detection, recovery, recovered_text = node_elastic_seconds(tmp, rep)
        elastic.append(seconds)
        detected.append(detection)
        inside.append(recovery)
        restart.append(node_restart_seconds(tmp, rep, checkpoint, recovered_text))
    lost = [LOST_NODE * PER_NODE + r for r in range(PER_NODE)]
    sent, bound = bytes_against_lower_bound(NODE_STRATEGY, lost, parse_strategy(recovered_text), BYTES_VOCAB)
    print(f"node row: {NODES} loopback nodes x {PER_NODE} gloo processes around `hspmd authority` (heartbeat "
          f"{NODE_HEARTBEAT:g}s), {NODE_STRATEGY}; node {LOST_NODE} (ranks {lost}) SIGKILLed whole after step "
          f"{KILL_STEP - 1}; recovered strategy: {recovered_text}; {moved(sent, bound)}")
    return rows("node", elastic, detected, inside, restart, goal=5.0)


def moved(sent: int, bound: int) -> str:
    return (f"the recovery BSR moved {sent / 2**20:.3f} MiB, lower bound {bound / 2**20:.3f} MiB (ratio {sent / bound:.2f})"
            if bound else f"the recovery BSR moved {sent} bytes (lower bound 0: a living replica held every piece)")


def rows(what: str, elastic: list[float], detected: list[float] | None, inside: list[float], restart: list[float],
         goal: float) -> list[list[str]]:
    ratios = [e / r for e, r in zip(elastic, restart)]
    median_ratio = statistics.median(elastic) / statistics.median(restart)
    out = [[f"{what} lost, elastic: kill -> step redone", f"{statistics.median(elastic):.2f}", spread(elastic),
            f"{median_ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f}); goal < {goal:g} s and <= 0.2"]]
    if detected is not None:
        out.append(["  of which kill -> announced by the authority", f"{statistics.median(detected):.2f}", spread(detected), ""])
    out.append(["  of which recovery (groups, agreement, BSR)", f"{statistics.median(inside):.2f}", spread(inside), ""])
    out.append([f"{what} lost, restart: relaunch -> step redone", f"{statistics.median(restart):.2f}", spread(restart), ""])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="elastic/restart pairs (interleaved)")
    parser.add_argument("--rows", default="rank,node", help="which losses to measure: rank, node or both (default)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    chosen = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not chosen or set(chosen) - {"rank", "node"}:
        parser.error(f"--rows takes rank, node or rank,node; got {args.rows!r}")
    table_rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for row in chosen:
            table_rows += (rank_row if row == "rank" else node_row)(tmp, args.reps)
    print(table(["", "median s", "runs", "elastic / restart: median (per pair)"], table_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
