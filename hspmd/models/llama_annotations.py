"""The annotations a Llama model takes from a strategy (hspmd.specialize.strategy.Strategy, read by
its fields): a union with one subgroup per pipeline, the subgroup being the stage of that pipeline
holding the layer.

Weight layout convention: a linear layer's weight is stored as (in_features, out_features) and
applied as y = x @ W. Column parallel therefore splits dim 1 (`S1:tp`), row parallel splits dim 0
(`S0:tp`). The embedding table is (vocab, hidden), the LM head weight (hidden, vocab). Norm
weights are `param_annotation(strategy, layer, "replicated")` (the final norm: the last layer's
stage); tokens enter at `activation_annotation(strategy, 0)`, logits and labels live at the last
layer's.
"""

from __future__ import annotations

from typing import Sequence

from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Duplicate, Split, Subgroup
from hspmd.errors import StrategyError, closest_hint
from hspmd.limits import brief

PARAM_KINDS = ("column", "row", "replicated")
EMBEDDING_KINDS = ("vocab", "replicated")


def _union(stages, axis_of, hdim="D", ratios=None, cp_axis=Duplicate) -> Annotation:
    """One subgroup per stage; stages of one (CP, TP) degree share one states object (what
    deduction and planning work out per distinct states is then worked out once). A stage with
    context parallelism adds `cp_axis(cp)` outside its TP axis (its ranks are CP-major)."""
    states: dict[tuple[int, int], DistributedStates] = {}

    def of(s) -> DistributedStates:
        inner, outer = axis_of(s.tp), cp_axis(s.cp)
        if s.cp == 1:
            axes = (inner,)
        elif isinstance(inner, Duplicate) and isinstance(outer, Duplicate):
            axes = (Duplicate(s.cp * s.tp),)  # (replicas of replicas: the form deduced layouts take)
        else:
            axes = (outer, inner)
        return states.setdefault((s.cp, s.tp), DistributedStates(axes))

    subgroups = tuple(Subgroup(DeviceGroup(s.ranks), of(s)) for s in stages)
    return Annotation(subgroups, hdim, ratios)


def param_annotation(strategy, layer: int, kind: str) -> Annotation:
    """A layer weight: duplicated across pipelines (HDim D) and a stage's CP groups, TP-sharded inside
    each. column: S1:tp (splits out_features), row: S0:tp (splits in_features), replicated: D:tp."""
    axis_of = _param_axis(kind, PARAM_KINDS, {"column": lambda n: Split(1, n), "row": lambda n: Split(0, n)})
    layer = strategy.check_layer(layer)
    return _union([strategy.stage_holding(layer, i) for i in range(len(strategy.pipelines))], axis_of)


def gradient_annotation(strategy, layer: int, kind: str) -> Annotation:
    """The weight's gradient before the once-per-step sync: one summand per pipeline (HDim P)."""
    return partial_over_pipelines(param_annotation(strategy, layer, kind))


def embedding_annotation(strategy, kind: str = "vocab") -> Annotation:
    """The (vocab, hidden) table on each pipeline's first stage; vocab: S0:tp, replicated: D:tp."""
    axis_of = _param_axis(kind, EMBEDDING_KINDS, {"vocab": lambda n: Split(0, n)})
    return _union([p.stages[0] for p in strategy.pipelines], axis_of)


def lm_head_annotation(strategy, kind: str = "vocab") -> Annotation:
    """The (hidden, vocab) LM head on each pipeline's last stage; vocab: S1:tp, replicated: D:tp."""
    axis_of = _param_axis(kind, EMBEDDING_KINDS, {"vocab": lambda n: Split(1, n)})
    return _union([p.stages[-1] for p in strategy.pipelines], axis_of)


def activation_annotation(strategy, layer: int, pipeline_dim: int = 0, seq_dim: int = 1) -> Annotation:
    """A micro-batch entering `layer`: split along `pipeline_dim` across pipelines in the ratio
    of their micro-batch sizes (run-time ratios if any is unbound), along `seq_dim` across a
    stage's CP groups, duplicated over each TP group. Tokens use layer 0, logits the last layer.
    Uneven CP shares make the CP groups the union's subgroups (its top tier splits the sequence
    in the shares), so they need a single pipeline."""
    layer = strategy.check_layer(layer)
    for name, dim in (("pipeline_dim", pipeline_dim), ("seq_dim", seq_dim)):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise StrategyError(f"{name} must be a tensor dim (integer >= 0), got {brief(dim)}")
    stages = [strategy.stage_holding(layer, i) for i in range(len(strategy.pipelines))]
    uneven = [s for s in stages if s.cp_shares is not None]
    if uneven:
        if len(stages) > 1:
            raise StrategyError(f"layer {layer}: uneven CP shares {list(uneven[0].cp_shares)} need a single pipeline "
                                f"(the sequence split across CP groups is the union's top tier), got {len(stages)} pipelines")
        (stage,) = stages
        subgroups = tuple(Subgroup(DeviceGroup(g), DistributedStates((Duplicate(stage.tp),))) for g in stage.cp_groups)
        return Annotation(subgroups, seq_dim, stage.cp_shares)
    return _union(stages, Duplicate, pipeline_dim, strategy.micro_batch_ratios, lambda n: Split(seq_dim, n))


def partial_over_pipelines(annotation: Annotation) -> Annotation:
    """The same union with HDim P: each pipeline holds a summand (per-pipeline partial gradients)."""
    return Annotation(annotation.subgroups, "P")


def _param_axis(kind: object, kinds: Sequence[str], split_of: dict):
    if kind not in kinds:
        raise StrategyError(f"unknown parameter kind {kind!r}: {closest_hint(str(kind), kinds)}")
    return split_of.get(kind, Duplicate)


__all__ = ["EMBEDDING_KINDS", "PARAM_KINDS", "activation_annotation", "embedding_annotation", "gradient_annotation",
           "lm_head_annotation", "param_annotation", "partial_over_pipelines"]
