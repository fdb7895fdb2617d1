"""Data-parallel throughput: RatelStrategy on N processes against Lightning's ``ddp`` on N and RatelStrategy on one.

Each configuration runs in a subprocess of its own (Lightning's launcher starts the other ranks) and trains a
transformers Llama on random tokens for ``--warmup`` + ``--steps`` optimizer steps, each rank with micro-batches of
``--batch-size``; the timed steps' global tokens per second are reported (rank 0's clock, after
``strategy.synchronize()`` where the strategy has one). On the CPU (the default) the ranks run on gloo and share the
machine's cores, so the figure says what the machinery costs more than what more devices gain; ``--accelerator gpu``
runs the same on a GPU machine (NCCL for Lightning's own collectives).

    python benchmarks/data_parallel.py --devices 2 --layers 4 --hidden 256 --steps 5

``--exchanges window,micro_batch --accumulate 2`` runs RatelStrategy on N processes once per gradient exchange (and
neither one rank nor ``ddp``): seconds per optimizer step, and rank 0's engine host bytes and those of its gradient
exchange at the end of fit. ``--param-cache ssd`` pages RatelStrategy's compute copies from the swap files instead of
a host cache (every rank then keeps and reads its own); ``--states device`` keeps every state on the devices (each
unit's on its owner's), the configuration to set against ``ddp`` where the model fits each GPU. The last line gives
each run's tokens per second over ``ddp``'s, where ``ddp`` ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ratel import RatelStrategy


class _LM(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                             max_position_embeddings=args.seq, use_cache=False)
        self.model = LlamaForCausalLM(config)
        self.args = args

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        a = self.args
        count = (a.warmup + a.steps) * a.batch_size * a.devices
        data = torch.randint(0, a.vocab, (count, a.seq), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=a.batch_size)


class _Clock(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.seconds = 0.0
        self.held: dict[str, int] = {}

    def _sync(self, trainer: L.Trainer) -> None:
        getattr(trainer.strategy, "synchronize", lambda: None)()
        trainer.strategy.barrier()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            self._sync(trainer)
            self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._sync(trainer)
        if self.start is not None:
            self.seconds = time.perf_counter() - self.start
        self.held = _held(trainer)


def _held(trainer: L.Trainer) -> dict[str, int]:
    """The engine's host bytes and, with several ranks, its gradient exchange's (empty for ``ddp``)."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is None or engine.adam is None:
        return {}
    held = {"host": trainer.strategy.byte_placement()["host"]}
    local = getattr(engine.adam, "local", None)
    if local is not None:
        held["exchange"] = engine.adam.host_buffer_bytes - local.host_buffer_bytes
    return held


def _worker(args: argparse.Namespace) -> None:
    swap = Path(args.out) / "swap"
    exchange = {"gradient_exchange": args.exchange} if args.exchange else {}
    strategy: Any = (RatelStrategy(ssd_paths=[str(swap)], param_cache=args.param_cache, checkpoint_format="full",
                                   optimizer_states=args.states, **exchange)
                     if args.strategy == "ratel" else "ddp")
    clock = _Clock(args.warmup)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        precision="bf16-mixed" if args.accelerator == "gpu" else "32-true",
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                        accumulate_grad_batches=args.accumulate)
    trainer.fit(_LM(args))
    if trainer.global_rank == 0:
        tokens = args.steps * args.accumulate * args.batch_size * args.devices * args.seq
        result = {"tokens_per_s": tokens / clock.seconds, "s_per_step": clock.seconds / args.steps}
        result.update({f"{k}_bytes": v for k, v in clock.held.items()})
        (Path(args.out) / "result.json").write_text(json.dumps(result))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="ranks of the data-parallel runs (default 2)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="micro-batch of each rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--param-cache", default="host", choices=["host", "ssd"], help="RatelStrategy's param_cache")
    parser.add_argument("--states", default="auto", choices=["auto", "host", "ssd", "device"],
                        help="RatelStrategy's optimizer_states (device: each rank's share on its GPU, for a model that "
                             "fits it)")
    parser.add_argument("--exchanges", default="",
                        help="comma-separated gradient exchanges to run RatelStrategy on N ranks with, alone")
    parser.add_argument("--exchange", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("STRATEGY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.strategy, args.out = args.worker
        _worker(args)
        return
    runs = ([("ratel", args.devices, exchange) for exchange in args.exchanges.split(",")] if args.exchanges else
            [("ratel", 1, ""), ("ratel", args.devices, ""), ("ddp", args.devices, "")])
    rates: dict[str, float] = {}
    for strategy, devices, exchange in runs:
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, __file__, "--worker", strategy, out, "--devices", str(devices),
                       f"--exchange={exchange}"]
            command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                        if k not in ("devices", "worker", "exchange", "exchanges")]
            subprocess.run(command, check=True)
            result = json.loads((Path(out) / "result.json").read_text())
        held = "".join(f", {k.removesuffix('_bytes')} {v / 2**20:.1f} MiB" for k, v in result.items()
                       if k.endswith("_bytes"))
        name = f"{strategy} x{devices}{' ' + exchange if exchange else ''}"
        rates[name] = result["tokens_per_s"]
        print(f"{name:>7}: {result['tokens_per_s']:10.1f} tokens/s, {result['s_per_step']:.3f} s/step{held}",
              flush=True)
    ddp = rates.pop(f"ddp x{args.devices}", None)
    if ddp:
        print("tokens/s over ddp's: " + ", ".join(f"{name} {rate / ddp:.2f}" for name, rate in rates.items()))


if __name__ == "__main__":
    main()
