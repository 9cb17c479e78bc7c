"""The DTensor bridge: `from_dtensor(dtensor) -> (annotation, local)` and `to_dtensor(local, annotation,
mesh=None) -> DTensor`, through the plain-data layouts of mesh_layout.py.

A DTensor's spec gives its placements and shard order (`_StridedShard` placements decoded into the
order with torch's own decoder); Shard, Replicate and Partial("sum") cross, other Partial reductions
and placement kinds are refused by name. The local tensor crosses as it is (a Partial summand stays
a summand). `to_dtensor` finds the placements (with `_StridedShard` where the shard order is not the
mesh's) on the mesh given, or on a mesh made from the annotation (`layout_on_a_mesh_of`), and checks the local
tensor's shape against this rank's piece.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hspmd.annotations.geometry import device_pieces
from hspmd.annotations.syntax import parse
from hspmd.annotations.union import Annotation
from hspmd.errors import InteropError
from hspmd.interop.mesh_layout import MeshLayout, annotation_of, layout_of, layout_on_a_mesh_of
from hspmd.limits import brief


def _dtensor_api():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
    return DTensor, Partial, Replicate, Shard, DTensorSpec, ShardOrderEntry


def dtensor_layout(mesh, placements: Sequence, shard_order=None) -> MeshLayout:
    """The plain-data layout of DTensor `placements` on DeviceMesh `mesh` (shard order from
    `_StridedShard` placements, or the order given, or the default)."""
    _, Partial, Replicate, Shard, DTensorSpec, _ = _dtensor_api()
    placements = tuple(placements)
    if shard_order is None:
        try:
            placements, shard_order = DTensorSpec._normalize_placements_into_shard_order(placements, mesh)
        except ValueError as exc:
            raise InteropError(f"placements {placements} on mesh {tuple(mesh.shape)} state no shard order "
                               f"(a _StridedShard of a view, whose pieces are not boxes): {exc}") from None
    plain = []
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            plain.append(("S", p.dim))
        elif isinstance(p, Replicate):
            plain.append(("R",))
        elif type(p) is Partial and p.reduce_op == "sum":
            plain.append(("P",))
        elif isinstance(p, Partial):
            raise InteropError(f"mesh dim {m} is {p}: hspmd's Partial sums; a {p.reduce_op!r} reduction has no "
                               f"hspmd annotation yet")
        else:
            raise InteropError(f"mesh dim {m} is {p!r}, a placement kind with no hspmd annotation")
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    order = tuple((entry.tensor_dim, tuple(entry.mesh_dims)) for entry in shard_order)
    return MeshLayout(tuple(mesh.shape), ranks, tuple(plain), order)


def annotation_for(mesh, placements: Sequence, shape: Sequence[int], shard_order=None) -> Annotation:
    """The hspmd annotation of DTensor `placements` on `mesh` for a tensor of `shape` (no data needed:
    a checkpoint's or a redistribute target's layout)."""
    return annotation_of(dtensor_layout(mesh, placements, shard_order), tuple(int(n) for n in shape))


def from_dtensor(dtensor) -> tuple[Annotation, torch.Tensor]:
    """(annotation, local tensor) of a DTensor: the annotation under which every rank holds what the
    DTensor holds there (InteropError where hspmd cannot state the layout)."""
    DTensor = _dtensor_api()[0]
    if not isinstance(dtensor, DTensor):
        raise InteropError(f"from_dtensor needs a DTensor, got {brief(dtensor)}")
    spec = dtensor._spec
    order = None if spec.use_strided_shard_as_shard_order else spec.shard_order
    return annotation_for(spec.mesh, spec.placements, tuple(dtensor.shape), order), dtensor.to_local()


def _torch_placements(layout: MeshLayout, mesh) -> tuple:
    _, Partial, Replicate, Shard, DTensorSpec, ShardOrderEntry = _dtensor_api()
    placements = tuple(Shard(p[1]) if p[0] == "S" else Replicate() if p[0] == "R" else Partial() for p in layout.placements)
    if layout.is_default_order():
        return placements
    order = tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=ms) for d, ms in layout.shard_order)
    return DTensorSpec._convert_shard_order_to_StridedShard(order, placements, mesh)


def _inferred_shape(annotation: Annotation, local: torch.Tensor, rank: int) -> tuple[int, ...]:
    """The global shape under which `rank`'s piece has the local tensor's shape, where each split of
    the rank's subgroup divides (and the top tier's weights are proportional to the lengths, as
    from_dtensor makes them); to_dtensor checks it against every rank's piece."""
    if rank not in annotation.device_set:
        raise InteropError(f"rank {rank} is not among the devices {list(annotation.devices)} of {annotation}")
    k = annotation.subgroup_of(rank)
    states = annotation.subgroups[k].ds
    shape = [int(n) * states.split_count(d) for d, n in enumerate(local.shape)]
    if isinstance(annotation.hdim, int):
        weights = annotation.ratios
        if weights is None:
            raise InteropError(f"{annotation} splits dim {annotation.hdim} in ratios bound at run time: pass shape=")
        total = shape[annotation.hdim] * sum(weights)
        if total % weights[k]:
            raise InteropError(f"rank {rank}'s local shape {tuple(local.shape)} under {annotation} implies no whole "
                               f"length of dim {annotation.hdim}: pass shape=")
        shape[annotation.hdim] = total // weights[k]
    return tuple(shape)


def to_dtensor(local: torch.Tensor, annotation: Annotation | str, mesh=None, shape: Sequence[int] | None = None):
    """The DTensor whose local tensor on this rank is `local`, laid out as `annotation` on `mesh`
    (default: a DeviceMesh of the annotation's devices, `layout_on_a_mesh_of`). `shape` is the global shape
    (default: read off this rank's piece, which needs each split of its subgroup to divide).
    InteropError where no DTensor placements on the mesh state the annotation."""
    DTensor = _dtensor_api()[0]
    from torch.distributed.device_mesh import DeviceMesh
    annotation = parse(annotation)
    if not isinstance(local, torch.Tensor):
        raise InteropError(f"to_dtensor needs a torch.Tensor local, got {brief(local)}")
    rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else None
    is_local_tensor_mode = type(local).__name__ == "LocalTensor"
    if shape is None:
        if rank is None or is_local_tensor_mode:
            raise InteropError("to_dtensor: pass shape= (the global shape) where no process group names this rank")
        shape = _inferred_shape(annotation, local, rank)
    shape = tuple(int(n) for n in shape)
    if mesh is None:
        layout = layout_on_a_mesh_of(annotation, shape)
        mesh = DeviceMesh(local.device.type, torch.tensor(layout.ranks).reshape(layout.mesh_shape))
    else:
        layout = layout_of(annotation, shape, tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()))
    if rank is not None and not is_local_tensor_mode and rank in annotation.device_set:
        expected = device_pieces(annotation, shape)[rank].shape
        if tuple(local.shape) != tuple(expected):
            raise InteropError(f"rank {rank} holds a local tensor of shape {tuple(local.shape)}, but {annotation} gives it "
                               f"{tuple(expected)} of a {shape} tensor")
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensor.from_local(local, mesh, _torch_placements(layout, mesh), run_check=False, shape=torch.Size(shape),
                              stride=stride)


__all__ = ["annotation_for", "dtensor_layout", "from_dtensor", "to_dtensor"]
