"""Deduction machinery shared by every op: align the inputs' axes, then apply a per-position rule.

After the deduction pass has aligned the inputs to one DG union and HSize (hspmd.annotations.
align_hsize), each subgroup is plain SPMD: the inputs' DS axes over the same device group are
refined to a common factorisation (D:4 against D:2,S1:2 becomes D:2,D:2 against D:2,S1:2) and
the op's position rule maps the inputs' axes at each position to one output axis. The top tier
(HDim) is one more position: HDim d is Split(d, HSize), D is Duplicate, P is Partial. This is the
paper's "DS union, then HDim" deduction with one rule per op instead of two.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Callable, Sequence

from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Duplicate, Partial, Split, Subgroup
from hspmd.annotations.algebra import common_refinement
from hspmd.annotations.states import Axis


class Mismatch(Exception):
    """The inputs' layouts do not let the op compute locally; the deduction pass turns this into a
    DeductionError that names the op and tells the user to insert comm()."""


PositionRule = Callable[[Sequence[Axis]], tuple[Axis, int | None]]


@lru_cache(maxsize=4096)
def _refine(ds_list: tuple[DistributedStates, ...], size: int) -> tuple[tuple[tuple[Axis, int], ...], ...]:
    """Each input's axes refined to the common cut points: (axis factor, original axis index).
    Cached: a pure function of immutable values, and a model repeats few distinct input layouts."""
    # the whole group as one more axis list, so that the cut points reach the group size
    refined = common_refinement([ds.axes for ds in ds_list] + [[Duplicate(size)]])
    if refined is None:
        raise Mismatch(
            "the inputs' distributed states nest their axes differently ("
            + " vs ".join(str(ds) or "-" for ds in ds_list) + ")"
        )
    out = refined[:-1]
    for pos in range(len(refined[-1])):
        splits = [(i, r[pos][1]) for i, r in enumerate(out) if isinstance(r[pos][0], Split)]
        for i, orig in splits:
            pieces = sum(1 for a, o in out[i] if o == orig)
            if pieces > 1 and len(splits) > 1:
                raise Mismatch(
                    "a split axis of one input lines up with differently grouped splits of another ("
                    + " vs ".join(str(ds) or "-" for ds in ds_list) + ")"
                )
    return tuple(out)


def _merge(axes: list[tuple[Axis, object]]) -> DistributedStates:
    """Join neighbouring output axes that describe one layout (D,D / P,P / splits of one origin)."""
    merged: list[tuple[Axis, object]] = []
    for axis, origin in axes:
        if merged:
            last, last_origin = merged[-1]
            same = (
                (isinstance(axis, Duplicate) and isinstance(last, Duplicate))
                or (isinstance(axis, Partial) and isinstance(last, Partial))
                or (isinstance(axis, Split) and isinstance(last, Split) and axis.dim == last.dim
                    and origin is not None and origin == last_origin)
            )
            if same:
                merged[-1] = (replace(last, n=last.n * axis.n), last_origin)
                continue
        merged.append((axis, origin))
    return DistributedStates(tuple(a for a, _ in merged))


def deduce_subgroup(ds_list: Sequence[DistributedStates], size: int, rule: PositionRule) -> DistributedStates:
    refined = _refine(tuple(ds_list), size)
    positions = len(refined[0])
    out = []
    for pos in range(positions):
        axes = [r[pos][0] for r in refined]
        axis, source = rule(axes)
        out.append((axis, None if source is None else (source, refined[source][pos][1])))
    return _merge(out)


def top_axis(ann: Annotation) -> Axis:
    if isinstance(ann.hdim, int):
        return Split(ann.hdim, ann.hsize)
    return (Partial if ann.hdim == "P" else Duplicate)(ann.hsize)


@lru_cache(maxsize=1024)
def _assemble(dgs: tuple[DeviceGroup, ...], states: tuple[DistributedStates, ...], hdim, ratios) -> Annotation:
    """The union of these groups and states. Cached because a model's repeated layers deduce
    equal unions again and again, and building (validating) a large union costs far more than
    hashing it; annotations are immutable, so sharing one value is safe."""
    return Annotation(tuple(Subgroup(dg, ds) for dg, ds in zip(dgs, states)), hdim, ratios)


def _top_tier(anns: Sequence[Annotation], rule: PositionRule):
    """(HDim, ratios) of the output: the rule applied to the inputs' top-tier axes. Inputs split
    across subgroups meet piece by piece (a split output, or a partial one where a contraction
    pairs them), so their ratios must agree."""
    hdim, ratios = "D", None
    if anns[0].hsize > 1:
        axis, source = rule([top_axis(a) for a in anns])
        if isinstance(axis, (Split, Partial)):
            split_ratios = [a.ratios for a in anns if isinstance(a.hdim, int)]  # compared, not hashed: HSize long
            if any(r != split_ratios[0] for r in split_ratios[1:]):
                raise Mismatch(f"inputs split across subgroups in different ratios {sorted(map(str, set(split_ratios)))}")
        if isinstance(axis, Split):
            hdim, ratios = axis.dim, anns[source].ratios
        elif isinstance(axis, Partial):
            hdim = "P"
    return hdim, ratios


def _result(anns: Sequence[Annotation], equal_inputs, hdim, ratios) -> Annotation | None:
    """The first input equal to the output (its states at every subgroup, its HDim and ratios)."""
    for i in sorted(equal_inputs):
        if anns[i].hdim == hdim and anns[i].ratios == ratios:
            return anns[i]
    return None


def _deduce_uniform(anns: Sequence[Annotation], rule: PositionRule) -> Annotation | None:
    """deduce_union for inputs whose subgroups all have one layout and size (a homogeneous stage):
    the rule runs once, and the output union is built once per (first input, output layout) and
    kept with that input, so a model's repeated layers cost O(1) per op whatever the HSize.
    None when some input is not uniform."""
    uniform = [a.uniform_states for a in anns]
    if any(u is None for u in uniform) or len({size for _, size in uniform}) > 1:
        return None
    ins = [ds for ds, _ in uniform]
    out = deduce_subgroup(ins, uniform[0][1], rule)
    hdim, ratios = _top_tier(anns, rule)
    same = _result(anns, [i for i, ds in enumerate(ins) if ds == out], hdim, ratios)
    if same is not None:
        return same
    first = anns[0]
    return first.derived(("deduced", out, hdim, ratios), lambda: first.restated(lambda _: out, hdim, ratios))


def deduce_union(anns: Sequence[Annotation], rule: PositionRule) -> Annotation:
    """Apply `rule` to every subgroup's DS and to the top tier of aligned inputs.

    Deduction runs this per op over unions of up to thousands of subgroups, so it avoids repeated
    work without changing the result: subgroups whose inputs have equal states deduce equal states
    (the rule sees only the axes and the group size), so the rule runs once per distinct case
    (inputs with one case throughout take _deduce_uniform; otherwise cases are told apart by the
    identity of the input states, which `anns` keeps alive for the call, then by value); and an
    output equal to one of the inputs is returned as that input's (immutable) value rather than
    rebuilt, layout-preserving ops being the common case."""
    fast = _deduce_uniform(anns, rule)
    if fast is not None:
        return fast
    first = anns[0]
    by_identity: dict[tuple[int, ...], int] = {}
    by_value: dict[tuple, int] = {}
    cases: list[tuple[DistributedStates, frozenset[int]]] = []  # (output states, inputs it equals)
    case_of_subgroup = []
    for ins, dg in zip(zip(*(a.ds_union for a in anns)), first.dg_union):
        identity = tuple(map(id, ins))
        if identity not in by_identity:
            value = (ins, len(dg))
            if value not in by_value:
                out = deduce_subgroup(list(ins), len(dg), rule)
                by_value[value] = len(cases)
                cases.append((out, frozenset(i for i, ds in enumerate(ins) if ds == out)))
            by_identity[identity] = by_value[value]
        case_of_subgroup.append(by_identity[identity])
    hdim, ratios = _top_tier(anns, rule)
    equal_inputs = frozenset.intersection(*(cases[c][1] for c in set(case_of_subgroup)))
    same = _result(anns, equal_inputs, hdim, ratios)
    if same is not None:
        return same
    return _assemble(first.dg_union, tuple(cases[c][0] for c in case_of_subgroup), hdim, ratios)


def map_annotation(ann: Annotation, fn: Callable[[Axis], Axis]) -> Annotation:
    """A single-input rule applied to every axis (both tiers) of one annotation."""
    return deduce_union([ann], lambda axes: (fn(axes[0]), 0))


# ---------------------------------------------------------------- shared position rules


def broadcast_info(in_shapes: Sequence[tuple], out_shape: tuple) -> list[tuple[int, set[int]]]:
    """(dim offset into the output, output dims this input broadcasts along) for each input."""
    info = []
    for shape in in_shapes:
        offset = len(out_shape) - len(shape)
        bcast = set(range(offset))
        bcast.update(offset + i for i, d in enumerate(shape) if d == 1 and out_shape[offset + i] != 1)
        info.append((offset, bcast))
    return info


def elementwise_rule(in_shapes: Sequence[tuple], out_shape: tuple, partial: str = "none",
                     linear_inputs: Sequence[int] = (), whole_dims: Sequence[int] = ()) -> PositionRule:
    """Rule for broadcasting elementwise ops.

    partial: "none" (nonlinear), "all" (a sum: every input partial alike, e.g. add) or "one"
    (linear in each input of `linear_inputs` separately: exactly one of them partial, e.g. mul).
    whole_dims: output dims the op needs whole on a device (the normalised dim of a norm)."""
    info = broadcast_info(in_shapes, out_shape)
    whole = {d % max(len(out_shape), 1) for d in whole_dims}

    def rule(axes: Sequence[Axis]) -> tuple[Axis, int | None]:
        n = axes[0].n
        split_dim, source = None, None
        for i, a in enumerate(axes):
            if isinstance(a, Split):
                d = a.dim + info[i][0]
                if d in info[i][1]:
                    raise Mismatch(f"input {i} is split along dim {a.dim}, which it broadcasts")
                if d in whole:
                    raise Mismatch(f"the op needs dim {d} whole on each device but input {i} splits it")
                if split_dim is not None and d != split_dim:
                    raise Mismatch(f"inputs split different dims ({split_dim} and {d}) at one axis")
                split_dim, source = d, (source if source is not None else i)
        partials = [i for i, a in enumerate(axes) if isinstance(a, Partial)]
        if split_dim is not None:
            if partials:
                raise Mismatch(f"input(s) {partials} hold partial summands where input {source} holds pieces")
            for i, a in enumerate(axes):
                if not isinstance(a, Split) and split_dim not in info[i][1]:
                    kind = "a partial summand" if isinstance(a, Partial) else "the whole dim"
                    raise Mismatch(f"input {source} holds pieces of dim {split_dim} where input {i} holds {kind}")
            return Split(split_dim, n), source
        if partials:
            if partial == "all" and len(partials) == len(axes):
                return Partial(n), None
            if partial == "one" and len(partials) == 1 and partials[0] in linear_inputs:
                return Partial(n), None
            raise Mismatch(
                f"input(s) {partials} hold partial summands, which this op cannot combine "
                f"({'it is not linear' if partial == 'none' else 'mixed with whole values'})"
            )
        return Duplicate(n), None

    return rule


__all__ = [
    "Mismatch", "PositionRule", "broadcast_info", "deduce_subgroup", "deduce_union", "elementwise_rule",
    "map_annotation", "top_axis",
]
