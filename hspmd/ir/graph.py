"""The graph IR: nodes (ops) producing tensors with symbolic shapes, and leaf/CommOp annotations.

A graph is written once from a single device's view. Leaves (placeholders, parameters, optimizer
states) and CommOps carry one annotation per strategy; every other tensor's annotation is deduced
(hspmd.specialize.deduce). Strategies are indexed explicitly and can be added to a built graph.
Some annotations are not written by the user but derived from other tensors' annotations at
deduction time (`Derived`): the reverse reshard of a CommOp in the backward graph, optimizer
states that follow their parameter, ZeRO-1 shards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Sequence

import sympy
import torch

from hspmd.annotations import Annotation, Hierarchy, parse
from hspmd.errors import AnnotationError, HSPMDError
from hspmd.ir.init import Initializer
from hspmd.ir.shapes import Shape, format_shape

PHASES = ("forward", "backward", "update")

NO_OPERATORS: Mapping[str, Callable[..., Any]] = MappingProxyType({})


class Tensor:
    """A value in the graph: produced by output `index` of `node`, with a symbolic global shape."""

    __slots__ = ("node", "index", "shape", "dtype", "id")

    def __init__(self, node: "Node", index: int, shape: Shape, dtype: torch.dtype, tensor_id: int):
        self.node, self.index, self.shape, self.dtype, self.id = node, index, shape, dtype, tensor_id

    @property
    def graph(self) -> "Graph":
        return self.node.graph

    @property
    def name(self) -> str:
        return self.node.name if len(self.node.outputs) == 1 else f"{self.node.name}:{self.index}"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.name}, shape={format_shape(self.shape)}, {str(self.dtype).replace('torch.', '')})"

    def __hash__(self) -> int:
        return hash((id(self.node.graph), self.id))

    def __eq__(self, other: object) -> bool:
        return self is other

    def _method(self, name: str) -> Callable[..., Any]:
        """Tensor operator methods (x + y, x @ w, x.sum(...)) come from the graph's operator table:
        the IR knows no concrete op (hspmd.ops.Graph passes the standard ones)."""
        graph = self.node.graph
        if name not in graph.operators:
            raise HSPMDError(f"tensor method {name!r}: graph {graph.name} was built without tensor operators; build it "
                             f"with hspmd.Graph (hspmd.ops.Graph) or call the op (hspmd.ops.{name}) directly")
        return graph.operators[name]

    def __add__(self, other):
        return self._method("add")(self, other)

    def __radd__(self, other):
        return self._method("add")(other, self)

    def __sub__(self, other):
        return self._method("sub")(self, other)

    def __rsub__(self, other):
        return self._method("sub")(other, self)

    def __mul__(self, other):
        return self._method("mul")(self, other)

    def __rmul__(self, other):
        return self._method("mul")(other, self)

    def __truediv__(self, other):
        return self._method("div")(self, other)

    def __neg__(self):
        return self._method("neg")(self)

    def __matmul__(self, other):
        return self._method("matmul")(self, other)

    def sum(self, dims=None, keepdim: bool = False):
        return self._method("sum")(self, dims, keepdim)

    def mean(self, dims=None, keepdim: bool = False):
        return self._method("mean")(self, dims, keepdim)

    def reshape(self, *shape):
        return self._method("reshape")(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)

    view = reshape

    def transpose(self, a: int, b: int):
        return self._method("transpose")(self, a, b)


@dataclass(frozen=True)
class Derived:
    """An annotation computed at deduction time from the annotations of `refs` (and, for a
    CommOp, of its input): fn(input_annotation_or_None, ref_annotations) -> Annotation."""

    refs: tuple[Tensor, ...]
    fn: Callable[[Annotation | None, tuple[Annotation, ...]], Annotation]
    description: str


class OpDef:
    """What an op kind does; subclasses live in hspmd.ops (leaves and CommOp in hspmd.ir.dsl).

    deduce: output annotations from input annotations already aligned to one DG union and HSize.
    compute: local outputs from local inputs on one device (ctx gives boxes, global shapes, binding).
    gradient: IR tensors for the input gradients (None where not differentiable)."""

    kind = "op"
    is_leaf = False
    is_comm = False
    unaligned = False  # True: deduce() takes the inputs' annotations as they are, not aligned to one union

    def deduce(self, node: "Node", anns: Sequence[Annotation]) -> list[Annotation]:
        raise HSPMDError(f"op kind {self.kind} has no deduction rule")

    def compute(self, node: "Node", ctx: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        raise HSPMDError(f"op kind {self.kind} has no local compute")

    def compute_into(self, node: "Node", ctx: Any, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> bool:
        """Write the single output into `out` (a buffer of its shape and dtype, e.g. a view of a
        gradient bucket) and return True; ops that cannot return False and the caller copies."""
        return False

    def gradient(self, node: "Node", grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        return [None] * len(node.inputs)

    def describe(self, node: "Node") -> str:
        return ""


class Node:
    """One op in the graph. Leaves and CommOps hold `annotation`: a tuple (one per strategy) or a
    Derived rule."""

    __slots__ = ("graph", "id", "name", "opdef", "inputs", "outputs", "attrs", "phase", "annotation", "init")

    def __init__(self, graph: "Graph", node_id: int, name: str, opdef: OpDef, inputs: tuple[Tensor, ...],
                 attrs: dict, phase: str):
        self.graph, self.id, self.name, self.opdef = graph, node_id, name, opdef
        self.inputs, self.attrs, self.phase = inputs, attrs, phase
        self.outputs: tuple[Tensor, ...] = ()
        self.annotation: tuple[Annotation, ...] | Derived | None = None
        self.init: Initializer | None = None

    @property
    def kind(self) -> str:
        return self.opdef.kind

    @property
    def output(self) -> Tensor:
        return self.outputs[0]

    @property
    def annotated(self) -> bool:
        return self.opdef.is_leaf or self.opdef.is_comm

    def __repr__(self) -> str:
        return f"Node({self.name}: {self.kind})"


def as_annotation(value: Annotation | str) -> Annotation:
    return parse(value) if isinstance(value, str) else value


def as_strategies(value: object, where: str) -> tuple[Annotation, ...]:
    """Accept one annotation, a per-strategy list, or a Hierarchy."""
    if value is None:
        return ()
    if isinstance(value, Hierarchy):
        return value.strategies
    if isinstance(value, (Annotation, str)):
        return (as_annotation(value),)
    if isinstance(value, (list, tuple)):
        return tuple(as_annotation(v) for v in value)
    raise AnnotationError(f"{where}: expected an annotation, a list of them (one per strategy) or a Hierarchy, got {value!r}")


class Graph:
    """A single-device-view program: build it with the DSL (hspmd.ir.dsl / hspmd.ops).
    `operators`: what tensor operator methods (x + y, x @ w) call, by name (add, sub, mul, div,
    neg, matmul, sum, mean, reshape, transpose); hspmd.ops.Graph passes the standard table."""

    def __init__(self, name: str = "graph", operators: Mapping[str, Callable[..., Any]] = NO_OPERATORS):
        self.name = name
        self.operators = operators
        self.nodes: list[Node] = []
        self.by_name: dict[str, Node] = {}
        self.tensors: list[Tensor] = []
        self.num_strategies = 0
        self._phase = "forward"
        self._counters: dict[str, int] = {}
        self._scope: list[str] = []
        self.losses: list[Tensor] = []
        self.gradients: dict[str, Tensor] = {}  # parameter name -> synchronised gradient (set by optimizers)

    # ---- construction ----
    def unique_name(self, base: str) -> str:
        prefix = ".".join(self._scope + [base]) if self._scope else base
        if prefix not in self.by_name:
            return prefix
        n = self._counters.get(prefix, 1)
        while f"{prefix}_{n}" in self.by_name:
            n += 1
        self._counters[prefix] = n + 1
        return f"{prefix}_{n}"

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix node names (`layers.3.attn.wq`) inside the block."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Nodes built inside belong to `phase` (forward, backward: per micro-batch; update: per step)."""
        if phase not in PHASES:
            raise HSPMDError(f"unknown phase {phase!r}; use one of {PHASES}")
        previous, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = previous

    def add_node(self, opdef: OpDef, inputs: Sequence[Tensor], out_specs: Sequence[tuple[Shape, torch.dtype]],
                 name: str | None = None, attrs: Mapping[str, Any] | None = None) -> Node:
        for t in inputs:
            if not isinstance(t, Tensor):
                raise HSPMDError(f"{opdef.kind}: inputs must be graph tensors, got {t!r}")
            if t.graph is not self:
                raise HSPMDError(f"{opdef.kind}: input {t.name} belongs to graph {t.graph.name}, not {self.name}")
        if name is not None and name in self.by_name:
            raise HSPMDError(f"graph {self.name} already has a node named {name!r}; names must be unique")
        node = Node(self, len(self.nodes), name or self.unique_name(opdef.kind), opdef, tuple(inputs),
                    dict(attrs or {}), self._phase)
        outs = []
        for i, (shape, dtype) in enumerate(out_specs):
            t = Tensor(node, i, tuple(shape), dtype, len(self.tensors))
            self.tensors.append(t)
            outs.append(t)
        node.outputs = tuple(outs)
        self.nodes.append(node)
        self.by_name[node.name] = node
        return node

    def set_annotation(self, node: Node, value: object) -> None:
        if isinstance(value, Derived):
            node.annotation = value
            return
        strategies = as_strategies(value, f"{node.kind} {node.name}")
        if self.num_strategies == 0 and strategies:
            self.num_strategies = len(strategies)
        if strategies and len(strategies) != self.num_strategies:
            raise AnnotationError(
                f"{node.kind} {node.name} has {len(strategies)} annotation(s) but the graph has "
                f"{self.num_strategies} strateg{'y' if self.num_strategies == 1 else 'ies'}: give one per strategy"
            )
        node.annotation = strategies

    def add_strategy(self, annotations: Mapping[str, Annotation | str] | Callable[[Node], Annotation | str]) -> int:
        """Add one strategy to an existing graph; returns its index.

        `annotations` gives each explicitly annotated leaf and CommOp (by node name, or a function
        of the node) its annotation for the new strategy; derived annotations follow by themselves."""
        lookup = annotations if callable(annotations) else (lambda n: annotations.get(n.name))
        new: dict[Node, Annotation] = {}
        for node in self.nodes:
            if node.annotated and not isinstance(node.annotation, Derived):
                ann = lookup(node)
                if ann is None:
                    raise AnnotationError(
                        f"add_strategy: {node.kind} {node.name} needs an annotation for strategy {self.num_strategies}"
                    )
                new[node] = as_annotation(ann)
        for node, ann in new.items():
            earlier = node.annotation if isinstance(node.annotation, tuple) else ()  # (derived ones were skipped)
            node.annotation = earlier + (ann,)
        self.num_strategies += 1
        return self.num_strategies - 1

    # ---- inspection ----
    def node(self, name: str) -> Node:
        if name not in self.by_name:
            raise HSPMDError(f"graph {self.name} has no node named {name!r}")
        return self.by_name[name]

    def tensor(self, name: str) -> Tensor:
        return self.node(name).output

    def symbol_names(self) -> frozenset[str]:
        """Names of the run-time symbols in the graph's shapes and op attributes (e.g. B, S and the
        T of a 1/T loss scale): what a run must bind before it computes anything."""
        found: set[str] = set()
        for node in self.nodes:
            values = [d for t in node.outputs for d in t.shape] + list(node.attrs.values())
            found.update(s.name for v in values if isinstance(v, sympy.Basic) for s in v.free_symbols)
        return frozenset(found)

    def nodes_of_kind(self, *kinds: str) -> list[Node]:
        return [n for n in self.nodes if n.kind in kinds]

    @property
    def placeholders(self) -> list[Node]:
        return self.nodes_of_kind("placeholder")

    @property
    def parameters(self) -> list[Node]:
        return self.nodes_of_kind("parameter")

    def __str__(self) -> str:
        lines = [f"graph {self.name} ({len(self.nodes)} ops, {self.num_strategies} strategies)"]
        for n in self.nodes:
            ins = ", ".join(t.name for t in n.inputs)
            outs = ", ".join(format_shape(t.shape) for t in n.outputs)
            extra = n.opdef.describe(n)
            ann = ""
            if isinstance(n.annotation, Derived):
                ann = f"  ann=<{n.annotation.description}>"
            elif n.annotation:
                ann = "  ann=" + " ; ".join(map(str, n.annotation))
            lines.append(f"  [{n.phase[0]}] {n.name} = {n.kind}({ins}){' ' + extra if extra else ''} -> {outs}{ann}")
        return "\n".join(lines)


__all__ = ["Derived", "Graph", "NO_OPERATORS", "Node", "OpDef", "PHASES", "Tensor", "as_annotation", "as_strategies"]
