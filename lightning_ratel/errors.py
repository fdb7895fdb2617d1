"""Exceptions raised by lightning_ratel.

Configuration problems are raised before the first step so that nothing is lost; what a model does that the plugin
cannot run, and that shows only once it runs, is raised at that point, before anything of the step is applied; I/O
problems during training carry the path and errno of the failing call so the user knows which drive to look at.
"""

from __future__ import annotations


class RatelConfigError(ValueError):
    """A setting or the environment cannot work; raised before training starts."""


class RatelPlanError(RatelConfigError):
    """The requested placement does not fit a memory or storage budget."""


class RatelModelError(RuntimeError):
    """The model did something during training that RatelStrategy cannot run (a parameter read outside every
    module's forward, or by another block only from some step on; clipping asked for after updates started). Raised
    when it happens, before anything of that step is applied; the message names the parameter or block and what to
    change."""


class RatelStoreError(OSError):
    """A read or write of the swap store failed.

    ``errno`` and ``filename`` are those of the failing system call; the message also names the operation, the
    tensor key and the file offset.
    """


class RatelRankFailed(RuntimeError):
    """With several ranks: another rank stopped on an error (named, with its error) or its process ended. Raised on the
    ranks that did not fail themselves, at their next collective rather than at the process group's timeout."""
