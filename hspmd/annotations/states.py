"""The value types a union is made of: axes, device groups, distributed states, subgroups (the
union itself and hierarchies of unions are in union.py).

All are frozen dataclasses: immutable, hashable, compared by value, printed in the text syntax
of docs/design.md and annotations/syntax.py (`str(a)` parses back to `a`). Construction validates and
normalises only this: size-1 axes are dropped and an HSize-1 union is plain SPMD (HDim Duplicate,
no ratios), so those spellings compare equal. Other spellings of one placement stay different
values (D:2,D:2 and D:4; S0:2,S0:2 and S0:4, which differ where a dim does not divide; H0(2:2) and
H0(1:1); HD{@[0] | @[1]} and D:2@[0,1]): compare device_pieces to compare placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Hashable, Literal, Sequence, Union

from hspmd.errors import AnnotationError, AnnotationTypeError
from hspmd.limits import MAX_DEVICES, MAX_DIMS, brief, check_limit

class _Memo:
    """Values computed once per immutable object (its hash, device lists, derived layouts).

    Specialization asks the same questions of one annotation thousands of times (once per op of a
    model's repeated layers); answering each in O(1) after the first is what keeps a rank's time
    flat as unions grow to hundreds of subgroups. The memo lives in the object (no global state)
    and never enters a pickle: str hashes differ between processes."""

    def _memo(self, key, compute):
        try:
            return self.__dict__["_memo_cache"][key]  # (asked thousands of times a plan: the one lookup first)
        except KeyError:
            cache = self.__dict__.setdefault("_memo_cache", {})
            value = cache[key] = compute()
            return value

    def _cached_hash(self) -> int | None:
        cache = self.__dict__.get("_memo_cache")
        return None if cache is None else cache.get("hash")

    def _hashes_differ(self, other) -> bool:
        mine, theirs = self._cached_hash(), other._cached_hash()
        return mine is not None and theirs is not None and mine != theirs

    def __getstate__(self):
        state = dict(self.__dict__)  # a copy first: another thread may add the memo meanwhile
        state.pop("_memo_cache", None)
        return state


HDup = Literal["D"]
HPartial = Literal["P"]
HDim = Union[int, HDup, HPartial]


def _positive_int(value: object, what: str, limit: int | None = MAX_DEVICES) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AnnotationTypeError(f"{what} must be an integer, got {brief(value)}")
    if value < 1:
        raise AnnotationError(f"{what} must be positive, got {brief(value)}; use 1 or drop the axis")
    return value if limit is None else check_limit(value, limit, what)


@dataclass(frozen=True)
class Split:
    """Split tensor dim `dim` into `n` pieces (uneven allowed, see geometry.split_bounds)."""

    dim: int
    n: int

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise AnnotationTypeError(f"Split dim must be a non-negative integer, got {brief(self.dim)}")
        if self.dim < 0:
            raise AnnotationError(f"Split dim must be a non-negative integer, got {brief(self.dim)}")
        check_limit(self.dim, MAX_DIMS - 1, "Split dim", "tensors have at most MAX_DIMS dims")
        _positive_int(self.n, f"Split(dim={self.dim}) count")

    def __str__(self) -> str:
        return f"S{self.dim}:{self.n}"


@dataclass(frozen=True)
class Duplicate:
    """`n` full replicas of the piece."""

    n: int

    def __post_init__(self):
        _positive_int(self.n, "Duplicate count")

    def __str__(self) -> str:
        return f"D:{self.n}"


REDUCTIONS = ("sum", "max", "min", "avg", "prod")
"""How a Partial axis's members combine into the piece (torch.distributed's reduce ops; avg is
the mean over the members)."""

IDEMPOTENT = frozenset({"max", "min", "avg"})
"""Reductions under which members that all hold the value combine to the value (a Partial
destination of these is reached by keeping the value on every member)."""


@dataclass(frozen=True)
class Partial:
    """`n` partial values whose reduction `reduce` (one of REDUCTIONS; "sum" by default: summands)
    is the piece."""

    n: int
    reduce: str = "sum"

    def __post_init__(self):
        _positive_int(self.n, "Partial count")
        if self.reduce not in REDUCTIONS:
            raise AnnotationError(f"Partial reduction must be one of {', '.join(REDUCTIONS)}, got {brief(self.reduce)}")

    def __str__(self) -> str:
        return f"P:{self.n}" if self.reduce == "sum" else f"P({self.reduce}):{self.n}"


Axis = Union[Split, Duplicate, Partial]


def _members(values, what: str, empty: str, member: type | None = None, member_what: str = "") -> tuple:
    """`values` as a tuple: raise naming `what` where it is no sequence (a string is none), `empty`
    where it has no member, and `member_what` where a member is not a `member`."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise AnnotationTypeError(f"{what}, got {brief(values)}")
    members = tuple(values)
    if not members:
        raise AnnotationError(empty)
    if member is not None:
        for m in members:
            if not isinstance(m, member):
                raise AnnotationTypeError(f"{member_what}, got {brief(m)}")
    return members


def _format_devices(devices: tuple[int, ...]) -> str:
    """Runs of three or more consecutive ids print as a-b: [0-3,5,6]."""
    parts, i = [], 0
    while i < len(devices):
        j = i
        while j + 1 < len(devices) and devices[j + 1] == devices[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{devices[i]}-{devices[j]}")
        else:
            parts.extend(str(d) for d in devices[i : j + 1])
        i = j + 1
    return "[" + ",".join(parts) + "]"


@dataclass(frozen=True)
class DeviceGroup(_Memo):
    """An ordered list of distinct device ids (the order matters: it maps devices to pieces)."""

    devices: tuple[int, ...]

    def __post_init__(self):
        devices = _members(self.devices, "a device group is a sequence of device ids",
                           "a device group needs at least one device, got []")
        check_limit(len(devices), MAX_DEVICES, "the number of devices in a group")
        for d in devices:
            if isinstance(d, bool) or not isinstance(d, int):
                raise AnnotationTypeError(f"device ids must be non-negative integers, got {brief(d)}")
            if d < 0:
                raise AnnotationError(f"device ids must be non-negative integers, got {brief(d)}")
            check_limit(d, MAX_DEVICES - 1, "a device id")
        if len(set(devices)) != len(devices):
            seen: set[int] = set()
            repeated = sorted({d for d in devices if d in seen or seen.add(d)})
            raise AnnotationError(f"device group {_format_devices(devices)} lists device(s) {repeated} more than once")
        object.__setattr__(self, "devices", devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self):
        return iter(self.devices)

    @property
    def order(self) -> tuple[int, ...]:
        """Each device's rank among the group's devices (0 for the smallest): groups of equal
        order are one group under an order-preserving renaming (what relabelling planners check)."""
        return self._memo("order", lambda: order_pattern(self.devices))

    @classmethod
    def known(cls, devices: tuple[int, ...]) -> "DeviceGroup":
        """DeviceGroup(devices) for distinct device ids the caller took from a valid group, without
        checking them again (planners pick a few devices of every subgroup of a union)."""
        made = object.__new__(cls)
        made.__dict__["devices"] = devices
        return made

    def __hash__(self) -> int:
        return self._memo("hash", lambda: hash(self.devices))

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.devices == other.devices

    def __str__(self) -> str:
        return _format_devices(self.devices)


@dataclass(frozen=True)
class DistributedStates(_Memo):
    """Ordered axes, outermost first; device index i is read in the mixed radix of the axis sizes.
    A union's hundreds of subgroups mostly share one states object: what planners ask of it per
    subgroup (size, partial count, split dims) is worked out once."""

    axes: tuple[Axis, ...] = ()

    def __post_init__(self):
        if isinstance(self.axes, (str, bytes)) or not hasattr(self.axes, "__iter__"):
            raise AnnotationTypeError(f"distributed states are a sequence of axes, got {brief(self.axes)}")
        axes = tuple(self.axes)
        for a in axes:
            if not isinstance(a, (Split, Duplicate, Partial)):
                raise AnnotationTypeError(f"a distributed-states axis must be Split, Duplicate or Partial, got {brief(a)}")
        object.__setattr__(self, "axes", tuple(a for a in axes if a.n > 1))
        reductions = {a.reduce for a in self.axes if isinstance(a, Partial)}
        if len(reductions) > 1:
            raise AnnotationError(
                f"distributed states {self} combine partial values by {' and '.join(sorted(reductions))}: the "
                f"Partial axes of one layout share one reduction (reduce one first, with comm())"
            )

    @property
    def reduction(self) -> str:
        """The reduction combining this layout's partial values ("sum" where there are none)."""
        return self._memo("reduction", lambda: next((a.reduce for a in self.axes if isinstance(a, Partial)), "sum"))

    @property
    def size(self) -> int:
        return self._memo("size", lambda: prod(a.n for a in self.axes))

    def split_count(self, dim: int) -> int:
        return prod(a.n for a in self.axes if isinstance(a, Split) and a.dim == dim)

    @property
    def partial_count(self) -> int:
        return self._memo("partial", lambda: prod(a.n for a in self.axes if isinstance(a, Partial)))

    @property
    def duplicate_count(self) -> int:
        return prod(a.n for a in self.axes if isinstance(a, Duplicate))

    @property
    def split_dims(self) -> tuple[int, ...]:
        return self._memo("split_dims", lambda: tuple(sorted({a.dim for a in self.axes if isinstance(a, Split)})))

    def __hash__(self) -> int:
        return self._memo("hash", lambda: hash(self.axes))

    def __str__(self) -> str:
        return ",".join(str(a) for a in self.axes)


@dataclass(frozen=True)
class Subgroup(_Memo):
    """One sharding subgroup: a device group and how the subgroup's piece is laid out on it."""

    dg: DeviceGroup
    ds: DistributedStates = field(default_factory=DistributedStates)

    def __post_init__(self):
        if not isinstance(self.dg, DeviceGroup):
            object.__setattr__(self, "dg", DeviceGroup(self.dg))
        if not isinstance(self.ds, DistributedStates):
            object.__setattr__(self, "ds", DistributedStates(self.ds))
        if self.ds.size != len(self.dg):
            raise AnnotationError(
                f"distributed states {str(self.ds) or '(none)'} describe {self.ds.size} device(s) but device group "
                f"{self.dg} has {len(self.dg)}: the product of the axis counts must equal the group size"
            )

    @classmethod
    def known(cls, dg: DeviceGroup, ds: DistributedStates) -> "Subgroup":
        """Subgroup(dg, ds) for values the caller made valid (states of the group's size, derived
        from valid ones), without checking them again."""
        made = object.__new__(cls)
        fields = made.__dict__  # (written directly: unions of thousands make one per subgroup)
        fields["dg"] = dg
        fields["ds"] = ds
        return made

    def __hash__(self) -> int:
        return self._memo("hash", lambda: hash((self.dg, self.ds)))

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.ds == other.ds and self.dg == other.dg

    def __str__(self) -> str:
        return f"{self.ds}@{self.dg}"


def order_pattern(devices: Sequence[int]) -> tuple[int, ...]:
    """Each device's rank among the distinct devices listed: two lists have equal patterns exactly
    when renaming one onto the other position by position is a function that keeps the order."""
    ordered = sorted(devices)
    if ordered == list(devices) and len(set(ordered)) == len(ordered):  # (the usual lists: ascending, in C)
        return _ascending(len(ordered))
    rank = {d: i for i, d in enumerate(sorted(set(devices)))}
    return tuple(rank[d] for d in devices)


@lru_cache(maxsize=64)
def _ascending(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def numbered(keys: Sequence[Hashable]) -> tuple[int, ...]:
    """A small int per key, equal exactly where the keys are, in order of first appearance
    (worked out in C: a union of hundreds of subgroups mostly repeats a few keys, often one,
    which comparing costs less than hashing)."""
    if keys.count(keys[0] if keys else None) == len(keys):
        return (0,) * len(keys)
    distinct = dict.fromkeys(keys)
    return tuple(map(dict(zip(distinct, range(len(distinct)))).__getitem__, keys))
