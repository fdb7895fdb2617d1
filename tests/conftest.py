"""Shared pytest setup: the simulated-streams mode, and updates overlapped with backward as on a GPU.

``pytest --simulate-streams`` (or ``RATEL_SIMULATE_STREAMS=1`` in the environment) runs every test on a CPU device that
simulates CUDA's streams (see :mod:`lightning_ratel.runtime.simulation`): copies run asynchronously on worker threads,
and memory that CUDA could hand out again is poisoned, so a missing wait or ``keep_alive`` makes results wrong or
raises :class:`~lightning_ratel.runtime.simulation.StreamOrderError`. The ``simulated_streams`` fixture does the same
for one test.
"""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Iterator

import pytest

from lightning_ratel.engine.coordinator import RatelEngine
from lightning_ratel.runtime import recompute
from lightning_ratel.runtime.probe import CACHE_ENV
from lightning_ratel.runtime.simulation import SIMULATE_STREAMS_ENV, take_simulation_errors


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--simulate-streams", action="store_true",
                     help="run every test on a CPU device that simulates CUDA streams")


def pytest_configure(config: pytest.Config) -> None:
    # Measured hardware speeds are kept in this process only: the tests leave nothing in the user's cache.
    os.environ.setdefault(CACHE_ENV, "")
    if config.getoption("--simulate-streams"):
        os.environ[SIMULATE_STREAMS_ENV] = "1"


@pytest.fixture
def simulated_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices created in this test simulate CUDA streams."""
    monkeypatch.setenv(SIMULATE_STREAMS_ENV, "1")


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[recompute.ForwardRecord]:
    """Every record replayed in this test, with the ops its replay executed as ``record.executed``."""
    seen: list[recompute.ForwardRecord] = []
    original = recompute.ForwardRecord.replay

    def replay(self, unpack, restore):
        if self.outputs is None:
            seen.append(self)
            self.executed = {self.ops[k].name for k in self.needed()[0]}
        original(self, unpack, restore)

    monkeypatch.setattr(recompute.ForwardRecord, "replay", replay)
    return seen


@pytest.fixture(autouse=True)
def _updates_overlap_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs the updates during backward, the path a GPU run takes (on the CPU the cost model defers them to
    the end of backward); a test of that decision sets ``RatelEngine.overlap_updates`` back to ``None``."""
    monkeypatch.setattr(RatelEngine, "overlap_updates", True)


@pytest.fixture(autouse=True)
def _no_stream_order_errors() -> Iterator[None]:
    """Fail a test when the stream simulation caught something that nothing raised during the test (a tensor freed
    after the last device call)."""
    take_simulation_errors()
    yield
    if os.environ.get(SIMULATE_STREAMS_ENV, "") not in ("", "0"):
        # Tensors in reference cycles are freed only by the collector: free them now, in the test that made them.
        gc.collect()
    errors = take_simulation_errors()
    if errors:
        pytest.fail("the stream simulation caught:\n" + "\n".join(errors))


@pytest.fixture(autouse=True)
def sigint_handler() -> Iterator[None]:
    """Lightning ignores SIGINT once a KeyboardInterrupt reached it (a second Ctrl-C must not stop its shutdown), and
    a subprocess inherits an ignored SIGINT: put the handler back after every test, so no test depends on the ones
    before it."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)

