"""The DSL entry points that create leaves and CommOps: placeholder, parameter, state, comm.

    g = Graph("mlp")
    B, = symbols("B")
    x = placeholder(g, "x", (B, 8), annotation="S0:2@[0,1]")
    w = parameter(g, "w", (8, 16), init=init.normal(0.02), annotation="D:2@[0,1]")
    y = comm(x @ w, "D:2@[0,1]")

`annotation` is one annotation, a list (one per strategy) or a Hierarchy; it may be left out and
given later with Graph.add_strategy.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from hspmd.annotations import Annotation, Box
from hspmd.errors import HSPMDError
from hspmd.ir.graph import Derived, Graph, Node, OpDef, Tensor
from hspmd.ir.init import Initializer, as_initializer, make_piece, normal, zeros
from hspmd.ir.shapes import as_shape

class _Leaf(OpDef):
    is_leaf = True

    def __init__(self, kind: str):
        self.kind = kind

    def describe(self, node: Node) -> str:
        return str(node.output.dtype).replace("torch.", "")


PLACEHOLDER, PARAMETER, STATE = _Leaf("placeholder"), _Leaf("parameter"), _Leaf("state")


class CommDef(OpDef):
    """Changes a tensor's annotation (the only op allowed to change its DG union or HSize).

    Its value is its input's; specialization replaces it by the resolved primitives. Its gradient
    is the reverse reshard: back to the input's annotation, with Partial read as Duplicate (the
    gradient of a sum reaches every summand whole). With attrs reduce="max" the partial values
    are combined by their maximum instead of their sum (only all-reduces do that); such a comm
    has no gradient (a maximum used as a shift is a constant to its result)."""

    kind = "comm"
    is_comm = True

    def describe(self, node: Node) -> str:
        return "reduce=max" if node.attrs.get("reduce") == "max" else ""

    def gradient(self, node: Node, grads):
        (g,) = grads
        if g is None or node.attrs.get("reduce") == "max":
            return [None]
        x = node.inputs[0]
        return [comm(g, Derived((x,), lambda own, refs: summand_gradient_annotation(refs[0], (own,)),
                                f"grad layout of {x.name}"), name=node.graph.unique_name(node.name))]


def gradient_annotation(ann: Annotation) -> Annotation:
    """The layout a gradient takes when it flows back to a tensor laid out as `ann`: the same
    splits, with every Partial (bottom tier or HDim P) read as Duplicate. Computed once per
    annotation object."""
    return ann.derived(gradient_annotation, lambda: _gradient_annotation(ann))


def summand_gradient_annotation(ann: Annotation, incoming: Sequence[Annotation | None]) -> Annotation:
    """The layout of the gradient flowing back to `ann` from gradients laid out as `incoming`:
    gradient_annotation(ann), except where `ann` is replicated over its subgroups (HDim D, HSize > 1,
    e.g. a weight over pipelines) and every incoming gradient holds one summand per subgroup (HDim P,
    as many subgroups). Then the gradient stays one summand per subgroup (HDim P): each subgroup's
    summand moves inside its own subgroup (a tied LM head's gradient goes from the last stage back
    to the first stage of its own pipeline) and the summands meet once per step in the parameter's
    gradient sync, for any micro-batch counts, rather than across subgroups in every micro-batch."""
    whole = gradient_annotation(ann)
    if ann.hdim == "D" and ann.hsize > 1 and incoming and all(
            i is not None and i.hdim == "P" and i.hsize == ann.hsize for i in incoming):
        return Annotation.known(whole.subgroups, "P", None)
    return whole


def _gradient_annotation(ann: Annotation) -> Annotation:
    from hspmd.annotations import DistributedStates, Duplicate, Partial

    def summed(ds: DistributedStates) -> DistributedStates:
        return DistributedStates(tuple(Duplicate(a.n) if isinstance(a, Partial) else a for a in ds.axes))

    hdim = "D" if ann.hdim == "P" else ann.hdim
    return ann.restated(summed, hdim, ann.ratios if isinstance(hdim, int) else None)


COMM = CommDef()
REDUCTIONS = ("sum", "max")


def placeholder(graph: Graph, name: str, shape: Sequence[object], dtype: torch.dtype = torch.float32,
                annotation: object = None, values: tuple[int, int, tuple[int, ...]] | None = None) -> Tensor:
    """A per-micro-batch input, fed at run time. `values`: (low, high, extras), the values a feed
    may hold (low <= v < high, or one of extras; e.g. token ids below the vocabulary size), checked
    before a step runs so that a bad id fails by name rather than inside one rank's schedule."""
    if values is not None:
        low, high, extras = values
        if not (isinstance(low, int) and isinstance(high, int) and low < high and all(isinstance(e, int) for e in extras)):
            raise HSPMDError(f"placeholder {name}: values must be (low, high, extras) ints with low < high, got {values}")
        values = (low, high, tuple(extras))
    node = graph.add_node(PLACEHOLDER, (), [(as_shape(shape, f"placeholder {name}"), dtype)], name=name,
                          attrs=None if values is None else {"values": values})
    graph.set_annotation(node, annotation)
    return node.output


def parameter(graph: Graph, name: str, shape: Sequence[object], init: Initializer | None = None,
              dtype: torch.dtype = torch.float32, annotation: object = None) -> Tensor:
    """A trained weight. `init` (hspmd.ir.init) makes any piece without the whole tensor, from
    a seed derived from the name, so every device agrees with a single-device run."""
    full = as_shape(shape, f"parameter {name}")
    if any(not isinstance(d, int) for d in full):
        raise HSPMDError(f"parameter {name}: shape {full} must be concrete ints (no run-time symbols)")
    node = graph.add_node(PARAMETER, (), [(full, dtype)], name=name)
    node.init = as_initializer(init or normal(0.02))
    graph.set_annotation(node, annotation)
    return node.output


def state(graph: Graph, name: str, like: Tensor, annotation: object, init: Initializer | None = None) -> Tensor:
    """A non-trained per-step value (optimizer moments), zero unless `init` says otherwise."""
    node = graph.add_node(STATE, (), [(like.shape, like.dtype)], name=name)
    node.init = as_initializer(init or zeros())
    graph.set_annotation(node, annotation)
    return node.output


def comm(x: Tensor, annotation: object, name: str | None = None, reduce: str = "sum") -> Tensor:
    """Reshard `x` to `annotation` (one per strategy, or a Derived rule). `reduce`: how partial
    values combine, "sum" (what Partial means) or "max" (partial maxima, e.g. hspmd.ops.class_max)."""
    if not isinstance(x, Tensor):
        raise HSPMDError(f"comm: expected a graph tensor, got {x!r}")
    if reduce not in REDUCTIONS:
        raise HSPMDError(f"comm: reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
    node = x.graph.add_node(COMM, (x,), [(x.shape, x.dtype)], name=name,
                            attrs={"reduce": reduce} if reduce != "sum" else None)
    x.graph.set_annotation(node, annotation)
    return node.output


def name_seed(name: str, seed: int = 0) -> int:
    return zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)


def initial_value(node: Node, seed: int = 0, box: Box | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The initial value of a parameter or state, deterministic in its name and `seed`: the whole
    tensor, or only the elements of `box` (equal to the same box of the whole, made without it),
    on `device`."""
    if node.init is None:
        raise HSPMDError(f"initial_value: {node.kind} {node.name} is not a parameter or state (it has no initializer)")
    shape = tuple(node.output.shape)
    box = tuple((0, n) for n in shape) if box is None else tuple(box)
    return make_piece(node.init, shape, box, name_seed(node.name, seed), node.output.dtype, device)


__all__ = [
    "COMM", "CommDef", "PARAMETER", "PLACEHOLDER", "STATE", "comm", "gradient_annotation", "initial_value", "name_seed",
    "parameter", "placeholder", "state",
]
