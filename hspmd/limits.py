"""Explicit size limits for every user-facing entry point, the one ASCII-number reader, and the
checks of integers and flags read back from plain-data files.

Each limit keeps the work an input can ask for bounded in time and memory (a device range of a
billion ids, a topology of 10^10 devices, a 5,000-digit integer). They are far above what the
paper's clusters need (thousands of GPUs, tens of layers); a LimitError states the limit it hit.
"""

from __future__ import annotations

import itertools
import reprlib
from typing import Iterable, Mapping

from hspmd.errors import HSPMDTypeError, HSPMDValueError, LimitError

class _Brief(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # repr of an int over 4,300 digits raises ValueError; show its size instead
        return repr(x) if x.bit_length() <= 128 else f"<{x.bit_length()}-bit integer>"


_BRIEF = _Brief()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 3, 60, 60, 40
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 8

MAX_DEVICES = 65536  # devices in one group, union, topology or job; device ids are 0..MAX_DEVICES-1
MAX_LOCAL_RANKS = 1024  # processes one launcher starts on one machine
MAX_DIMS = 32  # tensor rank, and so split dims 0..MAX_DIMS-1
MAX_LAYERS = 65536  # model layers in a strategy
MAX_BATCH_ROWS = 10**9  # micro-batches per step, and rows per micro-batch
MAX_SYMBOL_VALUE = 10**12  # a run-time size (sequence length, tokens per step)
MAX_RATIO = 10**12  # a top-tier split weight
MAX_DIGITS = 18  # decimal digits of one integer written in text (annotations, strategies, CLI)
MAX_WARMUP = 10**6  # forwards a pipeline stage launches before its first backward (warm-up vectors)
MAX_NESTING = 64  # nesting depth of a strategy file (JSON/YAML)


def check_limit(value: int, limit: int, what: str, where: str = "") -> int:
    """`value` if it is at most `limit`, else a LimitError naming both."""
    if value > limit:
        at = f" ({where})" if where else ""
        raise LimitError(f"{what} is {brief(value)}, over the limit of {limit}{at}; hspmd.limits sets it")
    return value


def is_ascii_number(text: str) -> bool:
    """True for a non-empty run of ASCII digits 0-9 (str.isdigit also accepts '²' and '٢')."""
    return bool(text) and text.isascii() and text.isdigit()


def ascii_int(text: str, what: str) -> int:
    """The value of ASCII digits `text`, at most MAX_DIGITS of them (no unicode digits, no 4,300-digit
    numbers); the caller has checked is_ascii_number."""
    if len(text) > MAX_DIGITS:
        raise LimitError(f"{what} {text[:12]}... has {len(text)} digits, over the limit of {MAX_DIGITS}")
    return int(text)


def json_count(value: object, what: str) -> int:
    """`value` read from a plain-data file as a non-negative integer (not a bool), else a
    ValueError naming `what`: the caller says which file and field."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer, at least 0, got {brief(value)}")
    return value


def json_flag(value: object, what: str) -> bool:
    """`value` read from a plain-data file as true or false, else a ValueError naming `what`."""
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, got {brief(value)}")
    return value


def brief(value: object) -> str:
    """A repr of a user's value short enough for an error message (a 10^6-element list or a YAML
    alias bomb prints in bounded time and length)."""
    return _BRIEF.repr(value)


def device_id_set(value: object, what: str) -> frozenset[int]:
    """`value` as a set of device ids (failed devices, for_devices...): a collection of ints in
    0..MAX_DEVICES-1, else an error naming `what`. A string is refused, not read as its characters."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise HSPMDTypeError(f"{what} must be device ids (a collection of ints), got {brief(value)}")
    found = list(itertools.islice(value, MAX_DEVICES + 1))
    check_limit(len(found), MAX_DEVICES, f"the number of {what}")
    bad = [d for d in found if isinstance(d, bool) or not isinstance(d, int)]
    if bad:
        raise HSPMDTypeError(f"{what} must be device ids (ints), got {brief(bad[0])}")
    outside = [d for d in found if not 0 <= d < MAX_DEVICES]
    if outside:
        raise HSPMDValueError(f"{what}: device id {brief(outside[0])} is outside 0-{MAX_DEVICES - 1}")
    return frozenset(found)
