"""Which warm-up vector a planned pipeline runs: classic 1F1B, or HAPT's H-1F1B (eq. 2/10) where
slow links leave bubbles that 1F1B cannot hide and the extra micro-batches in flight still fit.

Both are priced by the level-1 simulator (hspmd.planning.simulator) on the pipeline's stage and
link times from the search's Evaluator; H-1F1B is chosen only when it is strictly faster there
and every stage still fits its device with min(N_i, M) micro-batches in flight. Approximate: a
stage's forward is taken as a third of its forward + backward time (F:B = 1:2, HAPT eq. 13), and a
gradient crosses a link in the time an activation does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hspmd.planning.simulator import SimLink, SimPipeline, SimStage, simulate_pipelines
from hspmd.specialize.schedules import warmup_vector

FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class ScheduleChoice:
    """A pipeline's schedule: `policy` ("1f1b" or "h1f1b"), its warm-up vector N_i, the
    micro-batches each stage keeps in flight (min(N_i, M)), its peak memory per stage, and the
    simulated pipeline seconds (no gradient sync) under the policy and under 1F1B."""

    policy: str
    vector: tuple[int, ...]
    in_flight: tuple[int, ...]
    stage_memory: tuple[float, ...]
    seconds: float
    one_f_one_b_seconds: float


def _simulated(stage_times: Sequence[float], links: Sequence[float], micro_batches: int, schedule: str) -> float:
    stages = tuple(SimStage((i,), t * FORWARD_SHARE, t * (1 - FORWARD_SHARE)) for i, t in enumerate(stage_times))
    pipeline = SimPipeline(stages, tuple(SimLink(c, c) for c in links), micro_batches, schedule)
    return simulate_pipelines([pipeline]).iteration


def choose_schedule(evaluator, stages: Sequence, micro_batches: int, dp: int) -> ScheduleChoice:
    """The schedule of one pipeline of StagePlans (module docstring)."""
    n = len(stages)
    times = [s.time(evaluator, i == 0, i == n - 1) for i, s in enumerate(stages)]
    links = [evaluator.link_time(a.device_type, b.device_type) for a, b in zip(stages, stages[1:])]

    def memory(vector):
        return tuple(s.memory(evaluator, i == 0, i == n - 1, min(vector[i], micro_batches), dp)
                     for i, s in enumerate(stages))

    classic = warmup_vector("1f1b", times, links)
    base = _simulated(times, links, micro_batches, "1f1b")
    chosen = ScheduleChoice("1f1b", classic, tuple(min(v, micro_batches) for v in classic), memory(classic), base, base)
    hetero = warmup_vector("h1f1b", times, links)
    if hetero == classic:
        return chosen
    mem = memory(hetero)
    if any(m > evaluator.capacity(s.device_type) for m, s in zip(mem, stages)):
        return chosen
    seconds = _simulated(times, links, micro_batches, "h1f1b:" + ",".join(map(str, hetero)))
    if seconds >= base * (1 - 1e-9):
        return chosen
    return ScheduleChoice("h1f1b", hetero, tuple(min(v, micro_batches) for v in hetero), mem, seconds, base)


__all__ = ["FORWARD_SHARE", "ScheduleChoice", "choose_schedule"]
