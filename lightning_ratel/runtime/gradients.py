"""Gradients leave the device as soon as autograd has accumulated them.

A post-accumulate-grad hook on every trainable parameter copies its gradient to host memory on the device->host stream
(or, where several ranks reduce the gradients on the device first, hands the device's gradient over as it is:
:mod:`lightning_ratel.runtime.device_reduce`) and hands it to the CPU optimizer, whose worker waits for the copy's event
and folds it into the shard's gradient buffer (and updates the shard once its last gradient is in). The parameter's
``.grad`` is cleared at once, so gradients never pile up on the device. The host copy is a buffer of the device's host
pool (pinned on CUDA), which takes it back once the worker has dropped it: the pinned staging is bounded by the
gradients in flight, which the optimizer's gradient budget bounds, and those the optimizer holds until one of them
completes its shard. Parameters outside the optimizer have no consumer for their gradient: it is dropped.

A gradient arrives only while the engine's backward pass is open (:attr:`GradientOffload.open`): one computed by a
backward the engine did not start would be added to a step it knows nothing about, and raises instead, before the
optimizer has it.

Threads: the hooks run on autograd's thread; :attr:`GradientOffload.open` is set on the training thread before a
backward starts and after it returns.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_ratel.errors import RatelModelError
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.optimizer import CpuAdam
from lightning_ratel.runtime.timeline import span
from lightning_ratel.runtime.units import Shard

if TYPE_CHECKING:
    from lightning_ratel.runtime.collectives import DataParallelAdam


class GradientOffload:
    """Installs the gradient hooks.

    Args:
        device: the compute device.
        optimizer: the CPU optimizer that consumes the gradients.
        shards: the shards the optimizer updates.
        frozen: shards of parameters outside the optimizer.
        to_host: copy each gradient to host memory; ``False``: hand the device's gradient over (the optimizer then
            moves it, :attr:`~lightning_ratel.runtime.collectives.DataParallelAdam.reduces_on_device`).
    """

    def __init__(self, device: Device, optimizer: CpuAdam | DataParallelAdam, shards: Sequence[Shard],
                 frozen: Sequence[Shard], to_host: bool = True) -> None:
        self.device = device
        self.optimizer = optimizer
        self._to_host = to_host
        # Whether the engine's backward pass runs: gradients are its.
        self.open = False
        self._handles: list[Any] = []
        for shard in shards:
            for position, sp in enumerate(shard.params):
                if sp.param.requires_grad:
                    self._handles.append(sp.param.register_post_accumulate_grad_hook(
                        functools.partial(self._offload, shard, position)))
        for shard in frozen:
            for sp in shard.params:
                if sp.param.requires_grad:
                    self._handles.append(sp.param.register_post_accumulate_grad_hook(_drop))

    @span("ratel/grad_offload")
    def _offload(self, shard: Shard, position: int, param: nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        if not self.open:
            raise unseen_backward(shard.params[position].name)
        if not self._to_host:
            self.optimizer.gradient(shard, position, grad, None)
            return
        host, event = self.device.to_host(grad)
        self.optimizer.gradient(shard, position, host, event)

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def unseen_backward(name: str) -> RatelModelError:
    """The error for the gradient of parameter ``name`` from a backward pass the engine did not see start."""
    return RatelModelError(
        f"RatelStrategy: the gradient of {name} comes from a backward pass it did not see start "
        "(`torch.autograd.backward(...)`, or `loss.backward()` outside `training_step` and "
        "`LightningModule.backward`), which it cannot add to a step. Under manual optimization call `self.manual_backward(loss)` in "
        "`training_step`; under automatic optimization return the loss from `training_step` and Lightning runs its "
        "backward.")


def _drop(param: nn.Parameter) -> None:
    param.grad = None
