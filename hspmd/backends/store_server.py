"""The job store's server: its data and its listening socket, served by one thread.

The server binds only to the address it is given (loopback by default). Every connection starts
with a mutual challenge (hspmd.backends.store_channel): the server sends a random nonce, the
client answers with its tag and its own nonce, the server answers in turn; a client without the
job's secret is disconnected before it can read or write anything. After that every message is
authenticated (store_channel.Channel); one that fails its MAC closes its connection.
"""

from __future__ import annotations

import heapq
import hmac
import secrets
import selectors
import socket
import threading
import time
from collections import deque

from hspmd.backends.store_channel import (
    HANDSHAKE_TIMEOUT_S,
    LENGTH,
    MAC_BYTES,
    MAX_FRAME_BYTES,
    NONCE_BYTES,
    OPS,
    Channel,
    TamperedMessage,
    tag,
)
from hspmd.errors import CommunicationError

LOOPBACK = "127.0.0.1"


class _Connection:
    """A client connection's state in the server loop: the bytes read and not yet handled, the
    bytes not yet sent, the challenge's nonce until it is answered, then the channel; the request
    parked until its keys exist; the tracked keys it added to."""

    __slots__ = ("sock", "inbox", "outbox", "nonce", "channel", "parked", "tracked", "open", "queued", "writing")

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock, self.nonce = sock, nonce
        self.inbox, self.outbox = bytearray(), bytearray()
        self.channel: Channel | None = None
        self.parked: _Parked | None = None
        self.tracked: set[str] = set()
        self.open = True
        self.queued = False  # in the server's list of connections with bytes to send this turn
        self.writing = False  # waiting for the socket to take more bytes (registered for EVENT_WRITE)


class _Parked:
    """A get or wait whose keys do not all exist yet: it answers when they do or at its deadline."""

    __slots__ = ("conn", "op", "keys", "deadline", "on")

    def __init__(self, conn: _Connection, op: bytes, keys: list[str], deadline: float):
        self.conn, self.op, self.keys, self.deadline = conn, op, keys, deadline
        self.on = ""  # the missing key it is parked on


class StoreServer:
    """The store's data and its listening socket, served by one thread: a `selectors` loop over
    non-blocking sockets. A get or wait whose keys are missing is parked on the first missing key
    and answered when a set, add or compare_set makes it (or at its deadline); nothing polls.

    Binds to exactly (host, port); port 0 picks a free one (see `.port`)."""

    def __init__(self, secret: bytes, host: str = LOOPBACK, port: int = 0):
        self._secret = secret
        self._data: dict[str, bytes] = {}
        self.refused = 0  # connections that failed the challenge
        # keys under `track_prefix` a connection added to, reported once that connection closes
        # (a heartbeat connection's close is its process's death, known before any beat is missed)
        self.track_prefix: str | None = None
        self._closed_keys: list[str] = []
        self._closed_keys_lock = threading.Lock()
        self.tampered = 0  # connections closed on a message whose MAC did not match
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise CommunicationError(f"the job's store cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._listener.listen(4096)  # a whole job may connect at once (1,024 ranks in bench_store)
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._waiting: dict[str, list[_Parked]] = {}  # missing key -> requests parked on it
        self._deadlines: list[tuple[float, int, object]] = []  # (when, tie-break, parked request or handshake's connection)
        self._ticket, self._compact_at = 0, 1024
        self._woken: deque[_Parked] = deque()
        self._unsent: list[_Connection] = []  # connections given bytes this turn, sent once at its end
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._closed = False
        self._open = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hspmd-store")
        self._thread.start()

    def close(self) -> None:
        """Stop serving: the listener and every client connection are closed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    @property
    def open_connections(self) -> int:
        """Client connections open now (authenticated or still in their challenge)."""
        return self._open

    def take_closed_keys(self) -> list[str]:
        """Tracked keys (`track_prefix`) whose connections closed since the last call."""
        with self._closed_keys_lock:
            keys, self._closed_keys = self._closed_keys, []
        return keys

    # the loop ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, events in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_read:
                        self._drain_waker()
                    else:
                        conn = key.data
                        if events & selectors.EVENT_WRITE and conn.open:
                            self._flush(conn)
                        if events & selectors.EVENT_READ and conn.open:
                            self._read(conn)
                self._expire()
                self._send_queued()
        finally:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    self._close(key.data)
            self._selector.close()
            for sock in (self._listener, self._wake_read, self._wake_write):
                sock.close()

    def _drain_waker(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except OSError:
            pass

    def _next_timeout(self) -> float | None:
        return max(0.0, self._deadlines[0][0] - time.monotonic()) if self._deadlines else None

    def _at(self, when: float, what: object) -> None:
        self._ticket += 1
        heapq.heappush(self._deadlines, (when, self._ticket, what))
        if len(self._deadlines) > self._compact_at:  # drop the deadlines of requests answered long before them
            self._deadlines = [d for d in self._deadlines if self._pending(d[2])]
            heapq.heapify(self._deadlines)
            self._compact_at = 2 * len(self._deadlines) + 1024

    @staticmethod
    def _pending(what: object) -> bool:
        if isinstance(what, _Parked):
            return what.conn.open and what.conn.parked is what
        return isinstance(what, _Connection) and what.open and what.channel is None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, what = heapq.heappop(self._deadlines)
            if not self._pending(what):
                continue
            if isinstance(what, _Parked):
                self._unpark(what)
                what.conn.parked = None
                self._reply(what.conn, [b"timeout"])
                self._handle_buffered(what.conn)
            elif isinstance(what, _Connection):
                self._close(what)  # the challenge was not answered in time

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, secrets.token_bytes(NONCE_BYTES))
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._open += 1
            self._at(time.monotonic() + HANDSHAKE_TIMEOUT_S, conn)
            self._send(conn, conn.nonce)

    def _read(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        conn.inbox += chunk
        if conn.channel is None and not self._answer_challenge(conn):
            return
        self._handle_buffered(conn)

    def _answer_challenge(self, conn: _Connection) -> bool:
        if len(conn.inbox) < 32 + NONCE_BYTES:
            return False
        answer = bytes(conn.inbox[:32 + NONCE_BYTES])
        del conn.inbox[:32 + NONCE_BYTES]
        if not hmac.compare_digest(answer[:32], tag(self._secret, b"client", conn.nonce)):
            self.refused += 1
            self._close(conn)
            return False
        self._send(conn, tag(self._secret, b"server", answer[32:]))
        conn.channel = Channel(self._secret, conn.nonce, answer[32:], is_server=True)
        return True

    def _handle_buffered(self, conn: _Connection) -> None:
        """Answer the requests read on `conn`, in order, until one parks or the bytes run out;
        then the requests that became answerable meanwhile, on their own connections."""
        self._handle_requests(conn)
        while self._woken:
            parked = self._woken.popleft()
            if parked.conn.open and parked.conn.parked is parked and all(k in self._data for k in parked.keys):
                parked.conn.parked = None
                self._reply(parked.conn, self._answer_parked(parked))
                self._handle_requests(parked.conn)
            elif parked.conn.open and parked.conn.parked is parked:
                self._park(parked)

    def _handle_requests(self, conn: _Connection) -> None:
        inbox, channel = conn.inbox, conn.channel
        while channel is not None and conn.open and conn.parked is None and len(inbox) >= 4:
            (n,) = LENGTH.unpack_from(inbox, 0)
            if n > MAX_FRAME_BYTES:
                self._close(conn)
                return
            if len(inbox) < 4 + n + MAC_BYTES:
                return
            body, mac = bytes(inbox[4:4 + n]), bytes(inbox[4 + n:4 + n + MAC_BYTES])
            del inbox[:4 + n + MAC_BYTES]
            try:
                request = channel.open(body, mac)
                reply = self._handle(conn, request)
            except TamperedMessage:
                self.tampered += 1
                self._close(conn)
                return
            except Exception:  # noqa: BLE001 - a malformed request ends its connection, never the server
                self._close(conn)
                return
            if reply is not None:
                self._reply(conn, reply)

    def _reply(self, conn: _Connection, frames: list[bytes]) -> None:
        if conn.channel is not None:
            self._send(conn, conn.channel.seal(frames))

    def _send(self, conn: _Connection, data: bytes) -> None:
        """Queue `data` for `conn`; what a turn of the loop gives a connection (the challenge's
        answer and the first reply, say) leaves in one send at the turn's end."""
        conn.outbox += data
        if not conn.queued:
            conn.queued = True
            self._unsent.append(conn)

    def _send_queued(self) -> None:
        for conn in self._unsent:
            conn.queued = False
            if conn.open and conn.outbox and not conn.writing:
                self._flush(conn)
        self._unsent.clear()

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        del conn.outbox[:sent]
        if bool(conn.outbox) != conn.writing:  # wait for room only while bytes are left
            conn.writing = bool(conn.outbox)
            self._selector.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0), conn)

    def _close(self, conn: _Connection) -> None:
        if not conn.open:
            return
        if conn.parked is not None:
            self._unpark(conn.parked)
        conn.open, conn.parked = False, None
        self._open -= 1
        if conn.outbox and not conn.writing:  # what this turn gave it (the challenge's answer, say) still leaves
            try:
                conn.sock.send(conn.outbox)
            except OSError:
                pass
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.tracked:
            with self._closed_keys_lock:
                self._closed_keys.extend(sorted(conn.tracked))

    # the operations ------------------------------------------------------------------------------

    def _park(self, parked: _Parked) -> None:
        parked.on = next(k for k in parked.keys if k not in self._data)
        self._waiting.setdefault(parked.on, []).append(parked)

    def _unpark(self, parked: _Parked) -> None:
        """Forget a parked request whose connection closed (its key may never be written)."""
        waiting = self._waiting.get(parked.on)
        if waiting is not None and parked in waiting:
            waiting.remove(parked)
            if not waiting:
                del self._waiting[parked.on]

    def _made(self, key: str) -> None:
        """`key` now exists: the requests parked on it are looked at again."""
        parked = self._waiting.pop(key, None)
        if parked:
            self._woken.extend(parked)

    def _answer_parked(self, parked: _Parked) -> list[bytes]:
        return [b"ok", self._data[parked.keys[0]]] if parked.op == b"get" else [b"ok"]

    def _handle(self, conn: _Connection, request: list[bytes]) -> list[bytes] | None:
        """The reply to `request`, or None when it was parked until its keys exist."""
        if not request or request[0] not in OPS:
            return [b"error", b"unknown operation"]
        op, args = request[0], request[1:]
        data = self._data
        if op == b"set":
            key = args[0].decode("utf-8", "replace")
            data[key] = args[1]
            self._made(key)
            return [b"ok"]
        if op == b"add":
            key = args[0].decode("utf-8", "replace")
            if self.track_prefix and key.startswith(self.track_prefix):
                conn.tracked.add(key)
            value = int(data.get(key, b"0")) + int(args[1])
            data[key] = str(value).encode()
            self._made(key)
            return [b"ok", str(value).encode()]
        keys = [a.decode("utf-8", "replace") for a in args]
        if op == b"check":
            return [b"ok", b"1" if all(k in data for k in keys) else b"0"]
        if op in (b"get", b"wait"):
            timeout_ms, wanted = int(args[0]), keys[1:]
            if not wanted:
                raise ValueError("a get or wait without keys")
            parked = _Parked(conn, op, wanted, time.monotonic() + timeout_ms / 1000)
            if all(k in data for k in wanted):
                return self._answer_parked(parked)
            if timeout_ms <= 0:
                return [b"timeout"]
            conn.parked = parked
            self._park(parked)
            self._at(parked.deadline, parked)
            return None
        if op == b"compare_set":
            current = data.get(keys[0])
            if (current is None and args[1] == b"") or current == args[1]:
                data[keys[0]] = args[2]
                self._made(keys[0])
                return [b"ok", args[2]]
            return [b"ok", args[1] if current is None else current]
        if op == b"delete_key":
            found = data.pop(keys[0], None) is not None
            return [b"ok", b"1" if found else b"0"]
        return [b"ok", str(len(data)).encode()]


__all__ = ["LOOPBACK", "StoreServer"]
