"""How a model's parameters are laid out for paging and for the CPU optimizer: units, shards and the dtype policy.

Each parameter belongs to the first block that uses it (tied weights are owned once, shared by reference). The
parameters of one block form a *unit*, one flat tensor per compute dtype; the parameters of a unit that share an
optimizer parameter group and a compute dtype form a *shard*, the grain of the optimizer's state I/O and updates
(:mod:`lightning_ratel.runtime.units`).

The compute dtype follows mixed precision: a parameter that autocast would cast to 16-bit anyway (a linear or
convolution weight) is stored in 16-bit, bit-identical at half the bytes; everything else keeps its own dtype, so
results match Lightning's own mixed precision exactly.

Parameters outside the optimizer (frozen: ``requires_grad=False`` or in no parameter group) form *frozen shards*:
they have no fp32 master and no moments, only their compute copy (in the host cache, or on the store with
``param_cache="ssd"``), which nothing writes after the first time. That copy is their exact value when the dtype policy
kept their dtype, and also when a 16-bit copy represents every value exactly (weights loaded from a bf16 checkpoint
are, whatever dtype the module holds them in). Only where rounding to the compute dtype would change a value does the
shard keep its values in their own dtype on the store as well (:class:`FrozenValues`), so that what the module gets
back, what checkpoints hold and what an export writes are the values it started with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_ratel.engine.blocks import Block
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.plan.states import (
    HOST_SHARE,
    check_device_fit,
    describe,
    device_bytes,
    device_states_budget,
    on_device,
    place_states,
    read_ahead_sets,
    state_bytes,
)
from lightning_ratel.runtime.generic import GenericUpdate, OptimizerStateError, ParamStates, probe_states, rebuild
from lightning_ratel.runtime.hostmem import ALIGNMENT
from lightning_ratel.runtime.probe import available_host_memory
from lightning_ratel.runtime.state_buffers import BUFFER_SETS, Need, in_place, set_bytes, set_capacities, shard_need
from lightning_ratel.runtime.units import Layout, ParamSlot, Shard, ShardParam, Unit
from lightning_ratel.sizes import format_bytes, round_up
from lightning_ratel.tiers import OptimizerStates, ParamCache

FUSED_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam)
"""Optimizers the native fused AdamW kernel runs (exactly these classes: a subclass may change the step)."""
_NOT_FUSED_FLAGS = ("amsgrad", "maximize", "differentiable", "capturable")
_WHOLE_MODEL_OPTIMIZERS = {
    torch.optim.LBFGS: "its step re-evaluates the loss through a closure and keeps one state for all its parameters",
}
"""Optimizers known to need every parameter at once; others are checked by :func:`_reads_other_parameters`."""
HostAllocator = Callable[[int, torch.dtype], torch.Tensor]


def meta_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A :data:`HostAllocator` that allocates nothing (the meta device): a layout laid out to be measured, not run."""
    return torch.empty(numel, dtype=dtype, device="meta")


def fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the native fused AdamW kernel runs ``optimizer``: exactly ``torch.optim.AdamW`` or ``torch.optim.Adam``
    with none of the flags it does not implement (``amsgrad``, ``maximize``...)."""
    return type(optimizer) in FUSED_OPTIMIZERS and not any(
        group.get(flag) for group in optimizer.param_groups for flag in _NOT_FUSED_FLAGS)


def optimizer_groups(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[int, tuple[int, int]]:
    """Map parameter id -> (group index, index in the optimizer's ``state_dict`` order).

    Raises:
        RatelConfigError: the optimizer's step needs every parameter at once (see :func:`check_per_parameter`), or it
            holds a parameter that is not the module's.
    """
    if optimizer is None:
        return {}
    if not fused(optimizer):
        check_per_parameter(optimizer)
    model_params = {id(p) for p in module.parameters()}
    mapping: dict[int, tuple[int, int]] = {}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in model_params:
                raise RatelConfigError("the optimizer holds a parameter that is not part of the LightningModule")
            mapping[id(p)] = (g, index)
            index += 1
    return mapping


def check_per_parameter(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose step cannot run shard by shard.

    RatelStrategy updates each shard as soon as its gradients are in, with the optimizer's own ``step`` over that
    shard's parameters alone. That gives plain training's numbers only if the update of a parameter reads nothing but
    its own value, gradient and state. Known whole-model optimizers (LBFGS) are refused by name; any other is stepped
    twice in each of its groups on two small parameters together and on each alone, and refused where the results
    differ, where its step fails without a closure, or where it keeps state under anything but its parameters.

    Raises:
        RatelConfigError: with the reason, before training.
    """
    name = type(optimizer).__name__
    reason = next((why for kind, why in _WHOLE_MODEL_OPTIMIZERS.items() if isinstance(optimizer, kind)), None)
    for settings in ([] if reason is not None else optimizer.param_groups):
        reason = _reads_other_parameters(optimizer, {k: v for k, v in settings.items() if k != "params"})
        if reason is not None:
            break
    if reason is not None:
        raise RatelConfigError(
            f"RatelStrategy runs the optimizer shard by shard on the CPU while backward runs, so the update of a "
            f"parameter may read only that parameter's value, gradient and state; {name} cannot run that way: "
            f"{reason}. Use an optimizer whose step is per parameter (torch.optim's SGD, Adam, AdamW, Adagrad, "
            f"RMSprop, NAdam, RAdam..., transformers' Adafactor), or train with another strategy.")


def _reads_other_parameters(optimizer: torch.optim.Optimizer, settings: dict[str, Any]) -> str | None:
    """Why ``optimizer``'s step in a group with ``settings`` is not per parameter, or ``None`` when it is."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((3, 5), (7,))
    starts = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]

    def run(which: Sequence[int]) -> list[torch.Tensor]:
        params = [starts[i].clone() for i in which]
        try:
            opt = rebuild(type(optimizer), dict(optimizer.defaults), settings, params)
        except Exception as err:  # noqa: BLE001 - reported as the reason
            raise _NotPerParameter(f"it cannot be built again from its `defaults` and one parameter group, as the "
                                   f"CPU optimizer builds it for each shard ({type(err).__name__}: {err})") from err
        for step_grads in grads:
            for p, i in zip(params, which):
                p.grad = step_grads[i].clone()
            opt.step()
        if any(all(key is not p for p in params) for key in opt.state):
            raise _NotPerParameter("it keeps state under something other than its parameters")
        return params

    try:
        together = run((0, 1))
        alone = run((0,)) + run((1,))
    except _NotPerParameter as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - any failure of a bare step is the reason to report
        return f"its step fails on a parameter group of its own without a closure ({type(err).__name__}: {err})"
    if not all(torch.equal(a, b) for a, b in zip(together, alone)):
        return "the update of one parameter changes with the other parameters of its group"
    return None


class _NotPerParameter(Exception):
    pass


def generic_update(optimizer: torch.optim.Optimizer, shards: Sequence[Shard]) -> GenericUpdate:
    """The update of ``shards`` by an optimizer the fused kernel does not run, with its state layout probed once per
    group and parameter shape (see :func:`~lightning_ratel.runtime.generic.probe_states`).

    Raises:
        RatelConfigError: its state holds something that cannot be paged.
    """
    layouts: dict[tuple[int, tuple[int, ...]], ParamStates] = {}
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for shard in shards:
        for sp in shard.params:
            key = (shard.group, tuple(sp.shape))
            if key not in layouts:
                try:
                    layouts[key] = probe_states(type(optimizer), dict(optimizer.defaults), settings[shard.group],
                                                key[1])
                except OptimizerStateError as err:
                    raise RatelConfigError(f"RatelStrategy cannot page the state of {type(optimizer).__name__}: "
                                           f"{err}") from err
    return GenericUpdate(optimizer, shards, layouts)


def _autocast_only(modules: list[nn.Module]) -> bool:
    """Whether every module using a parameter feeds it only to ops that autocast runs in 16-bit."""
    linear_like = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return bool(modules) and all(isinstance(m, linear_like) or type(m).__name__ == "Conv1D" for m in modules)


def build_layout(
    module: nn.Module,
    blocks: Sequence[Block],
    optimizer: torch.optim.Optimizer | None,
    half_dtype: torch.dtype | None,
    param_cache: ParamCache,
    host_memory_limit: int | None,
    host_empty: HostAllocator,
    announce: bool = True,
    optimizer_states: OptimizerStates = "auto",
    read_ahead: int | None = None,
    device_empty: HostAllocator | None = None,
    device_memory: int | None = None,
    prefetch_depth: int = 1,
) -> Layout:
    """Lay out ``module``'s parameters.

    Args:
        module: the model.
        blocks: its blocks, covering every parameter.
        optimizer: the user's optimizer when fitting; ``None`` for evaluation (no shards, compute copies in host
            memory).
        half_dtype: the 16-bit dtype of mixed precision, ``None`` for fp32.
        param_cache: the requested place of the compute copies (``"auto"`` resolved here).
        host_memory_limit: the run's host memory budget, for ``"auto"``.
        host_empty: allocates host-cache memory (pinned on CUDA).
        announce: say so when ``"auto"`` chooses ``"ssd"``, and where the optimizer states went (not for an
            estimate).
        optimizer_states: where the shards' optimizer states live: ``"host"``, ``"ssd"``, or ``"auto"`` (host
            memory while :func:`states_budget` holds them, see :func:`~lightning_ratel.plan.states.place_states`).
        read_ahead: the CPU optimizer's buffer sets beyond the pipeline's, as the user fixed them; ``None``: planned
            (see :func:`with_state_tiers`).
        device_empty: allocates device memory, for the compute copies of units whose states are on the device
            tier; ``None``: the host cache's allocator.
        device_memory: device bytes the run may use (``device_memory_limit``, or a GPU's free memory); ``None``:
            unknown (the CPU without a limit), so ``"auto"`` puts nothing on the device tier and ``"device"`` is not
            checked.
        prefetch_depth: blocks the pager prefetches (their compute copies take device memory beside the tier's).

    Raises:
        RatelConfigError: a parameter is not floating point, the optimizer cannot be run (see
            :func:`optimizer_groups`, :func:`generic_update`), or ``optimizer_states="device"`` was asked of an
            optimizer the device tier does not run, or of a device it does not fit.
    """
    groups = optimizer_groups(module, optimizer)
    names = {id(p): n for n, p in module.named_parameters()}
    orig_dtype = {id(p): p.dtype for _, p in module.named_parameters()}
    users: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
            users.setdefault(id(p), []).append(m)

    def compute_dtype(p: nn.Parameter) -> torch.dtype:
        if not p.is_floating_point():
            raise RatelConfigError(f"parameter {names[id(p)]} is not floating point ({p.dtype})")
        if half_dtype is not None and _autocast_only(users.get(id(p), [])):
            return half_dtype
        return p.dtype

    def group_of(p: nn.Parameter) -> int:
        # A parameter that needs no gradient is never updated, even when the optimizer holds it (AdamW skips it).
        return groups[id(p)][0] if id(p) in groups and p.requires_grad else -1

    owner: dict[int, int] = {}
    owned: dict[int, list[nn.Parameter]] = {}
    for block in blocks:
        for p in block.uses:
            if id(p) not in owner:
                owner[id(p)] = block.index
                owned.setdefault(block.index, []).append(p)
    dtype_rank: dict[torch.dtype, int] = {}
    unit_slots: dict[int, tuple[list[ParamSlot], dict[torch.dtype, int]]] = {}
    for b, params in owned.items():
        dtypes = {id(p): compute_dtype(p) for p in params}
        for d in dtypes.values():
            dtype_rank.setdefault(d, len(dtype_rank))
        # Sorted so that each (dtype, group) is one contiguous range: one shard, one kernel call, one output.
        order = sorted(range(len(params)),
                       key=lambda i: (dtype_rank[dtypes[id(params[i])]], group_of(params[i]) % (1 << 30), i))
        offsets: dict[torch.dtype, int] = {}
        slots = []
        run = None
        for i in order:
            p = params[i]
            d = dtypes[id(p)]
            start = offsets.get(d, 0)
            if (d, group_of(p)) != run:
                # Each shard starts on a 4096-byte boundary, so the store reads it straight into the flat buffer.
                run = (d, group_of(p))
                start = round_up(start * d.itemsize, ALIGNMENT) // d.itemsize
            slots.append(ParamSlot(names[id(p)], p, d, start, p.numel(), p.shape))
            offsets[d] = start + p.numel()
        unit_slots[b] = (slots, offsets)

    compute_bytes = sum(n * d.itemsize for _, numels in unit_slots.values() for d, n in numels.items())
    # An optimizer that holds no parameter (Lightning's placeholder where `configure_optimizers` returns None) leaves
    # no state to place: such a run lays out as on the other tiers, as plain Lightning trains it without updates.
    updates = optimizer is not None and any(group["params"] for group in optimizer.param_groups)
    on_device = updates and optimizer_states == "device"
    if on_device and not fused(optimizer):
        raise RatelConfigError(
            f"optimizer_states='device' updates on the device with torch's AdamW, so it runs torch.optim.AdamW or "
            f"Adam (without amsgrad, maximize...) only, not {type(optimizer).__name__}: give optimizer_states='auto', "
            "'host' or 'ssd'")
    # Every compute copy is resident on the device: none is read from the swap files.
    cache = "host" if on_device else resolve_param_cache(param_cache, optimizer is not None, compute_bytes,
                                                         host_memory_limit, announce)
    # With every state on the device, every compute copy is resident there from the start.
    cache_empty = (device_empty or host_empty) if on_device else host_empty
    units = {
        b: Unit(b, tuple(slots), numels,
                host={d: cache_empty(n, d) for d, n in numels.items()} if cache == "host" else {},
                resident=on_device)
        for b, (slots, numels) in unit_slots.items()
    }
    shards: list[Shard] = []
    frozen: list[Shard] = []
    if optimizer is not None:
        for unit in units.values():
            runs: dict[tuple[torch.dtype, int], list[ParamSlot]] = {}
            for slot in unit.slots:
                runs.setdefault((slot.dtype, group_of(slot.param)), []).append(slot)
            for (dtype, g), slots in runs.items():
                params = []
                offset = 0
                for slot in slots:
                    index = groups[id(slot.param)][1] if g >= 0 else -1
                    params.append(ShardParam(slot.name, slot.param, index, offset, slot.numel, slot.shape))
                    offset += slot.numel
                shard = Shard(len(shards) + len(frozen), unit, g, dtype, slots[0].offset, tuple(params), offset,
                              master_in_host=cache == "host" and dtype == torch.float32)
                (shards if g >= 0 else frozen).append(shard)
    block_units = tuple(tuple(sorted({owner[id(p)] for p in block.uses})) for block in blocks)
    generic = generic_update(optimizer, shards) if optimizer is not None and not fused(optimizer) else None
    layout = Layout(units, block_units, shards, frozen, cache, orig_dtype, generic=generic)
    if on_device:
        check_device_fit(sum(device_bytes(s.numel) for s in shards) + compute_bytes, device_memory)
    # "auto" gives the device tier what its share of the device holds beside the pager's blocks in flight, where
    # the compute copies are in host memory (a unit read from the swap files has no cache for its shards' copies).
    in_flight = (prefetch_depth + 2) * max((u.nbytes for u in units.values()), default=0)
    auto_device = (device_states_budget(device_memory, in_flight)
                   if optimizer is not None and cache == "host" and generic is None else 0)
    layout = with_state_tiers(layout, optimizer_states, host_memory_limit, announce=announce, read_ahead=read_ahead,
                              device_budget=auto_device)
    return resident_units(layout, device_empty or host_empty, every_unit=on_device)


def resident_units(layout: Layout, device_empty: HostAllocator, every_unit: bool = False) -> Layout:
    """``layout`` with the compute copies of each unit whose shards are on the device tier (every unit, with
    ``every_unit``) moved to device memory, where the pager binds them without a copy; a device-tier shard's master is
    never its compute copy (its states have slots of their own on the device)."""
    resident = {s.unit.index for s in layout.shards if s.state_tier == "device"}
    if not resident:
        return layout
    if every_unit:
        resident = set(layout.units)
    # The device tier's update writes the unit's compute copy on the device, so a unit is on it whole.
    assert all(s.state_tier == "device" for s in layout.shards if s.unit.index in resident)
    units = {
        b: dataclasses.replace(unit, host={d: device_empty(n, d) for d, n in unit.numels.items()}, resident=True)
        if b in resident and not unit.resident else unit
        for b, unit in layout.units.items()
    }

    def moved(shard: Shard) -> Shard:
        return dataclasses.replace(shard, unit=units[shard.unit.index],
                                   master_in_host=shard.master_in_host and shard.state_tier != "device")

    return dataclasses.replace(layout, units=units, shards=[moved(s) for s in layout.shards],
                               frozen_shards=[moved(s) for s in layout.frozen_shards])


def with_state_tiers(layout: Layout, requested: OptimizerStates, host_memory_limit: int | None,
                     owned: set[int] | None = None, ranks_on_node: int = 1, announce: bool = True,
                     cache_shared: bool = False, read_ahead: int | None = None, device_budget: int = 0) -> Layout:
    """``layout`` with the optimizer states of its shards placed (:func:`~lightning_ratel.plan.states.place_states`)
    and the CPU optimizer's buffer sets beyond the pipeline's planned with them
    (:func:`~lightning_ratel.plan.states.read_ahead_sets`).

    Args:
        layout: the layout.
        requested: ``"host"``, ``"ssd"`` or ``"auto"``.
        host_memory_limit: this process's host budget; ``None``: its share of what the kernel can hand out.
        owned: the shards whose states this process holds (data parallel: the units its rank owns); ``None``: all.
            The others' states are another rank's, and stay ``"ssd"`` here.
        ranks_on_node: processes sharing the node's memory (data parallel), each with its share of it.
        announce: say where they went.
        cache_shared: the node's processes share one host cache of compute copies, each holding its share of it.
        read_ahead: buffer sets beyond the pipeline's, as the user fixed them; ``None``: planned.
        device_budget: device bytes ``"auto"`` may give the device tier (whole units: their shards' states,
            gradient sums and compute copies; see :func:`~lightning_ratel.plan.states.on_device`).
    """
    mine = [s for s in layout.shards if owned is None or s.index in owned]
    if not mine:
        return layout
    generic = layout.generic
    sizes = [state_bytes(s.numel, generic.nbytes(s) if generic is not None else None) for s in mine]
    compute = sum(u.nbytes for u in layout.units.values()) if layout.param_cache == "host" else 0
    if cache_shared:
        compute //= ranks_on_node
    base = buffer_sets(ranks_on_node)
    per_param = SET_BYTES_PER_PARAM * max(1.0, base) + GRADIENT_BYTES_PER_PARAM
    held = compute + int(per_param * max(s.numel for s in mine))
    budget = states_budget(host_memory_limit, held, ranks_on_node)
    # Units are numbered in block order, the order forward first runs them in (until a pass teaches another).
    first = min((s.unit.index for s in layout.shards), default=None)
    chosen = (on_device([device_bytes(s.numel) for s in mine], [s.unit.index for s in mine],
                        {b: u.nbytes for b, u in layout.units.items()}, device_budget, first)
              if requested == "auto" and device_budget > 0 else None)
    placed = place_states(sizes, requested, budget, chosen)
    tiers = dict(zip((s.index for s in mine), placed))
    shards = [dataclasses.replace(s, state_tier=tiers.get(s.index, "ssd")) for s in layout.shards]
    if read_ahead is None:
        # The pipeline's sets are already in ``held``; more come out of what the host tier left of the budget.
        mine_placed = [s for s in shards if owned is None or s.index in owned]
        read_ahead = read_ahead_sets(placed, sizes, budget, _whole_set_bytes(mine_placed, layout), base)
    if announce:
        extra = f"; {read_ahead} more optimizer buffer sets to read states ahead of their updates" if read_ahead else ""
        rank_zero_info(f"RatelStrategy: {describe(sizes, placed)}{extra}.")
    return dataclasses.replace(layout, shards=shards, read_ahead_sets=read_ahead)


def set_needs(shards: Sequence[Shard], layout: Layout) -> list[Need]:
    """What the update of each of ``shards`` that runs outside host memory (and off the device tier) takes of a CPU
    optimizer buffer set (see
    :func:`~lightning_ratel.runtime.state_buffers.shard_need`)."""
    on_store = layout.param_cache == "ssd"
    return [shard_need(s, on_store, layout.generic) for s in shards
            if not in_place(s, on_store) and s.state_tier != "device"]


def _whole_set_bytes(shards: Sequence[Shard], layout: Layout) -> int:
    """Host bytes of one CPU optimizer buffer set holding any of ``shards`` that updates outside host memory."""
    needs = set_needs(shards, layout)
    return set_bytes(set_capacities(needs, 1)[0]) if needs else 0


SET_BYTES_PER_PARAM = 16
"""Host bytes per element of the largest shard in one of the CPU optimizer's buffer sets: master, moments and a compute
copy."""
GRADIENT_BYTES_PER_PARAM = 16
"""Host bytes per element of the largest shard that the CPU optimizer's gradient buffers may take: four, of 4 bytes."""


def buffer_sets(ranks_on_node: int) -> float:
    """The CPU optimizer's buffer sets of each of ``ranks_on_node`` data-parallel processes of a node, in sets that hold
    its largest shard (:class:`~lightning_ratel.runtime.optimizer.CpuAdam`'s ``depth``): together one process's
    (:data:`~lightning_ratel.runtime.state_buffers.BUFFER_SETS`), so the node holds them once, not once per rank. Each
    rank's updates, and its reads ahead and write-backs, then overlap less within the rank; the node's drives and cores,
    shared by the ranks, see about as many in flight as one process keeps. Below one set the optimizer keeps one all
    the same."""
    return BUFFER_SETS / ranks_on_node


def states_budget(host_memory_limit: int | None, held: int, ranks_on_node: int = 1) -> int:
    """Host bytes ``optimizer_states="auto"`` may give one process's optimizer states: a share of its host budget
    (``host_memory_limit``, or its part of the memory the kernel can hand out now when ``ranks_on_node`` processes
    share it) less what it holds anyway (``held``: the host cache of compute copies, the optimizer's buffers)."""
    budget = host_memory_limit if host_memory_limit is not None else available_host_memory() // ranks_on_node
    return max(0, int(budget * HOST_SHARE) - held)


def resolve_param_cache(requested: ParamCache, fitting: bool, compute_bytes: int,
                        host_memory_limit: int | None, announce: bool = True) -> ParamCache:
    """``"host"`` or ``"ssd"``: where the compute copies live between uses.

    ``"auto"`` reads them from the store when a host cache would take more than half of the host memory budget.
    Without an optimizer there is no swap store, so they stay in host memory.
    """
    if not fitting:
        return "host"
    if requested != "auto":
        return requested
    budget = host_memory_limit if host_memory_limit is not None else available_host_memory()
    if budget and compute_bytes > budget // 2:
        if not announce:
            return "ssd"
        what = "host_memory_limit" if host_memory_limit is not None else "the available host memory"
        rank_zero_info(
            f"RatelStrategy: the compute copies of the parameters ({format_bytes(compute_bytes)}) would take more "
            f"than half of {what} ({format_bytes(budget)}); they are read from the swap files on every use "
            "(param_cache='ssd')."
        )
        return "ssd"
    return "host"
