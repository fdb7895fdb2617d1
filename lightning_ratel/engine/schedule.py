"""Block scheduling: the model's own execution drives paging and activation placement.

Forward: a pre-hook on each block pages its parameters in (and prefetches the blocks after it in execution order),
opens the activation cache's saved-tensor hooks for it and, where its placement tells ops apart, an
:class:`~lightning_ratel.runtime.recompute.OpTracker`; a post-hook closes them, releases the parameters and hooks the
block's outputs for backward.

Backward: backward reaches a block when the gradient of one of its outputs is computed. That hook is the one place
that knows backward's position: it keeps the block's parameters resident, releases the blocks behind it (telling the
activation cache it is done with them) and prefetches parameters and swapped activations for the blocks ahead. The
pager and the cache are told; neither tracks the position itself.

The first pass also teaches the real execution order (which may differ from the order blocks were registered in),
used for prefetching from then on.

Threads: forward hooks run on the training thread, backward hooks on autograd's thread; both drive the pager and the
cache, which are touched by nothing else while a pass runs.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn

from lightning_ratel.engine.blocks import Block
from lightning_ratel.runtime.activations import ActivationCache
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.escapes import module_calls, running_modules
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.recompute import ForwardRecord, ModuleState, OpTracker
from lightning_ratel.runtime.timeline import Timeline
from lightning_ratel.runtime.trees import tensor_leaves


class TrainingState(enum.Enum):
    """Where the pass is, for the scheduler's bookkeeping."""

    IDLE = "idle"
    """Between passes: nothing is resident for a pass, nothing is held for backward."""
    FORWARD = "forward"
    """A forward with autograd recording has started and its backward has not."""
    BACKWARD = "backward"
    """Backward runs: blocks are acquired as backward reaches them."""


class BlockObserver(Protocol):
    """Told, from the scheduler's hooks, where each block's forward and backward start and end (see
    :class:`BlockTimer`)."""

    def paged_in(self, seconds: float) -> None:
        """A block's forward waited ``seconds`` for its parameters before it started."""

    def forward_started(self, b: int) -> None: ...

    def forward_ended(self, b: int, output: Any) -> None: ...

    def backward_started(self) -> None: ...

    def backward_reached(self, b: int | None) -> None:
        """Backward moved on to block ``b`` (``None``: backward ended)."""


class BlockTimer:
    """Times each block's forward and backward, with the device synchronised around them, and the peak of device
    memory its backward reaches beyond what was allocated when it began: the profile of a step, for the planner.

    Args:
        device: the compute device.

    Attributes:
        block_times: per block: ``forward`` and ``backward`` seconds (summed over the passes timed), ``backward_peak``
            bytes, and the bytes and elements of its output (for the last block the logits, whose loss and gradient
            cost device memory outside any block).
        step_started: when the micro-batch now timed started (:meth:`step_start`), ``None`` before.
        backward_began: when its backward started, ``None`` before.
        forward_waits: seconds its forward waited for parameters before blocks started (the pager's waits, and on a
            device the page-ins' copies still queued when a block starts): the cost model charges those to the link
            and the disks, not to the work between the blocks.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.block_times: dict[int, dict[str, float]] = {}
        self.step_started: float | None = None
        self.backward_began: float | None = None
        self.forward_waits = 0.0
        self._current: int | None = None
        self._entered = 0.0
        self._allocated = 0

    def step_start(self) -> None:
        """A micro-batch starts: its forward, blocks and what runs around them, is timed from here."""
        self.device.synchronize()
        self.step_started = time.perf_counter()
        self.backward_began = None
        self.forward_waits = 0.0

    def paged_in(self, seconds: float) -> None:
        if self.backward_began is None:
            self.forward_waits += seconds

    def forward_started(self, b: int) -> None:
        queued = time.perf_counter()
        self.device.synchronize()
        now = time.perf_counter()
        self.paged_in(now - queued)
        self.block_times.setdefault(b, {})["forward_start"] = now

    def forward_ended(self, b: int, output: Any) -> None:
        self.device.synchronize()
        times = self.block_times.setdefault(b, {})
        times["forward"] = times.get("forward", 0.0) + time.perf_counter() - times.pop("forward_start")
        tensors = tensor_leaves(output)
        times["output_bytes"] = float(sum(t.numel() * t.element_size() for t in tensors))
        times["output_elements"] = float(sum(t.numel() for t in tensors))

    def backward_started(self) -> None:
        self.device.synchronize()
        self._current = None
        self._entered = self.backward_began = time.perf_counter()
        self._allocated = self.device.allocated_bytes()
        self.device.reset_peak()

    def backward_reached(self, b: int | None) -> None:
        """Charge the time since backward last changed block to that block."""
        self.device.synchronize()
        now = time.perf_counter()
        if self._current is not None:
            times = self.block_times.setdefault(self._current, {})
            times["backward"] = times.get("backward", 0.0) + now - self._entered
            peak = float(self.device.peak_bytes() - self._allocated)
            times["backward_peak"] = max(times.get("backward_peak", 0.0), peak)
        self._current = b
        self._entered = now
        self._allocated = self.device.allocated_bytes()
        self.device.reset_peak()


class BlockScheduler:
    """Installs the block hooks and keeps each pass's state.

    Args:
        blocks: the model's blocks.
        pager: pages parameters in and out.
        cache: places saved activations.
        device: the compute device (for profiling's synchronisation).
        prefetch_depth: blocks fetched ahead of the one computing.
        timeline: where backward's start and end are recorded.
        check: raises a pending failure of the optimizer before a block runs (an I/O error surfaces at once).
    """

    def __init__(self, blocks: Sequence[Block], pager: ParameterPager, cache: ActivationCache, device: Device,
                 prefetch_depth: int, timeline: Timeline, check: Callable[[], None] = lambda: None) -> None:
        self.blocks = blocks
        self.pager = pager
        self.cache = cache
        self.device = device
        self.prefetch_depth = prefetch_depth
        self.timeline = timeline
        self._check = check
        self.state = TrainingState.IDLE
        self.order = [b.index for b in blocks]
        self._order_pass: list[int] = []
        self._hook_stack: list[tuple[int, list[Any]]] = []
        # Each block submodule's path inside its block, for op names (tracked blocks only), and the last module call
        # whose path was asked for.
        self._paths: dict[int, str] = {}
        self._path_call: FrameType | None = None
        self._path = ""
        self._held: list[int] = []
        self._current: int | None = None
        # Told where each block's forward and backward start and end (the planner's timer while it profiles).
        self.observer: BlockObserver | None = None
        # Every unit is held through the pass (see ``RatelEngine.watch_forward``): the blocks' hooks have nothing to
        # page in, place or learn, and each backward of the pass holds them again (a ``backward`` override may run
        # two on one graph). Set for each pass, it lasts until the next.
        self.bound = False
        # A forward of the engine's runs (``RatelEngine.watch_forward``); with ``aside_between_steps``, only then and in
        # backward do the hooks page blocks in.
        self.forward_open = False
        # Some compute copy is not its parameter's own dtype (mixed precision): a forward between steps outside
        # autocast (a callback's) would mix 16-bit copies with fp32 values and differ from plain training, so the hooks
        # leave it to ``ParameterReads``, which hands it the committed values in the parameters' own dtypes. Under
        # autocast the compute copies are what autocast makes of those values, and the blocks page them in.
        self.aside_between_steps = False
        # Off while the engine looks for parameters used outside their block (see ``RatelEngine.watch_forward``).
        self.prefetching = True
        self._handles: list[Any] = []
        for block in blocks:
            self._install(block)

    def _install(self, block: Block) -> None:
        b = block.index
        self._handles.append(block.module.register_forward_pre_hook(
            functools.partial(self._pre_forward, b), with_kwargs=True))
        self._handles.append(
            block.module.register_forward_hook(functools.partial(self._post_forward, b), always_call=True))
        if not block.direct_only:
            self._paths.update({id(m): name for name, m in block.module.named_modules() if name})

    def add_block(self, block: Block) -> None:
        """Schedule a block found after the start (already one of the blocks); it runs last until a pass teaches its
        place."""
        self._install(block)
        self.order.append(block.index)

    def position(self, block: int) -> int:
        """``block``'s place in the execution order (past the end if it has not run)."""
        try:
            return self.order.index(block)
        except ValueError:
            return len(self.order)

    # ------------------------------------------------------------------ forward

    def _op_path(self) -> str:
        """The path inside its block of the innermost block submodule whose forward runs now (``""``: the block's own
        forward). Read off the Python stack, only for the ops of tracked forwards: hooks on every submodule would cost
        each of their calls in every forward. The ops of one submodule call share the answer."""
        call = next(module_calls(), None)
        if call is None:
            return ""
        if call is self._path_call:
            return self._path
        block = self.blocks[self._hook_stack[-1][0]].module if self._hook_stack else None
        path = ""
        for module in running_modules(call):
            if module is block:
                break
            if id(module) in self._paths:
                path = self._paths[id(module)]
                break
        # Kept until the block's forward ends (the frame holds the call's locals).
        self._path_call, self._path = call, path
        return path

    def _stands_aside(self) -> bool:
        """Whether a block's forward now leaves its parameters to others: the held pass, or ``ParameterReads``."""
        if self.forward_open or self.state is TrainingState.BACKWARD:
            return self.bound
        return self.aside_between_steps and not torch.is_autocast_enabled(self.device.device.type)

    def _pre_forward(self, b: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._check()
        if self._stands_aside():
            return
        waiting = time.perf_counter()
        self.pager.acquire(b)
        if self.observer is not None:
            self.observer.paged_in(time.perf_counter() - waiting)
        # A forward run again inside backward (the user's own torch.utils.checkpoint) neither prefetches the blocks
        # after it (backward goes the other way) nor changes the pass's order.
        if self.state is not TrainingState.BACKWARD:
            if self.prefetching:
                pos = self.position(b)
                for nxt in self.order[pos + 1 : pos + 1 + self.prefetch_depth]:
                    self.pager.prefetch(nxt)
            if not torch.is_grad_enabled():
                return
            self.state = TrainingState.FORWARD
            self._order_pass.append(b)
        self._hook(b, module, args, kwargs)

    def _hook(self, b: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Open the saved-tensor hooks (and op tracking) for one recorded forward of block ``b``."""
        if not torch.is_grad_enabled():
            return
        contexts: list[Any] = [self.cache.hooks(b)]
        if self.cache.tracked(b):
            device_type = self.device.device.type
            record = ForwardRecord(
                b,
                name=self.blocks[b].name,
                forward=module.forward,
                rng_state=torch.get_rng_state(),
                cuda_rng_state=torch.cuda.get_rng_state(self.device.device) if self.device.is_cuda else None,
                autocast=(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)),
                module_state=ModuleState(module.modules()),
            )
            self.cache.begin_record(record, args, kwargs)
            contexts.append(OpTracker(record, self._op_path, profile=self.observer is not None))
        if self.observer is not None:
            self.observer.forward_started(b)
        for context in contexts:
            context.__enter__()
        self._hook_stack.append((b, contexts))

    def _post_forward(self, b: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._stands_aside():
            return
        self._path_call = None
        if self._hook_stack and self._hook_stack[-1][0] == b:
            for context in reversed(self._hook_stack.pop()[1]):
                context.__exit__(None, None, None)
            if self.observer is not None:
                self.observer.forward_ended(b, output)
            self.cache.end_record(b)
            outputs = [t for t in tensor_leaves(output) if t.requires_grad]
            if len(outputs) == 1:
                # The hook torch's multi-tensor one would place, without its per-call set-up (a tenth of the host time
                # of each block's forward end).
                outputs[0].register_hook(functools.partial(self._pre_backward, b))
            elif outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, functools.partial(self._pre_backward, b), mode="any")
        self.pager.release(b)

    # ------------------------------------------------------------------ backward

    def begin_backward(self) -> None:
        """Backward of a micro-batch is about to run."""
        self.timeline.record("backward_start")
        if self.bound:
            self.pager.hold_all()
        self.state = TrainingState.BACKWARD
        if self.observer is not None:
            self.observer.backward_started()

    def _pre_backward(self, b: int, grad: torch.Tensor) -> None:
        """Backward reached block ``b``: keep it resident, release the blocks behind it, prefetch the ones ahead."""
        if self._current == b:
            return
        if self.observer is not None:
            self.observer.backward_reached(b)
        self._current = b
        if b not in self._held:
            self.pager.acquire(b)
            self._held.append(b)
        pos = self.position(b)
        for held in [h for h in self._held if self.position(h) > pos]:
            self._held.remove(held)
            self.pager.release(held)
            self.cache.done_with(held)
        ahead = self.order[max(0, pos - self.prefetch_depth) : pos]
        for nxt in reversed(ahead):
            self.pager.prefetch(nxt)
            self.cache.prefetch_block(nxt)

    def end_backward(self) -> None:
        """Backward finished: release what it held and learn the execution order from the pass."""
        if self.observer is not None:
            self.observer.backward_reached(None)
        self.timeline.record("backward_end")
        for held in self._held:
            self.pager.release(held)
        self._held.clear()
        self._current = None
        self.pager.release_all()
        if self._order_pass:
            order = list(dict.fromkeys(self._order_pass))
            if len(order) == len(self.blocks) or len(order) > len(self.order):
                self.order = order + [b for b in self.order if b not in order]
            self._order_pass = []
        self.state = TrainingState.IDLE

    # ------------------------------------------------------------------ teardown

    def leave_open_forwards(self) -> None:
        """Close the block forwards an exception left open, innermost first, so that the modes and hooks they entered
        come off their stacks in order: one that is not an ``Exception`` (Ctrl-C) skips the modules' always-called
        forward hooks."""
        while self._hook_stack:
            b, contexts = self._hook_stack.pop()
            for context in reversed(contexts):
                context.__exit__(None, None, None)
            self.cache.end_record(b)
            self.pager.release(b)
        self._path_call = None

    def close(self) -> None:
        """Leave any forward still open (after an error), remove every hook and release every block."""
        self.leave_open_forwards()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._held.clear()
        self._current = None
        self.bound = False
        self.pager.release_all()
        self.state = TrainingState.IDLE
