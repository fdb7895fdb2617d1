"""Where a model's parameters get their first values: the interface a pretrained folder or a checkpoint being resumed
implements, read block by block while the engine materializes the model (:mod:`lightning_ratel.engine.materialize`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_ratel.runtime.units import Layout, ParamSlot


@dataclass(frozen=True)
class SourceValue:
    """A parameter's first value from a :class:`ValueSource`.

    Attributes:
        tensor: the value; valid only inside the :meth:`ValueSource.read` block that produced it.
        master: ``tensor`` is an fp32 master (a checkpoint's), used as is; otherwise it is a value that is cast to the
            parameter's own dtype first, as loading it into the module would.
    """

    tensor: torch.Tensor
    master: bool = False


class ValueSource(abc.ABC):
    """Where parameters (and persistent buffers) get their first values from, read one block at a time.

    Subclasses implement :meth:`prepare`, :meth:`provides` and :meth:`read`.
    """

    description = "loading"

    @abc.abstractmethod
    def prepare(self, names: dict[int, list[str]], layout: Layout, buffers: Sequence[str] = ()) -> None:
        """Match the model's parameters to what the source holds, before anything is allocated or written.

        Args:
            names: every name of each parameter (tied parameters have several), by parameter id.
            layout: the model's layout (which parameters are trainable).
            buffers: the qualified names of the model's persistent buffers.

        Raises:
            RatelConfigError: a tensor the model needs is missing or has the wrong shape.
        """

    @abc.abstractmethod
    def provides(self, param: nn.Parameter) -> bool:
        """Whether the source holds a value for ``param``."""

    @abc.abstractmethod
    def read(self, slots: Sequence[ParamSlot]) -> contextlib.AbstractContextManager[dict[int, SourceValue]]:
        """The values of those of ``slots`` the source provides, by parameter id, valid inside the ``with`` block."""

    def prefetch(self, slots: Sequence[ParamSlot]) -> None:
        """Start bringing the values of ``slots`` closer (the next block's, while this one is written); optional."""

    def buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffer values by qualified name (empty: buffers are initialized)."""
        return {}

    def pretrained_key(self, param: nn.Parameter) -> str | None:
        """The tensor name in the ``pretrained`` folder ``param``'s value came from, if it did."""
        return None
