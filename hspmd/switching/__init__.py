"""Strategy switching (fused BSR) and elastic recovery after device failures."""

from hspmd.switching.recovery import WeightLost, recover_strategy, surviving_layout
from hspmd.switching.switch import (
    GRADIENT_PREFIX, LEAF_KINDS, SwitchPlan, checked_failed, execute_switch, gradient_leaves, plan_layout_switch, plan_switch,
    plan_switch_with_gradients,
)

__all__ = ["GRADIENT_PREFIX", "LEAF_KINDS", "SwitchPlan", "WeightLost", "checked_failed", "execute_switch", "gradient_leaves",
           "plan_layout_switch", "plan_switch", "plan_switch_with_gradients", "recover_strategy", "surviving_layout"]
