"""HetAuto's gathered layouts (HetAuto §5.2, App. E): a union with each subgroup's piece
gathered onto a few of its devices, the middle hops of the resolver's "root" and
"representatives" routes. Pure functions of annotations, made once per annotation."""

from __future__ import annotations

from functools import lru_cache
from operator import itemgetter

from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Split, Subgroup


def gathered_within(ann: Annotation, pick) -> Annotation:
    """`ann` with each subgroup's piece gathered onto the devices `pick` (root or representatives:
    states -> (positions in the group, states there)) chooses, the union's HDim and ratios
    unchanged: HetAuto gathers inside each outer-DP partition (an hspmd subgroup), never across
    partitions, so that one pipeline's data never passes through another's devices. Made once per
    annotation (plans of many shapes share their layouts), `pick` asked once per states object;
    a subset of each valid group is valid, so nothing is checked again."""
    def compute():
        uniform = ann.uniform_states
        if uniform is not None:  # (one layout: the subgroups are shared with the unions on the same groups)
            return Annotation.known(_gathered(pick, ann.dg_key, uniform[0]), ann.hdim, ann.ratios)
        picked = {id(ds): _picking(*pick(ds)) for ds in ann.distinct_states}
        subs = [Subgroup.known(DeviceGroup.known(take(devices)), states)
                for (take, states), devices in zip(map(picked.__getitem__, map(id, ann.ds_union)), ann.dg_key)]
        return Annotation.known(subs, ann.hdim, ann.ratios)
    return ann.derived(("within", pick), compute)


@lru_cache(maxsize=64)
def _gathered(pick, groups: tuple[tuple[int, ...], ...], states: DistributedStates) -> tuple[Subgroup, ...]:
    """gathered_within's subgroups of a union of one layout on `groups`: the same for every such union
    (a gradient's, its ZeRO shard's and its parameter's layouts differ in HDim only)."""
    take, picked = _picking(*pick(states))
    return tuple(Subgroup.known(DeviceGroup.known(take(devices)), picked) for devices in groups)


def _picking(positions: tuple[int, ...], states: DistributedStates):
    """(a function taking the devices at `positions` of a group's, as a tuple; `states`)."""
    take = itemgetter(*positions)
    return (take if len(positions) > 1 else lambda devices: (take(devices),)), states


def root(ds: DistributedStates) -> tuple[tuple[int, ...], DistributedStates]:
    """The subgroup's whole piece on its first device (S2's root)."""
    return (0,), _WHOLE


_WHOLE = DistributedStates()


@lru_cache(maxsize=256)
def representatives(ds: DistributedStates, dim: int = 0) -> tuple[tuple[int, ...], DistributedStates]:
    """The subgroup gathered along `dim` onto the devices at index 0 of every Split of `dim`
    (HetAuto's inner-DP-rank-0 devices), the other axes keeping their devices' order and pieces:
    (their positions in the group, their states)."""
    axes = ds.axes
    gathered = [isinstance(a, Split) and a.dim == dim for a in axes]
    positions = []
    for i in range(ds.size):
        digits, rest = [], i
        for a in reversed(axes):
            digits.append(rest % a.n)
            rest //= a.n
        if all(d == 0 for d, g in zip(reversed(digits), gathered) if g):
            positions.append(i)
    return tuple(positions), DistributedStates(tuple(a for a, g in zip(axes, gathered) if not g))
