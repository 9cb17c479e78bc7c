"""End to end (the end-to-end planning check): a 4-rank cluster of two device types (one 2.5x faster) planned by each
search; every plan trains on 4 gloo processes with the losses and weights of one device."""

from __future__ import annotations

import pytest
import torch

from hspmd.cluster import ClusterSpec, DeviceType, LinkClass, Node
from hspmd.planning import CostModel
from hspmd.planning.model import ModelSpec
from hspmd.planning.search import dfs, dp, mcts
from hspmd.planning.search.costed import cluster_problem
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from tests.test_multiprocess_training import CONFIG, SEQ, _weights, assert_matches_reference, batches, make_trainer, train

LAYERS, BATCH = 6, 4


def two_type_cluster() -> ClusterSpec:
    fast = DeviceType("fast", (("float32", 2.5e12),), 2.5e12, 1e9)
    slow = DeviceType("slow", (("float32", 1e12),), 1e12, 2e9)
    link = LinkClass("net", 10e9, 1e-6)
    return ClusterSpec((Node("fast", 2), Node("slow", 2)), (fast, slow), (link,),
                       (("fast", "net"), ("slow", "net")), (("*", "net"),), name="fast2+slow2")


def planned_texts() -> dict[str, str]:
    model = ModelSpec("tiny", LAYERS, CONFIG["hidden"], CONFIG["ffn"], CONFIG["heads"], CONFIG["heads"],
                      CONFIG["vocab"], SEQ, "float32")
    problem = cluster_problem(CostModel(two_type_cluster(), model), BATCH)
    plans = {"dp": dp(problem)[0], "dfs": dfs(problem)[0], "mcts": mcts(problem, iterations=500)[0]}
    return {name: f"layers={LAYERS} ; " + format_strategy(p.strategy).split(";", 1)[1] for name, p in plans.items()}


def planned_rank(backend, texts):
    torch.set_num_threads(1)
    out = {}
    for name, text in texts.items():
        trainer = make_trainer(backend, text, "1f1b")
        out[name] = (train(trainer, batches(text, 2, seed=5)), _weights(trainer.state_dict()))
    return out


@pytest.mark.multiprocess
def test_each_search_plans_a_strategy_that_trains_like_one_device():
    texts = planned_texts()
    results = run_multiprocess(planned_rank, 4, texts, timeout=300)
    for name, text in texts.items():
        losses, weights = results[0][name]
        assert all(r[name][0] == losses for r in results), name
        assert_matches_reference(losses, weights, batches(text, 2, seed=5), layers=LAYERS)


def test_plans_use_every_device_and_give_the_fast_type_more_layers():
    for name, text in planned_texts().items():
        strategy = parse_strategy(text)
        assert strategy.all_ranks == (0, 1, 2, 3), name
        layers = {r: len(s.layers) for p in strategy.pipelines for s in p.stages for r in s.ranks}
        assert layers[0] + layers[1] > layers[2] + layers[3], name
