"""Strategy fields: validation errors that name the field (`pipelines[1].stages[2].layers`), and the
compact rank / layer syntax ('0-3,8', '0-14') that strategy files and the text syntax share.

Validation raises `StrategyFieldError` (a `StrategyError`) whose `path` names the field;
loaders and the text parser add their own context to it with `field_context`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

from hspmd.annotations import DeviceGroup
from hspmd.errors import StrategyError, StrategyTypeError, closest_hint
from hspmd.limits import MAX_DEVICES, MAX_DIGITS, MAX_LAYERS, brief, is_ascii_number

Path = tuple[object, ...]


def format_path(path: Path) -> str:
    """("pipelines", 1, "stages", 2, "ranks") -> "pipelines[1].stages[2].ranks"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class StrategyFieldError(StrategyError):
    """A strategy field is invalid; `path` locates it (relative to where the check ran).
    A field of the wrong type raises StrategyFieldTypeError, also a TypeError."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = tuple(path), reason
        super().__init__(f"{format_path(self.path)}: {reason}" if self.path else reason)


class StrategyFieldTypeError(StrategyFieldError, StrategyTypeError):
    """A strategy field has the wrong type."""


@contextmanager
def field_context(*prefix: object) -> Iterator[None]:
    """Re-raise a StrategyFieldError from a nested value with `prefix` prepended to its path."""
    try:
        yield
    except StrategyFieldError as exc:
        raise type(exc)(prefix + exc.path, exc.reason) from None


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_count(value: object, path: Path, allow_none: bool, limit: int = 10**9) -> int | None:
    if value is None and allow_none:
        return None
    if not is_int(value):
        runtime = " or null (bound at run time)" if allow_none else ""
        raise StrategyFieldTypeError(path, f"must be a positive integer{runtime}, got {brief(value)} ({type(value).__name__})")
    if value < 1:
        raise StrategyFieldError(path, f"must be positive, got {brief(value)}")
    if value > limit:
        raise StrategyFieldError(path, f"is {brief(value)}, over the limit of {limit} (hspmd.limits)")
    return value


def format_ranks(ranks: Sequence[int]) -> str:
    """Rank lists print like annotation device groups without brackets: 0-3,8,9."""
    return str(DeviceGroup(tuple(ranks)))[1:-1]


def format_layers(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else str(layers.start)


def _bounds(text: str, what: str, limit: int) -> tuple[int, int]:
    """(first, last) of 'first-last' or 'n' in ASCII digits, both below `limit`."""
    first, dash, last = (part.strip() for part in text.strip().partition("-"))
    if not is_ascii_number(first) or (dash and not is_ascii_number(last)):
        raise StrategyFieldError((), f"{text.strip()!r} is not {what}")
    for number in (first, last) if dash else (first,):
        if len(number) > MAX_DIGITS or int(number) >= limit:
            raise StrategyFieldError((), f"{number[:12]} in {text.strip()!r} is over the limit: values run 0-{limit - 1} (hspmd.limits)")
    lo, hi = int(first), int(last) if dash else int(first)
    if hi < lo:
        raise StrategyFieldError((), f"range {text.strip()} runs backwards; write {hi}-{lo}")
    return lo, hi


def parse_index_list(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8); raises StrategyFieldError(()) naming the bad item."""
    out: list[int] = []
    for item in text.split(","):
        lo, hi = _bounds(item, f"a rank or a range like 0-3 (in {text!r})", MAX_DEVICES)
        if len(out) + hi - lo + 1 > MAX_DEVICES:
            raise StrategyFieldError((), f"{text!r} lists more than {MAX_DEVICES} ranks, the limit (hspmd.limits)")
        out.extend(range(lo, hi + 1))
    return tuple(out)


def parse_count_list(text: str) -> tuple[int, ...]:
    """'5,2,1' -> (5, 2, 1): a warm-up vector in text; the values are checked by Pipeline."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not is_ascii_number(item) or len(item) > MAX_DIGITS:
            raise StrategyFieldError((),
                f"{item[:12]!r} in {text[:40]!r} is not a count: write positive integers separated by commas, e.g. 5,2,1")
        out.append(int(item))
    return tuple(out)


def parse_layer_range(text: str) -> range:
    """'0-14' -> range(0, 15); '7' -> range(7, 8)."""
    lo, hi = _bounds(text, "a layer range like 0-14 (first-last, inclusive)", MAX_LAYERS)
    return range(lo, hi + 1)


def parse_layer_list(text: str) -> tuple[int, ...]:
    """'2-5,7' -> (2, 3, 4, 5, 7), sorted and each once; raises StrategyFieldError(()) naming the bad item."""
    out: set[int] = set()
    for item in text.split(","):
        lo, hi = _bounds(item, f"a layer or a range like 2-5 (in {text!r})", MAX_LAYERS)
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def format_layer_list(layers: Sequence[int]) -> str:
    """(2, 3, 4, 5, 7) -> '2-5,7' (runs of consecutive layers as ranges)."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(format_layers(range(a, b + 1)) for a, b in runs)


def check_keys(data: object, valid: Sequence[str], path: Path, required: Sequence[str]) -> None:
    if not isinstance(data, Mapping):
        raise StrategyFieldTypeError(path, f"must be a mapping with keys {', '.join(valid)}, got {brief(data)}")
    for key in data:
        if key not in valid:
            raise StrategyFieldError(path + (str(key),), f"unknown key {key!r}; {closest_hint(str(key), valid)}")
    for key in required:
        if key not in data:
            raise StrategyFieldError(path + (key,), f"missing required key {key!r}")


__all__ = ["Path", "StrategyFieldError", "StrategyFieldTypeError", "check_keys", "field_context", "format_layer_list",
           "format_layers", "format_path", "format_ranks", "is_int", "parse_count_list", "parse_index_list",
           "parse_layer_list", "parse_layer_range", "positive_count"]
