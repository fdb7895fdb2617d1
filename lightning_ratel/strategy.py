"""RatelStrategy: the Lightning entry point.

A thin adapter: it checks the settings (:class:`~lightning_ratel.config.RatelConfig`), builds a
:class:`~lightning_ratel.engine.coordinator.RatelEngine` for each fit/validate/test/predict run, and forwards
Lightning's events to it. It never moves data itself.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from typing_extensions import override

from lightning_ratel.callbacks import RatelProfiler
from lightning_ratel.config import ActivationPolicy, CheckpointFormat, ParamInitFn, PlanLike, RatelConfig
from lightning_ratel.engine.coordinator import RatelEngine
from lightning_ratel.engine.materialize import persistent_buffers
from lightning_ratel.engine.planner import Planner
from lightning_ratel.errors import RatelConfigError, RatelRankFailed
from lightning_ratel.io.checkpoint import Restored, choose_checkpoint_format
from lightning_ratel.io.export import (
    DEFAULT_SHARD_SIZE,
    LiveReader,
    ModuleReader,
    write_hf_folder,
    write_live_hf_folder,
)
from lightning_ratel.io.pretrained import PretrainedFolder, PretrainedSource, StateDictSource
from lightning_ratel.io.sharded import (
    ShardedReader,
    ShardedSource,
    is_sharded_checkpoint,
    load_moments,
    not_a_checkpoint,
    save_sharded,
)
from lightning_ratel.io.sources import ValueSource
from lightning_ratel.io.tensorfiles import parse_dtype
from lightning_ratel.plan.cost import check_device_types
from lightning_ratel.plan.search import Plan
from lightning_ratel.precision import RatelPrecision
from lightning_ratel.preflight import check_host_budget
from lightning_ratel.report import show_plan
from lightning_ratel.runtime.collectives import Ranks, WorldCollectives, meet_at_rendezvous
from lightning_ratel.runtime.swapfile import prepare_directories
from lightning_ratel.sizes import format_bytes, format_rate, path_bytes
from lightning_ratel.tiers import OptimizerStates, ParamCache, Placement

# A device tensor up to this size is reduced or gathered through host memory, where the wait watches for a failed rank:
# metrics and decisions, whose copies cost less than a collective's latency; larger ones keep the default group's speed.
WATCHED_DEVICE_BYTES = 64 * 1024


def _watchable(tensor: torch.Tensor) -> bool:
    """Whether a collective of ``tensor`` runs on the strategy's watched host collectives."""
    return tensor.device.type == "cpu" or tensor.numel() * tensor.element_size() <= WATCHED_DEVICE_BYTES


class RatelStrategy(ParallelStrategy):
    """Fine-tune a model larger than device memory, with model states in host memory or on NVMe, on one device or
    data parallel on several (``Trainer(devices=N, num_nodes=M)``, launched as Lightning's ``ddp`` strategy is).

    The fp32 master weights and Adam moments live in host memory while it holds them, and in swap files striped over
    ``ssd_paths`` for the rest (``optimizer_states``); 16-bit (or fp32)
    compute copies live in host memory and visit the device block by block; each gradient leaves the device as soon
    as it is accumulated and a CPU AdamW updates the block while backward continues; saved activations are kept,
    moved to host memory or to the swap files, or recomputed, per block.

    Args:
        ssd_paths: directories for the swap files (one file per directory; use one directory per NVMe drive),
            created when a run starts if missing (an existing one must be a writable directory). ``None``:
            ``<Trainer default_root_dir>/ratel_swap`` (the working directory's ``ratel_swap`` by default).
        prefetch_depth: how many blocks ahead parameters (and swapped activations, in backward) are fetched.
        read_ahead_sets: buffer sets the CPU optimizer keeps beyond its pipeline's three, each reading one more
            shard's optimizer states from the swap files ahead of its update, while the drives would idle. ``None``:
            planned with where the states live, from the host memory keeping states there leaves unused.
        keep_swap_files: keep the swap files after the run instead of deleting them.
        activation_policy: a fixed placement instead of a plan: ``"device"`` (alias ``"keep"``), ``"host"``,
            ``"ssd"`` or ``"recompute"`` for every block, or a mapping from ``fnmatch`` patterns over block names to
            those (first match wins; unmatched blocks stay on the device). ``None``: use ``plan``.
        plan: ``"auto"`` (profile the first step, then place every op's saved activations where the cost model
            predicts the shortest iteration), a path to a plan JSON file (``ratel_plan.json`` of an earlier run), or a
            :class:`~lightning_ratel.plan.Plan`. Ignored when ``activation_policy`` is given.
        host_memory_limit: host memory (bytes, or a string such as ``"64GiB"``) the plan may use in total, the
            engine's own buffers included; the optimizer state is copied back into the user's optimizer at the end
            of fit only within it. ``None``: what is available when planning, less a margin.
        device_memory_limit: device memory the plan and the CUDA caching allocator may use (e.g. ``"24GiB"`` to
            stand in for a consumer card). ``None``: what is free.
        blocks: names of the modules to treat as the repeated blocks, or a callable returning them from the model;
            ``None`` detects them (a transformers model's decoder layers, or the largest ``nn.ModuleList``).
        param_cache: where the compute copies of the parameters live between uses: ``"host"`` (a host-memory cache,
            2 or 4 bytes per parameter), ``"ssd"`` (read from the swap files on every use, so host memory holds only
            the blocks in flight; costs one read of the model per forward and per backward) or ``"auto"`` (``"ssd"``
            when the cache would take more than half of ``host_memory_limit``, or of the available host memory).
            Fitting only; evaluation runs keep them in host memory.
        optimizer_states: where each shard's fp32 master and optimizer moments live (both the committed step's and
            the one being written, 24 bytes per parameter for AdamW): ``"device"`` (the accelerator's memory, updated
            there once the step is decided, with every compute copy resident: for a job that fits the device;
            AdamW/Adam; with several ranks each unit's states on its owner's device), ``"host"`` (host memory),
            ``"ssd"`` (the swap files: 12 bytes per parameter read and 12 written each step) or ``"auto"`` (with
            several ranks every state on the devices where the largest rank's share fits half of each one's device
            budget; else the device for the cheapest whole units while half of ``device_memory_limit``, or of a GPU's
            free memory, holds them (one rank); host memory for the first blocks in forward order while they fit in
            three quarters of ``host_memory_limit``, or of the available host memory, less the parameter cache; the
            swap files for the rest). ``keep_swap_files=True`` keeps them in the swap
            files.
        param_init_fn: initializes one module whose parameters or buffers were on the meta device; called with the
            module after its tensors got (uninitialized) host memory. ``None`` calls ``module.reset_parameters()``
            (a peft LoRA adapter gets peft's initialization; with ``pretrained``, a module of a transformers model
            without ``reset_parameters()`` or holding buffers gets the model's ``_init_weights``). A floating-point
            buffer the initialization leaves unset raises ``RatelConfigError`` before training. Build the model under
            ``torch.device("meta")`` to train a model larger than host memory: each block is materialized,
            initialized and written to the swap files in turn.
        pretrained: a Hugging Face checkpoint folder (``model.safetensors``, or shards with
            ``model.safetensors.index.json``) whose weights the parameters start from, read block by block while the
            model (typically built on the meta device) is materialized. Names match through the LightningModule's
            attribute and peft's prefixes; trainable parameters the folder lacks (LoRA adapters, a new head) are
            initialized, a frozen one missing or a tensor of the wrong shape is an error before training.
        checkpoint_format: ``"full"``: Lightning's ordinary checkpoint file, gathered in host memory (loadable without
            this plugin); ``"sharded"``: a directory written and read shard by shard (:mod:`lightning_ratel.io.sharded`;
            ``ratel-convert`` turns it into either of the others; with several ranks each writes the units it owns, in
            parallel); ``"auto"``: ``"sharded"`` when gathering the checkpoint would take more than half of the host
            memory budget. Either resumes at any world size.
        gradient_exchange: how several ranks' gradients reach each shard's owner: ``"window"`` (each rank sums its
            micro-batches, then one reduce per step, as ``DistributedDataParallel``; every rank holds 4 bytes per
            trainable parameter for its sums), ``"micro_batch"`` (each micro-batch's gradients are reduced at once and
            the owner sums them: no rank holds sums it does not own, at the cost of ``accumulate_grad_batches``
            reduces per step; the sums' order differs from ``ddp``'s within fp32 rounding), ``"device"`` (as
            ``"micro_batch"``, reduced on the device by NCCL before they leave it, and only the owner copies them to
            host memory) or ``"auto"`` (the planner's choice, :func:`~lightning_ratel.plan.exchange.choose_exchange`:
            ``"device"`` on GPUs; on the CPU the window while it fits the host budget, each micro-batch where it does
            not; manual optimization keeps ``"window"``). The first two reduce in host memory over gloo. Without
            accumulation they all give the same sums.
        log_metrics: send the plugin's figures of every training step (time per part, disk bytes and throughput,
            overlap, bytes per tier; ``ratel/...`` keys) to the Trainer's loggers, at the rate of ``self.log``
            (``log_every_n_steps``).
        process_group_backend: the torch.distributed backend of several ranks (``None``: NCCL on CUDA, gloo on the
            CPU). The engine's own collectives run on host memory over gloo groups either way.
        timeout: how long a collective waits for the other ranks before the run fails (a rank that hangs).
        fault_timeout: once a rank stopped on an error (or its process ended), how long the others wait for every rank
            to stop before they take the missing ones as gone and stop too, without the checkpoint an
            ``OnExceptionCheckpoint`` would write; the ranks still running first finish the step they are in. A rank
            that raises is named on every rank within a fraction of a second of the others' next collective: the
            engine's, and those Lightning runs through the strategy (:meth:`barrier`, :meth:`broadcast`,
            :meth:`reduce` of ``self.log(..., sync_dist=True)``, :meth:`all_gather`) except a reduce or all-gather of
            a GPU tensor over 64 KiB (NCCL's wait cannot be abandoned: ranks waiting there wait for ``timeout``).
        start_method: how several ranks are launched, as for Lightning's ``DDPStrategy``: ``"popen"`` runs the script
            again for each rank, ``"spawn"``/``"fork"``/``"forkserver"`` start processes with ``multiprocessing``.
        accelerator: the accelerator; normally set by the Trainer.
        parallel_devices: the devices of this node's ranks; normally set by the Trainer.
        cluster_environment: the cluster environment (ranks, the main address); normally set by the Trainer.
        checkpoint_io: how checkpoints are written; normally set by the Trainer.

    Every argument but ``ssd_paths`` is keyword-only.
    """

    strategy_name = "ratel"

    def __init__(
        self,
        ssd_paths: list[str] | None = None,
        *,
        prefetch_depth: int = 1,
        read_ahead_sets: int | None = None,
        keep_swap_files: bool = False,
        activation_policy: str | dict[str, str] | None = None,
        plan: str | Path | PlanLike | None = "auto",
        host_memory_limit: int | str | None = None,
        device_memory_limit: int | str | None = None,
        blocks: list[str] | Callable[[nn.Module], list[str]] | None = None,
        param_cache: ParamCache = "auto",
        optimizer_states: OptimizerStates = "auto",
        param_init_fn: ParamInitFn | None = None,
        pretrained: str | None = None,
        checkpoint_format: CheckpointFormat = "auto",
        gradient_exchange: Literal["auto", "window", "micro_batch", "device"] = "auto",
        log_metrics: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        fault_timeout: timedelta = timedelta(minutes=2),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._fault_timeout = fault_timeout
        self._start_method = start_method
        self.config = RatelConfig(
            ssd_paths=ssd_paths,
            prefetch_depth=prefetch_depth,
            read_ahead_sets=read_ahead_sets,
            keep_swap_files=keep_swap_files,
            activation_policy=activation_policy,
            plan=plan,
            host_memory_limit=host_memory_limit,
            device_memory_limit=device_memory_limit,
            blocks=blocks,
            param_cache=param_cache,
            optimizer_states=optimizer_states,
            param_init_fn=param_init_fn,
            pretrained=pretrained,
            checkpoint_format=checkpoint_format,
            gradient_exchange=gradient_exchange,
            log_metrics=log_metrics,
        )
        self._engine: RatelEngine | None = None
        # The run's collectives over every rank, watched for a failed rank (several ranks, during a run).
        self._world: WorldCollectives | None = None
        self._exception: BaseException | None = None
        self._failure: BaseException | None = None
        # The device and allocator fraction that `device_memory_limit` replaced, to put back at teardown.
        self._replaced_memory_fraction: tuple[torch.device, float] | None = None
        self._format: Literal["full", "sharded"] = "full"
        self._pretrained: PretrainedFolder | None = None
        # A checkpoint being resumed: its values reach the engine as it materializes the model.
        self._resume: ShardedReader | None = None
        self._resume_source: ValueSource | None = None
        self._saved_step: int | None = None
        # The swap directories of the current run: `ssd_paths` or the default, created if missing.
        self._swap_directories: list[str] = []
        # Directories this run created for the swap files (parents included), removed again at teardown when empty.
        self._created_directories: list[Path] = []
        # The RatelProfiler of the last fit, and the trainer's callback list it was added to when this strategy added
        # it (taken out again at teardown: a tuner compares the trainer's callbacks before and after its trials).
        self._profiler: RatelProfiler | None = None
        self._added_profiler_to: list | None = None

    @property
    def ssd_paths(self) -> list[str] | None:
        """The swap directories asked for (``None``: the Trainer's default)."""
        return self.config.ssd_paths

    @property
    def prefetch_depth(self) -> int:
        """Blocks whose parameters (and, in backward, swapped activations) are fetched ahead."""
        return self.config.prefetch_depth

    @property
    def activation_policy(self) -> ActivationPolicy | None:
        """The fixed placement asked for (``None``: planning decides)."""
        return self.config.activation_policy

    @property
    def plan(self) -> str | Plan | None:
        """``"auto"``, the plan given (a file is loaded at construction), or ``None`` under a fixed policy."""
        return self.config.plan

    @property
    def optimizer_states(self) -> OptimizerStates:
        """Where the optimizer states are asked to live (``"auto"``, ``"host"`` or ``"ssd"``)."""
        return self.config.optimizer_states

    @property
    def host_memory_limit(self) -> int | None:
        """The host memory budget in bytes (``None``: what is available)."""
        return self.config.host_memory_limit

    @property
    def device_memory_limit(self) -> int | None:
        """The device memory budget in bytes (``None``: what is free)."""
        return self.config.device_memory_limit

    @property
    def keep_swap_files(self) -> bool:
        """Whether the swap files stay after the run."""
        return self.config.keep_swap_files

    @property
    def blocks(self) -> list[str] | Callable[[nn.Module], list[str]] | None:
        """The block names (or the callable returning them) asked for; ``None``: detected."""
        return self.config.blocks  # type: ignore[return-value]

    @property
    def param_cache(self) -> ParamCache:
        """Where compute copies live between uses, as asked for."""
        return self.config.param_cache

    @property
    def param_init_fn(self) -> ParamInitFn | None:
        """The initializer of modules on the meta device (``None``: their ``reset_parameters()``)."""
        return self.config.param_init_fn

    @property
    def pretrained(self) -> str | None:
        """The Hugging Face folder the weights start from (absolute path), if any."""
        return self.config.pretrained

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        """The checkpoint format asked for (the run's own is chosen at setup when this is ``"auto"``)."""
        return self.config.checkpoint_format

    @property
    def log_metrics(self) -> bool:
        """Whether each training step's figures go to the Trainer's loggers."""
        return self.config.log_metrics

    @property
    @override
    def root_device(self) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            if self.parallel_devices:
                return self.parallel_devices[self.local_rank]
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        """The nodes training (set by the Trainer from ``num_nodes``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """The ranks of one node (one per device)."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """Whether several ranks train (Lightning then gives each its part of the data)."""
        return self.num_processes * self.num_nodes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        """The torch.distributed backend of the run (``None`` before it started, or on one rank)."""
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        # One rank runs in the process the user started, without a process group: exactly the single-device run.
        if not self.is_distributed:
            return
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size (as ``DDPStrategy`` does)."""
        if self.cluster_environment is not None and self.is_distributed:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _setup_distributed(self) -> bool:
        """Create the default process group, once the ranks agreed on their device type (ranks on different types
        would pick different backends and never meet). Returns whether the check ran (not where the process group
        existed before the run)."""
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        environment = self.cluster_environment
        assert environment is not None
        if _distributed_is_initialized():
            return False
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        timeout = self._timeout or dist.default_pg_timeout
        store, device_types = meet_at_rendezvous(self.global_rank, self.world_size, timeout, self.root_device.type)
        check_device_types(device_types, self.num_processes)
        # The prefix init_process_group gives the store it makes itself.
        _init_dist_connection(environment, self._process_group_backend, timeout=self._timeout,
                              store=dist.PrefixStore("default_pg", store))
        return True

    def _ranks(self) -> Ranks | None:
        if not self.is_distributed:
            return None
        return Ranks(rank=self.global_rank, world=self.world_size, local_world=self.num_processes,
                     timeout=self._timeout, local_rank=self.local_rank, fault_timeout=self._fault_timeout)

    def _collectives(self) -> WorldCollectives | None:
        """The run's collectives over every rank, whose waits stop when a rank reports a failure (``None`` on one rank
        and outside a run, where Lightning's default-group collectives serve, as under ``DDPStrategy``). While
        Lightning handles an error that stopped training, the ranks first meet (:meth:`_meet`)."""
        if self._world is not None and self._interrupted():
            self._meet()
        return self._world

    def _interrupted(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    def _meet(self) -> None:
        """While Lightning handles the error that stopped training, before the ranks' first collective since (an
        ``on_exception`` callback's save or barrier): wait until every rank stopped, and give the engine's collectives
        and the strategy's new groups (the old ones may hold a collective that a failed rank never joined). Once."""
        error = sys.exc_info()[1] or RuntimeError("training stopped")
        if self._engine is not None:
            self._engine.regroup(error)
        if self._world is not None:
            self._world.regroup(error)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        world = self._collectives()
        if world is not None:
            world.barrier()
        elif _distributed_is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        world = self._collectives()
        if world is not None:
            return world.broadcast_object(obj, src)
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce ``tensor`` over the ranks (``self.log(..., sync_dist=True)``, boolean decisions). A tensor in host
        memory, or a small one on a GPU (copied through host memory), goes through the run's watched collectives; a
        larger one on a GPU, or one over a ``group`` of the caller's, through Lightning's default-group reduction (NCCL
        on a GPU), whose wait does not watch for a failed rank."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        world = self._collectives()
        if world is None or group is not None or not _watchable(tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        if tensor.device.type == "cpu":
            return world.reduce(tensor, reduce_op)
        return tensor.copy_(world.reduce(tensor.cpu(), reduce_op))

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # In host memory, so that the reduction is watched on a GPU too.
        count = self.reduce(torch.tensor(int(decision)), reduce_op=ReduceOp.SUM)  # type: ignore[arg-type]
        return bool(count == self.world_size) if all else bool(count)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor``, stacked. A tensor in host memory, or a small one on a GPU (through host memory),
        goes through the run's watched collectives, with ``sync_grads`` as an autograd op whose backward is a watched
        collective too; a larger one on a GPU, or one over a ``group`` of the caller's, through Lightning's all-gather
        on the default group (NCCL on a GPU), whose wait does not watch for a failed rank."""
        world = self._collectives()
        if world is None or group is not None or not _watchable(tensor):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        if sync_grads:
            # .to() is differentiable, so the gradient of a GPU tensor comes back to the GPU.
            return world.all_gather_with_grads(tensor.to("cpu")).to(tensor.device)
        return world.all_gather(tensor.cpu()).to(tensor.device)

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> RatelPrecision:
        return self._precision_plugin if self._precision_plugin is not None else RatelPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning assigns the plugin it built from Trainer(precision=...); translate it rather than override it.
        self._precision_plugin = None if precision_plugin is None else RatelPrecision.from_lightning(precision_plugin)

    @property
    def plans_automatically(self) -> bool:
        """Whether the first training step is profiled and a plan made from it (``plan="auto"``)."""
        return self.config.plans_automatically

    @override
    def connect(self, model: nn.Module) -> None:
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is None:
            return
        self._profiler = next((c for c in trainer.callbacks if isinstance(c, RatelProfiler)), None)
        if self._profiler is None:
            self._profiler = RatelProfiler()
            trainer.callbacks.append(self._profiler)
            self._added_profiler_to = trainer.callbacks

    @property
    def profiler(self) -> RatelProfiler | None:
        """The :class:`RatelProfiler` of the last fit (the plan, the measured steps): the trainer's own, or the one
        the strategy added for the fit (and took out of ``trainer.callbacks`` at its end)."""
        return self._profiler

    @property
    def engine(self) -> RatelEngine | None:
        """The engine of the current run (``None`` outside one)."""
        return self._engine

    @property
    def planner(self) -> Planner | None:
        """The planner of the current run (``None`` outside one)."""
        return self._engine.planner if self._engine is not None else None

    @override
    def model_to_device(self) -> None:
        # Parameters are paged by the engine; only buffers (masks, rotary tables) live on the device for good. Buffers
        # on the meta device are the engine's to materialize.
        assert self.model is not None
        device = self.root_device

        def place(module: nn.Module) -> None:
            for name, buf in module._buffers.items():
                if buf is not None and not buf.is_meta:
                    module._buffers[name] = buf.to(device)
            for child in module.children():
                if any(True for _ in child.parameters()) or any(b.is_meta for b in child.buffers()):
                    place(child)
                else:
                    # Nothing here for the engine to page: the module moves whole, as under Lightning's own
                    # strategies, so that state kept outside buffers (a torchmetrics metric's) comes along.
                    child.to(device)

        place(self.model)
        self.lightning_module._device = device  # type: ignore[union-attr]

    @override
    def setup_environment(self) -> None:
        # The first hook of a run, ahead of the setup hooks, the logger's directory and the model's materialization:
        # a run that cannot have its devices or its swap directories stops before it has cost anything.
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        super().setup_environment()
        if self.is_distributed:
            checked = self._setup_distributed()
            if self._world is None:
                self._world = WorldCollectives(self._ranks())
            if not checked:
                check_device_types(self._world.gather_objects(self.root_device.type), self.num_processes)
        paths = self.config.ssd_paths or [os.path.join(trainer.default_root_dir, "ratel_swap")]
        self._created_directories = [missing for path in paths for missing in _missing_directories(Path(path))]
        self._swap_directories = [str(p) for p in prepare_directories(paths, self._store_name())]

    def _store_name(self) -> str:
        """The swap files' name: ranks sharing a directory each have their own files (and lock)."""
        return f"{self.config.name}-rank{self.global_rank}" if self.is_distributed else self.config.name

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        optimizer = None
        exchange = None
        param_cache = self.config.param_cache
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                manual = "" if module.automatic_optimization else (
                    " Manual optimization with several optimizers stepped apart (a GAN's generator and "
                    "discriminator) is not supported: train such a module with another strategy.")
                raise RatelConfigError(
                    f"RatelStrategy supports one optimizer, got {len(self.optimizers)} from `configure_optimizers`. "
                    "Put their parameters into parameter groups of one optimizer (each group keeps its own "
                    f"hyperparameters), or train with another strategy.{manual}")
            optimizer = self.optimizers[0]
            finetuning = [type(c).__name__ for c in trainer.callbacks if isinstance(c, BaseFinetuning)]
            if finetuning:
                # Said now rather than only when it happens, possibly many epochs in.
                rank_zero_warn(
                    f"RatelStrategy: {finetuning[0]} unfreezes parameters during fit with `optimizer.add_param_group`, "
                    "which RatelStrategy cannot follow yet: fit stops with a RatelConfigError at that call. Train "
                    "each stage in a fit of its own (the frozen backbone first, then everything).")
            # A forced "full" that cannot be gathered is refused now rather than at the first save.
            self._format = choose_checkpoint_format(self.config.checkpoint_format, module, optimizer,
                                                    self.config.host_memory_limit)
            # Before the model is materialized: the budget must hold at least the run's own buffers.
            need = check_host_budget(module, optimizer, self.config, self.precision_plugin.half_dtype,
                                     unified=self.root_device.type == "cpu", ranks=self.world_size,
                                     accumulate=trainer.accumulate_grad_batches,
                                     automatic=module.automatic_optimization, ranks_on_node=self.num_processes)
            exchange = need.exchange if need is not None else None
            if self._world is not None and need is not None:
                # Every rank exchanges and pages alike: rank 0's choices (each measured its own free memory).
                exchange, param_cache = self._world.broadcast_object((exchange, need.param_cache))
                if self.config.param_cache == "auto" and param_cache == "ssd":
                    rank_zero_info("RatelStrategy: the compute copies of the parameters would take more than half of "
                                   "the host memory budget; they are read from the swap files on every use "
                                   "(param_cache='ssd').")
        self.model_to_device()
        config = replace(self.config.with_ssd_paths(self._swap_directories), name=self._store_name(),
                         param_cache=param_cache)
        self._limit_device_memory()
        precision = self.precision_plugin
        self._exception = None
        self._failure = None
        self._saved_step = None
        if config.pretrained is not None and self._pretrained is None:
            self._pretrained = PretrainedFolder(config.pretrained)
        source = self._resume_source
        if source is None and self._pretrained is not None:
            source = PretrainedSource(self._pretrained)
        self._resume_source = None
        start = time.perf_counter()
        self._engine = RatelEngine(module, self.root_device, config, precision.half_dtype, optimizer, source,
                                   progress=trainer.progress_bar_callback is not None, ranks=self._ranks(),
                                   faults=self._world.faults if self._world is not None else None,
                                   exchange=exchange)
        if source is not None:
            layout = self._engine.layout
            rank_zero_info(f"RatelStrategy: {source.description.replace('loading', 'loaded', 1)}: "
                           f"{len(layout.slots)} tensors, "
                           f"{format_rate(layout.param_nbytes, time.perf_counter() - start)}")
        precision.bind(self._engine, self.root_device.type)
        if isinstance(config.plan, Plan):
            self._engine.planner.apply_plan(config.plan)
            show_plan(config.plan)
        self.setup_precision_plugin()
        if optimizer is not None:
            # Parameters never hold gradients under RatelStrategy, the CPU optimizer does: zero_grad must drop those
            # (on the optimizer and on the LightningOptimizer self.optimizers() returns, which connecting the
            # precision plugin made anew). Automatic optimization calls it too: a backward whose step an
            # `optimizer_step` override skipped must not add its gradients to the next step's.
            for opt in (optimizer, *self._lightning_optimizers):
                opt.zero_grad = functools.partial(self._zero_grad, opt)  # type: ignore[method-assign]
        # From here on, code between the engine's passes (hooks, callbacks) reads the parameters' real values.
        self._engine.reads.open()
        placement = self._engine.byte_placement()
        # Free space once per file system: directories on one drive share it.
        free = sum(shutil.disk_usage(p).free for p in {os.stat(p).st_dev: p for p in config.ssd_paths}.values())
        rank_zero_info(
            f"RatelStrategy: {len(self._engine.blocks)} blocks on {self.root_device}; "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in placement.items())
            + f"; swap files in {', '.join(config.ssd_paths)} ({format_bytes(free)} free); "
            + self._engine.describe_updates()
        )

    def _limit_device_memory(self) -> None:
        """Cap the CUDA caching allocator at ``device_memory_limit`` (a warning on the CPU, where it means nothing)."""
        limit = self.config.device_memory_limit
        if limit is None:
            return
        if self.root_device.type != "cuda":
            rank_zero_warn("RatelStrategy: `device_memory_limit` is ignored when training on the CPU; "
                           "`host_memory_limit` bounds what the run uses there.")
            return
        total = torch.cuda.get_device_properties(self.root_device).total_memory
        if limit > total:
            raise RatelConfigError(
                f"`device_memory_limit` ({format_bytes(limit)}) exceeds the device's {format_bytes(total)}"
            )
        # Put back at teardown, which Lightning also runs after a failed setup: the cap is process-wide and would
        # otherwise outlive this run (a later run, or plain PyTorch, in the same process).
        read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = read(self.root_device) if read is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(limit / total, self.root_device)
        if self._replaced_memory_fraction is None:
            self._replaced_memory_fraction = (self.root_device, previous)

    def _zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()`` during a fit: the engine drops the gradients it holds, then the optimizer's own
        ``zero_grad`` runs as the user's code expects (the parameters hold none; a subclass may do more)."""
        assert self._engine is not None
        self._engine.zero_grad(set_to_none)
        type(optimizer).zero_grad(optimizer, set_to_none)

    def _restore_device_memory(self) -> None:
        """Undo :meth:`_limit_device_memory`."""
        replaced, self._replaced_memory_fraction = self._replaced_memory_fraction, None
        if replaced is not None:
            torch.cuda.set_per_process_memory_fraction(replaced[1], replaced[0])

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        assert self._engine is not None
        self._engine.begin_micro_batch()
        with self._engine.watch_forward(training=True):
            output = super().training_step(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        self._engine.note_loss(loss if isinstance(loss, torch.Tensor) else None)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._watch():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._watch():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._watch():
            return super().predict_step(*args, **kwargs)

    def _watch(self) -> contextlib.AbstractContextManager[None]:
        return self._engine.watch_forward(training=False) if self._engine is not None else contextlib.nullcontext()

    def _internal(self) -> contextlib.AbstractContextManager[None]:
        """The strategy's own whole-model work: parameters are the engine's, not read as the user's code reads them."""
        return self._engine.reads.bypass() if self._engine is not None else contextlib.nullcontext()

    def byte_placement(self) -> dict[str, int]:
        """Bytes held right now on the device, in host memory and on disk (empty outside a run)."""
        return self._engine.byte_placement() if self._engine is not None else {}

    def io_bytes(self) -> dict[str, int]:
        """Bytes the swap files have read (``"read"``) and written (``"written"``) since the run started: the
        model states' traffic, activations swapped to the SSDs not included (they are in the loggers' ``ratel/disk_*``
        figures); and the bytes reads took from another read's memory instead of the drives (``"shared"``: a page-in
        and the optimizer reading the same fp32 master). Empty outside a run."""
        store = self._engine.store if self._engine is not None else None
        if store is None:
            return {}
        return {"read": store.bytes_read, "written": store.bytes_written, "shared": store.bytes_shared}

    def state_traffic(self) -> dict[str, int]:
        """Bytes each optimizer step must read (``"read"``) and write (``"written"``) in the swap files for the model
        states: the moments and masters of the states kept there, and the new compute copies where the pager reads
        them from there. Compare with :meth:`io_bytes` per step. Empty outside a fit."""
        planner = self.planner
        return planner.state_traffic() if planner is not None and self._engine.adam is not None else {}

    def step_traffic(self) -> dict[str, int]:
        """The least each optimizer step must read (``"read"``) and write (``"written"``) in the swap files: the model
        states' traffic (:meth:`state_traffic`) and the page-ins of compute copies read from there, once for forward
        and once for backward unless an update shares one's bytes (an fp32 master is its shard's compute copy: the
        backward's page-in shares the update's read, or after an update run after backward the next forward's copies
        what it wrote). Compare with :meth:`io_bytes` per step. Empty outside a fit."""
        planner = self.planner
        if planner is None or self._engine.adam is None:
            return {}
        return planner.step_traffic(after_backward=not self._engine.updates_overlap)

    def state_placement(self) -> dict[str, int]:
        """Bytes of the optimizer states this process holds (fp32 masters and moments, both slots) by tier: ``"host"``
        for those kept in host memory, ``"ssd"`` for those in the swap files, and ``"device"`` for those on the device
        tier, where there are any. Empty outside a fit."""
        engine = self._engine
        if engine is None or engine.store is None:
            return {}
        store = engine.store
        on_disk = set(store.disk.keys())
        placed = {"host": 0, "ssd": 0}
        for shard in engine.layout.shards:
            for key in shard.state_keys():
                if store.device is not None and key in store.device:
                    placed["device"] = placed.get("device", 0) + store.device.nbytes(key)
                elif key in store.host:
                    placed["host"] += store.host.nbytes(key)
                elif key in on_disk:
                    placed["ssd"] += store.disk.nbytes(key)
        return placed

    def activation_placements(self) -> dict[str, Placement]:
        """Where each block's saved activations go now, by block name: a tier (``"device"``, ``"host"``, ``"ssd"``,
        ``"recompute"``) for everything the block saves, or a mapping from op names to tiers under a plan. Empty
        outside a run."""
        if self._engine is None:
            return {}
        return {block.name: placement for block, placement in zip(self._engine.blocks, self._engine.cache.placements)}

    def synchronize(self) -> None:
        """Wait until every optimizer update handed over so far has run and its states are in the swap files (a
        benchmark reading a clock calls it first; checkpoints and exports wait on their own). Nothing outside a
        run."""
        if self._engine is not None:
            self._engine.synchronize()

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether this run writes sharded checkpoints (chosen at setup)."""
        return self._engine is not None and self._engine.adam is not None and self._format == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._failure is not None:
            raise self._failure
        if self._engine is None:
            module = self.lightning_module
            assert module is not None
            placeholders = [n for n, p in module.named_parameters() if p.numel() > 1 and not any(p.stride())]
            if placeholders:
                raise RatelConfigError(
                    f"the module's parameters (e.g. {placeholders[0]}) were not copied back after training, so it "
                    "cannot be saved now; save checkpoints during fit (ModelCheckpoint), or export the kept swap files "
                    "with `ratel-convert --swap ...` as the warning at the end of fit says")
            return super().lightning_module_state_dict()
        if self.sharded_checkpoints:
            # Parameters go to the unit files; the checkpoint dict keeps the persistent buffers.
            module = self._engine.module
            with self._internal():
                state = module.state_dict()
            return {name: state[name] for name in persistent_buffers(module) if name in state}
        return self._from_engine(self._engine.state.state_dict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._failure is not None:
            raise self._failure
        if self._engine is not None and optimizer is self._engine.optimizer:
            if self.sharded_checkpoints:
                # Moments and step counts go to the unit files.
                return {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
            return self._from_engine(self._engine.state.optimizer_state_dict)
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        path = Path(filepath)
        start = time.perf_counter()
        if self.sharded_checkpoints:
            if storage_options is not None:
                raise TypeError("RatelStrategy writes sharded checkpoints itself and takes no `storage_options`")
            engine = self._engine
            assert engine is not None

            def save() -> dict[str, Any]:
                with engine.user_settings():
                    return {"path": save_sharded(path, checkpoint, engine.state, engine.module, self._pretrained,
                                                 progress=self._progress())}

            self._from_engine(save)
        else:
            if is_sharded_checkpoint(path) and self.is_global_zero:
                # Rank 0 writes the file in its place.
                shutil.rmtree(path)
            super().save_checkpoint(checkpoint, filepath, storage_options)
        # A module connected without a fit (``strategy.connect(model)``, then a save) has no trainer to ask.
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and self._engine is not None:
            self._saved_step = trainer.global_step
        if self.is_global_zero:
            kind = "sharded checkpoint" if self.sharded_checkpoints else "checkpoint"
            rank_zero_info(f"RatelStrategy: {kind} written to {path}: "
                           f"{format_rate(path_bytes(path), time.perf_counter() - start)}")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_sharded_checkpoint(checkpoint_path):
            if Path(checkpoint_path).is_dir():
                raise RatelConfigError(not_a_checkpoint(Path(checkpoint_path)))
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = ShardedReader(checkpoint_path, self._pretrained_folder())
        return self._resume.meta()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Parameter values reach the module as the engine materializes it; buffers come along.
        module = self.lightning_module
        assert module is not None
        if self._resume is not None:
            self._resume_source = ShardedSource(self._resume, dict(checkpoint.get("state_dict", {})))
        elif self.config.pretrained is not None or any(p.is_meta for p in module.parameters()):
            # Not into the module: a meta tensor holds no value, and the checkpoint outranks the pretrained folder.
            self._resume_source = StateDictSource(dict(checkpoint["state_dict"]))
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    def _pretrained_folder(self) -> PretrainedFolder | None:
        if self.config.pretrained is not None and self._pretrained is None:
            self._pretrained = PretrainedFolder(self.config.pretrained)
        return self._pretrained

    def _progress(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is not None and trainer.progress_bar_callback is not None

    def save_pretrained(self, path: str | os.PathLike[str], dtype: str | torch.dtype = "bf16",
                        max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
        """Write the trained weights as a Hugging Face folder, one tensor at a time (``from_pretrained`` loads it).

        During fit the weights are those of the last finished step, read from the swap files once every update has
        landed; outside fit, the module's own parameters. ``config.json`` and ``generation_config.json`` are written
        when the module holds a transformers model; a peft model's adapter goes to ``adapter/`` in peft's format.

        Args:
            path: the folder.
            dtype: ``"bf16"`` (default), ``"fp16"`` or ``"fp32"``.
            max_shard_size: the largest weight file; more is split into shards with an index.

        Returns:
            The folder.
        """
        dtype = parse_dtype(dtype)
        start = time.perf_counter()
        engine = self._engine
        with self._internal():
            if engine is not None and engine.adam is not None:
                with engine.user_settings():
                    reader: Any = LiveReader(engine.state, engine.module)
                folder = write_live_hf_folder(reader, path, dtype, max_shard_size, progress=self._progress())
            else:
                module = self.lightning_module
                if module is None:
                    raise RatelConfigError("RatelStrategy.save_pretrained needs a LightningModule")
                reader = ModuleReader(module)
                folder = self._on_rank_zero(lambda: write_hf_folder(reader, path, dtype, max_shard_size,
                                                                    progress=self._progress()))
        rank_zero_info(f"RatelStrategy: exported {len(reader.records)} tensors to {folder}: "
                       f"{format_rate(path_bytes(folder), time.perf_counter() - start)}")
        return folder

    def _on_rank_zero(self, write: Callable[[], Path]) -> Path:
        """Run ``write`` on rank 0 only (every rank holds the same module after fit); every rank returns its result or
        raises its error."""
        if not self.is_distributed:
            return write()
        outcome: tuple[bool, str] = (True, "")
        if self.is_global_zero:
            try:
                outcome = (True, str(write()))
            except BaseException as err:
                outcome = (False, f"{type(err).__name__}: {err}")
                self.broadcast(outcome)
                raise
        ok, what = self.broadcast(outcome)
        if not ok:
            raise RuntimeError(f"RatelStrategy: rank 0 could not write the export ({what})")
        return Path(what)

    def _from_engine(self, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Read state for a checkpoint (or write one); a failure leaves the run as a plain run's would be.

        A failed write of the checkpoint itself (a full disk, Ctrl-C in the writer) changes nothing: the exception
        goes on to Lightning, whose ``OnExceptionCheckpoint`` can still save the last committed step and whose
        teardown copies the parameters back. Two cases end the engine here: the engine's own state cannot be read
        (its swap files or its optimizer failed), and a save from an ``on_exception`` callback failed (Lightning
        skips ``teardown`` then, which would leave the swap files and the directory lock behind). The failure is
        remembered: a later save must not fall back to the module's paging placeholders.
        """
        interrupted = self._interrupted()
        try:
            if interrupted:
                # An on_exception callback saves while Lightning handles the error that stopped training (the
                # strategy hears of it only after the callbacks): the ranks meet before they save together.
                self._meet()
            with self._internal():
                return read()
        except BaseException as err:
            engine = self._engine
            if engine is None:
                raise
            # Another rank's failure leaves this rank's state readable, but no longer with the others.
            broken = not isinstance(err, RatelRankFailed) and self._engine_broken(engine, err)
            if not broken and not interrupted:
                raise
            self._failure = err
            self._engine = None
            if broken:
                rank_zero_warn(
                    f"RatelStrategy: the run's state could not be read back ({err!r}), so no checkpoint of it can be "
                    "written now and the module's parameters are not the trained values after this fit. Resume from "
                    "the last checkpoint written before the failure.")
                try:
                    engine.close(restore=False)
                except Exception as cleanup:
                    err.__notes__ = [*getattr(err, "__notes__", []), f"Closing the swap store failed too: {cleanup!r}"]
            else:
                self._end_engine(engine, err)
            raise

    @staticmethod
    def _engine_broken(engine: RatelEngine, err: BaseException) -> bool:
        """Whether ``err`` says the engine's own state is unreadable (a swap file, the optimizer), not the output."""
        if engine.adam is not None:
            try:
                engine.adam.check()
            except BaseException:
                return True
        filename = getattr(err, "filename", None)
        if not isinstance(err, OSError) or not filename or engine.store is None:
            return False
        return any(Path(filename).is_relative_to(directory) for directory in engine.store.paths)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._engine is None or self._engine.optimizer is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        if not checkpoint.get("optimizer_states"):
            # As plain Lightning, which loads nothing then (a checkpoint written for the weights alone); said, since
            # the moments start from zero.
            rank_zero_warn("RatelStrategy: the checkpoint holds no optimizer state; the optimizer starts afresh")
            return
        if self._resume is not None:
            load_moments(self._engine.state, self._resume, checkpoint["optimizer_states"][0]["param_groups"])
            # The last thing resuming reads from the checkpoint: its files need not stay open (and mapped) any more.
            self._resume.close()
            self._resume = None
            return
        self._engine.state.load_optimizer_state_dict(checkpoint["optimizer_states"][0])

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._exception = exception
        if isinstance(exception, torch.cuda.OutOfMemoryError):
            _explain_out_of_memory(exception, self.config.device_memory_limit)
        if self._world is not None:
            # The other ranks' watched collectives stop now instead of waiting for this one.
            self._world.report(exception)
        if self._engine is not None:
            try:
                self._engine.report_failure(exception)
                self._engine.abort_step()
            except Exception as err:
                # The exception that stopped training matters more; the copy-back at teardown says what it finds.
                rank_zero_warn(f"RatelStrategy could not roll the interrupted step back after {exception!r}: {err!r}")

    def _keep_what_is_not_restored(self, engine: RatelEngine) -> tuple[str, int] | None:
        """Before the copy back: say what will not be restored and, where a result would be lost, keep the swap files
        with what an export needs to read them.

        Returns:
            What the copy back will restore, in words, and its bytes; ``None`` outside fit or when nothing is.
        """
        state = engine.state
        if engine.adam is None or engine.store is None:
            return None
        engine.abort_step()
        plan = state.restore_plan()
        restored = _restored_summary(engine, plan)
        if plan.trainable and not plan.optimizer:
            rank_zero_info("RatelStrategy: the optimizer state is not copied back into the optimizer: it would not "
                           "fit in host memory beside the parameters, or within host_memory_limit. Checkpoints hold "
                           "it.")
        trainer = getattr(self.lightning_module, "_trainer", None)
        saved = trainer is not None and self._saved_step == trainer.global_step
        keep = self.config.keep_swap_files or (bool(plan.lost) and not saved)
        if keep:
            # Not a module-level import: `python -m lightning_ratel.io.convert` runs that module as __main__, and runpy
            # warns when importing the package has imported it already.
            from lightning_ratel.io.convert import kept_metadata

            with engine.user_settings():
                engine.store.set_metadata(kept_metadata(state, engine.module, self._pretrained))
            engine.store.keep_at_close()
        if plan.complete:
            return restored
        layout = engine.layout
        if plan.trainable:
            what = (f"the trainable parameters ({format_bytes(layout.nbytes_of(layout.shards))}) are copied back into "
                    f"the module; the frozen ones ({format_bytes(layout.nbytes_of(layout.frozen_shards))}) are not "
                    "copied back because they would not fit comfortably in host memory, and are NaN placeholders.")
        else:
            what = (f"the trained parameters ({format_bytes(layout.param_nbytes)}) are not copied back into the module "
                    "after training because they would not fit comfortably in host memory; its parameters are NaN "
                    "placeholders now.")
        if not plan.lost and self._pretrained is not None:
            where = (" The values of the parameters not copied back are those of the pretrained folder "
                     f"{self._pretrained.path}.")
        elif saved and not self.config.keep_swap_files:
            where = " The checkpoint saved at the last step holds every value."
        else:
            dirs = " ".join(f"--swap {p}" for p in engine.store.paths)
            name = "" if self.config.name == "ratel" else f" --name {self.config.name}"
            where = (f" The swap files are kept, with their index, in {', '.join(map(str, engine.store.paths))}: "
                     f"export the weights with `ratel-convert {dirs}{name} OUT_DIR --to hf "
                     "[--dtype fp32]`, then delete the swap files and their index. (RatelHFExport or "
                     "strategy.save_pretrained() during fit, or a checkpoint at the last step, avoid keeping them.)")
        rank_zero_warn(f"RatelStrategy: {what}{where}")
        return restored

    def _end_engine(self, engine: RatelEngine, exception: BaseException | None) -> None:
        """Copy the parameters back (keeping the swap files where a result would be lost) and close the engine.

        Args:
            engine: the run's engine, no longer reachable from the strategy.
            exception: the error that stopped training, if one did: a failure to restore is then only warned about.
        """
        engine.reads.close()
        if exception is not None and self.is_distributed:
            # Copying back reads each state from its owner, a collective the other ranks (stopped, or gone) never
            # join: the last checkpoint holds the state.
            rank_zero_warn(f"RatelStrategy: training stopped on {exception!r}; with several ranks the parameters are "
                           "not copied back into the module. Resume from the last checkpoint.")
            engine.close(restore=False)
            return
        try:
            try:
                restored = self._keep_what_is_not_restored(engine)
            finally:
                start = time.perf_counter()
                engine.close(restore=True)
            if restored:
                rank_zero_info(f"RatelStrategy: copied {restored[0]} back into the module: "
                               f"{format_rate(restored[1], time.perf_counter() - start)}")
        except Exception as err:
            if exception is None:
                raise
            # Do not hide the error that stopped training; the last checkpoint holds the state.
            rank_zero_warn(f"RatelStrategy could not restore the parameters after {exception!r}: {err!r}")

    def _remove_created_directories(self) -> None:
        """Remove the swap directories this run created, deepest first, where nothing is left in them (kept swap
        files, or anything else put there, keep theirs)."""
        for directory in sorted(set(self._created_directories), key=lambda p: len(p.parts), reverse=True):
            try:
                directory.rmdir()
            except OSError:
                pass  # not empty, or already gone: nothing of this run's to clean up there
        self._created_directories = []

    @override
    def teardown(self) -> None:
        self._restore_device_memory()
        for opt in (*self.optimizers, *self._lightning_optimizers):
            # The instance attribute manual optimization's setup put over the class's zero_grad.
            opt.__dict__.pop("zero_grad", None)
        added, self._added_profiler_to = self._added_profiler_to, None
        if added is not None and self._profiler in added:
            added.remove(self._profiler)
        engine, self._engine = self._engine, None
        if engine is not None:
            self._end_engine(engine, self._exception)
        world, self._world = self._world, None
        if world is not None:
            world.close()
        self._remove_created_directories()
        if self._resume is not None:
            self._resume.close()
            self._resume = None
        if self._precision_plugin is not None:
            # The ended engine must not stay reachable (with its buffers) through the plugin.
            self.precision_plugin.bind(None, self.root_device.type)
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        module = self.lightning_module
        if module is None or not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            Strategy.teardown(self)
            return
        # Setup failed before the model left the meta device. Lightning's teardown moves the module to the CPU, which
        # a meta tensor cannot do: move the rest here and let it tear down everything else.
        module._apply(lambda t: t if t.is_meta else t.cpu())
        self._lightning_module = None
        try:
            Strategy.teardown(self)
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Model states on NVMe, paged parameters, overlapped CPU AdamW"
        )


def _explain_out_of_memory(exception: BaseException, device_memory_limit: int | None) -> None:
    """Add to a device out-of-memory error what RatelStrategy knows of it and what to change.

    The plan places what the blocks hold; the model's output and its loss run outside every block and grow with the
    micro-batch (a causal LM's fp32 logits take batch x sequence x vocabulary x 4 bytes, the loss's softmax and the
    gradient as much again), so a micro-batch too large for them fails in the first step, before any plan exists. The
    step is rolled back whole, so nothing is lost.
    """
    figures = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cap = device_memory_limit or torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        figures = (f" With a device cap of {format_bytes(cap)}, {format_bytes(torch.cuda.memory_allocated())} were "
                   f"allocated at the failure, {format_bytes(torch.cuda.max_memory_allocated())} at the peak.")
    advice = (f"RatelStrategy: the step ran out of device memory and was rolled back, nothing of it applied.{figures} "
              "Outside the blocks the plan places, the model's output and loss take device memory that grows with "
              "the micro-batch (the fp32 logits of a causal LM: batch x sequence x vocabulary x 4 bytes, and as much "
              "again for the loss's softmax and for their gradient). Lower the DataLoader's batch size and raise the "
              "Trainer's accumulate_grad_batches by the same factor (same numbers, same global batch), compute the "
              "loss in chunks of the sequence, or raise device_memory_limit.")
    if hasattr(exception, "add_note"):
        exception.add_note(advice)
    else:  # Python 3.10: no exception notes
        rank_zero_warn(advice)


def _restored_summary(engine: RatelEngine, plan: Restored) -> tuple[str, int] | None:
    """What the copy back of ``plan`` restores, in words, and its bytes."""
    layout = engine.layout
    shards = (layout.shards if plan.trainable else []) + (layout.frozen_shards if plan.frozen else [])
    if not shards:
        return None
    count = sum(len(s.params) for s in shards)
    what = f"{count} parameter tensors" + (" and the optimizer state" if plan.optimizer else "")
    return what, layout.nbytes_of(shards) + (8 * sum(s.numel for s in layout.shards) if plan.optimizer else 0)


def _missing_directories(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet (what creating ``path`` makes), resolved."""
    missing = []
    current = path.resolve()
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return missing

