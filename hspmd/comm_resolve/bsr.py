"""Batched send-receive (paper section 4.3): the slice table and the sender heuristics.

For each tensor, the finest slices (cells of the grid cut at every src and dst piece boundary) are
listed with their owners (source devices holding them) and needers (destination devices that
must end up with them). Scanning the table slice by slice, needer by needer, the sender is:

  1. the needer itself when it already owns the slice (a local copy, no message);
  2. otherwise the owner with the highest-bandwidth link to the needer;
  3. among equally fast owners, the one with the lowest cumulative send load so far (then the
     lowest device id, so plans are deterministic).

With `heuristics=False` rules 2 and 3 give way to the paper's "w/o heuristics" baseline: the
owner with the smallest rank sends (rule 1 still holds: nobody sends a device what it has).

The load is shared across all tensors planned together, so a fused plan (many tensors, e.g. all
parameters of a model when switching strategies) balances senders globally; all slices one device
sends another, of every tensor, form one message. Each slice a device needs and lacks is received
exactly once, so the volume equals the lower bound.

BSR moves values, never partial sums: a destination with Partial receives the value in one
summand per slice (the one whose holders already own most of it) and zeros in the others.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from hspmd.annotations import Annotation, Box, device_pieces
from hspmd.annotations.geometry import device_pieces_of, subgroup_device_pieces, subgroup_kinds
from hspmd.annotations.states import IDEMPOTENT
from hspmd.comm_resolve.cost import itemsize_of
from hspmd.comm_resolve.plan import Transfer
from hspmd.comm_resolve.slices import Cell, Grid, box_contains, box_volume
from hspmd.comm_resolve.topology import ClusterSpec
from hspmd.errors import CommunicationError


@dataclass
class TensorSlices:
    """One tensor's slices that may serve each other: owners hold values, needers must get them."""

    tensor: int
    ndim: int
    owners: dict[int, Box]
    needs: dict[int, list[Box]] = field(default_factory=dict)


def destination_needs(
    dst: Annotation, shape: Sequence[int], owners: Mapping[int, Box], devices: Iterable[int] | None = None
) -> dict[int, list[Box]]:
    """What each destination device must receive as a value.

    Non-partial pieces need their whole box. Where the destination holds partial summands, each
    slice goes to one summand of each group whose summands add up to the tensor (all subgroups
    under HDim P, else each subgroup): the one whose holders own most of it already; the other
    summands hold the reduction's identity (zeros for sums, ones for products). Under an
    idempotent reduction (max, min, avg) every partial piece gets the value, as a value piece."""
    pieces = device_pieces(dst, shape) if devices is None else device_pieces_of(dst, shape, dict.fromkeys(devices))
    if dst.reduction in IDEMPOTENT or not any(p.is_partial for p in pieces.values()):
        return {d: [p.box] for d, p in pieces.items() if box_volume(p.box) > 0}
    families = [list(pieces)] if dst.hdim == "P" else [[d for d in s.dg if d in pieces] for s in dst.subgroups]
    grid = Grid([p.box for p in pieces.values()] + [b for b in owners.values()], len(shape))
    owners_of = grid.holders(owners.items())
    needs: dict[int, list[Cell]] = defaultdict(list)
    for family in families:
        if not any(pieces[d].is_partial for d in family):
            for d in family:
                needs[d].extend(grid.cells(pieces[d].box))
            continue
        holders: dict[Cell, dict[tuple, list[int]]] = defaultdict(lambda: defaultdict(list))
        for d in family:
            for cell in grid.cells(pieces[d].box):
                holders[cell][pieces[d].summand].append(d)
        for cell, by_key in holders.items():
            owning = set(owners_of.get(cell, ()))

            def score(key):
                devs = by_key[key]
                return (-sum(d in owning for d in devs), sum(d not in owning for d in devs), key)

            for d in by_key[min(by_key, key=score)]:
                needs[d].append(cell)
    return {d: grid.merge(cells) for d, cells in needs.items()}


def local_copies(src: Annotation, dst: Annotation, shape: Sequence[int],
                 leaves_out: Callable[[Sequence[int]], bool]) -> tuple[tuple[Transfer, ...], tuple]:
    """(the copies, the repeats) of a reshard in which every device finds its piece in its own
    piece: what plan_transfers would give (each device copies its destination box), without the
    table. A subgroup on devices `leaves_out` accepts whose kind (subgroup_kinds) an earlier
    subgroup has is left out and named in the repeats (Step.repeats), as a plan for some
    devices leaves out repeated subgroups."""
    copies, repeats, templates = [], [], {}
    for k, kind in enumerate(subgroup_kinds(src, dst, shape)):
        devices = dst.subgroups[k].dg.devices
        if kind is not None and kind in templates and leaves_out(devices):
            repeats.append((templates[kind], devices))
            continue
        if kind is not None:
            templates.setdefault(kind, devices)
        pieces = subgroup_device_pieces(dst, k, shape).items()
        copies += [Transfer(d, d, (p.box,), (0,)) for d, p in pieces if box_volume(p.box)]
    return tuple(sorted(copies, key=lambda t: t.src)), tuple(repeats)


def unowned_boxes(fam: TensorSlices) -> list[Box]:
    """The parts of `fam`'s needs that no owner holds (empty when every need can be served)."""
    needs = [b for boxes in fam.needs.values() for b in boxes if box_volume(b) > 0]
    if not needs:
        return []
    grid = Grid(list(fam.owners.values()) + needs, fam.ndim)
    owned = grid.holders(fam.owners.items())
    return grid.merge({cell for box in needs for cell in grid.cells(box) if cell not in owned})


def plan_transfers(
    families: Sequence[TensorSlices], topology: ClusterSpec, itemsize: int | Sequence[int], *, heuristics: bool = True
) -> tuple[Transfer, ...]:
    """The fused messages (and local copies) that deliver every family's needs, families scanned
    in the order given (the load balance of rule 3 depends on it); `itemsize` is one size or one
    per tensor number (mixed dtypes: loads count bytes)."""
    size_of = itemsize_of(itemsize)
    load: dict[int, int] = defaultdict(int)
    per_pair: dict[tuple[int, int], list[tuple[int, Box]]] = defaultdict(list)
    for fam in families:
        table: dict[Cell, list[int]] = defaultdict(list)
        pending = []
        for e in sorted(fam.needs):
            for box in fam.needs[e]:
                own = fam.owners.get(e)
                if own is not None and box_contains(own, box):
                    per_pair[(e, e)].append((fam.tensor, box))
                elif box_volume(box) > 0:
                    pending.append((e, box))
        if not pending:
            continue
        grid = Grid(list(fam.owners.values()) + [b for _, b in pending], fam.ndim)
        for e, box in pending:
            for cell in grid.cells(box):
                table[cell].append(e)
        owners_of = grid.holders(sorted(fam.owners.items()))
        cells_of_pair: dict[tuple[int, int], list[Cell]] = defaultdict(list)
        item = size_of(fam.tensor)
        for cell in sorted(table):
            owners = owners_of.get(cell, [])
            if not owners:
                raise CommunicationError(f"tensor {fam.tensor}: no source device holds slice {grid.cell_box(cell)}")
            nbytes = grid.cell_volume(cell) * item
            for e in table[cell]:
                if e in owners:
                    sender = e
                elif len(owners) == 1:
                    sender = owners[0]
                    load[sender] += nbytes
                elif not heuristics:
                    sender = min(owners)
                    load[sender] += nbytes
                else:
                    sender = max(owners, key=lambda d: (topology.bandwidth(d, e), -load[d], -d))
                    load[sender] += nbytes
                cells_of_pair[(sender, e)].append(cell)
        for pair, cells in cells_of_pair.items():  # one cell per pair in an all-to-all: no merging
            boxes = [grid.cell_box(cells[0])] if len(cells) == 1 else grid.merge(cells)
            per_pair[pair].extend((fam.tensor, b) for b in boxes)
    return tuple(
        Transfer(s, r, (items[0][1],), (items[0][0],)) if len(items) == 1
        else Transfer(s, r, tuple(b for _, b in items), tuple(t for t, _ in items))
        for (s, r), items in sorted(per_pair.items())
    )


def demand_by_owner_set(
    families: Sequence[TensorSlices], itemsize: int | Sequence[int], topology: ClusterSpec | None = None
) -> dict[frozenset, int]:
    """Bytes that must cross a link, grouped by the set of devices able to send them (with a
    topology: only the owners on the fastest link to the receiver, the ones rule 2 keeps)."""
    size_of = itemsize_of(itemsize)
    demand: dict[frozenset, int] = defaultdict(int)
    for fam in families:
        needs = [(e, b) for e in fam.needs for b in fam.needs[e]]
        grid = Grid(list(fam.owners.values()) + [b for _, b in needs], fam.ndim)
        owners_of = grid.holders(fam.owners.items())
        for e, box in needs:
            for cell in grid.cells(box):
                owners = frozenset(owners_of.get(cell, ()))
                if e in owners:
                    continue
                if topology is not None:
                    fastest = max(topology.bandwidth(d, e) for d in owners)
                    owners = frozenset(d for d in owners if topology.bandwidth(d, e) == fastest)
                demand[owners] += grid.cell_volume(cell) * size_of(fam.tensor)
    return dict(demand)


def max_send_lower_bound(
    families: Sequence[TensorSlices], itemsize: int | Sequence[int], topology: ClusterSpec | None = None
) -> int:
    """The least possible maximum of per-device send bytes, even splitting slices freely among
    their owners (with a topology: among their fastest owners): the smallest cap T for which a
    flow (demand -> owner sets -> owners, each owner capped at T) carries every byte. Binary
    search on integer T."""
    import networkx as nx

    demand = demand_by_owner_set(families, itemsize, topology)
    total = sum(demand.values())
    if total == 0:
        return 0
    senders = sorted({d for owners in demand for d in owners})

    def feasible(cap: int) -> bool:
        g = nx.DiGraph()
        for i, (owners, nbytes) in enumerate(demand.items()):
            g.add_edge("s", ("set", i), capacity=nbytes)
            for d in owners:
                g.add_edge(("set", i), ("dev", d))
        for d in senders:
            g.add_edge(("dev", d), "t", capacity=cap)
        return nx.maximum_flow_value(g, "s", "t") >= total

    lo, hi = -(-total // len(senders)) - 1, total
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


__all__ = ["TensorSlices", "demand_by_owner_set", "destination_needs", "local_copies", "max_send_lower_bound",
           "plan_transfers", "unowned_boxes"]
