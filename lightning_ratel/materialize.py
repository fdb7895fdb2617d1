"""A model's first trip into the engine: meta-device parameters materialized block by block, and the first writes.

A model built under ``torch.device("meta")`` has no memory yet. Each block's modules get host memory, are initialized
(``param_init_fn`` or their own ``reset_parameters()``, Lightning's convention), copied into the host cache and written
to the swap store; a parameter that was on the meta device then gives its memory back (a paging placeholder), so the
whole model never has to fit in host memory. Parameters that came with values are written the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch
from torch import nn

from lightning_ratel.blocks import Block
from lightning_ratel.config import ParamInitFn
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.layout import Layout
from lightning_ratel.runtime.storage import ALIGNMENT, TensorStore, aligned_empty
from lightning_ratel.runtime.units import Shard
from lightning_ratel.sizes import round_up


def nan_placeholder(param: nn.Parameter, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor of ``param``'s shape that costs no memory (one NaN, expanded) and reads as NaN if used."""
    return torch.full((), float("nan"), dtype=dtype or param.dtype).expand(param.shape)


def _reset_parameters(module: nn.Module) -> None:
    """Lightning's convention for materializing a module from the meta device."""
    module.reset_parameters()  # type: ignore[operator]


class Materializer:
    """Materializes meta parameters and buffers and writes every shard's first state.

    Args:
        module: the model.
        blocks: its blocks, in the order they are materialized.
        layout: units and shards.
        device: where buffers live for good (parameters are paged).
        param_init_fn: initializes one module; ``None`` calls its ``reset_parameters()``.

    Raises:
        RatelConfigError: a module on the meta device cannot be initialized on its own (no ``reset_parameters`` and
            no ``param_init_fn``, or it holds parameters owned by different blocks).
    """

    def __init__(self, module: nn.Module, blocks: Sequence[Block], layout: Layout, device: torch.device,
                 param_init_fn: ParamInitFn | None) -> None:
        self.module = module
        self.blocks = blocks
        self.layout = layout
        self.device = device
        self.init = param_init_fn or _reset_parameters
        self._explicit_init = param_init_fn is not None
        self._meta = {id(s.param) for s in layout.slots if s.param.is_meta}
        self._was_meta = set(self._meta)
        self._check()

    def _check(self) -> None:
        """Fail before anything is allocated if meta parameters cannot be initialized block by block."""
        if not self._meta:
            return
        unit_of = {id(s.param): u.index for u in self.layout.units.values() for s in u.slots}
        for name, m in self.module.named_modules():
            direct = list(m.parameters(recurse=False))
            if not any(id(p) in self._meta for p in direct) and not any(b.is_meta for b in m.buffers(recurse=False)):
                continue
            if not self._explicit_init and not callable(getattr(m, "reset_parameters", None)):
                raise RatelConfigError(
                    f"the model is on the meta device and module {name!r} ({type(m).__name__}) has no "
                    "reset_parameters(); pass RatelStrategy(param_init_fn=...) to initialize each module"
                )
            if len({unit_of[id(p)] for p in direct}) > 1:
                raise RatelConfigError(
                    f"module {name!r} is on the meta device and holds parameters owned by different blocks (tied "
                    "weights); it cannot be initialized one block at a time. Build it off the meta device."
                )

    def _materialize(self, modules: Sequence[nn.Module]) -> None:
        """Give the meta parameters and buffers of ``modules`` host memory and initialize them, module by module."""
        for m in modules:
            params = [p for p in m.parameters(recurse=False) if id(p) in self._meta]
            buffers = [n for n, b in m.named_buffers(recurse=False) if b.is_meta]
            if not params and not buffers:
                continue
            for p in params:
                # Swapped in place, so the optimizer's and the blocks' references stay the same objects.
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
                self._meta.discard(id(p))
            for n in buffers:
                m._buffers[n] = torch.empty_like(m._buffers[n], device="cpu")
            self.init(m)
            for n in buffers:
                m._buffers[n] = m._buffers[n].to(self.device)

    def load(self, store: TensorStore | None) -> None:
        """Materialize meta parameters, fill the host caches and write masters (and stored compute copies).

        Block by block: a parameter that was on the meta device holds host memory only until its unit is written.
        Moments start as zeros without a write. Without a store (evaluation) nothing is written.
        """
        layout = self.layout
        compute_on_store = layout.param_cache == "ssd"
        if store is not None:
            for shard in layout.shards:
                for what in ("exp_avg", "exp_avg_sq"):
                    store.reserve(shard.key(what), shard.numel * 4)
            for shard in layout.all_shards:
                if not shard.master_in_host:
                    store.reserve(shard.key("master"), shard.numel * 4)
                if compute_on_store and shard.dtype != torch.float32:
                    store.reserve(shard.compute_key, shard.numel * shard.dtype.itemsize)
            store.preallocate()
        writer = _ShardWriter(store, layout.all_shards, compute_on_store)
        unit_shards = layout.unit_shards()
        try:
            for block in self.blocks:
                materialized = set(self._meta)
                self._materialize([block.module] if block.direct_only else list(block.module.modules()))
                unit = layout.units.get(block.index)
                if unit is None:
                    continue
                for slot in unit.slots:
                    if unit.host:
                        slot.view(unit.host).copy_(slot.param.data)
                for shard in unit_shards.get(unit.index, ()):
                    writer.write(shard)
                if store is not None:
                    for slot in unit.slots:
                        if id(slot.param) in materialized:
                            slot.param.data = nan_placeholder(slot.param)
            # Buffers of modules outside every block (rotary tables, masks).
            self._materialize(list(self.module.modules()))
        finally:
            writer.finish()

    def undo(self) -> None:
        """Put parameters that came on the meta device back there after a failed setup, so a retry initializes them
        again instead of training from whatever they hold."""
        for slot in self.layout.slots:
            p = slot.param
            if id(p) in self._was_meta and not p.is_meta:
                torch.utils.swap_tensors(
                    p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))


class _ShardWriter:
    """Writes shards' fp32 masters (but not those the host cache holds; and, when the pager reads them from the store,
    16-bit compute copies) from the parameters' current values, through two staging buffer sets so one fills while
    the other is written.

    Args:
        store: the swap store; ``None`` writes nothing.
        shards: every shard that will be written (sizes the staging buffers).
        compute_copies: also write each 16-bit shard's compute copy.
    """

    def __init__(self, store: TensorStore | None, shards: list[Shard], compute_copies: bool) -> None:
        self.store = store
        self.compute_copies = compute_copies
        largest = max((s.numel for s in shards), default=0) if store is not None else 0
        half = max((s.numel * s.dtype.itemsize for s in shards if s.dtype != torch.float32), default=0)
        half = round_up(half, ALIGNMENT) if compute_copies and store is not None else 0
        self._staging = [
            (aligned_empty(largest, torch.float32, huge=True),
             aligned_empty(half, torch.uint8, huge=True) if half else None)
            for _ in range(2 if store is not None else 0)
        ]
        self._pending: list[list[Future]] = [[], []]
        self._count = 0

    def write(self, shard: Shard) -> None:
        if self.store is None or shard.master_in_host:
            return
        k = self._count % 2
        self._count += 1
        for future in self._pending[k]:
            future.result()
        master_buf, half_buf = self._staging[k]
        buf = master_buf[: shard.numel]
        for sp in shard.params:
            sp.view(buf).copy_(sp.param.data)
        futures = [self.store.write(shard.key("master"), buf)]
        if self.compute_copies and shard.dtype != torch.float32:
            assert half_buf is not None
            copy = half_buf.view(shard.dtype)[: shard.numel]
            copy.copy_(buf)
            futures.append(self.store.write(shard.compute_key, copy))
        self._pending[k] = futures

    def finish(self) -> None:
        """Wait for every write (raising the first error)."""
        pending, self._pending = self._pending, [[], []]
        for futures in pending:
            for future in futures:
                future.result()
