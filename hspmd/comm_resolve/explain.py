"""`hspmd explain SRC DST --shape 8,6 [--topology 2x4] [--via ROUTE] [--compare] [--json]`: the plan
between two annotations.

With --compare it prints every route the resolver knows (resolver.VIAS) with its steps, messages,
bytes per link class and estimated time, marking the one `resolve` picks by default; a route that
does not apply says why. JSON of --compare: {"schema": "hspmd.plan-alternatives/1", "chosen": ROUTE,
"alternatives": {ROUTE: plan JSON as below, or {"unsupported": reason}}}.

Without --json it prints the steps (primitive, device groups, bytes, estimated time), the bytes
each device sends and receives, the bytes per link class, the estimated time and, where the
resolver's decision order fell back from one tier to a later one, when and why (resolve also
issues a FallbackWarning then; explain shows it here instead). Errors print one message on
stderr and exit with code 2.

JSON schema ("schema": "hspmd.plan/1"; device ids as JSON object keys are strings):

    {
      "schema": "hspmd.plan/1",
      "src": "HP{S1:4@[0-3] | S1:2@[4,5]}", "dst": "...", "shape": [8, 6],
      "dtype": "float32", "itemsize": 4,
      "topology": {...},                     the ClusterSpec, as hspmd.cluster.cluster_to_dict writes it
                                              (the YAML cluster format: nodes, device types, links)
      "steps": [
        {"primitive": "SplitAllReduce",        one of Identity, LocalSplit, SendRecv, AllReduce,
                                                ReduceScatter, AllGather, SplitAllReduce,
                                                SplitReduceScatter, SplitAllGather, BatchedSendRecv
         "round": 0,                            steps of one round run side by side
         "subgroup": null,                      the subgroup a bottom-tier step acts on, else null
         "src": "...", "dst": "...",            layouts before and after the step
         "groups": [[0, 4], [1, 4], ...],       collective groups, then [sender, receiver] pairs
         "collectives": [{"kind": "all_reduce" | "reduce_scatter" | "all_gather",
                          "devices": [...], "box": [[start, stop], ...],
                          "parts": [box, ...], "zero_inputs": [...]}],
         "transfers": [{"src": d, "dst": e, "boxes": [box, ...], "tensors": [0, ...]}],
         "assembled_on": [...],                 devices that rebuild their piece in this step
         "bytes": n, "estimated_seconds": t}
      ],
      "bytes_sent": {"0": n, ...}, "bytes_received": {"0": n, ...},
      "bytes_by_link": {"intra-node": n, ...},
      "estimated_seconds": t,
      "fallbacks": ["top tier: ...", ...]     only where a tier of the decision order could not give its
                                              primitive and a later one made the steps: which and why
    }

Boxes are global half-open ranges per dim. `hspmd.comm_resolve.Plan.from_json` reads it back.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from hspmd.arguments import ArgumentParser, non_negative_int
from hspmd.errors import HSPMDError, error_line


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(non_negative_int(part) for part in text.replace(" ", "").split(",") if part != "")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (e.g. 8,6), got {text!r}") from None


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="hspmd explain", description="Show the communication plan that turns SRC into DST.")
    p.add_argument("src", help="source annotation, e.g. 'HP{S1:4@[0-3] | S1:2@[4,5]}'")
    p.add_argument("dst", help="destination annotation")
    p.add_argument("--shape", type=_ints, required=True, help="global tensor shape, e.g. 8,6")
    p.add_argument("--topology", default=None,
        help="cluster: a preset (hetu-h800-h20, hapt-a100-v100, heterosim-a100-h100, hetauto-a100-2x16), 2x4, "
                   "nvlink-ib:4x8, h800-h20:2+4 or a cluster .yaml file (default: one node)")
    p.add_argument("--dtype", default="float32", help="element type for byte counts (default float32)")
    p.add_argument("--src-ratios", type=_ints, default=None, help="run-time top-tier ratios of SRC, e.g. 2,1")
    p.add_argument("--dst-ratios", type=_ints, default=None, help="run-time top-tier ratios of DST")
    p.add_argument("--strict", action="store_true", help="follow the paper: refuse Partial sources that need BSR")
    p.add_argument("--via", default=None, help="force a route: hierarchical, merged-allgather, direct, root, representatives")
    p.add_argument("--compare", action="store_true", help="print every route with bytes per link and estimated time")
    p.add_argument("--details", action="store_true", help="list every sub-collective and message")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema in the module docstring)")
    return p


def _print_rich(plan, details: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from hspmd.comm_resolve.render import bytes_text, groups_text, seconds_text, step_details

    console = Console(highlight=False)
    console.print(f"[bold]{plan.src}[/bold] -> [bold]{plan.dst}[/bold]   shape {plan.shape}, {plan.dtype}, "
                  f"topology {plan.topology}", markup=True)
    steps = Table(title="steps")
    for col in ("#", "round", "primitive", "subgroup", "groups", "bytes", "est. time"):
        steps.add_column(col)
    for i, (s, b, t) in enumerate(zip(plan.steps, plan.step_bytes(), plan.step_seconds()), 1):
        steps.add_row(str(i), str(s.round), s.primitive, "" if s.subgroup is None else str(s.subgroup),
                      groups_text(s), bytes_text(b), seconds_text(t))
    console.print(steps)
    if details:
        for i, s in enumerate(plan.steps, 1):
            console.print(f"step {i}: {s.src} -> {s.dst}", markup=False)
            for line in step_details(s):
                console.print(f"  {line}", markup=False)
    devices = Table(title="bytes per device")
    for col in ("device", "sent", "received"):
        devices.add_column(col)
    for d in plan.devices:
        devices.add_row(str(d), bytes_text(plan.bytes_sent[d]), bytes_text(plan.bytes_received[d]))
    console.print(devices)
    links = ", ".join(f"{k}: {bytes_text(n)}" for k, n in plan.bytes_by_link.items()) or "none"
    console.print(f"bytes by link class: {links}", markup=False)
    console.print(f"estimated time: {seconds_text(plan.estimated_seconds)} (alpha-beta model, ring collectives)",
                  markup=False)
    for why in plan.fallbacks:
        console.print(f"fallback: {why}", markup=False)


def _print_compare(alts, chosen: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from hspmd.comm_resolve.plan import Plan
    from hspmd.comm_resolve.render import bytes_text, seconds_text

    console = Console(highlight=False)
    table = Table(title="routes (* = what resolve() picks by default)")
    for col in ("route", "steps", "messages", "bytes", "bytes per link", "est. time"):
        table.add_column(col)
    skipped = []
    for via, plan in alts.items():
        if not isinstance(plan, Plan):
            skipped.append(f"{via}: not applicable: {plan}")
            continue
        links = "\n".join(f"{k} {bytes_text(n)}" for k, n in plan.bytes_by_link.items()) or "none"
        table.add_row(via + (" *" if via == chosen else ""), str(len(plan.steps)), str(plan.messages),
                      bytes_text(plan.total_bytes), links, seconds_text(plan.estimated_seconds))
    console.print(table)
    for line in skipped:
        console.print(line, markup=False)
    for via, plan in alts.items():
        for why in getattr(plan, "fallbacks", ()):
            console.print(f"{via}: fallback: {why}", markup=False)


def main(argv: list[str] | None = None) -> int:
    from hspmd.comm_resolve.compare import alternatives, chosen_route
    from hspmd.comm_resolve.resolver import FallbackWarning, resolve

    try:
        args = _parser().parse_args(argv)
        options = dict(dtype=args.dtype, src_ratios=args.src_ratios, dst_ratios=args.dst_ratios,
                       reduce_partial=not args.strict)
        with warnings.catch_warnings():  # the plan's fallbacks are printed with it
            warnings.simplefilter("ignore", FallbackWarning)
            plan = resolve(args.src, args.dst, args.shape, args.topology, via=args.via, **options)
            if args.compare:
                alts = alternatives(args.src, args.dst, args.shape, args.topology, **options)
                chosen = chosen_route(alts, resolve(args.src, args.dst, args.shape, args.topology, **options))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except HSPMDError as exc:
        print(f"hspmd: error: {error_line(exc)}", file=sys.stderr)
        return 2
    if args.compare and args.json:
        import json

        print(json.dumps({"schema": "hspmd.plan-alternatives/1", "chosen": chosen, "alternatives": {
            via: p.to_dict() if not isinstance(p, HSPMDError) else {"unsupported": str(p)} for via, p in alts.items()
        }}, indent=2))
    elif args.compare:
        _print_compare(alts, chosen)
    elif args.json:
        print(plan.to_json(indent=2))
    else:
        _print_rich(plan, args.details)
    return 0


__all__ = ["main"]
