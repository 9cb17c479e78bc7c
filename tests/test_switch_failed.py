"""Every surviving piece is a source: after a failure the fused switch plans from what is still
alive, down to single devices of a damaged tensor-parallel group (Hetu v2 §8, Table 2)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hspmd import parse, resolve_many, run_plan, shard, unshard
from hspmd.cluster import nvlink_ib
from hspmd.comm_resolve.slices import box_volume
from hspmd.errors import HSPMDError, WeightLost
from hspmd.models.llama import LlamaConfig, llama_annotations
from hspmd.specialize.paper_strategies import paper_strategy
from hspmd.switching import plan_layout_switch, recover_strategy

TINY = LlamaConfig(layers=60, hidden=8, ffn=16, vocab=8, heads=2)
NVLINK_IB = nvlink_ib(4, 8)


def _c1_to_c2_layouts(config, failed=(31,)):
    c1 = paper_strategy("table7_c1")
    c2 = recover_strategy(c1, failed)
    before, after = llama_annotations(config, c1), llama_annotations(config, c2)
    return {n: (before[n], after[n], shape) for n, shape in config.parameter_shapes().items()}


def _run_switch(plan, layouts, failed):
    """Shard random full tensors in the source layouts, drop the failed devices' pieces, run the
    plan in this process and reassemble every tensor in its destination layout."""
    gen = torch.Generator().manual_seed(3)
    full = {n: torch.randn(shape, generator=gen) for n, (_, _, shape) in layouts.items()}
    index = {n: i for i, n in enumerate(plan.names)}
    locals_: dict[int, dict[int, torch.Tensor]] = {}
    for name, i in index.items():
        for device, piece in shard(full[name], layouts[name][0]).items():
            if device not in failed:
                locals_.setdefault(device, {})[i] = piece
    out = run_plan(plan.fused, locals_)
    for name, i in index.items():
        pieces = {d: got[i] for d, got in out.items() if i in got}
        torch.testing.assert_close(unshard(pieces, layouts[name][1], shape=full[name].shape), full[name], msg=name)
    return full


def test_c1_to_c2_after_rank_31_fails_reassembles_everything_from_survivors():
    layouts = _c1_to_c2_layouts(TINY)
    plan = plan_layout_switch(layouts, failed=[31], topology=NVLINK_IB)
    assert 31 not in plan.devices and plan.fused.failed == (31,)
    assert all(t.src != 31 and t.dst != 31 for t in plan.fused.transfers)
    _run_switch(plan, layouts, {31})
    sent = plan.fused.bytes_sent
    assert sent.get(31, 0) == 0
    # ranks 28-30 keep serving their own pieces, over NVLink to ranks of their node
    for r in (28, 29, 30):
        links = {NVLINK_IB.link(t.src, t.dst).name for t in plan.fused.transfers if t.src == r and t.dst != r}
        assert sent[r] > 0 and links == {"nvlink"}, (r, links)
    # what only rank 31 held in pipeline 2 comes over InfiniBand from its replica, rank 15
    ib_into_28_31 = {t.src for t in plan.fused.transfers if t.dst in (28, 29, 30) and t.src < 16}
    assert ib_into_28_31 == {15}


def test_losing_every_copy_names_the_lost_tensors():
    layouts = _c1_to_c2_layouts(TINY, (15, 31))
    with pytest.raises(WeightLost, match=r"layers\.45\.wq") as info:
        plan_layout_switch(layouts, failed=[15, 31], topology=NVLINK_IB)
    assert set(info.value.lost) == {f"layers.{l}.{w}" for l in range(45, 60)
                                    for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")} | {"lm_head"}


def test_resolve_many_failed_errors_are_clear():
    with pytest.raises(WeightLost, match=r"tensor 1 .*\[2:4\]") as info:
        resolve_many([("S0:2@[0,1]", "@[2]", (4,)), ("S0:2@[0,1]", "@[2]", (4,))], failed=[1])
    assert set(info.value.lost) == {0, 1}
    with pytest.raises(HSPMDError, match="failed device"):
        resolve_many([("HD{@[0] | @[1]}", "D:2@[1,2]", (4,))], failed=[1])


@settings(max_examples=40)
@given(st.data())
def test_any_failure_that_leaves_a_copy_is_survived(data):
    """Two 4-device TP groups holding one tensor; any failed set that leaves each piece one living
    copy is planned from survivors only, and the destination ends up exact."""
    src_split, dst_split = data.draw(st.sampled_from([0, 1])), data.draw(st.sampled_from([0, 1]))
    src = parse(f"HD{{S{src_split}:4@[0,1,2,3] | S{src_split}:4@[4,5,6,7]}}")
    failed = data.draw(st.sets(st.sampled_from(range(8)), max_size=4).filter(lambda f: all(i not in f or i + 4 not in f for i in range(4))))
    alive = sorted(set(range(8)) - failed)
    n = data.draw(st.integers(1, min(4, len(alive))))
    dst_devices = data.draw(st.permutations(alive))[:n]
    dst = parse(f"S{dst_split}:{n}@[{','.join(map(str, dst_devices))}]" if n > 1 else f"@[{dst_devices[0]}]")
    shape = (8, 12)
    plan = resolve_many([(src, dst, shape)], "2x4", failed=failed)
    assert not any(t.src in failed or t.dst in failed for t in plan.transfers)
    x = torch.randn(shape)
    pieces = {d: {0: p} for d, p in shard(x, src).items() if d not in failed}
    out = run_plan(plan, pieces)
    torch.testing.assert_close(unshard({d: r[0] for d, r in out.items()}, dst, shape=shape), x)


def test_one_switch_moves_bf16_weights_and_fp32_states_together():
    """A fused plan carries each tensor's dtype: bf16 weights and fp32 Adam states in one message
    per device pair, every value arriving bit-exact in its own dtype."""
    layouts = {}
    for name, (src, dst, shape) in _c1_to_c2_layouts(LlamaConfig(layers=60, hidden=8, ffn=16, vocab=8, heads=2)).items():
        if name.startswith(("layers.4", "lm_head")):
            layouts[name] = (src, dst, shape, "bfloat16")
            layouts[name + ".adam_m"] = (src, dst, shape, "float32")
    plan = plan_layout_switch(layouts, failed=[31], topology=NVLINK_IB)
    assert plan.fused.dtype == "mixed"
    assert {m.dtype for m in plan.fused.moves} == {"bfloat16", "float32"}
    assert any(len({plan.fused.moves[i].dtype for i in t.tensors}) == 2 for t in plan.fused.transfers if t.src != t.dst)
    gen = torch.Generator().manual_seed(5)
    index = {n: i for i, n in enumerate(plan.names)}
    full = {n: torch.randn(layouts[n][2], generator=gen).to(getattr(torch, layouts[n][3])) for n in index}
    locals_: dict[int, dict[int, torch.Tensor]] = {}
    for name, i in index.items():
        for device, piece in shard(full[name], layouts[name][0]).items():
            if device != 31:
                locals_.setdefault(device, {})[i] = piece
    out = run_plan(plan.fused, locals_)
    for name, i in index.items():
        got = unshard({d: r[i] for d, r in out.items() if i in r}, layouts[name][1], shape=full[name].shape)
        assert got.dtype == full[name].dtype and torch.equal(got, full[name]), name
    # bytes count each tensor at its own size
    sizes = [2 if m.dtype == "bfloat16" else 4 for m in plan.fused.moves]
    expected = sum(box_volume(b) * sizes[k] for t in plan.fused.transfers if t.src != t.dst
                   for b, k in zip(t.boxes, t.tensors))
    assert sum(plan.fused.bytes_sent.values()) == expected
