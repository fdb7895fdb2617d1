"""Host syncs counted per micro-batch, to tell the strategy's syncs from the model's.

A model may synchronize on its own (transformers' ``find_packed_sequence_indices`` reads a device tensor on the host),
so "no sync at all" is a property of the model, not of the strategy. The CUDA tests run plain Lightning and
RatelStrategy on the same model with :class:`SyncCounter` and require Ratel to add none: every place that syncs under
Ratel syncs as often under plain Lightning.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

# What torch says, in "warn" sync-debug mode, for each synchronizing call.
SYNC_MESSAGE = "called a synchronizing CUDA operation"


class SyncCounter(L.Callback):
    """Records every synchronizing CUDA call, by the Python line that made it, in micro-batches from ``first`` on.

    Args:
        first: the first micro-batch counted (steady state: after the profiled and the planning steps).
        set_mode: ``torch.cuda.set_sync_debug_mode`` (a stand-in where there is no CUDA).
    """

    def __init__(self, first: int, set_mode: Callable[[str], None] | None = None) -> None:
        self.first = first
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.checked = 0
        self.places: Counter[str] = Counter()
        self._recording: Any = None
        self._log: list[warnings.WarningMessage] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx >= self.first:
            self._recording = warnings.catch_warnings(record=True)
            self._log = self._recording.__enter__()
            warnings.simplefilter("always")  # every sync, not the first per place
            self.set_mode("warn")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.set_mode("default")
        if self._recording is None:
            return
        self._recording.__exit__(None, None, None)
        self._recording = None
        self.checked += 1
        self.places.update(f"{w.filename}:{w.lineno}" for w in self._log if SYNC_MESSAGE in str(w.message))


def extra_syncs(ratel: SyncCounter, plain: SyncCounter) -> Counter[str]:
    """The places that synchronized more often under Ratel than under plain Lightning, with how many more times."""
    return ratel.places - plain.places
