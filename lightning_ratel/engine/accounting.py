"""Where a run's bytes are now, and where each training step's time went.

:class:`ByteAccount` sums what every part of the engine holds on the device, in host memory and on disk (the planner
starts its host budget from it). :class:`StepBreakdown` turns what the parts measured during one step (copy times,
store transfer intervals, optimizer updates on the timeline, stalls) into the per-resource busy times the report
draws against the plan's prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_ratel.io.checkpoint import ModelState
from lightning_ratel.runtime.activations import ActivationCache
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.hoststore import TieredStore
from lightning_ratel.runtime.optimizer import CpuAdam
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.timeline import Timeline
from lightning_ratel.runtime.units import Layout


class ByteAccount:
    """Bytes held by one run's parts.

    Args:
        device: the compute device.
        layout: units (host caches).
        pager: resident parameters and page-in buffers.
        cache: activations in host memory and on disk.
        state: the originals an evaluation run keeps.
        adam: the CPU optimizer's buffers (fitting only).
        store: the model-state swap store (fitting only).
        cache_units: with a host cache the node's ranks share, the units whose cache this rank counts (those it writes:
            the node's ranks together count each once); ``None``: every unit's.
    """

    def __init__(self, device: Device, layout: Layout, pager: ParameterPager, cache: ActivationCache,
                 state: ModelState, adam: CpuAdam | None, store: TensorStore | None,
                 cache_units: set[int] | None = None) -> None:
        self.cache_units = cache_units
        self.device = device
        self.layout = layout
        self.pager = pager
        self.cache = cache
        self.state = state
        self.adam = adam
        self.store = store

    def held(self) -> dict[str, int]:
        """Bytes held right now on the device, in host memory and on disk, and how many of the host's are pinned."""
        # A unit resident on a GPU holds device memory (counted there by the allocator); on the CPU, host memory.
        host = sum(u.host_nbytes for u in self.layout.units.values()
                   if (self.cache_units is None or u.index in self.cache_units)
                   and not (u.resident and self.device.is_cuda))
        pool = self.device.pool
        if self.device.separate_memory:
            # Every staging copy (activations, gradients, page-ins) is one of the pool's buffers.
            host += pool.nbytes
        else:
            # On CPU the activations kept for forwarding are tensors of their own, not the pool's, and the pool's
            # buffers in use are the resident compute copies, counted as the device's, and the activations read back
            # from the SSDs for backward (saved activations, which these figures leave out on the CPU).
            host += self.cache.host_bytes_in_use + pool.nbytes - pool.nbytes_in_use
        if self.adam is not None:
            host += self.adam.host_buffer_bytes
        if isinstance(self.store, TieredStore):
            host += self.store.host_bytes
            if self.store.device is not None and not self.device.is_cuda:
                # The device tier's states: host memory on the CPU.
                host += self.store.device.nbytes_allocated
        host += self.state.originals_nbytes
        disk = (self.store.nbytes_reserved if self.store is not None else 0) + self.cache.disk_bytes
        device = self.pager.resident_bytes
        if self.device.is_cuda:
            device = self.device.allocated_bytes()
        return {"device": device, "host": host, "disk": disk, "pinned": self.device.pinned_bytes}


def _union(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[start, end]``."""
    total = 0.0
    reach = start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


class StepBreakdown:
    """Measured busy time per resource over an interval.

    Args:
        device: the compute device (link copy times).
        timeline: optimizer updates (``update_start:<shard>`` / ``update_end:<shard>``).
        pager: stalls waiting for updates.
        cache: stalls waiting for swapped activations, and the activation store's transfers.
        store: the model-state store's transfers (fitting only).
    """

    def __init__(self, device: Device, timeline: Timeline, pager: ParameterPager, cache: ActivationCache,
                 store: TensorStore | None) -> None:
        self.device = device
        self.timeline = timeline
        self.pager = pager
        self.cache = cache
        self.store = store
        self._cursor = 0
        self._transferred = (0, 0)

    def take(self, start: float, end: float) -> dict[str, float]:
        """Where the time of ``[start, end]`` (a training step) went.

        ``compute`` is the wall time the training thread did not spend stalled waiting for an update or a read;
        ``h2d``/``d2h`` the busy time of each link direction; ``ssd`` the time any swap-file transfer ran;
        ``cpu_optimizer`` the time any AdamW update ran; ``idle`` the training thread's stalls (waiting for a page-in
        or a swapped activation). Resources overlap, so the parts do not add up to the wall time.
        ``ssd_read_bytes``/``ssd_write_bytes``: what the swap files transferred since the previous call.
        ``backward``: the time backward ran, and ``ssd_backward`` the part of it any swap-file transfer ran (where the
        disk idles: in backward, or in the rest of the step, the forward and the updates run after backward).
        """
        copies = self.device.take_copy_seconds()
        busy = self.cache.take_busy_intervals()
        if self.store is not None:
            busy.extend(self.store.take_busy_intervals())
        updates: list[tuple[float, float]] = []
        backward: list[tuple[float, float]] = []
        opened: dict[str, float] = {}
        events, self._cursor = self.timeline.since(self._cursor)
        for name, t in events:
            kind, _, shard = name.partition(":")
            if kind == "update_start":
                opened[shard] = t
            elif kind == "update_end" and shard in opened:
                updates.append((opened.pop(shard), t))
            elif kind == "backward_start":
                opened[kind] = t
            elif kind == "backward_end" and "backward_start" in opened:
                backward.append((max(start, opened.pop("backward_start")), min(end, t)))
        backward = [(a, b) for a, b in backward if b > a]
        stall = self.pager.take_stall_seconds() + self.cache.take_stall_seconds()
        read, written = self._take_transferred_bytes()
        wall = end - start
        # Copies take the training thread's time only where they run on it.
        copy_time = copies["h2d"] + copies["d2h"] if not self.device.separate_memory else 0.0
        return {
            "wall": wall,
            "compute": max(wall - stall - copy_time, 0.0),
            "h2d": copies["h2d"],
            "d2h": copies["d2h"],
            "ssd": _union(busy, start, end),
            "cpu_optimizer": _union(updates, start, end),
            "idle": stall,
            "ssd_read_bytes": float(read),
            "ssd_write_bytes": float(written),
            "backward": sum(b - a for a, b in backward),
            "ssd_backward": sum(_union(busy, a, b) for a, b in backward),
        }

    def begin(self) -> None:
        """A step starts: bytes the swap stores moved before it (loading, checkpoints, evaluation) are not its own."""
        self._transferred = self._transferred_totals()

    def _transferred_totals(self) -> tuple[int, int]:
        read, written = self.cache.transferred_bytes()
        if self.store is not None:
            read += self.store.bytes_read
            written += self.store.bytes_written
        return read, written

    def _take_transferred_bytes(self) -> tuple[int, int]:
        """Bytes read and written by both swap stores since the last call (or :meth:`begin`)."""
        before, self._transferred = self._transferred, self._transferred_totals()
        return self._transferred[0] - before[0], self._transferred[1] - before[1]
