"""The job's store: bound to the address it was given, refusing clients without the
per-job secret, and no unpickling of anything read from the store or a peer."""

from __future__ import annotations

import ast
import socket
import struct
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from hspmd.backends.store import JobStore, StoreServer, new_secret
from hspmd.backends.wire import decode_groups, decode_unique_id, encode_groups, encode_unique_id
from hspmd.errors import CommunicationError, HSPMDError
from tests.job_store import SECRET

PACKAGE = Path(__file__).resolve().parents[1] / "hspmd"


def test_a_client_with_the_secret_uses_every_operation(store):
    other = JobStore("127.0.0.1", store.port, SECRET, timeout=5)
    other.set("k", b"\x00\xffvalue")
    assert store.get("k") == b"\x00\xffvalue"
    assert store.add("n", 2) == 2 and other.add("n", 3) == 5
    assert store.check(["k", "n"]) and not store.check(["k", "missing"])
    store.wait(["k"], timedelta(seconds=1))
    assert store.compare_set("c", b"", b"first") == b"first"
    assert store.compare_set("c", b"wrong", b"second") == b"first"
    assert store.num_keys() == 3 and store.delete_key("c") and not store.delete_key("c")
    with pytest.raises(CommunicationError, match="timed out"):
        store.wait(["never"], timedelta(seconds=0.2))


def test_a_client_without_the_secret_is_refused_before_reading_anything(store):
    store.set("planted-by-the-job", b"x")
    stranger = JobStore("127.0.0.1", store.port, new_secret().encode(), timeout=5)
    with pytest.raises(CommunicationError, match="refused this process"):
        stranger.get("planted-by-the-job")  # its first operation reads the server's refusal, not the key
    with pytest.raises(CommunicationError, match="refused this process"):
        JobStore("127.0.0.1", store.port, new_secret().encode(), timeout=5).confirm()
    # a raw connection that skips the challenge gets nothing but the nonce, then is closed
    with socket.create_connection(("127.0.0.1", store.port), timeout=5) as raw:
        raw.recv(32)
        raw.sendall(b"\x00" * 64 + b"\x00\x00\x00\x01\x00\x00\x00\x03get")
        try:
            answer = raw.recv(100)
        except ConnectionResetError:
            answer = b""
        assert answer == b""
    assert store.server.refused == 3
    assert store.get("planted-by-the-job") == b"x"


def test_a_server_without_the_secret_is_not_trusted_by_a_client():
    impostor = StoreServer(new_secret().encode())
    try:
        client = JobStore("127.0.0.1", impostor.port, SECRET, timeout=5)
        with pytest.raises(CommunicationError):  # the impostor cannot answer the challenge, so no reply is read
            client.set("k", b"v")
    finally:
        impostor.close()


def _other_local_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent for UDP connect
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_the_store_listens_only_on_the_address_it_was_given(store):
    assert store.server._listener.getsockname()[0] == "127.0.0.1"
    address = _other_local_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to try")
    with pytest.raises(OSError):
        socket.create_connection((address, store.port), timeout=2).close()


def test_ranks_need_the_secret_from_the_environment(monkeypatch):
    from hspmd.backends.store import secret_from_env

    monkeypatch.delenv("HSPMD_JOB_SECRET", raising=False)
    with pytest.raises(HSPMDError, match="HSPMD_JOB_SECRET is not set"):
        secret_from_env()
    monkeypatch.setenv("HSPMD_JOB_SECRET", "short")
    with pytest.raises(HSPMDError, match="shorter than 32"):
        secret_from_env()


def test_wire_formats_round_trip_and_refuse_anything_else():
    assert decode_groups(encode_groups([(0, 1), (2, 3, 5)]), 6, "rank 0") == [(0, 1), (2, 3, 5)]
    assert decode_groups(b"", 4, "rank 0") == []
    for uid in (tuple(range(-64, 64)), bytes(range(128, 256))):  # older cupy's signed chars, newer cupy's bytes
        assert decode_unique_id(encode_unique_id(uid), "rank 0") == uid
    with pytest.raises(CommunicationError):
        encode_unique_id((-1,) + (200,) * 127)
    for bad in (b"\x80\x04\x95", b"0-1;cos\nsystem", b"0-0", b"0-9", b"0--1", "٢".encode()):
        with pytest.raises(CommunicationError):
            decode_groups(bad, 4, "rank 1")
    with pytest.raises(CommunicationError):
        decode_unique_id(b"\x80\x04\x95" + b"x" * 20, "rank 1")


UNPICKLERS = {"loads", "load", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
              "recv_object_list", "send_object_list", "Unpickler"}


def test_no_module_unpickles_or_exchanges_python_objects():
    """pickle.load(s) and torch.distributed's *_object collectives (which unpickle what peers send)
    appear nowhere in the package, except where a process unpickles what its own parent pickled."""
    allowed = {("runtime/processes/multiprocess.py", "loads")}  # the parent's job, over multiprocessing's pipe
    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        pickle_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                        if a.name == "pickle"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in UNPICKLERS:
                owner = node.value.id if isinstance(node.value, ast.Name) else ""
                if owner in pickle_names or "object" in node.attr:
                    found.append((str(path.relative_to(PACKAGE)), node.attr))
            if isinstance(node, ast.ImportFrom) and node.module == "pickle":
                found.append((str(path.relative_to(PACKAGE)), "from pickle import"))
    assert set(found) <= allowed, sorted(set(found) - allowed)


class _Relay:
    """A relay on the path between a client and the store: forwards bytes both ways; after the
    handshake (64 bytes from the client) it hands each client message to `change`, which returns
    what to forward instead."""

    def __init__(self, port: int, change):
        self.change, self.seen = change, []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = port
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        client, _ = self._listener.accept()
        server = socket.create_connection(("127.0.0.1", self._target))
        threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()
        handshake = b""
        while len(handshake) < 64:
            handshake += client.recv(64 - len(handshake))
        server.sendall(handshake)
        while True:
            try:
                head = client.recv(4, socket.MSG_WAITALL)
                (n,) = struct.unpack(">I", head)
                message = head + client.recv(n + 32, socket.MSG_WAITALL)
            except (OSError, struct.error):
                break
            self.seen.append(message)
            try:
                server.sendall(self.change(message, self.seen))
            except OSError:
                break

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for end in (src, dst):  # shutdown, not close: the other thread may be blocked reading it
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.mark.parametrize("attack", ["change a value", "replay", "reorder to another connection"])
def test_every_message_is_authenticated_so_a_relay_cannot_change_or_replay_one(store, attack):
    """The handshake is passed through untouched; what the relay does to a later message is caught
    by its MAC: the store closes the connection and keeps the value it had."""
    other = JobStore("127.0.0.1", store.port, SECRET, timeout=5)
    other.set("k", b"original")
    earlier = []
    if attack == "reorder to another connection":  # a message recorded on one connection, sent on another
        first = _Relay(store.port, lambda m, seen: m)
        JobStore("127.0.0.1", first.port, SECRET, timeout=5).set("k", b"recorded")
        earlier = first.seen

    def change(message, seen):
        if attack == "change a value":
            return message[:-33] + bytes([message[-33] ^ 1]) + message[-32:]
        if attack == "replay":
            return seen[0] if len(seen) == 2 else message
        return earlier[0]

    relay = _Relay(store.port, change)
    client = JobStore("127.0.0.1", relay.port, SECRET, timeout=5)
    before = store.server.tampered
    with pytest.raises(CommunicationError, match="is gone"):
        if attack == "replay":
            client.set("k", b"first")
        client.set("k", b"changed")
    expected = {"change a value": b"recorded" if earlier else b"original", "replay": b"first",
                "reorder to another connection": b"recorded"}[attack]
    assert store.get("k") == expected
    deadline = time.monotonic() + 5
    while store.server.tampered == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.server.tampered == before + 1
