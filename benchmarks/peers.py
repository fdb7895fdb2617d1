"""RatelStrategy and the alternatives a user would try instead, on the same model and data, in one table.

Systems (``--systems``), all through Lightning, all from the same initial weights on the same batches in the same
order:

- ``ratel``: ``RatelStrategy`` (Adam moments, and fp32 masters not held as compute copies, in swap files under
  ``--swap-dir``; activations placed by the profiler's plan unless ``--ratel-config`` says otherwise).
- ``plain``: Lightning's default strategy, everything in memory: the baseline of the loss column.
- ``zero-offload``: DeepSpeed ZeRO-2 with the optimizer states and step on the CPU (``DeepSpeedCPUAdam``).
- ``zero-infinity``: DeepSpeed ZeRO-3 with the parameters and optimizer states on NVMe (``--swap-dir``), through
  DeepSpeed's ``async_io`` op (libaio).
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each decoder layer and the root with ``CPUOffloadPolicy``,
  through Lightning's ``ModelParallelStrategy`` (a one-process group).

DeepSpeed is an optional extra (``pip install 'lightning_ratel[peers]'``); where it is missing, or its ``async_io``
op cannot be built (no libaio headers), its rows say so and nothing of it runs. DeepSpeed refuses a client
``torch.optim.AdamW`` when the optimizer is offloaded, so its runs replace it with ``DeepSpeedCPUAdam(adamw_mode=True)``
of the same parameter groups, hyperparameters and LR schedule. Lightning's ``DeepSpeedStrategy`` accepts only a CUDA
accelerator while DeepSpeed itself runs on the CPU (``DS_ACCELERATOR=cpu``, set for the runs when there is no GPU):
on the CPU a subclass (:class:`CPUDeepSpeedStrategy`) skips Lightning's CUDA checks and nothing else.

Models (``--model``): ``cpu`` is the demo's Llama (``examples/lm_module.py``, ``--size``: ``demo`` is the demo's own
size) on the shipped Genesis text in ``32-true`` precision on the CPU; ``gpu`` is the GPT-2 model of
``benchmarks/gpu_throughput.py`` (``--size`` in its ``LxHxD`` form) on random tokens in ``bf16-mixed`` on one GPU.

Measurement. Each run is its own subprocess, so peak RSS is that system's own and no process group, DeepSpeed state or
allocator cache leaks into the next. Runs are interleaved: round ``r`` runs every system once, starting one system
later than round ``r - 1``, so that a change of machine load hits every system alike. In a run, the first
``--warmup`` steps are untimed (RatelStrategy profiles two and plans); each timed step runs from the start of its
batch to the start of the next, so work a step leaves running (Ratel's CPU updates overlapping the next forward) is in
it. s/step is the median of every timed step of every round; the per-round medians show the spread. Disk bytes are
``read_bytes`` / ``write_bytes`` of ``/proc/self/io`` (bytes that reached the block layer, so page-cache hits are not
counted) over the timed steps, per step; "swap" is what the system's swap directory holds on disk at the last timed
step. The loss column is the largest difference to plain Lightning's loss over all steps of the first round, and the
final loss; the systems run different optimizer kernels and (DeepSpeed) different reduction orders, so the
differences are rounding grown by Adam, not errors.

Host memory cap (``--host-memory-limit``). Every system gets the same cap, enforced the same way: the parent polls
each run's resident set (``VmRSS`` of ``/proc/PID/status``, every 20 ms) and kills a run that goes over it, and a run
whose own peak RSS (``ru_maxrss``, which catches a spike between two polls) ends above the cap counts as over it too:
the row says "out of memory". ``RLIMIT_AS`` is not used: it caps address space, which torch, thread stacks and
allocator arenas reserve far beyond what they touch, so it fails runs at many times their resident memory. Ratel is
also told the cap (``host_memory_limit``, less the process's RSS when the fit starts, since that option counts only
the strategy's own memory), so it plans within it.

On a machine shared with other work, run every system with ``OMP_WAIT_POLICY=passive``: with the default, OpenMP
threads spin while they wait and, when other processes hold the cores, a step can take many times as long (plain
Lightning's demo step went from 0.3 to 7 s on the 2-core development machine at load 10). The table records the
threading environment.

Run from the repository root::

    python -m benchmarks.peers --steps 20 --rounds 3 --out outputs/peers
    python -m benchmarks.peers --systems ratel plain zero-offload --size small --host-memory-limit 2GiB
    python -m benchmarks.peers --model gpu --size 8x8x1024 --swap-dir /mnt/nvme0/peers --out results/
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

RESULT_PREFIX = "PEERS_RESULT "
SYSTEMS = ("ratel", "plain", "zero-offload", "zero-infinity", "fsdp2")
DEEPSPEED_SYSTEMS = ("zero-offload", "zero-infinity")
ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30

LLAMA_SIZES = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 172},
    "demo": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 688},
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376},
    "medium": {"hidden_size": 1024, "num_layers": 16, "num_heads": 16, "intermediate_size": 2752},
}
"""``--size`` of the CPU Llama: ``CausalLMModule`` arguments (4.2M parameters at ``demo``, the demo's default)."""

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")
RSS_POLL_SECONDS = 0.02
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "bad_alloc", "memoryerror")


# ---------------------------------------------------------------------------------------------------- worker side


def _rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set of a process from ``/proc``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as io:
        fields = dict(line.split(": ") for line in io.read().splitlines())
    return {"read": int(fields["read_bytes"]), "written": int(fields["write_bytes"])}


def _disk_usage(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (sparse files count what they hold)."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(directory, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def _deepspeed_adam(config: dict[str, Any]) -> dict[str, Any]:
    """``configure_optimizers``' result with its AdamW replaced by DeepSpeedCPUAdam of the same groups and schedule."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    adamw = config["optimizer"]
    groups = [{k: v for k, v in group.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
              for group in adamw.param_groups]
    # LambdaLR already set each group's lr to base_lr * lambda(0): start the new one from the base again.
    for group, original in zip(groups, adamw.param_groups):
        group["lr"] = original.get("initial_lr", original["lr"])
    optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True)
    scheduler = config.get("lr_scheduler")
    if scheduler is not None:
        scheduler = dict(scheduler)
        scheduler["scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, scheduler["scheduler"].lr_lambdas)
    return {"optimizer": optimizer, **({"lr_scheduler": scheduler} if scheduler else {})}


def _decoder_layers(module: Any) -> Any:
    """The largest ``nn.ModuleList`` of the model: its decoder layers."""
    import torch

    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len)


def _system_module(base: type, system: str, pin_memory: bool) -> type:
    """``base`` with what ``system`` needs from a user's module: DeepSpeed's CPU Adam, or FSDP2 applied."""
    if system in DEEPSPEED_SYSTEMS:

        class DeepSpeedModule(base):
            def configure_optimizers(self) -> Any:
                config = super().configure_optimizers()
                if not isinstance(config, dict):
                    config = {"optimizer": config}
                return _deepspeed_adam(config)

        return DeepSpeedModule
    if system == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        class FSDP2Module(base):
            def configure_model(self) -> None:
                mesh = self.device_mesh["data_parallel"]
                policy = CPUOffloadPolicy(pin_memory=pin_memory)
                for layer in _decoder_layers(self):
                    fully_shard(layer, mesh=mesh, offload_policy=policy)
                # The model under the LightningModule is the root: sharding the LightningModule itself would change
                # the class Lightning holds.
                for child in self.children():
                    if any(True for _ in child.parameters()):
                        fully_shard(child, mesh=mesh, offload_policy=policy)

        return FSDP2Module
    return base


def _gpt_module_class(shape: Any, batches: int, batch_size: int) -> type:
    """The GPT-2 model of ``benchmarks/gpu_throughput.py`` on random tokens, as a LightningModule class."""
    import lightning as L
    import torch
    from transformers import GPT2LMHeadModel

    from benchmarks.gpu_throughput import _gpt2_config

    class RandomTokensGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # Every system starts from the same weights.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.model = GPT2LMHeadModel(_gpt2_config(shape))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            generator = torch.Generator().manual_seed(0)
            data = torch.randint(0, shape.vocab, (batches * batch_size, shape.seq), generator=generator)
            return torch.utils.data.DataLoader(data, batch_size=batch_size)

    return RandomTokensGPT


def deepspeed_config(system: str, largest_param: int, swap_dir: str, pin_memory: bool) -> dict[str, Any]:
    """The DeepSpeed config of ``system``; Lightning adds precision, batch size and clipping.

    ZeRO-Infinity's settings are those of ``benchmarks/gpu_throughput.py`` (sub-group size, aio), with its parameter
    buffers sized to hold the model's largest parameter.
    """
    from benchmarks.gpu_throughput import DS_AIO, zero_infinity_offload

    zero: dict[str, Any] = {"contiguous_gradients": True, "overlap_comm": True}
    if system == "zero-offload":
        zero.update(stage=2, offload_optimizer={"device": "cpu", "pin_memory": pin_memory})
        return {"zero_allow_untested_optimizer": True, "zero_optimization": zero}
    zero.update(zero_infinity_offload(swap_dir, swap_dir, largest_param, pin_memory))
    return {"zero_allow_untested_optimizer": True, "zero_optimization": zero, "aio": dict(DS_AIO)}


def _cpu_deepspeed_strategy(config: dict[str, Any]) -> Any:
    import torch
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy on the CPU accelerator (DeepSpeed's own ``DS_ACCELERATOR=cpu``).

        Lightning checks for CUDA in ``setup_environment`` and for CUDA device indices in ``setup_distributed``;
        DeepSpeed needs an integer device index. Nothing else is changed.
        """

        @property
        def root_device(self) -> torch.device:
            return torch.device("cpu", 0)

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    return CPUDeepSpeedStrategy(config=config)


def _strategy(spec: dict[str, Any], module: Any, on_gpu: bool) -> Any:
    system = spec["system"]
    swap_dir = spec["swap_dir"]
    if system == "plain":
        return "auto"
    if system == "ratel":
        from lightning_ratel import RatelStrategy

        kwargs = dict(spec["ratel_config"])
        if spec["host_memory_limit"] is not None:
            # host_memory_limit counts the strategy's own memory: what the process holds already is not its to plan.
            kwargs.setdefault("host_memory_limit", max(0, spec["host_memory_limit"] - (_rss_bytes() or 0)))
        return RatelStrategy(ssd_paths=[swap_dir], **kwargs)
    if system in DEEPSPEED_SYSTEMS:
        largest = max(p.numel() for p in module.parameters())
        config = deepspeed_config(system, largest, swap_dir, pin_memory=on_gpu)
        if on_gpu:
            from lightning.pytorch.strategies import DeepSpeedStrategy

            return DeepSpeedStrategy(config=config)
        return _cpu_deepspeed_strategy(config)
    from lightning.pytorch.strategies import ModelParallelStrategy

    class OffloadingModelParallelStrategy(ModelParallelStrategy):
        """Lightning's ModelParallelStrategy without its move of the whole module to the GPU after
        ``configure_model``: FSDP2 with ``CPUOffloadPolicy`` keeps the sharded parameters in host memory itself (and
        has put the buffers on the device), and refuses parameters moved to the GPU."""

        def model_to_device(self) -> None:
            pass

    return OffloadingModelParallelStrategy() if on_gpu else ModelParallelStrategy()


def _step_recorder(warmup: int, steps: int, swap_dir: Path, on_gpu: bool) -> Any:
    import lightning as L
    import torch

    class StepRecorder(L.Callback):
        """Start time of every batch, every step's loss, and the disk counters over the timed steps."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.losses: list[float] = []
            self.io_start: dict[str, int] = {}
            self.io_end: dict[str, int] = {}
            self.swap_bytes = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if on_gpu:
                torch.cuda.synchronize()
            self.starts.append(time.perf_counter())
            if batch_idx == warmup:
                self.io_start = _proc_io()
            elif batch_idx == warmup + steps:
                self.io_end = _proc_io()
            if batch_idx == warmup + steps - 1:
                self.swap_bytes = _disk_usage(swap_dir)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss))

    return StepRecorder()


def train_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One fit of ``spec["system"]``: per-step seconds and losses, disk bytes, peak RSS."""
    import lightning as L
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    system = spec["system"]
    on_gpu = spec["model"] == "gpu"
    if system == "fsdp2":
        import torch.distributed.fsdp as fsdp
        from lightning.pytorch import strategies

        if not (hasattr(fsdp, "fully_shard") and hasattr(fsdp, "CPUOffloadPolicy")):
            raise NotInstalled("this torch has no torch.distributed.fsdp.fully_shard / CPUOffloadPolicy")
        if not hasattr(strategies, "ModelParallelStrategy"):
            raise NotInstalled("this Lightning has no ModelParallelStrategy")
    if system == "zero-infinity":
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise NotInstalled("DeepSpeed's async_io op cannot be built here (it needs libaio and its headers)")
    total_steps = spec["warmup"] + spec["steps"] + 1
    datamodule = None
    if on_gpu:
        from benchmarks.gpu_throughput import parse_model

        base = _gpt_module_class(parse_model(spec["size"]), total_steps, spec["batch_size"])
        module = _system_module(base, system, pin_memory=True)()
    else:
        sys.path.insert(0, str(ROOT / "examples"))
        from lm_module import CausalLMModule
        from text_data import TextDataModule

        datamodule = TextDataModule(seq_len=spec["seq_len"], batch_size=spec["batch_size"])
        module = _system_module(CausalLMModule, system, pin_memory=False)(
            vocab_size=datamodule.vocab_size, max_seq_len=spec["seq_len"], **LLAMA_SIZES[spec["size"]])
    # Counted before the fit: ZeRO-3 and FSDP2 leave partitions in the module's parameters.
    params = sum(p.numel() for p in module.parameters())
    swap_dir = Path(spec["swap_dir"])
    swap_dir.mkdir(parents=True, exist_ok=True)
    recorder = _step_recorder(spec["warmup"], spec["steps"], swap_dir, on_gpu)
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        strategy=_strategy(spec, module, on_gpu),
        precision="bf16-mixed" if on_gpu else "32-true",
        max_steps=total_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # DeepSpeed and ModelParallelStrategy would otherwise shuffle with a DistributedSampler, in another order.
        use_distributed_sampler=False,
        callbacks=[recorder],
    )
    # The same batches in the same order for every system.
    L.seed_everything(0, verbose=False)
    trainer.fit(module, datamodule=datamodule)
    first, last = spec["warmup"], spec["warmup"] + spec["steps"]
    if len(recorder.starts) <= last:
        raise RuntimeError(f"the fit ended after {len(recorder.starts)} batches, before step {last}")
    return {
        "ok": True,
        "step_seconds": [b - a for a, b in zip(recorder.starts[first:last], recorder.starts[first + 1:last + 1])],
        "losses": recorder.losses,
        "disk_read_per_step": (recorder.io_end["read"] - recorder.io_start["read"]) / spec["steps"],
        "disk_written_per_step": (recorder.io_end["written"] - recorder.io_start["written"]) / spec["steps"],
        "swap_bytes": recorder.swap_bytes,
        "params": params,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch_threads": torch.get_num_threads(),
    }


class NotInstalled(Exception):
    """A system that cannot run here for want of a package or a build dependency."""


def classify(exc: BaseException) -> str:
    """The status of a run that raised ``exc``: out of memory, not installed or failed, with the reason."""
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    if isinstance(exc, NotInstalled):
        return f"not installed: {exc}"
    if isinstance(exc, MemoryError) or any(marker in message.lower() for marker in OOM_MARKERS):
        return f"out of memory: {message}"
    if type(exc).__name__ == "RatelPlanError":
        return f"out of memory (refused before the first step): {message}"
    return f"failed: {message}"


def worker_main(spec: dict[str, Any]) -> None:
    try:
        result = train_worker(spec)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the row's status
        traceback.print_exc()
        result = {"ok": False, "status": classify(exc),
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------- parent side


class Entry(NamedTuple):
    """One row of the table: its label, the system, the Ratel configuration it runs with, and the name of its swap
    directory and logs."""

    label: str
    system: str
    ratel_config: dict[str, Any]
    name: str


def row_entries(systems: Sequence[str], ratel_configs: Sequence[dict[str, Any]]) -> list[Entry]:
    """One row per system, and per Ratel configuration where several are given (labelled by the configuration)."""
    entries = []
    for system in systems:
        if system != "ratel" or len(ratel_configs) == 1:
            entries.append(Entry(system, system, ratel_configs[0] if system == "ratel" else {}, system))
            continue
        entries += [Entry(f"ratel {json.dumps(config, sort_keys=True)}", system, config, f"{system}-{k + 1}")
                    for k, config in enumerate(ratel_configs)]
    return entries


def not_installed(system: str) -> str | None:
    """Why ``system`` cannot run in this environment, or None (FSDP2's check needs torch: its worker makes it)."""
    if system in DEEPSPEED_SYSTEMS and importlib.util.find_spec("deepspeed") is None:
        return "not installed: deepspeed (pip install 'lightning_ratel[peers]')"
    return None


def run_one(spec: dict[str, Any], cap: int | None, timeout: float, log: Path) -> dict[str, Any]:
    """Run one system in a subprocess, killing it if its RSS goes over ``cap``; its result or a failure status."""
    env = dict(os.environ)
    if spec["model"] == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peers", "--worker", json.dumps(spec)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True,
        )
        over_cap: list[int] = []
        watched_peak = [0]

        def watch() -> None:
            while process.poll() is None:
                rss = _rss_bytes(process.pid) or 0
                watched_peak[0] = max(watched_peak[0], rss)
                if cap is not None and rss > cap:
                    over_cap.append(rss)
                    process.send_signal(signal.SIGKILL)
                    return
                time.sleep(RSS_POLL_SECONDS)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            stdout, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, _ = process.communicate()
            return {"ok": False, "status": f"failed: no result within --run-timeout {timeout:.0f} s"}
        watcher.join()
    log_file_text = log.read_text(errors="replace")
    log.write_text(log_file_text + stdout)
    if over_cap:
        return {"ok": False, "status": f"out of memory: RSS {over_cap[0] / GIB:.2f} GiB over the cap, killed",
                "peak_rss": over_cap[0]}
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        if process.returncode == -signal.SIGKILL:
            return {"ok": False, "status": "out of memory: killed by SIGKILL (the kernel's OOM killer?)",
                    "peak_rss": watched_peak[0]}
        tail = [line for line in log_file_text.splitlines() if line.strip()][-1:] or ["no output"]
        return {"ok": False, "status": f"failed: exit code {process.returncode}: {tail[0][:300]}"}
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    if result["ok"] and cap is not None and result["peak_rss"] > cap:
        result.update(ok=False, status=f"out of memory: peak RSS {result['peak_rss'] / GIB:.2f} GiB over the cap")
    return result


def summarize(system: str, runs: list[dict[str, Any]], reason: str | None) -> dict[str, Any]:
    """One row of the table from a system's runs (``reason``: why it did not run at all)."""
    row: dict[str, Any] = {"system": system}
    if reason is not None:
        return {**row, "status": reason}
    failed = [run for run in runs if not run["ok"]]
    row["peak_rss"] = max((run.get("peak_rss") or 0 for run in runs), default=None) or None
    if failed:
        return {**row, "status": failed[0]["status"], "rounds_ok": len(runs) - len(failed)}
    steps = [s for run in runs for s in run["step_seconds"]]
    row.update(
        status="ran",
        seconds_per_step=statistics.median(steps),
        round_medians=[statistics.median(run["step_seconds"]) for run in runs],
        disk_read_per_step=statistics.median(run["disk_read_per_step"] for run in runs),
        disk_written_per_step=statistics.median(run["disk_written_per_step"] for run in runs),
        swap_bytes=max(run["swap_bytes"] for run in runs),
        losses=runs[0]["losses"],
        torch_threads=runs[0]["torch_threads"],
        final_loss=runs[0]["losses"][-1],
    )
    return row


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Each ran row's s/step over the fastest, and its largest loss difference to plain Lightning's."""
    ran = [row for row in rows if row["status"] == "ran"]
    if ran:
        fastest = min(row["seconds_per_step"] for row in ran)
        for row in ran:
            row["vs_fastest"] = row["seconds_per_step"] / fastest
    plain = next((row for row in ran if row["system"] == "plain"), None)
    for row in ran:
        if plain is not None and len(row["losses"]) == len(plain["losses"]):
            row["max_loss_diff_vs_plain"] = max(abs(a - b) for a, b in zip(row["losses"], plain["losses"]))


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Column names and formatted cells, shared by the console and the markdown table."""
    columns = ["system", "status", "threads", "s/step (median)", "x fastest", "round medians s", "peak RSS GiB",
               "disk read MB/step", "disk written MB/step", "swap MB", "final loss", "max |loss - plain|"]
    cells = []
    for row in rows:
        cells.append([
            row["system"], row["status"], _fmt(row.get("torch_threads"), "{}"),
            _fmt(row.get("seconds_per_step"), "{:.3f}"),
            _fmt(row.get("vs_fastest"), "{:.2f}x"),
            ", ".join(f"{s:.3f}" for s in row.get("round_medians", [])) or "-",
            _fmt(row.get("peak_rss") and row["peak_rss"] / GIB, "{:.2f}"),
            _fmt(row.get("disk_read_per_step") and row["disk_read_per_step"] / 1e6, "{:.1f}"),
            _fmt(row.get("disk_written_per_step") and row["disk_written_per_step"] / 1e6, "{:.1f}"),
            _fmt(row.get("swap_bytes") and row["swap_bytes"] / 1e6, "{:.1f}"),
            _fmt(row.get("final_loss"), "{:.4f}"), _fmt(row.get("max_loss_diff_vs_plain"), "{:.2e}"),
        ])
    return columns, cells


def markdown(report: dict[str, Any]) -> str:
    columns, cells = table_rows(report["rows"])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in cells]
    return "\n".join([*report["notes"], "", *lines, ""])


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in ("torch", "lightning", "transformers", "deepspeed"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--model", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: the demo's Llama, 32-true on the CPU; gpu: gpu_throughput's GPT-2, bf16-mixed")
    parser.add_argument("--size", help=f"cpu: one of {', '.join(LLAMA_SIZES)} (default demo); gpu: LxHxD as in "
                                       "gpu_throughput (default 8x8x1024)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first; RatelStrategy profiles 2 and plans before the 3rd (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, interleaved (default 3)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128, help="cpu model's window (the gpu model's is 1024)")
    parser.add_argument("--threads", type=int,
                        help="torch intra-op threads in every run (default: torch's own choice, shown per system)")
    parser.add_argument("--host-memory-limit",
                        help="host memory cap for every system, e.g. 2GiB: a run whose RSS exceeds it is killed "
                             "and reported out of memory; Ratel is told the cap (see the module docstring)")
    parser.add_argument("--swap-dir", type=Path, default=Path("outputs") / "peers-swap",
                        help="parent of each system's swap directory (Ratel's swap files, ZeRO-Infinity's nvme_path); "
                             "each is removed after its run")
    parser.add_argument("--ratel-config", type=json.loads, nargs="+", default=[{}],
                        help="JSON object of further RatelStrategy keyword arguments; several give one ratel row "
                             "each, labelled by its object")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=Path("outputs") / "peers",
                        help="directory for peers.json, peers.md and each run's log")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        if args.size is None:
            args.size = "demo" if args.model == "cpu" else "8x8x1024"
        if args.model == "cpu" and args.size not in LLAMA_SIZES:
            parser.error(f"--size for the cpu model is one of {', '.join(LLAMA_SIZES)}")
        if args.model == "gpu":
            from benchmarks.gpu_throughput import parse_model

            try:
                parse_model(args.size)
            except ValueError as exc:
                parser.error(str(exc))
        if min(args.steps, args.rounds) < 1 or args.warmup < 0:
            parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return
    # The parent only starts runs and prints: it imports neither torch nor Lightning unless it must.
    from rich.console import Console
    from rich.table import Table

    device = None
    if args.model == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("peers --model gpu needs a CUDA GPU, and torch sees none here. Nothing was measured.")
        device = torch.cuda.get_device_name(0)
    cap = None
    if args.host_memory_limit:
        from lightning_ratel.sizes import parse_bytes

        cap = parse_bytes(args.host_memory_limit, "--host-memory-limit")
    # Wide enough that the table is not folded into unreadable columns when the output goes to a file.
    console = Console(width=max(Console().width, 200))
    args.out.mkdir(parents=True, exist_ok=True)
    entries = row_entries(args.systems, args.ratel_config)
    reasons = {entry.label: not_installed(entry.system) for entry in entries}
    runnable = [entry for entry in entries if reasons[entry.label] is None]
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    runs: dict[str, list[dict[str, Any]]] = {entry.label: [] for entry in entries}
    for round_index in range(args.rounds):
        shift = round_index % max(1, len(runnable))
        for label, system, ratel_config, name in runnable[shift:] + runnable[:shift]:
            swap_dir = args.swap_dir.resolve() / name
            spec = {"system": system, "model": args.model, "size": args.size, "steps": args.steps,
                    "warmup": args.warmup, "batch_size": args.batch_size, "seq_len": args.seq_len,
                    "swap_dir": str(swap_dir), "host_memory_limit": cap, "ratel_config": ratel_config,
                    "threads": args.threads}
            console.print(f"round {round_index + 1}/{args.rounds}: {label} ...", end=" ")
            try:
                result = run_one(spec, cap, args.run_timeout, args.out / f"{name}-round{round_index + 1}.log")
            finally:
                shutil.rmtree(swap_dir, ignore_errors=True)
            console.print(result.get("status", "ran"))
            runs[label].append(result)
    load_after = os.getloadavg()
    rows = [summarize(entry.label, runs[entry.label], reasons[entry.label]) for entry in entries]
    add_comparisons(rows)
    params = next((run.get("params") for system_runs in runs.values() for run in system_runs if run.get("params")),
                  None)
    model = (f"Llama '{args.size}' ({LLAMA_SIZES[args.size]}), batch {args.batch_size} x {args.seq_len + 1} tokens of "
             "Genesis, 32-true on the CPU" if args.model == "cpu"
             else f"GPT-2 {args.size}, batch {args.batch_size} x 1024 random tokens, bf16-mixed on "
                  f"{device}")
    installed = versions()
    notes = [
        f"Command: python -m benchmarks.peers {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"Started {started}; {os.cpu_count()} CPUs; load average (1/5/15 min) "
        f"{' / '.join(f'{x:.2f}' for x in load_before)} before and {' / '.join(f'{x:.2f}' for x in load_after)} "
        "after" + (" (above the CPU count: other work shared the machine, so the timings are noisy)."
                   if max(load_before[0], load_after[0]) > (os.cpu_count() or 1) else "."),
        f"Model: {model}" + (f", {params:,} parameters." if params else "."),
        f"{args.warmup} untimed warm-up steps, then {args.steps} timed steps per run; {args.rounds} interleaved "
        "rounds. s/step: median of every timed step of every round; x fastest: over the fastest system that ran.",
        "Peak RSS: the largest of the system's runs (each its own process). Disk: /proc/self/io bytes that reached "
        "the block layer over the timed steps, per step (median over rounds); swap: on-disk size of its swap "
        "directory at the last timed step. Loss: final (round 1) and the largest |loss - plain Lightning| over "
        "every step.",
        "Host memory cap: " + (f"{cap / GIB:.2f} GiB for every system, enforced by killing a run whose RSS "
                               "(polled every 20 ms, and its own ru_maxrss at the end) goes over it; Ratel is also "
                               "given it as host_memory_limit less the RSS at its fit's start."
                               if cap else "none."),
        # OpenMP threads that spin while they wait take the cores from those that work on a busy machine: under
        # load these settings change the figures more than the systems do.
        "Threading environment: " + (", ".join(f"{k}={os.environ[k]}" for k in THREAD_ENV if k in os.environ)
                                     or "defaults") + ".",
        "Versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in installed.items()) + ".",
    ]
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "worker"},
              "versions": installed, "load_before": load_before, "load_after": load_after, "started": started,
              "notes": notes, "rows": rows, "runs": runs}
    (args.out / "peers.json").write_text(json.dumps(report, indent=1))
    (args.out / "peers.md").write_text(markdown(report))
    columns, cells = table_rows(rows)
    table = Table(title="RatelStrategy and its peers: same model, same data")
    for column in columns:
        table.add_column(column, justify="left" if column in ("system", "status") else "right")
    for row in cells:
        table.add_row(*row)
    for line in notes:
        console.print(line)
    console.print(table)
    console.print(f"written: {args.out / 'peers.json'}, {args.out / 'peers.md'}")


if __name__ == "__main__":
    main()
