"""Model features that must be off while the engine trains a model, switched off for the fit and back on after.

- transformers' KV cache: a training step never reads it, but filling it is a side effect a replayed forward would
  repeat: each layer rebinds the cache's keys and values to their concatenation with its own (Python state of an
  object passed to the layer, which a replay neither redirects like a write into tensor memory nor gives back like
  its modules' attributes), so a replay would find them twice as long
  (transformers itself turns the cache off under gradient checkpointing). It is switched off in every config of the
  model, not only the top one: an encoder-decoder (T5) gives its decoder stack a copy of the config, and the stack
  decides by its own copy.
- transformers' own gradient (activation) checkpointing: the plan decides per op what is kept, moved or recomputed;
  the model's checkpointing would hide what its layers save from the planner and recompute whole layers on top.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn


class FitSwitches:
    """Turns the features off on construction; :meth:`restore` turns them back on.

    Args:
        module: the model.
    """

    def __init__(self, module: nn.Module) -> None:
        self._kv_cache: list[Any] = []
        for m in module.modules():
            # Every config in the model, not only the top one's: T5's decoder stack decides by its own copy, and a
            # sequence classifier's decoder fills a cache as well as a generating model's.
            config = getattr(m, "config", None)
            if getattr(config, "use_cache", False) is True:
                config.use_cache = False
                self._kv_cache.append(config)
        # transformers marks each layer that checkpoints itself with a ``gradient_checkpointing`` flag.
        self._checkpointing = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
        for m in self._checkpointing:
            m.gradient_checkpointing = False
        if self._checkpointing:
            rank_zero_info(
                f"RatelStrategy: the model's own gradient checkpointing ({len(self._checkpointing)} layers) is off "
                "during fit; the plan decides what to recompute. It is back on when fit ends."
            )

    @contextlib.contextmanager
    def user_settings(self) -> Iterator[None]:
        """The models' configurations as the user set them, for the duration of the ``with`` block (between steps:
        a ``config.json`` written then must not turn the KV cache off for good)."""
        configs = list(self._kv_cache)
        for config in configs:
            config.use_cache = True
        try:
            yield
        finally:
            for config in configs:
                config.use_cache = False

    def restore(self) -> None:
        """Put every switched feature back as it was."""
        for config in self._kv_cache:
            config.use_cache = True
        self._kv_cache.clear()
        for m in self._checkpointing:
            m.gradient_checkpointing = True
        self._checkpointing.clear()
