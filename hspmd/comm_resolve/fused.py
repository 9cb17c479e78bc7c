"""Fused batched send-receive of many tensors at once (paper section 6.2, strategy switching).

All tensors' BSR tables are merged into one: senders are balanced over the whole switch, and
every slice one device sends another, of every tensor, travels in one message. Tensors are
numbered by their position in the input; executing a fused plan maps tensor index -> piece.

JSON ("schema": "hspmd.fused-plan/1"): "tensors": [{"src", "dst", "shape"}, ...]; one step
{"primitive": "BatchedSendRecv", "groups": [[sender, receiver], ...], "transfers": [{"src", "dst",
"boxes", "tensors"}]} where tensors[i] is the index of the tensor boxes[i] belongs to; then
"messages", "bytes_sent", "bytes_received", "bytes_by_link", "estimated_seconds" as for plans.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from hspmd.annotations import box_intersection, device_pieces, parse
from hspmd.comm_resolve.bsr import Family, destination_needs, max_send_lower_bound, plan_transfers
from hspmd.comm_resolve.cost import DTYPE_SIZES, dtype_name
from hspmd.comm_resolve.plan import FusedPlan, TensorMove
from hspmd.comm_resolve.resolver import bind_ratios, check_shape
from hspmd.comm_resolve.slices import box_volume
from hspmd.comm_resolve.topology import Topology, default_topology
from hspmd.errors import ShapeError, UnsupportedReshard

def tensor_moves(moves: Iterable) -> tuple[TensorMove, ...]:
    """Validated TensorMove values from (src, dst, shape) triples (or TensorMoves)."""
    out = []
    for i, move in enumerate(moves):
        if isinstance(move, TensorMove):
            src, dst, shape = move.src, move.dst, move.shape
        else:
            try:
                src, dst, shape = move
            except (TypeError, ValueError):
                raise ShapeError(f"tensor {i}: expected a (src, dst, shape) triple, got {move!r}") from None
        src = bind_ratios(parse(src), None, f"source of tensor {i}")
        dst = bind_ratios(parse(dst), None, f"destination of tensor {i}")
        shape = check_shape(shape, src, dst)
        if src.has_partial:
            raise UnsupportedReshard(
                f"tensor {i}: cannot move {src} -> {dst} in a fused BatchedSendRecv: the source holds partial "
                f"sums, which BSR cannot carry; reduce it first (resolve() does) or pass a non-partial layout"
            )
        out.append(TensorMove(src, dst, shape))
    return tuple(out)


def families(moves: Sequence[TensorMove]) -> list[Family]:
    """One BSR table section per tensor: its owners and what each destination device needs."""
    out = []
    for i, m in enumerate(moves):
        owners = {d: p.box for d, p in device_pieces(m.src, m.shape).items()}
        out.append(Family(i, len(m.shape), owners, destination_needs(m.dst, m.shape, owners)))
    return out


def resolve_many(
    moves: Iterable, topology: Topology | str | None = None, *, dtype: object = "float32"
) -> FusedPlan:
    """One fused BSR plan moving every (src, dst, shape) tensor; run-time ratios must be bound."""
    moves = tensor_moves(moves)
    devices = {d for m in moves for d in m.src.devices + m.dst.devices}
    topology = default_topology(devices) if topology is None else Topology.parse(topology)
    topology.check_devices(sorted(devices), "fused reshard")
    name = dtype_name(dtype)
    transfers = plan_transfers(families(moves), topology, DTYPE_SIZES[name])
    return FusedPlan(moves, transfers, topology, name)


def send_lower_bound(plan: FusedPlan, fastest_links_only: bool = False) -> int:
    """The least possible maximum per-device send bytes for the plan's tensors, splitting slices
    freely among their owners; with `fastest_links_only`, among the owners the bandwidth rule
    allows (the bound the load-balancing rule can be held to)."""
    return max_send_lower_bound(families(plan.moves), plan.itemsize, plan.topology if fastest_links_only else None)


def required_bytes(plan: FusedPlan) -> dict[int, int]:
    """Per device, the bytes it needs and does not hold: what any plan must deliver to it."""
    needed: dict[int, int] = {}
    for fam in families(plan.moves):
        for e, boxes in fam.needs.items():
            own = fam.owners.get(e)
            for box in boxes:
                held = box_intersection(box, own) if own is not None else None
                lacking = box_volume(box) - (box_volume(held) if held is not None else 0)
                needed[e] = needed.get(e, 0) + lacking * plan.itemsize
    return needed


__all__ = ["families", "required_bytes", "resolve_many", "send_lower_bound", "tensor_moves"]
