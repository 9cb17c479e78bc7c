"""A stand-in for cupy.cuda.nccl on CPU memory, one thread per rank, for testing CupyNcclBackend's
own logic (store rendezvous, member order, padding, byte views, grouped point-to-point) without a GPU.

Calls take raw pointers and element counts like the real API; each collective is a rendezvous of
the communicator's members, who read each other's buffers while all of them wait inside the call.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import struct
import types

import numpy as np

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 0, 1, 2, 4, 6, 7, 8
NCCL_SUM = 0
_NUMPY = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_INT64: np.int64,
          NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
TIMEOUT_S = 20.0

_ids = itertools.count()
_cond = threading.Condition()
_slots: dict = {}
_mail: dict = {}
_pending = threading.local()


def _memory(ptr: int, count: int, dtype: int) -> np.ndarray:
    kind = np.dtype(_NUMPY[dtype])
    if count == 0:
        return np.zeros(0, kind)
    return np.frombuffer((ctypes.c_char * (count * kind.itemsize)).from_address(ptr), dtype=kind)


def get_unique_id():
    """Like cupy's: a tuple of 128 signed chars (here a counter in the first 8 bytes)."""
    return struct.unpack("128b", next(_ids).to_bytes(8, "little") + bytes(120))


class NcclCommunicator:
    def __init__(self, ndev: int, comm_id, rank: int):
        self.size, self.id, self.rank, self._calls = ndev, comm_id, rank, 0
        self._gather(None)

    def _gather(self, value) -> dict:
        """Deposit `value`, wait for every member's, return them (the call's rendezvous)."""
        key = (self.id, self._calls)
        self._calls += 1
        with _cond:
            slot = _slots.setdefault(key, {})
            slot[self.rank] = value
            _cond.notify_all()
            if not _cond.wait_for(lambda: len(slot) >= self.size, timeout=TIMEOUT_S):
                raise RuntimeError(f"fake NCCL: members never joined call {key}")
        return slot

    def allReduce(self, send, recv, count, dtype, op, stream):
        slot = self._gather((send, count, dtype))
        total = sum(_memory(*slot[k]) for k in range(self.size))
        self._gather(None)
        _memory(recv, count, dtype)[:] = total

    def allGather(self, send, recv, count, dtype, stream):
        slot = self._gather((send, count, dtype))
        pieces = [_memory(*slot[k]).copy() for k in range(self.size)]
        self._gather(None)
        _memory(recv, count * self.size, dtype)[:] = np.concatenate(pieces)

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        slot = self._gather((send, count * self.size, dtype))
        total = sum(_memory(*slot[k]) for k in range(self.size))
        self._gather(None)
        _memory(recv, count, dtype)[:] = total[self.rank * count:(self.rank + 1) * count]

    def broadcast(self, send, recv, count, dtype, root, stream):
        slot = self._gather((send, count, dtype))
        data = _memory(*slot[root]).copy()
        self._gather(None)
        _memory(recv, count, dtype)[:] = data

    def send(self, buf, count, dtype, peer, stream):
        _pending.ops.append(("send", self, buf, count, dtype, peer))

    def recv(self, buf, count, dtype, peer, stream):
        _pending.ops.append(("recv", self, buf, count, dtype, peer))

    def destroy(self):
        pass


def groupStart():
    _pending.ops = []


def groupEnd():
    ops, _pending.ops = _pending.ops, []
    with _cond:
        for kind, comm, buf, count, dtype, peer in ops:
            if kind == "send":
                _mail.setdefault((comm.id, comm.rank, peer), []).append(_memory(buf, count, dtype).copy())
        _cond.notify_all()
        for kind, comm, buf, count, dtype, peer in ops:
            if kind == "recv":
                box = _mail.setdefault((comm.id, peer, comm.rank), [])
                if not _cond.wait_for(lambda: bool(box), timeout=TIMEOUT_S):
                    raise RuntimeError(f"fake NCCL: nothing from rank {peer}")
                _memory(buf, count, dtype)[:] = box.pop(0)


class _Device:
    def __init__(self, index):
        self.index = index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


nccl = types.SimpleNamespace(
    NCCL_INT8=NCCL_INT8, NCCL_UINT8=NCCL_UINT8, NCCL_INT32=NCCL_INT32, NCCL_INT64=NCCL_INT64,
    NCCL_FLOAT16=NCCL_FLOAT16, NCCL_FLOAT32=NCCL_FLOAT32, NCCL_FLOAT64=NCCL_FLOAT64, NCCL_SUM=NCCL_SUM,
    get_unique_id=get_unique_id, NcclCommunicator=NcclCommunicator, groupStart=groupStart, groupEnd=groupEnd,
)
cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=_Device, nccl=nccl))


class Stream:
    cuda_stream = 0

    def synchronize(self):
        pass


class Event:
    def record(self, stream):
        pass

    def query(self):
        return True
