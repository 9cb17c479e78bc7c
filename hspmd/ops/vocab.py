"""Cross-entropy over logits whose class (vocabulary) dim is split across devices, without
gathering it: the vocabulary-parallel loss of Megatron-LM, expressed as ops with deduction rules
so that any strategy's layout of the logits works.

With the classes split over a group, each device holds logits x[..., lo:hi]. Per token:
  1. m  = max over the device's classes         (class_max: Partial, combined by maximum)
  2. M  = all-reduce max of m                   (comm(..., reduce="max"))
  3. s  = sum over the device's classes of exp(x - M),
     t  = x[label] on the device owning the label, else 0      (class_stats: Partial sums)
  4. all-reduce sum of s and t                  (comm)
  5. loss = sum over counted tokens of log(s) + M - t          (token_loss)
No device makes a tensor wider than its own classes. M is a constant to the gradient (the loss
does not depend on the shift), so the gradient of the logits is exp(x - M) / s - onehot(label),
made on each device for its own classes only.
"""

from __future__ import annotations

import torch

from hspmd.annotations import Duplicate, Partial, Split
from hspmd.errors import ShapeError
from hspmd.ir.dsl import comm
from hspmd.ir.graph import Derived, Node, Tensor
from hspmd.ir.shapes import format_shape, same_dim
from hspmd.ops.base import RuleOp, make
from hspmd.ops.nn import IGNORE_INDEX
from hspmd.ops.rules import Mismatch


def _class_rule(node: Node, class_split: str):
    """Position rule of ops taking logits [..., C] first and per-token values [...] after it.
    Where the logits' class dim is split, the per-token inputs must be whole (Duplicate) and the
    output is `class_split` ("partial": per-token values summed or maxed over the classes;
    "split": logits-shaped, split alike). Elsewhere every input is split alike or whole."""
    last = node.inputs[0].ndim - 1

    def rule(axes):
        first = axes[0]
        if any(isinstance(a, Partial) for a in axes):
            raise Mismatch("the logits and per-token inputs must not be partial; all-reduce them first")
        if isinstance(first, Split) and first.dim == last:
            if any(isinstance(a, Split) for a in axes[1:]):
                raise Mismatch("per-token inputs must be whole where the logits' classes are split")
            return (Partial(first.n), None) if class_split == "partial" else (Split(last, first.n), 0)
        if isinstance(first, Split):
            if not all(isinstance(a, Split) and a.dim == first.dim for a in axes[1:]):
                raise Mismatch("the logits and per-token inputs must be split alike")
            return Split(first.dim, first.n), 0
        if any(isinstance(a, Split) for a in axes[1:]):
            raise Mismatch("a per-token input is split where the logits are whole")
        return Duplicate(first.n), None

    return rule


def _label_positions(labels: torch.Tensor, ctx, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this device's classes, whether the label is one of them) per token."""
    local = labels - ctx.in_box(0)[-1][0]
    inside = (local >= 0) & (local < width)
    return local.clamp(0, max(width - 1, 0)), inside


class ClassMax(RuleOp):
    """Max over the device's classes, per token (-inf without classes). Where the classes are
    split the output is Partial *under maximum*: only comm(..., reduce="max") may combine it."""

    kind = "class_max"

    def rule(self, node: Node):
        return _class_rule(node, "partial")

    def compute(self, node, ctx, inputs):
        x = inputs[0]
        if x.shape[-1] == 0:
            return [torch.full(x.shape[:-1], -torch.inf, dtype=x.dtype, device=x.device)]
        return [x.amax(-1)]

    def gradient(self, node, grads):
        return [None]


class ClassStats(RuleOp):
    """(sum of exp(x - shift) over the device's classes, the label's logit if the device holds
    it else 0) per token; Partial sums where the classes are split."""

    kind = "class_stats"

    def rule(self, node: Node):
        return _class_rule(node, "partial")

    def compute(self, node, ctx, inputs):
        logits, shift, labels = inputs
        sumexp = torch.exp(logits - shift.unsqueeze(-1)).sum(-1)
        index, inside = _label_positions(labels, ctx, logits.shape[-1])
        if logits.shape[-1] == 0:
            return [sumexp, torch.zeros(labels.shape, dtype=logits.dtype, device=logits.device)]
        target = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        return [sumexp, torch.where(inside, target, torch.zeros((), dtype=logits.dtype, device=logits.device))]

    def gradient(self, node, grads):
        if all(g is None for g in grads):
            return [None, None, None]
        logits, shift, labels = node.inputs
        given = [g for g in grads if g is not None]
        attrs = {"sum": grads[0] is not None, "target": grads[1] is not None}
        g = make(CLASS_STATS_GRAD, [logits, shift, labels, *given], [(logits.shape, logits.dtype)], attrs=attrs)
        return [g.output, None, None]


class ClassStatsGrad(RuleOp):
    """Gradient of class_stats for the device's classes: exp(x - shift) * g_sum + onehot * g_target."""

    kind = "class_stats_grad"

    def rule(self, node: Node):
        return _class_rule(node, "split")

    def compute(self, node, ctx, inputs):
        logits, shift, labels, *given = inputs
        g_sum = given.pop(0) if node.attrs["sum"] else None
        g_target = given.pop(0) if node.attrs["target"] else None
        grad = torch.zeros_like(logits) if g_sum is None else \
            torch.exp(logits - shift.unsqueeze(-1)).mul_(g_sum.unsqueeze(-1))
        if g_target is not None and logits.shape[-1]:
            index, inside = _label_positions(labels, ctx, logits.shape[-1])
            grad.scatter_add_(-1, index.unsqueeze(-1), (g_target * inside).unsqueeze(-1).to(grad.dtype))
        return [grad]


class TokenLoss(RuleOp):
    """Sum over tokens not labelled IGNORE_INDEX of log(sumexp) + shift - target (inputs are
    per-token values with whole classes behind them); Partial where the tokens are split."""

    kind = "token_loss"

    def rule(self, node: Node):
        with_grad = node.kind == "token_loss_grad"

        def rule(axes):
            values = axes[:4]
            if any(isinstance(a, Partial) for a in values):
                raise Mismatch("per-token statistics must not be partial; all-reduce them first")
            splits = [a for a in values if isinstance(a, Split)]
            if splits:
                if len(splits) != len(values) or len({a.dim for a in splits}) != 1:
                    raise Mismatch("per-token statistics and labels must be split alike")
                if with_grad:
                    if isinstance(axes[4], Partial):
                        raise Mismatch("the loss gradient is partial where the tokens are split")
                    return Split(splits[0].dim, splits[0].n), 0
                return Partial(splits[0].n), None
            return (axes[4], None) if with_grad else (Duplicate(values[0].n), None)

        return rule

    def compute(self, node, ctx, inputs):
        sumexp, shift, target, labels = inputs
        counted = labels != IGNORE_INDEX
        per_token = torch.log(sumexp) + shift - target
        return [torch.where(counted, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device)).sum()]

    def gradient(self, node, grads):
        if grads[0] is None:
            return [None] * 4
        sumexp, shift, target, labels = node.inputs
        g = make(TOKEN_LOSS_GRAD, [sumexp, shift, target, labels, grads[0]],
                 [(sumexp.shape, sumexp.dtype), (target.shape, target.dtype)])
        return [g.outputs[0], None, g.outputs[1], None]


class TokenLossGrad(TokenLoss):
    """(d sumexp, d target) = (g / sumexp, -g) on counted tokens, 0 on ignored ones."""

    kind = "token_loss_grad"

    def compute(self, node, ctx, inputs):
        sumexp, _, _, labels, g = inputs
        counted = (labels != IGNORE_INDEX).to(sumexp.dtype)
        return [counted * g / sumexp, -counted * g]

    def gradient(self, node, grads):
        return [None] * len(node.inputs)


CLASS_MAX, CLASS_STATS, CLASS_STATS_GRAD = ClassMax(), ClassStats(), ClassStatsGrad()
TOKEN_LOSS, TOKEN_LOSS_GRAD = TokenLoss(), TokenLossGrad()


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of the token cross-entropies of logits [..., classes] against integer labels [...]
    (IGNORE_INDEX counts for nothing), for any layout of the logits, the class dim split or not:
    the per-token statistics are all-reduced into the labels' layout, the classes never gathered."""
    if labels.ndim != logits.ndim - 1 or not all(same_dim(a, b) for a, b in zip(logits.shape, labels.shape)):
        raise ShapeError(f"vocab_parallel_cross_entropy: labels {format_shape(labels.shape)} must match logits "
                         f"{format_shape(logits.shape)} without the class dim")
    tokens = labels.shape
    to_labels = Derived((labels,), lambda _, refs: refs[0], f"layout of {labels.name}")
    local_max = make(CLASS_MAX, [logits], [(tokens, logits.dtype)]).output
    shift = comm(local_max, to_labels, reduce="max")
    stats = make(CLASS_STATS, [logits, shift, labels], [(tokens, logits.dtype), (tokens, logits.dtype)])
    sumexp, target = (comm(t, to_labels) for t in stats.outputs)
    return make(TOKEN_LOSS, [sumexp, shift, target, labels], [((), logits.dtype)]).output


__all__ = ["vocab_parallel_cross_entropy"]
