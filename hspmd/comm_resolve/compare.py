"""Every correct plan the resolver knows for one reshard, side by side with its cost.

`alternatives` resolves the reshard by each route of resolver.VIAS (a route that does not apply
carries the reason instead of a plan), and the two-hop plan through an intermediate layout where
`resolve` picks one (TWO_HOP), and `chosen_route` names the one `resolve` returns by default.
`hspmd explain --compare` prints them with bytes per link class and estimated time.
"""

from __future__ import annotations

from typing import Sequence

from hspmd.comm_resolve.plan import Plan
from hspmd.comm_resolve.resolver import VIAS, resolve
from hspmd.errors import UnsupportedReshard


TWO_HOP = "two-hop"


def alternatives(src, dst, shape: Sequence[int], topology=None, **options) -> dict[str, Plan | UnsupportedReshard]:
    """{route: its plan, or the UnsupportedReshard saying why it does not apply}, with TWO_HOP where
    the default plan passes an intermediate layout (resolver.py, multihop.py); `options` are
    resolve's keywords (dtype, src_ratios, dst_ratios, reduce_partial)."""
    out: dict[str, Plan | UnsupportedReshard] = {}
    for via in VIAS:
        try:
            out[via] = resolve(src, dst, shape, topology, via=via, **options)
        except UnsupportedReshard as exc:
            out[via] = exc
    try:
        default = resolve(src, dst, shape, topology, **options)
    except UnsupportedReshard:
        return out
    if not any(isinstance(plan, Plan) and plan.steps == default.steps for plan in out.values()):
        out[TWO_HOP] = default
    return out


def chosen_route(alts: dict[str, Plan | UnsupportedReshard], chosen: Plan) -> str:
    """The route whose plan equals `chosen` (the default resolve's pick)."""
    return next(via for via, plan in alts.items() if isinstance(plan, Plan) and plan.steps == chosen.steps)


__all__ = ["TWO_HOP", "alternatives", "chosen_route"]
