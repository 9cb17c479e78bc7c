"""Parallel strategies for a layered model: pipelines of tensor-parallel stages, as values.

A `Strategy` is what the paper's appendix tables describe: several pipelines, each a chain of
stages; a stage is one tensor-parallel (TP) group of ranks that owns a contiguous range of layers.
Pipelines may differ in stage count, TP degrees, layer split, micro-batch count and size; data
parallelism is *between* pipelines (gradients are synchronised once per step), so there is no
data parallelism inside a stage and `tp` always equals the stage's rank count.

Related modules, one job each: strategy_fields (validation errors naming the field, the rank and
layer syntax), strategy_text (the compact one-line syntax), strategy_files (JSON / YAML),
strategy_build (generators), strategy_render (a readable table), paper_strategies (the paper's
appendix tables). The annotations a Llama model takes from a strategy are the model's own rules:
hspmd.models.llama_annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from hspmd.errors import StrategyError, closest_hint
from hspmd.limits import MAX_DEVICES, MAX_LAYERS, MAX_RATIO as MAX_CP_SHARE, MAX_WARMUP, brief
from hspmd.specialize.schedules import SCHEDULE_POLICIES, VECTOR_POLICIES
from hspmd.specialize.strategy_fields import (
    Path,
    StrategyFieldError,
    StrategyFieldTypeError,
    check_keys,
    field_context,
    format_layer_list,
    format_layers,
    format_ranks,
    is_int,
    parse_count_list,
    parse_index_list,
    parse_layer_list,
    parse_layer_range,
    positive_count,
)

STRATEGY_KEYS = ("name", "num_layers", "zero", "pipelines", "cp_attention")
PIPELINE_KEYS = ("stages", "micro_batches", "micro_batch_size", "schedule", "warmup")
STAGE_KEYS = ("ranks", "layers", "tp", "recompute", "cp", "cp_shares", "recompute_layers", "recompute_granularity")
GRANULARITIES = ("full", "selective")
CP_ATTENTION = ("ring", "all_gather", "all_to_all")  # hspmd.ops.context.MODES


@dataclass(frozen=True)
class Stage:
    """`cp` context-parallel groups of `tp` ranks each own layers `layers` (a range, or a
    (first, last) inclusive pair): `ranks` lists them CP-major (rank c * tp + t is CP position c,
    TP position t); `tp` defaults to, and must equal, the number of ranks / cp. `cp_shares`: each
    CP position's share of the sequence (ratios or explicit token counts, e.g. 1024, 340, 341, 343;
    None = equal). `recompute`: keep only the stage's inputs between a micro-batch's forward and
    backward and run the forward again in the backward (activation recomputation: less memory,
    one more forward). `recompute_layers` (a sorted tuple of some of the stage's layers; None: the
    whole stage) recomputes those layers only. `recompute_granularity`: "full" re-runs every op of
    what recomputes; "selective" re-runs only the cheap ops (norms, activation functions, rotary
    embeddings, casts and elementwise products and sums) and keeps the matmul and attention
    outputs and the collectives' results."""

    ranks: tuple[int, ...]
    layers: range
    tp: int | None = None
    recompute: bool = False
    cp: int = 1
    cp_shares: tuple[int, ...] | None = None
    recompute_layers: tuple[int, ...] | None = None
    recompute_granularity: str = "full"

    def __post_init__(self):
        ranks = self.ranks
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (tuple, list, range)):
            raise StrategyFieldTypeError(("ranks",), f"must be a sequence of integer ranks, got {brief(ranks)}")
        if len(ranks) > MAX_DEVICES:
            raise StrategyFieldError(("ranks",), f"{len(ranks)} ranks in one stage, over the limit of {MAX_DEVICES} (hspmd.limits)")
        ranks = tuple(ranks)
        if not ranks:
            raise StrategyFieldError(("ranks",), "a stage needs at least one rank")
        for r in ranks:
            if not is_int(r):
                raise StrategyFieldTypeError(("ranks",), f"ranks must be non-negative integers, got {brief(r)}")
            if not 0 <= r < MAX_DEVICES:
                raise StrategyFieldError(("ranks",),
                    f"ranks must be non-negative integers below {MAX_DEVICES} (hspmd.limits), got {brief(r)}")
        if len(set(ranks)) != len(ranks):
            seen: set[int] = set()
            repeated = sorted({r for r in ranks if r in seen or seen.add(r)})
            raise StrategyFieldError(("ranks",), f"rank(s) {repeated} listed more than once in {format_ranks(sorted(set(ranks)))}")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "layers", self._normalise_layers(self.layers))
        cp = self._check_cp(len(ranks))
        tp = len(ranks) // cp if self.tp is None else self.tp
        if not is_int(tp):
            raise StrategyFieldTypeError(("tp",), f"must be a positive integer, got {brief(tp)}")
        if tp < 1:
            raise StrategyFieldError(("tp",), f"must be a positive integer, got {brief(tp)}")
        if tp * cp != len(ranks):
            raise StrategyFieldError(
                ("tp",),
                f"tp {brief(tp)} x cp {cp} does not match the {len(ranks)} ranks {format_ranks(ranks)}: a stage is cp "
                f"tensor-parallel groups, so tp x cp must equal its rank count; for data parallelism add another pipeline "
                f"(gradients are synchronised between pipelines)",
            )
        object.__setattr__(self, "tp", tp)
        if not isinstance(self.recompute, bool):
            raise StrategyFieldTypeError(("recompute",), f"must be true or false, got {brief(self.recompute)}")
        self._check_recompute_choice()

    def _check_recompute_choice(self) -> None:
        granularity, chosen = self.recompute_granularity, self.recompute_layers
        if granularity not in GRANULARITIES:
            raise StrategyFieldError(("recompute_granularity",), f"must be one of {', '.join(GRANULARITIES)}, got "
                                     f"{brief(granularity)}; {closest_hint(str(granularity), GRANULARITIES)}")
        if chosen is None:
            if granularity != "full" and not self.recompute:
                raise StrategyFieldError(("recompute_granularity",), "is given but the stage does not recompute")
            return
        if isinstance(chosen, (str, bytes)) or not isinstance(chosen, (tuple, list, range)) or not all(map(is_int, chosen)):
            raise StrategyFieldTypeError(("recompute_layers",), f"must be a list of layers, got {brief(chosen)}")
        chosen = tuple(sorted(set(chosen)))
        if not self.recompute:
            raise StrategyFieldError(("recompute_layers",), "are given but the stage does not recompute")
        outside = [layer for layer in chosen if layer not in self.layers]
        if not chosen or outside:
            raise StrategyFieldError(("recompute_layers",), f"{format_layer_list(chosen) or 'none'}: the layers to "
                                     f"recompute must be some of the stage's layers {format_layers(self.layers)}")
        object.__setattr__(self, "recompute_layers", None if chosen == tuple(self.layers) else chosen)

    @property
    def recompute_kind(self) -> bool | str:
        """The planner's value of the stage's choice: False, True (whole layers) or "selective"."""
        return "selective" if self.recompute and self.recompute_granularity == "selective" else self.recompute

    @staticmethod
    def recompute_fields(kind: bool | str) -> dict:
        """Stage keyword arguments for a planner's choice `kind` (False, True or "selective")."""
        return {"recompute": bool(kind), "recompute_granularity": "selective" if kind == "selective" else "full"}

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """The layers whose activations this stage recomputes (none, some or all of its own)."""
        if not self.recompute:
            return ()
        return tuple(self.layers) if self.recompute_layers is None else self.recompute_layers

    def _check_cp(self, count: int) -> int:
        cp, shares = self.cp, self.cp_shares
        if not is_int(cp):
            raise StrategyFieldTypeError(("cp",), f"must be a positive integer, got {brief(cp)}")
        if not 1 <= cp <= count or count % cp:
            raise StrategyFieldError(("cp",), f"cp {cp} must be a positive divisor of the stage's {count} rank(s)")
        if shares is not None:
            if isinstance(shares, (str, bytes)) or not isinstance(shares, (tuple, list)):
                raise StrategyFieldTypeError(("cp_shares",), f"must be a list of positive integers, got {brief(shares)}")
            shares = tuple(shares)
            for n in shares:
                if not is_int(n) or not 1 <= n <= MAX_CP_SHARE:
                    raise StrategyFieldError(("cp_shares",), f"shares must be integers in 1-{MAX_CP_SHARE}, got {brief(n)}")
            if len(shares) != cp:
                raise StrategyFieldError(("cp_shares",), f"{len(shares)} share(s) for cp {cp}: give one per CP position")
            object.__setattr__(self, "cp_shares", shares)
        return cp

    @staticmethod
    def _normalise_layers(layers: object) -> range:
        if isinstance(layers, range):
            if layers.step != 1:
                raise StrategyFieldError(("layers",), f"must be a contiguous range (step 1), got {brief(layers)}")
            if len(layers) == 0 or layers.start < 0:
                raise StrategyFieldError(("layers",), f"must be a non-empty range of non-negative layers, got {brief(layers)}")
            if layers.stop > MAX_LAYERS:
                raise StrategyFieldError(("layers",), f"{layers!r} runs past layer {MAX_LAYERS - 1}, the limit (hspmd.limits)")
            return layers
        if isinstance(layers, (tuple, list)) and len(layers) == 2 and all(is_int(x) for x in layers):
            first, last = layers
            if first < 0 or last < first:
                raise StrategyFieldError(("layers",), f"(first, last) = {brief(tuple(layers))} must satisfy 0 <= first <= last")
            if last >= MAX_LAYERS:
                raise StrategyFieldError(("layers",), f"last layer {last} is past {MAX_LAYERS - 1}, the limit (hspmd.limits)")
            return range(first, last + 1)
        raise StrategyFieldTypeError(("layers",), f"must be a range or a (first, last) pair of integers, got {brief(layers)}")

    @property
    def first_layer(self) -> int:
        return self.layers.start

    @property
    def last_layer(self) -> int:
        return self.layers.stop - 1

    @property
    def cp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The stage's TP groups, one per CP position, in CP order."""
        return tuple(self.ranks[c * self.tp:(c + 1) * self.tp] for c in range(self.cp))

    def __str__(self) -> str:
        cp = "" if self.cp == 1 else f" cp{self.cp}" + ("" if self.cp_shares is None else "=" + ",".join(map(str, self.cp_shares)))
        return f"R{format_ranks(self.ranks)} L{format_layers(self.layers)}{cp}" + recompute_word(self)


@dataclass(frozen=True)
class Pipeline:
    """A chain of stages covering layers 0..n-1 in order. `micro_batches` and `micro_batch_size`
    are per step; None means bound at run time (e.g. sequences dispatched by a cost model).

    `schedule`: the pipeline's schedule policy (hspmd.specialize.schedules: gpipe, 1f1b, eager,
    h1f1b, virtual), None = the trainer's; `warmup`: its warm-up vector, forwards each stage
    launches before its first backward (one per stage, never increasing; required by h1f1b and
    virtual, which depend on stage and link times, e.g. from a planner)."""

    stages: tuple[Stage, ...]
    micro_batches: int | None
    micro_batch_size: int | None
    schedule: str | None = None
    warmup: tuple[int, ...] | None = None

    def __post_init__(self):
        stages = self.stages
        if not isinstance(stages, (tuple, list)):
            raise StrategyFieldTypeError(("stages",), f"must be a non-empty list of stages, got {brief(stages)}")
        if not stages:
            raise StrategyFieldError(("stages",), "must be a non-empty list of stages, got []")
        stages = tuple(stages)
        for j, s in enumerate(stages):
            if not isinstance(s, Stage):
                raise StrategyFieldTypeError(("stages", j), f"must be a Stage, got {brief(s)}")
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
        object.__setattr__(self, "micro_batches", positive_count(self.micro_batches, ("micro_batches",), True))
        object.__setattr__(self, "micro_batch_size", positive_count(self.micro_batch_size, ("micro_batch_size",), True))
        self._check_schedule()

    def _check_schedule(self) -> None:
        schedule, warmup = self.schedule, self.warmup
        if schedule is not None:
            if not isinstance(schedule, str):
                raise StrategyFieldTypeError(("schedule",), f"must be one of {', '.join(SCHEDULE_POLICIES)} or null, got {brief(schedule)}")
            if schedule not in SCHEDULE_POLICIES:
                raise StrategyFieldError(("schedule",), f"unknown schedule {brief(schedule)}; {closest_hint(schedule, SCHEDULE_POLICIES)}")
        if warmup is None:
            if schedule in VECTOR_POLICIES:
                raise StrategyFieldError(("warmup",), f"schedule {schedule} depends on stage and link times: give its warm-up "
                                                      f"vector (one count per stage, e.g. from warmup_vector({schedule!r}, ...))")
            return
        if schedule is None or schedule == "gpipe":
            raise StrategyFieldError(("warmup",), f"a warm-up vector needs a 1F1B-type schedule ({', '.join(SCHEDULE_POLICIES[1:])}), "
                                                  f"got schedule {schedule or 'null'}")
        if isinstance(warmup, (str, bytes)) or not isinstance(warmup, (tuple, list)):
            raise StrategyFieldTypeError(("warmup",), f"must be a list of positive integers, one per stage, got {brief(warmup)}")
        warmup = tuple(warmup)
        for n in warmup:
            if not is_int(n):
                raise StrategyFieldTypeError(("warmup",), f"must be a list of positive integers, got {brief(n)} in it")
            if not 1 <= n <= MAX_WARMUP:
                raise StrategyFieldError(("warmup",), f"counts must lie in 1-{MAX_WARMUP}, got {brief(n)}")
        if len(warmup) != len(self.stages):
            raise StrategyFieldError(("warmup",), f"{len(warmup)} count(s) for {len(self.stages)} stage(s): give one per stage")
        rising = [j for j in range(len(warmup) - 1) if warmup[j] < warmup[j + 1]]
        if rising:
            raise StrategyFieldError(("warmup",), f"{list(warmup)} increases after stage {rising[0]}: a stage must launch at least "
                                                  f"as many forwards before its first backward as the next, or the pipeline deadlocks")
        object.__setattr__(self, "warmup", warmup)

    @property
    def schedule_spec(self) -> str | None:
        """The schedule as the trainer and simulator name it ('gpipe', '1f1b', 'h1f1b:5,2,1'),
        None if the pipeline leaves it to the trainer."""
        if self.warmup is None:
            return self.schedule
        return f"{self.schedule}:{','.join(map(str, self.warmup))}"

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
    cp_attention: str = "ring"

    def __post_init__(self):
        pipelines = self.pipelines
        if not isinstance(pipelines, (tuple, list)):
            raise StrategyFieldTypeError(("pipelines",), f"must be a non-empty list of pipelines, got {brief(pipelines)}")
        if not pipelines:
            raise StrategyFieldError(("pipelines",), "must be a non-empty list of pipelines, got []")
        pipelines = tuple(pipelines)
        for i, p in enumerate(pipelines):
            if not isinstance(p, Pipeline):
                raise StrategyFieldTypeError(("pipelines", i), f"must be a Pipeline, got {brief(p)}")
        positive_count(self.num_layers, ("num_layers",), False, MAX_LAYERS)
        if not isinstance(self.zero, bool):
            raise StrategyFieldTypeError(("zero",), f"must be true or false, got {brief(self.zero)}")
        if not isinstance(self.name, str):
            raise StrategyFieldTypeError(("name",), f"must be one line of text without ';', got {brief(self.name)}")
        if ";" in self.name or "\n" in self.name:
            raise StrategyFieldError(("name",), f"must be one line of text without ';', got {brief(self.name)}")
        if self.cp_attention not in CP_ATTENTION:
            raise StrategyFieldError(("cp_attention",), f"must be one of {', '.join(CP_ATTENTION)}, got {brief(self.cp_attention)}")
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
    def max_cp(self) -> int:
        """The largest CP degree of any stage (1: no context parallelism)."""
        return max(s.cp for p in self.pipelines for s in p.stages)

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

    def check_layer(self, layer: object) -> int:
        """`layer`, if it is a layer of this strategy's model."""
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
        layer = self.check_layer(layer)
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
        raise StrategyError(
            f"rank {rank!r} is not used by strategy {self.name or '(unnamed)'}; its ranks are {format_ranks(self.all_ranks)}")

    # ---- conversion ---------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain data for JSON/YAML: ranks and layers as compact strings ('0-3', '0-14'); schedule,
        warmup and recompute only where set."""
        out = {
            "name": self.name,
            "num_layers": self.num_layers,
            "zero": self.zero,
            "pipelines": [_pipeline_to_dict(p) for p in self.pipelines],
        }
        if self.cp_attention != "ring":
            out["cp_attention"] = self.cp_attention
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "Strategy":
        """Build from plain data (see to_dict); errors name the key path, e.g. pipelines[0].stages[1].tp.
        ranks: '0-3,8', a list of ints or one int; layers: '0-14', [first, last] or one int;
        num_layers defaults to the first pipeline's coverage; micro-batch values may be null (run time)."""
        check_keys(data, STRATEGY_KEYS, (), required=("pipelines",))
        raw_pipelines = data["pipelines"]
        if not isinstance(raw_pipelines, list) or not raw_pipelines:
            raise StrategyFieldError(("pipelines",), f"must be a non-empty list of pipelines, got {brief(raw_pipelines)}")
        pipelines = tuple(_pipeline_from_dict(p, ("pipelines", i)) for i, p in enumerate(raw_pipelines))
        return cls(
            pipelines,
            data.get("num_layers", pipelines[0].num_layers),
            data.get("zero", False),
            "" if data.get("name") is None else data["name"],
            data.get("cp_attention", "ring"),
        )


def _pipeline_to_dict(p: Pipeline) -> dict:
    out: dict = {"micro_batches": p.micro_batches, "micro_batch_size": p.micro_batch_size}
    if p.schedule is not None:
        out["schedule"] = p.schedule
    if p.warmup is not None:
        out["warmup"] = list(p.warmup)
    out["stages"] = [_stage_to_dict(s) for s in p.stages]
    return out


def with_recompute(strategy: Strategy, layers=None, granularity: str = "full") -> Strategy:
    """`strategy` with `layers` (any layers of the model, None: all) recomputed at `granularity` in
    every pipeline: each stage recomputes the chosen layers it holds, so a range may straddle
    stage boundaries and cover some layers of a stage only. A stage that already recomputes is an
    error (one choice per stage)."""
    chosen = set(range(strategy.num_layers)) if layers is None else set(layers)
    outside = sorted(layer for layer in chosen if not 0 <= layer < strategy.num_layers)
    if not chosen or outside:
        raise StrategyError(f"recompute: layers {format_layer_list(outside) or 'none'} are not layers of the "
                            f"{strategy.num_layers}-layer model")
    pipelines = []
    for i, p in enumerate(strategy.pipelines):
        stages = []
        for j, stage in enumerate(p.stages):
            mine = tuple(layer for layer in stage.layers if layer in chosen)
            if mine and stage.recompute:
                raise StrategyFieldError(("pipelines", i, "stages", j, "recompute"),
                                         "is given for the stage and for the whole strategy: give one")
            stages.append(replace(stage, recompute=True, recompute_layers=mine, recompute_granularity=granularity)
                          if mine else stage)
        pipelines.append(replace(p, stages=tuple(stages)))
    return replace(strategy, pipelines=tuple(pipelines))


def recompute_word(s: Stage) -> str:
    """The stage's recompute choice in the text syntax: '', ' recompute', ' recompute=selective',
    ' recompute=L2-5' or ' recompute=selective:L2-5'."""
    if not s.recompute:
        return ""
    value = [] if s.recompute_granularity == "full" else [s.recompute_granularity]
    if s.recompute_layers is not None:
        value.append("L" + format_layer_list(s.recompute_layers))
    return " recompute" + ("=" + ":".join(value) if value else "")


def _stage_to_dict(s: Stage) -> dict:
    out: dict = {"ranks": format_ranks(s.ranks), "layers": format_layers(s.layers), "tp": s.tp}
    if s.recompute:
        out["recompute"] = True
        if s.recompute_layers is not None:
            out["recompute_layers"] = format_layer_list(s.recompute_layers)
        if s.recompute_granularity != "full":
            out["recompute_granularity"] = s.recompute_granularity
    if s.cp > 1:
        out["cp"] = s.cp
    if s.cp_shares is not None:
        out["cp_shares"] = list(s.cp_shares)
    return out


def _pipeline_from_dict(data: object, path: Path) -> Pipeline:
    check_keys(data, PIPELINE_KEYS, path, required=("stages", "micro_batches", "micro_batch_size"))
    raw_stages = data["stages"]
    if not isinstance(raw_stages, list) or not raw_stages:
        raise StrategyFieldError(path + ("stages",), f"must be a non-empty list of stages, got {brief(raw_stages)}")
    stages = tuple(_stage_from_dict(s, path + ("stages", j)) for j, s in enumerate(raw_stages))
    warmup = data.get("warmup")
    if isinstance(warmup, str):
        with field_context(*path, "warmup"):
            warmup = parse_count_list(warmup)
    with field_context(*path):
        return Pipeline(stages, data["micro_batches"], data["micro_batch_size"], data.get("schedule"), warmup)


def _stage_from_dict(data: object, path: Path) -> Stage:
    check_keys(data, STAGE_KEYS, path, required=("ranks", "layers"))
    ranks, layers = data["ranks"], data["layers"]
    with field_context(*path, "ranks"):
        ranks = parse_index_list(ranks) if isinstance(ranks, str) else (ranks,) if is_int(ranks) else ranks
    with field_context(*path, "layers"):
        layers = parse_layer_range(layers) if isinstance(layers, str) else (layers, layers) if is_int(layers) else layers
    with field_context(*path):
        shares = data.get("cp_shares")
        if isinstance(shares, str):
            with field_context(*path, "cp_shares"):
                shares = parse_count_list(shares)
        chosen = data.get("recompute_layers")
        if isinstance(chosen, str):
            with field_context(*path, "recompute_layers"):
                chosen = parse_layer_list(chosen)
        elif is_int(chosen):
            chosen = (chosen,)
        return Stage(ranks, layers, data.get("tp"), data.get("recompute", False), data.get("cp", 1), shares,
                     recompute_layers=chosen, recompute_granularity=data.get("recompute_granularity", "full"))


__all__ = ["CP_ATTENTION", "GRANULARITIES", "Pipeline", "Stage", "Strategy", "recompute_word", "with_recompute"]
