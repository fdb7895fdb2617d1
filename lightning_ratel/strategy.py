"""RatelStrategy: the Lightning entry point.

A thin adapter: it validates the configuration, builds a :class:`~lightning_ratel.engine.RatelEngine` for each
fit/validate/test/predict run, and forwards Lightning's events to it. It never moves data itself.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from rich.console import Console
from torch import nn
from typing_extensions import override

import lightning.pytorch as pl
from lightning_ratel.callbacks import RatelProfiler
from lightning_ratel.engine import (
    PARAM_CACHES,
    POLICIES,
    ActivationPolicy,
    EngineConfig,
    ParamCache,
    ParamInitFn,
    RatelEngine,
    ensure_checkpoint_fits,
)
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.plan.search import Plan
from lightning_ratel.precision import RatelPrecision
from lightning_ratel.report import plan_table


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | str | None, name: str) -> int | None:
    """``None``, a byte count, or a string such as ``"24GiB"`` / ``"1.5 GB"`` -> bytes."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            value = int(float(number) * _UNITS[unit])
        except (ValueError, KeyError):
            raise RatelConfigError(f"`{name}` must be a byte count or a size like '24GiB', got {value!r}") from None
    if not isinstance(value, int) or value <= 0:
        raise RatelConfigError(f"`{name}` must be a positive byte count, got {value!r}")
    return value


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
            when the cache would take more than half of the available host memory). Fitting only; evaluation runs
            keep them in host memory.
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
        if isinstance(ssd_paths, (str, os.PathLike)):
            ssd_paths = [os.fspath(ssd_paths)]
        if ssd_paths is not None and not ssd_paths:
            raise RatelConfigError("`ssd_paths` is empty: give at least one directory, or None for the default")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise RatelConfigError(f"`prefetch_depth` must be an integer >= 0, got {prefetch_depth!r}")
        if activation_policy is not None:
            policies = [activation_policy] if isinstance(activation_policy, str) else list(activation_policy.values())
            bad = [p for p in policies if p not in POLICIES]
            if bad:
                raise RatelConfigError(f"`activation_policy` values must be one of {POLICIES}, got {bad}")
            plan = None
        if isinstance(plan, (str, os.PathLike)) and plan != "auto":
            if not os.path.isfile(plan):
                raise RatelConfigError(f"`plan` must be 'auto', a Plan or a plan JSON file; {plan!r} is not a file")
            plan = Plan.load(plan)
        self.plan = plan
        self.host_memory_limit = parse_bytes(host_memory_limit, "host_memory_limit")
        self.device_memory_limit = parse_bytes(device_memory_limit, "device_memory_limit")
        if param_cache not in PARAM_CACHES:
            raise RatelConfigError(f"`param_cache` must be one of {PARAM_CACHES}, got {param_cache!r}")
        if param_init_fn is not None and not callable(param_init_fn):
            raise RatelConfigError(f"`param_init_fn` must be callable, got {type(param_init_fn).__name__}")
        self.ssd_paths = [os.fspath(p) for p in ssd_paths] if ssd_paths is not None else None
        self.prefetch_depth = prefetch_depth
        self.keep_swap_files = keep_swap_files
        self.activation_policy: ActivationPolicy | None = activation_policy
        self.blocks = blocks
        self.param_cache: ParamCache = param_cache
        self.param_init_fn = param_init_fn
        self._engine: RatelEngine | None = None
        self._exception: BaseException | None = None
        self._failure: BaseException | None = None

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
        return self.activation_policy is None and self.plan == "auto"

    @override
    def connect(self, model: nn.Module) -> None:
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and not any(isinstance(c, RatelProfiler) for c in trainer.callbacks):
            trainer.callbacks.append(RatelProfiler())

    def show_plan(self, plan: Plan, planning_seconds: float | None = None) -> None:
        """Print the plan as a table (rank zero)."""
        if self.global_rank != 0:
            return
        Console().print(plan_table(plan))
        took = f" (search {planning_seconds * 1000:.0f} ms)" if planning_seconds is not None else ""
        rank_zero_info(f"RatelStrategy: plan applied{took}; predicted {plan.predicted_iteration_time:.3f} s/step")

    @property
    def engine(self) -> RatelEngine | None:
        """The engine of the current run (``None`` outside one)."""
        return self._engine

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
        ssd_paths = self.ssd_paths
        if ssd_paths is None:
            default = os.path.join(trainer.default_root_dir, "ratel_swap")
            os.makedirs(default, exist_ok=True)
            ssd_paths = [default]
        config = EngineConfig(
            ssd_paths=ssd_paths,
            prefetch_depth=self.prefetch_depth,
            keep_swap_files=self.keep_swap_files,
            activation_policy=self.activation_policy or "host",
            blocks=self.blocks,
            host_memory_limit=self.host_memory_limit,
            device_memory_limit=self.device_memory_limit,
            param_cache=self.param_cache,
            param_init_fn=self.param_init_fn,
        )
        if self.device_memory_limit is not None and self.root_device.type == "cuda":
            total = torch.cuda.get_device_properties(self.root_device).total_memory
            if self.device_memory_limit > total:
                raise RatelConfigError(
                    f"`device_memory_limit` ({self.device_memory_limit / 2**30:.1f} GiB) exceeds the device's "
                    f"{total / 2**30:.1f} GiB"
                )
            torch.cuda.set_per_process_memory_fraction(self.device_memory_limit / total, self.root_device)
        precision = self.precision_plugin
        self._exception = None
        self._failure = None
        self._engine = RatelEngine(module, self.root_device, config, precision.half_dtype, optimizer)
        precision.bind(self._engine, self.root_device.type)
        if isinstance(self.plan, Plan):
            self._engine.apply_plan(self.plan)
            self.show_plan(self.plan)
        self.setup_precision_plugin()
        placement = self._engine.byte_placement()
        rank_zero_info(
            f"RatelStrategy: {len(self._engine.blocks)} blocks on {self.root_device}; "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in placement.items())
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        assert self._engine is not None
        self._engine.begin_micro_batch()
        return super().training_step(*args, **kwargs)

    def byte_placement(self) -> dict[str, int]:
        """Bytes held right now on the device, in host memory and on disk (empty outside a run)."""
        return self._engine.byte_placement() if self._engine is not None else {}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._failure is not None:
            raise self._failure
        if self._engine is None:
            return super().lightning_module_state_dict()
        return self._from_engine(self._engine.state_dict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._failure is not None:
            raise self._failure
        if self._engine is not None and optimizer is self._engine.optimizer:
            return self._from_engine(self._engine.optimizer_state_dict)
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
        self._engine.load_optimizer_state_dict(checkpoint["optimizer_states"][0])

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._exception = exception

    @override
    def teardown(self) -> None:
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
