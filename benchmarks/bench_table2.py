"""Hetu v2 Table 2 reproduced: per-sender NVLink / InfiniBand volumes of the C1 -> C2 switch after
rank 31 fails, planned by hspmd for llama-32b-hetu (60 layers, hidden 6656, 52 heads, FFN 17920,
vocab 30592, untied) on 4 nodes of 8 GPUs, printed next to the paper's figures.

Units are the two constants fitted to the table (Hetu v2 §8, Table 2): 6 bytes per parameter and
"MB" = 2^30/1000 bytes. Rows: the fused plan (heuristics, largest tensors first: the default),
the fused plan scanning tensors in model order (shows why the scan order matters: same per-link
totals, uneven IB senders), and each tensor planned alone with the smallest-rank owner sending
(the paper's "w/o heuristics"). Goal: every sender within 1 MB, total 45,703 +- 3.
Run: python benchmarks/bench_table2.py
"""

from __future__ import annotations

import time

from hspmd.switching.paper_table2 import PAPER, PAPER_TOTAL, table2_rows

try:
    from _common import table
except ImportError:  # run from elsewhere
    from benchmarks._common import table


def _side_by_side(row: str, ours: dict, paper: dict) -> str:
    rows, worst = [], 0.0
    for rank in sorted(set(ours) | set(paper)):
        nv, ib = ours.get(rank, (0.0, 0.0))
        pnv, pib = paper.get(rank, (0, 0))
        diff = max(abs(nv - pnv), abs(ib - pib))
        worst = max(worst, diff)
        rows.append((f"R{rank}", pnv, f"{nv:.1f}", pib, f"{ib:.1f}", f"{diff:.2f}"))
    total = sum(a + b for a, b in ours.values())
    head = (f"{row}: total {total:,.1f} MB (paper {PAPER_TOTAL:,}), worst sender difference {worst:.2f} MB "
            f"(goal <= 1)")
    return head + "\n" + table(("sender", "paper NVLink", "hspmd NVLink", "paper IB", "hspmd IB", "|diff|"), rows)


def main() -> None:
    start = time.perf_counter()
    rows = table2_rows()
    planned = time.perf_counter() - start
    given = table2_rows(order="given")["fused"]
    print("Hetu v2 Table 2, C1 -> C2 after rank 31 fails, llama-32b-hetu, 6 B/parameter, MB = 2^30/1000 B")
    print(f"(both rows planned in {planned:.2f} s)\n")
    print(_side_by_side("fused BSR (largest tensors first)", rows["fused"], PAPER["fused"]))
    print()
    print(_side_by_side("unfused BSR w/o heuristics (smallest-rank owner)", rows["w/o heuristics"],
                        PAPER["w/o heuristics"]))
    print()
    print(_side_by_side("fused BSR, model order (order='given'), for comparison", given, PAPER["fused"]))


if __name__ == "__main__":
    main()
