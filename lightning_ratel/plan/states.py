"""Where each shard's optimizer states live: host memory while the budget holds them, the swap files for the rest.

Every update reads a shard's fp32 master and moments and writes them back, so each byte kept in host memory is a byte
the drives do not move twice a step. Which bytes matter most is set by the step's order: backward finishes the first
blocks last, and the next forward needs them first, so their updates are the ones nothing overlaps. Shards are
therefore placed in forward order, each in host memory if it still fits the budget (a later, smaller one may fit
where a larger one did not).

A shard kept in host memory holds both of its state slots there (the committed step and the one being written), so it
takes twice its states' bytes. Pure arithmetic: the layout calls it with the shards' sizes and the budget.

The CPU optimizer's buffer sets compete for the same budget (:func:`read_ahead_sets`). Between the start of the
boundary micro-batch and the updates, the drives read page-ins and the states of as many shards as there are free sets
(in the order last step's updates ran); the rest of that time they idle: the forward where updates overlap backward,
the backward where they wait for its end (a CPU run's usual case, whose forward then runs the updates). A set moves
one shard's reads into that idle time, and where the master is the compute copy a page-in reads (fp32 with compute
copies on the store) the page-in copies it from the set instead of reading it again. A shard kept in host memory saves
its master and moments read *and* written every step (as many bytes as its two slots take), and the page-ins of its
master too, whether the drives idle or not: per byte at least what a set saves unless the set's master saves a
page-in and the idle time takes all its reads. Without the idle time known (the layout plans before any step ran),
the host tier is filled first, and sets beyond the pipeline's few are bought with what the host tier cannot use (a
remainder smaller than the next shard's states), as far as they can still read ahead a shard kept in the swap files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.sizes import format_bytes
from lightning_ratel.tiers import OPTIMIZER_STATES, StateTier

STATE_SLOTS = 2
"""State slots per shard: the committed step's and the one an update writes."""
HOST_SHARE = 0.75
"""Of a host budget the run was not given (the memory the kernel can hand out), the share states may take in
``"auto"``: the rest is for activations kept in host memory, staging buffers, the data loader and the page cache."""


def state_bytes(numel: int, record_bytes: int | None = None) -> int:
    """Host bytes one shard's states take in host memory: both slots of its fp32 master and of its moments (AdamW)
    or of its state record (``record_bytes``, another optimizer)."""
    per_slot = 4 * numel + (8 * numel if record_bytes is None else record_bytes)
    return STATE_SLOTS * per_slot


DEVICE_SHARE = 0.5
"""Of the device memory a run may use, the share ``"auto"`` may give the device tier: the layout is made before the
first step, so the activations the plan keeps on the device, the blocks in flight and the allocator's fragmentation
are not known yet; the rest is theirs."""


def device_states_budget(device_memory: int | None, in_flight: int) -> int:
    """Device bytes ``"auto"`` may give the device tier: :data:`DEVICE_SHARE` of ``device_memory`` (the run's
    device budget, ``None``: none known, so nothing) less ``in_flight`` (the pager's blocks in flight)."""
    if device_memory is None:
        return 0
    return max(0, int(device_memory * DEVICE_SHARE) - in_flight)


def device_bytes(numel: int) -> int:
    """Device bytes one shard takes on the device tier: both slots of its master and moments, and the fp32 sum of
    its gradients kept there."""
    return state_bytes(numel) + 4 * numel


def on_device(shard_bytes: Sequence[int], units: Sequence[int], unit_bytes: Mapping[int, int],
              budget: int, first: int | None = None) -> list[bool]:
    """Which shards ``"auto"`` puts on the device tier: whole units, so that a unit's compute copy stays resident on
    the device and nothing of it crosses the link; ``first`` before the others where it fits, then the cheapest
    first (fewest device bytes), while ``budget`` holds them.

    ``first`` is the unit the next forward needs first (the embedding): backward hands its gradients over last, so
    beside a GPU the step's last CPU update is its, and the next forward waits for it whole (with its states on
    disk, for their reads and writes too); updated on the device, it is ready at once.

    Per byte the small units (a final norm, the embeddings and head of a small model) save the most: each shard on the
    CPU pays a fixed cost per step whatever its size (a job for the optimizer's worker, its gradient's copy to host
    memory, a write-back, the wait of the next forward for its update, the page-ins of its unit), which the device
    tier replaces by a share of a few kernels on the training thread.

    Args:
        shard_bytes: device bytes of each shard's states and gradient sum (:func:`device_bytes`).
        units: the unit of each shard.
        unit_bytes: device bytes of each unit's compute copies.
        budget: device bytes the device tier may take.
        first: the unit the next forward waits for first (``None``, or not one of ``units``: none of them).
    """
    cost = dict.fromkeys(units, 0)
    for size, unit in zip(shard_bytes, units):
        cost[unit] += size
    for unit in cost:
        cost[unit] += unit_bytes[unit]
    chosen: set[int] = set()
    left = budget
    if first in cost and cost[first] <= left:
        chosen.add(first)
        left -= cost[first]
    for unit in sorted(cost, key=lambda u: (cost[u], u)):
        if unit in chosen:
            continue
        if cost[unit] > left:
            break
        chosen.add(unit)
        left -= cost[unit]
    return [unit in chosen for unit in units]


def place_states(sizes: Sequence[int], requested: str, budget: int | None,
                 device: Sequence[bool] | None = None) -> list[StateTier]:
    """The tier of each shard's states.

    Args:
        sizes: host bytes of each shard's states (:func:`state_bytes`), in forward order.
        requested: ``"device"``, ``"host"``, ``"ssd"`` or ``"auto"`` (the device for the shards ``device`` names,
            then host memory while ``budget`` holds them, in forward order).
        budget: host bytes the states may take in ``"auto"``; ``None``: unlimited.
        device: with ``"auto"``, the shards placed on the device (:func:`on_device`); ``None``: none.

    Raises:
        RatelConfigError: ``requested`` is not one of :data:`~lightning_ratel.tiers.OPTIMIZER_STATES`.
    """
    if requested not in OPTIMIZER_STATES:
        raise RatelConfigError(f"`optimizer_states` must be one of {OPTIMIZER_STATES}, got {requested!r}")
    if requested != "auto":
        return [requested] * len(sizes)  # type: ignore[list-item]
    chosen = device if device is not None else [False] * len(sizes)
    left = budget if budget is not None else sum(sizes)
    tiers: list[StateTier] = []
    for size, here in zip(sizes, chosen):
        if here:
            tiers.append("device")
        elif size <= left:
            tiers.append("host")
            left -= size
        else:
            tiers.append("ssd")
    return tiers


def check_device_fit(needed: int, budget: int | None) -> None:
    """Refuse ``optimizer_states="device"`` where the device budget cannot hold what it keeps there.

    Args:
        needed: device bytes of every shard's states and gradient sum and every unit's compute copy.
        budget: device bytes the run may use (``device_memory_limit``, or the device's free memory), less what the
            pager and activations need; ``None``: unknown (the CPU without a limit: the host memory is the device's).

    Raises:
        RatelConfigError: it does not fit, with the figures and what to change.
    """
    if budget is not None and needed > budget:
        raise RatelConfigError(
            f"optimizer_states='device' keeps {format_bytes(needed)} on the device (optimizer states in both slots, "
            f"fp32 gradient sums and every compute copy), more than the {format_bytes(max(0, budget))} its budget "
            "leaves after the blocks in flight and activations: give optimizer_states='auto' (the device tier for "
            "what fits, the host memory or the swap files for the rest), or raise device_memory_limit")


def describe(sizes: Sequence[int], tiers: Sequence[StateTier]) -> str:
    """One line on where the states went, for the run's log."""
    device = sum(s for s, t in zip(sizes, tiers) if t == "device")
    host = sum(s for s, t in zip(sizes, tiers) if t == "host")
    disk = sum(s for s, t in zip(sizes, tiers) if t == "ssd") // STATE_SLOTS
    parts = []
    if device:
        parts.append(f"{format_bytes(device)} on the device ({tiers.count('device')} shards, both slots, updated "
                     "there)")
    if host:
        parts.append(f"{format_bytes(host)} in host memory ({tiers.count('host')} shards, both slots)")
    if disk:
        parts.append(f"{format_bytes(disk)} per slot in the swap files ({tiers.count('ssd')} shards)")
    return "optimizer states: " + (", ".join(parts) if parts else "none")


def read_ahead_sets(tiers: Sequence[StateTier], sizes: Sequence[int], budget: int | None, set_bytes: int,
                    base_sets: float) -> int:
    """The optimizer's buffer sets beyond the pipeline's ``base_sets`` (reading ahead, updating, writing back): one
    for each ``set_bytes`` of the states' budget the host tier left unused, as long as the sets together do not
    outnumber the shards whose states are in the swap files (a set beyond those has nothing to read ahead). See the
    module's notes for why the host tier comes first.

    Args:
        tiers: each shard's tier (:func:`place_states`).
        sizes: host bytes of each shard's states in host memory (:func:`state_bytes`), as ``tiers``.
        budget: host bytes the states may take; ``None``: no bound was given, and no set is added.
        set_bytes: host bytes of one buffer set (holding the largest shard in the swap files).
        base_sets: the sets every run keeps (a rank of several on a node: its share of them).
    """
    on_disk = sum(1 for tier in tiers if tier == "ssd")
    if budget is None or set_bytes <= 0:
        return 0
    left = budget - sum(size for size, tier in zip(sizes, tiers) if tier == "host")
    return max(0, min(left // set_bytes, math.floor(on_disk - base_sets)))
