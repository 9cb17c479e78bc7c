"""The resolver says when its decision order falls back from one tier to a later one (Plan.fallbacks,
a FallbackWarning, `hspmd explain`), and checks the invariant that ends its recursion."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from hspmd import resolve, shard, unshard
from hspmd.backends.plan_executor import run_plan
from hspmd.comm_resolve import hierarchical, resolver
from hspmd.comm_resolve.explain import main as explain
from hspmd.comm_resolve.plan import Plan
from hspmd.comm_resolve.reshard import Reshard, Resolution
from hspmd.comm_resolve.resolver import FallbackWarning
from hspmd.comm_resolve.topology import cluster_for
from hspmd.errors import CommunicationError

# The top tier's SplitAllGather makes no partial values in the destination's subgroups.
TOP_TIER = ("H0(1:1){S1:2@[0,1] | S1:2@[2,3]}", "HD{P:2@[0,1] | P:2@[2,3]}", (4, 4))
# Reducing the top-tier sums in place: no SplitReduceScatter splits a dim of 2 over 1 + 3 devices alike.
REDUCTION = ("HP{@[5] | D:3@[1,3,0]}", "HD{@[5] | P:3@[1,3,0]}", (2,))
# The same HDims and union with value layouts: the top tier serves, nothing falls back.
NO_FALLBACK = ("H0(1:1){S1:2@[0,1] | S1:2@[2,3]}", "HD{S1:2@[0,1] | S1:2@[2,3]}", (4, 4))


@pytest.mark.parametrize("case, says", [(TOP_TIER, "top tier: SplitAllGather cannot make the partial values"),
                                        (REDUCTION, "no SplitReduceScatter splits any dim, so a SplitAllReduce")])
def test_a_fallback_is_named_in_the_plan_and_warned_about(case, says):
    src, dst, shape = case
    with pytest.warns(FallbackWarning, match=says):
        plan = resolve(src, dst, shape, dtype="float64")
    assert any(says in why for why in plan.fallbacks)
    x = torch.randn(shape, dtype=torch.float64)
    assert torch.allclose(unshard(run_plan(plan, shard(x, src, seed=1)), dst), x)  # the later tier is correct


def test_a_plan_without_fallback_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        plan = resolve(*NO_FALLBACK)
    assert plan.fallbacks == () and plan.primitives == ("SplitAllGather",)


def test_fallbacks_belong_to_the_ladders_plan_only():
    """The direct route never asks the ladder: its plan names no fallback, the forced
    hierarchical plan does; the fallbacks do not change a plan's value."""
    src, dst, shape = TOP_TIER
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        direct = resolve(src, dst, shape, via="direct")
        hierarchical = resolve(src, dst, shape, via="hierarchical")
    assert direct.fallbacks == () and hierarchical.fallbacks
    read = Plan.from_json(hierarchical.to_json())
    assert read.fallbacks == hierarchical.fallbacks and read == hierarchical
    assert "fallbacks" not in json.loads(resolve(*NO_FALLBACK).to_json())


def test_explain_says_when_and_why_a_fallback_happened(capsys):
    src, dst, shape = TOP_TIER
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # explain prints it instead of warning
        assert explain([src, dst, "--shape", ",".join(map(str, shape))]) == 0
        out = capsys.readouterr().out
        assert "fallback: top tier: SplitAllGather cannot make the partial values" in out
        assert explain([src, dst, "--shape", "4,4", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["fallbacks"][0].startswith("top tier: SplitAllGather")
        assert explain([src, dst, "--shape", "4,4", "--compare"]) == 0
        assert "hierarchical: fallback: top tier" in capsys.readouterr().out
        assert explain([*NO_FALLBACK[:2], "--shape", "4,4"]) == 0
        assert "fallback" not in capsys.readouterr().out


def test_the_recursion_checks_that_reducing_leaves_no_partial_values(monkeypatch):
    """_general reduces a partial source in place and resolves the rest again: a reduction that
    left partial values would recurse forever, so it is an internal error, named."""
    monkeypatch.setattr(hierarchical, "_reduce_union", lambda union, goal, ctx: ([], union))
    with pytest.raises(CommunicationError, match="internal: reducing the partial values of HP.* would not end"):
        resolve("HP{@[0] | @[1]}", "S0:3@[1,2,3]", (6, 2))


def test_the_reshard_is_a_value_and_the_working_state_is_the_calls_own():
    src, dst, shape = NO_FALLBACK
    topology = cluster_for(None, range(4))
    a = Reshard(resolver.parse(src), resolver.parse(dst), shape, topology, 4, True)
    b = Reshard(resolver.parse(src), resolver.parse(dst), shape, topology, 4, True)
    assert a == b and hash(a) == hash(b)
    first, second = Resolution(a), Resolution(b)
    first.planned["hop"] = ((), ())
    first.fall_back("why")
    first.fall_back("why")
    assert second.planned == {} and second.fallbacks == [] and first.fallbacks == ["why"]
