"""Pipeline schedules as data: the order in which one stage runs its micro-batches' forward and
backward passes.

A schedule is a pure function (stages, stage, micro_batches) -> tuple of Actions, printable and
testable without any device. The interpreter (hspmd.runtime.execution.interpreter) runs such an
order on a Backend. Every pipeline follows its own schedule: its own stage count and micro-batch count.

    gpipe   every forward, then every backward: simple, but a stage keeps all M micro-batches'
            activations alive at once.
    1f1b    N forwards before the first backward, then one backward / one forward in turn, then
            the remaining backwards: a stage keeps at most min(N, M) alive. Classic 1F1B has
            N = stages - stage; a warm-up vector (one N per stage) gives the variants below.

Warm-up vectors (HAPT eq. 2/10, HetAuto section 5.1): N_last = 1 and N_i = N_{i+1} + delta_i for
the link after stage i, where delta is the number of extra micro-batches in flight that hide that
link's transfer: `1f1b` delta = 1 (no hiding), `eager` delta = 2 (hides c <= (f+b)/2 on every
link), `h1f1b` delta = 1, 2 or 3 by the link's cost (hides up to f+b, only where needed),
`virtual` delta = 2 at slow (cross-cluster) links and 1 elsewhere (Virtual-1F1B). Schedule names
take an explicit vector too: "1f1b:5,2,1".

Any vector that never increases along the pipeline (N_i >= N_{i+1} >= 1) is deadlock-free when
stage-to-stage sends do not wait for their receiver (the executor posts sends without waiting):
before stage i waits for B(j), it has sent F(j + N_i - 1), which covers what stage i+1 needs
before its own B(j). `simulate` checks any set of per-stage orders and gives the unit-time
timeline that `render_timeline` prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from hspmd.errors import HSPMDError, closest_hint

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    """Run the forward ("F") or backward ("B") pass of micro-batch `micro_batch` on this stage."""

    kind: str
    micro_batch: int

    def __post_init__(self):
        if self.kind not in (FORWARD, BACKWARD):
            raise HSPMDError(f"action kind must be {FORWARD!r} or {BACKWARD!r}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


Schedule = tuple[Action, ...]


def _check_stage_arguments(stages: int, stage: int, micro_batches: int) -> None:
    for name, value, low in (("stages", stages, 1), ("micro_batches", micro_batches, 1), ("stage", stage, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HSPMDError(f"schedule: {name} must be an integer >= {low}, got {value!r}")
    if stage >= stages:
        raise HSPMDError(f"schedule: stage {stage} does not exist in a pipeline of {stages} stage(s)")


def gpipe(stages: int, stage: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order, like the P2P messages)."""
    _check_stage_arguments(stages, stage, micro_batches)
    return tuple(Action(FORWARD, m) for m in range(micro_batches)) + tuple(
        Action(BACKWARD, m) for m in range(micro_batches)
    )


def one_f_one_b(stages: int, stage: int, micro_batches: int, warmup: int | None = None) -> Schedule:
    """1F1B with `warmup` forwards launched before the first backward (HAPT's N_i; default
    stages - stage, PipeDream-flush), then backward/forward pairs, then the remaining backwards."""
    _check_stage_arguments(stages, stage, micro_batches)
    n = stages - stage if warmup is None else warmup
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise HSPMDError(f"schedule: stage {stage}'s warm-up must be an integer >= 1 (forwards before the first backward), got {n!r}")
    n = min(n, micro_batches)
    order = [Action(FORWARD, m) for m in range(n)]
    for i in range(micro_batches - n):
        order += [Action(BACKWARD, i), Action(FORWARD, n + i)]
    order += [Action(BACKWARD, m) for m in range(micro_batches - n, micro_batches)]
    return tuple(order)


WARMUP_POLICIES = ("1f1b", "eager", "h1f1b", "virtual")
SCHEDULE_POLICIES = ("gpipe",) + WARMUP_POLICIES
VECTOR_POLICIES = ("h1f1b", "virtual")  # their vectors depend on stage and link times


def link_delta(policy: str, link_time: float, t_max: float, eps: float = 0.05) -> int:
    """Extra micro-batches in flight across one link under `policy` (module docstring). For h1f1b,
    HAPT eq. 2: 1 if c <= eps t_max, 2 if c <= t_max / 2, 3 if c <= t_max; beyond t_max (where
    no warm-up hides the link) eq. 10's ceil(1 + 2c / t_max)."""
    if policy == "1f1b":
        return 1
    if policy == "eager":
        return 2
    slow = link_time > eps * t_max
    if policy == "virtual":
        return 2 if slow else 1
    if not slow:
        return 1
    if link_time <= t_max / 2:
        return 2
    if link_time <= t_max:
        return 3
    return math.ceil(1 + 2 * link_time / t_max)


def warmup_vector(policy: str, stage_times: Sequence[float], link_times: Sequence[float] = (),
                  eps: float = 0.05) -> tuple[int, ...]:
    """Forwards each stage launches before its first backward: N_last = 1, N_i = N_{i+1} + delta_i.
    stage_times: forward + backward per micro-batch of each stage; link_times: the transfer time
    between stage i and i+1 (len = stages - 1; all 0 if omitted)."""
    key = str(policy).lower()
    if key not in WARMUP_POLICIES:
        raise HSPMDError(f"unknown warm-up policy {policy!r}: {closest_hint(str(policy), WARMUP_POLICIES)}")
    times = [float(t) for t in stage_times]
    if not times or any(not t >= 0 for t in times):
        raise HSPMDError(f"warmup_vector: stage_times must be one non-negative time per stage, got {list(stage_times)}")
    links = [float(c) for c in link_times] or [0.0] * (len(times) - 1)
    if len(links) != len(times) - 1 or any(not c >= 0 for c in links):
        raise HSPMDError(f"warmup_vector: give {len(times) - 1} non-negative link time(s) for {len(times)} stages, "
                         f"got {list(link_times)}")
    t_max = max(times)
    vector = [1]
    for c in reversed(links):
        vector.append(vector[-1] + link_delta(key, c, t_max, eps))
    return tuple(reversed(vector))


def check_warmup(vector: Sequence[int], stages: int) -> tuple[int, ...]:
    """A warm-up vector that is deadlock-free: one integer >= 1 per stage, never increasing."""
    vector = tuple(vector)
    if len(vector) != stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in vector):
        raise HSPMDError(f"warm-up vector {list(vector)}: give one integer >= 1 per stage ({stages} stage(s))")
    rising = [i for i in range(stages - 1) if vector[i] < vector[i + 1]]
    if rising:
        raise HSPMDError(f"warm-up vector {list(vector)} increases after stage {rising[0]}: a stage must launch at least "
                         f"as many forwards before its first backward as the next one, or the pipeline deadlocks")
    return vector


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _parse_vector(name: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise HSPMDError(f"schedule {name!r}: the warm-up vector after ':' must be integers separated by commas") from None


def schedule_for(name: str, stages: int, stage: int, micro_batches: int) -> Schedule:
    """The order of schedule `name` for one stage: "gpipe", "1f1b", "eager" (delta 2 on every
    link), or a 1F1B policy with an explicit warm-up vector, "1f1b:5,2,1" / "h1f1b:5,2,1"."""
    text = str(name).lower().strip()
    key, _, vector_text = text.partition(":")
    if key == "gpipe" and not vector_text:
        return gpipe(stages, stage, micro_batches)
    if key not in WARMUP_POLICIES:
        raise HSPMDError(f"unknown pipeline schedule {name!r}: {closest_hint(key, tuple(SCHEDULES) + WARMUP_POLICIES[1:])}")
    if vector_text:
        vector = check_warmup(_parse_vector(name, vector_text), stages)
    elif key in VECTOR_POLICIES:
        raise HSPMDError(f"schedule {name!r} depends on stage and link times: compute its warm-up vector with "
                         f"warmup_vector({key!r}, stage_times, link_times) and pass it as '{key}:N1,N2,...'")
    else:
        vector = warmup_vector(key, [1.0] * stages)
    _check_stage_arguments(stages, stage, micro_batches)
    return one_f_one_b(stages, stage, micro_batches, vector[stage])


def pipeline_schedule(name: str, stages: int, micro_batches: int) -> tuple[Schedule, ...]:
    """Every stage's order for one pipeline."""
    return tuple(schedule_for(name, stages, s, micro_batches) for s in range(stages))


def check_order(order: Sequence[Action], micro_batches: int) -> None:
    """Raise HSPMDError unless every micro-batch runs exactly one forward and, later, one backward."""
    seen_forward: set[int] = set()
    seen_backward: set[int] = set()
    for position, a in enumerate(order):
        if not 0 <= a.micro_batch < micro_batches:
            raise HSPMDError(f"schedule step {position} ({a}) names a micro-batch outside 0-{micro_batches - 1}")
        done = seen_forward if a.kind == FORWARD else seen_backward
        if a.micro_batch in done:
            raise HSPMDError(f"schedule step {position} runs {a} a second time")
        if a.kind == BACKWARD and a.micro_batch not in seen_forward:
            raise HSPMDError(f"schedule step {position} runs {a} before F{a.micro_batch}")
        done.add(a.micro_batch)
    missing = [f"F{m}" for m in range(micro_batches) if m not in seen_forward]
    missing += [f"B{m}" for m in range(micro_batches) if m not in seen_backward]
    if missing:
        raise HSPMDError(f"schedule never runs {', '.join(missing)}")


def peak_in_flight(order: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran and backward did not yet: the activation memory bound."""
    live = peak = 0
    for a in order:
        live += 1 if a.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class Timeline:
    """Start time of every action of every stage (unit costs), and the total time."""

    starts: tuple[tuple[tuple[int, Action], ...], ...]
    makespan: int
    forward_cost: int
    backward_cost: int

    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle."""
        busy = sum(self.forward_cost if a.kind == FORWARD else self.backward_cost for s in self.starts for _, a in s)
        total = self.makespan * len(self.starts)
        return 0.0 if total == 0 else 1.0 - busy / total


def simulate(orders: Sequence[Sequence[Action]], forward_cost: int = 1, backward_cost: int = 2) -> Timeline:
    """Run per-stage orders (stage 0 first) on an ideal machine where sends never block: F(m) on
    stage s waits for F(m) on stage s-1, B(m) for B(m) on stage s+1. Raises HSPMDError naming the
    stuck stages if the orders deadlock."""
    stages = len(orders)
    done: dict[tuple[int, str, int], int] = {}
    position = [0] * stages
    clock = [0] * stages
    starts: list[list[tuple[int, Action]]] = [[] for _ in range(stages)]
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            a = orders[s][position[s]]
            upstream = s - 1 if a.kind == FORWARD else s + 1
            ready = clock[s]
            if 0 <= upstream < stages:
                key = (upstream, a.kind, a.micro_batch)
                if key not in done:
                    continue
                ready = max(ready, done[key])
            cost = forward_cost if a.kind == FORWARD else backward_cost
            starts[s].append((ready, a))
            clock[s] = done[(s, a.kind, a.micro_batch)] = ready + cost
            position[s] += 1
            progressed = True
        if not progressed:
            stuck = ", ".join(f"stage {s} at {orders[s][position[s]]}" for s in range(stages) if position[s] < len(orders[s]))
            raise HSPMDError(f"pipeline schedule deadlocks: {stuck} wait for each other")
    return Timeline(tuple(tuple(s) for s in starts), max(clock, default=0), forward_cost, backward_cost)


def render_timeline(timeline: Timeline) -> str:
    """One text row per stage, one column per time unit: 'F3' / 'B3' where an action starts,
    '..' while it continues, spaces while the stage idles."""
    width = max(len(str(a)) for s in timeline.starts for _, a in s) if timeline.makespan else 2
    rows = []
    for s, actions in enumerate(timeline.starts):
        cells = [" " * width] * timeline.makespan
        for start, a in actions:
            cost = timeline.forward_cost if a.kind == FORWARD else timeline.backward_cost
            cells[start] = str(a).ljust(width)
            for t in range(start + 1, start + cost):
                cells[t] = "." * width
        rows.append(f"stage {s} |" + " ".join(cells).rstrip())
    return "\n".join(rows)


def describe_schedule(name: str, stages: int, micro_batches: int) -> str:
    """The per-stage orders, the timeline and the bubble of one pipeline under a schedule."""
    orders = pipeline_schedule(name, stages, micro_batches)
    timeline = simulate(orders)
    lines = [f"{name}: {stages} stage(s), {micro_batches} micro-batch(es)"]
    for s, order in enumerate(orders):
        lines.append(f"  stage {s}: {' '.join(map(str, order))}   (peak in flight {peak_in_flight(order)})")
    lines.append(render_timeline(timeline))
    lines.append(f"  makespan {timeline.makespan} units (F=1, B=2), bubble {timeline.bubble_fraction():.0%}")
    return "\n".join(lines)


__all__ = [
    "Action", "BACKWARD", "FORWARD", "SCHEDULES", "SCHEDULE_POLICIES", "Schedule", "Timeline", "VECTOR_POLICIES",
    "WARMUP_POLICIES", "check_order",
    "check_warmup", "describe_schedule", "gpipe", "link_delta", "one_f_one_b", "peak_in_flight", "pipeline_schedule",
    "render_timeline", "schedule_for", "simulate", "warmup_vector",
]
