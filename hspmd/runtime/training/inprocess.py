"""The Trainer with every rank as a thread of this process, over the in-process backend: for fast
tests and checks (equivalence with single-device torch, switches), never for speed.

    job = InProcessJob(graph, 0, MicroBatchLayout((2, 1), (2, 2)), symbols={"S": 8, "T": 48})
    loss = job.step({"tokens": x, "labels": y})    # the same global batch a Trainer.step takes
    job.gradients(), job.parameters()             # whole values, gathered as a rank-0 caller would
    job = job.switch(1, other_layout)             # hot switch of every rank (fused BSR)

Each call runs the same method of every rank's Trainer at once, one thread per rank; the graph is
specialized once for all ranks (each thread would otherwise deduce the same graph again).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from hspmd.backends.local import LocalWorld
from hspmd.errors import HSPMDError
from hspmd.ir.graph import Graph
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.buckets import DEFAULT_BUCKET_CAP_MB
from hspmd.runtime.execution.checks import checked_ranks, checked_symbols
from hspmd.runtime.training.trainer import Trainer, as_layout, trainer_binding
from hspmd.specialize.deduce import check_strategy_index, deduce
from hspmd.specialize.specialized import Specialized, all_devices, specialize_graph
from hspmd.specialize.strategy import Strategy


class InProcessJob:
    """One Trainer per rank (ranks 0 .. the strategies' highest device), all in this process.

    `ranks`: how many ranks the job has (default: enough for `strategy`; give more to leave room
    for a later switch to a strategy on more devices); `device`: where every rank's tensors live
    (`meta` checks a job's device placement without data). The other arguments are the Trainer's."""

    def __init__(self, graph: Graph, strategy: int, layout: MicroBatchLayout | Strategy, schedule: str | None = None,
                 symbols: Mapping[str, int] | None = None, seed: int = 0, topology=None, ranks: int | None = None,
                 timeout: float = 120.0, device: torch.device | str = "cpu",
                 bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB):
        self.graph, self.symbols, self.seed, self.topology = graph, checked_symbols(symbols, "InProcessJob"), seed, topology
        spec = self._specialize(check_strategy_index(graph, strategy, "InProcessJob"), as_layout(layout))
        ranks = max(spec.devices) + 1 if ranks is None else ranks
        if ranks <= max(spec.devices):
            raise HSPMDError(f"strategy {strategy} uses devices up to {max(spec.devices)}, the job has {ranks} ranks")
        self.world = LocalWorld(range(ranks), timeout, device)
        self.trainers: dict[int, Trainer] = self.world.run(
            lambda b: Trainer(graph, strategy, b, layout, schedule, self.symbols, seed, topology,
                              spec if b.rank in spec.executables else None, bucket_cap_mb))

    def _specialize(self, strategy: int, layout: MicroBatchLayout) -> Specialized:
        deduced = deduce(self.graph, strategy)
        binding = trainer_binding(self.graph, layout, self.symbols)
        return specialize_graph(self.graph, strategy, binding, all_devices(deduced), self.topology, deduced=deduced)

    @property
    def specialized(self) -> Specialized:
        """The specialization every rank of the current strategy runs (one value, shared)."""
        return self._lead().specialized

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.world.devices

    def _lead(self) -> Trainer:
        return next(t for t in self.trainers.values() if not t.idle)

    def step(self, batch: Mapping[str, torch.Tensor]) -> float | None:
        """Trainer.step on every rank; returns the step loss."""
        losses = self.world.run(lambda b: self.trainers[b.rank].step(batch))
        return losses[self._lead().devices[0]]

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's synchronised gradients, whole (Trainer.gradients on every rank)."""
        return self.world.run(lambda b: self.trainers[b.rank].gradients())[self._lead().devices[0]]

    def parameters(self) -> dict[str, torch.Tensor]:
        """Whole values of every parameter (replicas checked to agree)."""
        tensors = self.world.run(lambda b: self.trainers[b.rank].state_dict())[self._lead().devices[0]]
        return {n.name: tensors[n.name] for n in self.graph.parameters if n.name in tensors}

    def switch(self, strategy: int, layout: MicroBatchLayout | Strategy, schedule: str | None = None,
               failed: Iterable[int] = ()) -> "InProcessJob":
        """Trainer.switch on every rank: this job, now training `strategy` (its trainers replaced)."""
        spec = self._specialize(check_strategy_index(self.graph, strategy, "switch()"), as_layout(layout))
        failed = checked_ranks(failed, len(self.ranks), "failed ranks", "switch()")
        self.trainers = self.world.run(lambda b: self.trainers[b.rank].switch(
            strategy, layout, schedule, failed, spec if b.rank in spec.executables else None))
        return self


__all__ = ["InProcessJob"]
