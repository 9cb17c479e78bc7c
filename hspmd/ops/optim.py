"""Optimizers as graph ops (phase "update", once per step after the micro-batches).

minimize() builds the backward graph, then per parameter: a gradient CommOp to the parameter's
layout (Partial gradients -> AllReduce; per-pipeline summands of a heterogeneous union ->
SplitAllReduce), the update op, and assignments of the new values. With ZeRO-1 the gradient goes
to a sharded layout instead (ReduceScatter / SplitReduceScatter), the optimizer states live in
that layout, and the updated shard is gathered back (AllGather / SplitAllGather).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from hspmd.annotations import Annotation, Axis, DistributedStates, Duplicate, Split
from hspmd.errors import DeductionError, HSPMDError
from hspmd.ir.dsl import comm, state
from hspmd.ir.graph import Derived, Node, OpDef, Tensor
from hspmd.ops.autodiff import gradients
from hspmd.ops.base import RuleOp, make
from hspmd.ops.rules import elementwise_rule


def zero_annotation(ann: Annotation, ndim: int) -> Annotation:
    """ZeRO-1 layout of a parameter of rank `ndim`: replicas hold disjoint shards.

    Bottom tier: Duplicate axes become splits of dim 0. Top tier: HDim D becomes a split (equal
    shares per subgroup) of the first dim that no subgroup then splits, so that each device's
    shard lies inside its own bottom-tier piece and the gradient sync from HP{S0:tp} is one
    reduce-scatter per bottom-tier position over the data-parallel members. Splitting a dim
    the bottom tier splits would cut across those pieces: one collective per slice over every
    member, O(DP^2 x TP) at scale, costlier than the memory it saves; so when every dim is split
    below (a 1-D norm weight on a TP stage), the top tier keeps whole copies of its subgroup's
    shards. Computed once per annotation object (layers on one stage share it)."""
    return ann.derived((zero_annotation, ndim), lambda: _zero_annotation(ann, ndim))


def _zero_annotation(ann: Annotation, ndim: int) -> Annotation:
    def shard(axis: Axis) -> Axis:
        return Split(0, axis.n) if isinstance(axis, Duplicate) else axis

    sharded = ann.restated(lambda ds: DistributedStates(tuple(map(shard, ds.axes))), ann.hdim, ann.ratios)
    split = {d for ds in {id(ds): ds for ds in sharded.ds_union}.values() for d in ds.split_dims}
    top = next((d for d in range(ndim) if d not in split), None)
    if ann.hdim == "D" and ann.hsize > 1 and top is not None:
        return sharded.restated(lambda ds: ds, top, (1,) * ann.hsize)
    return sharded


class Update(RuleOp):
    """Elementwise optimizer step on (param, grad, *states) -> (param, *states); no Partial."""

    def __init__(self, kind: str, step_fn):
        self.kind, self.step_fn = kind, step_fn

    def rule(self, node: Node):
        return elementwise_rule([t.shape for t in node.inputs], node.inputs[0].shape, "none")

    def compute(self, node, ctx, inputs):
        return list(self.step_fn(node.attrs, ctx.step, *inputs))

    def describe(self, node):
        return ", ".join(f"{k}={v}" for k, v in node.attrs.items())


# The updates return fresh tensors (inputs are never written: a leaf may still be read elsewhere in
# the step) but fuse scalar products into one kernel each (torch.add(alpha=), addcmul, addcdiv).

def _adamw(attrs, step, p, g, m, v):
    b1, b2 = attrs["betas"]
    lr = attrs["lr"]
    m = torch.add(m * b1, g, alpha=1 - b1)
    v = torch.addcmul(v * b2, g, g, value=1 - b2)
    denom = (v / (1 - b2 ** step)).sqrt_().add_(attrs["eps"])
    decayed = p * (1 - lr * attrs["weight_decay"]) if attrs["weight_decay"] else p
    p = torch.addcdiv(decayed, m, denom, value=-lr / (1 - b1 ** step))
    return p, m, v


def _sgd(attrs, step, p, g, *buf):
    if attrs["weight_decay"]:
        g = torch.add(g, p, alpha=attrs["weight_decay"])
    if buf:
        b = g if step == 1 else torch.add(g, buf[0], alpha=attrs["momentum"])
        return torch.add(p, b, alpha=-attrs["lr"]), b
    return (torch.add(p, g, alpha=-attrs["lr"]),)


ADAMW_UPDATE, SGD_UPDATE = Update("adamw_update", _adamw), Update("sgd_update", _sgd)


class Assign(OpDef):
    """Write `value` into the leaf `target` at the end of the step; layouts must be equal."""

    kind = "assign"

    def deduce(self, node, anns):
        target, value = anns
        if target != value:
            raise DeductionError(
                f"assign {node.name}: the new value of {node.inputs[0].name} is laid out as {value} but the "
                f"leaf is {target}; insert comm(value, ...) to the leaf's annotation"
            )
        return []

    def describe(self, node):
        return f"-> {node.inputs[0].name}"


ASSIGN = Assign()


def assign(target: Tensor, value: Tensor) -> Node:
    if not target.node.opdef.is_leaf or target.node.kind == "placeholder":
        raise HSPMDError(f"assign: {target.name} must be a parameter or state")
    return make(ASSIGN, [target, value], [], name=f"{target.node.name}.assign")


def _follow(param: Tensor, zero: bool, what: str) -> Derived:
    fn = (lambda _, refs: zero_annotation(refs[0], param.ndim)) if zero else (lambda _, refs: refs[0])
    return Derived((param,), fn, f"{'ZeRO-1 shard' if zero else 'layout'} of {param.name} ({what})")


@dataclass
class Optimizer:
    """Base: builds backward + gradient sync + update ops into the loss's graph."""

    lr: float
    weight_decay: float = 0.0
    zero: bool = False
    state_names: tuple[str, ...] = field(default=(), init=False)

    def _update(self, p: Tensor, g: Tensor, states: Sequence[Tensor]) -> list[Tensor]:
        raise HSPMDError(f"{type(self).__name__} defines no update")

    def minimize(self, loss: Tensor, params: Sequence[Tensor] | None = None) -> dict[str, Tensor]:
        """Add the training step to the graph; returns {param name: synchronised gradient}."""
        graph = loss.graph
        params = list(params) if params is not None else [n.output for n in graph.parameters]
        grads = gradients(loss, params)
        graph.losses.append(loss)
        synced = {}
        # In the order the backward finalises the gradients: what syncs first is updated first, so
        # a runtime that synchronises during the backward (hspmd.runtime.execution.buckets) can update the
        # first-synchronised parameters while the last gradients are still being reduced.
        made = sorted((g.node.id, i) for i, g in enumerate(grads) if g is not None)
        with graph.phase("update"):
            for p, g in ((params[i], grads[i]) for _, i in made):
                name = p.node.name
                g_sync = comm(g, _follow(p, self.zero, "gradient"), name=f"{name}.grad_sync")
                synced[name] = graph.gradients[name] = g_sync
                if self.zero:
                    shard = comm(p, _follow(p, True, "parameter shard"), name=f"{name}.shard")
                else:
                    shard = p
                states = [state(graph, f"{name}.{s}", p, _follow(p, self.zero, s)) for s in self.state_names]
                new = self._update(shard, g_sync, states)
                new_p = comm(new[0], _follow(p, False, "gathered update"), name=f"{name}.gather") if self.zero else new[0]
                assign(p, new_p)
                for s, value in zip(states, new[1:]):
                    assign(s, value)
        return synced


@dataclass
class AdamW(Optimizer):
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        self.state_names = ("exp_avg", "exp_avg_sq")

    def _update(self, p, g, states):
        attrs = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}
        return list(make(ADAMW_UPDATE, [p, g, *states], [(p.shape, p.dtype)] * 3, attrs=attrs,
                         name=f"{p.node.name}.adamw").outputs)


@dataclass
class SGD(Optimizer):
    momentum: float = 0.0

    def __post_init__(self):
        self.state_names = ("momentum",) if self.momentum else ()

    def _update(self, p, g, states):
        attrs = {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        return list(make(SGD_UPDATE, [p, g, *states], [(p.shape, p.dtype)] * (1 + len(states)), attrs=attrs,
                         name=f"{p.node.name}.sgd").outputs)


__all__ = ["AdamW", "Optimizer", "SGD", "assign", "zero_annotation"]
