"""The job's store server (one selectors loop): parked waits answered by the writes that complete
them, messages arriving in pieces, and a bad request ending only its own connection."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from datetime import timedelta

import pytest

from hspmd.backends.store import JobStore
from hspmd.backends.store_channel import NONCE_BYTES, Channel, tag
from hspmd.errors import CommunicationError
from tests.job_store import SECRET



def test_parked_waits_are_answered_by_the_writes_that_complete_them(store):
    """48 clients each wait for two keys (one of them shared), get one, and see exactly the values
    written afterwards in a random order by set, add and compare_set."""
    clients = 48
    rng = random.Random(7)
    results: dict[int, bytes] = {}
    failures: list[BaseException] = []

    def client(i: int) -> None:
        try:
            s = JobStore("127.0.0.1", store.port, SECRET, timeout=10)
            s.wait([f"k/{i}", "shared"])
            results[i] = s.get(f"k/{i}")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # let them park
    order = list(range(clients))
    rng.shuffle(order)
    for i in order:
        if i % 3 == 0:
            store.set(f"k/{i}", f"set {i}")
        elif i % 3 == 1:
            store.add(f"k/{i}", i)
        else:
            store.compare_set(f"k/{i}", b"", f"cas {i}".encode())
    assert not results  # nobody was answered before the shared key exists
    store.set("shared", b"go")
    for t in threads:
        t.join(30)
    assert not failures, failures[:1]
    assert results == {i: (f"set {i}".encode() if i % 3 == 0 else str(i).encode() if i % 3 == 1 else f"cas {i}".encode())
                       for i in range(clients)}


def _raw_client(port: int) -> tuple[socket.socket, Channel]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    nonce = sock.recv(NONCE_BYTES, socket.MSG_WAITALL)
    mine = bytes(range(NONCE_BYTES))
    sock.sendall(tag(SECRET, b"client", nonce) + mine)
    assert sock.recv(32, socket.MSG_WAITALL) == tag(SECRET, b"server", mine)
    return sock, Channel(SECRET, nonce, mine, is_server=False)


def test_messages_in_pieces_and_several_at_once_are_answered_in_order(store):
    sock, channel = _raw_client(store.port)
    with sock:
        one = channel.seal([b"set", b"a", b"1"])
        for i in range(len(one)):  # byte by byte
            sock.sendall(one[i:i + 1])
            time.sleep(0.001)
        assert channel.receive(sock) == [b"ok"]
        # a wait that parks, then two more requests in the same write: they wait behind it
        sock.sendall(channel.seal([b"wait", b"5000", b"b"]) + channel.seal([b"add", b"n", b"2"]) + channel.seal([b"get", b"0", b"a"]))
        time.sleep(0.2)
        assert store.check(["a"]) and not store.check(["n"])
        store.set("b", b"2")
        assert channel.receive(sock) == [b"ok"]
        assert channel.receive(sock) == [b"ok", b"2"]
        assert channel.receive(sock) == [b"ok", b"1"]


def test_a_malformed_request_ends_its_connection_only(store):
    sock, channel = _raw_client(store.port)
    waiting = JobStore("127.0.0.1", store.port, SECRET, timeout=10)
    answered = threading.Event()
    threading.Thread(target=lambda: (waiting.wait(["late"]), answered.set()), daemon=True).start()
    with sock:
        sock.sendall(channel.seal([b"add", b"n", b"not a number"]))
        assert sock.recv(1) == b""  # closed, no reply
    store.set("late", b"x")
    assert answered.wait(10)
    assert store.add("n", 1) == 1


def test_a_wait_times_out_on_its_own_deadline_while_others_stay_parked(store):
    other = JobStore("127.0.0.1", store.port, SECRET, timeout=10)
    answered = threading.Event()
    threading.Thread(target=lambda: (other.wait(["later"], timedelta(seconds=10)), answered.set()), daemon=True).start()
    start = time.monotonic()
    with pytest.raises(CommunicationError, match="timed out"):
        store.wait(["never"], timedelta(seconds=0.3))
    assert 0.25 <= time.monotonic() - start < 5
    assert not answered.is_set()
    store.set("later", b"1")
    assert answered.wait(10)


def test_closing_the_server_closes_its_connections(store):
    other = JobStore("127.0.0.1", store.port, SECRET, timeout=10)
    store.server.close()
    with pytest.raises(CommunicationError, match="is gone"):
        other.get("k")


def test_a_wait_that_times_out_or_whose_client_leaves_is_forgotten(store):
    """Parked requests on keys nobody writes do not pile up: a timed-out one and one whose
    connection closed are dropped from the server's waiting lists."""
    with pytest.raises(CommunicationError, match="timed out"):
        store.wait(["never/1"], timedelta(seconds=0.1))
    leaving = JobStore("127.0.0.1", store.port, SECRET, timeout=10)

    def wait_until_gone() -> None:
        with contextlib.suppress(CommunicationError):  # its connection is closed under it
            leaving.wait(["never/2"])

    threading.Thread(target=wait_until_gone, daemon=True).start()
    deadline = time.monotonic() + 5
    while "never/2" not in store.server._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "never/2" in store.server._waiting  # parked
    leaving._sock.shutdown(socket.SHUT_RDWR)
    while store.server._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.server._waiting == {}
