"""The hierarchical route (Hetu v2 §4, figure 4): the decision order resolver.py's docstring gives,
from a source annotation to a destination.

1. Same HSize, HDim and top-tier regions: every subgroup on its own (the bottom tier, §4.1).
2. Same HSize and device-group union, another HDim: a bottom-tier step per subgroup equalises the
   union, then Split collectives over the finest slices (the top tier, §4.2); where a Split
   collective cannot make the destination, it falls back (Resolution.fall_back warns) to 3.
3. Anything else: BatchedSendRecv over the finest slice grid (`transfer_step`).

resolver.py prices this route against the others and picks; this module only builds its steps.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from hspmd.annotations import Annotation, Subgroup, device_piece, device_pieces
from hspmd.annotations.geometry import device_pieces_of, region_extents
from hspmd.comm_resolve.bounds import lacks
from hspmd.comm_resolve.bsr import TensorSlices, destination_needs, local_copies, plan_transfers
from hspmd.comm_resolve.collectives import collective_steps, reduction_targets
from hspmd.comm_resolve import relabel, scaling
from hspmd.comm_resolve.plan import Step, Transfer
from hspmd.comm_resolve.reshard import Resolution, identity, in_sequence, next_round, regions, shifted
from hspmd.comm_resolve.split_collectives import split_step
from hspmd.errors import CommunicationError


def route(src: Annotation, dst: Annotation, ctx: Resolution) -> list[Step]:
    """The steps of the decision order (module docstring) from `src` to `dst`."""
    if src.hsize == dst.hsize and src.hdim == dst.hdim and regions(src, ctx) == regions(dst, ctx):
        return _bottom_tier(src, dst, ctx)
    if src.hsize == dst.hsize and src.same_dg_union(dst):
        steps = _top_tier(src, dst, ctx)
        if steps is not None:
            return steps
    return _general(src, dst, ctx)


def _equalise(union: Annotation, k: int, target: Subgroup, ctx: Resolution) -> tuple[list[Step], Annotation]:
    """Subgroup k (same device group) into `target`'s distributed states, inside `union`."""
    current = union.subgroups[k]
    if current == target:
        return [identity(union, k)], union
    steps = collective_steps(union, k, target.ds, ctx.shape)
    if steps:
        return in_sequence(steps), union.with_subgroup(k, target)
    if steps is not None:
        done = union.with_subgroup(k, target)
        return [Step("Identity", union, done, subgroup=k)], done
    steps = []
    if current.ds.partial_count > 1:
        steps, union = _reduce_subgroup(union, k, ctx, f"subgroup {k} changes {current.ds} -> {target.ds}")
    done = union.with_subgroup(k, target)
    step = transfer_step(union, done, ctx, restrict=k)
    return steps + [replace(step, round=len(steps))], done


def _reduce_subgroup(union: Annotation, k: int, ctx: Resolution, why: str) -> tuple[list[Step], Annotation]:
    """Reduce subgroup k's bottom-tier Partial in place (ReduceScatter, else AllReduce)."""
    if not ctx.reduce_partial:
        raise ctx.refuse(f"{why} with partial sums")
    sub = union.subgroups[k]
    for target in reduction_targets(sub.ds, regions(union, ctx)[k]):
        steps = collective_steps(union, k, target, ctx.shape)
        if steps:
            return in_sequence(steps), union.with_subgroup(k, Subgroup(sub.dg, target))
    raise CommunicationError(f"internal: no reduction of {sub} in {union}")


def _bottom_tier(src: Annotation, dst: Annotation, ctx: Resolution) -> list[Step]:
    moving = () if src.same_dg_union(dst) else [k for k, (a, b) in enumerate(zip(src.dg_key, dst.dg_key)) if a != b]
    steps, union = _equalise_pass(src, dst, ctx, moving)
    if moving:
        before = [s for s in steps if s.subgroup in moving]  # the move overlaps the other subgroups' steps
        steps.append(replace(_move_step(union, dst, moving, ctx), round=next_round(before)))
    elif steps[-1].dst != dst:
        steps[-1] = replace(steps[-1], dst=dst)  # equal regions written with other ratios: the same layout
    return steps


def _equalise_pass(src: Annotation, dst: Annotation, ctx: Resolution, moving=()) -> tuple[list[Step], Annotation]:
    """Every subgroup of `src` but the `moving` ones (whose device group changes: only their
    partial sums are reduced here) into its states in `dst`, in one pass (_equalise_like), and the
    union after it. The subgroups a plan for some devices leaves out (scaling.repeating) are named in
    their template's steps and end in their target states (relabel.leave_out; scaling.py)."""
    union, steps, templates = src, [], {}
    boxes = regions(src, ctx)
    frames = relabel.frames_in_place(src, dst, region_extents(src, ctx.shape))  # (of moving ones: unread)
    repeating = scaling.repeating(src, frames, ctx, moving)
    planned = sorted(set(range(src.hsize)).difference(repeating)) if repeating else range(src.hsize)
    for k in planned:
        s, t = src.subgroups[k], dst.subgroups[k]
        if moving and k in moving:
            if s.ds.partial_count > 1 and s.ds != t.ds:
                sub_steps, union = _reduce_subgroup(union, k, ctx, f"subgroup {k} moves {s} -> {t}")
                steps += sub_steps
            continue
        sub_steps, union = scaling.equalise_like(templates, union, k, t, ctx, boxes[k], frames[k], _equalise)
        steps += sub_steps
    return relabel.leave_out(steps, union, repeating, src.dg_key, dst.subgroups)


def _move_step(union: Annotation, dst: Annotation, moving: list[int], ctx: Resolution) -> Step:
    """Subgroups whose device group changes, in one fused exchange. Same distributed states:
    SendRecv (partial summands go device to device by position; values go through the BSR table,
    so replicas already in place stay and each missing piece comes from the best owner).
    Otherwise BSR within the subgroup, planned once per frame and moved onto the subgroups of that
    frame (scaling.moved_subgroup). A plan resolved for some devices leaves out the subgroups
    scaling.moves_left_out finds and names them in the step's repeats."""
    piece = partial(device_piece, union, ctx.shape)  # read for the subgroups planned only
    boxes = regions(union, ctx)
    before, after = union.ds_union, dst.ds_union
    partial_sums = {id(ds) for ds in union.distinct_states if ds.partial_count > 1}
    summands = [k for k in moving if id(before[k]) in partial_sums and before[k] == after[k]] if partial_sums else []
    if summands:
        sending = set(summands)
        reshaping = [k for k in moving if k not in sending]
    else:
        reshaping = moving
    frames = dict(zip(reshaping, relabel.frames_moved(union, dst, reshaping, region_extents(union, ctx.shape))))
    groups = scaling.moving_devices(union, dst) if ctx.focus is not None else []
    left_out = scaling.moves_left_out(groups, moving, frames, ctx)
    transfers, templates = [], {}
    for k in summands:
        transfers += [Transfer(a, b, (piece(a).box,), (0,)) for a, b in zip(union.dg_key[k], dst.dg_key[k])]
    for k, key in frames.items():
        if k not in left_out:
            transfers += scaling.moved_subgroup(templates, union, dst, k, key, boxes[k], piece, ctx)
    repeats = []
    for k, k0 in left_out.items():
        if scaling.crosses_shared_link(templates, frames[k0]):  # its time adds up: priced, not repeated
            transfers += scaling.moved_subgroup(templates, union, dst, k, frames[k], boxes[k], piece, ctx)
        else:
            repeats.append((groups[k0], groups[k]))
    pairs = {(id(a), id(b)): (a, b) for a, b in zip(map(before.__getitem__, reshaping), map(after.__getitem__, reshaping))}
    reshaped = any(a != b for a, b in pairs.values())  # (each distinct pair of states objects compared once)
    assembled_on = tuple(sorted(d for k in moving for d in dst.dg_key[k]))
    return Step("BatchedSendRecv" if reshaped else "SendRecv", union, dst, (), _fuse(transfers), assembled_on,
                repeats=tuple(repeats))


def _fuse(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    by_pair: dict[tuple[int, int], list[Transfer]] = {}
    for t in transfers:
        by_pair.setdefault((t.src, t.dst), []).append(t)
    return tuple(
        ts[0] if len(ts) == 1 else Transfer(s, d, sum((t.boxes for t in ts), ()), sum((t.tensors for t in ts), ()))
        for (s, d), ts in sorted(by_pair.items())
    )


_SPLIT = {("P", "D"): "SplitAllReduce", ("P", "dim"): "SplitReduceScatter", ("dim", "D"): "SplitAllGather"}


def _top_tier(src: Annotation, dst: Annotation, ctx: Resolution) -> list[Step] | None:
    """Decision 2: the bottom tiers equalised, then the split collective between the two HDims;
    None where there is no split collective between them (the general tier's case), or where the
    one there is cannot serve (a fallback, recorded with its reason)."""
    kind = lambda h: "dim" if isinstance(h, int) else h  # noqa: E731
    primitive = _SPLIT.get((kind(src.hdim), kind(dst.hdim)))
    if primitive is None:
        return None
    general = "the general tier (BatchedSendRecv" + (", after reducing the partial values)" if src.has_partial else ")")
    if any(ds.partial_count > 1 for ds in dst.distinct_states):
        ctx.fall_back(f"top tier: {primitive} cannot make the partial values of the destination's subgroups, "
                      f"so {general} serves")
        return None
    union, steps = src, []
    if not src.same_ds_union(dst):
        steps, union = _equalise_pass(src, dst, ctx)
    step = split_step(primitive, union, dst, ctx.shape)
    if step is None:
        ctx.fall_back(f"top tier: {primitive} does not apply to {union} -> {dst} (a member would receive two "
                      f"different sums of one slice), so {general} serves")
        return None
    return steps + [replace(step, round=next_round(steps))]


def _general(src: Annotation, dst: Annotation, ctx: Resolution) -> list[Step]:
    if not src.has_partial:
        return [transfer_step(src, dst, ctx)]
    if not ctx.reduce_partial:
        raise ctx.refuse("the destination has another HSize or device group union and the source holds partial sums")
    steps, union = _reduce_union(src, dst, ctx)
    if union.has_partial:  # what ends the recursion: route on a union without partial values never returns here
        raise CommunicationError(f"internal: reducing the partial values of {src} in place left {union}, which "
                                 f"still holds partial values; resolving it again would not end")
    return steps + shifted(route(union, dst, ctx), next_round(steps))


def _reduce_union(union: Annotation, goal: Annotation, ctx: Resolution) -> tuple[list[Step], Annotation]:
    """Every Partial reduced where it lies: bottom tier per subgroup, then the top tier by a
    SplitReduceScatter (along the goal's HDim and ratios when it has one, else ratios = subgroup
    sizes) or, failing that, a SplitAllReduce."""
    steps = []
    for k, sub in enumerate(union.subgroups):
        if sub.ds.partial_count > 1:
            sub_steps, union = _reduce_subgroup(union, k, ctx, f"subgroup {k} holds {sub.ds}")
            steps += sub_steps
    if union.hdim != "P":
        return steps, union
    after = next_round(steps)
    split = {d for s in union.subgroups for d in s.ds.split_dims}
    dims = sorted(range(len(ctx.shape)), key=lambda d: (d != goal.hdim, d in split, -ctx.shape[d], d))
    sizes = tuple(len(s.dg) for s in union.subgroups)
    for d in dims:
        ratios = goal.ratios if d == goal.hdim and goal.hsize == union.hsize else sizes
        target = Annotation(union.subgroups, d, ratios)
        step = split_step("SplitReduceScatter", union, target, ctx.shape)
        if step is not None:
            return steps + [replace(step, round=after)], target
    target = Annotation(union.subgroups, "D")
    ctx.fall_back(f"reducing {union} in place: no SplitReduceScatter splits any dim, so a SplitAllReduce "
                  f"(every member receives the whole sum) serves")
    return steps + [replace(split_step("SplitAllReduce", union, target, ctx.shape), round=after)], target


def transfer_step(src: Annotation, dst: Annotation, ctx: Resolution, restrict: int | None = None) -> Step:
    """BatchedSendRecv of values from `src` to `dst` (whole union, or subgroup `restrict` only);
    LocalSplit when every device finds what it needs in its own piece. The messages are planned
    once per hop and reshard (routes share hops: the direct route is often the hierarchical BSR)."""
    whole = restrict is None or (src.hsize == 1 and dst.hsize == 1)  # one subgroup: the whole union
    key = (src, dst, None if whole else restrict)
    if key not in ctx.planned:
        local = whole and not src.has_partial and not dst.has_partial and not lacks(src, dst, ctx.shape).total
        if local:  # every device holds what it needs: copies, without the BSR table
            ctx.planned[key] = local_copies(src, dst, ctx.shape, ctx.leaves_out)
        else:
            ctx.planned[key] = _transfers(src, dst, ctx, None if whole else restrict), ()
    transfers, repeats = ctx.planned[key]
    assembled_on = tuple(sorted(dst.devices if whole else dst.subgroups[restrict].dg.devices))
    remote = any(t.src != t.dst for t in transfers)
    return Step("BatchedSendRecv" if remote else "LocalSplit", src, dst, (), transfers, assembled_on, restrict,
                repeats=repeats)


def _transfers(src: Annotation, dst: Annotation, ctx: Resolution, restrict: int | None) -> tuple[Transfer, ...]:
    if restrict is None:
        devices, sp = None, device_pieces(src, ctx.shape)
    else:  # one subgroup's pieces, not the union's (its intermediate layouts are many)
        devices, sp = dst.subgroups[restrict].dg.devices, device_pieces_of(src, ctx.shape, src.subgroups[restrict].dg)
    owners = {d: p.box for d, p in sp.items()}
    needs = destination_needs(dst, ctx.shape, owners, devices)
    return plan_transfers([TensorSlices(0, len(ctx.shape), owners, needs)], ctx.topology, ctx.itemsize)


__all__ = ["route", "transfer_step"]
