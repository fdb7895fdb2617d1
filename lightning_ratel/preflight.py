"""What a run will need, before anything is allocated: disk, host, device and checkpoint bytes.

:func:`estimate` lays the model out exactly as a run does (blocks, units, shards, the dtype policy of the precision,
where the compute copies live) on the meta device, so it costs no memory and takes a model of any size: a module, a
transformers config, or a Hugging Face checkpoint folder. The strategy checks its host budget with the same numbers
before it builds anything (:func:`check_host_budget`). From the command line::

    ratel-estimate /data/Llama-3-8B --precision bf16-mixed --param-cache ssd
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn

from lightning_ratel.config import RatelConfig
from lightning_ratel.engine.blocks import discover_blocks
from lightning_ratel.engine.coordinator import GRAD_BUDGET_SHARDS
from lightning_ratel.engine.layout import buffer_sets, build_layout, meta_empty, set_needs
from lightning_ratel.errors import RatelConfigError, RatelPlanError
from lightning_ratel.io.checkpoint import choose_checkpoint_format, gathered_checkpoint_bytes
from lightning_ratel.plan.exchange import ExchangeChoice, choose_exchange
from lightning_ratel.plan.states import state_bytes
from lightning_ratel.precision import RatelPrecision
from lightning_ratel.runtime.collectives import (
    NodeCopies,
    StoredCopies,
    exchange_micro_batch_nbytes,
    exchange_window_nbytes,
)
from lightning_ratel.runtime.probe import available_host_memory
from lightning_ratel.runtime.state_buffers import set_bytes, set_capacities
from lightning_ratel.runtime.units import Layout
from lightning_ratel.sizes import format_bytes


@dataclass(frozen=True)
class Estimate:
    """The bytes a fit of one model with one set of strategy arguments needs.

    Attributes:
        parameters: parameters of the model (tied ones once).
        trainable: those the optimizer updates (``requires_grad``).
        param_cache: where the compute copies live, ``"host"`` or ``"ssd"`` (``"auto"`` resolved).
        checkpoint_format: ``"full"`` or ``"sharded"`` (``"auto"`` resolved).
        disk: the swap files: the fp32 master and two moments in two slots (24 bytes) of each trainable parameter whose
            states are not in host memory, and with ``param_cache="ssd"`` the 16-bit and frozen compute copies
            (with several ranks, the files of all of them: the ranks read each other's trainable compute copies, see
            :class:`~lightning_ratel.runtime.collectives.NodeCopies`, but for fp32 masters held in host memory, of
            which each other rank keeps a copy, see :class:`~lightning_ratel.runtime.collectives.StoredCopies`).
            Activations a plan sends to the SSD, and the own-dtype copies of frozen values bf16 would round, come on
            top.
        host_cache: the host cache of compute copies (``param_cache="host"``).
        host_states: the optimizer states kept in host memory (``optimizer_states``), both slots.
        optimizer_buffers: the CPU AdamW's buffer sets (master and moments of the largest shard whose states are in
            the swap files, each set): the pipeline's three (with several ranks on the node, a rank's part of them)
            and ``read_ahead_sets``.
        gradient_buffers: the gradients backward may hold in host memory before an update frees some (the largest
            shards' worth the gradient budget allows; with fp32 masters read from the swap files, part of it keeps
            backward's page-ins of masters for their updates instead). Not counted: with gradient accumulation, or
            with updates after backward (a CPU run's choice while those gradients take at most a quarter of the host
            memory left), the window holds up to 4 bytes per trainable parameter.
        exchange_buffers: with several ranks, each rank's gradient exchange. Under ``exchange="window"`` the window's
            fp32 sum of every trainable shard (4 bytes per trainable parameter) until it is reduced onto its owner; at
            most all of them at once (between the boundary micro-batches of gradient accumulation). Under
            ``"micro_batch"`` two buckets of gradients in flight, each one owner's fp32 gradients of consecutive
            parameters (a larger one in parts) and a flag per item, up to 25 MiB or half the largest shard, whichever
            is less (:func:`~lightning_ratel.runtime.collectives.exchange_micro_batch_nbytes`); under ``"device"``
            none (its buckets are device memory). With
            ``param_cache="ssd"`` and fp32 masters held in host memory also the two buffers of the largest one's
            compute copy that copies published between ranks pass through
            (:class:`~lightning_ratel.runtime.collectives.StoredCopies`). 0 on one rank.
        exchange: with several ranks, the gradient exchange the planner chooses
            (:func:`~lightning_ratel.plan.exchange.choose_exchange`) from the host budget (``host_memory_limit``, else
            a rank's part of the memory available now) and the other host bytes; ``None`` on one rank.
        device: the compute copies of the blocks in flight (``prefetch_depth + 1`` of the largest), and under
            ``exchange="device"`` its two buckets; activations and workspaces come on top and are known only once a
            step has run.
        checkpoint: one checkpoint in ``checkpoint_format`` (a sharded one: 12 bytes per trainable parameter, and the
            frozen parameters that did not come from ``pretrained``).
        read_ahead_sets: buffer sets beyond the pipeline's, reading more states ahead during forward (planned with
            the states' tiers, or as the strategy's ``read_ahead_sets`` fixed them).
    """

    parameters: int
    trainable: int
    param_cache: Literal["host", "ssd"]
    checkpoint_format: Literal["full", "sharded"]
    disk: int
    host_cache: int
    host_states: int
    optimizer_buffers: int
    gradient_buffers: int
    device: int
    checkpoint: int
    exchange_buffers: int = 0
    exchange: ExchangeChoice | None = None
    read_ahead_sets: int = 0

    @property
    def host(self) -> int:
        """Host memory of the run's own buffers (its activations come on top)."""
        return (self.host_cache + self.host_states + self.optimizer_buffers + self.gradient_buffers
                + self.exchange_buffers)

    def _host_parts(self) -> str:
        return (f"compute copies {format_bytes(self.host_cache)}, optimizer states "
                f"{format_bytes(self.host_states)}, CPU optimizer buffers "
                f"{format_bytes(self.optimizer_buffers)}"
                + (f" ({self.read_ahead_sets} sets beyond the pipeline's, to read ahead)" if self.read_ahead_sets else "")
                + f", gradients {format_bytes(self.gradient_buffers)}"
                + (f", gradient exchange {format_bytes(self.exchange_buffers)}" if self.exchange_buffers else ""))

    def __str__(self) -> str:
        rows = [
            ("parameters", f"{self.parameters:,} ({self.trainable:,} trainable)"),
            ("disk (swap files)", format_bytes(self.disk)),
            ("host memory", f"{format_bytes(self.host)} ({self._host_parts()})"),
            ("device memory", f"{format_bytes(self.device)} of parameters in flight, plus activations"),
            (f"checkpoint ({self.checkpoint_format})", format_bytes(self.checkpoint)),
        ]
        if self.exchange is not None:
            rows.append(("gradient exchange", f"{self.exchange.mode} ({self.exchange.reason})"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows) + f"\nparam_cache: {self.param_cache}"


def estimate(model: nn.Module | Any | str | os.PathLike[str], precision: str = "bf16-mixed",
             optimizer: torch.optim.Optimizer | None = None, ranks: int = 1, accumulate_grad_batches: int = 1,
             accelerator: Literal["gpu", "cpu"] = "gpu", **strategy_args: Any) -> Estimate:
    """The disk, host, device and checkpoint bytes a fit with :class:`~lightning_ratel.RatelStrategy` needs.

    Nothing is allocated: the model is laid out as a run lays it out, on the meta device.

    Args:
        model: a module (a LightningModule, on any device, the meta device included), a transformers
            ``PretrainedConfig``, or a Hugging Face checkpoint folder (its ``config.json``; frozen parameters then
            count as coming from it).
        precision: the Trainer's precision: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``.
        optimizer: the optimizer the module's ``configure_optimizers`` returns, for its parameter groups; ``None``:
            one group of every parameter that requires a gradient.
        ranks: the ranks training data parallel, on one node (each holds a gradient exchange's buffers; the other parts
            are one process's, but for the swap files, which with ``param_cache="ssd"`` count every rank's).
        accumulate_grad_batches: the Trainer's, for the choice of gradient exchange with several ranks.
        accelerator: where the run computes: ``"gpu"``, or ``"cpu"``, where the device's memory is the host's (the
            parameters in flight count against the host budget too, and several ranks reduce their gradients in host
            memory).
        **strategy_args: the arguments of :class:`~lightning_ratel.RatelStrategy` (``param_cache``,
            ``prefetch_depth``, ``host_memory_limit``, ``checkpoint_format``, ``blocks``, ``pretrained``...).

    Returns:
        The estimate; ``str()`` of it is a readable summary.

    Raises:
        RatelConfigError: a strategy argument is invalid, or the model cannot be built from what was given.
    """
    half = RatelPrecision(precision).half_dtype
    if isinstance(model, (str, os.PathLike)):
        strategy_args.setdefault("pretrained", os.fspath(model))
        model = _from_config(_config_of(os.fspath(model)))
    elif not isinstance(model, nn.Module):
        model = _from_config(model)
    config = RatelConfig(**strategy_args)
    if optimizer is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        # Construction only reads the groups; it never touches a value, so meta parameters are fine.
        optimizer = torch.optim.AdamW(trainable) if trainable else None
    if optimizer is None:
        raise RatelConfigError("the model has no parameter that requires a gradient: there is nothing to train")
    if accelerator not in ("gpu", "cpu"):
        raise RatelConfigError(f"accelerator must be 'gpu' or 'cpu', got {accelerator!r}")
    return _estimate(model, optimizer, config, half, ranks, accumulate_grad_batches, unified=accelerator == "cpu")


def _estimate(module: nn.Module, optimizer: torch.optim.Optimizer, config: RatelConfig,
              half_dtype: torch.dtype | None, ranks: int = 1, accumulate: int = 1, unified: bool = False,
              automatic: bool = True, ranks_on_node: int | None = None) -> Estimate:
    layout = build_layout(module, discover_blocks(module, config.blocks), optimizer, half_dtype, config.param_cache,
                          config.host_memory_limit, meta_empty, announce=False,
                          optimizer_states=config.states_request, read_ahead=config.read_ahead_sets)
    on_store = layout.param_cache == "ssd"
    disk = sum(state_bytes(s.numel) for s in layout.shards if s.state_tier == "ssd")
    # With the compute copies in the swap files, the ranks of the node read those in their owners' files (NodeCopies),
    # but for fp32 masters held in host memory: every other rank keeps a copy of those in its own (StoredCopies).
    stored = [s for s in layout.shards if not NodeCopies.in_swap_files(s)] if on_store else []
    if on_store:
        disk += sum(s.numel * s.dtype.itemsize for s in layout.all_shards if s.dtype != torch.float32 or s.group < 0)
        disk += (ranks - 1) * sum(s.numel * 4 for s in stored)
    checkpoint_format = choose_checkpoint_format(config.checkpoint_format, module, optimizer,
                                                 config.host_memory_limit)
    if checkpoint_format == "full":
        checkpoint = gathered_checkpoint_bytes(module, optimizer) + _buffer_bytes(module)
    else:
        frozen = 0 if config.pretrained is not None else sum(s.numel * s.dtype.itemsize for s in layout.frozen_shards)
        checkpoint = sum(12 * s.numel for s in layout.shards) + frozen
    largest_unit = max((u.nbytes for u in layout.units.values()), default=0)
    estimate = Estimate(
        parameters=sum(s.numel for s in layout.slots),
        trainable=sum(s.numel for s in layout.shards),
        param_cache=layout.param_cache,
        checkpoint_format=checkpoint_format,
        disk=disk,
        host_cache=sum(u.host_nbytes for u in layout.units.values()),
        host_states=sum(state_bytes(s.numel) for s in layout.shards if s.state_tier == "host"),
        optimizer_buffers=_buffer_sets_bytes(layout, ranks_on_node or ranks),
        gradient_buffers=GRAD_BUDGET_SHARDS * max((s.numel for s in layout.shards), default=0) * 4,
        device=(config.prefetch_depth + 1) * largest_unit,
        checkpoint=checkpoint,
        read_ahead_sets=layout.read_ahead_sets,
    )
    if ranks < 2:
        return estimate
    window = exchange_window_nbytes(layout.shards)
    budget = config.host_memory_limit
    if budget is None and config.gradient_exchange == "auto":
        budget = available_host_memory() // ranks
    # The buffers the published compute copies pass through, held whichever exchange runs.
    copies = StoredCopies.buffer_nbytes(stored)
    # The bytes the budget check counts for a rank, without the exchange.
    held = estimate.host + (estimate.device if unified else 0) + copies
    choice = choose_exchange(config.gradient_exchange, accumulate, ranks, held, window, budget, automatic=automatic,
                             gpu=not unified, device_states=config.states_request == "device")
    buckets = exchange_micro_batch_nbytes(layout.shards)
    # Reducing on the device, the buckets are device memory (the owner's copies of them are staged in host memory as
    # offloaded gradients are).
    nbytes = {"window": window, "micro_batch": buckets}.get(choice.mode, 0)
    device = estimate.device + (buckets if choice.mode == "device" else 0)
    return replace(estimate, exchange_buffers=nbytes + copies, exchange=choice, device=device)


def _buffer_sets_bytes(layout: Layout, ranks_on_node: int = 1) -> int:
    """The CPU AdamW's buffer sets of one process of ``ranks_on_node`` on a node (as
    :class:`~lightning_ratel.runtime.optimizer.CpuAdam` allocates them, sized for the largest shard): its part of the
    pipeline's (:func:`~lightning_ratel.engine.layout.buffer_sets`) and those planned to read ahead."""
    needs = set_needs(layout.shards, layout)
    depth = buffer_sets(ranks_on_node) + layout.read_ahead_sets
    return sum(map(set_bytes, set_capacities(needs, depth))) if needs else 0


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.dtype.itemsize for b in module.buffers())


def _config_of(folder: str) -> Any:
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise RatelConfigError(f"{folder!r} is not a Hugging Face checkpoint folder: it has no config.json")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def _from_config(config: Any) -> nn.Module:
    """The transformers model of ``config`` (its first ``architectures`` entry, else a causal LM) on the meta
    device."""
    import transformers

    if not isinstance(config, transformers.PretrainedConfig):
        raise RatelConfigError(
            f"estimate() takes a module, a transformers config or a checkpoint folder, got {type(config).__name__}")
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(config)



def check_host_budget(module: nn.Module, optimizer: torch.optim.Optimizer, config: RatelConfig,
                      half_dtype: torch.dtype | None, unified: bool, ranks: int = 1, accumulate: int = 1,
                      automatic: bool = True, ranks_on_node: int | None = None) -> Estimate | None:
    """Refuse a ``host_memory_limit`` that the run's own buffers exceed, before any of them is allocated; with several
    ranks, plan their gradient exchange on the way.

    Args:
        module: the model, on any device.
        optimizer: the user's optimizer.
        config: the strategy's settings.
        half_dtype: the 16-bit dtype of mixed precision, ``None`` for fp32.
        unified: device and host are one memory (a CPU run): the device's parameters count too.
        ranks: the ranks training data parallel (see :func:`estimate`).
        accumulate: the Trainer's ``accumulate_grad_batches``.
        automatic: Lightning's automatic optimization (see :func:`~lightning_ratel.plan.exchange.choose_exchange`).
        ranks_on_node: of those, the ranks on each node, which split one process's optimizer buffer sets (``None``:
            all of them).

    Returns:
        The estimate the check used (its ``exchange`` the plan of several ranks); ``None`` where one rank had no limit
        to check.

    Raises:
        RatelPlanError: the buffers need more than ``host_memory_limit``.
    """
    limit = config.host_memory_limit
    if limit is None and ranks < 2:
        return None
    need = _estimate(module, optimizer, config, half_dtype, ranks, accumulate, unified, automatic, ranks_on_node)
    total = need.host + (need.device if unified else 0)
    if limit is None or total <= limit:
        return need
    fixes = ["raise host_memory_limit"]
    if need.host_states:
        fixes.append("use optimizer_states='ssd' (optimizer states in the swap files)")
    if need.param_cache == "host":
        fixes.append("use param_cache='ssd' (compute copies read from the swap files)")
    if need.exchange is not None and need.exchange.mode == "window":
        fixes.append("use gradient_exchange='micro_batch' (no gradient window on each rank)")
    raise RatelPlanError(
        f"RatelStrategy: host_memory_limit ({format_bytes(limit)}) is less than the {format_bytes(total)} the run's "
        f"own buffers take before any activation ({need._host_parts()}"
        + (f", parameters in flight {format_bytes(need.device)}" if unified else "") + f"): {' or '.join(fixes)}.")
