"""The step coordinator: builds the parts that train one model and wires them together.

The Lightning adapters call into :class:`RatelEngine` at a handful of points (setup, each micro-batch, backward, the
boundary optimizer step, checkpoints, teardown). Each job lives in a module of its own, and nothing below calls back
up here:

- :mod:`~lightning_ratel.engine.layout`: units, shards and the dtype policy;
- :mod:`~lightning_ratel.engine.materialize`: meta-device initialization and the first writes to the store;
- :mod:`~lightning_ratel.engine.schedule`: forward/backward block scheduling, which drives the pager and the cache;
- :mod:`~lightning_ratel.engine.planner`: profiling, planning and applying activation placement;
- :mod:`~lightning_ratel.io.checkpoint`: everything that reads or writes whole-model state;
- :mod:`~lightning_ratel.engine.accounting`: bytes held and the per-step time breakdown;
- :mod:`lightning_ratel.runtime`: the mechanisms (device streams, swap store, pager, activation cache, gradient
  offload, CPU AdamW).

One gradient's way: the post-accumulate-grad hook (:mod:`~lightning_ratel.runtime.gradients`) copies it to host memory
and hands it to :class:`~lightning_ratel.runtime.optimizer.CpuAdam`, whose worker updates the shard and writes the new
compute copy where the pager reads it, then completes the unit's :class:`~lightning_ratel.runtime.units.UnitReady`;
the next forward's pre-hook asks the pager for the block, which waits on that signal and pages the copy in.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_ratel.config import RatelConfig
from lightning_ratel.engine.accounting import ByteAccount, StepBreakdown
from lightning_ratel.engine.backward import BackwardCalls
from lightning_ratel.engine.blocks import Block, BlockMembership, discover_blocks
from lightning_ratel.engine.layout import buffer_sets, build_layout, fused, meta_empty, with_state_tiers
from lightning_ratel.engine.materialize import Materializer
from lightning_ratel.engine.placement import check_patterns
from lightning_ratel.engine.planner import Planner
from lightning_ratel.engine.reads import ParameterReads
from lightning_ratel.engine.schedule import BlockScheduler
from lightning_ratel.engine.switches import FitSwitches
from lightning_ratel.errors import RatelConfigError, RatelModelError
from lightning_ratel.io.checkpoint import ModelState
from lightning_ratel.io.sources import ValueSource
from lightning_ratel.plan.cost import updates_overlap
from lightning_ratel.plan.exchange import ExchangeChoice
from lightning_ratel.plan.owners import UnitCost, assign_owners
from lightning_ratel.plan.states import check_device_fit, device_bytes, device_states_budget
from lightning_ratel.runtime import gds
from lightning_ratel.runtime.activations import ActivationCache, PlaceholderRead
from lightning_ratel.runtime.adamw import GroupHyper
from lightning_ratel.runtime.buffers import BufferBroadcast
from lightning_ratel.runtime.collectives import (
    DataParallelAdam,
    Faults,
    NodeCache,
    NodeCopies,
    Ranks,
    SharedCacheUnavailable,
    SharedCopiesUnavailable,
    every_rank_agrees,
)
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.device_adam import DeviceAdam, DeviceStates, TieredAdam
from lightning_ratel.runtime.escapes import Escape, EscapeDetector
from lightning_ratel.runtime.generic import group_settings
from lightning_ratel.runtime.gradients import GradientOffload
from lightning_ratel.runtime.hostmem import ALIGNMENT
from lightning_ratel.runtime.hoststore import HostStore, TieredStore
from lightning_ratel.runtime.optimizer import CpuAdam, StepPlan
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.probe import available_cores, available_host_memory, free_device_memory
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.timeline import Timeline
from lightning_ratel.runtime.units import Layout, Shard

_FIXED_PARAMETERS = (
    "RatelStrategy lays out the optimizer's states (fp32 masters, moments) for the parameters the optimizer holds at "
    "setup and cannot add parameters during fit yet (fine-tuning callbacks such as BackboneFinetuning unfreeze a "
    "backbone and call `optimizer.add_param_group` between epochs). Train each stage in a fit of its own: fit with "
    "the backbone frozen, then fit again with it unfrozen (`configure_optimizers` then returns an optimizer holding "
    "both); or use another strategy for this callback."
)

GRAD_BUDGET_SHARDS = 4
"""Gradient bytes backward may hold, in largest-shard buffers, before it waits for pending updates to free some: the
shard being updated, one waiting for its turn, and the ones backward is filling."""

KEPT_MASTER_SHARDS = 2
"""Of :data:`GRAD_BUDGET_SHARDS`, the bytes that keep backward's page-ins of fp32 masters (each its shard's compute
copy, read from the swap files) for the updates that come after, where updates overlap backward: an update late
behind backward then copies its master instead of reading it from the drive again, and backward waits for the
updates rather than run ahead of them by more than the gradients left in the budget."""


@dataclass(frozen=True)
class StoreIO:
    """How a swap store moves its chunks: I/O threads per directory, and the size of the stripes keys are cut in
    (a multiple of 4096; the stripes still go round-robin over the directories)."""

    threads_per_path: int
    stripe_bytes: int


def store_io(is_cuda: bool, cores: int) -> StoreIO:
    """The swap stores' threads and stripe size on a machine with ``cores`` cores.

    On a GPU the cores are the CPU optimizer's and the drives want queue depth: 4 threads per directory moving 1 MiB
    stripes. On the CPU the compute's own thread team fills every core, and each wake-up of an I/O thread preempts one
    of its threads: one thread per directory (two from 16 cores on, where one core taken costs the compute little and
    a second keeps the drive busy while the first checksums), moving 4 MiB stripes, so that a shard's moments go in
    one or two requests instead of several.
    """
    if is_cuda:
        return StoreIO(threads_per_path=4, stripe_bytes=1 << 20)
    return StoreIO(threads_per_path=1 if cores < 16 else 2, stripe_bytes=4 << 20)


def _activation_store(device: Device, config: RatelConfig, io: StoreIO) -> Callable[[], TensorStore]:
    """The factory of the swap store for ``ssd``-tier activations: device-direct through kvikio where it is installed,
    works and measures faster than staging through pinned host memory; the POSIX store, moving chunks as ``io``
    says, otherwise."""
    assert config.ssd_paths is not None
    paths = config.ssd_paths
    name = f"{config.name}-act"

    def create() -> TensorStore:
        if device.is_cuda and gds.kvikio_available(paths[0]) and gds.measure(paths, device.device).prefer_kvikio():
            return gds.GdsStore(paths, name=name, keep_files=False)
        return TensorStore(paths, name=name, keep_files=False, stripe_bytes=io.stripe_bytes,
                           io_threads_per_path=io.threads_per_path)

    return create


def rank_threads(is_cuda: bool, local_world: int, cores: int) -> tuple[int, int]:
    """Threads of one rank's CPU optimizer updates and of its host-state copies, out of the ``cores`` it may run on.

    On the CPU the compute's own thread team already fills every core: one thread for the updates, and the copies
    run on it (0: a thread of their own would take a core from the compute too, and wake the optimizer's thread
    again after every copy). On a GPU the cores are the CPU
    optimizer's, split evenly among the ``local_world`` ranks of the node, so that their updates together run one
    thread per core; the copies of states kept in host memory (memory-bound, run while the update waits for its
    states) get a quarter of a rank's share, at most 4.
    """
    if not is_cuda:
        return 1, 0
    share = max(1, cores // max(1, local_world))
    return share, max(1, min(4, share // 4))


def _state_store(device: Device, config: RatelConfig, shards: list[Shard], local_world: int, io: StoreIO
                 ) -> TieredStore:
    """The model-state store: the swap files (moving chunks as ``io`` says), and host or device memory for the states
    of shards placed there."""
    assert config.ssd_paths is not None
    # The stripe is recorded in the files' headers and a kept store's index: stores kept with another one still open.
    disk = TensorStore(config.ssd_paths, name=config.name, keep_files=config.keep_swap_files,
                       stripe_bytes=io.stripe_bytes, io_threads_per_path=io.threads_per_path)
    threads = rank_threads(device.is_cuda, local_world, available_cores())[1]
    host_keys = [key for shard in shards if shard.state_tier == "host" for key in shard.state_keys()]
    device_keys = [key for shard in shards if shard.state_tier == "device" for key in shard.state_keys()]
    return TieredStore(disk, HostStore(f"{config.name}-states", threads=threads), host_keys,
                       DeviceStates(device) if device_keys else None, device_keys)


def _device_memory(device: Device, config: RatelConfig) -> int | None:
    """Device bytes the run may use, for the device tier of the optimizer states: ``device_memory_limit``, or a
    GPU's free memory; ``None`` on the CPU without a limit (the host memory is the device's, and the host tier already
    keeps states there)."""
    if config.device_memory_limit is not None:
        return config.device_memory_limit
    return free_device_memory(device) if device.is_cuda else None


def _node_cache(module: nn.Module, ranks: Ranks, faults: Faults | None) -> NodeCache | None:
    """The host cache the ranks of this node share (collective over every rank, watching ``faults``), or ``None``:
    each rank keeps its own, with a warning why where several ranks share the node."""
    params = list(module.parameters())
    # At least the host cache's bytes: compute dtypes are never wider than the parameters' own, and each of a unit's
    # runs of one dtype and group starts on a page.
    nbytes = sum(p.numel() * p.element_size() for p in params) + 2 * ALIGNMENT * len(params)
    try:
        return NodeCache.open(ranks, nbytes, faults)
    except SharedCacheUnavailable as err:
        if ranks.local_world > 1:
            rank_zero_warn(
                f"RatelStrategy: the {ranks.local_world} ranks on each node keep a host cache of the compute copies "
                f"each, {ranks.local_world}x the host memory of one: {err}. Give /dev/shm room for one copy (docker: "
                "--shm-size) to hold it once per node.")
        return None


def _node_copies(ranks: Ranks, store: TieredStore, layout: Layout, owned: set[int], faults: Faults | None
                 ) -> NodeCopies | None:
    """With the compute copies in the swap files, the ones the node's ranks read from their owners' files (collective
    over every rank, watching ``faults``), or ``None``: each rank stores every copy, with a warning why where several
    ranks share the node."""
    on_disk = NodeCopies.written_by(ranks.rank, layout.shards, layout.frozen_shards, owned)
    try:
        return NodeCopies.open(ranks, store, on_disk, faults)
    except SharedCopiesUnavailable as err:
        if ranks.local_world > 1:
            rank_zero_warn(
                f"RatelStrategy: the {ranks.local_world} ranks on each node keep a copy of every compute copy in their "
                f"own swap files (param_cache='ssd'), {ranks.local_world}x the disk space of one: {err}.")
        return None


def _kept_masters(layout: Layout) -> int:
    """Largest-shard buffers of the gradient budget that keep fp32 masters paged in by backward for their updates
    (:data:`KEPT_MASTER_SHARDS` where the pager reads such masters from the swap files, else none)."""
    masters = layout.param_cache == "ssd" and any(s.dtype == torch.float32 and s.state_tier == "ssd"
                                                  for s in layout.shards)
    return KEPT_MASTER_SHARDS if masters else 0


def _largest_device_share(layout: Layout, owners: dict[int, int]) -> int:
    """Device bytes of the rank holding the most with every state on the devices: the states of the units it owns
    (both slots, the gradient sums) and every unit's compute copy, resident on each rank."""
    share: dict[int, int] = {}
    for shard in layout.shards:
        share[owners[shard.unit.index]] = share.get(owners[shard.unit.index], 0) + device_bytes(shard.numel)
    return max(share.values(), default=0) + sum(u.nbytes for u in layout.units.values())


def _states_fit_devices(module: nn.Module, blocks: Sequence[Block], optimizer: torch.optim.Optimizer,
                        half_dtype: torch.dtype | None, config: RatelConfig, device: Device, ranks: Ranks,
                        faults: Faults | None) -> bool:
    """Whether ``optimizer_states="auto"`` keeps every state on the devices with several ranks (collective over
    every rank): where the largest rank's share (:func:`_largest_device_share`, laid out on the meta device) fits
    the device tier's part of every rank's device budget; never with the compute copies in the swap files, an
    optimizer the device tier does not run, or a gradient exchange in host memory asked for."""
    fits = False
    if config.param_cache != "ssd" and fused(optimizer) and config.gradient_exchange in ("auto", "device"):
        probe = build_layout(module, blocks, optimizer, half_dtype, "host", config.host_memory_limit, meta_empty,
                             announce=False, optimizer_states="device", device_empty=meta_empty)
        fits = _largest_device_share(probe, _owners(probe, ranks)) <= device_states_budget(
            _device_memory(device, config), 0)
    return every_rank_agrees(ranks, fits, faults)


def _owners(layout: Layout, ranks: Ranks) -> dict[int, int]:
    """Each unit's owner rank, balancing the states' bytes (both slots) and the update's CPU time over the ranks."""
    costs: dict[int, tuple[int, int]] = {}
    for shard in layout.shards:
        nbytes = 2 * shard.numel * (8 if shard.master_in_host else 12)
        before = costs.get(shard.unit.index, (0, 0))
        costs[shard.unit.index] = (before[0] + nbytes, before[1] + shard.numel)
    return assign_owners([UnitCost(unit, nbytes, work) for unit, (nbytes, work) in costs.items()], ranks.world)


@dataclass(frozen=True)
class StepRule:
    """How one optimizer step treats its gradients, decided once at its start from what the Trainer and the module ask
    for. Together with :meth:`RatelEngine.finish_step` (unscale, skip on overflow, clip by norm) this is the one place
    where clipping and skipping are decided; the CPU optimizer only executes the result.

    Attributes:
        overlap: updates run during backward as each shard's gradients complete. Otherwise they wait for the end of
            backward: where overlapping cannot shorten the step (the cost model's
            :func:`~lightning_ratel.plan.cost.updates_overlap`: a run on the CPU), or where something global about the
            gradients must be known first: the norm (clipping by norm), the overflow check (fp16 loss scaling), or
            whatever the module's own ``configure_gradient_clipping`` asks.
        speculative: the norm or the overflow check is needed, yet updates overlap backward: each runs as if the clip
            coefficient were 1 and nothing overflowed, and the step's end confirms that or redoes them
            (:meth:`~lightning_ratel.runtime.optimizer.CpuAdam.resolve`), with the numbers of the deferred path.
        clip_value: the element-wise clip each shard applies to its own gradients before its overlapped update
            (clipping by value), or ``None``.
    """

    overlap: bool
    clip_value: float | None
    speculative: bool = False

    @classmethod
    def decide(cls, clip_val: float | None, clip_algorithm: str, custom_clipping: bool, loss_scaled: bool,
               speculate: bool = False, overlap_pays: bool = True) -> StepRule:
        """The rule of one step.

        Args:
            clip_val: the Trainer's gradient clipping value (``None`` or 0 for none).
            clip_algorithm: ``"norm"`` or ``"value"``.
            custom_clipping: the module defines its own ``configure_gradient_clipping`` (it may do anything with
                the gradients, so its steps always wait for the end of backward).
            loss_scaled: fp16 loss scaling is on.
            speculate: a step that needs the norm or the overflow check may speculate (the engine's predictor: the
                last step neither clipped nor overflowed, so the guess is likely right).
            overlap_pays: updating during backward can shorten the step at all; ``False`` runs every update after
                backward (nothing is speculated then either).
        """
        clipping = bool(clip_val) and float(clip_val) > 0
        needs_global = loss_scaled or (clipping and clip_algorithm == "norm")
        deferred = not overlap_pays or custom_clipping or (needs_global and not speculate)
        by_value = clipping and clip_algorithm == "value" and not deferred
        return cls(overlap=not deferred, clip_value=float(clip_val) if by_value else None,
                   speculative=needs_global and not deferred)


class RatelEngine:
    """Runs a model with its parameters paged, its optimizer states on disk and its activations placed by plan.

    Args:
        module: the model (the LightningModule).
        device: the compute device.
        config: the strategy's settings, with the swap directories resolved.
        half_dtype: the 16-bit compute dtype of mixed precision, ``None`` for fp32.
        optimizer: the user's optimizer when fitting; ``None`` for evaluation-only runs (no store is created).
        source: first values of the parameters (a pretrained folder, a checkpoint being resumed); ``None``: the
            module's own values, or initialization for a model on the meta device.
        progress: show a progress bar while the model is materialized.
        ranks: this process's place among several training data parallel (each unit's states and update then live on
            one owner rank, :mod:`lightning_ratel.runtime.collectives`); ``None``: one process.
        faults: with ``ranks``, where the run's failures are reported and watched for (shared with the strategy's own
            collectives, :class:`~lightning_ratel.runtime.collectives.WorldCollectives`); ``None``: the engine's
            collectives watch a store of their own.
        exchange: with ``ranks``, how their gradients reach each shard's owner
            (:func:`~lightning_ratel.plan.exchange.choose_exchange`, planned by the pre-flight check); ``None``: the
            window's sums (``"window"``).
    """

    speculate = True
    """Whether steps that clip by norm or scale the loss may speculate (:class:`StepRule`); ``False`` keeps every such
    step on the deferred path (the reference the speculative path is tested against)."""

    overlap_updates: bool | None = None
    """Whether updates run during backward: ``None`` lets the cost model decide
    (:func:`~lightning_ratel.plan.cost.updates_overlap`: during backward where a GPU computes, after it on the CPU);
    ``True`` overlaps them on the CPU too (the path a GPU run takes, which the tests run on a machine without one),
    ``False`` defers every update to the end of backward."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        config: RatelConfig,
        half_dtype: torch.dtype | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        source: ValueSource | None = None,
        progress: bool = False,
        ranks: Ranks | None = None,
        faults: Faults | None = None,
        exchange: ExchangeChoice | None = None,
    ) -> None:
        assert config.ssd_paths is not None
        self.module = module
        self.config = config
        self.device = Device(device)
        self.optimizer = optimizer
        self.timeline = Timeline()
        found = discover_blocks(module, config.blocks)
        if not found:
            raise RatelConfigError("the model has no parameters to manage")
        if config.activation_policy is not None:
            check_patterns(found, config.activation_policy)
        parallel = ranks is not None and optimizer is not None
        # Several ranks with every state on the device: each rank keeps every unit resident on its device, and each
        # unit's owner its states, updated there (see DataParallelAdam); "auto" where they fit every rank's device.
        device_states = parallel and ranks is not None and optimizer is not None and (
            config.states_request == "device" or config.states_request == "auto" and _states_fit_devices(
                module, found, optimizer, half_dtype, config, self.device, ranks, faults))
        states_request = "device" if device_states else config.states_request
        if device_states and config.states_request == "auto":
            rank_zero_info("RatelStrategy: every optimizer state fits the devices: each unit's states on its owner's "
                           "device, every unit resident on every rank's (optimizer_states='device').")
        # The ranks of a node page from one host cache (each compute copy held once per node), unless the compute
        # copies are to be read from the swap files or are all resident on the devices.
        node = (_node_cache(module, ranks, faults)
                if parallel and ranks is not None and config.param_cache != "ssd" and not device_states else None)
        try:
            host_empty = (self.device.host_empty if node is None
                          else functools.partial(self.device.shared_host_empty, node.memory))
            self.layout = build_layout(module, found, optimizer, half_dtype, config.param_cache,
                                       config.host_memory_limit, host_empty, announce=not parallel,
                                       optimizer_states=states_request, read_ahead=config.read_ahead_sets,
                                       device_empty=self.device.device_empty,
                                       device_memory=None if parallel else _device_memory(self.device, config),
                                       prefetch_depth=config.prefetch_depth)
            self.blocks = BlockMembership(found, self.layout.block_units)
            owners = _owners(self.layout, ranks) if parallel and ranks is not None else None
            # How the ranks' gradients reach their owners (the strategy's pre-flight plans it; window sums where it
            # did not).
            unplanned = (ExchangeChoice("device", "not planned", 1) if device_states
                         else ExchangeChoice("window", "not planned", 1))
            self.exchange = None if owners is None else exchange or unplanned
            if device_states and self.exchange is not None and self.exchange.mode != "device":
                # "auto" put the states on the devices after the pre-flight planned an exchange in host memory.
                self.exchange = ExchangeChoice("device", "the optimizer states are on the devices",
                                               self.exchange.reduces_per_step)
            if self.exchange is not None:
                rank_zero_info(f"RatelStrategy: {self.exchange.describe()}.")
        except BaseException:
            if node is not None:
                node.close()
            raise
        owned = None if owners is None else {s.index for s in self.layout.shards if owners[s.unit.index] == ranks.rank}
        if device_states and owners is not None:
            # Every rank checks the largest rank's share: they refuse alike.
            check_device_fit(_largest_device_share(self.layout, owners), _device_memory(self.device, config))
        if owned is not None and not device_states:
            # Each rank places the states it owns, in its share of the node's memory.
            self.layout = with_state_tiers(self.layout, config.states_request, config.host_memory_limit, owned,
                                           ranks.local_world, cache_shared=node is not None,
                                           read_ahead=config.read_ahead_sets)
        writes = None if node is None or owners is None else node.written_here(owners, list(self.layout.units))
        materializer = Materializer(module, found, self.layout, self.device.device, config.param_init_fn,
                                    source, progress, owned, writes)
        self.store: TieredStore | None = None
        self.adam: CpuAdam | DataParallelAdam | TieredAdam | None = None
        # Several ranks fitting: rank 0's buffers reach every rank, at setup and before the forwards
        # DistributedDataParallel broadcasts them before (see watch_forward).
        self._buffers: BufferBroadcast | None = None
        self._buffers_due = True
        # Whether this micro-batch's gradients are reduced over the ranks (DistributedDataParallel outside no_sync).
        self._reduces = False
        self._switches = FitSwitches(module) if optimizer is not None else None
        local_world = ranks.local_world if ranks is not None else 1
        io = store_io(self.device.is_cuda, available_cores())
        # Host bytes of backward's page-ins the pool keeps for the updates (see KEPT_MASTER_SHARDS).
        kept = 0
        try:
            node_copies = None
            if optimizer is not None:
                self.store = _state_store(self.device, config, self.layout.shards, local_world, io)
                if owned is not None and ranks is not None and self.layout.param_cache == "ssd":
                    node_copies = _node_copies(ranks, self.store, self.layout, owned, faults)
                    if node_copies is not None:
                        materializer.shared = node_copies.read_elsewhere
            materializer.load(self.store)
            if self.store is not None:
                largest = max((s.numel for s in self.layout.shards), default=0)
                # One rank alone keeps torch's thread count on a GPU.
                threads = None if self.device.is_cuda and ranks is None else rank_threads(
                    self.device.is_cuda, local_world, available_cores())[0]

                # The ranks of a node split one process's pipeline sets between them; each keeps the sets planned
                # to read ahead in its own budget.
                depth = buffer_sets(local_world) + self.layout.read_ahead_sets

                kept = _kept_masters(self.layout) * largest * 4

                def cpu_adam(shards: list[Shard]) -> CpuAdam:
                    assert self.store is not None
                    return CpuAdam(shards, self.store, depth, timeline=self.timeline,
                                   compute_on_store=self.layout.param_cache == "ssd",
                                   grad_budget_bytes=GRAD_BUDGET_SHARDS * largest * 4 - kept,
                                   threads=threads, generic=self.layout.generic)

                def rank_adam(shards: list[Shard]) -> CpuAdam:
                    # With the device tier a rank's optimizer has both lanes; the device tier's gradients come to
                    # it reduced, through the exchange, not from hooks of its own.
                    assert self.store is not None
                    if not device_states:
                        return cpu_adam(shards)
                    return TieredAdam(  # type: ignore[return-value]
                        cpu_adam([s for s in shards if s.state_tier != "device"]),
                        DeviceAdam(self.device, [s for s in shards if s.state_tier == "device"], self.store.device,
                                   hooks=False))

                on_device = [s for s in self.layout.shards if s.state_tier == "device"]
                if owners is None and on_device:
                    self.adam = TieredAdam(cpu_adam([s for s in self.layout.shards if s.state_tier != "device"]),
                                           DeviceAdam(self.device, on_device, self.store.device))
                elif owners is None:
                    self.adam = cpu_adam(self.layout.shards)
                else:
                    assert ranks is not None
                    assert self.exchange is not None
                    self.adam = DataParallelAdam(rank_adam, self.layout.shards, owners, ranks, node, faults,
                                                 self.exchange.mode, node_copies, self.device)
                    self.adam.sync_compute_copies(self.layout.frozen_shards)
                    # The training thread's own gloo group, whose waits watch for a failed rank (and which the ranks
                    # replace when they meet after a failure), also on CUDA.
                    self._buffers = BufferBroadcast(module, group=self.adam.control_group, wait=self.adam.wait)
                    self._buffers.broadcast()
                # State the optimizer's constructor made (Adagrad's sums) is made again for each parameter at its
                # first update; the run's state lives in the store.
                optimizer.state.clear()
        except BaseException:
            if node is not None and not isinstance(self.adam, DataParallelAdam):
                node.close()
            materializer.undo()
            if self._switches is not None:
                self._switches.restore()
            if self.store is not None:
                self.store.close()
            raise
        # Evaluation only: the original tensors are the values, kept in host memory to restore at teardown.
        originals = {id(s.param): s.param.data for s in self.layout.slots} if self.adam is None else {}
        self.pager = ParameterPager(self.device, self.layout.units, self.blocks.units_of,
                                    store=self.store if self.layout.param_cache == "ssd" else None,
                                    unit_shards=self.layout.unit_shards())
        self.state = ModelState(module, self.layout, self.pager, self.store, self.adam, optimizer, originals,
                                config.host_memory_limit)
        # Between passes the user's code reads the committed values instead of the paging placeholders.
        self.reads = ParameterReads(self.pager, self.state.unit_values, self.state.quiesce, self.state.assign_unit)
        self.cache = ActivationCache(self.device, self.pager, [], _activation_store(self.device, config, io))
        self.scheduler = BlockScheduler(self.blocks, self.pager, self.cache, self.device, config.prefetch_depth,
                                        self.timeline, check=self.adam.check if self.adam is not None else lambda: None)
        self.scheduler.aside_between_steps = any(slot.dtype != self.layout.orig_dtype[id(slot.param)]
                                                 for unit in self.layout.units.values() for slot in unit.slots)
        # Every unit resident on the device (fixed by the layout): passes may hold them all (see _resident_pass).
        self._every_unit_resident = all(unit.resident for unit in self.layout.units.values())
        # The device tier's gradients stay on the device (its own hooks).
        consumer = self.adam.cpu if isinstance(self.adam, TieredAdam) else self.adam
        # With several ranks every gradient goes to the exchange, the device tier's too.
        self.gradients = (GradientOffload(self.device, consumer,
                                          [s for s in self.layout.shards
                                           if s.state_tier != "device" or isinstance(consumer, DataParallelAdam)],
                                          self.layout.frozen_shards,
                                          to_host=not (isinstance(consumer, DataParallelAdam)
                                                       and consumer.reduces_on_device))
                          if consumer is not None else None)
        # Autograd's backward, where the training thread calls it, is the engine's backward pass.
        self.backward_calls = BackwardCalls(self._begin_backward, self._end_backward, self._backward_raised)
        self.accounts = ByteAccount(self.device, self.layout, self.pager, self.cache, self.state, self.adam,
                                    self.store, writes)
        self._overlap_pays = self._decide_overlap(local_world)
        if self._overlap_pays:
            self.device.pool.keep_limit = kept
        self.planner = Planner(config, self.device, self.blocks, self.layout, self.cache, self.scheduler,
                               self.accounts, StepBreakdown(self.device, self.timeline, self.pager, self.cache,
                                                            self.store), self.adam, updates_overlap=self._overlap_pays,
                               store_options={"stripe_bytes": io.stripe_bytes,
                                              "io_threads_per_path": io.threads_per_path})
        # A block found late gets an activation placement (the default) and forward hooks of its own.
        self.blocks.on_add(lambda block: self.cache.add_block())
        self.blocks.on_add(self.scheduler.add_block)
        # The optimizer's parameters at setup, by group: the layout is made for them.
        self._optimizer_params = ([[id(p) for p in g["params"]] for g in optimizer.param_groups]
                                  if optimizer is not None else [])
        if optimizer is not None:
            optimizer.add_param_group = self._refuse_new_group  # type: ignore[method-assign]
        self._step_plan = StepPlan([], overlap=False)
        self._pending_plan: StepPlan | None = None
        self._clip: tuple[float, str] | None = None
        # The predictor of speculation: whether the last step clipped by norm or overflowed (a speculative update would
        # have been redone or dropped).
        self._missed = False
        # Whether a backward ran since the last step: its gradients are held until a step takes them or zero_grad
        # drops them (every rank runs the same passes and steps, so each decides alike without a collective).
        self._backward_since_step = False
        # ``id`` of every module whose forward ran in a watched pass (empty before the first pass).
        self._ran_watched: set[int] = set()
        # Whether block forwards ran unwatched in the last pass, and that (training) pass's loss if they did.
        self._unwatched_ran = False
        # Whether the last training pass's loss was finite, on its way to host memory (flag, copy's event).
        self._last_loss: tuple[torch.Tensor, Any] | None = None

    @property
    def updates_overlap(self) -> bool:
        """Whether this run's updates may run during backward (otherwise every step runs them after it)."""
        return self._overlap_pays

    def describe_updates(self) -> str:
        """Where and when this run's updates run, for its start line."""
        tiers = {shard.state_tier for shard in self.layout.shards}
        parts = []
        if tiers - {"device"}:
            parts.append("CPU updates " + ("during backward" if self.updates_overlap else "after backward"))
        if "device" in tiers:
            parts.append("device updates after backward")
        return ", ".join(parts) or "no updates"

    def _decide_overlap(self, local_world: int) -> bool:
        """Whether updates may run during backward (:attr:`overlap_updates`, or else the cost model's
        :func:`~lightning_ratel.plan.cost.updates_overlap`), from what the run holds once set up. Never where every
        shard is on the device tier: its updates wait for the step's decision, and no CPU update is left to overlap."""
        if all(shard.state_tier == "device" for shard in self.layout.shards):
            return False
        if self.overlap_updates is not None:
            return self.overlap_updates
        held = self.accounts.held()["host"]
        limit = self.config.host_memory_limit
        room = max(0, limit - held) if limit is not None else available_host_memory() // local_world
        # With streams simulated on the CPU the run takes a GPU's path (copies between separate memories).
        return updates_overlap(unified=not self.device.separate_memory,
                               gradient_bytes=4 * sum(s.numel for s in self.layout.shards), host_room=room)

    # ------------------------------------------------------------------ parameters used outside their block

    @contextlib.contextmanager
    def watch_forward(self, training: bool) -> Iterator[None]:
        """Run one forward (a Lightning step), finding parameters used outside their block.

        Such parameters are paged in on the spot for this pass, and from then on with the block whose forward uses
        them (see :mod:`lightning_ratel.runtime.escapes`). Every pass is watched, not only the first: a model may
        use a parameter elsewhere only when training, only in evaluation, or only from some step on, and its
        placeholder must never reach compute. A block's own forward is watched the first time it runs; after that
        only the code around the blocks is (where a parent's forward reads a head or an embedding), since a watched
        op costs a few microseconds and the blocks run most ops. A pass with every unit resident on the device and
        every activation kept holds all the units instead, and has nothing to watch (:meth:`_resident_pass`).

        Args:
            training: a backward follows, which may read the parameters paged in on the spot; otherwise they are
                released when the forward ends.

        Raises:
            RatelModelError: a parameter is used outside every module's forward (in the LightningModule's step
                itself), where no block can page it in.
        """
        if training:
            self._check_last_loss()
        if self._buffers is not None and self._buffers_due:
            self._buffers.broadcast()
        # Under manual optimization the step runs its backward passes itself, `loss.backward()` as well as
        # `self.manual_backward(loss)`.
        manual = training and not getattr(self.module, "automatic_optimization", True)
        self.scheduler.bound = False
        self.scheduler.forward_open = True
        try:
            if not manual and self._resident_pass():
                with self._bound_pass():
                    yield
                self._unwatched_ran = False
            else:
                with self._watched_pass(training, manual):
                    yield
        finally:
            self.scheduler.forward_open = False
        if self._buffers is not None:
            # DistributedDataParallel's rule: the next forward broadcasts the buffers after one with gradients enabled
            # that reduces them (not an accumulating micro-batch, not an evaluation pass).
            self._buffers_due = training and torch.is_grad_enabled() and self._reduces

    def _resident_pass(self) -> bool:
        """Whether the next pass can hold every unit from its start to the end of its backward: each is resident on
        the device (nothing to page in, no placeholder for a read to meet, so nothing to watch), every block keeps
        its activations as they are (nothing to place), and no profile is being taken. The plan a model gets when its
        whole job fits the device."""
        return (self._every_unit_resident and self.scheduler.observer is None
                and all(p == "device" for p in self.cache.placements))

    @contextlib.contextmanager
    def _bound_pass(self) -> Iterator[None]:
        """A forward with every unit held (see :meth:`_resident_pass`). The blocks' hooks step aside: on a GPU the
        host queues a small model's kernels barely ahead of the device, so their work would be the device's wait.
        The units are released when the forward ends, as between steps (Lightning's ``on_before_backward`` reads the
        committed values, see :mod:`~lightning_ratel.engine.reads`), and held again for each backward."""
        self.scheduler.bound = True
        self.reads.pause()
        try:
            self.pager.hold_all()
            yield
        except BaseException:
            self.scheduler.bound = False
            raise
        finally:
            self.pager.release_all()
            self.reads.resume()

    @contextlib.contextmanager
    def _watched_pass(self, training: bool, manual: bool) -> Iterator[None]:
        """A forward whose parameters are paged in block by block, watched for parameters used outside their block."""
        # A block's forward is watched until it has run once (see EscapeDetector); what runs between and around the
        # blocks always is.
        unwatched = [b.module for b in self.blocks if not b.direct_only and id(b.module) in self._ran_watched]
        detector = EscapeDetector(self.pager, unwatched, [b.module for b in self.blocks if not b.direct_only])
        # Prefetching follows the registration order until a pass teaches the real one: it could page in a block
        # whose forward never runs just before another module reads its parameters, and hide that use.
        self.scheduler.prefetching = bool(self._ran_watched)
        self.cache.unwatched = {b.index for b in self.blocks if id(b.module) in {id(m) for m in unwatched}}
        self.reads.pause()
        if manual:
            self.backward_calls.open()
        try:
            with detector:
                try:
                    yield
                except BaseException:
                    # Before the detector leaves the mode stack: the block modes above it come off first.
                    self.scheduler.leave_open_forwards()
                    raise
        except PlaceholderRead as err:
            raise RatelModelError(
                f"the forward of block {self.blocks[err.block].name} read parameter {err.name}, which is paged in "
                "with another block, only after its first forward: RatelStrategy watches a block's forward for such "
                "reads the first time it runs (to keep the per-op cost off the blocks), so the read found the "
                "parameter's paging placeholder. Make the forward read it from its first run on, or make one block of "
                "the modules using it: RatelStrategy(blocks=[...]) naming a module that holds both."
            ) from err
        finally:
            if manual:
                self.backward_calls.close()
            self.scheduler.prefetching = True
            self.cache.unwatched = set()
            self.reads.resume()
        self._unwatched_ran = any(id(m) in detector.ran for m in unwatched)
        self._ran_watched |= detector.ran
        if detector.escapes:
            self._adopt(detector.escapes)
            if not training:
                self.pager.release_all()

    def note_loss(self, loss: torch.Tensor | None) -> None:
        """Start copying whether the loss of a training pass in which block forwards ran unwatched is finite to host
        memory, to check before the next pass; reading it on the device would be a host sync every step."""
        if loss is None or not self._unwatched_ran:
            self._last_loss = None
            return
        self._last_loss = self.device.to_host(torch.isfinite(loss.detach()).all().reshape(1))

    def _check_last_loss(self) -> None:
        """A NaN or infinite loss of a pass with unwatched block forwards may come from a paging placeholder read in
        one of them (a read that saved nothing for backward): say so, and watch every forward of the next pass, which
        pages such a read in and adopts the parameter into that block from then on. A flag whose copy has not landed
        yet is not waited for (the device is still busy with that step; the next step's flag follows)."""
        pending, self._last_loss = self._last_loss, None
        if pending is None or not pending[1].query() or bool(pending[0].item()):
            return
        self._ran_watched = set()
        rank_zero_warn(
            "RatelStrategy: the loss of the last training step is not finite. Besides the usual causes, a block's "
            "forward that reads a parameter of another block only from some step on reads that parameter's paging "
            "placeholder (NaN): this pass watches every block's forward to find such a read (it is paged in and "
            "reported as 'paged in with that block')."
        )

    def _adopt(self, escapes: list[Escape]) -> None:
        """Make each escaped parameter's unit part of the block whose forward used it: the innermost block running
        then, or else the outermost module running, as a new block of its own."""
        by_module = {id(block.module): block for block in self.blocks}
        for escape in escapes:
            running = [by_module[id(m)] for m in escape.modules if id(m) in by_module]
            if running:
                block = running[-1]
            elif escape.modules:
                module = escape.modules[0]
                name = next((n for n, m in self.module.named_modules() if m is module), type(module).__name__)
                block = self.blocks.add(module, name)
            else:
                raise RatelModelError(
                    f"parameter {escape.slot.name} is used outside the forward of every module (in the "
                    "LightningModule's step itself), where RatelStrategy cannot page it in. Compute it inside a "
                    "module's forward, or list the modules that use it together in RatelStrategy(blocks=[...])."
                )
            if self.blocks.adopt(block, escape.unit, escape.slot.param):
                rank_zero_info(
                    f"RatelStrategy: {escape.slot.name} is used by the forward of {block.name or 'the model'} too; it "
                    "is paged in with that block from now on."
                )

    # ------------------------------------------------------------------ the step

    def begin_micro_batch(self) -> None:
        """Called before each training_step: forget stale activations and tell the optimizer what this pass is."""
        # A profiled micro-batch is timed from here to the end of its backward or step (Planner.micro_batch_ended):
        # the work of callbacks and loggers around it is no part of it, whichever their order.
        self.planner.step_started()
        # Values written between steps land before the step begins (its updates start from them).
        self.reads.flush()
        if self.adam is not None:
            self.adam.check()
        self.cache.end_pass()
        if self.adam is not None:
            plan, self._pending_plan = self._pending_plan, None
            self.adam.begin(plan)
            # Lightning blocks DistributedDataParallel's gradient sync on the micro-batches that only accumulate
            # (automatic optimization); under manual optimization every backward syncs.
            self._reduces = plan is not None or not getattr(self.module, "automatic_optimization", True)

    def begin_step(self, optimizer: torch.optim.Optimizer, clip_val: float | None, clip_algorithm: str,
                   custom_clipping: bool, loss_scale: torch.Tensor | None) -> None:
        """The boundary micro-batch is about to run: snapshot hyperparameters and decide how updates run
        (:meth:`StepRule.decide`).

        Speculation is predicted to pay where the last step neither clipped by norm nor overflowed: once clipping
        starts it tends to go on for a while, and each such step would redo every update, so those steps wait for the
        end of backward instead until one of them does not clip. It is only tried for the fused AdamW, which never
        writes the gradient it reads (another optimizer's step may).

        Args:
            optimizer: the user's optimizer, whose param_groups hold the current hyperparameters.
            clip_val: the Trainer's gradient clipping value (``None`` or 0 for none).
            clip_algorithm: ``"norm"`` or ``"value"``.
            custom_clipping: the module defines its own ``configure_gradient_clipping``.
            loss_scale: the fp16 loss scale (host memory), ``None`` without loss scaling. It does not change before
                the step is finished.
        """
        self._check_optimizer_params(optimizer)
        speculate = self.speculate and self.layout.generic is None and not self._missed
        rule = StepRule.decide(clip_val, clip_algorithm, custom_clipping, loss_scale is not None, speculate,
                               overlap_pays=self._overlap_pays)
        hyper = GroupHyper.of(optimizer) if self.layout.generic is None else group_settings(optimizer)
        # GradScaler's reciprocal, taken once for every shard's unscale during backward.
        inv_scale = (loss_scale.double().reciprocal().float()
                     if rule.speculative and loss_scale is not None else None)
        self._pending_plan = self._step_plan = StepPlan(hyper, overlap=rule.overlap, speculative=rule.speculative,
                                                        inv_scale=inv_scale, clip_value=rule.clip_value)
        self._clip = None

    def begin_manual_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Manual optimization's ``optimizer.step()``: the gradients every ``manual_backward`` since the last step (or
        ``zero_grad``) accumulated are this step's. The updates wait for :meth:`finish_step` (nothing told backward that
        a step would follow), and a clip requested before the call (``self.clip_gradients``) applies to them."""
        assert self.adam is not None
        self._check_optimizer_params(optimizer)
        hyper = GroupHyper.of(optimizer) if self.layout.generic is None else group_settings(optimizer)
        self._step_plan = StepPlan(hyper, overlap=False)
        self.adam.begin(self._step_plan)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: drop the gradients accumulated since the last step. Lightning's automatic
        optimization calls it at the start of each accumulation window, where a step normally took them all already;
        it drops some only when a backward was not followed by a step (an ``optimizer_step`` that skips
        ``optimizer.step()``), as plain training forgets them there."""
        assert self.adam is not None
        if self._backward_since_step:
            self.adam.discard_window()
            self._backward_since_step = False

    @staticmethod
    def _refuse_new_group(param_group: dict) -> None:
        raise RatelConfigError(f"`optimizer.add_param_group` was called during fit. {_FIXED_PARAMETERS}")

    def _check_optimizer_params(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse a step whose optimizer holds other parameters than at setup (its groups were edited)."""
        if [[id(p) for p in g["params"]] for g in optimizer.param_groups] != self._optimizer_params:
            raise RatelConfigError(f"the optimizer's parameter groups changed during fit. {_FIXED_PARAMETERS}")

    def request_clip(self, clip_val: float, algorithm: str) -> None:
        """Record a clipping request made (through Lightning) after the closure ran."""
        self._clip = (float(clip_val), algorithm)

    def pre_backward(self) -> None:
        """Lightning's backward hook (``LightningModule.backward``, which the user may override) is about to run: the
        autograd backward it starts is the engine's backward pass (:class:`~lightning_ratel.engine.backward.
        BackwardCalls`); the code around that call reads the parameters as code between steps does."""
        self.backward_calls.open()

    def post_backward(self) -> None:
        """Lightning's backward hook returned."""
        self.backward_calls.close()
        self.planner.micro_batch_ended()

    def backward_stopped(self) -> None:
        """Lightning's backward hook raised."""
        self.backward_calls.close()

    def _begin_backward(self) -> None:
        """Autograd's backward of a micro-batch is about to run (training thread)."""
        self.reads.pause()
        self.scheduler.begin_backward()
        self._gradients_open(True)

    def _end_backward(self) -> None:
        """Autograd's backward finished: release what it held and forget the pass's activations."""
        self._gradients_open(False)
        self.scheduler.end_backward()
        self.planner.record_pass()
        self.cache.end_pass()
        self.reads.resume()
        self._backward_since_step = True

    def _backward_raised(self) -> None:
        """Autograd's backward raised: the user's hooks (``on_exception``, ``OnExceptionCheckpoint``'s) read the
        committed values again. (A forward that raises resumes them itself, see :meth:`watch_forward`.)"""
        self._gradients_open(False)
        self.reads.resume()

    def _gradients_open(self, flag: bool) -> None:
        """Whether the gradient hooks take gradients: only during the engine's backward pass."""
        if self.gradients is not None:
            self.gradients.open = flag
        if isinstance(self.adam, TieredAdam):
            self.adam.device.open = flag

    def finish_step(self, loss_scale: torch.Tensor | None = None) -> bool:
        """Run (or finish) the updates of the boundary micro-batch: one call to
        :meth:`~lightning_ratel.runtime.optimizer.CpuAdam.finish` with what this step decided.

        Args:
            loss_scale: the fp16 loss scale, to unscale gradients and check them for overflow.

        Returns:
            Whether the step was taken (``False`` when nothing had a gradient or an fp16 overflow skipped it).
        """
        assert self.adam is not None
        plan = self._step_plan
        clip = self._clip if self._clip is not None and self._clip[0] > 0 else None
        self._clip = None
        by_norm = clip is not None and clip[1] == "norm"
        if plan.overlap and not plan.speculative and by_norm:
            raise RatelModelError("gradient clipping by norm was requested after updates had started")
        if self.reads.written():
            if plan.overlap:
                raise RatelModelError(
                    "a parameter was written after the backward pass began updating the parameters (in "
                    "`on_after_backward`, `on_before_optimizer_step`, or a `backward` override after "
                    "`super().backward()`): this step's update ran from the value before the write. Write parameters "
                    "between steps instead (`on_train_batch_end`, or after `optimizer.step()` in `optimizer_step`).")
            # Written after backward and before the step: the step updates the written values, as plain training's
            # `optimizer.step()` does.
            self.reads.flush()
        # The values read so far are the last step's; the updates are the engine's own ops (on gradients, states and
        # compute copies, never a placeholder), which the mode would only slow down.
        self.reads.pause()
        start = time.perf_counter()
        try:
            finished = self.adam.finish(plan, self.scheduler.order, loss_scale, clip)
        finally:
            self.reads.resume()
        self._backward_since_step = False
        # An `optimizer_step` that ran the closure before `optimizer.step()` left the plan unused: the next
        # micro-batch is not this step's boundary.
        self._pending_plan = None
        self._missed = finished.missed
        if self.planner.profiling and not plan.overlap and finished.taken:
            # A profiled step waits for its updates, which then run alone: the planner measures them whole (reads
            # of the states, kernel, compute copies, write-back copies), and the next profiled forward runs alone.
            self.adam.barrier()
            numel = sum(s.numel for s in self.planner.owned_shards())
            self.planner.record_updates(time.perf_counter() - start, numel)
        self.planner.micro_batch_ended()
        return finished.taken

    def abort_step(self) -> None:
        """An exception stopped the step before it was finished: put every shard back at the last committed step."""
        if self.adam is not None:
            self.adam.abort()

    def report_failure(self, error: BaseException) -> None:
        """Tell the other ranks, if any, that ``error`` stopped training on this one (their collectives stop too)."""
        if isinstance(self.adam, DataParallelAdam):
            self.adam.report(error)

    def regroup(self, error: BaseException) -> None:
        """After ``error`` stopped training, before the ranks save its last committed step together: wait until every
        rank stopped and give their collectives a new group (:meth:`DataParallelAdam.regroup
        <lightning_ratel.runtime.collectives.DataParallelAdam.regroup>`); nothing on one rank."""
        if isinstance(self.adam, DataParallelAdam):
            self.adam.regroup(error)

    def synchronize(self) -> None:
        """Wait for every pending update and write-back."""
        if self.adam is not None:
            self.adam.barrier(include_writes=True)

    def byte_placement(self) -> dict[str, int]:
        """Bytes the engine holds right now on the device, in host memory and on disk."""
        return self.accounts.held()

    def user_settings(self) -> contextlib.AbstractContextManager[None]:
        """The model's settings as the user made them, for the duration of the ``with`` block: what a checkpoint or
        an export records is not what the fit switched off (:class:`~lightning_ratel.engine.switches.FitSwitches`)."""
        return self._switches.user_settings() if self._switches is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ teardown

    def close(self, restore: bool = True) -> None:
        """Remove every hook, put ordinary tensors back into the module, and close the store.

        Args:
            restore: copy parameters (and the optimizer state, into the user's optimizer) back from the store.
                After an I/O error the store may be unreadable; the last checkpoint then holds the state.
        """
        try:
            self.reads.close()
            self.scheduler.close()
            if self.gradients is not None:
                self.gradients.remove()
            if self._switches is not None:
                self._switches.restore()
            if self.optimizer is not None:
                self.optimizer.__dict__.pop("add_param_group", None)
            if restore:
                # A step stopped before it was finished must not leave its updates in what is copied back.
                self.abort_step()
                self.state.restore()
        finally:
            if self.adam is not None:
                self.adam.close()
            # After the worker has stopped: it writes the host copies this reads.
            self.state.unplace_leftovers()
            self.cache.close()
            if self.store is not None:
                self.store.close()

