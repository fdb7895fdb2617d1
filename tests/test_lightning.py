"""RatelStrategy inside Lightning: registry, CLI, precision translation, checkpoints and resume, the non-fit entry
points, logging, schedulers, skipped steps and configuration errors.

Every numeric check compares against the same LightningModule trained by plain Lightning (strategy "auto"), or
against an uninterrupted RatelStrategy run. Models are tiny and runs are a few steps, so the file stays fast on CPU.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import math
import os
import sys
import unittest.mock
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import lightning_ratel
from lightning_ratel import RatelConfigError, RatelModelError, RatelPrecision, RatelStrategy
from tests.models import LM, final_state, max_rel_err, trainer

# ---------------------------------------------------------------------------------------------------- helpers


def swap(tmp_path: Path, name: str = "swap") -> Path:
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    return directory


def ratel(directory: Path, **kwargs: Any) -> RatelStrategy:
    return RatelStrategy(ssd_paths=[str(directory)], **kwargs)


def ckpt_trainer(strategy: Any, dirpath: Path, max_steps: int, **kwargs: Any) -> L.Trainer:
    callback = ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=2, save_top_k=-1)
    return trainer(strategy, max_steps=max_steps, enable_checkpointing=True, callbacks=[callback], **kwargs)


def step_ckpt(dirpath: Path, step: int) -> Path:
    found = sorted(dirpath.glob(f"*step={step}.ckpt"))
    assert len(found) == 1, f"no single step-{step} checkpoint in {sorted(os.listdir(dirpath))}"
    return found[0]


def assert_opt_state_close(a: dict[str, Any], b: dict[str, Any], tol: float) -> None:
    """Two ``torch.optim.AdamW`` state dicts hold the same moments and step counts for every parameter."""
    assert set(a["state"]) == set(b["state"]), (sorted(a["state"]), sorted(b["state"]))
    assert a["state"], "no optimizer state at all"
    for index in a["state"]:
        sa, sb = a["state"][index], b["state"][index]
        assert float(sa["step"]) == float(sb["step"]), (index, sa["step"], sb["step"])
        moments = {k: sa[k] for k in ("exp_avg", "exp_avg_sq")}
        other = {k: sb[k] for k in ("exp_avg", "exp_avg_sq")}
        err = max_rel_err(moments, other)
        assert err <= tol, f"optimizer state of parameter {index} differs: rel err {err}"
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert math.isclose(ga["lr"], gb["lr"], rel_tol=1e-9), (ga["lr"], gb["lr"])


def assert_ordinary_params(module: torch.nn.Module) -> None:
    """After teardown: real tensors of the original dtype, finite, each with its own memory, not paged placeholders."""
    params = list(module.parameters())
    ptrs = set()
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32, (name, p.dtype)
        assert p.device.type == "cpu", (name, p.device)
        assert torch.isfinite(p).all(), f"{name} is not finite after teardown"
        if p.numel() > 1:
            assert all(s != 0 for s in p.stride()), f"{name} is an expanded placeholder (stride {p.stride()})"
        ptrs.add(p.data_ptr())
    assert len(ptrs) == len(params), "parameters share memory after teardown"
    state = module.state_dict()
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def without_key_bias(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's attention key bias zeroed out.

    Softmax is invariant to it, so its gradient is rounding noise that Adam scales up to about lr * noise / eps:
    plain Lightning on 1 versus 2 CPU threads differs there by 1e-3 relative. Every other weight is well determined.
    """
    out = dict(params)
    for name, value in params.items():
        if name.endswith("attn.c_attn.bias"):
            third = value.numel() // 3
            value = value.clone()
            value[third : 2 * third] = 0
            out[name] = value
    return out


@functools.lru_cache(maxsize=None)
def plain_run(model: str = "llama", steps: int = 4, n_batches: int = 2, **kwargs: Any) -> tuple[dict, dict]:
    """Final params and optimizer state of plain Lightning training (cached: several tests compare against it)."""
    lm = LM(model, n_batches=n_batches)
    t = trainer("auto", max_steps=steps, **kwargs)
    t.fit(lm)
    return final_state(lm, t)


class CountingLM(LM):
    training_steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        type(self).training_steps += 1
        return super().training_step(batch, batch_idx)


# ---------------------------------------------------------------------------------------------------- registry, CLI


def test_registry_name_trains_with_default_swap_dir(tmp_path: Path) -> None:
    assert lightning_ratel.RatelStrategy.strategy_name in StrategyRegistry
    default = tmp_path / "ratel_swap"
    seen: dict[str, Any] = {}

    class Spy(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            engine = trainer.strategy.engine
            assert engine is not None
            seen["paths"] = [str(p) for p in engine.store.paths]
            seen["files"] = sorted(os.listdir(default))

    lm = LM(n_batches=2)
    t = trainer("ratel", max_steps=2, default_root_dir=str(tmp_path), callbacks=[Spy()])
    assert isinstance(t.strategy, RatelStrategy)
    assert t.strategy.ssd_paths is None
    t.fit(lm)
    assert t.global_step == 2
    assert seen["paths"] == [str(default.resolve())]
    assert "ratel.swap" in seen["files"]
    params, opt = final_state(lm, t)
    ref_params, ref_opt = plain_run(steps=2)
    assert max_rel_err(ref_params, params) <= 1e-5
    assert_opt_state_close(ref_opt, opt, 1e-5)
    assert not default.exists(), "the swap directory the run created is left behind"


def test_lightning_cli_yaml_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["cli"])
    ssd = swap(tmp_path)
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 2,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "default_root_dir": str(tmp_path / "root"),
            "strategy": {
                "class_path": "lightning_ratel.RatelStrategy",
                "init_args": {"ssd_paths": [str(ssd)], "prefetch_depth": 2, "activation_policy": "ssd"},
            },
        },
        "model": {"model": "llama", "n_batches": 2},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(LM, run=False, args=["--config", str(path)], save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RatelStrategy)
    assert strategy.ssd_paths == [str(ssd)]
    assert strategy.prefetch_depth == 2
    assert strategy.activation_policy == "ssd"
    seen: dict[str, Any] = {}

    class Spy(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            engine = trainer.strategy.engine
            seen["depth"] = engine.config.prefetch_depth
            seen["policies"] = set(engine.cache.placements)
            seen["ssd_bytes"] = engine.cache.ssd_bytes

    cli.trainer.callbacks.append(Spy())
    cli.trainer.fit(cli.model)
    assert cli.trainer.global_step == 2
    # The settings reached the engine: activations of the repeated blocks really went to the swap directory.
    assert seen["depth"] == 2
    assert seen["policies"] == {"ssd"}
    assert seen["ssd_bytes"] > 0
    params, _ = final_state(cli.model, cli.trainer)
    ref_params, _ = plain_run(steps=2)
    assert max_rel_err(ref_params, params) <= 1e-5
    assert os.listdir(ssd) == []


def test_lightning_cli_keeps_plan_file_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan file given to LightningCLI is read by the strategy, not parsed into the config (nor saved in it)."""
    monkeypatch.setattr(sys, "argv", ["cli"])
    plan_file = tmp_path / "ratel_plan.json"
    lightning_ratel.Plan({"model.layers.0/mm": "host"}, 1.0, 0.5, 0.5, {}, {}, {}, [(0, 1.0)], 0).save(plan_file)
    config = {
        "trainer": {
            "accelerator": "cpu",
            "logger": False,
            "strategy": {"class_path": "lightning_ratel.RatelStrategy", "init_args": {"plan": str(plan_file)}},
        },
        "model": {"model": "llama", "n_batches": 2},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(LM, run=False, args=["--config", str(path)])
    assert cli.config.trainer.strategy.init_args.plan == str(plan_file)
    saved = cli.parser.dump(cli.config)
    assert "activation_placement" not in saved and str(plan_file) in saved
    plan = cli.trainer.strategy.plan
    assert isinstance(plan, lightning_ratel.Plan) and plan.activation_placement == {"model.layers.0/mm": "host"}


# ---------------------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_precision_translated(tmp_path: Path, precision: str) -> None:
    t = trainer(ratel(swap(tmp_path)), precision=precision)
    plugin = t.strategy.precision_plugin
    assert isinstance(plugin, RatelPrecision)
    assert plugin.precision == precision
    assert plugin.half_dtype == (torch.bfloat16 if precision == "bf16-mixed" else None)


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_unsupported_precision_rejected_at_construction(tmp_path: Path, precision: str) -> None:
    with pytest.raises(RatelConfigError) as info:
        trainer(ratel(swap(tmp_path)), precision=precision)
    assert isinstance(info.value, ValueError)
    assert "32-true" in str(info.value) and "bf16-mixed" in str(info.value)


# ---------------------------------------------------------------------------------------------------- resume


RESUME_CASES = {
    "llama-32": ("llama", 2, {}),
    "llama-bf16-ssd": ("llama", 2, {"precision": "bf16-mixed", "activation_policy": "ssd"}),
    # 4 batches per epoch = 2 optimizer steps, so the step-2 checkpoint falls on an epoch boundary.
    "gpt2-accum-clip": ("gpt2", 4, {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0}),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_equals_uninterrupted(tmp_path: Path, case: str) -> None:
    model, n_batches, extra = RESUME_CASES[case]
    extra = dict(extra)
    policy = extra.pop("activation_policy", "host")

    def ratel(directory: Path) -> RatelStrategy:
        return RatelStrategy(ssd_paths=[str(directory)], activation_policy=policy)

    straight_dir = tmp_path / "straight"
    lm = LM(model, n_batches=n_batches)
    t = ckpt_trainer(ratel(swap(tmp_path, "s1")), straight_dir, 4, **extra)
    t.fit(lm)
    straight_params, straight_opt = final_state(lm, t)

    first_dir = tmp_path / "first"
    lm = LM(model, n_batches=n_batches)
    t = ckpt_trainer(ratel(swap(tmp_path, "s2")), first_dir, 2, **extra)
    t.fit(lm)
    assert t.global_step == 2

    lm = LM(model, n_batches=n_batches)
    t = trainer(ratel(swap(tmp_path, "s3")), max_steps=4, **extra)
    t.fit(lm, ckpt_path=str(step_ckpt(first_dir, 2)))
    assert t.global_step == 4
    resumed_params, resumed_opt = final_state(lm, t)

    assert max_rel_err(straight_params, resumed_params) <= 1e-6
    assert_opt_state_close(straight_opt, resumed_opt, 1e-6)

    # The two step-2 checkpoints agree, and the final checkpoint holds what the module holds after teardown.
    a = torch.load(step_ckpt(straight_dir, 2), weights_only=False)
    b = torch.load(step_ckpt(first_dir, 2), weights_only=False)
    assert max_rel_err(a["state_dict"], b["state_dict"]) <= 1e-6
    assert_opt_state_close(a["optimizer_states"][0], b["optimizer_states"][0], 1e-6)
    last = torch.load(step_ckpt(straight_dir, 4), weights_only=False)
    assert max_rel_err(last["state_dict"], straight_params) <= 1e-6
    assert_opt_state_close(last["optimizer_states"][0], straight_opt, 1e-6)

    # And all of it is what plain Lightning computes.
    ref_params, ref_opt = plain_run(model, 4, n_batches, **extra)
    assert max_rel_err(without_key_bias(ref_params), without_key_bias(straight_params)) <= 1e-5
    assert_opt_state_close(ref_opt, straight_opt, 1e-5)


# ---------------------------------------------------------------------------------------------------- checkpoint format



def test_zero_grad_reaches_the_optimizers_own(tmp_path: Path) -> None:
    """The zero_grad RatelStrategy puts on the optimizer still calls the optimizer class's own, once per call: code
    that counts or extends it (Lightning's tests patch it) sees what plain Lightning gives it."""
    counts = {}
    for name in ("auto", "ratel"):
        with unittest.mock.patch("torch.optim.AdamW.zero_grad") as zero_grad:
            trainer(ratel(swap(tmp_path)) if name == "ratel" else "auto", max_steps=-1, max_epochs=1,
                    accumulate_grad_batches=2).fit(LM(n_batches=6))
        counts[name] = zero_grad.call_count
    assert counts["ratel"] == counts["auto"] == 3



def test_resume_from_a_checkpoint_without_optimizer_state(tmp_path: Path) -> None:
    """A checkpoint without optimizer states (written for the weights alone) resumes as under plain Lightning: the
    optimizer starts afresh from the checkpoint's weights, with a warning."""
    ckpt_trainer(ratel(swap(tmp_path)), tmp_path / "ckpt", max_steps=2).fit(LM())
    saved = torch.load(step_ckpt(tmp_path / "ckpt", 2), weights_only=False)
    saved["optimizer_states"] = []
    stripped = tmp_path / "stripped.ckpt"
    torch.save(saved, stripped)
    outcome = {}
    for name in ("auto", "ratel"):
        lm = LM()
        t = trainer(ratel(swap(tmp_path)) if name == "ratel" else "auto", max_steps=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(lm, ckpt_path=str(stripped))
        outcome[name] = final_state(lm, t), [str(w.message) for w in caught]
    (ref, _), (got, said) = outcome["auto"], outcome["ratel"]
    assert any("no optimizer state" in message for message in said)
    assert {float(s["step"]) for s in got[1]["state"].values()} == {2.0}
    assert max_rel_err(ref[0], got[0]) <= 1e-5
    assert_opt_state_close(ref[1], got[1], 1e-5)


class DirectLayerLM(L.LightningModule):
    """A training_step that calls its layer itself (as many of Lightning's own tests do): the layer's parameters are
    used outside the root's forward, so the first pass makes the layer a block of its own, after the run started."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), batch_size=2)


def test_resume_with_a_plan_made_after_a_block_formed(tmp_path: Path) -> None:
    """The checkpoint's plan names the block the first pass formed, which the resumed run does not have yet: it
    profiles again instead of refusing the plan, and ends where the uninterrupted run does."""
    ckpt_dir = tmp_path / "ckpt"
    first = DirectLayerLM()
    ckpt_trainer(ratel(swap(tmp_path)), ckpt_dir, max_steps=4).fit(first)
    ckpt = step_ckpt(ckpt_dir, 4)
    saved = torch.load(ckpt, weights_only=False)
    plan = next(state["plan"] for key, state in saved["callbacks"].items() if "RatelProfiler" in key)
    assert set(json.loads(plan)["blocks"]) == {"", "layer"}
    resumed = DirectLayerLM()
    t = trainer(ratel(swap(tmp_path)), max_steps=6)
    t.fit(resumed, ckpt_path=str(ckpt))
    uninterrupted = DirectLayerLM()
    trainer(ratel(swap(tmp_path)), max_steps=6).fit(uninterrupted)
    assert t.global_step == 6
    for name, value in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_checkpoint_loadable_without_plugin(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    lm = LM(n_batches=2)
    t = ckpt_trainer(ratel(swap(tmp_path)), ckpt_dir, 2, precision="bf16-mixed")
    t.fit(lm)
    ckpt = torch.load(step_ckpt(ckpt_dir, 2), weights_only=False)
    # bf16 compute copies, fp32 masters: after teardown the module holds the fp32 masters the checkpoint holds.
    assert_ordinary_params(lm)
    assert max_rel_err(ckpt["state_dict"], lm.state_dict()) == 0.0

    plain = LM()
    expected = plain.state_dict()
    state = ckpt["state_dict"]
    assert set(state) == set(expected)
    for key, value in state.items():
        assert isinstance(value, torch.Tensor) and value.dtype == torch.float32, (key, type(value))
        assert value.shape == expected[key].shape, key
        assert torch.isfinite(value).all(), key
    # The checkpoint holds trained weights, not the initial ones.
    assert max_rel_err(expected, state) > 1e-4

    plain.load_state_dict(state)
    opt = plain.configure_optimizers()["optimizer"]
    opt.load_state_dict(ckpt["optimizer_states"][0])
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt.state) == len(params)
    for p in params:
        entry = opt.state[p]
        assert float(entry["step"]) == 2.0
        assert entry["exp_avg"].shape == p.shape and entry["exp_avg_sq"].shape == p.shape
        assert entry["exp_avg_sq"].min() >= 0
    assert ckpt["global_step"] == 2
    assert ckpt["lr_schedulers"], "scheduler state missing"


def test_plain_and_ratel_checkpoints_are_interchangeable(tmp_path: Path) -> None:
    # Plain, uninterrupted, with a step-2 checkpoint.
    plain_dir = tmp_path / "plain"
    lm = LM(n_batches=2)
    t = ckpt_trainer("auto", plain_dir, 4)
    t.fit(lm)
    ref_params, ref_opt = final_state(lm, t)

    # Ratel 2 steps -> plain resumes to 4.
    ratel_dir = tmp_path / "ratel"
    lm = LM(n_batches=2)
    ckpt_trainer(ratel(swap(tmp_path, "s1")), ratel_dir, 2).fit(lm)
    lm = LM(n_batches=2)
    t = trainer("auto", max_steps=4)
    t.fit(lm, ckpt_path=str(step_ckpt(ratel_dir, 2)))
    params, opt = final_state(lm, t)
    assert max_rel_err(ref_params, params) <= 1e-5
    assert_opt_state_close(ref_opt, opt, 1e-5)

    # Plain 2 steps -> Ratel resumes to 4.
    lm = LM(n_batches=2)
    t = trainer(ratel(swap(tmp_path, "s2")), max_steps=4)
    t.fit(lm, ckpt_path=str(step_ckpt(plain_dir, 2)))
    params, opt = final_state(lm, t)
    assert max_rel_err(ref_params, params) <= 1e-5
    assert_opt_state_close(ref_opt, opt, 1e-5)


# ---------------------------------------------------------------------------------------------------- entry points


EVAL_LIMITS = dict(limit_val_batches=3, limit_test_batches=3, limit_predict_batches=3)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_validate_test_predict_standalone(tmp_path: Path, precision: str) -> None:
    ssd = swap(tmp_path)
    initial = LM().state_dict()
    results: dict[str, Any] = {}
    for name in ("auto", "ratel"):
        out: dict[str, Any] = {}
        for fn in ("validate", "test", "predict"):
            lm = LM()
            strategy = ratel(ssd, activation_policy="ssd") if name == "ratel" else "auto"
            t = trainer(strategy, precision=precision, **EVAL_LIMITS)
            out[fn] = getattr(t, fn)(lm)
            if name == "ratel":
                assert_ordinary_params(lm)
                assert max_rel_err(initial, lm.state_dict()) == 0.0, f"{fn} changed the parameters"
                assert os.listdir(ssd) == []
        results[name] = out
    tol = 1e-6
    for fn, key in (("validate", "val_loss"), ("test", "test_loss")):
        a, b = results["auto"][fn][0][key], results["ratel"][fn][0][key]
        assert math.isclose(a, b, rel_tol=tol), (fn, a, b)
    a, b = results["auto"]["predict"], results["ratel"]["predict"]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert math.isclose(float(x), float(y), rel_tol=tol), (float(x), float(y))


def test_fit_twice_then_validate(tmp_path: Path) -> None:
    ssd = swap(tmp_path)
    outcome: dict[str, Any] = {}
    for name in ("auto", "ratel"):
        lm = LM(n_batches=2)
        t = trainer(ratel(ssd) if name == "ratel" else "auto", max_steps=2, limit_val_batches=2)
        t.fit(lm)
        after_first = {k: v.clone() for k, v in lm.state_dict().items()}
        if name == "ratel":
            assert_ordinary_params(lm)
            assert os.listdir(ssd) == []
        if name == "ratel":
            # A fresh Adam's first step moves every weight by about +-lr whatever its gradient's size, so a weight
            # whose gradient is near eps turns a 1e-6 difference in the start point into a 1e-4 one; plain
            # Lightning does the same. Both second fits therefore start from plain Lightning's first result (this
            # also checks that a fit picks up weights loaded into the module between fits).
            lm.load_state_dict(outcome["auto"][0])
        t.fit_loop.epoch_loop.max_steps = 4
        t.fit(lm)
        assert t.global_step == 4
        if name == "ratel":
            assert_ordinary_params(lm)
            assert os.listdir(ssd) == []
        metrics = t.validate(lm, verbose=False)[0]
        outcome[name] = (after_first, final_state(lm, t), metrics)
    assert max_rel_err(outcome["auto"][0], outcome["ratel"][0]) <= 1e-5
    assert max_rel_err(outcome["auto"][1][0], outcome["ratel"][1][0]) <= 1e-5
    assert_opt_state_close(outcome["auto"][1][1], outcome["ratel"][1][1], 1e-5)
    a, b = outcome["auto"][2]["val_loss"], outcome["ratel"][2]["val_loss"]
    assert math.isclose(a, b, rel_tol=1e-5), (a, b)


def test_validation_during_fit_matches_plain(tmp_path: Path) -> None:
    ssd = swap(tmp_path)
    losses = {}
    for name in ("auto", "ratel"):
        lm = LM(n_batches=2)
        # Validate after every optimizer step: validation reads params while updates may be in flight.
        t = trainer(ratel(ssd, activation_policy="ssd") if name == "ratel" else "auto", max_steps=3,
                    limit_val_batches=2, val_check_interval=1, check_val_every_n_epoch=None)
        t.fit(lm)
        losses[name] = float(t.callback_metrics["val_loss"])
        if name == "ratel":
            assert_ordinary_params(lm)
    assert math.isclose(losses["auto"], losses["ratel"], rel_tol=1e-5), losses


def test_swap_files_kept_when_asked(tmp_path: Path) -> None:
    ssd = swap(tmp_path)
    lm = LM(n_batches=2)
    t = trainer(ratel(ssd, keep_swap_files=True), max_steps=2)
    t.fit(lm)
    files = sorted(os.listdir(ssd))
    assert "ratel.swap" in files
    assert not any(f.endswith(".lock") for f in files), files
    assert (ssd / "ratel.swap").stat().st_size > 0
    assert (ssd / "ratel.swap").stat().st_mode & 0o077 == 0, "swap file readable by others"
    assert_ordinary_params(lm)


# ---------------------------------------------------------------------------------------------------- logging, schedulers


def read_csv(path: str) -> list[dict[str, str]]:
    with open(os.path.join(path, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def test_train_loss_logged(tmp_path: Path) -> None:
    series = {}
    for name in ("auto", "ratel"):
        lm = LM(n_batches=2)
        logger = CSVLogger(str(tmp_path / "logs"), name=name)
        t = trainer(ratel(swap(tmp_path)) if name == "ratel" else "auto", logger=logger, log_every_n_steps=1)
        t.fit(lm)
        assert "train_loss" in t.callback_metrics
        rows = [r for r in read_csv(logger.log_dir) if r.get("train_loss")]
        assert len(rows) == 4, rows
        values = [float(r["train_loss"]) for r in rows]
        assert math.isclose(values[-1], float(t.callback_metrics["train_loss"]), rel_tol=1e-6)
        series[name] = values
    for a, b in zip(series["auto"], series["ratel"]):
        assert math.isclose(a, b, rel_tol=1e-5), series


def test_step_figures_logged(tmp_path: Path) -> None:
    """The plugin's figures reach the logger once per optimizer step (micro-batches of a window summed), under
    ``ratel/`` keys, at the steps of the user's own metrics; ``log_metrics=False`` sends none."""
    logger = CSVLogger(str(tmp_path / "logs"))
    t = trainer(ratel(swap(tmp_path), activation_policy="ssd"), logger=logger, log_every_n_steps=1, max_steps=3,
                accumulate_grad_batches=2)
    t.fit(LM(n_batches=6))
    rows = read_csv(logger.log_dir)
    figures = [r for r in rows if r.get("ratel/step_seconds")]
    assert [int(r["step"]) for r in figures] == [0, 1, 2]
    user_steps = {int(r["step"]) for r in rows if r.get("train_loss")}
    assert user_steps == {0, 1, 2}
    for row in figures:
        for part in ("step", "compute", "wait", "optimizer", "disk", "h2d", "d2h"):
            assert float(row[f"ratel/{part}_seconds"]) >= 0.0, part
        assert float(row["ratel/step_seconds"]) > 0.0
        # Activations go to the swap files and come back in every micro-batch.
        assert float(row["ratel/disk_read_bytes"]) > 0 and float(row["ratel/disk_write_bytes"]) > 0
        assert float(row["ratel/disk_gbps"]) > 0
        assert 0.0 <= float(row["ratel/overlap"]) <= 1.0
        assert float(row["ratel/disk_bytes"]) > 0 and float(row["ratel/host_bytes"]) > 0
    # A fixed placement: no step ran to be profiled.
    assert all(float(r["ratel/profiling"]) == 0.0 for r in figures)

    quiet = CSVLogger(str(tmp_path / "quiet"))
    t = trainer(ratel(swap(tmp_path, "swap2"), log_metrics=False), logger=quiet, log_every_n_steps=1, max_steps=2)
    t.fit(LM(n_batches=2))
    assert not [k for r in read_csv(quiet.log_dir) for k in r if k.startswith("ratel/")]


def test_long_passes_leave_a_lasting_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The start line says where the swap files are; loading, checkpointing, exporting and the copy back each end
    with a logged line (progress bars are transient)."""
    ssd = swap(tmp_path)
    callbacks = [ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2),
                 lightning_ratel.RatelHFExport(str(tmp_path / "hf"))]
    with caplog.at_level(logging.INFO):
        t = trainer(ratel(ssd, checkpoint_format="sharded"), max_steps=2, enable_checkpointing=True,
                    callbacks=callbacks)
        t.fit(LM(n_batches=2))
        t = trainer(ratel(ssd), max_steps=3)
        t.fit(LM(n_batches=2), ckpt_path=callbacks[0].best_model_path)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RatelStrategy: ")]
    text = "\n".join(lines)
    assert f"swap files in {ssd}" in text and "free)" in text
    assert f"sharded checkpoint written to {callbacks[0].best_model_path}: " in text
    assert f"exported 30 tensors to {tmp_path / 'hf' / 'final'}: " in text
    assert "loaded epoch=0-step=2.ckpt: 30 tensors, " in text
    assert sum("copied 30 parameter tensors and the optimizer state back into the module: " in line
               for line in lines) == 2
    assert all(" s (" in line for line in lines if "written" in line or "copied" in line or "loaded" in line)


def test_trace_shows_page_ins_and_gradient_offload(tmp_path: Path) -> None:
    """A Chrome trace of a step has spans for the training thread's own plugin work."""
    profiler = lightning_ratel.RatelProfiler(trace_step=1, output_dir=str(tmp_path / "trace"))
    t = trainer(ratel(swap(tmp_path), param_cache="ssd"), max_steps=2, callbacks=[profiler])
    t.fit(LM(n_batches=2))
    events = json.loads((tmp_path / "trace" / "ratel_trace_step1.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"ratel/page_in", "ratel/grad_offload"} <= names


def test_lr_scheduler_and_monitor(tmp_path: Path) -> None:
    lm = LM(n_batches=2)
    logger = CSVLogger(str(tmp_path / "logs"), name="ratel")
    t = trainer(ratel(swap(tmp_path)), logger=logger, log_every_n_steps=1,
                callbacks=[LearningRateMonitor(logging_interval="step")])
    t.fit(lm)
    rows = read_csv(logger.log_dir)
    columns = [c for c in rows[0] if c.startswith("lr-")]
    assert columns, list(rows[0])
    for column in columns:
        lrs = [float(r[column]) for r in rows if r.get(column)]
        assert len(lrs) == 4, (column, lrs)
        assert all(b < a for a, b in zip(lrs, lrs[1:])), (column, lrs)
        for k, lr in enumerate(lrs):
            assert math.isclose(lr, 1e-2 * 0.7**k, rel_tol=1e-9), (column, lrs)
    params, opt = final_state(lm, t)
    ref_params, ref_opt = plain_run()
    assert max_rel_err(ref_params, params) <= 1e-5
    assert_opt_state_close(ref_opt, opt, 1e-5)


def test_scheduler_does_not_warn_about_step_order(tmp_path: Path) -> None:
    """Plain Lightning steps the optimizer before the scheduler, so torch stays quiet; the engine's step must count
    as the optimizer's step too, or every user sees a false warning that the schedule skips its first value."""
    lm = LM(n_batches=2)
    t = trainer(ratel(swap(tmp_path)), max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(lm)
    order = [str(w.message) for w in caught if "before `optimizer.step()`" in str(w.message)]
    assert not order, order[0]
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.7**2, rel=1e-9)


class SkipLM(LM):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


class SkippingOptimizerStepLM(LM):
    """An ``optimizer_step`` that runs the closure every batch but steps only on even ones (Lightning's docs show such
    overrides): the odd batches' gradients are dropped by the next closure's ``zero_grad``, not added to a step."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        if batch_idx % 2 == 0:
            optimizer.step()


@pytest.mark.parametrize("module, n_batches", [(SkipLM, 4), (SkippingOptimizerStepLM, 5)],
                         ids=["training_step_returning_none", "optimizer_step_override"])
def test_skipped_steps_match_plain(tmp_path: Path, module: type[LM], n_batches: int) -> None:
    """A batch whose step is skipped (``training_step`` returning ``None``, an ``optimizer_step`` that does not call
    ``optimizer.step()``) trains as under plain Lightning: 3 steps taken, the same parameters and moments."""
    outcome = {}
    for name in ("auto", "ratel"):
        lm = module(n_batches=n_batches)
        t = trainer(ratel(swap(tmp_path)) if name == "ratel" else "auto", max_steps=-1, max_epochs=1)
        t.fit(lm)
        outcome[name] = final_state(lm, t)
    ref_params, ref_opt = outcome["auto"]
    params, opt = outcome["ratel"]
    assert {float(s["step"]) for s in ref_opt["state"].values()} == {3.0}
    assert max_rel_err(ref_params, params) <= 1e-5
    assert_opt_state_close(ref_opt, opt, 1e-5)


# ------------------------------------------------------------------------------------------------ manual optimization


class ManualBackwardLM(LM):
    """Manual optimization stepping every batch, its backward run as ``how`` says: ``self.manual_backward(loss)`` (as
    Lightning asks), ``loss.backward()`` (as plain PyTorch code does) or ``torch.autograd.backward(loss)``."""

    def __init__(self, how: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.how = how

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.model(input_ids=batch, labels=batch).loss
        if self.how == "manual_backward":
            self.manual_backward(loss)
        elif self.how == "loss.backward":
            loss.backward()
        else:
            torch.autograd.backward(loss)
        opt.step()
        return loss

    def configure_optimizers(self) -> Any:
        return super().configure_optimizers()["optimizer"]


@pytest.mark.parametrize("param_cache", ["host", "ssd"])
def test_manual_loss_backward_trains_like_plain(tmp_path: Path, param_cache: str) -> None:
    """``loss.backward()`` in a manual ``training_step`` is the engine's backward pass as ``self.manual_backward(loss)``
    is: the numbers of plain Lightning. (Unseen, it left the blocks it paged in resident: later forwards computed with
    compute copies paged in before the updates, or raced the optimizer rewriting them.)"""
    outcome = {}
    for name in ("auto", "ratel"):
        lm = ManualBackwardLM("loss.backward", n_batches=6)
        strategy = ratel(swap(tmp_path), param_cache=param_cache) if name == "ratel" else "auto"
        t = trainer(strategy, max_steps=-1, max_epochs=1)
        t.fit(lm)
        outcome[name] = final_state(lm, t)
    ref_params, ref_opt = outcome["auto"]
    params, opt = outcome["ratel"]
    assert {float(s["step"]) for s in ref_opt["state"].values()} == {6.0}
    assert max_rel_err(ref_params, params) <= 1e-5
    assert_opt_state_close(ref_opt, opt, 1e-5)


def test_manual_optimization_leaves_the_mode_stacks_as_found(tmp_path: Path) -> None:
    """Between manual steps only the between-steps reads are on torch's dispatch stack, and after fit nothing is: the
    backward inside the watched training step once put the reads back above the step's watch, which then took the
    reads off in its own place and stayed on the stack for good."""
    seen = []

    class Look(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            seen.append([type(mode).__name__ for mode in _get_current_dispatch_mode_stack()])

    lm = ManualBackwardLM("manual_backward", n_batches=3)
    trainer(ratel(swap(tmp_path)), callbacks=[Look()], max_steps=-1, max_epochs=1).fit(lm)
    assert seen == [["ParameterReads"]] * 3
    assert _get_current_dispatch_mode_stack() == [] and _get_current_function_mode_stack() == []


@pytest.mark.parametrize("states", ["auto", "device"])
def test_a_backward_the_engine_did_not_start_raises_before_the_step(tmp_path: Path, states: str) -> None:
    """``torch.autograd.backward`` does not go through ``Tensor.backward``, where the engine finds a backward: its
    first gradient raises, naming the fix, before the optimizer has it (on the device tier as on the CPU's)."""
    lm = ManualBackwardLM("torch.autograd.backward", n_batches=2)
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    with pytest.raises(RatelModelError, match=r"self\.manual_backward\(loss\)"):
        trainer(ratel(swap(tmp_path), optimizer_states=states)).fit(lm)
    assert lm.global_step == 0
    after = lm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------------- config errors


class LBFGSLM(CountingLM):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


def test_whole_model_optimizer_rejected(tmp_path: Path) -> None:
    ssd = swap(tmp_path)
    LBFGSLM.training_steps = 0
    with pytest.raises(RatelConfigError, match="LBFGS cannot run that way") as info:
        trainer(ratel(ssd)).fit(LBFGSLM())
    # What to do about it, not only the requirement.
    assert "per parameter" in str(info.value) and "another strategy" in str(info.value)
    assert LBFGSLM.training_steps == 0
    assert os.listdir(ssd) == []


def test_public_figures_and_wait(tmp_path: Path) -> None:
    """What examples and benchmarks read goes through the strategy's own methods, during a run and outside one."""
    seen: dict[str, Any] = {}

    class Look(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            strategy = trainer.strategy
            strategy.synchronize()
            seen["io"] = strategy.io_bytes()
            seen["placements"] = strategy.activation_placements()

    policy = {"*layers.0": "ssd", "*": "host"}
    strategy = RatelStrategy([str(tmp_path)], activation_policy=policy, optimizer_states="ssd")
    trainer(strategy, callbacks=[Look()]).fit(LM())
    assert seen["io"]["read"] > 0 and seen["io"]["written"] > 0
    names = list(seen["placements"])
    assert names[0].endswith("embed_tokens") and any(name.endswith("layers.0") for name in names)
    assert seen["placements"][next(n for n in names if n.endswith("layers.0"))] == "ssd"
    assert set(seen["placements"].values()) == {"ssd", "host"}
    # Outside a run there is nothing to report and nothing to wait for.
    assert strategy.io_bytes() == {} and strategy.activation_placements() == {}
    strategy.synchronize()
    with pytest.raises(TypeError):
        RatelStrategy([str(tmp_path)], 2)  # every argument but ssd_paths is keyword-only
