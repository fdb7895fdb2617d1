"""Exceptions raised by lightning_ratel.

Configuration problems are raised before the first step so that nothing is lost; I/O problems during training
carry the path and errno of the failing call so the user knows which drive to look at.
"""

from __future__ import annotations


class RatelConfigError(ValueError):
    """A setting or the environment cannot work; raised before training starts."""


class RatelPlanError(RatelConfigError):
    """The requested placement does not fit a memory or storage budget."""


class RatelStoreError(OSError):
    """A read or write of the swap store failed.

    ``errno`` and ``filename`` are those of the failing system call; the message also names the operation, the
    tensor key and the file offset.
    """
