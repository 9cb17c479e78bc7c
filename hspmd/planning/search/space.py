"""What every strategy search shares: the problem, the candidate layouts, one objective, and how a
layout becomes a trainable `Strategy` (a `PlannedStrategy`).

A *layout* is `d` identical pipelines, each a chain of stages (device type, TP degree, layer count,
recompute flag, CP degree), with `global_batch / d` micro-batches of one sample per pipeline. A
stage is HetAuto's intra-stage (c, t) (HetAuto §2.2.1, §4.1): `cp` context-parallel groups of `tp`
devices of one type (its principle P2: CP and TP never cross device types), all inside one node;
each device computes 1/cp of the sequence and passes K/V around (the cost model's `context_time`). The searches
(exhaustive, dp, dfs, mcts) differ in which layouts they visit, never in how one is priced:

    T = sum_i (t_i + 2 c_i) + (M - 1) * max(max_i t_i, max_i c_i) + sync(d)

t_i: stage i's forward + backward per micro-batch, c_i: the activation transfer to stage i + 1,
M micro-batches: the pipeline formula (`planning.simulator.pipeline_time`, HAPT eq. 13, H2's
alpha = 1 cost; what it bounds is said there). sync(d) is the gradient all-reduce
across the d pipelines (and the CP groups, which hold the same parameters) plus the optimizer
update, priced from the *average* per-device parameter share (approximate: it ignores which stage
holds more, so it does not depend on the layer split, and takes the pipeline's largest CP degree
for every stage).
Memory: stage i holds its parameters and optimizer states plus min(S - i, M) micro-batches of
activations (1F1B's in-flight count), which must fit the device.

Costs come from an `Evaluator` (per-stage time, memory, link and sync costs): `TableEvaluator`
reads profile tables (per device type and TP degree), as HAPT and H2 plan from profiles. A problem
offers CP degrees only where its evaluator prices them (`Problem.cp_degrees`; default none:
`CostModelEvaluator` prices them, `costed.context_degrees` says which pay their search).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Mapping, Protocol, Sequence

from hspmd.errors import HSPMDError
from hspmd.limits import brief
from hspmd.planning.ranks import DevicePool, RankAssignmentError, assign_ranks
from hspmd.planning.search.schedule_choice import choose_schedule
from hspmd.planning.simulator import pipeline_time
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_text import format_strategy


class PlanningError(HSPMDError):
    """A search problem is malformed or has no feasible strategy."""


class Evaluator(Protocol):
    """Costs of one micro-batch (one sample) for the searches; every method is pure. A stage's
    time is affine in its layers (layers x one layer's time + non-negative first/last extras): the
    searches' lower bounds rely on it. `cp`: the stage's context-parallel degree (the searches pass
    it only above 1, through `StagePlan.time` / `.memory`, so an evaluator that prices no CP
    needs no such argument). The sync's `pipeline_devices`: per device type, the devices of one CP
    group of each stage of a pipeline (its parameter shards), each shard held by `dp` pipelines
    times `cp` CP groups."""

    def stage_time(self, device_type: str, tp: int, layers: int, recompute: bool, first: bool, last: bool,
                   cp: int = 1) -> float: ...

    def stage_memory(self, device_type: str, tp: int, layers: int, recompute: bool, first: bool, last: bool,
                     inflight: int, dp: int, cp: int = 1) -> float: ...

    def capacity(self, device_type: str) -> float: ...

    def link_time(self, src_type: str, dst_type: str) -> float: ...

    def sync_time(self, dp: int, pipeline_devices: Mapping[str, int], cp: int = 1) -> float: ...


def _cp(cp: int) -> dict[str, int]:
    return {"cp": cp} if cp > 1 else {}


def sync_time_of(evaluator: Evaluator, stages: Sequence["StagePlan"], dp: int, per_pipeline: float = 1.0) -> float:
    """The gradient sync of `dp` pipelines of `stages` (one CP group of each stage holds the
    pipeline's parameter shards; `per_pipeline` scales the device counts, for strategies whose
    pipelines differ)."""
    devices: dict[str, float] = {}
    for s in stages:
        devices[s.device_type] = devices.get(s.device_type, 0) + s.tp * per_pipeline
    return evaluator.sync_time(dp, devices, **_cp(max((s.cp for s in stages), default=1)))


@dataclass(frozen=True)
class TableEvaluator:
    """Profile tables: `layer_time[(type, tp)]` = forward + backward seconds of one layer for one
    sample; recompute adds `forward_share` of it (one more forward). Memory per device:
    `layer_state_bytes / tp` per layer (weights, gradients, optimizer states), plus per in-flight
    micro-batch `layer_activation_bytes / tp` per layer (`recompute_activation_share` of that with
    recompute). `first_extra`/`last_extra`: (seconds, bytes) of the embedding / LM head at TP 1
    (divided by tp). `links[(src, dst)]` (or `default_link`): one activation transfer.
    `sync_bytes`: the model's gradient bytes, all-reduced across pipelines at `sync_bandwidth`."""

    layer_time: Mapping[tuple[str, int], float]
    capacities: Mapping[str, float]
    layer_state_bytes: float = 0.0
    layer_activation_bytes: float = 0.0
    forward_share: float = 1 / 3
    recompute_activation_share: float = 0.125
    first_extra: tuple[float, float] = (0.0, 0.0)
    last_extra: tuple[float, float] = (0.0, 0.0)
    links: Mapping[tuple[str, str], float] = field(default_factory=dict)
    default_link: float = 0.0
    sync_bytes: float = 0.0
    sync_bandwidth: float = math.inf

    def stage_time(self, device_type, tp, layers, recompute, first, last, cp=1):
        _no_cp(cp)
        key = (device_type, tp)
        if key not in self.layer_time:
            raise PlanningError(f"profile table has no layer time for {device_type} at TP {tp}")
        per_layer = self.layer_time[key] * (1 + (self.forward_share if recompute else 0.0))
        extra = (self.first_extra[0] if first else 0.0) + (self.last_extra[0] if last else 0.0)
        return layers * per_layer + extra / tp

    def stage_memory(self, device_type, tp, layers, recompute, first, last, inflight, dp, cp=1):
        _no_cp(cp)
        act = self.layer_activation_bytes * (self.recompute_activation_share if recompute else 1.0)
        extra = (self.first_extra[1] if first else 0.0) + (self.last_extra[1] if last else 0.0)
        return (layers * (self.layer_state_bytes + inflight * act) + extra) / tp

    def capacity(self, device_type):
        return self.capacities[device_type]

    def link_time(self, src_type, dst_type):
        return self.links.get((src_type, dst_type), self.default_link)

    def sync_time(self, dp, pipeline_devices, cp=1):
        _no_cp(cp)
        if dp == 1 or not self.sync_bytes:
            return 0.0
        share = self.sync_bytes / sum(pipeline_devices.values())
        return 2 * (dp - 1) / dp * share / self.sync_bandwidth

    def tp_degrees(self, device_type: str) -> tuple[int, ...]:
        return tuple(sorted(tp for t, tp in self.layer_time if t == device_type))


def _no_cp(cp: int) -> None:
    if cp != 1:
        raise PlanningError(f"profile tables have no context-parallel times (CP {cp}); plan CP with the cost model")


@dataclass(frozen=True, order=True)
class StagePlan:
    """One stage of a planned pipeline, before ranks are given."""

    device_type: str
    tp: int
    layers: int
    recompute: bool = False
    cp: int = 1

    @property
    def devices(self) -> int:
        """Devices of the stage: `cp` groups of `tp`."""
        return self.tp * self.cp

    def time(self, evaluator: Evaluator, first: bool, last: bool) -> float:
        """The stage's forward + backward seconds for one micro-batch."""
        return evaluator.stage_time(self.device_type, self.tp, self.layers, self.recompute, first, last, **_cp(self.cp))

    def memory(self, evaluator: Evaluator, first: bool, last: bool, inflight: int, dp: int) -> float:
        """The stage's peak bytes per device with `inflight` micro-batches alive."""
        return evaluator.stage_memory(self.device_type, self.tp, self.layers, self.recompute, first, last, inflight, dp,
                                      **_cp(self.cp))


@dataclass(frozen=True)
class Layout:
    """`pipelines` identical pipelines of `stages`, `micro_batches` samples each (size-1 micro-batches)."""

    pipelines: int
    stages: tuple[StagePlan, ...]
    micro_batches: int

    def key(self) -> tuple:
        return (self.pipelines, self.micro_batches, self.stages)

    @property
    def groups(self) -> tuple[tuple[str, int], ...]:
        """(device type, devices) of each stage: what rank assignment places inside nodes."""
        return tuple((s.device_type, s.devices) for s in self.stages)

    def describe(self) -> str:
        stages = ", ".join(f"{s.device_type} TP{s.tp}{f' CP{s.cp}' if s.cp > 1 else ''} {s.layers} layer(s)"
                           for s in self.stages)
        return f"{self.pipelines} pipeline(s) of [{stages}]"


@dataclass(frozen=True)
class Problem:
    """Plan `num_layers` layers and `global_batch` samples on `pools` (device types in the order
    their stages run: memory descending, H2 Obs. 4 / HAPT's A-first). `tp_degrees[type]`: the TP
    degrees profiled for it (default: powers of two up to a node). `recompute`: whether stages may
    recompute activations (True: whole layers or not at all; "selective": also only the cheap
    ops, which the CostModelEvaluator prices from the kernels; False: never). `cp_degrees[type]`:
    the context-parallel degrees its stages may take (default: 1 only); a CP stage's cp x tp
    devices must fit one node."""

    pools: tuple[DevicePool, ...]
    num_layers: int
    global_batch: int
    evaluator: Evaluator
    tp_degrees: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    recompute: bool | str = True
    cp_degrees: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self):
        if self.recompute not in (False, True, "selective"):
            raise PlanningError(f"Problem: recompute is True, False or 'selective', got {brief(self.recompute)}")
        pools = tuple(self.pools)
        if not pools:
            raise PlanningError("a planning problem needs at least one device pool")
        if len({p.device_type for p in pools}) != len(pools):
            raise PlanningError(f"device types repeat in the pools: {[p.device_type for p in pools]}")
        for name, value in (("num_layers", self.num_layers), ("global_batch", self.global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanningError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "pools", pools)
        degrees = {}
        for p in pools:
            given = dict(self.tp_degrees).get(p.device_type)
            if given is None:
                given = tuple(1 << k for k in range(p.node_size.bit_length()) if (1 << k) <= p.node_size)
            degrees[p.device_type] = tuple(sorted(set(given)))
        object.__setattr__(self, "tp_degrees", degrees)
        unknown = set(dict(self.cp_degrees)) - {p.device_type for p in pools}
        if unknown:
            raise PlanningError(f"Problem: cp_degrees names device type(s) {sorted(unknown)} that no pool has")
        contexts = {}
        for p in pools:
            given = tuple(dict(self.cp_degrees).get(p.device_type, (1,)))
            if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in given) or 1 not in given:
                raise PlanningError(f"Problem: the CP degrees of {p.device_type} must be positive integers including 1, "
                                    f"got {brief(given)}")
            contexts[p.device_type] = tuple(sorted(set(given)))
        object.__setattr__(self, "cp_degrees", contexts)

    def groups(self, device_type: str, cp: int | None = None) -> tuple[tuple[int, int], ...]:
        """The (tp, cp) a stage of `device_type` may take: every TP degree without CP, then each
        CP degree above 1 with the TP degrees that keep cp x tp devices inside a node. With `cp`:
        only the groups of that CP degree (CP 1 where the type does not offer it)."""
        node = next(p.node_size for p in self.pools if p.device_type == device_type)
        tps, cps = self.tp_degrees[device_type], self.cp_degrees[device_type]
        every = tuple((tp, 1) for tp in tps) + tuple((tp, c) for c in cps if c > 1 for tp in tps if tp * c <= node)
        if cp is None:
            return every
        own = cp if cp in cps else 1
        return tuple(g for g in every if g[1] == own)

    def pipeline_cps(self) -> tuple[int, ...]:
        """The CP degrees some device type offers (1 first)."""
        return tuple(sorted(set().union(*self.cp_degrees.values())))

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(p.device_type for p in self.pools)

    def counts(self) -> dict[str, int]:
        return {p.device_type: p.size for p in self.pools}

    def dp_degrees(self) -> tuple[int, ...]:
        """Pipeline counts that split every device type and the global batch evenly."""
        g = math.gcd(self.global_batch, *self.counts().values())
        return tuple(d for d in range(1, g + 1) if g % d == 0)

    def recompute_options(self) -> tuple[bool | str, ...]:
        if self.recompute == "selective":
            return (False, "selective", True)
        return (False, True) if self.recompute else (False,)


@dataclass(frozen=True)
class Priced:
    """A layout's price: iteration time, per-stage time and peak memory, feasibility."""

    time: float
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    feasible: bool


def price_pipeline(evaluator: Evaluator, stages: Sequence[StagePlan], micro_batches: int, dp: int) -> Priced:
    """The pipeline formula and memory check (module docstring) for one pipeline, sync excluded."""
    n = len(stages)
    times, memory, feasible = [], [], True
    for i, s in enumerate(stages):
        first, last = i == 0, i == n - 1
        times.append(s.time(evaluator, first, last))
        mem = s.memory(evaluator, first, last, min(n - i, micro_batches), dp)
        memory.append(mem)
        feasible = feasible and mem <= evaluator.capacity(s.device_type)
    links = [evaluator.link_time(a.device_type, b.device_type) for a, b in zip(stages, stages[1:])]
    return Priced(pipeline_time(times, micro_batches, links), tuple(times), tuple(memory), feasible)


def price(problem: Problem, layout: Layout) -> Priced:
    """The objective of the module docstring for a layout of identical pipelines. Feasible when
    its stages fit memory and its TP groups can be placed inside nodes (counting devices is not
    enough where nodes are not powers of two, e.g. after failures): in its own order, or in the
    order `placeable` gives, whose memory must fit too."""
    priced = price_pipeline(problem.evaluator, layout.stages, layout.micro_batches, layout.pipelines)
    sync = sync_time_of(problem.evaluator, layout.stages, layout.pipelines)
    feasible = priced.feasible
    if feasible:
        placed = placeable(problem, layout)
        feasible = placed is layout or placed is not None and price_pipeline(
            problem.evaluator, placed.stages, placed.micro_batches, placed.pipelines).feasible
    return Priced(priced.time + sync, priced.stage_times, priced.stage_memory, feasible)


def strategy_stages(problem: Problem, strategy: Strategy) -> list[tuple[StagePlan, ...]]:
    """Each pipeline of a strategy as StagePlans (device types from the problem's pools)."""
    type_of = {r: p.device_type for p in problem.pools for r in p.ranks}
    out = []
    for i, pipeline in enumerate(strategy.pipelines):
        stages = []
        for j, s in enumerate(pipeline.stages):
            kinds = {type_of.get(r) for r in s.ranks}
            if None in kinds or len(kinds) != 1:
                raise PlanningError(f"pipelines[{i}].stages[{j}] (ranks {list(s.ranks)}) is not on one device type of the cluster")
            stages.append(StagePlan(kinds.pop(), s.tp, len(s.layers), s.recompute_kind, s.cp))
        out.append(tuple(stages))
    return out


def price_strategy(problem: Problem, strategy: Strategy, recompute: Sequence[Sequence[bool]] | None = None) -> Priced:
    """Any strategy (pipelines may differ) under the objective: the slowest pipeline plus the sync.
    A pipeline of M micro-batches of size s is priced as M*s samples (size-1 micro-batches); a CP
    stage as even shares (approximate for uneven `cp_shares`).
    `recompute[k][j]` overrides the strategy's own recompute flag of stage j of pipeline k."""
    total, times, memory, feasible = 0.0, [], [], True
    pipelines = strategy_stages(problem, strategy)
    every: list[StagePlan] = []
    for k, stages in enumerate(pipelines):
        if recompute is not None:
            stages = tuple(replace(s, recompute=r) for s, r in zip(stages, recompute[k]))
        p = strategy.pipelines[k]
        if p.samples_per_step is None:
            raise PlanningError(f"pipelines[{k}] binds its micro-batches at run time; give counts to price it")
        priced = price_pipeline(problem.evaluator, stages, p.samples_per_step, len(pipelines))
        total = max(total, priced.time)
        times += priced.stage_times
        memory += priced.stage_memory
        feasible = feasible and priced.feasible
        every += stages
    total += sync_time_of(problem.evaluator, every, len(pipelines), 1 / len(pipelines))
    return Priced(total, tuple(times), tuple(memory), feasible)


class PriceCache:
    """Memoised prices on the layout's canonical key (HetAuto memoises its cost calls)."""

    def __init__(self, problem: Problem):
        self.problem, self.cache, self.calls = problem, {}, 0

    def __call__(self, layout: Layout) -> Priced:
        key = layout.key()
        if key not in self.cache:
            self.calls += 1
            self.cache[key] = price(self.problem, layout)
        return self.cache[key]


@dataclass(frozen=True)
class PlannedStrategy:
    """A trainable strategy and what the planner knows of it: the pipeline schedule ("1f1b", or
    "h1f1b" whose warm-up vector the strategy's pipelines carry) and each pipeline's micro-batches
    in flight per stage under it, predicted iteration time (s, the search objective), peak memory
    per device (bytes), and provenance (search, seconds, candidates priced, simulated pipeline
    seconds under 1F1B and the chosen schedule)."""

    strategy: Strategy
    schedule: str
    warmup: tuple[tuple[int, ...], ...]
    predicted_time: float
    peak_memory: Mapping[int, float]
    provenance: Mapping[str, object]
    layout: Layout | None = None

    def describe(self) -> str:
        peak = max(self.peak_memory.values()) / 2**30 if self.peak_memory else 0.0
        return (f"{self.provenance.get('search', '?')}: {self.predicted_time:.4g} s/iteration, peak {peak:.1f} GiB\n"
                f"  {format_strategy(self.strategy)}")


def one_f_one_b_warmup(stages: int, micro_batches: int) -> tuple[int, ...]:
    """Micro-batches in flight per stage under 1F1B: min(S - i, M)."""
    return tuple(min(stages - i, micro_batches) for i in range(stages))


def layout_strategy(problem: Problem, layout: Layout, name: str = "") -> Strategy:
    """The Strategy of a layout: ranks by the one rule of planning.ranks, layers in stage order."""
    ranks = assign_ranks([list(layout.groups)] * layout.pipelines, problem.pools)
    pipelines = []
    for groups in ranks:
        stages, first = [], 0
        for s, group in zip(layout.stages, groups):
            stages.append(Stage(group, range(first, first + s.layers), cp=s.cp, **Stage.recompute_fields(s.recompute)))
            first += s.layers
        pipelines.append(Pipeline(tuple(stages), layout.micro_batches, 1))
    return Strategy(tuple(pipelines), problem.num_layers, False, name)


def placeable(problem: Problem, layout: Layout) -> Layout | None:
    """`layout`, or, when its stages' groups cannot all be placed inside nodes in this order, the same
    stages with each device type's stages in descending group size (power-of-two groups taken
    largest first always pack into power-of-two nodes); None when neither order places them.
    Re-priced by the caller: the order can change memory (in-flight counts) and the first/last
    stage costs."""
    if _places(problem.pools, layout.pipelines, layout.groups):
        return layout
    stages = list(layout.stages)
    start = 0
    for k in range(1, len(stages) + 1):
        if k == len(stages) or stages[k].device_type != stages[start].device_type:
            stages[start:k] = sorted(stages[start:k], key=lambda s: -s.devices)
            start = k
    ordered = Layout(layout.pipelines, tuple(stages), layout.micro_batches)
    if ordered.stages != layout.stages and _places(problem.pools, ordered.pipelines, ordered.groups):
        return ordered
    return None


@lru_cache(maxsize=4096)
def _places(pools: tuple[DevicePool, ...], pipelines: int, groups: tuple[tuple[str, int], ...]) -> bool:
    """Whether `pipelines` copies of the (device type, TP) groups can be placed inside nodes."""
    try:
        assign_ranks([list(groups)] * pipelines, pools)
    except RankAssignmentError:
        return False
    return True


def scheduled(problem: Problem, strategy: Strategy) -> tuple[Strategy, str, tuple[tuple[int, ...], ...], dict[int, float], dict]:
    """`strategy` with each pipeline under H-1F1B where that beats 1F1B in the simulator and fits
    (schedule_choice; other pipelines keep the trainer's 1F1B), the schedule name ("h1f1b" if any
    pipeline runs it), the in-flight counts per pipeline, peak memory per device at those counts,
    and the simulated pipeline seconds of the slowest pipeline under 1F1B and as chosen."""
    pipelines, in_flight, peak, choices = [], [], {}, {}
    for k, (pipeline, stages) in enumerate(zip(strategy.pipelines, strategy_stages(problem, strategy))):
        if pipeline.samples_per_step is None:
            raise PlanningError(f"pipelines[{k}] binds its micro-batches at run time; give counts to schedule it")
        key = (stages, pipeline.samples_per_step)
        if key not in choices:
            choices[key] = choose_schedule(problem.evaluator, stages, pipeline.samples_per_step, strategy.num_pipelines)
        choice = choices[key]
        hetero = choice.policy != "1f1b"
        pipeline = replace(pipeline, schedule=choice.policy if hetero else None, warmup=choice.vector if hetero else None)
        pipelines.append(pipeline)
        in_flight.append(choice.in_flight)
        for s, mem in zip(pipeline.stages, choice.stage_memory):
            for r in s.ranks:
                peak[r] = mem
    used = [choices[key] for key in choices]
    policy = "h1f1b" if any(c.policy == "h1f1b" for c in used) else "1f1b"
    seconds = {"1f1b": max(c.one_f_one_b_seconds for c in used), policy: max(c.seconds for c in used)}
    return replace(strategy, pipelines=tuple(pipelines)), policy, tuple(in_flight), peak, seconds


def planned(problem: Problem, layout: Layout, provenance: Mapping[str, object]) -> PlannedStrategy:
    """The PlannedStrategy of a layout: its Strategy under the schedule `scheduled` picks."""
    placed = placeable(problem, layout)
    if placed is None:
        nodes = "; ".join(f"{p.device_type}: nodes of {[len(n) for n in p.nodes]} device(s)" for p in problem.pools)
        raise PlanningError(f"{provenance.get('search', 'planning')}: the TP groups of {layout.describe()} cannot be "
                            f"placed inside the nodes of {nodes}")
    layout = placed
    priced = price(problem, layout)
    if not priced.feasible:
        raise PlanningError(f"{provenance.get('search', 'planning')}: {layout.describe()} exceeds device memory")
    strategy = layout_strategy(problem, layout, str(provenance.get("search", "")))
    strategy, policy, in_flight, peak, seconds = scheduled(problem, strategy)
    return PlannedStrategy(strategy, policy, in_flight, priced.time, peak, {**provenance, "pipeline_seconds": seconds},
                           layout)


def best_of(priced: Mapping[tuple, tuple[float, Layout]]) -> Layout:
    """The cheapest layout, ties broken by the canonical key (deterministic across searches)."""
    return min(priced.values(), key=lambda tl: (tl[0], tl[1].key()))[1]


__all__ = [
    "Evaluator", "Layout", "PlannedStrategy", "PlanningError", "PriceCache", "Priced", "Problem", "StagePlan",
    "TableEvaluator", "layout_strategy", "price_strategy", "strategy_stages", "one_f_one_b_warmup", "planned", "price", "price_pipeline",
    "scheduled", "sync_time_of",
]
