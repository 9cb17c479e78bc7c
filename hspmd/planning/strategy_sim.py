"""A Strategy on a cluster, priced by a CostModel, as simulator input (levels 0 and 1).

Per stage: forward/backward of its layers on its first device's type at its TP degree, with the
TP all-reduces on its own ranks; the embedding on the first stage, the LM head and loss on the
last. Between stages: one activation (forward) or gradient (backward) message of micro-batch x
sequence x hidden elements on the link between the two stages' first ranks (BSR spreads the
senders, so a TP group sends no more than that at once). Gradient sync: stages that hold the
same layers in different pipelines form one group; its time is, per set of holders, a ring
all-reduce of those layers' gradients (the smallest TP shard) over the holders' first ranks (an
approximation of SplitAllReduce). Update: AdamW over the stage's parameters (divided by the
number of pipelines with ZeRO-1). Memory: the CostModel's per-stage memory with the schedule's
peak in-flight micro-batches. Context parallelism: a stage's devices compute their (busiest)
share of the tokens, its attention's ring / all-gather / all-to-all traffic is added per layer
(CostModel.context_time), its weight gradients are all-reduced over the CP groups in the stage's
sync, and each CP group sends its share of the activation to the next stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from hspmd.disjoint_sets import DisjointSets
from hspmd.errors import HSPMDError
from hspmd.planning.cost import CostModel, StageShape
from hspmd.planning.simulator import SimLink, SimPipeline, SimResult, SimStage, closed_form, simulate_pipelines
from hspmd.specialize.strategy import Strategy


@dataclass(frozen=True)
class PlannedRun:
    """What the simulator needs besides the strategy: sequence length, schedule and shapes."""

    pipelines: tuple[SimPipeline, ...]
    sync_groups: tuple[tuple[tuple[int, int], ...], ...]


def _shape(strategy: Strategy, p: int, s: int) -> StageShape:
    pipe = strategy.pipelines[p]
    stage = pipe.stages[s]
    share = None if stage.cp_shares is None else max(stage.cp_shares) / sum(stage.cp_shares)
    return StageShape(len(stage.layers), stage.tp, s == 0, s == len(pipe.stages) - 1,
                      strategy.num_pipelines, strategy.zero, stage.recompute_kind, stage.cp, share, strategy.cp_attention,
                      len(stage.recomputed_layers))


def _sync_groups(strategy: Strategy) -> list[list[tuple[int, int]]]:
    """Connected components of stages that share a layer across pipelines."""
    sets: DisjointSets[tuple[int, int]] = DisjointSets()
    for layer in range(strategy.num_layers):
        sets.join([(p, strategy.stage_of(layer, p)) for p in range(strategy.num_pipelines)])
    last = len(strategy.pipelines[0].stages) - 1
    for p, pipe in enumerate(strategy.pipelines):
        for s in range(len(pipe.stages)):
            sets.add((p, s))
        # embedding and head are shared by every pipeline's first and last stages
        sets.join([(0, 0), (p, 0)])
        sets.join([(0, last), (p, len(pipe.stages) - 1)])
    members, _ = sets.classes()
    return sorted(list(g) for g in members.values() if len(g) > 1)


def _sync_seconds(strategy: Strategy, cost: CostModel, group: Sequence[tuple[int, int]]) -> float:
    if strategy.num_pipelines < 2:
        return 0.0
    m = cost.model
    by_holders: dict[tuple[int, ...], float] = {}
    for layer in range(strategy.num_layers):
        stages = [strategy.stage_holding(layer, p) for p in range(strategy.num_pipelines)]
        if (0, strategy.stage_of(layer, 0)) not in group:
            continue
        holders = tuple(st.ranks[0] for st in stages)
        by_holders[holders] = by_holders.get(holders, 0.0) + m.layer_parameters() * m.itemsize / min(st.tp for st in stages)
    for first in (True, False):
        stages = [p.stages[0] if first else p.stages[-1] for p in strategy.pipelines]
        key = (0, 0) if first else (0, len(strategy.pipelines[0].stages) - 1)
        if key in group:
            holders = tuple(st.ranks[0] for st in stages)
            size = m.embedding_parameters() if first else m.head_parameters()
            by_holders[holders] = by_holders.get(holders, 0.0) + size * m.itemsize / min(st.tp for st in stages)
    return sum(cost.collective("all_reduce", nbytes, holders) for holders, nbytes in by_holders.items())


def _stage_time(cost: CostModel, stage, shape: StageShape, mbs: int, seq: int, comm: bool) -> tuple[float, float]:
    """(forward, backward) of a stage: its slowest CP group's, each group on its own device type
    with its own share of the sequence (one group: the stage's first device)."""
    shares = stage.cp_shares or (1,) * stage.cp
    worst = (0.0, 0.0)
    for group, part in zip(stage.cp_groups, shares):
        own = replace(shape, cp_share=part / sum(shares))
        t = cost.stage_time(group[0], own, mbs, seq, tp_group=group if comm else None,
                            cp_groups=stage.cp_groups if comm else ())
        worst = max(worst, t, key=sum)
    return worst


def balanced_cp_shares(cost: CostModel, stage, seq: int, mbs: int = 1) -> tuple[int, ...]:
    """Token counts for a stage's CP groups (summing to `seq`) that give each group about the same
    layer time on its own device type: a group's share is proportional to its throughput at an
    even split (a faster device takes more tokens). Attention grows faster than linearly in a
    share, so this is approximate for long sequences; the simulator prices the result exactly."""
    even = StageShape(1, stage.tp, cp=stage.cp)
    speed = [1.0 / sum(cost.stage_time(group[0], even, mbs, seq)) for group in stage.cp_groups]
    exact = [seq * v / sum(speed) for v in speed]
    counts = [max(1, int(x)) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - int(exact[i]), reverse=True)[:max(0, seq - sum(counts))]:
        counts[i] += 1
    return tuple(counts)


def plan_run(strategy: Strategy, cost: CostModel, schedule: str = "1f1b", seq: int | None = None,
             micro_batch_size: int | None = None, comm: bool = True) -> PlannedRun:
    """The simulator's pipelines for `strategy` (module docstring). A pipeline's own schedule (and
    warm-up vector), where the strategy has one, wins over `schedule`; stages that recompute are
    priced with one more forward and fewer kept activations. comm=False zeroes every
    communication (transfers, TP collectives, gradient sync)."""
    seq = seq or cost.model.seq_len
    groups = _sync_groups(strategy)
    group_of = {k: g for g in groups for k in g}
    sync_cache: dict[int, float] = {}
    loss = cost.step_loss(strategy.all_ranks if comm else ())
    pipelines = []
    for p, pipe in enumerate(strategy.pipelines):
        mbs = pipe.micro_batch_size or micro_batch_size or 1
        m = pipe.micro_batches or 1
        stages, links = [], []
        for s, stage in enumerate(pipe.stages):
            shape = _shape(strategy, p, s)
            device = stage.ranks[0]
            f0, b0 = _stage_time(cost, stage, shape, mbs, seq, False)
            f, b = _stage_time(cost, stage, shape, mbs, seq, True) if comm else (f0, b0)
            group = group_of.get((p, s))
            sync = 0.0
            if stage.cp > 1 and comm:  # weight gradients are partial sums over the sequence's CP groups
                sync += cost.collective("all_reduce", cost.stage_parameters(shape) * cost.model.itemsize,
                                        tuple(g[0] for g in stage.cp_groups))
            if group is not None and comm:
                gid = id(group)
                if gid not in sync_cache:
                    sync_cache[gid] = _sync_seconds(strategy, cost, group)
                sync += sync_cache[gid]
            params = cost.stage_parameters(shape)
            fixed = loss + max(cost.step_work(d) for d in stage.ranks)
            update = fixed + cost.update_time(device, params / (shape.dp if shape.zero else 1),
                                              tensors=9 * shape.layers + int(shape.first) + 2 * int(shape.last))
            one = cost.memory(shape, 1, mbs, seq)
            stages.append(SimStage(tuple(stage.ranks), f, b, f - f0, b - b0, sync, update,
                                   one.weights + one.gradients + one.optimizer, one.activations))
            if s + 1 < len(pipe.stages):
                nbytes = mbs * seq * shape.share * cost.model.hidden * cost.model.itemsize  # each CP group its share
                t = cost.p2p(nbytes, (stage.ranks[0], pipe.stages[s + 1].ranks[0])) if comm else 0.0
                links.append(SimLink(t, t))
        policy = pipe.schedule_spec or schedule
        pipelines.append(SimPipeline(tuple(stages), tuple(links), m, policy))
    return PlannedRun(tuple(pipelines), tuple(tuple(g) for g in groups))


def simulate_strategy(strategy: Strategy, cost: CostModel, schedule: str = "1f1b", seq: int | None = None,
                      micro_batch_size: int | None = None, comm: bool = True) -> SimResult:
    """Level 1 simulation of one training step of `strategy`."""
    run = plan_run(strategy, cost, schedule, seq, micro_batch_size, comm)
    return simulate_pipelines(run.pipelines, run.sync_groups)


def estimate_strategy(strategy: Strategy, cost: CostModel, schedule: str = "1f1b", seq: int | None = None,
                      micro_batch_size: int | None = None) -> float:
    """Level 0: the closed form per pipeline (slowest pipeline), plus sync and update."""
    run = plan_run(strategy, cost, schedule, seq, micro_batch_size)
    worst = 0.0
    for pipe in run.pipelines:
        if pipe.warmup() is None and len(pipe.stages) > 1:
            # GPipe: all forwards then all backwards
            f = [s.forward for s in pipe.stages]
            b = [s.backward for s in pipe.stages]
            t = sum(f) + (pipe.micro_batches - 1) * max(f) + sum(b) + (pipe.micro_batches - 1) * max(b)
            t += 2 * sum(l.forward + l.backward for l in pipe.links) / 2
            t += max(s.sync + s.update for s in pipe.stages)
        else:
            t = closed_form([s.forward + s.backward for s in pipe.stages], pipe.micro_batches,
                            [l.forward for l in pipe.links], max(s.sync for s in pipe.stages),
                            max(s.update for s in pipe.stages))
        worst = max(worst, t)
    if not run.pipelines:
        raise HSPMDError("estimate_strategy: the strategy has no pipelines")
    return worst


__all__ = ["PlannedRun", "balanced_cp_shares", "estimate_strategy", "plan_run", "simulate_strategy"]
