"""Hetu v2 Table 2: who sends what, over which link, when C1 becomes C2 after rank 31 fails (section 8).

C1 (Table 7) is two pipelines of four TP4 stages on 32 H20 GPUs (4 nodes of 8, NVLink inside a
node, InfiniBand between nodes); rank 31 fails and `recover_strategy` gives C2 (pipeline 2 ends
in a TP2 and a TP1 stage). Every parameter moves in one fused BSR; ranks 28-30 still serve their
own pieces, rank 15 serves rank 31's.

The paper never states the model or the units. With the Hetu authors' model (llama-32b-hetu: 60
layers, hidden 6656, 52 heads, FFN 17920, vocab 30592, untied) the table is reproduced with two
fitted constants (Hetu v2 §8, Table 2): 6 bytes per parameter and "MB" = 2^30/1000 bytes.

Rows: "fused" (one fused plan, heuristics, largest tensors first) and "w/o heuristics" (each
tensor planned alone, the smallest-rank owner sends: the paper's baseline).
"""

from __future__ import annotations

from hspmd.cluster import nvlink_ib
from hspmd.cluster.presets import NVLINK
from hspmd.comm_resolve import resolve_many
from hspmd.models.llama import LlamaConfig, llama_annotations
from hspmd.planning.model import ModelSpec, model_named
from hspmd.specialize.paper_strategies import paper_strategy
from hspmd.switching.recovery import recover_strategy
from hspmd.switching.switch import plan_layout_switch

BYTES_PER_PARAMETER = 6
PAPER_MB = 2**30 / 1000  # the paper's "MB"
FAILED = (31,)
TOPOLOGY = nvlink_ib(4, 8)

# sender rank: (NVLink MB, InfiniBand MB), as printed in Hetu v2 Table 2
PAPER = {
    "fused": {
        8: (0, 747), 9: (0, 747), 10: (0, 747), 11: (0, 747), 15: (0, 11496),
        20: (748, 0), 21: (748, 0), 22: (748, 0), 23: (748, 0),
        24: (0, 748), 25: (0, 748), 26: (0, 748), 27: (0, 748),
        28: (5517, 0), 29: (11496, 0), 30: (8222, 0),
    },
    "w/o heuristics": {
        4: (0, 748), 5: (0, 747), 6: (0, 747), 7: (0, 747), 8: (0, 1495), 9: (0, 1495), 10: (0, 1495),
        11: (0, 1495), 12: (0, 5517), 13: (0, 11496), 14: (0, 8222), 15: (0, 11496),
    },
}
PAPER_TOTAL = 45703


def table2_layouts(model: ModelSpec | str = "llama-32b-hetu") -> dict[str, tuple]:
    """{parameter: (C1 annotation, C2 annotation, shape)} of the model."""
    spec = model_named(model)
    config = LlamaConfig(vocab=spec.vocab, hidden=spec.hidden, layers=spec.layers, heads=spec.heads, ffn=spec.ffn)
    c1 = paper_strategy("table7_c1")
    c2 = recover_strategy(c1, FAILED)
    before, after = llama_annotations(config, c1), llama_annotations(config, c2)
    return {name: (before[name], after[name], shape) for name, shape in config.parameter_shapes().items()}


def sender_volumes(plans) -> dict[int, tuple[float, float]]:
    """{sender: (NVLink MB, InfiniBand MB)} summed over `plans`, at BYTES_PER_PARAMETER."""
    out: dict[int, list[float]] = {}
    for plan in plans:
        scale = BYTES_PER_PARAMETER / plan.itemsize / PAPER_MB
        for device, links in plan.bytes_sent_by_link.items():
            row = out.setdefault(device, [0.0, 0.0])
            for link, n in links.items():
                row[link != NVLINK.name] += n * scale
    return {d: (nv, ib) for d, (nv, ib) in sorted(out.items())}


def table2_rows(model: ModelSpec | str = "llama-32b-hetu", **fused_choices) -> dict[str, dict[int, tuple[float, float]]]:
    """Both rows of Table 2 as planned by hspmd: {row: {sender: (NVLink MB, InfiniBand MB)}}."""
    layouts = table2_layouts(model)
    fused = plan_layout_switch(layouts, failed=FAILED, topology=TOPOLOGY, **fused_choices)
    moved = [(a, b, s) for a, b, s in layouts.values() if a != b]
    alone = [resolve_many([m], TOPOLOGY, failed=FAILED, heuristics=False) for m in moved]
    return {"fused": sender_volumes([fused.fused]), "w/o heuristics": sender_volumes(alone)}


__all__ = ["BYTES_PER_PARAMETER", "PAPER_MB", "PAPER", "PAPER_TOTAL", "sender_volumes", "table2_layouts", "table2_rows"]
