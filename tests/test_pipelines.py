"""Pipeline discovery (paper 5.4) on hand-made patterns and on every paper strategy."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.errors import HSPMDError
from hspmd.specialize.paper_strategies import PAPER_STRATEGIES
from hspmd.specialize.pipelines import (PipelineLayout, _chains, _dags, _stage_classes, comm_pattern, discover_pipelines,
                                        expected_pipelines)


def discover(pattern):
    return discover_pipelines(pattern.collective_groups, pattern.p2p_edges, pattern.devices)


@pytest.mark.parametrize("key", list(PAPER_STRATEGIES))
def test_paper_strategies_are_rediscovered(key):
    strategy = PAPER_STRATEGIES[key].strategy
    found = discover(comm_pattern(strategy))
    assert found == expected_pipelines(strategy)
    assert len(found) == strategy.num_pipelines and all(p.is_chain for p in found)
    assert sorted(d for p in found for d in p.devices) == list(strategy.all_ranks)


def test_c2_layout():
    found = discover(comm_pattern(PAPER_STRATEGIES["table7_c2"].strategy))
    assert [len(p) for p in found] == [4, 5]
    assert [len(s) for s in found[1]] == [4, 4, 4, 2, 1]
    assert found[1][3] == (28, 29) and found[1][4] == (30,)
    assert str(found[1]) == "[16-19] -> [20-23] -> [24-27] -> [28,29] -> [30]"


def test_comm_pattern_of_c2_tail():
    pattern = comm_pattern(PAPER_STRATEGIES["table7_c2"].strategy)
    assert (28, 29) in pattern.collective_groups and (30,) not in pattern.collective_groups
    assert (24, 28) in pattern.p2p_edges and (25, 29) in pattern.p2p_edges and (28, 30) in pattern.p2p_edges
    assert (26, 28) not in pattern.p2p_edges and len(pattern.devices) == 31


def test_gradient_sync_would_merge_pipelines():
    """Why once-per-step collectives must be left out: a DP all-reduce spans pipelines."""
    strategy = PAPER_STRATEGIES["table7_c1"].strategy
    pattern = comm_pattern(strategy)
    grad_sync = [(0, 16), (1, 17)]
    merged = discover_pipelines(pattern.collective_groups + tuple(grad_sync), pattern.p2p_edges)
    assert len(merged) == 1 and len(discover(pattern)) == 2


def test_stages_from_collectives_and_chains_from_p2p():
    found = discover_pipelines([(0, 1), (1, 2), (5, 4)], [(2, 4), (4, 7)], devices=[9])
    assert found == (
        PipelineLayout.chain([(0, 1, 2), (4, 5), (7,)]),
        PipelineLayout(((9,),), ()),
    )


def test_dag_pipelines_are_valid():
    """A skip connection across stages and a branch that joins again are both one pipeline."""
    skip = discover_pipelines([(0, 1)], [(0, 2), (2, 3), (1, 3)])
    assert skip == (PipelineLayout(((0, 1), (2,), (3,)), ((0, 1), (0, 2), (1, 2))),)
    assert not skip[0].is_chain
    diamond = discover_pipelines([], [(0, 5), (0, 3), (5, 8), (3, 8)])
    assert diamond[0].stages == ((0,), (3,), (5,), (8,))
    assert diamond[0].links == ((0, 1), (0, 2), (1, 3), (2, 3))
    join = discover_pipelines([(6, 1)], [(5, 8), (1, 8), (3, 8)])
    assert join[0].stages == ((1, 6), (3,), (5,), (8,)), "ties go to the stage with the smallest rank"


def test_p2p_inside_a_stage_and_self_edges_do_not_chain():
    assert discover_pipelines([(0, 1)], [(0, 1), (1, 0), (2, 2)]) == (
        PipelineLayout(((0, 1),), ()),
        PipelineLayout(((2,),), ()),
    )


def test_cycles_are_rejected_with_the_stages_named():
    with pytest.raises(HSPMDError, match=r"cycle between stages \[0,1\] -> \[2,3\] -> \[0,1\]"):
        discover_pipelines([(0, 1), (2, 3)], [(1, 2), (3, 0)])
    with pytest.raises(HSPMDError, match=r"\[4\] -> \[5\] -> \[6\] -> \[4\]"):
        discover_pipelines([], [(0, 4), (4, 5), (5, 6), (6, 4), (6, 9)])


@pytest.mark.parametrize(
    "groups, edges, words",
    [
        ([()], [], "collective group 0 is empty"),
        ([(0, -1)], [], "non-negative integers"),
        ([(0, True)], [], "non-negative integers"),
        ([], [(0, 1, 2)], "P2P edge 0"),
        ([], [(0, "1")], "P2P edge 0"),
        ([(0, 1), ([2, 3],)], [], "collective group 1: device ids"),  # unhashable, after a good group
        ([], [(0, 1), ([0], 1)], "P2P edge 1: device ids"),
    ],
)
def test_malformed_input(groups, edges, words):
    with pytest.raises(HSPMDError, match=words):
        discover_pipelines(groups, edges)


def test_empty_input_has_no_pipelines():
    assert discover_pipelines([], []) == ()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_chains_walked_match_the_general_discovery(data):
    """Stage graphs where each stage hands off to at most one stage and takes from at most one are
    walked from their first stages (pipelines._chains); that walk agrees with the general
    topological discovery (pipelines._dags), and declines branching graphs and cycles."""
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=9))
    devices = data.draw(st.permutations(range(sum(sizes))))
    groups, start = [], 0
    for size in sizes:
        groups.append(tuple(devices[start:start + size]))
        start += size
    pairs = st.tuples(st.integers(0, len(groups) - 1), st.integers(0, len(groups) - 1))
    stage_pairs = data.draw(st.lists(pairs, max_size=2 * len(groups)))
    edges = [(data.draw(st.sampled_from(groups[a])), data.draw(st.sampled_from(groups[b]))) for a, b in stage_pairs]
    classes, root_of = _stage_classes(groups, edges, ())
    stage_edges = sorted({(root_of[a], root_of[b]) for a, b in edges if root_of[a] != root_of[b]})
    walked = _chains(classes, stage_edges)
    try:
        general = sorted(_dags(classes, stage_edges), key=lambda p: p.stages)
    except HSPMDError:
        assert walked is None  # a cycle
        with pytest.raises(HSPMDError, match="cycle"):
            discover_pipelines(groups, edges)
        return
    senders = [a for a, _ in stage_edges]
    receivers = [b for _, b in stage_edges]
    branching = len(set(senders)) < len(senders) or len(set(receivers)) < len(receivers)
    assert (walked is None) == branching
    if walked is not None:
        assert sorted(walked, key=lambda p: p.stages) == general and all(p.is_chain for p in walked)
    assert sorted(discover_pipelines(groups, edges), key=lambda p: p.stages) == general
