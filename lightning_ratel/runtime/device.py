"""One device abstraction for CPU and CUDA, with a simulation of CUDA's streams on the CPU for tests
(:mod:`lightning_ratel.runtime.simulation`).

Every mechanism in :mod:`lightning_ratel.runtime` moves data through this class, so the same code runs on a machine
without a GPU. Three modes:

- CUDA: host->device and device->host copies run on side streams, asynchronously, from and into pinned host memory.
- CPU: the device's memory is the host's, so copies are not made (a tensor is handed back as it is) and streams and
  events are no-ops.
- Simulated streams (a CPU device, for tests): host and device memory are separate as on CUDA, each side stream is a
  worker thread that runs its copies in order after random delays, events complete when the work queued before them
  has run, and memory is poisoned (NaN) when handed out and when CUDA's caching allocator could hand it out again. A
  missing wait then reads NaN, and a missing :meth:`Device.keep_alive` is reported as :class:`StreamOrderError`. Set
  ``RATEL_SIMULATE_STREAMS=1`` (or pass ``simulate_streams=True``) to run anything on it.

The rules every caller follows (the simulation checks them):

1. Whoever reads a copy's result waits for its event first: the compute stream through :meth:`Device.use`, a host
   thread through ``event.synchronize()``, a host->device copy of host memory that a device->host copy fills through
   ``to_device(..., after=event)``.
2. A tensor allocated on a copy stream and used on the compute stream is declared there (:meth:`Device.use` does it),
   so the caching allocator does not give its memory to the next copy while kernels queued on the compute stream still
   read it.
3. Host memory that copies touch comes from :attr:`Device.pool` (:meth:`Device.host_empty`,
   :meth:`Device.host_buffer`, and :meth:`Device.to_host` without ``out``). Every copy is recorded against it, so it
   is reused only once the copy has completed, without anyone blocking on it. The one exception is memory that the
   processes of a node share for the whole run (:meth:`Device.shared_host_empty`), never reused.

Threads: CUDA work (copies, events, allocations) is issued from the training thread and autograd's thread, which never
run a pass's work at the same time.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_ratel.runtime.hostmem import SharedHostMemory, aligned_empty
from lightning_ratel.runtime.pool import HostPool
from lightning_ratel.runtime.simulation import (
    SimEvent,
    SimStream,
    Simulation,
    StreamOrderError,
    pending_simulation_errors,
    simulating,
    take_simulation_errors,
)


class _DoneEvent:
    """Stands in for an event where every copy has completed when it returns (the CPU)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


DONE = _DoneEvent()


class Stopwatch:
    """Time between construction and :meth:`stop` on the host's clock, for work that is done when it returns."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._seconds = 0.0

    def stop(self) -> Stopwatch:
        """End the interval; returns ``self``."""
        self._seconds = time.perf_counter() - self._start
        return self

    def seconds(self) -> float:
        """The interval's length (0 before :meth:`stop`)."""
        return self._seconds


class _CudaStopwatch(Stopwatch):
    """Device time between two timing events on the current stream; read once the work in between has run."""

    def __init__(self) -> None:
        self._begin = torch.cuda.Event(enable_timing=True)
        self._begin.record()
        self._end: torch.cuda.Event | None = None

    def stop(self) -> Stopwatch:
        self._end = torch.cuda.Event(enable_timing=True)
        self._end.record()
        return self

    def seconds(self) -> float:
        """Waits for the interval's work (outside the steady state: profiling reads it once backward is over)."""
        if self._end is None:
            return 0.0
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1000.0


# ---------------------------------------------------------------------------------------------------- the device


class Device:
    """The compute device plus the side streams used for traffic to and from the host.

    Args:
        device: ``cpu`` or a CUDA device.
        simulate_streams: on a CPU device, simulate CUDA's streams (see the module docstring); ``None`` reads
            ``RATEL_SIMULATE_STREAMS``.

    Attributes:
        separate_memory: host and device memory differ, so data moves by copies (CUDA and the simulation).
        pool: the host memory that copies read and write (pinned on CUDA).
    """

    def __init__(self, device: torch.device, simulate_streams: bool | None = None) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"lightning_ratel runs on 'cpu' or 'cuda' devices, got {self.device}")
        if simulate_streams and self.is_cuda:
            raise ValueError("streams are simulated on a CPU device only")
        self.simulated = not self.is_cuda and (simulating() if simulate_streams is None else simulate_streams)
        self.separate_memory = self.is_cuda or self.simulated
        self.pool = HostPool(pin=self.is_cuda, poison=self.simulated)
        self._sim: Simulation | None = None
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            # Host->device (params, activations in) and device->host (grads, activations out) get their own streams
            # so both directions of the PCIe link are busy while the compute stream runs.
            self.h2d_stream: Any = torch.cuda.Stream(self.device)
            self.d2h_stream: Any = torch.cuda.Stream(self.device)
        elif self.simulated:
            self._sim = Simulation()
            self.h2d_stream = self._sim.h2d
            self.d2h_stream = self._sim.d2h
            weakref.finalize(self, self._sim.close)
        else:
            self.h2d_stream = None
            self.d2h_stream = None
        # Busy time of each direction of the link, for the measured step breakdown: on CPU copies are timed directly;
        # on CUDA each copy is bracketed by timing events read once they have completed.
        self._copy_seconds = {"h2d": 0.0, "d2h": 0.0}
        self._copy_lock = threading.Lock()
        self._copy_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._shared_pinned = 0

    # ------------------------------------------------------------------ host memory

    def host_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory held for the whole run (the host cache) that copies read: with separate memory a dedicated
        allocation of exactly this size from :attr:`pool` (pinned on CUDA); on CPU page-aligned memory on huge pages,
        which the swap store moves without a bounce buffer."""
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        if not self.separate_memory:
            return aligned_empty(math.prod(size), dtype, huge=True).view(size)
        return self.pool.allocate(math.prod(size), dtype).view(size)

    def device_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory held for the whole run (optimizer states and compute copies kept on the device). On the CPU
        it is :meth:`host_empty`'s memory, so a job run there takes the same path as on a GPU."""
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        if not self.separate_memory:
            return aligned_empty(math.prod(size), dtype, huge=True).view(size)
        return torch.empty(size, dtype=dtype, device=self.device)

    def shared_host_empty(self, memory: SharedHostMemory, shape: tuple[int, ...] | int,
                          dtype: torch.dtype) -> torch.Tensor:
        """Host memory held for the whole run in ``memory``, which the node's processes share (a host cache held once
        per node): its next allocation, pinned on CUDA (each process page-locks its own mapping of it). Never
        poisoned, even with simulated streams: another process may already have written it."""
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        tensor = memory.empty(math.prod(size), dtype, pin=self.is_cuda)
        if self.separate_memory:
            self._shared_pinned += tensor.untyped_storage().nbytes()
        return tensor.view(size)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A transient, page-aligned 1-D host buffer from :attr:`pool` (pinned on CUDA); its memory goes back to the
        pool once the tensor (every view of it) is gone and the copies recorded against it have completed."""
        return self.pool.take(numel, dtype)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked for copies (with simulated streams: the bytes that would be); memory
        shared with the node's other processes counts in each one's, as each page-locks its own mapping of it."""
        if not self.separate_memory:
            return 0
        return self.pool.nbytes + self.pool.dedicated_nbytes + self._shared_pinned

    # ------------------------------------------------------------------ streams and events

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` current for the work the enclosed code queues through this class (a no-op on CPU)."""
        if stream is None:
            yield
        elif self._sim is not None:
            local = self._sim.local
            previous = getattr(local, "stream", None)
            local.stream = stream
            try:
                yield
            finally:
                if previous is None:
                    del local.stream
                else:
                    local.stream = previous
        else:
            with torch.cuda.stream(stream):
                yield

    def record(self, stream: Any = None) -> Any:
        """An event marking all work queued so far on ``stream`` (default: the current stream)."""
        if self._sim is not None:
            self._check()
            return (stream or self._sim.current()).record()
        if not self.is_cuda:
            return DONE
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any) -> None:
        """Make the current stream wait for ``event`` without blocking the host (the simulated compute stream, which
        runs on the host, waits by blocking)."""
        if event is DONE:
            return
        if self._sim is not None:
            self._check()
            self._wait_on(self._sim.current(), event)
        elif self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_stream(self, stream: Any) -> None:
        """Make ``stream`` wait for the work queued so far on the current stream."""
        if stream is None:
            return
        if self._sim is not None:
            self._wait_on(stream, self.record())
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def wait_collective(self, work: Any, host_wait: Callable[[Any], None] | None = None) -> None:
        """Make the current stream wait for a collective (``work``, from ``async_op=True``): on CUDA without blocking
        the host (NCCL's ``wait`` orders the current stream after it); on the CPU the host waits, through
        ``host_wait`` where given (a wait that watches for a failed rank), and a simulated side stream waits in its own
        turn."""
        if self.is_cuda:
            work.wait()
            return
        if self._sim is not None:
            self._check()
            stream = self._sim.current()
            if not stream.synchronous:
                stream.submit(work.wait, delay=False)
                return
        (host_wait or (lambda w: w.wait()))(work)

    def keep_alive(self, tensor: torch.Tensor, stream: Any = None) -> None:
        """Tell the caching allocator that ``tensor`` is used on ``stream`` (default: current), so it is not reused
        while work on that stream may still read or write it."""
        if self._sim is not None:
            self._sim.keep_alive(tensor, stream or self._sim.current())
        elif self.is_cuda:
            tensor.record_stream(stream if stream is not None else torch.cuda.current_stream(self.device))

    def use(self, event: Any, *tensors: torch.Tensor) -> None:
        """Make the current stream wait for ``event`` and declare ``tensors`` (the copies it completes) used there:
        how the compute stream takes over what a copy stream produced."""
        self.wait(event)
        for tensor in tensors:
            self.keep_alive(tensor)

    def synchronize(self) -> None:
        """Block the host until every stream's queued work has run."""
        if self._sim is not None:
            for stream in (self._sim.h2d, self._sim.d2h):
                stream.record().synchronize()
            self._check()
        elif self.is_cuda:
            torch.cuda.synchronize(self.device)

    def _wait_on(self, stream: SimStream, event: SimEvent) -> None:
        assert self._sim is not None
        if isinstance(event, SimEvent):
            self._sim.waited(event, stream)
        if stream.synchronous:
            event.synchronize()
        else:
            stream.submit(event.synchronize, delay=False)

    def _check(self) -> None:
        """Raise what the simulation caught (on the thread that drives the device, where it stops training)."""
        if pending_simulation_errors():
            raise StreamOrderError("\n".join(take_simulation_errors()))

    # ------------------------------------------------------------------ copies

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Copy a device tensor to host memory on the device->host stream.

        On CPU the tensor already is in host memory and is returned as it is, so no copy is made.

        Args:
            tensor: what to copy; the copy starts after the work queued so far on the current stream.
            out: where to copy to; by default a buffer from :attr:`pool`.

        Returns:
            The host tensor and an event that completes when the copy has landed.
        """
        if not self.separate_memory:
            if out is None:
                return tensor, DONE
            start = time.perf_counter()
            out.copy_(tensor)
            self._copy_seconds["d2h"] += time.perf_counter() - start
            return out, DONE
        if out is None:
            out = self.pool.take(tensor.numel(), tensor.dtype).view(tensor.shape)
        self.wait_stream(self.d2h_stream)
        with self.on(self.d2h_stream):
            self._copy(out, tensor, "d2h")
            self.keep_alive(tensor)
            event = self.record()
        self.pool.record(out, event)
        return out, event

    def to_device(self, host: torch.Tensor, after: Any = None) -> tuple[torch.Tensor, Any]:
        """Copy a host tensor to a new device tensor on the host->device stream.

        On CPU the tensor already is the device's memory and is returned as it is, so no copy is made. The caller
        hands the result to the compute stream with :meth:`use`.

        Args:
            host: what to copy.
            after: the event of the copy that fills ``host`` (from :meth:`to_host`), which this copy waits for.
        """
        if not self.separate_memory:
            return host, DONE
        with self.on(self.h2d_stream):
            if after is not None:
                self.wait(after)
            out = self._empty(host.shape, host.dtype)
            self._copy(out, host, "h2d")
            event = self.record()
        self.pool.record(host, event)
        return out, event

    def _empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Device memory allocated on the current stream."""
        if self._sim is not None:
            return self._sim.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        """Queue ``dst.copy_(src)`` on the current stream."""
        if self._sim is None:
            with self._timed(direction):
                dst.copy_(src, non_blocking=True)
            return

        def copy() -> None:
            start = time.perf_counter()
            dst.copy_(src)
            with self._copy_lock:
                self._copy_seconds[direction] += time.perf_counter() - start

        self._sim.current().submit(copy)

    # ------------------------------------------------------------------ timing

    def stopwatch(self) -> Stopwatch:
        """Start timing the work queued on the current stream from now on (device time on CUDA)."""
        return _CudaStopwatch() if self.is_cuda else Stopwatch()

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
        with self._copy_lock:
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
