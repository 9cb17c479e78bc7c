"""The one rank-assignment rule reproduces the paper's rank lists (Hetu v2 Tables 5, 7, 8, 11)."""

import pytest

from hspmd.planning.ranks import DevicePool, RankAssignmentError, assign_ranks
from hspmd.specialize.paper_strategies import PAPER_STRATEGIES

FAILED = {"table7_c2": (31,), "table8_c6": (15,)}


def pools_of(key):
    """The cluster of a table entry: H800 ranks 0-15 (as many as the heading says, minus failed),
    H20 after them (from 16 on a mixed cluster, from 0 on an H20-only one); 8 GPUs per node."""
    entry = PAPER_STRATEGIES[key]
    counts = entry.cluster_counts()
    failed = FAILED.get(key, ())
    pools = {}
    if "H800" in counts:
        pools["H800"] = DevicePool.contiguous("H800", 0, counts["H800"] + len(failed), 8, failed)
        pools["H20"] = DevicePool.contiguous("H20", 16, counts["H20"], 8)
    else:
        pools["H20"] = DevicePool.contiguous("H20", 0, counts["H20"] + len(failed), 8, failed)
    return pools


KEYS = [k for k, e in PAPER_STRATEGIES.items() if e.table in (5, 7, 8, 11)]


@pytest.mark.parametrize("key", KEYS)
def test_rule_reproduces_the_table(key):
    entry = PAPER_STRATEGIES[key]
    layout = [[(entry.gpu_kind(s.ranks[0]), s.tp) for s in p.stages] for p in entry.strategy.pipelines]
    expected = tuple(tuple(s.ranks for s in p.stages) for p in entry.strategy.pipelines)
    assert assign_ranks(layout, pools_of(key)) == expected


def test_tp_group_never_crosses_a_node():
    pool = DevicePool.contiguous("A", 0, 16, 8)
    # TP1 then TP8: the cursor sits at rank 1, so the TP-8 group takes the second node whole.
    assert assign_ranks([[("A", 1), ("A", 8)], [("A", 4)]], [pool]) == (((0,), tuple(range(8, 16))), ((1, 2, 3, 4),))
    small = DevicePool.contiguous("A", 0, 8, 4)
    # Three TP-1 stages leave rank 3 alone on node 0: the TP-2 group goes to node 1, not 3,4.
    assert assign_ranks([[("A", 1)] * 3 + [("A", 2)]], [small]) == (((0,), (1,), (2,), (4, 5)),)
    holes = DevicePool.contiguous("A", 0, 8, 4, failed=(3, 7))
    with pytest.raises(RankAssignmentError, match="never crosses a node"):
        assign_ranks([[("A", 2)] * 3], [holes])


def test_errors_name_the_problem():
    pool = DevicePool.contiguous("A", 0, 8, 8)
    with pytest.raises(RankAssignmentError, match="more A devices"):
        assign_ranks([[("A", 4), ("A", 4), ("A", 1)]], [pool])
    with pytest.raises(RankAssignmentError, match="device type 'B'"):
        assign_ranks([[("B", 1)]], [pool])
    with pytest.raises(RankAssignmentError, match="whole node"):
        assign_ranks([[("A", 16)]], [pool])
