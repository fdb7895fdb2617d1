"""The pure parts of benchmarks/gpu_throughput.py: model sizes, FLOP formulas, the size search, result handling."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2LMHeadModel

from benchmarks import gpu_throughput as bench
from benchmarks.gpu_throughput import (
    ModelShape,
    OutOfTime,
    block_flops,
    checkpoint_recompute_flops,
    largest_layers,
    largest_passing,
    model_flops,
    params_that_fit,
    parse_model,
    proportional,
)
from lightning_ratel.plan.profile import LayerProfile, OpProfile
from lightning_ratel.plan.search import Plan

TINY = ModelShape(layers=2, heads=2, hidden=32, vocab=50, seq=16)


def _tiny_gpt2(attention: str) -> GPT2LMHeadModel:
    config = bench._gpt2_config(TINY)
    config.bos_token_id = config.eos_token_id = 0
    config._attn_implementation = attention
    return GPT2LMHeadModel(config)


def test_params_match_transformers():
    assert TINY.params() == sum(p.numel() for p in _tiny_gpt2("sdpa").parameters())


def test_model_flops_match_the_flop_counter():
    # Eager attention runs scores and weighted sum as plain matmuls over the whole sequence, as the formula counts.
    model = _tiny_gpt2("eager")
    ids = torch.randint(0, TINY.vocab, (3, TINY.seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == model_flops(TINY, 3)


def test_flop_formulas_agree():
    shape = ModelShape(layers=4, heads=8, hidden=1024, vocab=1000, seq=128)
    head = 6 * shape.vocab * shape.hidden * 5 * shape.seq
    assert model_flops(shape, 5) == pytest.approx(shape.layers * block_flops(shape, 5) + head)
    # Checkpointing reruns each block's forward: a third of its forward and backward.
    assert checkpoint_recompute_flops(shape, 5) == pytest.approx(shape.layers * block_flops(shape, 5) / 3)


def test_table_iv_rows_and_family():
    assert parse_model("13B") == ModelShape(40, 40, 5120)
    assert parse_model("175B:2") == ModelShape(2, 96, 12288)
    assert parse_model("20x20x2560", vocab=100, seq=64) == ModelShape(20, 20, 2560, 100, 64)
    for row in ("13B", "175B"):
        layers, heads, hidden = bench.TABLE_IV[row]
        assert proportional(layers) == ModelShape(layers, heads, hidden)
    assert 12.5e9 < parse_model("13B").params() < 13.5e9
    assert 174e9 < parse_model("175B").params() < 176e9
    for bad in ("7B", "2x3x32", "0x1x8", "axbxc"):
        with pytest.raises(ValueError):
            parse_model(bad)


def test_sizing():
    budgets = {"disk": 140e9, "host": 180e9, "device": 40e9}
    assert params_that_fit(budgets, ["ratel"]) == 10_000_000_000
    assert params_that_fit(budgets, ["ratel", "zero-offload"]) == 10_000_000_000
    assert params_that_fit({**budgets, "device": 4e9}, ["ratel", "zero-offload"]) == 1_000_000_000
    assert params_that_fit(budgets, ["zero-infinity"]) == int(140e9 / 18)
    # The disk budget is per swap directory: Ratel stripes over all of them, ZeRO-Infinity's optimizer directory holds
    # all but its 16-bit parameters.
    assert params_that_fit(budgets, ["ratel"], dirs=2) == 20_000_000_000
    assert params_that_fit(budgets, ["zero-infinity"], dirs=2) == int(140e9 / 16)
    assert params_that_fit(budgets, ["zero-infinity"], dirs=3) == int(140e9 / 16)
    # The model starts on the meta device and nothing per parameter is held in host memory: only the disk bounds it.
    assert params_that_fit({**budgets, "host": 1.0}, ["ratel"]) == 10_000_000_000
    layers = largest_layers(proportional, 2_000_000_000)
    assert proportional(layers).params() <= 2e9 < proportional(layers + 1).params()
    assert largest_layers(proportional, 10) == 0


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 8, 37, 64, 100])
def test_largest_passing_finds_the_threshold(threshold):
    tried: list[int] = []

    def trial(n: int) -> bool:
        tried.append(n)
        return n <= threshold

    assert largest_passing(trial) == threshold
    assert len(tried) == len(set(tried))
    assert len(tried) <= 2 * threshold.bit_length() + 1


def test_largest_passing_limits():
    assert largest_passing(lambda n: n <= 100, limit=20) == 20
    assert largest_passing(lambda n: n <= 12, limit=20) == 12
    assert largest_passing(lambda n: False) == 0
    assert largest_passing(lambda n: True, start=3, limit=2) == 2
    assert largest_passing(lambda n: n <= 4, start=3) == 4


def test_plan_recompute_flops():
    ops = [OpProfile("input", 0.0, 0.0, 100), OpProfile("a:mm", 1.0, 10.0, 100, ["input"]),
           OpProfile("b:gelu", 1.0, 3.0, 100, ["a:mm"]), OpProfile("c:mm", 1.0, 20.0, 100, ["b:gelu"])]
    layer = LayerProfile("layers.0", 0, 3.0, 6.0, 0, 0, 0, ops)
    placement = {"layers.0/input": "host", "layers.0/a:mm": "recompute", "layers.0/b:gelu": "recompute",
                 "layers.0/c:mm": "device"}
    plan = Plan(placement, 0.0, 0.0, 0.0, {}, {}, {}, [], 0, layers=[layer])
    assert bench.plan_recompute_flops(plan) == 13.0


def test_throughput_rows_and_ratios():
    shape = ModelShape(2, 2, 64, vocab=100, seq=32)
    block = {"ok": True, "tflops": 100.0}
    ratel = bench.throughput_row(shape, 4, "ratel", {"ok": True, "seconds_per_step": 0.5, "recompute_flops": 1e12},
                                 True, block)
    infinity = bench.throughput_row(shape, 4, "zero-infinity", {"ok": True, "seconds_per_step": 2.0}, True, block)
    offload = bench.throughput_row(shape, 4, "zero-offload", {"ok": False, "oom": True, "error": "x"}, True, block)
    rows = [ratel, infinity, offload]
    bench.add_ratios(rows)
    assert ratel["tokens_per_s"] == 4 * 32 / 0.5
    assert ratel["hardware_tflops"] == pytest.approx((model_flops(shape, 4) + 1e12) / 0.5 / 1e12)
    assert ratel["of_block_peak"] == pytest.approx(ratel["hardware_tflops"] / 100.0)
    assert infinity["hardware_tflops"] == pytest.approx(
        (model_flops(shape, 4) + checkpoint_recompute_flops(shape, 4)) / 2.0 / 1e12)
    assert infinity["ratel_speedup"] == pytest.approx(4.0)
    assert offload["error"] == "OOM" and "ratel_speedup" not in offload
    plain = bench.throughput_row(shape, 4, "zero-offload", {"ok": True, "seconds_per_step": 1.0}, False, None)
    assert plain["hardware_tflops"] == plain["model_tflops"] and "of_block_peak" not in plain
    # Two ranks: a step trains twice the sequences; the figures are the totals, against two GPUs' block peak.
    two = bench.throughput_row(shape, 4, "ratel", {"ok": True, "seconds_per_step": 0.5, "recompute_flops": 1e12,
                                                   "devices": 2}, True, block)
    assert two["devices"] == 2 and two["tokens_per_s"] == 2 * ratel["tokens_per_s"]
    assert two["hardware_tflops"] == pytest.approx(2 * ratel["hardware_tflops"])
    assert two["of_block_peak"] == pytest.approx(ratel["of_block_peak"])


def test_worker_output_parsing():
    line = bench.RESULT_PREFIX + json.dumps({"ok": True, "seconds_per_step": 1.5})
    assert bench.parse_worker_output(0, f"noise\n{line}\nmore noise\n") == {"ok": True, "seconds_per_step": 1.5}
    killed = bench.parse_worker_output(-9, "loading\n")
    assert not killed["ok"] and killed["oom"] and "SIGKILL" in killed["error"]
    crashed = bench.parse_worker_output(1, "Traceback\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    assert not crashed["ok"] and crashed["oom"] and "status 1" in crashed["error"]
    # Ranks of one run each print a result: rank 0's is the run's, unless one failed.
    ranks = [bench.RESULT_PREFIX + json.dumps({"ok": True, "rank": r, "seconds_per_step": 1.0 + r}) for r in (1, 0)]
    assert bench.parse_worker_output(0, "\n".join(ranks))["rank"] == 0
    failed = bench.RESULT_PREFIX + json.dumps({"ok": False, "rank": 1, "error": "x"})
    assert bench.parse_worker_output(1, "\n".join([ranks[1], failed]))["error"] == "x"


def test_worker_reports_failures_as_a_result(monkeypatch, capsys):
    def boom(spec):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setitem(bench.WORKERS, "train", boom)
    bench.worker_main({"kind": "train"})
    result = bench.parse_worker_output(0, capsys.readouterr().out)
    assert result["ok"] is False and result["oom"] is True and "OutOfMemoryError" in result["error"]


def _search_args(tmp_path, systems):
    return argparse.Namespace(systems=systems, search_max_layers=None, out=tmp_path, ssd=[tmp_path])


def test_search_largest_with_a_fake_trainer(tmp_path):
    fits = {"ratel": 11, "zero-infinity": 3, "zero-offload": 0}

    def run(spec):
        assert spec["batch"] == 1 and spec["kind"] == "train"
        return {"ok": spec["shape"]["layers"] <= fits[spec["system"]]}

    report = {"largest": {}}
    budgets = {"disk": 1e12, "host": 1e12, "device": 1e12}
    bench._search_largest(_search_args(tmp_path, list(fits)), TINY, budgets, True, run, {}, report)
    assert {s: e["layers"] for s, e in report["largest"].items()} == fits
    assert report["largest"]["ratel"]["params"] == ModelShape(11, 2, 32, 50, 16).params()
    assert report["largest"]["zero-offload"]["params"] is None
    assert (tmp_path / "gpu_throughput.json").exists()


def test_search_stops_at_what_the_disk_could_hold(tmp_path):
    # Room for the states of 5 layers and a little, not 6 (the search plans for the whole disk, not 70% of it).
    budgets = {"disk": 0.7 * 14 * (ModelShape(5, 2, 32, 50, 16).params() + 100), "host": 1e15, "device": 1e15}
    report = {"largest": {}}
    bench._search_largest(_search_args(tmp_path, ["ratel"]), TINY, budgets, True, lambda spec: {"ok": True}, {},
                          report)
    assert report["largest"]["ratel"]["layers"] == 5
    assert "search limit" in report["largest"]["ratel"]["note"]


def test_search_without_deepspeed_and_out_of_time(tmp_path):
    calls = []

    def run(spec):
        if len(calls) == 3:
            raise OutOfTime
        calls.append(spec["shape"]["layers"])
        return {"ok": True}

    report = {"largest": {}}
    budgets = {"disk": 1e15, "host": 1e15, "device": 1e15}
    with pytest.raises(OutOfTime):
        bench._search_largest(_search_args(tmp_path, ["zero-offload", "ratel"]), TINY, budgets, False, run, {},
                              report)
    assert report["largest"]["zero-offload"]["note"] == "DeepSpeed is not installed"
    ratel = report["largest"]["ratel"]
    assert ratel["layers"] == 4 and "incomplete" in ratel["note"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_main_without_cuda_exits_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--ssd", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "torch.cuda.is_available() is False" in str(info.value.code)
    assert "Nothing was measured" in str(info.value.code)
    assert not (tmp_path / "out").exists()


def test_quick_preset_and_defaults(tmp_path):
    quick = bench.parse_args(["--ssd", str(tmp_path), "--out", str(tmp_path), "--quick"])
    assert quick.models == ["8x8x1024"] and quick.batch_sizes == [8] and quick.max_seconds <= 540
    full = bench.parse_args(["--ssd", str(tmp_path), "--out", str(tmp_path)])
    assert full.models == ["auto"] and full.batch_sizes == [8, 16, 32] and full.seq == 1024
    models, notes = bench.auto_models(["auto", "13B:2"], {"disk": 70e9, "host": 70e9, "device": 12e9},
                                      list(bench.SYSTEMS), 50257, 1024)
    assert models[1] == ModelShape(2, 40, 5120)
    assert models[0].params() <= params_that_fit({"disk": 70e9, "host": 70e9, "device": 12e9}, bench.SYSTEMS)
    assert models[0].heads == models[0].layers and "auto:" in notes[0]


def test_main_runs_every_measurement_and_writes_the_report(tmp_path, monkeypatch, capsys):
    specs = []

    class FakeRunner:
        def __init__(self, ssd, budget):
            self.budget = budget

        def __call__(self, spec):
            specs.append(spec)
            if spec["kind"] == "io":
                return {"ok": True, "kvikio": "not installed"}
            if spec["kind"] == "block":
                return {"ok": True, "tflops": 500.0, "batch_used": spec["batch"], "seconds": 0.1}
            if spec["batch"] == 1:
                return {"ok": spec["shape"]["layers"] <= 6}
            return {"ok": True, "seconds_per_step": 2.0, "recompute_flops": 1e12}

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "machine_info", lambda ssd, cap: {"device_memory_cap": cap})
    monkeypatch.setattr(bench, "_deepspeed_installed", lambda: False)
    monkeypatch.setattr(bench, "Runner", FakeRunner)
    out = tmp_path / "out"
    bench.main(["--ssd", str(tmp_path), "--out", str(out), "--models", "4x4x256", "--batch-sizes", "8", "16",
                "--systems", "ratel", "zero-offload", "--search-max-layers", "20"])
    report = json.loads((out / "gpu_throughput.json").read_text())
    rows = [(r["batch"], r["system"], r.get("error")) for r in report["throughput"]]
    assert rows == [(8, "ratel", None), (8, "zero-offload", "DeepSpeed is not installed"), (16, "ratel", None),
                    (16, "zero-offload", "DeepSpeed is not installed")]
    assert report["throughput"][0]["of_block_peak"] == pytest.approx(report["throughput"][0]["hardware_tflops"] / 500)
    assert report["largest"]["ratel"]["layers"] == 6
    assert report["largest"]["zero-offload"]["note"] == "DeepSpeed is not installed"
    assert all(s["device_memory"] == 24 << 30 for s in specs)
    assert "DeepSpeed is not installed here" in " ".join(report["notes"])
    printed = capsys.readouterr().out
    assert "Throughput" in printed and "Largest model" in printed


def test_runner_starts_a_worker_and_cleans_its_swap_directories(tmp_path):
    # The io worker answers without a GPU (kvikio is unavailable), so this runs the real subprocess path.
    runner = bench.Runner([tmp_path], bench.Budget(300, 300))
    result = runner({"kind": "io"})
    assert result["ok"] is True and isinstance(result["kvikio"], str)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutOfTime):
        bench.Runner([tmp_path], bench.Budget(0, 300))({"kind": "io"})


def test_train_worker_launches_two_ranks_on_the_cpu(tmp_path):
    """The real path of ``--devices 2``, on the CPU: the runner starts the worker, Lightning's launcher starts the
    second rank, both train RatelStrategy data parallel, and rank 0's timing is the run's."""
    shape = ModelShape(layers=2, heads=2, hidden=32, vocab=50, seq=16)
    runner = bench.Runner([tmp_path], bench.Budget(600, 300))
    result = runner({"kind": "train", "system": "ratel", "shape": dataclasses.asdict(shape), "batch": 2, "warmup": 1,
                     "steps": 2, "device_memory": 1 << 30, "ds_checkpointing": False, "devices": 2,
                     "accelerator": "cpu"})
    assert result["ok"], result
    assert result["devices"] == 2 and result["rank"] == 0 and result["timed_steps"] == 2
    assert result["seconds_per_step"] > 0
    row = bench.throughput_row(shape, 2, "ratel", result, False, None)
    assert row["tokens_per_s"] == pytest.approx(2 * 2 * shape.seq / result["seconds_per_step"])
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------- DeepSpeed config


def test_deepspeed_infinity_uses_both_swap_directories(tmp_path):
    shape = parse_model("13B")
    one = bench.deepspeed_config("zero-infinity", shape, ["/a"])["zero_optimization"]
    assert one["offload_optimizer"]["nvme_path"] == one["offload_param"]["nvme_path"] == "/a"
    two = bench.deepspeed_config("zero-infinity", shape, ["/a", "/b"])["zero_optimization"]
    assert two["offload_optimizer"] == {"device": "nvme", "nvme_path": "/a", "pin_memory": True, "buffer_count": 4}
    assert two["offload_param"]["device"] == "nvme" and two["offload_param"]["nvme_path"] == "/b"
    # Each NVMe parameter buffer holds the largest parameter, the embedding here.
    assert two["offload_param"]["buffer_size"] >= shape.vocab * shape.hidden
    assert "only Ratel uses" not in bench.deepspeed_layout_note([tmp_path / "a", tmp_path / "b"])
    note = bench.deepspeed_layout_note([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert f"16-bit parameters in {tmp_path / 'b'}" in note and f"only Ratel uses {tmp_path / 'c'}" in note
    assert "RAID-0" in note


def test_deepspeed_sub_groups_and_aio_are_bounded():
    for shape in (TINY, parse_model("13B"), parse_model("175B")):
        config = bench.deepspeed_config("zero-infinity", shape, ["/a"])
        sub_group = config["zero_optimization"]["sub_group_size"]
        # Lightning's default (1e12) is one sub-group for the whole model, so its pinned swap buffers were model-sized.
        assert sub_group == bench.DS_SUB_GROUP_SIZE <= 100_000_000
        assert config["aio"]["block_size"] == 1 << 20 and 8 <= config["aio"]["queue_depth"] <= 128
    # The largest sub-group (sub_group_size plus the largest parameter) is a small share of a 13B model.
    shape = parse_model("13B")
    assert sub_group + shape.vocab * shape.hidden < shape.params() / 30
    tuned = bench.deepspeed_config("zero-infinity", TINY, ["/a"], {"queue_depth": 64})["aio"]
    assert tuned == {**bench.DS_AIO, "queue_depth": 64}
    offload = bench.deepspeed_config("zero-offload", TINY, ["/a"])["zero_optimization"]
    assert offload["stage"] == 2 and offload["offload_optimizer"]["device"] == "cpu"
    with pytest.raises(ValueError):
        bench.deepspeed_config("ratel", TINY, ["/a"])


def test_ds_aio_option(tmp_path):
    args = bench.parse_args(["--ssd", str(tmp_path), "--out", str(tmp_path), "--ds-aio", '{"queue_depth": 64}'])
    assert args.ds_aio == {"queue_depth": 64}
    assert bench.parse_args(["--ssd", str(tmp_path), "--out", str(tmp_path)]).ds_aio == {}
    tuned = '{"aio": {"single_submit": "false", "overlap_events": "true", "intra_op_parallelism": 8}}'
    assert bench.parse_ds_aio(tuned) == {"single_submit": False, "overlap_events": True, "intra_op_parallelism": 8}
    for bad in ('{"thread_count": 4}', "[1]", "{"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--ssd", str(tmp_path), "--out", str(tmp_path), "--ds-aio", bad])


def test_strategy_hands_deepspeed_the_config(monkeypatch):
    import lightning.pytorch.strategies as strategies

    built = {}

    class FakeDeepSpeed:
        def __init__(self, **kwargs):
            built.update(kwargs)

    monkeypatch.setattr(strategies, "DeepSpeedStrategy", FakeDeepSpeed)
    bench._strategy("zero-infinity", None, TINY, ["/a", "/b"], 1 << 30, {"queue_depth": 16})
    assert built["config"] == bench.deepspeed_config("zero-infinity", TINY, ["/a", "/b"], {"queue_depth": 16})
    assert built["remote_device"] == "nvme"


# ---------------------------------------------------------------------------------------------------- Ratel on meta


def test_a_ratel_run_sets_the_cost_models_phases_against_measured_ones(tmp_path, capsys, monkeypatch):
    """On the CPU, in this process: after its timed steps a RatelStrategy run trains PHASE_STEPS more, synchronised
    at each phase's end, whose forward and backward medians stand beside the plan's predicted phases; the report
    prints them with the ratio."""
    shape = ModelShape(layers=2, heads=2, hidden=32, vocab=50, seq=16)
    result = bench.train_worker({"kind": "train", "system": "ratel", "shape": dataclasses.asdict(shape), "batch": 2,
                                 "warmup": 3, "steps": 2, "device_memory": 1 << 30, "ds_checkpointing": False,
                                 "swap_dirs": [str(tmp_path)], "accelerator": "cpu"})
    assert result["ok"] and result["timed_steps"] == 2
    for key in ("predicted_forward", "predicted_backward", "measured_forward", "measured_backward"):
        assert result[key] > 0, key
    assert result["predicted_forward"] + result["predicted_backward"] == pytest.approx(
        result["predicted_seconds_per_step"])
    assert set(result["bound"]) == {"forward", "backward"}
    row = bench.throughput_row(shape, 2, "ratel", result, False, None)
    # Wide enough that rich prints every column whole.
    monkeypatch.setenv("COLUMNS", "250")
    bench._print_tables({"config": {"seq": shape.seq}, "machine": {"device_memory_cap": 1 << 30},
                         "throughput": [row], "largest": {}, "notes": []})
    printed = capsys.readouterr().out
    assert "cost model against the measured steps" in printed
    assert f"{result['measured_forward'] / result['predicted_forward']:.2f}" in printed


def test_ratel_model_starts_on_meta_and_the_strategy_materializes_it(tmp_path):
    import lightning as L

    shape = ModelShape(layers=2, heads=2, hidden=64, vocab=50, seq=16)
    module = bench._bench_module(shape, 2, 2, deepspeed=False, checkpointing=False)
    assert all(p.is_meta for p in module.parameters())
    strategy = bench._strategy("ratel", module, shape, [str(tmp_path)], 1 << 30)
    initialized = []
    init = strategy.param_init_fn

    def record(m):
        initialized.append(sum(p.numel() for p in module.parameters() if not p.is_meta and p.numel() > 1
                               and any(p.stride())))
        init(m)

    strategy.config.param_init_fn = record
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, precision="bf16-mixed", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    assert trainer.global_step == 2
    # One block at a time: never more than the largest block's parameters in host memory while initializing.
    largest = max(sum(p.numel() for p in b.parameters()) for b in [*module.model.transformer.h,
                                                                      module.model.transformer.wte])
    assert initialized and max(initialized) <= largest
    # GPT-2's initialization (two AdamW steps at lr 1e-5 move no weight by more than 2e-5).
    model = module.model
    assert all(not p.is_meta and torch.isfinite(p).all() for p in model.parameters())
    block = model.transformer.h[0]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.15)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.15)
    assert torch.allclose(block.ln_1.weight, torch.ones_like(block.ln_1.weight), atol=1e-4)
    assert block.attn.c_attn.bias.abs().max().item() < 1e-4
    assert model.lm_head.weight is model.transformer.wte.weight
    assert list(tmp_path.iterdir()) == []
