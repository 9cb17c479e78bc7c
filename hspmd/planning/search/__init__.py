"""Strategy searches over one objective (space.py): exhaustive (the oracle), dp (HAPT), dfs (H2),
mcts (HetAuto). Each returns ranked `PlannedStrategy` values that hspmd trains directly."""

from hspmd.planning.search.dfs_h2 import dfs
from hspmd.planning.search.dp_hapt import dp
from hspmd.planning.search.oracle import GENERAL, PERMUTED, SPACES, UNIFORM, Space, exhaustive, layouts
from hspmd.planning.search.mcts_hetauto import mcts
from hspmd.planning.search.space import (
    Evaluator,
    Layout,
    PlannedStrategy,
    PlanningError,
    Problem,
    StagePlan,
    TableEvaluator,
    layout_strategy,
    planned,
    price,
)

SEARCHES = {"dp": dp, "dfs": dfs, "mcts": mcts}

__all__ = [
    "Evaluator", "GENERAL", "Layout", "PERMUTED", "PlannedStrategy", "PlanningError", "Problem", "SEARCHES", "SPACES",
    "Space", "StagePlan", "TableEvaluator", "UNIFORM", "dfs", "dp", "exhaustive", "layout_strategy", "layouts", "mcts",
    "planned", "price",
]
