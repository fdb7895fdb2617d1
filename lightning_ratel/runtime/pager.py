"""Parameter paging: each block's compute copies live in a host cache and visit the device only while used.

A *unit* is the set of parameters owned by one block, laid out as one flat tensor per compute dtype so a page-in is
one copy (or one set of reads) per dtype. The compute copies live either in a host cache (one flat host tensor per
dtype, pinned on CUDA) or in the swap store, from which every page-in reads them. A block may also use parameters
owned by another block (tied weights); paging it in takes a reference on every unit it uses, so a shared parameter
stays resident while any user needs it.

Between uses a parameter's ``.data`` is a zero-stride NaN placeholder of the right shape, dtype and device: shape-
reading code (model summaries) still works, and any use outside the paged window shows up as NaN at once.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.pool import BufferPool

UnitReader = Callable[["Unit", dict[torch.dtype, torch.Tensor]], list[Future]]
"""Starts reading a unit's compute copies from the swap store into one flat host tensor per dtype."""


@dataclass
class ParamSlot:
    """Where one parameter's compute copy lives inside its unit."""

    name: str
    param: nn.Parameter
    dtype: torch.dtype
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class Unit:
    """The parameters owned by one block.

    Attributes:
        numels: elements of the flat tensor of each compute dtype (slots plus alignment padding).
        host: the host cache, one flat tensor per dtype; empty when the compute copies are read from the store.
        staging: host buffers a store read fills, held while the unit is resident.
        reads: store reads still filling ``staging``.
    """

    index: int
    slots: list[ParamSlot]
    numels: dict[torch.dtype, int]
    host: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    device_flats: dict[torch.dtype, torch.Tensor] | None = None
    staging: dict[torch.dtype, torch.Tensor] | None = None
    reads: list[Future] = field(default_factory=list)
    event: object = None
    refs: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's compute copies (what a page-in brings to the device)."""
        return sum(n * d.itemsize for d, n in self.numels.items())

    @property
    def host_nbytes(self) -> int:
        """Bytes of the unit's host cache."""
        return sum(t.numel() * t.element_size() for t in self.host.values())


class ParameterPager:
    """Makes blocks' parameters resident on the device on demand, with prefetch.

    Args:
        device: the compute device.
        units: every unit, indexed by owner block.
        block_units: for each block, the indices of the units its forward uses.
        wait_ready: blocks until a unit's pending optimizer updates are done (its compute copy is current where the
            pager reads it).
        is_ready: whether a unit has no pending optimizer update.
        read_unit: reads a unit's compute copies from the swap store; ``None`` pages in from the units' host cache.
    """

    def __init__(
        self,
        device: Device,
        units: dict[int, Unit],
        block_units: list[list[int]],
        wait_ready: Callable[[int], None] = lambda unit: None,
        is_ready: Callable[[int], bool] = lambda unit: True,
        read_unit: UnitReader | None = None,
    ) -> None:
        self.device = device
        self.units = units
        self.block_units = block_units
        self._wait_ready = wait_ready
        self._is_ready = is_ready
        self._read_unit = read_unit
        # Store reads land in these (pinned on CUDA); reusing them keeps page-ins off freshly mapped memory.
        self.pool = BufferPool(pin=device.is_cuda)
        self._prefetched: set[int] = set()
        self._acquired: dict[int, int] = {}
        self._storage_to_unit: dict[int, tuple[int, torch.dtype]] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self._placeholders: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        for unit in units.values():
            for slot in unit.slots:
                slot.param.data = self._placeholder(slot)

    def _placeholder(self, slot: ParamSlot) -> torch.Tensor:
        key = (slot.dtype, tuple(slot.shape))
        if key not in self._placeholders:
            nan = torch.full((), float("nan"), dtype=slot.dtype, device=self.device.device)
            self._placeholders[key] = nan.expand(slot.shape)
        return self._placeholders[key]

    def _page_in(self, unit: Unit) -> None:
        self._wait_ready(unit.index)
        if self._read_unit is None:
            self._upload(unit, unit.host)
        else:
            unit.staging = {dtype: self.pool.take(n, dtype) for dtype, n in unit.numels.items()}
            unit.reads = self._read_unit(unit, unit.staging)
            if not self.device.is_cuda:
                # On CPU the staging buffers are the compute copies; their data is complete once acquire returns.
                self._bind(unit, unit.staging)
        self.resident_bytes += unit.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _upload(self, unit: Unit, host: dict[torch.dtype, torch.Tensor]) -> None:
        if not self.device.is_cuda:
            # The host cache already is the compute device's memory: compute on it rather than on a copy. The
            # optimizer rewrites it only once every gradient of the unit is in, when nothing reads it any more.
            self._bind(unit, dict(host))
            return
        flats: dict[torch.dtype, torch.Tensor] = {}
        event = None
        for dtype, flat in host.items():
            flats[dtype], event = self.device.to_device(flat)
        self._bind(unit, flats)
        unit.event = event

    def _bind(self, unit: Unit, flats: dict[torch.dtype, torch.Tensor]) -> None:
        unit.device_flats = flats
        for slot in unit.slots:
            flat = flats[slot.dtype]
            slot.param.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        for dtype, flat in flats.items():
            self._storage_to_unit[flat.untyped_storage().data_ptr()] = (unit.index, dtype)

    def _complete(self, unit: Unit) -> None:
        """Wait for the unit's store reads (raising their errors) and, on CUDA, start its upload."""
        if not unit.reads:
            return
        reads, unit.reads = unit.reads, []
        for read in reads:
            read.result()
        if self.device.is_cuda:
            assert unit.staging is not None
            self._upload(unit, unit.staging)

    def _page_out(self, unit: Unit) -> None:
        if unit.reads:
            # A prefetch nobody used: its buffers go back to the pool only once the reads stop writing them. A read
            # error does not matter here because the data is never used.
            wait(unit.reads)
            unit.reads = []
        flats = unit.device_flats or {}
        for flat in flats.values():
            self._storage_to_unit.pop(flat.untyped_storage().data_ptr(), None)
            # Freed on the compute stream: the allocator must not hand this memory out while kernels queued on the
            # compute stream may still read it.
            self.device.keep_alive(flat)
        for slot in unit.slots:
            slot.param.data = self._placeholder(slot)
        if unit.staging is not None:
            if unit.event is not None:
                # The upload may still be reading the staging buffers; the next read into them must not overtake it.
                unit.event.synchronize()
            for buffer in unit.staging.values():
                self.pool.give(buffer)
        unit.staging = None
        unit.device_flats = None
        unit.event = None
        self.resident_bytes -= unit.nbytes

    def _take(self, block: int) -> None:
        for u in self.block_units[block]:
            unit = self.units[u]
            if unit.refs == 0 and unit.device_flats is None:
                self._page_in(unit)
            unit.refs += 1

    def _drop(self, block: int) -> None:
        for u in self.block_units[block]:
            unit = self.units[u]
            unit.refs -= 1
            if unit.refs == 0:
                self._page_out(unit)

    def prefetch(self, block: int) -> None:
        """Start paging ``block`` in without waiting; a later :meth:`acquire` takes over the reference.

        A block whose optimizer update is still running is left alone: prefetching it would block the caller.
        """
        if block in self._prefetched or self._acquired.get(block, 0):
            return
        if not all(self._is_ready(u) for u in self.block_units[block]):
            return
        self._take(block)
        self._prefetched.add(block)

    def acquire(self, block: int) -> None:
        """Make ``block``'s parameters usable by work queued on the current stream from now on."""
        if block in self._prefetched:
            self._prefetched.discard(block)
        else:
            self._take(block)
        self._acquired[block] = self._acquired.get(block, 0) + 1
        for u in self.block_units[block]:
            unit = self.units[u]
            self._complete(unit)
            if unit.event is not None:
                self.device.wait(unit.event)
                for flat in unit.device_flats.values():
                    self.device.keep_alive(flat)

    def release(self, block: int) -> None:
        """Drop one reference taken by :meth:`acquire`; parameters leave the device with the last one."""
        count = self._acquired.get(block, 0)
        if count == 0:
            return
        if count == 1:
            del self._acquired[block]
        else:
            self._acquired[block] = count - 1
        self._drop(block)

    def is_acquired(self, block: int) -> bool:
        return self._acquired.get(block, 0) > 0

    def release_all(self) -> None:
        """Return every block to the host (end of a pass, or after an error)."""
        for block in list(self._prefetched):
            self._prefetched.discard(block)
            self._drop(block)
        for block, count in list(self._acquired.items()):
            for _ in range(count):
                self._drop(block)
        self._acquired.clear()

    def param_view(self, storage_ptr: int) -> tuple[int, torch.dtype] | None:
        """The unit and dtype whose resident device storage starts at ``storage_ptr``, if any."""
        return self._storage_to_unit.get(storage_ptr)

    def device_flat(self, unit_index: int, dtype: torch.dtype) -> torch.Tensor:
        unit = self.units[unit_index]
        assert unit.device_flats is not None, f"unit {unit_index} is not resident"
        return unit.device_flats[dtype]
