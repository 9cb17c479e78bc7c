"""Properties over random strategies (hypothesis): text/dict/file-format round trips, annotations
that follow the stages, and pipeline discovery recovering exactly the declared pipelines."""

import json

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.annotations import device_pieces
from hspmd.specialize.schedules import SCHEDULE_POLICIES, VECTOR_POLICIES
from hspmd.specialize.pipelines import comm_pattern, discover_pipelines, expected_pipelines
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from hspmd.models.llama_annotations import activation_annotation, gradient_annotation, param_annotation

SOME = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def strategies(draw):
    """1-4 pipelines of 1-5 stages (TP 1-4) over a shuffled, gappy rank set; uneven layer cuts;
    random recompute flags, schedules and warm-up vectors."""
    num_layers = draw(st.integers(1, 12))
    plans = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, min(5, num_layers)))
        tps = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
        cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=n - 1, max_size=n - 1, unique=True))) if n > 1 else []
        plans.append((tps, [0] + cuts + [num_layers]))
    total = sum(sum(tps) for tps, _ in plans)
    ranks = iter(draw(st.permutations(range(total + draw(st.integers(0, 4)))))[:total])
    counts = st.one_of(st.none(), st.integers(1, 40))
    pipelines = []
    for tps, bounds in plans:
        stages = tuple(Stage(tuple(next(ranks) for _ in range(tp)), range(a, b), recompute=draw(st.booleans()))
                       for tp, a, b in zip(tps, bounds, bounds[1:]))
        schedule = draw(st.sampled_from((None,) + SCHEDULE_POLICIES))
        warmup = None
        if schedule in VECTOR_POLICIES or (schedule not in (None, "gpipe") and draw(st.booleans())):
            deltas = draw(st.lists(st.integers(0, 3), min_size=len(stages) - 1, max_size=len(stages) - 1))
            warmup = tuple(1 + sum(deltas[j:]) for j in range(len(stages)))
        pipelines.append(Pipeline(stages, draw(counts), draw(counts), schedule, warmup))
    name = draw(st.text(alphabet="ab_-. 19", max_size=6))
    return Strategy(tuple(pipelines), num_layers, draw(st.booleans()), name)


@SOME
@given(strategies())
def test_text_and_dict_round_trips(s):
    assert parse_strategy(format_strategy(s)) == s
    assert Strategy.from_dict(s.to_dict()) == s
    assert Strategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert Strategy.from_dict(yaml.safe_load(yaml.safe_dump(s.to_dict()))) == s


@SOME
@given(strategies(), st.data())
def test_annotations_follow_the_stage_holding_each_layer(s, data):
    layer = data.draw(st.integers(0, s.num_layers - 1))
    holders = [s.stage_holding(layer, i) for i in range(s.num_pipelines)]
    column = param_annotation(s, layer, "column")
    assert [g.devices for g in column.dg_union] == [h.ranks for h in holders]
    pieces = device_pieces(column, (3, 8))
    for h in holders:
        cols = sorted(pieces[r].box[1] for r in h.ranks)
        assert cols[0][0] == 0 and cols[-1][1] == 8 and all(a[1] == b[0] for a, b in zip(cols, cols[1:]))
    act = activation_annotation(s, layer)
    assert act.devices == column.devices and act.ratios == (s.micro_batch_ratios if s.num_pipelines > 1 else None)
    grad = gradient_annotation(s, layer, "row")
    assert grad.hdim == ("P" if s.num_pipelines > 1 else "D") and grad.subgroups == param_annotation(s, layer, "row").subgroups


@SOME
@given(strategies())
def test_discovery_recovers_the_declared_pipelines(s):
    pattern = comm_pattern(s)
    assert discover_pipelines(pattern.collective_groups, pattern.p2p_edges, pattern.devices) == expected_pipelines(s)


@SOME
@given(strategies(), st.randoms(use_true_random=False))
def test_discovery_ignores_input_order(s, rnd):
    pattern = comm_pattern(s)
    groups = [list(g) for g in pattern.collective_groups]
    for g in groups:
        rnd.shuffle(g)
    rnd.shuffle(groups)
    edges = list(pattern.p2p_edges) * 2
    rnd.shuffle(edges)
    devices = list(pattern.devices)
    rnd.shuffle(devices)
    shuffled = discover_pipelines(iter(groups), iter(edges), devices)
    assert shuffled == discover_pipelines(pattern.collective_groups, pattern.p2p_edges, pattern.devices)


@st.composite
def acyclic_patterns(draw):
    """Stages = a random partition of shuffled devices, each joined by a chain of pair collectives;
    P2P edges only from a stage to a later one (any DAG, not just chains)."""
    devices = draw(st.permutations(range(draw(st.integers(1, 12)))))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(devices) - 1)), max_size=len(devices) - 1))) if len(devices) > 1 else []
    stages = [devices[a:b] for a, b in zip([0] + cuts, cuts + [len(devices)])]
    groups = [tuple(s[k : k + 2]) for s in stages for k in range(len(s) - 1)]
    edges = []
    for i, j in draw(st.lists(st.tuples(st.integers(0, len(stages) - 1), st.integers(0, len(stages) - 1)), max_size=12)):
        if i < j:
            edges.append((draw(st.sampled_from(stages[i])), draw(st.sampled_from(stages[j]))))
    return stages, groups, edges


@SOME
@given(acyclic_patterns(), st.randoms(use_true_random=False))
def test_discovery_of_any_dag_is_deterministic_and_topological(pattern, rnd):
    stages, groups, edges = pattern
    found = discover_pipelines(groups, edges, [d for s in stages for d in s])
    assert sorted(s for p in found for s in p.stages) == sorted(tuple(sorted(s)) for s in stages)
    assert [p.devices[0] for p in found] == sorted(p.devices[0] for p in found)
    position = {d: (k, j) for k, p in enumerate(found) for j, s in enumerate(p.stages) for d in s}
    for src, dst in edges:
        assert position[src][0] == position[dst][0] and position[src][1] < position[dst][1]
    for p in found:
        assert all(a < b for a, b in p.links)
    rnd.shuffle(groups)
    rnd.shuffle(edges)
    assert discover_pipelines(groups, edges, [d for s in reversed(stages) for d in s]) == found
