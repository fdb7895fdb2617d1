"""Models as users bring them: their own activation checkpointing, parameters used outside their block."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from lightning_ratel import RatelModelError, RatelStrategy
from lightning_ratel.engine.blocks import discover_blocks
from tests.models import LM, MLP, MODELS, SEQ, VOCAB, cache_off, final_state, max_rel_err, mlp_layers, trainer

# Every unit resident on the device and every activation kept: passes hold every unit from forward to backward.
RESIDENT = {"optimizer_states": "device", "activation_policy": "keep"}


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
        self.layers = mlp_layers(3)
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
def plain(model: str, **kwargs: Any) -> dict[str, torch.Tensor]:
    lm = LM(model)
    t = trainer("auto", **kwargs)
    t.fit(lm)
    return final_state(lm, t)[0]


def _checkpointing(module: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in module.modules())


@pytest.mark.parametrize("plan", [{"plan": "auto"}, {"activation_policy": "recompute"}, RESIDENT],
                         ids=["auto", "recompute", "resident"])
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


@pytest.mark.parametrize("plan", [{"plan": "auto"}, {"activation_policy": "recompute"}, {"activation_policy": "ssd"},
                                  RESIDENT], ids=["auto", "recompute", "ssd", "resident"])
@pytest.mark.parametrize("model", ["self-ckpt-reentrant", "self-ckpt"])
def test_a_models_own_torch_checkpoint_composes(tmp_path: Path, model: str, plan: dict) -> None:
    lm = LM(model)
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], **plan)).fit(lm)
    assert max_rel_err(plain(model), lm.state_dict()) <= 1e-5


class TiedInParent(nn.Module):
    """The head is the embedding matrix, applied in the parent's own forward (no head module)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = mlp_layers(3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        logits = h @ self.embed.weight.T
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


class DiT(nn.Module):
    """diffusers' DiT (the Ratel paper's diffusion workload), which calls ``transformer_blocks[0].norm1.emb`` after
    the blocks ran, trained to predict the noise."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import DiTTransformer2DModel

        self.dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                         num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                         norm_num_groups=2)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        g = torch.Generator().manual_seed(int(input_ids.sum()))
        latents = torch.randn(input_ids.shape[0], 4, 8, 8, generator=g)
        noise = torch.randn(latents.shape, generator=g)
        timestep = input_ids[:, 0] % 10
        out = self.dit(latents + noise, timestep=timestep, class_labels=input_ids[:, 1] % 10).sample
        return type("Out", (), {"loss": nn.functional.mse_loss(out, noise)})()


MODELS.update({"tied-in-parent": TiedInParent, "dit": DiT})


@pytest.mark.parametrize("plan", [{"plan": "auto"}, {"activation_policy": "ssd"}, {"param_cache": "ssd"}, RESIDENT],
                         ids=["auto", "ssd", "param-cache-ssd", "resident"])
@pytest.mark.parametrize("model", ["tied-in-parent", "dit"])
def test_parameters_used_outside_their_block(tmp_path: Path, caplog: pytest.LogCaptureFixture, model: str,
                                              plan: dict) -> None:
    lm = LM(model)
    validating = {"limit_val_batches": 1, "val_check_interval": 2}
    with caplog.at_level(logging.INFO):
        t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], **plan), **validating)
        t.fit(lm)
    assert all(torch.isfinite(p).all() for p in lm.parameters())
    assert max_rel_err(plain(model, **validating), lm.state_dict()) <= 1e-5
    # Found once, in the first forward; later passes page the parameter in with the block that uses it. Passes that
    # hold every unit have nothing to find.
    found = sum("paged in with that block" in r.getMessage() for r in caplog.records)
    assert found == 0 if plan is RESIDENT else found >= 1
    assert os.listdir(tmp_path) == []


class HeadSometimes(TiedInParent):
    """Uses the embedding matrix outside its module only in training passes from the fourth forward on: after the
    first forward of each kind (a sanity-check validation pass runs first) and after the plan was made."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        self.calls += 1
        if self.training and self.calls > 3:
            return super().forward(input_ids, labels)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return type("Out", (), {"loss": h.square().mean()})()


MODELS["head-sometimes"] = HeadSometimes


@pytest.mark.parametrize("plan", [{"plan": "auto"}, {"param_cache": "ssd"}, RESIDENT],
                         ids=["auto", "param-cache-ssd", "resident"])
def test_parameter_used_outside_its_block_only_in_later_passes(tmp_path: Path, plan: dict) -> None:
    later = {"max_steps": 6, "num_sanity_val_steps": 1, "limit_val_batches": 1, "val_check_interval": 2}
    lm = LM("head-sometimes")
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], **plan), **later).fit(lm)
    assert all(torch.isfinite(p).all() for p in lm.parameters())
    assert max_rel_err(plain("head-sometimes", **later), lm.state_dict()) <= 1e-5


class LateBlock(nn.Module):
    """A block that reads a weight of another block (held outside its module tree)."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        object.__setattr__(self, "other", other)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.norm(h @ self.other.weight.T @ self.other.weight)


class BlockFirstRunLater(MLP):
    """A block whose forward first runs in the fourth pass, and reads a parameter of another block there."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.ModuleList([LateBlock(self.layers[0][1])])
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        self.calls += 1
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        if self.calls > 3:
            h = self.late[0](h)
        loss = nn.functional.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


MODELS["block-first-run-later"] = BlockFirstRunLater


@pytest.mark.parametrize("plan", [{}, RESIDENT], ids=["auto", "resident"])
def test_a_block_whose_forward_first_runs_later_is_watched_then(tmp_path: Path, plan: dict) -> None:
    lm = LM("block-first-run-later")
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], **plan), max_steps=6).fit(lm)
    assert all(torch.isfinite(p).all() for p in lm.parameters())
    assert max_rel_err(plain("block-first-run-later", max_steps=6), lm.state_dict()) <= 1e-5


class UsesWeightInStep(LM):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        return loss + 1e-3 * self.model.model.embed_tokens.weight.square().sum()


def test_parameter_used_outside_every_forward_is_refused_before_the_first_update(tmp_path: Path) -> None:
    lm = UsesWeightInStep("llama")
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    with pytest.raises(RatelModelError, match="embed_tokens.weight.*blocks="):
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)])).fit(lm)
    for name, p in lm.named_parameters():
        assert torch.equal(p, before[name]), name


def test_encoder_decoder_cache_is_off_in_the_decoders_own_config(tmp_path: Path) -> None:
    """T5 gives its decoder stack a copy of the config, which alone decides whether the stack fills a KV cache: left
    on, a replay of a decoder block appends its keys a second time and recomputation fails.

    The reference is plain training with the cache off as well: with it on, attention multiplies the cache's
    contiguous copies of keys and values instead of strided views, which rounds differently (3.98e-5 relative after
    2 steps on the 2-core development machine)."""
    lm = LM("t5")
    decoder_config = lm.model.decoder.config
    assert decoder_config is not lm.model.config and decoder_config.use_cache
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="recompute"), max_steps=2).fit(lm)
    assert decoder_config.use_cache and lm.model.config.use_cache
    reference = LM("t5")
    cache_off(reference)
    trainer("auto", max_steps=2).fit(reference)
    assert max_rel_err(reference.state_dict(), lm.state_dict()) == 0.0


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.sigmoid(self.proj(h))


class Stages(nn.Module):
    """Stages of different classes in an ``nn.ModuleList`` the parent iterates (diffusers' ``UNet2DConditionModel``
    ``down_blocks``), before repeated layers; ``proj``'s forward never runs: the parent multiplies by its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.proj = nn.Linear(32, 32, bias=False)
        self.stages = nn.ModuleList([nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)), _Gate()])
        self.layers = mlp_layers(2)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids) @ self.proj.weight.T
        for stage in self.stages:
            h = h + stage(h)
        for layer in self.layers:
            h = h + layer(h)
        loss = nn.functional.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


MODELS["stages"] = Stages


def test_children_of_a_module_list_are_blocks() -> None:
    """A list is never called, so hooks on it never run: each stage in it is a block."""
    names = [b.name for b in discover_blocks(LM("stages"))]
    assert "model.stages" not in names
    assert {"model.stages.0", "model.stages.1", "model.layers.0", "model.layers.1", "model.proj"} <= set(names)


def test_parameter_of_a_block_that_never_runs_is_found(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``proj`` comes right after the embedding in registration order, so prefetching by that order (before a pass
    taught the real one) paged it in just before the parent read it, and its use outside every block went unseen;
    with clipping, whose updates run after backward, a later forward then read its NaN placeholder."""
    clipping = {"gradient_clip_val": 0.05}
    with caplog.at_level(logging.INFO):
        lm = LM("stages")
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host"), **clipping).fit(lm)
    assert any("model.proj.weight is used by the forward of model" in r.getMessage() for r in caplog.records)
    assert max_rel_err(plain("stages", **clipping), lm.state_dict()) <= 1e-5


def test_encoder_output_cast_twice_under_autocast_is_recomputed(tmp_path: Path) -> None:
    """A T5 decoder block projects the encoder's output to keys and to values, and autocast casts it to bf16 for each
    projection. A replay that made this input a graph leaf requiring gradients got the second cast from autocast's
    cache (kept for weights) and diverged from the forward's ops."""
    bf16 = {"precision": "bf16-mixed", "max_steps": 2}
    lm = LM("t5")
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="recompute"), **bf16).fit(lm)
    assert max_rel_err(plain("t5", **bf16), lm.state_dict()) <= 1e-5
