"""Bridges to the torch ecosystem: DTensor layouts <-> hspmd annotations (mesh_layout.py: the geometry
as plain data; dtensor.py: DTensor objects)."""

from hspmd.interop.dtensor import annotation_for, dtensor_layout, from_dtensor, to_dtensor
from hspmd.interop.mesh_layout import MeshLayout, annotation_of, layout_of, layout_pieces

__all__ = ["MeshLayout", "annotation_for", "annotation_of", "dtensor_layout", "from_dtensor", "layout_of", "layout_pieces",
           "to_dtensor"]
