"""A simulation of CUDA's streams and caching allocator on the CPU, for tests of the code that moves data.

A :class:`~lightning_ratel.runtime.device.Device` on the CPU uses it when ``RATEL_SIMULATE_STREAMS=1`` is set (or
``simulate_streams=True`` is passed): host and device memory are separate as on CUDA, each side stream is a worker
thread that runs its copies in order after random delays, events complete when the work queued before them has run,
and memory is poisoned (NaN) when handed out and when CUDA's caching allocator could hand it out again. A missing wait
then reads NaN, and a missing ``keep_alive`` is reported as :class:`StreamOrderError`. The rules it checks are in
:mod:`lightning_ratel.runtime.device`.
"""

from __future__ import annotations

import ctypes
import math
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SIMULATE_STREAMS_ENV = "RATEL_SIMULATE_STREAMS"
"""Environment variable that makes every CPU :class:`Device` simulate CUDA streams (any value but ``""``/``"0"``)."""

_SIM_MAX_DELAY = 0.002
"""Longest random delay, in seconds, before each copy a simulated stream runs."""

_SIM_ERRORS: list[str] = []
"""What the simulation caught and has not raised yet (a test's teardown reports what is left)."""


class StreamOrderError(RuntimeError):
    """The stream simulation caught memory used in a way that CUDA could corrupt (see the module docstring)."""


def pending_simulation_errors() -> bool:
    """Whether the simulation caught something not raised yet."""
    return bool(_SIM_ERRORS)


def take_simulation_errors() -> list[str]:
    """What simulated devices caught since the last call and have not raised (for a test's teardown)."""
    errors = list(_SIM_ERRORS)
    del _SIM_ERRORS[: len(errors)]
    return errors


def simulating() -> bool:
    """Whether ``RATEL_SIMULATE_STREAMS`` asks every CPU device to simulate streams."""
    return os.environ.get(SIMULATE_STREAMS_ENV, "") not in ("", "0")


class SimEvent:
    """Completes once the work queued on its stream before it has run.

    Attributes:
        stream: the stream it was recorded on.
        seq: how many work items had been queued on that stream when it was recorded.
    """

    def __init__(self, stream: SimStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def set(self) -> None:
        self._done.set()


class SimStream:
    """A simulated stream: a worker thread that runs work in the order it was queued, each copy after a random delay.

    The compute stream is ``synchronous``: its work runs at once on the thread that queues it, as torch's CPU kernels
    do, so it is complete whenever anything else looks.
    """

    def __init__(self, name: str, synchronous: bool = False, max_delay: float = _SIM_MAX_DELAY) -> None:
        self.name = name
        self.synchronous = synchronous
        self.seq = 0
        self._max_delay = max_delay
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], bool] | None] = queue.SimpleQueue()
        if not synchronous:
            threading.Thread(target=self._run, name=f"ratel-sim-{name}", daemon=True).start()

    def submit(self, work: Callable[[], None], delay: bool = True) -> None:
        """Queue ``work`` (``delay``: after a random pause, as a copy that takes a while)."""
        with self._lock:
            self.seq += 1
            if not self.synchronous:
                self._queue.put((work, delay))
                return
        work()

    def record(self) -> SimEvent:
        with self._lock:
            event = SimEvent(self, self.seq)
            if not self.synchronous:
                self._queue.put((event.set, False))
                return event
        event.set()
        return event

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        # Tensors made under inference mode (a validation pass) may be written only there; writes to others are fine.
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        pause = random.Random()
        while (item := self._queue.get()) is not None:
            work, delay = item
            # Not held while waiting for the next item: the work's tensors must die once it has run.
            del item
            if delay:
                time.sleep(pause.uniform(0.0, self._max_delay))
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - raised on the training thread by the next Device call
                _SIM_ERRORS.append(f"work on the simulated {self.name} stream failed: {err!r}")
            del work


@dataclass(eq=False)
class _SimBlock:
    """A device tensor the simulation allocated: what the caching allocator would know about it.

    Attributes:
        stream: the stream it was allocated on (freed memory goes back to that stream's pool).
        seq: work items queued on that stream before the allocation.
        what: shape and dtype, for messages.
        used_on: streams that waited for work queued on ``stream`` after the allocation, so they may use it.
        kept_on: streams it was declared on (``record_stream``).
    """

    stream: SimStream
    seq: int
    what: str
    used_on: set[SimStream] = field(default_factory=set)
    kept_on: set[SimStream] = field(default_factory=set)


class Simulation:
    """CUDA's streams and caching allocator, as far as the order of memory accesses goes."""

    def __init__(self) -> None:
        self.compute = SimStream("compute", synchronous=True)
        self.h2d = SimStream("host->device")
        self.d2h = SimStream("device->host")
        # Poisons freed memory once the work that may still use it has run, without holding up any stream.
        self.allocator = SimStream("allocator")
        self.local = threading.local()
        self._lock = threading.Lock()
        self._blocks: dict[int, _SimBlock] = {}

    def close(self) -> None:
        for stream in (self.h2d, self.d2h, self.allocator):
            stream.close()

    def current(self) -> SimStream:
        return getattr(self.local, "stream", self.compute)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Device memory allocated on the current stream, poisoned, and watched for its release."""
        stream = self.current()
        numel = math.prod(shape)
        nbytes = max(numel, 1) * dtype.itemsize
        raw = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
        # The storage keeps this array alive and nothing else does, so its end is the tensor's release.
        owner = (ctypes.c_uint8 * nbytes).from_address(raw.data_ptr())
        block = _SimBlock(stream, stream.seq, f"{tuple(shape)} {dtype}")
        with self._lock:
            self._blocks[raw.data_ptr()] = block
        finalizer = weakref.finalize(owner, self._free, block, raw)
        finalizer.atexit = False
        return torch.frombuffer(owner, dtype=torch.uint8).view(dtype)[:numel].view(shape)

    def waited(self, event: SimEvent, waiter: SimStream) -> None:
        """``waiter`` waited for ``event``: from now on it may use what ``event``'s stream allocated before."""
        if waiter is event.stream:
            return
        with self._lock:
            for block in self._blocks.values():
                if block.stream is event.stream and block.seq < event.seq:
                    block.used_on.add(waiter)

    def keep_alive(self, tensor: torch.Tensor, stream: SimStream) -> None:
        if tensor.numel() == 0:
            return
        with self._lock:
            block = self._blocks.get(tensor.untyped_storage().data_ptr())
            if block is not None:
                block.kept_on.add(stream)

    def _free(self, block: _SimBlock, raw: torch.Tensor) -> None:
        """The tensor's storage died (on any thread): reuse as the caching allocator would, and check the rules."""
        with self._lock:
            self._blocks.pop(raw.data_ptr(), None)
        unsafe = block.used_on - block.kept_on - {block.stream}
        if unsafe:
            names = ", ".join(sorted(s.name for s in unsafe))
            _SIM_ERRORS.append(
                f"a device tensor {block.what} allocated on the {block.stream.name} stream was used on the {names} "
                "stream and freed without keep_alive there: the caching allocator could hand its memory to the next "
                f"allocation on the {block.stream.name} stream while work queued on the {names} stream still reads it"
            )
        # Reuse follows the allocation stream's order, and waits for the streams the tensor was kept alive on.
        waits = [block.stream.record()] + [s.record() for s in block.kept_on if s is not block.stream]

        def poison() -> None:
            for event in waits:
                event.synchronize()
            raw.fill_(0xFF)

        self.allocator.submit(poison, delay=False)
