"""Resolving unions of hundreds of repeated subgroups in the time of a few: the scaling path beside
the decision ladder (resolver.py), which it never changes the outcome of.

Two devices, both exact (relabel.py proves the renaming keeps every step):

* Templates: subgroups of one frame (relabel.frames_in_place / frames_moved: the same states, the
  same shape of region, devices in the same order) are planned once; the first one's steps or
  messages are moved onto the others (relabel.moved_steps / moved_transfers) where the links
  between their devices are alike.
* Repeats: a plan resolved `for_devices` (a rank specializing alone) leaves out each subgroup
  that holds none of those devices and repeats an earlier subgroup of its frame, and names it in
  the template's Step.repeats instead (relabel.leave_out), so a rank plans its own subgroups, not
  every data-parallel replica's. A moving subgroup may be left out only when its devices are
  alone (relabel.alone_devices: no other moving subgroup's) and its template's messages cross
  no shared link (whose time adds up over the subgroups, so they must be priced).

The decision ladder asks this module which subgroups to plan and hands it the planner of one
subgroup (in place) as a function; planning across subgroups stays in the ladder.
"""

from __future__ import annotations

from operator import add
from typing import Callable, Sequence

from hspmd.annotations import Annotation, Box, Subgroup
from hspmd.annotations.geometry import region_shift
from hspmd.comm_resolve import relabel
from hspmd.comm_resolve.bsr import TensorSlices, destination_needs, plan_transfers
from hspmd.comm_resolve.plan import Step, Transfer
from hspmd.comm_resolve.reshard import Resolution

PlanSubgroup = Callable[[Annotation, int, Subgroup, Resolution], tuple[list[Step], Annotation]]


def equalise_like(templates: dict, union: Annotation, k: int, target: Subgroup, ctx: Resolution,
                  region: Box, key: tuple, plan: PlanSubgroup) -> tuple[list[Step], Annotation]:
    """plan(union, k, target, ctx), or an earlier subgroup's steps of the same frame moved onto
    subgroup k (exactly what `plan` would give: relabel.py), so that a union of hundreds of equal
    subgroups is planned once. `templates` is kept by the caller for one pass over the subgroups;
    `region` is subgroup k's (the caller's union and `union` share HDim, ratios and HSize, so
    their regions); `key` is subgroup k's frame (relabel.frames_in_place)."""
    if key in templates:
        steps, k0, region0 = templates[key]
        if relabel.same_links(union.dg_key[k0], union.dg_key[k], ctx.topology) or not relabel.has_messages(steps):
            moved = relabel.moved_steps(steps, k0, k, union, region0, region)
            return moved, moved[-1].dst  # k in `target`'s states: the template's last layout moved
    steps, done = plan(union, k, target, ctx)
    templates.setdefault(key, (steps, k, region))
    return steps, done


def repeating(union: Annotation, frames: list[tuple], ctx: Resolution, moving) -> dict[int, int]:
    """{k: its template k0} for each subgroup (not moving) the plan leaves out and names in its
    template's repeats (Step.repeats): left_out's rule, on the subgroups' own devices (their
    collectives' cost, too, follows the links); empty where the plan is for every device."""
    if ctx.focus is None:
        return {}
    moved = set(moving)
    kept = {k: frame for k, frame in enumerate(frames) if k not in moved} if moved else dict(enumerate(frames))
    return left_out(kept, union.dg_key, ctx)


def left_out(frames: dict[int, tuple], devices: Sequence[tuple[int, ...]], ctx: Resolution,
             alone: frozenset[int] | None = None) -> dict[int, int]:
    """{k: k0} for each subgroup k of `frames` ({k: its frame}) that a plan resolved for the focus
    devices leaves out as a repeat of k0: the first subgroup of its frame, when k is another, on
    `devices[k]` holding none of the focus devices, with the template's link between every pair
    of them, and (where `alone` is given) k's and k0's devices all in `alone`. Worked out in a
    pass of C-level lookups rather than a planner call per subgroup."""
    first = dict(zip(reversed(frames.values()), reversed(frames.keys())))  # each frame's first subgroup
    focus = ctx.focus
    out = {k: first[frame] for k, frame in frames.items() if first[frame] != k and focus.isdisjoint(devices[k])}
    if alone is not None:
        out = {k: k0 for k, k0 in out.items() if alone.issuperset(devices[k]) and alone.issuperset(devices[k0])}
    if relabel.keeps_links(ctx.topology):  # (every pair of devices alike)
        return out
    return {k: k0 for k, k0 in out.items() if relabel.same_links(devices[k0], devices[k], ctx.topology)}


def moving_devices(union: Annotation, dst: Annotation) -> list[tuple[int, ...]]:
    """Per subgroup, the devices of its group in `union` then those of its group in `dst`."""
    return list(map(add, union.dg_key, dst.dg_key))


def moves_left_out(groups: list[tuple[int, ...]], moving: list[int], frames: dict[int, tuple],
                   ctx: Resolution) -> dict[int, int]:
    """{k: its template k0} for each moving subgroup k the plan leaves out: left_out's rule on the
    devices of both its groups (`groups`: moving_devices), all of them devices of no other moving
    subgroup (relabel.alone_devices); empty where the plan is for every device."""
    if ctx.focus is None or not frames:
        return {}
    return left_out(frames, groups, ctx, relabel.alone_devices(groups, moving))


def moved_subgroup(templates: dict, union: Annotation, dst: Annotation, k: int, key: tuple, region: Box, piece,
                   ctx: Resolution) -> list[Transfer]:
    """The BSR messages taking subgroup k of `union` to subgroup k of `dst`, `key` its frame.
    Moving subgroups share no sender, so each is planned alone (the senders' loads never meet),
    and one of the same frame planned before, on the same links, is moved onto this one
    (relabel.py). `templates`: frame -> (messages, devices, region, whether a message crosses a
    shared link)."""
    s, t = union.subgroups[k], dst.subgroups[k]
    devices = s.dg.devices + t.dg.devices
    if key in templates:
        transfers, template, region0, _ = templates[key]
        if relabel.same_links(template, devices, ctx.topology):
            return relabel.moved_transfers(transfers, dict(zip(template, devices)), region_shift(region0, region))
    owners = {d: piece(d).box for d in s.dg}
    family = TensorSlices(0, len(ctx.shape), owners, destination_needs(dst, ctx.shape, owners, t.dg))
    transfers = plan_transfers([family], ctx.topology, ctx.itemsize)
    templates.setdefault(key, (transfers, devices, region, relabel.crosses_shared_link(transfers, ctx.topology)))
    return list(transfers)


def crosses_shared_link(templates: dict, key: tuple) -> bool:
    """Whether the template of frame `key` (moved_subgroup) has a message over a shared link."""
    return templates[key][3]


__all__ = ["equalise_like", "left_out", "moved_subgroup", "moves_left_out", "moving_devices", "repeating"]
