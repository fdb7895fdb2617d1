"""RatelStrategy: the Lightning entry point.

A thin adapter: it checks the settings (:class:`~lightning_ratel.config.RatelConfig`), builds a :class:`~lightning_ratel.engine.RatelEngine` for each
fit/validate/test/predict run, and forwards Lightning's events to it. It never moves data itself.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_ratel.callbacks import RatelProfiler
from lightning_ratel.checkpoint import ensure_checkpoint_fits
from lightning_ratel.config import ActivationPolicy, ParamCache, ParamInitFn, RatelConfig
from lightning_ratel.engine import RatelEngine
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.plan.search import Plan
from lightning_ratel.planner import Planner
from lightning_ratel.precision import RatelPrecision
from lightning_ratel.report import show_plan
from lightning_ratel.sizes import format_bytes


class RatelStrategy(SingleDeviceStrategy):
    """Fine-tune a model larger than device memory on one device, with model states on NVMe.

    The fp32 master weights and Adam moments live in swap files striped over ``ssd_paths``; 16-bit (or fp32)
    compute copies live in host memory and visit the device block by block; each gradient leaves the device as soon
    as it is accumulated and a CPU AdamW updates the block while backward continues; saved activations are kept,
    moved to host memory or to the swap files, or recomputed, per block.

    Args:
        ssd_paths: directories for the swap files (one file per directory; use one directory per NVMe drive).
            ``None``: ``<Trainer default_root_dir>/ratel_swap``.
        prefetch_depth: how many blocks ahead parameters (and swapped activations, in backward) are fetched.
        keep_swap_files: keep the swap files after the run instead of deleting them.
        activation_policy: a fixed placement instead of a plan: ``"device"`` (alias ``"keep"``), ``"host"``,
            ``"ssd"`` or ``"recompute"`` for every block, or a mapping from ``fnmatch`` patterns over block names to
            those (first match wins; unmatched blocks stay on the device). ``None``: use ``plan``.
        plan: ``"auto"`` (profile the first step, then place every op's saved activations where the cost model
            predicts the shortest iteration), a path to a plan JSON file (``ratel_plan.json`` of an earlier run), or a
            :class:`~lightning_ratel.plan.Plan`. Ignored when ``activation_policy`` is given.
        host_memory_limit: host memory (bytes, or a string such as ``"64GiB"``) the plan may use in total, the
            engine's own buffers included. ``None``: what is available when planning, less a margin.
        device_memory_limit: device memory the plan and the CUDA caching allocator may use (e.g. ``"24GiB"`` to
            stand in for a consumer card). ``None``: what is free.
        blocks: names of the modules to treat as the repeated blocks, or a callable returning them from the model;
            ``None`` detects them (a transformers model's decoder layers, or the largest ``nn.ModuleList``).
        accelerator: the accelerator; normally set by the Trainer.
        checkpoint_io: how checkpoints are written; normally set by the Trainer.
        param_cache: where the compute copies of the parameters live between uses: ``"host"`` (a host-memory cache,
            2 or 4 bytes per parameter), ``"ssd"`` (read from the swap files on every use, so host memory holds only
            the blocks in flight; costs one read of the model per forward and per backward) or ``"auto"`` (``"ssd"``
            when the cache would take more than half of ``host_memory_limit``, or of the available host memory).
            Fitting only; evaluation runs keep them in host memory.
        param_init_fn: initializes one module whose parameters or buffers were on the meta device; called with the
            module after its tensors got (uninitialized) host memory. ``None`` calls ``module.reset_parameters()``.
            Build the model under ``torch.device("meta")`` to train a model larger than host memory: each block is
            materialized, initialized and written to the swap files in turn.
    """

    strategy_name = "ratel"

    def __init__(
        self,
        ssd_paths: list[str] | None = None,
        prefetch_depth: int = 1,
        keep_swap_files: bool = False,
        activation_policy: str | dict[str, str] | None = None,
        plan: str | Plan | None = "auto",
        host_memory_limit: int | str | None = None,
        device_memory_limit: int | str | None = None,
        blocks: list[str] | Callable[[nn.Module], list[str]] | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        param_cache: ParamCache = "auto",
        param_init_fn: ParamInitFn | None = None,
    ) -> None:
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io)
        self.config = RatelConfig(
            ssd_paths=ssd_paths,
            prefetch_depth=prefetch_depth,
            keep_swap_files=keep_swap_files,
            activation_policy=activation_policy,
            plan=plan,
            host_memory_limit=host_memory_limit,
            device_memory_limit=device_memory_limit,
            blocks=blocks,
            param_cache=param_cache,
            param_init_fn=param_init_fn,
        )
        self._engine: RatelEngine | None = None
        self._exception: BaseException | None = None
        self._failure: BaseException | None = None
        # The device and allocator fraction that `device_memory_limit` replaced, to put back at teardown.
        self._replaced_memory_fraction: tuple[torch.device, float] | None = None

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
    @override
    def root_device(self) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

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
        if trainer is not None and not any(isinstance(c, RatelProfiler) for c in trainer.callbacks):
            trainer.callbacks.append(RatelProfiler())

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
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and not buf.is_meta:
                    module._buffers[name] = buf.to(self.root_device)
        self.lightning_module._device = self.root_device  # type: ignore[union-attr]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        optimizer = None
        if trainer.state.fn == TrainerFn.FITTING:
            if not module.automatic_optimization:
                raise RatelConfigError("RatelStrategy runs the optimizer itself and needs automatic optimization")
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise RatelConfigError(f"RatelStrategy supports one optimizer, got {len(self.optimizers)}")
            optimizer = self.optimizers[0]
            if trainer.checkpoint_callbacks:
                # Refused now rather than at the first save, after hours of training.
                ensure_checkpoint_fits(module, optimizer)
        self.model_to_device()
        config = self.config
        if config.ssd_paths is None:
            default = os.path.join(trainer.default_root_dir, "ratel_swap")
            os.makedirs(default, exist_ok=True)
            config = config.with_ssd_paths([default])
        self._limit_device_memory()
        precision = self.precision_plugin
        self._exception = None
        self._failure = None
        self._engine = RatelEngine(module, self.root_device, config, precision.half_dtype, optimizer)
        precision.bind(self._engine, self.root_device.type)
        if isinstance(config.plan, Plan):
            self._engine.planner.apply_plan(config.plan)
            show_plan(config.plan)
        self.setup_precision_plugin()
        placement = self._engine.byte_placement()
        rank_zero_info(
            f"RatelStrategy: {len(self._engine.blocks)} blocks on {self.root_device}; "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in placement.items())
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
            return super().training_step(*args, **kwargs)

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

    def byte_placement(self) -> dict[str, int]:
        """Bytes held right now on the device, in host memory and on disk (empty outside a run)."""
        return self._engine.byte_placement() if self._engine is not None else {}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._failure is not None:
            raise self._failure
        if self._engine is None:
            return super().lightning_module_state_dict()
        return self._from_engine(self._engine.state.state_dict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._failure is not None:
            raise self._failure
        if self._engine is not None and optimizer is self._engine.optimizer:
            return self._from_engine(self._engine.state.optimizer_state_dict)
        return super().optimizer_state(optimizer)

    def _from_engine(self, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Read state for a checkpoint; if the engine cannot produce it, end the run's engine here.

        Lightning saves from ``on_exception`` callbacks (``OnExceptionCheckpoint``) and skips ``teardown`` when such a
        save raises, so waiting for teardown would leave the swap files and the directory lock behind. The failure is
        remembered: a later save must not fall back to the module's paging placeholders.
        """
        try:
            return read()
        except BaseException as err:
            self._failure = err
            engine, self._engine = self._engine, None
            if engine is not None:
                try:
                    engine.close(restore=False)
                except Exception as cleanup:
                    err.__notes__ = [*getattr(err, "__notes__", []), f"Closing the swap store failed too: {cleanup!r}"]
            raise

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._engine is None or self._engine.optimizer is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        self._engine.state.load_optimizer_state_dict(checkpoint["optimizer_states"][0])

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._exception = exception
        if self._engine is not None:
            try:
                self._engine.abort_step()
            except Exception as err:
                # The exception that stopped training matters more; the copy-back at teardown says what it finds.
                rank_zero_warn(f"RatelStrategy could not roll the interrupted step back after {exception!r}: {err!r}")

    @override
    def teardown(self) -> None:
        self._restore_device_memory()
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.close(restore=True)
            except Exception as err:
                if self._exception is None:
                    raise
                # Do not hide the error that stopped training; the last checkpoint holds the state.
                rank_zero_warn(f"RatelStrategy could not restore the parameters after {self._exception!r}: {err!r}")
        module = self.lightning_module
        if module is None or not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            super().teardown()
            return
        # Setup failed before the model left the meta device. Lightning's teardown moves the module to the CPU, which
        # a meta tensor cannot do: move the rest here and let it tear down everything else.
        module._apply(lambda t: t if t.is_meta else t.cpu())
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Model states on NVMe, paged parameters, overlapped CPU AdamW"
        )
