"""Elastic training: a rank whose process dies does not end the job.

`ElasticTrainer` (over a hspmd.runtime.processes.membership.Membership) runs steps as transactions. Each
rank keeps the last few committed versions (step count, switches done) of its state; a failure
anywhere (forward, backward, gradient sync, optimizer update, switch, checkpoint save) raises
PeerLost on every survivor, which then
  1. joins the next generation (the launcher's announcement names the dead ranks),
  2. agrees through the store on the newest version every survivor has committed (the minimum of
     the survivors' versions: a rank that finished the step's update while another did not rolls
     back, so survivors never mix old and new weights),
  3. derives the new strategy (`recover_strategy`: every device equal, unless the job gave a
     `plan_recovery`, e.g. planning.replan on the job's cluster and model) and moves
     every lost piece from surviving replicas in one fused BSR (`plan_switch(..., failed=dead)`);
     when no living device holds some piece (no replica, e.g. a pure pipeline), every rank loads
     its pieces under the new strategy from the last checkpoint the job saved, in place (no
     restart), and training goes back to that step; with no checkpoint the job stops with an
     error naming the lost tensors,
  4. redoes the interrupted step from its start: no sample is lost or counted twice.

Versions can differ by at most a few between survivors because every step ends with a loss
all-reduce over all ranks of the strategy: nobody finishes step k+1 before everyone has entered the
end of step k. Keeping `HISTORY` versions covers a step, a switch and a save in between.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hspmd.backends.backend import Backend, Group, Shape
from hspmd.backends.generation import PeerLost
from hspmd.errors import HSPMDError, WeightLost
from hspmd.ir.graph import Graph
from hspmd.runtime.data.loader import SequenceLoader, saved_state
from hspmd.runtime.data.order import DataState
from hspmd.runtime.execution.batches import PipelineBatch
from hspmd.runtime.processes.membership import Membership, killed_at, killed_key
from hspmd.runtime.persistence.sharded_checkpoint import ShardedReader, step_dir
from hspmd.runtime.execution.buckets import DEFAULT_BUCKET_CAP_MB
from hspmd.runtime.execution.interpreter import DeviceState
from hspmd.runtime.training.trainer import Trainer, switched
from hspmd.specialize.strategy import Strategy
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from hspmd.switching import recover_strategy

HISTORY = 4
START = DataState()  # the data loader's state before a job's first step


# ---- fault injection --------------------------------------------------------------------------------

PHASES = ("step", "switch", "save")


@dataclass(frozen=True)
class KillPoint:
    """Rank `rank` SIGKILLs itself at its `call`-th backend call (0-based) of `phase` around step
    `step` (1-based): phase "step" counts from the start of the step (forward and backward
    transfers and collectives, gradient synchronisation, the loss all-reduce), "switch" and
    "save" count within a planned switch or checkpoint save right after step `step`."""

    step: int
    rank: int
    call: int = 1
    phase: str = "step"
    stall: bool = False  # hang there for good instead (alive, heartbeat beating): `--stall`

    def __post_init__(self):
        if self.step < 1 or self.rank < 0 or self.call < 0:
            raise HSPMDError(f"--kill {self}: steps count from 1, ranks and calls from 0")

    @staticmethod
    def parse(text: str, stall: bool = False) -> "KillPoint":
        """STEP=RANK[:CALL][@PHASE], as `--kill` (and `--stall`, with `stall`) takes it (e.g. 20=3, 20=3:7, 20=3:0@save)."""
        step, _, rest = text.partition("=")
        rest, _, phase = rest.partition("@")
        rank, _, call = rest.partition(":")
        try:
            step, rank, call = int(step), int(rank), int(call) if call else 1
        except ValueError:
            point = None
        else:
            point = KillPoint(step, rank, call, phase or "step", stall)
        if point is None or point.phase not in PHASES:
            raise HSPMDError(f"--kill {text!r}: write STEP=RANK[:CALL][@PHASE] with PHASE one of {', '.join(PHASES)}, "
                             f"e.g. --kill 20=3")
        return point

    def __str__(self) -> str:
        """The text `parse` reads (and `--kill` takes)."""
        return f"{self.step}={self.rank}:{self.call}@{self.phase}"


class FaultInjector(Backend):
    """Forwards to a backend and SIGKILLs this process at a KillPoint: a real, unannounced death
    in the middle of whatever the step is doing. Before dying it notes where in the store."""

    def __init__(self, inner: Backend, kills: Sequence[KillPoint], store: dist.Store | None = None):
        self.inner, self.rank, self.world_size, self.device = inner, inner.rank, inner.world_size, inner.device
        self.overlaps_collectives = inner.overlaps_collectives
        self.kills = [k for k in kills if k.rank == inner.rank]
        self.store, self.step, self.calls, self.phase = store, 0, 0, "step"
        if hasattr(inner, "post_sends"):
            self.post_sends = self._post_sends

    def begin(self, step: int, phase: str = "step") -> None:
        for k in self.kills:  # a point past what the phase did never fires: say so rather than pass silently
            if (k.step, k.phase) == (self.step, self.phase) and k.call >= self.calls:
                print(f"hspmd: warning: --kill {k} never fired: rank {self.rank} "
                      f"made {self.calls} backend call(s) in {k.phase} {k.step} (calls count from 0)",
                      file=sys.stderr, flush=True)
        self.step, self.phase, self.calls = step, phase, 0

    def _tick(self, op: str) -> None:
        for k in self.kills:
            if (k.step, k.phase, k.call) == (self.step, self.phase, self.calls) and k.stall:
                if self.store is not None:
                    self.store.set(killed_key(self.rank), f"stalled at step {self.step} {self.phase} call {self.calls}: {op}")
                while True:  # stuck for good: alive, its heartbeat thread beating, its peers waiting on it
                    time.sleep(3600)
            if (k.step, k.phase, k.call) == (self.step, self.phase, self.calls):
                if self.store is not None:
                    self.store.set(killed_key(self.rank) + "/time", repr(time.time()))
                    self.store.set(killed_key(self.rank), f"step {self.step} {self.phase} call {self.calls}: {op}")
                os.kill(os.getpid(), signal.SIGKILL)
        self.calls += 1

    def prepare_groups(self, groups) -> None:
        self.inner.prepare_groups(groups)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        self._tick("all_reduce")
        return self.inner.all_reduce(tensor, group)

    def all_reduce_start(self, tensor: torch.Tensor, group: Group):
        self._tick("all_reduce")
        return self.inner.all_reduce_start(tensor, group)

    def all_gather(self, tensor: torch.Tensor, group: Group, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        self._tick("all_gather")
        return self.inner.all_gather(tensor, group, shapes)

    def all_reduce_into(self, tensor: torch.Tensor, group: Group, out: torch.Tensor, op: str = "sum") -> None:
        self._tick("all_reduce")
        self.inner.all_reduce_into(tensor, group, out, op)

    def all_gather_into(self, tensor: torch.Tensor, group: Group, outs: Sequence[torch.Tensor]) -> None:
        self._tick("all_gather")
        self.inner.all_gather_into(tensor, group, outs)

    def reduce_scatter_into(self, parts: Sequence[torch.Tensor], group: Group, out: torch.Tensor,
                            op: str = "sum") -> None:
        self._tick("reduce_scatter")
        self.inner.reduce_scatter_into(parts, group, out, op)

    def exchange_into(self, sends, recvs) -> None:
        self._tick("exchange")
        self.inner.exchange_into(sends, recvs)

    def reduce_scatter(self, parts: Sequence[torch.Tensor], group: Group) -> torch.Tensor:
        self._tick("reduce_scatter")
        return self.inner.reduce_scatter(parts, group)

    def exchange(self, sends, recvs) -> dict[int, torch.Tensor]:
        self._tick("exchange")
        return self.inner.exchange(sends, recvs)

    def _post_sends(self, sends):
        self._tick("send")
        return self.inner.post_sends(sends)

    def barrier(self, group: Group) -> None:
        self._tick("barrier")
        self.inner.barrier(group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        self._tick("broadcast")
        return self.inner.broadcast(tensor, src, group)


# ---- the trainer --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Failure:
    """Ranks lost at once, the step to redo (1-based: the interrupted one, or the one after the
    checkpoint `restored_from` when no living replica held a lost piece), and the seconds from
    noticing the failure to being ready to redo it."""

    ranks: tuple[int, ...]
    step: int
    recovery_seconds: float
    strategy: str = ""
    restored_from: str | None = None
    killed_at: float | None = None  # time.time() of an injected kill, for measuring kill-to-step
    joined: tuple[int, ...] = ()  # restarted ranks taken back (a join, not a death, when ranks is empty)
    lost_nodes: tuple[int, ...] = ()  # nodes of a multi-node job that lost all their ranks
    detected_at: float | None = None  # time.time() the authority announced it (multi-node jobs)

    def as_json(self) -> dict:
        return {"ranks": list(self.ranks), "step": self.step, "recovery_seconds": self.recovery_seconds,
                "strategy": self.strategy, "restored_from": self.restored_from, "killed_at": self.killed_at,
                "joined": list(self.joined), "lost_nodes": list(self.lost_nodes), "detected_at": self.detected_at}


@dataclass
class _Version:
    """A committed state: steps done, boundary actions done since, the trainer, its leaves and
    where the data loader stands."""

    key: tuple[int, int]
    trainer: Trainer
    strategy: int
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)
    data: DataState = START


class ElasticTrainer:
    """Trainer over a Membership that survives the death of ranks.

    build_graph(strategies) builds the model's graph annotated with each strategy of the list (the
    same nodes every time; a recovery appends the recovered strategy). `describe(strategy)` names a
    strategy in logs and the failure record. `sharded`: checkpoints are directories of per-rank
    files written in the background (hspmd.runtime.persistence.sharded_checkpoint), else single files.
    `data`: a SequenceLoader; a step given no batch then trains this rank's share of the loader's
    next global batch, and the loader's state (`data_state`, from `data_state=`) is part of every
    transaction and checkpoint, so a redone step trains the same samples.
    `plan_recovery(strategy, failed)`: the strategy without the failed ranks (default
    switching.recover_strategy, every device equal; `cluster_recovery` plans on the real hardware)."""

    def __init__(self, build_graph: Callable[[Sequence[Strategy]], Graph], strategy: Strategy,
                 membership: Membership, schedule: str | None = None, symbols: Mapping[str, int] | None = None,
                 seed: int = 0, kills: Sequence[KillPoint] = (), describe: Callable[[Strategy], str] = str,
                 sharded: bool = False, data: SequenceLoader | None = None, data_state: DataState = START,
                 topology=None, bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
                 plan_recovery: Callable[[Strategy, set[int]], Strategy] | None = None):
        self._setup(build_graph, strategy, membership, schedule, symbols, seed, kills, describe, sharded, data, data_state,
                    topology, bucket_cap_mb, plan_recovery)
        self.strategies: list[Strategy] = [strategy]
        self.graph = build_graph(self.strategies)
        self.trainer = self._trainer(0)
        self._commit()

    def _setup(self, build_graph, strategy: Strategy, membership: Membership, schedule: str | None = None,
               symbols: Mapping[str, int] | None = None, seed: int = 0, kills: Sequence[KillPoint] = (),
               describe: Callable[[Strategy], str] = str, sharded: bool = False, data: SequenceLoader | None = None,
               data_state: DataState = START, topology=None,
               bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
               plan_recovery: Callable[[Strategy, set[int]], Strategy] | None = None) -> None:
        self.plan_recovery = plan_recovery or recover_strategy
        self.build_graph, self.membership = build_graph, membership
        self.schedule, self.symbols, self.seed, self.describe = schedule, dict(symbols or {}), seed, describe
        self.topology, self.bucket_cap_mb = topology, bucket_cap_mb
        self.kills = tuple(kills)
        outside = [str(k) for k in self.kills if k.rank >= membership.world_size]
        if outside:
            raise HSPMDError(f"--kill {', '.join(outside)}: the job has ranks 0-{membership.world_size - 1}")
        self._injector: FaultInjector | None = None
        self.checkpoint_path: str | None = None
        self.sharded = sharded
        self.restored_from: str | None = None
        self.failures: list[Failure] = []
        self.switches_done = 0
        self._history: list[_Version] = []
        self.data, self.data_state = data, data_state
        self.last_batch: PipelineBatch | None = None

    # ---- pieces -----------------------------------------------------------------------------------

    def _backend(self) -> Backend:
        """The current generation's backend (behind one FaultInjector per generation if kills are planned)."""
        inner = self.membership.backend
        if not self.kills:
            return inner
        if self._injector is None or self._injector.inner is not inner:
            self._injector = FaultInjector(inner, self.kills, self.membership.store)
        return self._injector

    def _trainer(self, index: int, state: DeviceState | None = None) -> Trainer:
        """The trainer of strategy `index` on the current generation (`state`: its pieces and step,
        default the initial values)."""
        return Trainer(self.graph, index, self._backend(), self.strategies[index], self.schedule, self.symbols,
                       self.seed, self.topology, bucket_cap_mb=self.bucket_cap_mb, state=state)

    def _begin(self, phase: str) -> None:
        backend = self._backend()
        if isinstance(backend, FaultInjector):
            backend.begin(self.trainer.steps_done + (phase == "step"), phase)

    def _commit(self) -> None:
        version = _Version((self.trainer.steps_done, self.switches_done), self.trainer,
                           self.trainer.specialized.deduced.strategy, dict(self.trainer.state.leaves), self.data_state)
        self._history = (self._history + [version])[-HISTORY:]

    @property
    def strategy(self) -> Strategy:
        return self.strategies[self.trainer.specialized.deduced.strategy]

    @property
    def steps_done(self) -> int:
        return self.trainer.steps_done

    @property
    def rank(self) -> int:
        return self.membership.rank

    # ---- transactions -------------------------------------------------------------------------------

    def step(self, batch: Mapping[str, torch.Tensor] | None = None) -> float | None:
        """One step (on this rank's share of the data loader's next batch when `batch` is None);
        raises PeerLost (after which call recover()) if a rank died during it."""
        self._begin("step")
        after = None
        if batch is None:
            if self.data is None:
                raise HSPMDError("ElasticTrainer.step(): no batch given and no data loader to read one from")
            batch, after = self.data.share(self.trainer, self.data_state)
            self.last_batch = batch
        loss = self.trainer.step(batch)
        if after is not None:
            self.data_state = after
        self._commit()
        return loss

    def switch(self, strategy: Strategy) -> None:
        """A planned switch at a step boundary (collective). Targets naming dead ranks are first
        recovered without them."""
        lost = set(strategy.all_ranks) & self.membership.dead
        target = self.plan_recovery(strategy, lost) if lost else strategy
        self._begin("switch")
        self._move_to(target, failed=())
        self.switches_done += 1
        self._commit()

    def save(self, path, wait: bool = True) -> None:
        """Checkpoint save at a step boundary. A single file (`sharded` off) is a collective
        gather and an atomic replace: a failure half-way leaves the previous file. Sharded (a
        directory, hspmd.runtime.persistence.sharded_checkpoint): every rank writes its own pieces in the
        background (`wait` or not); a death before the index is written leaves the previous
        step the latest."""
        self._begin("save")
        data = self.data_state.to_json() if self.data is not None else None
        if self.sharded:
            pending = self.trainer.save_sharded(path, data=data)
            if pending is not None and wait:
                pending.wait()
        else:
            self.trainer.save_checkpoint(path, data=data)
        self.checkpoint_path = os.fspath(path)

    def _adopt(self, target: Strategy) -> int:
        """Append `target` to the graph's strategies (the graph is rebuilt); its index."""
        self.strategies.append(target)
        self.graph = self.build_graph(self.strategies)
        return len(self.strategies) - 1

    def _move_to(self, target: Strategy, failed: Sequence[int], leaves: Mapping[str, torch.Tensor] | None = None,
                 source: int | None = None, steps: int | None = None) -> None:
        """Move this rank's `leaves` (default the trainer's) of strategy `source` to `target`,
        appended to the graph's strategies, on the current generation (the one switch routine,
        hspmd.runtime.training.trainer.switched)."""
        source = self.trainer.specialized.deduced.strategy if source is None else source
        leaves = self.trainer.state.leaves if leaves is None else leaves
        steps = self.trainer.steps_done if steps is None else steps
        index = self._adopt(target)
        self.trainer = switched(self.graph, source, index, self._backend(), target, leaves, steps, failed=failed,
                                schedule=self.schedule, symbols=self.symbols, seed=self.seed, topology=self.topology,
                                bucket_cap_mb=self.bucket_cap_mb)

    def _restore(self, target: Strategy, lost: WeightLost) -> None:
        """No living replica holds some piece: load every rank's pieces under `target` from the
        last checkpoint this job saved (each rank reads only its own boxes; the survivors keep
        running), going back to its step. Without one, the job cannot continue."""
        if self.checkpoint_path is None or not os.path.exists(self.checkpoint_path):
            raise HSPMDError(f"rank {self.rank}: cannot recover: {lost} (and this job saved no checkpoint to restore "
                             f"from; train with --save-every N)") from lost
        path = self.checkpoint_path
        if self.sharded:
            # a background save may commit a newer step while the survivors open the checkpoint:
            # all of them load the oldest step any of them saw as the latest (complete on disk)
            seen = ShardedReader.open(path).step
            path = step_dir(path, min(self.membership.agree("restore", (seen,)))[0])
        index = self.strategies.index(target) if target in self.strategies else self._adopt(target)
        nxt = self._trainer(index, DeviceState({}))  # every piece comes from the checkpoint
        nxt.load_checkpoint(path)
        if self.data is not None:
            self.data_state = saved_state(path) or DataState()
        nxt.last_switch = None
        self.trainer = nxt
        self.restored_from = self.checkpoint_path

    def train(self, steps: int, batch: Callable[[int], Mapping[str, torch.Tensor]] | None = None,
              switches: Sequence[tuple[int, Strategy]] = (), save_every: int = 0, save_path=None,
              on_step: Callable[[int, float | None], None] | None = None,
              on_failure: Callable[[Failure], None] | None = None,
              on_switch: Callable[[int, Strategy], None] | None = None) -> dict[int, float | None]:
        """Train until `steps` steps are done, surviving deaths: {step (1-based): loss}.

        batch(k) is the global batch of step k+1 (the same on every rank; None: the data loader's);
        `switches` are planned
        switches (after step, to strategy), `save_every` saves to `save_path` every N steps. A
        step, switch or save interrupted by a death is redone after recovery."""
        planned = sorted(switches, key=lambda s: s[0])
        losses: dict[int, float | None] = {}
        saved = self.steps_done
        while self.steps_done < steps:
            try:
                done = self.steps_done
                pending = [(at, s) for i, (at, s) in enumerate(planned) if i >= self.switches_done and at == done]
                if pending:
                    self.switch(pending[0][1])
                    if on_switch is not None:
                        on_switch(done, self.strategy)
                    continue
                if save_every and save_path is not None and done % save_every == 0 and done != saved:
                    self.save(save_path, wait=False)
                    saved = done
                loss = self.step(batch(done) if batch is not None else None)
                losses[done + 1] = loss
                if on_step is not None:
                    on_step(done + 1, loss)
            except PeerLost:
                failure = self.recover(time.monotonic())
                for k in [k for k in losses if k >= failure.step]:
                    del losses[k]
                if on_failure is not None:
                    on_failure(failure)
        return losses

    def _grow_target(self, dead: set[int]) -> Strategy:
        """The strategy that uses the ranks back after a restart: the job's first strategy, without
        the ranks that are still dead."""
        original = self.strategies[0]
        lost = dead & set(original.all_ranks)
        return self.plan_recovery(original, lost) if lost else original

    def recover(self, noticed: float | None = None) -> Failure:
        """After PeerLost: join the next generation, roll back to the newest version every survivor
        committed, move to a strategy without the dead ranks (or, when restarted ranks joined, to
        one that uses them again: they receive their pieces through the same fused BSR), and
        return the Failure record. Retries if another rank dies meanwhile."""
        noticed = time.monotonic() if noticed is None else noticed
        before, joined_before = set(self.membership.dead), set(self.membership.rejoined)
        generations = range(self.membership.generation + 1, 1 << 62)
        while True:
            try:
                self.membership.next_generation()
                agreed = min(v for v in self.membership.agree("version", self._history[-1].key) if v[0] >= 0)
                version = next((v for v in self._history if v.key == agreed), None)
                if version is None:
                    raise HSPMDError(f"rank {self.rank}: survivors agreed on version {agreed} but this "
                                     f"rank only kept {[v.key for v in self._history]}")
                self.trainer, self.switches_done, self.data_state = version.trainer, version.key[1], version.data
                self.trainer.state.step = version.key[0]
                self.trainer.state.accum.clear()
                dead = set(self.membership.dead)
                old = self.strategies[version.strategy]
                failed = sorted(dead & set(old.all_ranks))
                if self.membership.joined:
                    target = self._grow_target(dead)
                else:
                    target = self.plan_recovery(old, set(failed)) if failed else old
                if self.membership.joined and self.rank == min(self.membership.original):
                    self.membership.store.set(_plan_key(self.membership.generation), json.dumps({
                        "source": format_strategy(old), "target": format_strategy(target), "failed": failed,
                        "steps": version.key[0], "switches": version.key[1], "checkpoint": self.checkpoint_path,
                        "data": version.data.to_json()}))
                self.restored_from = None
                try:
                    self._move_to(target, failed=failed, leaves=dict(version.leaves), source=version.strategy)
                except WeightLost as lost:
                    self._restore(target, lost)
                self._history = []
                self._commit()
                break
            except PeerLost:
                continue
        ranks = tuple(sorted(set(self.membership.dead) - before))
        kills = [t for t in (killed_at(self.membership.store, r) for r in ranks) if t is not None]
        lost, detected = self.membership.announcements(generations)
        failure = Failure(ranks, self.trainer.steps_done + 1, time.monotonic() - noticed, self.describe(self.strategy),
                          self.restored_from, min(kills) if kills else None,
                          tuple(sorted(set(self.membership.rejoined) - joined_before)), lost, detected)
        self.failures.append(failure)
        return failure

    @classmethod
    def join(cls, build_graph: Callable[[Sequence[Strategy]], Graph], membership: Membership, **options) -> "ElasticTrainer":
        """A restarted rank (Membership(joining=True)) joins the running job: it learns from the
        survivors which strategy they leave and which one takes it back, and receives its pieces
        through their fused BSR (it has none to send)."""
        membership.agree("version", (-1, -1))  # a joining rank holds no version
        plan = json.loads(membership.store.get(_plan_key(membership.generation)))
        source, target = parse_strategy(plan["source"]), parse_strategy(plan["target"])
        self = cls.__new__(cls)
        self._setup(build_graph, source, membership, **options)
        self.strategies = [source]
        self.graph = build_graph(self.strategies)
        self.switches_done, self.checkpoint_path = plan["switches"], plan["checkpoint"]
        self.data_state = DataState.from_json(plan["data"], "the survivors' join plan")
        self.trainer = None
        try:
            self._move_to(target, failed=plan["failed"], leaves={}, source=0, steps=plan["steps"])
        except WeightLost as lost:
            self._restore(target, lost)
        self._commit()
        return self


def cluster_recovery(cluster, model, calibration=None) -> Callable[[Strategy, set[int]], Strategy]:
    """Recovery planned on the job's hardware: planning.replan (through recover_strategy) with the
    job's cluster and model, priced by `calibration`'s fit of this host when given and the cluster
    is emulated here (Calibration.cost_model_for), else by the cluster file's nominal figures."""
    options = {}
    if calibration is not None and cluster.emulation is not None:
        from hspmd.planning.search.costed import CostModelEvaluator

        options["evaluator"] = CostModelEvaluator(calibration.cost_model_for(cluster, model))

    def plan(strategy: Strategy, failed: set[int]) -> Strategy:
        return recover_strategy(strategy, failed, cluster=cluster, model=model, **options)

    return plan


def _plan_key(generation: int) -> str:
    return f"g{generation}/join-plan"


__all__ = ["ElasticTrainer", "Failure", "FaultInjector", "KillPoint", "cluster_recovery"]
