"""A bounded, thread-safe record of named events and their times (backward, optimizer updates, reads ahead), and
the spans the plugin's work shows in a ``torch.profiler`` trace."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, TypeVar

import torch
from torch.autograd import _profiler_enabled

_F = TypeVar("_F", bound=Callable[..., Any])


def span(name: str) -> Callable[[_F], _F]:
    """Show every call of the decorated function as a span ``name`` in a ``torch.profiler`` trace (such as
    ``RatelProfiler(trace_step=N)`` writes). Only for work on the training thread: torch's profiler does not record
    threads that were running before it started (the optimizer's and the store's workers)."""

    def decorate(function: _F) -> _F:
        @functools.wraps(function)
        def spanned(*args: Any, **kwargs: Any) -> Any:
            # Entering a span costs microseconds even when nothing records it; this check, hundredths of one.
            if not _profiler_enabled():
                return function(*args, **kwargs)
            with torch.profiler.record_function(name):
                return function(*args, **kwargs)

        return spanned  # type: ignore[return-value]

    return decorate


class Timeline:
    """Events ``(name, time)`` in the order they were recorded; past ``capacity`` the oldest are dropped, so a long
    run keeps a constant amount of memory.

    Args:
        capacity: events kept.
        clock: the time source.
    """

    def __init__(self, capacity: int = 1 << 16, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._events: deque[tuple[str, float]] = deque(maxlen=capacity)
        self._recorded = 0
        self._lock = threading.Lock()

    def record(self, name: str) -> None:
        """Add the event ``name`` at the current time."""
        with self._lock:
            self._events.append((name, self.clock()))
            self._recorded += 1

    def since(self, cursor: int) -> tuple[list[tuple[str, float]], int]:
        """The events recorded after the first ``cursor`` (those still kept) and the cursor for the next call."""
        with self._lock:
            new = min(self._recorded - cursor, len(self._events))
            events = list(islice(self._events, len(self._events) - new, None)) if new > 0 else []
            return events, self._recorded

    def __iter__(self) -> Iterator[tuple[str, float]]:
        with self._lock:
            return iter(list(self._events))

    def __len__(self) -> int:
        return len(self._events)
