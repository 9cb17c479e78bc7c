"""The Llama example under the launcher (`hspmd run -n 4 examples/llama/train.py`): it trains,
writes a checkpoint that --resume continues from, and a misconfigured job fails with the rank's
own error. Tiny dimensions keep each launch to a few seconds."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from hspmd.runtime.processes.launcher import launch

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "llama" / "train.py"
TINY = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--seq", "8"]


def _run(tmp_path: Path, nprocs: int, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = launch([sys.executable, str(SCRIPT), *TINY, *args], nprocs, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_example_trains_saves_and_resumes_under_the_launcher(tmp_path):
    checkpoint, summary = tmp_path / "ckpt.safetensors", tmp_path / "summary.json"
    code, out, err = _run(tmp_path, 4, "--steps", "2", "--checkpoint", str(checkpoint), "--summary", str(summary))
    assert code == 0, err
    first = json.loads(summary.read_text())
    assert first["start_step"] == 0 and len(first["losses"]) == 2
    assert all(math.isfinite(loss) for loss in first["losses"])
    assert "[rank 0]   1: [2] -> [3]" in out  # the discovered pipelines are printed
    assert "[rank 2] rank 2: pipeline 1" in out and "1f1b: F0 F1 B0 B1" in out
    with safe_open(str(checkpoint), framework="pt") as f:
        assert f.metadata()["hspmd.step"] == "2"
        assert {"embed", "lm_head", "layers.3.w_down", "layers.3.w_down.exp_avg"} <= set(f.keys())

    code, out, err = _run(tmp_path, 4, "--steps", "3", "--checkpoint", str(checkpoint), "--summary", str(summary),
                          "--resume", "--schedule", "gpipe")
    assert code == 0, err
    resumed = json.loads(summary.read_text())
    assert resumed["start_step"] == 2 and len(resumed["losses"]) == 1
    assert f"resumed from {checkpoint} at step 2" in out
    with safe_open(str(checkpoint), framework="pt") as f:
        assert f.metadata()["hspmd.step"] == "3"


def test_a_job_with_too_few_ranks_fails_with_the_ranks_error(tmp_path):
    code, _, err = _run(tmp_path, 2, "--steps", "1", "--checkpoint", str(tmp_path / "never.safetensors"))
    assert code != 0
    assert "uses devices [0, 1, 2, 3] but the job has ranks 0-1" in err
    assert "hspmd run -n 4" in err
