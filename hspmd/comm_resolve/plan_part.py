"""A device's part of a plan: what one rank runs, cut from the whole plan (plan.py).

A plan names every device's collectives and messages; a rank runs only its own. `part_of(plan,
device)` keeps, per step, the device's source and destination pieces, the collectives it is a
member of (in the plan's global order), its local copies and its messages in the plan's message
rounds (worked out over the whole step, so that every device agrees on them: `message_rounds`),
whether the step builds the device's destination piece afresh and whether the step's results
cover that piece once (it then starts empty, not zero-filled). Steps in which the device does
nothing are left out. The plan executor (hspmd.backends.plan_executor) runs parts alone, so
running every device's part is running the plan.

Why: a part grows with the groups its device is in, not with the devices of the plan. A
data-parallel gradient plan over 256 subgroups is 256 steps; a device runs one of them. A rank's
program (hspmd.specialize.program) stores parts, so at thousands of ranks each names its own
peers only, and the executor's per-step work no longer walks every subgroup's steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from hspmd.annotations import REDUCTIONS, Annotation, Box, Piece, box_intersection, device_piece
from hspmd.comm_resolve.collectives import tiles
from hspmd.comm_resolve.plan import Collective, Plan, Step, Transfer
from hspmd.comm_resolve.slices import box_volume
from hspmd.disjoint_sets import DisjointSets
from hspmd.errors import CommunicationError
from hspmd.limits import json_count, json_flag

PART_SCHEMA = "hspmd.plan-part/1"
LABEL_CHARS = 160


@lru_cache(maxsize=4096)
def message_rounds(transfers: tuple[Transfer, ...]) -> tuple[tuple[Transfer, ...], ...]:
    """The messages (src != dst) in rounds where each device sends at most one and receives at
    most one, so a device stages at most one message each way at a time. Greedy in a fixed order
    (by ring distance, then sender), the same on every device; a cyclic shift pattern takes the
    fewest rounds. Messages run round by round, each round one batched exchange. Worked out per
    set of devices that exchange messages (a connected component), so that a device's rounds
    depend only on the messages of its own component: a plan resolved for some devices lists
    only their subgroups' messages (Step.repeats), and its devices must agree with the whole plan."""
    rounds: list[list[Transfer]] = []
    for component in _components([t for t in transfers if t.src != t.dst]):
        for i, round_ in enumerate(_greedy_rounds(component)):
            if i == len(rounds):
                rounds.append([])
            rounds[i] += round_
    return tuple(tuple(r) for r in rounds)


def _components(messages: list[Transfer]) -> list[list[Transfer]]:
    """The messages grouped by connected component of the devices they join, in order of first message."""
    linked = DisjointSets()
    for t in messages:
        linked.join((t.src, t.dst))
    groups: dict[int, list[Transfer]] = {}
    for t in messages:
        groups.setdefault(linked.find(t.src), []).append(t)
    return list(groups.values())


def _greedy_rounds(messages: list[Transfer]) -> list[list[Transfer]]:
    width = 1 + max(max(t.src, t.dst) for t in messages)
    rounds: list[list[Transfer]] = []
    busy: list[tuple[set, set]] = []
    for t in sorted(messages, key=lambda t: ((t.dst - t.src) % width, t.src, t.dst)):
        r = next((i for i, (out, into) in enumerate(busy) if t.src not in out and t.dst not in into), len(rounds))
        if r == len(rounds):
            rounds.append([])
            busy.append((set(), set()))
        rounds[r].append(t)
        busy[r][0].add(t.src)
        busy[r][1].add(t.dst)
    return rounds


Exchange = tuple[Transfer | None, Transfer | None]
"""(the message a device sends, the one it receives) in one message round; either may be None."""


def transfers_part(transfers: tuple[Transfer, ...], device: int) -> tuple[tuple[Transfer, ...], tuple[Exchange, ...]]:
    """(the device's local copies, its (send, receive) per message round it takes part in, in order)."""
    copies = tuple(t for t in transfers if t.src == device == t.dst)
    exchanges = []
    for round_ in message_rounds(transfers):
        send = next((t for t in round_ if t.src == device), None)
        receive = next((t for t in round_ if t.dst == device), None)
        if send is not None or receive is not None:
            exchanges.append((send, receive))
    return copies, tuple(exchanges)


@dataclass(frozen=True)
class StepPart:
    """One step of a plan as one device runs it (module docstring). `assembles`: the device builds
    its destination piece afresh (else it keeps its tensor and at most sends from it); `covered`:
    the collectives and messages write every element of that piece exactly once."""

    primitive: str
    src: Piece | None
    dst: Piece | None
    assembles: bool
    covered: bool = False
    collectives: tuple[Collective, ...] = ()
    copies: tuple[Transfer, ...] = ()
    exchanges: tuple[Exchange, ...] = ()

    def __str__(self) -> str:
        peers = [f"{c.kind}[{','.join(map(str, c.devices))}]" for c in self.collectives]
        peers += [f"{s.src}->{s.dst}" for s, _ in self.exchanges if s is not None]
        peers += [f"{r.src}->{r.dst}" for _, r in self.exchanges if r is not None]
        return self.primitive + (" " + " ".join(peers) if peers else " (local)")


@dataclass(frozen=True)
class PlanPart:
    """Device `device`'s part of a plan of a tensor of `shape`: the piece it is given (`src`,
    None: none), its steps, whether it ends holding a destination piece, every collective kind
    the whole plan uses (a max reduction runs on all-reduces alone, decided alike everywhere) and
    the layouts' text for messages (`source`, `destination`, cut to LABEL_CHARS)."""

    device: int
    shape: tuple[int, ...]
    dtype: str
    src: Piece | None
    holds_result: bool
    steps: tuple[StepPart, ...]
    collective_kinds: tuple[str, ...] = ()
    source: str = ""
    destination: str = ""
    reduction: str = "sum"

    @property
    def label(self) -> str:
        return f"{self.source} -> {self.destination}"

    def __str__(self) -> str:
        return f"{self.label} {list(self.shape)} {self.dtype}: " + (" ; ".join(map(str, self.steps)) or "nothing")

    def to_dict(self) -> dict:
        return {"schema": PART_SCHEMA, "device": self.device, "shape": list(self.shape), "dtype": self.dtype,
                "src": _piece_json(self.src), "holds_result": self.holds_result,
                "collective_kinds": list(self.collective_kinds), "source": self.source,
                "destination": self.destination, "reduction": self.reduction,
                "steps": [_step_json(s) for s in self.steps]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "PlanPart":
        """The part written by to_dict; ValueError naming what is wrong (a collective or message
        of another device, a piece that is not a box, an unknown schema)."""
        if d.get("schema") != PART_SCHEMA:
            raise ValueError(f"schema is {d.get('schema')!r}, expected {PART_SCHEMA!r}")
        device = json_count(d["device"], "device")
        part = cls(device, tuple(json_count(n, "shape") for n in d["shape"]), str(d["dtype"]), _piece_from(d["src"]),
                   json_flag(d["holds_result"], "holds_result"), tuple(_step_from(s) for s in d["steps"]),
                   tuple(str(k) for k in d["collective_kinds"]), str(d["source"]), str(d["destination"]),
                   str(d.get("reduction", "sum")))
        if part.reduction not in REDUCTIONS:
            raise ValueError(f"reduction is {part.reduction!r}, expected one of {', '.join(REDUCTIONS)}")
        for i, step in enumerate(part.steps):
            for c in step.collectives:
                if device not in c.devices:
                    raise ValueError(f"step {i} has a collective over {list(c.devices)} without device {device}")
            for send, receive in step.exchanges:
                if (send is not None and send.src != device) or (receive is not None and receive.dst != device):
                    raise ValueError(f"step {i} has a message of another device than {device}")
        return part


def part_of(plan: Plan, device: int) -> PlanPart:
    """`device`'s part of `plan` (module docstring); kept on the plan, which is immutable, so a
    rank running a plan every micro-batch cuts it once."""
    parts = plan.__dict__.setdefault("_parts", {})  # a cache beside the frozen fields, as cached_property keeps
    if device not in parts:
        if device in plan.left_out:
            raise CommunicationError(f"device {device}'s steps are left out of this plan of {_shortened(str(plan.src))} -> "
                                     f"{_shortened(str(plan.dst))}, resolved for other devices; resolve it for "
                                     f"device {device} (resolve(..., for_devices=[{device}]))")
        parts[device] = _cut(plan, device)
    return parts[device]


def _cut(plan: Plan, me: int) -> PlanPart:
    shape = plan.shape
    steps = []
    for step in plan.steps:
        if me not in step.assembled_on:  # it keeps its tensor (None where it holds no destination piece) and may send
            talks = any(me in (t.src, t.dst) and t.src != t.dst for t in step.transfers)
            exchanges = transfers_part(step.transfers, me)[1] if talks else ()
            if exchanges or me not in step.dst.device_set:  # pieces read only here: most steps of a
                # plan over hundreds of subgroups are another subgroup's, and the device skips them
                src, dst = piece_of(step.src, shape, me), piece_of(step.dst, shape, me)
                if exchanges or src != dst:  # it sends, or drops its piece; not another subgroup's step
                    steps.append(StepPart(step.primitive, src, dst, False, exchanges=exchanges))
            continue
        src, dst = piece_of(step.src, shape, me), piece_of(step.dst, shape, me)
        copies, exchanges = transfers_part(step.transfers, me)
        collectives = tuple(c for c in step.collectives if me in c.devices)
        if not collectives and keeps_own_piece(copies, exchanges, 0, src, dst):
            continue  # the device keeps its tensor: nothing to run
        steps.append(StepPart(step.primitive, src, dst, True, _covered(step, me, dst.box), collectives, copies,
                              exchanges))
    kinds = tuple(sorted({c.kind for s in plan.steps for c in s.collectives}))
    return PlanPart(me, shape, plan.dtype, piece_of(plan.src, shape, me), me in plan.dst.devices, tuple(steps),
                    kinds, _shortened(str(plan.src)), _shortened(str(plan.dst)), plan.reduction)


def _shortened(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def piece_of(ann: Annotation, shape: tuple[int, ...], device: int) -> Piece | None:
    """The device's piece of a layout (None: it holds none), from its own subgroup (device_piece)."""
    return device_piece(ann, shape, device)


def keeps_own_piece(copies: tuple[Transfer, ...], exchanges: tuple[Exchange, ...], tensor: int, src: Piece | None,
                    dst: Piece) -> bool:
    """The device's only part in `tensor` (an index of the transfers' tensors) is copying its whole
    piece to itself: it keeps its tensor."""
    moves = copies + tuple(t for pair in exchanges for t in pair if t is not None)
    mine = [(t, box) for t in moves for x, box in zip(t.tensors, t.boxes) if x == tensor]
    return (src is not None and src.box == dst.box and src.summand == dst.summand and len(mine) == 1
            and mine[0][0].src == mine[0][0].dst and mine[0][1] == dst.box)


def _covered(step: Step, me: int, dst: Box) -> bool:
    """The step's collectives and messages write every element of this device's destination piece
    exactly once: it then starts empty, not zero-filled."""
    regions = []
    for c in step.collectives:
        if me in c.devices:
            if c.kind == "all_reduce":
                regions.append(box_intersection(c.box, dst))
            elif c.kind == "all_gather":
                regions += [box_intersection(p, dst) for p in c.parts]
            else:
                regions.append(box_intersection(c.parts[c.devices.index(me)], dst))
    regions += [box_intersection(b, dst) for t in step.transfers if t.dst == me for b in t.boxes]
    return tiled(dst, regions)


def tiled(box: Box, regions) -> bool:
    """The non-empty regions tile `box` (an empty box needs nothing)."""
    return box_volume(box) == 0 or tiles(box, [r for r in regions if r is not None])


# ---- plain data ----------------------------------------------------------------------------------


def _piece_json(piece: Piece | None):
    return None if piece is None else {"box": [[a, b] for a, b in piece.box], "summand": list(piece.summand)}


def _piece_from(d) -> Piece | None:
    if d is None:
        return None
    box = tuple((json_count(a, "box"), json_count(b, "box")) for a, b in d["box"])
    if any(b < a for a, b in box):
        raise ValueError(f"piece box {[list(r) for r in box]} has a range that ends before it starts")
    return Piece(box, tuple(json_count(s, "summand") for s in d["summand"]))


def _step_json(s: StepPart) -> dict:
    return {"primitive": s.primitive, "src": _piece_json(s.src), "dst": _piece_json(s.dst), "assembles": s.assembles,
            "covered": s.covered, "collectives": [c.to_dict() for c in s.collectives],
            "copies": [t.to_dict() for t in s.copies],
            "exchanges": [[None if t is None else t.to_dict() for t in pair] for pair in s.exchanges]}


def _step_from(d: Mapping) -> StepPart:
    def transfer(t):
        return None if t is None else Transfer.from_dict(t)

    exchanges = []
    for pair in d["exchanges"]:
        send, receive = pair
        exchanges.append((transfer(send), transfer(receive)))
    step = StepPart(str(d["primitive"]), _piece_from(d["src"]), _piece_from(d["dst"]), json_flag(d["assembles"], "assembles"),
                    json_flag(d["covered"], "covered"), tuple(Collective.from_dict(c) for c in d["collectives"]),
                    tuple(Transfer.from_dict(t) for t in d["copies"]), tuple(exchanges))
    if step.assembles and step.dst is None:
        raise ValueError(f"a {step.primitive} step assembles a destination piece but names none")
    return step


__all__ = ["PART_SCHEMA", "Exchange", "PlanPart", "StepPart", "keeps_own_piece", "message_rounds", "part_of", "piece_of",
           "tiled", "transfers_part"]
