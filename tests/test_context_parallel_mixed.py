"""Mixed-length training with a context-parallel pool entry (Hetu v2 section 7.3 with CP): steps
whose longest sequence is long run a CP4 strategy (one pipeline, the packed row split along the
sequence across 4 ranks), the others two 2-stage pipelines, switching through the fused BSR,
pipelines included (which Megatron's dynamic CP refuses). Per-step losses and the final weights
equal single-device torch over the same sequences."""

import pytest
import torch

from hspmd.backends.local import LocalWorld
from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.planning.dispatch import PipelineCost, PoolEntry
from hspmd.runtime.policies.mixed import MixedLengthTrainer
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import assert_weights_close

LR = 1e-2
CONFIG = dict(layers=2, vocab=32, hidden=16, heads=2, ffn=32)
CP4 = "layers=2 ; ?x?: R0-3 L0-1 cp4"
PP2 = "layers=2 ; ?x?: R0 L0 | R1 L1 ; ?x?: R2 L0 | R3 L1"
THRESHOLD = 12
POOL = (
    PoolEntry("CP4", 0, 64, (PipelineCost(1e-3, 0.25, 0.25, 64),)),
    PoolEntry("PP2", 1, THRESHOLD, (PipelineCost(2e-3, 0.5, 0.5, 16, 2), PipelineCost(2e-3, 0.5, 0.5, 16, 2))),
)
STEPS = ([30, 5, 3], [10, 6, 3, 8], [21, 9, 2])
EXPECTED = ["CP4", "PP2", "CP4"]


def _sequences():
    gen = torch.Generator().manual_seed(5)
    out = []
    for lengths in STEPS:
        ids = [torch.randint(0, CONFIG["vocab"], (n + 1,), generator=gen) for n in lengths]
        out.append([(t[:-1], t[1:]) for t in ids])
    return out


def _graph():
    return build_llama(LlamaConfig(**CONFIG), [parse_strategy(s) for s in (CP4, PP2)], optimizer=AdamW(lr=LR),
                       packed=True)


def _rank(backend):
    trainer = MixedLengthTrainer(_graph().graph, POOL, backend, symbols={"S": 8, "T": 8}, passes=10)
    losses = [trainer.step(samples) for samples in _sequences()]
    return losses, trainer.parameters(), [[POOL[k].name for k in r.entries] for r in trainer.history]


@pytest.mark.equivalence
def test_a_cp_pool_entry_for_long_steps_equals_one_device():
    results = LocalWorld(range(4), 120).run(_rank)
    losses, params, chosen = results[0]
    assert [names[0] for names in chosen] == EXPECTED
    model = _graph()
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    data = _sequences()
    history, final = reference_training(initial, lambda s: list(data[s]), CONFIG["layers"], CONFIG["heads"],
                                        len(data), lr=LR)
    for step, (loss, (ref_loss, _)) in enumerate(zip(losses, history)):
        assert loss == pytest.approx(ref_loss, abs=1e-5, rel=1e-5), step
    for name, value in final.items():
        assert_weights_close(params[name], value, LR, name)
