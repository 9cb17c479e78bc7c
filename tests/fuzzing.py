"""Helpers of the fuzz tests: mutations of valid inputs, and the one rule every entry point obeys.

A fuzzed call either returns (and the test then checks the result against the reference) or
raises an HSPMDError; any other exception fails the test. Each outcome is recorded with
hypothesis.event, so `pytest --hypothesis-show-statistics tests/test_fuzz_*.py` prints, per entry
point, how many inputs were accepted and how many raised an HSPMDError.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Sequence, TypeVar

from hypothesis import event, settings
from hypothesis import strategies as st

from hspmd.errors import HSPMDError

T = TypeVar("T")

# A generous bound: every entry point answers in milliseconds; an unbounded expansion (the
# 15-second parse of @[0-99999] this suite was written against) trips it. Not a speed test.
DEADLINE = timedelta(seconds=10)

# Characters that matter to hspmd's parsers, plus unicode digits and other traps.
TRAPS = list("0123456789-,:;@[](){}|SDPHRLxtp?= \n\t") + ["²", "٢", "𝟡", "\u200b", "é", "\x00", "9" * 25, "-1"]


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=DEADLINE)


@st.composite
def mutated_text(draw, valid: Sequence[str], max_edits: int = 3) -> str:
    """A valid text with 1..max_edits random insertions, deletions or replacements."""
    text = draw(st.sampled_from(list(valid)))
    for _ in range(draw(st.integers(1, max_edits))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(("insert", "delete", "replace", "duplicate")))
        piece = draw(st.sampled_from(TRAPS) | st.text(max_size=2))
        if kind == "insert":
            text = text[:at] + piece + text[at:]
        elif kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 3)):]
        elif kind == "replace":
            text = text[:at] + piece + text[at + 1:]
        else:
            text = text[:at] + text[at:at + 4] * draw(st.integers(2, 4)) + text[at:]
    return text


def fuzzed_text(valid: Sequence[str]):
    """Mostly mutations of valid texts, some fully random text."""
    return mutated_text(valid) | st.text(max_size=40)


@st.composite
def mutated_bytes(draw, valid: bytes) -> bytes:
    """Byte flips, truncation, insertion of invalid UTF-8, deep nesting or huge numbers."""
    data = bytearray(valid)
    kind = draw(st.sampled_from(("flip", "truncate", "insert", "nest", "number", "random")))
    if kind == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data))):]
    elif kind == "insert":
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"[" * 100000, b"{", b"'", b"!!python/object:os.system"]))
    elif kind == "nest":
        depth = draw(st.integers(50, 20000))
        data = bytearray(b"[" * depth + b"]" * depth)
    elif kind == "number":
        at = draw(st.integers(0, len(data)))
        data[at:at] = b"9" * draw(st.sampled_from([20, 5000]))
    else:
        data = bytearray(draw(st.binary(max_size=200)))
    return bytes(data)


def outcome(label: str, call: Callable[[], T]) -> tuple[bool, T | HSPMDError]:
    """(True, result) or (False, the HSPMDError); anything else propagates and fails the test."""
    try:
        result = call()
    except HSPMDError as exc:
        event(f"{label}: HSPMDError")
        return False, exc
    event(f"{label}: accepted")
    return True, result
