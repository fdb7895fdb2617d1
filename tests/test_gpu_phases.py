"""benchmarks/gpu_phases.py on the CPU: five fits, their per-step phases and the traces it promises."""

from __future__ import annotations

import json

from benchmarks import gpu_phases


def test_phases_and_traces_of_every_fit(tmp_path, capsys):
    out = tmp_path / "phases"
    gpu_phases.main(["--out", str(out), "--size", "1x1x32", "--vocab", "256", "--batch-size", "2", "--steps", "4",
                     "--trace-step", "3", "--swap-dir", str(tmp_path / "swap")])
    results = json.loads((out / "phases.json").read_text())
    assert [r["run"] for r in results] == ["plain", "ratel", "ratel-steady", "ratel-host", "ratel-host-steady"]
    for r in results:
        steps = json.loads((out / r["run"] / "phases.json").read_text())
        assert [s["step"] for s in steps] == [0, 1, 2, 3]
        assert all(0 < s["forward"] < s["wall"] for s in steps)
        assert r["forward_ms"] > 0 and r["step_ms"] > r["forward_ms"]
    for steady in ("plain", "ratel-steady", "ratel-host-steady"):
        assert (out / steady / "trace_step3.json").is_file()
    for profiled in ("ratel", "ratel-host"):
        assert (out / profiled / "ratel_trace_step1.json").is_file()
        assert len(json.loads((out / profiled / "ratel_steps.json").read_text())) == 4
    assert "x plain" in capsys.readouterr().out
