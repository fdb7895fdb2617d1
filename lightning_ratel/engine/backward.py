"""The engine's backward pass is autograd's backward itself, found where the training thread starts it.

Lightning runs the user's code around the backward it asks for: a ``LightningModule.backward`` override may read the
parameters before and after its ``super().backward(loss)``, and under manual optimization ``training_step`` may call
``loss.backward()`` itself instead of ``self.manual_backward(loss)``. Only autograd's pass is the engine's backward
(blocks page their parameters in, :class:`~lightning_ratel.engine.reads.ParameterReads` steps aside, the gradients go
to the CPU optimizer); the code around it reads the parameters as code between steps does.

:class:`BackwardCalls` is a ``TorchFunctionMode`` on the stack while such code runs. It sees ``Tensor.backward`` called
on the training thread, and runs the call inside the engine's pass. Inside its handler the mode is off the stack, so
the backward runs without it: autograd hands the modes of the thread that started it to its own threads (on a GPU,
backward's hooks run there), and nothing is switched from those threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class BackwardCalls(TorchFunctionMode):
    """Runs each ``Tensor.backward`` called while it is open as one backward pass of the engine.

    Args:
        begin: the pass starts (training thread, before autograd runs).
        end: the pass ended.
        stopped: the backward raised (the error goes on to the caller).
    """

    def __init__(self, begin: Callable[[], None], end: Callable[[], None], stopped: Callable[[], None]) -> None:
        super().__init__()
        self._begin = begin
        self._end = end
        self._stopped = stopped
        self._depth = 0

    def open(self) -> None:
        """Code that may start a backward runs from now on; openings nest (the mode is on the stack once)."""
        if self._depth == 0:
            TorchFunctionMode.__enter__(self)
        self._depth += 1

    def close(self) -> None:
        """Undo one :meth:`open`."""
        self._depth -= 1
        if self._depth == 0:
            TorchFunctionMode.__exit__(self, None, None, None)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.Tensor.backward:
            return func(*args, **kwargs)
        self._begin()
        try:
            result = func(*args, **kwargs)
        except BaseException:
            self._stopped()
            raise
        self._end()
        return result
