"""Hetu v2 Table 2 reproduced by the planner: every sender within 1 MB of the paper, both rows."""

import pytest

from hspmd.switching.paper_table2 import FAILED, PAPER, PAPER_TOTAL, TOPOLOGY, table2_layouts, table2_rows
from hspmd.switching import plan_layout_switch


@pytest.fixture(scope="module")
def rows():
    return table2_rows()


@pytest.mark.parametrize("row", ["fused", "w/o heuristics"])
def test_every_sender_within_1_mb_of_the_paper(rows, row):
    ours, paper = rows[row], PAPER[row]
    assert set(ours) == set(paper)
    for rank, (nv, ib) in ours.items():
        assert abs(nv - paper[rank][0]) <= 1 and abs(ib - paper[rank][1]) <= 1, (row, rank, nv, ib, paper[rank])
    assert abs(sum(a + b for a, b in ours.values()) - PAPER_TOTAL) <= 3


def test_rank_15_is_the_only_source_of_rank_31s_pieces():
    plan = plan_layout_switch(table2_layouts(), failed=FAILED, topology=TOPOLOGY).fused
    assert 31 not in plan.bytes_sent_by_link
    into_damaged_stage = {t.src for t in plan.transfers if t.dst in (28, 29, 30) and TOPOLOGY.node_of(t.src) != 3}
    assert into_damaged_stage == {15}


def test_model_order_scan_misses_the_paper(rows):
    """The scan order is what makes the fused row match: model order unbalances the IB senders."""
    given = table2_rows(order="given")["fused"]
    assert max(abs(given[r][1] - PAPER["fused"][r][1]) for r in (8, 24)) > 10
    assert sum(a + b for a, b in given.values()) == pytest.approx(sum(a + b for a, b in rows["fused"].values()))
