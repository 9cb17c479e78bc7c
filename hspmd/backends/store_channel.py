"""The job store's wire: the mutual challenge's tags and one authenticated connection's framing.

After the challenge every message in either direction carries a MAC: HMAC-SHA256 under a session
key both sides derive from the secret and the two nonces, over the direction, the message's
sequence number on the connection and its bytes. A relay on the path that changes, drops,
reorders or replays a message (also one from another connection: its key differs) is caught by
the next MAC.

Wire format: a message is a 4-byte big-endian length, a body and a 32-byte MAC; the body is a
4-byte frame count and frames of a 4-byte length and a payload. A request's frames are the
operation and its arguments; a reply's are a status and its results. The MAC is checked before
the body is read.
"""

from __future__ import annotations

import hmac
import socket
import struct
from hashlib import sha256
from typing import Sequence

NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 1 << 28
MAX_ARGUMENTS = 1 << 16
OPS = (b"set", b"get", b"add", b"check", b"wait", b"compare_set", b"delete_key", b"num_keys")


def tag(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    """The challenge's answer: HMAC-SHA256(secret, role + the other side's nonce)."""
    return hmac.new(secret, role + nonce, sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes from a blocking socket (ConnectionError if the peer closes first)."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


LENGTH = struct.Struct(">I")
SEQ = struct.Struct(">Q")
MAC_BYTES = 32


class Channel:
    """One authenticated connection's MAC state: the session key and a sequence number per
    direction, so every message is bound to its connection, its direction and its place."""

    def __init__(self, secret: bytes, server_nonce: bytes, client_nonce: bytes, is_server: bool):
        key = hmac.new(secret, b"session" + server_nonce + client_nonce, sha256).digest()
        # HMAC's keyed state, copied per message; unlike hmac.digest (which releases the interpreter
        # lock on every call), a copy's update keeps the lock for small messages, so a process with
        # many store clients (1,024 threads in bench_store) does not hand the lock around per MAC
        self._keyed = hmac.new(key, digestmod=sha256)
        self._out, self._in = (b"s2c", b"c2s") if is_server else (b"c2s", b"s2c")
        self._sent = self._received = 0
        self._unread = bytearray()  # bytes received on a blocking socket past the last message

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        mac = self._keyed.copy()
        mac.update(direction + SEQ.pack(seq) + body)
        return mac.digest()

    def seal(self, frames: Sequence[bytes]) -> bytes:
        """The next outgoing message holding `frames`: length, body, MAC."""
        parts = [LENGTH.pack(len(frames))]
        for f in frames:
            parts += (LENGTH.pack(len(f)), f)
        body = b"".join(parts)
        message = LENGTH.pack(len(body)) + body + self._mac(self._out, self._sent, body)
        self._sent += 1
        return message

    def open(self, body: bytes, mac: bytes) -> list[bytes]:
        """The frames of the next incoming message, once its MAC is right (TamperedMessage if not)."""
        if not hmac.compare_digest(mac, self._mac(self._in, self._received, body)):
            raise TamperedMessage("a store message failed its MAC (changed, replayed, reordered or not from this job)")
        self._received += 1
        return frames_of(body)

    def send(self, sock: socket.socket, frames: Sequence[bytes]) -> None:
        sock.sendall(self.seal(frames))

    def _fill(self, sock: socket.socket, n: int) -> bytearray:
        """The receive buffer once it holds at least `n` bytes (read from a blocking socket)."""
        unread = self._unread
        while len(unread) < n:
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            unread += chunk
        return unread

    def receive_bytes(self, sock: socket.socket, n: int) -> bytes:
        """The next `n` raw bytes, through the same buffer as messages (the challenge's answer,
        which may arrive in one segment with the first reply)."""
        unread = self._fill(sock, n)
        head = bytes(unread[:n])
        del unread[:n]
        return head

    def receive(self, sock: socket.socket) -> list[bytes]:
        """The next message's frames: one recv per message as a rule (a reply arrives whole), more
        only while it is incomplete."""
        (n,) = LENGTH.unpack_from(self._fill(sock, 4), 0)
        if n > MAX_FRAME_BYTES:
            raise ConnectionError(f"a message of {n} bytes is over the limit of {MAX_FRAME_BYTES}")
        unread = self._fill(sock, 4 + n + MAC_BYTES)
        body, mac = bytes(unread[4:4 + n]), bytes(unread[4 + n:4 + n + MAC_BYTES])
        del unread[:4 + n + MAC_BYTES]
        return self.open(body, mac)


class TamperedMessage(ConnectionError):
    """A message on an authenticated store connection whose MAC does not match."""


def frames_of(body: bytes) -> list[bytes]:
    (count,) = LENGTH.unpack_from(body, 0)
    if count > MAX_ARGUMENTS:
        raise ConnectionError(f"a message of {count} frames is over the limit of {MAX_ARGUMENTS}")
    frames, at = [], 4
    for _ in range(count):
        (n,) = LENGTH.unpack_from(body, at)
        if at + 4 + n > len(body):
            raise ConnectionError("a frame runs past the end of its message")
        frames.append(body[at + 4:at + 4 + n])
        at += 4 + n
    if at != len(body):
        raise ConnectionError("bytes after the last frame of a message")
    return frames
