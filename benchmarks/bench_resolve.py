"""Planning the strategy switch C1 -> C2 of paper Table 7 (elastic training, one H20 lost) for every
parameter of a Llama-32B-shaped model (60 layers, hidden 5120, FFN 27648, 40 heads, vocab 152064,
bf16) on 32 GPUs in 4 nodes of 8 (NVLink inside a node, InfiniBand between nodes).

C1: two pipelines of 4 TP4 stages, R0-15 and R16-31, layers 0-14 / 15-29 / 30-44 / 45-59.
C2: pipeline 1 unchanged; pipeline 2 has 5 stages: R16-19 L0-15, R20-23 L16-31, R24-27 L32-47,
    R28-29 (TP2) L48-55, R30 (TP1) L56-59.
Each parameter is an HD union over the two pipelines' stages holding it (Megatron TP inside a
stage: q/k/v/gate/up split on the output dim, o/down on the input dim, norms duplicated,
embedding and LM head vocab-parallel).

Reported: planning time of the fused BSR (goal: under 1 s), fused message count vs planning each
tensor alone, max per-device send bytes vs the lower bound (slices split freely among owners),
total bytes vs the volume lower bound, bytes per link class, and the estimated switch time.
Then, for a few of HetAuto App. E's stage hand-offs across HetAuto's two clusters, the route resolve()
picks by default, its messages across the clusters and its estimated gain over the hierarchical plan.
Run: python benchmarks/bench_resolve.py
"""

from __future__ import annotations

import time

from hspmd.cluster import nvlink_ib
from hspmd.comm_resolve import resolve
from hspmd.comm_resolve.fused import required_bytes, resolve_many, send_lower_bound
from hspmd.comm_resolve.render import bytes_text, seconds_text

HIDDEN, FFN, LAYERS, VOCAB = 5120, 27648, 60, 152064

C1 = [
    [(range(0, 4), range(0, 15)), (range(4, 8), range(15, 30)), (range(8, 12), range(30, 45)), (range(12, 16), range(45, 60))],
    [(range(16, 20), range(0, 15)), (range(20, 24), range(15, 30)), (range(24, 28), range(30, 45)), (range(28, 32), range(45, 60))],
]
C2 = [
    C1[0],
    [(range(16, 20), range(0, 16)), (range(20, 24), range(16, 32)), (range(24, 28), range(32, 48)),
     (range(28, 30), range(48, 56)), (range(30, 31), range(56, 60))],
]

# name -> (shape, Megatron layout: split dim, or None for duplicated)
LAYER_PARAMS = {
    "q": ((HIDDEN, HIDDEN), 0), "k": ((HIDDEN, HIDDEN), 0), "v": ((HIDDEN, HIDDEN), 0), "o": ((HIDDEN, HIDDEN), 1),
    "gate": ((FFN, HIDDEN), 0), "up": ((FFN, HIDDEN), 0), "down": ((HIDDEN, FFN), 1),
    "input_norm": ((HIDDEN,), None), "post_attention_norm": ((HIDDEN,), None),
}


def stage_layout(devices: range, split_dim: int | None) -> str:
    group = "[" + ",".join(map(str, devices)) + "]"
    tp = len(devices)
    if tp == 1:
        return f"@{group}"
    return f"S{split_dim}:{tp}@{group}" if split_dim is not None else f"D:{tp}@{group}"


def holder(strategy, pipeline: int, layer: int) -> range:
    """Devices of the stage of `pipeline` holding `layer` (-1: embedding stage, LAYERS: head stage)."""
    stages = strategy[pipeline]
    if layer < 0:
        return stages[0][0]
    if layer >= LAYERS:
        return stages[-1][0]
    return next(devices for devices, layers in stages if layer in layers)


def annotation(strategy, layer: int, split_dim: int | None) -> str:
    return "HD{" + " | ".join(stage_layout(holder(strategy, p, layer), split_dim) for p in range(2)) + "}"


def parameters():
    """(name, shape, layer index for placement, split dim) of every parameter."""
    out = [("embedding", (VOCAB, HIDDEN), -1, 0)]
    for layer in range(LAYERS):
        out += [(f"layers.{layer}.{name}", shape, layer, dim) for name, (shape, dim) in LAYER_PARAMS.items()]
    out += [("final_norm", (HIDDEN,), LAYERS, None), ("lm_head", (VOCAB, HIDDEN), LAYERS, 0)]
    return out


def main() -> None:
    topology = nvlink_ib(4, 8)
    moves = [(annotation(C1, layer, dim), annotation(C2, layer, dim), shape) for _, shape, layer, dim in parameters()]
    changed = sum(src != dst for src, dst, _ in moves)

    timings = []
    for _ in range(3):
        start = time.perf_counter()
        plan = resolve_many(moves, topology, dtype="bfloat16")
        timings.append(time.perf_counter() - start)

    start = time.perf_counter()
    alone = [resolve_many([m], topology, dtype="bfloat16") for m in moves]
    alone_s = time.perf_counter() - start
    start = time.perf_counter()
    hierarchical = [resolve(*m, topology, dtype="bfloat16") for m in moves]
    hierarchical_s = time.perf_counter() - start

    sent, needed = plan.bytes_sent, required_bytes(plan)
    bound, fast_bound = send_lower_bound(plan), send_lower_bound(plan, fastest_links_only=True)
    rows = [
        ("parameters (tensors)", f"{len(moves)} ({changed} change layout)"),
        ("fused BSR planning time", f"{min(timings) * 1e3:.0f} ms best, {timings[0] * 1e3:.0f} ms first run (goal < 1 s)"),
        ("planning each tensor alone", f"{alone_s * 1e3:.0f} ms (BSR), {hierarchical_s * 1e3:.0f} ms (resolve)"),
        ("messages, fused", f"{plan.messages} (one per device pair)"),
        ("messages, per tensor", f"{sum(p.messages for p in alone)} (BSR), {sum(p.messages for p in hierarchical)} (resolve)"),
        ("bytes moved, fused", f"{bytes_text(plan.total_bytes)} (volume lower bound {bytes_text(sum(needed.values()))})"),
        ("max per-device send", bytes_text(max(sent.values()))),
        ("  lower bound, any owner", f"{bytes_text(bound)} (ratio {max(sent.values()) / bound:.3f}: the bandwidth rule "
                                     f"keeps slices on NVLink rather than spread them over InfiniBand)"),
        ("  lower bound, fastest owners", f"{bytes_text(fast_bound)} (ratio {max(sent.values()) / fast_bound:.3f})"),
        ("max per-device send, per tensor", bytes_text(max(_sum_sent(alone).values()))),
        ("senders / receivers", f"{sum(1 for n in sent.values() if n)} / {sum(1 for n in plan.bytes_received.values() if n)}"),
    ]
    rows += [(f"bytes over {link}", bytes_text(n)) for link, n in plan.bytes_by_link.items()]
    rows.append(("estimated switch time", f"{seconds_text(plan.estimated_seconds)} fused, "
                                          f"{seconds_text(sum(p.estimated_seconds for p in alone))} per tensor in sequence"))
    width = max(len(k) for k, _ in rows)
    print(f"C1 -> C2 parameter switch, Llama-32B shape, bf16, topology {topology}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    cross_cluster_routes()


# HetAuto App. E: one stage per cluster, (inner DP, CP x TP) per stage, activations [b', s, h] in bf16
APP_E_CASES = [((16, 1), (1, 16)), ((4, 4), (8, 2)), ((2, 8), (4, 4)), ((1, 16), (16, 1))]
APP_E_SHAPES = [(16, 128, 256), (16, 512, 1024), (16, 8192, 4096)]


def cross_cluster_routes() -> None:
    """The route resolve() picks between two stages on HetAuto's clusters (hetauto-a100-2x16:
    one shared ~10 Gb/s pipe between them) and its estimated gain over the hierarchical plan."""
    from hspmd.comm_resolve.compare import alternatives, chosen_route

    print("\nCross-cluster stage hand-off (HetAuto App. E, hetauto-a100-2x16, bf16): the default route vs the hierarchical plan")
    rows = []
    for (d1, ct1), (d2, ct2) in APP_E_CASES:
        src, dst = f"S0:{d1},S1:{ct1}@[0-15]", f"S0:{d2},S1:{ct2}@[16-31]"
        for shape in APP_E_SHAPES:
            start = time.perf_counter()
            plan = resolve(src, dst, shape, "hetauto-a100-2x16", dtype="bfloat16")
            planning = time.perf_counter() - start
            alts = alternatives(src, dst, shape, "hetauto-a100-2x16", dtype="bfloat16")
            base = alts["hierarchical"]
            rows.append((f"({d1},{ct1})->({d2},{ct2})", "x".join(map(str, shape)), chosen_route(alts, plan),
                         f"{_across(plan)} / {_across(base)}", seconds_text(plan.estimated_seconds),
                         seconds_text(base.estimated_seconds), f"{base.estimated_seconds / plan.estimated_seconds:.2f}x",
                         f"{planning * 1e3:.1f} ms"))
    head = ("stages (d, ct)", "shape", "route", "msgs across", "est. time", "hierarchical", "gain", "resolve")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    for row in [head] + rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))


def _across(plan, first_of_cluster2: int = 16) -> int:
    return sum(1 for s in plan.steps for t in s.transfers if (t.src < first_of_cluster2) != (t.dst < first_of_cluster2))


def _sum_sent(plans) -> dict[int, int]:
    total: dict[int, int] = {}
    for p in plans:
        for d, n in p.bytes_sent.items():
            total[d] = total.get(d, 0) + n
    return total


if __name__ == "__main__":
    main()
