"""Jobs over several nodes: three `hspmd run --nnodes 3 --node-rank K` launchers, each binding its own
loopback address (127.0.0.1, .2, .3) as a node of its own, 2 ranks each.

A heterogeneous strategy whose pipelines and a tensor-parallel stage span the nodes trains to the
same losses as the one-host run of that strategy; every rank knows its node and device type (a
cluster file of two types); gloo listens on the node's own address. Bad input (another secret,
another --nnodes, a node rank given twice, a cluster file of another size) is one `hspmd: error:`
line naming it on the node concerned, and no launcher waits past the rendezvous timeout."""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hspmd.errors import HSPMDError
from hspmd.runtime.processes import loopback
from hspmd.runtime.processes.launcher import launch
from hspmd.runtime.processes.nodes import NodeRole
from hspmd.runtime.processes.ports import free_port
from tests.cluster_files import H800_H20_TYPES_AND_LINKS

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("multinode")]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "examples" / "llama" / "train.py")
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--seq", "8", "--log-every", "1"]
STEPS = 2
# pipeline 0: a TP2 stage on node 0 hands off to node 2; pipeline 1: node 1 hands off to a TP2 stage
# over nodes 1 and 2; gradients are synchronised across all three nodes
SPANNING = "layers=4 ; 2x4: R0,1 L0-1 | R4 L2-3 ; 2x2: R2 L0-1 | R3,5 L2-3"
TWO_TYPES = "name: two-types" + H800_H20_TYPES_AND_LINKS + """nodes:
  - {type: H800, devices: 2, count: %d}
  - {type: H20, devices: 2, count: %d}
intra: {H800: nvlink, H20: nvlink}
inter: ib
"""


def secret() -> str:
    return secrets.token_hex(32)


def start_node(node: int, nnodes: int, port: int, args: list[str], job_secret: str, *, node_rank: int | None = None,
               timeout: float = 60.0, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return loopback.start_node(loopback.node_command(node, nnodes, port, 2, args, node_rank=node_rank,
                                                     rendezvous_timeout=timeout, extra=extra), job_secret)


def finish(nodes: list[subprocess.Popen], limit: float) -> list[tuple[int, str, str]]:
    """Each node's (exit code, stdout, stderr); fails the test if one runs past `limit` seconds."""
    results = []
    end = time.monotonic() + limit
    for p in nodes:
        try:
            out, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            pytest.fail(f"a launcher ran past {limit:g}s")
        results.append((p.returncode, out, err))
    return results


def test_three_nodes_train_a_strategy_spanning_them_to_the_one_host_losses(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(TWO_TYPES % (1, 2))
    train = ["--steps", str(STEPS), *SMALL, "--strategy", SPANNING]
    summary = tmp_path / "nodes.json"
    port, job_secret = free_port(), secret()
    nodes = [start_node(k, 3, port, [SCRIPT, *train, "--summary", str(summary), "--checkpoint",
                                     str(tmp_path / "nodes.safetensors")], job_secret, extra=("--cluster", str(cluster)))
             for k in range(3)]
    out, err = io.StringIO(), io.StringIO()
    reference = tmp_path / "one.json"
    code = launch([sys.executable, SCRIPT, *train, "--summary", str(reference), "--checkpoint",
                   str(tmp_path / "one.safetensors")], 6, stdout=out, stderr=err)
    assert code == 0, out.getvalue() + err.getvalue()
    results = finish(nodes, 300)
    log = "\n".join(o + e for _, o, e in results)
    assert [c for c, _, _ in results] == [0, 0, 0], log
    for rank in range(6):
        node = rank // 2
        kind = "H800" if node == 0 else "H20"
        assert f"rank {rank} runs on node {node} of 3 at 127.0.0.{node + 1} ({kind})" in log, log
    ran, one = json.loads(summary.read_text()), json.loads(reference.read_text())
    assert len(ran["losses"]) == STEPS
    assert ran["losses"] == pytest.approx(one["losses"], rel=0, abs=1e-6)


def launch_node(node: int, nnodes: int, port: int, script: Path, job_secret: str, timeout: float,
                node_rank: int | None = None) -> dict:
    """One node's launcher in a thread of this process (no interpreter to start): its error or exit code."""
    role = NodeRole(nnodes, node if node_rank is None else node_rank, 2, "127.0.0.1", port, f"127.0.0.{node + 1}")
    result: dict = {"out": io.StringIO(), "err": io.StringIO()}

    def run():
        try:
            result["code"] = launch([sys.executable, str(script)], 2, role=role, secret=job_secret,
                                    rendezvous_timeout=timeout, stdout=result["out"], stderr=result["err"])
        except HSPMDError as exc:
            result["error"] = str(exc)

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def test_gloo_listens_on_the_nodes_own_address(tmp_path):
    """Every rank's listening sockets (gloo's) are on its node's address, none on another node's or
    on every interface."""
    script = tmp_path / "sockets.py"
    script.write_text(
        "import os\n"
        "from hspmd.backends.from_env import backend_from_env\n"
        "b = backend_from_env(timeout=60)\n"
        "b.barrier(tuple(range(b.world_size)))\n"
        "inodes = set()\n"
        "for fd in os.listdir('/proc/self/fd'):\n"
        "    try:\n"
        "        target = os.readlink(f'/proc/self/fd/{fd}')\n"
        "    except OSError:\n"
        "        continue\n"
        "    if target.startswith('socket:['):\n"
        "        inodes.add(target[8:-1])\n"
        "rows = [line.split() for line in open('/proc/net/tcp').read().splitlines()[1:]]\n"
        "mine = sorted({r[1].split(':')[0] for r in rows if r[3] == '0A' and r[9] in inodes})\n"
        "print('listening', b.rank, ','.join(mine), flush=True)\n"
        "b.barrier(tuple(range(b.world_size)))\n"
        "b.shutdown()\n")
    port, job_secret = free_port(), secret()
    nodes = [launch_node(k, 3, port, script, job_secret, 60.0) for k in range(3)]
    for node in nodes:
        node["thread"].join(240)
    log = "\n".join(n["out"].getvalue() + n["err"].getvalue() + n.get("error", "") for n in nodes)
    assert [n.get("code") for n in nodes] == [0, 0, 0], log
    for rank in range(6):
        node_hex = f"{rank // 2 + 1:02X}00007F"  # 127.0.0.k in /proc/net/tcp's little-endian hex
        assert f"listening {rank} {node_hex}\n" in log, log


@pytest.mark.parametrize("case", ["another secret", "another --nnodes", "a node rank twice"])
def test_bad_input_names_the_node_and_nothing_waits_past_the_rendezvous_timeout(tmp_path, case):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('no rank may start when the nodes do not agree')\n")
    port, job_secret, timeout = free_port(), secret(), 3.0
    started = time.monotonic()
    nodes = [launch_node(0, 3, port, script, job_secret, timeout), launch_node(1, 3, port, script, job_secret, timeout)]
    if case == "another secret":
        nodes.append(launch_node(2, 3, port, script, secret(), timeout))
        expected = {2: f"node 2: the job's store at 127.0.0.1:{port} refused this node: its HSPMD_JOB_SECRET is not "
                       "the job's",
                    0: "node(s) [2] of 3 never joined the job at 127.0.0.1:",
                    1: "node(s) [2] of 3 never joined"}
    elif case == "another --nnodes":
        nodes.append(launch_node(2, 2, port, script, job_secret, timeout, node_rank=1))
        expected = {2: "node 1 was given --nnodes 2 but the job (node 0) has 3",
                    0: "the job stopped: node 1 was given --nnodes 2"}
    else:  # node 1's launcher at 127.0.0.2 and another at 127.0.0.3 both claim node rank 1: one of them loses
        nodes.append(launch_node(2, 3, port, script, job_secret, timeout, node_rank=1))
        expected = {0: "node rank 1 given twice: the launcher at 127.0.0.", 1: "node rank 1 given twice",
                    2: "node rank 1 given twice"}
    for node in nodes:
        node["thread"].join(timeout + 30)
        assert not node["thread"].is_alive(), "a launcher waited past the rendezvous timeout"
    for node, text in expected.items():
        assert text in nodes[node].get("error", ""), (node, nodes[node])
    assert all("code" not in n for n in nodes), nodes  # no node started its ranks
    assert time.monotonic() - started < timeout + 30


def test_a_cluster_file_of_another_size_is_one_line_from_the_command(tmp_path):
    cluster = tmp_path / "four-nodes.yaml"
    cluster.write_text(TWO_TYPES % (2, 2))
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('never started')\n")
    results = finish([start_node(0, 3, free_port(), [str(script)], secret(), extra=("--cluster", str(cluster)))], 120)
    code, out, err = results[0]
    assert code == 2 and err == (f"hspmd: error: --cluster {cluster}: 8 devices on 4 node(s), but the job has 3 node(s) "
                                 f"x 2 ranks = 6\n"), err
