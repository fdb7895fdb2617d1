"""Fine-tune a pretrained Llama whose model states are more than twice this machine's RAM, end to end.

Five phases, each streamed so that host memory holds a few blocks at a time, never the model:

1. write   a bf16 Hugging Face checkpoint of a Llama-style model (random weights standing in for a published model:
           sharded ``model-0000k-of-0000n.safetensors`` with an index and ``config.json``), one tensor at a time;
2. load    ``RatelStrategy(pretrained=folder)`` on a model built on the meta device: each block's tensors are read
           (``safe_open``, memory-mapped) and written to the swap files as fp32 masters;
3. train   a few steps (``param_cache="ssd"``: compute copies read from the swap files; activations recomputed);
4. checkpoint  a sharded checkpoint at the last step (fp32 masters, Adam moments, step counts, loop state, plan);
5. export  a bf16 Hugging Face folder of the trained weights (``RatelHFExport``);

then a second run resumes from the checkpoint (``resume``: masters and moments read back shard by shard) and trains
one more step. The disk is measured first with the swap store's own probe (O_DIRECT, striped), so each phase's
throughput is printed against it, with the peak resident set size of each phase (``VmHWM``, reset at every phase
boundary through ``/proc/self/clear_refs``).

The defaults are a 3.37B-parameter Llama (53.9 GB of model states at 16 bytes per parameter). Disk needed: the
checkpoint folder (2 bytes per parameter), the swap files (24 bytes per parameter: master and moments in two slots,
so a step commits as a whole), the sharded checkpoint (12) and the export (2): about 135 GB for the default size.
Smaller sizes run the same code (``--layers 2 --hidden 256 --intermediate 512 --heads 4 --vocab 2048`` takes
seconds).

Run from the repository root:

    .venv/bin/python examples/finetune_pretrained.py --work-dir /mnt/nvme0/ratel-finetune
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_ratel import RatelHFExport, RatelStrategy  # noqa: E402
from lightning_ratel.io.export import SAFE_INDEX, SAFE_WEIGHTS  # noqa: E402
from lightning_ratel.runtime.probe import disk_bandwidth  # noqa: E402
from lightning_ratel.sizes import format_bytes  # noqa: E402
from lightning_ratel.io.tensorfiles import TensorFileWriter  # noqa: E402
from beyond_ram import (  # noqa: E402
    HelpFormatter,
    RepeatedWindowLM,
    add_model_arguments,
    llama_config,
    memory_total,
    training_window,
)

GIB = 2**30
GB = 1e9
DISK_BYTES_PER_PARAM = 40
"""Disk the example needs per parameter: the checkpoint folder (2), the swap files (24: master and moments in two
slots), the sharded checkpoint (12) and the export (2)."""


class Phases:
    """Wall time, peak resident set size (``VmHWM``, reset when a phase starts) and the bytes the process read from and
    wrote to storage (``/proc/self/io``, all threads, direct I/O included) in each phase."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}
        self.current: str | None = None
        self._start = 0.0
        self._io = (0, 0)

    @staticmethod
    def _storage_bytes() -> tuple[int, int]:
        counters = {}
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                counters[key] = int(value)
        return counters["read_bytes"], counters["write_bytes"]

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def begin(self, name: str) -> None:
        self.end()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.current = name
        self._start = time.perf_counter()
        self._io = self._storage_bytes()

    def end(self, nbytes: float = 0.0) -> None:
        if self.current is None:
            return
        row = self.rows.setdefault(self.current, {"seconds": 0.0, "peak_rss": 0.0, "bytes": 0.0, "read": 0.0,
                                                  "written": 0.0})
        row["seconds"] += time.perf_counter() - self._start
        row["peak_rss"] = max(row["peak_rss"], self._status("VmHWM"))
        row["bytes"] += nbytes
        read, written = self._storage_bytes()
        row["read"] += read - self._io[0]
        row["written"] += written - self._io[1]
        self.current = None

    @contextmanager
    def phase(self, name: str) -> Iterator[dict[str, float]]:
        moved = {"bytes": 0.0}
        self.begin(name)
        try:
            yield moved
        finally:
            self.end(moved["bytes"])


def write_checkpoint(config: LlamaConfig, folder: Path, max_shard_bytes: int, seed: int) -> int:
    """A bf16 Hugging Face checkpoint of ``config`` with random weights, written one tensor at a time.

    Returns:
        Bytes of weights written.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = torch.Size(shape).numel() * 2
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nbytes
    names = [SAFE_WEIGHTS] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    total = 0
    for file, entries in zip(names, files):
        writer = TensorFileWriter(folder / file, [(n, torch.bfloat16, s) for n, s in entries], {"format": "pt"})
        for name, shape in entries:
            if name.endswith("norm.weight"):
                value = torch.ones(shape, dtype=torch.bfloat16)
            else:
                value = (torch.randn(shape, generator=generator) * config.initializer_range).to(torch.bfloat16)
            writer.write(name, value)
            total += value.numel() * 2
            del value
        writer.close()
    if len(files) > 1:
        weight_map = {n: f for f, entries in zip(names, files) for n, _ in entries}
        (folder / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    return total


class Watch(Callback):
    """Switches phases at Lightning's hooks and records the loss of each step."""

    def __init__(self, phases: Phases, load_phase: str, train_phase: str) -> None:
        self.phases = phases
        self.load_phase = load_phase
        self.train_phase = train_phase
        self.losses: list[float] = []
        self.step_seconds: list[float] = []
        self._step_start = 0.0
        self.store_written_at_load = 0
        self.store_read_at_load = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.phases.begin(self.load_phase)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        io = trainer.strategy.io_bytes()
        self.store_written_at_load = io["written"]
        self.store_read_at_load = io["read"]
        self.phases.end()
        self.phases.begin(self.train_phase)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.phases.end()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.step_seconds.append(time.perf_counter() - self._step_start)
        print(f"  step {trainer.global_step}: loss {self.losses[-1]:.4f}, {self.step_seconds[-1]:.1f} s", flush=True)


def timed(phases: Phases, name: str, method: Any, strategy: RatelStrategy) -> Any:
    """``method`` run as phase ``name`` (the phase that was running resumes afterwards). The updates of the step that
    just ended finish first, in the phase that was running: they are the step's work, not the save's."""

    def run(*args: Any, **kwargs: Any) -> Any:
        outer = phases.current
        strategy.synchronize()
        phases.end()
        with phases.phase(name):
            result = method(*args, **kwargs)
        if outer is not None:
            phases.begin(outer)
        return result

    return run


def parameter_count(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def layers_that_fit(config: LlamaConfig, free: int) -> int:
    """The most decoder layers (at the other sizes of ``config``) whose run fits in ``free`` bytes of disk."""
    one, two = (parameter_count(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": n})) for n in (1, 2))
    per_layer, rest = two - one, 2 * one - two
    return max(0, int((free / DISK_BYTES_PER_PARAM - rest) // per_layer))


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("outputs") / "finetune-pretrained",
                        help="where the checkpoint folder, swap files, sharded checkpoint and export go")
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=2, help="steps of the first run (the resumed run adds one)")
    parser.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate")
    parser.add_argument("--max-shard-size", type=float, default=5.0, help="GB per file of the checkpoint folder")
    parser.add_argument("--probe-gib", type=float, default=2.0, help="GiB the disk probe writes and reads")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (removed at the end otherwise)")
    args = parser.parse_args()
    L.seed_everything(0)
    on_gpu = torch.cuda.is_available()
    config = llama_config(args)
    params = parameter_count(config)
    ram = memory_total()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    hf, swap, ckpt_dir, export_dir = work / "hf", work / "swap", work / "checkpoints", work / "export"
    swap.mkdir(exist_ok=True)
    free = shutil.disk_usage(work).free
    print(f"Llama: {params:,} parameters; model states 16 B x P = {format_bytes(16 * params)} = "
          f"{16 * params / ram:.2f} x this machine's RAM ({format_bytes(ram)}); {format_bytes(free)} free in {work}, "
          f"about {format_bytes(DISK_BYTES_PER_PARAM * params)} needed")
    if DISK_BYTES_PER_PARAM * params > free:
        # Refused before anything is written: the strategy would refuse the swap files only after the checkpoint
        # folder was written.
        fits = layers_that_fit(config, free)
        raise SystemExit(f"not enough disk in {work}: about {format_bytes(DISK_BYTES_PER_PARAM * params)} needed, "
                         f"{format_bytes(free)} free. Point --work-dir at a larger drive, or shrink the model "
                         + (f"(--layers {fits} fits)." if fits else "(--hidden, --intermediate, --vocab)."))
    phases = Phases()

    probe = int(args.probe_gib * GIB)
    with phases.phase("disk probe"):
        read_bw, write_bw = disk_bandwidth([str(swap)], probe)
    print(f"disk ({swap}, O_DIRECT, {args.probe_gib:g} GiB): read {format_bytes(read_bw)}/s, write "
          f"{format_bytes(write_bw)}/s", flush=True)

    with phases.phase("write") as moved:
        moved["bytes"] = write_checkpoint(config, hf, int(args.max_shard_size * GB), seed=0)
    print(f"wrote {hf} ({format_bytes(folder_bytes(hf))})", flush=True)

    tokens = training_window(args.seq_len)

    def run(steps: int, load_phase: str, train_phase: str, ckpt_path: str | None) -> Watch:
        with torch.device("meta"):
            module = RepeatedWindowLM(config, args.lr)
        strategy = RatelStrategy(ssd_paths=[str(swap)], param_cache="ssd", activation_policy="recompute",
                                 checkpoint_format="sharded", pretrained=str(hf) if ckpt_path is None else None)
        # Timed as phases of their own: RatelHFExport and ModelCheckpoint call these.
        setattr(strategy, "save_checkpoint", timed(phases, "checkpoint", strategy.save_checkpoint, strategy))
        setattr(strategy, "save_pretrained", timed(phases, "export", strategy.save_pretrained, strategy))
        watch = Watch(phases, load_phase, train_phase)
        callbacks: list[Callback] = [watch]
        if ckpt_path is None:
            callbacks += [ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=steps, save_top_k=-1),
                          RatelHFExport(str(export_dir), dtype="bf16")]
        trainer = L.Trainer(accelerator="gpu" if on_gpu else "cpu", devices=1, strategy=strategy,
                            precision="bf16-mixed" if on_gpu else "32-true", max_steps=steps, logger=False,
                            enable_checkpointing=ckpt_path is None, enable_progress_bar=sys.stderr.isatty(),
                            enable_model_summary=False, callbacks=callbacks, default_root_dir=str(work))
        loader = DataLoader([tokens] * (steps + 1), batch_size=1)
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
        phases.end()
        # What the run copied back (when it fitted) is not needed any more: the trainer and module reference each
        # other, and the C allocator keeps freed memory until asked to give it back.
        del trainer, module, strategy
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return watch

    print("first run: load from the checkpoint folder, train, save a sharded checkpoint, export", flush=True)
    first = run(args.steps, "load", "train", None)
    checkpoint = next(ckpt_dir.glob(f"*step={args.steps}.ckpt"))
    phases.rows["checkpoint"]["bytes"] = folder_bytes(checkpoint)
    phases.rows["export"]["bytes"] = folder_bytes(export_dir / "final")
    # Kept swap files of the first run hold nothing the checkpoint does not: remove them before the resume.
    shutil.rmtree(swap)
    swap.mkdir()
    print(f"resumed run: from {checkpoint.name}, one more step", flush=True)
    resumed = run(args.steps + 1, "resume", "train (resumed)", str(checkpoint))
    phases.rows["resume"]["bytes"] = folder_bytes(checkpoint)

    rows = phases.rows
    rows["load"]["bytes"] = folder_bytes(hf)
    print()
    print(f"losses: first run {', '.join(f'{x:.4f}' for x in first.losses)}; resumed "
          f"{', '.join(f'{x:.4f}' for x in resumed.losses)}")
    # The phases that move data read and write the same disk: its busy share is the time the measured bandwidths need
    # for what the phase read and wrote, over the phase's time.
    print(f"{'phase':<16}{'seconds':>9}{'peak RSS':>12}{'moved':>12}{'read':>12}{'written':>12}{'disk busy':>11}")
    for name, row in rows.items():
        busy = (row["read"] / read_bw + row["written"] / write_bw) / row["seconds"] if row["seconds"] else 0.0
        sizes = "".join(f"{format_bytes(row[key]):>12}" for key in ("peak_rss", "bytes", "read", "written"))
        print(f"{name:<16}{row['seconds']:9.1f}{sizes}{busy:11.0%}")
    load = rows["load"]
    moved = load["bytes"] + first.store_written_at_load
    print(f"load moved {format_bytes(moved)} in all (folder read + swap files written): "
          f"{format_bytes(moved / load['seconds'])}/s; resume read {format_bytes(rows['resume']['bytes'])} and wrote "
          f"{format_bytes(resumed.store_written_at_load)} to the swap files")
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
