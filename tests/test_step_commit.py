"""A step is all or nothing: an exception or Ctrl-C at any point of a step leaves the module, the optimizer state and
the on-exception checkpoint at the last committed step, and resuming from that checkpoint equals never stopping."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_ratel import RatelStrategy
from lightning_ratel.runtime.timeline import Timeline
from tests.models import LM, cache_off, final_state, max_rel_err, trainer

STEPS = 4
FAIL_AT = 2  # global_step when the fault fires: two steps are committed, the third is being taken
N_BATCHES = 2
ROOT = Path(__file__).resolve().parents[1]
UPDATE_WAIT_SECONDS = 10.0
"""The longest a fault in backward waits for an update to start: far beyond a thread's scheduling delay on a busy
machine."""


def _an_update_started(timeline: Timeline) -> bool:
    """Wait until the optimizer has started an update since the last backward began (by the events of the engine's
    ``timeline``), at most :data:`UPDATE_WAIT_SECONDS`; whether one did. Polled: the timeline signals nothing."""
    deadline = time.monotonic() + UPDATE_WAIT_SECONDS
    while True:
        names = [name for name, _ in timeline]
        began = len(names) - names[::-1].index("backward_start")
        if any(name.startswith("update_start") for name in names[began:]):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


class _Fault(torch.autograd.Function):
    """Identity in forward; in backward, where updates overlap it (``timeline``: the engine's, else ``None``), waits
    for the optimizer to start updating the blocks backward has left, then fails."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, action: str, timeline: Timeline | None) -> torch.Tensor:
        ctx.action = action
        ctx.timeline = timeline
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Backward has passed every later block: their updates run on the CPU optimizer meanwhile, and the fault must
        # find at least one to undo, however late the optimizer's thread is scheduled.
        if ctx.timeline is not None:
            assert _an_update_started(ctx.timeline), "no update started during backward"
        if ctx.action == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        raise RuntimeError("injected fault in backward")


class FaultyLM(LM):
    """The tiny Llama of the other tests (8 layers, so backward lasts while updates start), failing at step
    ``FAIL_AT`` from ``where``: ``"backward"`` / ``"sigint"`` (inside the first decoder layer's backward),
    ``"after_backward"`` or ``"before_optimizer_step"`` (Lightning hooks)."""

    def __init__(self, where: str | None = None) -> None:
        super().__init__("llama8", n_batches=N_BATCHES)
        self.where = where
        self.model.model.layers[0].register_forward_hook(self._inject)

    def _armed(self, where: tuple[str, ...]) -> bool:
        return self.where in where and self.trainer.global_step == FAIL_AT and torch.is_grad_enabled()

    def _inject(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not self._armed(("backward", "sigint")):
            return output
        engine = self.trainer.strategy.engine
        timeline = engine.timeline if engine.updates_overlap else None
        if isinstance(output, tuple):
            return (_Fault.apply(output[0], self.where, timeline), *output[1:])
        return _Fault.apply(output, self.where, timeline)

    def on_after_backward(self) -> None:
        if self._armed(("after_backward",)):
            raise RuntimeError("injected fault in on_after_backward")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._armed(("before_optimizer_step",)):
            raise RuntimeError("injected fault in on_before_optimizer_step")


@functools.lru_cache(maxsize=None)
def plain(steps: int) -> tuple[dict, dict]:
    lm = FaultyLM()
    t = trainer("auto", max_steps=steps)
    t.fit(lm)
    return final_state(lm, t)


def _close(ref: tuple[dict, dict], params: dict[str, torch.Tensor], opt: dict[str, Any]) -> None:
    assert max_rel_err(ref[0], params) <= 1e-5
    assert set(opt["state"]) == set(ref[1]["state"])
    for index, entry in ref[1]["state"].items():
        assert float(opt["state"][index]["step"]) == float(entry["step"]), index
        moments = {k: opt["state"][index][k] for k in ("exp_avg", "exp_avg_sq")}
        assert max_rel_err({k: entry[k] for k in moments}, moments) <= 1e-5, index


def _resume_and_compare(tmp_path: Path, checkpoint: Path) -> None:
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["global_step"] == FAIL_AT
    _close(plain(FAIL_AT), saved["state_dict"], saved["optimizer_states"][0])
    lm = FaultyLM()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    t = trainer(RatelStrategy(ssd_paths=[str(resumed)]), max_steps=STEPS)
    t.fit(lm, ckpt_path=str(checkpoint))
    assert t.global_step == STEPS
    _close(plain(STEPS), *final_state(lm, t))


@pytest.mark.parametrize("states", ["host", "ssd", "device"])
@pytest.mark.parametrize("where", ["backward", "after_backward", "before_optimizer_step"])
def test_exception_leaves_the_last_committed_step(tmp_path: Path, where: str, states: str) -> None:
    """On every tier of the optimizer states, a fault leaves (and checkpoints) the last committed step."""
    swap = tmp_path / "swap"
    swap.mkdir()
    lm = FaultyLM(where)
    t = trainer(RatelStrategy(ssd_paths=[str(swap)], optimizer_states=states), max_steps=STEPS,
                enable_checkpointing=True, callbacks=[OnExceptionCheckpoint(str(tmp_path / "ckpt"))])
    with pytest.raises(RuntimeError, match="injected fault"):
        t.fit(lm)
    assert t.global_step == FAIL_AT
    # The module holds the committed step (plain Lightning leaves it there too), nothing of the failed one.
    assert max_rel_err(plain(FAIL_AT)[0], lm.state_dict()) <= 1e-5
    assert os.listdir(swap) == []
    _resume_and_compare(tmp_path, tmp_path / "ckpt" / "on_exception.ckpt")


_SIGINT_RUN = """
import signal, sys
# Python's own Ctrl-C, whatever the launching shell or test left (a background job starts with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning_ratel import RatelStrategy
from tests.models import trainer
from tests.test_step_commit import STEPS, FaultyLM

t = trainer(RatelStrategy(ssd_paths=[{swap!r}]), max_steps=STEPS, enable_checkpointing=True,
            callbacks=[OnExceptionCheckpoint({ckpt!r})])
t.fit(FaultyLM("sigint"))
"""


def test_ctrl_c_in_backward_leaves_the_last_committed_step(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    script = _SIGINT_RUN.format(root=str(ROOT), swap=str(swap), ckpt=str(tmp_path / "ckpt"))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "KeyboardInterrupt" in run.stdout + run.stderr
    assert os.listdir(swap) == []
    _resume_and_compare(tmp_path, tmp_path / "ckpt" / "on_exception.ckpt")


def test_uninterrupted_run_matches_plain(tmp_path: Path) -> None:
    """The reference the resumed runs are compared with is what Ratel computes without a fault too."""
    lm = FaultyLM()
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=STEPS)
    t.fit(lm)
    _close(plain(STEPS), *final_state(lm, t))


class WindowFaultT5(LM):
    """T5 (two block lists) with gradient accumulation over two micro-batches, failing at step ``FAIL_AT`` in the
    forward of the decoder's last block (``"block_forward"``) or in the window's second micro-batch, once the first
    one's gradients are accumulated (``"second_micro_batch"``)."""

    def __init__(self, where: str | None = None) -> None:
        super().__init__("t5", n_batches=2 * N_BATCHES)
        # RatelStrategy turns the KV cache off during fit; plain training with it on multiplies the cache's contiguous
        # copies of keys and values instead of strided views, which rounds differently (1.7e-5 relative here).
        cache_off(self)
        self.where = where
        self.model.decoder.block[-1].register_forward_hook(self._in_block)

    def _armed(self, where: str) -> bool:
        return self.where == where and self.trainer.global_step == FAIL_AT and torch.is_grad_enabled()

    def _in_block(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._armed("block_forward"):
            raise RuntimeError("injected fault in a block's forward")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self._armed("second_micro_batch") and batch_idx % 2 == 1:
            raise RuntimeError("injected fault in the second micro-batch")
        return loss


def _fail_and_resume(tmp_path: Path, strategy: Any, where: str) -> tuple[dict, tuple[dict, dict]]:
    """The module as the fault left it, and the state after resuming from the on-exception checkpoint."""
    fit = {"max_steps": STEPS, "accumulate_grad_batches": 2}
    lm = WindowFaultT5(where)
    t = trainer(strategy(), enable_checkpointing=True, callbacks=[OnExceptionCheckpoint(str(tmp_path))], **fit)
    with pytest.raises(RuntimeError, match="injected fault"):
        t.fit(lm)
    assert t.global_step == FAIL_AT
    left = {k: v.detach().clone() for k, v in lm.state_dict().items()}
    lm = WindowFaultT5()
    t = trainer(strategy(), **fit)
    t.fit(lm, ckpt_path=str(tmp_path / "on_exception.ckpt"))
    assert t.global_step == STEPS
    return left, final_state(lm, t)


@pytest.mark.parametrize("where", ["block_forward", "second_micro_batch"])
def test_fault_inside_an_accumulation_window_resumes_like_plain(tmp_path: Path, where: str) -> None:
    """Every tier on (swapped and recomputed activations, compute copies read from the swap files): the module after
    the fault and the resumed run equal plain Lightning's given the same fault (a fault in the second micro-batch
    resumes mid-epoch, where plain Lightning's own resume differs from never stopping)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    policy = {"*block.0": "ssd", "*block.1": "recompute", "*": "host"}
    ratel = functools.partial(RatelStrategy, ssd_paths=[str(swap)], activation_policy=policy, param_cache="ssd")
    ref_left, ref = _fail_and_resume(tmp_path / "plain", lambda: "auto", where)
    got_left, got = _fail_and_resume(tmp_path / "ratel", ratel, where)
    assert max_rel_err(ref_left, got_left) <= 1e-5
    _close(ref, *got)
    assert os.listdir(swap) == []


class LogitsTooLarge(LM):
    """Runs out of device memory in the loss of its third step, as a causal LM head whose logits do not fit."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        if batch_idx == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB.")
        return loss


def test_out_of_device_memory_says_what_to_change_and_loses_nothing(tmp_path: Path) -> None:
    module = LogitsTooLarge()
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host")).fit(module)
    advice = "\n".join(getattr(caught.value, "__notes__", []))
    assert "rolled back" in advice and "accumulate_grad_batches" in advice and "device_memory_limit" in advice
    # The two committed steps, as a plain run of two steps has them.
    two_steps = LM()
    trainer(max_steps=2).fit(two_steps)
    assert max_rel_err(two_steps.state_dict(), module.state_dict()) == 0.0
