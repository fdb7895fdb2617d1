"""Parameter paging: each block's compute copies live in a host cache and visit the device only while used.

A *unit* is the set of parameters owned by one block, laid out as one flat host tensor per compute dtype (pinned on
CUDA) so a page-in is one copy per dtype. A block may also use parameters owned by another block (tied weights);
paging it in takes a reference on every unit it uses, so a shared parameter stays resident while any user needs it.

Between uses a parameter's ``.data`` is a zero-stride NaN placeholder of the right shape, dtype and device: shape-
reading code (model summaries) still works, and any use outside the paged window shows up as NaN at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ratel.runtime.device import Device


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
    """The parameters owned by one block."""

    index: int
    slots: list[ParamSlot]
    host: dict[torch.dtype, torch.Tensor]
    device_flats: dict[torch.dtype, torch.Tensor] | None = None
    event: object = None
    refs: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())


class ParameterPager:
    """Makes blocks' parameters resident on the device on demand, with prefetch.

    Args:
        device: the compute device.
        units: every unit, indexed by owner block.
        block_units: for each block, the indices of the units its forward uses.
        wait_ready: blocks until a unit's pending optimizer updates are done (its host copy is current).
        is_ready: whether a unit has no pending optimizer update.
    """

    def __init__(
        self,
        device: Device,
        units: dict[int, Unit],
        block_units: list[list[int]],
        wait_ready: Callable[[int], None] = lambda unit: None,
        is_ready: Callable[[int], bool] = lambda unit: True,
    ) -> None:
        self.device = device
        self.units = units
        self.block_units = block_units
        self._wait_ready = wait_ready
        self._is_ready = is_ready
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
        flats: dict[torch.dtype, torch.Tensor] = {}
        event = None
        for dtype, host in unit.host.items():
            out = None if self.device.is_cuda else torch.empty_like(host)
            flats[dtype], event = self.device.to_device(host, out=out)
        unit.device_flats = flats
        unit.event = event
        for slot in unit.slots:
            flat = flats[slot.dtype]
            slot.param.data = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        for dtype, flat in flats.items():
            self._storage_to_unit[flat.untyped_storage().data_ptr()] = (unit.index, dtype)
        self.resident_bytes += unit.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def _page_out(self, unit: Unit) -> None:
        assert unit.device_flats is not None
        for flat in unit.device_flats.values():
            self._storage_to_unit.pop(flat.untyped_storage().data_ptr(), None)
            # Freed on the compute stream: the allocator must not hand this memory out while kernels queued on the
            # compute stream may still read it.
            self.device.keep_alive(flat)
        for slot in unit.slots:
            slot.param.data = self._placeholder(slot)
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
