"""Several nodes of one job on one machine, each on its own loopback address.

Node K's `hspmd run` launcher binds 127.0.0.(K+1) for its ranks (Linux routes all of 127/8 to the
loopback device), the job's store or authority listens on 127.0.0.1: the multi-node tests and
benchmarks run the command a real cluster runs on each host, and lose a node the way a host is
lost (its launcher and every rank SIGKILLed or stopped at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from hspmd.backends.store import SECRET_ENV

SOURCE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding the hspmd package (a checkout's root)


def node_address(node: int) -> str:
    """The loopback address node `node` binds: 127.0.0.1 for node 0, 127.0.0.2 for node 1, ..."""
    return f"127.0.0.{node + 1}"


def node_command(node: int, nnodes: int, port: int, nproc: int, script: Sequence[str], *, node_rank: int | None = None,
                 rendezvous_timeout: float = 120.0, elastic: bool = False, heartbeat: float | None = None,
                 join: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The `hspmd run` command line of node `node` (claiming `node_rank`, by default its own)."""
    options = ["--nnodes", str(nnodes), "--node-rank", str(node if node_rank is None else node_rank), "--master-addr",
               node_address(0), "--master-port", str(port), "--node-addr", node_address(node), "--rendezvous-timeout",
               f"{rendezvous_timeout:g}", "-n", str(nproc)]
    if elastic:
        options.append("--elastic")
    if heartbeat is not None:
        options += ["--heartbeat", f"{heartbeat:g}"]
    if join:
        options.append("--join")
    return [sys.executable, "-m", "hspmd.cli", "run", *options, *extra, *script]


def start_node(command: Sequence[str], job_secret: str) -> subprocess.Popen:
    """Start a node's launcher (text pipes for its output) with the job's secret exported, running
    this hspmd (its source root on PYTHONPATH and as the working directory)."""
    env = {**os.environ, SECRET_ENV: job_secret, "PYTHONPATH": str(SOURCE_ROOT)}
    return subprocess.Popen(list(command), cwd=SOURCE_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_authority(port: int, job_secret: str, heartbeat: float, stuck: float = 0.0,
                    rendezvous_timeout: float = 120.0) -> subprocess.Popen:
    """Start `hspmd authority` on 127.0.0.1:port, a process of its own as on a cluster."""
    command = [sys.executable, "-m", "hspmd.cli", "authority", "--addr", node_address(0), "--port", str(port),
               "--heartbeat", f"{heartbeat:g}", "--stuck", f"{stuck:g}", "--rendezvous-timeout", f"{rendezvous_timeout:g}"]
    return start_node(command, job_secret)


def rank_guards(launcher: int) -> list[int]:
    """The launcher's rank guards: its children, each the leader of its rank's process group."""
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


def signal_node(launcher: int, sig: int, guards: Sequence[int] | None = None) -> list[int]:
    """Send `sig` to every rank of the node (each guard's process group) and to its launcher, the
    way a host is lost or frozen whole; returns the guards (to continue or kill them later)."""
    guards = rank_guards(launcher) if guards is None else list(guards)
    for guard in guards:
        try:
            os.killpg(guard, sig)
        except ProcessLookupError:
            pass
    try:
        os.kill(launcher, sig)
    except ProcessLookupError:
        pass
    return guards


def end_node(launcher: int, guards: Sequence[int]) -> None:
    """Make sure a lost node's processes are gone, frozen ones too (a stopped process cannot act on
    its launcher's death: kill it, then let it run to die)."""
    for sig in (signal.SIGKILL, signal.SIGCONT):
        signal_node(launcher, sig, guards)


__all__ = ["end_node", "node_address", "node_command", "rank_guards", "signal_node", "start_authority", "start_node"]
