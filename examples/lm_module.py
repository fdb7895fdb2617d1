"""A small Llama causal LM as an ordinary LightningModule: nothing in it knows about Ratel."""

from __future__ import annotations

from functools import partial

import lightning as L
import torch
from torchmetrics.text import Perplexity
from transformers import LlamaConfig, LlamaForCausalLM


def linear_warmup(step: int, warmup_steps: int) -> float:
    """LR multiplier: rises linearly to 1 over `warmup_steps` optimizer steps, then stays at 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


class CausalLMModule(L.LightningModule):
    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_size: int = 688,
        max_seq_len: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            intermediate_size=intermediate_size,
            # Samples carry max_seq_len + 1 tokens: max_seq_len targets after the internal shift.
            max_position_embeddings=max_seq_len + 1,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        # A private RNG stream makes the initial weights depend on `seed` alone, not on
        # whatever consumed the global generator before this module was built.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = LlamaForCausalLM(config)
        # Labels of -100 (none in the example data) would be padding, as for the model's own loss.
        self.val_perplexity = Perplexity(ignore_index=-100)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.model(input_ids=input_ids, labels=labels)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch["input_ids"], batch["labels"]).loss
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch["input_ids"], batch["labels"])
        batch_size = batch["input_ids"].shape[0]
        self.log("val_loss", out.loss, prog_bar=True, batch_size=batch_size)
        # The model predicts token t + 1 from position t: logits and labels shifted as its loss shifts them.
        self.val_perplexity(out.logits[:, :-1].float(), batch["labels"][:, 1:])
        self.log("val_perplexity", self.val_perplexity, prog_bar=True, batch_size=batch_size)
        return out.loss

    def configure_optimizers(self):
        decay, no_decay = [], []
        for param in self.parameters():
            if not param.requires_grad:
                continue
            # Norm weights and biases are 1-D; decaying them only fights the normalization.
            (decay if param.ndim >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(linear_warmup, warmup_steps=self.hparams.warmup_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
