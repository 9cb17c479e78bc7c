"""Context parallelism (CP) in the Llama: a stage's sequence split across CP groups (Stage.cp,
ring / all-gather / all-to-all attention, uneven shares) trains exactly like one device: loss and
every synchronised gradient on each step, and the weights after them, against the independent
torch reference, in-process and on 4 gloo processes. Tokens are fed in the ring's head + tail
order with their positions (ops.context.head_tail_order); the loss does not depend on the order."""

from __future__ import annotations

import pytest
import torch

from hspmd.backends.local import LocalWorld
from hspmd.errors import HSPMDError, StrategyError
from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.ops.context import head_tail_order, in_token_order
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.packing import counted_tokens, pack_row
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.programs.compiling import compile_programs
from hspmd.runtime.programs.runner import ProgramRunner
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.program import DeviceProgram
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

SEQ, STEPS, LR = 16, 2, 1e-3


def _setup(text, seq, compute_dtype=torch.float32, reference=True, **options):
    strategy = parse_strategy(text)
    config = LlamaConfig(layers=strategy.num_layers, **options)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=LR), compute_dtype=compute_dtype)
    layout = MicroBatchLayout.of(strategy)
    rows = layout.global_batch_size
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, config.vocab, (rows, seq), generator=gen),
                torch.randint(0, config.vocab, (rows, seq), generator=gen)) for _ in range(STEPS)]
    history = final = None
    if reference:
        initial = {n.name: initial_value(n) for n in model.graph.parameters}
        history, final = reference_training(initial, lambda step: batches[step], config.layers, config.heads, STEPS, lr=LR,
                                            compute_dtype=compute_dtype)
    balanced = any(s.cp_shares is None for p in strategy.pipelines for s in p.stages)
    order = head_tail_order(seq, strategy.max_cp) if balanced else torch.arange(seq)
    feeds = [in_token_order({"tokens": t, "labels": y}, order) for t, y in batches]
    return strategy, model, layout, feeds, history, final


def _compare(loss, gradients, ref_loss, ref_grads, exact=True):
    if exact:
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    else:
        assert loss == pytest.approx(ref_loss, rel=3e-3)
    assert set(gradients) == set(ref_grads)
    for name, grad in ref_grads.items():
        if exact:
            scale = float(grad.abs().max())
            torch.testing.assert_close(gradients[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
        else:
            assert float((gradients[name] - grad).norm() / grad.norm()) < 5e-2, name


STRATEGIES = {
    "cp2 ring": "1x2: R0,1 L0-1 cp2",
    "cp4 ring": "1x2: R0-3 L0-1 cp4",
    "cp2 all_to_all": "1x2: R0,1 L0-1 cp2 ; cp_attention=all_to_all",
    "cp2 all_gather": "1x2: R0,1 L0-1 cp2 ; cp_attention=all_gather",
    "cp2 x tp2": "1x2: R0-3 L0-1 cp2",
    "cp2 with pp2 1f1b": "2x1 1f1b: R0,1 L0 cp2 | R2,3 L1 cp2",
    "cp2 x dp2": "1x1: R0,1 L0-1 cp2 ; 1x1: R2,3 L0-1 cp2",
    "cp2 shares 3:1": "1x2: R0,1 L0-1 cp2=3,1",
    "cp4 explicit token counts": "1x1: R0-3 L0-1 cp4=32,10,11,11",
}


@pytest.mark.equivalence
@pytest.mark.parametrize("case", sorted(STRATEGIES))
def test_context_parallel_training_equals_one_device(case):
    seq = 64 if "explicit" in case else SEQ  # 1024/340/341/343 scaled down to 64 tokens
    options = dict(kv_heads=2) if "tp2" in case else {}
    strategy, model, layout, feeds, history, final = _setup(STRATEGIES[case], seq, **options)
    rows = layout.global_batch_size
    job = InProcessJob(model.graph, 0, layout, symbols={"S": seq, "T": rows * seq})
    for step in range(STEPS):
        loss = job.step(feeds[step])
        _compare(loss, job.gradients(), *history[step])
    params = job.parameters()
    for name, value in final.items():
        assert_weights_close(params[name], value, LR, name)


@pytest.mark.equivalence
def test_context_parallel_bf16_with_fp32_masters():
    """bf16 compute, fp32 master weights: against the bf16 reference at bf16's rounding (the ring
    sums blocks in another order than one softmax; see test_mixed_precision)."""
    strategy, model, layout, feeds, history, final = _setup("1x2: R0-3 L0-1 cp2", SEQ, torch.bfloat16)
    job = InProcessJob(model.graph, 0, layout, symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
    for step in range(STEPS):
        loss = job.step(feeds[step])
        _compare(loss, job.gradients(), *history[step], exact=False)
    assert {p.dtype for p in job.parameters().values()} == {torch.float32}


def _packed_setup(text, reference=True):
    """Rows packing several sequences (positions restart, segments mask), one packed row per
    micro-batch: per step, the pipeline's rows and the step's token count."""
    strategy = parse_strategy(text)
    config = LlamaConfig(layers=2)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=LR), packed=True)
    gen = torch.Generator().manual_seed(3)
    lengths = [[3, 5, 2, 4, 6], [7, 2, 3, 1]]
    seqs = []
    for step_lengths in lengths:
        ids = [torch.randint(0, config.vocab, (n + 1,), generator=gen) for n in step_lengths]
        seqs.append([(t[:-1], t[1:]) for t in ids])
    rows_of = [[[0, 1, 2], [3, 4]], [[0], [1, 2, 3]]]
    steps = [([[pack_row([seqs[step][i] for i in row], sum(len(seqs[step][i][0]) for i in row) + 1)
                for row in rows_of[step]]], {"T": counted_tokens(seqs[step])}) for step in range(STEPS)]
    history = final = None
    if reference:
        initial = {n.name: initial_value(n) for n in model.graph.parameters}
        history, final = reference_training(initial, lambda s: list(seqs[s]), config.layers, config.heads, STEPS, lr=LR)
    return model, steps, history, final


PACKED = "layers=2 ; ?x?: R0,1 L0-1 cp2"


@pytest.mark.equivalence
def test_packed_rows_under_context_parallelism():
    """Rows packing several sequences split across CP groups."""
    model, steps, history, final = _packed_setup(PACKED)
    job = InProcessJob(model.graph, 0, MicroBatchLayout((1,), (1,)), symbols={"S": 4, "T": 4})
    for step, (rows, symbols) in enumerate(steps):
        loss = job.world.run(lambda b: job.trainers[b.rank].step_rows(rows, symbols))[0]
        _compare(loss, job.gradients(), *history[step])
    params = job.parameters()
    for name, value in final.items():
        assert_weights_close(params[name], value, LR, name)


def test_strategies_disagreeing_on_cp_attention_are_refused():
    config = LlamaConfig(layers=2)
    a, b = parse_strategy("1x1: R0,1 L0-1 cp2"), parse_strategy("1x1: R0,1 L0-1 cp2 ; cp_attention=all_to_all")
    with pytest.raises(HSPMDError, match="attention differs"):
        build_llama(config, [a, b])
    with pytest.raises(StrategyError, match="need a single pipeline"):
        build_llama(config, [parse_strategy("1x1: R0,1 L0-1 cp2=3,1 ; 1x1: R2,3 L0-1 cp2")])


def test_head_tail_order_balances_the_ring():
    order = head_tail_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    shares = order.reshape(4, 4)
    causal_work = [int((row + 1).sum()) for row in shares]  # keys each rank's queries see
    assert max(causal_work) == min(causal_work)
    assert head_tail_order(7, 2).numel() == 7 and head_tail_order(0, 3).numel() == 0


# The acceptance's cases on 4 gloo processes, in ONE launch (each start costs seconds): name ->
# (strategy, sequence length, compute dtype, model options). A strategy on fewer devices leaves the
# other ranks idle. The explicit shares are Hetu's 1024/340/341/343 scaled down to 64 tokens.
GLOO_CASES = {
    "cp4 ring": ("1x2: R0-3 L0-1 cp4", SEQ, torch.float32, {}),
    "cp2 with pp2 1f1b": ("2x1 1f1b: R0,1 L0 cp2 | R2,3 L1 cp2", SEQ, torch.float32, {}),
    "cp2 all_to_all": ("1x2: R0,1 L0-1 cp2 ; cp_attention=all_to_all", SEQ, torch.float32, {}),
    "cp2 x tp2": ("1x2: R0-3 L0-1 cp2", SEQ, torch.float32, {"kv_heads": 2}),
    "cp2 shares 3:1": ("1x2: R0,1 L0-1 cp2=3,1", SEQ, torch.float32, {}),
    "cp2 shares 3:1 x tp2": ("1x2: R0-3 L0-1 cp2=3,1", SEQ, torch.float32, {}),
    "cp4 explicit token counts": ("1x1: R0-3 L0-1 cp4=32,10,11,11", 64, torch.float32, {}),
    "bf16 compute, fp32 masters": ("1x2: R0-3 L0-1 cp2", SEQ, torch.bfloat16, {}),
}
GLOO_PACKED = "layers=2 ; ?x?: R0-3 L0-1 cp4"


def _gloo_rank(backend):
    """Every case in turn on this rank: per case, each step's (loss, gradients) and the final
    weights (gradients and weights whole on rank 0, None elsewhere)."""
    torch.set_num_threads(1)
    results = {}
    for case, (text, seq, dtype, options) in GLOO_CASES.items():
        _, model, layout, feeds, _, _ = _setup(text, seq, dtype, reference=False, **options)
        trainer = Trainer(model.graph, 0, backend, layout, symbols={"S": seq, "T": layout.global_batch_size * seq})
        steps = [(trainer.step(feeds[step]), trainer.gradients()) for step in range(STEPS)]
        results[case] = steps, _weights(trainer)
    model, packed_steps, _, _ = _packed_setup(GLOO_PACKED, reference=False)
    trainer = Trainer(model.graph, 0, backend, MicroBatchLayout((1,), (1,)), symbols={"S": 4, "T": 4})
    steps = [(trainer.step_rows(rows, symbols), trainer.gradients()) for rows, symbols in packed_steps]
    results["packed rows cp4"] = steps, _weights(trainer)
    return results


def _weights(trainer):
    weights = trainer.state_dict()
    return None if weights is None else {k: v for k, v in weights.items() if "exp_avg" not in k}


@pytest.fixture(scope="module")
def gloo_results():
    return run_multiprocess(_gloo_rank, 4, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.xdist_group("gloo")
@pytest.mark.parametrize("case", [*GLOO_CASES, "packed rows cp4"])
def test_context_parallel_on_gloo_processes(gloo_results, case):
    if case in GLOO_CASES:
        text, seq, dtype, options = GLOO_CASES[case]
        *_, history, final = _setup(text, seq, dtype, **options)
    else:
        _, _, history, final = _packed_setup(GLOO_PACKED)
    exact = dtype == torch.float32 if case in GLOO_CASES else True
    steps, weights = gloo_results[0][case]
    for step in range(STEPS):
        losses = [r[case][0][step][0] for r in gloo_results if r[case][0][step][0] is not None]
        assert len(losses) >= 2 and all(loss == losses[0] for loss in losses)  # every working rank reports it
        _compare(losses[0], steps[step][1], *history[step], exact=exact)
    if exact:
        for name, value in final.items():
            assert_weights_close(weights[name], value, LR, name)
    else:
        assert {w.dtype for w in weights.values()} == {torch.float32}


@pytest.mark.parametrize("text", ["1x2: R0,1 L0-1 cp2", "1x1: R0,1 L0-1 cp2=3,1"], ids=["ring", "uneven"])
def test_context_parallel_programs_run_like_the_trainer(text):
    """Per-device programs (through JSON) of a CP strategy: the same losses as the graph-based
    Trainer, step after step (ring blocks, rotated layouts and uneven shares are plain data)."""
    strategy, model, layout, feeds, _, _ = _setup(text, SEQ)
    symbols = {"S": SEQ, "T": layout.global_batch_size * SEQ}
    programs = compile_programs(model.graph, 0, layout, "1f1b", symbols, world_size=2)
    world = LocalWorld(range(2))
    runners = world.run(lambda b: ProgramRunner(DeviceProgram.from_json(programs[b.rank].to_json()), b))
    trainers = world.run(lambda b: Trainer(model.graph, 0, b, layout, "1f1b", symbols))
    for batch in feeds:
        got = world.run(lambda b: runners[b.rank].step(batch))
        want = world.run(lambda b: trainers[b.rank].step(batch))
        assert got == want and got[0] is not None


def test_cp_in_the_strategy_syntaxes():
    from hspmd.specialize.strategy import Strategy
    from hspmd.specialize.strategy_render import describe_strategy, strategy_map_text
    from hspmd.specialize.strategy_text import StrategySyntaxError, format_strategy

    s = parse_strategy("1x1: R0-3 L0 cp2=3,1 | R4,5 L1 cp2 ; cp_attention=all_gather")
    first = s.pipelines[0].stages[0]
    assert (first.cp, first.tp, first.cp_shares, first.cp_groups) == (2, 2, (3, 1), ((0, 1), (2, 3)))
    assert s.max_cp == 2 and s.cp_attention == "all_gather"
    assert parse_strategy(format_strategy(s)) == s and Strategy.from_dict(s.to_dict()) == s
    assert "2 (3:1)" in describe_strategy(s) and "TP2xCP2(3:1)" in strategy_map_text(s)
    for bad, what in (("1x1: R0-2 L0-1 cp2", "positive divisor"), ("1x1: R0-3 L0-1 cp2=1,2,3", "one per CP position"),
                      ("1x1: R0-3 L0-1 cp2 ; cp_attention=zigzag", "must be one of"),
                      ("1x1: R0-3 L0-1 cp2=0,1", "shares must be integers")):
        with pytest.raises(StrategySyntaxError, match=what):
            parse_strategy(bad)
