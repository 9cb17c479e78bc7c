"""Planning: what a model costs on a cluster (ModelSpec, CostModel), simulated schedules, and the
strategy searches built on them. Above specialize: planners return plans (data); executors run them."""

from hspmd.planning.model import MODELS, Kernel, ModelSpec, from_llama_config, model_named
from hspmd.planning.cost import CostModel, Efficiency, Memory, OpCosts, ProfileTable, StageShape, ring_time

__all__ = [
    "CostModel", "Efficiency", "Kernel", "MODELS", "Memory", "ModelSpec", "OpCosts", "ProfileTable", "StageShape",
    "from_llama_config", "model_named", "ring_time",
]
