"""The byte-counting bars of the whole-model passes (:mod:`lightning_ratel.progress`)."""

from __future__ import annotations

import threading

from lightning_ratel.progress import progress_bar


def test_a_closed_bar_leaves_no_thread_running() -> None:
    before = set(threading.enumerate())
    bar = progress_bar(1000, "saving", enabled=True)
    bar.update(500)
    started = set(threading.enumerate()) - before
    bar.close()
    # rich redraws the bar from a thread of its own: the check below has one to find.
    assert started
    assert [t for t in started if t.is_alive()] == []
