"""A job over several nodes: which launcher is which node, and where each rank lies.

`hspmd run --nnodes N --node-rank K --master-addr HOST [--master-port P] [--node-addr ADDR] -n R`
runs on every node with the same arguments (only K and ADDR differ) and the job's secret in
HSPMD_JOB_SECRET. Node 0's launcher hosts the job's store (hspmd.backends.store) bound to HOST:P;
every launcher, node 0's included, joins it as a client and takes part in the *node rendezvous*
below before any rank starts, so a node given other arguments is named in one line and nothing
waits past the rendezvous timeout:

  1. node 0 writes the job's shape under ``nodes/job`` (nodes, ranks per node, the cluster file's
     digest); every node compares its own with it and, on a difference, writes why under
     ``nodes/refused`` (node 0 reports it too) and stops;
  2. each node claims ``nodes/<K>`` with compare-and-set (its address and a token of its own): a
     second launcher given the same node rank finds the first one's claim and stops naming it;
  3. every node waits until all N have claimed, then starts its ranks.

Ranks are numbered node by node: node K's local rank L is global rank K * R + L. With a cluster
file (`--cluster`, a ClusterSpec YAML) node K is the cluster's node K and its device type is every
local rank's; each rank finds its place in the environment (`RankPlace.from_env`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass

from hspmd.backends.torch_join import NODE_ADDR_ENV
from hspmd.errors import CommunicationError, LaunchError

DEFAULT_MASTER_PORT = 29500
DEFAULT_RENDEZVOUS_S = 60.0
NODE_ENV, NNODES_ENV = "HSPMD_NODE_RANK", "HSPMD_NNODES"
DEVICE_TYPE_ENV = "HSPMD_DEVICE_TYPE"
JOB_KEY, REFUSED_KEY = "nodes/job", "nodes/refused"
_POLL_S = 0.02
_SIOCGIFADDR = 0x8915


def node_key(node: int) -> str:
    return f"nodes/{node}"


@dataclass(frozen=True)
class NodeRole:
    """This launcher's part of the job: node `node_rank` of `nnodes`, `nproc` ranks each."""

    nnodes: int
    node_rank: int
    nproc: int
    master_addr: str
    master_port: int
    node_addr: str

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def global_rank(self, local: int) -> int:
        return self.node_rank * self.nproc + local

    @property
    def ranks(self) -> range:
        return range(self.global_rank(0), self.global_rank(self.nproc))

    def node_of(self, rank: int) -> int:
        return rank // self.nproc


@dataclass(frozen=True)
class RankPlace:
    """Where a rank lies: its node, that node's address and its device type ('' without a cluster file)."""

    rank: int
    node: int
    nnodes: int
    node_addr: str
    device_type: str = ""

    @staticmethod
    def from_env() -> "RankPlace":
        env = os.environ
        return RankPlace(int(env.get("RANK", "0")), int(env.get(NODE_ENV, env.get("GROUP_RANK", "0"))),
                         int(env.get(NNODES_ENV, "1")), env.get(NODE_ADDR_ENV, ""), env.get(DEVICE_TYPE_ENV, ""))


def address_towards(host: str, port: int) -> str:
    """This machine's address that reaches `host` (the route's source address; no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))
            return sock.getsockname()[0]
    except OSError as exc:
        raise LaunchError(f"--master-addr {host}: no route from this node ({exc.strerror or exc}); give --node-addr") from None


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME): the
    loopback interface for any 127.x address, else the one whose IPv4 address it is."""
    names = [name for _, name in socket.if_nameindex()]
    if address.startswith("127."):
        return next((n for n in names if n == "lo" or n.startswith("lo")), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def check_bindable(address: str) -> None:
    """A clear error when this node cannot listen on `address` (not one of its own)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError as exc:
        raise LaunchError(f"--node-addr {address} is not an address of this node ({exc.strerror or exc})") from None


def check_cluster(cluster, role: NodeRole, path: str) -> str:
    """The device type of this node under `cluster` (a ClusterSpec), after checking that the cluster
    is the job: as many nodes, each of `nproc` devices. LaunchError naming the file and what differs."""
    sizes = cluster.node_sizes
    if cluster.n_devices != role.world_size or len(sizes) != role.nnodes:
        raise LaunchError(f"--cluster {path}: {cluster.n_devices} devices on {len(sizes)} node(s), but the job has "
                          f"{role.nnodes} node(s) x {role.nproc} ranks = {role.world_size}")
    uneven = [k for k, n in enumerate(sizes) if n != role.nproc]
    if uneven:
        raise LaunchError(f"--cluster {path}: node {uneven[0]} has {sizes[uneven[0]]} devices, but every node of the "
                          f"job runs -n {role.nproc} ranks")
    return cluster.nodes[role.node_rank].device_type


def cluster_digest(cluster: str | None) -> str:
    """What every node compares of its --cluster: the file's bytes (or the preset's name), digested."""
    if not cluster:
        return ""
    data = open(cluster, "rb").read() if os.path.isfile(cluster) else cluster.encode()
    return hashlib.sha256(data).hexdigest()[:16]


def join_running_job(store, role: NodeRole, cluster_digest: str, dead: set[int]) -> None:
    """A fresh node (`--join`) takes node `role.node_rank`'s place in a running elastic job: its
    shape must be the job's and every rank of that node must have been declared dead (`dead`)."""
    if not store.check([JOB_KEY]):
        raise LaunchError(f"node {role.node_rank} --join: no job runs at {role.master_addr}:{role.master_port}")
    job = json.loads(store.get(JOB_KEY).decode())
    shape = {"nnodes": role.nnodes, "nproc": role.nproc, "cluster": cluster_digest}
    different = [name for name in shape if job[name] != shape[name]]
    if different:
        raise LaunchError(f"node {role.node_rank} --join: its {different[0]} is {shape[different[0]] or 'none'} but the "
                          f"running job's is {job[different[0]] or 'none'}")
    alive = [r for r in role.ranks if r not in dead]
    if alive:
        raise LaunchError(f"node {role.node_rank} --join: ranks {alive} of that node are still alive in the job; a fresh "
                          f"node takes the place of a lost one")


def node_rendezvous(store, role: NodeRole, cluster_digest: str, timeout: float, server=None) -> dict[int, str]:
    """Steps 1-3 of the module docstring over the job's store; {node: address} of every node.
    Raises LaunchError naming the node and the argument that differs, or the nodes that never
    came within `timeout` seconds. `server`: the store server node 0 hosts (its count of refused
    connections names a node with another secret)."""
    try:
        return _node_rendezvous(store, role, cluster_digest, timeout, server)
    except CommunicationError:
        raise LaunchError(f"node {role.node_rank}: the job's store at {role.master_addr}:{role.master_port} went away "
                          f"during the node rendezvous (node 0's launcher stopped)") from None


def _node_rendezvous(store, role: NodeRole, cluster_digest: str, timeout: float, server) -> dict[int, str]:
    shape = {"nnodes": role.nnodes, "nproc": role.nproc, "cluster": cluster_digest}
    if role.node_rank == 0:
        store.set(JOB_KEY, json.dumps(shape))
    end = time.monotonic() + timeout
    job = json.loads(_wait_key(store, JOB_KEY, end, role, "node 0 never published the job"))
    for name, flag in (("nnodes", "--nnodes"), ("nproc", "-n"), ("cluster", "--cluster")):
        if job[name] != shape[name]:
            mine, theirs = (shape[name] or "none", job[name] or "none") if name != "cluster" else \
                (f"file digest {shape[name] or 'none'}", f"digest {job[name] or 'none'}")
            why = f"node {role.node_rank} was given {flag} {mine} but the job (node 0) has {theirs}"
            store.set(REFUSED_KEY, why)
            raise LaunchError(why)
    token = secrets.token_hex(8)
    claim = json.dumps({"addr": role.node_addr, "token": token, "pid": os.getpid()})
    held = store.compare_set(node_key(role.node_rank), "", claim)
    held_text = held.decode() if isinstance(held, bytes) else held
    if json.loads(held_text)["token"] != token:
        other = json.loads(held_text)
        why = (f"node rank {role.node_rank} given twice: the launcher at {other['addr']} (pid {other['pid']}) "
               f"already holds it, this one is at {role.node_addr}")
        store.set(REFUSED_KEY, why)
        raise LaunchError(why)
    keys = [node_key(k) for k in range(role.nnodes)]
    while not store.check(keys):
        if store.check([REFUSED_KEY]):
            raise LaunchError(f"the job stopped: {store.get(REFUSED_KEY).decode()}")
        if time.monotonic() > end:
            missing = [k for k in range(role.nnodes) if not store.check([node_key(k)])]
            refused = getattr(server, "refused", 0)
            hint = (f"; the store refused {refused} connection(s) without the job's secret: does node "
                    f"{missing[0]} have another HSPMD_JOB_SECRET?" if refused else
                    " (not started, another --master-addr/--master-port, or another HSPMD_JOB_SECRET)")
            why = (f"node(s) {missing} of {role.nnodes} never joined the job at {role.master_addr}:"
                   f"{role.master_port} within {timeout:g}s{hint}")
            store.set(REFUSED_KEY, why)
            raise LaunchError(why)
        time.sleep(_POLL_S)
    return {k: json.loads(store.get(node_key(k)).decode())["addr"] for k in range(role.nnodes)}


def _wait_key(store, key: str, end: float, role: NodeRole, why: str) -> str:
    while not store.check([key]):
        if time.monotonic() > end:
            raise LaunchError(f"node {role.node_rank}: {why} at {role.master_addr}:{role.master_port}")
        time.sleep(_POLL_S)
    return store.get(key).decode()


__all__ = ["DEFAULT_MASTER_PORT", "DEFAULT_RENDEZVOUS_S", "DEVICE_TYPE_ENV", "NODE_ADDR_ENV", "NODE_ENV",
           "NNODES_ENV", "NodeRole", "RankPlace", "address_towards", "check_bindable", "check_cluster", "cluster_digest", "interface_of",
           "join_running_job", "node_rendezvous"]
