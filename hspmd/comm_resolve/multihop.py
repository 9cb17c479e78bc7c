"""Intermediate layouts for two-hop reshards: the candidates the resolver prices a route through
(src -> intermediate -> dst, each hop resolved as any reshard is) beside its direct routes.

DTensor's redistribute planner searches sequences of per-mesh-dim transforms for the cheapest; on
hspmd's cost model the cheapest plan between two layouts is likewise not always one of the
direct routes: gathering an axis first (one AllGather on fast links) can make the rest a cheap
exchange, e.g. S1:2,S1:2,S1:2@[0,2,4,6,1,3,5,7] -> S0:2,S0:2,S1:2@[0,1,4,5,2,3,6,7] of a (16, 8)
tensor: 15 us as one BatchedSendRecv, 10 us through S1:2,S1:2,D:2 on the source's devices.

The candidates are generated, not searched open-ended, and bounded (at most MAX_INTERMEDIATES):
for two SPMD layouts (HSize 1) of values on the same devices (one mesh, as DTensor's; no partial
values on either side: a partial source has the resolver's own reduction first; moves between
device sets, pipeline hand-offs, are HetAuto's routes' domain), each layout with axes gathered (each axis alone, each
suffix, all of them: Duplicate in their place) on its own devices; each layout's states on the
other's devices (where the sizes agree); and, over the two layouts' common refinement of axes, each
one with one position taken from the other. Unions of several subgroups are resolved by the
decision order alone (their intermediates would be per-subgroup choices: not searched).
"""

from __future__ import annotations

from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Duplicate, Subgroup
from hspmd.comm_resolve.collectives import refine
from hspmd.errors import AnnotationError

MAX_INTERMEDIATES = 48


def applies(src: Annotation, dst: Annotation) -> bool:
    """Whether two-hop routes are searched between these layouts (module docstring)."""
    return (src.hsize == 1 and dst.hsize == 1 and not src.has_partial and not dst.has_partial
            and src.device_set == dst.device_set)


def intermediates(src: Annotation, dst: Annotation) -> tuple[Annotation, ...]:
    """The candidate intermediate layouts between `src` and `dst`, neither of them, each once, in a
    fixed order (every device generates the same list); empty where applies() is False."""
    if not applies(src, dst):
        return ()
    (s,), (d,) = src.subgroups, dst.subgroups
    out: dict[Annotation, None] = {}

    def add(axes, group: DeviceGroup) -> None:
        states = DistributedStates(tuple(axes))
        if states.size != len(group):
            return
        try:
            ann = Annotation((Subgroup(group, states),))
        except AnnotationError:
            return
        if ann != src and ann != dst and len(out) < MAX_INTERMEDIATES:
            out[ann] = None

    for sub in (s, d):
        axes = list(sub.ds.axes)
        for p in range(len(axes)):
            add(axes[:p] + [Duplicate(axes[p].n)] + axes[p + 1:], sub.dg)  # one axis gathered
            add(axes[:p] + [Duplicate(a.n) for a in axes[p:]], sub.dg)  # a suffix gathered
    add(d.ds.axes, s.dg)  # the destination's states on the source's devices, then a permutation
    add(s.ds.axes, d.dg)  # a permutation first
    refined = refine(s.ds.axes, d.ds.axes)
    if refined is not None:
        mine, theirs = refined
        for p, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                add(mine[:p] + [b] + mine[p + 1:], s.dg)
                add(theirs[:p] + [a] + theirs[p + 1:], d.dg)
    return tuple(out)


__all__ = ["MAX_INTERMEDIATES", "applies", "intermediates"]
