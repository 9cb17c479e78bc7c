"""Pictures and the commands that draw them: `hspmd simulate`, `hspmd show`, `hspmd calibrate`.

    strategy map   devices x layers, one colour per pipeline, lighter and darker by stage, each
                   stage block labelled with its stage index and TP degree (hatched: recomputed)
    timeline       one row per rank: forward, backward, gradient sync / other communication,
                   optimizer update; idle is the white in between. Drawn from a SimResult or from
                   a run's Chrome trace (hspmd.runtime.execution.trace), side by side for the same strategy.

The terminal gets rich tables; PNG files come from matplotlib (Agg, no display needed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hspmd.cluster import ClusterSpec, parse_cluster  # noqa: E402
from hspmd.errors import HSPMDError  # noqa: E402
from hspmd.planning import CostModel, model_named  # noqa: E402
from hspmd.planning.device_sim import simulate_llama  # noqa: E402
from hspmd.planning.simulator import SimResult  # noqa: E402
from hspmd.planning.strategy_sim import estimate_strategy, simulate_strategy  # noqa: E402
from hspmd.runtime.policies.calibrate import calibrate, emulated_reference, emulated_slowdowns  # noqa: E402
from hspmd.runtime.policies.calibration import Calibration  # noqa: E402
from hspmd.runtime.execution.trace import read_trace  # noqa: E402
from hspmd.specialize.strategy import Strategy  # noqa: E402
from hspmd.specialize.strategy_files import strategy_from  # noqa: E402

PIPELINE_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
KIND_COLOURS = {"F": "#6baed6", "B": "#2171b5", "sync": "#e6550d", "comm": "#fd8d3c", "update": "#74c476", "send": "#bdbdbd"}

Segment = tuple[str, float, float, str]  # kind, start s, end s, label


# ---- drawing ---------------------------------------------------------------------------------------

def draw_strategy_map(ax, strategy: Strategy, cluster: ClusterSpec | None = None) -> None:
    """Devices (rows) x layers (columns), coloured by pipeline, shaded by stage; recomputed stages
    hatched and labelled RC."""
    ranks = strategy.all_ranks
    row = {r: i for i, r in enumerate(ranks)}
    for p, pipe in enumerate(strategy.pipelines):
        colour = matplotlib.colors.to_rgb(PIPELINE_COLOURS[p % len(PIPELINE_COLOURS)])
        for s, stage in enumerate(pipe.stages):
            shade = 0.35 + 0.65 * (1 - s / max(1, len(pipe.stages)))
            fill = tuple(1 - shade * (1 - c) for c in colour)
            for r in stage.ranks:
                ax.add_patch(Rectangle((stage.first_layer, row[r]), len(stage.layers), 1, facecolor=fill,
                                       edgecolor="white", linewidth=0.5, hatch="//" if stage.recompute else None))
            top = min(row[r] for r in stage.ranks)
            height = max(row[r] for r in stage.ranks) - top + 1
            label = f"P{p}S{s}\nTP{stage.tp}" + (" RC" if stage.recompute else "")
            ax.text(stage.first_layer + len(stage.layers) / 2, top + height / 2, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, strategy.num_layers)
    ax.set_ylim(len(ranks), 0)
    labels = [f"R{r}" + (f" {cluster.device_type(r).name}" if cluster and r < cluster.n_devices else "") for r in ranks]
    ax.set_yticks([i + 0.5 for i in range(len(ranks))], labels, fontsize=6 if len(ranks) > 16 else 8)
    ax.set_xlabel("layer")
    ax.set_title(f"strategy {strategy.name or ''}: {strategy.num_pipelines} pipeline(s)".replace("  ", " "))


def segments_of_result(result: SimResult) -> dict[int, list[Segment]]:
    out: dict[int, list[Segment]] = {}
    for key, intervals in result.stages.items():
        for device in result.devices[key]:
            out.setdefault(device, []).extend(
                (i.kind, i.start, i.end, f"{i.kind}{i.micro_batch}" if i.micro_batch >= 0 else "") for i in intervals)
    return dict(sorted(out.items()))


def segments_of_trace(events: Mapping[int, Sequence[dict]]) -> dict[int, list[Segment]]:
    out: dict[int, list[Segment]] = {}
    origin = min(e["ts"] for evs in events.values() for e in evs)
    for rank, evs in events.items():
        for e in evs:
            name = e["name"]
            kind = name[0] if name[:1] in ("F", "B") and name[1:].isdigit() else \
                "update" if e.get("cat") == "update" else "comm"
            out.setdefault(rank, []).append((kind, (e["ts"] - origin) / 1e6, (e["ts"] - origin + e["dur"]) / 1e6,
                                             name if kind in ("F", "B") else ""))
    return dict(sorted(out.items()))


def draw_timeline(ax, segments: Mapping[int, Sequence[Segment]], title: str) -> None:
    ranks = list(segments)
    end = max((s[2] for segs in segments.values() for s in segs), default=1.0) or 1.0
    scale, unit = (1e3, "ms") if end < 10 else (1.0, "s")
    for i, rank in enumerate(ranks):
        for kind, start, stop, label in segments[rank]:
            ax.add_patch(Rectangle((start * scale, i + 0.1), max((stop - start) * scale, end * scale * 1e-4), 0.8,
                                   facecolor=KIND_COLOURS.get(kind, "#999999"), edgecolor="black", linewidth=0.2))
            if label and (stop - start) / end > 0.025:
                ax.text((start + stop) / 2 * scale, i + 0.5, label, ha="center", va="center", fontsize=6,
                        color="white" if kind == "B" else "black")
    ax.set_xlim(0, end * scale * 1.01)
    ax.set_ylim(len(ranks), 0)
    ax.set_yticks([i + 0.5 for i in range(len(ranks))], [f"rank {r}" for r in ranks], fontsize=7)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=l) for k, l in
                       (("F", "forward"), ("B", "backward"), ("sync", "gradient sync"), ("comm", "wait / comm"),
                        ("update", "update"))], fontsize=6, loc="lower right", ncol=5)


def strategy_figure(strategy: Strategy, result: SimResult, cluster: ClusterSpec | None = None,
                    title: str = "simulated step", panels: int = 2):
    """The one layout of every strategy picture: its map, then its simulated step, then
    (panels > 2) room for more timelines; returns (figure, axes)."""
    height = min(40, max(3, 0.25 * len(strategy.all_ranks) + 1.5))
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, height))
    draw_strategy_map(axes[0], strategy, cluster)
    draw_timeline(axes[1], segments_of_result(result), f"{title}: {result.iteration * 1e3:.1f} ms")
    return fig, axes


def draw_plan(strategy: Strategy, cost: CostModel, path: str | Path) -> None:
    """`hspmd plan --png`: the strategy map (device types on the rows) next to its simulated step
    (level 1, each pipeline under its own schedule)."""
    fig, _ = strategy_figure(strategy, simulate_strategy(strategy, cost), cost.cluster)
    save_figure(fig, path)


def save_figure(fig, path: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- terminal --------------------------------------------------------------------------------------

def print_result(result: SimResult, title: str, closed: float | None = None) -> None:
    table = Table(title=title)
    for column in ("rank", "compute ms", "comm ms", "idle ms", "peak memory GiB"):
        table.add_column(column, justify="right")
    for rank, b in sorted(result.per_rank.items()):
        table.add_row(str(rank), f"{b.compute * 1e3:.2f}", f"{b.comm * 1e3:.2f}", f"{b.idle * 1e3:.2f}",
                      f"{result.peak_memory.get(rank, 0) / 2 ** 30:.2f}")
    console = Console()
    console.print(table)
    line = f"iteration {result.iteration * 1e3:.2f} ms, bubble {result.bubble_fraction():.1%}, load balance {result.load_balance():.1%}"
    if closed is not None:
        line += f"; closed form {closed * 1e3:.2f} ms"
    warm = {p: v for p, v in result.warmup.items() if v}
    if warm:
        line += "; warm-up " + ", ".join(f"P{p} {list(v)}" for p, v in warm.items())
    console.print(line)


# ---- commands --------------------------------------------------------------------------------------

def _cost_model(args) -> CostModel:
    if getattr(args, "calibration", None):
        cal = Calibration.load(args.calibration)
        return cal.cost_model(model_named(args.model), max(2, len(strategy_from(args.strategy).all_ranks)))
    return CostModel(parse_cluster(args.cluster), model_named(args.model))


def _simulate(strategy: Strategy, cost: CostModel, schedule: str, seq: int | None, level: int) -> SimResult:
    if level == 2:
        return simulate_llama(strategy, cost, schedule, seq)
    return simulate_strategy(strategy, cost, schedule, seq)


def simulate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="hspmd simulate", description="simulate one training step of a strategy")
    p.add_argument("strategy", help="strategy text, a strategy file, or a paper strategy name (e.g. table7_c1)")
    p.add_argument("--cluster", default="hetu-h800-h20", help="preset, NxM, or a cluster .yaml file")
    p.add_argument("--model", default="llama-32b-hetu", help="model preset")
    p.add_argument("--calibration", default=None, help="price on this machine's calibration (hspmd calibrate)")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, eager, h1f1b, virtual or policy:N1,N2,...")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--level", type=int, choices=(1, 2), default=1,
                   help="1: stage times from the model spec; 2: the specialized programs op by op (small models)")
    p.add_argument("--png", default=None, help="write the strategy map and simulated timeline here")
    args = p.parse_args(list(argv))
    try:
        strategy = strategy_from(args.strategy)
        cost = _cost_model(args)
        result = _simulate(strategy, cost, args.schedule, args.seq, args.level)
        closed = estimate_strategy(strategy, cost, args.schedule, args.seq)
    except HSPMDError as e:
        print(f"hspmd simulate: {e}", file=sys.stderr)
        return 2
    print_result(result, f"{strategy.name or 'strategy'} on {cost.cluster.describe()}, {cost.model.name}, {args.schedule}", closed)
    if args.png:
        fig, _ = strategy_figure(strategy, result, cost.cluster)
        save_figure(fig, args.png)
        print(f"wrote {args.png}")
    return 0


def show_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="hspmd show", description="draw a strategy (map + simulated timeline), a run's "
                                "trace, or both side by side")
    p.add_argument("target", help="a strategy (text, file or paper name) or a Chrome trace .json of a run")
    p.add_argument("--trace", default=None, help="with a strategy: the measured trace of the same strategy")
    p.add_argument("--cluster", default="hetu-h800-h20")
    p.add_argument("--model", default="llama-32b-hetu")
    p.add_argument("--calibration", default=None, help="simulate on this machine's calibration")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--level", type=int, choices=(1, 2), default=1)
    p.add_argument("--png", default="hspmd-show.png")
    args = p.parse_args(list(argv))
    try:
        if args.target.endswith(".json") and Path(args.target).is_file() and args.trace is None:
            fig, ax = plt.subplots(figsize=(11, 3.5))
            draw_timeline(ax, segments_of_trace(read_trace(args.target)), f"measured: {args.target}")
        else:
            args.strategy = args.target
            strategy = strategy_from(args.target)
            result = _simulate(strategy, _cost_model(args), args.schedule, None, args.level)
            fig, axes = strategy_figure(strategy, result, title=f"simulated (level {args.level})",
                                        panels=3 if args.trace else 2)
            if args.trace:
                segs = segments_of_trace(read_trace(args.trace))
                end = max(s[2] for v in segs.values() for s in v)
                draw_timeline(axes[2], segs, f"measured: {end * 1e3:.1f} ms")
    except HSPMDError as e:
        print(f"hspmd show: {e}", file=sys.stderr)
        return 2
    save_figure(fig, args.png)
    print(f"wrote {args.png}")
    return 0


def calibrate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="hspmd calibrate", description="fit the cost model to this machine: torch "
                                "micro-benchmarks, the executor's overhead, a gloo ping-pong (2 processes)")
    p.add_argument("--out", default="calibration.json")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cluster", default=None,
                   help="a cluster file with an emulate block: also print the rates its emulated types follow from this "
                        "host's fit (this host is its reference type; the others at the file's ratios)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the compute probes on CPU time (a core of one's own): what emulated device types follow "
                        "(hspmd run --cluster with an emulate block), whatever else this host runs")
    args = p.parse_args(list(argv))
    cluster = parse_cluster(args.cluster) if args.cluster else None
    if cluster is not None and cluster.emulation is None:
        raise HSPMDError(f"--cluster {args.cluster}: the cluster has no emulate block (nothing on this host follows from it)")
    # on CPU time for an emulated cluster, the step probes run as its reference type (dilated time included)
    cal = calibrate(args.repeats, cpu_time=args.cpu_time, emulate=emulated_reference(cluster) if args.cpu_time else None,
                    wake_at=emulated_slowdowns(cluster))
    cal.save(args.out)
    print(cal.describe())
    if cluster is not None:
        for t in cluster.device_types:
            s = cluster.type_slowdown(t.name)
            role = "this host (reference)" if t.name == cluster.emulation.reference else f"{s:.3g}x slower than this host"
            print(f"  emulated {t.name}: {role}: matmul {cal.peak_flops / s / 1e9:.2f} GFLOP/s, elementwise "
                  f"{cal.bandwidth / s / 1e9:.2f} GB/s, {cal.overhead * s * 1e6:.1f} us/instruction")
    print(f"wrote {args.out} (use it with hspmd simulate --calibration {args.out})")
    return 0


__all__ = [
    "calibrate_main", "draw_plan", "draw_strategy_map", "draw_timeline", "print_result", "segments_of_result", "segments_of_trace",
    "show_main", "simulate_main", "strategy_figure", "strategy_from",
]
