"""Op-level tracking of a block's forward pass and partial recomputation in backward.

While a block runs forward, :class:`OpTracker` (a ``TorchDispatchMode``) names every aten op after the submodule
that ran it (``"self_attn.q_proj:mm"``, ``"input_layernorm:mul#1"``), and remembers which op produced each storage
and each tensor, so the activation cache can place every saved tensor by the op that produced it. An op depends on
the ops that returned its input tensors and, where the block wrote a tensor's memory in place after that (through
another view of it), on the last op that wrote it.

A saved tensor placed ``recompute`` is not stored. When backward first needs one, :meth:`ForwardRecord.replay` runs
the block's forward again, executing only the ops the discarded tensors depend on: an op whose output was stored
(on the device, in host memory or on disk) hands that output back instead of running (an in-place op writes it into
the tensor it mutates), and an op nobody needs returns an uninitialised tensor of the right shape. The replay stops
after the last op it needs. RNG state and autocast state are those of the original forward, so recomputed values
are bit-identical, and the RNG state after a replay is the one before it. The replayed op sequence must be the recorded
one, op by op.

A replay has no side effects on state outside the block's activations. A forward may write, in place, memory it did
not produce: batch norm's running statistics (written by ``native_batch_norm`` although its schema does not say so),
spectral norm's power-iteration vectors (``out=``), a buffer, a tensor attribute, a cache object. The tracker keeps a
copy of each such storage's bytes before the forward first writes it and which op wrote it last, and an op reading it
depends on that write. A replay gives every op touching such a storage the same view of a private copy started from
those bytes: it reads what the forward read there, and the real buffer keeps what the forward left. A forward may also
rebind state in Python (``self.ema = 0.9 * self.ema + ...``, ``self.calls += 1``): the buffers and plain attributes
(tensors, numbers, strings) of the block's modules are kept as the forward started with them, given back to the
modules for the replay and put back as they were after it.

The replay runs in the autograd state of the original forward: gradients enabled, each input requiring gradients as it
did then, and a saved-tensor hook that drops whatever the replay's own graph would save, so it holds no more memory
than a forward without gradients. Autograd changes which aten ops a forward issues: its generated kernel of an
in-place op whose derivative needs the input's old value (``div_``, or ``mul_`` by a tensor; ``x /= x.sum()`` in
Mixtral's router) first dispatches ``self.clone()`` and saves the clone, whose output may itself be placed
``recompute`` and must then be replayed as the input before the write. Code also picks its path by gradient state:
``nn.MultiheadAttention`` in eval mode takes a fused fast path (other ops) only when no input requires gradients. A
replay without gradients would skip the clone and take other paths; autograd's clone cannot be told apart from a
user's own ``.clone()`` by the ops alone (the same op on the same tensor), and skipping clones would still miss the
paths. In the same autograd state autograd issues exactly the ops it issued before, in the same places. ``detach``
(which autograd issues when it saves a tensor without hooks) and ``lift_fresh`` are left out of the sequence, in the
forward and in the replay alike.

A forward that does something else from the same inputs and state kept that way (one that counts its calls in a
container or an object outside its modules' attributes, or reads a cache it fills) cannot be recomputed: where its
replay runs another op, or an executed op gives other shapes, the replay raises an error that names the block, the op
and what to do instead. So does a replay that would read inputs the forward wrote in place, which no longer hold what
the forward started from. Values Python reads from memory without an op
(``.tolist()``, ``.numpy()``) are only right in a replay that executes the op producing them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_ratel.runtime.device import Stopwatch
from lightning_ratel.runtime.flops import count_flops
from lightning_ratel.runtime.trees import flatten, tensor_args, tensor_leaves

# Aliasing no-ops that are not part of a block's op sequence: autograd detaches a tensor it saves when no saved-tensor
# hook is set, so whether they are issued depends on the hooks, which differ between the forward and the replay.
_IGNORED = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default}


# Attribute values a module's forward may rebind (``self.ema = 0.9 * self.ema + ...``, ``self.calls += 1``): what a
# replay gives back as the forward saw it. Containers and other objects are shared, not copied.
_PLAIN = (torch.Tensor, int, float, str, type(None))


class ModuleState:
    """The buffers and plain attributes (tensors, numbers, strings, ``None``) of modules, at one moment.

    Args:
        modules: the modules (a block's ``modules()``).
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.entries = [(m, dict(m._buffers), {k: v for k, v in vars(m).items() if isinstance(v, _PLAIN)})
                        for m in modules]

    @property
    def modules(self) -> list[nn.Module]:
        return [m for m, _, _ in self.entries]

    def apply(self) -> None:
        """Give every module exactly these buffers and plain attributes again."""
        for module, buffers, attributes in self.entries:
            values = vars(module)
            for name in [k for k, v in values.items() if isinstance(v, _PLAIN) and k not in attributes]:
                del values[name]
            values.update(attributes)
            module._buffers.clear()
            module._buffers.update(buffers)


class KeptOutput:
    """An op's output the block keeps as it is (on the device, or too small to move): a weak reference and the
    tensor's version when it was saved. A replay hands it back only while it is alive and unwritten since."""

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.version = t._version

    def get(self) -> torch.Tensor | None:
        t = self.ref()
        return t if t is not None and t._version == self.version else None


class _StopReplay(Exception):
    """Raised inside the replayed forward once every needed op has run."""


def _drop_saved(tensor: torch.Tensor) -> None:
    """Pack hook of the replay: its autograd graph is never differentiated, so nothing it saves is kept."""
    return None


# Ops that write arguments their schema does not mark as written: batch norm updates its running statistics (arguments
# 3 and 4) when it normalises by batch statistics (argument 5).
_UNMARKED_WRITES = {
    op: (3, 4, 5)
    for op in (torch.ops.aten.native_batch_norm.default, torch.ops.aten.cudnn_batch_norm.default,
               torch.ops.aten.miopen_batch_norm.default)
}


def _written_tensors(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor argument an op writes in place (``self`` of ``add_``, ``out`` of ``div.out``, the running
    statistics of a training batch norm)."""
    unmarked = _UNMARKED_WRITES.get(func)
    if unmarked is not None:
        *written, flag = unmarked
        training = args[flag] if flag < len(args) else kwargs.get(func._schema.arguments[flag].name)
        picked = [args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name) for i in written]
        return [t for t in picked if isinstance(t, torch.Tensor)] if training else []
    if not func._schema.is_mutable:
        return []
    found = []
    for i, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is not None and info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            found.extend(tensor_leaves(value))
    return found


def _written_argument(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The argument an op writes and returns (``self`` of ``add_``, ``out`` of ``add.out``), or ``None``."""
    returns = func._schema.returns
    alias = returns[0].alias_info if len(returns) == 1 else None
    if alias is None or not alias.is_write:
        return None
    for i, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is not None and info.is_write and info.before_set == alias.before_set:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            return value if isinstance(value, torch.Tensor) else None
    return None


@dataclass
class OpRecord:
    """One aten op of a block's forward."""

    name: str
    func: Any
    inputs: list[int]
    out_spec: Any
    out_meta: list[Any]
    # times the op's forward while profiling (on CUDA its device time, read once the pass is over)
    watch: Stopwatch | None = None
    flops: float = 0.0

    @property
    def forward_time(self) -> float:
        """Seconds the op's forward took (0 where it was not timed)."""
        return self.watch.seconds() if self.watch is not None else 0.0

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
    # the block's module name, for messages
    name: str = ""
    ops: list[OpRecord] = field(default_factory=list)
    # storage pointer -> (op index, output index, weak reference to the storage) of the op that last wrote the
    # storage; an entry whose storage has been freed is stale (its memory may hold another tensor by now)
    owner: dict[int, tuple[int, int, StorageWeakRef]] = field(default_factory=dict)
    # id(tensor) -> (weak reference, op index): the op whose output is this very tensor object
    direct: dict[int, tuple[Any, int]] = field(default_factory=dict)
    # ops whose single tensor output was stored whole (a packed reference, or a :class:`KeptOutput` where the block
    # keeps the tensor itself): the replay hands these back instead of running the op
    stored: dict[int, Any] = field(default_factory=dict)
    # ops whose (recomputed) outputs packed references point into
    targets: set[int] = field(default_factory=set)
    # saved-activation bytes by producing op (-1: the block's inputs), each storage counted once
    saved: dict[int, int] = field(default_factory=dict)
    counted: set[tuple[int, int]] = field(default_factory=set)
    args: Any = None
    kwargs: Any = None
    # per leaf of (args, kwargs): whether a tensor required gradients, None for anything else
    input_grads: list[bool | None] = field(default_factory=list)
    # per leaf of (args, kwargs): whether a tensor was a leaf of the autograd graph
    input_leaves: list[bool] = field(default_factory=list)
    # storage pointers of the input tensors; ops that read them; the first op that wrote one
    input_storages: set[int] = field(default_factory=set)
    input_readers: set[int] = field(default_factory=set)
    input_written: int | None = None
    # storage pointer -> (weak reference, copy of its bytes before the forward first wrote it), for every storage from
    # outside the block (a buffer, a tensor attribute, a cache) that the forward writes in place
    external: dict[int, tuple[StorageWeakRef, torch.UntypedStorage]] = field(default_factory=dict)
    # storage pointer -> the op that last wrote that outside storage in the forward
    external_writer: dict[int, int] = field(default_factory=dict)
    forward: Callable[..., Any] | None = None
    # the block's modules' buffers and plain attributes when the forward started
    module_state: ModuleState | None = None
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

    @property
    def label(self) -> str:
        """The block as messages name it."""
        return f"block {self.block} ({self.name!r})" if self.name else f"block {self.block}"

    def keep_inputs(self, args: Any, kwargs: Any, keep: Callable[[torch.Tensor], Any]) -> None:
        """Keep the forward's inputs for a replay: each tensor as ``keep`` packs it, with its autograd state."""
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        self.input_grads = [t.requires_grad if isinstance(t, torch.Tensor) else None for t in leaves]
        self.input_leaves = [isinstance(t, torch.Tensor) and t.is_leaf for t in leaves]
        self.input_storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
        self.args, self.kwargs = tree_unflatten([keep(t) if isinstance(t, torch.Tensor) else t for t in leaves], spec)

    def producer(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The (op, output) that wrote ``t``'s storage in this forward, or ``None`` for a tensor from outside."""
        if t.numel() == 0:
            return None
        return self.writer(t.untyped_storage().data_ptr())

    def writer(self, storage: int) -> tuple[int, int] | None:
        """The (op, output) that last wrote the live storage at pointer ``storage`` in this forward, or ``None``.

        The allocator hands a freed storage's memory to the next tensor, and a tensor made without an op the tracker
        sees (the index tensor ``x[..., [0]]`` builds from a list) must not inherit the dead storage's producer.
        """
        entry = self.owner.get(storage)
        if entry is None or entry[2].expired():
            return None
        return entry[0], entry[1]

    def note_outside_writes(self, written: list[torch.Tensor]) -> None:
        """Before an op writes ``written``: keep the bytes of each storage from outside the block it writes for the
        first time, so that a replay can start that storage from what the forward started from."""
        for t in written:
            if not t.numel():
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.input_storages or ptr in self.external or self.writer(ptr) is not None:
                continue
            self.external[ptr] = (StorageWeakRef(storage), storage.clone())

    def outside_storage(self, ptr: int) -> bool:
        """Whether ``ptr`` is a live storage from outside the block that the forward wrote."""
        entry = self.external.get(ptr)
        return entry is not None and not entry[0].expired()

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

    def holds(self, op: int) -> bool:
        """Whether a replay can hand back ``op``'s stored output (a kept tensor must still be alive and unwritten)."""
        ref = self.stored.get(op)
        return ref is not None and (not isinstance(ref, KeptOutput) or ref.get() is not None)

    def needed(self) -> tuple[set[int], int]:
        """The ops the replay executes, and the index after which it may stop."""
        execute: set[int] = set()
        todo = list(self.targets)
        while todo:
            k = todo.pop()
            if k in execute:
                continue
            execute.add(k)
            todo.extend(i for i in self.ops[k].inputs if i >= 0 and i not in execute and not self.holds(i))
        return execute, max(execute, default=-1)

    def replay(self, unpack: Callable[[Any], torch.Tensor], restore_inputs: Callable[[Any], Any]) -> None:
        """Run the forward again and keep the outputs of the target ops (see the module docstring)."""
        if self.outputs is not None:
            return
        watch = self.stopwatch()
        execute, last = self.needed()
        if self.input_written is not None and execute & self.input_readers:
            raise RuntimeError(
                f"RatelStrategy: cannot recompute saved activations of {self.label}: its forward writes its own "
                f"input in place (op {self.input_written}, {self.ops[self.input_written].name}), so the inputs kept "
                f"for a replay no longer hold what the forward started from. {self.remedy()}"
            )
        outputs: dict[int, list[Any]] = {}
        args = restore_inputs(self.args)
        kwargs = restore_inputs(self.kwargs)
        mode = _Replayer(self, execute, last, unpack, outputs)
        assert self.forward is not None
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_drop_saved, self._unpack_dropped))
            args, kwargs = self._with_autograd_state(args, kwargs)
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
            if self.module_state is not None:
                stack.callback(self._rebind_during(self.module_state))
            stack.enter_context(mode)
            try:
                self.forward(*args, **kwargs)
            except _StopReplay:
                pass
        if mode.k <= last:
            raise RuntimeError(
                f"RatelStrategy: recomputing saved activations of {self.label}: its forward ran {len(self.ops)} ops "
                f"the first time but only {mode.k} when replayed, and the replay needs the outputs of op {last} "
                f"({self.ops[last].name}). {self.remedy()}"
            )
        self.outputs = outputs
        self.replay_watch = watch.stop()

    @staticmethod
    def _rebind_during(start: ModuleState) -> Callable[[], None]:
        """Give the block's modules the attributes they had when the forward started; returns what puts back the
        ones they have now (rebindings the replay makes are undone with it)."""
        now = ModuleState(start.modules)
        start.apply()
        return now.apply

    def _with_autograd_state(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The restored inputs, each requiring gradients as the forward's own did, and a graph leaf only where it was
        one: autocast caches its casts of leaves that require gradients (it takes them for weights), so a second cast
        of a non-leaf input made a leaf (T5's encoder output, projected to keys and to values) is a cache hit in the
        replay where the forward ran ``_to_copy``."""
        leaves, spec = tree_flatten((args, kwargs))
        for i, (t, requires_grad, leaf) in enumerate(zip(leaves, self.input_grads, self.input_leaves)):
            if isinstance(t, torch.Tensor) and requires_grad is not None:
                restored = t.detach().requires_grad_(requires_grad)
                leaves[i] = restored if leaf or not requires_grad else restored.view_as(restored)
        return tree_unflatten(leaves, spec)

    def _unpack_dropped(self, packed: None) -> torch.Tensor:
        raise RuntimeError(
            f"RatelStrategy: the forward of {self.label} differentiates its own graph, which a replay cannot do "
            f"(what the replay saves is dropped). {self.remedy()}"
        )

    def remedy(self) -> str:
        """What to do about a block whose activations cannot be recomputed."""
        pattern = self.name or f"<name of block {self.block}>"
        return (
            f"Store this block's activations instead of recomputing them: activation_policy={{{pattern!r}: 'host', "
            f"...}} (or 'ssd'), or, in a plan, place its ops on 'host' or 'ssd'."
        )

    def diverged(self, k: int, func: Any) -> RuntimeError:
        """The error for a replay whose op ``k`` is ``func`` where the forward ran something else."""
        seen = f"{self.ops[k].func} ({self.ops[k].name})" if k < len(self.ops) else "no further op"
        return RuntimeError(
            f"RatelStrategy: recomputing saved activations of {self.label}: the replay of its forward ran {func} as "
            f"op {k}, where the forward ran {seen}. The replay runs the forward again from the same inputs with the "
            f"same random, autocast and autograd state, so this forward runs different ops from the same inputs "
            f"(it depends on something else: a Python counter, a cache, values read with .tolist() or .numpy()). "
            f"{self.remedy()}"
        )

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
        # Outside storages the forward wrote, by pointer: this replay's own copies, made on first use from the bytes
        # they held before the forward.
        self._scratch: dict[int, torch.UntypedStorage] = {}

    def _redirected(self, t: Any) -> Any:
        """``t``, or where it lies in an outside storage the forward wrote, the same view of this replay's copy of
        that storage: the replay reads what the forward read and writes nothing the forward left behind."""
        if not isinstance(t, torch.Tensor) or not t.numel():
            return t
        ptr = t.untyped_storage().data_ptr()
        if not self.record.outside_storage(ptr):
            return t
        scratch = self._scratch.get(ptr)
        if scratch is None:
            scratch = self._scratch[ptr] = self.record.external[ptr][1].clone()
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(scratch, t.storage_offset(), t.size(), t.stride())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.record.external:
            args, kwargs = tree_map(self._redirected, (args, kwargs))
        if func in _IGNORED:
            return func(*args, **kwargs)
        k = self.k
        self.k += 1
        record = self.record
        ops = record.ops
        if k >= len(ops) or ops[k].func is not func:
            raise record.diverged(k, func)
        if k in self.execute:
            out = func(*args, **kwargs)
            self._check_shapes(k, func, out)
        elif record.holds(k):
            out = self._stored(k, func, args, kwargs)
        else:
            out = ops[k].dummy()
        if k in record.targets:
            # Aliases: autograd attaches the replay's graph to the tensors returned here, not to these.
            self.outputs[k] = [t.detach() if isinstance(t, torch.Tensor) else t for t in flatten(out)[0]]
        if k >= self.last:
            raise _StopReplay
        return out

    def _check_shapes(self, k: int, func: Any, out: Any) -> None:
        """An executed op must give the shapes it gave in the forward; others mean the forward took another path."""
        record = self.record
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in flatten(out)[0]]
        want = [m[0] if isinstance(m, tuple) and len(m) == 4 else None for m in record.ops[k].out_meta]
        if got != want:
            raise RuntimeError(
                f"RatelStrategy: recomputing saved activations of {record.label}: op {k} ({record.ops[k].name}, "
                f"{func}) gave outputs of shapes {got} when replayed but {want} in the forward, so the forward took "
                f"another path from the same inputs. {record.remedy()}"
            )

    def _stored(self, k: int, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The stored output of op ``k``, in the place and layout the forward had it."""
        # An alias, so autograd attaches the replay's graph to it and not to the stored tensor.
        ref = self.record.stored[k]
        value = (ref.get() if isinstance(ref, KeptOutput) else self.unpack(ref)).detach()
        written = _written_argument(func, args, kwargs)
        if written is not None:
            # An in-place op returns the tensor it writes whatever this returns: put the stored result there.
            return written.copy_(value)
        shape, stride, dtype, device = self.record.ops[k].out_meta[0]
        if tuple(value.stride()) != stride:
            # Stored copies come back contiguous; the forward may branch on strides (``.contiguous()``).
            value = torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(value)
        return value


class OpTracker(TorchDispatchMode):
    """Records the ops of one forward pass of a block into a :class:`ForwardRecord`.

    Args:
        record: where the ops go.
        path: returns the dotted path, inside the block, of the innermost submodule running now.
        profile: also time every op (with the record's stopwatch: on CUDA the device time between two events, so
            timing does not stop the host from queueing ahead) and count its FLOPs.
    """

    def __init__(self, record: ForwardRecord, path: Callable[[], str], profile: bool = False) -> None:
        super().__init__()
        self.record = record
        self.path = path
        self.profile = profile
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
        written = _written_tensors(func, args, kwargs)
        record.note_outside_writes(written)
        if self.profile:
            watch: Stopwatch | None = record.stopwatch()
            out = func(*args, **kwargs)
            watch.stop()
        else:
            out = func(*args, **kwargs)
            watch = None
        k = len(record.ops)
        path = self.path()
        op_name = func.overloadpacket.__name__
        base = f"{path}:{op_name}" if path else op_name
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        name = base if n == 0 else f"{base}#{n}"
        inputs = []
        in_storages = set()
        for leaf in tensor_args(args, kwargs):
            op = record.direct_op(leaf)
            inputs.append(op if op is not None else -1)
            if leaf.numel():
                ptr = leaf.untyped_storage().data_ptr()
                in_storages.add(ptr)
                if ptr in record.input_storages:
                    record.input_readers.add(k)
                last = record.writer(ptr)
                if op is not None and last is not None and last[0] > op:
                    # Written in place after the op that returned this tensor (through another view of the
                    # memory): the replay must run that write too.
                    inputs.append(last[0])
                if ptr in record.external_writer and record.outside_storage(ptr):
                    # A storage from outside the block, written in this forward: a replay starts it from its
                    # bytes before the forward, so it runs every write the value read here went through.
                    inputs.append(record.external_writer[ptr])
        out_leaves, spec = flatten(out)
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
                        record.owner[ptr] = (k, i, StorageWeakRef(leaf.untyped_storage()))
                    if mutates and ptr in record.input_storages and record.input_written is None:
                        record.input_written = k
            else:
                meta.append(leaf)
        for t in written:
            if t.numel() and record.outside_storage(t.untyped_storage().data_ptr()):
                record.external_writer[t.untyped_storage().data_ptr()] = k
        flops = count_flops(func, args, kwargs, out) if self.profile else 0.0
        record.ops.append(OpRecord(name, func, sorted(set(inputs)), spec, meta, watch, flops))
        return out
