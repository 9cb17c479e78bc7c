"""HSPMD annotations: value types, text syntax, shard geometry and reference shard/unshard."""

from hspmd.annotations.algebra import align_hsize, expand_hsize
from hspmd.annotations.geometry import (
    Box,
    Piece,
    box_intersection,
    box_relative,
    box_shape,
    device_piece,
    device_pieces,
    split_bounds,
    subgroup_pieces,
    subgroup_regions,
)
from hspmd.annotations.reference import infer_shape, shard, unshard
from hspmd.annotations.states import REDUCTIONS, Axis, DeviceGroup, DistributedStates, Duplicate, HDim, Partial, Split, Subgroup
from hspmd.annotations.union import Annotation, Hierarchy
from hspmd.annotations.syntax import parse, parse_hierarchy

__all__ = [
    "Annotation", "Axis", "align_hsize", "expand_hsize", "Box", "DeviceGroup", "DistributedStates", "Duplicate", "HDim", "Hierarchy",
    "Partial", "Piece", "REDUCTIONS", "Split", "Subgroup", "box_intersection", "box_relative", "box_shape",
    "device_piece", "device_pieces", "infer_shape", "parse", "parse_hierarchy", "shard", "split_bounds", "subgroup_pieces",
    "subgroup_regions", "unshard",
]
