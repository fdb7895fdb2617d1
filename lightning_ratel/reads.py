"""Parameters read between training steps: hooks and callbacks see the real values.

While a run trains, a parameter outside its block's forward and backward holds a paging placeholder (a NaN, see
:mod:`lightning_ratel.runtime.pager`). Lightning runs the user's code between the steps' forward and backward passes:
``on_train_batch_end``, ``on_validation_*``, ``on_save_checkpoint``, callbacks (an EMA of the weights, weight
statistics). :class:`ParameterReads` is a ``TorchDispatchMode`` on the stack for the whole run except while a
forward or backward of the engine runs (it steps aside there, so the blocks' ops pay nothing): every op that reads a
placeholder is given the parameter's value of the last committed step in the parameter's own dtype (the fp32 master
under mixed precision, as plain Lightning holds it) on the parameters' device, read from the swap files unit by unit
(:data:`CACHED_UNITS` kept). A write to a placeholder, or to a value handed out this way, would not reach the swap
files: it raises, naming the parameter, the code writing and what to do (:meth:`ParameterReads._refuse_write` is where
a write path to the masters and the optimizer would go).

Values handed out are copies: a view taken between steps (``p.detach()``) keeps the values of that moment.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ratel.runtime.pager import ParameterPager

CACHED_UNITS = 2
"""Units whose values stay in host memory between reads: code walking the parameters in order reads each unit once,
and host memory holds about two units, not the model."""

# Frames of these are not the user's code that read a parameter: torch, this package, Python's own library.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep,
                 sysconfig.get_paths()["stdlib"] + os.sep)
_LIGHTNING = (f"{os.sep}lightning{os.sep}", f"{os.sep}pytorch_lightning{os.sep}")


def reader() -> str:
    """Where the user's code that runs the current op is: the innermost frame outside torch, Lightning, Python's
    library and this package."""
    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(_LIBRARY_DIRS) and not any(part in file for part in _LIGHTNING):
            return f"{frame.f_code.co_name} ({file}:{frame.f_lineno})"
        frame = frame.f_back
    return "Lightning"


class ParameterReads(TorchDispatchMode):
    """Gives ops run between steps the committed values of the parameters they read.

    Args:
        pager: the parameter pager (which tensors are placeholders).
        values: a unit's committed values, by parameter id, each in the parameter's own dtype and shape; called once
            every pending update has landed.
        settle: waits for every pending update (called before the first read after :meth:`invalidate`).
    """

    def __init__(self, pager: ParameterPager, values: Callable[[int], dict[int, torch.Tensor]],
                 settle: Callable[[], None]) -> None:
        super().__init__()
        self.pager = pager
        self._values = values
        self._settle = settle
        self._cache: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()
        # Storage of every cached value -> the parameter's name, to refuse writes into them.
        self._storages: dict[int, str] = {}
        self._settled = False
        self._entered = False
        self._popped = False
        self._passing = False
        self._bypass = 0

    # ------------------------------------------------------------------ where it applies

    def open(self) -> None:
        """Go on the dispatch stack (start of a run)."""
        TorchDispatchMode.__enter__(self)
        self._entered = True

    def close(self) -> None:
        """Leave the dispatch stack (end of a run); a mode still above it keeps it there, passing ops through."""
        self.invalidate()
        self._bypass += 1
        if self._entered and not self._popped and _get_current_dispatch_mode() is self:
            TorchDispatchMode.__exit__(self, None, None, None)
        self._entered = self._popped = False

    def pause(self) -> None:
        """An engine pass starts: step off the stack (its blocks page their parameters in themselves), and forget the
        values read so far (the pass's update changes them). Under a mode entered later it stays, passing ops on."""
        self.invalidate()
        if not self._entered or self._popped or self._passing:
            return
        if _get_current_dispatch_mode() is self:
            TorchDispatchMode.__exit__(self, None, None, None)
            self._popped = True
        else:
            self._passing = True
            self._bypass += 1

    def resume(self) -> None:
        """The engine pass ended: back on the stack."""
        if self._popped:
            TorchDispatchMode.__enter__(self)
            self._popped = False
        elif self._passing:
            self._passing = False
            self._bypass -= 1

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        """Let the engine's own whole-model work (checkpoints, exports) see the placeholders it handles itself."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    def invalidate(self) -> None:
        """Forget the values read (an update may change them)."""
        self._cache.clear()
        self._storages.clear()
        self._settled = False

    # ------------------------------------------------------------------ ops

    def _unit_values(self, unit: int) -> dict[int, torch.Tensor]:
        values = self._cache.get(unit)
        if values is not None:
            self._cache.move_to_end(unit)
            return values
        if not self._settled:
            self._settle()
            self._settled = True
        # Where the parameters live during fit (the placeholders' device), as the code reading them expects.
        device = self.pager.device.device
        values = {pid: value.to(device) for pid, value in self._values(unit).items()}
        self._cache[unit] = values
        while len(self._cache) > CACHED_UNITS:
            for value in self._cache.popitem(last=False)[1].values():
                self._storages.pop(value.untyped_storage().data_ptr(), None)
        for slot in self.pager.units[unit].slots:
            self._storages[values[id(slot.param)].untyped_storage().data_ptr()] = slot.name
        return values

    def _refuse_write(self, func: Any, name: str) -> None:
        raise RuntimeError(
            f"RatelStrategy: {func} writes parameter {name} between training steps, in {reader()}. During fit the "
            "parameters' values live in RatelStrategy's swap files, and a write there would not reach them (nor the "
            "optimizer). Change parameters inside training_step's computation (through the optimizer), or before or "
            "after fit."
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._bypass:
            return func(*args, **kwargs)
        found = {}
        for t in tree_flatten((args, kwargs))[0]:
            slot = self._placeholder(t)
            if slot is not None:
                found[id(t)] = slot
        if found or self._storages:
            self._check_writes(func, args, kwargs, found)
        if not found:
            return func(*args, **kwargs)

        def real(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or id(t) not in found:
                return t
            unit, slot = found[id(t)]
            value = self._unit_values(unit)[id(slot.param)]
            if t.shape == slot.shape:
                return value
            raise RuntimeError(
                f"RatelStrategy: parameter {slot.name} is used through a view made while it was paged out (shape "
                f"{tuple(t.shape)}), in {reader()}; use the parameter itself"
            )

        args, kwargs = tree_map(real, (args, kwargs))
        return func(*args, **kwargs)

    def _placeholder(self, t: Any) -> Any:
        """The unit and slot of the placeholder ``t`` is (or views), ``None`` for anything else."""
        # Placeholders are dense, and stride 0 wherever they have a dimension; anything else is never one (and a
        # tensor without storage cannot be asked for its address).
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return None
        if t.dim() and 0 not in t.stride():
            return None
        return self.pager.placeholder_slot(t)

    def _check_writes(self, func: Any, args: Any, kwargs: Any, found: dict[int, Any]) -> None:
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        named = dict(zip((a.name for a in schema.arguments), args))
        named.update(kwargs)
        for argument in schema.arguments:
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for t in tree_flatten(named.get(argument.name))[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                if id(t) in found:
                    self._refuse_write(func, found[id(t)][1].name)
                if type(t) is torch.Tensor and t.layout == torch.strided and t.numel():
                    name = self._storages.get(t.untyped_storage().data_ptr())
                    if name is not None:
                        self._refuse_write(func, name)
