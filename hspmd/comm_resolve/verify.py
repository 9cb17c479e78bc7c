"""Structural checks of a plan, without running it (e.g. for plans read back from JSON).

`check_plan` verifies what the executor relies on: consecutive steps chain, every box a device
reads lies in its source piece and every box it writes in its destination piece, each element of
a destination piece is written at most once (exactly once when the piece holds a value, not a
partial summand), and devices that do not rebuild keep an unchanged piece. In a plan resolved for
some devices, the devices a step leaves out (Step.repeats) have no listed collectives or messages:
their pieces are not checked, the listed template devices' are. `peak_elements` is the
largest buffer each device allocates, to check that no device materialises the whole tensor.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import combinations

from hspmd.annotations import Box, box_intersection, device_pieces
from hspmd.comm_resolve.plan import COLLECTIVE_KINDS, PRIMITIVES, Plan, Step
from hspmd.comm_resolve.slices import box_contains, box_volume
from hspmd.errors import CommunicationError


def _fail(index: int, step: Step, message: str) -> CommunicationError:
    return CommunicationError(f"plan step {index + 1} ({step.primitive} {step.src} -> {step.dst}) is inconsistent: {message}")


def _writes(step: Step, shape) -> dict[int, list[Box]]:
    dp = device_pieces(step.dst, shape)
    out: dict[int, list[Box]] = defaultdict(list)
    for c in step.collectives:
        regions = [c.box] if c.kind == "all_reduce" else list(c.parts) if c.kind == "all_gather" else []
        for m in c.devices:
            if c.kind == "reduce_scatter":
                regions = [c.parts[c.devices.index(m)]]
            for r in regions:
                common = box_intersection(r, dp[m].box)
                if common is not None:
                    out[m].append(common)
    for t in step.transfers:
        out[t.dst].extend(b for b in t.boxes if box_volume(b) > 0)
    return out


def check_step(index: int, step: Step, shape) -> None:
    left_out = {d for _, devices in step.repeats for d in devices}
    if step.primitive not in PRIMITIVES:
        raise _fail(index, step, f"unknown primitive {step.primitive!r}")
    sp, dp = device_pieces(step.src, shape), device_pieces(step.dst, shape)
    assembled_on = set(step.assembled_on)
    for c in step.collectives:
        if c.kind not in COLLECTIVE_KINDS:
            raise _fail(index, step, f"unknown collective kind {c.kind!r}")
        if not set(c.devices) <= assembled_on:
            raise _fail(index, step, f"{c.kind} members {list(c.devices)} must all rebuild their piece")
        for i, m in enumerate(c.devices):
            limit = max(box_volume(sp[m].box) if m in sp else 0, box_volume(dp[m].box) if m in dp else 0)
            if box_volume(c.box) > limit:
                raise _fail(index, step, f"{c.kind} over {c.box} on device {m} is larger than its pieces")
            if m in c.zero_inputs:
                continue
            reads = [c.parts[i]] if c.kind == "all_gather" else [c.box]
            for r in reads:
                if box_volume(r) and (m not in sp or not box_contains(sp[m].box, r)):
                    raise _fail(index, step, f"{c.kind} reads {r} on device {m}, outside its source piece")
    for t in step.transfers:
        if t.dst not in assembled_on:
            raise _fail(index, step, f"device {t.dst} receives but does not rebuild its piece")
        for b in t.boxes:
            if box_volume(b) == 0:
                continue
            if t.src not in sp or not box_contains(sp[t.src].box, b):
                raise _fail(index, step, f"device {t.src} sends {b}, outside its source piece")
            if not box_contains(dp[t.dst].box, b):
                raise _fail(index, step, f"device {t.dst} receives {b}, outside its destination piece")
    for d, piece in dp.items():
        if d not in assembled_on and d not in left_out and (d not in sp or sp[d] != piece):
            raise _fail(index, step, f"device {d} keeps its tensor but its piece changes")
    writes = _writes(step, shape)
    for d, boxes in writes.items():
        for a, b in combinations(boxes, 2):
            if box_intersection(a, b) is not None:
                raise _fail(index, step, f"device {d} writes {box_intersection(a, b)} twice")
        written = sum(box_volume(b) for b in boxes)
        if not dp[d].is_partial and written != box_volume(dp[d].box):
            raise _fail(index, step, f"device {d} writes {written} of the {box_volume(dp[d].box)} elements it needs")
    for d in assembled_on:
        if d in dp and d not in left_out and not dp[d].is_partial and box_volume(dp[d].box) and not writes.get(d):
            raise _fail(index, step, f"device {d} assembled_on its piece but nothing is written to it")


def check_plan(plan: Plan) -> None:
    """Raise CommunicationError naming the first inconsistent step."""
    if not plan.steps:
        raise CommunicationError(f"plan {plan.src} -> {plan.dst} has no steps")
    if plan.steps[0].src != plan.src or plan.steps[-1].dst != plan.dst:
        raise CommunicationError(f"plan {plan.src} -> {plan.dst}: its steps do not start at src and end at dst")
    for i, (a, b) in enumerate(zip(plan.steps, plan.steps[1:])):
        if a.dst != b.src:
            raise _fail(i, a, f"its result {a.dst} is not the next step's source {b.src}")
    for i, step in enumerate(plan.steps):
        check_step(i, step, plan.shape)


def peak_elements(plan: Plan) -> dict[int, int]:
    """The largest single buffer (piece, collective box, message) each device allocates."""
    peak: dict[int, int] = defaultdict(int)
    for step in plan.steps:
        for ann in (step.src, step.dst):
            for d, piece in device_pieces(ann, plan.shape).items():
                peak[d] = max(peak[d], box_volume(piece.box))
        for c in step.collectives:
            for m in c.devices:
                peak[m] = max(peak[m], box_volume(c.box))
        for t in step.transfers:
            for d in (t.src, t.dst):
                peak[d] = max(peak[d], t.elements)
    return dict(peak)


__all__ = ["check_plan", "check_step", "peak_elements"]
