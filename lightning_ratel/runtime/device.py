"""One device abstraction for CPU and CUDA.

Every mechanism in :mod:`lightning_ratel.runtime` moves data through this class, so the same code runs on a machine
without a GPU: on CPU, side streams and events become no-ops and pinned memory becomes ordinary memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class _DoneEvent:
    """Stands in for a CUDA event on CPU, where every copy has completed when it returns."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True


class Device:
    """The compute device plus the side streams used for traffic to and from the host.

    Args:
        device: ``cpu`` or a CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"lightning_ratel runs on 'cpu' or 'cuda' devices, got {self.device}")
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            # Host->device (params, activations in) and device->host (grads, activations out) get their own streams
            # so both directions of the PCIe link are busy while the compute stream runs.
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
        else:
            self.h2d_stream = None
            self.d2h_stream = None
        # Busy time of each direction of the link, for the measured step breakdown: on CPU copies are synchronous and
        # timed directly; on CUDA each copy is bracketed by timing events read once they have completed.
        self._copy_seconds = {"h2d": 0.0, "d2h": 0.0}
        self._copy_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def host_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for transfers: pinned on CUDA so copies are asynchronous, plain memory on CPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Run the enclosed work on ``stream`` (a no-op on CPU)."""
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def record(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | _DoneEvent:
        """An event marking all work queued so far on ``stream`` (default: the current stream)."""
        if not self.is_cuda:
            return _DoneEvent()
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: torch.cuda.Event | _DoneEvent) -> None:
        """Make the current stream wait for ``event`` without blocking the host."""
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` wait for the work queued so far on the current stream."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def keep_alive(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """Tell the caching allocator that ``tensor`` is used on ``stream`` (default: current), so it is not reused
        while work on that stream may still read or write it."""
        if self.is_cuda:
            tensor.record_stream(stream if stream is not None else torch.cuda.current_stream(self.device))

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """Copy a device tensor to host memory on the device->host stream.

        On CPU the tensor already is in host memory and is returned as it is, so no copy is made.

        Returns:
            The host tensor and an event that completes when the copy has landed.
        """
        if not self.is_cuda:
            if out is None:
                return tensor, _DoneEvent()
            start = time.perf_counter()
            out.copy_(tensor)
            self._copy_seconds["d2h"] += time.perf_counter() - start
            return out, _DoneEvent()
        if out is None:
            out = self.host_empty(tuple(tensor.shape), tensor.dtype)
        self.wait_stream(self.d2h_stream)
        with self.on(self.d2h_stream), self._timed("d2h"):
            out.copy_(tensor, non_blocking=True)
            self.keep_alive(tensor, self.d2h_stream)
            event = self.record(self.d2h_stream)
        return out, event

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Copy a host tensor to a new device tensor on the host->device stream.

        On CPU the tensor already is the device's memory and is returned as it is, so no copy is made. The caller
        makes the compute stream :meth:`wait` for the returned event before using the result.
        """
        if not self.is_cuda:
            return host, _DoneEvent()
        with self.on(self.h2d_stream):
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            with self._timed("h2d"):
                out.copy_(host, non_blocking=True)
            event = self.record(self.h2d_stream)
        return out, event

    @contextlib.contextmanager
    def _timed(self, direction: str) -> Iterator[None]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._copy_events.append((direction, start, end))

    def take_copy_seconds(self) -> dict[str, float]:
        """Seconds each direction of the link was busy copying since the last call (completed copies only)."""
        pending = []
        for direction, start, end in self._copy_events:
            if end.query():
                self._copy_seconds[direction] += start.elapsed_time(end) / 1000.0
            else:
                pending.append((direction, start, end))
        self._copy_events = pending
        taken, self._copy_seconds = self._copy_seconds, {"h2d": 0.0, "d2h": 0.0}
        return taken

    def allocated_bytes(self) -> int:
        """Bytes the caching allocator has handed out on the device now (0 on CPU, where nothing is tracked)."""
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def reset_peak(self) -> None:
        """Start a new window for :meth:`peak_bytes`."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        """The most bytes allocated on the device at once since :meth:`reset_peak` (0 on CPU)."""
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else 0
