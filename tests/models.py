"""Tiny models and a runner shared by the tests: the same module trained with and without RatelStrategy."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 64
SEQ = 16


def tiny_llama(layers: int = 3, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def tiny_gpt2() -> nn.Module:
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(cfg)


def tiny_t5() -> nn.Module:
    """An encoder-decoder: two lists of blocks, the decoder's with cross-attention, a shared embedding."""
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


def mlp_layers(count: int) -> nn.ModuleList:
    """``count`` residual MLP layers of width 32, for models the tests build by hand."""
    return nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                         for _ in range(count))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = mlp_layers(3)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h).float()
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


class _NormedLayer(nn.Module):
    """A residual MLP layer that normalizes with BatchNorm: running statistics, buffers each training forward updates
    from its own micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(h.transpose(1, 2)).transpose(1, 2))


class BatchNormMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_NormedLayer() for _ in range(3))


class BranchMLP(MLP):
    """Parameters that some ranks' forward does not use (as ``DistributedDataParallel(find_unused_parameters=True)``
    handles): the last of four layers runs on rank 1 only, ``gate`` (beside the embedding and the head) on rank 0
    only, and ``unused`` on no rank."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = mlp_layers(4)
        self.gate = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if i < 3 or rank == 1:
                h = h + layer(h)
        if rank == 0:
            h = h + self.gate(h)
        logits = self.head(h).float()
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


MODELS = {"llama": tiny_llama, "llama8": lambda: tiny_llama(8), "llama16": lambda: tiny_llama(16), "gpt2": tiny_gpt2,
          "t5": tiny_t5, "mlp": MLP, "batchnorm": BatchNormMLP,
          # 19.7M parameters, for measuring memory (no test runs it).
          "llama19m": lambda: tiny_llama(8, hidden=496, heads=8, kv_heads=8),
          "branch": BranchMLP}

# Every tier at once: a block's activations on disk, one recomputed, the rest in host memory.
# The first layer of Llama (layers.0), GPT-2 (h.0) and the MLP on disk, the second recomputed (a pattern that places
# no block is refused, so one written for all three names only what they share).
MIXED_POLICY = {"*.0": "ssd", "*.1": "recompute", "*": "host"}


class LM(L.LightningModule):
    """Wraps a causal LM; AdamW with a no-decay group and a step LR scheduler, like a typical fine-tuning script."""

    sync_dist = False
    """Whether the losses are logged with ``sync_dist=True`` (reduced over the ranks as they are logged)."""
    gather_loss = False
    """Whether the loss adds a term over every rank's logits, gathered with ``self.all_gather(..., sync_grads=True)``
    (as a contrastive loss gathers embeddings), so that backward runs a collective."""

    def __init__(self, model: str = "llama", lr: float = 1e-2, n_batches: int = 12, batch_size: int = 2,
                 eps: float = 1e-8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MODELS[model]()
        self.lr = lr
        self.eps = eps
        self.n_batches = n_batches
        self.batch_size = batch_size

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        output = self.model(input_ids=batch, labels=batch)
        loss = output.loss
        if self.gather_loss:
            gathered = self.all_gather(output.logits.float().mean(dim=(1, 2)), sync_grads=True)
            loss = loss + gathered.square().mean()
        self.log("train_loss", loss, prog_bar=True, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=self.sync_dist)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.model(input_ids=batch, labels=batch).loss)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=self.lr, eps=self.eps)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _loader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, VOCAB, (self.n_batches * self.batch_size, SEQ), generator=g)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader()


def cache_off(module: nn.Module) -> None:
    """Turn the KV cache off in every transformers config of ``module``, as RatelStrategy does during fit."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False


class HostAdamW(torch.optim.AdamW):
    """torch's AdamW stepping fp32 copies of the parameters in host memory with torch's CPU (single-tensor) arithmetic,
    wherever the parameters are: plain training with the arithmetic of RatelStrategy's CPU optimizer, so that on a GPU
    a run under RatelStrategy and a plain run with this optimizer differ only where the training step's path does.

    The hyperparameters (and any scheduler's changes to them) are this optimizer's; ``state_dict`` gives the host
    copies' state under these param groups.
    """

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        host_groups = []
        for group in self.param_groups:
            host = [nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in group["params"]]
            host_groups.append({**group, "params": host, "foreach": False, "fused": None})
        self.host = torch.optim.AdamW(host_groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = []
        for group, host_group in zip(self.param_groups, self.host.param_groups):
            host_group.update({k: v for k, v in group.items() if k not in ("params", "foreach", "fused")})
            for p, h in zip(group["params"], host_group["params"]):
                h.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
                pairs.append((p, h))
        self.host.step()
        for p, h in pairs:
            p.copy_(h)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.host.state_dict()["state"], "param_groups": super().state_dict()["param_groups"]}


class HostAdamLM(LM):
    """:class:`LM` whose optimizer is :class:`HostAdamW` with the same groups and scheduler."""

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        opt = HostAdamW(config["optimizer"].param_groups)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(strategy: Any = "auto", **kwargs: Any) -> L.Trainer:
    defaults = dict(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0)
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)


def final_state(module: L.LightningModule, trainer_: L.Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parameters and optimizer state after fit, as a user would read them."""
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return params, trainer_.optimizers[0].state_dict()


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference over the tensors of ``a`` and ``b``; ``inf`` where either holds a NaN (which
    ``max`` would otherwise skip)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        scale = a[k].abs().max().clamp(min=1e-12)
        err = ((a[k].float() - b[k].float()).abs().max() / scale).item()
        worst = max(worst, err) if not math.isnan(err) else math.inf
    return worst


def compare_states(ref: tuple[dict, dict], got: tuple[dict, dict], tol: float) -> None:
    """Parameters, Adam moments, step counts and param groups of two runs agree within ``tol`` (relative)."""
    assert max_rel_err(ref[0], got[0]) <= tol
    ref_state, got_state = ref[1]["state"], got[1]["state"]
    assert ref_state.keys() == got_state.keys()
    for i in ref_state:
        assert got_state[i]["step"].item() == ref_state[i]["step"].item()
        for key in ("exp_avg", "exp_avg_sq"):
            scale = ref_state[i][key].abs().max().clamp(min=1e-20)
            assert ((ref_state[i][key] - got_state[i][key]).abs().max() / scale).item() <= tol, (i, key)
    assert got[1]["param_groups"] == ref[1]["param_groups"]


def gradscaler_reference(model: str, steps: int, overflow_step: int | None = None) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` fp16 AMP steps written by hand with torch's GradScaler, as plain fp16 training
    does them; the loss of ``overflow_step`` is blown up so that step overflows and is skipped."""
    reference = LM(model)
    config = reference.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    scaler = torch.amp.GradScaler("cpu")
    for step, batch in enumerate(reference.train_dataloader()):
        if step == steps:
            break
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference.model(input_ids=batch, labels=batch).loss
        scaler.scale(loss * 1e30 if step == overflow_step else loss).backward()
        scaler.step(opt)
        scaler.update()
        # Lightning steps the scheduler after a skipped step too.
        sched.step()
        opt.zero_grad()
    return reference.state_dict()
