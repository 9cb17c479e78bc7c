"""specialize_graph(): deduction + per-device executable graphs + pipeline discovery, as one value.

    spec = specialize_graph(graph, strategy=0, binding=Binding.of({"B": 4, "S": 8, "T": 64}, ratios=(2, 1)))
    print(spec)                   # pipelines, then each device's program
    spec.executables[3]           # one device's ExecutableGraph
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Sequence

from hspmd.comm_resolve import relabel
from hspmd.errors import HSPMDError
from hspmd.ir.graph import Graph, Tensor
from hspmd.ir.shapes import Binding
from hspmd.specialize import comm_plans
from hspmd.specialize.deduce import Deduced, deduce
from hspmd.specialize.executable import ExecutableGraph, comm_args, instantiate_many, live_nodes, resolve_node
from hspmd.gc_pause import collector_paused
from hspmd.specialize.pipelines import PipelineLayout, discover_pipelines


@dataclass
class Specialized:
    """A graph specialized under one strategy: annotations, device programs, pipelines."""

    deduced: Deduced
    executables: dict[int, ExecutableGraph]
    pipelines: tuple[PipelineLayout, ...]
    binding: Binding
    topology: object = None
    live: set[int] | None = field(default=None, repr=False)  # the nodes the fetches need (None: the graph's)
    plans: dict = field(default_factory=dict, repr=False)  # resolved CommOps, shared by every executable

    @property
    def graph(self) -> Graph:
        return self.deduced.graph

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(self.executables))

    @cached_property
    def _places(self) -> dict[int, tuple[int, int]]:
        """device -> (pipeline index, stage index), built once: compiling every rank's program
        asks for each of thousands of ranks."""
        return {d: (i, j) for i, p in enumerate(self.pipelines) for j, stage in enumerate(p.stages) for d in stage}

    def instantiate(self, devices: Iterable[int]) -> dict[int, ExecutableGraph]:
        """More devices' executable graphs (not kept in `executables`), their plans resolved for
        them (instantiate_many's `focused`): a job's compiler makes its ranks' batch by batch."""
        return instantiate_many(self.deduced, devices, self.binding, self.topology, live=self.live, plans=self.plans,
                                focused=True)

    def locate(self, device: int) -> tuple[int, int]:
        """(pipeline index, stage index) of `device`."""
        if device not in self._places:
            raise HSPMDError(f"device {device} is in no pipeline of this specialization")
        return self._places[device]

    def __str__(self) -> str:
        lines = [f"graph {self.graph.name} under strategy {self.deduced.strategy}: "
                 f"{len(self.executables)} devices, {len(self.pipelines)} pipeline(s)"]
        for i, p in enumerate(self.pipelines):
            lines.append(f"  pipeline {i}: {p}")
        for d in self.devices:
            lines.append(str(self.executables[d]))
        return "\n".join(lines)


def all_devices(deduced: Deduced) -> tuple[int, ...]:
    distinct = {id(s): s for s in (deduced.devices_of(t) for t in deduced.graph.tensors)}  # shared sets once
    return tuple(sorted(frozenset().union(*distinct.values())))


def per_micro_batch_pattern(deduced: Deduced, binding: Binding, live: set[int], topology=None, cache=None):
    """(collective groups, P2P edges, devices) of the forward-phase CommOps: what pipeline
    discovery reads (backward mirrors forward; update-phase comms span pipelines once a step).

    A rank reads every stage's CommOps but holds the plans of its own only. Another stage's
    CommOp that is one already read up to an order-preserving renaming of devices (the same comm
    of the next stage's layers) takes that pattern renamed instead of a plan of its own, where the
    renaming keeps links (relabel.canonical; tests/test_specialize_fast_path.py compares both).
    The plans the rank holds are read first, so that another stage's CommOp is renamed from one
    of them rather than resolved; the pattern lists keep the graph's order."""
    comms: dict[tuple, object] = {}  # resolver arguments -> the first CommOp with them (shared plans count once)
    for node in deduced.graph.nodes:
        if node.phase != "forward" or not node.opdef.is_comm or node.id not in live:
            continue
        if deduced[node.inputs[0]] != deduced[node.output]:
            comms.setdefault(comm_args(deduced, node, binding, topology), node)
    read: dict[tuple, tuple] = {}  # canonical reshard -> (its devices, pattern)
    held_first = sorted(comms, key=lambda args: cache is None or args not in cache)  # stable
    found = {args: _pattern_of(deduced, comms[args], binding, topology, cache, args, read) for args in held_first}
    groups, edges = [], []
    for args in comms:
        groups += found[args][0]
        edges += found[args][1]
    return groups, edges


def _pattern_of(deduced: Deduced, node, binding: Binding, topology, cache, args: tuple, read: dict):
    """The pattern of one CommOp: of its plan where this rank holds it (or must resolve it), else
    of one read before renamed onto its devices. Every pattern read is kept in `read`."""
    held = None if cache is None else cache.get(args)
    key, devices = None, ()
    if relabel.keeps_links(topology):
        shape_key, devices = relabel.canonical(args[0], args[1])
        key = (shape_key,) + args[2:5] + args[6:]
        if held is None and key in read:
            template, found = read[key]
            return comm_plans.renamed(found, template, devices)
    if held is None:  # any devices' plan gives the whole pattern (comm_plans: left-out subgroups renamed)
        held = resolve_node(deduced, node, binding, topology, cache, frozenset())
    found = comm_plans.pattern(held)
    if key is not None:
        read.setdefault(key, (devices, found))
    return found


def specialize_graph(graph: Graph, strategy: int = 0, binding: Binding | None = None, devices: Iterable[int] | None = None,
               topology=None, fetches: Sequence[Tensor] = (), deduced: Deduced | None = None) -> Specialized:
    """Deduce, instantiate one executable graph per device (all devices of the strategy unless
    `devices` is given), resolve CommOps under `binding`, and discover the pipelines. Given
    `devices`, the plans are resolved for them alone (instantiate_many's `focused`: a rank of a
    large job plans its own subgroups). The graph and everything older stay out of the cyclic
    collector's walks meanwhile (gc_pause.py)."""
    binding = binding or Binding()
    with collector_paused():
        deduced = deduced or deduce(graph, strategy)
        live = live_nodes(graph, fetches)
        every = all_devices(deduced)
        chosen = every if devices is None else tuple(devices)
        plans: dict = {}
        executables = instantiate_many(deduced, chosen, binding, topology, fetches, live, plans, devices is not None)
        groups, edges = per_micro_batch_pattern(deduced, binding, live, topology, plans)
        pipelines = discover_pipelines(groups, edges, every)
    return Specialized(deduced, executables, pipelines, binding, topology, live, plans)


__all__ = ["Specialized", "all_devices", "per_micro_batch_pattern", "specialize_graph"]
