"""Reference semantics of annotations: shard a whole tensor into per-device locals and back.

Every plan and executor is tested against these two functions. `shard` turns Partial into random
summands that add up to the value, so a plan that drops or double-counts a summand is caught;
`unshard` checks that replicas agree instead of trusting one of them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hspmd.annotations.geometry import (
    box_intersection, box_relative, check_shape, device_pieces, split_index, subgroup_pieces, subgroup_regions,
)
from hspmd.annotations.states import Subgroup
from hspmd.annotations.union import Annotation
from hspmd.annotations.syntax import parse
from hspmd.errors import ReplicaMismatch, ShapeError, ShapeTypeError


def _random_partials(value: torch.Tensor, n: int, gen: torch.Generator, reduce: str = "sum") -> list[torch.Tensor]:
    """`n` random tensors whose reduction `reduce` (states.REDUCTIONS) is `value`: every one
    differs from the value, so a plan that drops, repeats or wrongly combines one is caught."""
    if n == 1:
        return [value]
    noise = [torch.randn(value.shape, generator=gen, dtype=value.dtype) for _ in range(n - 1)]
    if reduce == "sum":
        return noise + [value - sum(noise)]
    if reduce == "avg":
        parts = [value + e for e in noise]
        return parts + [value * n - sum(parts)]
    if reduce == "prod":  # factors near 1 (never 0), the last one making up the value
        factors = [torch.exp(0.25 * e) for e in noise]
        rest = factors[0]
        for f in factors[1:]:
            rest = rest * f
        return factors + [value / rest]
    holder = torch.randint(n, value.shape, generator=gen)  # per element, the member holding the value itself
    away = -1.0 if reduce == "max" else 1.0
    gaps = noise + [torch.randn(value.shape, generator=gen, dtype=value.dtype)]
    return [torch.where(holder == j, value, value + away * gap.abs()) for j, gap in enumerate(gaps)]


def combine(values: Sequence[torch.Tensor], reduce: str = "sum") -> torch.Tensor:
    """The reduction `reduce` (states.REDUCTIONS) of equally shaped partial values."""
    if reduce == "sum" or len(values) == 1:
        return values[0] if len(values) == 1 else sum(values[1:], values[0])
    stacked = torch.stack(list(values))
    return {"max": lambda: stacked.amax(0), "min": lambda: stacked.amin(0), "avg": lambda: stacked.mean(0),
            "prod": lambda: stacked.prod(0)}[reduce]()


def _check_partial_dtype(x: torch.Tensor, ann: Annotation) -> None:
    """Partial values need floating-point (or, but for max and min, complex) elements."""
    if not ann.has_partial:
        return
    if ann.reduction in ("max", "min") and not torch.is_floating_point(x):
        raise ShapeError(f"{ann} has {ann.reduction} partials, which need a real floating-point tensor, got {x.dtype}")
    if not (torch.is_floating_point(x) or torch.is_complex(x)):
        raise ShapeError(f"{ann} has Partial values, which need a floating-point or complex tensor, got {x.dtype}")


def shard(
    x: torch.Tensor, ann: Annotation | str, seed: int = 0, ratios: Sequence[int] | None = None
) -> dict[int, torch.Tensor]:
    """{device: local tensor} for the whole tensor `x` laid out as `ann`."""
    ann = parse(ann)
    if not isinstance(x, torch.Tensor):
        raise ShapeTypeError(f"shard needs a torch.Tensor, got {type(x).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ShapeTypeError(f"shard's seed must be an integer, got {seed!r}")
    _check_partial_dtype(x, ann)
    gen = torch.Generator().manual_seed(seed)
    regions = subgroup_regions(ann, tuple(x.shape), ratios)
    tops = _random_partials(x, ann.hsize, gen) if ann.hdim == "P" else [x] * ann.hsize
    out: dict[int, torch.Tensor] = {}
    for sub, region, top in zip(ann.subgroups, regions, tops):
        whole = tuple((0, s) for s in x.shape)
        value = top[box_relative(region, whole)]
        summands = _random_partials(value, sub.ds.partial_count, gen, sub.ds.reduction)
        for device, piece in subgroup_pieces(sub, region).items():
            j = piece.summand[0] if piece.summand else 0
            out[device] = summands[j][box_relative(piece.box, region)].clone()
    return out


def _subgroup_shape(sub: Subgroup, locals_: Mapping[int, torch.Tensor], ndim: int) -> list[int]:
    """The subgroup region's shape, read off the local shapes (one device per split index)."""
    shape = []
    for dim in range(ndim):
        lengths: dict[int, int] = {}
        for index, device in enumerate(sub.dg.devices):
            lengths.setdefault(split_index(sub, index, dim)[0], locals_[device].shape[dim])
        shape.append(sum(lengths.values()))
    return shape


def check_locals(locals_: Mapping[int, torch.Tensor], ann: Annotation) -> tuple[int, torch.dtype]:
    """(rank, dtype) shared by the locals of every device of `ann`; a missing device, a non-tensor,
    or locals of different ranks or dtypes raise (mixed dtypes are refused, never downcast)."""
    if not isinstance(locals_, Mapping):
        raise ShapeTypeError(f"unshard needs a mapping {{device: tensor}}, got {type(locals_).__name__}")
    missing = [d for d in ann.devices if d not in locals_]
    if missing:
        raise ShapeError(f"unshard: no local tensor for device(s) {missing} of {ann}")
    first = ann.devices[0]
    for d in ann.devices:
        if not isinstance(locals_[d], torch.Tensor):
            raise ShapeTypeError(f"unshard: device {d} holds {type(locals_[d]).__name__}, not a torch.Tensor")
    ndim, dtype = locals_[first].dim(), locals_[first].dtype
    for d in ann.devices:
        local = locals_[d]
        if local.dim() != ndim:
            raise ShapeError(f"unshard {ann}: device {d} holds a rank-{local.dim()} tensor, device {first} a rank-{ndim} one")
        if local.dtype != dtype:
            raise ShapeError(
                f"unshard {ann}: device {d} holds {local.dtype}, device {first} {dtype}; cast the pieces to one "
                f"dtype first (unshard never downcasts)"
            )
    return ndim, dtype


def infer_shape(locals_: Mapping[int, torch.Tensor], ann: Annotation | str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(global shape, top-tier ratios) implied by the local shapes; ratios None unless HDim is a dim.
    `ann` may be annotation text, as for shard and unshard."""
    ann = parse(ann)
    ndim, _ = check_locals(locals_, ann)
    ann.check_rank(ndim, "unshard")
    shapes = [_subgroup_shape(s, locals_, ndim) for s in ann.subgroups]
    if not isinstance(ann.hdim, int):
        return tuple(shapes[0]), None
    shape = list(shapes[0])
    shape[ann.hdim] = sum(s[ann.hdim] for s in shapes)
    return tuple(shape), tuple(max(s[ann.hdim], 0) for s in shapes)


def _agree(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if torch.is_floating_point(a) or torch.is_complex(a):
        return torch.allclose(a, b, rtol=rtol, atol=atol)
    return torch.equal(a, b)


def unshard(
    locals_: Mapping[int, torch.Tensor],
    ann: Annotation | str,
    shape: Sequence[int] | None = None,
    ratios: Sequence[int] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> torch.Tensor:
    """The whole tensor from {device: local}; raises ReplicaMismatch if replicas disagree.

    Shape and run-time ratios are read off the locals unless given."""
    ann = parse(ann)
    _, dtype = check_locals(locals_, ann)
    if shape is None:
        shape, inferred = infer_shape(locals_, ann)
        if ann.ratios is None and ratios is None and inferred is not None:
            ratios = tuple(inferred) if sum(inferred) > 0 else (1,) * ann.hsize
    shape = check_shape(ann, shape, "unshard")
    pieces = device_pieces(ann, shape, ratios)
    regions = subgroup_regions(ann, shape, ratios)
    on = next(iter(locals_.values())).device  # the whole tensor is made where the pieces are (a GPU's too)
    values = []
    for sub, region in zip(ann.subgroups, regions):
        seen: dict[tuple, int] = {}
        partials: dict[tuple, torch.Tensor] = {}  # summand -> its value of the region
        for device in sub.dg:
            piece, local = pieces[device], locals_[device]
            if tuple(local.shape) != tuple(piece.shape):
                raise ShapeError(
                    f"unshard: device {device} holds shape {tuple(local.shape)} but {ann} gives it "
                    f"{tuple(piece.shape)} of a {shape} tensor"
                )
            key = (piece.box, piece.summand)
            if key not in seen:
                seen[key] = device
                if piece.summand not in partials:
                    partials[piece.summand] = torch.zeros([b - a for a, b in region], dtype=dtype, device=on)
                partials[piece.summand][box_relative(piece.box, region)] = local
            elif not _agree(locals_[seen[key]], local, rtol, atol):
                raise ReplicaMismatch(
                    f"unshard {ann}: devices {seen[key]} and {device} should hold equal copies of box {piece.box}"
                    f"{' summand ' + str(piece.summand) if piece.summand else ''} but differ "
                    f"(max abs diff {_max_diff(locals_[seen[key]], local):g})"
                )
        values.append(combine([partials[j] for j in sorted(partials)], sub.ds.reduction))
    if ann.hdim == "P":
        return sum(values[1:], values[0])
    if ann.hdim == "D":
        for k in range(1, ann.hsize):
            if not _agree(values[0], values[k], rtol, atol):
                raise ReplicaMismatch(
                    f"unshard {ann}: subgroups 0 and {k} should both hold the whole tensor but differ "
                    f"(max abs diff {_max_diff(values[0], values[k]):g}){_culprits(ann, pieces, locals_, values[0], k, rtol, atol)}"
                )
        return values[0]
    out = torch.zeros(shape, dtype=dtype)
    whole = tuple((0, s) for s in shape)
    for region, value in zip(regions, values):
        out[box_relative(region, whole)] = value
    return out


def _culprits(ann: Annotation, pieces, locals_, first: torch.Tensor, k: int, rtol: float, atol: float) -> str:
    """Which devices disagree, for a message: a device of subgroup k whose piece differs from
    subgroup 0's values there, and the devices of subgroup 0 holding that box (one side is wrong)."""
    for device in ann.subgroups[k].dg:
        box = pieces[device].box
        whole = tuple((0, n) for n in first.shape)
        if not _agree(first[box_relative(box, whole)], locals_[device], rtol, atol):
            others = [d for d in ann.subgroups[0].dg if box_intersection(pieces[d].box, box) is not None]
            return f": device {device} holds box {box} unlike device(s) {others} of subgroup 0"
    return ""


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    if torch.is_complex(a):
        return (a.to(torch.complex128) - b.to(torch.complex128)).abs().max().item()
    return (a.double() - b.double()).abs().max().item()
