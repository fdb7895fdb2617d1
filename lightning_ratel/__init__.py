"""lightning_ratel: fine-tune models larger than GPU memory with PyTorch Lightning, model states on NVMe."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ratel.callbacks import RatelHFExport, RatelProfiler
from lightning_ratel.errors import (
    RatelConfigError,
    RatelModelError,
    RatelPlanError,
    RatelRankFailed,
    RatelStoreError,
)
from lightning_ratel.plan import Plan
from lightning_ratel.precision import RatelPrecision
from lightning_ratel.preflight import Estimate, estimate
from lightning_ratel.strategy import RatelStrategy

if RatelStrategy.strategy_name not in StrategyRegistry:
    RatelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "Estimate",
    "Plan",
    "RatelHFExport",
    "RatelConfigError",
    "RatelModelError",
    "RatelPlanError",
    "RatelPrecision",
    "RatelProfiler",
    "RatelRankFailed",
    "RatelStoreError",
    "RatelStrategy",
    "estimate",
]
__version__ = "0.1.0"
