"""How well the planner's cost model predicts step time, and whether the plan it picks is among the fastest measured.

The model (the examples' Llama on the bundled Genesis text; size, batch and sequence length are options) first trains
under ``plan="auto"`` with a host memory limit too small for all saved activations, so the planner has to choose
between keeping, swapping (host memory, SSD) and recomputing. Then the same training runs under pinned plans
(``RatelStrategy(plan=Plan(...))``, no profiling) that store a growing share of the ops the search chooses among, taken
in the search's own benefit order (recompute seconds saved per byte) and the rest recomputed:

- ``tiered``: each stored op on the fastest tier with room (device, then host, then SSD), the search's rule, with
  host room for one block's SSD staging kept free where the budget allows, as the search's second walk does;
- ``ssd``: each stored op on the SSDs (where staging room allows).

Every point is predicted with the cost model under the planner's hardware profile, settings and budgets, and measured
as the median wall time of a training step (batch start to batch end, optimizer step included) over the timed steps
of all repeats. Repeats run the points round-robin, in alternating directions, so a drift in the machine's load spreads
evenly over them. Two checks: the planner's plan measures within ``--tolerance`` (10%) of the best
measured point, and every point's step time lies within ``--accuracy`` (15%) of its prediction (issue 22). Forward
and backward are shown apart too. The least step time and the process's CPU seconds per step (all threads) are shown
as well: on a machine other work shares they move less with that work than the median wall time does.

Run from the repository root::

    .venv/bin/python -m benchmarks.plan_accuracy                       # demo Llama, seq 256, batch 8, 3 repeats
    .venv/bin/python -m benchmarks.plan_accuracy --seq-len 512 --repeats 3 --ssd-paths /mnt/nvme0/ratel
    .venv/bin/python -m benchmarks.plan_accuracy --save sweep.json    # keep the measurements ...
    .venv/bin/python -m benchmarks.plan_accuracy --replay sweep.json  # ... and predict them again after a model change

The exit status is 1 when either check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

import lightning as L
import torch
from rich.console import Console
from rich.table import Table

from examples.lm_module import CausalLMModule
from examples.text_data import TextDataModule
from lightning_ratel import Plan, RatelProfiler, RatelStrategy
from lightning_ratel.plan.cost import CostModel, CostSettings, Prediction, bottleneck, predict
from lightning_ratel.plan.search import candidate_order, storing
from lightning_ratel.report import plan_table
from lightning_ratel.sizes import format_bytes, parse_bytes
from lightning_ratel.tiers import TIERS

MIB = 1 << 20
VARIANTS = {"tiered": ("device", "host", "ssd"), "ssd": ("ssd",)}
"""Sweep name -> the tiers a stored op may take, tried in order."""
PROFILE_STEPS = 3
"""Steps the ``plan="auto"`` runs profile before planning: one more than the profiler's default, so that each measured
time is the least of two passes after the first and one pass another process slowed does not set the prediction."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model and data")
    model.add_argument("--hidden-size", type=int, default=256, help="(default 256, the demo's)")
    model.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    model.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    model.add_argument("--intermediate-size", type=int, default=688, help="MLP width (default 688)")
    model.add_argument("--seq-len", type=int, default=256, help="tokens per sample (default 256; the demo uses 128)")
    model.add_argument("--batch-size", type=int, default=8, help="samples per step (default 8)")
    run = parser.add_argument_group("memory and storage")
    run.add_argument("--host-memory-limit", help="host memory the plan may use, e.g. '300MiB' (default: what the "
                     "engine holds and the compute working set needs, plus half the saved activations)")
    run.add_argument("--device-memory-limit", help="device memory limit on CUDA, e.g. '2GiB' (default: what is free)")
    run.add_argument("--ssd-paths", nargs="+", type=Path, help="swap directories (default: a temporary directory here)")
    sweep = parser.add_argument_group("sweep and timing")
    sweep.add_argument("--fractions", nargs="+", type=Fraction, default=[Fraction(n, 8) for n in (0, 1, 2, 4, 6, 8)],
                       help="shares of the candidate ops' bytes to store (default 0 1/8 1/4 1/2 3/4 1)")
    sweep.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["tiered", "ssd"],
                       help="sweeps to run (default both)")
    sweep.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    sweep.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    sweep.add_argument("--repeats", type=int, default=3, help="runs of every point, round-robin (default 3)")
    sweep.add_argument("--tolerance", type=float, default=0.10, help="allowed excess over the best (default 0.10)")
    sweep.add_argument("--accuracy", type=float, default=0.15,
                       help="allowed |measured / predicted - 1| of every point's step time (default 0.15)")
    sweep.add_argument("--save", type=Path, help="write the plan and the measured times to this JSON file")
    sweep.add_argument("--replay", type=Path, help="measure nothing: predict a sweep --save wrote with the cost "
                       "model as it is now, against the times measured then")
    sweep.add_argument("--verbose", action="store_true", help="show Lightning's and the strategy's own output")
    args = parser.parse_args(argv)
    if any(not 0 <= f <= 1 for f in args.fractions):
        parser.error("--fractions must lie in [0, 1]")
    if args.warmup < 0 or args.steps < 1 or args.repeats < 1:
        parser.error("--warmup must be >= 0, --steps and --repeats >= 1")
    return args


@dataclass
class Point:
    """One placement of the sweep: what it stores, what the cost model says, and the measured step times."""

    labels: list[str]
    placement: dict[str, str]
    prediction: Prediction
    walls: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    forwards: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The labels joined, each sweep's name written once: ``"tiered 1/2 = 3/4 = planner"``."""
        parts, previous = [], None
        for label in self.labels:
            variant, _, share = label.partition(" ")
            parts.append(share if variant == previous and share else label)
            previous = variant
        return " = ".join(parts)

    @property
    def measured(self) -> float:
        return statistics.median(self.walls)

    @property
    def measured_forward(self) -> float:
        return statistics.median(self.forwards)

    @property
    def measured_backward(self) -> float:
        """Median of each step's time after forward (backward and the rest of the optimizer step)."""
        return statistics.median(wall - forward for wall, forward in zip(self.walls, self.forwards))

    @property
    def spread(self) -> tuple[float, float]:
        """The interquartile range of the timed steps (the single value twice with fewer than two steps)."""
        if len(self.walls) < 2:
            return self.walls[0], self.walls[0]
        quartiles = statistics.quantiles(self.walls, n=4, method="inclusive")
        return quartiles[0], quartiles[2]


class StepClock(L.Callback):
    """Wall time, process CPU time (all threads) and forward's wall time of each training step from batch ``first``
    on, batch start to batch end; forward ends where backward starts (``on_before_backward``), so the rest, optimizer
    included, is backward. The batches before ``first`` run without the clock's synchronisations."""

    def __init__(self, first: int = 0) -> None:
        self.first = first
        self.steps: list[tuple[float, float, float]] = []
        self._timing = False
        self._start = (0.0, 0.0)
        self._forward = 0.0

    @staticmethod
    def _now(trainer: L.Trainer) -> tuple[float, float]:
        if trainer.strategy.root_device.type == "cuda":
            # Work still queued on the GPU belongs to the step that queued it.
            torch.cuda.synchronize()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), usage.ru_utime + usage.ru_stime

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object,
                             batch_idx: int) -> None:
        self._timing = batch_idx >= self.first
        if self._timing:
            self._start = self._now(trainer)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._timing:
            self._forward = self._now(trainer)[0] - self._start[0]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if self._timing:
            wall, cpu = self._now(trainer)
            self.steps.append((wall - self._start[0], cpu - self._start[1], self._forward))


class Runner:
    """Trains the same model on the same batches under a given strategy, quietly unless asked not to be.

    Args:
        args: the command line.
        ssd_paths: the swap directories.
    """

    def __init__(self, args: argparse.Namespace, ssd_paths: list[str]) -> None:
        self.args = args
        self.ssd_paths = ssd_paths
        self.on_gpu = torch.cuda.is_available()
        # Tokenised once: setup() returns early on later fits, so only training is repeated.
        self.data = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
        self.data.prepare_data()
        self.data.setup("fit")

    def fit(self, plan: str | Plan, steps: int, host_memory_limit: int | None = None,
            headroom: int | None = None) -> tuple[RatelProfiler, StepClock]:
        """Train ``steps`` steps from the same initial weights and batches; returns the profiler and the step times.

        ``headroom`` (see :class:`HostHeadroom`) replaces ``host_memory_limit`` when given.
        """
        args = self.args
        L.seed_everything(0, workers=True, verbose=False)
        model = CausalLMModule(vocab_size=self.data.vocab_size, hidden_size=args.hidden_size, num_layers=args.layers,
                               num_heads=args.heads, intermediate_size=args.intermediate_size,
                               max_seq_len=args.seq_len)
        profiler = RatelProfiler(report=False, profile_steps=PROFILE_STEPS)
        clock = StepClock()
        strategy = RatelStrategy(ssd_paths=self.ssd_paths, plan=plan, host_memory_limit=host_memory_limit,
                                 device_memory_limit=args.device_memory_limit)
        trainer = L.Trainer(
            accelerator="gpu" if self.on_gpu else "cpu",
            devices=1,
            strategy=strategy,
            precision="bf16-mixed" if self.on_gpu else "32-true",
            max_steps=steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[clock, *([HostHeadroom(headroom)] if headroom is not None else []), profiler],
        )
        quiet = contextlib.nullcontext() if args.verbose else contextlib.redirect_stdout(io.StringIO())
        with quiet:
            trainer.fit(model, datamodule=self.data)
        return profiler, clock


def default_headroom(plan: Plan) -> int:
    """Host bytes beyond the engine's own that hold the compute working set but only half of the activations."""
    static = plan.budgets["host_static"]
    model = CostModel(plan.hardware, plan.layers,
                      CostSettings(prefetch_depth=plan.prefetch_depth, host_static_bytes=static))
    nothing_saved = model.memory([dict.fromkeys(TIERS, 0) for _ in plan.layers])["host"]
    return nothing_saved - static + sum(layer.saved_bytes for layer in plan.layers) // 2


class HostHeadroom(L.Callback):
    """Caps host memory at ``headroom`` bytes beyond what the engine holds when the profiler plans.

    What the engine holds varies from run to run (it counts the optimizer's buffers only while they are idle), so a
    limit fixed in advance would leave the planner a different amount of room each time; this one does not.
    Must come before the :class:`RatelProfiler` in the callbacks, which plans at the end of its last profiled batch.
    """

    def __init__(self, headroom: int) -> None:
        self.headroom = headroom

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        engine = trainer.strategy.engine
        engine.config.host_memory_limit = engine.byte_placement()["host"] + self.headroom


def fraction_text(fraction: Fraction) -> str:
    """``1/4`` as ``"1/4"``, whole numbers without a denominator."""
    return str(fraction) if fraction.denominator > 1 else str(fraction.numerator)


def sweep_points(plan: Plan, fractions: Sequence[Fraction], variants: Sequence[str]) -> list[Point]:
    """The sweep's placements and the planner's, each predicted; placements equal to an earlier one are merged."""
    layers = plan.layers
    sizes = {f"{layer.name}/{op.name}": op.saved_bytes for layer in layers for op in layer.ops}
    order = candidate_order(layers)
    total = sum(sizes[key] for key in order)
    # The planner's own settings (where its optimizer states live, state write-backs deferred into forward, ...).
    common = plan.settings or CostSettings(prefetch_depth=plan.prefetch_depth,
                                           host_static_bytes=plan.budgets["host_static"])
    placements: list[tuple[str, dict[str, str]]] = []
    for variant in variants:
        for fraction in fractions:
            # The longest prefix of the benefit order within the byte share.
            stored, cumulative = [], 0
            for key in order:
                cumulative += sizes[key]
                if cumulative > fraction * total:
                    break
                stored.append(key)
            placement = storing(plan.hardware, layers, stored, device_budget=plan.budgets["device"],
                                host_budget=plan.budgets["host"], store_budget=plan.budgets["ssd"],
                                tiers=VARIANTS[variant], keep_staging=True, settings=common)
            placements.append((f"{variant} {fraction_text(fraction)}", placement))
    placements.append(("planner", plan.activation_placement))
    points: list[Point] = []
    for label, placement in placements:
        same = next((p for p in points if p.placement == placement), None)
        if same is not None:
            same.labels.append(label)
            continue
        points.append(Point([label], placement, predict(plan.hardware, layers, placement, common)))
    return points


def measure(runner: Runner, plan: Plan, points: list[Point], console: Console) -> None:
    """Train each point under a pinned plan ``--repeats`` times, round-robin; keep the timed steps' times."""
    args = runner.args
    for repeat in range(args.repeats):
        # Forward then backward through the points: a steady drift in load then costs each point about the same.
        for point in points if repeat % 2 == 0 else points[::-1]:
            console.print(f"  repeat {repeat + 1}/{args.repeats}: {point.label}")
            pinned = replace(plan, activation_placement=point.placement,
                             predicted_iteration_time=point.prediction.iteration_time,
                             predicted_forward_time=point.prediction.forward_time,
                             predicted_backward_time=point.prediction.backward_time,
                             resource_times={"forward": point.prediction.forward,
                                             "backward": point.prediction.backward},
                             memory=point.prediction.memory)
            _, clock = runner.fit(pinned, args.warmup + args.steps)
            timed = clock.steps[args.warmup:]
            point.walls.extend(wall for wall, _, _ in timed)
            point.cpu_seconds.extend(cpu for _, cpu, _ in timed)
            point.forwards.extend(forward for _, _, forward in timed)


def hardware_table(plan: Plan, model_line: str) -> Table:
    """The hardware profile, compute totals and budgets every prediction used."""
    hw = plan.hardware
    table = Table(title="Profile the planner used (measured by its plan=\"auto\" run)", caption=model_line)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("device", hw.device_type),
        ("host->device copy", f"{hw.h2d_bandwidth / 1e9:.2f} GB/s"),
        ("device->host copy", f"{hw.d2h_bandwidth / 1e9:.2f} GB/s"),
        ("SSD read", f"{hw.ssd_read_bandwidth / 1e9:.2f} GB/s"),
        ("SSD write", f"{hw.ssd_write_bandwidth / 1e9:.2f} GB/s"),
        ("CPU AdamW kernel", f"{hw.adam_params_per_s / 1e6:.1f} M params/s"),
        ("forward compute (sum of blocks)", f"{sum(layer.forward_time for layer in plan.layers):.3f} s"),
        ("backward compute (sum of blocks)", f"{sum(layer.backward_time for layer in plan.layers):.3f} s"),
        ("saved activations", format_bytes(sum(layer.saved_bytes for layer in plan.layers))),
        ("host budget (static)", f"{format_bytes(plan.budgets['host'])} ({format_bytes(plan.budgets['host_static'])})"),
        ("device budget", format_bytes(plan.budgets["device"])),
        ("SSD budget", format_bytes(plan.budgets["ssd"])),
    ]
    settings = plan.settings
    if settings is not None:
        rate = settings.update_params_per_s
        rows += [
            ("forward outside the blocks", f"{settings.forward_overhead:.3f} s"),
            ("backward outside the blocks", f"{settings.backward_overhead:.3f} s"),
            ("whole CPU update (measured)", f"{rate / 1e6:.1f} M params/s" if rate else "not measured"),
            ("updates run", "after backward" if settings.updates_after_backward else "during backward"),
        ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def results_table(points: list[Point], best: Point, args: argparse.Namespace) -> Table:
    """One row per point: volumes per tier, predicted and measured step time; the planner's row in bold."""
    table = Table(title=f"Predicted vs measured step time ({args.steps * args.repeats} timed steps per point)",
                  caption="stored = device + host + ssd; offloaded = host + ssd; measured = median, with the "
                          "interquartile range; CPU s = process CPU seconds per step (median)")
    table.add_column("point", no_wrap=True)
    for name in ("stored MiB", "offloaded MiB", "ssd MiB", "recomputed MiB", "predicted s", "measured s", "IQR s",
                 "min s", "CPU s", "meas/pred", "meas/best"):
        table.add_column(name, justify="right")
    for point in points:
        volume = point.prediction.bytes
        low, high = point.spread
        label = f"{point.label} (best)" if point is best else point.label
        table.add_row(
            label,
            *(f"{size / MIB:.1f}" for size in (volume["device"] + volume["host"] + volume["ssd"],
                                               volume["host"] + volume["ssd"], volume["ssd"], volume["recompute"])),
            f"{point.prediction.iteration_time:.3f}",
            f"{point.measured:.3f}",
            f"{low:.3f}-{high:.3f}",
            f"{min(point.walls):.3f}",
            f"{statistics.median(point.cpu_seconds):.3f}",
            f"{point.measured / point.prediction.iteration_time:.2f}",
            f"{point.measured / best.measured:.2f}",
            style="bold" if "planner" in point.labels else None,
        )
    return table


def phase_table(points: list[Point], unified: bool) -> Table:
    """One row per point: predicted and measured forward and backward (medians), and what the model says bounds each."""
    table = Table(title="Predicted vs measured per phase (median seconds)",
                  caption="backward = the step after forward: backward and what the optimizer step still waits for; "
                          "bound = the resource with the most predicted busy seconds in the phase")
    table.add_column("point", no_wrap=True)
    for name in ("fwd pred", "fwd meas", "fwd m/p", "fwd bound", "bwd pred", "bwd meas", "bwd m/p", "bwd bound"):
        table.add_column(name, justify="right")
    for point in points:
        prediction = point.prediction
        table.add_row(
            point.label,
            f"{prediction.forward_time:.3f}", f"{point.measured_forward:.3f}",
            f"{point.measured_forward / prediction.forward_time:.2f}",
            bottleneck(prediction.forward, unified=unified),
            f"{prediction.backward_time:.3f}", f"{point.measured_backward:.3f}",
            f"{point.measured_backward / prediction.backward_time:.2f}",
            bottleneck(prediction.backward, unified=unified),
            style="bold" if "planner" in point.labels else None,
        )
    return table


def worst_error(points: list[Point]) -> float:
    """The largest relative error of a predicted step time over the points: ``max |measured / predicted - 1|``."""
    return max(abs(p.measured / p.prediction.iteration_time - 1) for p in points)


def ratio_interval(planner: Point, points: list[Point], draws: int = 2000) -> tuple[float, float]:
    """90% interval of planner / best (medians) when each point's timed steps are resampled with replacement.

    Steps of one run share that run's load, so the interval understates the uncertainty rather than overstating it.
    """
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        medians = {id(p): statistics.median(rng.choices(p.walls, k=len(p.walls))) for p in points}
        ratios.append(medians[id(planner)] / min(medians.values()))
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def load_average() -> str:
    """The 1-minute load average, which says how much other work shared the machine."""
    return f"{os.getloadavg()[0]:.1f}"


def measured_sweep(args: argparse.Namespace, console: Console) -> tuple[Plan, list[Point], str]:
    """Plan, sweep and measure; returns the plan, the measured points and a line describing the model."""
    host_limit = parse_bytes(args.host_memory_limit, "--host-memory-limit")
    own_directory = None
    if args.ssd_paths:
        ssd_paths = [str(path.resolve()) for path in args.ssd_paths]
    else:
        # Here rather than in /tmp, which may be RAM: the SSD tier should be the disk the repository is on.
        own_directory = tempfile.mkdtemp(prefix="ratel-bench-", dir=os.getcwd())
        ssd_paths = [own_directory]
    try:
        runner = Runner(args, ssd_paths)
        # One step after profiling, so the plan is made and applied.
        planning_steps = PROFILE_STEPS + 1
        headroom = None
        if host_limit is None:
            console.print("Profiling without a host limit, to size the default limit")
            headroom = default_headroom(runner.fit("auto", planning_steps)[0].plan)
            console.print(f"Planning with {format_bytes(headroom)} of host memory beyond the engine's own")
        else:
            console.print(f"Planning under a host memory limit of {format_bytes(host_limit)}")
        plan = runner.fit("auto", planning_steps, host_memory_limit=host_limit, headroom=headroom)[0].plan
        points = sweep_points(plan, args.fractions, args.variants)
        console.print(f"Measuring {len(points)} placements ({args.warmup} + {args.steps} steps each, "
                      f"{args.repeats} repeat(s))")
        measure(runner, plan, points, console)
    finally:
        if own_directory is not None:
            shutil.rmtree(own_directory, ignore_errors=True)
    params = sum(layer.trainable_numel for layer in plan.layers)
    model_line = (f"Llama {params / 1e6:.2f}M params, {args.layers} layers, hidden {args.hidden_size}, "
                  f"seq {args.seq_len}, batch {args.batch_size}, {'bf16-mixed' if runner.on_gpu else 'fp32'}; "
                  f"{torch.get_num_threads()} torch threads")
    return plan, points, model_line


def save_sweep(path: Path, plan: Plan, points: list[Point], model_line: str) -> None:
    """Write the plan (profiles, settings) and every point's placement and measured times as JSON."""
    data = {"model": model_line, "plan": json.loads(plan.to_json()),
            "points": [{"labels": p.labels, "placement": p.placement, "walls": p.walls,
                        "cpu_seconds": p.cpu_seconds, "forwards": p.forwards} for p in points]}
    path.write_text(json.dumps(data))


def replayed_sweep(path: Path) -> tuple[Plan, list[Point], str]:
    """A sweep :func:`save_sweep` wrote, every point predicted again by the cost model as it is now."""
    data = json.loads(path.read_text())
    plan = Plan.from_json(json.dumps(data["plan"]))
    settings = plan.settings or CostSettings(prefetch_depth=plan.prefetch_depth,
                                             host_static_bytes=plan.budgets["host_static"])
    points = [Point(p["labels"], p["placement"], predict(plan.hardware, plan.layers, p["placement"], settings),
                    p["walls"], p["cpu_seconds"], p["forwards"]) for p in data["points"]]
    return plan, points, data["model"]


def main(argv: Sequence[str] | None = None) -> int:
    """Plan, sweep, measure (or replay a saved sweep) and print; returns the exit status (1 when a check fails)."""
    args = parse_args(argv)
    # Wide enough for the results table when the output goes to a file.
    console = Console(width=None if sys.stdout.isatty() else 180)
    if not args.verbose:
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", module=r"lightning\.")
    args.device_memory_limit = parse_bytes(args.device_memory_limit, "--device-memory-limit")
    load_before = load_average()
    if args.replay:
        plan, points, model_line = replayed_sweep(args.replay)
    else:
        plan, points, model_line = measured_sweep(args, console)
        if args.save:
            save_sweep(args.save, plan, points, model_line)

    console.print(hardware_table(plan, model_line))
    console.print(plan_table(plan))
    planner = next(p for p in points if "planner" in p.labels)
    best = min(points, key=lambda p: p.measured)
    console.print(results_table(points, best, args))
    console.print(phase_table(points, plan.hardware.unified_memory))
    rank = sorted(points, key=lambda p: p.measured).index(planner) + 1
    ratio = planner.measured / best.measured
    passed = ratio <= 1 + args.tolerance
    verdict = "[green]PASS" if passed else "[red]FAIL"
    console.print(f"planner's choice ({planner.label}): measured {planner.measured:.3f} s/step, predicted "
                  f"{planner.prediction.iteration_time:.3f}; rank {rank} of {len(points)}. Best measured: {best.label} "
                  f"at {best.measured:.3f} s/step. Ratio {ratio:.3f}, limit {1 + args.tolerance:.2f}: {verdict}")
    low, high = ratio_interval(planner, points)
    by_min = min(planner.walls) / min(min(p.walls) for p in points)
    by_cpu = statistics.median(planner.cpu_seconds) / min(statistics.median(p.cpu_seconds) for p in points)
    console.print(f"not the check: planner / best with steps resampled, 90% interval {low:.3f}-{high:.3f}; by least "
                  f"step time {by_min:.3f}; by CPU seconds per step "
                  f"{by_cpu:.3f}; 1-minute load average {load_before} before, {load_average()} after, on "
                  f"{os.cpu_count()} CPUs")
    error = worst_error(points)
    accurate = error <= args.accuracy
    console.print(f"largest error of a predicted step time: {error:.1%} (limit {args.accuracy:.0%}): "
                  f"{'[green]PASS' if accurate else '[red]FAIL'}")
    return 0 if passed and accurate else 1


if __name__ == "__main__":
    sys.exit(main())
