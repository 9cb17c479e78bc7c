"""Checkpoints of sharded training state: gather whole tensors by annotation, re-shard on load.

A checkpoint holds every live parameter and optimizer state as a whole tensor (safetensors, one
file) plus the optimizer step count, so it does not depend on the strategy that wrote it: any
strategy loads it back by cutting each device's piece out of the whole tensors (each rank reads
only its own slices from the file).

Gathering follows `hspmd.unshard`: the writing rank receives every holder's piece, replicas
included, and checks that replicas agree (a diverged data-parallel replica fails the save rather
than being silently dropped). The writing rank therefore holds the whole model and receives each
replica once: fine for small models; a large model would write per-rank shard files instead.

Integrity (schema "hspmd.checkpoint" version 1): the metadata holds the schema version, the step
and a sha256 per tensor (hspmd.runtime.persistence.integrity); every tensor a rank reads is verified whole
before it is cut, so a flipped byte, a truncated file, another model's file or a negative step is a
CheckpointError naming the file and the tensor. Files are written with integrity.atomic_write
(fsync of the file and its directory before and after the rename; stale temporaries removed).
"""

from __future__ import annotations

import hashlib
import json
import os
import reprlib
from typing import Callable, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hspmd.annotations import box_shape, device_pieces, unshard
from hspmd.errors import CheckpointError, HSPMDError, ShapeError
from hspmd.ir.graph import Graph, Node, Tensor
from hspmd.backends.backend import Backend
from hspmd.runtime.persistence.integrity import CHECKSUM, atomic_write, tensor_checksum
from hspmd.specialize.executable import ExecutableGraph, live_nodes, run_time_ratios

STEP_KEY = "hspmd.step"
GRAPH_KEY = "hspmd.graph"
SCHEMA_KEY = "hspmd.schema"
DATA_KEY = "hspmd.data"  # the data loader's state at this step (JSON text; hspmd.runtime.data.order.DataState)
SCHEMA = "hspmd.checkpoint/1"
CHECKSUM_PREFIX = f"hspmd.{CHECKSUM}."
HEADER_CHECKSUM_KEY = f"hspmd.header.{CHECKSUM}"


def checkpoint_leaves(graph: Graph) -> list[Node]:
    """Live parameters and optimizer states, in graph order (the same on every rank)."""
    live = live_nodes(graph)
    return [n for n in graph.nodes if n.kind in ("parameter", "state") and n.id in live]


def gather_whole(exe: ExecutableGraph, backend: Backend, tensors: Sequence[Tensor], values: Mapping[str, torch.Tensor],
                 dst: int) -> dict[str, torch.Tensor] | None:
    """Collective over every rank of the strategy: rank `dst` gets {name: whole value} of each of
    `tensors` (this device's pieces are values[name], its peers' come by point-to-point); other
    ranks get None. Replicas are checked to agree, as hspmd.unshard does."""
    me = backend.rank
    out: dict[str, torch.Tensor] | None = {} if me == dst else None
    for t in tensors:
        ann = exe.deduced[t]
        shape = exe.binding.shape(t.shape, t.name)
        ratios = run_time_ratios(ann, exe.binding)
        pieces = device_pieces(ann, shape, ratios)
        if me == dst:
            recvs = {d: (box_shape(p.box), t.dtype) for d, p in pieces.items() if d != me}
            got = dict(backend.exchange({}, recvs)) if recvs else {}
            if me in pieces:
                got[me] = values[t.name]
            out[t.name] = unshard(got, ann, shape=shape, ratios=ratios)
        elif me in pieces:
            backend.exchange({dst: values[t.name].contiguous()}, {})
    return out


def gather_leaves(exe: ExecutableGraph, backend: Backend, leaves: Mapping[str, torch.Tensor],
                  dst: int) -> dict[str, torch.Tensor] | None:
    """gather_whole of every checkpoint leaf (parameters and optimizer states) to rank `dst`."""
    return gather_whole(exe, backend, [n.output for n in checkpoint_leaves(exe.graph)], leaves, dst)


def cut_leaves(exe: ExecutableGraph, read: Callable[[str, tuple, tuple[int, ...]], torch.Tensor],
               device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """This device's piece of every leaf it holds, on `device`: read(name, box, whole shape)
    returns the box (global coordinates) of the named whole tensor. A reader of a checkpoint saved
    from a stand-in device (`read.stand_in`) loads only onto one (it has no values)."""
    device = torch.device(device)
    if getattr(read, "stand_in", False) and device.type != "meta":
        raise CheckpointError(f"{getattr(read, 'folder', 'the checkpoint')} was saved from a stand-in (meta) device and "
                              f"holds no values: it loads only onto a stand-in device, not {device}")
    out = {}
    for node in exe.held_leaves:
        box = exe.box(node.output, exe.binding)
        piece = read(node.name, box, exe.binding.shape(node.output.shape, node.name))
        if piece.dtype != node.output.dtype:
            raise CheckpointError(f"checkpoint tensor {node.name} is {piece.dtype}, the model expects {node.output.dtype}")
        out[node.name] = piece.to(device, copy=True)
    return out


def check_leaf_names(graph: Graph, names, path: str) -> None:
    """A checkpoint in hspmd's own formats holds exactly the model's leaves. One with more (a deeper
    model's layers) would otherwise load silently and be overwritten by this run's smaller save."""
    wanted = {n.name for n in checkpoint_leaves(graph)}
    missing, extra = sorted(wanted - set(names)), sorted(set(names) - wanted)
    if not (missing or extra):
        return

    def few(items):
        shown = ", ".join(repr(i) for i in items[:3])
        return shown + (f" and {len(items) - 3} more" if len(items) > 3 else "")

    parts = ([f"it lacks {len(missing)} tensor(s) the model needs ({few(missing)})"] if missing else []) + \
            ([f"it holds {len(extra)} tensor(s) the model does not have ({few(extra)})"] if extra else [])
    raise CheckpointError(f"checkpoint {path} was written for a different model than graph {graph.name!r}: "
                          f"{'; '.join(parts)}; load a checkpoint of this model's configuration")


def cut_from_tensors(tensors: Mapping[str, torch.Tensor]) -> Callable[[str, tuple, tuple[int, ...]], torch.Tensor]:
    """A `read` for cut_leaves over whole tensors in memory."""

    def read(name, box, shape):
        if name not in tensors:
            raise HSPMDError(f"state dict has no tensor {name!r}; it must hold every parameter and optimizer state")
        value = tensors[name]
        if tuple(value.shape) != tuple(shape):
            raise ShapeError(f"state dict tensor {name} has shape {tuple(value.shape)}, the model expects {tuple(shape)}")
        return value[tuple(slice(a, b) for a, b in box)]

    return read


def checkpoint_metadata(tensors: Mapping[str, torch.Tensor], step: int, graph_name: str = "",
                        extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The metadata of a checkpoint of `tensors`: schema, step, graph name, one checksum per tensor
    and `extra` entries (covered by the header checksum too)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        shown = step if isinstance(step, int) and not isinstance(step, bool) and step.bit_length() < 64 else type(step).__name__
        raise CheckpointError(f"a checkpoint's step must be a non-negative integer, got {shown}")
    metadata = {SCHEMA_KEY: SCHEMA, STEP_KEY: str(step), GRAPH_KEY: str(graph_name), **(extra or {})}
    metadata.update({CHECKSUM_PREFIX + name: tensor_checksum(t) for name, t in tensors.items()})
    metadata[HEADER_CHECKSUM_KEY] = _header_checksum(metadata)
    return metadata


def _header_checksum(metadata: Mapping[str, str]) -> str:
    """sha256 of every other metadata entry (step, graph, schema, tensor checksums)."""
    entries = sorted((k, v) for k, v in metadata.items() if k != HEADER_CHECKSUM_KEY)
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def save_checkpoint(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], step: int, graph_name: str = "",
                    extra: Mapping[str, str] | None = None) -> str:
    """Write whole tensors, the step count and per-tensor checksums (atomic and durable:
    integrity.atomic_write); returns the header checksum, which names this write."""
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    metadata = checkpoint_metadata(tensors, step, graph_name, extra)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return metadata[HEADER_CHECKSUM_KEY]


def read_step(metadata: Mapping[str, str], path: str) -> int:
    """The step count of a checkpoint's metadata (ASCII digits, non-negative)."""
    text = metadata.get(STEP_KEY)
    if text is None:
        raise CheckpointError(f"{path} is not an hspmd checkpoint (its metadata has no {STEP_KEY!r})")
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise CheckpointError(f"checkpoint {path}: step {reprlib.repr(text)} is not a non-negative integer; the file is damaged")
    return int(text)


class CheckpointReader:
    """Reads slices of a checkpoint. A checksum covers a whole tensor, so each read loads the whole
    tensor, verifies it and returns the slice (peak memory: the largest tensor, not the model)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointError(f"checkpoint {self.path!r} does not exist (train without --resume first, or fix the path)")
        try:
            self._file = safe_open(self.path, framework="pt")
            metadata = self._file.metadata() or {}
            self.names = set(self._file.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {self.path} cannot be read (truncated or not a safetensors file): {exc}") from None
        schema = metadata.get(SCHEMA_KEY)
        if schema is None and STEP_KEY not in metadata:
            raise CheckpointError(f"{self.path} is not an hspmd checkpoint (its metadata has no {SCHEMA_KEY!r})")
        if schema != SCHEMA:
            found = "none (an older hspmd, without checksums)" if schema is None else reprlib.repr(schema)
            raise CheckpointError(f"checkpoint {self.path} has schema {found}; this hspmd reads {SCHEMA!r}")
        self.step = read_step(metadata, self.path)
        self.graph_name = metadata.get(GRAPH_KEY, "")
        self._checksums = {k[len(CHECKSUM_PREFIX):]: v for k, v in metadata.items() if k.startswith(CHECKSUM_PREFIX)}
        unsummed = sorted(self.names - set(self._checksums))
        if unsummed:
            raise CheckpointError(f"checkpoint {self.path}: tensor {unsummed[0]!r} has no {CHECKSUM} in the metadata")
        if metadata.get(HEADER_CHECKSUM_KEY) != _header_checksum(metadata):
            raise CheckpointError(f"checkpoint {self.path}: the metadata (step, graph, checksums) does not match its "
                                  f"{CHECKSUM}: the file is corrupted")
        self.metadata = metadata

    @property
    def data(self) -> str | None:
        """The data loader's state saved with the weights (JSON text), if any."""
        return self.metadata.get(DATA_KEY)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, checked against its checksum."""
        if name not in self.names:
            raise CheckpointError(
                f"checkpoint {self.path} has no tensor {reprlib.repr(name)}: it was written for a different model "
                f"(graph {self.graph_name!r}); load a checkpoint of this model's configuration"
            )
        try:
            value = self._file.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} cannot be read: {exc}") from None
        if tensor_checksum(value) != self._checksums[name]:
            raise CheckpointError(
                f"checkpoint {self.path}: tensor {name!r} does not match its {CHECKSUM}: the file is corrupted; "
                f"restore it or load an older checkpoint"
            )
        return value

    @property
    def header_checksum(self) -> str:
        """Names this write of the file: it covers the step, the graph and every tensor's checksum."""
        return self.metadata[HEADER_CHECKSUM_KEY]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the header alone."""
        return {name: tuple(self._file.get_slice(name).get_shape()) for name in self.names}

    def part(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Part of tensor `name`, read alone: not checked (a checksum covers the whole tensor)."""
        try:
            return self._file.get_slice(name)[index]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} cannot be read: {exc}") from None

    def verify(self) -> None:
        """Check every tensor of the file (a reader otherwise checks only what it reads)."""
        for name in sorted(self.names):
            self.tensor(name)

    def __call__(self, name: str, box: tuple, shape: tuple[int, ...]) -> torch.Tensor:
        value = self.tensor(name)
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.path}: tensor {name!r} has shape {tuple(value.shape)}, the model expects "
                f"{tuple(shape)}: it was written for a different model configuration"
            )
        if not box:
            return value
        return value[tuple(slice(a, b) for a, b in box)]


__all__ = ["CheckpointReader", "DATA_KEY", "SCHEMA", "check_leaf_names",
           "checkpoint_leaves", "checkpoint_metadata", "cut_from_tensors", "cut_leaves",
           "gather_leaves", "gather_whole", "read_step", "save_checkpoint"]
