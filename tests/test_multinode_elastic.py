"""Elasticity across nodes: three `hspmd run --elastic --nnodes 3` launchers on 127.0.0.1-3 (2 ranks
each) around an `hspmd authority` (the job's store and membership authority, a process of its own
so that it outlives any training node). A whole node is lost, its launcher and ranks SIGKILLed
together at a random step, or frozen (SIGSTOP): the other nodes name it, recover as on one host and
finish every step, and their losses equal a reference of live processes that switched to the
recovered strategy at that step boundary."""

from __future__ import annotations

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

from hspmd.runtime.processes.authority import serve
from hspmd.runtime.processes.launcher import launch
from hspmd.runtime.processes.ports import free_port

# each test runs three launchers and a six-process reference (minutes on a busy 2-core machine): `make elastic`
pytestmark = [pytest.mark.multiprocess, pytest.mark.elastic_full, pytest.mark.xdist_group("multinode")]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "examples" / "llama" / "train.py")
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--seq", "8", "--log-every", "1"]
STEPS = 6
# pipeline 0 spans nodes 0 and 1; pipeline 1 is node 2's: losing node 1 leaves layers 2-3 on node 2 only
STRATEGY = "layers=4 ; 2x4: R0,1 L0-1 | R2,3 L2-3 ; 2x2: R4 L0-1 | R5 L2-3"


def start_authority(port: int, job_secret: str, heartbeat: float, stuck: float = 0.0) -> dict:
    result: dict = {"err": io.StringIO()}

    def run():
        result["code"] = serve("127.0.0.1", port, heartbeat, stuck, 120.0, err=result["err"], secret=job_secret)

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def start_node(node: int, port: int, job_secret: str, args: list[str], heartbeat: float,
               join: bool = False) -> subprocess.Popen:
    env = {**os.environ, "HSPMD_JOB_SECRET": job_secret, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "hspmd.cli", "run", "--elastic", "--heartbeat", f"{heartbeat:g}", "--nnodes", "3",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "--node-addr",
               f"127.0.0.{node + 1}", "--rendezvous-timeout", "120", "-n", "2", *(["--join"] if join else []), SCRIPT, *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def node_processes(launcher: int) -> list[int]:
    """The launcher's rank guards (each leads the process group of its rank)."""
    guards = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == launcher:
                guards.append(int(entry))
    return guards


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
    victims = node_processes(nodes[1].pid)
    struck = time.time()
    if how == "stall":
        pass
    elif how == "kill":  # the node's ranks and its launcher, all at once
        for guard in victims:
            os.killpg(guard, signal.SIGKILL)
        nodes[1].send_signal(signal.SIGKILL)
    else:  # frozen: every process of the node stops (its heartbeats stop), none dies
        for guard in victims:
            os.killpg(guard, signal.SIGSTOP)
        nodes[1].send_signal(signal.SIGSTOP)
    survivors = nodes if how == "stall" else [nodes[0], nodes[2]]
    try:
        outputs = [p.communicate(timeout=400) for p in survivors]
    finally:
        for guard in victims:  # a stopped process cannot act on its launcher's death: kill, then let it run to die
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.killpg(guard, sig)
                except ProcessLookupError:
                    pass
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
    for guard in node_processes(nodes[1].pid):
        os.killpg(guard, signal.SIGKILL)
    nodes[1].send_signal(signal.SIGKILL)
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
