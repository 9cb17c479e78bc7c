"""CommOps and their resolved plans (hspmd.comm_resolve): the only place the specializer calls the
resolver. Plans are read as plain data: how a device takes part in one, which collective groups and
P2P edges it has (what pipeline discovery reads), and a one-line view per device."""

from __future__ import annotations

from hspmd.annotations import Annotation
from hspmd.comm_resolve.resolver import resolve


def resolve_comm(src: Annotation, dst: Annotation, shape, src_ratios, dst_ratios, topology, dtype):
    return resolve(src, dst, tuple(shape), topology, dtype=dtype, src_ratios=src_ratios, dst_ratios=dst_ratios)


def roles_of(plan) -> dict[int, str]:
    """How each device of the plan takes part: collective, send, recv, send+recv, or local (no
    peer). Worked out in one pass over the plan and kept on it (a plan is immutable, and a job's
    compiler asks for every device of a plan over thousands)."""
    roles = plan.__dict__.get("_roles")
    if roles is not None:
        return roles
    collective, sends, recvs = set(), set(), set()
    for step in plan.steps:
        for c in step.collectives:
            if len(c.devices) > 1:
                collective.update(c.devices)
        for t in step.transfers:
            if t.src != t.dst:
                sends.add(t.src)
                recvs.add(t.dst)
    roles = dict.fromkeys(plan.devices, "local")
    roles.update(dict.fromkeys(sends - recvs, "send"))
    roles.update(dict.fromkeys(recvs - sends, "recv"))
    roles.update(dict.fromkeys(sends & recvs, "send+recv"))
    roles.update(dict.fromkeys(collective, "collective"))
    plan.__dict__["_roles"] = roles  # beside the frozen fields, as cached_property keeps
    return roles


def groups_of(plan) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Each device's collective groups in the plan (of two or more members), in plan order, worked
    out in one pass and kept on the plan: a rank names only its own groups (a backend creates the
    union of every rank's), where the plan's whole list grows with the job."""
    groups = plan.__dict__.get("_groups")
    if groups is not None:
        return groups
    found: dict[int, dict[tuple[int, ...], None]] = {}
    for step in plan.steps:
        for c in step.collectives:
            if len(c.devices) > 1:
                for d in c.devices:
                    found.setdefault(d, {})[c.devices] = None
    groups = {d: tuple(g) for d, g in found.items()}
    plan.__dict__["_groups"] = groups
    return groups


def pattern(plan) -> tuple[list[tuple[int, ...]], list[tuple[int, int]]]:
    """(collective groups, P2P edges) of a plan, as pipeline discovery reads them.

    A transfer between two devices that each hold a piece of both the source and the destination
    is a reshard inside one stage (it may run both ways, e.g. `@[0] | D:3@[1-3]` to
    `S0:2,D:2@[0-3]`), not a hand-off from one stage to the next: it joins its two devices like a
    collective. Only a transfer with an end outside the source or the destination is a P2P edge."""
    groups = [c.devices for s in plan.steps for c in s.collectives if len(c.devices) > 1]
    both = set(plan.src.devices) & set(plan.dst.devices)
    edges = []
    for s in plan.steps:
        for t in s.transfers:
            if t.src == t.dst:
                continue
            if t.src in both and t.dst in both:
                groups.append((t.src, t.dst))
            else:
                edges.append((t.src, t.dst))
    return groups, edges


def renamed(pattern_: tuple[list[tuple[int, ...]], list[tuple[int, int]]], name: dict[int, int]):
    """A pattern with every device renamed."""
    groups, edges = pattern_
    return [tuple(name[d] for d in g) for g in groups], [(name[a], name[b]) for a, b in edges]


def describe_for(plan, device: int) -> str:
    """The plan's steps as this device sees them, e.g. 'AllReduce[0,1] ; SendRecv 1->3'."""
    parts = []
    for s in plan.steps:
        mine = [c for c in s.collectives if device in c.devices]
        moves = [t for t in s.transfers if device in (t.src, t.dst) and t.src != t.dst]
        if mine:
            parts.append(s.primitive + "".join("[" + ",".join(map(str, c.devices)) + "]"
                                               for c in dict.fromkeys(c for c in mine)))
        elif moves:
            parts.append(s.primitive + " " + ",".join(f"{t.src}->{t.dst}" for t in moves))
        elif device in s.assembled_on or device in s.dst.devices:
            parts.append(s.primitive + " (local)")
    return " ; ".join(parts) or "nothing on this device"


__all__ = ["describe_for", "groups_of", "pattern", "renamed", "resolve_comm", "roles_of"]
