"""benchmarks/peers.py: the table's structure on a tiny model, and a missing system as a row instead of a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import peers

REPO = Path(__file__).resolve().parents[1]


def test_ratel_and_plain_rows(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--systems", "ratel", "plain", "--size", "tiny", "--steps", "2",
         "--warmup", "0", "--rounds", "1", "--seq-len", "32",
         "--ratel-config", '{"activation_policy": "host"}', "--out", str(out), "--swap-dir", str(tmp_path / "swap")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "peers.json").read_text())
    rows = {row["system"]: row for row in report["rows"]}
    assert list(rows) == ["ratel", "plain"]
    for row in rows.values():
        assert row["status"] == "ran", row["status"]
        assert row["seconds_per_step"] > 0 and row["peak_rss"] > 0
        assert len(row["round_medians"]) == 1 and len(row["losses"]) == 3
    assert min(row["vs_fastest"] for row in rows.values()) == 1.0
    assert rows["plain"]["max_loss_diff_vs_plain"] == 0.0
    assert "max_loss_diff_vs_plain" in rows["ratel"]
    table = (out / "peers.md").read_text()
    assert "| system | status |" in table and "max |loss - plain|" in table
    assert "Command: python -m benchmarks.peers" in table and "load average" in table
    assert not (tmp_path / "swap" / "ratel").exists()


def test_system_that_cannot_run_is_a_row() -> None:
    rows = [peers.summarize("zero-offload", [], "not installed: deepspeed"),
            peers.summarize("plain", [{"ok": True, "step_seconds": [0.2, 0.4], "losses": [2.0, 1.0],
                                       "disk_read_per_step": 0.0, "disk_written_per_step": 0.0, "swap_bytes": 0,
                                       "peak_rss": 1 << 30, "torch_threads": 2}], None),
            peers.summarize("fsdp2", [{"ok": False, "status": "out of memory: RSS over the cap", "peak_rss": 5}], None)]
    peers.add_comparisons(rows)
    columns, cells = peers.table_rows(rows)
    assert [cell[1] for cell in cells] == ["not installed: deepspeed", "ran", "out of memory: RSS over the cap"]
    assert all(len(cell) == len(columns) for cell in cells)
    assert rows[1]["vs_fastest"] == 1.0 and abs(rows[1]["seconds_per_step"] - 0.3) < 1e-12


def test_failures_are_classified() -> None:
    assert peers.classify(MemoryError()).startswith("out of memory")
    assert peers.classify(RuntimeError("DefaultCPUAllocator: can't allocate memory")).startswith("out of memory")
    assert peers.classify(peers.NotInstalled("no libaio")) == "not installed: no libaio"
    assert peers.classify(ValueError("bad")) == "failed: ValueError: bad"


def test_several_ratel_configs_give_a_row_each() -> None:
    """One ``--ratel-config`` keeps the plain ``ratel`` row; several give one row each, labelled by the configuration,
    with swap directories and logs of their own; other systems run without one."""
    assert peers.row_entries(["ratel", "plain"], [{"activation_policy": "host"}]) == [
        peers.Entry("ratel", "ratel", {"activation_policy": "host"}, "ratel"),
        peers.Entry("plain", "plain", {}, "plain"),
    ]
    host = {"optimizer_states": "host"}
    assert peers.row_entries(["plain", "ratel"], [{}, host]) == [
        peers.Entry("plain", "plain", {}, "plain"), peers.Entry("ratel {}", "ratel", {}, "ratel-1"),
        peers.Entry('ratel {"optimizer_states": "host"}', "ratel", host, "ratel-2")]
