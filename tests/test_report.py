"""Tests of the plan table and the PNG report (lightning_ratel.report)."""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from lightning_ratel.plan import HardwareProfile, LayerProfile, OpProfile, Plan, search
from lightning_ratel.report import curve_axis, plan_table, write_report

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _plan(device_type: str = "cuda") -> Plan:
    hw = HardwareProfile(device_type=device_type, h2d_bandwidth=1e8, d2h_bandwidth=1e8, ssd_read_bandwidth=1e8,
                         ssd_write_bandwidth=1e8, adam_params_per_s=1e9, host_memory_free=1 << 40,
                         device_memory_free=1 << 40)
    layers = []
    for i in range(3):
        ops = [OpProfile("input", 0.0, 0.0, 1 << 20)]
        for k, seconds in enumerate([8e-3, 4e-3, 1e-3]):
            ops.append(OpProfile(f"mlp.op{k}:mm", seconds, 1e9, 1 << 20, [ops[-1].name]))
        layers.append(LayerProfile(f"model.layers.{i}", i, 0.013, 0.026, 1 << 20, 1 << 20, 1 << 10, ops))
    # Device room for paging and one block's backward only (8 MiB): the rest is swapped or recomputed.
    return search(hw, layers, device_budget=8 << 20, host_budget=1 << 40, store_budget=1 << 40)


def _steps(n: int) -> list[dict[str, float]]:
    return [{"step": s, "wall": 0.2, "compute": 0.12, "h2d": 0.05, "d2h": 0.04, "ssd": 0.08, "cpu_optimizer": 0.03,
             "idle": 0.02} for s in range(n)]


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("n_steps", [0, 3, 45])
def test_write_report_writes_a_png(tmp_path, n_steps):
    path = tmp_path / "out" / "report.png"
    write_report(path, _plan(), _steps(n_steps))
    _assert_png(path)


def test_write_report_with_a_single_point_curve(tmp_path):
    plan = _plan("cpu")
    plan.curve, plan.chosen = plan.curve[:1], 0
    write_report(tmp_path / "one.png", plan, [])
    _assert_png(tmp_path / "one.png")


def test_plan_table_renders_blocks_and_bounds():
    plan = _plan()
    console = Console(record=True, width=160)
    console.print(plan_table(plan))
    text = console.export_text()
    assert "of model.layers.*" in text
    assert "total" in text and "iteration" in text and "bound:" in text


def test_plan_table_strips_the_common_prefix_and_fits_80_columns():
    """Long module paths (peft's) must not cut every row to the same text."""
    plan = _plan()
    prefix = "model.base_model.model.model.layers."
    plan.layers = [dataclasses.replace(layer, name=prefix + layer.name.rpartition(".")[2]) for layer in plan.layers]
    plan.layers.append(dataclasses.replace(plan.layers[0], name="model.base_model.model.lm_head", index=3))
    plan.activation_placement = {prefix + key.removeprefix("model.layers."): tier
                                 for key, tier in plan.activation_placement.items()}
    console = Console(record=True, width=80)
    console.print(plan_table(plan))
    text = console.export_text()
    assert "of model.base_model.model.*" in text
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert rows == ["model.layers.0", "model.layers.1", "model.layers.2", "lm_head", "total"]
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_report_curve_axis_by_search_order_when_nothing_is_offloaded():
    plan = _plan("cpu")
    plan.curve = [(0, 0.02 - 0.001 * n) for n in range(5)]
    plan.chosen = 4
    xs, title, xlabel, where = curve_axis(plan)
    assert xs == [0, 1, 2, 3, 4] and "search point" in xlabel and where == "point 4"
    xs, _, xlabel, _ = curve_axis(_plan())
    assert len(set(xs)) > 1 and "offloaded" in xlabel
