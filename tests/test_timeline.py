"""The bounded event record the engine and the CPU optimizer share."""

from __future__ import annotations

import itertools

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
