"""Parameter paging: each block's compute copies visit the device only while used.

The compute copies of a unit (see :mod:`lightning_ratel.runtime.units`) live either in its host cache (one flat host
tensor per dtype, pinned on CUDA) or in the swap store, from which every page-in reads them into staging buffers of
the device's host pool. A block may also use parameters owned by another block (tied weights); paging it in takes a
reference on every unit it uses, so a shared parameter stays resident while any user needs it. A unit is paged in
only once its :class:`UnitReady` is set, so a forward never reads a compute copy an optimizer update is still
rewriting.

With separate device memory (CUDA), a unit read from the store starts its upload as soon as its reads have landed
(noticed at the pager's next call, on the thread that drives the device, so all device work stays on that thread),
not only when its block is acquired. A page-out never blocks the host: the staging buffers go back to the pool, which
reuses them once the reads and the upload using them have completed.

Between uses a parameter's ``.data`` is a zero-stride NaN placeholder of the right shape, dtype and device: shape-
reading code (model summaries) still works, and any use outside the paged window shows up as NaN at once.

Threads: everything here runs on the training thread (forward hooks and backward's pre-hooks), except the store
reads it starts, whose futures it checks or waits for before their buffers are used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.timeline import span
from lightning_ratel.runtime.units import ParamSlot, Shard, Unit, UnitReady


@dataclass(frozen=True, eq=False)
class _StagingOffer:
    """A paged-out staging buffer whose bytes the store goes on offering to reads of its keys while the pool keeps
    it (see :class:`~lightning_ratel.runtime.pool.Offer`). Worth keeping while the store offers them and some shard's
    compute copy is still there: once an update has moved it to the other state slot, nothing reads the old one
    again until a later update overwrites it."""

    store: TensorStore
    buffer: torch.Tensor
    ready: UnitReady
    keys: tuple[tuple[Shard, str], ...]

    def offered(self) -> bool:
        return (any(self.ready.compute_key(shard) == key for shard, key in self.keys)
                and self.store.offers(self.buffer))

    def withdraw(self) -> list[Future]:
        return self.store.unshare(self.buffer)


def nan_placeholder(param: nn.Parameter, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor of ``param``'s shape that costs no memory (one NaN, expanded) and reads as NaN if used: what a
    parameter holds outside the pager's reach while its values are elsewhere (the pager's own are on the device)."""
    return torch.full((), float("nan"), dtype=dtype or param.dtype).expand(param.shape)


@dataclass
class _Residency:
    """A unit's state on the device (training thread only).

    Attributes:
        flats: the device copies while resident (on CPU: the host cache or the staging buffers themselves).
        staging: host buffers a store read fills, held while the unit is resident.
        reads: store reads still filling ``staging``, or that failed (the error is raised at acquire).
        keys: the store key each shard's compute copy was read from, by shard.
        event: completes when the upload of ``flats`` has landed (separate device memory).
        refs: blocks holding the unit.
    """

    flats: dict[torch.dtype, torch.Tensor] | None = None
    staging: dict[torch.dtype, torch.Tensor] | None = None
    reads: list[Future] = field(default_factory=list)
    keys: dict[Shard, str] = field(default_factory=dict)
    event: object = None
    refs: int = 0


class ParameterPager:
    """Makes blocks' parameters resident on the device on demand, with prefetch.

    Args:
        device: the compute device.
        units: every unit, indexed by owner block.
        units_of: for a block, the indices of the units its forward uses (they may grow during the run).
        store: the swap store to read compute copies from on every page-in; ``None`` pages in from the host caches.
        unit_shards: each unit's shards, whose compute keys a page-in reads (with ``store``).
    """

    def __init__(
        self,
        device: Device,
        units: Mapping[int, Unit],
        units_of: Callable[[int], Sequence[int]],
        store: TensorStore | None = None,
        unit_shards: Mapping[int, Sequence[Shard]] | None = None,
    ) -> None:
        self.device = device
        self.units = units
        self.units_of = units_of
        self._store = store
        self._unit_shards = unit_shards or {}
        # Store reads land in the device's host pool (pinned on CUDA); reusing its buffers keeps page-ins off freshly
        # mapped memory.
        self.pool = device.pool
        self._state = {index: _Residency() for index in units}
        # The units each reference took, dropped as taken: a block's units may grow between taking and dropping
        # (a unit adopted while the block is resident, see the engine's escape handling).
        self._prefetched: dict[int, tuple[int, ...]] = {}
        self._acquired: dict[int, list[tuple[int, ...]]] = {}
        # Units whose store reads are in flight and whose upload starts once they have landed (separate memory).
        self._reading: set[int] = set()
        self._storage_to_unit: dict[int, tuple[int, torch.dtype]] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self._stall = 0.0
        # One placeholder per parameter (a single NaN each), so a use of one names the parameter.
        self._placeholders: dict[int, torch.Tensor] = {}
        self._placeholder_slots: dict[int, tuple[int, ParamSlot]] = {}
        self._held: list[int] = []
        # Per unit, its parameters' views of its host cache: binding the cache (on the CPU, or a unit resident on the
        # device) reuses them instead of slicing it anew at every page-in.
        self._host_views: dict[int, tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]] = {}
        for unit in units.values():
            for slot in unit.slots:
                # The parameter's own dtype, not its compute copy's: code between steps reads ``p.dtype`` as plain
                # training holds it (the fp32 master's under mixed precision), and makes its own buffers of it.
                nan = torch.full((), float("nan"), dtype=slot.param.dtype, device=self.device.device)
                self._placeholders[id(slot.param)] = nan.expand(slot.shape)
                self._placeholder_slots[nan.data_ptr()] = (unit.index, slot)
                slot.param.data = self._placeholder(slot)

    def _placeholder(self, slot: ParamSlot) -> torch.Tensor:
        return self._placeholders[id(slot.param)]

    def holds_placeholder(self, param: nn.Parameter) -> bool:
        """Whether ``param`` holds a paging placeholder now (it is not resident)."""
        return param.data_ptr() in self._placeholder_slots

    def unbind(self, slot: ParamSlot) -> None:
        """Give a parameter that is not resident its placeholder again (code outside the engine had given it another
        tensor, whose value was taken over)."""
        slot.param.data = self._placeholder(slot)

    def placeholder_slot(self, tensor: torch.Tensor) -> tuple[int, ParamSlot] | None:
        """The unit and slot of the parameter whose placeholder ``tensor`` is (or views), ``None`` for any other."""
        return self._placeholder_slots.get(tensor.data_ptr()) if tensor.numel() else None

    def hold(self, unit: int) -> None:
        """Make one unit resident now, outside any block, until :meth:`release_all` (a parameter used where its
        block does not run)."""
        state = self._state[unit]
        if state.refs == 0 and state.flats is None:
            self._page_in(self.units[unit])
        state.refs += 1
        self._held.append(unit)
        self._complete(self.units[unit])
        if state.event is not None:
            self.device.wait(state.event)

    def hold_all(self) -> None:
        """:meth:`hold` every unit (a pass that keeps them all resident throughout)."""
        for unit in self.units:
            self.hold(unit)

    def take_stall_seconds(self) -> float:
        """Seconds page-ins waited for pending optimizer updates, since the last call."""
        stall, self._stall = self._stall, 0.0
        return stall

    @span("ratel/page_in")
    def _page_in(self, unit: Unit) -> None:
        if not unit.ready.is_set():
            start = time.perf_counter()
            unit.ready.wait()
            self._stall += time.perf_counter() - start
        state = self._state[unit.index]
        if self._store is None:
            self._upload(unit, dict(unit.host))
        else:
            state.staging = {dtype: self.device.host_buffer(n, dtype) for dtype, n in unit.numels.items()}
            # A page-in: the forward or backward of this block will wait for it. The staging buffers hold the keys'
            # bytes until the page-out (and after it while the pool keeps them), so a read of the same key meanwhile
            # (the optimizer's of an fp32 master, which is that shard's compute copy) copies them rather than reading
            # the drive again; a page-in copies in turn from such a read where it came first.
            state.keys = {s: unit.ready.compute_key(s) for s in self._unit_shards.get(unit.index, ())}
            state.reads = [
                self._store.read(key, s.compute_view(state.staging[s.dtype]), urgent=True, share=True)
                for s, key in state.keys.items()
            ]
            if self.device.separate_memory:
                self._reading.add(unit.index)
            else:
                # On CPU the staging buffers are the compute copies; their data is complete once acquire returns.
                self._bind(unit, state.staging)
        self.resident_bytes += unit.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _upload(self, unit: Unit, host: dict[torch.dtype, torch.Tensor]) -> None:
        if not self.device.separate_memory or unit.resident:
            # The host cache already is the compute device's memory (on the CPU, or a unit resident on the device):
            # compute on it rather than on a copy. The optimizer rewrites it only once every gradient of the unit is
            # in, when nothing reads it any more.
            self._bind(unit, host)
            return
        flats: dict[torch.dtype, torch.Tensor] = {}
        event = None
        for dtype, flat in host.items():
            flats[dtype], event = self.device.to_device(flat)
        self._bind(unit, flats)
        self._state[unit.index].event = event

    def _bind(self, unit: Unit, flats: dict[torch.dtype, torch.Tensor]) -> None:
        self._state[unit.index].flats = flats
        for slot, view in zip(unit.slots, self._views(unit, flats)):
            slot.param.data = view
        for dtype, flat in flats.items():
            self._storage_to_unit[flat.untyped_storage().data_ptr()] = (unit.index, dtype)

    def _views(self, unit: Unit, flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's view of ``flats``; those of the unit's host cache are made once (views of other buffers
        are not kept: they would keep the buffers alive)."""
        host = tuple(unit.host.values())
        if len(host) != len(flats) or any(flats.get(dtype) is not t for dtype, t in unit.host.items()):
            return [slot.view(flats) for slot in unit.slots]
        cached = self._host_views.get(unit.index)
        if cached is None or any(a is not b for a, b in zip(cached[0], host)):
            cached = self._host_views[unit.index] = (host, [slot.view(flats) for slot in unit.slots])
        return cached[1]

    def _start_uploads(self) -> None:
        """Start the upload of every unit whose store reads have all landed (a failed read is left for acquire)."""
        for index in list(self._reading):
            state = self._state[index]
            if not all(read.done() for read in state.reads):
                continue
            self._reading.discard(index)
            if any(read.exception() is not None for read in state.reads):
                continue
            state.reads = []
            assert state.staging is not None
            self._upload(self.units[index], state.staging)

    def _complete(self, unit: Unit) -> None:
        """Wait for the unit's store reads (raising their errors) and, with separate memory, start its upload."""
        state = self._state[unit.index]
        if not state.reads:
            return
        reads, state.reads = state.reads, []
        self._reading.discard(unit.index)
        for read in reads:
            read.result()
        if self.device.separate_memory:
            assert state.staging is not None
            self._upload(unit, state.staging)

    def _page_out(self, unit: Unit) -> None:
        state = self._state[unit.index]
        # Nothing here waits: the staging buffers go back to the pool, which reuses them once the reads still in
        # flight (a prefetch nobody used; its errors do not matter because the data is never used) and the upload's
        # copies recorded against them have completed.
        for dtype, buffer in (state.staging or {}).items():
            # The store goes on offering the buffer's bytes (see _page_in) until the pool reuses it: the optimizer's
            # read of an fp32 master may come well after the backward that paged it in, behind other updates.
            offer = None
            if self._store is not None:
                keys = tuple((s, key) for s, key in state.keys.items() if s.dtype == dtype)
                offer = _StagingOffer(self._store, buffer, unit.ready, keys)
            self.pool.give(buffer, after=state.reads, offer=offer)
        state.reads = []
        self._reading.discard(unit.index)
        for flat in (state.flats or {}).values():
            self._storage_to_unit.pop(flat.untyped_storage().data_ptr(), None)
            if not unit.resident:
                # Freed on the compute stream: the allocator must not hand this memory out while kernels queued on
                # the compute stream may still read it (a resident unit's memory is the device tier's, kept for the
                # run).
                self.device.keep_alive(flat)
        for slot in unit.slots:
            slot.param.data = self._placeholder(slot)
        state.staging = None
        state.keys = {}
        state.flats = None
        state.event = None
        self.resident_bytes -= unit.nbytes

    def _take(self, block: int) -> tuple[int, ...]:
        units = tuple(self.units_of(block))
        for u in units:
            state = self._state[u]
            if state.refs == 0 and state.flats is None:
                self._page_in(self.units[u])
            state.refs += 1
        return units

    def _drop(self, units: tuple[int, ...]) -> None:
        for u in units:
            state = self._state[u]
            state.refs -= 1
            if state.refs == 0:
                self._page_out(self.units[u])

    def prefetch(self, block: int) -> None:
        """Start paging ``block`` in without waiting; a later :meth:`acquire` takes over the reference.

        A block whose optimizer update is still running is left alone: prefetching it would block the caller.
        """
        self._start_uploads()
        if block in self._prefetched or block in self._acquired:
            return
        if not all(self.units[u].ready.is_set() for u in self.units_of(block)):
            return
        self._prefetched[block] = self._take(block)

    def acquire(self, block: int) -> None:
        """Make ``block``'s parameters usable by work queued on the current stream from now on."""
        units = self._prefetched.pop(block, None)
        if units != tuple(self.units_of(block)):
            # Not prefetched, or prefetched before the block gained a unit: take it whole (before dropping the
            # prefetch, so that units in both stay resident).
            stale, units = units, self._take(block)
            if stale is not None:
                self._drop(stale)
        self._acquired.setdefault(block, []).append(units)
        for u in units:
            unit = self.units[u]
            self._complete(unit)
            state = self._state[u]
            if state.event is not None:
                self.device.use(state.event, *(state.flats or {}).values())
        # After waiting for this block's reads, those of the blocks prefetched behind it may have landed too.
        self._start_uploads()

    def release(self, block: int) -> None:
        """Drop one reference taken by :meth:`acquire`; parameters leave the device with the last one."""
        self._start_uploads()
        taken = self._acquired.get(block)
        if not taken:
            return
        units = taken.pop()
        if not taken:
            del self._acquired[block]
        self._drop(units)

    def release_all(self) -> None:
        """Return every block (and every unit held on its own) to the host (end of a pass, or after an error)."""
        prefetched, self._prefetched = self._prefetched, {}
        for units in prefetched.values():
            self._drop(units)
        acquired, self._acquired = self._acquired, {}
        for taken in acquired.values():
            for units in taken:
                self._drop(units)
        held, self._held = self._held, []
        for unit in held:
            state = self._state[unit]
            state.refs -= 1
            if state.refs == 0:
                self._page_out(self.units[unit])

    def param_view(self, storage_ptr: int) -> tuple[int, torch.dtype] | None:
        """The unit and dtype whose resident device storage starts at ``storage_ptr``, if any."""
        return self._storage_to_unit.get(storage_ptr)

    def device_flat(self, unit_index: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The resident flat device tensor of one dtype of a unit, ``None`` when the unit is not resident."""
        flats = self._state[unit_index].flats
        return flats[dtype] if flats is not None else None
