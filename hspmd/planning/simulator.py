"""The pipeline simulator, levels 0 and 1 (HeteroSim §3; level 2 is hspmd.planning.device_sim).

Level 0, `closed_form`: the pipeline formula (`pipeline_time`, the one every strategy search
prices with) plus gradient sync and the update. Without links it is an upper bound of level 1's
1F1B makespan (exact for uniform stages; HAPT §4). With links it is HAPT's steady-state estimate,
one bottleneck period per micro-batch, and not a bound either way: plain 1F1B stalls a round trip
per warm-up window once a link is slower than about half a stage (S = 2, f = 1/3, b = 2/3, c = 10,
M = 8: level 1 98.0, level 0 92.0), and under H-1F1B's warm-up level 1 lies within 0.83-1.50x
of it on random pipelines. Level 1 prices the candidates a search keeps.

Level 1, `simulate_pipelines`: a discrete-event run of every stage's schedule order. Each stage is
one resource running its order (1F1B with a warm-up vector, or GPipe) one action at a time; each
stage-to-stage transfer is a message on a link resource (one per direction of each pipeline link
unless `resource` names a shared one, which then serialises messages first-in first-out: that is
the contention model). Sends never block the sender (the executor posts them without waiting),
a receiver waits for the message. After its last backward a stage joins its gradient-sync group
(every stage holding the same layers in another pipeline), which starts when the last member is
ready, then runs its optimizer update. Events are committed in time order, so the result is exact
for this model: no overlap of compute with the TP collectives counted inside forward/backward,
no copy engines (Virtual-1F1B's device-host copies are not modelled separately).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from hspmd.errors import HSPMDError
from hspmd.specialize.schedules import (
    BACKWARD, FORWARD, WARMUP_POLICIES, check_warmup, gpipe, one_f_one_b, peak_in_flight, warmup_vector,
)

StageKey = tuple[int, int]  # (pipeline, stage)

STAGE_ACTION, LINK_MESSAGE = 0, 1
"""The two kinds of event level 1 commits; at equal start times a stage's action goes first."""


class _Message(NamedTuple):
    """A transfer queued on a link: from stage `index` of pipeline `pipeline` to stage `target`,
    carrying micro-batch `micro_batch`'s `kind` (forward activations or backward gradients)."""

    pipeline: int
    index: int
    direction: str
    target: int
    kind: str
    micro_batch: int
    seconds: float


@dataclass(frozen=True)
class SimStage:
    """One pipeline stage: its devices, forward/backward seconds per micro-batch (of which
    `*_comm` is tensor-parallel communication), its gradient sync and update seconds, and its memory
    (static bytes + bytes per micro-batch in flight)."""

    devices: tuple[int, ...]
    forward: float
    backward: float
    forward_comm: float = 0.0
    backward_comm: float = 0.0
    sync: float = 0.0
    update: float = 0.0
    static_memory: float = 0.0
    activation_memory: float = 0.0


@dataclass(frozen=True)
class SimLink:
    """Transfer seconds from a stage to the next (forward activation) and back (gradient);
    messages on links with the same `resource` name share it (first come, first served)."""

    forward: float = 0.0
    backward: float = 0.0
    resource: str | None = None


@dataclass(frozen=True)
class SimPipeline:
    """Stages in order, the links between consecutive ones, micro-batches per step, and the schedule:
    "gpipe", a warm-up policy ("1f1b", "eager", "h1f1b", "virtual") or "policy:N1,N2,..."."""

    stages: tuple[SimStage, ...]
    links: tuple[SimLink, ...]
    micro_batches: int
    schedule: str = "1f1b"

    def __post_init__(self):
        if not self.stages:
            raise HSPMDError("a simulated pipeline needs at least one stage")
        links = tuple(self.links) or tuple(SimLink() for _ in range(len(self.stages) - 1))
        if len(links) != len(self.stages) - 1:
            raise HSPMDError(f"a simulated pipeline of {len(self.stages)} stages needs {len(self.stages) - 1} links, got {len(links)}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise HSPMDError(f"micro_batches must be an integer >= 1, got {self.micro_batches!r}")
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "links", links)

    def warmup(self) -> tuple[int, ...] | None:
        """The warm-up vector of the schedule (None for GPipe)."""
        key, _, explicit = str(self.schedule).lower().partition(":")
        if key == "gpipe" and not explicit:
            return None
        if explicit:
            try:
                return check_warmup(tuple(int(x) for x in explicit.split(",")), len(self.stages))
            except ValueError:
                raise HSPMDError(f"schedule {self.schedule!r}: the warm-up vector must be integers") from None
        if key not in WARMUP_POLICIES:
            raise HSPMDError(f"unknown schedule {self.schedule!r}: use gpipe, {', '.join(WARMUP_POLICIES)} or policy:N1,N2,...")
        return warmup_vector(key, [s.forward + s.backward for s in self.stages], [l.forward for l in self.links])

    def orders(self):
        vector = self.warmup()
        n = len(self.stages)
        if vector is None:
            return [gpipe(n, s, self.micro_batches) for s in range(n)]
        return [one_f_one_b(n, s, self.micro_batches, vector[s]) for s in range(n)]


@dataclass(frozen=True)
class Interval:
    """Something a stage (or link) did: kind in F, B, send, sync, update; micro-batch or -1."""

    kind: str
    start: float
    end: float
    micro_batch: int = -1


@dataclass(frozen=True)
class Breakdown:
    compute: float
    comm: float
    idle: float


@dataclass(frozen=True)
class SimResult:
    """Iteration time, every stage's and link's intervals, per-rank breakdown and peak memory."""

    iteration: float
    stages: Mapping[StageKey, tuple[Interval, ...]]
    links: Mapping[tuple[int, int, str], tuple[Interval, ...]]
    devices: Mapping[StageKey, tuple[int, ...]]
    per_rank: Mapping[int, Breakdown]
    peak_memory: Mapping[int, float]
    warmup: Mapping[int, tuple[int, ...] | None] = field(default_factory=dict)

    def bubble_fraction(self) -> float:
        """Share of rank-time spent idle."""
        total = self.iteration * len(self.per_rank)
        return 0.0 if total == 0 else sum(b.idle for b in self.per_rank.values()) / total

    def load_balance(self) -> float:
        """HAPT eq. 25 with equal peaks: 1 - mean (max busy - busy) / max busy."""
        busy = [b.compute + b.comm for b in self.per_rank.values()]
        top = max(busy, default=0.0)
        return 1.0 if top == 0 else 1.0 - sum(top - x for x in busy) / (top * len(busy))

    def describe(self) -> str:
        lines = [f"iteration {self.iteration * 1e3:.3f} ms, bubble {self.bubble_fraction():.1%}"]
        for rank in sorted(self.per_rank):
            b = self.per_rank[rank]
            lines.append(f"  rank {rank}: compute {b.compute * 1e3:.3f} ms, comm {b.comm * 1e3:.3f} ms, "
                         f"idle {b.idle * 1e3:.3f} ms, peak memory {self.peak_memory.get(rank, 0) / 2**20:.1f} MiB")
        return "\n".join(lines)


def pipeline_time(stage_times: Sequence[float], micro_batches: int, link_times: Sequence[float] = ()) -> float:
    """The pipeline formula: sum_i t_i + 2 sum_i c_i + (M - 1) * max(max_i t_i, max_i c_i), for
    stage times t_i = f_i + b_i per micro-batch and c_i the transfer from stage i to i + 1 (HAPT
    eq. 13; with c = 0 the formula H2 (alpha = 1), Metis and Hydraulis share). What it bounds and
    what it does not: the module docstring."""
    if not stage_times:
        raise HSPMDError("the pipeline formula needs at least one stage time")
    if len(link_times) not in (0, len(stage_times) - 1):
        raise HSPMDError(f"{len(stage_times)} stages have {len(stage_times) - 1} links, got {len(link_times)} link times")
    bottleneck = max(max(stage_times), max(link_times, default=0.0))
    return sum(stage_times) + 2 * sum(link_times) + (micro_batches - 1) * bottleneck


def closed_form(stage_times: Sequence[float], micro_batches: int, link_times: Sequence[float] = (),
                sync: float = 0.0, update: float = 0.0) -> float:
    """Level 0: the pipeline formula for one pipeline, plus its gradient sync and update."""
    return pipeline_time(stage_times, micro_batches, link_times) + sync + update


def simulate_pipelines(pipelines: Sequence[SimPipeline],
                       sync_groups: Sequence[Sequence[StageKey]] | None = None) -> SimResult:
    """Level 1 (module docstring). `sync_groups`: sets of (pipeline, stage) whose gradient sync is
    one collective; stages in no group sync on their own."""
    orders = {(p, s): order for p, pipe in enumerate(pipelines) for s, order in enumerate(pipe.orders())}
    stage_of = {(p, s): st for p, pipe in enumerate(pipelines) for s, st in enumerate(pipe.stages)}
    position = {k: 0 for k in orders}
    free = {k: 0.0 for k in orders}
    arrived: dict[tuple[int, int, str, int], float] = {}
    intervals: dict[StageKey, list[Interval]] = {k: [] for k in orders}
    link_intervals: dict[tuple[int, int, str], list[Interval]] = {}
    queues: dict[str, list] = {}
    link_free: dict[str, float] = {}
    sequence = 0
    remaining = sum(len(o) for o in orders.values())

    def enqueue(p, s, kind, m, ready):
        nonlocal sequence
        pipe = pipelines[p]
        if kind == FORWARD:
            if s + 1 >= len(pipe.stages):
                return
            link, index, target, seconds, direction = pipe.links[s], s, s + 1, pipe.links[s].forward, "fwd"
        else:
            if s == 0:
                return
            link, index, target, seconds, direction = pipe.links[s - 1], s - 1, s - 1, pipe.links[s - 1].backward, "bwd"
        if seconds <= 0:
            arrived[(p, target, kind, m)] = ready
            return
        resource = link.resource or f"p{p}.link{index}.{direction}"
        sequence += 1
        heapq.heappush(queues.setdefault(resource, []), (ready, sequence, _Message(p, index, direction, target, kind, m, seconds)))

    while remaining:
        best = None
        for key, order in orders.items():
            if position[key] == len(order):
                continue
            p, s = key
            a = order[position[key]]
            n = len(pipelines[p].stages)
            upstream = s - 1 if a.kind == FORWARD else s + 1
            start = free[key]
            if 0 <= upstream < n:
                dep = arrived.get((p, s, a.kind, a.micro_batch))
                if dep is None:
                    continue
                start = max(start, dep)
            if best is None or start < best[0]:
                best = (start, STAGE_ACTION, key, a)
        for resource, queue in queues.items():
            if queue:
                ready, seq, job = queue[0]
                start = max(ready, link_free.get(resource, 0.0))
                if best is None or start < best[0]:
                    best = (start, LINK_MESSAGE, resource, job)
        if best is None:
            stuck = ", ".join(f"pipeline {p} stage {s} at {orders[(p, s)][position[(p, s)]]}"
                              for (p, s) in orders if position[(p, s)] < len(orders[(p, s)]))
            raise HSPMDError(f"simulated schedule deadlocks: {stuck}")
        start, event, key, job = best
        if event == STAGE_ACTION:
            stage = stage_of[key]
            seconds = stage.forward if job.kind == FORWARD else stage.backward
            end = start + seconds
            intervals[key].append(Interval(job.kind, start, end, job.micro_batch))
            free[key] = end
            position[key] += 1
            remaining -= 1
            enqueue(key[0], key[1], job.kind, job.micro_batch, end)
        else:
            heapq.heappop(queues[key])
            end = start + job.seconds
            link_free[key] = end
            arrived[(job.pipeline, job.target, job.kind, job.micro_batch)] = end
            link_intervals.setdefault((job.pipeline, job.index, job.direction), []).append(
                Interval("send", start, end, job.micro_batch))
    # drain transfers nobody waits for (none in a valid pipeline, kept for the timeline)
    for resource, queue in queues.items():
        while queue:
            ready, _, message = heapq.heappop(queue)
            start = max(ready, link_free.get(resource, 0.0))
            link_free[resource] = start + message.seconds
            link_intervals.setdefault((message.pipeline, message.index, message.direction), []).append(
                Interval("send", start, start + message.seconds, message.micro_batch))

    # gradient sync (one collective per group, once every member is done) and the update
    grouped = {k for g in (sync_groups or ()) for k in g}
    groups = [tuple(g) for g in (sync_groups or ())] + [(k,) for k in orders if k not in grouped]
    end_of: dict[StageKey, float] = {}
    for group in groups:
        ready = max(free[k] for k in group)
        seconds = max(stage_of[k].sync for k in group)
        for k in group:
            t = ready
            if seconds > 0:
                intervals[k].append(Interval("sync", ready, ready + seconds))
                t = ready + seconds
            if stage_of[k].update > 0:
                intervals[k].append(Interval("update", t, t + stage_of[k].update))
                t += stage_of[k].update
            end_of[k] = t
    iteration = max(end_of.values(), default=0.0)

    per_rank: dict[int, Breakdown] = {}
    memory: dict[int, float] = {}
    devices = {k: stage_of[k].devices for k in orders}
    for key, items in intervals.items():
        st = stage_of[key]
        m_f = sum(1 for i in items if i.kind == FORWARD)
        m_b = sum(1 for i in items if i.kind == BACKWARD)
        comm = m_f * st.forward_comm + m_b * st.backward_comm + sum(i.end - i.start for i in items if i.kind == "sync")
        busy = sum(i.end - i.start for i in items if i.kind in (FORWARD, BACKWARD, "update"))
        compute = busy - m_f * st.forward_comm - m_b * st.backward_comm
        mem = st.static_memory + st.activation_memory * peak_in_flight(orders[key])
        for d in st.devices:
            per_rank[d] = Breakdown(compute, comm, max(0.0, iteration - compute - comm))
            memory[d] = mem
    return SimResult(iteration, {k: tuple(v) for k, v in intervals.items()},
                     {k: tuple(v) for k, v in link_intervals.items()}, devices, per_rank, memory,
                     {p: pipe.warmup() for p, pipe in enumerate(pipelines)})


__all__ = [
    "Breakdown", "Interval", "SimLink", "SimPipeline", "SimResult", "SimStage", "closed_form", "pipeline_time", "simulate_pipelines",
]
