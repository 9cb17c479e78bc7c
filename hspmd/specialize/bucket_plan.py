"""Gradient buckets, planned: which gradients one device all-reduces together, in what order.

A gradient joins buckets when its synchronisation plan is all-reduces alone in which every device
keeps its piece and the boxes it reduces tile that piece (Plan.why_not_all_reduces): data parallelism over whatever else splits
the gradient, HP -> HD,
either one all-reduce of each device's whole piece (the common case) or a split all-reduce
(pipelines of different TP degrees in a heterogeneous strategy: a device holding the whole gradient
reduces one box with each TP rank of the other pipeline). A member without a summand (a TP rank
whose replica of a norm weight's gradient another member counts) gives zeros. Each (all-reduce, box)
is a slot; slots are grouped by (all-reduce group, dtype) in the order the backward makes the
gradients, each bucket holding at most `cap_bytes` (a slot larger than the cap is a bucket by
itself), or less for a group whose gradients would fill fewer than MIN_BUCKETS buckets
(hspmd.comm_resolve.bucketing, which the simulator prices alike: otherwise a small model syncs in
one bucket after the whole backward). Every member of a group derives the same buckets with no
message: the predicate reads only the global plan, the order is the graph's, the sizes are the
plan's boxes. Every other gradient (a plan that moves or gathers pieces) keeps its plan in the
update program; `BucketPlan.kept` says which and why.

The plan is data a program can carry (`to_dict` / `from_dict`, hspmd.specialize.program);
hspmd.runtime.execution.buckets runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Mapping

import torch

from hspmd.annotations import device_pieces
from hspmd.backends.backend import Group
from hspmd.comm_resolve.bucketing import fill_buckets
from hspmd.errors import HSPMDError
from hspmd.limits import json_count, json_flag
from hspmd.specialize.executable import ExecutableGraph


@dataclass(frozen=True)
class BucketSlot:
    """One gradient in a bucket: the per-micro-batch tensor the backward makes (`tensor_id`), the
    update's comm node whose plan the bucket replaces (`sync_node_id`), its place in the buffer."""

    gradient: str
    tensor_id: int
    sync_node_id: int
    shape: tuple[int, ...]
    offset: int
    box: tuple[tuple[int, int], ...] | None = None  # within the device's piece; None: the whole piece
    zero: bool = False  # the device has no summand here (a replica another member counts): it gives zeros

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Gradients all-reduced together over `group` as one flat `dtype` buffer."""

    group: Group
    dtype: torch.dtype
    slots: tuple[BucketSlot, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketPlan:
    """One device's buckets, in the order they fill during the backward, and the gradients that
    keep their own plan (name, why)."""

    cap_bytes: int
    buckets: tuple[Bucket, ...]
    kept: tuple[tuple[str, str], ...]

    def to_dict(self) -> dict:
        return {"cap_bytes": self.cap_bytes, "kept": [list(k) for k in self.kept], "buckets": [
            {"group": list(b.group), "dtype": str(b.dtype).removeprefix("torch."), "slots": [
                {"gradient": s.gradient, "tensor": s.tensor_id, "sync": s.sync_node_id, "shape": list(s.shape),
                 "offset": s.offset, "box": None if s.box is None else [list(r) for r in s.box], "zero": s.zero}
                for s in b.slots]} for b in self.buckets]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "BucketPlan":
        """The plan written by to_dict; ValueError naming what is wrong."""
        buckets = []
        for i, b in enumerate(d["buckets"]):
            if b["dtype"] not in DTYPES:
                raise ValueError(f"bucket {i}: dtype {b['dtype']!r} is not one of {', '.join(DTYPES)}")
            slots = tuple(BucketSlot(str(s["gradient"]), json_count(s["tensor"], "tensor"), json_count(s["sync"], "sync"),
                                     tuple(json_count(n, "shape") for n in s["shape"]), json_count(s["offset"], "offset"),
                                     None if s["box"] is None else
                                     tuple((json_count(a, "box"), json_count(z, "box")) for a, z in s["box"]),
                                     json_flag(s["zero"], "zero")) for s in b["slots"])
            bucket = Bucket(tuple(json_count(m, "group") for m in b["group"]), DTYPES[b["dtype"]], slots)
            ends = [s.offset + s.numel for s in slots]
            if [s.offset for s in slots] != [0] + ends[:-1]:
                raise ValueError(f"bucket {i}: slots must follow one another from offset 0")
            buckets.append(bucket)
        return cls(json_count(d["cap_bytes"], "cap_bytes"), tuple(buckets), tuple((str(n), str(why)) for n, why in d["kept"]))


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plan_buckets(exe: ExecutableGraph, cap_bytes: int) -> BucketPlan:
    """This device's gradient buckets (see the module docstring); pure."""
    if cap_bytes <= 0:
        raise HSPMDError(f"the bucket cap must be positive, got {cap_bytes} bytes")
    graph, binding = exe.graph, exe.binding
    names = {t.node.id: name for name, t in graph.gradients.items()}
    readers: dict[int, int] = {}  # over the whole graph, so that every rank decides alike
    for node in graph.nodes:
        for t in node.inputs:
            readers[t.id] = readers.get(t.id, 0) + 1
    syncs = {ins.node.inputs[0].id: ins for ins in exe.update if ins.node.id in names and ins.node.opdef.is_comm}
    slots: dict[tuple[Group, torch.dtype], list[tuple[int, BucketSlot, int]]] = {}  # (position, slot, bytes)
    kept: list[tuple[str, str]] = []
    for position, ins in enumerate(exe.backward):
        for t in ins.node.outputs:
            sync = syncs.get(t.id)
            if sync is None or sync.role == "identity":
                continue
            name = names[sync.node.id]
            plan = exe.plan(sync.node, binding)
            reason = plan.why_not_all_reduces()
            if reason is None and ins.role != "compute":
                reason = f"the backward makes it with a {ins.role} instruction"
            if reason is None and readers.get(t.id, 0) != 1:
                reason = "something besides its synchronisation reads it"
            if reason is not None:
                kept.append((name, reason))
                continue
            piece = device_pieces(plan.src, plan.shape)[exe.device].box
            mine = [c for c in plan.steps[0].collectives if exe.device in c.devices]
            for c in mine:
                shape = tuple(b - a for a, b in c.box)
                box = None if len(mine) == 1 else tuple((a - p, b - p) for (a, b), (p, _) in zip(c.box, piece))
                nbytes = prod(shape) * torch.empty((), dtype=t.dtype).element_size()
                slot = BucketSlot(name, t.id, sync.node.id, shape, 0, box, exe.device in c.zero_inputs)
                slots.setdefault((c.devices, t.dtype), []).append((position, slot, nbytes))
    buckets = []
    for (group, dtype), chain in sorted(slots.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        for indices in fill_buckets([n for _, _, n in chain], cap_bytes):
            members, offset = [], 0
            for i in indices:
                members.append(replace(chain[i][1], offset=offset))
                offset += members[-1].numel
            buckets.append((chain[indices[-1]][0], Bucket(group, dtype, tuple(members))))
    buckets.sort(key=lambda pb: pb[0])
    return BucketPlan(cap_bytes, tuple(b for _, b in buckets), tuple(kept))


__all__ = ["Bucket", "BucketPlan", "BucketSlot", "plan_buckets"]
