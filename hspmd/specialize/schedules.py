"""Pipeline schedules as data: the order in which one stage runs its micro-batches' forward and
backward passes.

A schedule is a pure function (stages, stage, micro_batches) -> tuple of Actions, printable and
testable without any device. The executor (hspmd.runtime.executor) runs such an order on a
Backend. Every pipeline follows its own schedule: its own stage count and micro-batch count.

    gpipe   every forward, then every backward: simple, but a stage keeps all M micro-batches'
            activations alive at once.
    1f1b    warm-up of (stages - stage - 1) forwards, then one forward / one backward in turn,
            then the remaining backwards: a stage keeps at most min(stages - stage, M) alive.

Both are deadlock-free when stage-to-stage sends do not wait for their receiver (the executor
posts sends without waiting); `simulate` checks that for any set of per-stage orders and gives
the unit-time timeline that `render_timeline` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from hspmd.errors import HSPMDError
from hspmd.specialize.strategy import closest_hint

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


def _check_shape(stages: int, stage: int, micro_batches: int) -> None:
    for name, value, low in (("stages", stages, 1), ("micro_batches", micro_batches, 1), ("stage", stage, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise HSPMDError(f"schedule: {name} must be an integer >= {low}, got {value!r}")
    if stage >= stages:
        raise HSPMDError(f"schedule: stage {stage} does not exist in a pipeline of {stages} stage(s)")


def gpipe(stages: int, stage: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order, like the P2P messages)."""
    _check_shape(stages, stage, micro_batches)
    return tuple(Action(FORWARD, m) for m in range(micro_batches)) + tuple(
        Action(BACKWARD, m) for m in range(micro_batches)
    )


def one_f_one_b(stages: int, stage: int, micro_batches: int) -> Schedule:
    """PipeDream-flush 1F1B: warm-up forwards, steady forward/backward pairs, cool-down backwards."""
    _check_shape(stages, stage, micro_batches)
    warmup = min(stages - stage - 1, micro_batches)
    order = [Action(FORWARD, m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    order += [Action(BACKWARD, m) for m in range(micro_batches - warmup, micro_batches)]
    return tuple(order)


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def schedule_for(name: str, stages: int, stage: int, micro_batches: int) -> Schedule:
    """The order of schedule `name` ("gpipe" or "1f1b") for one stage."""
    key = str(name).lower()
    if key not in SCHEDULES:
        raise HSPMDError(f"unknown pipeline schedule {name!r}: {closest_hint(str(name), tuple(SCHEDULES))}")
    return SCHEDULES[key](stages, stage, micro_batches)


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
    "Action", "BACKWARD", "FORWARD", "SCHEDULES", "Schedule", "Timeline", "check_order", "describe_schedule",
    "gpipe", "one_f_one_b", "peak_in_flight", "pipeline_schedule", "render_timeline", "schedule_for", "simulate",
]
