"""Sharded checkpoints: each rank writes only its own pieces, in the background; any strategy loads.

Layout of a checkpoint directory:

    DIR/latest                        name of the newest complete step directory
    DIR/step-00000040/rank-3.safetensors   the pieces rank 3 was the first holder of
    DIR/step-00000040/index.json      tensor -> shape, dtype, boxes -> file; each file's header
                                      checksum; written last (the commit)

A piece held by several devices (replicas) is written once, by its first holder, so the files add
up to the model once. Nothing is gathered: each rank writes from its own memory on a background
thread while training continues (updates never write into a leaf tensor in place, so the pieces
being written cannot change underneath). The index is computed from the annotations (every rank
could) and written by the lowest rank once every rank's file is in place. Loading under any
strategy reads, for each piece a rank needs, only the intersecting part of each stored box
(safetensors slices), so a rank never reads what it will not hold.

Integrity: a rank file is an hspmd single-file checkpoint of the rank's pieces (checkpoint.py: a
sha256 per piece and one over the header), stamped with the step and the job (Backend.job). Every
file is written with integrity.atomic_write (fsync before and after the rename). The index writer
waits until each file holds this job's save of this step, so a file an earlier job left at the same
step never counts as written, and records each file's header checksum: a file replaced after the
commit is refused by name. A piece read whole is checked against its sha256; a part of a piece
(loading under another strategy) cannot be, as the checksum covers the whole piece; `verify()`
(`hspmd checkpoint verify`) checks every piece.

On a stand-in device (`meta` tensors, which hold no values) the same save and load run without
the data path: each rank checks its pieces against the index and writes a manifest of them
(`rank-3.json`: name, box, shape, dtype) instead of tensor bytes, and the index says `stand_in`.
Loading such a checkpoint checks that the manifests cover every requested box and returns `meta`
pieces of the right shape and dtype; loading it onto a device with data is refused (it has no
values). No CPU tensor is made on either side.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from hspmd.annotations import device_pieces
from hspmd.comm_resolve.slices import box_volume
from hspmd.errors import CheckpointError, HSPMDError, ShapeError
from hspmd.json_fields import JsonField
from hspmd.runtime.persistence.checkpoint import STEP_KEY, CheckpointReader, checkpoint_leaves, save_checkpoint
from hspmd.runtime.persistence.integrity import atomic_write, read_format_document
from hspmd.specialize.executable import ExecutableGraph, run_time_ratios

INDEX = "index.json"
LATEST = "latest"
FORMAT = "hspmd-sharded-2"
JOB_KEY = "hspmd.job"
_LATEST_LOCK = threading.Lock()
_NEWEST: dict[str, int] = {}  # directory -> the newest step this process (this run) committed there


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def rank_file(rank: int, stand_in: bool = False) -> str:
    return f"rank-{rank}.json" if stand_in else f"rank-{rank}.safetensors"


def on_stand_in(tensors) -> bool:
    """True when the tensors live on a device without data (`meta`); a mix is a bug, refused."""
    kinds = {t.is_meta for t in tensors}
    if len(kinds) > 1:
        raise HSPMDError("a checkpoint's pieces are partly on the stand-in (meta) device and partly on a device with "
                         "data; save from one device")
    return kinds == {True}


def _box_key(box) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in box)


def checkpoint_index(exe: ExecutableGraph, step: int, stand_in: bool = False, data: str | None = None) -> dict:
    """Every leaf's shape, dtype and the boxes that tile it once, each with the file of the device
    writing it (the same on every rank: it follows from the annotations alone). A union that
    replicates the tensor across subgroups (HDim D) is written from one subgroup, taken in turn
    leaf after leaf so the writing spreads over the subgroups; within it, equal boxes (replicas)
    are written by their first holder."""
    tensors = {}
    for position, node in enumerate(checkpoint_leaves(exe.graph)):
        t = node.output
        ann = exe.deduced[t]
        shape = exe.binding.shape(t.shape, node.name)
        pieces = device_pieces(ann, shape, run_time_ratios(ann, exe.binding))
        subgroups = [ann.subgroups[position % len(ann.subgroups)]] if ann.hdim == "D" else ann.subgroups
        writers: dict[tuple, int] = {}
        for sub in subgroups:
            for device in sorted(sub.dg.devices):
                writers.setdefault(_box_key(pieces[device].box), device)
        tensors[node.name] = {
            "shape": list(shape), "dtype": str(t.dtype).removeprefix("torch."),
            "pieces": [{"box": [list(b) for b in box], "file": rank_file(d, stand_in)} for box, d in writers.items()],
        }
    index = {"format": FORMAT, "step": step, "graph": exe.graph.name, "tensors": tensors}
    if stand_in:
        index["stand_in"] = True
    if data is not None:
        index["data"] = data  # the data loader's state at this step (JSON text)
    return index


def own_pieces(exe: ExecutableGraph, leaves: Mapping[str, torch.Tensor], index: dict) -> dict[str, torch.Tensor]:
    """The pieces this device writes: those the index assigns to its file."""
    mine = rank_file(exe.device, bool(index.get("stand_in")))
    out = {}
    for name, entry in index["tensors"].items():
        if any(p["file"] == mine for p in entry["pieces"]):
            out[name] = leaves[name]
    return out


class PendingSave:
    """A save running on a background thread; wait() returns once this rank's part is on disk
    (and, on the index writer, the index too) and re-raises a failure."""

    def __init__(self, target, *args):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(target, args), daemon=True, name="hspmd-ckpt")
        self._thread.start()

    def _run(self, target, args) -> None:
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise HSPMDError(f"sharded checkpoint save still running after {timeout}s")
        if self._error is not None:
            raise self._error


def save_sharded(exe: ExecutableGraph, leaves: Mapping[str, torch.Tensor], step: int, directory,
                 writers: tuple[int, ...], background: bool = True, timeout: float = 300.0,
                 job: str = "", data: str | None = None) -> PendingSave | None:
    """This device's part of a sharded checkpoint of `step` under `directory` (not collective).
    `writers`: every device of the strategy; the lowest writes the index once every file holds
    this `job`'s save of `step` (Backend.job: the same on every rank). `data`: the data loader's
    state at this step (JSON text), kept in the index."""
    directory = os.fspath(directory)
    stand_in = on_stand_in(leaves.values())
    index = checkpoint_index(exe, step, stand_in, data)
    pieces = own_pieces(exe, leaves, index)

    def write() -> None:
        folder = step_dir(directory, step)
        os.makedirs(folder, exist_ok=True)
        if pieces and stand_in:
            _write_text(os.path.join(folder, rank_file(exe.device, True)), json.dumps(_manifest(exe, pieces, index, job)))
        elif pieces:
            save_checkpoint(os.path.join(folder, rank_file(exe.device)), pieces, step, exe.graph.name, {JOB_KEY: job})
        if exe.device == min(writers):
            _commit(directory, folder, index, job, timeout)

    if not background:
        write()
        return None
    return PendingSave(write)


def _manifest(exe: ExecutableGraph, pieces: Mapping[str, torch.Tensor], index: dict, job: str) -> dict:
    """What a stand-in rank file holds in place of tensor bytes: each piece's box, shape and dtype,
    checked against the index (a piece of the wrong shape or dtype fails the save, as it would
    when writing real bytes)."""
    mine = rank_file(exe.device, True)
    out = {}
    for name, value in pieces.items():
        entry = index["tensors"][name]
        box = next(p["box"] for p in entry["pieces"] if p["file"] == mine)
        shape = [b - a for a, b in box]
        dtype = str(value.dtype).removeprefix("torch.")
        if list(value.shape) != shape or dtype != entry["dtype"]:
            raise ShapeError(f"device {exe.device}: its piece of {name} is {tuple(value.shape)} {dtype}, the checkpoint "
                             f"index gives it {tuple(shape)} {entry['dtype']}")
        out[name] = {"box": box, "shape": shape, "dtype": dtype}
    return {"format": FORMAT, "step": index["step"], "job": job, "device": exe.device, "pieces": out}


def _signature(path: str, step: int, job: str, shapes: dict[str, tuple[int, ...]], stand_in: bool) -> str | None:
    """The header checksum of the rank file at `path` (a stand-in manifest: the sha256 of its text)
    once it holds `job`'s save of `step` with exactly the pieces `shapes` names; None while it is
    missing, damaged or another save's (an earlier job's, or this job's under another strategy
    before a restore took it back to an earlier step)."""
    try:
        if stand_in:
            with open(path, "rb") as f:
                text = f.read()
            manifest = json.loads(text)
            held = {name: tuple(p["shape"]) for name, p in manifest["pieces"].items()}
            ours = manifest["step"] == step and manifest["job"] == job and held == shapes
            return hashlib.sha256(text).hexdigest() if ours else None
        reader = CheckpointReader(path)
        ours = (reader.metadata.get(STEP_KEY) == str(step) and reader.metadata.get(JOB_KEY) == job
                and reader.shapes() == shapes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError):
        return None
    return reader.header_checksum if ours else None


def _commit(directory: str, folder: str, index: dict, job: str, timeout: float) -> None:
    """Wait until every file the index names holds this job's save of this step, then write the
    index (with each file's signature) and point `latest` at the step: the newest this run
    committed (saves overlap in the background), whatever an earlier run left there (a new run into
    an old directory must not resume from that run's later steps)."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, entry in index["tensors"].items():
        for p in entry["pieces"]:
            shapes.setdefault(p["file"], {})[name] = tuple(b - a for a, b in p["box"])
    files = sorted(shapes)
    stand_in = bool(index.get("stand_in"))
    signatures: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(signatures) < len(files):
        for f in files:
            if f not in signatures:
                found = _signature(os.path.join(folder, f), index["step"], job, shapes[f], stand_in)
                if found is not None:
                    signatures[f] = found
        if len(signatures) == len(files):
            break
        if time.monotonic() > deadline:
            missing = [f for f in files if f not in signatures]
            raise HSPMDError(f"sharded checkpoint {folder}: {missing} never held this job's save of step "
                             f"{index['step']} within {timeout:g}s (missing, damaged or another run's); the index "
                             "was not written, so the previous checkpoint stays the latest")
        time.sleep(0.01)
    _write_text(os.path.join(folder, INDEX), json.dumps({**index, "files": signatures}, indent=1))
    with _LATEST_LOCK:
        key = os.path.abspath(directory)
        if index["step"] >= _NEWEST.get(key, -1):
            _NEWEST[key] = index["step"]
            _write_text(os.path.join(directory, LATEST), os.path.basename(folder))


def _write_text(path: str, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


@dataclass
class ShardedReader:
    """Reads boxes of whole tensors from a sharded checkpoint (a `read` for checkpoint.cut_leaves):
    only the parts of stored pieces that intersect the requested box. `bytes_read` counts them."""

    folder: str
    index: dict
    bytes_read: int = 0
    _manifests: dict | None = None
    _files: dict = field(default_factory=dict)

    @property
    def stand_in(self) -> bool:
        """Saved from a stand-in device: manifests, no values (loads only onto `meta`)."""
        return bool(self.index.get("stand_in"))

    @staticmethod
    def open(path) -> "ShardedReader":
        """`path`: a checkpoint directory (its `latest` step) or one step directory."""
        path = os.fspath(path)
        folder = path
        if not os.path.exists(os.path.join(path, INDEX)):
            latest = os.path.join(path, LATEST)
            if not os.path.exists(latest):
                raise HSPMDError(f"{path} is not a sharded hspmd checkpoint (no {INDEX} and no {LATEST} file)")
            try:
                with open(latest, encoding="utf-8") as f:
                    folder = os.path.join(path, f.read().strip())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{latest}: cannot read the pointer to the latest step: {exc}") from exc
        where = os.path.join(folder, INDEX)
        index = read_format_document(where, FORMAT, CheckpointError, "cannot read the sharded checkpoint's index")
        _check_index(index, where)
        return ShardedReader(folder, index)

    @property
    def path(self) -> str:
        return self.folder

    @property
    def step(self) -> int:
        return int(self.index["step"])

    @property
    def data(self) -> str | None:
        """The data loader's state saved with the weights (JSON text), if any."""
        return self.index.get("data")

    @property
    def names(self) -> list[str]:
        return list(self.index["tensors"])

    def __call__(self, name: str, box, shape: tuple[int, ...]) -> torch.Tensor:
        entry = self.index["tensors"].get(name)
        if entry is None:
            raise HSPMDError(f"sharded checkpoint {self.folder} has no tensor {name!r}: it was written for a different "
                             f"model (graph {self.index.get('graph')!r})")
        if tuple(entry["shape"]) != tuple(shape):
            raise ShapeError(f"sharded checkpoint {self.folder}: {name} has shape {tuple(entry['shape'])}, the model "
                             f"expects {tuple(shape)}")
        box = _box_key(box) if box else tuple((0, s) for s in shape)
        if self.stand_in:
            return self._stand_in_piece(name, entry, box)
        out = torch.empty(tuple(b - a for a, b in box), dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for piece in entry["pieces"]:
            stored = _box_key(piece["box"])
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, stored))
            if any(a >= b for a, b in inter) and inter:
                continue
            reader = self._file(piece["file"])
            if inter == stored:  # the whole piece: checked against its sha256
                part = reader.tensor(name)
            else:
                part = reader.part(name, tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inter, stored)))
            if tuple(part.shape) != tuple(b - a for a, b in inter):
                raise CheckpointError(f"{reader.path}: {name}'s piece {list(stored)} has shape {tuple(part.shape)}, "
                                      "not its box's")
            out[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inter, box))] = part
            covered += part.numel()
            self.bytes_read += part.numel() * part.element_size()
        if covered != out.numel():
            raise HSPMDError(f"sharded checkpoint {self.folder}: the stored pieces of {name} do not cover box {box}")
        return out

    def _file(self, name: str) -> CheckpointReader:
        """The rank file `name`, opened once, refused unless it is the file the index committed."""
        if name not in self._files:
            reader = CheckpointReader(os.path.join(self.folder, name))
            if reader.header_checksum != self.index["files"][name]:
                raise CheckpointError(f"{reader.path} is not the file step {self.step}'s index committed: it was "
                                      "replaced later (another run saving the same step?); load another step")
            self._files[name] = reader
        return self._files[name]

    def verify(self) -> None:
        """Read every stored piece whole and check it (loads under another strategy check only the
        pieces they read whole); stand-in manifests are checked against the index."""
        for name, entry in self.index["tensors"].items():
            if self.stand_in:
                self._stand_in_piece(name, entry, tuple((0, s) for s in entry["shape"]))
                continue
            for piece in entry["pieces"]:
                reader = self._file(piece["file"])
                shape = tuple(b - a for a, b in piece["box"])
                if tuple(reader.tensor(name).shape) != shape:
                    raise CheckpointError(f"{reader.path}: {name}'s piece {piece['box']} does not have its box's shape")

    def _stand_in_piece(self, name: str, entry: dict, box) -> torch.Tensor:
        """A `meta` tensor of the box, once the manifests are found to cover it with pieces of the
        index's shape and dtype (the checks a real load makes, without any bytes)."""
        if self._manifests is None:
            files = sorted({p["file"] for e in self.index["tensors"].values() for p in e["pieces"]})
            self._manifests = {}
            for f in files:
                path = os.path.join(self.folder, f)
                try:
                    with open(path, "rb") as handle:
                        text = handle.read()
                    pieces = json.loads(text).get("pieces", {})
                except (OSError, ValueError, AttributeError) as exc:
                    raise CheckpointError(f"stand-in checkpoint {self.folder}: {f} cannot be read: {exc}") from None
                if hashlib.sha256(text).hexdigest() != self.index["files"][f]:
                    raise CheckpointError(f"stand-in checkpoint {self.folder}: {f} is not the manifest the index "
                                          "committed (replaced later)")
                self._manifests[f] = pieces
        covered = 0
        for piece in entry["pieces"]:
            stored = _box_key(piece["box"])
            listed = self._manifests[piece["file"]].get(name)
            if listed is None or _box_key(listed["box"]) != stored or listed["dtype"] != entry["dtype"]:
                raise HSPMDError(f"stand-in checkpoint {self.folder}: {piece['file']} does not list {name}'s piece "
                                 f"{list(stored)} as {entry['dtype']}")
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, stored))
            if all(a < b for a, b in inter):
                covered += box_volume(inter)
        if covered != box_volume(box):
            raise HSPMDError(f"stand-in checkpoint {self.folder}: the stored pieces of {name} do not cover box {box}")
        return torch.empty(tuple(b - a for a, b in box), dtype=getattr(torch, entry["dtype"]), device="meta")

    def whole(self) -> dict[str, torch.Tensor]:
        return {name: self(name, (), tuple(e["shape"])) for name, e in self.index["tensors"].items()}


class _IndexField(JsonField):
    error_type = CheckpointError
    noun = "sharded checkpoint index"


def _check_index(index: dict, where: str) -> None:
    """The index's shape, so that a damaged one is named here (with the field's path), not met as a
    KeyError mid-load."""
    top = _IndexField(index, "", where)
    top["step"].int()
    if top.get("data").value is not None:
        top["data"].str()
    files = top["files"]
    if not isinstance(files.value, dict) or not all(isinstance(v, str) for v in files.value.values()):
        raise files.fail("expected an object mapping each rank file to its signature")
    tensors = top["tensors"]
    if not isinstance(tensors.value, dict):
        raise tensors.fail("expected an object mapping names to entries")
    for name in tensors.value:
        entry = tensors[name]
        entry["shape"].ints()
        if not isinstance(getattr(torch, entry["dtype"].str(), None), torch.dtype):
            raise entry["dtype"].fail("expected a torch dtype")
        for piece in entry["pieces"].items():
            if piece["file"].str() not in files.value or os.sep in piece["file"].value:
                raise piece["file"].fail("expected a rank file the index signs")
            piece["box"].box()


def is_sharded_checkpoint(path) -> bool:
    """A directory holding a sharded checkpoint (its `latest` pointer) or one step of it (an index)."""
    path = os.fspath(path)
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in (LATEST, INDEX))


def open_checkpoint(path):
    """A reader for either format: a sharded checkpoint directory, or a single safetensors file."""
    return ShardedReader.open(path) if os.path.isdir(os.fspath(path)) else CheckpointReader(path)


def consolidate(path, out) -> int:
    """Write a sharded checkpoint as one plain safetensors file of whole tensors (loadable by other
    tools, and by hspmd as a single-file checkpoint); returns its step."""
    reader = ShardedReader.open(path)
    if reader.stand_in:
        raise HSPMDError(f"{reader.folder} was saved from a stand-in (meta) device: it holds no values to consolidate")
    save_checkpoint(out, reader.whole(), reader.step, reader.index.get("graph", ""))
    return reader.step


def inspect(path) -> str:
    """A human-readable summary: step, files with their sizes, tensors with their pieces."""
    reader = ShardedReader.open(path)
    lines = [f"{reader.folder}: step {reader.step}, graph {reader.index.get('graph')!r}, "
             f"{len(reader.index['tensors'])} tensors"]
    files: dict[str, int] = {}
    for entry in reader.index["tensors"].values():
        for p in entry["pieces"]:
            files[p["file"]] = files.get(p["file"], 0) + 1
    for name in sorted(files):
        size = os.path.getsize(os.path.join(reader.folder, name))
        lines.append(f"  {name}: {files[name]} pieces, {size / 2**10:.1f} KiB")
    for name, entry in reader.index["tensors"].items():
        boxes = " ".join("[" + ",".join(f"{a}:{b}" for a, b in p["box"]) + "]@" + p["file"].split(".")[0]
                         for p in entry["pieces"])
        lines.append(f"  {name} {tuple(entry['shape'])} {entry['dtype']}: {boxes}")
    return "\n".join(lines)


__all__ = ["PendingSave", "ShardedReader", "checkpoint_index", "consolidate", "inspect", "is_sharded_checkpoint",
           "open_checkpoint",
           "save_sharded"]
