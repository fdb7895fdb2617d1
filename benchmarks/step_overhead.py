"""Training-step time of the demo model under RatelStrategy against plain Lightning on the same machine.

Both runs train the demo's Llama (``examples/lm_module.py``) on the shipped Genesis text (``examples/text_data.py``)
from the same initial weights and the same batches, in ``32-true`` precision with torch.optim.AdamW. The baseline is
Lightning's default strategy with everything in memory; the contender is ``RatelStrategy`` with its optimizer states
where ``optimizer_states`` puts them (host memory for this model by default; ``--ratel-config '{"optimizer_states":
"ssd"}'`` puts them in swap files under ``--swap-dir``; fp32 masters stay in the host cache, where they are the compute
copies), parameters paged per block and activations placed as ``--ratel-config`` says (by default planned by the
profiler, as a user gets it; its two profiled steps fall in the warm-up). Runs take turns (plain, Ratel, plain, ...)
so that changing machine load hits both alike.

The clock starts when the batch after the ``--warmup`` untimed steps starts and stops when the batch after the timed
``--steps`` starts, so every timed step is a whole step, Ratel's optimizer work that overlaps the next forward
included. tokens/s counts input tokens (batch size times window length). The CPU time of the whole process (all
threads) over the same span is printed too: on a machine shared with other work it shows how much computing each
run did, which wall time alone mixes up with waiting for a core. So are counts that do not depend on the load: Ratel's
updates per timed step by how they ran (overlapped with backward, deferred to its end, speculative ones redone or
dropped), the bytes its swap store wrote and read (each checksummed), and what its store's I/O threads did (their
context switches, read and write calls and CPU time, from ``/proc`` on Linux; only the involuntary switches depend on
the load): on a CPU run each wake-up of one of them preempts a compute thread.

A model so small that its compute takes almost no time shows the host work of a step instead: the Python each
strategy runs around the ops (hooks, paging, the optimizer's bookkeeping), which on a GPU is what the host thread
adds between kernels (the third command, with the states and updates on the device as a GPU run that fits gets them,
and nothing moved between tiers).

Run from the repository root::

    python -m benchmarks.step_overhead --swap-dir /mnt/nvme0/ratel
    python -m benchmarks.step_overhead --ratel-config '{"activation_policy": {"*layers.0": "ssd", "*": "host"}}'
    python -m benchmarks.step_overhead --hidden-size 32 --intermediate-size 64 --num-heads 2 --num-layers 8 \
        --batch-size 1 --seq-len 8 --threads 1 --steps 200 --repeats 4 \
        --ratel-config '{"optimizer_states": "device", "activation_policy": "keep"}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rich.console import Console
from rich.table import Table

from lightning_ratel import RatelStrategy

# The example modules are plain files next to each other, as examples/demo.py imports them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from lm_module import CausalLMModule  # noqa: E402
from text_data import TextDataModule  # noqa: E402


class StepClock(L.Callback):
    """Times the steps from the start of batch ``first`` to the start of batch ``first + count``, in wall time and
    in the process's CPU time."""

    def __init__(self, first: int, count: int) -> None:
        self.first = first
        self.count = count
        self.started: float | None = None
        self.seconds: float | None = None
        self.cpu_started = 0.0
        self.cpu_seconds = 0.0
        self.tokens = 0
        self.last_loss: float | None = None
        # Ratel's counts over the timed steps (empty for other strategies).
        self.counts: Counter[str] = Counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        if batch_idx == self.first:
            self.counts = _ratel_counts(trainer)
            self.started = time.perf_counter()
            self.cpu_started = time.process_time()
        elif batch_idx == self.first + self.count:
            self.seconds = time.perf_counter() - self.started
            self.cpu_seconds = time.process_time() - self.cpu_started
            start, end = self.counts, _ratel_counts(trainer)
            self.counts = Counter({key: end[key] - start[key] for key in end})
            # Not a count of events: how many there are.
            self.counts["io threads"] = end["io threads"]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.first <= batch_idx < self.first + self.count:
            self.tokens += batch["input_ids"].numel()
            self.last_loss = float(outputs["loss"])


def _ratel_counts(trainer: L.Trainer) -> Counter[str]:
    """Ratel's updates by how they ran and its swap store's bytes so far (worker and I/O threads settled first); empty
    for another strategy."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is None or engine.adam is None:
        return Counter()
    engine.adam.barrier(include_writes=True)
    return Counter({**engine.adam.counts, "bytes written": engine.store.bytes_written,
                    "bytes read": engine.store.bytes_read, **_io_thread_counts()})


def _io_thread_counts() -> Counter[str]:
    """Context switches, read and write calls and CPU clock ticks so far of the swap stores' I/O threads, from
    ``/proc`` (empty where it is missing)."""
    counts: Counter[str] = Counter()
    for thread in threading.enumerate():
        if not thread.name.startswith("ratel-io-"):
            continue
        task = Path(f"/proc/self/task/{thread.native_id}")
        try:
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
            io = dict(line.split(":", 1) for line in (task / "io").read_text().splitlines())
            stat = (task / "stat").read_text()
        except OSError:
            continue
        # utime and stime, counted after the command name (which may hold spaces).
        utime, stime = stat[stat.rindex(")") + 2 :].split()[11:13]
        counts["io threads"] += 1
        counts["io voluntary switches"] += int(status["voluntary_ctxt_switches"])
        counts["io involuntary switches"] += int(status["nonvoluntary_ctxt_switches"])
        counts["io calls"] += int(io["syscr"]) + int(io["syscw"])
        counts["io ticks"] += int(utime) + int(stime)
    return counts


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the clock starts")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each strategy, taking turns")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden-size", type=int, default=256, help="the Llama's hidden size (the demo's default)")
    parser.add_argument("--intermediate-size", type=int, default=688, help="its MLP's inner size")
    parser.add_argument("--num-layers", type=int, default=4, help="its decoder layers")
    parser.add_argument("--num-heads", type=int, default=4, help="its attention heads")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--gradient-clip-val", type=float, default=None,
                        help="clip by norm in both runs (Ratel then starts its updates after backward)")
    parser.add_argument("--swap-dir", type=Path, default=Path("outputs") / "step_overhead-swap",
                        help="directory for Ratel's swap files (created if missing; emptied by Ratel at the end)")
    parser.add_argument("--ratel-config", type=json.loads, default={},
                        help="JSON object of RatelStrategy keyword arguments other than ssd_paths (default: none, so "
                             "activations are placed by the profiler's plan)")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, data: TextDataModule) -> CausalLMModule:
    """The demo's Llama in the sizes ``args`` give."""
    return CausalLMModule(vocab_size=data.vocab_size, max_seq_len=data.seq_len, hidden_size=args.hidden_size,
                          intermediate_size=args.intermediate_size, num_layers=args.num_layers,
                          num_heads=args.num_heads)


def run(strategy: str, args: argparse.Namespace, data: TextDataModule) -> StepClock:
    """One fit of ``args.warmup + args.steps + 1`` steps; the last one only marks the end of the clock."""
    if strategy == "ratel":
        args.swap_dir.mkdir(parents=True, exist_ok=True)
        trainer_strategy: Any = RatelStrategy(ssd_paths=[str(args.swap_dir)], **args.ratel_config)
    else:
        trainer_strategy = "auto"
    model = build_model(args, data)
    clock = StepClock(args.warmup, args.steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=trainer_strategy,
        precision="32-true",
        max_steps=args.warmup + args.steps + 1,
        gradient_clip_val=args.gradient_clip_val,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    # The same batches in the same order for every run.
    L.seed_everything(0, verbose=False)
    trainer.fit(model, datamodule=data)
    if clock.seconds is None:
        raise SystemExit(f"the {strategy} run ended before step {args.warmup + args.steps}; is the data too small?")
    return clock


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    data = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    data.prepare_data()
    data.setup("fit")
    batches = len(data.train_dataloader())
    if args.warmup + args.steps + 1 > batches:
        raise SystemExit(f"one epoch has {batches} batches; ask for fewer than {batches} steps in all")

    seconds: dict[str, list[float]] = {"plain": [], "ratel": []}
    cpu_seconds: dict[str, list[float]] = {"plain": [], "ratel": []}
    tokens: dict[str, int] = {}
    losses: dict[str, float | None] = {}
    counts: Counter[str] = Counter()
    for _ in range(args.repeats):
        for strategy in seconds:
            clock = run(strategy, args, data)
            seconds[strategy].append(clock.seconds)
            cpu_seconds[strategy].append(clock.cpu_seconds)
            tokens[strategy] = clock.tokens
            losses[strategy] = clock.last_loss
            counts += clock.counts

    params = sum(p.numel() for p in build_model(args, data).parameters())
    console.print(
        f"Llama {params / 1e6:.2f}M params, batch {args.batch_size} x {args.seq_len + 1} tokens, 32-true, "
        f"{args.threads} torch threads; {args.warmup} warm-up steps untimed, {args.steps} steps timed, "
        f"{args.repeats} runs each; Ratel config {json.dumps(args.ratel_config)}, swap files in {args.swap_dir}"
    )
    # torch.optim.AdamW's sqrt and matmuls thread inside MKL, so these settings change the baseline a lot.
    threading = {name: os.environ[name] for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")
                 if name in os.environ}
    console.print(f"threading environment: {threading or 'defaults'}")
    table = Table(title="Training steps on CPU: RatelStrategy vs plain Lightning")
    columns = ("strategy", "wall s per run", "steps/s (median)", "tokens/s (median)", "CPU s per run",
               "loss at last timed step")
    for column in columns:
        table.add_column(column, justify="left" if column == "strategy" else "right")
    median = {name: statistics.median(values) for name, values in seconds.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu_seconds.items()}
    for name, label in (("plain", "plain Lightning (auto)"), ("ratel", "RatelStrategy")):
        table.add_row(
            label,
            ", ".join(f"{s:.2f}" for s in seconds[name]),
            f"{args.steps / median[name]:.2f}",
            f"{tokens[name] / median[name]:,.0f}",
            ", ".join(f"{s:.2f}" for s in cpu_seconds[name]),
            f"{losses[name]:.4f}",
        )
    console.print(table)
    # The goals of issue 22: safety costs at most 10% of a step, 12% under clipping by norm.
    goal = 12 if args.gradient_clip_val else 10
    console.print(
        f"Ratel / plain throughput (median wall time): {median['plain'] / median['ratel']:.3f}, i.e. Ratel "
        f"{100 * (median['ratel'] / median['plain'] - 1):+.1f}% time per step (the goal is at most +{goal}%); "
        f"CPU time Ratel / plain: {cpu_median['ratel'] / cpu_median['plain']:.3f}"
    )
    steps = args.steps * args.repeats
    console.print(
        "Ratel per timed step: updates "
        + ", ".join(f"{kind} {counts[kind] / steps:.1f}" for kind in ("overlapped", "deferred", "redone", "dropped"))
        + f"; swap store {counts['bytes written'] / steps / 2**20:.1f} MiB written, "
        f"{counts['bytes read'] / steps / 2**20:.1f} MiB read (each checksummed)"
    )
    if counts["io threads"]:
        console.print(
            f"Ratel's swap-store I/O threads ({counts['io threads'] // args.repeats}) per timed step: "
            f"{counts['io voluntary switches'] / steps:.1f} voluntary and "
            f"{counts['io involuntary switches'] / steps:.1f} involuntary context switches, "
            f"{counts['io calls'] / steps:.1f} read and write calls, "
            f"{1000 * counts['io ticks'] / os.sysconf('SC_CLK_TCK') / steps:.1f} ms CPU"
        )


if __name__ == "__main__":
    main()
