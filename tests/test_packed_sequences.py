"""Packed rows (several sequences per row, block-diagonal causal attention, per-sequence RoPE
positions, padding as an ignored segment) against an independent single-device torch Llama
that runs each sequence alone: loss, gradients and weights after AdamW steps are equal."""

import pytest
import torch
import torch.nn.functional as F

import hspmd.ops as O
from hspmd.backends.local import run_on_devices
from hspmd.errors import DeductionError, HSPMDError, ShapeError
from hspmd.ir import Binding, initial_value, placeholder
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import _rope, reference_training
from hspmd.ops import AdamW, Graph, causal_attention, rotary
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.execution.packing import counted_tokens, pack_row, pad_rows
from hspmd.runtime.execution.interpreter import run_ops
from hspmd.runtime.execution.run import DeviceState, run_forward
from hspmd.specialize.deduce import deduce
from hspmd.specialize.executable import instantiate
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

LR, STEPS = 1e-3, 2


def _sequences(gen, lengths, vocab):
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n + 1,), generator=gen)
        out.append((ids[:-1], ids[1:]))
    return out


def _run(text, steps_rows, lengths_per_step, pad=0):
    """steps_rows[step][m][pipeline] = the sequence indices packed in that row (each row its own
    length, bound per micro-batch by Trainer.step_rows; `pad` more tokens of padding per row)."""
    strategy = parse_strategy(text)
    config = LlamaConfig(layers=strategy.num_layers)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=LR), packed=True)
    gen = torch.Generator().manual_seed(3)
    seqs = [_sequences(gen, lengths, config.vocab) for lengths in lengths_per_step]
    pipelines = len(strategy.pipelines)
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    history, final = reference_training(initial, lambda s: list(seqs[s]), config.layers, config.heads, STEPS, lr=LR)
    job = InProcessJob(model.graph, 0, MicroBatchLayout((1,) * pipelines, (1,) * pipelines), symbols={"S": 4, "T": 4})
    for step in range(STEPS):
        rows = [[] for _ in range(pipelines)]
        for mb in steps_rows[step]:
            for p, r in enumerate(mb):
                chosen = [seqs[step][i] for i in r]
                rows[p].append(pack_row(chosen, sum(len(t) for t, _ in chosen) + pad))
        total = counted_tokens(seqs[step])
        loss = job.world.run(lambda b: job.trainers[b.rank].step_rows(rows, {"T": total}))[0]
        ref_loss, ref_grads = history[step]
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        gradients = job.gradients()
        for name, grad in ref_grads.items():
            torch.testing.assert_close(gradients[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    params = job.parameters()
    for name, value in final.items():
        assert_weights_close(params[name], value, LR, name)


@pytest.mark.equivalence
def test_packed_single_device_with_padding():
    # 5 sequences in two rows of one device, the shorter row padded (an ignored segment)
    _run("layers=2 ; ?x?: R0 L0-1", [[[[0, 1, 2]], [[3, 4]]], [[[0]], [[1, 2, 3]]]],
         [[3, 5, 2, 4, 6], [7, 2, 3, 1]], pad=2)


@pytest.mark.equivalence
def test_packed_tensor_and_pipeline_parallel():
    # a TP2 pipeline and a PP2 pipeline, each its own packed rows; positions/segments cross the stage boundary
    _run("layers=2 ; ?x?: R0,1 L0-1 ; ?x?: R2 L0 | R3 L1",
         [[[[0, 1], [2]], [[3], [4, 5]]], [[[0, 1, 2], [3]], [[4], [5]]]],
         [[3, 5, 2, 4, 6, 1], [2, 2, 3, 6, 4, 3]])


def test_packed_op_shapes_checked():
    g = Graph("att")
    q = placeholder(g, "q", (1, 2, 6, 4))
    seg = placeholder(g, "seg", (1, 1, 6, 1), torch.int64)
    pos = placeholder(g, "pos", (1, 6, 1, 1), torch.int64)
    out = causal_attention(q, q, q, seg)
    assert out.shape == (1, 2, 6, 4)
    assert rotary(placeholder(g, "x", (1, 6, 2, 4)), 1, 10000.0, positions=pos).shape == (1, 6, 2, 4)
    with pytest.raises(ShapeError, match="segments"):
        causal_attention(q, q, q, placeholder(g, "bad", (1, 6), torch.int64))
    with pytest.raises(ShapeError, match="positions"):
        rotary(placeholder(g, "y", (1, 6, 2, 4)), 1, 10000.0, positions=placeholder(g, "badpos", (1, 6, 2, 4)))


def test_pack_row_errors_and_layout():
    a = (torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]))
    b = (torch.tensor([5, 6]), torch.tensor([6, 7]))
    row = pack_row([a, b], 7)
    assert row["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert row["segments"].tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert row["labels"].tolist()[0][-2:] == [-100, -100]
    assert counted_tokens([a, b]) == 5
    assert pad_rows([a, b], 4)["tokens"].shape == (2, 4)
    with pytest.raises(HSPMDError, match="do not fit"):
        pack_row([a, b], 4)
    with pytest.raises(HSPMDError, match="equal non-empty"):
        pack_row([(torch.tensor([1]), torch.tensor([1, 2]))])


def _forward_backward(graph, feeds, fetch):
    """Values of `fetch` after one forward and backward pass on one device."""
    exe = instantiate(deduce(graph, 0), 0, Binding(), fetches=fetch)
    state = DeviceState.initial(exe)

    def body(backend):
        mb = run_forward(exe, backend, state, feeds, Binding())
        run_ops(mb.passes.backward, backend, state, mb.env)
        return [mb.env[t.id] for t in fetch]

    return run_on_devices(body, [0])[0]


def test_packed_ops_value_and_gradient_match_torch_per_sequence():
    # one row holding sequences of 3 and 4 tokens (+1 padding): equal to running each alone
    gen = torch.Generator().manual_seed(0)
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3, 0])
    x = torch.randn(1, 8, 2, 4, generator=gen)
    w = torch.randn(1, 2, 8, 4, generator=gen)
    g = Graph()
    tx = placeholder(g, "x", (1, 8, 2, 4), annotation="@[0]")
    tpos = placeholder(g, "pos", (1, 8, 1, 1), torch.int64, annotation="@[0]")
    tseg = placeholder(g, "seg", (1, 1, 8, 1), torch.int64, annotation="@[0]")
    tw = placeholder(g, "w", (1, 2, 8, 4), annotation="@[0]")
    q = O.transpose(O.rotary(tx, 1, 10000.0, positions=tpos), 1, 2)
    y = O.causal_attention(q, q, q, tseg)
    (gx,) = O.gradients(O.reduce_sum(y * tw), [tx])
    exe_feeds = {"x": x, "pos": pos.reshape(1, 8, 1, 1), "seg": seg.reshape(1, 1, 8, 1), "w": w}
    got_y, got_g = _forward_backward(g, exe_feeds, [y, gx])
    leaf = x.clone().requires_grad_(True)
    outs = []
    for a, b in ((0, 3), (3, 7), (7, 8)):
        qq = _rope(leaf[:, a:b], 10000.0).transpose(1, 2)
        s = b - a
        att = (qq @ qq.transpose(-1, -2) / 2.0).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(att.softmax(-1) @ qq)
    ref = torch.cat(outs, dim=2)
    (ref * w).sum().backward()
    torch.testing.assert_close(got_y, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_g, leaf.grad, rtol=1e-4, atol=1e-5)


def test_packed_attention_deduction():
    def build(q_ann, seg_ann):
        g = Graph()
        q = placeholder(g, "q", (2, 4, 6, 8), annotation=q_ann)
        seg = placeholder(g, "seg", (2, 1, 6, 1), torch.int64, annotation=seg_ann)
        return g, O.causal_attention(q, q, q, seg)

    g, y = build("S1:2@[0,1]", "D:2@[0,1]")  # heads split (TP), segments replicated
    assert str(deduce(g, 0)[y]) == "S1:2@[0,1]"
    g, y = build("S0:2@[0,1]", "S0:2@[0,1]")  # batch split alike
    assert str(deduce(g, 0)[y]) == "S0:2@[0,1]"
    g, y = build("D:2@[0,1]", "S2:2@[0,1]")  # the sequence must stay whole
    with pytest.raises(DeductionError, match="packed_attention"):
        deduce(g, 0)


def test_cross_entropy_ignores_padding_labels():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=gen)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    labels[1, 3:] = -100
    g = Graph()
    tl = placeholder(g, "l", (2, 5, 7), annotation="@[0]")
    ty = placeholder(g, "y", (2, 5), torch.int64, annotation="@[0]")
    loss = O.cross_entropy(tl, ty, reduction="sum")
    (gl,) = O.gradients(loss, [tl])
    got_loss, got_grad = _forward_backward(g, {"l": logits, "y": labels}, [loss, gl])
    leaf = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(leaf.reshape(-1, 7), labels.reshape(-1), reduction="sum")
    ref.backward()
    torch.testing.assert_close(got_loss, ref.detach())
    torch.testing.assert_close(got_grad, leaf.grad)
    assert got_grad[1, 3:].abs().sum() == 0
