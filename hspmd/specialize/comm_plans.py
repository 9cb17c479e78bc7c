"""CommOps and their resolved plans (hspmd.comm_resolve): the only place the specializer calls the
resolver. Plans are read as plain data: how a device takes part in one, which collective groups and
P2P edges it has (what pipeline discovery reads), and a one-line view per device."""

from __future__ import annotations

from itertools import chain
from operator import itemgetter

from hspmd.annotations import Annotation
from hspmd.comm_resolve.plan_part import part_of
from hspmd.comm_resolve.resolver import resolve


def resolve_comm(src: Annotation, dst: Annotation, shape, src_ratios, dst_ratios, topology, dtype, for_devices=None):
    return resolve(src, dst, tuple(shape), topology, dtype=dtype, src_ratios=src_ratios, dst_ratios=dst_ratios,
                   for_devices=for_devices)


def _exchanges(plan, repeats: bool = True):
    """Per step, (its collective groups, its messages as (src, dst) pairs), then the same for the
    subgroups a plan resolved for some devices leaves out (Step.repeats): the template devices'
    groups and messages, renamed, for every subgroup of one template at once. Every consumer
    below reads plans through this, so that a rank's focused plan gives the whole plan's groups,
    roles and pattern. `repeats=False`: the listed steps alone (every step of a device the plan
    covers)."""
    for step in plan.steps:
        groups = [c.devices for c in step.collectives]
        messages = [(t.src, t.dst) for t in step.transfers if t.src != t.dst]
        yield groups, messages
        named_by_template: dict[tuple, list] = {}  # template devices -> the device lists it stands for (few templates)
        for template, devices in step.repeats if repeats else ():
            named_by_template.setdefault(template, []).append(devices)
        for template, named in named_by_template.items():
            members = set(template)
            mine = [g for g in groups if members.issuperset(g)]
            sent = [m for m in messages if m[0] in members and m[1] in members]
            yield _renamed_onto(mine, template, named), _renamed_onto(sent, template, named)


def _renamed_onto(tuples: list[tuple[int, ...]], template: tuple[int, ...], named: list[tuple[int, ...]]):
    """`tuples` of the template's devices renamed position by position onto each device list in
    `named`, one after another: picked in C where the tuples have one length (a subgroup's
    groups and messages, renamed for each of hundreds of subgroups)."""
    if not tuples:
        return []
    position = dict(zip(template, range(len(template))))
    at = [position[d] for d in chain.from_iterable(tuples)]
    lengths = set(map(len, tuples))
    if len(lengths) > 1:
        return [tuple(devices[position[d]] for d in t) for devices in named for t in tuples]
    picked = map(itemgetter(*at), named)
    flat = picked if len(at) == 1 else chain.from_iterable(picked)
    return list(zip(*[flat] * lengths.pop()))


def roles_of(plan) -> dict[int, str]:
    """How each device takes part in a plan: collective, send, recv, send+recv, or local (no
    peer). Worked out in one pass over the plan and kept on it (a plan is immutable, and a job's
    compiler asks for every device of a plan over thousands)."""
    roles = plan.__dict__.get("_roles")
    if roles is None:
        roles = _roles(_exchanges(plan), plan.devices)
        plan.__dict__["_roles"] = roles  # beside the frozen fields, as cached_property keeps
    return roles


def roles_for(plan, devices: tuple[int, ...]) -> dict[int, str]:
    """The roles of `devices` in the plan. Where the plan covers them, read from the steps it lists,
    those being every step of theirs (no left-out subgroup renamed): a rank's role in a plan over
    thousands of devices costs the plan's listed steps. Kept on the plan per device tuple."""
    known = plan.__dict__.setdefault("_roles_for", {})
    if devices not in known:
        if plan.covers(devices):
            known[devices] = _roles(_exchanges(plan, repeats=False), devices)
        else:
            everyone = roles_of(plan)
            known[devices] = {d: everyone.get(d, "local") for d in devices}
    return known[devices]


def _roles(exchanges, devices) -> dict[int, str]:
    """Each of `devices`' role in the exchanges (see roles_of)."""
    collective, sends, recvs = set(), set(), set()
    for groups, messages in exchanges:
        for g in groups:
            if len(g) > 1:
                collective.update(g)
        for a, b in messages:
            sends.add(a)
            recvs.add(b)
    return {d: "collective" if d in collective else
            ("send+recv" if d in recvs else "send") if d in sends else
            "recv" if d in recvs else "local" for d in devices}


def groups_of(plan) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Each device's collective groups in the plan (of two or more members), in plan order, worked
    out in one pass and kept on the plan: a rank names only its own groups (a backend creates the
    union of every rank's), where the plan's whole list grows with the job."""
    groups = plan.__dict__.get("_groups")
    if groups is not None:
        return groups
    found: dict[int, dict[tuple[int, ...], None]] = {}
    for step_groups, _ in _exchanges(plan):
        for g in step_groups:
            if len(g) > 1:
                for d in g:
                    found.setdefault(d, {})[g] = None
    groups = {d: tuple(g) for d, g in found.items()}
    plan.__dict__["_groups"] = groups
    return groups


def touched(plan) -> set[int]:
    """Every device that is a member of a collective of the plan or sends or receives a message."""
    out: set[int] = set()
    for groups, messages in _exchanges(plan):
        for g in groups:
            out.update(g)
        for m in messages:
            out.update(m)
    return out


def pattern(plan) -> tuple[list[tuple[int, ...]], list[tuple[int, int]]]:
    """(collective groups, P2P edges) of a plan, as pipeline discovery reads them.

    A transfer between two devices that each hold a piece of both the source and the destination
    is a reshard inside one stage (it may run both ways, e.g. `@[0] | D:3@[1-3]` to
    `S0:2,D:2@[0-3]`), not a hand-off from one stage to the next: it joins its two devices like a
    collective. Only a transfer with an end outside the source or the destination is a P2P edge."""
    both = set(plan.src.devices) & set(plan.dst.devices)
    groups, edges = [], []
    for step_groups, messages in _exchanges(plan):
        groups += [g for g in step_groups if len(g) > 1]
        for a, b in messages:
            if a in both and b in both:
                groups.append((a, b))
            else:
                edges.append((a, b))
    return groups, edges


def renamed(pattern_: tuple[list[tuple[int, ...]], list[tuple[int, int]]], template: tuple[int, ...],
            devices: tuple[int, ...]):
    """A pattern with each of the template's devices renamed to the device at its position."""
    groups, edges = pattern_
    return _renamed_onto(groups, template, [devices]), _renamed_onto(edges, template, [devices])


def describe_for(plan, device: int) -> str:
    """The plan's steps as this device runs them (its part), e.g. 'AllReduce all_reduce[0,1] ;
    SendRecv 1->3'; steps of other subgroups, in which it does nothing, are not listed."""
    return " ; ".join(map(str, part_of(plan, device).steps)) or "nothing on this device"


__all__ = ["describe_for", "groups_of", "pattern", "renamed", "resolve_comm", "roles_for", "roles_of", "touched"]
