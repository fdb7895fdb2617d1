"""benchmarks/step_overhead.py runs both strategies on the model sizes it is given and reports their ratio."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import step_overhead


def test_a_host_bound_run_reports_both_strategies_with_equal_losses(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    step_overhead.main(["--hidden-size", "32", "--intermediate-size", "64", "--num-heads", "2", "--num-layers", "2",
                        "--batch-size", "1", "--seq-len", "8", "--threads", "1", "--steps", "3", "--warmup", "1",
                        "--repeats", "1", "--swap-dir", str(tmp_path / "swap"),
                        "--ratel-config", '{"optimizer_states": "device", "activation_policy": "keep"}'])
    out = capsys.readouterr().out
    params = 2048 * 32 * 2 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32
    assert f"Llama {params / 1e6:.2f}M params" in out
    assert "Ratel / plain throughput" in out
    # The last timed step's loss, the same under both strategies (Ratel's numbers are plain Lightning's).
    losses = [line.split("│")[-2].strip() for line in out.splitlines() if line.startswith("│ plain") or
              line.startswith("│ Ratel")]
    assert len(losses) == 2 and losses[0] == losses[1] and losses[0]
