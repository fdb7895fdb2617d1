"""Train a small Llama on Genesis with every Ratel offload tier active, then show where the bytes are.

Activations go to device, host, SSD or recompute per layer; optimizer states are split between host memory and the
swap files; compute copies live in the host cache.

Run from the repository root: `make demo`, or `.venv/bin/python examples/demo.py`.
`--strategy auto` runs the same training with Lightning's own strategy, for comparison.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from rich.console import Console
from rich.table import Table

from lightning_ratel import RatelStrategy, estimate
from lightning_ratel.plan.states import HOST_SHARE
from lm_module import CausalLMModule
from text_data import TextDataModule

OUTPUTS = Path("outputs")

# Block names are module paths inside the LightningModule (self.model.model.layers.N); the first
# pattern that matches wins, so the list below puts each offload tier on a different layer.
ACTIVATION_POLICY = {
    "*layers.0": "host",
    "*layers.1": "ssd",
    "*layers.2": "recompute",
    "*": "host",
}


class DemoReport(L.Callback):
    """Prints the loss and throughput every `every` optimizer steps and a summary at the end."""

    def __init__(self, console: Console, every: int = 10) -> None:
        self.console = console
        self.every = every
        self.first_loss: float | None = None
        self.tokens = 0
        self.window_tokens = 0
        self.started = 0.0
        self.window_started = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, RatelStrategy):
            placements = trainer.strategy.activation_placements()
            self.console.print(tier_table(list(placements), list(placements.values())))
            states = trainer.strategy.state_placement()
            self.console.print("Optimizer states (fp32 masters and moments, both slots): "
                               + ", ".join(f"{tier} {size / 2**20:.1f} MiB" for tier, size in states.items()))
        self.started = self.window_started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        tokens = batch["input_ids"].numel()
        self.tokens += tokens
        self.window_tokens += tokens
        step = trainer.global_step
        if self.first_loss is None:
            self.first_loss = float(trainer.callback_metrics["train_loss"])
        if step % self.every != 0 and step != trainer.max_steps:
            return
        # Reading the loss waits for the device, so the clock is read after it.
        loss = float(trainer.callback_metrics["train_loss"])
        now = time.perf_counter()
        rate = self.window_tokens / (now - self.window_started)
        self.console.print(f"step {step:4d}  train_loss {loss:7.4f}  {rate:9.0f} tokens/s")
        self.window_tokens = 0
        self.window_started = now

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        val_loss = float(trainer.callback_metrics["val_loss"])
        perplexity = float(trainer.callback_metrics["val_perplexity"])
        self.console.print(f"step {trainer.global_step:4d}  val_loss   {val_loss:7.4f}  perplexity {perplexity:9.2f}")
        # Validation time is not training throughput.
        self.window_started = time.perf_counter()
        self.window_tokens = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elapsed = time.perf_counter() - self.started
        final_loss = float(trainer.callback_metrics["train_loss"])
        self.console.print(
            f"\ntrain_loss: first {self.first_loss:.4f} -> final {final_loss:.4f} "
            f"after {trainer.global_step} steps; {self.tokens / elapsed:.0f} tokens/s overall"
        )
        # Called here, not after fit(), because teardown releases the engine and its swap files.
        if isinstance(trainer.strategy, RatelStrategy):
            self.console.print(placement_table(trainer.strategy.byte_placement()))


def tier_table(blocks: list[str], placements: list[str | dict[str, str]]) -> Table:
    """Where each block's saved activations go (the blocks' shared module path left out)."""
    prefix = os.path.commonprefix(blocks).rpartition(".")[0]
    table = Table(title="Activations saved for backward, per block" + (f" of {prefix}.*" if prefix else ""))
    table.add_column("block")
    table.add_column("tier")
    for name, placement in zip(blocks, placements):
        tiers = placement if isinstance(placement, str) else ", ".join(sorted(set(placement.values())))
        table.add_row(name[len(prefix):].lstrip(".") or name, tiers)
    return table


def placement_table(placement: dict[str, int]) -> Table:
    # "pinned" is the part of "host" that is page-locked, not a tier of its own.
    tiers = {tier: size for tier, size in placement.items() if tier != "pinned"}
    total = sum(tiers.values())
    table = Table(title="Where the training state lives now",
                  caption="More than the start line said: training added room in the swap files for the activations "
                          "sent to the SSD, and host buffers for activations, page-ins and gradients.")
    table.add_column("tier")
    table.add_column("bytes", justify="right")
    table.add_column("MiB", justify="right")
    table.add_column("share", justify="right")
    for tier, size in tiers.items():
        share = f"{100 * size / total:.1f}%" if total else "-"
        name = f"host (pinned {size and placement.get('pinned', 0) / size:.0%})" if tier == "host" else tier
        table.add_row(name, f"{size:,}", f"{size / 2**20:.1f}", share)
    table.add_row("total", f"{total:,}", f"{total / 2**20:.1f}", "", style="bold")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["ratel", "auto"], default="ratel")
    parser.add_argument("--max-steps", type=int, default=50)
    args = parser.parse_args()

    console = Console()
    L.seed_everything(0, workers=True)
    on_gpu = torch.cuda.is_available()
    data = TextDataModule()
    model = CausalLMModule(vocab_size=data.vocab_size, max_seq_len=data.seq_len)
    params = sum(p.numel() for p in model.parameters())
    precision = "bf16-mixed" if on_gpu else "32-true"
    if args.strategy == "ratel":
        # The host memory limit stands in for a machine whose RAM holds only part of the optimizer states: what the
        # run's buffers take, plus about half of the states (24 bytes per parameter), within the share of the limit
        # the states may use. The first blocks' states stay in host memory, the rest go to the swap files.
        buffers = estimate(model, precision=precision, optimizer_states="ssd").host
        limit = int((buffers + 12 * params) / HOST_SHARE)
        # Created by the strategy when missing; the swap files in it are removed when training ends.
        strategy = RatelStrategy(ssd_paths=[str(OUTPUTS / "demo-swap")], prefetch_depth=1,
                                 activation_policy=ACTIVATION_POLICY, host_memory_limit=limit)
    else:
        strategy = "auto"
    console.print(f"Llama with {params / 1e6:.2f}M parameters, strategy {args.strategy}, {'GPU' if on_gpu else 'CPU'}")

    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=args.max_steps,
        gradient_clip_val=1.0,
        # Validate by optimizer step, across epoch boundaries, rather than at epoch ends.
        val_check_interval=25,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(OUTPUTS, name="demo"),
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[DemoReport(console)],
    )
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
