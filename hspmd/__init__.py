"""hspmd: hierarchical SPMD training for heterogeneous and unstable clusters (after Hetu v2)."""

from hspmd.annotations import (
    Annotation,
    DeviceGroup,
    DistributedStates,
    Duplicate,
    Hierarchy,
    Partial,
    Split,
    Subgroup,
    device_pieces,
    parse,
    parse_hierarchy,
    shard,
    unshard,
)
from hspmd.errors import HSPMDError

__all__ = [
    "Annotation", "DeviceGroup", "DistributedStates", "Duplicate", "Hierarchy", "HSPMDError", "Partial", "Split",
    "Subgroup", "device_pieces", "parse", "parse_hierarchy", "shard", "unshard",
]
