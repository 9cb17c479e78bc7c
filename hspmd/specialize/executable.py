"""Operator instantiation (paper section 5.3): one executable graph per device.

From the deduced graph, a device keeps the live ops whose tensors touch it (non-local operator
removal) and replaces each CommOp by the resolver's plan (CommOp substitution: top-tier plans run
on every device of the union, bottom-tier ones on each subgroup alone; the plan executor runs
only this device's part). Plans depend on concrete shapes, so they are resolved per binding of the
run-time symbols and cached.

The program is split the way a pipeline scheduler needs it:
    forward   ops of one micro-batch's forward pass on this device (its pipeline stage)
    backward  ops of one micro-batch's backward pass
    update    once per step: gradient synchronisation and optimizer ops
Each comm instruction knows whether it is a stage-to-stage transfer (P2P: send and/or receive
points), a collective, or local; a scheduler interleaves micro-batches by running forward(m) and
backward(m) in any order that keeps P2P pairs matched (run.py runs them against any Backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

from hspmd.annotations import Annotation, device_piece
from hspmd.errors import HSPMDError
from hspmd.ir.graph import Graph, Node, Tensor
from hspmd.ir.shapes import Binding, format_shape
from hspmd.specialize import comm_plans
from hspmd.specialize.deduce import Deduced


@dataclass(frozen=True)
class Instruction:
    """One step of a device program: run `node` locally, or this device's part of its comm plan.
    role: "leaf", "compute", "assign", "identity" (comm with equal layouts), "local" (comm that
    needs no peer), "collective", "send", "recv", "send+recv"."""

    node: Node
    role: str

    @property
    def is_p2p(self) -> bool:
        return self.role in ("send", "recv", "send+recv")

    def __str__(self) -> str:
        n = self.node
        ins = ", ".join(t.name for t in n.inputs)
        return f"{self.role:10s} {n.name} = {n.kind}({ins})"


def run_time_ratios(ann: Annotation, binding: Binding):
    """The binding's top-tier ratios, for an annotation that leaves them to run time."""
    return binding.ratios if isinstance(ann.hdim, int) and ann.ratios is None else None


def comm_args(deduced: Deduced, node: Node, binding: Binding, topology=None) -> tuple:
    """What the plan of a CommOp is a function of: the resolver's arguments (src, dst, concrete
    shape, run-time ratios of each, topology, dtype)."""
    src, dst = deduced[node.inputs[0]], deduced[node.output]
    return (src, dst, binding.shape(node.output.shape, node.name), run_time_ratios(src, binding),
            run_time_ratios(dst, binding), topology, node.output.dtype)


def resolve_node(deduced: Deduced, node: Node, binding: Binding, topology=None, cache: dict | None = None,
                 focus: frozenset[int] | None = None):
    """The plan of a CommOp under a binding (plans are global values, cached per binding),
    resolved for the devices `focus` (None: every device; resolve's for_devices). A cached plan
    serves when it covers them; one resolved for other devices is resolved again (and replaced).

    `cache` keeps each plan under two keys: (node id, binding), the quick hit for a node seen
    before, and the resolver's own arguments (src, dst, concrete shape, ratios, topology, dtype),
    so that CommOps resharding equal layouts of equal shapes (the same comm in each of a model's
    identical layers) share one plan. Sharing is safe: `resolve` is a pure function of exactly
    those arguments and plans are immutable values that name no node."""
    node_key = (node.id, binding)
    plan = None if cache is None else cache.get(node_key)
    if plan is not None and plan.covers(focus):
        return plan
    args = comm_args(deduced, node, binding, topology)
    plan = None if cache is None else cache.get(args)
    if plan is None or not plan.covers(focus):
        plan = comm_plans.resolve_comm(*args, for_devices=focus)
    if cache is not None:
        cache[node_key] = cache[args] = plan
    return plan


def live_nodes(graph: Graph, fetches: Iterable[Tensor] = ()) -> set[int]:
    """Ids of nodes needed for the step: assignments, losses, fetched tensors, and their inputs."""
    roots = [n for n in graph.nodes if n.kind == "assign"]
    roots += [t.node for t in graph.losses] + [t.node for t in fetches]
    live, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n.id in live:
            continue
        live.add(n.id)
        stack.extend(t.node for t in n.inputs)
    return live


def _node_tensors(node: Node) -> list[Tensor]:
    if node.kind == "assign":
        return [node.inputs[0]]
    return list(node.outputs) + ([node.inputs[0]] if node.opdef.is_comm else [])


def node_devices(node: Node, deduced: Deduced) -> frozenset[int]:
    tensors = _node_tensors(node)
    if len(tensors) == 1:
        return deduced.devices_of(tensors[0])
    return frozenset().union(*(deduced.devices_of(t) for t in tensors))


def runs_on(node: Node, deduced: Deduced, device: int) -> bool:
    """Whether `device` is in node_devices(node) (without building the union of large sets)."""
    return any(device in deduced.devices_of(t) for t in _node_tensors(node))


@dataclass
class ExecutableGraph:
    """The program of one device under one strategy (printable with str())."""

    device: int
    deduced: Deduced
    forward: tuple[Instruction, ...]
    backward: tuple[Instruction, ...]
    update: tuple[Instruction, ...]
    topology: object = None
    binding: Binding = field(default_factory=Binding)
    plans: dict = field(default_factory=dict, repr=False)
    focus: frozenset[int] | None = None  # the devices its plans are resolved for (None: every device)
    fetched: frozenset[int] = frozenset()  # ids of the tensors it was made to fetch (kept after the forward)
    _boxes: dict = field(default_factory=dict, repr=False)

    @property
    def graph(self) -> Graph:
        return self.deduced.graph

    @property
    def strategy(self) -> int:
        return self.deduced.strategy

    def instructions(self) -> tuple[Instruction, ...]:
        return self.forward + self.backward + self.update

    @cached_property
    def placeholders(self) -> tuple[Node, ...]:
        """(Kept: the programs are set once, by instantiate, and the runtime asks every step.)"""
        return tuple(i.node for i in self.forward + self.backward if i.node.kind == "placeholder")

    @property
    def held_leaves(self) -> tuple[Node, ...]:
        """Parameters and optimizer states this device keeps a piece of."""
        return tuple(i.node for i in self.instructions() if i.node.kind in ("parameter", "state"))

    @cached_property
    def accumulated(self) -> tuple[Tensor, ...]:
        """Per-micro-batch tensors the update phase reads: summed over the step's micro-batches."""
        mine = {i.node.id for i in self.forward + self.backward}
        out = {}
        for i in self.update:
            for t in i.node.inputs:
                if t.node.id in mine and t.node.kind not in ("parameter", "state"):
                    out[t.id] = t
        return tuple(out.values())

    def box(self, t: Tensor, binding: Binding):
        """This device's piece of `t` (global coordinates) under a binding; None if it holds none."""
        key = (t.id, binding)
        if key not in self._boxes:
            ann = self.deduced[t]
            shape = binding.shape(t.shape, t.name)
            piece = device_piece(ann, shape, self.device, run_time_ratios(ann, binding))
            self._boxes[key] = None if piece is None else piece.box
        return self._boxes[key]

    def plan(self, node: Node, binding: Binding):
        return resolve_node(self.deduced, node, binding, self.topology, self.plans, self.focus)

    def __str__(self) -> str:
        lines = [f"executable graph of device {self.device} (strategy {self.strategy}, graph {self.graph.name})"]
        for title, prog in (("forward", self.forward), ("backward", self.backward), ("update", self.update)):
            lines.append(f"  {title} ({len(prog)} instructions)")
            for ins in prog:
                n = ins.node
                anns = " ; ".join(str(self.deduced[t]) for t in n.outputs)
                line = f"    {ins}"
                if n.opdef.is_comm:
                    line += f"  {self.deduced[n.inputs[0]]} -> {anns}"
                    if ins.role != "identity":
                        try:
                            line += "  [" + comm_plans.describe_for(self.plan(n, self.binding), self.device) + "]"
                        except HSPMDError as exc:
                            line += f"  [unresolved: {exc}]"
                elif anns:
                    line += f"  {format_shape(n.outputs[0].shape)} {anns}"
                lines.append(line)
        return "\n".join(lines)


def instantiate(deduced: Deduced, device: int, binding: Binding = Binding(), topology: object = None,
                fetches: Iterable[Tensor] = (), live: set[int] | None = None,
                plans: dict | None = None) -> ExecutableGraph:
    """The executable graph of `device` (plans for comms are resolved under `binding`, for it)."""
    return instantiate_many(deduced, (device,), binding, topology, fetches, live, plans, focused=True)[device]


FEW_DEVICES = 8
"""Up to this many devices, instantiate_many asks each node whether each device runs it; beyond,
it intersects the chosen devices with each of the node's tensors' devices (each intersection
walks the smaller set), so a batch of ranks costs in proportion to its size, not the job's."""


def instantiate_many(deduced: Deduced, devices: Iterable[int], binding: Binding = Binding(), topology: object = None,
                     fetches: Iterable[Tensor] = (), live: set[int] | None = None,
                     plans: dict | None = None, focused: bool = False) -> dict[int, ExecutableGraph]:
    """The executable graph of each of `devices`, in one pass over the graph (a pass per device
    made compiling every rank's program grow with the job: each pass reads every node).
    `focused`: their plans are resolved for these devices alone (resolve's for_devices), so that
    a rank of a large job plans its own subgroups, not every data-parallel replica's; otherwise
    whole plans, which every device can share (and any later batch of devices reuses)."""
    graph = deduced.graph
    fetches = tuple(fetches)
    live = live_nodes(graph, fetches) if live is None else live
    plans = {} if plans is None else plans
    chosen = tuple(dict.fromkeys(devices))
    wanted = set(chosen)
    focus = frozenset(chosen) if focused else None
    programs = {d: {"forward": [], "backward": [], "update": []} for d in chosen}
    for node in graph.nodes:
        if node.id not in live:
            continue
        if len(chosen) <= FEW_DEVICES:
            on = [d for d in chosen if runs_on(node, deduced, d)]
        else:  # each intersection walks the smaller side: a node's devices or the chosen ones
            on = set().union(*(wanted & deduced.devices_of(t) for t in _node_tensors(node)))
        if not on:
            continue
        roles = None
        if node.opdef.is_comm:
            if deduced[node.inputs[0]] == deduced[node.output]:
                role = "identity"
            else:
                roles = comm_plans.roles_for(resolve_node(deduced, node, binding, topology, plans, focus), chosen)
        elif node.kind == "assign":
            role = "assign"
        else:
            role = "leaf" if node.opdef.is_leaf else "compute"
        for d in on:
            programs[d][node.phase].append(Instruction(node, role if roles is None else roles.get(d, "local")))
    fetched = frozenset(t.id for t in fetches)
    return {d: ExecutableGraph(d, deduced, *(tuple(programs[d][p]) for p in ("forward", "backward", "update")),
                               topology, binding, plans, focus, fetched) for d in chosen}


__all__ = [
    "ExecutableGraph", "Instruction", "comm_args", "instantiate", "instantiate_many", "live_nodes", "node_devices", "resolve_node",
    "run_time_ratios", "runs_on",
]
