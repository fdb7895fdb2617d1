"""How a rank's gradients reach their owners (several ranks; pure arithmetic).

Three ways, the same numbers within fp32 rounding (the sum over ranks and micro-batches is taken in another order):

- ``"window"``: each rank sums its gradients of the whole accumulation window in an fp32 buffer per shard and reduces
  the sum onto the shard's owner once, on the boundary micro-batch (``DistributedDataParallel``'s arithmetic and
  traffic). Every rank holds a window buffer of every trainable shard: 4 bytes per trainable parameter per rank, on
  top of the owners' own accumulation.
- ``"micro_batch"``: each micro-batch's gradient is reduced onto its owner as soon as backward completes it, and the
  owner's optimizer sums the window (as it does on one rank). A rank holds no window for what it does not own, so a
  node holds each gradient sum once; the price is ``accumulate - 1`` more reduces of the gradients per step.
- ``"device"``: as ``"micro_batch"``, reduced on the device (NCCL on CUDA) before anything leaves it, and only the
  owner copies each reduced bucket to host memory: a rank's gradients cross PCIe for its own share only, and the sum
  runs at the device link's speed instead of gloo's over the host's loopback.

Without accumulation all three reduce each gradient once, with the same sums; ``"micro_batch"`` then only saves the
window buffers (it holds two buckets of gradients in flight: up to 25 MiB or half the largest shard, whichever is less;
a larger parameter goes in parts; the window's buffers live from a shard's first gradient until its reduce landed, so
how many are held at once depends on how far the reduces fall behind backward, up to all of them).
:func:`choose_exchange` reduces on the device on GPUs (under automatic optimization: manual optimization may run
several backward passes in one micro-batch, which only the window sums); elsewhere it keeps the window (``ddp``'s very
sums) while all its buffers fit the host budget, and reduces each micro-batch where they do not. Host memory the
windows take is not weighed against what it would hold of the states (nor the extra reduces' time):
``gradient_exchange="micro_batch"`` asks for the node's bytes held once where the windows fit too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.sizes import format_bytes

Exchange = Literal["window", "micro_batch", "device"]
GRADIENT_EXCHANGES: tuple[str, ...] = ("auto", "window", "micro_batch", "device")


@dataclass(frozen=True)
class ExchangeChoice:
    """The planner's choice of gradient exchange, and why.

    Attributes:
        mode: ``"window"``, ``"micro_batch"`` or ``"device"``.
        reason: one clause for the run's log.
        reduces_per_step: how many times a rank reduces its gradients each step.
    """

    mode: Exchange
    reason: str
    reduces_per_step: int

    def describe(self) -> str:
        """One line for the run's log."""
        return f"gradient exchange: {self.mode} ({self.reduces_per_step} reduce(s) per step; {self.reason})"


def choose_exchange(requested: str, accumulate: int, ranks: int, rank_host_bytes: int, window_bytes: int,
                    host_budget: int | None = None, automatic: bool = True, gpu: bool = False,
                    device_states: bool = False) -> ExchangeChoice:
    """The gradient exchange of one rank.

    Args:
        requested: ``"auto"``, ``"window"``, ``"micro_batch"`` or ``"device"`` (the strategy's
            ``gradient_exchange``).
        accumulate: micro-batches per step (the Trainer's ``accumulate_grad_batches``).
        ranks: ranks training data parallel.
        rank_host_bytes: the host bytes this rank holds without any window buffer, as the host budget check counts
            them (:func:`~lightning_ratel.preflight.check_host_budget`).
        window_bytes: this rank's window buffers under ``"window"``.
        host_budget: host bytes this rank may take; ``None``: unlimited.
        automatic: Lightning's automatic optimization; manual optimization may run several backward passes in one
            micro-batch, which only the window sums, so ``"auto"`` keeps it.
        gpu: the ranks train on GPUs, where ``"auto"`` reduces on the device.
        device_states: the optimizer states are on the device tier (``optimizer_states="device"``), whose owners
            update on the device the gradients reduced there: only ``"device"`` (or ``"auto"``) runs it.

    Raises:
        RatelConfigError: ``requested`` or ``accumulate`` is invalid, or ``device_states`` asks for an exchange in
            host memory.
    """
    if requested not in GRADIENT_EXCHANGES:
        raise RatelConfigError(f"`gradient_exchange` must be one of {GRADIENT_EXCHANGES}, got {requested!r}")
    if accumulate < 1:
        raise RatelConfigError(f"accumulate_grad_batches must be at least 1, got {accumulate}")
    if ranks < 2:
        return ExchangeChoice("window", "one rank: nothing is exchanged", 0)
    window = ExchangeChoice("window", "", 1)
    micro = ExchangeChoice("micro_batch", "", accumulate)
    device = ExchangeChoice("device", "", accumulate)
    if device_states:
        if requested not in ("auto", "device"):
            raise RatelConfigError(
                f"optimizer_states='device' with several ranks updates each unit on its owner's device from the "
                f"gradients reduced there: give gradient_exchange='device' (or 'auto'), not {requested!r}")
        return _because(device, "optimizer_states='device': each owner updates its units on the device")
    if requested == "window":
        return _because(window, "asked for")
    if requested == "micro_batch":
        return _because(micro, "asked for")
    if requested == "device":
        return _because(device, "asked for")
    if not automatic:
        return _because(window, "manual optimization may run several backward passes in one micro-batch")
    if gpu:
        return _because(device, "on the GPUs, NCCL sums each micro-batch's gradients and each owner copies its share "
                                "to host memory")
    with_window = rank_host_bytes + window_bytes
    if host_budget is not None and with_window > host_budget:
        return _because(micro, f"the window buffers ({format_bytes(window_bytes)}) would take this rank to "
                               f"{format_bytes(with_window)}, over its host budget of {format_bytes(host_budget)}"
                               + ("; one micro-batch per step: the same sums" if accumulate == 1 else ""))
    if accumulate == 1:
        return _because(window, "one micro-batch per step: each gradient is reduced once either way")
    return _because(window, f"the window buffers ({format_bytes(window_bytes)}) fit the host budget: ddp's sums; "
                            "'micro_batch' would hold each gradient sum once per node")


def _because(choice: ExchangeChoice, reason: str) -> ExchangeChoice:
    return ExchangeChoice(choice.mode, reason, choice.reduces_per_step)
