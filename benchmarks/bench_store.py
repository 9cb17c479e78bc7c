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
import gc
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


def rendezvous(connect, clients: int, ids: range | None = None, total: int | None = None) -> float:
    """Seconds for `clients` threads to connect (connect(i) -> store) and meet (client ids `ids`
    of `total`, when this process holds a share of them). The caller collects garbage before (a
    full collection walks the ~200,000 objects torch's import made, ~0.1 s here holding the
    interpreter lock), so neither side inherits the collector's debt of what ran before it."""
    ids = range(clients) if ids is None else ids
    total = clients if total is None else total
    failures: list[BaseException] = []
    stores = []

    def client(i: int) -> None:
        try:
            store = connect(i)
            stores.append(store)
            store.set(f"rank/{i}", str(i))
            if int(store.add("arrived", 1)) == total:
                store.set("go", "1")
            store.wait(["go"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in ids]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if failures:
        raise SystemExit(f"bench_store: {len(failures)} client(s) failed, e.g. {failures[0]!r}")
    return seconds


def _client_share(connect, ids: range, total: int, ready, go, done) -> None:
    """A client process: its share of the clients, started when every process is ready."""
    gc.collect()
    ready.put(1)
    go.wait()
    start = time.perf_counter()
    try:
        seconds = rendezvous(connect, len(ids), ids, total)
    except SystemExit as exc:
        done.put(str(exc))
        return
    done.put(start + seconds)  # perf_counter is the host's monotonic clock: comparable across processes


def rendezvous_in_processes(connect, clients: int, processes: int) -> float:
    """Seconds for `clients` clients spread over `processes` forked processes (threads in each)
    to meet: from the signal to start to the last process's last client returning."""
    fork = multiprocessing.get_context("fork")
    ready, go, done = fork.Queue(), fork.Event(), fork.Queue()
    shares = [fork.Process(target=_client_share, args=(connect, range(k, clients, processes), clients, ready, go, done))
              for k in range(processes)]
    for process in shares:
        process.start()
    for _ in shares:
        ready.get(timeout=120)
    start = time.perf_counter()
    go.set()
    ends = [done.get(timeout=300) for _ in shares]
    for process in shares:
        process.join()
    failed = [e for e in ends if isinstance(e, str)]
    if failed:
        raise SystemExit(failed[0])
    return max(ends) - start


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
    gc.collect()  # a forked server starts without the collector's debt, as a job's long-running server would
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


def meet(connect, clients: int, processes: int) -> float:
    gc.collect()
    return rendezvous(connect, clients) if processes <= 1 else rendezvous_in_processes(connect, clients, processes)


def hspmd_once(clients: int, separate: bool = False, processes: int = 1) -> float:
    secret = new_secret().encode()
    port, end = hosted(host_hspmd, (secret,), separate)
    try:
        return meet(lambda i: JobStore("127.0.0.1", port, secret, 120), clients, processes)
    finally:
        end()


def torch_once(clients: int, separate: bool = False, processes: int = 1) -> float:
    port, end = hosted(host_torch, (clients,), separate)
    try:
        return meet(lambda i: dist.TCPStore("127.0.0.1", port, clients + 1, False, timeout=timedelta(seconds=120)),
                    clients, processes)
    finally:
        end()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--server-process", action="store_true", help="host each server in a process of its own")
    p.add_argument("--client-processes", type=int, default=1,
                   help="spread the clients over this many processes (threads in each), as a job's ranks are processes")
    args = p.parse_args(argv)
    ours, theirs = [], []
    separate, processes = args.server_process, args.client_processes
    hspmd_once(8, separate), torch_once(8, separate)  # warm-up, not counted: torch's first client resolves this host's name
    for _ in range(args.reps):
        ours.append(hspmd_once(args.clients, separate, processes))
        theirs.append(torch_once(args.clients, separate, processes))
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    print(table(["store", "clients", "median s", "min-max s"], [
        ["hspmd JobStore (authenticated)", args.clients, f"{statistics.median(ours):.3f}", f"{min(ours):.3f}-{max(ours):.3f}"],
        ["torch TCPStore", args.clients, f"{statistics.median(theirs):.3f}", f"{min(theirs):.3f}-{max(theirs):.3f}"],
    ]))
    where = "servers in processes of their own" if separate else "servers in this process"
    if processes > 1:
        where += f", clients in {processes} processes"
    print(f"hspmd / TCPStore: {statistics.median(ours) / statistics.median(theirs):.2f}x "
          f"(per-pair ratios {ratios[0]:.2f}-{ratios[-1]:.2f}, {args.reps} interleaved pairs; {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
