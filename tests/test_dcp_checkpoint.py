"""DCP in and out in one process (a DCP save or load without a process group): hspmd's pieces become
DCP chunks torch loads whole; a box reads only the chunks it meets; names map with transposes; a
damaged data file or metadata is a CheckpointError naming what; torch's own checkpoints carry no
hspmd checksums and say so."""

from __future__ import annotations

import glob
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hspmd.errors import CheckpointError, HSPMDError, ShapeError
from hspmd.runtime.data.loader import saved_state
from hspmd.runtime.data.order import DataState
from hspmd.runtime.persistence.dcp_checkpoint import DCPCheckpoint, is_dcp_checkpoint, open_any_checkpoint, save_pieces

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

W = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
B = torch.arange(5, dtype=torch.float64)


def test_hspmd_pieces_are_dcp_chunks_that_torch_loads_whole(tmp_path):
    save_pieces(tmp_path, {"w": (((0, 7), (0, 6)), W), "b": (((0, 5),), B)}, {"w": (7, 6), "b": (5,)}, step=4, no_dist=True,
                data=DataState().to_json())
    assert is_dcp_checkpoint(tmp_path) and isinstance(open_any_checkpoint(tmp_path), DCPCheckpoint)
    state = {"w": torch.zeros(7, 6), "b": torch.zeros(5, dtype=torch.float64)}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["w"], W) and torch.equal(state["b"], B)
    reader = DCPCheckpoint(tmp_path)
    assert reader.step == 4 and sorted(reader.names) == ["b", "w"] and saved_state(tmp_path) == DataState()
    assert torch.equal(reader("w", ((2, 5), (1, 4)), (7, 6)), W[2:5, 1:4])
    reader.verify()


def test_torch_names_map_with_transposes_and_fresh_optimizer_states(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"model.proj.weight": W.t().contiguous()}  # torch's orientation of an hspmd (in, out) weight
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    reader = DCPCheckpoint(tmp_path, names={"proj": ("model.proj.weight", True)})
    assert reader.step == 0 and not reader.checksums
    assert torch.equal(reader("proj", ((1, 4), (2, 6)), (7, 6)), W[1:4, 2:6])
    assert torch.equal(reader("proj.m", ((0, 2), (0, 6)), (7, 6)), torch.zeros(2, 6))  # an optimizer state starts fresh
    with pytest.raises(ShapeError, match="model.proj.weight has shape"):
        reader("proj", ((0, 6), (0, 7)), (6, 7))
    with pytest.raises(CheckpointError, match="no tensor for 'other'"):
        reader("other", ((0, 1),), (1,))
    with pytest.raises(HSPMDError, match="carries no hspmd checksums"):
        reader.verify()


def test_a_piece_is_one_chunk_and_a_box_reads_only_the_chunks_it_meets(tmp_path):
    from hspmd.runtime.persistence.dcp_checkpoint import _save_planner
    planner = _save_planner({"w": (((0, 3), (0, 4)), W[0:3, 0:4])}, {"w": (7, 6)}, {"step": 1})
    plan = planner.create_local_plan()  # one chunk per piece, its offsets and sizes the piece's box
    chunk = plan.items[0].tensor_data.chunk
    assert tuple(chunk.offsets) == (0, 0) and tuple(chunk.sizes) == (3, 4) and len(plan.items) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_pieces(tmp_path, {"w": (((0, 3), (0, 6)), W[:3]), "b": (((0, 5),), B)}, {"w": (7, 6), "b": (5,)}, 1, no_dist=True)
    reader = DCPCheckpoint(tmp_path)
    assert torch.equal(reader("b", ((1, 3),), (5,)), B[1:3])
    assert reader.chunks_read == [("b", 0)]  # w's chunk is not read for a box of b


def test_a_flipped_byte_or_damaged_metadata_is_named(tmp_path, capsys):
    from hspmd.cli import main as cli_main
    save_pieces(tmp_path, {"w": (((0, 7), (0, 6)), W)}, {"w": (7, 6)}, step=1, no_dist=True)
    assert cli_main(["checkpoint", "verify", str(tmp_path)]) == 0
    assert "step 1, 1 tensors, every one matches its checksum" in capsys.readouterr().out
    path = glob.glob(os.path.join(tmp_path, "*.distcp"))[0]
    data = bytearray(open(path, "rb").read())
    at = bytes(data).find(W[5].numpy().tobytes())
    assert at >= 0
    data[at + 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=rf"tensor w's chunk at offsets \(0, 0\) in .*{os.path.basename(path)} fails its checksum"):
        DCPCheckpoint(tmp_path)("w", ((0, 1), (0, 1)), (7, 6))
    assert cli_main(["checkpoint", "verify", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("hspmd: error: DCP checkpoint") and "fails its checksum" in line and "\n" not in line
    data[len(data) - 30] ^= 0xFF  # the zip directory: the file cannot be read at all
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=rf"cannot be read from .*{os.path.basename(path)}"):
        DCPCheckpoint(tmp_path).verify()
    with open(os.path.join(tmp_path, ".metadata"), "r+b") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match=".metadata cannot be read"):
        DCPCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no committed DCP checkpoint"):
        DCPCheckpoint(tmp_path / "absent")
