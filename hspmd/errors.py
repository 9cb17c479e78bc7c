"""The one error hierarchy of hspmd: every mistake a user can make raises an HSPMDError subclass."""

from __future__ import annotations

import difflib
from typing import Sequence


class HSPMDError(Exception):
    """Base of every error a user can cause; the message names what is wrong, where, and the fix."""


class HSPMDTypeError(HSPMDError, TypeError):
    """An argument has the wrong type; also a TypeError, so conventional handlers catch it."""


class HSPMDValueError(HSPMDError, ValueError):
    """An argument has the right type but an invalid value; also a ValueError."""


class LimitError(HSPMDValueError):
    """A size is beyond an explicit limit of hspmd.limits (devices, ranks, dims, layers...);
    the message states the limit. Limits keep every entry point bounded in time and memory."""


class AnnotationError(HSPMDError):
    """An annotation (device group, distributed states, union, hierarchy) is invalid."""


class AnnotationTypeError(AnnotationError, HSPMDTypeError):
    """An annotation value was built from an argument of the wrong type."""


class ParseError(AnnotationError):
    """The annotation text does not follow the syntax; `position` points at the offending character."""

    def __init__(self, message: str, text: str, position: int):
        self.text, self.position = text, position
        super().__init__(f"{message}\n  {text}\n  {' ' * position}^ (at character {position})")


class ShapeError(HSPMDError):
    """A shape does not fit an annotation or an op (rank, symbol mismatch, unbound ratios)."""


class ShapeTypeError(ShapeError, HSPMDTypeError):
    """A shape, ratio or tensor argument has the wrong type."""


class UnsupportedReshard(HSPMDError):
    """No correct communication exists between two annotations (e.g. Partial with no collective path)."""


class PlanError(HSPMDValueError):
    """A plan read back from JSON or a dict (Plan / FusedPlan.from_dict) is invalid; the message names the
    field. Also a ValueError, as PlanPart.from_dict, which reads collectives and messages alike, documents."""


class DeductionError(HSPMDError):
    """Annotation deduction failed for an op; the message names the op and says where to insert comm()."""


class StrategyError(HSPMDError):
    """A strategy file or description is invalid; the message names the key."""


class StrategyTypeError(StrategyError, HSPMDTypeError):
    """A strategy argument has the wrong type."""


class CommunicationError(HSPMDError):
    """A backend collective failed, timed out, or a peer rank crashed."""


class ReplicaMismatch(HSPMDError):
    """Devices that should hold equal copies of a piece disagree (unshard found a broken replica)."""


class ClusterError(HSPMDError):
    """A cluster or model description (ClusterSpec, ModelSpec, their files) is invalid; the message names the key."""


class DeviceOutOfMemory(HSPMDError):
    """A rank's live tensors would exceed its device's memory: what a GPU's out-of-memory is, raised by an
    emulated device type (hspmd.runtime.execution.emulation) before the value is stored. Carries the rank,
    the device type, the bytes it would hold and its capacity."""

    def __init__(self, rank: int, device_type: str, needed: int, capacity: float, where: str = ""):
        self.rank, self.device_type, self.needed, self.capacity = rank, device_type, needed, capacity
        at = f" at {where}" if where else ""
        super().__init__(f"rank {rank} ({device_type}): out of device memory{at}: {needed:,} bytes live, "
                         f"capacity {int(capacity):,} bytes (emulated {device_type} memory)")


class ClusterTypeError(ClusterError, HSPMDTypeError):
    """A cluster was given as something other than a ClusterSpec, preset name, size text or file."""


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


class InteropError(HSPMDError):
    """A layout has no equivalent on the other side of a bridge (hspmd annotation <-> DTensor placements):
    the message names the layout and what the other side cannot state."""


class LaunchError(HSPMDError):
    """The launcher's arguments are invalid, or a rank stopped (the message names the rank)."""


class UsageError(HSPMDValueError):
    """A command line is invalid (unknown option, missing or malformed argument)."""


def error_line(exc: BaseException) -> str:
    """The error as one line: a parse error's marked text becomes '(at character N of TEXT)'."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    text, position = getattr(exc, "text", None), getattr(exc, "position", None)
    if isinstance(text, str) and isinstance(position, int):
        shown = text if len(text) <= 80 else text[:77] + "..."
        return f"{lines[0]} (at character {position} of {shown!r})"
    return " ".join(line.strip() for line in lines if line.strip())
