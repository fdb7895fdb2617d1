"""Finding parameters a model uses outside the block that pages them in.

A block's forward pages in the parameters of its own modules (and tied ones). Some models use a parameter elsewhere:
a head computed in the parent's forward as ``h @ embed.weight.T``, or diffusers' DiT calling
``transformer_blocks[0].norm1.emb`` after all blocks ran. There the parameter holds its paging placeholder, and its
NaN would flow into the result.

:class:`EscapeDetector` watches one forward pass (a ``TorchDispatchMode`` sees every op; the engine watches every
pass, since a model may take such a path only in some passes). When an op reads a placeholder, it pages that
parameter's unit in on the spot (held until the pass ends, backward included), so the pass computes with the real
values, and records the use with the module forwards that were running. The engine then makes the block that was
running there (or the model's outermost running module, as a new block) page that unit in from then on, so later
passes find nothing more.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_map

from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.trees import tensor_args
from lightning_ratel.runtime.units import ParamSlot

# The frame of every module call (``Module.__call__`` runs it, with or without hooks).
_CALL_IMPL = nn.Module._call_impl.__code__


def module_calls(frame: FrameType | None = None) -> Iterator[FrameType]:
    """The frames of the module calls running now (or from ``frame`` outward), innermost first."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            yield frame
        frame = frame.f_back


def running_modules(frame: FrameType | None = None) -> Iterator[nn.Module]:
    """The modules whose forward (or forward hooks) run now (or from ``frame`` outward), innermost first: their calls
    on the Python stack, read only when asked, which costs nothing while no one asks (hooks on every module would
    cost each of their calls)."""
    for call in module_calls(frame or sys._getframe(1)):
        yield call.f_locals["self"]


@dataclass(frozen=True)
class Escape:
    """A parameter used while its unit was not resident.

    Attributes:
        unit: the unit owning the parameter.
        slot: the parameter.
        modules: the module forwards running at that moment, outermost first (empty: outside any module's forward).
    """

    unit: int
    slot: ParamSlot
    modules: tuple[nn.Module, ...]


class EscapeDetector(TorchDispatchMode):
    """Pages in and records parameters read while their units are not resident, during one forward pass.

    Args:
        pager: the parameter pager (placeholders, and units held until it releases everything).
        unwatched: modules whose forwards are not watched (the detector leaves the mode stack while they run): blocks
            that ran watched before, whose own parameters and those of other units their forwards used are paged in
            around them. Every op costs a trip through Python while watched, and blocks run most of a model's ops.
        blocks: modules whose forwards running in the pass are recorded in :attr:`ran`.
    """

    def __init__(self, pager: ParameterPager, unwatched: Sequence[nn.Module] = (),
                 blocks: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        self.pager = pager
        self._unwatched = unwatched
        self._blocks = blocks
        # Per unwatched forward running: whether this detector left the mode stack for it.
        self._left: list[bool] = []
        self.escapes: list[Escape] = []
        # ``id`` of every module of ``blocks`` whose forward ran in the pass.
        self.ran: set[int] = set()
        self._handles: list[Any] = []
        self._seen: set[int] = set()

    def __enter__(self) -> EscapeDetector:
        self._handles = [module.register_forward_pre_hook(self._ran) for module in self._blocks]
        for module in self._unwatched:
            # First of the pre-hooks and last of the post-hooks: the block's own modes (the op tracker) go on the
            # stack above this detector's place and come off before it returns.
            self._handles.append(module.register_forward_pre_hook(self._pause, prepend=True))
            self._handles.append(module.register_forward_hook(self._resume, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        # A forward stopped by an exception that is not an ``Exception`` (Ctrl-C's KeyboardInterrupt) skips the
        # modules' always-called hooks: the detector may still be off the stack, left for an unwatched forward.
        off_stack = any(self._left)
        self._left = []
        if not off_stack:
            super().__exit__(*exc)

    def _ran(self, module: nn.Module, args: Any) -> None:
        self.ran.add(id(module))

    def _pause(self, module: nn.Module, args: Any) -> None:
        # Only from the top of the stack: a mode entered inside this pass (a user's) stays where it is, and so does
        # this detector then.
        top = _get_current_dispatch_mode() is self
        if top:
            TorchDispatchMode.__exit__(self, None, None, None)
        self._left.append(top)

    def _resume(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._left and self._left.pop():
            TorchDispatchMode.__enter__(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        found = {}
        for t in tensor_args(args, kwargs):
            slot = self.pager.placeholder_slot(t)
            if slot is not None:
                found[id(t)] = slot
        if found:
            for unit, slot in found.values():
                self.pager.hold(unit)
                if id(slot.param) not in self._seen:
                    self._seen.add(id(slot.param))
                    self.escapes.append(Escape(unit, slot, tuple(reversed(list(running_modules())))))

            def real(t: Any) -> Any:
                # The parameter itself now holds its values; a tensor viewing the placeholder cannot be rebuilt.
                if not isinstance(t, torch.Tensor) or id(t) not in found:
                    return t
                unit, slot = found[id(t)]
                if t is slot.param or self.pager.placeholder_slot(t) is None:
                    return t
                if t.shape == slot.shape:
                    return slot.param.data
                raise RuntimeError(
                    f"RatelStrategy: parameter {slot.name} is used through a view made while it was paged out; "
                    "use the parameter itself in the forward"
                )

            args, kwargs = tree_map(real, (args, kwargs))
        return func(*args, **kwargs)
