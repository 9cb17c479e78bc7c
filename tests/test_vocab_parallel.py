"""Vocabulary-parallel cross-entropy: the loss and its gradients over logits whose class dim is
split across devices equal single-device torch (in-process and on gloo processes), for uneven
splits, ignored labels and logits large enough that an unshifted exp overflows; its deduction
rules; and no rank ever makes a [tokens, vocab] tensor wider than its own share of the vocabulary
(the Llama model uses it whenever the lm head is vocabulary-split)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hspmd.ops as O
from hspmd import parse, unshard
from hspmd.backends.backend import Backend
from hspmd.backends.local import run_on_devices
from hspmd.errors import DeductionError
from hspmd.ir import Binding, Graph, placeholder
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops.nn import IGNORE_INDEX
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.execution.interpreter import run_ops
from hspmd.runtime.execution.run import DeviceState, device_feeds, run_forward
from hspmd.runtime.training.trainer import step_groups
from hspmd.specialize.deduce import deduce
from hspmd.specialize.executable import instantiate
from hspmd.specialize.strategy_text import parse_strategy

TOKENS, HIDDEN, VOCAB = 6, 5, 11


def _graph(head_layout: str, token_layout: str):
    g = Graph()
    x = placeholder(g, "x", (TOKENS, HIDDEN), annotation=token_layout)
    head = placeholder(g, "head", (HIDDEN, VOCAB), annotation=head_layout)
    labels = placeholder(g, "labels", (TOKENS,), torch.int64, annotation=token_layout)
    loss = O.scale(O.vocab_parallel_cross_entropy(O.matmul(x, head), labels), 1.0 / TOKENS)
    return g, loss, O.gradients(loss, [x, head])


def _values(scale: float = 1.0):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen) * scale
    head = torch.randn(HIDDEN, VOCAB, generator=gen)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels[2] = IGNORE_INDEX
    return {"x": x, "head": head, "labels": labels}


def _reference(values):
    x, head = values["x"].clone().requires_grad_(True), values["head"].clone().requires_grad_(True)
    loss = F.cross_entropy(x @ head, values["labels"], ignore_index=IGNORE_INDEX, reduction="sum") / TOKENS
    loss.backward()
    return loss.detach(), x.grad, head.grad


def _device_run(backend: Backend, graph, fetch, values):
    binding = Binding()
    exe = instantiate(deduce(graph, 0), backend.rank, binding, fetches=fetch)
    backend.prepare_groups(step_groups(exe, tuple(range(backend.world_size)), binding))
    state = DeviceState.initial(exe)
    mb = run_forward(exe, backend, state, device_feeds(exe, values, binding), binding)
    run_ops(mb.passes.backward, backend, state, mb.env)
    return {t.name: (mb.env.get(t.id), exe.deduced[t]) for t in fetch}


def _check(per_device, fetch, values):
    loss, gx, ghead = fetch
    ref_loss, ref_x, ref_head = _reference(values)
    for name, ref in ((gx.name, ref_x), (ghead.name, ref_head)):
        pieces = {d: r[name][0] for d, r in per_device.items() if r[name][0] is not None}
        ann = next(r[name][1] for r in per_device.values())
        torch.testing.assert_close(unshard(pieces, ann, shape=tuple(ref.shape)), ref, rtol=1e-5, atol=1e-6)
    losses = {d: r[loss.name] for d, r in per_device.items()}
    ann = next(a for _, a in losses.values())
    total = unshard({d: v for d, (v, _) in losses.items() if v is not None}, ann, shape=())
    torch.testing.assert_close(total, ref_loss, rtol=1e-5, atol=1e-6)


LAYOUTS = [
    ("S1:3@[0-2]", "D:3@[0-2]"),  # TP3 over 11 classes: 4 + 4 + 3
    ("D:2,S1:2@[0-3]", "S0:2,D:2@[0-3]"),  # DP2 x TP2
    ("S1:2@[0,1]", "D:2@[0,1]"),
    ("D:2@[0,1]", "D:2@[0,1]"),  # classes whole: the same ops, nothing to all-reduce
]


@pytest.mark.parametrize("head_layout,token_layout", LAYOUTS)
@pytest.mark.parametrize("scale", [1.0, 60.0], ids=["plain", "logits-over-88"])
def test_loss_and_gradients_equal_torch_in_process(head_layout, token_layout, scale):
    graph, loss, grads = _graph(head_layout, token_layout)
    fetch = [loss, *grads]
    values = _values(scale)
    per_device = run_on_devices(lambda b: _device_run(b, graph, fetch, values), parse(head_layout).devices)
    _check(per_device, fetch, values)
    if scale > 1:
        assert (values["x"] @ values["head"]).abs().max() > 88  # exp would overflow without the shift


def gloo_rank(backend: Backend, head_layout: str, token_layout: str):
    torch.set_num_threads(1)
    graph, loss, grads = _graph(head_layout, token_layout)
    return _device_run(backend, graph, [loss, *grads], _values(60.0))


@pytest.mark.multiprocess
def test_loss_and_gradients_equal_torch_on_gloo():
    head_layout, token_layout = LAYOUTS[1]
    graph, loss, grads = _graph(head_layout, token_layout)
    per_rank = run_multiprocess(gloo_rank, 4, head_layout, token_layout, timeout=120)
    _check(dict(enumerate(per_rank)), [loss, *grads], _values(60.0))


def test_deduction_keeps_the_classes_split_and_refuses_split_statistics():
    graph, loss, _ = _graph("S1:2@[0,1]", "D:2@[0,1]")
    deduced = deduce(graph, 0)
    kinds = {n.kind: deduced[n.outputs[0]] for n in graph.nodes}
    assert str(kinds["class_max"]) == "P:2@[0,1]" and str(kinds["class_stats"]) == "P:2@[0,1]"
    assert str(kinds["class_stats_grad"]) == "S1:2@[0,1]"
    reductions = [n.attrs.get("reduce", "sum") for n in graph.nodes if n.opdef.is_comm and n.phase == "forward"]
    assert sorted(reductions) == ["max", "sum", "sum"]
    g = Graph()
    logits = placeholder(g, "logits", (4, VOCAB), annotation="S1:2@[0,1]")
    labels = placeholder(g, "labels", (4,), torch.int64, annotation="S0:2@[0,1]")
    O.vocab_parallel_cross_entropy(logits, labels)
    with pytest.raises(DeductionError, match="per-token inputs must be whole where the logits' classes are split"):
        deduce(g, 0)


class _WidestVocabRow(TorchDispatchMode):
    """The widest last dim of any tensor an op makes on this thread."""

    def __init__(self):
        super().__init__()
        self.widest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.widest = max(self.widest, t.shape[-1])
        return out


@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_no_rank_makes_a_vocabulary_wider_than_its_share_in_a_llama_step(vocab_parallel):
    """Every tensor any rank makes in a whole training step (forward, backward, update) of a
    DP2 x TP2 Llama is at most vocab / 2 wide in its last dim with the vocabulary-parallel loss;
    the gathered loss (vocab_parallel=False) does make vocab-wide tensors, so the check can fail."""
    config = LlamaConfig(layers=1, hidden=8, ffn=16, vocab=48, heads=2)
    strategy = parse_strategy("layers=1 ; 2x2: R0,1 L0 ; 2x2: R2,3 L0")
    model = build_llama(config, [strategy], vocab_parallel=vocab_parallel)
    rows = strategy.global_batch_size
    gen = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, config.vocab, (rows, 4), generator=gen),
             "labels": torch.randint(0, config.vocab, (rows, 4), generator=gen)}
    job = InProcessJob(model.graph, 0, strategy, symbols={"S": 4, "T": rows * 4})
    widest = {}

    def step(trainer, batch):
        with _WidestVocabRow() as mode:
            out = original(trainer, batch)
        widest[trainer.backend.rank] = mode.widest
        return out

    original = type(next(iter(job.trainers.values()))).step
    for trainer in job.trainers.values():
        trainer.step = lambda b, t=trainer: step(t, b)
    job.step(batch)
    assert len(widest) == 4
    if vocab_parallel:
        assert max(widest.values()) <= config.vocab // 2
    else:
        assert max(widest.values()) == config.vocab


def test_the_llama_loss_is_the_same_with_and_without_vocabulary_parallelism():
    config = LlamaConfig(layers=1, hidden=12, ffn=24, vocab=40, heads=3)  # TP3: 14 + 13 + 13 classes
    strategy = parse_strategy("layers=1 ; 2x1: R0,1,2 L0")
    rows = strategy.global_batch_size
    gen = torch.Generator().manual_seed(2)
    batch = {"tokens": torch.randint(0, config.vocab, (rows, 5), generator=gen),
             "labels": torch.randint(0, config.vocab, (rows, 5), generator=gen)}
    batch["labels"][0, :2] = IGNORE_INDEX
    losses = {}
    for vp in (True, False):
        job = InProcessJob(build_llama(config, [strategy], vocab_parallel=vp).graph, 0, strategy,
                           symbols={"S": 5, "T": rows * 5})
        losses[vp] = [job.step(batch) for _ in range(2)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
