"""How one training step's global batch is split across pipelines and micro-batches (pure data).

Pipeline k runs counts[k] micro-batches of sizes[k] samples each, so a faster pipeline can take
more or larger micro-batches. The global batch's rows are laid out pipeline by pipeline, each
pipeline's micro-batches in order:

    rows [0, counts[0]*sizes[0])   pipeline 0: micro-batch 0, then 1, ...
    the next counts[1]*sizes[1]     pipeline 1, ...

The micro-batch sizes are also the top-tier ratios of the batch annotation (`H0(2:1){...}`): a
micro-batch step of the whole strategy covers sum(sizes) rows, pipeline k's region of it being
its own sizes[k] rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from hspmd.errors import HSPMDError, HSPMDTypeError
from hspmd.limits import MAX_BATCH_ROWS, MAX_DEVICES, brief, check_limit


@dataclass(frozen=True)
class MicroBatchLayout:
    """Per pipeline (in strategy order): micro-batches per step and samples per micro-batch."""

    counts: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        for what in ("counts", "sizes"):
            if not isinstance(getattr(self, what), (tuple, list)):
                raise HSPMDTypeError(f"micro-batch {what} must be a tuple of ints (one per pipeline), got "
                                     f"{brief(getattr(self, what))}")
        counts, sizes = tuple(self.counts), tuple(self.sizes)
        if not counts or len(counts) != len(sizes):
            raise HSPMDError(f"micro-batch layout needs one count and one size per pipeline, got counts "
                             f"{brief(counts)}, sizes {brief(sizes)}")
        check_limit(len(counts), MAX_DEVICES, "the number of pipelines", "micro-batch layout")
        for what, values in (("counts", counts), ("sizes", sizes)):
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad:
                raise HSPMDError(f"micro-batch {what} must be positive integers, got {brief(values)}")
            check_limit(max(values), MAX_BATCH_ROWS, f"a micro-batch {what[:-1]}", "micro-batch layout")
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "sizes", sizes)

    @staticmethod
    def of(strategy) -> "MicroBatchLayout":
        """The layout a Strategy (hspmd.specialize.strategy) fixes; its counts and sizes must be bound."""
        counts = tuple(p.micro_batches for p in strategy.pipelines)
        sizes = tuple(p.micro_batch_size for p in strategy.pipelines)
        if None in counts or None in sizes:
            raise HSPMDError(
                f"strategy {strategy.name or '(unnamed)'} leaves micro-batch counts or sizes to run time "
                f"(counts {counts}, sizes {sizes}); pass a MicroBatchLayout(counts, sizes) to the trainer"
            )
        return MicroBatchLayout(counts, sizes)

    @property
    def pipelines(self) -> int:
        return len(self.counts)

    @property
    def global_batch_size(self) -> int:
        return sum(c * s for c, s in zip(self.counts, self.sizes))

    def _check(self, pipeline: int) -> None:
        if not 0 <= pipeline < len(self.counts):
            raise HSPMDError(f"pipeline {pipeline} does not exist: the layout has pipelines 0-{len(self.counts) - 1}")

    def pipeline_rows(self, pipeline: int) -> tuple[int, int]:
        """[start, stop) of the global batch's rows that `pipeline` trains on in one step."""
        self._check(pipeline)
        start = sum(c * s for c, s in zip(self.counts[:pipeline], self.sizes[:pipeline]))
        return start, start + self.counts[pipeline] * self.sizes[pipeline]

    def rows(self, pipeline: int, micro_batch: int) -> tuple[int, int]:
        """[start, stop) rows of micro-batch `micro_batch` of `pipeline`."""
        self._check(pipeline)
        if not 0 <= micro_batch < self.counts[pipeline]:
            raise HSPMDError(f"pipeline {pipeline} runs micro-batches 0-{self.counts[pipeline] - 1}, not {micro_batch}")
        start = self.pipeline_rows(pipeline)[0] + micro_batch * self.sizes[pipeline]
        return start, start + self.sizes[pipeline]

    def __str__(self) -> str:
        parts = [f"pipeline {k}: {c} x {s}" for k, (c, s) in enumerate(zip(self.counts, self.sizes))]
        return f"global batch {self.global_batch_size} = " + " + ".join(parts)


@dataclass(frozen=True)
class PipelineBatch:
    """One rank's share of a step's global batch, for a rank that reads only what it trains:
    `rows` are pipeline `pipeline`'s rows (MicroBatchLayout.pipeline_rows) of each placeholder
    this rank's program feeds (none for a rank whose program takes no placeholder, and pipeline
    None for a rank the strategy leaves idle); `ids` name the samples (for logs and tests)."""

    pipeline: int | None
    rows: Mapping[str, torch.Tensor]
    ids: tuple = field(default=(), compare=False)


__all__ = ["MicroBatchLayout", "PipelineBatch"]
