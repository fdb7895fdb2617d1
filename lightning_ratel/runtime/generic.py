"""Any per-parameter ``torch.optim.Optimizer`` as the CPU optimizer's update, with its state paged like Adam's moments.

AdamW and Adam run the native fused kernel (:mod:`~lightning_ratel.runtime.adamw`). Every other optimizer whose step
treats each parameter on its own runs its own arithmetic here: a scratch instance of the user's optimizer class, built
from the user's ``defaults`` and one group's current hyperparameters, steps views of a shard's flat fp32 master and
gradient shaped as the parameters, with ``optimizer.state`` filled with views of the state read from the store. torch's
built-ins thus run their single-tensor or foreach functions exactly as in plain training, and any other optimizer runs
its ``step`` on the shard's parameters.

What a parameter's state holds is found once per group and parameter shape by stepping a probe parameter
(:func:`probe_states`): each entry's name, shape and dtype (Adafactor's factored ``exp_avg_sq_row``/``_col`` are
smaller than the parameter, ``step`` is a 0-dim tensor or a Python number). A shard's state is one byte record per
slot in the store, each parameter's entries at fixed offsets, so it is read, checksummed, written and committed with
the step as one tensor. Python numbers are kept as 0-dim float64/int64 tensors and handed back as their own type.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ratel.runtime.units import Shard
from lightning_ratel.sizes import round_up

_ALIGN = 64
"""Bytes each parameter's record and each entry start on, so every entry can be viewed in its own dtype."""

_PYTHON_DTYPES = {int: torch.int64, bool: torch.int64, float: torch.float64}


class OptimizerStateError(ValueError):
    """A state entry the record cannot hold, or a step that left other entries than the probe found."""


@dataclass(frozen=True)
class StateEntry:
    """One named entry of a parameter's optimizer state and where it sits in the parameter's record.

    Attributes:
        name: the key in ``optimizer.state[param]``.
        shape: the tensor's shape (``()`` for a Python number).
        dtype: how it is stored.
        python: the Python type of a number kept as a 0-dim tensor (``type(None)`` for ``None``), ``None`` for a tensor.
        offset: bytes from the start of the parameter's record.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    python: type | None
    offset: int

    @property
    def nbytes(self) -> int:
        return 0 if self.python is type(None) else math.prod(self.shape) * self.dtype.itemsize

    def view(self, record: torch.Tensor) -> torch.Tensor:
        """This entry's bytes in ``record`` (a parameter's uint8 record) as a tensor of its shape and dtype."""
        return record[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class ParamStates:
    """The entries of one parameter's state and the bytes of its record.

    Attributes:
        entries: in the order the optimizer created them.
        nbytes: the record's bytes (a multiple of 64).
        initial: the optimizer's constructor fills this state (Adagrad's ``sum``), so a parameter never updated starts
            from what a fresh constructor gives it rather than from an empty state.
    """

    entries: tuple[StateEntry, ...]
    nbytes: int
    initial: bool

    @classmethod
    def of(cls, state: dict[str, Any], initial: bool) -> ParamStates:
        """The layout of a state as one step of the optimizer left it.

        Raises:
            OptimizerStateError: an entry is neither a tensor nor a Python number (nor ``None``).
        """
        described = []
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                described.append((str(name), tuple(value.shape), value.dtype, None))
            elif value is None or type(value) in _PYTHON_DTYPES:
                described.append((str(name), (), _PYTHON_DTYPES.get(type(value), torch.int64), type(value)))
            else:
                raise OptimizerStateError(f"its state entry {name!r} is a {type(value).__name__}, which cannot be "
                                          "paged (only tensors and Python numbers can)")
        return cls._laid_out(described, initial)

    @classmethod
    def _laid_out(cls, described: Sequence[tuple[str, tuple[int, ...], torch.dtype, type | None]],
                  initial: bool) -> ParamStates:
        entries = []
        offset = 0
        for name, shape, dtype, python in described:
            entry = StateEntry(name, shape, dtype, python, offset)
            entries.append(entry)
            offset = round_up(offset + entry.nbytes, _ALIGN)
        return cls(tuple(entries), offset, initial)

    def rescaled(self, probed: Sequence[int], shape: Sequence[int]) -> ParamStates:
        """This layout, found on a parameter of shape ``probed``, for a parameter of ``shape``: every state dimension
        equal to one of ``probed``'s (distinct primes) becomes the matching dimension of ``shape``."""
        where = {d: i for i, d in enumerate(probed)}
        return self._laid_out([(e.name, tuple(shape[where[d]] if d in where else d for d in e.shape), e.dtype,
                                e.python) for e in self.entries], self.initial)

    def load(self, record: torch.Tensor) -> dict[str, Any]:
        """The state held in ``record``: tensors are views of it (updated in place by the step), numbers are values."""
        state: dict[str, Any] = {}
        for entry in self.entries:
            if entry.python is None:
                state[entry.name] = entry.view(record)
            elif entry.python is type(None):
                state[entry.name] = None
            else:
                state[entry.name] = entry.python(entry.view(record).item())
        return state

    def store(self, state: dict[str, Any], record: torch.Tensor, what: str) -> None:
        """Write ``state`` into ``record`` (copying only what the step did not already update in place).

        Raises:
            OptimizerStateError: ``state`` has other entries, shapes or dtypes than the layout (``what`` names whose
                state it is).
        """
        if sorted(map(str, state)) != sorted(e.name for e in self.entries):
            raise OptimizerStateError(f"the optimizer state of {what} has entries {sorted(map(str, state))}, not "
                                      f"{sorted(e.name for e in self.entries)} as its first step gave a parameter of "
                                      "this shape; RatelStrategy pages a fixed state per parameter")
        for entry in self.entries:
            value = state[entry.name]
            if entry.python is type(None):
                continue
            target = entry.view(record)
            if entry.python is not None:
                target.fill_(value)
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != entry.shape or value.dtype != entry.dtype:
                raise OptimizerStateError(f"the optimizer state {entry.name!r} of {what} changed its shape or dtype")
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)


def rebuild(optimizer_type: type[torch.optim.Optimizer], defaults: dict[str, Any], settings: dict[str, Any],
            params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """An instance of the user's optimizer class over ``params``, with its defaults and one group's ``settings``.

    The group carries every setting; the constructor gets the defaults it takes as arguments (its checks and any
    attribute it derives from them), since some ``defaults`` are not arguments (AdamW's ``decoupled_weight_decay``).
    """
    return optimizer_type([{**settings, "params": list(params)}], **_constructor_arguments(optimizer_type, defaults))


def _constructor_arguments(optimizer_type: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(optimizer_type.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's current hyperparameters (everything but ``params``), as a scheduler left them."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


# Distinct primes above the size thresholds optimizers decide by (factoring only dimensions of 128 and more, as some
# Adafactor variants do): a state dimension equal to one of them is that dimension of the parameter.
_STAND_IN_DIMS = ((131, 137, 139, 149), (151, 157, 163, 167))


def probe_states(optimizer_type: type[torch.optim.Optimizer], defaults: dict[str, Any], settings: dict[str, Any],
                 shape: tuple[int, ...]) -> ParamStates:
    """The state layout one step of the optimizer gives an fp32 parameter of ``shape`` in a group with ``settings``.

    A large parameter is not probed at its own shape, which could take gigabytes (an embedding): the optimizer steps
    two stand-ins of the same rank whose dimensions are distinct primes, and each state dimension that equals one of
    the stand-in's dimensions is taken to follow it. Where the two stand-ins disagree on that rule, or the parameter is
    no larger than a stand-in, the probe takes the parameter's own shape.

    Raises:
        OptimizerStateError: its state holds something that cannot be paged.
    """
    rank = len(shape)
    stand_ins = [dims[:rank] for dims in _STAND_IN_DIMS]
    if 0 < rank <= len(_STAND_IN_DIMS[0]) and math.prod(shape) > math.prod(stand_ins[1]):
        first, second = (probe_shape(optimizer_type, defaults, settings, s) for s in stand_ins)
        if first.rescaled(stand_ins[0], stand_ins[1]) == second:
            return first.rescaled(stand_ins[0], shape)
    return probe_shape(optimizer_type, defaults, settings, shape)


def probe_shape(optimizer_type: type[torch.optim.Optimizer], defaults: dict[str, Any], settings: dict[str, Any],
                shape: tuple[int, ...]) -> ParamStates:
    """The state layout of one step on a zero parameter of ``shape`` itself (its memory taken for the call)."""
    param = torch.zeros(shape)
    param.grad = torch.full(shape, 1e-3)
    optimizer = rebuild(optimizer_type, defaults, settings, [param])
    initial = bool(optimizer.state.get(param))
    optimizer.step()
    return ParamStates.of(dict(optimizer.state.get(param, {})), initial)


class GenericUpdate:
    """The update of any per-parameter optimizer on a shard, and the layout of every shard's state record.

    Args:
        optimizer: the user's optimizer (its class and defaults are what the scratch instances are built from).
        shards: every shard the CPU optimizer holds.
        params: each parameter's state layout, by ``(group, shape)`` (from :func:`probe_states`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shards: Sequence[Shard],
                 params: dict[tuple[int, tuple[int, ...]], ParamStates]) -> None:
        self.optimizer_type = type(optimizer)
        self.defaults = dict(optimizer.defaults)
        self._params = params
        self._records: dict[int, tuple[list[int], int]] = {}
        for shard in shards:
            offsets, offset = [], 0
            for sp in shard.params:
                offsets.append(offset)
                offset += self.param_states(shard, sp.shape).nbytes
            self._records[shard.index] = (offsets, offset)
        # One scratch instance per group, built once: the worker only swaps its parameters, settings and state.
        settings = group_settings(optimizer)
        self._scratch = [rebuild(self.optimizer_type, self.defaults, s, [torch.zeros(1)]) for s in settings]

    def param_states(self, shard: Shard, shape: Sequence[int]) -> ParamStates:
        """The state layout of a parameter of ``shard`` with ``shape``."""
        return self._params[(shard.group, tuple(shape))]

    def nbytes(self, shard: Shard) -> int:
        """Bytes of ``shard``'s state record (one per slot in the store)."""
        return self._records[shard.index][1]

    def record(self, shard: Shard, position: int, blob: torch.Tensor) -> torch.Tensor:
        """The bytes of ``shard.params[position]``'s state in ``blob`` (the shard's record)."""
        offset = self._records[shard.index][0][position]
        return blob[offset : offset + self.param_states(shard, shard.params[position].shape).nbytes]

    def load(self, shard: Shard, position: int, blob: torch.Tensor) -> dict[str, Any]:
        """``shard.params[position]``'s state as ``optimizer.state`` holds it (tensors are views of ``blob``)."""
        sp = shard.params[position]
        return self.param_states(shard, sp.shape).load(self.record(shard, position, blob))

    def store(self, shard: Shard, position: int, state: dict[str, Any], blob: torch.Tensor) -> None:
        """Write one parameter's ``state`` into the shard's record ``blob``."""
        sp = shard.params[position]
        self.param_states(shard, sp.shape).store(state, self.record(shard, position, blob), sp.name)

    def update(self, shard: Shard, master: torch.Tensor, grad: torch.Tensor, blob: torch.Tensor,
               positions: Sequence[int], fresh: Sequence[bool], settings: dict[str, Any]) -> None:
        """One step of the user's optimizer on the parameters of ``shard`` at ``positions``, in place.

        Args:
            shard: the shard.
            master: its flat fp32 master.
            grad: its flat fp32 gradient.
            blob: its state record (read from the latest slot; written back by the caller).
            positions: the parameters that have a gradient.
            fresh: for each of ``positions``, whether that parameter was never updated (its state starts as the
                optimizer would start it).
            settings: the group's hyperparameters for this step.
        """
        scratch = self._scratch[shard.group]
        views, states = [], {}
        for position, new in zip(positions, fresh):
            sp = shard.params[position]
            view = master[sp.offset : sp.offset + sp.numel].view(sp.shape)
            view.grad = grad[sp.offset : sp.offset + sp.numel].view(sp.shape)
            layout = self.param_states(shard, sp.shape)
            if not new:
                states[view] = self.load(shard, position, blob)
            elif layout.initial:
                states[view] = dict(rebuild(self.optimizer_type, self.defaults, settings, [view]).state[view])
            views.append(view)
        group = scratch.param_groups[0]
        group.clear()
        group.update(settings, params=views)
        scratch.state = defaultdict(dict, states)
        try:
            scratch.step()
            for position, view in zip(positions, views):
                sp = shard.params[position]
                target = master[sp.offset : sp.offset + sp.numel]
                if view.data_ptr() != target.data_ptr():
                    # The step rebound the parameter's data instead of writing it in place.
                    target.copy_(view.reshape(-1))
                self.store(shard, position, scratch.state[view], blob)
        finally:
            group["params"] = []
            scratch.state = defaultdict(dict)
            for view in views:
                view.grad = None
