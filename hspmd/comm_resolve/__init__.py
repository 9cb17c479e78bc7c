"""Hierarchical communication resolution: from a (src, dst) annotation pair to a plan of primitives."""

from hspmd.comm_resolve.plan import PRIMITIVES, Collective, FusedPlan, Plan, Step, TensorMove, Transfer
from hspmd.comm_resolve.resolver import resolve
from hspmd.comm_resolve.fused import resolve_many
from hspmd.comm_resolve.topology import Link, Topology

__all__ = [
    "PRIMITIVES", "Collective", "FusedPlan", "Link", "Plan", "Step", "TensorMove", "Topology", "Transfer", "resolve",
    "resolve_many",
]
