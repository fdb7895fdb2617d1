"""Model features that must be off while the engine trains a model, switched off for the fit and back on after.

transformers' KV cache: a training step never reads it, but filling it is a side effect a replayed forward would
repeat (transformers itself turns it off under gradient checkpointing).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class FitSwitches:
    """Turns the features off on construction; :meth:`restore` turns them back on.

    Args:
        module: the model.
    """

    def __init__(self, module: nn.Module) -> None:
        self._kv_cache: list[Any] = []
        for m in module.modules():
            config = getattr(m, "config", None)
            if config is not None and getattr(config, "use_cache", False) is True and hasattr(m, "generation_config"):
                config.use_cache = False
                self._kv_cache.append(config)

    def restore(self) -> None:
        """Put every switched feature back as it was."""
        for config in self._kv_cache:
            config.use_cache = True
        self._kv_cache.clear()
