"""Progress bars for the long whole-model passes (loading, checkpoints, exports), drawn like Lightning's own: with
rich (Lightning's bar when rich is installed, and a dependency of this package), else with tqdm."""

from __future__ import annotations

import sys
from typing import Any


class _Silent:
    """Stands in for a bar when none is shown."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class _RichBar:
    """A transient rich bar counting bytes."""

    def __init__(self, total: int, description: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
                                  console=Console(file=sys.stderr))
        self._task = self._progress.add_task(description, total=total)
        self._progress.start()

    def update(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def close(self) -> None:
        # rich's stop only tells its refresh thread to end: join it, so that no thread of the bar outlives the pass
        # (Lightning's own bar does the same; test suites such as Lightning's fail a test that leaves one running).
        thread = getattr(self._progress.live, "_refresh_thread", None)
        self._progress.stop()
        if thread is not None:
            thread.join()


def progress_bar(total_bytes: int, description: str, enabled: bool) -> Any:
    """A byte-counting bar on stderr (``update(nbytes)``, ``close()``), or one that shows nothing."""
    if not enabled:
        return _Silent()
    try:
        return _RichBar(total_bytes, description)
    except ImportError:
        from tqdm.auto import tqdm

        return tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                    file=sys.stderr, dynamic_ncols=True, leave=False)
