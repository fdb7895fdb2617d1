"""Precision plugin for RatelStrategy: autocast for mixed precision, fp16 loss scaling, and the optimizer step.

The engine, not ``optimizer.step()``, updates the parameters, so this plugin owns the step the way Lightning's
DeepSpeed precision plugin does: it runs the closure (forward + backward, during which the CPU updates already run)
and then lets the engine finish the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from typing_extensions import override

from lightning_ratel.errors import RatelConfigError

_PRECISION_INPUT = Literal["32-true", "bf16-mixed", "16-mixed"]


class StepEngine(Protocol):
    """What this plugin asks of the engine during a step (:class:`~lightning_ratel.engine.coordinator.RatelEngine` is it)."""

    def begin_step(self, optimizer: torch.optim.Optimizer, clip_val: float | None, clip_algorithm: str,
                   custom_clipping: bool, loss_scale: Tensor | None) -> None: ...

    def begin_manual_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def finish_step(self, loss_scale: Tensor | None = None) -> bool: ...

    def request_clip(self, clip_val: float, algorithm: str) -> None: ...

    def pre_backward(self) -> None: ...

    def post_backward(self) -> None: ...

    def backward_stopped(self) -> None: ...
_HALF = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class RatelPrecision(Precision):
    """Mixed or full precision for :class:`~lightning_ratel.RatelStrategy`.

    In ``"bf16-mixed"`` and ``"16-mixed"`` the device holds 16-bit copies of the parameters that autocast would cast
    to 16-bit anyway (linear and convolution weights), fp32 copies of the rest, and the fp32 masters stay off the
    device; the numbers match Lightning's own mixed precision.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        device: device type for autocast; the strategy sets it from the device it runs on.
        init_scale: initial fp16 loss scale (as ``torch.amp.GradScaler``).
        growth_factor: scale multiplier after ``growth_interval`` steps without overflow.
        backoff_factor: scale multiplier after an overflow.
        growth_interval: steps without overflow before the scale grows.
    """

    def __init__(
        self,
        precision: _PRECISION_INPUT = "32-true",
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if precision not in _HALF:
            raise RatelConfigError(
                f"RatelStrategy supports precision '32-true', 'bf16-mixed' and '16-mixed', got {precision!r}"
            )
        self.precision = precision
        self.device = device
        self.half_dtype: torch.dtype | None = _HALF[precision]
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        # The scale lives in host memory, where the CPU optimizer unscales the gradients and checkpoints read it, and
        # in a copy on the device that scales the loss. The copy is made once per run and then changed by the same
        # operations as the host scale, so no step copies it over (a copy from pageable memory syncs the device).
        self._scale = torch.full((), init_scale, dtype=torch.float32) if precision == "16-mixed" else None
        self._device_scale: Tensor | None = None
        self._growth_tracker = 0
        self._engine: StepEngine | None = None
        self.steps_skipped = 0

    @classmethod
    def from_lightning(cls, plugin: Precision) -> RatelPrecision:
        """Translate the precision plugin Lightning built from ``Trainer(precision=...)``."""
        if isinstance(plugin, RatelPrecision):
            return plugin
        if type(plugin) is Precision:
            return cls("32-true")
        if isinstance(plugin, MixedPrecision):
            ratel = cls(plugin.precision, device=plugin.device)  # type: ignore[arg-type]
            return ratel
        raise RatelConfigError(
            f"RatelStrategy supports precision '32-true', 'bf16-mixed' and '16-mixed'; got {type(plugin).__name__}"
            f" (precision={getattr(plugin, 'precision', '?')!r})"
        )

    def bind(self, engine: StepEngine | None, device_type: str) -> None:
        """Attach the engine that runs this fit (``None`` once it has ended), and the device type autocast must
        target."""
        self._engine = engine
        self.device = device_type

    @property
    def loss_scale(self) -> Tensor | None:
        return self._scale

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.half_dtype is None:
            yield
        else:
            with torch.autocast(self.device, dtype=self.half_dtype):
                yield

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self._scale is not None:
            tensor = tensor * self._scale_on(tensor.device)
        tensor = super().pre_backward(tensor, module)
        if self._engine is not None:
            self._engine.pre_backward()
        return tensor

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any,  # type: ignore[override]
                 **kwargs: Any) -> None:
        try:
            super().backward(tensor, model, optimizer, *args, **kwargs)
        except BaseException:
            if self._engine is not None:
                self._engine.backward_stopped()
            raise

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self._engine is not None:
            self._engine.post_backward()
        return super().post_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        engine = self._bound()
        trainer = model.trainer
        if model.automatic_optimization:
            algorithm = trainer.gradient_clip_algorithm
            custom_clipping = (type(model).configure_gradient_clipping
                               is not pl.LightningModule.configure_gradient_clipping)
            # Lightning clips by norm unless told otherwise; the engine decides what that means for the updates.
            engine.begin_step(optimizer, trainer.gradient_clip_val, GradClipAlgorithmType(algorithm or "norm").value,
                              custom_clipping, loss_scale=self._scale)
        else:
            # The user's training_step already ran its manual_backward calls; their gradients are the step's.
            engine.begin_manual_step(optimizer)
        closure_result = closure()
        self._after_closure(model, optimizer)
        taken = engine.finish_step(self._scale)
        if taken:
            # LR schedulers count optimizer.step() calls to warn about a wrong call order; the engine's update is
            # that step.
            optimizer._opt_called = True
        # As Lightning's MixedPrecision: a manual step always updates the scale (its closure returns nothing).
        if self._scale is not None and (closure_result is not None or not model.automatic_optimization):
            self._update_scale(found_inf=not taken)
        return closure_result

    def _scale_on(self, device: torch.device) -> Tensor:
        """The loss scale on ``device``: the host scale itself on the CPU, its device copy elsewhere."""
        assert self._scale is not None
        if device.type == "cpu":
            return self._scale
        if self._device_scale is None or self._device_scale.device != device:
            self._device_scale = self._scale.to(device)
        return self._device_scale

    def _scales(self) -> list[Tensor]:
        """The host scale and its device copy (if made): every change applies to both, without a copy between."""
        assert self._scale is not None
        return [self._scale] if self._device_scale is None else [self._scale, self._device_scale]

    def _update_scale(self, found_inf: bool) -> None:
        """``torch.amp.GradScaler.update`` semantics."""
        if found_inf:
            for scale in self._scales():
                scale.mul_(self.backoff_factor)
            self._growth_tracker = 0
            self.steps_skipped += 1
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                for scale in self._scales():
                    scale.mul_(self.growth_factor)
                self._growth_tracker = 0

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        self._bound().request_clip(clip_val, GradClipAlgorithmType(gradient_clip_algorithm).value)

    def _bound(self) -> StepEngine:
        if self._engine is None:
            raise RuntimeError(
                "RatelPrecision runs an optimizer step only inside a RatelStrategy fit (no engine is bound)")
        return self._engine

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._scale is None:
            return {}
        return {"scale": self._scale.item(), "growth_tracker": self._growth_tracker}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._scale is not None and state_dict:
            for scale in self._scales():
                scale.fill_(state_dict["scale"])
            self._growth_tracker = int(state_dict["growth_tracker"])
