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


def _union(stages, axis_of, hdim="D", ratios=None) -> Annotation:
    """One subgroup per stage; stages of one TP degree share one states object (what deduction
    and planning work out per distinct states is then worked out once)."""
    states: dict[int, DistributedStates] = {}
    subgroups = tuple(Subgroup(DeviceGroup(s.ranks), states.setdefault(s.tp, DistributedStates((axis_of(s.tp),))))
                      for s in stages)
    return Annotation(subgroups, hdim, ratios)


def param_annotation(strategy, layer: int, kind: str) -> Annotation:
    """A layer weight: duplicated across pipelines (HDim D), TP-sharded inside each holding stage.
    column: S1:tp (splits out_features), row: S0:tp (splits in_features), replicated: D:tp."""
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


def activation_annotation(strategy, layer: int, pipeline_dim: int = 0) -> Annotation:
    """A micro-batch entering `layer`: split along `pipeline_dim` across pipelines in the ratio
    of their micro-batch sizes (run-time ratios if any is unbound), duplicated over each TP group.
    Tokens use layer 0, logits the last layer."""
    layer = strategy.check_layer(layer)
    if isinstance(pipeline_dim, bool) or not isinstance(pipeline_dim, int) or pipeline_dim < 0:
        raise StrategyError(f"pipeline_dim must be a tensor dim (integer >= 0), got {brief(pipeline_dim)}")
    stages = [strategy.stage_holding(layer, i) for i in range(len(strategy.pipelines))]
    return _union(stages, Duplicate, pipeline_dim, strategy.micro_batch_ratios)


def partial_over_pipelines(annotation: Annotation) -> Annotation:
    """The same union with HDim P: each pipeline holds a summand (per-pipeline partial gradients)."""
    return Annotation(annotation.subgroups, "P")


def _param_axis(kind: object, kinds: Sequence[str], split_of: dict):
    if kind not in kinds:
        raise StrategyError(f"unknown parameter kind {kind!r}: {closest_hint(str(kind), kinds)}")
    return split_of.get(kind, Duplicate)


__all__ = ["EMBEDDING_KINDS", "PARAM_KINDS", "activation_annotation", "embedding_annotation", "gradient_annotation",
           "lm_head_annotation", "param_annotation", "partial_over_pipelines"]
