"""Level 2's memory model (planning/device_memory.py) against the bytes an emulated device counts
while hspmd's interpreter runs the same program (runtime/execution/emulation.py, exact sweeps)."""

import pytest
import torch

from hspmd.backends.local import LocalWorld
from hspmd.cluster import cluster_from_yaml
from hspmd.ir.shapes import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.planning import CostModel, from_llama_config
from hspmd.planning.device_memory import device_memory
from hspmd.planning.device_sim import simulate_specialized
from hspmd.planning.strategy_sim import simulate_strategy
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.emulation import emulated, emulation_of
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.specialized import specialize_graph
from hspmd.specialize.strategy_text import parse_strategy

SEQ = 16
CONFIG = LlamaConfig(vocab=64, hidden=32, heads=4, ffn=64, layers=2)
PAIR = cluster_from_yaml("""
name: pair
device_types:
  cpu: {flops: {float32: 1.0e9}, hbm_bandwidth: 4.0e9, hbm_capacity: 1.0e9}
links:
  host: {bandwidth: 1.0e9, latency: 1.0e-5}
nodes: [{type: cpu, devices: 2}]
intra: {cpu: host}
inter: host
emulate: {reference: cpu, memory_scale: 1.0, links: false}
""")
STRATEGIES = {  # data parallel with buckets and accumulation, tensor parallel, a 1F1B and a GPipe pipeline
    "DP2": ("layers=2 ; 2x2: R0 L0-1 ; 2x2: R1 L0-1", "1f1b"),
    "TP2": ("layers=2 ; 2x4: R0,1 L0-1", "1f1b"),
    "PP2 1F1B": ("layers=2 ; 4x2: R0 L0 | R1 L1", "1f1b"),
    "PP2 GPipe": ("layers=2 ; 4x2: R0 L0 | R1 L1", "gpipe"),
}


def counted_peak(text: str, schedule: str) -> dict[int, tuple[int, int]]:
    """Each rank's exact peak live bytes over one step (after a warm-up step), and what stays after it."""
    strategy = parse_strategy(text)
    layout = MicroBatchLayout.of(strategy)
    gen = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, CONFIG.vocab, (layout.global_batch_size, SEQ), generator=gen) for k in ("tokens", "labels")}

    def body(backend):
        trainer = Trainer(build_llama(CONFIG, [strategy]).graph, 0, emulated(backend, PAIR), layout, schedule=schedule,
                          symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})
        trainer.step(batch)
        device = emulation_of(trainer.backend)
        device.sweep_every, device.peak_bytes = 1, 0
        trainer.step(batch)
        return device.stats().peak_bytes, device.live_bytes

    return LocalWorld(range(2)).run(body)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_level2_memory_is_what_the_interpreter_holds(name):
    text, schedule = STRATEGIES[name]
    strategy = parse_strategy(text)
    layout = MicroBatchLayout.of(strategy)
    binding = Binding.of({"B": sum(layout.sizes), "S": SEQ, "T": layout.global_batch_size * SEQ}, ratios=layout.sizes)
    spec = specialize_graph(build_llama(CONFIG, [strategy]).graph, 0, binding)
    cost = CostModel(PAIR, from_llama_config(CONFIG, SEQ))
    predicted = simulate_specialized(spec, cost, dict(enumerate(layout.counts)), schedule).peak_memory
    for rank, (peak, kept) in counted_peak(text, schedule).items():
        assert device_memory(spec.executables[rank], spec.binding).static == kept  # what stays between steps, exactly
        assert abs(predicted[rank] - peak) <= 0.10 * peak, (name, rank, predicted[rank], peak)
    # level 1 counts a layer's kept activations as autograd would: well under what the interpreter holds
    assert max(simulate_strategy(strategy, cost, schedule).peak_memory.values()) < 0.9 * max(predicted.values())
