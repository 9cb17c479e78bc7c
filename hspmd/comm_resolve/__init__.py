"""Hierarchical communication resolution: from a (src, dst) annotation pair to a plan of primitives."""

from hspmd.comm_resolve.plan import PRIMITIVES, Collective, FusedPlan, Plan, Step, TensorMove, Transfer
from hspmd.comm_resolve.resolver import resolve
from hspmd.comm_resolve.fused import resolve_many
from hspmd.comm_resolve.topology import ClusterSpec, cluster_for

__all__ = [
    "PRIMITIVES", "ClusterSpec", "Collective", "FusedPlan", "Plan", "Step", "TensorMove", "Transfer", "cluster_for", "resolve",
    "resolve_many",
]
