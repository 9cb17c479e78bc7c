"""Strategy switching (fused BSR) and elastic recovery after device failures."""

from hspmd.switching.elastic import WeightLost, recover_strategy, surviving_layout
from hspmd.switching.switch import LEAF_KINDS, SwitchPlan, execute_switch, plan_layout_switch, plan_switch

__all__ = ["LEAF_KINDS", "SwitchPlan", "WeightLost", "execute_switch", "plan_layout_switch", "plan_switch", "recover_strategy",
           "surviving_layout"]
