"""hspmd: hierarchical SPMD training for heterogeneous and unstable clusters (after Hetu v2).

The public facade: annotations and their geometry; the graph IR, DSL and op library; deduction and
specialization; communication resolution and plan execution; the trainer and strategy switching."""

from hspmd import ops
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
from hspmd.backends.plan_executor import run_plan
from hspmd.cluster import ClusterSpec, parse_cluster
from hspmd.comm_resolve import FusedPlan, Plan, resolve, resolve_many
from hspmd.errors import HSPMDError
from hspmd.interop import from_dtensor, to_dtensor
from hspmd.ir import Binding, Derived, comm, parameter, placeholder, state, symbols
from hspmd.ops import SGD, AdamW, Graph, gradients
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.run import DeviceState, run_backward, run_forward, run_update
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.deduce import deduce
from hspmd.specialize.specialized import specialize_graph
from hspmd.switching import execute_switch, plan_switch, recover_strategy

__all__ = [
    # annotations
    "Annotation", "DeviceGroup", "DistributedStates", "Duplicate", "Hierarchy", "HSPMDError", "Partial", "Split",
    "Subgroup", "device_pieces", "parse", "parse_hierarchy", "shard", "unshard",
    # graph IR, DSL, op library, specialization
    "AdamW", "Binding", "Derived", "DeviceState", "Graph", "InProcessJob", "SGD", "comm", "deduce", "gradients",
    "ops", "parameter", "placeholder", "run_backward", "run_forward", "run_update", "specialize_graph", "state", "symbols",
    # communication resolution and plan execution
    "ClusterSpec", "FusedPlan", "Plan", "parse_cluster", "resolve", "resolve_many", "run_plan",
    # the trainer and strategy switching
    "MicroBatchLayout", "Trainer", "execute_switch", "plan_switch", "recover_strategy",
    # the DTensor bridge (torch.distributed.tensor is imported when a bridge function is called)
    "from_dtensor", "to_dtensor",
]
