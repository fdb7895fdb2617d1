"""The sync counting of the CUDA tests, checked without CUDA: syncs are told apart by the line that made them, a
model's own syncs cancel against plain Lightning's, and one more sync under the strategy is caught with its place."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch

from lightning_ratel import RatelStrategy
from tests.models import LM, trainer
from tests.syncs import SYNC_MESSAGE, SyncCounter, extra_syncs

# The stand-in syncs outside the counted micro-batches are not worth a line in the test report.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class SyncingModel(LM):
    """The shared Llama whose step "syncs" once, as transformers' mask code does, and optionally once more."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__("llama")
        self.extra = extra

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        warnings.warn(SYNC_MESSAGE)
        if self.extra:
            warnings.warn(SYNC_MESSAGE)
        warnings.warn("an unrelated warning")
        return self.model(input_ids=batch, labels=batch).loss


def _count(strategy: Any, module: SyncingModel, modes: list[str]) -> SyncCounter:
    counter = SyncCounter(first=1, set_mode=modes.append)
    trainer(strategy, max_steps=3, callbacks=[counter]).fit(module)
    return counter


def test_the_models_own_syncs_cancel(tmp_path):
    modes: list[str] = []
    plain = _count("auto", SyncingModel(), modes)
    ratel = _count(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host"), SyncingModel(), modes)
    assert plain.checked == ratel.checked == 2  # micro-batches 1 and 2
    assert sum(plain.places.values()) == 2 and len(plain.places) == 1
    assert extra_syncs(ratel, plain) == {}
    # Armed in "warn" mode for each counted micro-batch, back to "default" after every micro-batch.
    assert modes.count("warn") == 4 and modes[-1] == "default"


def test_a_sync_beyond_plains_is_reported_with_its_place(tmp_path):
    plain = _count("auto", SyncingModel(), [])
    more = _count(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host"), SyncingModel(extra=True), [])
    extra = extra_syncs(more, plain)
    assert sum(extra.values()) == 2 and all(place.startswith(__file__) for place in extra)


class ThreadSyncingModel(SyncingModel):
    """Also "syncs" on a thread of its own in each step, as the swap store's I/O threads do by design."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        worker = threading.Thread(target=warnings.warn, args=(SYNC_MESSAGE,))
        worker.start()
        worker.join()
        return super().training_step(batch, batch_idx)


def test_only_the_training_threads_syncs_count(tmp_path):
    plain = _count("auto", SyncingModel(), [])
    threaded = _count("auto", ThreadSyncingModel(), [])
    assert extra_syncs(threaded, plain) == {}
    assert sum(threaded.other_threads.values()) == 2 and not plain.other_threads

