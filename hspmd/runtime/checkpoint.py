"""Checkpoints of sharded training state: gather whole tensors by annotation, re-shard on load.

A checkpoint holds every live parameter and optimizer state as a whole tensor (safetensors, one
file) plus the optimizer step count, so it does not depend on the strategy that wrote it: any
strategy loads it back by cutting each device's piece out of the whole tensors (each rank reads
only its own slices from the file).

Gathering follows `hspmd.unshard`: the writing rank receives every holder's piece, replicas
included, and checks that replicas agree (a diverged data-parallel replica fails the save rather
than being silently dropped). The writing rank therefore holds the whole model and receives each
replica once: fine for small models; a large model would write per-rank shard files instead.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hspmd.annotations import box_shape, device_pieces, unshard
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.graph import Graph, Node, Tensor
from hspmd.backends.backend import Backend
from hspmd.specialize.executable import ExecutableGraph, live_nodes, run_time_ratios

STEP_KEY = "hspmd.step"
GRAPH_KEY = "hspmd.graph"


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


def cut_leaves(exe: ExecutableGraph, read: Callable[[str, tuple, tuple[int, ...]], torch.Tensor]) -> dict[str, torch.Tensor]:
    """This device's piece of every leaf it holds: read(name, box, whole shape) returns the box
    (global coordinates) of the named whole tensor."""
    out = {}
    for node in exe.held_leaves:
        box = exe.box(node.output, exe.binding)
        piece = read(node.name, box, exe.binding.shape(node.output.shape, node.name))
        if piece.dtype != node.output.dtype:
            raise ShapeError(f"checkpoint tensor {node.name} is {piece.dtype}, the model expects {node.output.dtype}")
        out[node.name] = piece.clone()
    return out


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


def save_checkpoint(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], step: int, graph_name: str = "") -> None:
    """Write whole tensors and the step count (atomically: a crash never leaves half a file)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={STEP_KEY: str(step), GRAPH_KEY: graph_name})
    os.replace(tmp, path)


class CheckpointReader:
    """Reads slices of a checkpoint without loading whole tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise HSPMDError(f"checkpoint {self.path!r} does not exist (train without --resume first, or fix the path)")
        self._file = safe_open(self.path, framework="pt")
        metadata = self._file.metadata() or {}
        if STEP_KEY not in metadata:
            raise HSPMDError(f"{self.path} is not an hspmd checkpoint (its metadata has no {STEP_KEY!r})")
        self.step = int(metadata[STEP_KEY])
        self.graph_name = metadata.get(GRAPH_KEY, "")
        self.names = set(self._file.keys())

    def __call__(self, name: str, box: tuple, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.names:
            raise HSPMDError(
                f"checkpoint {self.path} has no tensor {name!r}: it was written for a different model "
                f"(graph {self.graph_name!r}); load a checkpoint of this model's configuration"
            )
        view = self._file.get_slice(name)
        stored = tuple(view.get_shape())
        if stored != tuple(shape):
            raise ShapeError(f"checkpoint {self.path}: {name} has shape {stored}, the model expects {tuple(shape)}")
        if not box:
            return self._file.get_tensor(name)
        return view[tuple(slice(a, b) for a, b in box)]


__all__ = ["CheckpointReader", "checkpoint_leaves", "cut_from_tensors", "cut_leaves", "gather_leaves", "gather_whole",
           "save_checkpoint"]
