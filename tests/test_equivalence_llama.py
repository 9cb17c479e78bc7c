"""Numerical equivalence of parallel strategies with an independent single-device torch Llama:
loss and every synchronised gradient on each of 3 AdamW steps, and the weights after them."""

import pytest
import torch

from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, RopeScaling, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.specialize.comm_plans import pattern
from hspmd.specialize.pipelines import expected_pipelines
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

SEQ, STEPS, LR = 8, 3, 1e-3


def _primitives(spec, phase):
    found = set()
    for exe in spec.executables.values():
        for ins in getattr(exe, phase):
            if ins.node.opdef.is_comm and ins.role != "identity":
                found.update(exe.plan(ins.node, spec.binding).primitives)
    return found


def _check(text, sequence_parallel=False, expect=None, **options):
    strategy = parse_strategy(text)
    config = LlamaConfig(layers=strategy.num_layers, **options)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=LR, zero=strategy.zero),
                        sequence_parallel=sequence_parallel)
    layout = MicroBatchLayout.of(strategy)
    rows = layout.global_batch_size
    job = InProcessJob(model.graph, 0, layout, symbols={"S": SEQ, "T": rows * SEQ})
    spec = job.specialized

    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, config.vocab, (rows, SEQ), generator=gen),
                torch.randint(0, config.vocab, (rows, SEQ), generator=gen)) for _ in range(STEPS)]

    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    scaling = config.rope_scaling
    history, final = reference_training(initial, lambda step: batches[step], config.layers, config.heads, STEPS, lr=LR,
        rope_scaling=scaling and {
        "rope_type": scaling.kind, "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor, "original_max_position_embeddings": scaling.original_max_position})
    for step in range(STEPS):
        tokens, labels = batches[step]
        loss = job.step({"tokens": tokens, "labels": labels})
        ref_loss, ref_grads = history[step]
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        gradients = job.gradients()
        assert set(gradients) == set(ref_grads)
        for name, grad in ref_grads.items():
            # float32 summation order differs: allow 1e-4 of the gradient's own scale
            scale = float(grad.abs().max())
            torch.testing.assert_close(gradients[name], grad, rtol=1e-4, atol=1e-4 * scale, msg=name)
    params = job.parameters()
    for name, value in final.items():
        assert_weights_close(params[name], value, LR, name)
    for phase, names in (expect or {}).items():
        assert set(names) <= _primitives(spec, phase), (phase, _primitives(spec, phase))
    return spec


pytestmark = pytest.mark.equivalence


def test_data_parallel():
    # pipelines are the subgroups of a union: per-pipeline gradient summands meet in a top-tier SplitAllReduce
    _check("layers=2 ; 2x1: R0 L0-1 ; 2x1: R1 L0-1", expect={"update": ["SplitAllReduce"]})


def test_megatron_tensor_parallel():
    spec = _check("layers=2 ; 2x2: R0,1 L0-1", expect={"forward": ["AllReduce"]})
    assert [p.stages for p in spec.pipelines] == [((0, 1),)]
    # the loss is vocabulary-parallel: per-token statistics are all-reduced, the logits never gathered
    assert "AllGather" not in _primitives(spec, "forward")


def test_sequence_parallel():
    _check("layers=2 ; 2x2: R0,1 L0-1", sequence_parallel=True,
           expect={"forward": ["AllGather", "ReduceScatter"], "backward": ["ReduceScatter"]})


def test_pipeline_parallel():
    spec = _check("layers=2 ; 3x1: R0 L0 | R1 L1", expect={"forward": ["SendRecv"], "backward": ["SendRecv"]})
    assert [p.stages for p in spec.pipelines] == [((0,), (1,))]


def test_dp_tp_pp():
    spec = _check("layers=4 ; 2x1: R0,1 L0-1 | R2,3 L2-3 ; 2x1: R4,5 L0-1 | R6,7 L2-3",
                  expect={"forward": ["AllReduce", "SendRecv"], "update": ["SplitAllReduce"]})
    assert [p.stages for p in spec.pipelines] == [((0, 1), (2, 3)), ((4, 5), (6, 7))]


def test_heterogeneous_tensor_parallel():
    """TP2 on [0,1] and TP1 on [2], batch split 2:1 across them."""
    _check("layers=2 ; 2x2: R0,1 L0-1 ; 2x1: R2 L0-1", expect={"update": ["SplitAllReduce"]})


def test_heterogeneous_pipelines():
    """2 stages vs 3 stages, different layer ranges, micro-batch counts and sizes."""
    spec = _check("layers=3 ; 2x2: R0,1 L0-1 | R2 L2 ; 3x1: R3 L0 | R4 L1 | R5 L2")
    assert [p.stages for p in spec.pipelines] == [((0, 1), (2,)), ((3,), (4,), (5,))]


def test_zero1_with_different_tp_degrees():
    _check("layers=2 ; 2x2: R0,1 L0-1 ; 2x2: R2 L0-1 ; zero",
           expect={"update": ["SplitReduceScatter", "SplitAllGather"]})


def test_zero1_over_data_and_tensor_parallel_shards_inside_each_tp_piece():
    """DP2 x TP2: a row-parallel weight's ZeRO shards split the columns its TP piece keeps whole."""
    spec = _check("layers=2 ; 2x2: R0,1 L0-1 ; 2x2: R2,3 L0-1 ; zero",
                  expect={"update": ["SplitReduceScatter", "SplitAllGather"]})
    wo = spec.graph.node("layers.0.wo.exp_avg").output
    assert str(spec.deduced[wo]) == "H1(1:1){S0:2@[0,1] | S0:2@[2,3]}"


# Grouped-query attention (2 K/V heads for 4 Q heads), an explicit head_dim (12, not 32 / 4),
# tied embeddings and Llama 3.1 RoPE scaling (original context 32: head_dim 12 has a wavelength in every band).
GQA_TIED = dict(kv_heads=2, head_dim=12, tie_embeddings=True, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32))


def test_gqa_tied_data_parallel():
    _check("layers=2 ; 2x1: R0 L0-1 ; 2x1: R1 L0-1", expect={"update": ["SplitAllReduce"]}, **GQA_TIED)


def test_gqa_tied_tensor_parallel_shards_kv_heads():
    spec = _check("layers=2 ; 2x2: R0,1 L0-1", **GQA_TIED)
    assert str(spec.deduced[spec.graph.node("layers.0.wk").output]) == "S1:2@[0,1]"


def test_gqa_tensor_parallel_above_kv_heads_replicates_them():
    """TP4 over 2 K/V heads: wk/wv replicated, K/V sliced to Q's heads, their gradient gathered back."""
    spec = _check("layers=2 ; 2x4: R0,1,2,3 L0-1", expect={"backward": ["AllGather"]}, **GQA_TIED)
    assert str(spec.deduced[spec.graph.node("layers.0.wv").output]) == "D:4@[0-3]"


def test_gqa_tied_pipeline_parallel():
    """The tied head lives on the last stage: the table goes there and its gradient comes back."""
    _check("layers=2 ; 3x1: R0 L0 | R1 L1", expect={"forward": ["SendRecv"], "backward": ["SendRecv"]}, **GQA_TIED)


def test_gqa_tied_heterogeneous():
    """TP4 (replicated K/V) next to a 2-stage pipeline, batch split 2:1, linear RoPE scaling."""
    _check("layers=2 ; 2x2: R0,1,2,3 L0-1 ; 2x1: R4 L0 | R5 L1", expect={"update": ["SplitAllReduce"]},
           **{**GQA_TIED, "rope_scaling": RopeScaling("linear", 2.0)})


def _crossing_pipelines(spec, phases=("forward", "backward")):
    """The CommOps of `phases` whose plans join devices of two pipelines (a group or a message)."""
    pipeline_of = {d: i for i, p in enumerate(spec.pipelines) for d in p.devices}
    found = set()
    for exe in spec.executables.values():
        for phase in phases:
            for ins in getattr(exe, phase):
                if ins.node.opdef.is_comm and ins.role != "identity":
                    groups, edges = pattern(exe.plan(ins.node, spec.binding))
                    if any(len({pipeline_of[d] for d in g}) > 1 for g in list(groups) + list(edges)):
                        found.add(ins.node.name)
    return found


@pytest.mark.parametrize("text", [
    "layers=2 ; 1x1: R0 L0-1 ; 2x1: R1 L0-1",  # one micro-batch next to two: failed in step 1 when summed per micro-batch
    "layers=2 ; 2x1: R0,1 L0 | R2,3 L1 ; 3x1: R4,5 L0 | R6,7 L1",  # DP2 x TP2 x PP2, 2 vs 3 micro-batches
    "layers=3 ; 1x2: R0 L0 | R1,2 L1-2 ; 3x1: R3,4 L0-1 | R5 L2",  # TP and stage cuts differ between pipelines
])
def test_tied_embeddings_sum_over_pipelines_once_per_step(text):
    """Each pipeline moves the head's gradient back to its own first stage every micro-batch; the
    pipelines' summands meet in the table's gradient sync only (Hetu's rule), for any micro-batch counts."""
    spec = _check(text, **GQA_TIED)
    assert spec.pipelines == expected_pipelines(parse_strategy(text))
    assert not _crossing_pipelines(spec)
    assert _crossing_pipelines(spec, ("update",)) >= {"embed.grad_sync"}


@pytest.mark.parametrize("text", [
    "layers=4 ; recompute=L1-2 ; 2x1: R0 L0-1 | R1 L2-3 ; 3x1: R2,3 L0-3",  # a range straddling a stage boundary
    "layers=4 ; 2x1: R0,1 L0-1 recompute=selective | R2 L2-3 recompute=selective:L3",  # selective under TP, one layer
    "layers=3 ; 1x2: R0 L0 | R1,2 L1-2 recompute=L2 ; 2x1: R3 L0-2 recompute",  # some layers next to a whole stage
])
def test_recompute_by_layer_and_selective_equal_one_device(text):
    _check(text, **GQA_TIED)
