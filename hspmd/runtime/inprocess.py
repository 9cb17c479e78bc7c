"""Training a specialized graph in one process: one thread per device over the in-process
backend, in the simplest correct order (each device: every micro-batch's forward, then every
backward, then the update). Real schedules (GPipe, 1F1B) drive the same run_* calls."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hspmd.annotations import unshard
from hspmd.errors import HSPMDError, ShapeError
from hspmd.ir.shapes import Binding
from hspmd.backends.backend import Backend
from hspmd.backends.local import run_on_devices
from hspmd.specialize.executable import ExecutableGraph, run_time_ratios
from hspmd.runtime.run import DeviceState, run_backward, run_forward, run_update
from hspmd.specialize.specialized import Specialized

Feeds = Mapping[str, torch.Tensor]


def local_feeds(exe: ExecutableGraph, feeds: Feeds, binding: Binding) -> dict[str, torch.Tensor]:
    """This device's pieces of one micro-batch's whole placeholder values."""
    out = {}
    for node in exe.placeholders:
        if node.name not in feeds:
            raise HSPMDError(f"no value fed for placeholder {node.name}")
        value = feeds[node.name]
        expected = binding.shape(node.output.shape, node.name)
        if tuple(value.shape) != expected:
            raise ShapeError(f"placeholder {node.name}: fed shape {tuple(value.shape)}, the binding gives {expected}")
        box = exe.box(node.output, binding)
        out[node.name] = value[tuple(slice(a, b) for a, b in box)]
    return out


class InProcessTrainer:
    """Holds every device's state; step() runs one training step on all devices.

    micro_batches: per pipeline (in spec.pipelines order), how many of the fed micro-batches it
    runs (default: all). Micro-batch m's feeds are whole tensors under the binding; each pipeline
    takes its region (the top-tier split) of them."""

    def __init__(self, spec: Specialized, micro_batches: Sequence[int] | None = None, seed: int = 0,
                 timeout: float = 120.0):
        self.spec, self.seed, self.timeout = spec, seed, timeout
        if micro_batches is not None and len(micro_batches) != len(spec.pipelines):
            raise HSPMDError(f"micro_batches has {len(micro_batches)} entries for {len(spec.pipelines)} pipelines")
        self.micro_batches = micro_batches
        self.states = {d: DeviceState.initial(exe, seed) for d, exe in spec.executables.items()}
        self.synced = dict(spec.graph.gradients)
        self.loss: float | None = None
        self.gradients: dict[str, torch.Tensor] = {}

    def _device_step(self, backend: Backend, feeds: Sequence[Feeds], bindings: Sequence[Binding]) -> None:
        exe = self.spec.executables[backend.rank]
        state = self.states[backend.rank]
        state.fetched.clear()
        pipeline, _ = self.spec.locate(backend.rank)
        count = len(feeds) if self.micro_batches is None else self.micro_batches[pipeline]
        if count > len(feeds):
            raise HSPMDError(f"pipeline {pipeline} runs {count} micro-batches but {len(feeds)} were fed")
        mbs = [run_forward(exe, backend, state, local_feeds(exe, feeds[m], bindings[m]), bindings[m])
               for m in range(count)]
        for mb in mbs:
            run_backward(exe, backend, state, mb)
        run_update(exe, backend, state, fetch=list(self.synced.values()))

    def step(self, feeds: Sequence[Feeds], bindings: Binding | Sequence[Binding] | None = None) -> float:
        """One step over the fed micro-batches; returns the loss (summed over micro-batches)."""
        if isinstance(bindings, Binding) or bindings is None:
            bindings = [bindings or self.spec.binding] * len(feeds)
        run_on_devices(lambda b: self._device_step(b, feeds, bindings), self.spec.devices, self.timeout)
        graph, deduced = self.spec.graph, self.spec.deduced
        if graph.losses:
            loss = graph.losses[0]
            self.loss = float(self._gather(loss.name, deduced[loss], (), bindings[0], fetched=True))
        self.gradients = {name: self._gather(t.name, deduced[t], None, bindings[0], True)
                          for name, t in self.synced.items()}
        return self.loss

    def _gather(self, name, ann, shape, binding, fetched: bool) -> torch.Tensor:
        locals_ = {d: (s.fetched if fetched else s.leaves)[name] for d, s in self.states.items()
                   if d in ann.devices}
        return unshard(locals_, ann, shape=shape, ratios=run_time_ratios(ann, binding))

    def parameters(self) -> dict[str, torch.Tensor]:
        """Whole values of every parameter (checks that replicas agree)."""
        deduced = self.spec.deduced
        return {n.name: self._gather(n.name, deduced[n.output], n.output.shape, self.spec.binding, False)
                for n in self.spec.graph.parameters}


__all__ = ["InProcessTrainer", "local_feeds"]
