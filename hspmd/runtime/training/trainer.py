"""Training one strategy, one rank's part: every rank builds the same graph, constructs a Trainer
over its Backend and calls step(batch) with the same global batch.

    backend = backend_from_env()                    # under `hspmd run -n 4 [--backend nccl]` or torchrun
    trainer = Trainer(graph, 0, backend, MicroBatchLayout.of(strategy),
                      schedule="1f1b", symbols={"S": 16, "T": 96})
    loss = trainer.step({"tokens": x, "labels": y})  # the same value on every rank
    trainer.save_checkpoint("ckpt.safetensors")     # collective; rank-independent file

The backend decides where the ranks are: torch.distributed (gloo / NCCL) for one process per
rank, the in-process backend for every rank as a thread of one process (hspmd.runtime.training.inprocess
runs the same Trainer that way). The batch is always the global batch, laid out pipeline by
pipeline as hspmd.runtime.execution.batches.MicroBatchLayout says.

Each rank specializes the graph for itself, finds its pipeline and stage among the discovered
pipelines, and runs its stage's schedule over its pipeline's own micro-batches (pipelines may
differ in stage count, micro-batch count and size). The update (gradient synchronisation across
pipelines + optimizer) runs once per step on every rank.

Stages are numbered in the discovered (topological) order. For a pipeline whose stages form a DAG
rather than a chain, 1F1B's warm-up then counts every later stage, not only those on this stage's
path: more warm-up than needed (more activations kept), but still strictly decreasing along every
link, which is what keeps the order deadlock-free.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import sympy
import torch

from hspmd.annotations import Annotation, box_relative, box_shape, device_pieces, subgroup_regions
from hspmd.errors import HSPMDError, HSPMDTypeError, ShapeError
from hspmd.limits import brief
from hspmd.ir.graph import Graph, Node
from hspmd.ir.shapes import Binding
from hspmd.backends.backend import Backend
from hspmd.runtime.execution.batches import MicroBatchLayout, PipelineBatch
from hspmd.runtime.execution.buckets import DEFAULT_BUCKET_CAP_MB, BucketSync, cap_bytes_of
from hspmd.runtime.persistence.checkpoint import (
    DATA_KEY, CheckpointReader, check_leaf_names, cut_from_tensors, cut_leaves, gather_leaves, gather_whole, save_checkpoint,
)
from hspmd.runtime.execution.checks import check_bound, check_feeds, check_seed, checked_ranks, checked_symbols
from hspmd.runtime.execution.interpreter import DeviceState, Passes, ScheduleRun, run_step, step_loss
from hspmd.runtime.execution.run import Recompute, lower_executable
from hspmd.runtime.persistence.dcp_checkpoint import DCPCheckpoint, open_any_checkpoint, save_dcp, save_pieces
from hspmd.runtime.persistence.sharded_checkpoint import PendingSave, ShardedReader, save_sharded
from hspmd.runtime.execution.trace import Tracer
from hspmd.specialize import comm_plans
from hspmd.specialize.schedules import Schedule, pipeline_schedule, schedule_for
from hspmd.specialize.deduce import Deduced, check_strategy_index
from hspmd.specialize.bucket_plan import plan_buckets
from hspmd.specialize.executable import ExecutableGraph, run_time_ratios
from hspmd.specialize.specialized import Specialized, all_devices, specialize_graph
from hspmd.specialize.strategy import Pipeline, Strategy
from hspmd.switching import (
    GRADIENT_PREFIX, SwitchPlan, execute_switch, gradient_leaves, plan_switch, plan_switch_with_gradients,
)


def batch_symbol(graph: Graph) -> sympy.Symbol:
    """The symbol every placeholder's dim 0 is declared with (the micro-batch size)."""
    firsts = {p.output.shape[0] for p in graph.placeholders if p.output.shape}
    symbols = {d for d in firsts if isinstance(d, sympy.Symbol)}
    if len(firsts) != 1 or len(symbols) != 1:
        raise ShapeError(
            f"graph {graph.name}: the trainer splits placeholders along dim 0, which must be one shared "
            f"batch symbol in every placeholder, found {sorted(map(str, firsts))}"
        )
    return symbols.pop()


def summing_devices(ann: Annotation, shape: tuple[int, ...], ratios=None) -> tuple[int, ...]:
    """One holder per distinct piece (the first in device-group order), skipping replicated
    subgroups: the devices whose values add up to a scalar laid out as `ann`."""
    pieces = device_pieces(ann, shape, ratios)
    subgroups = ann.subgroups[:1] if ann.hdim == "D" else ann.subgroups
    chosen, seen = [], set()
    for k, sub in enumerate(subgroups):
        for d in sub.dg:
            key = (k, pieces[d].box, pieces[d].summand)
            if key not in seen:
                seen.add(key)
                chosen.append(d)
    return tuple(chosen)


def within_pipeline(ann: Annotation) -> bool:
    """Whether a placeholder's subgroups lie inside one pipeline: its top tier splits another dim
    than the batch (uneven context-parallel shares split the sequence across a stage's CP groups)."""
    return isinstance(ann.hdim, int) and ann.hdim != 0


def pipeline_region(ann: Annotation, shape: tuple[int, ...], device: int, ratios=None) -> tuple[tuple[int, int], ...]:
    """The region of a placeholder that `device`'s pipeline feeds (its rows of a micro-batch)."""
    if within_pipeline(ann):  # the subgroups share the pipeline's rows
        return tuple((0, n) for n in shape)
    k = next(k for k, sub in enumerate(ann.subgroups) if device in sub.dg.devices)
    return subgroup_regions(ann, shape, ratios)[k]


def batch_hsize(deduced: Deduced) -> int:
    """Across how many subgroups (pipelines) the placeholders split the batch."""
    return max(1 if within_pipeline(a) else a.hsize for a in (deduced[p.output] for p in deduced.graph.placeholders))


def batch_subgroup(deduced: Deduced, devices) -> int:
    """Index of the batch-annotation subgroup (= strategy pipeline) that holds `devices`."""
    for p in deduced.graph.placeholders:
        ann = deduced[p.output]
        for k, sub in enumerate(ann.subgroups):
            if set(sub.dg.devices) & set(devices):
                return 0 if within_pipeline(ann) else k
    raise HSPMDError(f"no placeholder of graph {deduced.graph.name} is fed to pipeline {list(devices)}")


def step_groups(exe: ExecutableGraph, devices: tuple[int, ...], binding: Binding) -> list[tuple[int, ...]]:
    """The collective groups a rank's step uses, its own alone (backends that create groups up front
    create the union of every rank's, so another rank's groups come from their members)."""
    groups = {devices}
    for ins in exe.instructions():
        if ins.role == "collective":
            groups.update(comm_plans.groups_of(exe.plan(ins.node, binding)).get(exe.device, ()))
    return sorted(groups)


def as_layout(layout: MicroBatchLayout | Strategy) -> MicroBatchLayout:
    if isinstance(layout, MicroBatchLayout):
        return layout
    if isinstance(layout, Strategy):
        return MicroBatchLayout.of(layout)
    raise HSPMDTypeError(f"the micro-batch layout is a MicroBatchLayout or a Strategy with bound micro-batch counts, "
                         f"got {brief(layout)}")


def trainer_binding(graph: Graph, layout: MicroBatchLayout, symbols: Mapping[str, int] | None) -> Binding:
    """The binding a trainer runs under: `symbols`, plus the batch symbol bound to one micro-batch
    of every pipeline (the sum of the sizes), split across pipelines in the sizes' ratios."""
    return Binding.of({**dict(symbols or {}), batch_symbol(graph).name: sum(layout.sizes)}, ratios=layout.sizes)


def pipeline_options(spec: Specialized, layout: MicroBatchLayout, strategy: Strategy | None, schedule: str | None,
                     recompute: bool | None) -> list[tuple[str, tuple[tuple | None, ...]]]:
    """Per discovered pipeline of `spec`: its schedule and each stage's recompute choice, (layers
    or None, granularity) or None (the arguments, else the Strategy's pipeline, else 1f1b and none). What a Trainer and a compiled
    program run alike. Every schedule is checked (a schedule that does not suit a pipeline fails
    on every rank alike, not on that pipeline's ranks)."""
    out, checked = [], set()
    for pipeline in spec.pipelines:
        count = layout.counts[batch_subgroup(spec.deduced, pipeline.devices)]
        declared = declared_pipeline(strategy, pipeline)
        chosen = schedule or (declared.schedule_spec if declared else None) or "1f1b"
        if (chosen, len(pipeline.stages), count) not in checked:  # thousands of equal pipelines at scale
            checked.add((chosen, len(pipeline.stages), count))
            pipeline_schedule(chosen, len(pipeline.stages), count)
        if recompute is not None:
            flags = ((None, "full") if recompute else None,) * len(pipeline.stages)
        else:
            flags = tuple((s.recompute_layers, s.recompute_granularity) if s.recompute else None
                          for s in declared.stages) if declared else (None,) * len(pipeline.stages)
        out.append((chosen, flags))
    return out


def declared_pipeline(strategy: Strategy | None, pipeline) -> Pipeline | None:
    """The Strategy's pipeline that runs on the discovered `pipeline`, where it gives a schedule
    or recompute flags (its stages must then be the ones the graph runs)."""
    if strategy is None or pipeline.devices[0] not in strategy.all_ranks:
        return None
    p, _ = strategy.locate(pipeline.devices[0])
    declared = strategy.pipelines[p]
    if declared.schedule_spec is None and not any(s.recompute for s in declared.stages):
        return None
    stages = tuple(tuple(sorted(s.ranks)) for s in declared.stages)
    if stages != pipeline.stages:
        raise HSPMDError(f"pipelines[{p}] of strategy {strategy.name or '(unnamed)'} declares stages {list(stages)} "
                         f"but the graph runs stages {list(pipeline.stages)}: its schedule and recompute flags cannot "
                         f"be applied; pass the strategy the graph was built with")
    return declared


class Trainer:
    """One rank's part of training `graph` under strategy index `strategy`, over `backend`.

    layout: how a step's global batch splits across pipelines (a MicroBatchLayout, or a Strategy
    whose micro-batch counts and sizes are bound; a Strategy also gives each pipeline's schedule
    and each stage's recompute choice: layers, granularity). schedule: "gpipe", "1f1b", "eager" or a 1F1B warm-up
    vector such as "h1f1b:5,2,1" (specialize.schedules); None: the pipeline's own schedule in the
    Strategy, else "1f1b". recompute: whether this rank's stage recomputes its forward in the
    backward (keeping only its inputs in between); None: the Strategy's flag for the stage, else
    False. symbols: values of
    the graph's other run-time symbols (e.g. sequence length, tokens per step); the batch symbol
    (dim 0 of the placeholders) is bound to the sum of the micro-batch sizes. specialized: a
    specialization of `graph` under `strategy` and trainer_binding(...) holding this rank's program
    (an in-process job specializes once for all of its ranks); by default the trainer specializes
    for its own rank. state: the rank's leaves and step to start from (default: the initial values).
    bucket_cap_mb: gradients whose synchronisation is a plain all-reduce are reduced in buckets of
    at most this many MiB, each started as soon as the backward has made all of its gradients
    (hspmd.runtime.execution.buckets); None synchronises every gradient in the update. Every argument is
    checked alike on every rank before any communication. Construction is collective: every rank
    of the job constructs its trainer at the same point."""

    def __init__(self, graph: Graph, strategy: int, backend: Backend, layout: MicroBatchLayout | Strategy,
                 schedule: str | None = None, symbols: Mapping[str, int] | None = None, seed: int = 0, topology=None,
                 specialized: Specialized | None = None, bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
                 state: DeviceState | None = None, recompute: bool | None = None):
        self.graph, self.backend = graph, backend
        strategy = check_strategy_index(graph, strategy, "Trainer")
        self.bucket_cap_mb = bucket_cap_mb
        cap = None if bucket_cap_mb is None else cap_bytes_of(bucket_cap_mb)
        self.symbols, self.seed, self.topology = checked_symbols(symbols, "Trainer"), check_seed(seed, "Trainer"), topology
        self.layout = as_layout(layout)
        self.symbols_needed = graph.symbol_names()
        if schedule is not None and not isinstance(schedule, str):
            raise HSPMDTypeError(f"Trainer: the schedule is a name such as '1f1b', got {brief(schedule)}")
        if recompute is not None and not isinstance(recompute, bool):
            raise HSPMDTypeError(f"Trainer: recompute is True, False or None (the strategy's), got {brief(recompute)}")
        self.strategy_value = layout if isinstance(layout, Strategy) else None
        self.schedule_name, self.recompute_requested = schedule, recompute
        self.binding = trainer_binding(graph, self.layout, symbols)
        rank = backend.rank
        if specialized is None:
            specialized = specialize_graph(graph, strategy, self.binding, devices=[rank], topology=topology)
        elif (specialized.graph is not graph or specialized.deduced.strategy != strategy
              or specialized.binding != self.binding or rank not in specialized.executables):
            raise HSPMDError(f"rank {rank}: the given specialization is not of graph {graph.name} under strategy "
                             f"{strategy} and binding {self.binding} with this rank's program")
        self.specialized = specialized
        self.devices = all_devices(self.specialized.deduced)
        if not set(self.devices) <= set(range(backend.world_size)):
            raise HSPMDError(
                f"strategy {strategy} uses devices {list(self.devices)} but the job has ranks 0-{backend.world_size - 1}: "
                f"start one rank per device (e.g. `hspmd run -n {max(self.devices) + 1}`)"
            )
        self.exe = self.specialized.executables[rank]
        if self.layout.pipelines != self._batch_hsize():
            raise HSPMDError(
                f"the micro-batch layout has {self.layout.pipelines} pipeline(s) but the batch of strategy {strategy} "
                f"is split across {self._batch_hsize()}: give one count and size per pipeline"
            )
        options = self._pipeline_options()
        self.idle = rank not in self.devices
        self.stages, self.stage, self.pipeline, self.micro_batches, self.order = None, 0, None, 0, ()
        self.schedule, self.recompute = None, None
        if not self.idle:
            discovered, self.stage = self.specialized.locate(rank)
            self.stages = self.specialized.pipelines[discovered]
            self.pipeline = self._batch_subgroup(self.stages.devices)
            self.micro_batches = self.layout.counts[self.pipeline]
            self.schedule, recomputes = options[discovered][0], options[discovered][1][self.stage]
            # what this stage recomputes, its devices together (None: no recomputation)
            self.recompute: Recompute | None = None if recomputes is None else Recompute.of(
                self.stages.stages[self.stage], *recomputes)
            self.order: Schedule = schedule_for(self.schedule, len(self.stages.stages), self.stage, self.micro_batches)
        self.state = DeviceState.initial(self.exe, seed, backend.device) if state is None else state
        self.buckets = None if cap is None or self.idle else BucketSync(plan_buckets(self.exe, cap), backend.device)
        self.last_run: ScheduleRun | None = None
        self.measure = True  # count the activation bytes held after each action (ScheduleRun.peak_held_bytes)
        self._lowered: dict[Binding, Passes] = {}
        self.tracer: Tracer | None = None  # set one to record this rank's F/B/update events (runtime.trace)
        self.last_switch = None
        self.carried: dict[str, torch.Tensor] = {}
        self._cuts: dict[str, tuple] = {}  # placeholder -> (region shape, this device's slice, annotation)
        self._sums_loss: bool | None = None  # whether this rank's loss is a summand of the step loss
        backend.prepare_groups(self._groups())

    def _pipeline_options(self) -> list[tuple[str, tuple[tuple | None, ...]]]:
        return pipeline_options(self.specialized, self.layout, self.strategy_value, self.schedule_name,
                                self.recompute_requested)

    def _batch_hsize(self) -> int:
        return batch_hsize(self.specialized.deduced)

    def _batch_subgroup(self, devices) -> int:
        return batch_subgroup(self.specialized.deduced, devices)

    def _groups(self) -> list[tuple[int, ...]]:
        return step_groups(self.exe, self.devices, self.binding)

    # ---- training -------------------------------------------------------------------------------

    def _check_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        check_feeds(self.graph.placeholders, batch, "step()", self.layout.global_batch_size, self.binding.mapping)
        check_bound(self.symbols_needed, self.binding.mapping, "step()")

    def _piece(self, node: Node, rows: torch.Tensor, binding: Binding | None = None) -> torch.Tensor:
        """This device's piece of a placeholder, from its pipeline's rows of one micro-batch."""
        binding = binding or self.binding
        cut = self._cuts.get(node.name) if binding == self.binding else None
        if cut is None:
            t = node.output
            ann = self.specialized.deduced[t]
            shape = binding.shape(t.shape, node.name)
            region = pipeline_region(ann, shape, self.backend.rank, run_time_ratios(ann, binding))
            cut = (tuple(box_shape(region)), box_relative(self.exe.box(t, binding), region), str(ann))
            if binding == self.binding:  # the trainer's own binding: the same cut every step
                self._cuts[node.name] = cut
        if tuple(rows.shape) != cut[0]:
            raise ShapeError(f"step(): pipeline {self.pipeline}'s micro-batch of {node.name} has shape "
                             f"{tuple(rows.shape)}, its region under {cut[2]} is {cut[0]}")
        return rows[cut[1]].to(self.backend.device, non_blocking=True)

    def _check_share(self, share: PipelineBatch) -> None:
        if share.pipeline != self.pipeline:
            raise HSPMDError(f"step(): rank {self.backend.rank} trains pipeline {self.pipeline}, the batch given holds "
                             f"the rows of pipeline {share.pipeline}")
        if not self.idle:
            check_feeds(self.exe.placeholders, share.rows, "step()", self.layout.counts[self.pipeline]
                        * self.layout.sizes[self.pipeline], self.binding.mapping)

    def step(self, batch: Mapping[str, torch.Tensor] | PipelineBatch) -> float | None:
        """One training step on the global batch (every rank passes the same one), or on this
        rank's share of it (a PipelineBatch, e.g. from hspmd.runtime.data.loader): this rank's
        schedule, then the update. Returns the step loss, the same on every rank of the strategy
        (None if the graph has no loss, or on an idle rank that the strategy leaves out)."""
        share = batch if isinstance(batch, PipelineBatch) else None
        self._check_share(share) if share is not None else self._check_batch(batch)
        if self.idle:
            self.state.step += 1  # counts the job's steps: a later switch that brings it back agrees on them
            return None
        placeholders = self.exe.placeholders
        first, rows = (self.layout.pipeline_rows(self.pipeline)[0], share.rows) if share is not None else (0, batch)

        def feeds(m: int) -> dict[str, torch.Tensor]:
            start, stop = self.layout.rows(self.pipeline, m)
            return {node.name: self._piece(node, rows[node.name][start - first:stop - first]) for node in placeholders}

        passes = self._passes(self.binding)
        self.last_run, _ = run_step(self.order, self.backend, self.state, lambda m: passes, feeds, passes,
                                    self.buckets, self.tracer, measure=self.measure)
        return self._reduce_loss()

    def _passes(self, binding: Binding) -> Passes:
        """This rank's work lowered for the interpreter under `binding` (once per binding)."""
        passes = self._lowered.get(binding)
        if passes is None:
            passes = self._lowered[binding] = lower_executable(self.exe, binding, self.recompute)
        return passes

    def step_rows(self, micro_batches: Sequence[Sequence[Mapping[str, torch.Tensor]]],
                  symbols: Mapping[str, int] | None = None, carried: Mapping[str, torch.Tensor] | None = None
                  ) -> float | None:
        """One step whose micro-batches each bind the run-time symbols anew: micro_batches[p] lists
        pipeline p's micro-batches, each {placeholder: rows} with the
        pipeline's micro-batch size as dim 0 (at least one per pipeline); a symbol of a placeholder dim (e.g. the sequence length
        of a packed row, hspmd.runtime.execution.packing) takes that row's size, the others come from `symbols`
        (e.g. T, the step's token count) or the trainer's. Every rank passes the same lists. Comm
        plans are resolved once per binding and kept (the specialization's plan cache).
        `carried`: synchronised gradients of earlier buckets of this step (see bucket_rows)."""
        if not self._run_rows(micro_batches, symbols, carried=carried):
            self.state.step += 1  # an idle rank counts the job's steps too (see step)
            return None
        return self._reduce_loss()

    def bucket_rows(self, micro_batches: Sequence[Sequence[Mapping[str, torch.Tensor]]],
                    symbols: Mapping[str, int] | None = None, carried: Mapping[str, torch.Tensor] | None = None
                    ) -> tuple[float | None, dict[str, torch.Tensor]]:
        """One bucket of a step that runs under several strategies in turn (Hetu-A): step_rows
        without the update. Returns the bucket's loss and this rank's synchronised gradient pieces
        (plus `carried`), which switch(carry=...) moves with the weights to the next strategy."""
        synced = self._run_rows(micro_batches, symbols, sync_only=True)
        if synced is None:
            return None, {}
        loss = self._reduce_loss()
        return loss, {k: v + carried[k] if carried and k in carried else v for k, v in synced.items()}

    def _run_rows(self, micro_batches, symbols, carried=None, sync_only: bool = False):
        """This rank's step over its pipeline's rows: None on an idle rank, else the synchronised
        gradients (sync_only) or True."""
        if len(micro_batches) != self.layout.pipelines:
            raise HSPMDError(f"step_rows(): {len(micro_batches)} pipeline lists for the {self.layout.pipelines} "
                             f"pipelines of strategy {self.specialized.deduced.strategy}")
        empty = [p for p, rows in enumerate(micro_batches) if not rows]
        if empty:
            raise HSPMDError(f"step_rows(): pipeline(s) {empty} have no micro-batch; give each at least one (a row "
                             f"whose labels are all IGNORE_INDEX contributes nothing)")
        bindings = [[self._row_binding(p, m, row, symbols) for m, row in enumerate(rows)]
                    for p, rows in enumerate(micro_batches)]
        if self.idle:
            return None
        rows, mine = micro_batches[self.pipeline], bindings[self.pipeline]
        order = schedule_for(self.schedule, len(self.stages.stages), self.stage, len(rows))
        placeholders = self.exe.placeholders
        self.last_run, synced = run_step(
            order, self.backend, self.state, lambda m: self._passes(mine[m]),
            lambda m: {node.name: self._piece(node, rows[m][node.name], mine[m]) for node in placeholders},
            self._passes(self.binding), self.buckets, self.tracer, carried, sync_only, self.measure)
        return synced if sync_only else True

    def _row_binding(self, pipeline: int, m: int, row: Mapping[str, torch.Tensor], symbols) -> Binding:
        values = {**self.binding.mapping, **dict(symbols or {})}
        found: dict[str, int] = {}
        size = self.layout.sizes[pipeline]
        check_feeds(self.graph.placeholders, row, f"step_rows(): micro-batch {m} of pipeline {pipeline}", size)
        for node in self.graph.placeholders:
            value, shape = row[node.name], node.output.shape
            for d, n in zip(shape[1:], value.shape[1:]):
                if isinstance(d, sympy.Symbol):
                    if found.setdefault(d.name, int(n)) != n:
                        raise ShapeError(f"step_rows(): micro-batch {m} of pipeline {pipeline} gives symbol {d.name} "
                                         f"two sizes ({found[d.name]} and {n})")
        check_bound(self.symbols_needed, {**values, **found}, f"step_rows(): micro-batch {m} of pipeline {pipeline}")
        return Binding.of({**values, **found}, ratios=self.binding.ratios)

    def gradients(self) -> dict[str, torch.Tensor] | None:
        """Collective: the last step's synchronised gradients (what the optimizer applied), whole,
        by parameter name, on the lowest rank of the strategy; the other ranks get None."""
        named = [(name, t) for name, t in self.graph.gradients.items()]
        whole = gather_whole(self.exe, self.backend, [t for _, t in named], self.state.fetched, dst=self.devices[0])
        return None if whole is None else {name: whole[t.name] for name, t in named}

    def _reduce_loss(self) -> float | None:
        if not self.graph.losses:
            return None
        loss = self.graph.losses[0]
        if self._sums_loss is None:
            ann = self.specialized.deduced[loss]
            shape = self.binding.shape(loss.shape, loss.name)
            self._sums_loss = self.backend.rank in summing_devices(ann, shape, run_time_ratios(ann, self.binding))
        return step_loss(self.backend, self.state.fetched.get(loss.name), self._sums_loss, self.devices)

    @property
    def steps_done(self) -> int:
        return self.state.step

    # ---- switching ------------------------------------------------------------------------------

    def switch(self, strategy: int, layout: MicroBatchLayout | Strategy, schedule: str | None = None,
               failed: tuple[int, ...] = (), specialized: Specialized | None = None,
               carry: Mapping[str, torch.Tensor] | None = None, recompute: bool | None = None,
               plan: SwitchPlan | None = None, reuse: "Trainer | None" = None) -> "Trainer":
        """Collective: the trainer of another strategy of the same graph, holding this one's
        parameters and optimizer states, moved by one fused batched send-receive (paper section 6).
        No restart and no checkpoint: training continues at the same step.

        `failed`: ranks whose devices were lost (e.g. a dead GPU whose host process still runs).
        Their pieces are taken from replicas elsewhere, the new strategy must leave them out, and
        they stay in the job as idle ranks. `specialized`: as for the constructor, for the new strategy.

        `carry`: this rank's synchronised gradient pieces of a step still under way (from
        bucket_rows); they move in the same fused plan as the weights, from the gradient layout of
        this strategy to that of the next, and wait in the new trainer's `carried`.
        `schedule`, `recompute`: as for the constructor; None keeps this trainer's arguments.
        `plan`: the switch plan of an earlier switch between the same strategies with the same
        failed ranks and carry (its `last_switch`), for a caller that switches back and forth:
        planning is pure, so it is reused rather than made again. `reuse`: a trainer this rank
        made earlier for the same strategy, layout, schedule and job, which takes the moved state
        instead of a new trainer being built (its program, buckets and groups are ready)."""
        strategy = check_strategy_index(self.graph, strategy, "switch()")
        failed = checked_ranks(failed, self.backend.world_size, "failed ranks", "switch()")
        if schedule is not None and not isinstance(schedule, str):
            raise HSPMDTypeError(f"switch(): the schedule is a name such as '1f1b', got {brief(schedule)}")
        here = self.specialized.deduced.strategy
        if plan is not None and (not isinstance(plan, SwitchPlan)
                                 or (plan.src_strategy, plan.dst_strategy) != (here, strategy)):
            raise HSPMDError(f"switch(): the plan given is not a switch plan from strategy {here} to {strategy}")
        made = [s.deduced for s in (self.specialized, specialized, reuse.specialized if reuse else None) if s is not None]
        if reuse is not None:
            self._check_reusable(reuse, strategy, layout, schedule, recompute)
        return switched(self.graph, here, strategy, self.backend, layout, self.state.leaves, self.state.step,
                        failed=failed, carry=carry, plan=plan, deduced=made,
                        reuse=reuse, schedule=schedule or self.schedule_name, symbols=self.symbols, seed=self.seed,
                        topology=self.topology, specialized=specialized, bucket_cap_mb=self.bucket_cap_mb,
                        recompute=self.recompute_requested if recompute is None else recompute)

    def release(self) -> None:
        """Drop this trainer's weights, optimizer states and accumulators (a switch moved them to
        another trainer), keeping its program, buckets and groups for a later `switch(reuse=)`."""
        self.state = DeviceState({}, step=self.state.step)
        self.carried = {}

    def _check_reusable(self, other: "Trainer", strategy: int, layout, schedule, recompute) -> None:
        same = (isinstance(other, Trainer) and other.graph is self.graph and other.backend is self.backend
                and other.specialized.deduced.strategy == strategy and other.layout == as_layout(layout)
                and other.schedule_name == (schedule or self.schedule_name)
                and other.recompute_requested == (self.recompute_requested if recompute is None else recompute)
                and (other.symbols, other.seed, other.topology, other.bucket_cap_mb)
                == (self.symbols, self.seed, self.topology, self.bucket_cap_mb))
        if not same:
            raise HSPMDError(f"switch(): the trainer given to reuse is not one of strategy {strategy} with this "
                             f"layout, schedule and job")

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """Whole parameters and optimizer states, gathered on the lowest rank (collective; the
        other ranks get None). Replicas are checked to agree, as hspmd.unshard does."""
        return gather_leaves(self.exe, self.backend, self.state.leaves, dst=self.devices[0])

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], step: int | None = None) -> None:
        """Take this device's pieces of whole tensors (every rank passes them; not collective)."""
        self.state.leaves.update(cut_leaves(self.exe, cut_from_tensors(tensors), self.backend.device))
        self.state.accum.clear()
        if step is not None:
            self.state.step = step

    def save_checkpoint(self, path, data: str | None = None) -> None:
        """Collective: gather to the lowest rank, which writes `path`; returns once it is written.
        `data`: the data loader's state at this step (JSON text), saved with the weights."""
        if self.backend.device.type == "meta":
            raise HSPMDError("save_checkpoint gathers and writes values, which a stand-in (meta) device has none of: "
                             "use save_sharded, which writes the stand-in pieces' manifests")
        tensors = self.state_dict()
        if tensors is not None:
            save_checkpoint(path, tensors, self.state.step, self.graph.name, None if data is None else {DATA_KEY: data})
        if not self.idle:
            self.backend.barrier(self.devices)

    def save_sharded(self, directory, background: bool = True, data: str | None = None) -> PendingSave | None:
        """This rank writes its own pieces to a sharded checkpoint under `directory` (not
        collective, nothing gathered; in the background unless told otherwise: wait() on the
        result before relying on the files). hspmd.runtime.persistence.sharded_checkpoint."""
        if self.idle:
            return None
        return save_sharded(self.exe, dict(self.state.leaves), self.state.step, directory, self.devices, background,
                            job=self.backend.job, data=data)

    def save_dcp(self, directory, names: Mapping[str, tuple[str, bool]] | None = None, data: str | None = None) -> None:
        """Collective over the job's default process group (every rank, idle ones too): this rank
        writes its own pieces as chunks of a torch Distributed Checkpoint under `directory`, which
        torch.distributed.checkpoint loads into whole tensors or DTensors, and load_checkpoint
        reads back under any strategy; `data`: the data loader's state at this step (JSON text).
        hspmd.runtime.persistence.dcp_checkpoint."""
        if self.idle:
            save_pieces(directory, {}, {}, self.state.step, self.graph.name, self.backend.job, data=data)
            return
        save_dcp(self.exe, dict(self.state.leaves), self.state.step, directory, self.backend.job, names, data)

    def load_checkpoint(self, source) -> int:
        """Each rank reads only its own pieces from `source`: a checkpoint path (any strategy's
        checkpoint of this model, a single file or a sharded checkpoint directory) or a reader with a
        `step` (e.g. hspmd.runtime.persistence.hf_checkpoint.HFCheckpoint over a Hugging Face directory);
        returns the step count it was saved at. A checkpoint in hspmd's own formats must hold
        exactly this model's leaves (checkpoint.check_leaf_names)."""
        reader = source if callable(source) else open_any_checkpoint(source)
        if isinstance(reader, (CheckpointReader, ShardedReader)) or (isinstance(reader, DCPCheckpoint) and reader.own):
            check_leaf_names(self.graph, reader.names, reader.path)
        self.state.leaves.update(cut_leaves(self.exe, reader, self.backend.device))
        self.state.accum.clear()
        self.state.step = reader.step
        return reader.step

    # ---- reporting ------------------------------------------------------------------------------

    def describe(self) -> str:
        """This rank's place in the strategy and its schedule, e.g. for a log line."""
        if self.idle:
            return f"rank {self.backend.rank}: idle (strategy {self.specialized.deduced.strategy} leaves it out)"
        return (f"rank {self.backend.rank}: pipeline {self.pipeline} ({self.stages}), stage {self.stage + 1} of "
                f"{len(self.stages.stages)}, {self.micro_batches} micro-batch(es) of {self.layout.sizes[self.pipeline]}, "
                f"{self.schedule}{', recompute' if self.recompute else ''}: {' '.join(map(str, self.order))}")


def switched(graph: Graph, source: int, target: int, backend: Backend, layout: MicroBatchLayout | Strategy,
             leaves: Mapping[str, torch.Tensor], step: int, *, failed: Sequence[int] = (),
             carry: Mapping[str, torch.Tensor] | None = None, plan: SwitchPlan | None = None, deduced=(),
             reuse: Trainer | None = None, schedule: str | None = None, symbols: Mapping[str, int] | None = None,
             seed: int = 0, topology=None, specialized: Specialized | None = None,
             bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB, recompute: bool | None = None) -> Trainer:
    """Collective, the one switch routine: the trainer of strategy `target` of `graph` on
    `backend` (the other arguments as the Trainer's), holding this rank's `leaves` of strategy
    `source` moved there by one fused batched send-receive (paper section 6), at step `step`.
    The new trainer initialises no weight: it holds exactly the pieces the switch delivers (a rank
    with nothing to send, e.g. a restarted one, passes no leaves). `failed`: ranks whose pieces
    are taken from replicas elsewhere. `carry`: synchronised gradient pieces of a step under way,
    moved in the same plan into the new trainer's `carried`. `plan`: the plan of an earlier
    switch between the same strategies (planning is pure); `deduced`: deductions of the graph
    already made (the planner reuses them). `reuse`: a trainer of `target` made earlier on this
    rank, which takes the moved state instead of a new one being built."""
    if carry is None:
        plan = plan or plan_switch(graph, source, target, failed=failed, topology=topology, deduced=deduced)
        moving = {} if backend.rank in failed else dict(leaves)
    else:
        plan = plan or plan_switch_with_gradients(graph, source, target, failed=failed, topology=topology,
                                                  deduced=deduced)
        moving = {} if backend.rank in failed else {**leaves, **gradient_leaves(carry)}
    if reuse is None:
        nxt = Trainer(graph, target, backend, layout, schedule, symbols, seed, topology, specialized, bucket_cap_mb,
                      state=DeviceState({}, step=step), recompute=recompute)
    else:
        nxt, nxt.state, nxt.last_run = reuse, DeviceState({}, step=step), None
    moved = execute_switch(plan, backend, moving)
    carried = {name[len(GRADIENT_PREFIX):]: v for name, v in moved.items() if name.startswith(GRADIENT_PREFIX)}
    missing = {node.name for node in nxt.exe.held_leaves} - set(moved)
    if missing:
        raise HSPMDError(f"rank {backend.rank}: the switch to strategy {target} delivered no piece of "
                         f"{sorted(missing)[:3]}; the strategies disagree on the graph's leaves")
    nxt.state.leaves = {node.name: moved[node.name] for node in nxt.exe.held_leaves}
    nxt.last_switch = plan
    nxt.carried = carried
    return nxt


__all__ = [
    "Trainer", "as_layout", "batch_hsize", "batch_subgroup", "batch_symbol", "declared_pipeline", "pipeline_options",
    "pipeline_region", "step_groups", "summing_devices", "switched", "trainer_binding",
]
