"""Specialization's fast path (interned annotations, uniform unions deduced once per layout, layers
sharing annotation objects, shared plans read once per rank, a subgroup's steps moved onto the
equal subgroups of a union) gives every rank the program the full path gives it: the full path
deduces every subgroup of every union on its own, interns nothing, makes every Llama annotation
afresh per layer, and plans every subgroup's steps on their own."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.annotations import Annotation, Subgroup
from hspmd.comm_resolve import relabel, resolve
from hspmd.errors import HSPMDError
from hspmd.ir import Binding
from hspmd.models.llama import LlamaConfig, build_llama, llama_annotations
from hspmd.models.llama_annotations import activation_annotation, param_annotation
from hspmd.ops import rules
from hspmd.specialize import comm_plans
from hspmd.specialize.deduce import Deduced, deduce, deduce_node
from hspmd.specialize import executable
from hspmd.specialize.executable import instantiate, instantiate_many, live_nodes
from hspmd.specialize.specialized import per_micro_batch_pattern
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_build import balanced_layers
from hspmd.testing import annotations, plan_every_subgroup, shapes


def _full_path_deduce(graph, strategy, monkeypatch) -> Deduced:
    """Deduction without the fast path: every union deduced subgroup by subgroup, nothing interned."""
    with monkeypatch.context() as m:
        m.setattr(rules, "_deduce_uniform", lambda anns, rule: None)
        anns = [None] * len(graph.tensors)
        for node in graph.nodes:
            for t, a in zip(node.outputs, deduce_node(node, strategy, anns)):
                anns[t.id] = a
    return Deduced(graph, strategy, tuple(anns))


def _program(exe, binding):
    """A rank's program as plain values: per phase, (node, role, this rank's part of its plan)."""
    out = []
    for phase in ("forward", "backward", "update"):
        for ins in getattr(exe, phase):
            part = ""
            if ins.node.opdef.is_comm and ins.role != "identity":
                part = comm_plans.describe_for(exe.plan(ins.node, binding), exe.device)
            out.append((phase, ins.node.id, ins.role, part))
    return out


@st.composite
def llama_strategies(draw):
    """Small strategies: pipelines of 1-3 stages with TP 1-2 each (heterogeneous across pipelines),
    layers split by random weights, optionally ZeRO-1."""
    layers = draw(st.integers(2, 4))
    pipelines, rank = [], 0
    for _ in range(draw(st.integers(1, 3))):
        n_stages = draw(st.integers(1, min(3, layers)))
        tps = [draw(st.sampled_from([1, 2])) for _ in range(n_stages)]
        weights = [draw(st.integers(1, 3)) for _ in range(n_stages)]
        try:
            ranges = balanced_layers(layers, weights)
        except Exception:
            ranges = balanced_layers(layers, [1] * n_stages)
        stages = []
        for tp, r in zip(tps, ranges):
            stages.append(Stage(tuple(range(rank, rank + tp)), r))
            rank += tp
        pipelines.append(Pipeline(tuple(stages), draw(st.integers(1, 3)), 1))
    return Strategy(tuple(pipelines), layers, draw(st.booleans()))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(strategy=llama_strategies(), sequence_parallel=st.booleans(), kv_heads=st.sampled_from([1, 2]), data=st.data())
def test_every_rank_gets_the_same_program_under_the_fast_and_the_full_path(strategy, sequence_parallel, kv_heads,
                                                                           data, monkeypatch):
    config = LlamaConfig(layers=strategy.num_layers, hidden=16, heads=2, kv_heads=kv_heads, ffn=32, vocab=32)
    model = build_llama(config, [strategy], sequence_parallel=sequence_parallel)
    fast = deduce(model.graph, 0)
    full = _full_path_deduce(model.graph, 0, monkeypatch)
    for t in model.graph.tensors:
        assert fast[t] == full[t], t.name
    ratios = strategy.micro_batch_ratios
    binding = Binding.of({"B": sum(ratios), "S": 8, "T": 8 * strategy.global_batch_size}, ratios=ratios)
    live = live_nodes(model.graph)
    shared: dict = {}
    ranks = data.draw(st.lists(st.sampled_from(strategy.all_ranks), min_size=1, max_size=3, unique=True))
    for r in ranks:
        quick = instantiate(fast, r, binding, live=live, plans=shared)
        with monkeypatch.context() as m:
            plan_every_subgroup(m)
            slow = instantiate(full, r, binding, live=live, plans={})
            slow_program = _program(slow, binding)
        assert _program(quick, binding) == slow_program
    with monkeypatch.context() as m:
        m.setattr(relabel, "keeps_links", lambda topology: False)  # every stage's plans resolved, none renamed
        full_groups, full_edges = per_micro_batch_pattern(full, binding, live, None, {})
    groups, edges = per_micro_batch_pattern(fast, binding, live, None, shared)
    assert (set(groups), set(edges)) == (set(full_groups), set(full_edges))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(strategy=llama_strategies(), few=st.sampled_from([0, 1]))
def test_instantiating_every_rank_in_one_pass_gives_each_the_program_of_its_own(strategy, few, monkeypatch):
    """A job's compiler instantiates every rank in one pass over the graph (each node's devices
    walked, or each device asked, on either side of FEW_DEVICES); each rank gets what instantiating
    it alone gives: the same instructions, roles and parts of plans."""
    config = LlamaConfig(layers=strategy.num_layers, hidden=16, heads=2, ffn=32, vocab=32)
    model = build_llama(config, [strategy])
    deduced = deduce(model.graph, 0)
    ratios = strategy.micro_batch_ratios
    binding = Binding.of({"B": sum(ratios), "S": 8, "T": 8 * strategy.global_batch_size}, ratios=ratios)
    with monkeypatch.context() as m:
        m.setattr(executable, "FEW_DEVICES", few)
        every = instantiate_many(deduced, strategy.all_ranks, binding)
    assert sorted(every) == sorted(strategy.all_ranks)
    for r in strategy.all_ranks:
        alone = instantiate(deduced, r, binding)  # one device: each node asked whether it runs there
        assert every[r].device == r
        assert _program(every[r], binding) == _program(alone, binding)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(1, 2).flatmap(lambda n: st.tuples(annotations(n, 10), annotations(n, 10), shapes(n))),
       data=st.data())
def test_a_reshard_renamed_in_order_has_the_renamed_pattern(case, data):
    """What discovery relies on to read another stage's CommOp from one read before: the resolver
    sees devices only through their order (on one node), so renaming them in order renames the plan."""
    src, dst, shape = case
    devices = sorted(src.device_set | dst.device_set)
    new = sorted(data.draw(st.lists(st.integers(0, 40), min_size=len(devices), max_size=len(devices), unique=True)))
    name = dict(zip(devices, new))
    moved = [Annotation(tuple(Subgroup(tuple(name[d] for d in s.dg), s.ds) for s in a.subgroups), a.hdim, a.ratios)
             for a in (src, dst)]
    assert relabel.canonical(*moved)[0] == relabel.canonical(src, dst)[0]
    try:
        plan = resolve(src, dst, shape)
    except HSPMDError as exc:
        with pytest.raises(type(exc)):
            resolve(*moved, shape)
        return
    assert comm_plans.pattern(resolve(*moved, shape)) == comm_plans.renamed(comm_plans.pattern(plan), tuple(devices), tuple(new))


@pytest.mark.parametrize("dp,tp,pp", [(3, 2, 2), (2, 1, 3)])
def test_llama_layers_on_the_same_stages_share_annotations_equal_to_fresh_ones(dp, tp, pp):
    from hspmd.specialize.strategy_build import uniform_strategy

    strategy = uniform_strategy(6, dp=dp, tp=tp, pp=pp, micro_batches=2)
    config = LlamaConfig(layers=6, hidden=16, heads=2, ffn=32, vocab=32)
    anns = llama_annotations(config, strategy)
    for l in range(6):
        assert anns[f"layers.{l}.wq"] == param_annotation(strategy, l, "column")
        assert anns[f"layers.{l}.wo"] == param_annotation(strategy, l, "row")
        assert anns[f"layers.{l}.attn_norm"] == param_annotation(strategy, l, "replicated")
        assert anns[f"layers.{l}.attn.in"] == activation_annotation(strategy, l)
    same_stage = [l for l in range(6) if strategy.stage_of(l, 0) == strategy.stage_of(0, 0)]
    assert len(same_stage) > 1
    assert all(anns[f"layers.{l}.wq"] is anns["layers.0.wq"] for l in same_stage)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_renamed_onto_renames_position_by_position(data):
    """Groups and messages of a template subgroup renamed onto other subgroups' devices (picked in
    C where the tuples have one length) equal renaming each device through a mapping."""
    template = tuple(data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True)))
    tuples = data.draw(st.lists(st.lists(st.sampled_from(template), min_size=1, max_size=4).map(tuple), max_size=5))
    named = data.draw(st.lists(st.permutations(range(100, 100 + len(template))).map(tuple), min_size=1, max_size=4))
    expected = [tuple(dict(zip(template, devices))[d] for d in t) for devices in named for t in tuples]
    assert comm_plans._renamed_onto(tuples, template, named) == expected
