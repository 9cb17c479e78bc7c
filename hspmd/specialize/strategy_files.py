"""Strategy files: JSON or YAML holding Strategy.to_dict() data (one strategy, or a list of them for
multi-strategy training). Example (YAML):

    name: c3
    num_layers: 60
    zero: false
    pipelines:
      - micro_batches: 32
        micro_batch_size: 1
        stages:
          - {ranks: 0-3, layers: 0-19}
          - {ranks: 4-7, layers: 20-39, tp: 4}
          - {ranks: "8,9,10,11", layers: [40, 59]}

Every error is a StrategyError naming the file and the key path (e.g. pipelines[0].stages[2].tp).
"""

from __future__ import annotations

import json
from pathlib import Path as FilePath

import yaml

from hspmd.errors import StrategyError
from hspmd.limits import MAX_NESTING
from hspmd.specialize.paper_strategies import PAPER_STRATEGIES, paper_strategy
from hspmd.specialize.strategy import Strategy
from hspmd.specialize.strategy_fields import StrategyFieldError, field_context
from hspmd.specialize.strategy_text import parse_strategy

SUFFIXES = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
MAX_FILE_BYTES = 16 * 2**20  # a strategy of 65,536 ranks in one-rank stages is about 4 MiB of JSON


def _format_of(path: FilePath) -> str:
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise StrategyError(f"strategy file {path} has suffix {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    return fmt


def _read(path: str | FilePath) -> tuple[FilePath, object]:
    path = FilePath(path)
    fmt = _format_of(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise StrategyError(f"cannot read strategy file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise StrategyError(f"strategy file {path} is over {MAX_FILE_BYTES} bytes, the limit for a strategy file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StrategyError(f"{path} is not UTF-8 text: byte {raw[exc.start]:#04x} at offset {exc.start}") from None
    depth = _bracket_depth(text) if text.count("[") + text.count("{") > MAX_NESTING else 0
    if depth > MAX_NESTING:
        raise StrategyError(f"{path} nests {depth} levels deep, over the limit of {MAX_NESTING}; a strategy needs 5")
    try:
        data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise StrategyError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except yaml.YAMLError as exc:
        raise StrategyError(f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise StrategyError(f"{path} nests too deeply (limit {MAX_NESTING} levels); a strategy needs 5") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise StrategyError(f"{path} holds a value that cannot be read: {exc}") from None
    return path, data


def _bracket_depth(text: str) -> int:
    """The deepest nesting of [ and { (strings included: an over-estimate is safe); block-style YAML
    nests by indentation and is bounded by the parser's own recursion, caught above."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    return deepest


def _from_data(data: object, path: FilePath, index: int | None = None) -> Strategy:
    try:
        if index is None:
            return Strategy.from_dict(data)
        with field_context(index):
            return Strategy.from_dict(data)
    except StrategyFieldError as exc:
        raise StrategyError(f"in strategy file {path}: {exc}") from None


def load_strategy(path: str | FilePath) -> Strategy:
    """One strategy from a .json/.yaml/.yml file."""
    path, data = _read(path)
    if isinstance(data, list):
        raise StrategyError(f"{path} holds a list of {len(data)} strategies; load it with load_strategies()")
    return _from_data(data, path)


def load_strategies(path: str | FilePath) -> tuple[Strategy, ...]:
    """All strategies of a file holding a list of them (a single strategy gives a 1-tuple)."""
    path, data = _read(path)
    if not isinstance(data, list):
        return (_from_data(data, path),)
    if not data:
        raise StrategyError(f"{path} holds an empty list; give at least one strategy")
    return tuple(_from_data(item, path, i) for i, item in enumerate(data))


def strategy_from(text: str) -> Strategy:
    """A paper strategy name, a strategy file (.json/.yaml/.txt), or strategy text."""
    if text in PAPER_STRATEGIES:
        return paper_strategy(text)
    path = FilePath(text)
    if path.suffix in (".json", ".yaml", ".yml", ".txt", ".strategy") and path.is_file():
        return load_strategy(path)
    return parse_strategy(text)


def save_strategy(strategy: Strategy | tuple[Strategy, ...] | list[Strategy], path: str | FilePath) -> None:
    """Write one strategy (or a list) in the format given by the suffix."""
    path = FilePath(path)
    fmt = _format_of(path)
    data = strategy.to_dict() if isinstance(strategy, Strategy) else [s.to_dict() for s in strategy]
    if fmt == "json":
        path.write_text(json.dumps(data, indent=2) + "\n")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False))
