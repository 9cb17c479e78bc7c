"""Initializers that make any box of a tensor without the rest of it.

Every element's value is a pure function of (the tensor's seed, the element's global flat index):
a counter-based generator, in the spirit of Philox / Threefry, built on a 32-bit integer mixer
(Wellons' `lowbias32`). A rank that holds one piece of a weight creates just that piece, and the
piece equals the same box of the whole tensor made on one device, under any strategy. A 32B model
can therefore start on 32 devices without any of them ever holding a whole weight.

The arithmetic is done on int64 tensors holding 32-bit values; products are split into 16-bit
halves so that nothing overflows int64.

`make_piece` makes a piece in chunks of at most CHUNK_ELEMENTS elements, written into the piece in
its dtype and on its device as they come: the int64 and float64 temporaries of the mixer stay in
cache whatever the piece's size (made at once, a 4 MiB fp32 piece of 1M elements took the process
130 MiB above its start, in chunks 14 MiB; a 16M-element one 5.8 s at once, 0.9 s in chunks).

A custom initializer is any callable `(shape, generator) -> whole tensor` (the older form); it is
wrapped in `WholeTensor`, which does make the whole tensor on every rank and keeps only the box:
fine for small weights, and the one initializer that does not scale.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from hspmd.errors import HSPMDError

Box = tuple[tuple[int, int], ...]
_MASK = 0xFFFFFFFF
CHUNK_ELEMENTS = 1 << 15  # elements made at once by make_piece: 256 KiB per int64 temporary (in cache)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _flat_index(shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """Global row-major flat index of every element of `box`, laid out as the box."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        start, stop = box[d]
        view = [1] * len(shape)
        view[d] = stop - start
        index = index + torch.arange(start, stop, dtype=torch.int64).reshape(view) * stride
        stride *= shape[d]
    return index.expand(tuple(b - a for a, b in box)) if shape else index


def uniform_bits(seed: int, stream: int, shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """Uniform floats in (0, 1) (float64, 24 random bits) for the elements of `box`."""
    key = (seed * 0x9E3779B1 + stream * 0x85EBCA77) & _MASK
    index = _flat_index(shape, box)
    h = _mix32((index & _MASK) ^ key)
    h = _mix32(h ^ (index >> 32) ^ ((key * 0xC2B2AE3D + 1) & _MASK))
    return ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)


class Initializer(ABC):
    """Makes the elements of `box` of a tensor of `shape` (float64; the caller casts)."""

    @abstractmethod
    def make(self, shape: tuple[int, ...], box: Box, seed: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class Normal(Initializer):
    std: float = 0.02
    mean: float = 0.0

    def make(self, shape, box, seed):
        u1, u2 = uniform_bits(seed, 0, shape, box), uniform_bits(seed, 1, shape, box)
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2) * self.std + self.mean


@dataclass(frozen=True)
class Uniform(Initializer):
    bound: float

    def make(self, shape, box, seed):
        return (uniform_bits(seed, 0, shape, box) * 2 - 1) * self.bound


@dataclass(frozen=True)
class Constant(Initializer):
    value: float

    def make(self, shape, box, seed):
        return torch.full(tuple(b - a for a, b in box), float(self.value), dtype=torch.float64)


@dataclass(frozen=True)
class WholeTensor(Initializer):
    """A user's `(shape, generator) -> tensor`: the whole tensor is made, then cut to `box`."""

    fn: Callable[[tuple[int, ...], torch.Generator], torch.Tensor]

    def make(self, shape, box, seed):
        whole = self.fn(shape, torch.Generator().manual_seed(seed))
        return whole[tuple(slice(a, b) for a, b in box)]


def box_chunks(box: Box, limit: int) -> Iterator[Box]:
    """Sub-boxes tiling `box` in row-major order, each of at most `limit` elements (or one element)."""
    sizes = [b - a for a, b in box]
    if math.prod(sizes) <= limit:
        yield box
        return
    inner = math.prod(sizes[1:])
    (start, stop), rest = box[0], box[1:]
    if inner <= limit:
        rows = limit // inner
        for first in range(start, stop, rows):
            yield ((first, min(first + rows, stop)),) + rest
        return
    for row in range(start, stop):
        for sub in box_chunks(rest, limit):
            yield ((row, row + 1),) + sub


def make_piece(init: Initializer, shape: tuple[int, ...], box: Box, seed: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", chunk: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """The elements of `box` in `dtype` on `device`, equal to init.make(...).to(dtype): made chunk
    by chunk straight into the result (a WholeTensor is made whole: it has no other way). The
    mixer runs on the CPU whatever `device` is, so every device gets the same bits."""
    shape, box = tuple(shape), tuple((a, b) for a, b in box)
    if isinstance(init, WholeTensor):
        return init.make(shape, box, seed).to(dtype).to(device)
    out = torch.empty(tuple(b - a for a, b in box), dtype=dtype, device=device)
    for sub in box_chunks(box, chunk):
        out[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(sub, box))].copy_(init.make(shape, sub, seed))
    return out


_KINDS: dict[str, type[Normal] | type[Uniform] | type[Constant]] = {"normal": Normal, "uniform": Uniform, "constant": Constant}


def initializer_key(init: Initializer) -> tuple[tuple[str, object], ...] | None:
    """The initializer as plain data, ("kind", name) first, then its fields; None for a user's
    WholeTensor, which is code and cannot be written down."""
    for kind, cls in _KINDS.items():
        if type(init) is cls:
            return (("kind", kind),) + tuple((f.name, getattr(init, f.name)) for f in dataclasses.fields(cls))
    return None


def initializer_from_key(key: Mapping[str, object]) -> Initializer:
    """The initializer `initializer_key` wrote (as a mapping); an HSPMDError names a bad key."""
    fields = dict(key)
    kind = fields.pop("kind", None)
    if kind not in _KINDS:
        raise HSPMDError(f"initializer kind {kind!r} is not one of {', '.join(_KINDS)}")
    cls = _KINDS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    if not set(fields) <= names or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in fields.values()):
        raise HSPMDError(f"initializer {kind} takes numbers {sorted(names)}, got {fields!r}")
    return cls(**{k: float(v) for k, v in fields.items()})  # type: ignore[arg-type]  # numbers, checked above


def as_initializer(init: Initializer | Callable[[tuple[int, ...], torch.Generator], torch.Tensor]) -> Initializer:
    return init if isinstance(init, Initializer) else WholeTensor(init)


def normal(std: float = 0.02, mean: float = 0.0) -> Initializer:
    return Normal(std, mean)


def uniform(bound: float) -> Initializer:
    return Uniform(bound)


def zeros() -> Initializer:
    return Constant(0.0)


def ones() -> Initializer:
    return Constant(1.0)


def constant(value: float) -> Initializer:
    return Constant(value)


__all__ = [
    "CHUNK_ELEMENTS", "Constant", "Initializer", "Normal", "Uniform", "WholeTensor", "as_initializer", "box_chunks",
    "constant", "initializer_from_key", "initializer_key", "make_piece", "normal", "ones", "uniform", "uniform_bits",
    "zeros",
]
