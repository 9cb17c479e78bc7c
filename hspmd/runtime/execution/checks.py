"""Checks of a trainer's arguments and of what a user feeds a step, made alike on every rank
before any communication.

A step whose batch is wrong (a missing or misspelt key, a list instead of a tensor, a float where
token ids go, a row count that is not the layout's, a token id outside the vocabulary) must fail
with an error naming the placeholder and the fix, on every rank, before any rank sends a byte: a
fault found later, inside one rank's schedule, leaves its peers blocked in a collective and the job
lost. Every rank receives the same batch, so the same check on each gives the same answer.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import sympy
import torch

from hspmd.errors import HSPMDError, HSPMDTypeError, ShapeError, closest_hint
from hspmd.ir.graph import Node
from hspmd.limits import MAX_SYMBOL_VALUE, brief, check_limit
from hspmd.switching import checked_failed


class FeedError(HSPMDError):
    """A batch fed to a step is not what the graph's placeholders take."""


class FeedTypeError(FeedError, HSPMDTypeError):
    """A batch, or one of its values, has the wrong Python type."""


def checked_symbols(symbols: object, where: str) -> dict[str, int]:
    """The run-time symbol values as a dict of names to positive ints."""
    if symbols is None:
        return {}
    if not isinstance(symbols, Mapping):
        raise HSPMDTypeError(f"{where}: symbols map names to sizes (e.g. {{'S': 512}}), got {brief(symbols)}")
    for name, value in symbols.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise HSPMDTypeError(f"{where}: symbol names are identifiers, got {brief(name)}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise HSPMDTypeError(f"{where}: symbol {name} must be an int, got {brief(value)}")
        if value < 1:
            raise HSPMDError(f"{where}: symbol {name} must be at least 1, got {value}")
        check_limit(value, MAX_SYMBOL_VALUE, f"symbol {name}", where)
    return dict(symbols)


def check_seed(seed: object, where: str) -> int:
    """`seed` if it is a non-negative int below 2**63 (the initializers mix it as an int64)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise HSPMDTypeError(f"{where}: the seed must be an int, got {brief(seed)}")
    if not 0 <= seed < 2**63:
        raise HSPMDError(f"{where}: the seed must lie in [0, 2**63), got {brief(seed)}")
    return seed


def checked_ranks(ranks: object, world_size: int, what: str, where: str) -> tuple[int, ...]:
    """`ranks` as a sorted tuple of distinct ranks of a job of `world_size`."""
    found = checked_failed(ranks, where)
    outside = sorted(r for r in found if r >= world_size)
    if outside:
        raise HSPMDError(f"{where}: {what} {brief(outside)} are not ranks of this job (0-{world_size - 1})")
    return tuple(sorted(found))


def check_feeds(placeholders: Sequence[Node], batch: object, where: str, rows: int,
                symbols: Mapping[str, int] | None = None) -> None:
    """Raise FeedError unless `batch` maps every placeholder's name (and nothing else) to a tensor
    of its dtype and rank, with `rows` rows, the dims its shape fixes (`symbols` binds the symbolic
    ones that are known) and values in the placeholder's declared range (`values` attribute)."""
    if not isinstance(batch, Mapping):
        raise FeedTypeError(f"{where}: the batch must map placeholder names to tensors, got {type(batch).__name__}")
    names = [p.name for p in placeholders]
    for key in batch:
        if key not in names:
            raise FeedError(f"{where}: the batch has {key!r}, which is no placeholder of the graph; "
                            f"{closest_hint(str(key), names)}")
    for node in placeholders:
        if node.name not in batch:
            raise FeedError(f"{where}: the batch has no {node.name!r}; feed every placeholder: {', '.join(names)}")
        _check_value(node, batch[node.name], where, rows, symbols or {})


def check_bound(needed: frozenset[str], bound: Mapping[str, int], where: str) -> None:
    """Raise FeedError unless `bound` gives every needed run-time symbol (Graph.symbol_names, read
    once by the caller: it walks the whole graph) a value."""
    unbound = sorted(needed - set(bound))
    if unbound:
        raise FeedError(f"{where}: symbol(s) {', '.join(unbound)} have no value; pass them "
                        f"in the trainer's symbols (e.g. symbols={{{unbound[0]!r}: ...}})")


def _check_value(node: Node, value: object, where: str, rows: int, symbols: Mapping[str, int]) -> None:
    name, dtype, shape = node.name, node.output.dtype, node.output.shape
    if not isinstance(value, torch.Tensor):
        raise FeedTypeError(f"{where}: {name} must be a torch.Tensor of {dtype}, got {type(value).__name__}")
    if value.dtype != dtype:
        raise FeedTypeError(f"{where}: {name} must be {dtype}, got {value.dtype} (convert it with .to({dtype}))")
    if value.dim() != len(shape):
        raise ShapeError(f"{where}: {name} has shape {tuple(value.shape)}; it needs {len(shape)} dims "
                         f"({', '.join(map(str, shape))})")
    if value.shape[0] != rows:
        raise ShapeError(f"{where}: {name} has {value.shape[0]} rows (dim 0); it needs {rows}")
    for d, (expected, got) in enumerate(zip(shape[1:], value.shape[1:]), start=1):
        wanted = symbols.get(expected.name) if isinstance(expected, sympy.Symbol) else expected
        if isinstance(wanted, int) and got != wanted:
            raise ShapeError(f"{where}: {name} has size {got} in dim {d}; it needs {expected} = {wanted}")
    _check_range(node, value, where)


def _check_range(node: Node, value: torch.Tensor, where: str) -> None:
    accepted = node.attrs.get("values")
    if accepted is None or value.is_meta or value.numel() == 0:
        return
    low, high, extras = accepted
    outside = (value < low) | (value >= high)
    for extra in extras:
        outside &= value != extra
    if bool(outside.any()):
        bad = value[outside][0].item()
        also = f" or {', '.join(map(str, extras))}" if extras else ""
        raise FeedError(f"{where}: {node.name} holds {bad}; its values must lie in [{low}, {high}){also}")


__all__ = ["FeedError", "FeedTypeError", "check_bound", "check_feeds", "check_seed", "checked_ranks",
           "checked_symbols"]
