"""Specialization end to end on the paper's strategies (built from the generator, not run):
pipeline discovery from the specialized graphs' CommOps, and per-device programs."""

import pytest

from hspmd.ir import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.specialize.deduce import deduce
from hspmd.specialize.paper_strategies import paper_strategy
from hspmd.specialize.pipelines import expected_pipelines
from hspmd.specialize.specialized import specialize_graph

_CACHE = {}


def _specialized(key, device):
    strategy = paper_strategy(key)
    if key not in _CACHE:
        config = LlamaConfig(layers=strategy.num_layers, hidden=32, heads=4, ffn=64, vocab=64)
        model = build_llama(config, [strategy])
        _CACHE[key] = (model, deduce(model.graph, 0))
    model, deduced = _CACHE[key]
    ratios = strategy.micro_batch_ratios
    binding = Binding.of({"B": sum(ratios), "S": 16, "T": 4096}, ratios=ratios)
    return strategy, specialize_graph(model.graph, 0, binding, devices=[device], deduced=deduced)


@pytest.mark.parametrize("key, device", [("table7_c1", 5), ("table7_c2", 30), ("table5_32b_16h800_32h20", 40)])
def test_discovered_pipelines_match_the_strategy(key, device):
    strategy, spec = _specialized(key, device)
    assert [p.stages for p in spec.pipelines] == [p.stages for p in expected_pipelines(strategy)]
    assert all(p.is_chain for p in spec.pipelines)


def test_c2_structure_and_the_lone_last_stage_program():
    strategy, spec = _specialized("table7_c2", 30)
    assert [len(p.stages) for p in spec.pipelines] == [4, 5]
    assert spec.pipelines[1].stages[-2:] == ((28, 29), (30,))
    exe = spec.executables[30]
    names = {i.node.name for i in exe.forward}
    assert "layers.59.wq" in names and "layers.0.wq" not in names and "embed" not in names
    # the stage boundary into layer 56 is a receive on device 30, and its backward a send
    boundary = [i for i in exe.forward if i.node.name == "layers.55.out"]
    assert boundary and boundary[0].role == "recv"
    back = [i for i in exe.backward if i.node.name == "grad.layers.55.out"]
    assert back and back[0].role == "send"
    # no TP partner: every forward comm is identity, local or P2P
    assert {i.role for i in exe.forward if i.node.opdef.is_comm} <= {"identity", "local", "recv"}
    text = str(exe)
    assert "executable graph of device 30" in text and "update" in text


def test_table5_stage_devices_collect_their_tp_group_and_sync_across_pipelines():
    strategy, spec = _specialized("table5_32b_16h800_32h20", 40)
    exe = spec.executables[40]
    assert spec.locate(40) == (3, 0)
    collectives = [i for i in exe.forward if i.role == "collective"]
    assert collectives
    groups = {c.devices for i in collectives for s in exe.plan(i.node, spec.binding).steps for c in s.collectives}
    assert (40, 41, 42, 43) in groups
    sync = [i for i in exe.update if i.node.name == "layers.0.wq.grad_sync"]
    assert sync and sync[0].role == "collective"
    plan = exe.plan(sync[0].node, spec.binding)
    assert "SplitReduceScatter" in plan.primitives  # ZeRO-1 across the four pipelines
