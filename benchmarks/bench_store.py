"""The job's store under a rendezvous of many clients, against torch's TCPStore in the same run.

N clients (threads of this process; default 1,024) each connect to a store served by this process,
then rendezvous: every client sets its own key and adds to a counter, the client that brings the
counter to N sets `go`, and every client waits for `go`. Seconds from the first connect to the
last client's return. hspmd's store authenticates each connection (HMAC challenge both ways) and
every message after it (a MAC per message); TCPStore does neither. Both servers run on one thread
of this process (hspmd's a `selectors` loop in Python, TCPStore's a libuv loop in C++) and both sides'
clients are Python threads; hspmd's clients and server do their work holding the interpreter lock,
TCPStore's run in C++ without it, so hspmd's time grows less than TCPStore's falls with free cores. Runs interleave (hspmd, torch,
hspmd, torch, ...); the table gives medians, the ratio of medians and the spread of per-pair ratios.

`--server-process` hosts each server in a process of its own, as `hspmd run` does (its launcher
hosts the store; the ranks are other processes): the clients then no longer share the server's
interpreter lock.

    python benchmarks/bench_store.py [--clients 1024] [--reps 3] [--server-process]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from datetime import timedelta

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # TCPStore warns per client when this host's reverse lookup fails
import torch.distributed as dist  # noqa: E402

from _common import table  # noqa: E402
from hspmd.backends.store import JobStore, new_secret, open_store  # noqa: E402


def rendezvous(connect, clients: int) -> float:
    """Seconds for `clients` threads to connect (connect(i) -> store) and meet."""
    failures: list[BaseException] = []
    stores = []

    def client(i: int) -> None:
        try:
            store = connect(i)
            stores.append(store)
            store.set(f"rank/{i}", str(i))
            if int(store.add("arrived", 1)) == clients:
                store.set("go", "1")
            store.wait(["go"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if failures:
        raise SystemExit(f"bench_store: {len(failures)} client(s) failed, e.g. {failures[0]!r}")
    return seconds


def host_hspmd(secret: bytes) -> tuple[int, object]:
    server = open_store("127.0.0.1", 0, is_master=True, secret=secret, timeout=120)
    return server.port, server


def host_torch(clients: int) -> tuple[int, object]:
    master = dist.TCPStore("127.0.0.1", 0, clients + 1, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    return master.port, master


def _serve(host, args, ports, stop) -> None:
    """A server process: host the store, tell its port, serve until told to stop."""
    port, kept = host(*args)
    ports.put(port)
    stop.wait()
    del kept


def hosted(host, args, separate: bool):
    """(port, stop): the store hosted by `host(*args)` here or, `separate`, in a forked process."""
    if not separate:
        port, kept = host(*args)
        return port, lambda: kept.server.close() if hasattr(kept, "server") else None
    fork = multiprocessing.get_context("fork")
    ports, stop = fork.Queue(), fork.Event()
    process = fork.Process(target=_serve, args=(host, args, ports, stop), daemon=True)
    process.start()
    port = ports.get(timeout=60)

    def end() -> None:
        stop.set()
        process.join()
    return port, end


def hspmd_once(clients: int, separate: bool = False) -> float:
    secret = new_secret().encode()
    port, end = hosted(host_hspmd, (secret,), separate)
    try:
        return rendezvous(lambda i: JobStore("127.0.0.1", port, secret, 120), clients)
    finally:
        end()


def torch_once(clients: int, separate: bool = False) -> float:
    port, end = hosted(host_torch, (clients,), separate)
    try:
        return rendezvous(lambda i: dist.TCPStore("127.0.0.1", port, clients + 1, False, timeout=timedelta(seconds=120)),
                          clients)
    finally:
        end()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--server-process", action="store_true", help="host each server in a process of its own")
    args = p.parse_args(argv)
    ours, theirs = [], []
    separate = args.server_process
    hspmd_once(8, separate), torch_once(8, separate)  # warm-up, not counted: torch's first client resolves this host's name
    for _ in range(args.reps):
        ours.append(hspmd_once(args.clients, separate))
        theirs.append(torch_once(args.clients, separate))
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    print(table(["store", "clients", "median s", "min-max s"], [
        ["hspmd JobStore (authenticated)", args.clients, f"{statistics.median(ours):.3f}", f"{min(ours):.3f}-{max(ours):.3f}"],
        ["torch TCPStore", args.clients, f"{statistics.median(theirs):.3f}", f"{min(theirs):.3f}-{max(theirs):.3f}"],
    ]))
    where = "servers in processes of their own" if separate else "servers in this process"
    print(f"hspmd / TCPStore: {statistics.median(ours) / statistics.median(theirs):.2f}x "
          f"(per-pair ratios {ratios[0]:.2f}-{ratios[-1]:.2f}, {args.reps} interleaved pairs; {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
