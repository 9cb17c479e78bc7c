"""The job's rendezvous store: a key-value store only the job's own processes can use.

torch's TCPStore listens on every interface and lets any process that can reach the port read and
write keys (and list them). This store replaces it for every hspmd job:

* the server binds only to the address it is given (loopback, 127.0.0.1, by default);
* every connection starts with a mutual challenge: the server sends a random nonce, the client
  answers HMAC-SHA256(secret, nonce) and sends its own nonce, the server answers in turn. A client
  without the job's secret is disconnected before it can read or write anything. The client reads
  the server's answer before its first reply (in one read with it, as a rule: a round trip fewer
  per connection), so it accepts nothing from a server that does not know the secret, and a
  client with the wrong secret learns so at its first operation (`JobStore.confirm` asks at once);
* after the challenge every message in either direction carries a MAC: HMAC-SHA256 under a session
  key both sides derive from the secret and the two nonces, over the direction, the message's
  sequence number on the connection and its bytes. A relay on the path that changes, drops,
  reorders or replays a message (also one from another connection: its key differs) is caught
  by the next MAC, and the connection is closed;
* values are opaque bytes: nothing read from the store is ever unpickled (hspmd.backends.wire).

The secret is per job: the launcher generates it (new_secret) and passes it to its ranks in the
environment variable HSPMD_JOB_SECRET (a torchrun-started job sets that variable itself, the same
on every rank). `JobStore` is a torch.distributed Store, so gloo's rendezvous, PrefixStore and
process groups run over it unchanged.

Three modules: this one (the secret, the client JobStore, open_store), store_server (the server's
one-thread loop) and store_channel (the challenge's tags and the authenticated framing, with the
wire format).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta
from hashlib import sha256

import torch.distributed as dist

from hspmd.backends.store_channel import HANDSHAKE_TIMEOUT_S, NONCE_BYTES, Channel, recv_exact, tag
from hspmd.backends.store_server import LOOPBACK, StoreServer
from hspmd.errors import CommunicationError, HSPMDError

SECRET_ENV = "HSPMD_JOB_SECRET"
STORE_HOSTED_ENV = "HSPMD_STORE_HOSTED"  # "1": the launcher hosts the store, every rank is a client
STORE_PORT_ENV = "HSPMD_STORE_PORT"  # torchrun jobs: where rank 0 hosts this store (torchrun's own store is on MASTER_PORT)


def new_secret() -> str:
    """A fresh per-job secret (256 random bits as hex text, safe in an environment variable)."""
    return secrets.token_hex(32)


def secret_from_env() -> bytes:
    """The job's secret from HSPMD_JOB_SECRET; a clear error when the process was not given one."""
    value = os.environ.get(SECRET_ENV, "")
    if len(value) < 32:
        raise HSPMDError(
            f"{SECRET_ENV} is {'not set' if not value else 'shorter than 32 characters'}: the job's store refuses "
            f"clients without the job's secret. `hspmd run` sets it for its ranks; under torchrun export the same "
            f"value to every rank, e.g. {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return value.encode()


def job_from_env() -> str:
    """The job's name for Backend.job: a digest of HSPMD_JOB_SECRET (the secret itself never leaves
    the process), "" when the process was given none."""
    value = os.environ.get(SECRET_ENV, "")
    return sha256(b"hspmd job " + value.encode()).hexdigest()[:16] if value else ""


class JobStore(dist.Store):
    """A client of the job's StoreServer (hosting it when `server` is given), usable wherever
    torch.distributed takes a Store. One connection, used by one call at a time."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 300.0, server: StoreServer | None = None):
        super().__init__()
        self.host, self.port, self.server = host, port, server
        self.set_timeout(timedelta(seconds=timeout))
        self._lock = threading.Lock()
        self._sock = self._connect(secret, timeout)

    def _connect(self, secret: bytes, timeout: float) -> socket.socket:
        end = time.monotonic() + timeout
        while True:
            try:
                sock = _dial(self.host, self.port)
                break
            except OSError as exc:
                if time.monotonic() > end:
                    raise CommunicationError(
                        f"cannot reach the job's store at {self.host}:{self.port} within {timeout:g}s: {exc.strerror or exc}"
                    ) from None
                time.sleep(0.05)
        try:
            nonce = recv_exact(sock, NONCE_BYTES)
            mine = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(tag(secret, b"client", nonce) + mine)
        except (ConnectionError, OSError):
            sock.close()
            raise CommunicationError(
                f"the job's store at {self.host}:{self.port} closed the connection during its challenge"
            ) from None
        for option in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):  # a store call may wait as long as it asks
            sock.setsockopt(socket.SOL_SOCKET, option, _NO_TIMEVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._channel = Channel(secret, nonce, mine, is_server=False)
        self._proof: bytes | None = tag(secret, b"server", mine)  # the server's answer, read before its first reply
        return sock

    def confirm(self) -> None:
        """Read the server's answer to this client's challenge now (CommunicationError if the
        server refused this process's secret or does not know the job's). Every call does this
        before it reads its first reply; a launcher calls it to name a wrong secret at once."""
        with self._lock:
            self._confirm()

    def _confirm(self) -> None:
        expected, self._proof = self._proof, None
        if expected is None:
            return
        try:
            proof = self._channel.receive_bytes(self._sock, len(expected))
        except (ConnectionError, OSError):
            self._sock.close()
            raise CommunicationError(
                f"the job's store at {self.host}:{self.port} closed the connection before answering this process's "
                f"challenge: it refused this process, which does not hold the job's secret ({SECRET_ENV}), or it is gone"
            ) from None
        if not hmac.compare_digest(proof, expected):
            self._sock.close()
            raise CommunicationError(f"the server at {self.host}:{self.port} does not know the job's secret: not our store")

    def _call(self, *frames: bytes) -> list[bytes]:
        with self._lock:
            try:
                self._channel.send(self._sock, frames)
            except (ConnectionError, OSError) as exc:  # before the proof is read, _confirm names why
                if self._proof is None:
                    raise CommunicationError(f"the job's store at {self.host}:{self.port} is gone: {exc}") from None
            try:
                self._confirm()
                reply = self._channel.receive(self._sock)
            except (ConnectionError, OSError, struct.error) as exc:
                raise CommunicationError(f"the job's store at {self.host}:{self.port} is gone: {exc}") from None
        if reply[0] == b"timeout":
            raise CommunicationError(
                f"timed out after {self.timeout.total_seconds():g}s waiting for store key(s) "
                f"{[f.decode('utf-8', 'replace') for f in frames[2:]][:4]}"
            )
        if reply[0] != b"ok":
            raise CommunicationError(f"the job's store refused {frames[0].decode()}: {reply[1:2]}")
        return reply[1:]

    def _millis(self, timeout: timedelta | None) -> bytes:
        return str(int((timeout or self.timeout).total_seconds() * 1000)).encode()

    def set(self, key: str, value) -> None:
        self._call(b"set", key.encode(), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(b"get", self._millis(None), key.encode())[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(b"add", key.encode(), str(int(value)).encode())[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(b"check", *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(b"wait", self._millis(timeout), *(k.encode() for k in keys))

    def compare_set(self, key: str, expected, desired) -> bytes:
        as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._call(b"compare_set", key.encode(), as_bytes(expected), as_bytes(desired))[0]

    def delete_key(self, key: str) -> bool:
        return self._call(b"delete_key", key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(b"num_keys")[0])

    def close(self) -> None:
        """Close this client's connection (a later call raises CommunicationError)."""
        with self._lock:
            self._sock.close()

    def connect_again(self, secret: bytes) -> "JobStore":
        """Another connection to the same store (for a thread that polls while this one blocks)."""
        return JobStore(self.host, self.port, secret, self.timeout.total_seconds())


_HANDSHAKE_TIMEVAL = struct.pack("ll", int(HANDSHAKE_TIMEOUT_S), 0)
_NO_TIMEVAL = struct.pack("ll", 0, 0)


def _dial(host: str, port: int) -> socket.socket:
    """A connected blocking socket to host:port whose connect and reads give up after
    HANDSHAKE_TIMEOUT_S (the kernel's SO_SNDTIMEO / SO_RCVTIMEO, which `_connect` clears once the
    challenge is answered). Kernel timeouts rather than Python's socket timeout: with one, every
    send and receive is a poll and then the call, each handing the interpreter lock round, which
    1,024 clients connecting at once pay twice. A numeric address skips the resolver."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _HANDSHAKE_TIMEVAL)
        return sock
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _HANDSHAKE_TIMEVAL)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _HANDSHAKE_TIMEVAL)
        sock.connect((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def hosts_store(rank: int) -> bool:
    """Whether this rank hosts the job's store: rank 0, unless a launcher hosts it (HSPMD_STORE_HOSTED)."""
    return rank == 0 and os.environ.get(STORE_HOSTED_ENV) != "1"


def open_store(host: str, port: int, is_master: bool, secret: bytes | None = None, timeout: float = 300.0) -> JobStore:
    """The job's store at host:port: hosted here when `is_master` (bound to `host` only), then
    joined as a client. `secret` defaults to HSPMD_JOB_SECRET."""
    secret = secret_from_env() if secret is None else secret
    server = StoreServer(secret, host, port) if is_master else None
    return JobStore(host, server.port if server else port, secret, timeout, server)


__all__ = ["JobStore", "LOOPBACK", "SECRET_ENV", "STORE_HOSTED_ENV", "STORE_PORT_ENV", "StoreServer", "hosts_store",
    "new_secret", "open_store", "secret_from_env"]
