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

# Graph IR, DSL, op library and specialization (issue 4).
from hspmd import ops
from hspmd.ir import Binding, Derived, comm, parameter, placeholder, state, symbols
from hspmd.ops import SGD, AdamW, Graph, gradients
from hspmd.specialize.deduce import deduce
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.execution.run import DeviceState, run_backward, run_forward, run_update
from hspmd.specialize.specialized import specialize_graph

__all__ += [
    "AdamW", "Binding", "Derived", "DeviceState", "Graph", "InProcessJob", "SGD", "comm", "deduce", "gradients",
    "ops", "parameter", "placeholder", "run_backward", "run_forward", "run_update", "specialize_graph", "state", "symbols",
]

# Hierarchical communication resolution and plan execution (issue 3).
from hspmd.cluster import ClusterSpec, parse_cluster
from hspmd.comm_resolve import FusedPlan, Plan, resolve, resolve_many
from hspmd.backends.plan_executor import run_plan

__all__ += ["ClusterSpec", "FusedPlan", "Plan", "parse_cluster", "resolve", "resolve_many", "run_plan"]

# Distributed runtime (issue 5) and strategy switching.
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.training.trainer import Trainer
from hspmd.switching import execute_switch, plan_switch, recover_strategy

__all__ += ["MicroBatchLayout", "Trainer", "execute_switch", "plan_switch", "recover_strategy"]
