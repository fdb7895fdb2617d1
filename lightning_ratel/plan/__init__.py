"""Activation-placement planning: hardware and block profiles, the cost model and the search (pure Python)."""

from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.plan.cost import CostSettings, Prediction, predict, recompute_ops
from lightning_ratel.plan.profile import LayerProfile, OpProfile
from lightning_ratel.plan.search import Plan, fixed, search
from lightning_ratel.tiers import TIERS

__all__ = [
    "TIERS",
    "CostSettings",
    "HardwareProfile",
    "LayerProfile",
    "OpProfile",
    "Plan",
    "Prediction",
    "fixed",
    "predict",
    "recompute_ops",
    "search",
]
