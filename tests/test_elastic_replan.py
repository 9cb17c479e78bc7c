"""Recovery on the real hardware: under a two-type cluster file (`hspmd run --elastic --cluster`) the
survivors of an H800 rank's death move to the strategy planning.replan gives for that cluster and
the model, not to recover_strategy's every-device-equal fallback."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import pytest

from hspmd.cluster import parse_cluster
from hspmd.cluster.emulation import CLUSTER_ENV
from hspmd.models.llama import LlamaConfig
from hspmd.planning.model import from_llama_config
from hspmd.runtime.processes.launcher import launch
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from hspmd.switching import recover_strategy
from tests.cluster_files import H800_H20_TWO_NODES
from tests.example_modules import example_module

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "examples" / "llama" / "train.py")
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--seq", "8", "--log-every", "1"]
STRATEGY = "name=hetero-4 ; layers=4 ; 2x4: R0,1 L0-3 ; 2x2: R2 L0-1 | R3 L2-3"


def test_an_h800_death_recovers_to_the_strategy_replan_gives_for_the_cluster(tmp_path):
    token_files = example_module("llama").token_files  # the example's own data: its vocabulary sizes the model replan prices

    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(H800_H20_TWO_NODES)
    cluster = parse_cluster(str(cluster_file))
    assert cluster.device_type(0).name == "H800"
    vocab = token_files(argparse.Namespace(data=None)).vocab
    model = from_llama_config(LlamaConfig(vocab=vocab, hidden=16, layers=4, heads=2, ffn=32), seq_len=8)
    strategy = parse_strategy(STRATEGY)
    on_cluster = format_strategy(recover_strategy(strategy, {0}, cluster=cluster, model=model))
    all_equal = format_strategy(recover_strategy(strategy, {0}))
    assert on_cluster != all_equal  # the test tells them apart

    summary = tmp_path / "summary.json"
    out = io.StringIO()
    code = launch([sys.executable, SCRIPT, "--steps", "3", *SMALL, "--strategy", STRATEGY, "--kill", "2=0:1",
                   "--summary", str(summary), "--checkpoint", str(tmp_path / "c.safetensors")], 4, stdout=out,
                  stderr=out, elastic=True, env={CLUSTER_ENV: str(cluster_file)})
    assert code == 0, out.getvalue()
    result = json.loads(summary.read_text())
    assert [f["ranks"] for f in result["failures"]] == [[0]], out.getvalue()
    assert result["final_strategy"] == on_cluster, (result["final_strategy"], on_cluster)
    assert len(result["losses"]) == 3
