"""Lightning's own callbacks and Tuner under RatelStrategy give what they give under plain Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning, StochasticWeightAveraging, Timer
from lightning.pytorch.tuner import Tuner

from lightning_ratel import RatelConfigError, RatelStrategy
from tests.models import LM, final_state, max_rel_err, trainer


def _both(tmp_path: Path, run: Any) -> tuple[Any, Any]:
    """``run(strategy)`` under plain Lightning and under RatelStrategy."""
    return run("auto"), run(RatelStrategy(ssd_paths=[str(tmp_path)]))


def test_lr_find_like_plain(tmp_path: Path) -> None:
    def run(strategy: Any) -> tuple[float, dict]:
        module = LM("llama")
        t = trainer(strategy, max_steps=-1, max_epochs=1)
        finder = Tuner(t).lr_find(module, num_training=6, min_lr=1e-4, max_lr=1e-1)
        assert finder is not None
        # The tuner put the model back as it found it; fit trains from there.
        t.fit(module)
        return finder.results["loss"], final_state(module, t)[0]

    (plain_losses, plain), (losses, state) = _both(tmp_path, run)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert max_rel_err(plain, state) <= 1e-5


class BatchSizeLM(LM):
    def __init__(self) -> None:
        super().__init__("llama", n_batches=16)

    def _loader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, 64, (self.n_batches * 2, 16), generator=g)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


@pytest.mark.parametrize("method", ["fit", "validate"])
def test_scale_batch_size_like_plain(tmp_path: Path, method: str) -> None:
    def run(strategy: Any) -> tuple[int, dict]:
        module = BatchSizeLM()
        t = trainer(strategy, max_steps=-1, max_epochs=1, limit_val_batches=2)
        size = Tuner(t).scale_batch_size(module, method=method, mode="power", steps_per_trial=1, max_trials=3)
        t.fit(module)
        return size, final_state(module, t)[0]

    (plain_size, plain), (size, state) = _both(tmp_path, run)
    assert size == plain_size
    assert max_rel_err(plain, state) <= 1e-5


def test_stochastic_weight_averaging_like_plain(tmp_path: Path) -> None:
    def run(strategy: Any) -> dict:
        module = LM("llama", n_batches=3)
        t = trainer(strategy, max_steps=-1, max_epochs=4,
                    callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2)])
        t.fit(module)
        return final_state(module, t)[0]

    plain, state = _both(tmp_path, run)
    assert max_rel_err(plain, state) <= 1e-5


def test_model_pruning_with_the_lottery_ticket_like_plain(tmp_path: Path) -> None:
    def run(strategy: Any) -> dict:
        module = LM("llama", n_batches=3)
        # Pruned (and reset to the first values) once, after the first epoch; the second trains the winning ticket.
        pruning = ModelPruning("l1_unstructured", amount=lambda epoch: 0.5 if epoch == 0 else 0,
                               use_lottery_ticket_hypothesis=True,
                               parameters_to_prune=[(module.model.model.layers[0].mlp.up_proj, "weight"),
                                                    (module.model.lm_head, "weight")],
                               make_pruning_permanent=False, verbose=0)
        t = trainer(strategy, max_steps=-1, max_epochs=2, callbacks=[pruning])
        t.fit(module)
        return final_state(module, t)[0]

    plain, state = _both(tmp_path, run)
    assert "model.lm_head.weight_orig" in state
    assert max_rel_err(plain, state) <= 1e-5


def test_timer_stops_a_short_fit_like_plain(tmp_path: Path) -> None:
    """A Timer with room to spare lets the fit run every step, as under plain Lightning (the first step used to
    include the hardware measurement)."""
    steps = {}
    for name, strategy in (("plain", "auto"), ("ratel", RatelStrategy(ssd_paths=[str(tmp_path)]))):
        t = trainer(strategy, max_steps=2, callbacks=[Timer(duration={"seconds": 3600})])
        t.fit(LM("llama"))
        steps[name] = t.global_step
    assert steps == {"plain": 2, "ratel": 2}


def test_model_checkpoint_saves_a_connected_model_without_fit(tmp_path: Path) -> None:
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path / "swap")]), enable_checkpointing=True,
                default_root_dir=tmp_path)
    t.strategy.connect(module)
    t.save_checkpoint(tmp_path / "model.ckpt")
    saved = torch.load(tmp_path / "model.ckpt", weights_only=False)["state_dict"]
    assert max_rel_err({k: v for k, v in module.state_dict().items()}, saved) == 0


class Backbone(LM):
    """:class:`LM` whose optimizer holds the trainable parameters only, as BackboneFinetuning asks."""

    def __init__(self) -> None:
        super().__init__("llama", n_batches=3)
        self.backbone = self.model.model

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=self.lr)


def test_backbone_finetuning_is_refused_with_the_reason_when_it_unfreezes(tmp_path: Path) -> None:
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=-1, max_epochs=2, callbacks=[finetuning])
    with pytest.warns(UserWarning, match="BackboneFinetuning unfreezes"), \
            pytest.raises(RatelConfigError, match=r"add_param_group.*fit of its own"):
        t.fit(Backbone())
    # The optimizer is the user's again.
    assert "add_param_group" not in t.optimizers[0].__dict__
