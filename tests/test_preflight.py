"""The pre-flight estimate (``lightning_ratel.estimate``) against what a run measures, and budgets refused before
anything is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_ratel
from lightning_ratel import RatelPlanError, RatelStrategy
from lightning_ratel.config import RatelConfig
from lightning_ratel.engine.coordinator import GRAD_BUDGET_SHARDS
from lightning_ratel.preflight import check_host_budget
from tests.models import LM, tiny_llama, trainer


class Measure(Callback):
    """The bytes the engine's parts hold once the model is set up, and the gradient pool at the end."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine
        self.seen["disk"] = engine.store.nbytes_reserved
        self.seen["host_cache"] = sum(u.host_nbytes for u in engine.layout.units.values())
        self.seen["optimizer"] = engine.adam.host_buffer_bytes

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen["gradients"] = trainer.strategy.engine.adam.grads.nbytes


def close(estimated: int, measured: int) -> bool:
    return abs(estimated - measured) <= 0.1 * measured


@pytest.mark.parametrize(("precision", "param_cache"), [("32-true", "host"), ("bf16-mixed", "ssd")])
def test_estimate_matches_a_run(tmp_path: Path, precision: str, param_cache: str) -> None:
    lm = LM("llama8", n_batches=2)
    args: dict[str, Any] = {"param_cache": param_cache, "checkpoint_format": "sharded"}
    estimate = lightning_ratel.estimate(lm, precision=precision, optimizer=lm.configure_optimizers()["optimizer"],
                                        **args)
    assert estimate.param_cache == param_cache and estimate.checkpoint_format == "sharded"
    measure = Measure()
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path / "swap")], **args), max_steps=2, precision=precision,
                enable_checkpointing=True, callbacks=[measure, checkpoints])
    t.fit(lm)
    seen = measure.seen
    assert close(estimate.disk, seen["disk"]), (estimate.disk, seen["disk"])
    assert close(estimate.host_cache, seen["host_cache"]), (estimate.host_cache, seen["host_cache"])
    assert close(estimate.optimizer_buffers, seen["optimizer"]), (estimate.optimizer_buffers, seen["optimizer"])
    # The gradient budget holds back backward only while the optimizer has work that will free memory, so one more
    # shard's gradient can be taken past it; how far backward runs ahead depends on timing.
    assert 0 < seen["gradients"] <= estimate.gradient_buffers * (GRAD_BUDGET_SHARDS + 1) // GRAD_BUDGET_SHARDS
    written = sum(f.stat().st_size for f in Path(checkpoints.best_model_path).glob("unit-*.safetensors"))
    assert close(estimate.checkpoint, written), (estimate.checkpoint, written)
    assert estimate.parameters == estimate.trainable == sum(p.numel() for p in lm.parameters())


def test_estimate_of_a_config_and_of_a_folder(tmp_path: Path) -> None:
    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf")
    from_module = lightning_ratel.estimate(model, precision="bf16-mixed")
    from_config = lightning_ratel.estimate(model.config, precision="bf16-mixed")
    from_folder = lightning_ratel.estimate(tmp_path / "hf", precision="bf16-mixed")
    assert from_module == from_config == from_folder
    assert from_module.parameters == sum(p.numel() for p in model.parameters())
    # Trainable parameters: 24 bytes each (master and two moments, two slots), in host memory where it holds them and
    # in the swap files otherwise.
    assert from_module.disk + from_module.host_states == 24 * from_module.parameters
    on_disk = lightning_ratel.estimate(model, precision="bf16-mixed", optimizer_states="ssd")
    assert on_disk.disk == 24 * on_disk.parameters and on_disk.host_states == 0
    text = str(from_module)
    assert "disk (swap files)" in text and "host memory" in text and "checkpoint" in text


def test_frozen_parameters_cost_no_optimizer_state() -> None:
    model = tiny_llama()
    for name, p in model.named_parameters():
        p.requires_grad = "q_proj" in name
    frozen = lightning_ratel.estimate(model, precision="32-true", param_cache="ssd", checkpoint_format="sharded",
                                      optimizer_states="ssd")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert frozen.trainable == trainable
    # Masters and moments of the trainable ones; the frozen ones' fp32 compute copies, read from the swap files.
    assert frozen.disk == 24 * trainable + 4 * (frozen.parameters - trainable)
    assert frozen.checkpoint == 12 * trainable + 4 * (frozen.parameters - trainable)


def test_host_budget_refused_before_the_model_is_built(tmp_path: Path) -> None:
    lm = LM("llama8", n_batches=2)
    swap = tmp_path / "swap"
    steps = []

    class Count(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            steps.append(1)

    t = trainer(RatelStrategy(ssd_paths=[str(swap)], host_memory_limit="64KiB"), max_steps=1, callbacks=[Count()])
    with pytest.raises(RatelPlanError, match=r"host_memory_limit \(64.00 KiB\).*CPU optimizer"):
        t.fit(lm)
    assert steps == []
    assert not swap.exists(), "swap files written before the budget was checked, or the directory the run made left"
    assert all(torch.isfinite(p).all() for p in lm.parameters())


def test_several_ranks_count_their_gradient_exchange() -> None:
    """Each of several ranks sums the window's gradients of every trainable shard in fp32 before reducing it onto its
    owner: 4 bytes per trainable parameter (and a flag per tensor), counted in its host memory and checked against the
    budget; one rank holds none. The ranks of a node split one process's optimizer buffer sets."""
    lm = LM("llama8", n_batches=2)
    optimizer = lm.configure_optimizers()["optimizer"]
    # Where the states and the compute copies live, and the sets reading ahead, chosen, so that a host budget does not
    # move them.
    placed = {"param_cache": "host", "optimizer_states": "ssd", "read_ahead_sets": 0}
    one = lightning_ratel.estimate(lm, precision="32-true", optimizer=optimizer, **placed)
    two = lightning_ratel.estimate(lm, precision="32-true", optimizer=optimizer, ranks=2, accelerator="cpu", **placed)
    assert one.exchange_buffers == 0 and "gradient exchange" not in str(one)
    tensors = sum(1 for p in lm.parameters() if p.requires_grad)
    assert 4 * two.trainable <= two.exchange_buffers <= 4 * (two.trainable + tensors) + 4096 * tensors
    assert two.optimizer_buffers < one.optimizer_buffers
    assert two.host == one.host - one.optimizer_buffers + two.optimizer_buffers + two.exchange_buffers
    assert "gradient exchange" in str(two)
    # A budget that holds one rank's buffers but not those of a rank of two that keeps the window; left to the
    # planner, a rank of two reduces each micro-batch instead (without accumulation, the same sums).
    limit = two.host - two.exchange_buffers // 2 + two.device
    config = RatelConfig(host_memory_limit=limit, gradient_exchange="window", **placed)
    check_host_budget(lm, optimizer, config, None, unified=True)
    with pytest.raises(RatelPlanError, match="gradient exchange"):
        check_host_budget(lm, optimizer, config, None, unified=True, ranks=2)
    need = check_host_budget(lm, optimizer, RatelConfig(host_memory_limit=limit, **placed), None, unified=True,
                             ranks=2)
    assert need is not None and need.exchange is not None and need.exchange.mode == "micro_batch"


def test_the_window_is_weighed_beside_the_buffers_of_stored_compute_copies() -> None:
    """Several ranks reading the compute copies from the swap files with the fp32 masters in host memory (so each
    stores the copies of the others' units) hold two buffers of the largest shard's copy whichever exchange runs: a
    budget the window fits only without them makes the planner reduce each micro-batch, and the check passes
    (weighing the window alone, it kept the window and then refused the budget)."""
    lm = LM("llama8", n_batches=2)
    optimizer = lm.configure_optimizers()["optimizer"]
    placed = {"param_cache": "ssd", "optimizer_states": "host", "read_ahead_sets": 0}

    def check(limit: int, exchange: str = "auto") -> Any:
        config = RatelConfig(host_memory_limit=limit, gradient_exchange=exchange, **placed)
        return check_host_budget(lm, optimizer, config, None, unified=True, ranks=2)

    window = check(1 << 40, "window")
    assert window is not None and window.exchange is not None and window.exchange.mode == "window"
    need = check(window.host + window.device - 1)
    assert need is not None and need.exchange is not None and need.exchange.mode == "micro_batch"
    assert need.host + need.device < window.host + window.device


def test_a_host_budget_the_windows_exceed_reduces_each_micro_batch() -> None:
    """With accumulation, two ranks whose window buffers would exceed the host budget reduce each micro-batch instead
    (the planner's choice, in the estimate and the budget check alike): the exchange then counts at most the largest
    shard's fp32 copies, and the same budget passes; asked for the window, it is refused, naming the way out."""
    lm = LM("llama8", n_batches=2)
    optimizer = lm.configure_optimizers()["optimizer"]
    placed = {"param_cache": "host", "optimizer_states": "ssd", "read_ahead_sets": 0}
    window = lightning_ratel.estimate(lm, precision="32-true", optimizer=optimizer, ranks=2, accelerator="cpu",
                                      accumulate_grad_batches=4, gradient_exchange="window", **placed)
    assert window.exchange is not None and window.exchange.mode == "window"
    limit = window.host + window.device - window.exchange_buffers // 2
    tight = lightning_ratel.estimate(lm, precision="32-true", optimizer=optimizer, ranks=2, accelerator="cpu",
                                     accumulate_grad_batches=4, host_memory_limit=limit, **placed)
    assert tight.exchange is not None and tight.exchange.mode == "micro_batch" and "host budget" in tight.exchange.reason
    largest = max(p.numel() for p in lm.parameters())
    assert largest * 4 <= tight.exchange_buffers < window.exchange_buffers // 2
    assert "micro_batch" in str(tight)
    checked = check_host_budget(lm, optimizer, RatelConfig(host_memory_limit=limit, **placed), None, unified=True,
                                ranks=2, accumulate=4)
    assert checked is not None and checked.exchange is not None and checked.exchange.mode == "micro_batch"
    with pytest.raises(RatelPlanError, match="gradient_exchange='micro_batch'"):
        check_host_budget(lm, optimizer, RatelConfig(host_memory_limit=limit, gradient_exchange="window", **placed),
                          None, unified=True, ranks=2, accumulate=4)
    # Without accumulation as well: the same sums, one reduce per step either way, and the buckets' memory.
    one_batch = lightning_ratel.estimate(lm, precision="32-true", optimizer=optimizer, ranks=2, accelerator="cpu",
                                         host_memory_limit=limit, **placed)
    assert one_batch.exchange is not None and one_batch.exchange.mode == "micro_batch"
    assert one_batch.exchange.reduces_per_step == 1 and one_batch.exchange_buffers == tight.exchange_buffers
