"""Sharded checkpoints: each rank writes only its own pieces, in the background; any strategy loads.

Layout of a checkpoint directory:

    DIR/latest                        name of the newest complete step directory (atomic replace)
    DIR/step-00000040/rank-3.safetensors   the pieces rank 3 was the first holder of
    DIR/step-00000040/index.json      tensor -> shape, dtype, boxes -> file; written last (the commit)

A piece held by several devices (replicas) is written once, by its first holder, so the files add
up to the model once. Nothing is gathered: each rank writes from its own memory on a background
thread while training continues (updates never write into a leaf tensor in place, so the pieces
being written cannot change underneath). The index is computed from the annotations (every rank
could) and written by the lowest rank once every rank's file is in place. Loading under any
strategy reads, for each piece a rank needs, only the intersecting part of each stored box
(safetensors slices), so a rank never reads what it will not hold.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hspmd.annotations import device_pieces
from hspmd.errors import HSPMDError, ShapeError
from hspmd.runtime.checkpoint import GRAPH_KEY, STEP_KEY, CheckpointReader, checkpoint_leaves, save_checkpoint
from hspmd.specialize.executable import ExecutableGraph, run_time_ratios

INDEX = "index.json"
LATEST = "latest"
FORMAT = "hspmd-sharded-1"
_LATEST_LOCK = threading.Lock()


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def rank_file(rank: int) -> str:
    return f"rank-{rank}.safetensors"


def _box_key(box) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in box)


def checkpoint_index(exe: ExecutableGraph, step: int) -> dict:
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
            "pieces": [{"box": [list(b) for b in box], "file": rank_file(d)} for box, d in writers.items()],
        }
    return {"format": FORMAT, "step": step, "graph": exe.graph.name, "tensors": tensors}


def own_pieces(exe: ExecutableGraph, leaves: Mapping[str, torch.Tensor], index: dict) -> dict[str, torch.Tensor]:
    """The pieces this device writes: those the index assigns to its file."""
    mine = rank_file(exe.device)
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
                 writers: tuple[int, ...], background: bool = True, timeout: float = 300.0) -> PendingSave | None:
    """This device's part of a sharded checkpoint of `step` under `directory` (not collective).
    `writers`: every device of the strategy; the lowest writes the index once all files exist."""
    directory = os.fspath(directory)
    index = checkpoint_index(exe, step)
    pieces = own_pieces(exe, leaves, index)

    def write() -> None:
        folder = step_dir(directory, step)
        os.makedirs(folder, exist_ok=True)
        if pieces:
            _atomic_save(pieces, os.path.join(folder, rank_file(exe.device)), step, exe.graph.name)
        if exe.device == min(writers):
            _commit(directory, folder, index, timeout)

    if not background:
        write()
        return None
    return PendingSave(write)


def _atomic_save(tensors: Mapping[str, torch.Tensor], path: str, step: int, graph: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp,
              metadata={STEP_KEY: str(step), GRAPH_KEY: graph})
    os.replace(tmp, path)


def _commit(directory: str, folder: str, index: dict, timeout: float) -> None:
    """Wait for every file the index names, then write the index and point `latest` at the step."""
    files = sorted({p["file"] for entry in index["tensors"].values() for p in entry["pieces"]})
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(folder, f)) for f in files):
        if time.monotonic() > deadline:
            missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
            raise HSPMDError(f"sharded checkpoint {folder}: {missing} never appeared within {timeout:g}s; "
                             "the index was not written, so the previous checkpoint stays the latest")
        time.sleep(0.01)
    _atomic_write(os.path.join(folder, INDEX), json.dumps(index, indent=1))
    with _LATEST_LOCK:  # saves overlap in the background: `latest` only moves forward
        latest = os.path.join(directory, LATEST)
        current = open(latest, encoding="utf-8").read().strip() if os.path.exists(latest) else ""
        if os.path.basename(folder) > current:
            _atomic_write(latest, os.path.basename(folder))


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


@dataclass
class ShardedReader:
    """Reads boxes of whole tensors from a sharded checkpoint (a `read` for checkpoint.cut_leaves):
    only the parts of stored pieces that intersect the requested box. `bytes_read` counts them."""

    folder: str
    index: dict
    bytes_read: int = 0

    @staticmethod
    def open(path) -> "ShardedReader":
        """`path`: a checkpoint directory (its `latest` step) or one step directory."""
        path = os.fspath(path)
        folder = path
        if not os.path.exists(os.path.join(path, INDEX)):
            latest = os.path.join(path, LATEST)
            if not os.path.exists(latest):
                raise HSPMDError(f"{path} is not a sharded hspmd checkpoint (no {INDEX} and no {LATEST} file)")
            with open(latest, encoding="utf-8") as f:
                folder = os.path.join(path, f.read().strip())
        with open(os.path.join(folder, INDEX), encoding="utf-8") as f:
            index = json.load(f)
        if index.get("format") != FORMAT:
            raise HSPMDError(f"{folder}/{INDEX}: unknown format {index.get('format')!r} (expected {FORMAT})")
        return ShardedReader(folder, index)

    @property
    def step(self) -> int:
        return int(self.index["step"])

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
        out = torch.empty(tuple(b - a for a, b in box), dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for piece in entry["pieces"]:
            stored = _box_key(piece["box"])
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, stored))
            if any(a >= b for a, b in inter) and inter:
                continue
            with safe_open(os.path.join(self.folder, piece["file"]), framework="pt") as f:
                view = f.get_slice(name)
                part = view[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inter, stored))] if inter else f.get_tensor(name)
            out[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inter, box))] = part
            covered += part.numel()
            self.bytes_read += part.numel() * part.element_size()
        if covered != out.numel():
            raise HSPMDError(f"sharded checkpoint {self.folder}: the stored pieces of {name} do not cover box {box}")
        return out

    def whole(self) -> dict[str, torch.Tensor]:
        return {name: self(name, (), tuple(e["shape"])) for name, e in self.index["tensors"].items()}


def open_checkpoint(path):
    """A reader for either format: a sharded checkpoint directory, or a single safetensors file."""
    return ShardedReader.open(path) if os.path.isdir(os.fspath(path)) else CheckpointReader(path)


def consolidate(path, out) -> int:
    """Write a sharded checkpoint as one plain safetensors file of whole tensors (loadable by other
    tools, and by hspmd as a single-file checkpoint); returns its step."""
    reader = ShardedReader.open(path)
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


__all__ = ["PendingSave", "ShardedReader", "checkpoint_index", "consolidate", "inspect", "open_checkpoint",
           "save_sharded"]
