"""Plans are data: ordered steps of primitives, each with its device groups and the boxes it moves.

One uniform step shape serves every primitive, so one executor runs them all:

* `Step.src` / `Step.dst`: the layouts before and after the step (intermediate annotations).
* `Step.collectives`: sub-collectives `Collective(kind, devices, box, parts, zero_inputs)` in a
  global order (every member runs the ones it is in, in this order, so blocking collectives on
  overlapping groups cannot deadlock). `box` is the global region acted on; for all_gather
  `parts[i]` is member i's input, for reduce_scatter `parts[i]` is member i's output (uneven and
  empty allowed); members in `zero_inputs` contribute zeros (a replica whose summand another
  member already contributes, or a member that only receives).
* `Step.transfers`: fused point-to-point messages `Transfer(src, dst, boxes, tensors)`: all boxes
  one device sends another in this step, in one message; src == dst is a local copy.
* `Step.assembled_on`: the devices that build their destination piece afresh (zeros, then the local
  copies, collective results and received boxes land in it). Any other device of the destination
  keeps its local tensor unchanged (an Identity for it).

A device's results are always clipped to its destination piece: no device allocates more than the
boxes it sends, receives or reduces, never the whole tensor unless its piece is the whole tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from operator import itemgetter
from typing import Iterable, Mapping

from hspmd.annotations import Annotation, Box, box_intersection, device_pieces, parse
from hspmd.comm_resolve.cost import DTYPE_SIZES, Traffic, collective_traffic, transfer_traffic
from hspmd.comm_resolve.render import fused_plan_text, plan_text
from hspmd.comm_resolve.slices import box_contains, box_volume
from hspmd.cluster import cluster_from_dict, cluster_to_dict
from hspmd.comm_resolve.topology import ClusterSpec
from hspmd.errors import HSPMDError, PlanError, ShapeError, error_line
from hspmd.json_fields import JsonField

PRIMITIVES = (
    "Identity", "LocalSplit", "SendRecv", "AllReduce", "ReduceScatter", "AllGather",
    "SplitAllReduce", "SplitReduceScatter", "SplitAllGather", "BatchedSendRecv",
)
COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
SCHEMA = "hspmd.plan/1"
FUSED_SCHEMA = "hspmd.fused-plan/1"


def _box_json(box: Box) -> list[list[int]]:
    return [[int(a), int(b)] for a, b in box]


class _Field(JsonField):
    """A value read from a plan's JSON and its path in the plan (for error messages)."""

    error_type = PlanError
    noun = "plan"


def _read(data: object, where: str, read):
    """`read` applied to `data` (from JSON), every mistake a PlanError naming the field."""
    return read(_Field(data, "", where))


def _loaded(text: str | bytes, where: str) -> object:
    try:
        return json.loads(text)
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise PlanError(f"{where}: not JSON ({exc})") from None


def _schema(f: _Field, schema: str) -> None:
    if f["schema"].value != schema:
        raise f["schema"].fail(f"expected {schema!r}")


def _annotation(f: _Field, rank: int | None = None) -> Annotation:
    """The annotation written in `f`, fitting a tensor of `rank` dims where given."""
    try:
        ann = parse(f.str())
        if rank is not None:
            ann.check_rank(rank)
    except HSPMDError as exc:
        raise f.error(error_line(exc)) from None
    return ann


def _dtype(f: _Field, default: str = "float32") -> str:
    return default if f.value is None else f.str(tuple(DTYPE_SIZES))


def _topology(f: _Field) -> ClusterSpec:
    try:
        return cluster_from_dict(f.value)
    except HSPMDError as exc:
        raise f.error(error_line(exc)) from None


def _read_collective(f: _Field) -> "Collective":
    zero = f.get("zero_inputs")
    return Collective(f["kind"].str(COLLECTIVE_KINDS), f["devices"].ints(), f["box"].box(),
                      tuple(p.box() for p in f["parts"].items()), () if zero.value is None else zero.ints())


def _read_transfer(f: _Field) -> "Transfer":
    return Transfer(f["src"].int(), f["dst"].int(), tuple(b.box() for b in f["boxes"].items()), f["tensors"].ints())


def _read_step(f: _Field, rank: int | None = None) -> "Step":
    subgroup, round_, repeats = f.get("subgroup"), f.get("round"), f.get("repeats")
    pairs = []
    for r in ([] if repeats.value is None else repeats.items()):
        if not (isinstance(r.value, list) and len(r.value) == 2):
            raise r.fail("expected [template devices, devices]")
        template, devices = r.items()
        pairs.append((template.ints(), devices.ints()))
    return Step(
        f["primitive"].str(PRIMITIVES), _annotation(f["src"], rank), _annotation(f["dst"], rank),
        tuple(_read_collective(c) for c in f["collectives"].items()),
        tuple(_read_transfer(t) for t in f["transfers"].items()), f["assembled_on"].ints(),
        None if subgroup.value is None else subgroup.int(), 0 if round_.value is None else round_.int(), tuple(pairs),
    )


def _read_plan(f: _Field) -> "Plan":
    _schema(f, SCHEMA)
    shape = f["shape"].ints()
    return Plan(_annotation(f["src"], len(shape)), _annotation(f["dst"], len(shape)), shape,
                tuple(_read_step(s, len(shape)) for s in f["steps"].items()), _topology(f["topology"]),
                _dtype(f.get("dtype")), _fallbacks(f.get("fallbacks")))


def _fallbacks(f: _Field) -> tuple[str, ...]:
    return () if f.value is None else tuple(x.str() for x in f.items())


def _read_fused_plan(f: _Field) -> "FusedPlan":
    _schema(f, FUSED_SCHEMA)
    common = f.get("dtype")
    default = "float32" if common.value in (None, "mixed") else _dtype(common)
    moves = []
    for m in f["tensors"].items():
        shape = m["shape"].ints()
        moves.append(TensorMove(_annotation(m["src"], len(shape)), _annotation(m["dst"], len(shape)), shape,
                                _dtype(m.get("dtype"), default)))
    steps = f["steps"].items()
    if len(steps) != 1:
        raise f["steps"].fail("expected one BatchedSendRecv step")
    failed = f.get("failed")
    return FusedPlan(tuple(moves), tuple(_read_transfer(t) for t in steps[0]["transfers"].items()),
                     _topology(f["topology"]), () if failed.value is None else failed.ints())


@dataclass(frozen=True)
class Collective:
    kind: str
    devices: tuple[int, ...]
    box: Box
    parts: tuple[Box, ...] = ()
    zero_inputs: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "devices": list(self.devices), "box": _box_json(self.box),
            "parts": [_box_json(p) for p in self.parts], "zero_inputs": list(self.zero_inputs),
        }

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "Collective.from_dict") -> "Collective":
        return _read(d, where, _read_collective)


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    boxes: tuple[Box, ...]
    tensors: tuple[int, ...]

    @property
    def elements(self) -> int:
        return sum(box_volume(b) for b in self.boxes)

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "boxes": [_box_json(b) for b in self.boxes],
                "tensors": list(self.tensors)}

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "Transfer.from_dict") -> "Transfer":
        return _read(d, where, _read_transfer)


@dataclass(frozen=True)
class Step:
    """One primitive of a plan. `assembled_on`: see the module docstring. `round`: steps of one round
    act on disjoint subgroups and may run side by side (the time estimate overlaps them); rounds
    run one after another. (Not the IR's forward/backward/update phase of a node.) `repeats`:
    (template devices, devices) pairs, in a plan resolved for some devices only: the step also
    runs, unlisted, on each `devices` as it runs on its `template` devices (renamed position by
    position, boxes moved to that subgroup's region; relabel.py), at the same cost."""

    primitive: str
    src: Annotation
    dst: Annotation
    collectives: tuple[Collective, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    assembled_on: tuple[int, ...] = ()
    subgroup: int | None = None
    round: int = 0
    repeats: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Who talks to whom: collective groups, then sender-receiver pairs; for a step without
        communication, the devices it acts on."""
        groups = list(dict.fromkeys(c.devices for c in self.collectives))
        groups += [(t.src, t.dst) for t in self.transfers if t.src != t.dst]
        if groups:
            return tuple(groups)
        if self.assembled_on:
            return (tuple(self.assembled_on),)
        sub = self.dst.subgroups[self.subgroup] if self.subgroup is not None else None
        return (tuple(sub.dg) if sub else self.dst.devices,)

    @property
    def messages(self) -> int:
        return sum(1 for t in self.transfers if t.src != t.dst)

    def traffic(self, topology: ClusterSpec, itemsize: int, tables: bool = True) -> Traffic:
        """Bytes and busy time of this step (`tables=False`: the times alone, see Traffic)."""
        traffic = Traffic(tables)
        for c in self.collectives:
            collective_traffic(traffic, topology, itemsize, c.kind, c.devices, c.box, c.parts)
        transfer_traffic(traffic, topology, itemsize, self.transfers)
        return traffic

    def to_dict(self) -> dict:
        out = {
            "primitive": self.primitive, "round": self.round, "subgroup": self.subgroup,
            "src": str(self.src), "dst": str(self.dst),
            "groups": [list(g) for g in self.groups],
            "collectives": [c.to_dict() for c in self.collectives],
            "transfers": [t.to_dict() for t in self.transfers],
            "assembled_on": list(self.assembled_on),
        }
        if self.repeats:
            out["repeats"] = [[list(template), list(devices)] for template, devices in self.repeats]
        return out

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "Step.from_dict") -> "Step":
        return _read(d, where, _read_step)


class _Stats:
    """Traffic summaries shared by single-tensor and fused plans (needs `_priced` and `_rounds`)."""

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @cached_property
    def _total(self) -> Traffic:
        total = Traffic()
        for t in self._traffics:
            for table, into in ((t.sent, total.sent), (t.received, total.received), (t.by_link, total.by_link),
                                (t.sent_by_link, total.sent_by_link)):
                for key, n in table.items():
                    into[key] += n
        return total

    def _with_all_devices(self, table) -> dict[int, int]:
        return {d: int(table.get(d, 0)) for d in self.devices}

    @property
    def bytes_sent(self) -> dict[int, int]:
        return self._with_all_devices(self._total.sent)

    @property
    def bytes_received(self) -> dict[int, int]:
        return self._with_all_devices(self._total.received)

    @property
    def bytes_by_link(self) -> dict[str, int]:
        return dict(sorted(self._total.by_link.items()))

    @property
    def bytes_sent_by_link(self) -> dict[int, dict[str, int]]:
        """{sender: {link class: bytes}} for every device that sends."""
        out: dict[int, dict[str, int]] = {}
        for (device, link), n in sorted(self._total.sent_by_link.items()):
            out.setdefault(device, {})[link] = n
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self._total.sent.values())

    @property
    def estimated_seconds(self) -> float:
        per_round: dict[int, float] = {}
        for round_, seconds in zip(self._rounds, self._seconds):
            per_round[round_] = max(per_round.get(round_, 0.0), seconds)
        return sum(per_round.values())

    @cached_property
    def _seconds(self) -> list[float]:
        """Each step's estimated time. Pricing keeps these numbers, not the steps' traffic tables
        (unless something asked for those already): a rank prices the plans it resolves, and
        keeping every table alive cost memory and garbage-collector walks at thousands of devices."""
        traffics = self.__dict__.get("_traffics")
        return [t.seconds for t in (self._priced(tables=False) if traffics is None else traffics)]

    @cached_property
    def _traffics(self) -> list[Traffic]:
        return self._priced()

    def _stats_dict(self) -> dict:
        return {
            "bytes_sent": {str(d): n for d, n in self.bytes_sent.items()},
            "bytes_received": {str(d): n for d, n in self.bytes_received.items()},
            "bytes_by_link": self.bytes_by_link,
            "estimated_seconds": self.estimated_seconds,
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


@dataclass(frozen=True, eq=True)
class Plan(_Stats):
    """How to turn a tensor laid out as `src` into `dst` (see the module docstring)."""

    src: Annotation
    dst: Annotation
    shape: tuple[int, ...]
    steps: tuple[Step, ...]
    topology: ClusterSpec
    dtype: str = "float32"
    # Where a tier of the resolver's decision order could not give its primitive and a later tier
    # made these steps: what and why, in order (not part of the plan's value: the steps are).
    fallbacks: tuple[str, ...] = field(default=(), compare=False)

    def _priced(self, tables: bool = True) -> list[Traffic]:
        return [s.traffic(self.topology, self.itemsize, tables) for s in self.steps]

    @property
    def _rounds(self) -> list[int]:
        return [s.round for s in self.steps]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.devices) | set(self.dst.devices)))

    @cached_property
    def left_out(self) -> frozenset[int]:
        """Devices whose steps the plan leaves out (Step.repeats; empty for a whole plan): resolved
        for some devices only, it holds their parts, its cost and, renamed, everyone's groups, but
        not every device's steps, nor every byte in its tables."""
        return frozenset(chain.from_iterable(map(itemgetter(1), chain.from_iterable(s.repeats for s in self.steps))))

    @property
    def reduction(self) -> str:
        """How the partial values of the plan's layouts combine (Annotation.reduction: one per
        plan, resolve refuses a plan between two reductions): every reducing collective and every
        partial destination's fill follow it."""
        return self.src.reduction if self.src.has_partial else self.dst.reduction

    def covers(self, devices: Iterable[int] | None) -> bool:
        """Whether the plan lists the steps of every one of `devices` (None: of every device)."""
        return not self.left_out if devices is None else self.left_out.isdisjoint(devices)

    @property
    def primitives(self) -> tuple[str, ...]:
        return tuple(s.primitive for s in self.steps)

    @property
    def messages(self) -> int:
        return sum(s.messages for s in self.steps)

    def collective_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every collective group the plan uses (for backends that must create groups up front)."""
        return tuple(dict.fromkeys(c.devices for s in self.steps for c in s.collectives))

    def step_seconds(self) -> list[float]:
        return list(self._seconds)

    def step_bytes(self) -> list[int]:
        return [sum(t.sent.values()) for t in self._traffics]

    def why_not_one_all_reduce(self) -> str | None:
        """None when every device's part of the plan is one all-reduce of exactly the piece it
        holds before and after (a gradient sync that can share a bucket with others, and that a
        simulator may price as part of one); otherwise what differs."""
        reason = self.why_not_all_reduces()
        if reason is not None:
            return reason
        seen: set[int] = set()
        for c in self.steps[0].collectives:
            if c.zero_inputs:
                return "its plan has an all_reduce with zero inputs"
            for d in c.devices:
                if d in seen:
                    return f"device {d} takes part in two all-reduces"
                seen.add(d)
        return None

    def why_not_all_reduces(self) -> str | None:
        """None when the plan is all-reduces alone in which every device keeps its piece and the
        boxes it reduces tile that piece: a plain or a split all-reduce (a gradient that pipelines
        of different TP degrees hold in different pieces), members without a summand giving
        zeros, which buckets can carry; otherwise what differs."""
        if self.left_out:
            return "its plan has a step per subgroup"
        if len(self.steps) != 1:
            return f"its plan has {len(self.steps)} steps"
        step = self.steps[0]
        if step.transfers:
            return "its plan moves pieces point to point"
        src, dst = device_pieces(self.src, self.shape), device_pieces(self.dst, self.shape)
        boxes: dict[int, list[Box]] = {}
        for c in step.collectives:
            if c.kind != "all_reduce":
                return f"its plan has a {c.kind}"
            for d in c.devices:
                if d not in src or d not in dst or src[d].box != dst[d].box:
                    return f"device {d}'s piece changes"
                if not box_contains(src[d].box, c.box) or any(box_intersection(c.box, b) is not None for b in boxes.get(d, ())):
                    return f"device {d} reduces a box outside its piece or twice"
                boxes.setdefault(d, []).append(c.box)
        if set(boxes) != set(self.src.devices) | set(self.dst.devices):
            return "some device of the plan takes part in no all-reduce"
        for d, mine in boxes.items():
            if sum(box_volume(b) for b in mine) != box_volume(src[d].box):
                return f"device {d}'s all-reduced boxes do not tile its piece"
        return None

    def explain(self) -> str:
        return plan_text(self)

    def __str__(self) -> str:
        return self.explain()

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "src": str(self.src), "dst": str(self.dst), "shape": list(self.shape),
            "dtype": self.dtype, "itemsize": self.itemsize, "topology": cluster_to_dict(self.topology),
            "steps": [
                {**s.to_dict(), "bytes": b, "estimated_seconds": t}
                for s, b, t in zip(self.steps, self.step_bytes(), self.step_seconds())
            ],
            **self._stats_dict(),
            **({"fallbacks": list(self.fallbacks)} if self.fallbacks else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "Plan.from_dict") -> "Plan":
        """The plan written by to_dict; PlanError naming the field that is wrong (`where` names the source)."""
        return _read(d, where, _read_plan)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "Plan.from_json") -> "Plan":
        return cls.from_dict(_loaded(text, where), where)


@dataclass(frozen=True)
class TensorMove:
    """One tensor of a fused reshard: its layouts before and after, its global shape and dtype."""

    src: Annotation
    dst: Annotation
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, eq=True)
class FusedPlan(_Stats):
    """One batched send-receive moving many tensors at once: one message per device pair. Each
    tensor keeps its own dtype (bf16 weights and fp32 optimizer states in one switch)."""

    moves: tuple[TensorMove, ...]
    transfers: tuple[Transfer, ...]
    topology: ClusterSpec
    failed: tuple[int, ...] = ()

    @property
    def dtype(self) -> str:
        """The tensors' common dtype, or "mixed"."""
        names = {m.dtype for m in self.moves}
        return names.pop() if len(names) == 1 else ("float32" if not names else "mixed")

    @property
    def itemsizes(self) -> tuple[int, ...]:
        """Bytes per element of each tensor."""
        return tuple(m.itemsize for m in self.moves)

    @property
    def itemsize(self) -> int:
        sizes = set(self.itemsizes)
        if len(sizes) > 1:
            raise ShapeError(f"the plan moves tensors of several dtypes ({self.dtype}); use itemsizes per tensor")
        return sizes.pop() if sizes else DTYPE_SIZES["float32"]

    def _priced(self, tables: bool = True) -> list[Traffic]:
        traffic = Traffic(tables)
        transfer_traffic(traffic, self.topology, self.itemsizes, self.transfers)
        return [traffic]

    @property
    def _rounds(self) -> list[int]:
        return [0]

    @property
    def devices(self) -> tuple[int, ...]:
        """The living devices taking part (failed ones are left out)."""
        return tuple(sorted({d for m in self.moves for d in m.src.devices + m.dst.devices} - set(self.failed)))

    @property
    def messages(self) -> int:
        return sum(1 for t in self.transfers if t.src != t.dst)

    def explain(self) -> str:
        return fused_plan_text(self)

    def __str__(self) -> str:
        return self.explain()

    def to_dict(self) -> dict:
        return {
            "schema": FUSED_SCHEMA, "dtype": self.dtype, "topology": cluster_to_dict(self.topology),
            "tensors": [{"src": str(m.src), "dst": str(m.dst), "shape": list(m.shape), "dtype": m.dtype}
                        for m in self.moves],
            "steps": [{"primitive": "BatchedSendRecv", "groups": [[t.src, t.dst] for t in self.transfers if t.src != t.dst],
                       "transfers": [t.to_dict() for t in self.transfers]}],
            "messages": self.messages,
            "failed": list(self.failed),
            **self._stats_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "FusedPlan.from_dict") -> "FusedPlan":
        """The plan written by to_dict; PlanError naming the field that is wrong (`where` names the source)."""
        return _read(d, where, _read_fused_plan)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "FusedPlan.from_json") -> "FusedPlan":
        return cls.from_dict(_loaded(text, where), where)


__all__ = ["COLLECTIVE_KINDS", "Collective", "FusedPlan", "PRIMITIVES", "Plan", "Step", "TensorMove", "Transfer"]
