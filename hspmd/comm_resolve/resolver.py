"""Hierarchical communication resolution (paper section 4, figure 4): src annotation -> plan.

Decision order (the "hierarchical" route, whose steps hierarchical.py builds):

1. Same HSize, same HDim (and the same top-tier regions): every subgroup on its own (4.1) --
   Identity; SendRecv when only its device group changes; AllReduce / ReduceScatter / AllGather /
   LocalSplit when only its distributed states change (collectives.py); BatchedSendRecv otherwise.
   Subgroups whose device group changes move together in one final step.
2. Same HSize, other HDim, same DG union (4.2): a bottom-tier step per subgroup equalises the DS
   union (e.g. ReduceScatter in one subgroup, Identity in the other), then SplitAllReduce /
   SplitReduceScatter / SplitAllGather over the finest slices (split_collectives.py).
3. Anything else: BatchedSendRecv over the finest slice grid (bsr.py).

BSR never cuts or combines partial sums: its slice table carries values only. A subgroup whose
summands only change devices (same distributed states) moves each summand whole, position by
position; those messages join the step's other transfers, so they travel in a BatchedSendRecv step
when other subgroups of that step reshape (with either reduce_partial). When a Partial source has
no collective path, the default
is to reduce it where it lies first (ReduceScatter inside subgroups, SplitReduceScatter across
them) and move the reduced pieces; with `reduce_partial=False` the resolver follows the paper
to the letter and raises UnsupportedReshard instead. A Partial destination is reached by giving
each slice to one summand and zeros to the others (no reduction needed).

Steps of different subgroups in one round run side by side (the time estimate overlaps them);
the plan lists them subgroup by subgroup so that each step's src is the previous step's dst.

Several correct plans exist for most reshards; by default the resolver returns the one of least
estimated time (cost.py, the same alpha-beta pricing for all) among these routes (VIAS), ties going
to the plan with fewer messages and collective calls, then to the earlier route:

* "hierarchical": the decision order above;
* "merged-allgather": a source whose pieces tile the tensor once, gathered whole onto the same
  devices, in one AllGather over the union instead of AllGathers per subgroup followed by a
  SplitAllGather;
* HetAuto's resharding routes (HetAuto §5.2, App. E), for value layouts:
  "direct": one BatchedSendRecv over all devices (S1: every overlapping pair exchanges);
  "root": each subgroup gathers onto its first device, the roots exchange, each destination
  subgroup's first device scatters (S2; one message per subgroup pair of one stage each);
  "representatives": each subgroup gathers along dim 0 (the batch, inner DP) onto its devices at
  batch index 0, those exchange with the destination's batch-index-0 devices, which scatter along
  dim 0 (S3: bottom-tier gather, top-tier send, bottom-tier split).

Between two SPMD value layouts it also prices two-hop routes through generated intermediate
layouts (multihop.py) and takes one where it beats them all. `via` forces one route. Lower bounds
(bounds.py) keep the choice cheap: routes that cannot win are not built. A reshard that keeps its
top tier (decision 1 with HSize above 1) is not priced against the other routes: it resolves
subgroup by subgroup (`subgroup_by_subgroup`), so route choice never joins subgroups that a
strategy keeps apart, such as pipelines.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Iterable, Sequence

from hspmd.annotations import Annotation, Box, device_pieces, parse
from hspmd.annotations.geometry import check_ratios, kept_regions
from hspmd.comm_resolve.bounds import lacks, reshard_bound, route_bound
from hspmd.comm_resolve.cost import DTYPE_SIZES, dtype_name
from hspmd.comm_resolve.gathered import gathered_within, representatives, root
from hspmd.comm_resolve.hierarchical import route, transfer_step
from hspmd.comm_resolve import multihop
from hspmd.comm_resolve.plan import Collective, Plan, Step
from hspmd.comm_resolve.reshard import Reshard, Resolution, in_sequence, next_round, regions, shifted
from hspmd.comm_resolve.slices import box_volume
from hspmd.comm_resolve.topology import ClusterSpec, cluster_for
from hspmd.errors import HSPMDTypeError, ShapeError, ShapeTypeError, UnsupportedReshard
from hspmd.gc_pause import collector_paused
from hspmd.limits import MAX_DIMS, brief, check_limit, device_id_set


def bind_ratios(ann: Annotation, ratios: Sequence[int] | None, role: str, argument: str = "") -> Annotation:
    """The annotation with its top-tier ratios bound (run-time ratios must be given). `ratios`
    that contradict the annotation's own are refused, not ignored; an annotation without a
    top-tier split takes any (callers pass a binding's ratios to every layout)."""
    if ratios is not None and ann.ratios is not None:
        given = check_ratios(ratios)
        if given != ann.ratios:
            raise ShapeError(f"{argument or 'ratios'}={given} contradicts the {role} {ann}, whose ratios are "
                             f"{':'.join(map(str, ann.ratios))}; pass ratios only for a layout that leaves them to run time")
        return ann
    if isinstance(ann.hdim, int) and ann.ratios is None:
        if ratios is None:
            how = f"pass {argument}=(...) or " if argument else ""
            raise ShapeError(
                f"the {role} {ann} splits dim {ann.hdim} across subgroups in ratios bound at run time; "
                f"{how}bind them with annotation.with_ratios(...)"
            )
        return ann.with_ratios(check_ratios(ratios))
    return ann


def concrete_shape(shape: Sequence[int], *anns: Annotation) -> tuple[int, ...]:
    """`shape` as a tuple of non-negative ints of the annotations' rank (resolving needs concrete sizes)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ShapeTypeError(f"shape must be a sequence of non-negative integers, got {brief(shape)}")
    shape = tuple(shape)
    check_limit(len(shape), MAX_DIMS, "the tensor rank")
    if any(isinstance(s, bool) or not isinstance(s, int) for s in shape):
        raise ShapeTypeError(f"resolve needs a concrete shape of non-negative integers, got {brief(shape)}")
    if any(s < 0 for s in shape):
        raise ShapeError(f"resolve needs a concrete shape of non-negative integers, got {brief(shape)}")
    for ann in anns:
        ann.check_rank(len(shape), f"tensor of shape {shape}")
    return shape


def resolve(
    src: Annotation | str,
    dst: Annotation | str,
    shape: Sequence[int],
    topology: ClusterSpec | str | None = None,
    *,
    dtype: object = "float32",
    src_ratios: Sequence[int] | None = None,
    dst_ratios: Sequence[int] | None = None,
    reduce_partial: bool = True,
    via: str | None = None,
    for_devices: Iterable[int] | None = None,
    multi_hop: bool = True,
) -> Plan:
    """The communication plan turning a tensor of `shape` laid out as `src` into `dst`.

    A pure function of its arguments. `topology` (a ClusterSpec or text such as "2x4", see topology.py) defaults to one
    node holding every device; `dtype` sets the element size for byte counts and time estimates;
    `src_ratios` / `dst_ratios` bind top-tier ratios left to run time (`H0{...}`). A Partial
    source with no collective path is reduced in place first; `reduce_partial=False` raises
    UnsupportedReshard instead (the paper's rule). Partial values combine by the layouts'
    reduction (Partial.reduce: sum, max, min, avg, prod), one per plan. `via` (one of VIAS) forces one route, None picks
    the cheapest (module docstring). Where a tier of the decision order cannot give its primitive
    and a later one serves, the plan's `fallbacks` say which and why, and a FallbackWarning is
    issued. Between two SPMD value layouts the cheapest plan may pass an intermediate layout
    (multihop.py): with `multi_hop` (the default) it is chosen when it beats every direct route.
    `for_devices` resolves the plan for those devices only: a
    subgroup holding none of them whose steps repeat an earlier subgroup's (relabel.py) is left
    out, named in Step.repeats instead (a rank specializing alone then plans its own subgroups,
    not every data-parallel replica's); their parts, the plan's cost and choice of route, and
    everyone's groups (comm_plans) are the whole plan's. Raises AnnotationError / ShapeError when
    the annotations do not fit the shape or the topology."""
    src = bind_ratios(parse(src), src_ratios, "source", "src_ratios")
    dst = bind_ratios(parse(dst), dst_ratios, "destination", "dst_ratios")
    shape = concrete_shape(shape, src, dst)
    topology = cluster_for(topology, src.device_set | dst.device_set, lambda: f"reshard {src} -> {dst}")
    name = dtype_name(dtype)
    if not isinstance(reduce_partial, bool):
        raise HSPMDTypeError(f"reduce_partial must be True or False, got {brief(reduce_partial)}")
    focus = None if for_devices is None else device_id_set(for_devices, "for_devices")
    if src.has_partial and dst.has_partial and src.reduction != dst.reduction:
        raise UnsupportedReshard(
            f"cannot reshard {src} -> {dst}: the source's partial values combine by {src.reduction} and the "
            f"destination's by {dst.reduction}; reshard to a layout without partial values first (one plan "
            f"follows one reduction)"
        )
    ctx = Resolution(Reshard(src, dst, shape, topology, DTYPE_SIZES[name], reduce_partial, focus))
    with collector_paused():  # a large plan is many long-lived objects and no cycles (hspmd.gc_pause)
        if via is not None:
            plan = _plan(ctx, name, _via(via, src, dst, ctx), ctx.fallbacks)
        else:
            plan = _cheapest(ctx, name)
            if multi_hop:
                plan = _through_intermediate(ctx, name, plan)
    if plan.fallbacks:
        warnings.warn(FallbackWarning(f"resolve {src} -> {dst} (shape {shape}): " + "; ".join(plan.fallbacks)),
                      stacklevel=2)
    return plan


class FallbackWarning(UserWarning):
    """A tier of the decision ladder could not give its primitive and a later tier planned the
    reshard instead (Plan.fallbacks says which and why; `hspmd explain` prints it)."""


VIAS = ("hierarchical", "merged-allgather", "direct", "root", "representatives")


def _via(via: str, src: Annotation, dst: Annotation, ctx: Resolution) -> list[Step]:
    """The steps of route `via`, or UnsupportedReshard saying why it does not apply."""
    if via not in VIAS:
        raise UnsupportedReshard(f"unknown route via={via!r}; use one of {', '.join(VIAS)} (or None: the cheapest)")
    if via == "hierarchical":
        return route(src, dst, ctx)
    steps = _alternative(via, ctx)
    if steps is not None:
        return steps
    if via == "merged-allgather":
        raise UnsupportedReshard(
            f"via='merged-allgather' needs a source whose pieces tile the tensor once (no replicas, no partial "
            f"sums) and a destination holding the whole tensor on the same devices; {src} -> {dst} is not"
        )
    if src.has_partial:
        raise ctx.refuse(f"via={via!r} moves values and the source holds partial sums")
    raise UnsupportedReshard(
        f"via={via!r} gathers values onto a few devices of each destination subgroup, and the destination {dst} "
        f"holds partial sums; use 'direct' or the hierarchical route"
    )


def _alternative(via: str, ctx: Resolution) -> list[Step] | None:
    """The steps of a route other than the hierarchical one, or None where it does not apply."""
    if via == "merged-allgather":
        step = _merged_all_gather(ctx.src, ctx.dst, ctx)
        return None if step is None else [step]
    hops = _hops(via, ctx)
    return None if hops is None else _hop_steps(hops, ctx)


def _hops(via: str, ctx: Resolution) -> tuple[Annotation, ...] | None:
    """The layouts HetAuto's route `via` passes through, src first and dst last, or None where it
    does not apply: the routes move values, so they need a source without partial sums, and root
    and representatives, which gather values onto a few devices, a destination without them."""
    src, dst = ctx.src, ctx.dst
    if src.has_partial:
        return None
    if via == "direct":
        return (src, dst)
    if dst.has_partial:
        return None
    pick = root if via == "root" else representatives
    hops = (src, gathered_within(src, pick), gathered_within(dst, pick), dst)
    return tuple(h for i, h in enumerate(hops) if i == 0 or h != hops[i - 1])


def _hop_steps(hops: tuple[Annotation, ...], ctx: Resolution) -> list[Step]:
    """One BatchedSendRecv per hop, in sequence (the hierarchical plan when there is no hop)."""
    if len(hops) == 1:
        return route(ctx.src, ctx.dst, ctx)
    return in_sequence([transfer_step(a, b, ctx) for a, b in zip(hops, hops[1:])])


# choosing by cost ---------------------------------------------------------------------------------

TIE = 1e-9
"""Relative margin below which two estimates count as equal: routes that are the same in exact
arithmetic (a ring AllGather and a BatchedSendRecv on equal links) differ in the last bits of a
float sum, and float noise must not decide between them."""


def cheaper(a: float, b: float) -> bool:
    """`a` beats `b` by more than float noise (TIE)."""
    return a < b * (1.0 - TIE)


def operations(plan: Plan) -> int:
    """The plan's messages and collective calls, those of the subgroups it leaves out (Step.repeats)
    counted as their templates': equal for a plan resolved for some devices and the whole plan."""
    total = 0
    for step in plan.steps:
        total += step.messages + len(step.collectives)
        for template, _ in step.repeats:
            mine = set(template)
            total += sum(1 for t in step.transfers if t.src != t.dst and t.src in mine)
            total += sum(1 for c in step.collectives if c.devices[0] in mine)
    return total


def better(plan: Plan, best: Plan) -> bool:
    """`plan` beats `best`: cheaper by more than float noise (TIE), or as cheap with fewer messages
    and collective calls (one AllGather rather than a BatchedSendRecv of dozens of messages at the
    same estimate)."""
    if cheaper(plan.estimated_seconds, best.estimated_seconds):
        return True
    return not cheaper(best.estimated_seconds, plan.estimated_seconds) and operations(plan) < operations(best)


def _cheapest(ctx: Resolution, dtype: str) -> Plan:
    """The plan of least estimated time among every route that applies (VIAS). Ties go to the plan
    with fewer messages and collective calls, then to the earlier route, so the hierarchical plan
    stays unless another is better (`better`), and every device, resolving the same arguments,
    picks the same plan.

    Kept cheap (resolve runs for every CommOp): a source holding partial sums has no other route
    (the hierarchical plan is not even priced then), nothing more is tried once the best plan meets the
    bound no plan undercuts (bounds.py) but the one AllGather (where the best takes more operations:
    HetAuto's routes are BatchedSendRecvs, building them to count messages costs more than it
    saves), a HetAuto route is built only when its own
    bound is below the best so far, and a route whose messages are the best plan's (the direct
    BSR when the hierarchical plan is that BSR) is not priced again."""
    best = _plan(ctx, dtype, route(ctx.src, ctx.dst, ctx), ctx.fallbacks)
    if ctx.src.has_partial or best.estimated_seconds == 0.0:  # every other route moves values
        return best
    if _subgroup_by_subgroup(ctx.src, ctx.dst, ctx.shape):  # the other routes may join what the union keeps apart
        return best
    floor = reshard_bound(ctx.src, ctx.dst, ctx.shape, ctx.itemsize, ctx.topology)
    tried = set()
    best_operations = operations(best)
    for via in VIAS[1:]:
        if not cheaper(floor, best.estimated_seconds) and (best_operations <= 1 or via != "merged-allgather"):
            break  # nothing is cheaper; only the one AllGather can tie with fewer operations
        if via == "merged-allgather":
            steps = _alternative(via, ctx)
        else:
            hops = _hops(via, ctx)
            if hops is None or hops in tried:  # representatives on one device each: the root route
                continue
            tried.add(hops)
            beaten = best.estimated_seconds * (1.0 - TIE)  # a bound this high cannot be `cheaper`
            if not cheaper(route_bound(hops, ctx.shape, ctx.itemsize, ctx.topology, beaten), best.estimated_seconds):
                continue
            steps = _hop_steps(hops, ctx)
        if steps is None or _same_messages(steps, best.steps):
            continue
        plan = _plan(ctx, dtype, steps)
        if better(plan, best):
            best, best_operations = plan, operations(plan)
    return best


def subgroup_by_subgroup(src: Annotation | str, dst: Annotation | str, shape: Sequence[int]) -> bool:
    """Whether `src` -> `dst` keeps its top tier (the same HSize above 1, the same HDim, the same
    subgroup regions), so that each subgroup reshards on its own (Hetu v2 §4.1). Such a reshard
    takes the hierarchical route only, however the other routes are priced: their messages may go
    from any subgroup to any other, and a strategy's subgroups are what it keeps apart (pipelines:
    a tied head sent from one pipeline's first stage into another's last stage would join them)."""
    src, dst = parse(src), parse(dst)
    return _subgroup_by_subgroup(src, dst, concrete_shape(shape, src, dst))


def _subgroup_by_subgroup(src: Annotation, dst: Annotation, shape: tuple[int, ...]) -> bool:
    return src.hsize == dst.hsize > 1 and src.hdim == dst.hdim and kept_regions(src, shape) == kept_regions(dst, shape)


def _through_intermediate(ctx: Resolution, dtype: str, best: Plan) -> Plan:
    """`best`, or the two-hop plan through the intermediate layout (multihop.py) that beats it
    (`better`), chosen once per reshard (_INTERMEDIATES) and resolved again for each call's devices."""
    if not multihop.applies(ctx.src, ctx.dst) or best.estimated_seconds == 0.0:
        return best
    key = replace(ctx.reshard, focus=None)
    if key not in _INTERMEDIATES:
        if len(_INTERMEDIATES) >= 1024:
            _INTERMEDIATES.clear()
        _INTERMEDIATES[key] = _best_intermediate(ctx, dtype, best)
    mid = _INTERMEDIATES[key]
    return best if mid is None else _two_hops(ctx, dtype, mid)[0]


_INTERMEDIATES: dict[Reshard, Annotation | None] = {}  # reshard (all devices) -> the intermediate its plan passes


def _best_intermediate(ctx: Resolution, dtype: str, best: Plan) -> Annotation | None:
    """The intermediate whose two-hop plan beats `best` and every other candidate's, or None. A
    candidate is priced only where the bounds of its hops (bounds.reshard_bound: no plan of a hop
    undercuts it) allow it to tie the best so far, its second hop only where the first allows it."""
    src, dst, shape, itemsize, topology = ctx.src, ctx.dst, ctx.shape, ctx.itemsize, ctx.topology
    floor = reshard_bound(src, dst, shape, itemsize, topology)
    if not cheaper(floor, best.estimated_seconds) and operations(best) <= 1:
        return None
    chosen = None
    for mid in multihop.intermediates(src, dst):
        after = reshard_bound(mid, dst, shape, itemsize, topology)
        if cheaper(best.estimated_seconds, reshard_bound(src, mid, shape, itemsize, topology) + after):
            continue
        plan, _ = _two_hops(ctx, dtype, mid, after, best.estimated_seconds)
        if plan is not None and better(plan, best):
            chosen, best = mid, plan
    return chosen


def _two_hops(ctx: Resolution, dtype: str, mid: Annotation, after: float = 0.0,
              enough: float = float("inf")) -> tuple[Plan | None, Plan]:
    """(the plan src -> mid -> dst, each hop the cheapest direct plan, or None where the first hop
    with `after` (a bound of the second) already exceeds `enough`; the first hop's plan)."""
    first = _hop(ctx, dtype, ctx.src, mid)
    if cheaper(enough, first.estimated_seconds + after):
        return None, first
    second = _hop(ctx, dtype, mid, ctx.dst)
    steps = list(first.steps) + shifted(list(second.steps), next_round(list(first.steps)))
    return _plan(ctx, dtype, steps, first.fallbacks + second.fallbacks), first


def _hop(ctx: Resolution, dtype: str, a: Annotation, b: Annotation) -> Plan:
    """The cheapest direct plan from `a` to `b` under the call's options (no further hops)."""
    return _cheapest(Resolution(replace(ctx.reshard, src=a, dst=b)), dtype)


def _plan(ctx: Resolution, dtype: str, steps: list[Step], fallbacks: Sequence[str] = ()) -> Plan:
    """The plan of `steps`; `fallbacks`: those the ladder took to make them (the hierarchical route's)."""
    return Plan(ctx.src, ctx.dst, ctx.shape, tuple(steps), ctx.topology, dtype, tuple(fallbacks))


def _same_messages(steps: list[Step], others: tuple[Step, ...]) -> bool:
    """Both are the one BatchedSendRecv planned once (the same transfers object): the same cost."""
    return (len(steps) == len(others) == 1 and not steps[0].collectives and not others[0].collectives
            and steps[0].transfers is others[0].transfers)


def _merged_all_gather(src: Annotation, dst: Annotation, ctx: Resolution) -> Step | None:
    """One AllGather over the whole union, when every source device holds a disjoint piece, the
    pieces tile the tensor and every destination device (the same devices) wants all of it."""
    if src.has_partial or src.device_set != dst.device_set:
        return None
    whole = tuple((0, n) for n in ctx.shape)
    volume = box_volume(whole)
    if not volume or not _whole_everywhere(dst, whole, ctx) or lacks(src, dst, ctx.shape).held != volume:
        return None
    pieces = device_pieces(src, ctx.shape)
    devices = tuple(src.devices)
    gather = Collective("all_gather", devices, whole, tuple(pieces[d].box for d in devices))
    return Step("AllGather", src, dst, (gather,), (), devices)


def _whole_everywhere(ann: Annotation, whole: Box, ctx: Resolution) -> bool:
    """Whether every device of `ann` holds the `whole` tensor as a value, read from its subgroups:
    a region short of the tensor, or states splitting a dim of some length, leave a device less."""
    return (not ann.has_partial and all(r == whole for r in regions(ann, ctx))
            and not any(ds.split_dims for ds in ann.distinct_states))


__all__ = ["VIAS", "bind_ratios", "concrete_shape", "resolve", "subgroup_by_subgroup"]
