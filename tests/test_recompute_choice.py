"""Recompute by layer and selective recompute: the strategy's syntaxes, what a stage re-runs, the
activation bytes it keeps (measured against no recompute), bit-identical training, and the
planner's memory model and choice. Equivalence with one device is in test_equivalence_llama."""

from __future__ import annotations

import pytest
import torch
import yaml

from hspmd.cluster import ClusterSpec, DeviceType, LinkClass, Node
from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.planning import CostModel
from hspmd.planning.cost import StageShape
from hspmd.planning.model import ModelSpec
from hspmd.planning.search import dp
from hspmd.planning.search.costed import cluster_problem
from hspmd.runtime.execution.run import SELECTIVE_KINDS
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.specialize.strategy import Strategy
from hspmd.specialize.strategy_text import format_strategy, parse_strategy


@pytest.mark.parametrize("text, chosen", [
    ("layers=4 ; 2x1: R0 L0-1 recompute=L1 | R1 L2-3 recompute=selective",
     [((1,), "full"), ((2, 3), "selective")]),
    ("layers=6 ; recompute=selective:L1-4 ; 2x1: R0 L0-2 | R1 L3-5 ; 1x1: R2,3 L0-5",  # straddles the stages
     [((1, 2), "selective"), ((3, 4), "selective"), ((1, 2, 3, 4), "selective")]),
    ("layers=4 ; recompute=L0,3 ; 1x1: R0 L0-1 | R1 L2 | R2 L3", [((0,), "full"), ((), "full"), ((3,), "full")]),
    ("layers=2 ; 1x1: R0 L0-1 recompute", [((0, 1), "full")]),
])
def test_strategy_text_dict_and_yaml_name_the_layers_and_granularity(text, chosen):
    s = parse_strategy(text)
    assert [(st.recomputed_layers, st.recompute_granularity) for p in s.pipelines for st in p.stages] == chosen
    assert parse_strategy(format_strategy(s)) == s
    assert Strategy.from_dict(yaml.safe_load(yaml.safe_dump(s.to_dict()))) == s


@pytest.mark.parametrize("text, message", [
    ("layers=4 ; 1x1: R0 L0-3 recompute=L5", "recompute_layers: 5: the layers to recompute must be some of the stage's"),
    ("layers=4 ; 1x1: R0 L0-3 recompute=fast", "the granularity is one of full, selective"),
    ("layers=4 ; recompute=L9 ; 1x1: R0 L0-3", "layers 9 are not layers of the 4-layer model"),
    ("layers=4 ; recompute=L1 ; 1x1: R0 L0-3 recompute", "given for the stage and for the whole strategy"),
    ("layers=4 ; 1x1: R0 L0-3 recompute=selective:2", "layers are written L<layers>"),
])
def test_bad_recompute_choices_are_named(text, message):
    with pytest.raises(HSPMDError, match=message):
        parse_strategy(text)


def test_a_dict_choice_without_recompute_is_refused_by_field():
    data = parse_strategy("layers=2 ; 1x1: R0 L0-1").to_dict()
    data["pipelines"][0]["stages"][0]["recompute_layers"] = "1"
    with pytest.raises(HSPMDError, match=r"stages\[0\]\.recompute_layers.*does not recompute"):
        Strategy.from_dict(data)


CHOICES = {  # one stage of 4 layers, 2 micro-batches of 4 x 16 tokens under GPipe (both alive at once)
    "none": "layers=4 ; 2x4: R0 L0-3",
    "layers 1-2": "layers=4 ; recompute=L1-2 ; 2x4: R0 L0-3",
    "selective": "layers=4 ; recompute=selective ; 2x4: R0 L0-3",
    "whole stage": "layers=4 ; 2x4: R0 L0-3 recompute",
}


def _run(text: str):
    strategy = parse_strategy(text)
    model = build_llama(LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=32), [strategy], optimizer=AdamW(lr=1e-2))
    job = InProcessJob(model.graph, 0, strategy, schedule="gpipe", symbols={"S": 16, "T": 8 * 16})
    gen = torch.Generator().manual_seed(3)
    batch = {"tokens": torch.randint(0, 32, (8, 16), generator=gen), "labels": torch.randint(0, 32, (8, 16), generator=gen)}
    return job, [job.step(batch)]


def test_each_choice_re_runs_what_it_names_keeps_less_and_trains_bit_identically():
    """Peak activation bytes held between forward and backward (ScheduleRun.peak_held_bytes),
    measured: every choice below no recompute, selective above recomputing half the layers."""
    runs = {name: _run(text) for name, text in CHOICES.items()}
    base_job, base_losses = runs["none"]
    base = base_job.parameters()
    held = {name: job.trainers[0].last_run.peak_held_bytes for name, (job, _) in runs.items()}
    for name, (job, losses) in runs.items():
        assert losses == base_losses, name
        params = job.parameters()
        assert all(torch.equal(params[n], base[n]) for n in base), name
    assert held["whole stage"] < held["layers 1-2"] < held["selective"] < held["none"], held
    # what each re-runs: the named layers' ops only; selective re-runs no matmul and no attention
    exe = runs["none"][0].specialized.executables[0]
    from hspmd.runtime.execution.run import Recompute, recomputable  # noqa: PLC0415 (what the trainer uses)

    def rerun(choice):
        return [ins.node for ins in exe.forward if choice.chooses(ins.node)
                and recomputable(exe, ins, exe.binding, choice.stage)]
    layers = rerun(Recompute.of((0,), (1, 2)))
    assert layers and all(n.name.startswith(("layers.1.", "layers.2.")) for n in layers)
    assert {n.kind for n in layers} >= {"matmul", "rms_normalize", "causal_attention"}
    selective = rerun(Recompute.of((0,), None, "selective"))
    assert selective and {n.kind for n in selective} <= SELECTIVE_KINDS and "rms_normalize" in {n.kind for n in selective}


def test_the_planner_memory_model_knows_layers_and_granularity():
    model = ModelSpec("m", 8, 1024, 4096, 16, 16, 32000, 2048, "float32")
    none, selective, full = (model.layer_activation_bytes(1, 2048, 1, r) for r in (False, "selective", True))
    assert full < selective < none
    cost = CostModel(_one_type(40e9), model)
    acts = {r: cost.memory(StageShape(8, recompute=r, recompute_layers=k), 2).activations
            for r, k in ((False, None), (True, 2), ("selective", None), (True, None))}
    assert acts[False] == 8 * 2 * none and acts[True] == 8 * 2 * full
    assert acts[(True)] < acts["selective"] < acts[False]
    assert cost.memory(StageShape(8, recompute=True, recompute_layers=2), 2).activations == 2 * (6 * none + 2 * full)
    times = [cost.stage_time("gpu", StageShape(8, recompute=r))[1] for r in (False, "selective", True)]
    assert times[0] < times[1] < times[2]


def _one_type(capacity: float) -> ClusterSpec:
    gpu = DeviceType("gpu", (("float32", 100e12),), 2e12, capacity)
    return ClusterSpec((Node("gpu", 2),), (gpu,), (LinkClass("nv", 100e9, 1e-6),), (("gpu", "nv"),), (("*", "nv"),), name="g")


def test_the_planner_chooses_selective_recompute_where_it_fits_and_is_faster():
    """6 GB devices: without recompute the activations do not fit; selective fits and costs less
    than recomputing whole layers, so the planner offered it picks it."""
    model = ModelSpec("m", 8, 1024, 4096, 16, 16, 32000, 2048, "float32")
    cost = CostModel(_one_type(6e9), model)
    chosen = dp(cluster_problem(cost, 8, recompute="selective"))[0]
    kinds = {s.recompute_kind for p in chosen.strategy.pipelines for s in p.stages}
    assert kinds == {"selective"}, format_strategy(chosen.strategy)
    whole = dp(cluster_problem(cost, 8, recompute=True))[0]
    assert chosen.predicted_time < whole.predicted_time
