"""`make gpu-check` skips cleanly on a machine without a CUDA GPU (CI never has one)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: `make gpu-check` runs for real there")
def test_gpu_check_skips_cleanly_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == ["gpu-check: skipped (no CUDA GPU on this machine)"]
