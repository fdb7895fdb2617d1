"""Speculative updates under clipping by norm and fp16 loss scaling end on the very bits of the deferred path.

A speculative step runs each shard's update during backward as if the clip coefficient were 1 and nothing overflowed;
its end either confirms that or undoes the updates and redoes them clipped (or drops them on an overflow). Each test
fits the same module twice, with speculation and with every such step deferred to the end of backward
(``RatelEngine.speculate = False``), and compares parameters and optimizer state after every step bit for bit; the
optimizer's counts show which way the steps went.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_ratel import RatelPrecision, RatelStrategy
from lightning_ratel.engine.coordinator import RatelEngine
from lightning_ratel.runtime.optimizer import CpuAdam
from tests.models import LM, trainer
from tests.test_step_commit import FAIL_AT, STEPS, FaultyLM


class _Steps(L.Callback):
    """Parameters and optimizer state after every step (reading them waits for the step's updates) or only at the end
    (``every_step=False``), and the optimizer's update counts at the end."""

    def __init__(self, every_step: bool = True) -> None:
        self.every_step = every_step
        self.states: list[tuple[dict, dict]] = []
        self.final: tuple[dict, dict] | None = None
        self.counts: Counter[str] = Counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.every_step:
            engine = trainer.strategy.engine
            self.states.append((engine.state.state_dict(), engine.state.optimizer_state_dict()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine
        engine.adam.barrier()
        self.counts = Counter(engine.adam.counts)
        self.final = (engine.state.state_dict(), engine.state.optimizer_state_dict())


class Overflowing(LM):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1e30 if batch_idx in (2, 5) else loss


class _Infinite(torch.autograd.Function):
    """Identity in forward; an infinite gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class LateOverflow(LM):
    """The llama whose embedding alone gets an infinite gradient at steps 2 and 5: the embedding's shard completes
    last in backward, after every other shard's speculative update ran."""

    def __init__(self) -> None:
        super().__init__("llama")
        self.model.model.embed_tokens.register_forward_hook(self._overflow)

    def _overflow(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.trainer.global_step in (2, 5):
            return _Infinite.apply(output)
        return output


class OwnClipping(LM):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, 2.0, "norm")


def _fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, speculate: bool, module: LM,
         precision: str = "32-true", every_step: bool = True, **kwargs: Any) -> _Steps:
    monkeypatch.setattr(RatelEngine, "speculate", speculate)
    swap = tmp_path / ("speculative" if speculate else "deferred")
    swap.mkdir()
    record = _Steps(every_step)
    plugins = [RatelPrecision("16-mixed", device="cpu")] if precision == "16-mixed" else []
    extra = {} if plugins else {"precision": precision}
    trainer(RatelStrategy(ssd_paths=[str(swap)]), callbacks=[record], plugins=plugins, **extra, **kwargs).fit(module)
    return record


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _same_bits(a: Any, b: Any) -> bool:
    """Equal structure, and tensors of the same dtype, shape and bytes (a NaN equals itself, -0.0 differs from 0.0)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    return a == b


def _compare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Any, **kwargs: Any) -> Counter[str]:
    """Fit ``make()`` deferred and speculative; assert every step's state is the same bits; return the speculative
    run's counts."""
    deferred = _fit(tmp_path, monkeypatch, False, make(), **kwargs)
    speculative = _fit(tmp_path, monkeypatch, True, make(), **kwargs)
    assert len(speculative.states) == len(deferred.states) > 0
    for step, (got, ref) in enumerate(zip(speculative.states, deferred.states)):
        assert _same_bits(got, ref), f"step {step} differs"
    # The reference really took the deferred path.
    assert deferred.counts["overlapped"] == 0 or kwargs.get("gradient_clip_algorithm") == "value"
    return speculative.counts


@pytest.mark.parametrize("model", ["llama", "mlp"])
def test_norm_that_never_clips_keeps_every_update_overlapped(tmp_path, monkeypatch, model):
    counts = _compare(tmp_path, monkeypatch, lambda: LM(model), max_steps=6, gradient_clip_val=1e9)
    assert counts["overlapped"] > 0
    assert counts["redone"] == counts["deferred"] == counts["dropped"] == 0


def test_norm_that_clips_sometimes_redoes_those_steps(tmp_path, monkeypatch):
    # The llama's gradient norms wander around 2 (1.6 to 2.7 over these steps): some steps clip, some do not.
    counts = _compare(tmp_path, monkeypatch, lambda: LM("llama"), max_steps=8, gradient_clip_val=2.0)
    assert counts["overlapped"] > 0 and counts["redone"] > 0 and counts["deferred"] > counts["redone"]


def test_norm_that_always_clips_stops_speculating(tmp_path, monkeypatch):
    counts = _compare(tmp_path, monkeypatch, lambda: LM("mlp"), max_steps=5, gradient_clip_val=1e-3)
    # Only the first step guessed (and was redone); the predictor deferred the others.
    assert counts["redone"] == counts["overlapped"] > 0
    assert counts["deferred"] == 5 * counts["redone"]


def test_updates_still_running_when_the_next_step_begins(tmp_path, monkeypatch):
    """Slow updates: a step's last updates (stood or redone) run while the next step's backward hands gradients over,
    and must still release their own gradients rather than keep them for the next step's speculation."""
    adamw = CpuAdam._adamw

    def slow(self: CpuAdam, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.02)
        adamw(self, *args, **kwargs)

    monkeypatch.setattr(CpuAdam, "_adamw", slow)
    fit = dict(every_step=False, max_steps=8, gradient_clip_val=2.0)
    deferred = _fit(tmp_path, monkeypatch, False, LM("llama"), **fit)
    speculative = _fit(tmp_path, monkeypatch, True, LM("llama"), **fit)
    # The states are compared at the end only: reading them after every step would let each step's updates finish.
    assert _same_bits(speculative.final, deferred.final)
    assert speculative.counts["redone"] > 0 and speculative.counts["overlapped"] > speculative.counts["redone"]


@pytest.mark.parametrize("clip", [None, 2.0])
def test_accumulation_windows(tmp_path, monkeypatch, clip):
    counts = _compare(tmp_path, monkeypatch, lambda: LM("llama"), max_steps=4, accumulate_grad_batches=3,
                      gradient_clip_val=clip, precision="16-mixed")
    assert counts["overlapped"] > 0


def test_fp16_overflow_in_the_first_shard_queues_nothing_more(tmp_path, monkeypatch):
    counts = _compare(tmp_path, monkeypatch, lambda: Overflowing("mlp"), max_steps=8, precision="16-mixed")
    assert counts["overlapped"] > 0 and counts["dropped"] == 0


@pytest.mark.parametrize("clip", [None, 2.0])
def test_fp16_overflow_in_the_last_shard_drops_the_speculative_updates(tmp_path, monkeypatch, clip):
    counts = _compare(tmp_path, monkeypatch, LateOverflow, max_steps=8, precision="16-mixed", gradient_clip_val=clip)
    assert counts["overlapped"] > 0 and counts["dropped"] > 0


def test_fp16_with_clipping_by_value_clips_each_shard_as_it_completes(tmp_path, monkeypatch):
    counts = _compare(tmp_path, monkeypatch, lambda: LM("llama"), max_steps=4, precision="16-mixed",
                      gradient_clip_val=0.01, gradient_clip_algorithm="value")
    assert counts["overlapped"] > 0 and counts["deferred"] == 0


def test_own_configure_gradient_clipping_is_never_speculated(tmp_path, monkeypatch):
    counts = _compare(tmp_path, monkeypatch, lambda: OwnClipping("llama"), max_steps=4)
    assert counts["overlapped"] == 0 and counts["deferred"] > 0


@pytest.mark.parametrize("where", ["backward", "before_optimizer_step"])
def test_a_fault_in_a_speculative_step_leaves_the_last_committed_step(tmp_path, monkeypatch, where):
    """The fault comes while (``backward``) or after (``before_optimizer_step``) the speculative updates ran: they are
    undone, and the module holds the values of the step before, as an uninterrupted run has them."""
    monkeypatch.setattr(RatelEngine, "speculate", True)
    clip = {"gradient_clip_val": 1e9}
    ref = FaultyLM()
    (tmp_path / "ref").mkdir()
    trainer(RatelStrategy(ssd_paths=[str(tmp_path / "ref")]), max_steps=FAIL_AT, **clip).fit(ref)
    lm = FaultyLM(where)
    (tmp_path / "swap").mkdir()
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path / "swap")]), max_steps=STEPS, enable_checkpointing=True,
                callbacks=[OnExceptionCheckpoint(str(tmp_path / "ckpt"))], **clip)
    with pytest.raises(RuntimeError, match="injected fault"):
        t.fit(lm)
    assert t.global_step == FAIL_AT
    assert _same_bits(lm.state_dict(), ref.state_dict())
    saved = torch.load(tmp_path / "ckpt" / "on_exception.ckpt", weights_only=False)
    assert _same_bits(saved["state_dict"], ref.state_dict())
