"""Steps planned once per kind of subgroup, then moved onto the other subgroups of that kind.

A union of hundreds of subgroups (one per data-parallel pipeline) usually repeats one layout, and
the resolver's steps inside subgroup k are a function of k's states, target states, region
extents, the order of its devices and the links between them, never of the device ids or where
the region lies: pieces are cut relative to the region's start (geometry.py), collectives group
devices by their index in the device group, and the BSR planner ranks senders by bandwidth, then
load, then device id. So subgroups whose frame (that description) is equal get the first one's
steps with devices renamed position by position and boxes shifted by the difference of the
region starts, which is exactly what planning them again would give. Device order is kept by
requiring equal order patterns (an order-preserving renaming keeps every tie-break and sorted
list), and links by comparing bandwidths pair by pair where a step has messages between devices.

A plan resolved for some devices (resolve's `for_devices`) does not even move them: a subgroup
holding none of those devices is left out and named in its template's steps (`leave_out`,
Step.repeats), where its steps' cost is surely the template's (same links, no shared pipe).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import chain
from typing import Sequence

from hspmd.annotations import Annotation, Box, Subgroup
from hspmd.annotations.states import numbered, order_pattern
from hspmd.annotations.geometry import region_shift
from hspmd.comm_resolve.plan import Collective, Step, Transfer
from hspmd.comm_resolve.topology import ClusterSpec


def frames_moved(union: Annotation, target: Annotation, moving: Sequence[int],
                 extents: Sequence[tuple[int, ...]]) -> list[tuple]:
    """A key per subgroup k in `moving` going from its device group in `union` to its own in
    `target` (frames_in_place's, with the order pattern of both groups' devices listed one after
    the other in place of the group's own order)."""
    before, after = union.dg_key, target.dg_key
    src, dst, sizes = union.states_codes, target.states_codes, numbered(extents)
    return [(src[k], dst[k], _joined_order(before[k], after[k]), sizes[k]) for k in moving]


def _joined_order(devices: tuple[int, ...], then: tuple[int, ...]) -> tuple[int, ...]:
    """order_pattern(devices + then), read off that of `then + devices` where `then` lies below
    (a group moving to lower devices, e.g. a backward hand-off: the list is then mostly ascending,
    order_pattern's fast case)."""
    if then[-1] < devices[0]:
        pattern = order_pattern(then + devices)
        return pattern[len(then):] + pattern[:len(then)]
    return order_pattern(devices + then)


def frames_in_place(union: Annotation, target: Annotation, extents: Sequence[tuple[int, ...]]) -> list[tuple]:
    """A key per subgroup k of `union` going to the states of `target`'s subgroup k on its own
    device group, `extents` its region's, equal for two subgroups exactly where their frames (the
    module docstring) are: states, device orders and extents are named by small ints (numbered),
    so a pass over hundreds of subgroups that mostly repeat one template hashes and compares its
    keys, tuples of ints, in C."""
    return list(zip(union.states_codes, target.states_codes, union.order_codes, numbered(extents)))


def same_links(template: Sequence[int], devices: Sequence[int], topology: ClusterSpec) -> bool:
    """Whether every pair of devices has the bandwidth of the template's pair at the same positions
    (always on one node without per-pair links, where every link is the node's)."""
    if len(topology.nodes) == 1 and not topology.pairs:
        return True
    pairs = [(i, j) for i in range(len(devices)) for j in range(len(devices)) if i != j]
    return all(topology.bandwidth(template[i], template[j]) == topology.bandwidth(devices[i], devices[j])
               for i, j in pairs)


def keeps_links(topology: ClusterSpec | str | None) -> bool:
    """Whether every renaming of devices keeps their links: no cluster given (one node holds every
    device) or one node without per-pair links."""
    if topology is None:
        return True
    return isinstance(topology, ClusterSpec) and len(topology.nodes) == 1 and not topology.pairs


def canonical(src: Annotation, dst: Annotation) -> tuple[tuple, tuple[int, ...]]:
    """(the reshard with each device replaced by its rank among the devices of both layouts, those
    devices in order). Two reshards with equal first parts are one reshard under an
    order-preserving renaming of devices, so where links are kept (keeps_links) the resolver plans
    them alike up to that renaming: it reads devices only through their order and links."""
    devices = tuple(sorted(src.device_set | dst.device_set))
    rank = dict(zip(devices, range(len(devices))))

    def skeleton(ann: Annotation) -> tuple:
        # the groups as every device's rank, subgroup by subgroup, and the group sizes (in C)
        groups = tuple(map(rank.__getitem__, ann.devices)), tuple(map(len, ann.dg_key))
        states = ann.uniform_states or ann.ds_union  # (one layout for all: named once)
        return ann.hdim, ann.ratios, groups, states

    return (skeleton(src), skeleton(dst)), devices


def has_messages(steps: Sequence[Step]) -> bool:
    return any(t.src != t.dst for s in steps for t in s.transfers)


def _box(box: Box, shift: tuple[int, ...]) -> Box:
    return tuple((a + o, b + o) for (a, b), o in zip(box, shift))


def _collective(c: Collective, name: dict[int, int], shift: tuple[int, ...]) -> Collective:
    return Collective(c.kind, tuple(name[d] for d in c.devices), _box(c.box, shift),
                      tuple(_box(p, shift) for p in c.parts), tuple(name[d] for d in c.zero_inputs))


def _transfer(t: Transfer, name: dict[int, int], shift: tuple[int, ...]) -> Transfer:
    return Transfer(name[t.src], name[t.dst], tuple(_box(b, shift) for b in t.boxes), t.tensors)


def moved_transfers(transfers: Sequence[Transfer], name: dict[int, int], shift: tuple[int, ...]) -> list[Transfer]:
    return [_transfer(t, name, shift) for t in transfers]


def moved_step(step: Step, name: dict[int, int], shift: tuple[int, ...], src: Annotation, dst: Annotation,
               subgroup: int | None) -> Step:
    """`step` with devices renamed by `name`, boxes shifted by `shift`, and the given layouts."""
    return Step(step.primitive, src, dst, tuple(_collective(c, name, shift) for c in step.collectives),
                tuple(_transfer(t, name, shift) for t in step.transfers), tuple(name[d] for d in step.assembled_on),
                subgroup, step.round)


def moved_steps(steps: Sequence[Step], k0: int, k: int, union: Annotation, region0: Box, region: Box) -> list[Step]:
    """Steps planned for subgroup k0 (each step changes only k0) moved onto subgroup k of `union`
    (the union before k's steps): k's states follow the template's at every step."""
    sub0, sub = steps[0].src.subgroups[k0], union.subgroups[k]
    name = dict(zip(sub0.dg.devices, sub.dg.devices))
    shift = region_shift(region0, region)
    layouts: dict[int, Annotation] = {id(sub0.ds): union}  # the first step starts from `union` itself

    def at(ann: Annotation) -> Annotation:
        ds = ann.subgroups[k0].ds
        if id(ds) not in layouts:  # the template's states fit k's group: equal frames, equal sizes
            layouts[id(ds)] = union.with_subgroup(k, Subgroup.known(sub.dg, ds))
        return layouts[id(ds)]

    return [moved_step(s, name, shift, at(s.src), at(s.dst), k) for s in steps]


def leave_out(steps: list[Step], union: Annotation, repeating: dict[int, int], groups: Sequence[tuple[int, ...]],
              targets: Sequence[Subgroup]) -> tuple[list[Step], Annotation]:
    """The subgroups a plan resolved for some devices leaves out of one pass over a union
    (`repeating`: {k: its template k0}): each template's steps name their repeats (Step.repeats:
    the template's devices and k's, from `groups`), and each left-out k ends in `targets[k]`.
    Returns (the steps, the union after the pass). The layouts of the steps kept show left-out
    subgroups as they were (only the kept devices' pieces are read from them)."""
    if not repeating:
        return steps, union
    repeats: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for k, k0 in repeating.items():
        repeats.setdefault(k0, []).append((groups[k0], groups[k]))
    steps = [replace(s, repeats=tuple(repeats[s.subgroup])) if s.subgroup in repeats else s for s in steps]
    return steps, union.with_subgroups(dict(zip(repeating, map(targets.__getitem__, repeating))))


def alone_devices(groups: Sequence[tuple[int, ...]], moving: list[int]) -> frozenset[int]:
    """The devices of exactly one moving subgroup (`groups[k]`: the devices of k's group before,
    then after the move). Only a subgroup on such devices may be left out, and only as a repeat
    of a template on such devices: then every message a kept device's rounds depend on stays
    (plan_part.message_rounds), and the messages among a template's devices are its own
    (comm_plans renames them)."""
    listed = list(chain.from_iterable(map(groups.__getitem__, moving)))
    if len(set(listed)) == len(listed):  # (the usual case, in C: no device in two groups)
        return frozenset(listed)
    count = Counter(chain.from_iterable(set(groups[k]) for k in moving))
    return frozenset(d for d, n in count.items() if n == 1)


def crosses_shared_link(transfers: Sequence[Transfer], topology: ClusterSpec) -> bool:
    """Whether a message crosses a shared link class (its time queues with other subgroups' there)."""
    return any(t.src != t.dst and topology.link(t.src, t.dst).shared for t in transfers)


__all__ = ["alone_devices", "canonical", "crosses_shared_link", "frames_in_place", "frames_moved", "has_messages",
           "keeps_links", "leave_out", "moved_step", "moved_steps", "moved_transfers", "same_links"]
