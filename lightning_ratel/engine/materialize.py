"""A model's first trip into the engine: meta-device parameters materialized block by block, and the first writes.

A model built under ``torch.device("meta")`` has no memory yet. Block by block, each parameter gets its first value
from a :class:`ValueSource` when one provides it (a pretrained folder, a checkpoint being resumed), else from
initialization of its module (``param_init_fn`` or its own ``reset_parameters()``, Lightning's convention; only the
modules that need it), or from the values the module came with. The values go into the host cache and to the swap
store (fp32 masters of trainable parameters, compute copies read from the store); a parameter that was on the meta
device then gets a paging placeholder instead of memory, so the whole model never has to fit in host memory.

Parameters outside the optimizer (frozen shards) get no master: only their compute copy is written, plus their values
in their own dtype where the compute dtype rounds them (see :class:`~lightning_ratel.runtime.units.FrozenValues`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import torch
from torch import nn

from lightning_ratel.config import ParamInitFn
from lightning_ratel.engine.blocks import Block
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.io.sources import SourceValue, ValueSource
from lightning_ratel.progress import progress_bar
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.runtime.pager import nan_placeholder
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.units import Layout, ParamSlot, Shard
from lightning_ratel.sizes import round_up


def _widens(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of ``source`` is exactly a value of ``target`` (16-bit floats into fp32, anything into
    itself)."""
    return source == target or (target == torch.float32 and source in (torch.bfloat16, torch.float16))


def persistent_buffers(module: nn.Module) -> list[str]:
    """Qualified names of the buffers ``module.state_dict()`` holds."""
    return [f"{name}.{n}" if name else n for name, m in module.named_modules()
            for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]


class DefaultInit:
    """Initializes a module whose parameters or buffers were on the meta device, when no ``param_init_fn`` is given.

    A peft LoRA adapter's matrices get peft's own initialization (A as ``nn.Linear`` does, or Gaussian; B zeros, so the
    adapted model starts as the base model); any other module its ``reset_parameters()``; with ``fallback`` (weights
    come from a file, so only buffers and new parameters are initialized here) a module inside a transformers model
    gets the model's own ``_init_weights`` when it has no ``reset_parameters()`` (rotary tables, RMSNorm weights) or
    holds buffers of its own on the meta device: ``reset_parameters()`` leaves buffers alone (Gemma's scaled embedding
    keeps its scale in one), ``_init_weights`` sets them as ``from_pretrained`` does.
    """

    def __init__(self, root: nn.Module, fallback: bool) -> None:
        self._lora: dict[int, tuple[str, str, object, int]] = {}
        self._owner: dict[int, nn.Module] = {}
        self._meta_buffers = {id(m) for m in root.modules() if any(b.is_meta for b in m.buffers(recurse=False))}
        for layer in root.modules():
            lora_a = getattr(layer, "lora_A", None)
            lora_b = getattr(layer, "lora_B", None)
            if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
                continue
            ranks = getattr(layer, "r", {})
            for adapter, m in lora_a.items():
                self._lora[id(m)] = ("A", adapter, _lora_init(root, adapter), int(ranks.get(adapter, 1)))
            for adapter, m in lora_b.items():
                self._lora[id(m)] = ("B", adapter, True, 1)
        if fallback:
            for m in root.modules():
                if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config"):
                    for inner in m.modules():
                        # The innermost transformers model wins: it defines the module's initialization.
                        self._owner[id(inner)] = m

    def problem(self, module: nn.Module) -> str | None:
        """Why ``module`` cannot be initialized, or ``None`` when it can."""
        role = self._lora.get(id(module))
        if role is not None:
            if role[0] == "A" and role[2] not in (True, "gaussian"):
                return (f"peft initialization init_lora_weights={role[2]!r} needs the base weights; build the LoRA "
                        "adapters off the meta device, or pass param_init_fn")
            return None
        if callable(getattr(module, "reset_parameters", None)) or id(module) in self._owner:
            return None
        return "it has no reset_parameters()"

    def __call__(self, module: nn.Module) -> None:
        role = self._lora.get(id(module))
        if role is not None:
            kind, _, how, rank = role
            weight = module.weight  # type: ignore[union-attr]
            bias = getattr(module, "bias", None)
            with torch.no_grad():
                if kind == "B":
                    weight.zero_()
                elif how == "gaussian":
                    nn.init.normal_(weight, std=1 / rank)
                else:
                    module.reset_parameters()  # type: ignore[operator]
                if bias is not None:
                    bias.zero_()
            return
        owner = self._owner.get(id(module))
        reset = getattr(module, "reset_parameters", None)
        if owner is not None and (id(module) in self._meta_buffers or not callable(reset)):
            with torch.no_grad():
                owner._init_weights(module)  # type: ignore[operator]
            return
        reset()  # type: ignore[misc]


def _lora_init(root: nn.Module, adapter: str) -> object:
    """The ``init_lora_weights`` of adapter ``adapter`` in the peft model inside ``root`` (``True``: peft's default)."""
    for m in root.modules():
        configs = getattr(m, "peft_config", None)
        if isinstance(configs, dict) and adapter in configs:
            return getattr(configs[adapter], "init_lora_weights", True)
    return True


class Materializer:
    """Materializes meta parameters and buffers and writes every shard's first state.

    Args:
        module: the model.
        blocks: its blocks, in the order they are materialized.
        layout: units and shards.
        device: where buffers live for good (parameters are paged).
        param_init_fn: initializes one module; ``None``: :class:`DefaultInit`.
        source: first values of (some) parameters and buffers; the rest are initialized or keep their values.
        progress: show a progress bar.
        owned: the trainable shards whose states this rank keeps, by index, when several ranks train (each unit's
            states are on one rank, which alone reads their values from ``source``); ``None``: all.
        writes: the units whose host cache this rank fills, when the ranks of its node share one (each unit's is
            written by one of them, and read by the others once it says so); ``None``: all.

    Raises:
        RatelConfigError: the source does not match the model, or a module on the meta device cannot be initialized
            on its own (no ``reset_parameters`` and no ``param_init_fn``, or it holds parameters owned by different
            blocks).
    """

    def __init__(self, module: nn.Module, blocks: Sequence[Block], layout: Layout, device: torch.device,
                 param_init_fn: ParamInitFn | None, source: ValueSource | None = None, progress: bool = False,
                 owned: set[int] | None = None, writes: set[int] | None = None) -> None:
        self.module = module
        self.writes = writes
        self.blocks = blocks
        self.layout = layout
        self.device = device
        self.source = source
        self.progress = progress
        self.owned = owned
        # Shards whose compute copies this rank reads from another rank's swap files (see NodeCopies): a trainable
        # one's owner, a frozen one's writer. Their copies do not go into this rank's.
        self.shared: set[int] = set()
        self._default = DefaultInit(module, fallback=source is not None) if param_init_fn is None else None
        self.init: Callable[[nn.Module], None] = param_init_fn or self._default  # type: ignore[assignment]
        self._meta = {id(s.param) for s in layout.slots if s.param.is_meta}
        self._was_meta = set(self._meta)
        # Floating buffers given memory here, filled with NaN until something sets them (see _check_buffers).
        self._new_buffers: list[tuple[nn.Module, str]] = []
        if source is not None:
            names: dict[int, list[str]] = {}
            for name, p in module.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
            source.prepare(names, layout, persistent_buffers(module))
        self._provided = {id(s.param) for s in layout.slots if source is not None and source.provides(s.param)}
        # Values another rank reads: the trainable shards whose states it owns (it broadcasts their compute copies
        # once the model is materialized), so each rank reads its own part of the source.
        self._elsewhere = set() if owned is None else {
            id(sp.param) for s in layout.shards if s.index not in owned for sp in s.params} & self._provided
        self._check()

    def _needs_init(self, m: nn.Module) -> bool:
        """Whether ``m`` holds meta tensors that nothing else gives a value."""
        direct = m.parameters(recurse=False)
        return (any(id(p) in self._meta and id(p) not in self._provided for p in direct)
                or any(b.is_meta for b in m.buffers(recurse=False)))

    def _check(self) -> None:
        """Fail before anything is allocated if meta parameters cannot be initialized block by block."""
        if not self._meta and not any(b.is_meta for b in self.module.buffers()):
            return
        unit_of = {id(s.param): u.index for u in self.layout.units.values() for s in u.slots}
        for name, m in self.module.named_modules():
            if not self._needs_init(m):
                continue
            problem = self._default.problem(m) if self._default is not None else None
            if problem is not None:
                raise RatelConfigError(
                    f"the model is on the meta device and module {name!r} ({type(m).__name__}) cannot be initialized: "
                    f"{problem}; pass RatelStrategy(param_init_fn=...) to initialize each module"
                )
            if len({unit_of[id(p)] for p in m.parameters(recurse=False)}) > 1:
                raise RatelConfigError(
                    f"module {name!r} is on the meta device and holds parameters owned by different blocks (tied "
                    "weights); it cannot be initialized one block at a time. Build it off the meta device."
                )

    def _materialize(self, modules: Sequence[nn.Module], everything: bool) -> None:
        """Give host memory to the meta tensors of the modules that need initializing (or of all, with
        ``everything``) and initialize those modules, module by module."""
        for m in modules:
            init = self._needs_init(m)
            params = [p for p in m.parameters(recurse=False) if id(p) in self._meta and (init or everything)]
            buffers = [n for n, b in m.named_buffers(recurse=False) if b.is_meta]
            if not params and not buffers:
                continue
            for p in params:
                # Swapped in place, so the optimizer's and the blocks' references stay the same objects.
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
                self._meta.discard(id(p))
            for n in buffers:
                if m._buffers[n].is_floating_point():
                    m._buffers[n] = torch.full_like(m._buffers[n], float("nan"), device="cpu")
                    self._new_buffers.append((m, n))
                else:
                    m._buffers[n] = torch.empty_like(m._buffers[n], device="cpu")
            if init:
                self.init(m)
            for n in buffers:
                m._buffers[n] = m._buffers[n].to(self.device)

    def _load_buffers(self) -> None:
        """Persistent buffers from the source, where it has them."""
        if self.source is None:
            return
        values = self.source.buffers()
        for name, m in self.module.named_modules():
            for n, b in m.named_buffers(recurse=False):
                full = f"{name}.{n}" if name else n
                if full in values and b is not None:
                    m._buffers[n] = values[full].to(device=b.device, dtype=b.dtype).clone()

    def _check_buffers(self) -> None:
        """Fail before training when a buffer that was on the meta device was set by nothing: ``reset_parameters()``
        sets parameters only, and a value a module computes in its ``__init__`` is lost on the meta device."""
        unset = [(m, n) for m, n in self._new_buffers if torch.isnan(m._buffers[n]).any()]  # type: ignore[arg-type]
        if not unset:
            return
        names = {id(m): name for name, m in self.module.named_modules()}
        shown = ", ".join(f"{names[id(m)]}.{n}".lstrip(".") + f" ({type(m).__name__})" for m, n in unset[:8])
        raise RatelConfigError(
            f"the model is on the meta device and {len(unset)} of its buffers were not set by the initialization, "
            f"which sets only parameters: {shown}. Pass RatelStrategy(param_init_fn=...) that also sets them (for a "
            "transformers model, its `_init_weights`), or build the modules holding them off the meta device.")

    def load(self, store: TensorStore | None) -> None:
        """Materialize meta parameters, fill the host caches and write masters (and stored compute copies).

        Block by block: a parameter that was on the meta device holds host memory only until its unit is written.
        Moments start as zeros without a write. Without a store (evaluation) nothing is written, and every parameter
        gets ordinary memory holding its value.
        """
        layout = self.layout
        compute_on_store = layout.param_cache == "ssd"
        if store is not None:
            for shard in layout.shards:
                if self.owned is not None and shard.index not in self.owned:
                    continue
                # Another optimizer's state records are laid out by the CPU optimizer, which knows their sizes.
                for what in ("exp_avg", "exp_avg_sq") if layout.generic is None else ():
                    store.reserve(shard.key(what), shard.numel * 4)
                if not shard.master_in_host:
                    store.reserve(shard.key("master"), shard.numel * 4)
            for shard in layout.all_shards if compute_on_store else ():
                if shard.index in self.shared:
                    continue
                if shard.dtype != torch.float32 or shard.group < 0:
                    store.reserve(shard.compute_key, shard.numel * shard.dtype.itemsize)
                elif self.owned is not None and shard.index not in self.owned:
                    # Another rank's fp32 master: this rank keeps its compute copy apart (see StoredCopies).
                    store.reserve(shard.key("compute"), shard.numel * 4)
            store.preallocate()
        writer = _ShardWriter(store, layout, compute_on_store, self.owned, self.writes, self.shared)
        unit_shards = layout.unit_shards()
        def nbytes(slots: Sequence[ParamSlot]) -> int:
            return sum(s.numel * layout.orig_dtype[id(s.param)].itemsize for s in slots)

        total = nbytes(layout.slots)
        description = self.source.description if self.source is not None else "initializing"
        bar = progress_bar(total, f"RatelStrategy: {description}", self.progress)
        units = [layout.units[b.index] for b in self.blocks if b.index in layout.units]
        try:
            for block in self.blocks:
                modules = [block.module] if block.direct_only else list(block.module.modules())
                self._materialize(modules, everything=store is None)
                unit = layout.units.get(block.index)
                if unit is None:
                    continue
                following = units.index(unit) + 1
                if self.source is not None and following < len(units):
                    self.source.prefetch([s for s in units[following].slots if id(s.param) not in self._elsewhere])
                with self._values(unit.slots) as values:
                    fills = self.writes is None or unit.index in self.writes
                    for slot in unit.slots:
                        value = values.get(id(slot.param))
                        if value is None:
                            continue  # another rank's to read
                        if unit.host and fills:
                            slot.view(unit.host).copy_(value.tensor)
                        if store is None and value.tensor is not slot.param.data:
                            slot.param.data.copy_(value.tensor)
                    for shard in unit_shards.get(unit.index, ()):
                        writer.write(shard, values)
                        self._remember_origin(shard)
                if store is not None:
                    for slot in unit.slots:
                        self._release(slot.param)
                bar.update(nbytes(unit.slots))
            # Buffers of modules outside every block (rotary tables, masks).
            self._materialize(list(self.module.modules()), everything=store is None)
            self._load_buffers()
            self._check_buffers()
        finally:
            bar.close()
            writer.finish()

    @contextlib.contextmanager
    def _values(self, slots: Sequence[ParamSlot]) -> Iterator[dict[int, SourceValue]]:
        """Each slot's first value: from the source, or the parameter's own (initialized) data; none for a value
        another rank reads."""
        provided = [s for s in slots if id(s.param) in self._provided and id(s.param) not in self._elsewhere]
        reading = self.source.read(provided) if self.source is not None and provided else contextlib.nullcontext({})
        with reading as got:
            values = {id(s.param): SourceValue(s.param.data) for s in slots if id(s.param) not in self._provided}
            for s in provided:
                value = got[id(s.param)]
                orig = self.layout.orig_dtype[id(s.param)]
                if not value.master and value.tensor.dtype != orig and not _widens(value.tensor.dtype, orig):
                    # As loading it into the module would store it (a widening cast changes nothing: left to the
                    # copies into the cache and the staging buffers).
                    value = SourceValue(value.tensor.to(orig))
                values[id(s.param)] = SourceValue(value.tensor.view(s.shape), value.master)
            yield values

    def _remember_origin(self, shard: Shard) -> None:
        if self.source is None or shard.group >= 0:
            return
        for sp in shard.params:
            key = self.source.pretrained_key(sp.param)
            if key is not None:
                self.layout.frozen_values.pretrained[id(sp.param)] = key

    def _release(self, p: nn.Parameter) -> None:
        """A parameter that came on the meta device gives its memory back (the pager places its placeholder)."""
        if id(p) not in self._was_meta:
            return
        if p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(nan_placeholder(p), p.requires_grad))
            self._meta.discard(id(p))
        else:
            p.data = nan_placeholder(p)

    def undo(self) -> None:
        """Put parameters that came on the meta device back there after a failed setup, so a retry initializes them
        again instead of training from whatever they hold."""
        for slot in self.layout.slots:
            p = slot.param
            if id(p) in self._was_meta and not p.is_meta:
                torch.utils.swap_tensors(
                    p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))


class _ShardWriter:
    """Writes each shard's first state to the store, through two staging buffer sets so one fills while the other is
    written: a trainable shard's fp32 master (unless the host cache holds it) and, when the pager reads compute copies
    from the store, its 16-bit compute copy; a frozen shard's compute copy (when read from the store) and, where the
    compute dtype rounds its values, the values in their own dtype.

    Args:
        store: the swap store; ``None`` writes nothing.
        layout: the model's layout (every shard sizes the staging buffers).
        compute_copies: also write compute copies (the pager reads them from the store).
        owned: the trainable shards this rank keeps states of, by index (``None``: all).
        writes: the units whose host cache this rank fills (``None``: all); another rank may be filling the others.
        shared: the frozen shards whose compute copies another rank writes into its swap files, which this rank reads.
    """

    def __init__(self, store: TensorStore | None, layout: Layout, compute_copies: bool,
                 owned: set[int] | None = None, writes: set[int] | None = None, shared: set[int] | None = None
                 ) -> None:
        self.store = store
        self.layout = layout
        self.compute_copies = compute_copies
        self.owned = owned
        self.writes = writes
        self.shared = shared or set()
        shards = layout.all_shards if store is not None else []
        largest = round_up(max((s.numel * 4 for s in shards), default=0), ALIGNMENT)
        # A compute copy of its own: 16-bit trainable shards and every frozen shard (an fp32 master is its own copy).
        half = round_up(max((s.numel * s.dtype.itemsize for s in shards if s.dtype != torch.float32 or s.group < 0),
                            default=0), ALIGNMENT)
        self._staging = [
            (aligned_empty(largest, torch.uint8, huge=True), aligned_empty(half, torch.uint8, huge=True)
             if compute_copies and half else None)
            for _ in range(2 if store is not None else 0)
        ]
        self._pending: list[list[Future]] = [[], []]
        self._count = 0

    def write(self, shard: Shard, values: dict[int, SourceValue]) -> None:
        if self.store is None:
            return
        if shard.group >= 0:
            self._write_trainable(shard, values)
        else:
            self._write_frozen(shard, values)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = self._count % 2
        self._count += 1
        for future in self._pending[k]:
            future.result()
        self._pending[k] = []
        return self._staging[k]

    def _submit(self, futures: list[Future]) -> None:
        self._pending[(self._count - 1) % 2] = futures

    def _write_trainable(self, shard: Shard, values: dict[int, SourceValue]) -> None:
        assert self.store is not None
        if shard.master_in_host or (self.owned is not None and shard.index not in self.owned):
            # The host cache holds the fp32 compute copy, which is the master (the optimizer stores its first copy), or
            # another rank keeps the states.
            return
        master_buf, half_buf = self._buffers()
        buf = master_buf.view(torch.float32)[: shard.numel]
        for sp in shard.params:
            sp.view(buf).copy_(values[id(sp.param)].tensor)
        futures = [self.store.write(shard.key("master"), buf)]
        if self.compute_copies and shard.dtype != torch.float32:
            assert half_buf is not None
            copy = half_buf.view(shard.dtype)[: shard.numel]
            copy.copy_(buf)
            futures.append(self.store.write(shard.compute_key, copy))
        self._submit(futures)

    def _write_frozen(self, shard: Shard, values: dict[int, SourceValue]) -> None:
        assert self.store is not None
        value_buf, half_buf = self._buffers()
        futures = []
        if self.compute_copies:
            assert half_buf is not None
            copy = half_buf.view(shard.dtype)[: shard.numel]
            for sp in shard.params:
                sp.view(copy).copy_(values[id(sp.param)].tensor)
            if shard.index not in self.shared:
                futures.append(self.store.write(shard.compute_key, copy))
        elif self.writes is None or shard.unit.index in self.writes:
            copy = shard.compute_view(shard.unit.host[shard.dtype])
        else:
            # The cache is another rank's to fill: this rank rounds its own values.
            copy = torch.empty(shard.numel, dtype=shard.dtype)
            for sp in shard.params:
                sp.view(copy).copy_(values[id(sp.param)].tensor)
        exact = all(self._exact(sp.view(copy), values[id(sp.param)].tensor, self.layout.orig_dtype[id(sp.param)])
                    for sp in shard.params)
        if not exact:
            dtype = shard.dtype
            for sp in shard.params:
                dtype = torch.promote_types(dtype, self.layout.orig_dtype[id(sp.param)])
            exact_buf = value_buf.view(dtype)[: shard.numel] if dtype.itemsize <= 4 else torch.empty(shard.numel,
                                                                                                     dtype=dtype)
            for sp in shard.params:
                sp.view(exact_buf).copy_(values[id(sp.param)].tensor)
            self.layout.frozen_values.exact_copies[shard.index] = dtype
            futures.append(self.store.write(self.layout.frozen_values.key(shard), exact_buf))
        self._submit(futures)

    @staticmethod
    def _exact(copy: torch.Tensor, value: torch.Tensor, orig: torch.dtype) -> bool:
        """Whether a compute copy holds its parameter's value (``value``, in ``orig`` or a dtype ``orig`` widens)."""
        if copy.dtype == orig or copy.dtype == value.dtype:
            return True
        return torch.equal(copy.to(value.device, value.dtype), value)

    def finish(self) -> None:
        """Wait for every write (raising the first error)."""
        pending, self._pending = self._pending, [[], []]
        for futures in pending:
            for future in futures:
                future.result()
