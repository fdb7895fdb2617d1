"""Host memory bounded by blocks: compute copies read from the swap files, meta-device models initialized block by
block, pooled gradient buffers, and no gathering of more state than host memory holds.

Every numeric check compares against the same LightningModule trained by plain Lightning (strategy "auto").
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

import lightning_ratel
from lightning_ratel import RatelConfigError, RatelPlanError, RatelPrecision, RatelStrategy
from lightning_ratel.engine import coordinator as engine
from lightning_ratel.engine import layout
from lightning_ratel.io import checkpoint
from lightning_ratel.runtime.pool import BufferPool
from tests.models import LM, MIXED_POLICY
from tests.models import compare_states as _compare
from tests.models import final_state, gradscaler_reference, max_rel_err, trainer


class _Inspect(Callback):
    """Records what the engine held at the end of training (teardown releases it)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        eng = trainer.strategy.engine
        self.seen["param_cache"] = eng.layout.param_cache
        self.seen["host_cache_bytes"] = sum(u.host_nbytes for u in eng.layout.units.values())
        self.seen["grad_pool_bytes"] = eng.adam.grads.nbytes
        self.seen["shard_bytes"] = [s.numel * 4 for s in eng.layout.shards]
        self.seen["placement"] = eng.byte_placement()


def _fit(strategy: Any, module: L.LightningModule, **kwargs: Any) -> tuple[dict, dict]:
    t = trainer(strategy, **kwargs)
    t.fit(module)
    return final_state(module, t)


def _is_placeholder(p: torch.Tensor) -> bool:
    return p.numel() > 1 and all(s == 0 for s in p.stride())


# ---------------------------------------------------------------------------------------------------- param_cache="ssd"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("model", ["llama", "gpt2", "mlp"])
@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (3, 0.05)])
def test_ssd_param_cache_matches_plain_adamw(tmp_path: Path, model: str, precision: str, accumulate: int,
                                             clip: float | None) -> None:
    kwargs = dict(precision=precision, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    ref = _fit("auto", LM(model), **kwargs)
    inspect = _Inspect()
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=MIXED_POLICY, param_cache="ssd")
    got = _fit(strategy, LM(model), callbacks=[inspect], **kwargs)
    _compare(ref, got, 1e-5)
    assert inspect.seen["param_cache"] == "ssd"
    assert inspect.seen["host_cache_bytes"] == 0
    assert os.listdir(tmp_path) == []


def test_ssd_param_cache_fp16_overflow_skip_matches_gradscaler(tmp_path: Path) -> None:
    class Overflowing(LM):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * 1e30 if batch_idx == 1 else loss

    module = Overflowing("mlp")
    precision = RatelPrecision("16-mixed", device="cpu")
    t = L.Trainer(accelerator="cpu", strategy=RatelStrategy(ssd_paths=[str(tmp_path)], param_cache="ssd"),
                  plugins=[precision], max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    t.fit(module)
    assert precision.steps_skipped == 1
    assert max_rel_err(gradscaler_reference("mlp", 3, overflow_step=1), module.state_dict()) <= 1e-5


def test_auto_reads_from_ssd_and_leaves_placeholders_when_memory_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Host memory smaller than the model: the compute copies must not be cached, the result not gathered back.
    for decides in (layout, checkpoint):
        monkeypatch.setattr(decides, "available_host_memory", lambda: 64 * 1024)
    inspect = _Inspect()
    module = LM("llama")
    with pytest.warns(UserWarning, match="not copied back"):
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=2, callbacks=[inspect]).fit(module)
    assert inspect.seen["param_cache"] == "ssd"
    assert inspect.seen["host_cache_bytes"] == 0
    for name, p in module.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
        assert _is_placeholder(p) or p.numel() == 1, name
    # The result exists nowhere else: the swap files stay, with the index an export reads them through.
    assert sorted(os.listdir(tmp_path)) == ["ratel.index.json", "ratel.swap"]


def test_auto_follows_host_memory_limit(tmp_path: Path) -> None:
    inspect = _Inspect()
    # Room for the run's own buffers (a smaller budget is refused before the model is built; no sets to read further
    # ahead, which a run plans only where its budget has room), and less than twice the compute copies, which
    # therefore stay in the swap files.
    need = lightning_ratel.estimate(LM("llama16"), precision="32-true", param_cache="ssd", optimizer_states="ssd",
                                    read_ahead_sets=0)
    limit = need.host + need.device
    assert lightning_ratel.estimate(LM("llama16"), precision="32-true", param_cache="host").host_cache > limit // 2
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", host_memory_limit=limit,
                             optimizer_states="ssd")
    ref = _fit("auto", LM("llama16"))
    got = _fit(strategy, LM("llama16"), callbacks=[inspect])
    # The budget leaves no room for the optimizer state's copy back.
    assert max_rel_err(ref[0], got[0]) <= 1e-5
    assert not got[1]["state"]
    assert inspect.seen["param_cache"] == "ssd"


def test_checkpointing_refused_before_training_when_states_do_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for decides in (layout, checkpoint):
        monkeypatch.setattr(decides, "available_host_memory", lambda: 64 * 1024)
    steps = []

    class Counting(LM):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            steps.append(batch_idx)
            return super().training_step(batch, batch_idx)

    # Forced to Lightning's ordinary format, which gathers the state (``"auto"`` would write sharded checkpoints).
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], checkpoint_format="full"), max_steps=2,
                enable_checkpointing=True, default_root_dir=str(tmp_path / "root"))
    with pytest.raises(RatelPlanError, match="checkpoint_format='sharded'"):
        t.fit(Counting("llama"))
    assert steps == []
    assert [n for n in os.listdir(tmp_path) if n != "root"] == []


# ---------------------------------------------------------------------------------------------------- gradient pool


def test_gradient_buffers_follow_the_shards_in_flight(tmp_path: Path) -> None:
    inspect = _Inspect()
    ref = _fit("auto", LM("llama16"))
    got = _fit(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host"), LM("llama16"), callbacks=[inspect])
    _compare(ref, got, 1e-5)
    # Updates overlap backward, so buffers are given back and reused: a few shards' worth, not the model's.
    shard_bytes = inspect.seen["shard_bytes"]
    assert inspect.seen["grad_pool_bytes"] <= (engine.GRAD_BUDGET_SHARDS + 2) * max(shard_bytes) + 4096 * 8
    assert inspect.seen["grad_pool_bytes"] < sum(shard_bytes) / 2


def test_buffer_pool_reuses_and_keeps_small_requests_out_of_large_buffers() -> None:
    pool = BufferPool()
    big = pool.take(10_000, torch.float32)
    assert big.data_ptr() % 4096 == 0 and big.numel() == 10_000
    pool.give(big)
    again = pool.take(9_000, torch.float32)
    assert again.data_ptr() == big.data_ptr()
    small = pool.take(10, torch.bfloat16)
    assert small.data_ptr() != big.data_ptr()
    pool.give(again)
    pool.give(small)
    assert pool.take(10, torch.bfloat16).data_ptr() == small.data_ptr()
    assert pool.nbytes == 40_960 + 4096
    assert pool.nbytes_in_use == 4096


# ---------------------------------------------------------------------------------------------------- meta device


def _deterministic_init(model: nn.Module, record: list[int] | None = None) -> Callable[[nn.Module], None]:
    """Initializes each module from a generator seeded by its parameter names, so the result does not depend on the
    order modules are initialized in; optionally records how many parameter elements hold memory at each call."""
    names = {m: n for n, m in model.named_modules()}

    def init(module: nn.Module) -> None:
        if record is not None:
            record.append(sum(p.numel() for p in model.parameters() if not p.is_meta and not _is_placeholder(p)))
        model._init_weights(module)  # buffers (rotary tables) and norms as the model defines them
        for pname, p in module.named_parameters(recurse=False):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{names[module]}.{pname}".encode()))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    return init


def test_meta_model_initialized_block_by_block_matches_plain(tmp_path: Path) -> None:
    reference = LM("llama")
    init = _deterministic_init(reference.model)
    for m in reference.model.modules():
        init(m)
    ref = _fit("auto", reference)

    with torch.device("meta"):
        module = LM("llama")
    assert all(p.is_meta for p in module.parameters())
    materialized: list[int] = []
    inspect = _Inspect()
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], param_cache="ssd",
                             param_init_fn=_deterministic_init(module.model, materialized))
    got = _fit(strategy, module, callbacks=[inspect])
    _compare(ref, got, 1e-5)
    # Never more than one block's parameters in host memory while initializing.
    largest_block = max(sum(p.numel() for p in layer.parameters()) for layer in module.model.model.layers)
    assert max(materialized) <= largest_block
    assert all(not b.is_meta for b in module.buffers())
    assert os.listdir(tmp_path) == []


def test_meta_model_with_reset_parameters_needs_no_initializer(tmp_path: Path) -> None:
    with torch.device("meta"):
        module = LM("mlp")
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=2).fit(module)
    assert all(torch.isfinite(p).all() and not _is_placeholder(p) for p in module.parameters())


def test_meta_model_without_initializer_rejected_before_training(tmp_path: Path) -> None:
    with torch.device("meta"):
        module = LM("llama")
    with pytest.raises(RatelConfigError, match="reset_parameters"):
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=2).fit(module)
    assert os.listdir(tmp_path) == []



def test_copy_back_stays_within_host_memory_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Plenty of memory on the machine, the smallest budget that holds the run (states and compute copies in host
    # memory). The trained parameters are copied back (the module held them before the run); the optimizer state,
    # new bytes, only where the budget leaves room for it beside what the run holds: the budget decides, not the
    # machine.
    monkeypatch.setattr(checkpoint, "available_host_memory", lambda: 1 << 40)
    need = lightning_ratel.estimate(LM("llama"), precision="32-true", param_cache="host", optimizer_states="host")
    trainable = sum(p.numel() * 4 for p in LM("llama").parameters())
    room = need.host + need.device - need.host_cache - need.host_states
    assert room < 2 * trainable
    for limit, moments in ((need.host + need.device, False), (need.host + need.device + 3 * trainable, True)):
        module = LM("llama")
        strategy = RatelStrategy(ssd_paths=[str(tmp_path / str(limit))], activation_policy="host", param_cache="host",
                                 optimizer_states="host", host_memory_limit=limit)
        t = trainer(strategy, max_steps=2)
        t.fit(module)
        assert not any(_is_placeholder(p) for p in module.parameters())
        assert bool(t.optimizers[0].state) == moments
