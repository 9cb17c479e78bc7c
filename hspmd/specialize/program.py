"""A device's program as plain data: what one rank needs to train, without the IR graph.

    program = device_program(exe, schedule=..., feeds=..., ...)   # from an ExecutableGraph
    text = program.to_json()                                       # one file per rank
    again = DeviceProgram.from_json(text)                          # in another process; == program
    print(again)                                                   # ops, plans, schedule, pieces

A program lists the tensors its ops touch (global shape under the program's binding, dtype, this
device's box, annotation text: each distinct text written once), its forward / backward /
update ops in execution order (kind, role, input and output tensor ids, attributes, the index of
the plan of a CommOp), this device's parts of the resolved plans (hspmd.comm_resolve.plan_part:
its own collectives and messages only, so that a program's size follows the groups its device is
in, not the size of the job), its parameter and optimizer-state
pieces with their boxes and initialisation keys, which tensors are accumulated over micro-batches,
the loss and gradient tensors, its pipeline stage and schedule order, which box of the
step's global batch each placeholder takes for every micro-batch, and its gradient buckets
(hspmd.specialize.bucket_plan). hspmd.runtime.programs.runner
interprets it, calling each op kind's compute function by name (hspmd.ops.registry).

A program is fixed to one binding of the run-time symbols: shapes and boxes are concrete, and a
symbolic scalar attribute (e.g. a loss scale 1/T) is evaluated under the binding when the program
is made. Steps whose micro-batches bind symbols anew (packed rows, Trainer.step_rows) are not
expressible as one program.

Loading checks everything it reads and raises ProgramError naming the file and the field
(`rank3.json: program field forward[3].inputs[1]: ...`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Sequence

import sympy

from hspmd.annotations import Box, device_piece
from hspmd.comm_resolve.plan_part import PlanPart, part_of
from hspmd.specialize.bucket_plan import BucketPlan
from hspmd.errors import HSPMDError
from hspmd.json_fields import JsonField
from hspmd.ir.dsl import name_seed
from hspmd.ir.graph import Node, Tensor
from hspmd.ir.init import initializer_from_key, initializer_key
from hspmd.ir.shapes import Binding
from hspmd.ops.registry import OPERATORS
from hspmd.specialize.executable import ExecutableGraph, Instruction, run_time_ratios
from hspmd.specialize.schedules import BACKWARD, FORWARD, Action, check_order

SCHEMA = "hspmd.program/2"
ROLES = ("leaf", "compute", "assign", "identity", "local", "collective", "send", "recv", "send+recv")
PHASES = ("forward", "backward", "update")


class ProgramError(HSPMDError):
    """A program file that is not a valid program; the message names the field."""


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorInfo:
    """A tensor one of the device's ops reads or writes."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    box: Box | None
    annotation: str


@dataclass(frozen=True)
class Op:
    """One instruction: run `kind`'s compute (or, for a CommOp, this device's part of plans[plan]).
    Also what an op's compute function reads of its node: `name`, `kind`, `attrs`."""

    name: str
    kind: str
    role: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    plan: int | None = None

    def __str__(self) -> str:
        ins = ", ".join(f"t{i}" for i in self.inputs)
        outs = ", ".join(f"t{o}" for o in self.outputs)
        attrs = "".join(f" {k}={v}" for k, v in self.attrs.items())
        plan = f" plan {self.plan}" if self.plan is not None else ""
        return f"{self.role:10s} {outs} = {self.kind}({ins}){attrs}{plan}  # {self.name}"


@dataclass(frozen=True)
class LeafPiece:
    """A parameter or optimizer state this device holds: its tensor (box in the tensor table) and
    how to make its piece (hspmd.ir.init: the initializer's key and the seed derived from the name)."""

    name: str
    kind: str
    tensor: int
    init: tuple[tuple[str, Any], ...]
    seed: int


@dataclass(frozen=True)
class Feed:
    """Placeholder `name` (tensor `tensor`) of one micro-batch: `box` of the step's global batch."""

    name: str
    tensor: int
    box: Box


@dataclass(frozen=True)
class PipelinePlace:
    """Where the device runs: its pipeline's stages, its stage, the batch subgroup (pipeline index
    of the micro-batch layout), the schedule's name and this stage's order of F/B actions;
    `recomputed`: the indices of the forward ops that run again before each backward (activation
    recomputation: only the others' values are kept between the two), empty when the stage keeps
    its activations."""

    stages: tuple[tuple[int, ...], ...]
    stage: int
    pipeline: int
    schedule: str
    order: tuple[Action, ...]
    recomputed: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DeviceProgram:
    """One device's whole training step under one strategy, as data (module docstring). An idle
    device (one the strategy leaves out) has no ops and no place. `loss`: the loss tensor if this
    device computes it; `loss_summand`: this device's value counts in the step loss (one holder
    per distinct piece); `step_loss`: the graph has a loss, so every device joins its sum;
    `buckets`: the gradients it all-reduces in buckets during the last backward (None: every
    gradient synchronises in the update)."""

    device: int
    graph: str
    strategy: int
    binding: Binding
    devices: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    tensors: tuple[TensorInfo, ...]
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    update: tuple[Op, ...]
    plans: tuple[PlanPart, ...]
    leaves: tuple[LeafPiece, ...]
    accumulated: tuple[int, ...]
    gradients: tuple[tuple[str, int], ...]
    loss: int | None
    loss_summand: bool
    step_loss: bool
    place: PipelinePlace | None
    feeds: tuple[tuple[Feed, ...], ...]
    global_batch: int
    buckets: BucketPlan | None = None

    @property
    def idle(self) -> bool:
        return self.place is None

    def tensor(self, tensor_id: int) -> TensorInfo:
        return self._tensors[tensor_id]

    @cached_property
    def _tensors(self) -> dict[int, TensorInfo]:
        return {t.id: t for t in self.tensors}

    # ---- text ----------------------------------------------------------------------------------

    def __str__(self) -> str:
        b = ", ".join(f"{k}={v}" for k, v in self.binding.values)
        lines = [f"program of device {self.device} (graph {self.graph}, strategy {self.strategy}, binding {b or '-'}"
                 f"{f', ratios {self.binding.ratios}' if self.binding.ratios else ''})"]
        if self.place is None:
            lines.append("  idle: the strategy leaves this device out")
            return "\n".join(lines)
        p = self.place
        lines.append(f"  stage {p.stage + 1} of {len(p.stages)} {list(map(list, p.stages))}, pipeline {p.pipeline}, "
                     f"{p.schedule}: {' '.join(map(str, p.order))}"
                     f"{f', recomputes {len(p.recomputed)} forward ops' if p.recomputed else ''}")
        lines.append(f"  tensors ({len(self.tensors)})")
        for t in self.tensors:
            lines.append(f"    t{t.id} {t.name} {list(t.shape)} {t.dtype} box {t.box and [list(r) for r in t.box]} "
                         f"{t.annotation}")
        for title, ops in (("forward", self.forward), ("backward", self.backward), ("update", self.update)):
            lines.append(f"  {title} ({len(ops)} ops)")
            lines.extend(f"    {op}" for op in ops)
        lines.append(f"  plans ({len(self.plans)})")
        lines.extend(f"    plan {i}: {part}" for i, part in enumerate(self.plans))
        lines.append(f"  leaves ({len(self.leaves)})")
        for leaf in self.leaves:
            init = ", ".join(f"{k}={v}" for k, v in leaf.init)
            lines.append(f"    {leaf.kind} {leaf.name} t{leaf.tensor} init {init} seed {leaf.seed}")
        return "\n".join(lines)

    # ---- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        def box(b):
            return None if b is None else [[a, z] for a, z in b]

        def ops(prog):
            return [{"name": o.name, "kind": o.kind, "role": o.role, "inputs": list(o.inputs), "outputs": list(o.outputs),
                     "attrs": _json_value(dict(o.attrs)), **({} if o.plan is None else {"plan": o.plan})} for o in prog]

        annotations = list(dict.fromkeys(t.annotation for t in self.tensors))  # a few texts shared by many tensors
        annotation_index = {a: i for i, a in enumerate(annotations)}
        place = None if self.place is None else {
            "stages": [list(s) for s in self.place.stages], "stage": self.place.stage, "pipeline": self.place.pipeline,
            "schedule": self.place.schedule, "order": [str(a) for a in self.place.order],
            "recomputed": list(self.place.recomputed),
        }
        return {
            "schema": SCHEMA, "device": self.device, "graph": self.graph, "strategy": self.strategy,
            "binding": {"symbols": dict(self.binding.values),
                        "ratios": None if self.binding.ratios is None else list(self.binding.ratios)},
            "devices": list(self.devices), "groups": [list(g) for g in self.groups],
            "annotations": annotations,
            "tensors": [{"id": t.id, "name": t.name, "shape": list(t.shape), "dtype": t.dtype, "box": box(t.box),
                         "annotation": annotation_index[t.annotation]} for t in self.tensors],
            "forward": ops(self.forward), "backward": ops(self.backward), "update": ops(self.update),
            "plans": [p.to_dict() for p in self.plans],
            "leaves": [{"name": l.name, "kind": l.kind, "tensor": l.tensor, "init": dict(l.init), "seed": l.seed}
                       for l in self.leaves],
            "accumulated": list(self.accumulated), "gradients": [[n, t] for n, t in self.gradients],
            "loss": self.loss, "loss_summand": self.loss_summand, "step_loss": self.step_loss, "place": place,
            "feeds": [[{"name": f.name, "tensor": f.tensor, "box": box(f.box)} for f in mb] for mb in self.feeds],
            "global_batch": self.global_batch,
            "buckets": None if self.buckets is None else self.buckets.to_dict(),
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "program") -> "DeviceProgram":
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProgramError(f"{where}: not JSON ({exc})") from None
        return cls.from_dict(data, where)

    @classmethod
    def from_dict(cls, data: object, where: str = "program") -> "DeviceProgram":
        return _read_program(_Field(data, "", where))


# ---- attributes ------------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    return value


def _frozen_attr(value: Any, binding: Binding, where: str) -> Any:
    """An attribute value as a program holds it: JSON scalars and tuples of them; a symbolic scalar
    becomes its value under `binding`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_frozen_attr(v, binding, where) for v in value)
    if isinstance(value, sympy.Basic):
        return binding.scalar(value, where)
    raise ProgramError(f"{where}: attribute value {value!r} ({type(value).__name__}) has no plain-data form")


# ---- building --------------------------------------------------------------------------------------


class GraphFacts:
    """What one binding makes of a specialized graph's tensors and ops, the same in every rank's
    program: each tensor's concrete shape, dtype name and annotation text, and each op's
    attributes as plain data. compile_programs works them out once for all ranks (per
    rank, they were most of compiling a job's programs)."""

    def __init__(self, exe: ExecutableGraph):
        self.deduced, self.binding = exe.deduced, exe.binding
        self._tensors: dict[int, tuple] = {}
        self._attrs: dict[int, dict] = {}

    def tensor(self, t: Tensor) -> tuple[tuple[int, ...], str, str]:
        """(shape, dtype name, annotation text) of `t`."""
        if t.id not in self._tensors:
            self._tensors[t.id] = (self.binding.shape(t.shape, t.name), _dtype_name(t.dtype), str(self.deduced[t]))
        return self._tensors[t.id]

    def box(self, t: Tensor, device: int) -> Box | None:
        """`device`'s piece of `t` (None: none), from its own subgroup (geometry.device_piece)."""
        ann = self.deduced[t]
        piece = device_piece(ann, self.tensor(t)[0], device, run_time_ratios(ann, self.binding))
        return None if piece is None else piece.box

    def attrs(self, n: Node) -> dict[str, Any]:
        if n.id not in self._attrs:
            self._attrs[n.id] = {k: _frozen_attr(v, self.binding, f"op {n.name} attribute {k}")
                                 for k, v in n.attrs.items()}
        return self._attrs[n.id]


def device_program(exe: ExecutableGraph, *, seed: int, place: PipelinePlace | None, feeds: Sequence[Sequence[Feed]],
                   global_batch: int, devices: Sequence[int], groups: Sequence[Sequence[int]],
                   loss: Tensor | None, loss_summand: bool, buckets: BucketPlan | None = None,
                   facts: GraphFacts | None = None) -> DeviceProgram:
    """The program of `exe`'s device under its binding. The caller (hspmd.runtime.programs.compiling)
    decides the pipeline place, feeds, loss holder and gradient buckets, as the Trainer does, and
    may share one GraphFacts of the same specialization among the programs it makes."""
    binding = exe.binding
    facts = GraphFacts(exe) if facts is None else facts
    tensors: dict[int, TensorInfo] = {}
    plans: dict[PlanPart, int] = {}

    def note(t: Tensor) -> int:
        if t.id not in tensors:
            shape, dtype, text = facts.tensor(t)
            tensors[t.id] = TensorInfo(t.id, t.name, shape, dtype, facts.box(t, exe.device), text)
        return t.id

    def op(ins: Instruction) -> Op:
        n = ins.node
        if n.kind not in OPERATORS:
            raise ProgramError(f"op {n.name}: kind {n.kind!r} is not in hspmd.ops.registry; programs call ops by kind")
        attrs = facts.attrs(n)
        index = None
        if n.opdef.is_comm and ins.role != "identity":
            index = plans.setdefault(part_of(exe.plan(n, binding), exe.device), len(plans))
        return Op(n.name, n.kind, ins.role, tuple(note(t) for t in n.inputs), tuple(note(t) for t in n.outputs),
                  attrs, index)

    forward, backward, update = (tuple(op(i) for i in prog) for prog in (exe.forward, exe.backward, exe.update))
    leaves = []
    for node in exe.held_leaves:
        key = initializer_key(node.init)
        if key is None:
            raise ProgramError(f"{node.kind} {node.name} has a custom initializer (code); a program can only name "
                               f"hspmd.ir.init's normal, uniform or constant")
        leaves.append(LeafPiece(node.name, node.kind, note(node.output), key, name_seed(node.name, seed)))
    gradients = tuple((name, t.id) for name, t in exe.graph.gradients.items() if t.id in tensors)
    return DeviceProgram(
        device=exe.device, graph=exe.graph.name, strategy=exe.strategy, binding=binding, devices=tuple(devices),
        groups=tuple(tuple(g) for g in groups), tensors=tuple(tensors[i] for i in sorted(tensors)),
        forward=forward, backward=backward, update=update, plans=tuple(plans), leaves=tuple(leaves),
        accumulated=tuple(t.id for t in exe.accumulated if t.id in tensors), gradients=gradients,
        loss=loss.id if loss is not None and loss.id in tensors else None, loss_summand=loss_summand,
        step_loss=loss is not None, place=place, feeds=tuple(tuple(mb) for mb in feeds), global_batch=global_batch,
        buckets=buckets,
    )


# ---- reading, with the field named in every error --------------------------------------------------


class _Field(JsonField):
    """A value read from a program file and its path in the program (for error messages)."""

    error_type = ProgramError
    noun = "program"


def _read_attr(f: _Field) -> Any:
    v = f.value
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return tuple(_read_attr(x) for x in f.items())
    raise f.fail("expected a JSON scalar or a list")


def _read_action(f: _Field) -> Action:
    text = f.str()
    if len(text) < 2 or text[0] not in (FORWARD, BACKWARD) or not text[1:].isascii() or not text[1:].isdigit():
        raise f.fail("expected an action such as F0 or B3")
    return Action(text[0], int(text[1:]))


def _read_ops(f: _Field, known: set[int], plans: int) -> tuple[Op, ...]:
    out = []
    for o in f.items():
        kind = o["kind"].str()
        if kind not in OPERATORS:
            raise o["kind"].fail("unknown op kind (hspmd.ops.registry)")
        refs = []
        for key in ("inputs", "outputs"):
            ids = o[key].ints()
            for i, t in enumerate(ids):
                if t not in known:
                    raise o[key].items()[i].error(f"tensor {t} is not in the tensor table")
            refs.append(ids)
        attrs = o["attrs"]
        if not isinstance(attrs.value, dict):
            raise attrs.fail("expected an object")
        plan = o.get("plan")
        index = None if plan.value is None else plan.int()
        if index is not None and index >= plans:
            raise plan.fail(f"expected a plan index below {plans}")
        role = o["role"].str(ROLES)
        if role in ("local", "collective", "send", "recv", "send+recv") and index is None:
            raise plan.error(f"a {role} CommOp needs its plan")
        out.append(Op(o["name"].str(), kind, role, refs[0], refs[1],
                      {k: _read_attr(attrs[k]) for k in attrs.value}, index))
    return tuple(out)


def _read_program(f: _Field) -> DeviceProgram:
    if f["schema"].value != SCHEMA:
        raise f["schema"].fail(f"expected {SCHEMA!r}")
    binding_f = f["binding"]
    symbols = binding_f["symbols"]
    if not isinstance(symbols.value, dict):
        raise symbols.fail("expected an object of symbol values")
    ratios = binding_f["ratios"]
    binding = Binding(tuple(sorted((k, symbols[k].int()) for k in symbols.value)),
                      None if ratios.value is None else ratios.ints(1))
    annotations = tuple(a.str() for a in f["annotations"].items())

    def annotation(g: _Field) -> str:
        i = g.int()
        if i >= len(annotations):
            raise g.fail(f"expected an index below {len(annotations)} into the annotations")
        return annotations[i]

    tensors = tuple(TensorInfo(t["id"].int(), t["name"].str(), t["shape"].ints(), t["dtype"].str(),
                               t["box"].box(optional=True), annotation(t["annotation"])) for t in f["tensors"].items())
    known = {t.id for t in tensors}
    if len(known) != len(tensors):
        raise f["tensors"].fail("tensor ids must be unique")
    plans = []
    for p in f["plans"].items():
        try:
            plans.append(PlanPart.from_dict(p.value))
        except (HSPMDError, KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise p.error(f"not a plan part ({type(exc).__name__}: {exc})") from None
        if plans[-1].device != f["device"].value:
            raise p["device"].fail(f"expected this program's device {f['device'].value}")
    ops = {phase: _read_ops(f[phase], known, len(plans)) for phase in PHASES}
    leaves = []
    for leaf in f["leaves"].items():
        init = leaf["init"]
        if not isinstance(init.value, dict):
            raise init.fail("expected an object")
        try:
            initializer_from_key(init.value)
        except HSPMDError as exc:
            raise init.error(str(exc)) from None
        tensor = leaf["tensor"].int()
        if tensor not in known:
            raise leaf["tensor"].fail("expected an id from the tensor table")
        leaves.append(LeafPiece(leaf["name"].str(), leaf["kind"].str(("parameter", "state")), tensor,
                                tuple(init.value.items()), leaf["seed"].int()))

    def tensor_id(g: _Field) -> int:
        t = g.int()
        if t not in known:
            raise g.fail("expected an id from the tensor table")
        return t

    gradients = []
    for g in f["gradients"].items():
        name, t = g.items() if isinstance(g.value, list) and len(g.value) == 2 else (None, None)
        if name is None:
            raise g.fail("expected [parameter name, tensor id]")
        gradients.append((name.str(), tensor_id(t)))
    loss = None if f["loss"].value is None else tensor_id(f["loss"])
    place_f = f["place"]
    place = None
    if place_f.value is not None:
        stages = tuple(s.ints() for s in place_f["stages"].items())
        stage = place_f["stage"].int()
        if stage >= len(stages):
            raise place_f["stage"].fail(f"expected a stage index below {len(stages)}")
        order = tuple(_read_action(a) for a in place_f["order"].items())
        try:
            check_order(order, len({a.micro_batch for a in order}))
        except HSPMDError as exc:
            raise place_f["order"].error(str(exc)) from None
        recomputed = () if place_f.get("recomputed").value is None else place_f["recomputed"].ints()
        if any(i >= len(ops["forward"]) for i in recomputed) or len(set(recomputed)) != len(recomputed):
            raise place_f["recomputed"].fail(f"expected distinct indices of the {len(ops['forward'])} forward ops")
        place = PipelinePlace(stages, stage, place_f["pipeline"].int(), place_f["schedule"].str(), order, recomputed)
    feeds = tuple(tuple(Feed(x["name"].str(), tensor_id(x["tensor"]), x["box"].box()) for x in mb.items())
                  for mb in f["feeds"].items())
    if place is not None and len(feeds) != len({a.micro_batch for a in place.order}):
        raise f["feeds"].fail(f"expected one list of feeds per micro-batch of the order ({len(place.order) // 2})")
    return DeviceProgram(
        device=f["device"].int(), graph=f["graph"].str(), strategy=f["strategy"].int(), binding=binding,
        devices=f["devices"].ints(), groups=tuple(g.ints() for g in f["groups"].items()), tensors=tensors,
        forward=ops["forward"], backward=ops["backward"], update=ops["update"], plans=tuple(plans), leaves=tuple(leaves),
        accumulated=tuple(tensor_id(a) for a in f["accumulated"].items()), gradients=tuple(gradients), loss=loss,
        loss_summand=f["loss_summand"].bool(), step_loss=f["step_loss"].bool(), place=place, feeds=feeds,
        global_batch=f["global_batch"].int(), buckets=_read_buckets(f["buckets"], known),
    )


def _read_buckets(f: _Field, known: set[int]) -> BucketPlan | None:
    if f.value is None:
        return None
    try:
        plan = BucketPlan.from_dict(f.value)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise f.error(f"not a bucket plan ({type(exc).__name__}: {exc})") from None
    for i, bucket in enumerate(plan.buckets):
        for slot in bucket.slots:
            if slot.tensor_id not in known:
                raise f.error(f"bucket {i}: gradient {slot.gradient} names tensor {slot.tensor_id}, which is not in "
                              f"the tensor table")
    return plan


__all__ = [
    "DeviceProgram", "Feed", "LeafPiece", "Op", "PipelinePlace", "ProgramError", "SCHEMA", "TensorInfo",
    "device_program",
]
