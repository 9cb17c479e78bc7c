"""Partial values under any reduction (sum, max, min, avg, prod): the `P(op):n` syntax, shard and
unshard (real and complex tensors), resolved plans run in-process and over gloo, the backends'
reducing collectives, and the refusals (BatchedSendRecv carries no partial values of any
reduction; one plan follows one reduction)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd import resolve, shard, unshard
from hspmd.annotations import REDUCTIONS, DistributedStates, Partial, Subgroup, parse
from hspmd.annotations.algebra import expand_hsize
from hspmd.annotations.reference import combine
from hspmd.backends.local import run_on_devices
from hspmd.backends.plan_executor import execute_plan, run_plan
from hspmd.comm_resolve.plan_part import PlanPart, part_of
from hspmd.comm_resolve.verify import check_plan
from hspmd.errors import AnnotationError, CommunicationError, HSPMDError, ParseError, ShapeError, UnsupportedReshard
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.testing import annotations

IDEMPOTENT_OR_NOT = ("max", "min", "avg", "prod")
COMPLEX_OK = ("sum", "avg", "prod")  # max and min have no order on complex numbers


def _dtypes(reduce: str) -> list[torch.dtype]:
    return [torch.float64, torch.complex128] if reduce in COMPLEX_OK else [torch.float64]


# syntax -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_the_reduction_is_written_and_read_back(reduce):
    text = f"S0:2,P({reduce}):2@[0-3]"
    ann = parse(text)
    assert ann.reduction == reduce and ann.subgroups[0].ds.axes[1] == Partial(2, reduce)
    assert parse(str(ann)) == ann
    assert ("(" in str(ann)) == (reduce != "sum")  # a sum prints as the plain P:n


def test_plain_p_is_a_sum():
    assert parse("P:4@[0-3]") == parse("P(sum):4@[0-3]")
    assert parse("P:4@[0-3]").reduction == "sum" and parse("S0:2@[0,1]").reduction == "sum"


@pytest.mark.parametrize("text, says", [
    ("P(max):2,P:2@[0-3]", "share one reduction"),
    ("H0(1:1){P(min):2@[0,1] | P(max):2@[2,3]}", "min and max|max and min"),
    ("HP{P(max):2@[0,1] | @[2]}", "HP\\) sums"),
    ("P(mean):2@[0,1]", "expected a reduction"),
    ("P(max:2@[0,1]", "to close the reduction"),
])
def test_mixed_or_unknown_reductions_are_refused_naming_them(text, says):
    with pytest.raises(ParseError, match=says):
        parse(text)


def test_partial_axis_refuses_an_unknown_reduction_and_lifting_a_max_to_the_top_tier():
    with pytest.raises(AnnotationError, match="one of sum, max"):
        Partial(2, "median")
    with pytest.raises(AnnotationError, match="cannot become a top-tier P"):
        expand_hsize(parse("P(max):4@[0-3]"), 2)
    lifted = expand_hsize(parse("P:4@[0-3]"), 2)
    assert lifted.hdim == "P" and str(lifted) == "HP{P:2@[0,1] | P:2@[2,3]}"


# reference shard / unshard ------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_shard_makes_partial_values_whose_reduction_is_the_tensor(reduce):
    for dtype in _dtypes(reduce):
        x = torch.randn(6, 6, dtype=dtype)
        ann = f"S1:2,P({reduce}):3@[0-5]"
        pieces = shard(x, ann, seed=7)
        for first in (0, 3):  # the three partial values of each half
            values, half = [pieces[first + j] for j in range(3)], x[:, first : first + 3]
            assert all(not torch.allclose(v, half) for v in values)
            assert torch.allclose(combine(values, reduce), half)
        assert torch.allclose(unshard(pieces, ann), x)


def test_complex_partials_need_a_reduction_with_an_order_for_max_and_min():
    z = torch.randn(4, dtype=torch.complex64)
    assert torch.allclose(unshard(shard(z, "P:2@[0,1]"), "P:2@[0,1]"), z)
    with pytest.raises(ShapeError, match="max partials, which need a real floating-point"):
        shard(z, "P(max):2@[0,1]")
    with pytest.raises(ShapeError, match="floating-point or complex"):
        shard(torch.arange(4), "P(prod):2@[0,1]")


# resolved plans, in-process -----------------------------------------------------------------------

CASES = [  # (src, dst, shape): %s is the reduction
    ("P(%s):4@[0-3]", "@[0]", (5, 3)),                        # reduce, then move
    ("P(%s):4@[0-3]", "D:4@[0-3]", (5, 3)),                   # AllReduce
    ("P(%s):4@[0-3]", "S0:4@[0-3]", (7, 3)),                  # ReduceScatter, uneven
    ("P(%s):2,S1:2@[0-3]", "S0:2,D:2@[0-3]", (6, 5)),         # ReduceScatter then BSR
    ("S0:4@[0-3]", "P(%s):2,D:2@[0-3]", (6, 5)),              # a partial destination from a split
    ("D:4@[0-3]", "P(%s):4@[0-3]", (3, 4)),                   # LocalSplit into partial values
    ("S0:2@[0,1]", "P(%s):2@[2,3]", (5, 3)),                  # BSR into partial values elsewhere
    ("P(%s):2@[0,1]", "P(%s):2@[2,3]", (5, 3)),               # partial values moved whole
    ("H0(1:1){P(%s):2@[0,1] | S1:2@[2,3]}", "S0:4@[0-3]", (8, 6)),
    ("P(%s):2,D:2@[0-3]", "S1:2,P(%s):2@[4-7]", (4, 6)),
]


@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize("src, dst, shape", CASES)
def test_plans_combine_by_the_layouts_reduction(reduce, src, dst, shape):
    src, dst = src.replace("%s", reduce), dst.replace("%s", reduce)
    for dtype in _dtypes(reduce):
        x = torch.randn(shape, dtype=dtype)
        plan = resolve(src, dst, shape, dtype=str(dtype).removeprefix("torch."))
        check_plan(plan)
        assert plan.reduction == (reduce if "P(" in src + dst else "sum")
        got = run_plan(plan, shard(x, src, seed=2))
        assert torch.allclose(unshard(got, dst), x, atol=1e-9), (src, dst, dtype)


@pytest.mark.parametrize("reduce", ["max", "min", "avg"])
def test_an_idempotent_partial_destination_holds_the_value_on_every_member(reduce):
    x = torch.randn(4, 6, dtype=torch.float64)
    plan = resolve("D:2@[0,1]", f"P({reduce}):2@[0,1]", (4, 6), dtype="float64")
    got = run_plan(plan, shard(x, "D:2@[0,1]"))
    assert torch.equal(got[0], x) and torch.equal(got[1], x)


def test_a_product_destination_fills_the_other_members_with_ones():
    x = torch.randn(4, 6, dtype=torch.float64)
    got = run_plan(resolve("D:2@[0,1]", "P(prod):2@[0,1]", (4, 6), dtype="float64"), shard(x, "D:2@[0,1]"))
    assert sorted([torch.equal(got[d], x) for d in (0, 1)]) == [False, True]
    assert any(torch.equal(got[d], torch.ones_like(x)) for d in (0, 1))


@st.composite
def reshards(draw):
    reduce = draw(st.sampled_from(IDEMPOTENT_OR_NOT))
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    src = draw(annotations(ndim, max_devices=8, reduce=reduce))
    dst = draw(annotations(ndim, max_devices=8, reduce=reduce))
    return reduce, src, dst, shape


def test_random_reshards_under_each_reduction_match_the_reference():
    """Random reshards whose layouts are partial under one reduction reproduce the tensor; each
    reduction must be drawn into partial layouts at least 10 times (counted in this test itself, so
    that the count holds whichever worker runs it)."""
    accepted = {r: 0 for r in IDEMPOTENT_OR_NOT}

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(reshards(), st.integers(0, 2**16))
    def case(drawn, seed):
        reduce, src, dst, shape = drawn
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        plan = resolve(src, dst, shape, dtype="float64")
        got = run_plan(plan, shard(x, src, seed=seed))
        assert torch.allclose(unshard(got, dst), x, atol=1e-9)
        if src.reduction == reduce or dst.reduction == reduce:
            accepted[reduce] += 1

    case()
    assert all(n >= 10 for n in accepted.values()), accepted


# refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_batched_send_recv_refuses_partial_values_of_any_reduction(reduce):
    src = f"P({reduce}):2@[0,1]"
    with pytest.raises(UnsupportedReshard, match="BatchedSendRecv cannot carry"):
        resolve(src, "S0:3@[1,2,3]", (6, 2), reduce_partial=False)
    with pytest.raises(UnsupportedReshard, match="partial sums"):
        resolve(src, "S0:3@[1,2,3]", (6, 2), via="direct")


def test_a_plan_between_two_reductions_is_refused():
    with pytest.raises(UnsupportedReshard, match="combine by max .* by sum"):
        resolve("P(max):2@[0,1]", "P:2@[0,1]", (4,))


def test_an_avg_partial_has_no_identity_to_fill_a_split_into():
    """S -> P(avg) as a local split would need an identity: the resolver moves values instead."""
    plan = resolve("S0:2@[0,1]", "P(avg):2@[0,1]", (4,), dtype="float64")
    assert "LocalSplit" not in plan.primitives
    x = torch.randn(4, dtype=torch.float64)
    assert torch.allclose(unshard(run_plan(plan, shard(x, "S0:2@[0,1]")), "P(avg):2@[0,1]"), x)


def test_plan_parts_carry_their_reduction_through_json():
    plan = resolve("P(min):2@[0,1]", "D:2@[0,1]", (3,), dtype="float64")
    part = part_of(plan, 0)
    assert part.reduction == "min" and PlanPart.from_dict(part.to_dict()) == part
    broken = dict(part.to_dict(), reduction="median")
    with pytest.raises(ValueError, match="reduction is 'median'"):
        PlanPart.from_dict(broken)


def test_executing_a_plan_of_one_reduction_under_another_is_refused():
    plan = resolve("P(min):2@[0,1]", "D:2@[0,1]", (3,), dtype="float64")
    pieces = shard(torch.randn(3, dtype=torch.float64), "P(min):2@[0,1]")
    with pytest.raises(HSPMDError, match="combines partial values by min"):
        run_on_devices(lambda b: execute_plan(plan, b, pieces[b.rank], reduce="max"), (0, 1))


# backends -----------------------------------------------------------------------------------------


def _collectives_on(backend, tensors, parts):
    me = backend.rank
    out = {}
    for op in REDUCTIONS:
        target = torch.empty_like(tensors[me])
        backend.all_reduce_into(tensors[me], (0, 1, 2), target, op)
        scattered = torch.empty_like(parts[me][me])
        backend.reduce_scatter_into(parts[me], (0, 1, 2), scattered, op)
        out[op] = (target, scattered)
    return out


def _backend_inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(4, 3, generator=gen, dtype=dtype) for _ in range(3)]
    parts = [[torch.randn(2 + i, 3, generator=gen, dtype=dtype) for i in range(3)] for _ in range(3)]
    return tensors, parts


def _check_collectives(results, tensors, parts, ops=REDUCTIONS):
    for rank, by_op in results.items():
        for op in ops:
            reduced, scattered = by_op[op]
            assert torch.allclose(reduced, combine(tensors, op)), op
            assert torch.allclose(scattered, combine([p[rank] for p in parts], op)), op


def test_the_in_process_backend_reduces_by_every_reduction():
    tensors, parts = _backend_inputs(torch.float64)
    _check_collectives(run_on_devices(lambda b: _collectives_on(b, tensors, parts), (0, 1, 2)), tensors, parts)


def test_a_backend_refuses_an_unknown_reduction():
    def body(backend):
        backend.all_reduce_into(torch.ones(2), (backend.rank,), torch.empty(2), "median")
    with pytest.raises(CommunicationError, match="op must be one of sum, max, min, avg, prod"):
        run_on_devices(body, (0,))


def gloo_rank(backend, plans, seeds):
    """Every reducing collective (real and complex) and every plan, on this rank."""
    real, complex_ = _backend_inputs(torch.float64), _backend_inputs(torch.complex128)
    me = backend.rank
    backend.prepare_groups(sorted({g for plan in plans for g in plan.collective_groups() if me in g} | {(0, 1, 2)}))
    out = {"real": _collectives_on(backend, *real) if me < 3 else None}
    complex_out = {}
    for op in COMPLEX_OK if me < 3 else ():
        target = torch.empty_like(complex_[0][me])
        backend.all_reduce_into(complex_[0][me], (0, 1, 2), target, op)
        scattered = torch.empty_like(complex_[1][me][me])
        backend.reduce_scatter_into(complex_[1][me], (0, 1, 2), scattered, op)
        complex_out[op] = (target, scattered)
    out["complex"] = complex_out
    out["plans"] = [execute_plan(plan, backend, shard(_plan_input(plan, seed), plan.src, seed=seed).get(me))
                    for plan, seed in zip(plans, seeds)]
    return out


def _plan_input(plan, seed: int) -> torch.Tensor:
    dtype = getattr(torch, plan.dtype)
    return torch.randn(plan.shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.multiprocess
@pytest.mark.xdist_group("reductions_gloo")
def test_gloo_reduces_by_every_reduction_and_runs_their_plans():
    plans, seeds = [], []
    for reduce in REDUCTIONS:
        for src, dst, shape in CASES:
            if max(parse(src.replace("%s", reduce)).devices + parse(dst.replace("%s", reduce)).devices) > 3:
                continue
            for dtype in _dtypes(reduce):
                plans.append(resolve(src.replace("%s", reduce), dst.replace("%s", reduce), shape,
                                     dtype=str(dtype).removeprefix("torch.")))
                seeds.append(len(seeds))
    plans += [resolve(f"P({r}):3@[0-2]", "S0:3@[0-2]", (n, 2), dtype="float64") for r in REDUCTIONS for n in (6, 7)]
    seeds += list(range(len(seeds), len(plans)))
    per_rank = run_multiprocess(gloo_rank, 4, plans, seeds, timeout=120, comm_timeout=30)
    tensors, parts = _backend_inputs(torch.float64)
    _check_collectives(dict(enumerate(r["real"] for r in per_rank[:3])), tensors, parts)
    tensors, parts = _backend_inputs(torch.complex128)
    _check_collectives(dict(enumerate(r["complex"] for r in per_rank[:3])), tensors, parts, COMPLEX_OK)
    assert len(plans) >= 60
    for i, (plan, seed) in enumerate(zip(plans, seeds)):
        pieces = {rank: r["plans"][i] for rank, r in enumerate(per_rank) if r["plans"][i] is not None}
        assert torch.allclose(unshard(pieces, plan.dst), _plan_input(plan, seed), atol=1e-9), (plan.src, plan.dst)


def test_subgroup_states_share_one_reduction():
    with pytest.raises(AnnotationError, match="share one reduction"):
        DistributedStates((Partial(2, "max"), Partial(2, "prod")))
    assert Subgroup((0, 1), DistributedStates((Partial(2, "avg"),))).ds.reduction == "avg"
