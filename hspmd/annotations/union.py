"""The union of sharding subgroups (an HSPMD annotation: HDim, HSize, ratios) and hierarchies of
unions, one per strategy. Frozen dataclasses like the parts in states.py: immutable, hashable,
compared by value (after the few normalisations states.py lists), printed in the text syntax
(`str(a)` parses back to `a`)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter
from typing import Callable, Mapping, Sequence

from hspmd.annotations.states import (DeviceGroup, DistributedStates, HDim, Subgroup, _Memo, _members, _positive_int,
                                      numbered)
from hspmd.errors import AnnotationError, AnnotationTypeError
from hspmd.limits import MAX_DIMS, MAX_RATIO, brief, check_limit


_SHARED_SUBGROUPS: dict[tuple, tuple[Subgroup, ...]] = {}  # (device groups, states) -> subgroups


def _subgroups_on(union: "Annotation", ds: DistributedStates) -> tuple[Subgroup, ...]:
    """Subgroups on `union`'s device groups, each with states `ds`: one tuple shared by every
    union restated onto the same groups and states (deducing a large job restates a few stages'
    unions of hundreds of groups dozens of times, about half of them onto a layout made before)."""
    key = (union.dg_key, ds)
    subs = _SHARED_SUBGROUPS.get(key)
    if subs is None:
        if len(_SHARED_SUBGROUPS) >= 256:
            _SHARED_SUBGROUPS.clear()
        subs = _SHARED_SUBGROUPS[key] = tuple(Subgroup.known(dg, ds) for dg in union.dg_union)
    return subs


def _top_tier(hdim, ratios, hsize: int) -> tuple[HDim, tuple[int, ...] | None]:
    """(HDim, ratios) of a union of `hsize` subgroups, checked and normalised (HSize 1 is plain
    SPMD: HDim Duplicate, no ratios)."""
    if not (isinstance(hdim, str) and hdim in ("D", "P")) and (isinstance(hdim, bool) or not isinstance(hdim, int)):
        raise AnnotationTypeError(f"HDim must be a tensor dim (integer >= 0), 'D' or 'P', got {brief(hdim)}")
    if isinstance(hdim, int):
        if hdim < 0:
            raise AnnotationError(f"HDim must be a tensor dim (integer >= 0), 'D' or 'P', got {brief(hdim)}")
        check_limit(hdim, MAX_DIMS - 1, "HDim", "tensors have at most MAX_DIMS dims")
    if ratios is not None:
        if isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__iter__"):
            raise AnnotationTypeError(f"split ratios must be a sequence of positive integers, got {brief(ratios)}")
        ratios = tuple(ratios)
        if not (set(map(type, ratios)) <= {int} and 1 <= min(ratios, default=1) and max(ratios, default=1) <= MAX_RATIO):
            for r in ratios:  # (checked in C above where all are fine: a union has hundreds)
                _positive_int(r, "a top-tier split ratio", MAX_RATIO)
        if not isinstance(hdim, int):
            raise AnnotationError(f"split ratios {brief(ratios)} need a tensor-dim HDim, but HDim is {hdim!r}")
        if len(ratios) != hsize:
            raise AnnotationError(
                f"ratios {':'.join(map(str, ratios))} have {len(ratios)} entries but the union has HSize "
                f"{hsize}: give one ratio per subgroup"
            )
    if hsize == 1:
        hdim, ratios = "D", None
    return hdim, ratios


@dataclass(frozen=True)
class Annotation(_Memo):
    """A union of HSize sharding subgroups related by HDim (the top tier).

    hdim: a tensor dim (split across subgroups, in `ratios` or, if None, ratios bound at run time),
    "D" (each subgroup holds the whole tensor) or "P" (each subgroup holds a summand).
    HSize 1 is plain SPMD.
    """

    subgroups: tuple[Subgroup, ...]
    hdim: HDim = "D"
    ratios: tuple[int, ...] | None = None

    def __post_init__(self):
        subgroups = _members(self.subgroups, "a union is a sequence of subgroups",
                             "a union needs at least one subgroup (HSize >= 1)", Subgroup,
                             "union members must be Subgroup values")
        count = sum(len(s.dg.devices) for s in subgroups)
        if len(frozenset().union(*(s.dg.devices for s in subgroups))) != count:  # set work in C, then the details
            seen: dict[int, int] = {}
            for k, s in enumerate(subgroups):
                for d in s.dg:
                    if d in seen:
                        raise AnnotationError(
                            f"device {d} is in subgroup {seen[d]} and subgroup {k}: sharding subgroups must be disjoint"
                        )
                    seen[d] = k
        hdim, ratios = _top_tier(self.hdim, self.ratios, len(subgroups))
        object.__setattr__(self, "subgroups", subgroups)
        object.__setattr__(self, "hdim", hdim)
        object.__setattr__(self, "ratios", ratios)
        reductions = {ds.reduction for ds in self.distinct_states if ds.partial_count > 1}
        if len(reductions) > 1 or hdim == "P" and reductions - {"sum"}:
            found = " and ".join(sorted(reductions | ({"sum"} if hdim == "P" else set())))
            raise AnnotationError(
                f"union {self} combines partial values by {found}: one layout's partial values share one reduction, "
                f"and a top-tier P (HP) sums its subgroups"
            )

    @property
    def hsize(self) -> int:
        return len(self.subgroups)

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device of the union, subgroup by subgroup."""
        return self._memo("devices", lambda: tuple(chain.from_iterable(self.dg_key)))

    @property
    def device_set(self) -> frozenset[int]:
        """The union's devices as a set (membership in O(1))."""
        return self._memo("device_set", lambda: frozenset(self.devices))

    @property
    def dg_union(self) -> tuple[DeviceGroup, ...]:
        return self._memo("dg_union", lambda: tuple(map(attrgetter("dg"), self.subgroups)))

    @property
    def ds_union(self) -> tuple[DistributedStates, ...]:
        return self._memo("ds_union", lambda: tuple(map(attrgetter("ds"), self.subgroups)))

    @property
    def distinct_states(self) -> tuple[DistributedStates, ...]:
        """The subgroups' states objects, each once (by identity, in C: a union of hundreds mostly
        shares one), for questions asked of every subgroup's states."""
        return self._memo("distinct_states", lambda: tuple(dict(zip(map(id, self.ds_union), self.ds_union)).values()))

    @property
    def states_codes(self) -> tuple[int, ...]:
        """A small int per subgroup, equal exactly where the subgroups' states are (numbered;
        each distinct states object hashed once), for keys compared and hashed in C."""
        def compute():
            code = dict(zip(map(id, self.distinct_states), numbered(self.distinct_states)))
            return tuple(map(code.__getitem__, map(id, self.ds_union)))
        return self._memo("states_codes", compute)

    @property
    def order_codes(self) -> tuple[int, ...]:
        """A small int per subgroup, equal exactly where the device groups' orders
        (DeviceGroup.order) are."""
        def compute():
            devices = self.devices
            if sorted(devices) == list(devices):  # (in C) every group ascending: the sizes tell orders apart
                return numbered(list(map(len, self.dg_key)))
            return numbered([dg.order for dg in self.dg_union])
        return self._memo("order_codes", compute)

    def same_dg_union(self, other: "Annotation") -> bool:
        """Whether both unions have the same device groups in the same order (compared as plain
        int tuples, without a Python call per subgroup)."""
        if self.dg_union is other.dg_union:
            return True
        return self.dg_key == other.dg_key

    def same_ds_union(self, other: "Annotation") -> bool:
        """Whether both unions have equal states subgroup by subgroup (one comparison where each
        has one layout; otherwise in C, where equal states are mostly one object)."""
        mine, theirs = self.uniform_states, other.uniform_states
        if mine is not None and theirs is not None and self.hsize == other.hsize:
            return mine[0] == theirs[0]
        return self.ds_union == other.ds_union

    @property
    def dg_key(self) -> tuple[tuple[int, ...], ...]:
        """The device groups as plain int tuples (compared and hashed in C)."""
        return self._memo("dg_key", lambda: tuple(map(attrgetter("devices"), self.dg_union)))

    @property
    def uniform_states(self) -> tuple[DistributedStates, int] | None:
        """(states, group size) when every subgroup has the same states and size, else None: the
        common case of a homogeneous stage, which deduction handles as one subgroup."""
        def compute():
            first, states = self.subgroups[0], self.ds_union
            size = len(first.dg)
            if states.count(first.ds) == len(states) and set(map(len, self.dg_key)) == {size}:  # (in C)
                return first.ds, size
            return None
        return self._memo("uniform", compute)

    @property
    def has_partial(self) -> bool:
        return self._memo("partial", lambda: self.hdim == "P" or any(ds.partial_count > 1 for ds in self.distinct_states))

    @property
    def reduction(self) -> str:
        """The reduction combining this layout's partial values ("sum" where there are none, and
        for a top-tier P, which sums its subgroups)."""
        return self._memo("reduction", lambda: next(
            (ds.reduction for ds in self.distinct_states if ds.partial_count > 1), "sum"))

    def _subgroup_index(self) -> dict[int, int]:
        return self._memo("subgroup_of", lambda: dict(zip(self.devices, chain.from_iterable(
            map(repeat, range(self.hsize), map(len, self.dg_key))))))

    def subgroup_of(self, device: int) -> int:
        """Index of the subgroup holding `device`."""
        index = self._subgroup_index()
        if device not in index:
            raise AnnotationError(f"device {device} is not in annotation {self}")
        return index[device]

    def derived(self, key, compute):
        """`compute()`, a pure function of this annotation named by `key`, evaluated once per
        object (e.g. the ZeRO layout or the gradient layout of a parameter's annotation)."""
        return self._memo(("derived", key), compute)

    _KEPT_BY_WITH_SUBGROUP = ("devices", "device_set", "dg_union", "dg_key", "order_codes", "subgroup_of")

    @classmethod
    def known(cls, subgroups, hdim: HDim, ratios: tuple[int, ...] | None) -> "Annotation":
        """Annotation(subgroups, hdim, ratios) for values the caller made valid (disjoint device
        groups, a normalised top tier: derived from a valid union), without checking them again."""
        made = object.__new__(cls)
        fields = made.__dict__
        fields["subgroups"], fields["hdim"], fields["ratios"] = tuple(subgroups), hdim, ratios
        return made

    def with_subgroup(self, k: int, sub: Subgroup) -> "Annotation":
        """This union with subgroup k replaced by `sub` (same HDim and ratios).

        A planner stepping through every subgroup of a large union makes one such union per step.
        When `sub` keeps subgroup k's device group, the result is valid by construction (nothing
        to check again) and keeps what this union knows of its devices and regions, so a step
        costs a tuple copy rather than a revalidation of every device."""
        return self.with_subgroups({k: sub})

    def with_subgroups(self, replaced: Mapping[int, Subgroup]) -> "Annotation":
        """This union with each subgroup k in `replaced` replaced by `replaced[k]`, in one copy
        (with_subgroup, for many subgroups at once)."""
        outside = [k for k in replaced if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self.hsize]
        if outside:
            raise AnnotationError(f"{self} has subgroups 0-{self.hsize - 1}; there is no subgroup {outside[0]!r} to replace")
        listed = list(self.subgroups)
        for k, sub in replaced.items():
            listed[k] = sub
        subs = tuple(listed)
        groups = self.dg_union
        if not (all(isinstance(sub, Subgroup) for sub in replaced.values())
                and [sub.dg for sub in replaced.values()] == [groups[k] for k in replaced]):  # (in C: mostly one object each)
            return Annotation(subs, self.hdim, self.ratios)
        self._subgroup_index()  # made here once, it passes down a plan's chain of layouts (else one per layout)
        new = Annotation.known(subs, self.hdim, self.ratios)
        # a copy (one C call, atomic under the GIL): threads sharing this union may memoise more meanwhile
        known = dict(self.__dict__.get("_memo_cache") or {})
        kept: dict[object, object] = {key: known[key] for key in self._KEPT_BY_WITH_SUBGROUP if key in known}
        kept.update((key, v) for key, v in known.items() if isinstance(key, tuple) and key[:1] == ("derived",)
                    and isinstance(key[1], tuple) and key[1][:1] == ("regions",))  # regions: HDim, ratios, HSize only
        if "dim_bound" in known:
            kept["dim_bound"] = max([known["dim_bound"]] + [d for sub in replaced.values() for d in sub.ds.split_dims])
        object.__setattr__(new, "_memo_cache", kept)
        return new

    def restated(self, states: Callable[[DistributedStates], DistributedStates], hdim: HDim,
                 ratios: tuple[int, ...] | None) -> "Annotation":
        """A union on this one's device groups with each subgroup's states replaced by
        `states(old)` (called once per distinct states: equal ones share the result), and the given
        top tier. The groups are known valid, so neither a subgroup nor the union checks its
        devices again, only the new states' sizes and top tier (making hundreds of subgroups one by
        one dominated deducing a large job: a deduced layout, a gradient or ZeRO layout); a
        subgroup whose states stay is kept as it is, and what this union knows of its devices is
        kept."""
        uniform = self.uniform_states
        if uniform is not None:  # one layout: restated once
            ds = states(uniform[0])
            if ds.size != uniform[1]:
                Subgroup(self.subgroups[0].dg, ds)  # raises, naming both
            same = ds == uniform[0]
            return self._restated_as(self.subgroups if same else _subgroups_on(self, ds), hdim, ratios, (ds, uniform[1]))
        new_states: dict[DistributedStates, tuple] = {}  # old -> (new, its size, unchanged)
        by_object: dict[int, tuple] = {}  # the same by id: hashed once per object
        subs: list[Subgroup] = []
        for sub in self.subgroups:
            entry = by_object.get(id(sub.ds))
            if entry is None:
                entry = new_states.get(sub.ds)
                if entry is None:
                    ds = states(sub.ds)
                    entry = new_states[sub.ds] = ds, ds.size, ds == sub.ds
                by_object[id(sub.ds)] = entry
            ds, size, same = entry
            if same:  # unchanged: the subgroup itself
                subs.append(sub)
                continue
            if size != len(sub.dg):
                Subgroup(sub.dg, ds)  # raises, naming both
            subs.append(Subgroup.known(sub.dg, ds))
        return self._restated_as(subs, hdim, ratios, None)

    def _restated_as(self, subs: Sequence[Subgroup], hdim: HDim, ratios: tuple[int, ...] | None,
                     uniform: tuple[DistributedStates, int] | None) -> "Annotation":
        """A union of `subs` (this union's device groups, valid states) and the given top tier,
        keeping what this union knows of its devices (and `uniform`, when known)."""
        new = Annotation.known(subs, *_top_tier(hdim, ratios, len(subs)))  # the device groups are this union's
        _ = self.device_set  # made here once, every layout deduced or derived from this one shares it
        known = self.__dict__.get("_memo_cache") or {}
        cache = new.__dict__.setdefault("_memo_cache", {})
        cache.update((key, known[key]) for key in self._KEPT_BY_WITH_SUBGROUP if key in known and key not in cache)
        if uniform is not None:
            cache.setdefault("uniform", uniform)
        return new

    def with_ratios(self, ratios: tuple[int, ...] | None) -> "Annotation":
        """The same union with its top-tier split ratios bound (e.g. per-pipeline micro-batch sizes)."""
        return Annotation(self.subgroups, self.hdim, None if ratios is None else tuple(ratios))

    def check_rank(self, ndim: int, where: str = "") -> None:
        """Raise if a split dim (bottom or top tier) is outside a tensor of rank `ndim`."""
        if self._memo("dim_bound", self._max_dim) < ndim:  # at least the largest split dim (see with_subgroup)
            return
        at = f" ({where})" if where else ""
        if isinstance(self.hdim, int) and self.hdim >= ndim:
            raise AnnotationError(f"HDim {self.hdim} of {self} is outside a rank-{ndim} tensor{at}")
        for s in self.subgroups:
            for d in s.ds.split_dims:
                if d >= ndim:
                    raise AnnotationError(f"split dim {d} in {s} is outside a rank-{ndim} tensor{at}")

    def _max_dim(self) -> int:
        dims = [d for ds in self.distinct_states for d in ds.split_dims]
        return max(dims + ([self.hdim] if isinstance(self.hdim, int) else []), default=-1)

    def __hash__(self) -> int:
        return self._memo("hash", self._value_hash)

    def _value_hash(self) -> int:
        """A union whose subgroups share one layout hashes its states once and its device groups
        as int tuples (hashing hundreds of Subgroup objects dominated deducing a large job);
        uniformity is a property of the value, so equal unions still hash alike."""
        uniform = self.uniform_states
        if uniform is not None:
            return hash((uniform, self.dg_key, self.hdim, self.ratios))
        return hash((self.subgroups, self.hdim, self.ratios))

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        if self._hashes_differ(other):
            return False
        if self.hdim != other.hdim or self.ratios != other.ratios or self.hsize != other.hsize:
            return False
        mine, theirs = self.uniform_states, other.uniform_states
        if mine is not None or theirs is not None:  # one layout each: compare it and the int-tuple groups in C
            return mine == theirs and self.dg_key == other.dg_key
        return self.subgroups == other.subgroups

    def __str__(self) -> str:
        """The text syntax (made once per object: a union of hundreds of subgroups is a long text,
        and a device program names the annotation of each of its thousands of tensors)."""
        def compute():
            if self.hsize == 1:
                return str(self.subgroups[0])
            ratios = "" if self.ratios is None else "(" + ":".join(map(str, self.ratios)) + ")"
            return f"H{self.hdim}{ratios}{{" + " | ".join(map(str, self.subgroups)) + "}"
        return self._memo("text", compute)

    def __repr__(self) -> str:
        return f"Annotation({str(self)!r})"


@dataclass(frozen=True)
class Hierarchy:
    """One annotation per strategy; strategy i is always passed explicitly, never global."""

    strategies: tuple[Annotation, ...]

    def __post_init__(self):
        strategies = _members(self.strategies, "a hierarchy is a sequence of annotations",
                              "a hierarchy needs at least one strategy", Annotation,
                              "hierarchy members must be Annotation values")
        object.__setattr__(self, "strategies", strategies)

    def __getitem__(self, strategy: int) -> Annotation:
        if isinstance(strategy, bool) or not isinstance(strategy, int):
            raise AnnotationTypeError(f"a strategy index is an integer, got {brief(strategy)}")
        if not 0 <= strategy < len(self.strategies):
            raise AnnotationError(f"strategy {strategy} does not exist: this hierarchy has {len(self.strategies)}")
        return self.strategies[strategy]

    def __len__(self) -> int:
        return len(self.strategies)

    def with_strategy(self, annotation: Annotation) -> "Hierarchy":
        return Hierarchy(self.strategies + (annotation,))

    def __str__(self) -> str:
        return " ; ".join(map(str, self.strategies))
