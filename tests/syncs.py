"""Host syncs counted per micro-batch, to tell the strategy's syncs from the model's.

A model may synchronize on its own (transformers' ``find_packed_sequence_indices`` reads a device tensor on the host),
so "no sync at all" is a property of the model, not of the strategy. The CUDA tests run plain Lightning and
RatelStrategy on the same model with :class:`SyncCounter` and require Ratel to add none: every place that syncs under
Ratel syncs as often under plain Lightning.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

# What torch says, in "warn" sync-debug mode, for each synchronizing call.
SYNC_MESSAGE = "called a synchronizing CUDA operation"


class SyncCounter(L.Callback):
    """Records every synchronizing CUDA call of the training thread, by the Python line that made it, in micro-batches
    from ``first`` on.

    Only the training thread counts: the swap store's I/O threads checksum device data on streams of their own and
    wait for that result by design (it holds up neither the training thread nor its streams), and torch's sync debug
    mode reports every thread's syncs alike.

    Args:
        first: the first micro-batch counted (steady state: after the profiled and the planning steps).
        set_mode: ``torch.cuda.set_sync_debug_mode`` (a stand-in where there is no CUDA).
    """

    def __init__(self, first: int, set_mode: Callable[[str], None] | None = None) -> None:
        self.first = first
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.checked = 0
        self.places: Counter[str] = Counter()
        self.other_threads: Counter[str] = Counter()
        self._recording: Any = None
        self._thread = threading.get_ident()

    def _record(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                line: Any = None) -> None:
        if SYNC_MESSAGE in str(message):
            place = f"{filename}:{lineno}"
            (self.places if threading.get_ident() == self._thread else self.other_threads)[place] += 1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx >= self.first:
            self._thread = threading.get_ident()
            self._recording = warnings.catch_warnings()
            self._recording.__enter__()
            warnings.simplefilter("always")  # every sync, not the first per place
            warnings.showwarning = self._record
            self.set_mode("warn")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.set_mode("default")
        if self._recording is None:
            return
        self._recording.__exit__(None, None, None)
        self._recording = None
        self.checked += 1


def extra_syncs(ratel: SyncCounter, plain: SyncCounter) -> Counter[str]:
    """The places that synchronized more often under Ratel than under plain Lightning, with how many more times."""
    return ratel.places - plain.places
