"""One data-parallel training run, for the multi-process tests: ``python -m tests.distributed_run OUT [options]``.

Lightning's own launcher starts the other ranks (``devices=N``), or the test starts one process per node
(``--num-nodes``, with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set), or every rank (``LOCAL_RANK`` set too;
most tests fork them through :mod:`tests.forked_ranks`, which calls :func:`main`). Every rank writes ``OUT/rank<r>.pt``:
its parameters and optimizer state after fit (as a user reads them), the bytes the strategy held at the end of training,
the bytes it read from a pretrained folder and from a sharded checkpoint, the growth of the process's proportional set
size and of its private memory (before and after the heap hands its free memory back) from the start of ``main`` to
then, its peak RSS, its state traffic per step, the metrics logged last and, with ``--plan-auto``, the plan it applied.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import errno
import os
import resource
import sys
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_ratel import RatelHFExport, RatelPrecision, RatelStrategy
from lightning_ratel import strategy as strategy_module
from lightning_ratel.engine import planner
from lightning_ratel.engine.coordinator import RatelEngine
from lightning_ratel.io import checkpoint, sharded
from lightning_ratel.io.pretrained import PretrainedFolder
from lightning_ratel.io.sharded import ShardedReader
from lightning_ratel.runtime.collectives import StoredCopies
from lightning_ratel.runtime.peerstore import PeerStore
from lightning_ratel.sizes import path_bytes
from tests.models import LM, cache_off, final_state, trainer


def proportional_set_size() -> int:
    """This process's memory with each page shared with others counted in proportion (Linux ``Pss``; 0 elsewhere):
    summed over the processes of a node, memory they share counts once."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def private_memory() -> int:
    """This process's anonymous memory and its proportional share of shared memory (Linux ``Pss_Anon`` +
    ``Pss_Shmem``; 0 elsewhere): the memory it made, not the libraries' file pages it maps, with a host cache shared on
    the node counted once over the node's processes."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            fields = dict(line.split()[:2] for line in rollup if line.startswith(("Pss_Anon:", "Pss_Shmem:")))
    except OSError:
        return 0
    return sum(int(kb) * 1024 for kb in fields.values())


def _trim_heap() -> None:
    """Hand the heap's free memory back to the kernel (glibc's ``malloc_trim``; nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def shared_cache_memory() -> tuple[int, int]:
    """Resident and proportional bytes of this process's mappings of a host cache shared with the node's other ranks
    (Linux; (0, 0) without one)."""
    rss = pss = 0
    inside = False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split()
                if head and "-" in head[0] and not head[0].endswith(":"):
                    inside = "ratel-host-cache-" in line
                elif inside and head[0] == "Rss:":
                    rss += int(head[1]) * 1024
                elif inside and head[0] == "Pss:":
                    pss += int(head[1]) * 1024
    except OSError:
        pass
    return rss, pss


class _Measure(L.Callback):
    """The bytes the strategy holds (engine accounting, swap files on disk) once training ends, before teardown, the
    process's proportional set size then, above ``baseline``, its private memory (:func:`private_memory`) above
    ``private``, as it is and once the heap handed its free memory back, and its memory of a host cache shared on the
    node."""

    def __init__(self, swap: Path, baseline: int, private: int) -> None:
        self.swap = swap
        self.baseline = baseline
        self.private = private
        self.figures: dict[str, Any] = {}
        self._io_at_start: dict[str, int] = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._io_at_start = getattr(trainer.strategy, "io_bytes", dict)()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        placement = getattr(trainer.strategy, "byte_placement", dict)()
        states = getattr(trainer.strategy, "state_placement", dict)()
        self.figures = {"placement": placement, "states": states,
                        "swap_bytes": path_bytes(self.swap) if self.swap.exists() else 0,
                        "pss_growth": proportional_set_size() - self.baseline,
                        "private_growth": private_memory() - self.private,
                        "shared_cache": shared_cache_memory()}
        _trim_heap()
        self.figures["private_growth_trimmed"] = private_memory() - self.private
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and engine.adam is not None:
            # How this rank's own optimizer ran its updates (overlapped, deferred, redone, dropped).
            engine.adam.barrier()
            self.figures["counts"] = dict(getattr(engine.adam, "local", engine.adam).counts)
            local = getattr(engine.adam, "local", None)
            if local is not None:
                # What the gradient exchange holds, in the engine's host accounting.
                self.figures["exchange_bytes"] = engine.adam.host_buffer_bytes - local.host_buffer_bytes
                self.figures["buffer_sets_bytes"] = local.buffers.nbytes
                self.figures["exchange_counts"] = engine.adam.exchange_counts
            self.figures["state_traffic"] = trainer.strategy.state_traffic()
            self.figures["step_traffic"] = trainer.strategy.step_traffic()
            # What the swap files moved during fit, every write-back landed.
            engine.adam.barrier(include_writes=True)
            io = trainer.strategy.io_bytes()
            self.figures["fit_io"] = {what: io[what] - self._io_at_start.get(what, 0) for what in io}
            if engine.exchange is not None:
                self.figures["exchange"] = engine.exchange.mode
            # Every parameter read between steps as a callback reads it, on this rank alone.
            self.figures["read_params"] = {name: p.detach().float().clone() for name, p in module.named_parameters()}
        profiler = getattr(trainer.strategy, "profiler", None)
        if profiler is not None and profiler.plan is not None:
            self.figures["plan"] = profiler.plan.to_json()


class _Save(L.Callback):
    """Save a checkpoint at the end of training, or after every step, on every rank (as ``trainer.save_checkpoint`` is
    called)."""

    def __init__(self, path: str, every_step: bool = False) -> None:
        self.path = path
        self.every_step = every_step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.every_step:
            trainer.save_checkpoint(self.path)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not self.every_step:
            trainer.save_checkpoint(self.path)


def _count_reads(fail_save: str | None) -> dict[str, int]:
    """Count the bytes this rank reads from a pretrained folder and from a sharded checkpoint (masters and moments),
    and the files it wrote of the last sharded checkpoint; with ``fail_save`` (``LOCAL_RANK:STEP``), make that rank's
    part of the sharded checkpoint of that step fail to write."""
    counts = {"pretrained": 0, "checkpoint": 0, "checkpoint_files": 0}
    folder_read = PretrainedFolder.read
    read_into = ShardedReader.read_into

    @contextlib.contextmanager
    def counted_folder_read(self: PretrainedFolder, keys: Any) -> Any:
        with folder_read(self, keys) as tensors:
            counts["pretrained"] += sum(t.numel() * t.element_size() for t in tensors.values())
            yield tensors

    def counted_read_into(self: ShardedReader, record: Any, what: str, out: torch.Tensor) -> torch.Tensor:
        counts["checkpoint"] += out.numel() * out.element_size()
        return read_into(self, record, what, out)

    failing = tuple(int(x) for x in fail_save.split(":")) if fail_save else None
    write_files = sharded._write_files

    def counted_write_files(directory: Path, checkpoint: dict, *args: Any, **kwargs: Any) -> Any:
        if failing is not None and (int(os.environ.get("LOCAL_RANK", "0")), checkpoint.get("global_step")) == failing:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(directory))
        parts = write_files(directory, checkpoint, *args, **kwargs)
        counts["checkpoint_files"] = sum(part.file is not None for part in parts)
        return parts

    PretrainedFolder.read = counted_folder_read  # type: ignore[method-assign]
    ShardedReader.read_into = counted_read_into  # type: ignore[method-assign]
    sharded._write_files = counted_write_files  # type: ignore[attr-defined]
    return counts


class _Raise(L.Callback):
    """Raise on one rank at one step (the others must stop too), ``where``: after its backward (``"backward"``), before
    its first forward (``"early"``), at the end of its forward while the others log the loss with ``sync_dist``
    (``"forward"``), or after the step while the others wait in ``trainer.strategy.barrier()`` (``"barrier"``)."""

    def __init__(self, rank: int, step: int, where: str = "backward") -> None:
        self.rank = rank
        self.step = step
        self.where = where

    def _fail(self, trainer: L.Trainer) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if os.environ.get("RATEL_TEST_KILL"):
                os._exit(9)
            raise RuntimeError(f"rank {self.rank} fails at step {self.step}")

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if self.where == "forward":
            module.model.register_forward_hook(lambda *_: self._fail(trainer) if torch.is_grad_enabled() else None)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.where == "early":
            self._fail(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if self.where == "backward":
            self._fail(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if self.where == "barrier" and trainer.global_step == self.step:
            self._fail(trainer)
            trainer.strategy.barrier()


class _NoRoom(L.Callback):
    """Make one rank find (almost) no free host memory when the run ends, so that it alone would decide to copy
    nothing back."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank == self.rank:
            checkpoint.available_host_memory = lambda: 1


class _TightHost(L.Callback):
    """Leave one rank no host room for activations (a ``host_memory_limit`` 1 MiB below what its engine holds), set
    before the strategy's profiler plans at the end of the profiled batches."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        engine = trainer.strategy.engine
        if trainer.global_rank == self.rank:
            engine.config.host_memory_limit = engine.byte_placement()["host"] - (1 << 20)


def node_speeds(node: int, slow_node: int | None) -> dict[str, float]:
    """The speeds node ``node`` reports with ``--slow-node`` or ``--same-speeds`` (:func:`_fixed_speeds`): the slow
    node a tenth of the others'. The disks are slow (hundreds of KB/s), so that a node's state traffic takes seconds
    of its predicted step: more than what each node measures of its own step varies between the processes of one busy
    machine (tens of milliseconds)."""
    share = 0.1 if node == slow_node else 1.0
    return {"h2d_bandwidth": 8e9 * share, "d2h_bandwidth": 8e9 * share, "ssd_read_bandwidth": 2e5 * share,
            "ssd_write_bandwidth": 1e5 * share, "adam_params_per_s": 2e8 * share}


def _fixed_speeds(slow_node: int | None) -> None:
    """Make this node's hardware probe report :func:`node_speeds` instead of what it measured (the nodes of the tests
    are one machine), keeping the free capacities it read."""
    measure = planner.measure_hardware

    def fixed(*args: Any, **kwargs: Any) -> Any:
        node = int(os.environ.get("NODE_RANK", "0"))
        return dataclasses.replace(measure(*args, **kwargs), **node_speeds(node, slow_node))

    planner.measure_hardware = fixed  # type: ignore[assignment]


def _fail_copies(rank: int) -> None:
    """Make rank ``rank``'s swap store fail every write of a compute copy the publisher received from another rank, as a
    full drive would (the future of the write raises)."""
    write = StoredCopies.write

    def failing(self: StoredCopies, turn: int, shard: Any, copy: torch.Tensor) -> Future:
        if threading.current_thread().name != "ratel-publish" or int(os.environ.get("LOCAL_RANK", "0")) != rank:
            return write(self, turn, shard, copy)
        failed: Future = Future()
        failed.set_exception(OSError(errno.ENOSPC, "No space left on device (injected)"))
        return failed

    StoredCopies.write = failing  # type: ignore[method-assign]


def _damage_peer_copies(rank: int) -> None:
    """On rank ``rank``, damage one byte of the first compute copy another rank announces to it, in that rank's swap
    file (what a failing drive would do to it) once the announcement is in: the next read of it must fail."""
    announce = PeerStore.announce
    damaged: list[str] = []

    def damaging(self: PeerStore, key: str, sums: Any) -> None:
        announce(self, key, sums)
        if int(os.environ.get("LOCAL_RANK", "0")) != rank or damaged:
            return
        chunk = self.extent(key).chunks[0]
        path = self.swap_files[chunk.file].path
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, chunk.file_offset)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), chunk.file_offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        damaged.append(key)

    PeerStore.announce = damaging  # type: ignore[method-assign]


def _claim_device(rank: int, device_type: str) -> None:
    """Make rank ``rank`` tell the others at the rendezvous that it trains on ``device_type``, and make its process
    group one the others can never join (as NCCL's is for ranks on gloo): its ``init_process_group`` never returns."""
    meet = strategy_module.meet_at_rendezvous

    def claimed(this: int, world: int, timeout: Any, value: str) -> Any:
        return meet(this, world, timeout, device_type if this == rank else value)

    init = torch.distributed.init_process_group

    def never_meets(*args: Any, **kwargs: Any) -> None:
        if kwargs["rank"] == rank:
            time.sleep(3600)
        init(*args, **kwargs)

    strategy_module.meet_at_rendezvous = claimed  # type: ignore[assignment]
    torch.distributed.init_process_group = never_meets  # type: ignore[assignment]


def _overflow_on(module: LM, rank: int, step: int) -> None:
    """Give the llama's embedding alone a non-finite gradient, on one rank at one step: its shard completes last in
    backward, after the other shards' speculative updates ran, and only its owner sees the overflow."""

    def hook(embedding: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        t = module.trainer
        if torch.is_grad_enabled() and t.global_rank == rank and t.global_step == step:
            output.register_hook(lambda grad: grad * float("inf"))

    module.model.model.embed_tokens.register_forward_hook(hook)


def arguments() -> argparse.ArgumentParser:
    """The command line of a run."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ratel")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's eps")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--checkpoint-format", default="full")
    parser.add_argument("--save", default=None, help="save a checkpoint here at the end of training")
    parser.add_argument("--resume", default=None, help="resume from this checkpoint")
    parser.add_argument("--states", default="auto", help="RatelStrategy's optimizer_states")
    parser.add_argument("--device-memory-limit", default=None, help="RatelStrategy's device_memory_limit")
    parser.add_argument("--param-cache", default="host", help="RatelStrategy's param_cache")
    parser.add_argument("--exchange", default="auto", help="RatelStrategy's gradient_exchange")
    parser.add_argument("--node-states", default=None,
                        help="each node's optimizer_states, comma-separated in node order (instead of --states)")
    parser.add_argument("--fail", default=None, help="RANK:STEP: raise on that rank at that step")
    parser.add_argument("--fail-early", action="store_true", help="--fail raises before the step's first forward")
    parser.add_argument("--fail-in", default="backward", choices=["backward", "forward", "barrier"],
                        help="--fail raises there (see _Raise)")
    parser.add_argument("--sync-dist", action="store_true", help="the losses are logged with sync_dist=True")
    parser.add_argument("--gather-loss", action="store_true",
                        help="the loss adds a term over every rank's logits, gathered with sync_grads=True")
    parser.add_argument("--on-exception", default=None,
                        help="Lightning's OnExceptionCheckpoint writes <this>/on_exception.ckpt when training fails")
    parser.add_argument("--timeout", type=float, default=60, help="RatelStrategy's timeout of a collective, seconds")
    parser.add_argument("--fault-timeout", type=float, default=None, help="RatelStrategy's fault_timeout, seconds")
    parser.add_argument("--save-every-step", action="store_true", help="save the checkpoint after every step")
    parser.add_argument("--fail-save", default=None, help="RANK:STEP: that rank fails to write that step's checkpoint")
    parser.add_argument("--fail-copy", type=int, default=None,
                        help="that rank's store fails to write the compute copies published to it (--param-cache ssd)")
    parser.add_argument("--damage-peer-copy", type=int, default=None,
                        help="that rank damages the first compute copy it reads from another rank's swap files")
    parser.add_argument("--pretrained", default=None, help="RatelStrategy's pretrained folder")
    parser.add_argument("--keep-swap", action="store_true", help="RatelStrategy's keep_swap_files")
    parser.add_argument("--export", default=None, help="RatelHFExport's dirpath (fp32, at the end of fit); "
                        "RatelStrategy.save_pretrained writes <dirpath>/after once fit is over")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters on a model built on the meta device")
    parser.add_argument("--no-room", type=int, default=None,
                        help="this rank finds no free host memory for the copy back at the end of fit")
    parser.add_argument("--overflow", default=None,
                        help="RANK:STEP: the llama's embedding gets a non-finite gradient on that rank at that step")
    parser.add_argument("--no-speculate", action="store_true",
                        help="every step that clips by norm or scales the loss waits for the end of backward")
    parser.add_argument("--updates-after-backward", action="store_true",
                        help="the cost model decides where updates run (after backward, on the CPU); by default they "
                             "overlap backward, as on a GPU")
    parser.add_argument("--plan-auto", action="store_true",
                        help="RatelStrategy profiles the first step and plans activation placement (plan='auto')")
    parser.add_argument("--slow-node", type=int, default=None,
                        help="every node's probe reports fixed speeds, this node's a tenth of the others' "
                             "(--plan-auto)")
    parser.add_argument("--same-speeds", action="store_true",
                        help="every node's probe reports the same fixed speeds (--plan-auto)")
    parser.add_argument("--claim-device", default=None,
                        help="RANK:TYPE: that rank tells the others at setup that it trains on TYPE")
    parser.add_argument("--tight-host", type=int, default=None,
                        help="this rank has no host room for activations when the plan is made (--plan-auto)")
    parser.add_argument("--validate", type=int, default=0,
                        help="validate on 2 batches every that many training batches (and a sanity check first)")
    return parser


def main(argv: list[str]) -> None:
    baseline, private = proportional_set_size(), private_memory()
    args = arguments().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    swap = out / "swap"
    strategy: Any = args.strategy
    states = args.node_states.split(",")[int(os.environ.get("NODE_RANK", "0"))] if args.node_states else args.states
    if args.strategy == "ratel":
        strategy = RatelStrategy(ssd_paths=[str(swap)], activation_policy=None if args.plan_auto else "device",
                                 param_cache=args.param_cache,
                                 optimizer_states=states, checkpoint_format=args.checkpoint_format,
                                 gradient_exchange=args.exchange, device_memory_limit=args.device_memory_limit,
                                 pretrained=args.pretrained, keep_swap_files=args.keep_swap,
                                 timeout=timedelta(seconds=args.timeout),
                                 **({} if args.fault_timeout is None else
                                    {"fault_timeout": timedelta(seconds=args.fault_timeout)}))
    measure = _Measure(swap, baseline, private)
    callbacks: list[L.Callback] = [measure]
    if args.save:
        callbacks.append(_Save(args.save, args.save_every_step))
    if args.export:
        callbacks.append(RatelHFExport(args.export, dtype="fp32"))
    if args.on_exception:
        callbacks.append(OnExceptionCheckpoint(args.on_exception))
    if args.fail:
        rank, step = (int(x) for x in args.fail.split(":"))
        callbacks.append(_Raise(rank, step, "early" if args.fail_early else args.fail_in))
    if args.no_room is not None:
        callbacks.append(_NoRoom(args.no_room))
    if args.tight_host is not None:
        callbacks.append(_TightHost(args.tight_host))
    if args.slow_node is not None or args.same_speeds:
        _fixed_speeds(args.slow_node)
    if args.fail_copy is not None:
        _fail_copies(args.fail_copy)
    if args.damage_peer_copy is not None:
        _damage_peer_copies(args.damage_peer_copy)
    if args.claim_device:
        claimer, device_type = args.claim_device.split(":")
        _claim_device(int(claimer), device_type)
    reads = _count_reads(args.fail_save)
    with torch.device("meta") if args.lora else contextlib.nullcontext():
        module = LM(args.model, batch_size=2, eps=args.adam_eps)
        if args.lora:
            import peft  # only here: peft is optional, and its test skips without it

            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            module.model = peft.get_peft_model(module.model, config)
    if args.overflow:
        rank, step = (int(x) for x in args.overflow.split(":"))
        _overflow_on(module, rank, step)
    module.sync_dist = args.sync_dist
    module.gather_loss = args.gather_loss
    if args.no_speculate:
        RatelEngine.speculate = False
    # As the tests' conftest does in their own process: the GPU's path unless asked otherwise.
    RatelEngine.overlap_updates = None if args.updates_after_backward else True
    # As RatelStrategy does during fit: with the cache on, attention rounds differently (an encoder-decoder's decoder).
    cache_off(module)
    precision: dict[str, Any] = {"precision": args.precision}
    if args.strategy == "ratel" and args.precision == "16-mixed":
        # Lightning refuses fp16 mixed precision on the CPU; the plugin runs it there.
        precision = {"plugins": [RatelPrecision("16-mixed", device="cpu")]}
    validation: dict[str, Any] = {}
    if args.validate:
        validation = dict(val_check_interval=args.validate, limit_val_batches=2, num_sanity_val_steps=1)
    t = trainer(strategy, devices=args.devices, num_nodes=args.num_nodes, max_steps=args.steps,
                accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip, callbacks=callbacks,
                enable_checkpointing=args.on_exception is not None,
                **precision, **validation)
    t.fit(module, ckpt_path=args.resume)
    if args.export and args.strategy == "ratel":
        t.strategy.save_pretrained(Path(args.export) / "after", dtype="fp32")
    params, optimizer = final_state(module, t)
    torch.save({"params": params, "optimizer": optimizer, **measure.figures,
                "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "world": t.world_size,
                "metrics": {name: value.item() for name, value in t.callback_metrics.items()},
                "reads": reads},
               out / f"rank{t.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
