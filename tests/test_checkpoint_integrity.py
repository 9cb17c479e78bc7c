"""Checkpoint integrity: checksums verified on load, a schema version, clear errors for
corrupted, truncated, wrong-model or negative-step files (the write helpers: test_integrity.py)."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from hspmd.errors import CheckpointError, HSPMDError
from hspmd.runtime.persistence.checkpoint import SCHEMA, CheckpointReader, checkpoint_metadata, save_checkpoint
from tests.fuzzing import fuzz_settings, mutated_bytes, outcome

TENSORS = {
    "embed": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "norm": torch.ones(6, dtype=torch.bfloat16),
    "count": torch.tensor([3, 1, 4], dtype=torch.int64),
}


def _read_all(path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {name: reader(name, (), tuple(t.shape)) for name, t in TENSORS.items()}


def _data_offset(raw: bytes) -> int:
    return 8 + struct.unpack("<Q", raw[:8])[0]


def test_a_saved_checkpoint_reads_back_whole_and_in_slices(tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, step=7, graph_name="g")
    reader = CheckpointReader(path)
    assert reader.step == 7 and reader.graph_name == "g"
    assert torch.equal(reader("embed", ((1, 3), (2, 6)), (4, 6)), TENSORS["embed"][1:3, 2:6])
    for name, t in _read_all(path).items():
        assert torch.equal(t, TENSORS[name])
    reader.verify()


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_a_flipped_data_byte_is_caught_and_names_file_and_tensor(tmp_path, name):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, {name: TENSORS[name]}, step=1)
    raw = bytearray(path.read_bytes())
    raw[_data_offset(raw) + 1] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(path)(name, (), tuple(TENSORS[name].shape))
    assert str(path) in str(info.value) and repr(name) in str(info.value) and "corrupted" in str(info.value)


@pytest.mark.parametrize("keep", [0, 5, 40, -3])
def test_empty_and_truncated_files_raise_checkpoint_error(tmp_path, keep):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, TENSORS, step=1)
    raw = path.read_bytes()
    path.write_bytes(raw[:keep] if keep >= 0 else raw[:keep])
    with pytest.raises(CheckpointError) as info:
        _read_all(path)
    assert str(path) in str(info.value)


def test_another_models_checkpoint_names_the_tensor(tmp_path):
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, {"embed": torch.zeros(4, 5)}, step=1)
    reader = CheckpointReader(path)
    with pytest.raises(CheckpointError, match="'norm'"):
        reader("norm", (), (6,))
    with pytest.raises(CheckpointError, match=r"'embed' has shape \(4, 5\), the model expects \(4, 6\)"):
        reader("embed", (), (4, 6))


@pytest.mark.parametrize("step, words", [("-5", "not a non-negative"), ("abc", "not a non-negative"),
                                         ("٣", "not a non-negative"), (None, "no 'hspmd.step'")])
def test_bad_steps_in_the_metadata_are_refused(tmp_path, step, words):
    metadata = checkpoint_metadata(TENSORS, 1)
    if step is None:
        del metadata["hspmd.step"]
    else:
        metadata["hspmd.step"] = step
    path = tmp_path / "ck.safetensors"
    save_file(dict(TENSORS), str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=words):
        CheckpointReader(path)


def test_a_changed_step_or_graph_name_is_caught_by_the_metadata_checksum(tmp_path):
    for key, value in (("hspmd.step", "2"), ("hspmd.graph", "other")):
        metadata = checkpoint_metadata(TENSORS, 3, "g")
        metadata[key] = value
        path = tmp_path / "ck.safetensors"
        save_file(dict(TENSORS), str(path), metadata=metadata)
        with pytest.raises(CheckpointError, match="metadata .* does not match"):
            CheckpointReader(path)


def test_a_negative_step_is_never_written(tmp_path):
    with pytest.raises(CheckpointError, match="non-negative"):
        save_checkpoint(tmp_path / "ck.safetensors", TENSORS, step=-5)
    assert not os.listdir(tmp_path)


def test_files_of_another_schema_or_without_checksums_are_refused(tmp_path):
    path = tmp_path / "old.safetensors"
    save_file(dict(TENSORS), str(path), metadata={"hspmd.step": "3", "hspmd.graph": ""})
    with pytest.raises(CheckpointError, match="older hspmd"):
        CheckpointReader(path)
    metadata = checkpoint_metadata(TENSORS, 1)
    del metadata["hspmd.sha256.norm"]
    save_file(dict(TENSORS), str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="'norm' has no sha256"):
        CheckpointReader(path)
    metadata[integrity_key := "hspmd.schema"] = "hspmd.checkpoint/99"
    save_file(dict(TENSORS), str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=SCHEMA):
        CheckpointReader(path)
    assert integrity_key == "hspmd.schema"


@fuzz_settings(150)
@given(st.data())
def test_fuzzed_checkpoint_files_load_equal_or_raise_checkpoint_error(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("ck", numbered=True)
    path = directory / "ck.safetensors"
    save_checkpoint(path, TENSORS, step=3)
    raw = path.read_bytes()
    mutated = data.draw(mutated_bytes(raw) | st.builds(lambda at, bit: _flip(raw, at, bit),
                                                       st.integers(0, len(raw) - 1), st.integers(0, 7)))
    path.write_bytes(mutated)
    ok, loaded = outcome("checkpoint loading", lambda: (CheckpointReader(path).step, _read_all(path)))
    if ok:
        step, tensors = loaded
        assert step == 3
        for name, t in tensors.items():
            assert torch.equal(t, TENSORS[name]), name
    else:
        assert isinstance(loaded, CheckpointError) and str(path) in str(loaded), loaded


def _flip(raw: bytes, at: int, bit: int) -> bytes:
    out = bytearray(raw)
    out[at] ^= 1 << bit
    return bytes(out)


def test_checkpoint_error_is_an_hspmd_error():
    assert issubclass(CheckpointError, HSPMDError)
