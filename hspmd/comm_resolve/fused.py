"""Fused batched send-receive of many tensors at once (paper section 6.2, strategy switching).

All tensors' BSR tables are merged into one: senders are balanced over the whole switch, and
every slice one device sends another, of every tensor, travels in one message. Tensors are
numbered by their position in the input; executing a fused plan maps tensor index -> piece.

Failed devices (`failed=`) are never sources, down to single devices: a tensor-parallel group that
lost one member still serves its other members' pieces. Only what no living device holds is lost
(WeightLost names those tensors). Failed devices take no part in the plan.

Where several owners could send a slice, the plan depends on the choices made: `order` is the
order the merged table is scanned in ("largest_first" by bytes, the default, or "given"), which decides
how load balancing spreads senders; `heuristics=False` is the paper's baseline (smallest-rank
owner, no bandwidth or load rule).

JSON ("schema": "hspmd.fused-plan/1"): "dtype" (the common one, or "mixed"), "tensors": [{"src", "dst",
"shape", "dtype"}, ...]; one step
{"primitive": "BatchedSendRecv", "groups": [[sender, receiver], ...], "transfers": [{"src", "dst",
"boxes", "tensors"}]} where tensors[i] is the index of the tensor boxes[i] belongs to; then
"messages", "bytes_sent", "bytes_received", "bytes_by_link", "estimated_seconds" as for plans;
"failed": the failed devices the plan routes around.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from hspmd.annotations import box_intersection, device_pieces, parse
from hspmd.comm_resolve.bsr import TensorSlices, destination_needs, max_send_lower_bound, plan_transfers, unowned_boxes
from hspmd.comm_resolve.cost import dtype_name
from hspmd.comm_resolve.plan import FusedPlan, TensorMove
from hspmd.comm_resolve.resolver import bind_ratios, concrete_shape
from hspmd.comm_resolve.slices import box_volume
from hspmd.comm_resolve.topology import ClusterSpec, cluster_for
from hspmd.comm_resolve.render import box_text
from hspmd.errors import HSPMDError, HSPMDTypeError, ShapeError, UnsupportedReshard, WeightLost
from hspmd.gc_pause import collector_paused
from hspmd.limits import brief, device_id_set

SCAN_ORDERS = ("largest_first", "given")

def tensor_moves(moves: Iterable, dtype: object = "float32") -> tuple[TensorMove, ...]:
    """Validated TensorMove values from (src, dst, shape[, dtype]) tuples (or TensorMoves);
    `dtype` is the dtype of tuples that do not name one."""
    if isinstance(moves, (str, bytes)) or not isinstance(moves, Iterable):
        raise HSPMDTypeError(f"moves must be a collection of (src, dst, shape[, dtype]) tuples, got {brief(moves)}")
    out = []
    for i, move in enumerate(moves):
        if isinstance(move, TensorMove):
            src, dst, shape, its_dtype = move.src, move.dst, move.shape, move.dtype
        else:
            try:
                src, dst, shape, *rest = move
            except (TypeError, ValueError):
                raise ShapeError(f"tensor {i}: expected a (src, dst, shape[, dtype]) tuple, got {move!r}") from None
            if len(rest) > 1:
                raise ShapeError(f"tensor {i}: expected a (src, dst, shape[, dtype]) tuple, got {move!r}")
            its_dtype = rest[0] if rest else dtype
        src = bind_ratios(parse(src), None, f"source of tensor {i}")
        dst = bind_ratios(parse(dst), None, f"destination of tensor {i}")
        shape = concrete_shape(shape, src, dst)
        if src.has_partial:
            raise UnsupportedReshard(
                f"tensor {i}: cannot move {src} -> {dst} in a fused BatchedSendRecv: the source holds partial "
                f"sums, which BSR cannot carry; reduce it first (resolve() does) or pass a non-partial layout"
            )
        try:
            name = dtype_name(its_dtype)
        except ShapeError as exc:
            raise ShapeError(f"tensor {i}: {exc}") from None
        out.append(TensorMove(src, dst, shape, name))
    return tuple(out)


def families(moves: Sequence[TensorMove], failed: Iterable[int] = ()) -> list[TensorSlices]:
    """One BSR table section per tensor: its living owners and what each destination device needs."""
    failed = frozenset(failed)
    out = []
    for i, m in enumerate(moves):
        owners = {d: p.box for d, p in device_pieces(m.src, m.shape).items() if d not in failed}
        out.append(TensorSlices(i, len(m.shape), owners, destination_needs(m.dst, m.shape, owners)))
    return out


def _check_failed(moves: Sequence[TensorMove], fams: Sequence[TensorSlices], failed: frozenset[int]) -> None:
    """Raise HSPMDError for a destination that places a tensor on a failed device, then WeightLost
    naming every tensor some of whose needed values only failed devices held."""
    for i, m in enumerate(moves):
        on_failed = failed & set(m.dst.devices)
        if on_failed:
            raise HSPMDError(
                f"tensor {i}: its destination {m.dst} places it on failed device(s) {sorted(on_failed)}; "
                f"choose a destination layout without them"
            )
    lost = {f.tensor: boxes for f in fams if (boxes := unowned_boxes(f))}
    if lost:
        lines = [
            f"tensor {i} (shape {moves[i].shape}, {moves[i].src}): {' '.join(box_text(b) for b in boxes)}"
            for i, boxes in lost.items()
        ]
        raise WeightLost(
            f"{len(lost)} tensor(s) lost parts that only failed device(s) {sorted(failed)} held; restore them from a "
            f"checkpoint:\n  " + "\n  ".join(lines), lost,
        )


def scan_order(moves: Sequence[TensorMove], order: str) -> list[int]:
    """Tensor indices in the order the merged BSR table is scanned."""
    if order == "given":
        return list(range(len(moves)))
    if order == "largest_first":
        def nbytes(i: int) -> int:
            return box_volume(tuple((0, n) for n in moves[i].shape)) * moves[i].itemsize

        return sorted(range(len(moves)), key=lambda i: -nbytes(i))
    raise HSPMDError(f"unknown scan order {order!r}; use one of {', '.join(SCAN_ORDERS)}")


def resolve_many(
    moves: Iterable,
    topology: ClusterSpec | str | None = None,
    *,
    dtype: object = "float32",
    failed: Iterable[int] = (),
    order: str = "largest_first",
    heuristics: bool = True,
) -> FusedPlan:
    """One fused BSR plan moving every (src, dst, shape[, dtype]) tensor (`dtype` for those that
    name none); run-time ratios must be bound.

    `failed` devices send nothing and receive nothing: every piece a living device holds is a
    source. `order` and `heuristics` choose among correct plans (see the module docstring)."""
    moves = tensor_moves(moves, dtype)
    failed = device_id_set(failed, "resolve_many: failed")
    devices = {d for m in moves for d in m.src.devices + m.dst.devices}
    topology = cluster_for(topology, devices, "fused reshard")
    with collector_paused():  # as resolve: many long-lived objects, no cycles (hspmd.gc_pause)
        fams = families(moves, failed)
        if failed:
            _check_failed(moves, fams, failed)
        scanned = [fams[i] for i in scan_order(moves, order)]
        transfers = plan_transfers(scanned, topology, [m.itemsize for m in moves], heuristics=heuristics)
    return FusedPlan(moves, transfers, topology, tuple(sorted(failed & devices)))


def send_lower_bound(plan: FusedPlan, fastest_links_only: bool = False) -> int:
    """The least possible maximum per-device send bytes for the plan's tensors, splitting slices
    freely among their owners; with `fastest_links_only`, among the owners the bandwidth rule
    allows (the bound the load-balancing rule can be held to)."""
    return max_send_lower_bound(families(plan.moves, plan.failed), plan.itemsizes, plan.topology if fastest_links_only else None)


def required_bytes(plan: FusedPlan) -> dict[int, int]:
    """Per device, the bytes it needs and does not hold: what any plan must deliver to it."""
    needed: dict[int, int] = {}
    for fam in families(plan.moves, plan.failed):
        for e, boxes in fam.needs.items():
            own = fam.owners.get(e)
            for box in boxes:
                held = box_intersection(box, own) if own is not None else None
                lacking = box_volume(box) - (box_volume(held) if held is not None else 0)
                needed[e] = needed.get(e, 0) + lacking * plan.itemsizes[fam.tensor]
    return needed


__all__ = ["SCAN_ORDERS", "families", "required_bytes", "resolve_many", "scan_order", "send_lower_bound", "tensor_moves"]
