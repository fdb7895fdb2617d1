"""Lightning callbacks of the plugin.

:class:`RatelProfiler`: hardware-aware profiling, planning and the per-run report.
:class:`~lightning_ratel.RatelStrategy` adds one by default; add your own to change its settings. The first training
step runs under the safe default placement while every op is timed; the plan made from those measurements applies
from the next step. The plan is saved in checkpoints, so a resumed run keeps it instead of profiling again.

:class:`RatelHFExport`: the trained weights as a Hugging Face folder, at the end of fit and every N steps.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ratel.engine.planner import Planner
from lightning_ratel.io.export import ModuleReader, write_hf_folder
from lightning_ratel.io.tensorfiles import parse_dtype
from lightning_ratel.plan.search import Plan


@runtime_checkable
class PlanningStrategy(Protocol):
    """What the profiler needs from the strategy: the run's planner (``None`` outside a run), whether to send the
    step figures to the loggers, and where the run's bytes are."""

    @property
    def planner(self) -> Planner | None: ...

    @property
    def log_metrics(self) -> bool: ...

    def byte_placement(self) -> dict[str, int]: ...


def _planner(trainer: pl.Trainer) -> Planner | None:
    strategy = trainer.strategy
    return strategy.planner if isinstance(strategy, PlanningStrategy) else None


_SECONDS = {"wall": "step", "compute": "compute", "idle": "wait", "cpu_optimizer": "optimizer", "ssd": "disk",
            "h2d": "h2d", "d2h": "d2h"}
"""Breakdown keys and the names of their ``ratel/<name>_seconds`` metrics."""


def step_metrics(micro_batches: list[dict[str, float]], placement: dict[str, int]) -> dict[str, float]:
    """The figures of one optimizer step (its micro-batches' breakdowns summed) as ``ratel/...`` logger metrics.

    ``ratel/<part>_seconds``: wall time of the step, time the training thread computed, waited for a page-in or a
    swapped activation, and the busy time of the CPU AdamW, the swap files and each link direction (resources overlap:
    the parts do not add up to the step); ``ratel/disk_{read,write}_bytes`` and ``ratel/disk_gbps`` (GB/s while the
    swap files were busy), ``ratel/disk_busy`` (the share of the step they were busy); ``ratel/overlap``: the share of the disk and optimizer time that did not stall the training
    thread; ``ratel/{device,host,disk,pinned}_bytes``: where the run's bytes are at the end of the step;
    ``ratel/profiling``: 1 while the step ran under the safe default placement to be timed.
    """
    total = {key: sum(m.get(key, 0.0) for m in micro_batches) for key in (*_SECONDS, "ssd_read_bytes",
                                                                            "ssd_write_bytes")}
    metrics = {f"ratel/{name}_seconds": total[key] for key, name in _SECONDS.items()}
    moved = total["ssd_read_bytes"] + total["ssd_write_bytes"]
    metrics["ratel/disk_read_bytes"] = total["ssd_read_bytes"]
    metrics["ratel/disk_write_bytes"] = total["ssd_write_bytes"]
    if total["ssd"] > 0:
        metrics["ratel/disk_gbps"] = moved / total["ssd"] / 1e9
    if total["wall"] > 0:
        metrics["ratel/disk_busy"] = min(1.0, total["ssd"] / total["wall"])
    background = total["ssd"] + total["cpu_optimizer"]
    if background > 0:
        metrics["ratel/overlap"] = 1.0 - min(total["idle"], background) / background
    metrics.update({f"ratel/{tier}_bytes": float(n) for tier, n in placement.items()})
    metrics["ratel/profiling"] = float(any(m.get("profiling") for m in micro_batches))
    return metrics


class RatelProfiler(Callback):
    """Profiles the machine and the model, plans activation placement, and reports what each step measured.

    Each optimizer step's figures (:func:`step_metrics`) go to the Trainer's loggers while the strategy's
    ``log_metrics`` is on; the report at the end of fit draws them against the plan.

    Args:
        report: write ``ratel_report.png`` (predicted iteration time against offloaded bytes with the chosen plan,
            and the measured per-step breakdown) and ``ratel_plan.json`` at the end of fit, into ``output_dir``.
        output_dir: where the report goes; ``None``: the logger's directory (no report without a logger).
        trace_step: also write a Chrome trace (``torch.profiler``) of this training step (global step number).
        reprofile: profile and plan again even when the plan came from a checkpoint.
        profile_steps: training micro-batches run under the safe default while profiling; each measured time is
            the least over them after the first, which also pays a run's one-off costs: from three on, one step that
            other processes slowed does not set the plan's rates. The plan applies from the next micro-batch.
    """

    def __init__(
        self,
        report: bool = True,
        output_dir: str | None = None,
        trace_step: int | None = None,
        reprofile: bool = False,
        profile_steps: int = 2,
    ) -> None:
        if profile_steps < 1:
            raise ValueError(f"`profile_steps` must be at least 1, got {profile_steps}")
        self.profile_steps = profile_steps
        self.report = report
        self.output_dir = output_dir
        self.trace_step = trace_step
        self.reprofile = reprofile
        self.plan: Plan | None = None
        self.steps: list[dict[str, float]] = []
        self._step_start = 0.0
        # The micro-batches of the optimizer step in progress, and the global step they lead to.
        self._window: list[dict[str, float]] = []
        self._window_start_step = 0
        self._trace: torch.profiler.profile | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        planner = _planner(trainer)
        if planner is None:
            return
        planner.start(self.profile_steps, restored=self.plan, reprofile=self.reprofile)
        self._window = []
        self._window_start_step = trainer.global_step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        planner = _planner(trainer)
        if planner is None:
            return
        if self.trace_step is not None and trainer.global_step == self.trace_step and self._trace is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._trace = torch.profiler.profile(activities=activities)
            self._trace.__enter__()
        planner.breakdown.begin()
        self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        planner = _planner(trainer)
        if planner is None:
            return
        breakdown = planner.breakdown.take(self._step_start, time.perf_counter())
        breakdown["step"] = float(trainer.global_step)
        breakdown["profiling"] = float(planner.profiling)
        self.steps.append(breakdown)
        self._window.append(breakdown)
        if trainer.global_step != self._window_start_step:
            self._log_step(trainer)
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            directory = self._directory(trainer) or trainer.default_root_dir
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"ratel_trace_step{self.trace_step}.json")
            self._trace.export_chrome_trace(path)
            self._trace = None
            rank_zero_info(f"RatelProfiler: Chrome trace of step {self.trace_step} written to {path}")
        plan = planner.micro_batch_done()
        if plan is not None:
            self.plan = plan

    def _log_step(self, trainer: pl.Trainer) -> None:
        """Send the optimizer step that just ended to the loggers, at the step and rate of ``self.log`` metrics."""
        window, self._window = self._window, []
        self._window_start_step = trainer.global_step
        strategy = trainer.strategy
        # Lightning's own rule for step metrics (`log_every_n_steps`), checked as LearningRateMonitor does.
        if not (isinstance(strategy, PlanningStrategy) and strategy.log_metrics and trainer.loggers
                and trainer._logger_connector.should_update_logs):
            return
        metrics = step_metrics(window, strategy.byte_placement())
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        directory = self._directory(trainer)
        if not self.report or directory is None or self.plan is None or trainer.global_rank != 0:
            return
        from lightning_ratel.report import write_report

        os.makedirs(directory, exist_ok=True)
        measured = [s for s in self.steps if not s.get("profiling")]
        write_report(os.path.join(directory, "ratel_report.png"), self.plan, measured)
        self.plan.save(os.path.join(directory, "ratel_plan.json"))
        with open(os.path.join(directory, "ratel_steps.json"), "w") as f:
            json.dump(self.steps, f, indent=1)
        rank_zero_info(f"RatelProfiler: report written to {directory}")

    def _directory(self, trainer: pl.Trainer) -> str | None:
        if self.output_dir is not None:
            return self.output_dir
        return trainer.log_dir if trainer.loggers else None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_json() if self.plan is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        text = state_dict.get("plan")
        self.plan = Plan.from_json(text) if text else None


class RatelHFExport(Callback):
    """Writes the trained weights as a Hugging Face folder at the end of fit, and every ``every_n_train_steps`` steps.

    Under :class:`~lightning_ratel.RatelStrategy` the weights are streamed from the swap files shard by shard once the
    step's updates have landed (:meth:`RatelStrategy.save_pretrained`); under another strategy they come from the
    module. ``from_pretrained`` loads the folder; a peft model's adapter goes to ``adapter/`` in peft's format.

    Args:
        dirpath: the export goes to ``<dirpath>/final`` at the end of fit and to ``<dirpath>/step=<k>`` every
            ``every_n_train_steps``.
        every_n_train_steps: also export during training (``None``: only at the end).
        dtype: ``"bf16"`` (default), ``"fp16"`` or ``"fp32"``.
        max_shard_size: the largest weight file (``"5GB"``); more weights are split into shards with an index.
        at_end: export at the end of fit.
    """

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None, dtype: str = "bf16",
                 max_shard_size: int | str = "5GB", at_end: bool = True) -> None:
        if every_n_train_steps is not None and (isinstance(every_n_train_steps, bool) or every_n_train_steps < 1):
            raise ValueError(f"`every_n_train_steps` must be a positive integer or None, got {every_n_train_steps!r}")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self.dtype = parse_dtype(dtype)
        self.max_shard_size = max_shard_size
        self.at_end = at_end
        self._last_step = -1

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, path: str) -> None:
        """Write the current weights to ``path``."""
        save = getattr(trainer.strategy, "save_pretrained", None)
        if callable(save):
            # It says what it wrote, where, and how long it took.
            save(path, dtype=self.dtype, max_shard_size=self.max_shard_size)
            return
        if trainer.is_global_zero:
            write_hf_folder(ModuleReader(pl_module), path, self.dtype, self.max_shard_size)
        rank_zero_info(f"RatelHFExport: step {trainer.global_step} exported to {path}")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_train_steps is None or step == self._last_step or step % self.every_n_train_steps:
            return
        self._last_step = step
        self.export(trainer, pl_module, os.path.join(self.dirpath, f"step={step}"))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end:
            self.export(trainer, pl_module, os.path.join(self.dirpath, "final"))
