"""Plain-data encodings for what ranks exchange through the rendezvous store or a collective.

Nothing received from a peer or the store is unpickled (a planted pickle runs code in the reader):
group lists travel as ASCII text and NCCL unique ids as raw bytes, and the decoders accept exactly
the format the encoders write, raising CommunicationError on anything else.
"""

from __future__ import annotations

import re
import struct
from typing import Iterable, Sequence

from hspmd.errors import CommunicationError
from hspmd.limits import MAX_DEVICES

NCCL_UNIQUE_ID_BYTES = 128
_GROUP = re.compile(r"[0-9]{1,5}(?:-[0-9]{1,5})*")
MAX_GROUPS_BYTES = 1 << 24


def encode_groups(groups: Iterable[Sequence[int]]) -> bytes:
    """[(0, 1), (2, 3)] -> b'0-1;2-3' (an empty list -> b'')."""
    return ";".join("-".join(str(int(r)) for r in g) for g in groups).encode("ascii")


def decode_groups(data: bytes, world_size: int, sender: object) -> list[tuple[int, ...]]:
    """The groups of encode_groups, each a tuple of distinct ranks below `world_size`."""
    if len(data) > MAX_GROUPS_BYTES:
        raise CommunicationError(f"group list from {sender} is {len(data)} bytes, over {MAX_GROUPS_BYTES}")
    try:
        text = bytes(data).decode("ascii")
    except UnicodeDecodeError:
        raise CommunicationError(f"group list from {sender} is not ASCII text; refusing it") from None
    groups = []
    for item in text.split(";") if text else []:
        if not _GROUP.fullmatch(item):
            raise CommunicationError(f"group list from {sender} holds {item[:40]!r}, not ranks like 0-1-2; refusing it")
        ranks = tuple(int(r) for r in item.split("-"))
        if len(set(ranks)) != len(ranks) or any(r >= min(world_size, MAX_DEVICES) for r in ranks):
            raise CommunicationError(f"group list from {sender} names ranks {ranks[:8]} outside the world of {world_size}")
        groups.append(ranks)
    return groups


def encode_unique_id(unique_id: Sequence[int] | bytes) -> bytes:
    """cupy's NCCL unique id as a form byte and 128 raw bytes. cupy gives the id as a tuple of 128
    signed chars in older releases and as 128 bytes in newer ones (and its NcclCommunicator takes
    the same form back); the form byte (`-` signed chars, `+` bytes) lets every rank rebuild it."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise CommunicationError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    signed = not isinstance(unique_id, bytes) and any(v < 0 for v in unique_id)
    low, high = (-128, 127) if signed else (0, 255)
    if not all(low <= v <= high for v in unique_id):
        raise CommunicationError(f"an NCCL unique id holds chars outside {low}..{high}: {min(unique_id)}..{max(unique_id)}")
    return (b"-" if signed else b"+") + bytes(v & 0xFF for v in unique_id)


def decode_unique_id(data: bytes, sender: object) -> tuple[int, ...] | bytes:
    if len(data) != NCCL_UNIQUE_ID_BYTES + 1 or data[:1] not in (b"-", b"+"):
        raise CommunicationError(
            f"NCCL unique id from {sender} is not a sign byte and {NCCL_UNIQUE_ID_BYTES} bytes ({len(data)} bytes); refusing it")
    raw = bytes(data[1:])
    return struct.unpack(f"{NCCL_UNIQUE_ID_BYTES}b", raw) if data[:1] == b"-" else raw


__all__ = ["NCCL_UNIQUE_ID_BYTES", "decode_groups", "decode_unique_id", "encode_groups", "encode_unique_id"]
