"""Reading plain data (JSON) with the field's path named in every error.

Device programs (hspmd.specialize.program) and plans (hspmd.comm_resolve.plan) are written as JSON
and read back in other processes; a reader subclasses JsonField to name its error type and what
the data is (`rank3.json: program field forward[3].inputs[1]: expected an integer >= 0, got -1`).
"""

from __future__ import annotations

import builtins

import json
from typing import Sequence

from hspmd.errors import HSPMDError

Box = tuple[tuple[int, int], ...]


def _jsonable(value: object) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


class JsonField:
    """A value read from JSON and its path in the document. Subclasses set `error_type` (an
    HSPMDError subclass) and `noun` (what the document is, for messages)."""

    error_type: type[HSPMDError] = HSPMDError
    noun = "data"

    def __init__(self, value: object, path: str, source: str):
        self.value, self.path, self.source = value, path, source

    def error(self, what: str) -> HSPMDError:
        return self.error_type(f"{self.source}: {self.noun} field {self.path or '(top)'}: {what}")

    def fail(self, what: str) -> HSPMDError:
        shown = json.dumps(self.value)[:80] if _jsonable(self.value) else repr(self.value)[:80]
        return self.error(f"{what}, got {shown}")

    def _child(self, value: object, key: str) -> "JsonField":
        return type(self)(value, f"{self.path}.{key}" if self.path else key, self.source)

    def __getitem__(self, key: str) -> "JsonField":
        if not isinstance(self.value, dict):
            raise self.fail("expected an object")
        if key not in self.value:
            raise self._child(None, key).error("missing")
        return self._child(self.value[key], key)

    def get(self, key: str) -> "JsonField":
        """The field `key`, its value None when it is missing."""
        if not isinstance(self.value, dict):
            raise self.fail("expected an object")
        return self._child(self.value.get(key), key)

    def items(self) -> list["JsonField"]:
        if not isinstance(self.value, list):
            raise self.fail("expected a list")
        return [type(self)(v, f"{self.path}[{i}]", self.source) for i, v in enumerate(self.value)]

    def int(self, minimum: int = 0) -> int:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.fail(f"expected an integer >= {minimum}")
        return v

    def str(self, choices: Sequence[str] | None = None) -> str:
        if not isinstance(self.value, str) or (choices is not None and self.value not in choices):
            raise self.fail("expected a string" + (f" among {', '.join(choices)}" if choices else ""))
        return self.value

    def bool(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail("expected true or false")
        return self.value

    def ints(self, minimum: builtins.int = 0) -> tuple[builtins.int, ...]:
        return tuple(f.int(minimum) for f in self.items())

    def box(self, optional: builtins.bool = False) -> Box | None:
        if optional and self.value is None:
            return None
        out: list[tuple[builtins.int, builtins.int]] = []
        for r in self.items():
            bounds = r.ints() if isinstance(r.value, list) and len(r.value) == 2 else ()
            if len(bounds) != 2 or bounds[1] < bounds[0]:
                raise r.fail("expected a range [start, stop] with start <= stop")
            out.append((bounds[0], bounds[1]))
        return tuple(out)


__all__ = ["JsonField"]
