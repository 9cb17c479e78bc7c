"""Command-line parsing shared by every `hspmd` subcommand: mistakes raise UsageError (which the
`hspmd` wrapper prints as one line, exit code 2) instead of argparse's usage text and sys.exit;
number arguments accept ASCII digits only (int() would take '٢' as 2)."""

from __future__ import annotations

import argparse
import math

from hspmd.errors import UsageError
from hspmd.limits import MAX_DIGITS, is_ascii_number


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, refusing an option of one value given as `--` (`-n--`, `--port=--`): argparse
        drops the `--` and sets the option to [] without calling its type."""
        parsed, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.option_strings and action.nargs is None and isinstance(value, list) and not value \
                    and value is not action.default:
                self.error(f"argument {'/'.join(action.option_strings)}: expected one value, got '--'")
        return parsed, rest


def _integer(text: str) -> int:
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    if not is_ascii_number(digits) or len(digits) > MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"expected an integer in ASCII digits (at most {MAX_DIGITS}), got {text!r}")
    return int(sign + digits)


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def rank_list(text: str) -> tuple[int, ...]:
    """Ranks as `0-7` or `0,3,8-11` (ranges inclusive), in the order given, each once."""
    ranks: dict[int, None] = {}
    for item in text.split(","):
        first, dash, last = item.partition("-")
        lo = non_negative_int(first)
        hi = non_negative_int(last) if dash else lo
        if hi < lo:
            raise argparse.ArgumentTypeError(f"rank range {item!r} runs backwards; write {hi}-{lo}")
        if hi - lo >= 1 << 20:
            raise argparse.ArgumentTypeError(f"rank range {item!r} is longer than {1 << 20} ranks")
        ranks.update(dict.fromkeys(range(lo, hi + 1)))
    return tuple(ranks)


def non_negative_float(text: str) -> float:
    try:
        value = float(text) if text.isascii() else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (seconds), got {text!r}")
    return value


__all__ = ["ArgumentParser", "non_negative_float", "non_negative_int", "positive_int", "rank_list"]
