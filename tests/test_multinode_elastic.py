"""Elasticity across nodes: three `hspmd run --elastic --nnodes 3` launchers on 127.0.0.1-3 (2 ranks
each) around an `hspmd authority` (the job's store and membership authority, a process of its own
so that it outlives any training node). A whole node is lost, its launcher and ranks SIGKILLed
together at a random step, or frozen (SIGSTOP): the other nodes name it, recover as on one host and
finish every step, and their losses equal a reference of live processes that switched to the
recovered strategy at that step boundary. Under a two-type cluster file on two nodes, an H800's
death recovers to the strategy planning.replan gives for that cluster."""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hspmd.cluster import parse_cluster
from hspmd.models.llama import LlamaConfig
from hspmd.planning.model import from_llama_config
from hspmd.runtime.processes import loopback
from hspmd.runtime.processes.authority import serve
from hspmd.runtime.processes.launcher import launch
from hspmd.runtime.processes.ports import free_port
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from hspmd.switching import recover_strategy
from tests.cluster_files import H800_H20_TWO_NODES
from tests.example_modules import example_module

# each test runs three launchers and a six-process reference (minutes on a busy 2-core machine): `make elastic`
pytestmark = [pytest.mark.multiprocess, pytest.mark.elastic_full, pytest.mark.xdist_group("multinode")]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "examples" / "llama" / "train.py")
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--seq", "8", "--log-every", "1"]
STEPS = 6
# pipeline 0 spans nodes 0 and 1; pipeline 1 is node 2's: losing node 1 leaves layers 2-3 on node 2 only
STRATEGY = "layers=4 ; 2x4: R0,1 L0-1 | R2,3 L2-3 ; 2x2: R4 L0-1 | R5 L2-3"
# two nodes, H800s (ranks 0, 1) then H20s (2, 3): pipeline 1 spans them
TWO_TYPE_STRATEGY = "name=hetero-4 ; layers=4 ; 2x4: R0,1 L0-3 ; 2x2: R2 L0-1 | R3 L2-3"


def start_authority(port: int, job_secret: str, heartbeat: float, stuck: float = 0.0) -> dict:
    result: dict = {"err": io.StringIO()}

    def run():
        result["code"] = serve("127.0.0.1", port, heartbeat, stuck, 120.0, err=result["err"], secret=job_secret)

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def start_node(node: int, port: int, job_secret: str, args: list[str], heartbeat: float,
               join: bool = False) -> subprocess.Popen:
    return loopback.start_node(loopback.node_command(node, 3, port, 2, [SCRIPT, *args], elastic=True, heartbeat=heartbeat,
                                                     join=join), job_secret)


def watch(process: subprocess.Popen, lines: list[str], seen: threading.Condition) -> None:
    for line in process.stdout:
        with seen:
            lines.append(line)
            seen.notify_all()


def reference(tmp: Path, boundary: int, strategy: str) -> dict:
    summary = tmp / "reference.json"
    out = io.StringIO()
    code = launch([sys.executable, SCRIPT, "--steps", str(STEPS), *SMALL, "--strategy", STRATEGY, "--switch",
                   f"{boundary}={strategy}", "--summary", str(summary), "--checkpoint", str(tmp / "reference.safetensors")],
                  6, stdout=out, stderr=out)
    assert code == 0, out.getvalue()
    return json.loads(summary.read_text())


def run_losing_a_node(tmp: Path, how: str, after_step: int) -> tuple[dict, str, float]:
    """Train on three nodes and, once node 0 reports `after_step`, kill node 1 whole, freeze it, or
    (`stall`) have rank 4 hang for good in the next step (alive, beating) until the authority names it."""
    port, job_secret, heartbeat = free_port(), os.urandom(32).hex(), 2.0
    authority = start_authority(port, job_secret, heartbeat, stuck=3.0 if how == "stall" else 0.0)
    summary = tmp / "elastic.json"
    args = ["--steps", str(STEPS), *SMALL, "--strategy", STRATEGY, "--summary", str(summary), "--checkpoint",
            str(tmp / "elastic.safetensors")] + (["--stall", f"{after_step + 1}=4:1"] if how == "stall" else [])
    nodes = [start_node(k, port, job_secret, args, heartbeat) for k in range(3)]
    lines: list[str] = []
    seen = threading.Condition()
    threading.Thread(target=watch, args=(nodes[0], lines, seen), daemon=True).start()
    with seen:
        assert seen.wait_for(lambda: any(f"step {after_step:>4}/" in line for line in lines), timeout=300), "".join(lines)
    victims = loopback.rank_guards(nodes[1].pid)
    struck = time.time()
    if how == "kill":  # the node's ranks and its launcher, all at once
        loopback.signal_node(nodes[1].pid, signal.SIGKILL, victims)
    elif how == "freeze":  # every process of the node stops (its heartbeats stop), none dies
        loopback.signal_node(nodes[1].pid, signal.SIGSTOP, victims)
    survivors = nodes if how == "stall" else [nodes[0], nodes[2]]
    try:
        outputs = [p.communicate(timeout=400) for p in survivors]
    finally:
        loopback.end_node(nodes[1].pid, victims)
        for p in nodes:
            p.kill()
            p.send_signal(signal.SIGCONT)
            p.wait()
    authority["thread"].join(60)
    log = "".join(lines) + "\n".join(o + e for o, e in outputs) + authority["err"].getvalue()
    assert all(p.returncode == 0 for p in survivors), log
    return json.loads(summary.read_text()), log, struck


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_lost_node_is_named_and_the_others_finish_equal_to_a_reference_that_switched(tmp_path, how):
    after = random.Random(f"{how}-37").choice([2, 3])
    result, log, struck = run_losing_a_node(tmp_path, how, after)
    failure = result["failures"][0]
    assert [f["ranks"] for f in result["failures"]] == [[2, 3]], log
    assert failure["lost_nodes"] == [1], log
    assert "node(s) [1] lost" in log and ("connection to the store closed" if how == "kill" else "no heartbeat") in log
    assert result["survivors"] == [0, 1, 4, 5] and len(result["losses"]) == STEPS
    detected = failure["detected_at"] - struck
    print(f"node {how}: detected {detected:.2f}s after, recovered in {failure['recovery_seconds']:.2f}s")
    assert detected > 0
    redone = failure["step"]
    ref = reference(tmp_path, redone - 1, result["final_strategy"])
    assert result["losses"] == pytest.approx(ref["losses"], rel=0, abs=1e-6)


def test_a_rank_stuck_while_its_heartbeat_beats_is_named_by_its_progress_and_handled_as_a_death(tmp_path):
    """Rank 4 hangs in step 3 (or 4), alive, its heartbeat thread beating: nobody's communication
    progresses, every other rank waits inside one, rank 4 does not; the authority names it after
    its --stuck 3 s (not the 300 s collective timeout), node 2's launcher kills it, the others
    recover and match the reference."""
    after = random.Random("stall-37").choice([2, 3])
    result, log, _ = run_losing_a_node(tmp_path, "stall", after)
    assert [f["ranks"] for f in result["failures"]] == [[4]], log
    assert "rank 4 on node 2: alive but no communication progress anywhere for 3s" in log, log
    assert "rank 4 was declared dead" in log and "killed it" in log, log
    assert result["survivors"] == [0, 1, 2, 3, 5] and len(result["losses"]) == STEPS
    ref = reference(tmp_path, result["failures"][0]["step"] - 1, result["final_strategy"])
    assert result["losses"] == pytest.approx(ref["losses"], rel=0, abs=1e-6)


def test_a_fresh_node_joins_and_the_job_grows_back_to_a_strategy_that_uses_it(tmp_path):
    """Node 1 is lost whole after step 2; a fresh launcher started with --join takes its place: the
    authority takes its ranks back, the survivors fill them through their fused BSR and the job
    grows back to its first strategy (which uses them) and finishes every step."""
    steps = 60  # enough for a fresh launcher to start (seconds of imports) before the job ends
    port, job_secret, heartbeat = free_port(), os.urandom(32).hex(), 2.0
    authority = start_authority(port, job_secret, heartbeat)
    summary = tmp_path / "join.json"
    args = ["--steps", str(steps), *SMALL, "--strategy", STRATEGY, "--summary", str(summary), "--checkpoint",
            str(tmp_path / "join.safetensors")]
    nodes = [start_node(k, port, job_secret, args, heartbeat) for k in range(3)]
    lines: list[str] = []
    seen = threading.Condition()
    threading.Thread(target=watch, args=(nodes[0], lines, seen), daemon=True).start()
    with seen:
        assert seen.wait_for(lambda: any("step    2/" in line for line in lines), timeout=300), "".join(lines)
    loopback.signal_node(nodes[1].pid, signal.SIGKILL)
    nodes[1].wait()
    with seen:
        assert seen.wait_for(lambda: any("died in step" in line for line in lines), timeout=300), "".join(lines)
    fresh = start_node(1, port, job_secret, args, heartbeat, join=True)
    try:
        outputs = [p.communicate(timeout=400) for p in (nodes[0], nodes[2], fresh)]
    finally:
        for p in (*nodes, fresh):
            p.kill()
    authority["thread"].join(60)
    log = "".join(lines) + "\n".join(o + e for o, e in outputs) + authority["err"].getvalue()
    assert all(p.returncode == 0 for p in (nodes[0], nodes[2], fresh)), log
    result = json.loads(summary.read_text())
    assert len(result["failures"]) == 2, log
    death, join = result["failures"]
    assert death["ranks"] == [2, 3] and death["lost_nodes"] == [1], log
    assert join["ranks"] == [] and join["joined"] == [2, 3], log
    assert result["survivors"] == [0, 1, 2, 3, 4, 5] and len(result["losses"]) == steps
    assert join["strategy"] == result["final_strategy"] and "R2,3" in result["final_strategy"], log


def test_an_h800_death_under_two_nodes_recovers_to_the_strategy_replan_gives_for_the_cluster(tmp_path):
    """Two loopback nodes, node 0 of H800s and node 1 of H20s (`--cluster`); rank 0, an H800, dies in
    step 2: the survivors on both nodes move to the strategy planning.replan gives for that cluster
    and model (as tests/test_elastic_replan.py on one host), not to the every-device-equal one, and
    their losses equal a reference that switched to it after step 1."""
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(H800_H20_TWO_NODES)
    cluster = parse_cluster(str(cluster_file))
    assert [cluster.device_type(r).name for r in range(4)] == ["H800", "H800", "H20", "H20"]
    vocab = example_module("llama").token_files(argparse.Namespace(data=None)).vocab
    model = from_llama_config(LlamaConfig(vocab=vocab, hidden=16, layers=4, heads=2, ffn=32), seq_len=8)
    strategy = parse_strategy(TWO_TYPE_STRATEGY)
    on_cluster = format_strategy(recover_strategy(strategy, {0}, cluster=cluster, model=model))
    assert on_cluster != format_strategy(recover_strategy(strategy, {0}))  # the test tells them apart

    steps, port, job_secret, heartbeat = 3, free_port(), os.urandom(32).hex(), 2.0
    authority = start_authority(port, job_secret, heartbeat)
    summary = tmp_path / "elastic.json"
    args = [SCRIPT, "--steps", str(steps), *SMALL, "--strategy", TWO_TYPE_STRATEGY, "--kill", "2=0:1", "--summary",
            str(summary), "--checkpoint", str(tmp_path / "elastic.safetensors")]
    nodes = [loopback.start_node(loopback.node_command(k, 2, port, 2, args, elastic=True, heartbeat=heartbeat,
                                                       extra=("--cluster", str(cluster_file))), job_secret)
             for k in range(2)]
    try:
        outputs = [p.communicate(timeout=400) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    authority["thread"].join(60)
    log = "\n".join(o + e for o, e in outputs) + authority["err"].getvalue()
    assert all(p.returncode == 0 for p in nodes), log
    assert "rank 0 runs on node 0 of 2 at 127.0.0.1 (H800)" in log and "rank 3 runs on node 1 of 2 at 127.0.0.2 (H20)" in log, log
    result = json.loads(summary.read_text())
    assert [f["ranks"] for f in result["failures"]] == [[0]], log
    assert result["final_strategy"] == on_cluster, (result["final_strategy"], on_cluster)
    assert result["survivors"] == [1, 2, 3] and len(result["losses"]) == steps

    reference_summary = tmp_path / "reference.json"
    out = io.StringIO()
    code = launch([sys.executable, SCRIPT, "--steps", str(steps), *SMALL, "--strategy", TWO_TYPE_STRATEGY, "--switch",
                   f"{result['failures'][0]['step'] - 1}={on_cluster}", "--summary", str(reference_summary),
                   "--checkpoint", str(tmp_path / "reference.safetensors")], 4, stdout=out, stderr=out)
    assert code == 0, out.getvalue()
    assert result["losses"] == pytest.approx(json.loads(reference_summary.read_text())["losses"], rel=0, abs=1e-6)
