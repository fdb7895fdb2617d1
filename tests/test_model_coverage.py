"""Models as users bring them: their own activation checkpointing, parameters used outside their block."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from lightning_ratel import RatelStrategy
from tests.models import LM, MODELS, SEQ, VOCAB, final_state, max_rel_err, trainer


def tiny_neox() -> nn.Module:
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=SEQ)
    return GPTNeoXForCausalLM(cfg)


class SelfCheckpointing(nn.Module):
    """A model that wraps each layer in ``torch.utils.checkpoint`` itself."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.reentrant)
        loss = nn.functional.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


MODELS.update({
    "neox": tiny_neox,
    "self-ckpt-reentrant": functools.partial(SelfCheckpointing, True),
    "self-ckpt": functools.partial(SelfCheckpointing, False),
})


@functools.lru_cache(maxsize=None)
def plain(model: str) -> dict[str, torch.Tensor]:
    lm = LM(model)
    t = trainer("auto")
    t.fit(lm)
    return final_state(lm, t)[0]


def _checkpointing(module: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in module.modules())


@pytest.mark.parametrize("plan", [{"plan": "auto"}, {"activation_policy": "recompute"}], ids=["auto", "recompute"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("model", ["llama", "neox"])
def test_transformers_gradient_checkpointing_is_off_during_fit(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                model: str, reentrant: bool, plan: dict) -> None:
    lm = LM(model)
    lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    seen: list[bool] = []
    lm.model.register_forward_pre_hook(lambda m, a, k: seen.append(_checkpointing(m)), with_kwargs=True)
    with caplog.at_level(logging.INFO):
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)], **plan)).fit(lm)
    assert seen and not any(seen)
    assert _checkpointing(lm.model), "the model's checkpointing is back on after fit"
    assert sum("gradient checkpointing" in r.getMessage() for r in caplog.records) == 1
    assert max_rel_err(plain(model), lm.state_dict()) <= 1e-5


@pytest.mark.parametrize("plan", [{"plan": "auto"}, {"activation_policy": "recompute"}, {"activation_policy": "ssd"}],
                         ids=["auto", "recompute", "ssd"])
@pytest.mark.parametrize("model", ["self-ckpt-reentrant", "self-ckpt"])
def test_a_models_own_torch_checkpoint_composes(tmp_path: Path, model: str, plan: dict) -> None:
    lm = LM(model)
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], **plan)).fit(lm)
    assert max_rel_err(plain(model), lm.state_dict()) <= 1e-5
