"""torch Distributed Checkpoint (DCP) in and out: hspmd's pieces as DCP chunks.

Save (`save_dcp`, collective over the job's default process group): each rank hands DCP the
pieces it writes in hspmd's sharded format (sharded_checkpoint.checkpoint_index: every box once, by
its first holder), each a DCP chunk whose offsets and sizes are the piece's box; DCP's own global
plan checks that the chunks tile each tensor once, its FileSystemWriter writes the rank's data
file and the coordinator writes `.metadata` last, by rename (the commit). So
`torch.distributed.checkpoint.load` reads an hspmd checkpoint into whole tensors or into DTensors
of any placements, and `DCPCheckpoint` reads one torch wrote.

What hspmd's own format promises, carried in the metadata's `planner_data` (saved with the
commit, ignored by torch's planners): a sha256 per piece (`hspmd.sha256/<name>/<offsets>`, of
dtype, shape and bytes as integrity.tensor_checksum) and a stamp (`hspmd.stamp`: format, step,
graph, job). What DCP loses: the per-file header checksum (DCP's data files carry none; a file
replaced by another complete DCP save of other bytes fails the piece checksums instead of being
named at open) and the background write (a DCP save is collective and returns once written).

Load (`DCPCheckpoint`, a `read(name, box, shape)` for Trainer.load_checkpoint / cut_leaves): for
each box a rank holds, only the stored chunks that intersect it are read (a DCP load without a
process group, `no_dist`: ranks read independently), each whole so that its checksum, where the
checkpoint has one, is checked before the box is cut from it; a mismatch or an unreadable chunk is
a CheckpointError naming the tensor, the chunk and the data file. Names map through `names` (for a
torch model's state dict: models/hf_llama.hf_names, Hugging Face names with the projections
transposed), and optimizer states missing from a torch checkpoint start at zero, as
hf_checkpoint.HFCheckpoint does.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

import torch

from hspmd.annotations.geometry import box_intersection, box_shape
from hspmd.errors import CheckpointError, HSPMDError, ShapeError
from hspmd.runtime.persistence.integrity import tensor_checksum
from hspmd.runtime.persistence.sharded_checkpoint import checkpoint_index, open_checkpoint, rank_file
from hspmd.specialize.executable import ExecutableGraph

METADATA_FILE = ".metadata"
STAMP_KEY = "hspmd.stamp"
CHECKSUM_PREFIX = "hspmd.sha256/"
FORMAT = "hspmd-dcp-1"


def _dcp():
    import torch.distributed.checkpoint as dcp
    return dcp


def _failures():
    """What a DCP save or load raises: its CheckpointException (a BaseException gathering every
    rank's failure) and whatever its reader meets in a damaged file."""
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)


def _checksum_key(name: str, offsets: Iterable[int]) -> str:
    return f"{CHECKSUM_PREFIX}{name}/{','.join(map(str, offsets))}"


def is_dcp_checkpoint(path) -> bool:
    """A directory holding a committed DCP checkpoint (its `.metadata`)."""
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


def open_any_checkpoint(path):
    """A reader for any of the formats hspmd loads: a DCP directory, hspmd's sharded directory, or
    hspmd's single safetensors file."""
    return DCPCheckpoint(path) if is_dcp_checkpoint(path) else open_checkpoint(path)


def _save_planner(pieces: Mapping[str, tuple[tuple, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]],
                  stamp: Mapping[str, object]):
    """A DCP save planner whose write items are the given pieces ({name: (box, tensor)}) as chunks."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class PiecesSavePlanner(DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self) -> SavePlan:
            items, data = [], {name: (name,) for name in shapes}
            data[STAMP_KEY] = dict(stamp)
            self._tensors = {}
            for name, (box, value) in pieces.items():
                offsets = tuple(int(a) for a, _ in box)
                value = value.detach().to("cpu").contiguous()
                self._tensors[(name, offsets)] = value
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(box_shape(box)))
                items.append(WriteItem(index=MetadataIndex(name, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(value),
                                                                   size=torch.Size(shapes[name]))))
                data[_checksum_key(name, offsets)] = tensor_checksum(value)
            self.plan = SavePlan(items, planner_data=data)
            return self.plan

        def resolve_data(self, write_item):
            return self._tensors[(write_item.index.fqn, tuple(write_item.index.offset))]

    return PiecesSavePlanner()


def save_pieces(directory, pieces: Mapping[str, tuple[tuple, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]],
                step: int, graph_name: str = "", job: str = "", no_dist: bool = False,
                names: Mapping[str, tuple[str, bool]] | None = None, data: str | None = None) -> str:
    """Write a DCP checkpoint in which this process contributes `pieces` ({name: (box, tensor)}) of
    tensors of `shapes` (every name, on every rank). Collective over the default process group
    unless `no_dist` (one process writing every piece). `names` ({hspmd name: (stored name,
    transposed)}) goes into the stamp, so that hspmd reads its leaves back by their own names; so
    does `data`, the data loader's state at this step (JSON text)."""
    from torch.distributed.checkpoint import FileSystemWriter
    directory = os.fspath(directory)
    stamp = {"format": FORMAT, "step": int(step), "graph": str(graph_name), "job": str(job),
             "names": {k: [stored, bool(transposed)] for k, (stored, transposed) in (names or {}).items()}, "data": data}
    try:
        _dcp().save({}, storage_writer=FileSystemWriter(directory), planner=_save_planner(pieces, shapes, stamp),
                    no_dist=no_dist)
    except _failures() as exc:
        raise CheckpointError(f"DCP save to {directory} failed: {exc}") from None
    return directory


def save_dcp(exe: ExecutableGraph, leaves: Mapping[str, torch.Tensor], step: int, directory, job: str = "",
             names: Mapping[str, tuple[str, bool]] | None = None, data: str | None = None) -> str:
    """This device's part of a DCP checkpoint of every leaf (collective over the default process
    group: every rank of the job calls it, those holding no piece too): the boxes hspmd's sharded
    format assigns to this device's file. `names` maps hspmd names to (stored name, transposed),
    e.g. a torch model's (models/hf_llama.hf_names), so that torch loads the parameters straight
    into that model's state dict; leaves it does not name keep their hspmd names."""
    index = checkpoint_index(exe, step)
    mine = rank_file(exe.device)
    where = {name: (names or {}).get(name, (name, False)) for name in index["tensors"]}
    shapes = {}
    pieces = {}
    for name, entry in index["tensors"].items():
        stored, transposed = where[name]
        shapes[stored] = tuple(reversed(entry["shape"])) if transposed else tuple(entry["shape"])
        for piece in entry["pieces"]:
            if piece["file"] == mine:
                box = tuple(tuple(b) for b in piece["box"])
                value = leaves[name]
                pieces[stored] = (tuple(reversed(box)), value.t()) if transposed else (box, value)
    return save_pieces(directory, pieces, shapes, step, exe.graph.name, job, names=where, data=data)


def _load_planner(wanted: Iterable, metadata):
    """A DCP load planner reading each wanted stored chunk ((name, chunk index)) whole into a buffer."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

    class ChunkLoadPlanner(LoadPlanner):
        def __init__(self):
            self.buffers: dict[tuple[str, int], torch.Tensor] = {}

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            self.metadata = metadata

        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, k in wanted:
                entry = self.metadata.state_dict_metadata[name]
                chunk = entry.chunks[k]
                index = MetadataIndex(name, chunk.offsets, k)
                self.buffers[(name, k)] = torch.empty(tuple(chunk.sizes), dtype=entry.properties.dtype)
                items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size([0] * len(chunk.sizes)),
                                      storage_index=index, storage_offsets=torch.Size([0] * len(chunk.sizes)),
                                      lengths=chunk.sizes))
            return LoadPlan(items)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value) -> None:
            raise CheckpointError(f"DCP checkpoint entry {read_item.dest_index.fqn} is bytes, not a tensor")

        def resolve_tensor(self, read_item):
            return self.buffers[(read_item.dest_index.fqn, read_item.dest_index.index)]

        def commit_tensor(self, read_item, tensor) -> None:
            pass

    return ChunkLoadPlanner()


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else type(exc).__name__


class DCPCheckpoint:
    """A read(name, box, shape) over a DCP checkpoint directory (module docstring). `names` maps an
    hspmd name to (stored name, transposed) (default: the same name, as stored); `dtype` casts
    what is read (default: as stored)."""

    def __init__(self, directory, names: Mapping[str, tuple[str, bool]] | None = None, dtype: torch.dtype | None = None):
        from torch.distributed.checkpoint import FileSystemReader
        self.directory = self.path = os.fspath(directory)
        if not is_dcp_checkpoint(self.directory):
            raise CheckpointError(f"{self.directory} holds no committed DCP checkpoint (no {METADATA_FILE})")
        self._reader = FileSystemReader
        try:
            self.metadata = FileSystemReader(self.directory).read_metadata()
        except Exception as exc:  # a damaged .metadata: torch's unpickler raises what it meets
            raise CheckpointError(f"DCP checkpoint {self.directory}: {METADATA_FILE} cannot be read: {exc}") from None
        data = self.metadata.planner_data if isinstance(self.metadata.planner_data, dict) else {}
        self.stamp = data.get(STAMP_KEY) or {}
        self.checksums = {k: v for k, v in data.items() if isinstance(k, str) and k.startswith(CHECKSUM_PREFIX)}
        self.step = int(self.stamp.get("step", 0))
        self.own = names is None and bool(self.stamp)  # hspmd's own save, read by hspmd's names
        stamped = {k: (v[0], bool(v[1])) for k, v in (self.stamp.get("names") or {}).items()}
        self.map = dict(names or stamped)
        self.dtype = dtype
        self.chunks_read: list[tuple[str, int]] = []  # (stored name, chunk index) of every chunk read, in order
        stored = self.metadata.state_dict_metadata
        self.names = list(self.map) if self.map else [n for n in stored if hasattr(stored[n], "chunks")]

    @property
    def data(self) -> str | None:
        """The data loader's state saved with the weights (JSON text), if any."""
        return self.stamp.get("data")

    def _where(self, name: str) -> tuple[str, bool] | None:
        if not self.map:
            return (name, False) if name in self.metadata.state_dict_metadata else None
        return self.map.get(name)

    def _file_of(self, name: str, offsets) -> str:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        info = (self.metadata.storage_data or {}).get(MetadataIndex(name, tuple(offsets)))
        return os.path.join(self.directory, info.relative_path) if info is not None else self.directory

    def _read_chunks(self, wanted: list[tuple[str, int]]) -> dict[tuple[str, int], torch.Tensor]:
        """The stored chunks `wanted`, each read whole and checked against its checksum (if any)."""
        planner = _load_planner(wanted, self.metadata)
        self.chunks_read.extend(wanted)
        try:
            _dcp().load({}, storage_reader=self._reader(self.directory), planner=planner, no_dist=True)
        except _failures() as exc:  # a truncated or garbled data file
            names = sorted({self._file_of(n, self.metadata.state_dict_metadata[n].chunks[k].offsets) for n, k in wanted})
            raise CheckpointError(f"DCP checkpoint {self.directory}: chunks of {sorted({n for n, _ in wanted})} cannot be "
                                  f"read from {', '.join(names)} (damaged or truncated): {_first_line(exc)}"
                                  ) from None
        for (name, k), value in planner.buffers.items():
            offsets = tuple(self.metadata.state_dict_metadata[name].chunks[k].offsets)
            expected = self.checksums.get(_checksum_key(name, offsets))
            if expected is not None and tensor_checksum(value) != expected:
                raise CheckpointError(f"DCP checkpoint {self.directory}: tensor {name}'s chunk at offsets {offsets} in "
                                      f"{self._file_of(name, offsets)} fails its checksum (the file was changed after the save)")
        return planner.buffers

    def __call__(self, name: str, box: tuple, shape: tuple[int, ...]) -> torch.Tensor:
        where = self._where(name)
        if where is None:
            owner = name.rsplit(".", 1)[0]
            if self.map and owner in self.map:  # an optimizer state a torch checkpoint lacks: fresh, as a new run's
                stored = self.metadata.state_dict_metadata[self.map[owner][0]]
                return torch.zeros(box_shape(box) if box else tuple(shape), dtype=self.dtype or stored.properties.dtype)
            raise CheckpointError(f"DCP checkpoint {self.directory} has no tensor for {name!r}")
        stored_name, transposed = where
        entry = self.metadata.state_dict_metadata.get(stored_name)
        if entry is None or not hasattr(entry, "chunks"):
            raise CheckpointError(f"DCP checkpoint {self.directory} has no tensor {stored_name!r} (for {name!r})")
        expected = tuple(reversed(shape)) if transposed else tuple(shape)
        if tuple(entry.size) != expected:
            raise ShapeError(f"DCP checkpoint {self.directory}: {stored_name} has shape {tuple(entry.size)}, the model "
                             f"expects {expected}")
        box = tuple(box) if box else tuple((0, s) for s in shape)
        stored_box = tuple(reversed(box)) if transposed else box
        chunks = [(k, tuple((o, o + s) for o, s in zip(c.offsets, c.sizes))) for k, c in enumerate(entry.chunks)]
        parts = [(k, cut) for k, extent in chunks if (cut := box_intersection(stored_box, extent)) is not None]
        out = torch.empty(box_shape(stored_box), dtype=entry.properties.dtype)
        if out.numel():
            values = self._read_chunks([(stored_name, k) for k, _ in parts])
            covered = 0
            for k, cut in parts:
                extent = chunks[k][1]
                source = values[(stored_name, k)][tuple(slice(a - e0, b - e0) for (a, b), (e0, _) in zip(cut, extent))]
                out[tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(cut, stored_box))] = source
                covered += source.numel()
            if covered != out.numel():
                raise CheckpointError(f"DCP checkpoint {self.directory}: the chunks of {stored_name} do not cover box "
                                      f"{stored_box} once")
        piece = out.t() if transposed else out
        return piece.to(self.dtype or piece.dtype).contiguous()

    def verify(self) -> None:
        """Read every stored chunk whole and check its checksum; a checkpoint without them (torch's
        own) is refused, as nothing could be verified."""
        if not self.checksums:
            raise HSPMDError(f"DCP checkpoint {self.directory} carries no hspmd checksums (written by torch, not hspmd)")
        stored = self.metadata.state_dict_metadata
        self._read_chunks([(n, k) for n in stored if hasattr(stored[n], "chunks") for k in range(len(stored[n].chunks))])


__all__ = ["DCPCheckpoint", "is_dcp_checkpoint", "open_any_checkpoint", "save_dcp", "save_pieces"]
