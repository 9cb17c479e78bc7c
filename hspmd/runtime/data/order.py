"""The order in which a dataset's documents are trained, and the small state that says where a job is.

Epoch e visits the documents in the order `permuted(i, n, seed, e)`, i = 0 .. n-1: a Feistel
network on the next even power of two above n, cycle-walked into [0, n) (a bijection on [0, n),
made of 4 rounds of a 64-bit mixer keyed by (seed, epoch, round)). Any position's document is
computed on its own, in constant time and memory: nothing of size n is ever built, so a loader's
memory does not grow with the dataset.

`DataState` is a cursor into that order: the epoch, the samples taken in it, the position in the
epoch's document order and the tokens of that document already passed. It is all a loader keeps
between steps; it round-trips through JSON for checkpoints and elastic transactions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from hspmd.runtime.data.tokens import DataError

_M64 = (1 << 64) - 1
ROUNDS = 4


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words whose output bits all depend on every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


@lru_cache(maxsize=64)
def _round_keys(seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(_mix((seed & _M64) ^ _mix(epoch * ROUNDS + r + 1)) for r in range(ROUNDS))


def permuted(index: int, count: int, seed: int, epoch: int) -> int:
    """The document at position `index` of epoch `epoch`'s order of `count` documents."""
    if not 0 <= index < count:
        raise DataError(f"position {index} is outside the {count} documents of the dataset")
    if count <= 2:
        return index ^ (_mix(seed * 1_000_003 + epoch) & 1) if count == 2 else index
    bits = (count - 1).bit_length()
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    keys = _round_keys(seed, epoch)
    x = index
    while True:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(key ^ right) & mask)
        x = (left << half) | right
        if x < count:
            return x


@dataclass(frozen=True)
class DataState:
    """Where a job is in its data: `epoch`, `sample` (samples taken in the epoch), `document`
    (position in the epoch's document order) and `offset` (tokens of that document passed)."""

    epoch: int = 0
    sample: int = 0
    document: int = 0
    offset: int = 0

    def __post_init__(self):
        for name, value in (("epoch", self.epoch), ("sample", self.sample), ("document", self.document),
                            ("offset", self.offset)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataError(f"data state: {name} must be a non-negative integer, got {value!r}")

    def to_json(self) -> str:
        return json.dumps({"document": self.document, "epoch": self.epoch, "offset": self.offset, "sample": self.sample})

    @staticmethod
    def from_json(text: str, where: str) -> "DataState":
        """The state a checkpoint or a peer wrote; a DataError naming `where` if it is damaged."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or set(raw) != {"epoch", "sample", "document", "offset"}:
                raise ValueError(f"expected the fields epoch, sample, document, offset, got {text[:80]!r}")
            return DataState(**raw)
        except (ValueError, TypeError, DataError) as exc:
            raise DataError(f"{where}: the data state is damaged ({exc})") from None


__all__ = ["DataState", "permuted"]
