"""The one error hierarchy of hspmd: every mistake a user can make raises an HSPMDError subclass."""

from __future__ import annotations

import difflib
from typing import Sequence


class HSPMDError(Exception):
    """Base of every error a user can cause; the message names what is wrong, where, and the fix."""


class AnnotationError(HSPMDError):
    """An annotation (device group, distributed states, union, hierarchy) is invalid."""


class ParseError(AnnotationError):
    """The annotation text does not follow the syntax; `position` points at the offending character."""

    def __init__(self, message: str, text: str, position: int):
        self.text, self.position = text, position
        super().__init__(f"{message}\n  {text}\n  {' ' * position}^ (at character {position})")


class ShapeError(HSPMDError):
    """A shape does not fit an annotation or an op (rank, symbol mismatch, unbound ratios)."""


class UnsupportedReshard(HSPMDError):
    """No correct communication exists between two annotations (e.g. Partial with no collective path)."""


class DeductionError(HSPMDError):
    """Annotation deduction failed for an op; the message names the op and says where to insert comm()."""


class StrategyError(HSPMDError):
    """A strategy file or description is invalid; the message names the key."""


class CommunicationError(HSPMDError):
    """A backend collective failed, timed out, or a peer rank crashed."""


class ReplicaMismatch(HSPMDError):
    """Devices that should hold equal copies of a piece disagree (unshard found a broken replica)."""


class ClusterError(HSPMDError):
    """A cluster or model description (ClusterSpec, ModelSpec, their files) is invalid; the message names the key."""


class WeightLost(HSPMDError):
    """Every copy of some piece of a tensor was on failed devices; `lost` maps each lost tensor
    (its index in a fused plan, or its name) to the boxes nobody alive holds."""

    def __init__(self, message: str, lost: dict | None = None):
        self.lost = dict(lost or {})
        super().__init__(message)


def closest_hint(word: str, options: Sequence[str]) -> str:
    """'did you mean X?' for a typo, else the list of valid words."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid: " + ", ".join(repr(o) for o in options)


class CheckpointError(HSPMDError):
    """A checkpoint is missing, corrupted, truncated, of another model or schema; names file and tensor."""
