"""Compiling a graph under a strategy into one DeviceProgram per rank (hspmd.specialize.program),
with the decisions a Trainer makes at construction: the binding, each rank's pipeline, stage and
schedule order, which box of the global batch each placeholder takes per micro-batch, which rank
adds its loss into the step loss. Writing and reading a directory of programs:

    programs = compile_programs(graph, 0, MicroBatchLayout.of(strategy), "1f1b", {"S": 8, "T": 64})
    write_programs(programs, "out/")          # out/rank0.json, out/rank1.json, ...
    program = read_program("out/", rank)      # what a rank loads; runs with ProgramRunner

A large job streams instead: `write_programs(iter_programs(...), "out/")` holds one rank's program
at a time, not thousands.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from hspmd.annotations import box_relative
from hspmd.errors import HSPMDError, ShapeError
from hspmd.gc_pause import collector_paused
from hspmd.ir.graph import Graph
from hspmd.ir.shapes import Binding
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.buckets import DEFAULT_BUCKET_CAP_MB, cap_bytes_of
from hspmd.runtime.persistence.integrity import atomic_write
from hspmd.runtime.execution.run import Recompute, rerun_instructions
from hspmd.runtime.training.trainer import (
    as_layout, batch_hsize, batch_subgroup, pipeline_options, pipeline_region, step_groups, summing_devices,
    trainer_binding,
)
from hspmd.specialize.bucket_plan import plan_buckets
from hspmd.specialize.deduce import deduce
from hspmd.specialize.executable import ExecutableGraph, run_time_ratios
from hspmd.specialize.program import DeviceProgram, Feed, GraphFacts, PipelinePlace, ProgramError, device_program
from hspmd.specialize.schedules import schedule_for
from hspmd.specialize.specialized import Specialized, all_devices, specialize_graph
from hspmd.specialize.strategy import Strategy

PROGRAM_FILE = "rank{rank}.json"
RANKS_AT_ONCE = 64
"""iter_programs makes this many ranks' executable graphs at a time: a 4,096-rank job's all at once
added 1.5 GB to the compiling process (0.2 GB in batches), at no gain in time."""


def _feeds(spec: Specialized, exe: ExecutableGraph, layout: MicroBatchLayout, pipeline: int) -> list[list[Feed]]:
    """Per micro-batch, each placeholder's box of the global batch (the Trainer's `_piece`)."""
    binding = spec.binding
    placeholders = {i.node.name: i.node for i in exe.forward + exe.backward if i.node.kind == "placeholder"}
    out = []
    for m in range(layout.counts[pipeline]):
        start, stop = layout.rows(pipeline, m)
        feeds = []
        for name, node in placeholders.items():
            t = node.output
            ann = spec.deduced[t]
            shape = binding.shape(t.shape, name)
            region = pipeline_region(ann, shape, exe.device, run_time_ratios(ann, binding))
            if stop - start != region[0][1] - region[0][0]:
                raise ShapeError(f"placeholder {name}: pipeline {pipeline}'s micro-batch has {stop - start} rows, its "
                                 f"region under {ann} has {region[0][1] - region[0][0]}")
            rel = box_relative(exe.box(t, binding), region)
            box = ((start + rel[0].start, start + rel[0].stop),) + tuple((s.start, s.stop) for s in rel[1:])
            feeds.append(Feed(name, t.id, box))
        out.append(feeds)
    return out


def compile_programs(graph: Graph, strategy: int, layout: MicroBatchLayout | Strategy, schedule: str | None = None,
                     symbols: Mapping[str, int] | None = None, seed: int = 0, topology=None,
                     world_size: int | None = None, bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
                     ranks: Iterable[int] | None = None, recompute: bool | None = None) -> dict[int, DeviceProgram]:
    """Every rank's program (ranks 0..world_size-1; by default up to the strategy's highest device;
    a rank the strategy leaves out gets an idle program). The programs run as Trainers over the
    same arguments would: same losses, gradients and updated weights. `schedule` and `recompute`
    as the Trainer's (None: each pipeline's own schedule and warm-up vector and each stage's
    recompute flag where `layout` is a Strategy that gives them, else 1f1b and no recomputation).
    `bucket_cap_mb` as the Trainer's (None: every gradient synchronises in the update). `ranks`:
    only these ranks' programs (e.g. one node's), each the same as in the whole job's; only their
    executable graphs are made, the deduction, plans and pipelines are the job's."""
    return dict(iter_programs(graph, strategy, layout, schedule, symbols, seed, topology, world_size, bucket_cap_mb,
                              ranks, recompute))


def iter_programs(graph: Graph, strategy: int, layout: MicroBatchLayout | Strategy, schedule: str | None = None,
                  symbols: Mapping[str, int] | None = None, seed: int = 0, topology=None,
                  world_size: int | None = None, bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
                  ranks: Iterable[int] | None = None, recompute: bool | None = None
                  ) -> Iterator[tuple[int, DeviceProgram]]:
    """compile_programs one rank at a time, in rank order: (rank, program) pairs. Deduction and the
    pipelines are worked out once before the first; executable graphs are made RANKS_AT_ONCE ranks
    at a time and each let go once its program is made, so a consumer that writes and drops each
    program holds one program and a batch of executable graphs at a time."""
    cap = None if bucket_cap_mb is None else cap_bytes_of(bucket_cap_mb)
    declared = layout if isinstance(layout, Strategy) else None
    layout = as_layout(layout)
    binding: Binding = trainer_binding(graph, layout, symbols)
    with collector_paused():
        deduced = deduce(graph, strategy)
    devices = all_devices(deduced)
    if layout.pipelines != batch_hsize(deduced):
        raise HSPMDError(f"the micro-batch layout has {layout.pipelines} pipeline(s) but the batch of strategy "
                         f"{strategy} is split across {batch_hsize(deduced)}: give one count and size per pipeline")
    world = max(devices) + 1 if world_size is None else world_size
    if world <= max(devices):
        raise HSPMDError(f"strategy {strategy} uses devices {list(devices)}: world_size {world} is too small")
    chosen = range(world) if ranks is None else tuple(ranks)
    outside = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world]
    if outside:
        raise HSPMDError(f"ranks {outside[:8]} are not ranks of the job: it has ranks 0-{world - 1}")
    chosen = sorted(set(chosen))
    in_strategy = set(devices)
    spec = specialize_graph(graph, strategy, binding, devices=(), topology=topology, deduced=deduced)
    options = pipeline_options(spec, layout, declared, schedule, recompute)
    loss = graph.losses[0] if graph.losses else None
    summands: tuple[int, ...] = ()
    if loss is not None:
        ann = spec.deduced[loss]
        summands = summing_devices(ann, binding.shape(loss.shape, loss.name), run_time_ratios(ann, binding))

    def each_rank() -> Iterator[tuple[int, DeviceProgram]]:
        facts = None
        with collector_paused():  # thousands of long-lived objects: no collection walks them meanwhile (gc_pause.py)
            for first in range(0, len(chosen), RANKS_AT_ONCE):
                batch = chosen[first:first + RANKS_AT_ONCE]
                executables = spec.instantiate([r for r in batch if r in in_strategy])
                for rank in batch:
                    if rank not in executables:
                        yield rank, DeviceProgram(
                            device=rank, graph=graph.name, strategy=strategy, binding=binding, devices=devices,
                            groups=(devices,), tensors=(), forward=(), backward=(), update=(), plans=(), leaves=(),
                            accumulated=(), gradients=(), loss=None, loss_summand=False, step_loss=loss is not None,
                            place=None, feeds=(), global_batch=layout.global_batch_size)
                        continue
                    exe = executables.pop(rank)
                    facts = facts or GraphFacts(exe)
                    discovered, stage = spec.locate(rank)
                    stages = spec.pipelines[discovered]
                    pipeline = batch_subgroup(spec.deduced, stages.devices)
                    schedule_name, flags = options[discovered]
                    order = schedule_for(schedule_name, len(stages.stages), stage, layout.counts[pipeline])
                    rerun = () if flags[stage] is None else {id(ins) for ins in rerun_instructions(
                        exe, binding, Recompute.of(stages.stages[stage], *flags[stage]))}
                    recomputed = tuple(i for i, ins in enumerate(exe.forward) if id(ins) in rerun)
                    place = PipelinePlace(stages.stages, stage, pipeline, schedule_name, tuple(order), recomputed)
                    yield rank, device_program(
                        exe, seed=seed, place=place, feeds=_feeds(spec, exe, layout, pipeline), devices=devices,
                        global_batch=layout.global_batch_size, groups=step_groups(exe, devices, binding),
                        loss=loss, loss_summand=rank in summands, facts=facts,
                        buckets=None if cap is None else plan_buckets(exe, cap))

    return each_rank()  # the checks above fail at the call, not at the first program


def write_programs(programs: Mapping[int, DeviceProgram] | Iterable[tuple[int, DeviceProgram]],
                   directory: str | os.PathLike) -> list[Path]:
    """One JSON file per rank (atomically written), in rank order for a mapping, as they come for
    (rank, program) pairs (iter_programs: one program in memory at a time); returns the paths."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    pairs = sorted(programs.items()) if isinstance(programs, Mapping) else programs
    for rank, program in pairs:
        path = root / PROGRAM_FILE.format(rank=rank)
        data = program.to_json().encode()
        atomic_write(path, lambda tmp, data=data: Path(tmp).write_bytes(data))
        paths.append(path)
    return paths


def read_program(directory: str | os.PathLike, rank: int) -> DeviceProgram:
    """Rank `rank`'s program from a directory written by write_programs (or `hspmd compile`)."""
    path = Path(directory) / PROGRAM_FILE.format(rank=rank)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ProgramError(f"{path}: cannot read rank {rank}'s program ({exc.strerror or exc})") from None
    program = DeviceProgram.from_json(data, where=str(path))
    if program.device != rank:
        raise ProgramError(f"{path}: program field device is {program.device}, not rank {rank}")
    return program


__all__ = ["PROGRAM_FILE", "compile_programs", "iter_programs", "read_program", "write_programs"]
