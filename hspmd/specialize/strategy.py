"""Parallel strategies for a layered model (Llama): pipelines of tensor-parallel stages, as values.

A `Strategy` is what the paper's appendix tables describe: several pipelines, each a chain of
stages; a stage is one tensor-parallel (TP) group of ranks that owns a contiguous range of layers.
Pipelines may differ in stage count, TP degrees, layer split, micro-batch count and size; data
parallelism is *between* pipelines (gradients are synchronised once per step), so there is no
data parallelism inside a stage and `tp` always equals the stage's rank count.

From a strategy come the annotations a Llama model needs (`param_annotation`,
`activation_annotation`, ...): a union with one subgroup per pipeline, the subgroup being the
stage of that pipeline holding the layer.

Weight layout convention: a linear layer's weight is stored as (in_features, out_features) and
applied as y = x @ W. Column parallel therefore splits dim 1 (`S1:tp`), row parallel splits dim 0
(`S0:tp`). The embedding table is (vocab, hidden), the LM head weight (hidden, vocab). Norm
weights are `param_annotation(layer, "replicated")` (the final norm: the last layer's stage);
tokens enter at `activation_annotation(0)`, logits and labels live at the last layer's.

Validation raises `StrategyFieldError` (a `StrategyError`) whose `path` names the field, e.g.
`pipelines[1].stages[2].layers`; loaders and the text parser add their own context to it.
"""

from __future__ import annotations

import difflib
import io
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from rich.console import Console
from rich.table import Table

from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Duplicate, Split, Subgroup
from hspmd.errors import StrategyError

PARAM_KINDS = ("column", "row", "replicated")
EMBEDDING_KINDS = ("vocab", "replicated")
STRATEGY_KEYS = ("name", "num_layers", "zero", "pipelines")
PIPELINE_KEYS = ("stages", "micro_batches", "micro_batch_size")
STAGE_KEYS = ("ranks", "layers", "tp")

Path = tuple[object, ...]


def format_path(path: Path) -> str:
    """("pipelines", 1, "stages", 2, "ranks") -> "pipelines[1].stages[2].ranks"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class StrategyFieldError(StrategyError):
    """A strategy field is invalid; `path` locates it (relative to where the check ran)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = tuple(path), reason
        super().__init__(f"{format_path(self.path)}: {reason}" if self.path else reason)


@contextmanager
def field_context(*prefix: object) -> Iterator[None]:
    """Re-raise a StrategyFieldError from a nested value with `prefix` prepended to its path."""
    try:
        yield
    except StrategyFieldError as exc:
        raise StrategyFieldError(prefix + exc.path, exc.reason) from None


def closest_hint(word: str, options: Sequence[str]) -> str:
    """'did you mean X?' for a typo, else the list of valid words."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid: " + ", ".join(repr(o) for o in options)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: object, path: Path, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if not is_int(value):
        runtime = " or null (bound at run time)" if allow_none else ""
        raise StrategyFieldError(path, f"must be a positive integer{runtime}, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise StrategyFieldError(path, f"must be positive, got {value}")
    return value


def format_ranks(ranks: Sequence[int]) -> str:
    """Rank lists print like annotation device groups without brackets: 0-3,8,9."""
    return str(DeviceGroup(tuple(ranks)))[1:-1]


def format_layers(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else str(layers.start)


def parse_index_list(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8); raises StrategyFieldError(()) naming the bad item."""
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        first, dash, last = item.partition("-")
        if not first.strip().isdigit() or (dash and not last.strip().isdigit()):
            raise StrategyFieldError((), f"{item!r} in {text!r} is not a rank or a range like 0-3")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise StrategyFieldError((), f"range {item} runs backwards; write {hi}-{lo}")
        out.extend(range(lo, hi + 1))
    return tuple(out)


def parse_layer_range(text: str) -> range:
    """'0-14' -> range(0, 15); '7' -> range(7, 8)."""
    first, dash, last = text.strip().partition("-")
    if not first.strip().isdigit() or (dash and not last.strip().isdigit()):
        raise StrategyFieldError((), f"{text!r} is not a layer range like 0-14 (first-last, inclusive)")
    lo, hi = int(first), int(last) if dash else int(first)
    if hi < lo:
        raise StrategyFieldError((), f"layer range {text.strip()} runs backwards; write {hi}-{lo}")
    return range(lo, hi + 1)


@dataclass(frozen=True)
class Stage:
    """One tensor-parallel group: `ranks` (in TP order) own layers `layers` (a range, or a
    (first, last) inclusive pair); `tp` defaults to, and must equal, the number of ranks."""

    ranks: tuple[int, ...]
    layers: range
    tp: int | None = None

    def __post_init__(self):
        ranks = self.ranks
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (tuple, list, range)):
            raise StrategyFieldError(("ranks",), f"must be a sequence of integer ranks, got {ranks!r}")
        ranks = tuple(ranks)
        if not ranks:
            raise StrategyFieldError(("ranks",), "a stage needs at least one rank")
        for r in ranks:
            if not is_int(r) or r < 0:
                raise StrategyFieldError(("ranks",), f"ranks must be non-negative integers, got {r!r}")
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        if repeated:
            raise StrategyFieldError(("ranks",), f"rank(s) {repeated} listed more than once in {format_ranks(sorted(set(ranks)))}")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "layers", self._normalise_layers(self.layers))
        tp = len(ranks) if self.tp is None else self.tp
        if not is_int(tp) or tp < 1:
            raise StrategyFieldError(("tp",), f"must be a positive integer, got {tp!r}")
        if tp != len(ranks):
            raise StrategyFieldError(
                ("tp",),
                f"tp {tp} does not match the {len(ranks)} ranks {format_ranks(ranks)}: a stage is one tensor-parallel "
                f"group, so tp must equal its rank count; for data parallelism add another pipeline "
                f"(gradients are synchronised between pipelines)",
            )
        object.__setattr__(self, "tp", tp)

    @staticmethod
    def _normalise_layers(layers: object) -> range:
        if isinstance(layers, range):
            if layers.step != 1:
                raise StrategyFieldError(("layers",), f"must be a contiguous range (step 1), got {layers!r}")
            if len(layers) == 0 or layers.start < 0:
                raise StrategyFieldError(("layers",), f"must be a non-empty range of non-negative layers, got {layers!r}")
            return layers
        if isinstance(layers, (tuple, list)) and len(layers) == 2 and all(is_int(x) for x in layers):
            first, last = layers
            if first < 0 or last < first:
                raise StrategyFieldError(("layers",), f"(first, last) = {tuple(layers)} must satisfy 0 <= first <= last")
            return range(first, last + 1)
        raise StrategyFieldError(("layers",), f"must be a range or a (first, last) pair of integers, got {layers!r}")

    @property
    def first_layer(self) -> int:
        return self.layers.start

    @property
    def last_layer(self) -> int:
        return self.layers.stop - 1

    def __str__(self) -> str:
        return f"R{format_ranks(self.ranks)} L{format_layers(self.layers)}"


@dataclass(frozen=True)
class Pipeline:
    """A chain of stages covering layers 0..n-1 in order. `micro_batches` and `micro_batch_size`
    are per step; None means bound at run time (e.g. sequences dispatched by a cost model)."""

    stages: tuple[Stage, ...]
    micro_batches: int | None
    micro_batch_size: int | None

    def __post_init__(self):
        stages = self.stages
        if not isinstance(stages, (tuple, list)) or not stages:
            raise StrategyFieldError(("stages",), f"must be a non-empty list of stages, got {stages!r}")
        stages = tuple(stages)
        for j, s in enumerate(stages):
            if not isinstance(s, Stage):
                raise StrategyFieldError(("stages", j), f"must be a Stage, got {s!r}")
        owner: dict[int, int] = {}
        expected_first = 0
        for j, s in enumerate(stages):
            if s.first_layer != expected_first:
                where = "the first stage must start at layer 0" if j == 0 else (
                    f"stage {j - 1} ends at layer {stages[j - 1].last_layer}, so stage {j} must start at {expected_first}"
                )
                raise StrategyFieldError(
                    ("stages", j, "layers"), f"starts at layer {s.first_layer} but {where} (layers run in order, once each)"
                )
            expected_first = s.last_layer + 1
            for r in s.ranks:
                if r in owner:
                    raise StrategyFieldError(("stages", j, "ranks"), f"rank {r} is already in stage {owner[r]} of this pipeline")
                owner[r] = j
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "micro_batches", _count(self.micro_batches, ("micro_batches",), True))
        object.__setattr__(self, "micro_batch_size", _count(self.micro_batch_size, ("micro_batch_size",), True))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for s in self.stages for r in s.ranks)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].last_layer + 1

    @property
    def samples_per_step(self) -> int | None:
        if self.micro_batches is None or self.micro_batch_size is None:
            return None
        return self.micro_batches * self.micro_batch_size


@dataclass(frozen=True)
class Strategy:
    """Pipelines over disjoint ranks, each covering all `num_layers` layers; `zero` shards optimizer
    states across pipelines (ZeRO-1)."""

    pipelines: tuple[Pipeline, ...]
    num_layers: int
    zero: bool = False
    name: str = ""

    def __post_init__(self):
        pipelines = self.pipelines
        if not isinstance(pipelines, (tuple, list)) or not pipelines:
            raise StrategyFieldError(("pipelines",), f"must be a non-empty list of pipelines, got {pipelines!r}")
        pipelines = tuple(pipelines)
        for i, p in enumerate(pipelines):
            if not isinstance(p, Pipeline):
                raise StrategyFieldError(("pipelines", i), f"must be a Pipeline, got {p!r}")
        _count(self.num_layers, ("num_layers",), False)
        if not isinstance(self.zero, bool):
            raise StrategyFieldError(("zero",), f"must be true or false, got {self.zero!r}")
        if not isinstance(self.name, str) or ";" in self.name or "\n" in self.name:
            raise StrategyFieldError(("name",), f"must be one line of text without ';', got {self.name!r}")
        owner: dict[int, tuple[int, int]] = {}
        for i, p in enumerate(pipelines):
            if p.num_layers != self.num_layers:
                raise StrategyFieldError(
                    ("pipelines", i, "stages", len(p.stages) - 1, "layers"),
                    f"the last stage ends at layer {p.num_layers - 1} but the model has {self.num_layers} layers: "
                    f"every pipeline must cover layers 0-{self.num_layers - 1} exactly once",
                )
            for j, s in enumerate(p.stages):
                for r in s.ranks:
                    if r in owner and owner[r][0] != i:
                        oi, oj = owner[r]
                        raise StrategyFieldError(
                            ("pipelines", i, "stages", j, "ranks"),
                            f"rank {r} is already in pipelines[{oi}].stages[{oj}]: pipelines must use disjoint ranks",
                        )
                    owner[r] = (i, j)
        object.__setattr__(self, "pipelines", pipelines)
        object.__setattr__(self, "name", self.name.strip())

    # ---- structure --------------------------------------------------------------------------

    @property
    def all_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for p in self.pipelines for r in p.ranks))

    @property
    def num_pipelines(self) -> int:
        return len(self.pipelines)

    @property
    def global_batch_size(self) -> int | None:
        """Samples per step over all pipelines; None if any pipeline binds its batches at run time."""
        samples = [p.samples_per_step for p in self.pipelines]
        return None if None in samples else sum(samples)

    @property
    def micro_batch_ratios(self) -> tuple[int, ...] | None:
        """Each pipeline's micro-batch size: the top-tier split of a micro-batch across pipelines."""
        sizes = tuple(p.micro_batch_size for p in self.pipelines)
        return None if None in sizes else sizes

    def _check_layer(self, layer: object) -> int:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise StrategyError(
                f"layer {layer!r} is outside strategy {self.name or '(unnamed)'}: it has layers 0-{self.num_layers - 1}"
            )
        return layer

    def _check_pipeline(self, pipeline: object) -> int:
        if not is_int(pipeline) or not 0 <= pipeline < len(self.pipelines):
            raise StrategyError(f"pipeline {pipeline!r} does not exist: the strategy has pipelines 0-{len(self.pipelines) - 1}")
        return pipeline

    def stage_of(self, layer: int, pipeline: int) -> int:
        """Index of the stage of `pipeline` that holds `layer`."""
        layer = self._check_layer(layer)
        stages = self.pipelines[self._check_pipeline(pipeline)].stages
        return next(j for j, s in enumerate(stages) if layer in s.layers)

    def stage_holding(self, layer: int, pipeline: int) -> Stage:
        return self.pipelines[pipeline].stages[self.stage_of(layer, pipeline)]

    def locate(self, rank: int) -> tuple[int, int]:
        """(pipeline, stage) of `rank`."""
        for i, p in enumerate(self.pipelines):
            for j, s in enumerate(p.stages):
                if rank in s.ranks:
                    return i, j
        raise StrategyError(f"rank {rank!r} is not used by strategy {self.name or '(unnamed)'}; its ranks are {format_ranks(self.all_ranks)}")

    # ---- annotations --------------------------------------------------------------------------

    def _union(self, stages: Sequence[Stage], axis_of, hdim="D", ratios=None) -> Annotation:
        subgroups = tuple(Subgroup(DeviceGroup(s.ranks), DistributedStates((axis_of(s.tp),))) for s in stages)
        return Annotation(subgroups, hdim, ratios)

    def param_annotation(self, layer: int, kind: str) -> Annotation:
        """A layer weight: duplicated across pipelines (HDim D), TP-sharded inside each holding stage.
        column: S1:tp (splits out_features), row: S0:tp (splits in_features), replicated: D:tp."""
        axis_of = _param_axis(kind, PARAM_KINDS, {"column": lambda n: Split(1, n), "row": lambda n: Split(0, n)})
        layer = self._check_layer(layer)
        return self._union([self.stage_holding(layer, i) for i in range(len(self.pipelines))], axis_of)

    def gradient_annotation(self, layer: int, kind: str) -> Annotation:
        """The weight's gradient before the once-per-step sync: one summand per pipeline (HDim P)."""
        return partial_over_pipelines(self.param_annotation(layer, kind))

    def embedding_annotation(self, kind: str = "vocab") -> Annotation:
        """The (vocab, hidden) table on each pipeline's first stage; vocab: S0:tp, replicated: D:tp."""
        axis_of = _param_axis(kind, EMBEDDING_KINDS, {"vocab": lambda n: Split(0, n)})
        return self._union([p.stages[0] for p in self.pipelines], axis_of)

    def lm_head_annotation(self, kind: str = "vocab") -> Annotation:
        """The (hidden, vocab) LM head on each pipeline's last stage; vocab: S1:tp, replicated: D:tp."""
        axis_of = _param_axis(kind, EMBEDDING_KINDS, {"vocab": lambda n: Split(1, n)})
        return self._union([p.stages[-1] for p in self.pipelines], axis_of)

    def activation_annotation(self, layer: int, pipeline_dim: int = 0) -> Annotation:
        """A micro-batch entering `layer`: split along `pipeline_dim` across pipelines in the ratio
        of their micro-batch sizes (run-time ratios if any is unbound), duplicated over each TP group.
        Tokens use layer 0, logits the last layer."""
        layer = self._check_layer(layer)
        if not is_int(pipeline_dim) or pipeline_dim < 0:
            raise StrategyError(f"pipeline_dim must be a tensor dim (integer >= 0), got {pipeline_dim!r}")
        stages = [self.stage_holding(layer, i) for i in range(len(self.pipelines))]
        return self._union(stages, Duplicate, pipeline_dim, self.micro_batch_ratios)

    # ---- conversion ---------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain data for JSON/YAML: ranks and layers as compact strings ('0-3', '0-14')."""
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "zero": self.zero,
            "pipelines": [
                {
                    "micro_batches": p.micro_batches,
                    "micro_batch_size": p.micro_batch_size,
                    "stages": [
                        {"ranks": format_ranks(s.ranks), "layers": format_layers(s.layers), "tp": s.tp} for s in p.stages
                    ],
                }
                for p in self.pipelines
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Strategy":
        """Build from plain data (see to_dict); errors name the key path, e.g. pipelines[0].stages[1].tp.
        ranks: '0-3,8', a list of ints or one int; layers: '0-14', [first, last] or one int;
        num_layers defaults to the first pipeline's coverage; micro-batch values may be null (run time)."""
        _check_keys(data, STRATEGY_KEYS, (), required=("pipelines",))
        raw_pipelines = data["pipelines"]
        if not isinstance(raw_pipelines, list) or not raw_pipelines:
            raise StrategyFieldError(("pipelines",), f"must be a non-empty list of pipelines, got {raw_pipelines!r}")
        pipelines = tuple(_pipeline_from_dict(p, ("pipelines", i)) for i, p in enumerate(raw_pipelines))
        return cls(
            pipelines,
            data.get("num_layers", pipelines[0].num_layers),
            data.get("zero", False),
            "" if data.get("name") is None else data["name"],
        )

    def describe(self) -> str:
        """A readable table of pipelines, stages, layers, ranks, TP degrees and micro-batches."""
        title = (
            f"{self.name or 'strategy'}: {self.num_layers} layers, {len(self.all_ranks)} devices, "
            f"{len(self.pipelines)} pipeline(s), ZeRO {'on' if self.zero else 'off'}"
        )
        table = Table(title=title, title_justify="left")
        for column in ("pipeline", "micro-batches", "stage", "ranks", "layers", "tp"):
            table.add_column(column)
        for i, p in enumerate(self.pipelines):
            count = "run time" if p.micro_batches is None else str(p.micro_batches)
            size = "run time" if p.micro_batch_size is None else str(p.micro_batch_size)
            for j, s in enumerate(p.stages):
                batches = f"{count} x bs {size}" if j == 0 else ""
                table.add_row(str(i) if j == 0 else "", batches, str(j), format_ranks(s.ranks), format_layers(s.layers), str(s.tp))
            if i + 1 < len(self.pipelines):
                table.add_section()
        buffer = io.StringIO()
        Console(file=buffer, width=100, color_system=None, force_terminal=False).print(table)
        return buffer.getvalue()


def partial_over_pipelines(annotation: Annotation) -> Annotation:
    """The same union with HDim P: each pipeline holds a summand (per-pipeline partial gradients)."""
    return Annotation(annotation.subgroups, "P")


def _param_axis(kind: object, kinds: Sequence[str], split_of: dict):
    if kind not in kinds:
        raise StrategyError(f"unknown parameter kind {kind!r}: {closest_hint(str(kind), kinds)}")
    return split_of.get(kind, Duplicate)


def _check_keys(data: object, valid: Sequence[str], path: Path, required: Sequence[str]) -> None:
    if not isinstance(data, Mapping):
        raise StrategyFieldError(path, f"must be a mapping with keys {', '.join(valid)}, got {data!r}")
    for key in data:
        if key not in valid:
            raise StrategyFieldError(path + (str(key),), f"unknown key {key!r}; {closest_hint(str(key), valid)}")
    for key in required:
        if key not in data:
            raise StrategyFieldError(path + (key,), f"missing required key {key!r}")


def _pipeline_from_dict(data: object, path: Path) -> Pipeline:
    _check_keys(data, PIPELINE_KEYS, path, required=PIPELINE_KEYS)
    raw_stages = data["stages"]
    if not isinstance(raw_stages, list) or not raw_stages:
        raise StrategyFieldError(path + ("stages",), f"must be a non-empty list of stages, got {raw_stages!r}")
    stages = tuple(_stage_from_dict(s, path + ("stages", j)) for j, s in enumerate(raw_stages))
    with field_context(*path):
        return Pipeline(stages, data["micro_batches"], data["micro_batch_size"])


def _stage_from_dict(data: object, path: Path) -> Stage:
    _check_keys(data, STAGE_KEYS, path, required=("ranks", "layers"))
    ranks, layers = data["ranks"], data["layers"]
    with field_context(*path, "ranks"):
        ranks = parse_index_list(ranks) if isinstance(ranks, str) else (ranks,) if is_int(ranks) else ranks
    with field_context(*path, "layers"):
        layers = parse_layer_range(layers) if isinstance(layers, str) else (layers, layers) if is_int(layers) else layers
    with field_context(*path):
        return Stage(ranks, layers, data.get("tp"))
