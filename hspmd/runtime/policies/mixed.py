"""Mixed-length training (Hetu v2 section 7.3): a step's strategy, its sequences' pipelines and
micro-batches chosen per step from a pool (hspmd.planning.dispatch), one rank's part.

Hetu-B (`step`): the step's longest sequence picks one pool entry; dispatch assigns the sequences
to that strategy's pipelines and packs each pipeline's share into rows (hspmd.runtime.execution.packing);
the trainer switches strategy (fused BSR) only when the choice changes. Hetu-A (`step_buckets`,
HotSPa's scheme): every sequence goes to the bucket of the narrowest length interval holding it;
the buckets run one after another inside the step, each under its own strategy, the accumulated
gradients synchronised and moved with the weights at each bucket boundary; one update at the end.

The loss is token-weighted over the whole step (T = the step's counted tokens), so the gradient
equals the single-device gradient of the same sequences whatever the dispatch or bucketing.
Each strategy is specialized once; its comm plans are resolved once per micro-batch binding
(sequence length) and kept, each switch is planned once per pair of strategies and each
strategy's trainer is built once (a switch back refills it), so a switch back, or a length seen
before, resolves nothing anew.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from hspmd.backends.backend import Backend
from hspmd.errors import HSPMDError
from hspmd.ir.graph import Graph
from hspmd.ops.nn import IGNORE_INDEX
from hspmd.planning.dispatch import SHUFFLED_PASSES, Dispatch, PoolEntry, dispatch, fit_sequence_cost, select_entry
from hspmd.runtime.data.loader import DocumentStep
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.packing import PACKED_FIELDS, Sample, check_sample, counted_tokens, pack_row
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.specialized import Specialized
from hspmd.switching import SwitchPlan


@dataclass(frozen=True)
class StepReport:
    """What one mixed-length step did: per part (one for Hetu-B, one per bucket for Hetu-A) the
    pool entry, its dispatch and the sequences' lengths; the switches made (pool entry names);
    the step loss."""

    step: int
    entries: tuple[int, ...]
    dispatches: tuple[Dispatch, ...]
    lengths: tuple[tuple[int, ...], ...]
    switches: tuple[tuple[str, str], ...]
    loss: float | None


class MixedLengthTrainer:
    """One rank's mixed-length training of `graph` (built with every pool strategy, packed) over
    `backend`. pool: PoolEntry per strategy (entry.strategy = its graph index). symbols: the
    reference binding every strategy is specialized under (per-micro-batch values replace it);
    tokens_symbol: the graph's tokens-per-step symbol. by_cost: choose each step's strategy by
    predicted time, a switch priced at `switch_seconds` (hspmd.planning.dispatch), rather than by
    the paper's length bounds alone; calibrate() measures both on this machine. Construction is
    collective."""

    def __init__(self, graph: Graph, pool: Sequence[PoolEntry], backend: Backend, schedule: str = "1f1b",
                 symbols: Mapping[str, int] | None = None, seed: int = 0, topology=None, dispatch_seed: int = 0,
                 passes: int = SHUFFLED_PASSES, tokens_symbol: str = "T", by_cost: bool = False,
                 switch_seconds: float = 0.0):
        if not pool:
            raise HSPMDError("MixedLengthTrainer: the strategy pool is empty")
        self.graph, self.pool, self.backend = graph, tuple(pool), backend
        self.schedule, self.symbols, self.seed, self.topology = schedule, dict(symbols or {"S": 16, "T": 16}), seed, topology
        self.dispatch_seed, self.passes, self.tokens_symbol = dispatch_seed, passes, tokens_symbol
        self.by_cost, self.switch_seconds = by_cost, switch_seconds
        self._specs: dict[int, Specialized] = {}
        self._switch_plans: dict[tuple[int, int, bool], SwitchPlan] = {}  # (from, to, carrying gradients)
        self._trainers: dict[int, Trainer] = {}  # per pool entry: a switch back refills it, builds nothing
        self.trainer: Trainer | None = None
        self.current: int | None = None
        self.steps = 0
        self.history: list[StepReport] = []

    # ---- strategies -----------------------------------------------------------------------------

    def _layout(self, k: int) -> MicroBatchLayout:
        n = len(self.pool[k].pipelines)
        return MicroBatchLayout((1,) * n, (1,) * n)

    def _enter(self, k: int, carry=None) -> tuple[str, str] | None:
        """Make pool entry k's strategy the current one; the switch made, if any."""
        entry = self.pool[k]
        if self.trainer is None:
            self.trainer = Trainer(self.graph, entry.strategy, self.backend, self._layout(k), self.schedule,
                                   self.symbols, self.seed, self.topology, self._specs.get(entry.strategy))
        elif self.current == k:
            return None
        else:
            key = (self.trainer.specialized.deduced.strategy, entry.strategy, carry is not None)
            previous = self.trainer
            self.trainer = self.trainer.switch(entry.strategy, self._layout(k), specialized=self._specs.get(entry.strategy),
                                               carry=carry, plan=self._switch_plans.get(key),
                                               reuse=self._trainers.get(k))
            self._switch_plans[key] = self.trainer.last_switch
            previous.release()
        self._specs[entry.strategy] = self.trainer.specialized
        self._trainers[k] = self.trainer
        before, self.current = self.current, k
        return None if before is None else (self.pool[before].name, entry.name)

    def _rows(self, samples: Sequence[Sample], d: Dispatch, ids: Sequence[int]):
        """Each pipeline's packed rows; a pipeline given no sequence runs one ignored token (its
        gradients are exact zeros), so every rank runs the same update program. From a
        DocumentStep, only this rank's pipeline's sequences are read: the other pipelines' rows
        are stand-ins on `meta` of their shapes (what binds their symbols)."""
        idle = [pack_row([(torch.zeros(1, dtype=torch.int64), torch.full((1,), IGNORE_INDEX))])]
        lazy = isinstance(samples, DocumentStep)

        def row(p: int, mb) -> dict[str, torch.Tensor]:
            if lazy and p != self.trainer.pipeline:
                size = sum(samples.lengths[ids[i]] for i in mb)
                return {k: torch.empty((1, size), dtype=torch.int64, device="meta") for k in PACKED_FIELDS}
            return pack_row([samples[ids[i]] for i in mb])

        return [[row(p, mb) for mb in mbs] or idle for p, mbs in enumerate(d.micro_batches)]

    # ---- steps ----------------------------------------------------------------------------------

    def _lengths(self, samples: Sequence[Sample]) -> list[int]:
        if not samples:
            raise HSPMDError("MixedLengthTrainer: a step needs at least one sequence")
        if isinstance(samples, DocumentStep):  # lengths from the index: nothing read yet
            return list(samples.lengths)
        return [check_sample(s, f"step {self.steps}, sequence {i}") for i, s in enumerate(samples)]

    @staticmethod
    def _counted(samples: Sequence[Sample]) -> int:
        return samples.counted if isinstance(samples, DocumentStep) else counted_tokens(samples)

    def step(self, samples: Sequence[Sample]) -> float | None:
        """Hetu-B: one step on these sequences ((tokens, labels) pairs, the same on every rank; or a
        DocumentStep, of which this rank reads only the sequences dispatched to its pipeline)."""
        lengths = self._lengths(samples)
        d = dispatch(self.pool, lengths, seed=self.dispatch_seed + self.steps, passes=self.passes, by_cost=self.by_cost,
                     current=self.current, switch_seconds=self.switch_seconds)
        switch = self._enter(d.entry)
        loss = self.trainer.step_rows(self._rows(samples, d, range(len(samples))),
                                      {self.tokens_symbol: self._counted(samples)})
        return self._report([d.entry], [d], [lengths], [switch] if switch else [], loss)

    def step_buckets(self, samples: Sequence[Sample]) -> float | None:
        """Hetu-A: the step's sequences in length buckets (one per pool entry, the narrowest interval
        holding each), run bucket after bucket, the current strategy's first, then by decreasing
        bound; gradients accumulate across buckets and move with the weights; one update."""
        lengths = self._lengths(samples)
        buckets: dict[int, list[int]] = {}
        for i, s in enumerate(lengths):
            buckets.setdefault(select_entry(self.pool, s), []).append(i)
        order = sorted(buckets, key=lambda k: (k != self.current, -self.pool[k].max_seq_len, k))
        tokens = {self.tokens_symbol: self._counted(samples)}
        entries, dispatches, parts, switches, losses, carry = [], [], [], [], [], None
        for n, k in enumerate(order):
            ids = buckets[k]
            d = dispatch(self.pool, [lengths[i] for i in ids], seed=self.dispatch_seed + self.steps,
                         passes=self.passes, entry=k)
            switch = self._enter(k, carry=carry)
            if switch:
                switches.append(switch)
            rows = self._rows(samples, d, ids)
            carried = self.trainer.carried
            if n + 1 < len(order):
                part, carry = self.trainer.bucket_rows(rows, tokens, carried=carried)
            else:
                part = self.trainer.step_rows(rows, tokens, carried=carried)
            self.trainer.carried = {}
            losses.append((self.trainer.devices, part))
            entries.append(k)
            dispatches.append(d)
            parts.append(tuple(lengths[i] for i in ids))
        return self._report(entries, dispatches, parts, switches, self._step_loss(losses))

    def _step_loss(self, losses: Sequence[tuple[tuple[int, ...], float | None]]) -> float | None:
        """The step loss from its buckets' (strategy devices, loss on this rank): their sum, on
        every rank. A bucket's loss is known only to the ranks of its strategy, so where a bucket's
        strategy leaves some rank out, each bucket's loss is counted by its strategy's lowest rank
        and one all-reduce over the job gives every rank the sum (the same choice on every rank:
        each knows every bucket's strategy)."""
        if not self.graph.losses:
            return None
        world = tuple(range(self.backend.world_size))
        if all(set(devices) == set(world) for devices, _ in losses):
            known = [part for _, part in losses if part is not None]
            return sum(known) if known else None
        rank = self.backend.rank
        mine = sum(part for devices, part in losses if part is not None and devices[0] == rank)
        total = self.backend.all_reduce(torch.tensor(float(mine), dtype=torch.float64, device=self.backend.device),
                                        world)
        return float("nan") if total.is_meta else float(total)

    # ---- calibration ----------------------------------------------------------------------------

    def calibrate(self, lengths: Sequence[int] = (8, 16, 32, 64, 128), repeats: int = 3) -> tuple[PoolEntry, ...]:
        """Collective: fit every pool entry's costs on this machine, through the real runtime:
        per pipeline a s^2 + b s + c (a sequence of s tokens; c per micro-batch), per step the
        entry's `sync`; and the price of a switch. Keep and return the calibrated pool.

        Each entry's strategy runs forward, backward and gradient synchronisation (no update: the
        weights do not change) on one sequence of each length per pipeline, all pipelines at
        once, `repeats` times. A pipeline's time is its slowest rank's schedule (forward and
        backward, ScheduleRun.seconds), so pipelines of different widths (a heterogeneous
        strategy) get their own fits; the sync is what the step takes beyond the slowest
        pipeline. The switch price is the median of switches there and back between the first
        entry and each other, planned beforehand (the trainer keeps each pair's plan). Every rank
        gathers the same figures, fits the same pool and dispatches alike."""
        if not lengths or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in lengths):
            raise HSPMDError(f"calibrate: lengths must be positive ints, got {list(lengths)}")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise HSPMDError(f"calibrate: repeats must be a positive int, got {repeats!r}")
        start = 0 if self.current is None else self.current
        calibrated, switches = [], []
        for k, entry in enumerate(self.pool):
            self._enter(k)
            usable = sorted({s for s in lengths if s <= min(entry.max_seq_len, entry.longest_fit)})
            if len(usable) < 3:
                raise HSPMDError(f"calibrate: pool entry {entry.name} holds only {usable} of lengths {list(lengths)}; "
                                 f"give at least three lengths it takes")
            per_pipeline = [[] for _ in entry.pipelines]  # [pipeline][length] median schedule seconds
            syncs = []
            for s in usable:
                runs = [self._timed_parts(lambda: self.trainer.bucket_rows(
                    [[self._probe_row(s)] for _ in entry.pipelines], {self.tokens_symbol: s}))
                    for _ in range(repeats)]
                for p, times in enumerate(per_pipeline):
                    times.append(statistics.median(max(t for q, t in schedules if q == p) for _, schedules in runs))
                syncs.extend(total - max(t for _, t in schedules) for total, schedules in runs)
            fits = [fit_sequence_cost(usable, times, constant=True) for times in per_pipeline]
            calibrated.append(replace(entry, sync=max(0.0, statistics.median(syncs)), pipelines=tuple(
                replace(p, a=a, b=b, c=c) for p, (a, b, c) in zip(entry.pipelines, fits))))
        if self.current != start:
            self._enter(start)
        for k in range(len(self.pool)):  # the price of a switch once it is planned (plans are kept): there and back
            if k != start:
                switches.append(self._timed(lambda: self._enter(k)))
                switches.append(self._timed(lambda: self._enter(start)))
        self.pool = tuple(calibrated)
        self.switch_seconds = statistics.median(switches) if switches else 0.0
        return self.pool

    def _probe_row(self, length: int) -> dict[str, torch.Tensor]:
        tokens = torch.arange(length, dtype=torch.int64) % 2
        return pack_row([(tokens, tokens)])

    def _timed(self, fn) -> float:
        """Seconds of fn() on the slowest rank, started together; the same value on every rank."""
        return self._timed_parts(fn)[0]

    def _timed_parts(self, fn) -> tuple[float, list[tuple[int, float]]]:
        """fn() started together on every rank: (the slowest rank's seconds, [(pipeline, schedule
        seconds) of every rank that ran one]), the same on every rank (gathered)."""
        world = tuple(range(self.backend.world_size))
        self.backend.barrier(world)
        began = time.perf_counter()
        self.trainer.last_run = None
        fn()
        elapsed = time.perf_counter() - began
        run = self.trainer.last_run
        mine = torch.tensor([elapsed, -1.0 if run is None else float(self.trainer.pipeline),
                             0.0 if run is None else run.seconds], dtype=torch.float64, device=self.backend.device)
        rows = [row.tolist() for row in self.backend.all_gather(mine, world, [(3,)] * len(world))]
        return max(r[0] for r in rows), [(int(r[1]), r[2]) for r in rows if r[1] >= 0]

    def _report(self, entries, dispatches, lengths, switches, loss) -> float | None:
        self.history.append(StepReport(self.steps, tuple(entries), tuple(dispatches),
                                       tuple(tuple(x) for x in lengths), tuple(switches), loss))
        self.steps += 1
        return loss

    def parameters(self) -> dict | None:
        """Whole parameters and optimizer states on the strategy's lowest rank (collective)."""
        return self.trainer.state_dict()


__all__ = ["MixedLengthTrainer", "StepReport"]
