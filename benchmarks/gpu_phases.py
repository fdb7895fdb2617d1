"""Where a step's time goes: forward and step wall times per step, and Chrome traces, of plain Lightning and
RatelStrategy on the GPU benchmark's model.

Trains the GPT-2 model of ``benchmarks/gpu_throughput.py`` (``--size``, default 8 layers, hidden 1024: 153M
parameters; batch 8 x 1024 random tokens, ``bf16-mixed``) five times in one process, each fit its own Trainer:

- ``plain``: Lightning's default strategy, traced at step ``--trace-step``;
- ``ratel``: ``RatelStrategy()`` with its defaults (on a GPU a model this size keeps its states on the device), with
  ``RatelProfiler(trace_step=1)``: the trace of the second profiled pass, and the profiler's per-step breakdown
  (``ratel_steps.json``) and plan (``ratel_plan.json``);
- ``ratel-steady``: the same, traced at step ``--trace-step``, after planning;
- ``ratel-host``: ``RatelStrategy(optimizer_states="host")`` (the CPU AdamW overlapped with backward), with the
  profiler's trace of its second profiled pass and its breakdown;
- ``ratel-host-steady``: the same, traced at step ``--trace-step`` (the CPU updates overlapping backward, and the
  next forward waiting for the last of them).

Each step's forward is timed from the batch's start to ``on_before_backward`` and the step to the batch's end, the
device synchronised at each point (so a step's queued work is its own). Steps 0 and 1 (RatelStrategy's profiled
passes) are shown but not in the medians. On a machine without CUDA it runs a 2-layer, 64-wide model on the CPU in
``32-true``, for a check of the script itself.

Run from the repository root on the GPU machine::

    python -m benchmarks.gpu_phases --out results/phases

and read the traces in ``chrome://tracing`` or Perfetto.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.gpu_throughput import parse_model
from benchmarks.peers import _gpt_module_class
from benchmarks.plan_accuracy import StepClock
from lightning_ratel import RatelProfiler, RatelStrategy


class PhaseClock(StepClock):
    """:class:`~benchmarks.plan_accuracy.StepClock`'s times of every training step, and a Chrome trace of one step.

    Args:
        trace_step: the step to trace (``None``: none).
        trace_path: where its trace goes.
        activities: what ``torch.profiler`` records.
    """

    def __init__(self, trace_step: int | None, trace_path: Path,
                 activities: Sequence[torch.profiler.ProfilerActivity]) -> None:
        super().__init__()
        self.trace_step = trace_step
        self.trace_path = trace_path
        self.activities = list(activities)
        self._profile: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == self.trace_step:
            self._profile = torch.profiler.profile(activities=self.activities)
            self._profile.__enter__()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile.export_chrome_trace(str(self.trace_path))
            self._profile = None


def run(name: str, strategy: Any, args: argparse.Namespace, on_gpu: bool, ratel_trace: int | None = None,
        trace_step: int | None = None) -> dict[str, Any]:
    """One fit of ``args.steps`` steps under ``strategy``; its per-step times, written under ``args.out / name``."""
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    clock = PhaseClock(trace_step, out / f"trace_step{trace_step}.json", activities)
    callbacks: list[L.Callback] = [clock]
    if ratel_trace is not None:
        callbacks.append(RatelProfiler(output_dir=str(out), trace_step=ratel_trace))
    module = _gpt_module_class(parse_model(args.size, vocab=args.vocab), args.steps + 1, args.batch_size)()
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu", devices=1, strategy=strategy,
        precision="bf16-mixed" if on_gpu else "32-true", max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(module)
    steps = [{"step": i, "forward": forward, "wall": wall} for i, (wall, _, forward) in enumerate(clock.steps)]
    (out / "phases.json").write_text(json.dumps(steps, indent=1))
    settled = steps[2:] or steps
    return {"run": name, "forward_ms": statistics.median(s["forward"] for s in settled) * 1e3,
            "step_ms": statistics.median(s["wall"] for s in settled) * 1e3,
            "per_step_ms": [(round(s["forward"] * 1e3, 1), round(s["wall"] * 1e3, 1)) for s in steps]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the traces and phases.json files")
    parser.add_argument("--size", help="LxHxD as in gpu_throughput (default 8x8x1024 on a GPU, 2x2x64 on the CPU)")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=9, help="steps per fit (default 9)")
    parser.add_argument("--trace-step", type=int, default=6, help="the steady-state step traced (default 6)")
    parser.add_argument("--swap-dir", type=Path, help="RatelStrategy's swap directory (default: a temporary one)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    args.size = args.size or ("8x8x1024" if on_gpu else "2x2x64")
    if args.steps <= max(args.trace_step, 2):
        raise SystemExit(f"--steps must exceed --trace-step ({args.trace_step}) and 2")
    swap = args.swap_dir or Path(tempfile.mkdtemp(prefix="ratel-phases-"))
    swap.mkdir(parents=True, exist_ok=True)
    results = [
        run("plain", "auto", args, on_gpu, trace_step=args.trace_step),
        run("ratel", RatelStrategy(ssd_paths=[str(swap)]), args, on_gpu, ratel_trace=1),
        run("ratel-steady", RatelStrategy(ssd_paths=[str(swap)]), args, on_gpu, trace_step=args.trace_step),
        run("ratel-host", RatelStrategy(ssd_paths=[str(swap)], optimizer_states="host"), args, on_gpu,
            ratel_trace=1),
        run("ratel-host-steady", RatelStrategy(ssd_paths=[str(swap)], optimizer_states="host"), args, on_gpu,
            trace_step=args.trace_step),
    ]
    (args.out / "phases.json").write_text(json.dumps(results, indent=1))
    plain = results[0]["step_ms"]
    for r in results:
        print(f"{r['run']:17s} forward {r['forward_ms']:8.1f} ms  step {r['step_ms']:8.1f} ms  "
              f"x plain {r['step_ms'] / plain:5.2f}  per step (forward, step) ms: {r['per_step_ms']}")
    print(f"written under {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
