"""Op-level tracking of a block's forward pass and partial recomputation in backward.

While a block runs forward, :class:`OpTracker` (a ``TorchDispatchMode``) names every aten op after the submodule
that ran it (``"self_attn.q_proj:mm"``, ``"input_layernorm:mul#1"``), and remembers which op produced each storage
and each tensor, so the activation cache can place every saved tensor by the op that produced it.

A saved tensor placed ``recompute`` is not stored. When backward first needs one, :meth:`ForwardRecord.replay` runs
the block's forward again without autograd, executing only the ops the discarded tensors depend on: an op whose
output was stored (on the device, in host memory or on disk) hands that output back instead of running, and an op
nobody needs returns an uninitialised tensor of the right shape. The replay stops after the last op it needs. RNG
state and autocast state are those of the original forward, so recomputed values are bit-identical.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import flop_registry

from lightning_ratel.runtime.device import Stopwatch

# Aliasing no-ops that autograd itself issues in a forward with gradients (detaching saved outputs) and not in the
# replay, which runs without them: they are not part of a block's op sequence.
_IGNORED = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default}


class _StopReplay(Exception):
    """Raised inside the replayed forward once every needed op has run."""


@dataclass
class OpRecord:
    """One aten op of a block's forward."""

    name: str
    func: Any
    inputs: list[int]
    out_spec: Any
    out_meta: list[Any]
    forward_time: float = 0.0
    flops: float = 0.0

    def dummy(self) -> Any:
        """Outputs of the right shapes with unspecified values, for an op the replay does not need."""
        leaves = [
            torch.empty_strided(m[0], m[1], dtype=m[2], device=m[3]) if isinstance(m, tuple) and len(m) == 4 else m
            for m in self.out_meta
        ]
        return tree_unflatten(leaves, self.out_spec)


@dataclass
class ForwardRecord:
    """What one forward pass of one block did, as far as the saved tensors and their recomputation need."""

    block: int
    ops: list[OpRecord] = field(default_factory=list)
    # storage pointer -> (op index, output index) of the op that last wrote the storage
    owner: dict[int, tuple[int, int]] = field(default_factory=dict)
    # id(tensor) -> (weak reference, op index): the op whose output is this very tensor object
    direct: dict[int, tuple[Any, int]] = field(default_factory=dict)
    # ops whose single tensor output was stored whole: the replay hands these back instead of running the op
    stored: dict[int, Any] = field(default_factory=dict)
    # ops whose (recomputed) outputs packed references point into
    targets: set[int] = field(default_factory=set)
    # saved-activation bytes by producing op (-1: the block's inputs), each storage counted once
    saved: dict[int, int] = field(default_factory=dict)
    counted: set[tuple[int, int]] = field(default_factory=set)
    args: Any = None
    kwargs: Any = None
    forward: Callable[..., Any] | None = None
    rng_state: torch.Tensor | None = None
    cuda_rng_state: torch.Tensor | None = None
    autocast: tuple[str, bool, torch.dtype] | None = None
    # set while the activation cache packs a tensor: its own copies are not ops of the block
    paused: bool = False
    outputs: dict[int, list[Any]] | None = None
    # Times a replay (the device's clock, set by the activation cache; the host's by default) and the last replay.
    stopwatch: Callable[[], Stopwatch] = Stopwatch
    replay_watch: Stopwatch | None = None

    @property
    def replay_time(self) -> float:
        """Seconds the last replay took (0 before one)."""
        return self.replay_watch.seconds() if self.replay_watch is not None else 0.0

    def producer(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The (op, output) that wrote ``t``'s storage in this forward, or ``None`` for a tensor from outside."""
        if t.numel() == 0:
            return None
        return self.owner.get(t.untyped_storage().data_ptr())

    def count_saved(self, storage: int, op: int, nbytes: int) -> None:
        """Add ``nbytes`` saved from ``op``'s output (-1: the inputs), once per storage."""
        if (storage, op) not in self.counted:
            self.counted.add((storage, op))
            self.saved[op] = self.saved.get(op, 0) + nbytes

    def direct_op(self, t: torch.Tensor) -> int | None:
        entry = self.direct.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def needed(self) -> tuple[set[int], int]:
        """The ops the replay executes, and the index after which it may stop."""
        execute: set[int] = set()
        todo = list(self.targets)
        while todo:
            k = todo.pop()
            if k in execute:
                continue
            execute.add(k)
            todo.extend(i for i in self.ops[k].inputs if i >= 0 and i not in self.stored and i not in execute)
        return execute, max(execute, default=-1)

    def replay(self, unpack: Callable[[Any], torch.Tensor], restore_inputs: Callable[[Any], Any]) -> None:
        """Run the forward again and keep the outputs of the target ops (see the module docstring)."""
        if self.outputs is not None:
            return
        watch = self.stopwatch()
        execute, last = self.needed()
        outputs: dict[int, list[Any]] = {}
        args = restore_inputs(self.args)
        kwargs = restore_inputs(self.kwargs)
        mode = _Replayer(self, execute, last, unpack, outputs)
        assert self.forward is not None
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            devices = []
            if self.cuda_rng_state is not None:
                devices = [torch.cuda.current_device()]
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type="cuda"))
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state)
            if self.cuda_rng_state is not None:
                torch.cuda.set_rng_state(self.cuda_rng_state)
            if self.autocast is not None:
                device_type, enabled, dtype = self.autocast
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            stack.enter_context(mode)
            try:
                self.forward(*args, **kwargs)
            except _StopReplay:
                pass
        if mode.k <= last:
            raise RuntimeError(
                f"RatelStrategy: replaying block {self.block}'s forward ran {mode.k} ops, but the original forward "
                f"ran {len(self.ops)}; recomputation needs a forward that runs the same ops every time"
            )
        self.outputs = outputs
        self.replay_watch = watch.stop()

    def recomputed(self, op: int, index: int) -> torch.Tensor:
        assert self.outputs is not None
        return self.outputs[op][index]


class _Replayer(TorchDispatchMode):
    def __init__(self, record: ForwardRecord, execute: set[int], last: int, unpack: Callable[[Any], torch.Tensor],
                 outputs: dict[int, list[Any]]) -> None:
        super().__init__()
        self.record = record
        self.execute = execute
        self.last = last
        self.unpack = unpack
        self.outputs = outputs
        self.k = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _IGNORED:
            return func(*args, **(kwargs or {}))
        k = self.k
        self.k += 1
        ops = self.record.ops
        if k >= len(ops) or ops[k].func is not func:
            seen = ops[k].func if k < len(ops) else "nothing"
            raise RuntimeError(
                f"RatelStrategy: replaying block {self.record.block}'s forward, op {k} is {func} but the original "
                f"forward ran {seen}; recomputation needs a forward that runs the same ops every time"
            )
        if k in self.execute:
            out = func(*args, **(kwargs or {}))
        elif k in self.record.stored:
            out = self.unpack(self.record.stored[k])
            shape, stride, dtype, device = ops[k].out_meta[0]
            if tuple(out.stride()) != stride:
                # Stored copies come back contiguous; the forward may branch on strides (``.contiguous()``).
                out = torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(out)
        else:
            out = ops[k].dummy()
        if k in self.record.targets:
            self.outputs[k] = tree_flatten(out)[0]
        if k >= self.last:
            raise _StopReplay
        return out


class OpTracker(TorchDispatchMode):
    """Records the ops of one forward pass of a block into a :class:`ForwardRecord`.

    Args:
        record: where the ops go.
        path: returns the dotted path, inside the block, of the innermost submodule running now.
        profile: also time every op (synchronising the device around it) and count its FLOPs.
        synchronize: waits for the device, for timing.
    """

    def __init__(self, record: ForwardRecord, path: Callable[[], str], profile: bool = False,
                 synchronize: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.record = record
        self.path = path
        self.profile = profile
        self.synchronize = synchronize
        self._counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        record = self.record
        if record.paused:
            return func(*args, **kwargs)
        if func in _IGNORED:
            out = func(*args, **kwargs)
            op = record.direct_op(args[0])
            if op is not None:
                record.direct[id(out)] = (weakref.ref(out), op)
            return out
        if self.profile:
            self.synchronize()
            start = time.perf_counter()
            out = func(*args, **kwargs)
            self.synchronize()
            elapsed = time.perf_counter() - start
        else:
            out = func(*args, **kwargs)
            elapsed = 0.0
        k = len(record.ops)
        path = self.path()
        op_name = func.overloadpacket.__name__
        base = f"{path}:{op_name}" if path else op_name
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        name = base if n == 0 else f"{base}#{n}"
        in_leaves = tree_flatten((args, kwargs))[0]
        inputs = []
        in_storages = set()
        for leaf in in_leaves:
            if isinstance(leaf, torch.Tensor):
                op = record.direct_op(leaf)
                inputs.append(op if op is not None else -1)
                if leaf.numel():
                    in_storages.add(leaf.untyped_storage().data_ptr())
        out_leaves, spec = tree_flatten(out)
        meta: list[Any] = []
        mutates = func._schema.is_mutable
        for i, leaf in enumerate(out_leaves):
            if isinstance(leaf, torch.Tensor):
                meta.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device))
                record.direct[id(leaf)] = (weakref.ref(leaf), k)
                if leaf.numel():
                    ptr = leaf.untyped_storage().data_ptr()
                    # A view keeps its base's owner; a fresh result or an in-place write makes this op the owner.
                    if ptr not in in_storages or mutates:
                        record.owner[ptr] = (k, i)
            else:
                meta.append(leaf)
        flops = 0.0
        if self.profile and func.overloadpacket in flop_registry:
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        record.ops.append(OpRecord(name, func, sorted(set(inputs)), spec, meta, elapsed, flops))
        return out
