"""Pipeline discovery (paper section 5.4): which devices form which stage of which pipeline.

Start with one pipeline per device; devices joined by a collective share a stage; a P2P edge
(src -> dst) makes src's stage precede dst's. A pipeline is then a connected set of stages: the
minimal device set that runs one micro-batch's whole dataflow.

Inputs are the CommOps scheduled per micro-batch, forward direction only: the backward pass mirrors
the forward P2P edges in reverse and would only add cycles, and once-per-step communication
(gradient synchronisation between data-parallel pipelines, the initial parameter broadcast) must be
left out, since its collectives span pipelines and would merge them into one.

Valid stage graphs are DAGs: a chain is the usual pipeline, and a stage may feed several later
stages (a skip connection across stages, or two branches that join again); stages are returned in a
topological order with ties broken by smallest rank, and `links` keeps the exact edges. A cycle is
the only inconsistent pattern (one micro-batch's data would return to an earlier stage).
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from itertools import chain, repeat
from operator import itemgetter
from dataclasses import dataclass
from typing import Iterable

from hspmd.annotations import DeviceGroup
from hspmd.disjoint_sets import DisjointSets
from hspmd.errors import HSPMDError
from hspmd.specialize.strategy import Strategy

StageDevices = tuple[int, ...]


@dataclass(frozen=True)
class PipelineLayout:
    """Stages (sorted device tuples) in dataflow order and `links` = (producer, consumer) stage
    indices, sorted. Iterating, indexing and len() go over the stages."""

    stages: tuple[StageDevices, ...]
    links: tuple[tuple[int, int], ...]

    @classmethod
    def chain(cls, stages: Iterable[Iterable[int]]) -> "PipelineLayout":
        stages = tuple(tuple(sorted(s)) for s in stages)
        return cls(stages, _chain_links(len(stages)))

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted(d for s in self.stages for d in s))

    @property
    def is_chain(self) -> bool:
        return self.links == _chain_links(len(self.stages))

    def __len__(self) -> int:
        return len(self.stages)

    def __iter__(self):
        return iter(self.stages)

    def __getitem__(self, index: int) -> StageDevices:
        return self.stages[index]

    def __str__(self) -> str:
        arrows = " -> " if self.is_chain else " , "
        return arrows.join(str(DeviceGroup(s)) for s in self.stages)


@dataclass(frozen=True)
class CommPattern:
    """The per-micro-batch communication of a strategy: collective groups, forward P2P edges, and
    every device (a lone single-stage TP1 pipeline communicates with nobody)."""

    collective_groups: tuple[tuple[int, ...], ...]
    p2p_edges: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]


def _device_ids(values) -> bool:
    """Whether every value is a device id (in C: a pattern lists thousands)."""
    return set(map(type, values)) <= {int} and min(values, default=0) >= 0


def _check_devices(values: tuple, where: str) -> None:
    if _device_ids(values):
        return
    for value in values:
        if type(value) is not int or value < 0:  # a bool is not a device id
            raise HSPMDError(f"{where}: device ids must be non-negative integers, got {value!r}")


def _checked(groups: list[tuple], edges: list[tuple], devices: tuple) -> None:
    """Raise naming the first malformed group, edge or device (checked all at once when none is)."""
    if not (all(groups) and _device_ids(list(chain.from_iterable(groups)))):
        for i, members in enumerate(groups):
            _check_devices(members, f"collective group {i}")
            if not members:
                raise HSPMDError(f"collective group {i} is empty; a collective needs at least one device")
    if not (set(map(len, edges)) <= {2} and _device_ids(list(chain.from_iterable(edges)))):
        for i, edge in enumerate(edges):
            if len(edge) != 2:
                raise HSPMDError(f"P2P edge {i} is {edge!r}; give (src, dst) pairs")
            _check_devices(edge, f"P2P edge {i}")
    _check_devices(devices, "devices")


def _stage_classes(groups: list[tuple[int, ...]], edges: list[tuple[int, int]],
                   devices: tuple[int, ...]) -> tuple[dict[int, StageDevices], dict[int, int]]:
    """(the devices of each stage by its root, each device's root). Where no two groups share a
    device (the usual case: one tensor-parallel group per stage), each group is a stage, rooted
    at its first device, worked out in C; otherwise by union-find."""
    flat = list(chain.from_iterable(groups))
    if len(set(flat)) == len(flat):
        roots = [g[0] for g in groups]
        root_of = dict(zip(flat, chain.from_iterable(map(repeat, roots, map(len, groups)))))
        classes = dict(zip(roots, map(tuple, map(sorted, groups))))
        alone = set(chain.from_iterable(edges)).union(devices).difference(root_of)
        root_of.update(zip(alone, alone))
        classes.update(zip(alone, zip(alone)))
        return classes, root_of
    stages = DisjointSets()
    for members in groups:
        stages.join(members)
    for d in chain(chain.from_iterable(edges), devices):
        stages.add(d)
    return stages.classes()


def discover_pipelines(
    collective_groups: Iterable[Iterable[int]],
    p2p_edges: Iterable[tuple[int, int]],
    devices: Iterable[int] = (),
) -> tuple[PipelineLayout, ...]:
    """Pipelines from per-micro-batch communication (module docstring), ordered by smallest rank.
    `devices` adds devices that take part in no communication (each its own pipeline)."""
    groups, edges, devices = list(map(tuple, collective_groups)), list(map(tuple, p2p_edges)), tuple(devices)
    _checked(groups, edges, devices)
    classes, root_of = _stage_classes(list(dict.fromkeys(groups)), edges, devices)
    stage = root_of.__getitem__
    stage_edges = set(zip(map(stage, map(itemgetter(0), edges)), map(stage, map(itemgetter(1), edges))))
    stage_edges = [(a, b) for a, b in stage_edges if a != b]  # (thousands of device edges are mostly a few hundred stage edges)
    layouts = _chains(classes, stage_edges)
    if layouts is None:
        layouts = _dags(classes, stage_edges)
    return tuple(sorted(layouts, key=lambda p: min(map(itemgetter(0), p.stages))))


def _chains(classes: dict[int, StageDevices], stage_edges: list[tuple[int, int]]) -> list[PipelineLayout] | None:
    """The pipelines where every stage hands off to at most one stage and takes from at most one
    (the usual layout), each walked from its first stage without a sort; None where some stage
    has two successors or two predecessors, or where the stages form a cycle."""
    senders, receivers = list(map(itemgetter(0), stage_edges)), list(map(itemgetter(1), stage_edges))
    if len(set(senders)) < len(senders) or len(set(receivers)) < len(receivers):
        return None
    following = dict(stage_edges)
    layouts, walked = [], 0
    for head in set(classes).difference(receivers):
        order = [head]
        while order[-1] in following:
            order.append(following[order[-1]])
        walked += len(order)
        layouts.append(PipelineLayout(tuple(map(classes.__getitem__, order)), _chain_links(len(order))))
    return layouts if walked == len(classes) else None  # stages on no walk lie on a cycle


@lru_cache(maxsize=64)
def _chain_links(stages: int) -> tuple[tuple[int, int], ...]:
    return tuple((j, j + 1) for j in range(stages - 1))


def _dags(classes: dict[int, StageDevices], stage_edges: list[tuple[int, int]]) -> list[PipelineLayout]:
    """The pipelines of any stage graph: its connected components, each in topological order."""
    successors: dict[int, set[int]] = {root: set() for root in classes}
    neighbours: dict[int, set[int]] = {root: set() for root in classes}
    for a, b in stage_edges:
        successors[a].add(b)
        neighbours[a].add(b)
        neighbours[b].add(a)
    layouts = []
    seen: set[int] = set()
    for root in sorted(classes, key=lambda r: classes[r][0]):
        if root in seen:
            continue
        component, frontier = {root}, [root]
        while frontier:
            for n in neighbours[frontier.pop()] - component:
                component.add(n)
                frontier.append(n)
        seen |= component
        layouts.append(_order(component, successors, classes))
    return layouts


def _order(component: set[int], successors: dict[int, set[int]], classes: dict[int, StageDevices]) -> PipelineLayout:
    """Topological order of one pipeline's stages (ties: smallest rank first); raise on a cycle."""
    indegree = {n: 0 for n in component}
    for n in component:
        for m in successors[n]:
            indegree[m] += 1
    ready = [(classes[n][0], n) for n in component if indegree[n] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in successors[n]:
            indegree[m] -= 1
            if indegree[m] == 0:
                heapq.heappush(ready, (classes[m][0], m))
    if len(order) < len(component):
        raise HSPMDError(_cycle_message(set(component) - set(order), successors, classes))
    position = {n: k for k, n in enumerate(order)}
    links = sorted((position[n], position[m]) for n in order for m in successors[n])
    return PipelineLayout(tuple(classes[n] for n in order), tuple(links))


def _cycle_message(stuck: set[int], successors: dict[int, set[int]], classes: dict[int, StageDevices]) -> str:
    """Every stage left after a topological sort has a predecessor also left: walk back to a cycle."""
    predecessor = {m: n for n in sorted(stuck) for m in successors[n] if m in stuck}
    walk, n = [], min(stuck)
    while n not in walk:
        walk.append(n)
        n = predecessor[n]
    cycle = walk[walk.index(n):][::-1]
    first = min(range(len(cycle)), key=lambda k: classes[cycle[k]][0])
    cycle = cycle[first:] + cycle[:first]
    names = " -> ".join(str(DeviceGroup(classes[s])) for s in cycle + cycle[:1])
    return (
        f"P2P edges form a cycle between stages {names}: one micro-batch's forward dataflow cannot return "
        f"to an earlier stage. Pass only the forward-pass CommOps (the backward pass mirrors them) and leave "
        f"out once-per-step communication such as gradient synchronisation."
    )


def expected_pipelines(strategy: Strategy) -> tuple[PipelineLayout, ...]:
    """The layout a strategy declares, in discover_pipelines' order and form."""
    layouts = (PipelineLayout.chain(s.ranks for s in p.stages) for p in strategy.pipelines)
    return tuple(sorted(layouts, key=lambda p: p.devices[0]))


def comm_pattern(strategy: Strategy) -> CommPattern:
    """The per-micro-batch forward communication a Llama under `strategy` generates: one TP
    all-reduce group per stage with tp > 1 (attention/MLP outputs, vocab-parallel embedding and
    loss), and the activation hand-off between consecutive stages, where receiver j of the next
    TP group takes the whole activation from sender j mod |previous group| (the least-loaded BSR
    choice when every link is equal). Gradient sync between pipelines is once per step: excluded."""
    groups, edges = [], []
    for p in strategy.pipelines:
        for j, stage in enumerate(p.stages):
            if stage.tp > 1:
                groups.append(stage.ranks)
            if j > 0:
                senders = p.stages[j - 1].ranks
                edges.extend((senders[k % len(senders)], r) for k, r in enumerate(stage.ranks))
    return CommPattern(tuple(groups), tuple(edges), strategy.all_ranks)
