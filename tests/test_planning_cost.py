"""ModelSpec counts and the roofline CostModel: exact parameter counts, FLOP formulas, the ring
alpha-beta identities, ZeRO-1 memory, profile overrides."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from hspmd.cluster import parse_cluster
from hspmd.cluster.presets import uniform
from hspmd.errors import ClusterError
from hspmd.models.llama import LlamaConfig
from hspmd.planning import MODELS, CostModel, Efficiency, ModelSpec, ProfileTable, StageShape, from_llama_config
from hspmd.planning.model import model_named

MB_HETU = 2 ** 30 / 1000  # Hetu v2 Table 2's "MB" (Hetu v2 §8, Table 2)


def test_llama_32b_hetu_layer_shard_is_table2s_unit():
    m = MODELS["llama-32b-hetu"]
    h, f = m.hidden, m.ffn
    assert m.layer_parameters() == 4 * h * h + 3 * h * f + 2 * h
    shard_matrices = (m.layer_parameters() - 2 * h) / 4
    assert round(shard_matrices * 6 / MB_HETU, 2) == 747.44  # s = 747.43 MB at 6 bytes/parameter
    assert round(m.vocab * h / 4 * 6 / MB_HETU, 2) == 284.45   # h = a quarter of the LM head


@pytest.mark.parametrize("extra", [{}, {"kv_heads": 2, "tie_embeddings": True}, {"head_dim": 16, "kv_heads": 1}])
def test_parameter_count_matches_the_dsl_llama(extra):
    config = LlamaConfig(vocab=50, hidden=32, layers=3, heads=4, ffn=48, **extra)
    spec = from_llama_config(config)
    assert spec.parameters() == sum(math.prod(s) for s in config.parameter_shapes().values())


def test_gqa_and_tied_embeddings_shrink_the_count():
    m = MODELS["h2-100b"]
    assert m.kv_heads == 8 and m.head_dim == 128
    full = m.with_(kv_heads=m.heads)
    assert full.layer_parameters() - m.layer_parameters() == 2 * m.hidden * (m.heads - m.kv_heads) * m.head_dim
    assert m.with_(tied=True).parameters() == m.parameters() - m.vocab * m.hidden


@settings(max_examples=40)
@given(st.integers(1, 4), st.integers(1, 64), st.sampled_from([64, 128, 256]), st.sampled_from([1, 2, 4]))
def test_layer_flops_is_24bsh2_plus_4bs2h_for_gpt_shapes(b, s, h, tp):
    m = ModelSpec("gpt", 2, h, 4 * h, 4, 4, 100, s, mlp="gelu")
    assert m.layer_flops(b, s) == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h)
    per_device = sum(k.flops * k.count for k in m.layer_kernels(b, s, tp) if k.cls in ("gemm", "attn"))
    assert per_device == pytest.approx(m.layer_flops(b, s) / tp)


def test_roofline_layer_time_scales_with_peak_and_gamma():
    cluster = parse_cluster("hetu-h800-h20")
    m = MODELS["llama-32b-hetu"]
    fast, slow = CostModel(cluster, m).layer_time(0, 4), CostModel(cluster, m).layer_time(16, 4)
    assert fast[1] == pytest.approx(2 * fast[0], rel=0.05) and slow[0] > 4 * fast[0]  # matmuls dominate: B ~ 2F
    gemm_bound = sum(k.flops for k in m.layer_kernels(1, m.seq_len, 4) if k.cls in ("gemm", "attn")) / 990e12
    assert fast[0] >= gemm_bound
    slowed = CostModel(cluster, m, {"*": Efficiency(gamma={"gemm": 2.0, "attn": 2.0})}).layer_time(0, 4)
    assert slowed[0] == pytest.approx(fast[0] + gemm_bound, rel=1e-9)
    recomputed = CostModel(cluster, m).layer_time(0, 4, recompute=True)
    assert recomputed == pytest.approx((fast[0], fast[1] + fast[0]))
    delta = CostModel(cluster, m, {"*": Efficiency(delta={"misc": 1e-3})}).layer_time(0, 4)
    assert delta[0] == pytest.approx(fast[0] + 8e-3)  # 8 views per layer


@settings(max_examples=60)
@given(st.integers(2, 8), st.floats(1e3, 1e9), st.sampled_from(["all_reduce", "reduce_scatter", "all_gather"]))
def test_ring_on_equal_links_is_the_alpha_beta_identity(n, nbytes, kind):
    cluster = uniform(1, 8)
    link = cluster.link(0, 1)
    cm = CostModel(cluster, MODELS["llama-tiny"])
    rounds = 2 if kind == "all_reduce" else 1
    expected = rounds * ((n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth)
    assert cm.collective(kind, nbytes, tuple(range(n))) == pytest.approx(expected, rel=1e-12)


def test_ring_runs_at_its_slowest_edge():
    cluster = parse_cluster("hetu-h800-h20")
    cm = CostModel(cluster, MODELS["llama-tiny"])
    inside = cm.collective("all_reduce", 1e9, (0, 1, 2, 3))
    across = cm.collective("all_reduce", 1e9, (0, 1, 2, 16))
    ib = cluster.link(0, 16)
    assert across == pytest.approx(6 * ib.latency + 1.5e9 / ib.bandwidth) and across > 5 * inside
    assert cm.p2p(1e6, (0, 16)) == pytest.approx(ib.latency + 1e6 / ib.bandwidth) == cm.p2p(1e6, ib)
    with pytest.raises(ClusterError, match="unknown collective"):
        cm.collective("all_to_all", 1.0, (0, 1))


def test_zero1_divides_only_optimizer_states():
    cm = CostModel(parse_cluster("hetu-h800-h20"), MODELS["llama-32b-hetu"])
    plain = cm.memory(StageShape(15, 4, first=True, dp=4), inflight=4)
    zero = cm.memory(StageShape(15, 4, first=True, dp=4, zero=True), inflight=4)
    assert zero.weights == plain.weights and zero.activations == plain.activations
    assert zero.optimizer == pytest.approx(plain.optimizer / 4)
    params = cm.stage_parameters(StageShape(15, 4, first=True))
    assert plain.weights == params * 2 and plain.optimizer == params * 12  # bf16 weights; fp32 master + moments
    one = cm.memory(StageShape(15, 4, first=True, dp=4), inflight=1)
    assert plain.activations == pytest.approx(4 * one.activations)
    assert cm.memory(StageShape(15, 4, recompute=True), 1).activations < one.activations / 10


def test_profile_table_overrides_and_interpolates():
    cluster = parse_cluster("hetu-h800-h20")
    table = ProfileTable({("H20", 4, 1, 1000): (1.0, 2.0), ("H20", 4, 1, 3000): (3.0, 7.0)})
    cm = CostModel(cluster, MODELS["llama-32b-hetu"], profile=table)
    assert cm.layer_time(16, 4, 1, 1000) == (1.0, 2.0)
    assert cm.layer_time(16, 4, 1, 2000) == pytest.approx((2.0, 4.5))
    assert cm.layer_time(16, 4, 2, 3000) == pytest.approx((6.0, 14.0))
    assert cm.layer_time(16, 4, 1, 1000, recompute=True) == (1.0, 3.0)
    assert cm.layer_time(0, 4, 1, 1000) != (1.0, 2.0)  # no H800 entry: roofline


def test_bad_specs_are_clear():
    with pytest.raises(ClusterError, match="kv_heads"):
        ModelSpec("x", 2, 64, 128, 4, 3, 10, 8)
    with pytest.raises(ClusterError, match="unknown model"):
        model_named("llama-9000")
    with pytest.raises(ClusterError, match="unknown kernel class"):
        Efficiency(gamma={"conv": 1.0})


def test_the_searches_price_gradient_sync_at_every_data_parallel_degree():
    # More replicas than nodes: the ring still has d distinct members (round-robin over nodes).
    from hspmd.planning.search.costed import CostModelEvaluator
    evaluator = CostModelEvaluator(CostModel(uniform(2, 8), MODELS["llama-30b"]))
    model = evaluator.cost.model
    for dp, ring in ((2, [0, 8]), (4, [0, 8, 1, 9])):
        share = model.parameters() / (16 // dp)
        allreduce = evaluator.cost.collective("all_reduce", share * model.itemsize, ring)
        update = evaluator.cost.update_time("gpu", share)
        assert allreduce > 0
        assert evaluator.sync_time(dp, {"gpu": 16 // dp}) == pytest.approx(allreduce + update)


def test_a_hand_off_between_stages_on_one_node_is_not_free():
    from hspmd.planning.search.costed import CostModelEvaluator
    evaluator = CostModelEvaluator(CostModel(uniform(1, 8), MODELS["llama-30b"]))
    model = evaluator.cost.model
    nbytes = model.seq_len * model.hidden * model.itemsize
    within_node = evaluator.cost.p2p(nbytes, (0, 1))
    assert within_node > 0 and evaluator.link_time("gpu", "gpu") == pytest.approx(within_node)
