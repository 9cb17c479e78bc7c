"""A strategy as a readable table (rich): pipelines, stages, layers, ranks, TP degrees, micro-batches;
and as a compact text strategy map (one row per stage, its layers as a bar)."""

from __future__ import annotations

import io
from typing import Callable

from rich.console import Console
from rich.table import Table

from hspmd.specialize.strategy import Strategy, recompute_word
from hspmd.specialize.strategy_fields import format_layers, format_ranks


def describe_strategy(strategy: Strategy) -> str:
    """A readable table of pipelines, stages, layers, ranks, TP and CP degrees, micro-batches, schedules
    (a pipeline's warm-up count per stage) and recomputation."""
    title = (
        f"{strategy.name or 'strategy'}: {strategy.num_layers} layers, {len(strategy.all_ranks)} devices, "
        f"{len(strategy.pipelines)} pipeline(s), ZeRO {'on' if strategy.zero else 'off'}"
    )
    table = Table(title=title, title_justify="left")
    for column in ("pipeline", "micro-batches", "schedule", "stage", "ranks", "layers", "tp", "cp", "warm-up", "recompute"):
        table.add_column(column)
    for i, p in enumerate(strategy.pipelines):
        count = "run time" if p.micro_batches is None else str(p.micro_batches)
        size = "run time" if p.micro_batch_size is None else str(p.micro_batch_size)
        for j, s in enumerate(p.stages):
            batches = f"{count} x bs {size}" if j == 0 else ""
            schedule = (p.schedule or "trainer's") if j == 0 else ""
            warmup = "" if p.warmup is None else str(p.warmup[j])
            table.add_row(str(i) if j == 0 else "", batches, schedule, str(j), format_ranks(s.ranks), format_layers(s.layers),
                          str(s.tp), _cp_text(s), warmup, recompute_word(s).strip().partition("=")[2] or ("yes" if s.recompute else ""))
        if i + 1 < len(strategy.pipelines):
            table.add_section()
    buffer = io.StringIO()
    Console(file=buffer, width=120, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


def _cp_text(stage) -> str:
    """A stage's CP degree, with its sequence shares where uneven ('2 (3:1)')."""
    shares = "" if stage.cp_shares is None else f" ({':'.join(map(str, stage.cp_shares))})"
    return f"{stage.cp}{shares}"


def _bar(layers: range, num_layers: int, width: int) -> str:
    """`width` columns over layers 0..num_layers-1; a column is filled when its centre falls in
    `layers` (at least the column of the first layer, so no stage vanishes)."""
    filled = [layers.start <= (c + 0.5) * num_layers / width < layers.stop for c in range(width)]
    if not any(filled):
        filled[min(width - 1, layers.start * width // num_layers)] = True
    return "".join("\u2588" if f else " " for f in filled)


def strategy_map_text(strategy: Strategy, device_type: Callable[[int], str] | None = None, width: int = 48) -> str:
    """The strategy map in text: pipelines of the same shape (stage TP degrees, layers, device
    types, recompute flags, batches, schedule) once, with their count; one row per stage, its
    layers as a bar across the model, then TP, device type, layers, recompute and the ranks of
    the first pipeline of the group."""
    width = max(1, min(width, strategy.num_layers))
    kind = device_type or (lambda rank: "")
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(strategy.pipelines):
        shape = (tuple((s.tp, s.cp, s.cp_shares, s.layers, recompute_word(s), kind(s.ranks[0])) for s in p.stages),
                 p.micro_batches, p.micro_batch_size, p.schedule_spec)
        groups.setdefault(shape, []).append(i)
    lines = [f"strategy map: {strategy.num_layers} layers across, one row per stage"]
    for members in groups.values():
        first = strategy.pipelines[members[0]]
        count = "?" if first.micro_batches is None else first.micro_batches
        size = "?" if first.micro_batch_size is None else first.micro_batch_size
        which = f"pipeline {members[0]}" if len(members) == 1 else \
            f"pipelines {format_ranks(members)} ({len(members)} alike, ranks of pipeline {members[0]})"
        lines.append(f"{which}: {count}x{size}, schedule {first.schedule_spec or 'of the trainer'}")
        for j, s in enumerate(first.stages):
            cp = "" if s.cp == 1 else f"xCP{_cp_text(s).replace(' ', '')}"
            label = f"TP{s.tp}{cp} {kind(s.ranks[0])}".rstrip()
            note = recompute_word(s)
            lines.append(f"  S{j:<3}|{_bar(s.layers, strategy.num_layers, width)}| {label:<10} L{format_layers(s.layers):<8}"
                         f"R{format_ranks(s.ranks)}{note}")
    return "\n".join(lines)


__all__ = ["describe_strategy", "strategy_map_text"]
