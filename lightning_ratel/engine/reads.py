"""Parameters used between training steps: hooks and callbacks see and change the real values.

While a run trains, a parameter outside its block's forward and backward holds a paging placeholder (a NaN, see
:mod:`lightning_ratel.runtime.pager`). Lightning runs the user's code between the steps' forward and backward passes:
``on_train_batch_end``, ``on_validation_*``, ``on_save_checkpoint``, callbacks (an EMA of the weights, weight
averaging, pruning), the Tuner restoring its checkpoint. :class:`ParameterReads` is a ``TorchDispatchMode`` on the
stack for the whole run except while a forward or backward of the engine runs (it steps aside there, so the blocks'
ops pay nothing): every op that reads a placeholder is given the parameter's value of the last committed step in the
parameter's own dtype (the fp32 master under mixed precision, as plain Lightning holds it) on the parameters' device,
read from the swap files unit by unit (:data:`CACHED_UNITS` kept).

Writes go the same way: an in-place op on a parameter (``copy_``, ``mul_``, ``load_state_dict``) changes the unit's
values held here, and a parameter given another tensor (``param.data = ...``, as pruning's lottery ticket reset does)
is found before the next pass. A changed unit is written back as a committed step would leave it (its fp32 master and
compute copy; the optimizer's moments stay, as under plain training) before the next engine pass, before a step's
updates that run after backward (a write made after backward where they ran during it is refused: see the engine's
``finish_step``), before the engine's own whole-model work (checkpoints) and at the end of the run
(:meth:`ParameterReads.flush`). Values read are forgotten when a pass starts and when a step's updates are scheduled.

A view taken between steps (``p.detach()``) is the unit's value held here: a write through it reaches the parameter
while the unit is held (until the next pass, or until :data:`CACHED_UNITS` others were read since).
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
from torch.utils._pytree import tree_map

from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.trees import tensor_args, tensor_leaves
from lightning_ratel.runtime.units import ParamSlot

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
        assign: gives a unit new values (every parameter's, by parameter id), as a committed step would.
    """

    def __init__(self, pager: ParameterPager, values: Callable[[int], dict[int, torch.Tensor]],
                 settle: Callable[[], None], assign: Callable[[int, dict[int, torch.Tensor]], None]) -> None:
        super().__init__()
        self.pager = pager
        self._values = values
        self._settle = settle
        self._assign = assign
        self._cache: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()
        # Storage of every cached value -> its unit, to find writes into them.
        self._storages: dict[int, int] = {}
        # Units whose cached values were written and not yet given to the engine.
        self._dirty: set[int] = set()
        self._settled = False
        self._entered = False
        self._popped = False
        self._passing = False
        # Engine passes under way: a backward runs inside a manual training step's watched forward.
        self._pauses = 0
        self._bypass = 0

    # ------------------------------------------------------------------ where it applies

    def open(self) -> None:
        """Go on the dispatch stack (start of a run)."""
        TorchDispatchMode.__enter__(self)
        self._entered = True

    def close(self) -> None:
        """Leave the dispatch stack (end of a run); a mode still above it keeps it there, passing ops through."""
        self.flush()
        self.invalidate()
        self._bypass += 1
        if self._entered and not self._popped and _get_current_dispatch_mode() is self:
            TorchDispatchMode.__exit__(self, None, None, None)
        self._entered = self._popped = False

    def pause(self) -> None:
        """An engine pass starts: step off the stack (its blocks page their parameters in themselves), and forget the
        values read so far (the pass's update changes them). Under a mode entered later it stays, passing ops on.
        Passes nest (a manual training step's backward runs inside its forward): each :meth:`resume` undoes one
        pause, and the last one puts this mode back, after the modes the passes entered above it have left."""
        self.flush()
        self.invalidate()
        self._pauses += 1
        if not self._entered or self._popped or self._passing:
            return
        if _get_current_dispatch_mode() is self:
            TorchDispatchMode.__exit__(self, None, None, None)
            self._popped = True
        else:
            self._passing = True
            self._bypass += 1

    def resume(self) -> None:
        """The engine pass ended: back on the stack once no pass is left."""
        self._pauses -= 1
        if self._pauses:
            return
        if self._popped:
            TorchDispatchMode.__enter__(self)
            self._popped = False
        elif self._passing:
            self._passing = False
            self._bypass -= 1

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        """Let the engine's own whole-model work (checkpoints, exports) see the placeholders it handles itself, once the
        values written so far are the engine's."""
        if not self._bypass:
            self.flush()
        with self._through():
            yield

    def invalidate(self) -> None:
        """Forget the values read (an update may change them); call :meth:`flush` first to keep what was written."""
        self._cache.clear()
        self._storages.clear()
        self._dirty.clear()
        self._settled = False

    def written(self) -> bool:
        """Whether values were written since the last flush (what :meth:`flush` would give the engine)."""
        return bool(self._dirty) or any(self._rebound(unit.index, slot) for unit in self.pager.units.values()
                                        for slot in unit.slots)

    def _rebound(self, unit: int, slot: ParamSlot) -> bool:
        """Whether ``slot``'s parameter was given another tensor: neither its placeholder nor resident."""
        return not self.pager.holds_placeholder(slot.param) and self.pager.device_flat(unit, slot.dtype) is None

    def flush(self) -> None:
        """Give the engine every value written since the last flush: in-place writes into the values held here, and
        parameters given another tensor (``param.data = ...``), which get their placeholder back."""
        for unit in self.pager.units.values():
            for slot in unit.slots:
                if not self._rebound(unit.index, slot):
                    continue
                param = slot.param
                value = param.data
                self.pager.unbind(slot)
                if value.shape != slot.shape:
                    raise RuntimeError(
                        f"RatelStrategy: parameter {slot.name} was given a tensor of shape {tuple(value.shape)} "
                        f"between training steps (its shape is {tuple(slot.shape)}); RatelStrategy lays its "
                        "parameters out at setup and cannot change a shape during fit. Change the model's shapes "
                        "before fit.")
                with self._through():
                    self._unit_values(unit.index)[id(param)].copy_(value)
                self._dirty.add(unit.index)
                self._evict()
        dirty, self._dirty = self._dirty, set()
        for unit in sorted(dirty):
            self._assign(unit, self._cache[unit])

    @contextlib.contextmanager
    def _through(self) -> Iterator[None]:
        """Pass ops through (this mode's own copies)."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

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
        for slot in self.pager.units[unit].slots:
            self._storages[values[id(slot.param)].untyped_storage().data_ptr()] = unit
        return values

    def _evict(self) -> None:
        """Keep :data:`CACHED_UNITS` units (after an op: one op's arguments all stay), giving written ones to the
        engine."""
        while len(self._cache) > CACHED_UNITS:
            evicted, old = self._cache.popitem(last=False)
            if evicted in self._dirty:
                self._dirty.discard(evicted)
                self._assign(evicted, old)
            for value in old.values():
                self._storages.pop(value.untyped_storage().data_ptr(), None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._bypass:
            return func(*args, **kwargs)
        found = {}
        for t in tensor_args(args, kwargs):
            slot = self._placeholder(t)
            if slot is not None:
                found[id(t)] = slot
        written = self._written_units(func, args, kwargs, found) if found or self._storages else set()
        if not found and not written:
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
        try:
            return func(*args, **kwargs)
        finally:
            self._dirty.update(written)
            self._evict()

    def _placeholder(self, t: Any) -> Any:
        """The unit and slot of the placeholder ``t`` is (or views), ``None`` for anything else."""
        # Placeholders are dense, and stride 0 wherever they have a dimension; anything else is never one (and a
        # tensor without storage cannot be asked for its address).
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return None
        if t.dim() and 0 not in t.stride():
            return None
        return self.pager.placeholder_slot(t)

    def _written_units(self, func: Any, args: Any, kwargs: Any, found: dict[int, Any]) -> set[int]:
        """The units whose values ``func`` writes: through a placeholder (mapped to the value held here) or through a
        value handed out before."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return set()
        named = dict(zip((a.name for a in schema.arguments), args))
        named.update(kwargs)
        units = set()
        for argument in schema.arguments:
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for t in tensor_leaves(named.get(argument.name)):
                if id(t) in found:
                    units.add(found[id(t)][0])
                elif type(t) is torch.Tensor and t.layout == torch.strided and t.numel():
                    unit = self._storages.get(t.untyped_storage().data_ptr())
                    if unit is not None:
                        units.add(unit)
        return units
