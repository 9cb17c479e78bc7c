"""Symbolic shapes: dims are ints or sympy expressions in run-time symbols (batch, sequence, ...).

Shapes are checked when the graph is built, so a mismatch that would only surface inside a
communication at run time (two tensors whose batch dims are different symbols) is an error at
build time. A `Binding` gives the symbols (and run-time top-tier ratios) their values for one
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Mapping, Sequence, Union

import sympy

from hspmd.errors import ShapeError

Dim = Union[int, sympy.Expr]
Shape = tuple[Dim, ...]


def symbols(names: str) -> tuple[sympy.Symbol, ...]:
    """Positive integer symbols for run-time dims: `B, S = symbols("B S")`."""
    out = sympy.symbols(names, integer=True, positive=True)
    return out if isinstance(out, tuple) else (out,)


def as_dim(value: object, where: str) -> Dim:
    if isinstance(value, bool):
        raise ShapeError(f"{where}: a dim must be an int or a sympy expression, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ShapeError(f"{where}: dim {value} is negative")
        return value
    if isinstance(value, sympy.Basic):
        expr = sympy.sympify(value)
        return int(expr) if expr.is_Integer else expr
    raise ShapeError(f"{where}: a dim must be an int or a sympy expression, got {value!r}")


def as_shape(values: Sequence[object], where: str) -> Shape:
    return tuple(as_dim(v, where) for v in values)


def same_dim(a: Dim, b: Dim) -> bool:
    """Equal for every binding of the symbols (dims are polynomials in the symbols, so expanding
    the difference decides it exactly)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return a == b or _expanded_difference_is_zero(sympy.sympify(a), sympy.sympify(b))


@lru_cache(maxsize=4096)
def _expanded_difference_is_zero(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.expand(a - b) == 0


def numel(shape: Shape) -> Dim:
    return sympy.sympify(prod(shape)) if any(not isinstance(d, int) for d in shape) else prod(shape)


def format_shape(shape: Shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


@lru_cache(maxsize=65536)
def _substituted(expr: sympy.Expr, values: tuple[tuple[str, int], ...]) -> sympy.Expr:
    """`expr` with the bound symbols replaced (cached: a trainer evaluates the same few dims and
    scalars under the same binding every step, and sympy's subs is slow)."""
    mapping = dict(values)
    return sympy.sympify(expr).subs({s: mapping[s.name] for s in expr.free_symbols if s.name in mapping})


@dataclass(frozen=True)
class Binding:
    """Values of the run-time symbols for one micro-batch, and ratios for run-time top-tier splits
    (`H0{...}` annotations): one weight per subgroup, e.g. the per-pipeline micro-batch sizes."""

    values: tuple[tuple[str, int], ...] = ()
    ratios: tuple[int, ...] | None = None

    @staticmethod
    def of(values: Mapping[object, int] | None = None, ratios: Sequence[int] | None = None) -> "Binding":
        items = tuple(sorted((str(k), int(v)) for k, v in (values or {}).items()))
        return Binding(items, None if ratios is None else tuple(ratios))

    @property
    def mapping(self) -> dict[str, int]:
        return dict(self.values)

    def dim(self, d: Dim, where: str = "") -> int:
        if isinstance(d, int):
            return d
        value = _substituted(d, self.values)
        if not value.is_Integer:
            missing = sorted(s.name for s in value.free_symbols)
            raise ShapeError(
                f"{where or 'shape'}: dim {d} needs a value for symbol(s) {missing}; "
                f"bind them, e.g. Binding.of({{{', '.join(repr(m) + ': ...' for m in missing)}}})"
            )
        value = int(value)  # compared as an int: sympy's comparison is slow, and this runs per tensor per rank
        if value < 0:
            raise ShapeError(f"{where or 'shape'}: dim {d} is {value} < 0 under binding {self.mapping}")
        return value

    def shape(self, shape: Shape, where: str = "") -> tuple[int, ...]:
        return tuple(self.dim(d, where) for d in shape)

    def scalar(self, value: float | sympy.Expr, where: str = "") -> float:
        if isinstance(value, (int, float)):
            return float(value)
        out = _substituted(value, self.values)
        if out.free_symbols:
            raise ShapeError(f"{where or 'scalar'}: {value} needs symbol(s) {sorted(map(str, out.free_symbols))} bound")
        return float(out)


__all__ = ["Binding", "Dim", "Shape", "as_dim", "as_shape", "format_shape", "numel", "same_dim", "symbols"]
