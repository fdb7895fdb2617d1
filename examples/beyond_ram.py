"""Fine-tune a Llama whose model states are more than twice this machine's RAM, with RatelStrategy.

Mixed-precision Adam training keeps 16 bytes per parameter (fp32 master, two fp32 moments, a compute copy and a
gradient). The default model here has 3.37B parameters, 53.9 GB of model states, and trains on a 24 GiB machine:

- the model is built on the meta device, so it never exists in host memory as a whole; RatelStrategy initializes it
  one block at a time (`param_init_fn`, here the model's own Llama initialization) and writes each block's fp32
  masters straight to the swap files;
- `param_cache="ssd"`: the compute copies are read from the swap files whenever a block runs, instead of being
  cached in host memory (in fp32 training the fp32 master is the compute copy: one page-in and the CPU AdamW share
  its bytes, the backward's read where updates overlap backward, and on a CPU, where they run after it, the next
  forward's page-in copies the master the update has just written);
- gradients go into a few pooled shard buffers that the CPU AdamW gives back after each block's update, while
  backward still runs; in fp32 (this example on a CPU), half of that budget keeps backward's page-ins of masters
  for updates that run behind it (their moments go through the same disk), so they copy the master instead of
  reading it again;
- the optimizer states (fp32 master and moments, in two slots) of the first blocks stay in host memory as far as
  three quarters of the available memory hold them besides the run's buffers (`optimizer_states="auto"`), the rest in
  the swap files (`--optimizer-states ssd`, or a `--host-memory-limit`, keeps a smaller model's states there too); the
  summary compares each step's swap-file traffic with the least the plan needs (the states read and written once,
  the compute copies read for forward and for backward unless shared) and says how busy the disk was, in backward
  and in the rest of the step;
- `activation_policy="recompute"`: only each block's input is kept between forward and backward;
- no checkpoint is written (it would gather 12 bytes per parameter in host memory), and the trained parameters are
  not copied back into the module at the end (RatelStrategy warns and leaves NaN placeholders).

To show learning within a few steps, every step trains on the same short window of text (Genesis, from
`examples/data`) with a fairly high learning rate: the loss going down means the model memorizes that window, nothing
more. On a CPU a step takes on the order of a minute: fp32 compute on a few cores, 12 bytes per parameter of
optimizer state read and written per step, and the model's compute copies read twice (forward and backward).

Run from the repository root:

    .venv/bin/python examples/beyond_ram.py --swap-dir /mnt/nvme0/ratel-swap
    .venv/bin/python examples/beyond_ram.py --swap-dir /mnt/nvme0/ratel-swap --devices 2   # two GPUs, data parallel
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from text_data import TextDataModule
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ratel import RatelProfiler, RatelStrategy

GIB = 2**30
# With several ranks each process runs this script: the first one reports.
say = rank_zero_only(print)
DEFAULT_SWAP = Path("outputs") / "beyond-ram-swap"


class RepeatedWindowLM(L.LightningModule):
    """A causal LM trained with plain AdamW; nothing in it knows about Ratel."""

    def __init__(self, config: LlamaConfig, lr: float) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(config)
        self.lr = lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, batch_size=batch.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class MemoryWatch:
    """Samples the resident set size (VmRSS) of this process in a background thread and keeps the maximum."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-watch", daemon=True)

    @staticmethod
    def current() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            self._stop.wait(self.interval)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class StepReport(L.Callback):
    """Prints each step's loss, wall time, resident memory and swap-store traffic, and keeps them for the summary."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self._started = 0.0
        self._io = (0, 0)
        self.disk_bytes = 0
        self.planned: dict[str, int] = {}
        self.states: dict[str, int] = {}
        # The swap store's counters (read, written, shared) at the start of each step: a step's write-backs land
        # during the next one, so a step is measured from its start to the next one's.
        self.marks: list[tuple[int, int, int]] = []
        # Every rank's RSS at the end of each step, and every rank's swap-file bytes (one node's ranks: their sums are
        # the node's, to hold against one rank's run).
        self.rank_rss: list[list[int]] = []
        self.rank_disk_bytes: list[int] = []
        self.busy: list[float] = []
        # Per step: the disk's busy share of backward, and of the rest of the step.
        self.busy_backward: list[tuple[float, float]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.planned = trainer.strategy.step_traffic()
        self.states = trainer.strategy.state_traffic()

    def _store_io(self, trainer: L.Trainer) -> tuple[int, int]:
        io = trainer.strategy.io_bytes()
        return io["read"], io["written"]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._started = time.perf_counter()
        self._io = self._store_io(trainer)
        io = trainer.strategy.io_bytes()
        self.marks.append((io["read"], io["written"], io["shared"]))

    @staticmethod
    def _every_rank(trainer: L.Trainer, value: int) -> list[int]:
        """``value`` of every rank (a collective: every rank calls it at the same point)."""
        gathered = trainer.strategy.all_gather(torch.tensor([value], dtype=torch.int64))
        return [int(v) for v in gathered.reshape(-1).tolist()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = float(outputs["loss"])
        seconds = time.perf_counter() - self._started
        read, written = (now - before for now, before in zip(self._store_io(trainer), self._io))
        row = {"loss": loss, "seconds": seconds, "rss": MemoryWatch.current(), "read": read, "written": written}
        self.rows.append(row)
        self.rank_rss.append(self._every_rank(trainer, row["rss"]))
        node = f" (the {trainer.world_size} ranks {sum(self.rank_rss[-1]) / GIB:.2f})" if trainer.world_size > 1 else ""
        say(
            f"step {len(self.rows)}  loss {loss:.4f}  {seconds:6.1f} s  RSS {row['rss'] / GIB:5.2f} GiB{node}  "
            f"store read {read / GIB:5.1f} GiB, written {written / GIB:5.1f} GiB",
            flush=True,
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Read before teardown removes the swap files.
        self.disk_bytes = trainer.strategy.byte_placement()["disk"]
        self.rank_disk_bytes = self._every_rank(trainer, self.disk_bytes)
        profiler = next((c for c in trainer.callbacks if isinstance(c, RatelProfiler)), None)
        if profiler is not None:
            self.busy = [s["ssd"] / s["wall"] for s in profiler.steps if s.get("wall")]
            self.busy_backward = [
                (s["ssd_backward"] / s["backward"], (s["ssd"] - s["ssd_backward"]) / (s["wall"] - s["backward"]))
                for s in profiler.steps if 0 < s.get("backward", 0.0) < s.get("wall", 0.0)]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with the module docstring as written and every argument's default."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The Llama's sizes (defaults: 3.37B parameters) and the training window's length."""
    parser.add_argument("--layers", type=int, default=28, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=3072, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=8192, help="MLP intermediate size")
    parser.add_argument("--heads", type=int, default=24, help="attention heads (as many key/value heads)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """The Llama that :func:`add_model_arguments` describes."""
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq_len + 1, 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def memory_total() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def training_window(seq_len: int) -> torch.Tensor:
    """The first window of seq_len + 1 tokens of Genesis (the model shifts labels itself)."""
    data = TextDataModule(seq_len=seq_len, batch_size=1)
    data.prepare_data()
    data.setup()
    assert data.train_set is not None
    return data.train_set[0]["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--swap-dir", type=Path, default=DEFAULT_SWAP, help="directory for the swap files")
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=4, help="training steps")
    parser.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate")
    parser.add_argument("--activation-policy", default="recompute", choices=["keep", "host", "ssd", "recompute"],
                        help="where saved activations go (RatelStrategy's activation_policy)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initialization, which happens during fit")
    parser.add_argument("--optimizer-states", default="auto", choices=["auto", "host", "ssd"],
                        help="where the fp32 masters and moments live (RatelStrategy's optimizer_states)")
    parser.add_argument("--host-memory-limit", default=None,
                        help="host memory the plan may use, such as 4GiB (RatelStrategy's host_memory_limit); "
                             "a smaller model then still keeps part of its states in the swap files")
    parser.add_argument("--devices", type=int, default=1,
                        help="data-parallel ranks (on the CPU, processes sharing its cores); the figures are rank "
                             "0's, each rank moving its own states and every compute copy through its own swap files, "
                             "and the summary adds up every rank's RSS and swap files")
    parser.add_argument("--read-ahead-sets", type=int, default=None,
                        help="CPU optimizer buffer sets beyond the pipeline's three, reading states ahead of "
                             "their updates (RatelStrategy's read_ahead_sets); default: planned")
    args = parser.parse_args()
    L.seed_everything(args.seed)

    config = llama_config(args)
    # On the meta device the model takes no memory; RatelStrategy materializes it block by block.
    with torch.device("meta"):
        module = RepeatedWindowLM(config, args.lr)
    params = sum(p.numel() for p in module.parameters())
    ram = memory_total()
    say(f"Llama: {params:,} parameters; model states 16 B x P = {16 * params / 1e9:.1f} GB = "
        f"{16 * params / ram:.2f} x this machine's RAM ({ram / GIB:.1f} GiB)")

    created = not args.swap_dir.exists()
    args.swap_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.swap_dir).free
    say(f"swap files in {args.swap_dir} (fp32 master and two Adam moments: {12 * params / 1e9:.1f} GB; "
        f"{free / 1e9:.1f} GB free there)")

    window = training_window(args.seq_len)
    # Every step sees the same window: repeated memorization shows learning within a handful of steps.
    loader = DataLoader([window] * args.steps * args.devices, batch_size=1)
    on_gpu = torch.cuda.is_available()
    strategy = RatelStrategy(
        ssd_paths=[str(args.swap_dir)],
        activation_policy=args.activation_policy,
        param_cache="ssd",
        optimizer_states=args.optimizer_states,
        host_memory_limit=args.host_memory_limit,
        read_ahead_sets=args.read_ahead_sets,
        param_init_fn=module.model._init_weights,
    )
    report = StepReport()
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=args.devices,
        strategy=strategy,
        precision="bf16-mixed" if on_gpu else "32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[report],
    )
    started = time.perf_counter()
    try:
        with MemoryWatch() as watch:
            trainer.fit(module, train_dataloaders=loader)
    finally:
        if created and args.swap_dir.exists() and not any(args.swap_dir.iterdir()):
            # Ranks started together (torchrun) may each have created it.
            with contextlib.suppress(FileNotFoundError):
                args.swap_dir.rmdir()
    total = time.perf_counter() - started
    peak_rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    losses = [row["loss"] for row in report.rows]
    steady = [row["seconds"] for row in report.rows[1:]] or [report.rows[0]["seconds"]]

    say()
    say(f"losses: {', '.join(f'{x:.4f}' for x in losses)}")
    say(f"peak RSS: {peak_rusage / GIB:.2f} GiB (getrusage), {watch.peak / GIB:.2f} GiB (sampled VmRSS)")
    if args.devices > 1 and report.rank_rss:
        last = report.rank_rss[-1]
        say(f"RSS of the {args.devices} ranks at the end of the last step: {sum(last) / GIB:.2f} GiB together "
            f"({', '.join(f'{r / GIB:.2f}' for r in last)} GiB; hold the sum against a run with --devices 1)")
    say(f"wall time per step: first {report.rows[0]['seconds']:.1f} s, then {sum(steady) / len(steady):.1f} s "
        f"on average; {total:.0f} s for the whole run including setup")
    if report.planned and len(report.marks) > 2:
        # Between the starts of steps, after the first two and up to the last: the first step has no moments to read
        # yet, and its updates run after its backward, so more of its write-backs land in the second step than a
        # later step's do in the next; the last one's land after it.
        skip = 2 if len(report.marks) > 3 else 1
        first, last = report.marks[skip], report.marks[-1]
        steps = len(report.marks) - 1 - skip
        read, written, shared = ((b - a) / steps for a, b in zip(first, last))
        say(f"swap-file traffic per step after the first: read {read / GIB:.2f} GiB, written {written / GIB:.2f} "
            f"GiB, and {shared / GIB:.2f} GiB copied from another read's memory instead of read again; the plan's "
            f"minimum: read {report.planned['read'] / GIB:.2f} GiB, written {report.planned['written'] / GIB:.2f} "
            f"GiB (read {read / max(report.planned['read'], 1):.2f}x, written "
            f"{written / max(report.planned['written'], 1):.2f}x that): the model states read and written once "
            f"({report.states['read'] / GIB:.2f} GiB, {report.states['written'] / GIB:.2f} GiB) and the compute "
            "copies read for forward and for backward, each fp32 master's update sharing one page-in's bytes, and "
            "the other page-in's too where a buffer set read the states ahead (activations on the SSD come on top)")
    if len(report.busy) > 1:
        busy = report.busy[1:]
        # Each step's too: the first steps after the first still touch buffers the run allocated (slow on fresh pages).
        say(f"disk busy: {100 * sum(busy) / len(busy):.0f}% of each step's wall time on average after the first "
            f"(steps 2-{len(report.busy)}: {', '.join(f'{100 * b:.0f}%' for b in busy)})")
    if len(report.busy_backward) > 1:
        in_backward, outside = (sum(column) / len(column) for column in zip(*report.busy_backward[1:]))
        say(f"disk busy by phase after the first step: {100 * in_backward:.0f}% of backward, {100 * outside:.0f}% of "
            "the rest (the forward, and the updates after backward that it overlaps)")
    if args.devices > 1 and report.rank_disk_bytes:
        say(f"disk of the {args.devices} ranks: {sum(report.rank_disk_bytes):,} bytes in swap files together "
            f"({', '.join(f'{b:,}' for b in report.rank_disk_bytes)})")
    left = sorted(os.listdir(args.swap_dir)) if args.swap_dir.exists() else None
    if left is not None and args.devices > 1:
        # This rank's own: the others may still be closing theirs.
        left = [name for name in left if name.startswith("ratel-rank0.")]
    say(f"disk: {report.disk_bytes:,} bytes in swap files during training; swap files left: "
        f"{'none (directory removed)' if left is None else left or 'none'}")


if __name__ == "__main__":
    main()
