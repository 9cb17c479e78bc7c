"""A strategy as a readable table (rich): pipelines, stages, layers, ranks, TP degrees, micro-batches."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from hspmd.specialize.strategy import Strategy
from hspmd.specialize.strategy_fields import format_layers, format_ranks


def describe_strategy(strategy: Strategy) -> str:
    """A readable table of pipelines, stages, layers, ranks, TP degrees, micro-batches, schedules
    (a pipeline's warm-up count per stage) and recomputation."""
    title = (
        f"{strategy.name or 'strategy'}: {strategy.num_layers} layers, {len(strategy.all_ranks)} devices, "
        f"{len(strategy.pipelines)} pipeline(s), ZeRO {'on' if strategy.zero else 'off'}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("pipeline", "micro-batches", "schedule", "stage", "ranks", "layers", "tp", "warm-up", "recompute"):
        table.add_column(column)
    for i, p in enumerate(strategy.pipelines):
        count = "run time" if p.micro_batches is None else str(p.micro_batches)
        size = "run time" if p.micro_batch_size is None else str(p.micro_batch_size)
        for j, s in enumerate(p.stages):
            batches = f"{count} x bs {size}" if j == 0 else ""
            schedule = (p.schedule or "trainer's") if j == 0 else ""
            warmup = "" if p.warmup is None else str(p.warmup[j])
            table.add_row(str(i) if j == 0 else "", batches, schedule, str(j), format_ranks(s.ranks), format_layers(s.layers),
                          str(s.tp), warmup, "yes" if s.recompute else "")
        if i + 1 < len(strategy.pipelines):
            table.add_section()
    buffer = io.StringIO()
    Console(file=buffer, width=120, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


__all__ = ["describe_strategy"]
