"""Optimizers other than AdamW run out of core with the numbers of plain Lightning, their state paged and resumable;
optimizers whose step needs every parameter at once are refused before training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from transformers.optimization import Adafactor

from lightning_ratel import RatelConfigError, RatelStrategy
from lightning_ratel.io.convert import sharded_to_lightning
from lightning_ratel.runtime.generic import group_settings, probe_shape, probe_states
from tests.models import LM, MIXED_POLICY, final_state, trainer
from tests.test_step_commit import FAIL_AT, FaultyLM

Make = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Make] = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
    # No state at all: its shards have no record in either slot.
    "stateless_sgd": lambda g: torch.optim.SGD(g, lr=0.05),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.9, centered=True),
    "nadam": lambda g: torch.optim.NAdam(g, lr=1e-2, decoupled_weight_decay=True),
    "radam": lambda g: torch.optim.RAdam(g, lr=1e-2),
    "amsgrad": lambda g: torch.optim.Adam(g, lr=1e-2, amsgrad=True),
    "adafactor": lambda g: Adafactor(g, lr=None, relative_step=True, scale_parameter=True, warmup_init=True),
}


class OptimizerLM(LM):
    """:class:`LM` with another optimizer over the same two groups (weight decay on matrices only) and, where the
    optimizer takes a learning rate, the same step scheduler."""

    def __init__(self, optimizer: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        opt = OPTIMIZERS[self.optimizer_name]([{"params": decay, "weight_decay": 0.01},
                                               {"params": no_decay, "weight_decay": 0.0}])
        if self.optimizer_name == "adafactor":
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(strategy: Any, optimizer: str, module: LM | None = None, ckpt_path: str | None = None,
         **kwargs: Any) -> tuple[dict, dict]:
    module = module or OptimizerLM(optimizer)
    t = trainer(strategy, **kwargs)
    t.fit(module, ckpt_path=ckpt_path)
    return final_state(module, t)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def assert_identical(ref: tuple[dict, dict], got: tuple[dict, dict]) -> None:
    """Parameters, every state entry of every parameter, and param groups are bit for bit those of ``ref``."""
    assert ref[0].keys() == got[0].keys()
    for name in ref[0]:
        assert torch.equal(ref[0][name], got[0][name]), name
    ref_state, got_state = ref[1]["state"], got[1]["state"]
    assert ref_state.keys() == got_state.keys()
    for index in ref_state:
        assert ref_state[index].keys() == got_state[index].keys(), index
        for key in ref_state[index]:
            assert _same(ref_state[index][key], got_state[index][key]), (index, key)
    assert got[1]["param_groups"] == ref[1]["param_groups"]


def _ratel(tmp_path: Path, **kwargs: Any) -> RatelStrategy:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return RatelStrategy(ssd_paths=[str(swap)], **kwargs)


# Each optimizer on another tier: its states with the masters in the host cache or on the store, activations on every
# placement, and the planned path.
@pytest.mark.parametrize(("optimizer", "param_cache", "policy", "precision"), [
    ("sgd", "ssd", MIXED_POLICY, "32-true"),
    ("stateless_sgd", "host", "keep", "32-true"),
    ("adagrad", "host", "recompute", "32-true"),
    ("rmsprop", "ssd", "host", "bf16-mixed"),
    ("nadam", "host", "ssd", "32-true"),
    ("radam", "ssd", None, "32-true"),
    ("amsgrad", "host", "keep", "bf16-mixed"),
    ("adafactor", "ssd", MIXED_POLICY, "32-true"),
])
def test_matches_plain_lightning(tmp_path: Path, optimizer: str, param_cache: str, policy: Any,
                                 precision: str) -> None:
    ref = _fit("auto", optimizer, precision=precision)
    got = _fit(_ratel(tmp_path, param_cache=param_cache, activation_policy=policy), optimizer, precision=precision)
    assert_identical(ref, got)


def test_gradient_accumulation_and_clipping_match(tmp_path: Path) -> None:
    """Accumulated gradients and a clip by norm (updates deferred to the end of backward) with SGD's momentum."""
    kwargs = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    ref = _fit("auto", "sgd", **kwargs)
    got = _fit(_ratel(tmp_path), "sgd", **kwargs)
    assert_identical(ref, got)


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_resume_in_the_middle_equals_never_stopping(tmp_path: Path, optimizer: str, checkpoint_format: str) -> None:
    # Two batches an epoch, so the checkpoint of step 2 ends an epoch and the resumed run sees the batches the
    # uninterrupted one sees.
    ref = _fit("auto", optimizer, OptimizerLM(optimizer, n_batches=2))
    ckpt = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1)
    _fit(_ratel(tmp_path, param_cache="ssd", checkpoint_format=checkpoint_format), optimizer,
         OptimizerLM(optimizer, n_batches=2), max_steps=2, callbacks=[callback], enable_checkpointing=True)
    [saved] = ckpt.iterdir()
    # What it holds is Lightning's own checkpoint (converted, for the sharded one): the optimizer state plain training
    # has after two steps.
    lightning = saved
    if checkpoint_format == "sharded":
        lightning = sharded_to_lightning(saved, tmp_path / "converted.ckpt")
    plain = _fit("auto", optimizer, OptimizerLM(optimizer, n_batches=2), max_steps=2)
    assert_identical(plain, (plain[0], torch.load(lightning, weights_only=False)["optimizer_states"][0]))
    got = _fit(_ratel(tmp_path, checkpoint_format=checkpoint_format), optimizer, OptimizerLM(optimizer, n_batches=2),
               ckpt_path=str(saved))
    assert_identical(ref, got)


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1)
    _fit(_ratel(tmp_path, checkpoint_format="sharded"), "rmsprop", OptimizerLM("rmsprop", n_batches=2), max_steps=2,
         callbacks=[callback], enable_checkpointing=True)
    [saved] = ckpt.iterdir()
    with pytest.raises(RatelConfigError, match="another optimizer state"):
        _fit(_ratel(tmp_path, checkpoint_format="sharded"), "sgd", OptimizerLM("sgd", n_batches=2),
             ckpt_path=str(saved))


class FaultySGD(FaultyLM):
    """The failing 8-layer Llama of ``tests/test_step_commit.py`` with SGD's momentum."""

    optimizer_name = "sgd"
    configure_optimizers = OptimizerLM.configure_optimizers


def test_a_fault_in_backward_leaves_the_last_committed_state(tmp_path: Path) -> None:
    """Backward fails at step 3 while the updates of the blocks it has left already ran: the module, the momentum
    buffers in the on-exception checkpoint and the run resumed from it are those of plain training."""
    def plain(steps: int) -> tuple[dict, dict]:
        return _fit("auto", "sgd", FaultySGD(), max_steps=steps)

    module = FaultySGD("backward")
    callback = OnExceptionCheckpoint(str(tmp_path / "ckpt"))
    with pytest.raises(RuntimeError, match="injected fault"):
        trainer(_ratel(tmp_path), enable_checkpointing=True, callbacks=[callback]).fit(module)
    committed = plain(FAIL_AT)
    saved = torch.load(tmp_path / "ckpt" / "on_exception.ckpt", weights_only=False)
    assert_identical(committed, (module.state_dict(), saved["optimizer_states"][0]))
    got = _fit(_ratel(tmp_path), "sgd", FaultySGD(), ckpt_path=str(tmp_path / "ckpt" / "on_exception.ckpt"))
    assert_identical(plain(4), got)


class GlobalNormSGD(torch.optim.Optimizer):
    """Normalizes every update by the gradient norm of the whole group: a step that reads other parameters."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])


class CallableLM(LM):
    def __init__(self, make: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


@pytest.mark.parametrize(("make", "reason"), [
    (lambda p: torch.optim.LBFGS(p), "closure and keeps one state for all its parameters"),
    (lambda p: GlobalNormSGD(p), "changes with the other parameters of its group"),
], ids=["lbfgs", "global-norm"])
def test_whole_model_optimizers_are_refused_at_setup(tmp_path: Path, make: Any, reason: str) -> None:
    module = CallableLM(make)
    with pytest.raises(RatelConfigError, match=reason):
        trainer(_ratel(tmp_path)).fit(module)
    assert module.global_step == 0


@pytest.mark.parametrize("optimizer", ["sgd", "amsgrad", "adafactor", "adagrad"])
@pytest.mark.parametrize("shape", [(512, 300), (40, 30, 200), (100_000,)])
def test_large_parameters_are_probed_through_stand_ins(optimizer: str, shape: tuple[int, ...]) -> None:
    """The state layout found on small stand-ins is the one the parameter's own shape gives (factored Adafactor
    moments included)."""
    scratch = OPTIMIZERS[optimizer]([{"params": [torch.zeros(1)]}])
    settings = group_settings(scratch)[0]
    assert probe_states(type(scratch), dict(scratch.defaults), settings, shape) == probe_shape(
        type(scratch), dict(scratch.defaults), settings, shape)


class ManualLM(OptimizerLM):
    """Manual optimization as users write it: ``manual_backward``, a clip by norm, a step every ``every`` batches
    (the skipped ones accumulate) and ``zero_grad`` after it."""

    def __init__(self, optimizer: str, every: int) -> None:
        super().__init__(optimizer, n_batches=4)
        self.automatic_optimization = False
        self.every = every

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = self.model(input_ids=batch, labels=batch).loss
        self.manual_backward(loss / self.every)
        if (batch_idx + 1) % self.every == 0:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        return config["optimizer"] if isinstance(config, dict) else config


@pytest.mark.parametrize(("optimizer", "every"), [("sgd", 1), ("sgd", 2), ("amsgrad", 2)])
def test_manual_optimization_matches_plain_lightning(tmp_path: Path, optimizer: str, every: int) -> None:
    ref = _fit("auto", optimizer, ManualLM(optimizer, every), max_steps=-1, max_epochs=2)
    got = _fit(_ratel(tmp_path, activation_policy=MIXED_POLICY), optimizer, ManualLM(optimizer, every), max_steps=-1,
               max_epochs=2)
    assert_identical(ref, got)


def test_manual_zero_grad_drops_the_accumulated_gradients(tmp_path: Path) -> None:
    """A backward whose gradients ``zero_grad`` drops before any step changes nothing."""

    class Dropping(ManualLM):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx % 2 == 0:
                self.manual_backward(self.model(input_ids=batch, labels=batch).loss)
                self.optimizers().zero_grad()
                return None
            return super().training_step(batch, batch_idx)

    ref = _fit("auto", "sgd", Dropping("sgd", 1), max_steps=-1, max_epochs=1)
    got = _fit(_ratel(tmp_path), "sgd", Dropping("sgd", 1), max_steps=-1, max_epochs=1)
    assert_identical(ref, got)


def test_several_optimizers_are_refused_at_setup(tmp_path: Path) -> None:
    """A GAN's generator and discriminator optimizers, stepped apart: refused with what to do."""

    class TwoOptimizers(ManualLM):
        def configure_optimizers(self) -> Any:
            layers = list(self.model.model.layers)
            return (torch.optim.SGD(layers[0].parameters(), lr=0.1),
                    torch.optim.SGD(layers[1].parameters(), lr=0.1))

    module = TwoOptimizers("sgd", 1)
    with pytest.raises(RatelConfigError, match="several optimizers stepped apart") as info:
        trainer(_ratel(tmp_path)).fit(module)
    assert "another strategy" in str(info.value)
    assert module.global_step == 0
