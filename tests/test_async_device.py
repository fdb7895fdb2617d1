"""A representative part of the equivalence tests, run on the CPU device that simulates CUDA streams.

Copies run asynchronously and memory is poisoned when CUDA's caching allocator could reuse it (see
:mod:`lightning_ratel.runtime.device`), so these fail where a wait for a copy, or a ``keep_alive`` of what a copy
stream allocated, is missing. ``pytest --simulate-streams`` runs the whole suite that way (several times slower).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import test_beyond_ram, test_equivalence, test_planning, test_schedule

pytestmark = pytest.mark.usefixtures("simulated_streams")


@pytest.mark.parametrize(
    ("model", "precision", "accumulate", "clip", "placement"),
    [("llama", "bf16-mixed", 3, 0.05, "mixed"), ("gpt2", "32-true", 1, None, "planned"),
     ("mlp", "bf16-mixed", 1, 0.05, "mixed")],
)
def test_matches_plain_adamw(tmp_path: Path, model: str, precision: str, accumulate: int, clip: float | None,
                             placement: str) -> None:
    test_equivalence.test_matches_plain_adamw(tmp_path, model, precision, accumulate, clip, placement)


@pytest.mark.parametrize("policy", ["host", "ssd"])
def test_each_policy_matches(tmp_path: Path, policy: str) -> None:
    test_equivalence.test_each_policy_matches(tmp_path, policy)


def test_fp16_overflow_skip(tmp_path: Path) -> None:
    test_beyond_ram.test_ssd_param_cache_fp16_overflow_skip_matches_gradscaler(tmp_path)


@pytest.mark.parametrize(("model", "precision", "accumulate", "clip"),
                         [("llama", "bf16-mixed", 3, 0.05), ("gpt2", "32-true", 1, None)])
def test_ssd_param_cache_matches_plain_adamw(tmp_path: Path, model: str, precision: str, accumulate: int,
                                             clip: float | None) -> None:
    test_beyond_ram.test_ssd_param_cache_matches_plain_adamw(tmp_path, model, precision, accumulate, clip)


def test_whole_block_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    test_planning.test_whole_block_recompute_replays_from_the_inputs(tmp_path, monkeypatch)


@pytest.mark.parametrize("policy", ["host", "ssd", "recompute"])
def test_each_policy_gives_plain_gradients(tmp_path: Path, policy: str) -> None:
    parts = test_schedule.Parts(tmp_path)
    try:
        assert parts.device.simulated
        test_schedule.test_each_policy_gives_plain_gradients(parts, policy)
    finally:
        parts.close()
