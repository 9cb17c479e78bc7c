"""Per-step dispatch of mixed-length sequences (Hetu v2 section 7.3, Hetu-B; Hetu v2 §7.3).

Each training step: pick a strategy from a pool by the step's longest sequence (and the memory
limits of its pipelines), assign every sequence to one of its pipelines so that the slowest
pipeline finishes as early as possible, and pack each pipeline's sequences into micro-batches
under its per-micro-batch token limit. The result is a `Dispatch` (plain data) that the trainer
runs; nothing here touches a device.

The paper gives neither the cost model nor the dispatcher. Both follow the authors' code
(`PKU-DAIR/Hetu`, examples/hydraulis/strategy/{cost_model.py,new_dynamic.py}) as Hetu v2 §7.3
describes it -- "from the authors' code":

- cost of a sequence of s tokens on pipeline p: a_p s^2 + b_p s (fwd+bwd of its bottleneck
  stage); a micro-batch costs the sum of its sequences plus a constant c_p; a pipeline of pp_p
  stages running micro-batches m_1..m_v takes  T_p = sum_j cost(m_j) + (pp_p - 1) max_j cost(m_j)
  (1F1B: the steady state plus warm-up and cool-down); the step takes max_p T_p (+ sync).
- assignment: pipelines by token limit, largest first; sequences longer than the second-largest
  limit go to the largest pipeline; every other sequence goes to the feasible pipeline that
  minimises the resulting slowest pipeline (ties: the one whose own time stays smaller, then an
  empty pipeline, then the lower index). One
  deterministic longest-first pass, then shuffled passes (seeded); the best is kept; passes that
  leave a pipeline empty lose to any that does not.
- micro-batching: for v = ceil(tokens / limit) ... +16 bins, longest-processing-time-first into
  the cheapest bin that still has room (the authors solve this with a 0.5 s ILP; LPT is the
  greedy stand-in the spec allows), keeping the v that minimises (max bin + c_p)(pp_p - 1 + v).

During an assignment pass a pipeline's time is estimated without packing (its sequences' cost,
one c_p per ceil(tokens/limit) micro-batches, and (pp_p - 1) times its costliest sequence);
every finished pass is then scored exactly, with packing. This estimate is the project's choice.

Choosing the strategy by cost (`by_cost=True`, the project's extension): among the entries that
can hold the step, the one whose predicted makespan plus the switch it needs is the smallest. On
hardware where the narrow strategy does not pay for its switch, this keeps the current one.
"""

from __future__ import annotations

import math
import numbers
import random
from functools import lru_cache
from dataclasses import dataclass
from typing import Sequence


from hspmd.errors import HSPMDError
from hspmd.planning.fitting import nonnegative_least_squares

SHUFFLED_PASSES = 100
EXTRA_BIN_COUNTS = 16


@dataclass(frozen=True)
class PipelineCost:
    """What dispatch needs of one pipeline: per-sequence cost a s^2 + b s, a per-micro-batch
    constant c, its token limit per micro-batch (from its activation memory) and stage count."""

    a: float
    b: float
    c: float
    max_tokens: int
    stages: int = 1

    def __post_init__(self):
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise HSPMDError(f"PipelineCost.{name} must be a finite number >= 0, got {value!r}")
        for name in ("max_tokens", "stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HSPMDError(f"PipelineCost.{name} must be a positive integer, got {value!r}")

    def sequence(self, length: int) -> float:
        return self.a * length * length + self.b * length

    def micro_batch(self, lengths: Sequence[int]) -> float:
        return sum(self.sequence(s) for s in lengths) + self.c

    def time(self, micro_batches: Sequence[Sequence[int]]) -> float:
        """T_p of running these micro-batches (lists of sequence lengths) through the pipeline: the
        pipeline formula (planning.simulator.pipeline_time) read across micro-batches instead of
        stages, sum_m c_m + (S - 1) max_m c_m, for S equal stages and micro-batches of unequal
        cost c_m (Hydraulis); the two agree where both apply, (M + S - 1) c."""
        costs = [self.micro_batch(m) for m in micro_batches if len(m)]
        return sum(costs) + (self.stages - 1) * max(costs) if costs else 0.0


@dataclass(frozen=True)
class PoolEntry:
    """One strategy of a pool: `strategy` is its index in the graph (or any key the caller uses),
    chosen for steps whose longest sequence is at most `max_seq_len`; one PipelineCost per
    pipeline in strategy order; `sync` a per-step constant (gradient synchronisation)."""

    name: str
    strategy: int
    max_seq_len: int
    pipelines: tuple[PipelineCost, ...]
    sync: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        if not self.pipelines or not all(isinstance(p, PipelineCost) for p in self.pipelines):
            raise HSPMDError(f"pool entry {self.name!r}: pipelines must be a non-empty list of PipelineCost")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 1:
            raise HSPMDError(f"pool entry {self.name!r}: max_seq_len must be a positive integer, got {self.max_seq_len!r}")

    @property
    def longest_fit(self) -> int:
        """The longest sequence any of its pipelines can hold."""
        return max(p.max_tokens for p in self.pipelines)


@dataclass(frozen=True)
class Dispatch:
    """One step's plan: the pool entry chosen, the pipeline of every sequence, each pipeline's
    micro-batches (tuples of sequence indices, in run order) and their predicted times."""

    entry: int
    assignment: tuple[int, ...]
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    times: tuple[float, ...]
    sync: float = 0.0

    @property
    def makespan(self) -> float:
        return max(self.times) + self.sync

    def describe(self, lengths: Sequence[int]) -> str:
        lines = []
        for p, (mbs, t) in enumerate(zip(self.micro_batches, self.times)):
            shown = " ".join("[" + "+".join(str(lengths[i]) for i in mb) + "]" for mb in mbs) or "(idle)"
            lines.append(f"pipeline {p}: {shown}  ~{t:.3g}")
        return "\n".join(lines)


def fitting_entries(pool: Sequence[PoolEntry], longest: int) -> list[int]:
    """The pool entries that can take a step whose longest sequence has `longest` tokens: its
    length bound covers it and one of its pipelines holds it."""
    if not pool:
        raise HSPMDError("dispatch: the strategy pool is empty")
    fitting = [i for i, e in enumerate(pool) if longest <= e.max_seq_len and longest <= e.longest_fit]
    if not fitting:
        bounds = ", ".join(f"{e.name}: <= {min(e.max_seq_len, e.longest_fit)}" for e in pool)
        raise HSPMDError(f"dispatch: no strategy in the pool takes a sequence of {longest} tokens ({bounds})")
    return fitting


def select_entry(pool: Sequence[PoolEntry], longest: int) -> int:
    """The paper's rule: of the fitting entries, the one with the smallest length bound."""
    return min(fitting_entries(pool, longest), key=lambda i: (pool[i].max_seq_len, i))


def pack_micro_batches(cost: PipelineCost, lengths: Sequence[int], ids: Sequence[int] | None = None
                       ) -> tuple[tuple[int, ...], ...]:
    """Micro-batches (tuples of positions into `lengths`, or of `ids`) of one pipeline's sequences,
    each within cost.max_tokens tokens (from the authors' code; LPT instead of their ILP)."""
    ids = list(range(len(lengths))) if ids is None else list(ids)
    if not ids:
        return ()
    too_long = [lengths[k] for k in range(len(ids)) if lengths[k] > cost.max_tokens]
    if too_long:
        raise HSPMDError(f"dispatch: sequences of {too_long} tokens exceed the pipeline's limit of {cost.max_tokens}")
    order = sorted(range(len(ids)), key=lambda k: (-lengths[k], ids[k]))
    first = max(1, math.ceil(sum(lengths) / cost.max_tokens))
    best, best_score = None, math.inf
    heaviest = cost.c + max(cost.sequence(s) for s in lengths)  # no micro-batch costs less than this one's
    for v in range(first, min(first + EXTRA_BIN_COUNTS - 1, len(ids)) + 1):  # [first, first + 16), at most one per sequence
        if heaviest * (cost.stages - 1 + v) >= best_score:
            break  # LPT fills all v bins (v <= sequences), so this and every larger v scores at least that
        bins = _lpt(cost, lengths, order, v)
        if bins is None:
            continue
        used = [b for b in bins if b]
        top = max(cost.micro_batch([lengths[k] for k in b]) for b in used)
        score = top * (cost.stages - 1 + len(used))
        if score < best_score - 1e-12 * max(1.0, abs(score)):
            best, best_score = used, score
    if best is None:  # LPT could not fit any tried count: one sequence per micro-batch always fits
        best = [[k] for k in order]
    return tuple(tuple(ids[k] for k in b) for b in best)


def _lpt(cost: PipelineCost, lengths: Sequence[int], order: Sequence[int], v: int) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(v)]
    tokens, costs = [0] * v, [0.0] * v
    for k in order:
        room = [j for j in range(v) if tokens[j] + lengths[k] <= cost.max_tokens]
        if not room:
            return None
        j = min(room, key=lambda j: (costs[j], j))
        bins[j].append(k)
        tokens[j] += lengths[k]
        costs[j] += cost.sequence(lengths[k])
    return bins


def packed_pipeline_time(cost: PipelineCost, lengths: Sequence[int]) -> float:
    """T_p of one pipeline given its sequences' lengths, packed by pack_micro_batches."""
    return _packed_time(cost, tuple(sorted(lengths, reverse=True)))


@lru_cache(maxsize=1 << 14)
def _packed_time(cost: PipelineCost, lengths: tuple[int, ...]) -> float:
    """packed_pipeline_time of a multiset of lengths (packing depends on nothing else): the assignment
    passes of a step score the same pipeline contents over and over."""
    mbs = pack_micro_batches(cost, lengths)
    return cost.time([[lengths[k] for k in mb] for mb in mbs])


def _estimate(cost: PipelineCost, total: float, tokens: int, longest: float) -> float:
    if tokens == 0:
        return 0.0
    return total + cost.c * math.ceil(tokens / cost.max_tokens) + (cost.stages - 1) * (longest + cost.c)


def assign(pipelines: Sequence[PipelineCost], lengths: Sequence[int], seed: int = 0,
           passes: int = SHUFFLED_PASSES) -> tuple[int, ...]:
    """The pipeline of every sequence (see the module docstring; from the authors' code)."""
    n, P = len(lengths), len(pipelines)
    if n == 0:
        return ()
    order = sorted(range(P), key=lambda p: (-pipelines[p].max_tokens, p))
    second = pipelines[order[1]].max_tokens if P > 1 else math.inf
    for i, s in enumerate(lengths):
        if s > pipelines[order[0]].max_tokens:
            raise HSPMDError(f"dispatch: sequence {i} has {s} tokens, more than any pipeline holds "
                             f"(longest limit {pipelines[order[0]].max_tokens})")
    forced = [i for i, s in enumerate(lengths) if s > second]
    free = [i for i in range(n) if lengths[i] <= second]
    rng = random.Random(seed)
    passes_orders = [sorted(free, key=lambda i: (-lengths[i], i))]
    for _ in range(passes):
        shuffled = list(free)
        rng.shuffle(shuffled)
        passes_orders.append(shuffled)
    best, best_key = None, None
    for seq_order in passes_orders:
        result = _greedy_pass(pipelines, lengths, forced, seq_order, order[0])
        times = [packed_pipeline_time(pipelines[p], [lengths[i] for i in range(n) if result[i] == p]) for p in range(P)]
        empty = sum(1 for p in range(P) if p not in result)
        key = (empty > 0 and n >= P, max(times), sum(times))
        if best_key is None or key < best_key:
            best, best_key = result, key
    return tuple(best)


def _greedy_pass(pipelines, lengths, forced, seq_order, largest) -> list[int]:
    P = len(pipelines)
    result = [-1] * len(lengths)
    total, tokens, longest = [0.0] * P, [0] * P, [0.0] * P
    est = [0.0] * P

    def put(i, p):
        cost = pipelines[p].sequence(lengths[i])
        result[i] = p
        total[p] += cost
        tokens[p] += lengths[i]
        longest[p] = max(longest[p], cost)
        est[p] = _estimate(pipelines[p], total[p], tokens[p], longest[p])

    for i in forced:
        put(i, largest)
    for i in seq_order:
        s = lengths[i]
        best_p, best_key = None, None
        for p in range(P):
            if s > pipelines[p].max_tokens:
                continue
            cost = pipelines[p].sequence(s)
            mine = _estimate(pipelines[p], total[p] + cost, tokens[p] + s, max(longest[p], cost))
            worst = max([mine] + [est[q] for q in range(P) if q != p])
            key = (worst, mine, tokens[p] > 0, p)
            if best_key is None or key < best_key:
                best_p, best_key = p, key
        put(i, best_p)
    return result


def dispatch(pool: Sequence[PoolEntry], lengths: Sequence[int], seed: int = 0, passes: int = SHUFFLED_PASSES,
             entry: int | None = None, by_cost: bool = False, current: int | None = None,
             switch_seconds: float = 0.0) -> Dispatch:
    """One step's Dispatch: the entry, the assignment and the packed micro-batches. Deterministic
    for a given seed. The entry is `entry` if given; else with `by_cost` the fitting entry whose
    predicted makespan, plus `switch_seconds` when it is not the `current` one, is the smallest
    (a strategy switch is only worth its price when the step gains more); else select_entry's."""
    lengths = list(lengths)
    if not lengths:
        raise HSPMDError("dispatch: the step has no sequences")
    bad = [s for s in lengths if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1]
    if bad:
        raise HSPMDError(f"dispatch: sequence lengths must be positive integers, got {bad[:5]}")
    lengths = [int(s) for s in lengths]
    if entry is not None:
        if isinstance(entry, bool) or not isinstance(entry, int) or not 0 <= entry < len(pool):
            raise HSPMDError(f"dispatch: entry must be an index into the pool of {len(pool)}, got {entry!r}")
        return _dispatch_to(pool, entry, lengths, seed, passes)
    if not by_cost:
        return _dispatch_to(pool, select_entry(pool, max(lengths)), lengths, seed, passes)
    plans = [_dispatch_to(pool, k, lengths, seed, passes) for k in fitting_entries(pool, max(lengths))]
    return min(plans, key=lambda d: (d.makespan + (switch_seconds if current not in (None, d.entry) else 0.0), d.entry))


def _dispatch_to(pool: Sequence[PoolEntry], k: int, lengths: list[int], seed: int, passes: int) -> Dispatch:
    chosen = pool[k]
    where = assign(chosen.pipelines, lengths, seed, passes)
    mbs, times = [], []
    for p, cost in enumerate(chosen.pipelines):
        ids = [i for i in range(len(lengths)) if where[i] == p]
        packed = pack_micro_batches(cost, [lengths[i] for i in ids], ids)
        mbs.append(packed)
        times.append(cost.time([[lengths[i] for i in mb] for mb in packed]))
    return Dispatch(k, where, tuple(mbs), tuple(times), chosen.sync)


def fit_sequence_cost(lengths: Sequence[int], seconds: Sequence[float], constant: bool = False
                      ) -> tuple[float, ...]:
    """(a, b) of a s^2 + b s, or (a, b, c) of a s^2 + b s + c with `constant`, fitted by least
    squares to measured times with every coefficient >= 0."""
    terms = 3 if constant else 2
    if len(lengths) != len(seconds) or len(lengths) < terms:
        raise HSPMDError(f"fit_sequence_cost: needs at least {terms} (length, time) measurements of equal count")
    if len(set(lengths)) < 2:
        raise HSPMDError("fit_sequence_cost: needs at least two different lengths")
    return nonnegative_least_squares([[s * s, s, 1.0][:terms] for s in lengths], seconds)


__all__ = [
    "Dispatch", "PipelineCost", "PoolEntry", "assign", "dispatch", "fit_sequence_cost", "fitting_entries",
    "pack_micro_batches",
    "packed_pipeline_time", "select_entry",
]
