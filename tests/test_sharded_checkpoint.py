"""Sharded checkpoints: every rank writes only the pieces it is the first holder of (replicas once),
in the background; a job under another strategy loads them reading only the boxes each rank needs;
`hspmd checkpoint inspect / consolidate`."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hspmd.cli import main as cli_main
from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.persistence.checkpoint import STEP_KEY
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.persistence.sharded_checkpoint import ShardedReader
from hspmd.specialize.strategy_text import parse_strategy

CONFIG = dict(vocab=32, hidden=16, heads=2, ffn=32)
SEQ = 8
HETERO = "layers=4 ; 2x2: R0,1 L0-3 ; 3x1: R2 L0-1 | R3 L2-3"
PP3 = "layers=4 ; 7x1: R0 L0-1 | R1 L2 | R2 L3"  # same 7 rows per step, other devices and cuts


def _job(strategies, index):
    model = build_llama(LlamaConfig(layers=4, **CONFIG), strategies, optimizer=AdamW(lr=1e-2))
    rows = MicroBatchLayout.of(strategies[index]).global_batch_size
    return InProcessJob(model.graph, index, strategies[index], symbols={"S": SEQ, "T": rows * SEQ}, ranks=4)


def _train(job, steps):
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = (torch.randint(0, CONFIG["vocab"], (7, SEQ), generator=gen) for _ in range(2))
        job.step({"tokens": x, "labels": y})


def _save(job, directory):
    pending = job.world.run(lambda b: job.trainers[b.rank].save_sharded(directory))
    for p in pending.values():
        if p is not None:
            p.wait(60)


def _state(job):
    return job.world.run(lambda b: job.trainers[b.rank].state_dict())[0]


def test_each_rank_writes_its_own_pieces_once_and_any_strategy_loads_reading_only_what_it_needs(tmp_path):
    strategies = [parse_strategy(HETERO), parse_strategy(PP3)]
    job = _job(strategies, 0)
    _train(job, 2)
    _save(job, tmp_path)
    saved = _state(job)
    folder = tmp_path / "step-00000002"
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert files == [f"rank-{r}.safetensors" for r in range(4)]
    # replicas are written once: the files together hold every tensor exactly once
    total = sum(v.numel() for f in files for v in load_file(str(folder / f)).values())
    assert total == sum(v.numel() for v in saved.values())
    # rank 2 holds layers 0-1 only (pipeline 1, stage 1) and TP rank 1 only halves it is first to hold
    assert not any(k.startswith("layers.3.") for k in load_file(str(folder / "rank-2.safetensors")))

    other = _job(strategies, 1)
    steps = other.world.run(lambda b: 0 if other.trainers[b.rank].idle else other.trainers[b.rank].load_checkpoint(tmp_path))
    assert set(steps.values()) <= {0, 2} and steps[0] == 2
    loaded = _state(other)
    assert set(loaded) == set(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def test_a_reader_reads_only_the_intersecting_boxes(tmp_path):
    job = _job([parse_strategy(HETERO)], 0)
    _save(job, tmp_path)
    reader = ShardedReader.open(tmp_path)
    shape = tuple(reader.index["tensors"]["layers.0.wq"]["shape"])
    part = reader("layers.0.wq", ((0, shape[0]), (0, shape[1] // 4)), shape)
    assert tuple(part.shape) == (shape[0], shape[1] // 4)
    assert reader.bytes_read == part.numel() * part.element_size()
    whole = reader("layers.0.wq", (), shape)
    assert torch.equal(whole[:, : shape[1] // 4], part)


def test_inspect_and_consolidate(tmp_path, capsys):
    job = _job([parse_strategy(HETERO)], 0)
    _train(job, 1)
    _save(job, tmp_path / "ckpt")
    saved = _state(job)
    assert cli_main(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert "step 1" in text and "rank-3.safetensors" in text and "layers.0.wq" in text
    out = tmp_path / "whole.safetensors"
    assert cli_main(["checkpoint", "consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    whole = load_file(str(out))
    assert set(whole) == set(saved) and all(torch.equal(whole[k], saved[k]) for k in saved)
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()[STEP_KEY] == "1"


def test_a_directory_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(HSPMDError, match="not a sharded hspmd checkpoint"):
        ShardedReader.open(tmp_path)
    assert cli_main(["checkpoint", "inspect", str(tmp_path)]) == 2


def test_the_checkpoint_tool_leaves_error_reporting_to_the_cli_wrapper(tmp_path, capsys):
    """One place turns an HSPMDError into `hspmd: error: ...` and exit 2 (hspmd.cli.main)."""
    from hspmd.runtime.persistence.checkpoint_tool import main as tool_main

    with pytest.raises(HSPMDError, match="not a sharded hspmd checkpoint"):
        tool_main(["inspect", str(tmp_path)])
    assert cli_main(["checkpoint", "inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("hspmd: error: ")


def test_latest_names_this_runs_newest_save_not_a_later_step_an_earlier_run_left(tmp_path):
    from hspmd.runtime.persistence import sharded_checkpoint

    first = _job([parse_strategy(HETERO)], 0)
    _train(first, 3)
    _save(first, tmp_path)
    sharded_checkpoint._NEWEST.clear()  # a new process: a new run into the same directory
    second = _job([parse_strategy(HETERO)], 0)
    _train(second, 1)
    _save(second, tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert ShardedReader.open(tmp_path).step == 1
    _train(second, 1)
    _save(second, tmp_path)
    assert ShardedReader.open(tmp_path).step == 2


@pytest.mark.parametrize("damage", ["index-json", "index-entry", "latest", "rank-file", "truncated"])
def test_a_damaged_sharded_checkpoint_is_a_checkpoint_error_naming_the_file(tmp_path, damage):
    from hspmd.errors import CheckpointError

    job = _job([parse_strategy(HETERO)], 0)
    _save(job, tmp_path)
    folder = tmp_path / "step-00000000"
    index = folder / "index.json"
    named = {"index-json": "index.json", "index-entry": "index.json", "latest": "step-00000009",
             "rank-file": "rank-1.safetensors", "truncated": "rank-1.safetensors"}[damage]
    if damage == "index-json":
        index.write_text("{not json")
    elif damage == "index-entry":
        index.write_text(index.read_text().replace('"dtype": "float32"', '"dtype": "float33"', 1))
    elif damage == "latest":
        (tmp_path / "latest").write_text("step-00000009")
    elif damage == "rank-file":
        (folder / "rank-1.safetensors").unlink()
    else:
        data = (folder / "rank-1.safetensors").read_bytes()
        (folder / "rank-1.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=named):
        ShardedReader.open(tmp_path).whole()


def test_a_rank_file_an_earlier_job_left_at_the_same_step_never_counts_as_written(tmp_path):
    """Job two saves step 0 where job one saved it, but rank 1 dies before writing: the index writer
    does not take job one's rank-1 file for job two's, and the old index, whose files job two
    replaced, is refused by name instead of loading a mix of the two jobs."""
    from hspmd.errors import CheckpointError
    from hspmd.runtime.persistence.sharded_checkpoint import save_sharded

    first = _job([parse_strategy(HETERO)], 0)
    _save(first, tmp_path)
    second = _job([parse_strategy(HETERO)], 0)
    _train(second, 1)
    assert first.world.backends[0].job != second.world.backends[0].job
    assert len({b.job for b in second.world.backends.values()}) == 1

    def all_but_rank_1(backend):
        t = second.trainers[backend.rank]
        t.state.step = 0
        if backend.rank != 1:
            save_sharded(t.exe, dict(t.state.leaves), 0, tmp_path, t.devices, background=False, timeout=1,
                         job=backend.job)

    with pytest.raises(HSPMDError, match=r"rank-1.safetensors.*never held this job's save of step 0"):
        second.world.run(all_but_rank_1)
    with pytest.raises(CheckpointError, match="rank-0.safetensors is not the file step 0's index committed"):
        ShardedReader.open(tmp_path).whole()


def test_a_flipped_byte_in_a_piece_fails_its_checksum_and_verify_names_the_file(tmp_path, capsys):
    from hspmd.errors import CheckpointError

    job = _job([parse_strategy(HETERO)], 0)
    _train(job, 1)
    _save(job, tmp_path)
    assert cli_main(["checkpoint", "verify", str(tmp_path)]) == 0
    assert "every one matches its checksum" in capsys.readouterr().out
    path = tmp_path / "step-00000001" / "rank-1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-1.safetensors: tensor .* does not match its sha256"):
        ShardedReader.open(tmp_path).whole()
    assert cli_main(["checkpoint", "verify", str(tmp_path)]) == 2
    assert "rank-1.safetensors" in capsys.readouterr().err


def test_every_rank_file_is_a_checked_hspmd_checkpoint_stamped_with_its_step_and_job(tmp_path):
    from hspmd.runtime.persistence.checkpoint import CheckpointReader
    from hspmd.runtime.persistence.sharded_checkpoint import JOB_KEY

    job = _job([parse_strategy(HETERO)], 0)
    _save(job, tmp_path)
    index = ShardedReader.open(tmp_path).index
    for name, signature in index["files"].items():
        reader = CheckpointReader(tmp_path / "step-00000000" / name)
        reader.verify()
        assert reader.header_checksum == signature
        assert reader.metadata[JOB_KEY] == job.world.job and reader.metadata[STEP_KEY] == "0"


def test_a_rank_file_of_the_same_job_and_step_under_another_strategy_never_counts_as_written(tmp_path):
    """After a restore took a job back to an earlier step under a new strategy, its next save of a
    step it saved before must not take the old strategy's rank file for the new one's."""
    from hspmd.runtime.persistence.sharded_checkpoint import save_sharded

    first = _job([parse_strategy(HETERO)], 0)
    _save(first, tmp_path)
    same_job = first.world.job
    second = _job([parse_strategy(HETERO), parse_strategy(PP3)], 1)

    def all_but_rank_1(backend):
        t = second.trainers[backend.rank]
        if backend.rank != 1 and not t.idle:
            save_sharded(t.exe, dict(t.state.leaves), 0, tmp_path, t.devices, background=False, timeout=1, job=same_job)

    with pytest.raises(HSPMDError, match=r"\['rank-1.safetensors'\] never held this job's save of step 0"):
        second.world.run(all_but_rank_1)


@pytest.mark.parametrize("field, damage, expected", [
    ("step", -1, "step: expected an integer >= 0"),
    ("files", None, "files: expected an object mapping each rank file"),
    ("file", "rank-9.safetensors", r"pieces\[0\].file: expected a rank file the index signs"),
    ("box", [[2, 1]], r"pieces\[0\].box\[0\]: expected a range"),
])
def test_a_damaged_index_field_is_named_by_its_path(tmp_path, field, damage, expected):
    import json

    from hspmd.errors import CheckpointError

    job = _job([parse_strategy(HETERO)], 0)
    _save(job, tmp_path)
    path = tmp_path / "step-00000000" / "index.json"
    index = json.loads(path.read_text())
    first = next(iter(index["tensors"].values()))["pieces"][0]
    if field in ("file", "box"):
        first[field] = damage
    else:
        index[field] = damage
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"index.json: sharded checkpoint index field (.*[.])?{expected}"):
        ShardedReader.open(tmp_path)
