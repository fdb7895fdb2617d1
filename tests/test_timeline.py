"""The bounded event record the engine and the CPU optimizer share."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from lightning_ratel.engine.accounting import StepBreakdown
from lightning_ratel.runtime.timeline import Timeline


def test_keeps_the_newest_events_and_reads_each_once() -> None:
    ticks = itertools.count()
    timeline = Timeline(capacity=4, clock=lambda: float(next(ticks)))
    for i in range(6):
        timeline.record(f"e{i}")
    # Two events fell off the front; a reader that had seen none gets what is kept.
    events, cursor = timeline.since(0)
    assert events == [("e2", 2.0), ("e3", 3.0), ("e4", 4.0), ("e5", 5.0)]
    assert cursor == 6 and len(timeline) == 4
    assert timeline.since(cursor) == ([], 6)
    timeline.record("e6")
    assert timeline.since(cursor) == ([("e6", 6.0)], 7)
    assert [name for name, _ in timeline] == ["e3", "e4", "e5", "e6"]


def test_a_steps_breakdown_splits_the_disks_busy_time_at_backward() -> None:
    """The disk's busy time in backward (``ssd_backward``, within ``backward``) and in the whole step (``ssd``), from
    the swap stores' transfer intervals and the timeline's backward marks, clipped to the step."""
    now = iter([1.0, 4.0, 6.0])
    timeline = Timeline(clock=lambda: next(now))
    timeline.record("backward_start")
    timeline.record("backward_end")
    timeline.record("update_start:0")
    busy = [(0.5, 2.0), (3.0, 5.0), (5.5, 7.5)]
    device = SimpleNamespace(take_copy_seconds=lambda: {"h2d": 0.0, "d2h": 0.0}, separate_memory=False)
    cache = SimpleNamespace(take_busy_intervals=lambda: list(busy), take_stall_seconds=lambda: 0.0,
                            transferred_bytes=lambda: (0, 0))
    pager = SimpleNamespace(take_stall_seconds=lambda: 0.0)
    breakdown = StepBreakdown(device, timeline, pager, cache, None)  # type: ignore[arg-type]
    took = breakdown.take(0.0, 7.0)
    assert took["backward"] == 3.0
    # In backward [1, 4]: 1-2 and 3-4; in the step [0, 7]: 0.5-2, 3-5 and 5.5-7.
    assert took["ssd_backward"] == 2.0 and took["ssd"] == 5.0
