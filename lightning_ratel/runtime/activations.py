"""Saved-activation placement through autograd's saved-tensor hooks.

Each block runs under its own pack/unpack hooks. What autograd saves is one of:

- a paging placeholder, in a block whose forward runs unwatched (see :mod:`lightning_ratel.runtime.escapes`): never;
  the block read a parameter that is not paged in with it, and computed with its NaN (:class:`PlaceholderRead`);
- a view of a paged parameter: saved as a reference and rebuilt from the resident copy in backward (saving it would
  pin the whole parameter on the device and defeat paging);
- a tensor placed by the block's placement: ``device`` (left where it is), ``host`` (copied to host memory on the
  device->host stream), ``ssd`` (copied to host, then written to the swap store; read back one block ahead of
  backward, or handed back from memory if its write has not finished: forwarding) or ``recompute`` (not stored;
  rebuilt in backward by a partial replay of the block's forward, see :mod:`lightning_ratel.runtime.recompute`).

Host copies live in buffers of the device's host pool, which takes them back once autograd (or the store write) is
done with them and the copies using them have completed. A copy back to the device waits for the copy that filled
its host buffer, and hands its result to the compute stream with :meth:`~lightning_ratel.runtime.device.Device.use`.

A block's placement is one tier for everything it saves, or a mapping from op names (as
:class:`~lightning_ratel.runtime.recompute.OpTracker` names them) to tiers, where ``"input"`` stands for the block's
inputs and ``"*"`` for ops the mapping does not name. A tensor is placed by the op that produced its storage. A tensor
object saved by several ops is packed once (deduplication).

Threads: packing runs on the training thread (forward), unpacking on autograd's thread (backward), never both at
once; both read and write the per-pass tables (records, refs by block, the deduplication map). The cache's own I/O
threads only run ``ssd``-tier writes and clear a ref's in-memory copy once its write has landed (a field the unpacking
thread reads once, then uses its local copy).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.recompute import ForwardRecord, KeptOutput
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.tiers import Placement, tier_of


@dataclass
class _ParamRef:
    block: int
    unit: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _HostRef:
    block: int
    host: torch.Tensor
    # Completes when the device->host copy has filled ``host``.
    event: Any
    # The saved tensor's strides, which its copy back gets again.
    stride: tuple[int, ...]


@dataclass
class _SsdRef:
    block: int
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # The staging copy, kept until the store write completes so backward can use it directly (forwarding).
    host: torch.Tensor | None
    # Completes when the device->host copy has filled ``host``.
    event: Any = None
    # The device tensor itself when the store writes device memory directly (kvikio); kept until written, likewise.
    device: torch.Tensor | None = None
    write: Future | None = None
    read: Future | None = None
    read_buffer: torch.Tensor | None = None
    # The saved tensor's strides (what is written is its elements in row-major order).
    stride: tuple[int, ...] = ()


@dataclass
class _RecomputeRef:
    block: int
    record: ForwardRecord
    op: int
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    # The saved tensor's dtype: it may view the output's memory as another (``view_as_complex``, ``view_as_real``).
    dtype: torch.dtype


def _laid_out(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``t`` (a saved tensor brought back in row-major order) with the strides it was saved with: backward kernels
    take other paths on another layout (a transposed operand of a matmul), and their results round differently.

    A tensor that overlapped itself (expanded) comes back row-major: its layout cannot be written into.
    """
    if tuple(t.stride()) == stride or any(s == 0 and n > 1 for n, s in zip(t.shape, stride)):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


class PlaceholderRead(RuntimeError):
    """An op of a block's forward saved a parameter's paging placeholder for backward: the block read a parameter that
    was not paged in with it, and computed with its NaN.

    Attributes:
        block: the block whose forward read it.
        name: the parameter's name.
    """

    def __init__(self, block: int, name: str) -> None:
        super().__init__(f"block {block} read the paging placeholder of {name}")
        self.block = block
        self.name = name


def _is_ref(x: Any) -> bool:
    return isinstance(x, (_ParamRef, _HostRef, _SsdRef, _RecomputeRef))


class ActivationCache:
    """Packs and unpacks saved tensors according to each block's placement.

    Backward's position is not this class's business: whoever tracks it calls :meth:`prefetch_block` for the blocks
    backward reaches next and :meth:`done_with` for the ones it has left. Unpacking only rebuilds tensors.

    Args:
        device: the compute device.
        pager: the parameter pager, to recognise parameter views and rebuild them in backward.
        placements: placement per block index (a tier, or op name -> tier).
        store: creates the swap store for the ``ssd`` tier on first use; a store whose ``device_tensors`` is true
            reads and writes device memory itself (kvikio), so nothing is staged in host memory.
        min_bytes: tensors smaller than this stay on the device; moving them costs more than it saves.
    """

    def __init__(
        self,
        device: Device,
        pager: ParameterPager,
        placements: list[Placement],
        store: Callable[[], TensorStore],
        min_bytes: int = 1024,
    ) -> None:
        self.device = device
        self.pager = pager
        self.placements = list(placements)
        self._store_factory = store
        self._store: TensorStore | None = None
        self.min_bytes = min_bytes
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ratel-act")
        self._by_block: dict[int, list[_SsdRef]] = {}
        self._records: dict[int, list[ForwardRecord]] = {}
        self._open: dict[int, ForwardRecord] = {}
        # id -> (weak reference, packed ref): a dead tensor whose id is reused never matches its weak reference.
        self._dedup: dict[int, tuple[weakref.ref, Any]] = {}
        self._counter = 0
        self._pending_writes: list[Future] = []
        # Bytes written to the ssd tier so far.
        self.ssd_bytes = 0
        # bytes packed off the device (or kept) per block, for the profile of blocks that are not tracked op by op
        self.saved_by_block: dict[int, int] = {}
        self._stall = 0.0
        # Blocks whose forwards run unwatched in the current pass: a placeholder they save is a read nobody paged in.
        self.unwatched: set[int] = set()

    def hooks(self, block: int) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks context for one forward pass of ``block``."""
        if self.placements[block] == "device":
            # A forward saves hundreds of tensors: where every one stays as it is, the short path (on a GPU the host
            # queues the blocks' kernels, and these hooks are part of its time).
            return torch.autograd.graph.saved_tensors_hooks(functools.partial(self._keep, block), self._unpack)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(block, t), self._unpack)

    def add_block(self, placement: Placement = "device") -> None:
        """One more block, at the next index (a container found using a parameter of another block)."""
        self.placements.append(placement)

    def set_placements(self, placements: list[Placement]) -> None:
        """Place activations differently from the next forward pass on (a new plan)."""
        self.placements = list(placements)

    def tracked(self, block: int) -> bool:
        """Whether ``block``'s placement depends on which op produced a tensor (its forward must be tracked)."""
        return isinstance(self.placements[block], dict)

    def begin_record(self, record: ForwardRecord, args: Any, kwargs: Any) -> None:
        """A tracked forward of ``record.block`` starts: pack its inputs under the ``input`` placement, since a
        replay starts from them."""
        self._open[record.block] = record
        self._records.setdefault(record.block, []).append(record)
        # A replay only queues its kernels on CUDA: time it on the device's clock.
        record.stopwatch = self.device.stopwatch

        record.keep_inputs(args, kwargs,
                           lambda t: self._pack_as(record.block, t, tier_of(self.placements[record.block], None)))

    def end_record(self, block: int) -> None:
        """The tracked forward of ``block`` ended: what identified producers is no longer needed."""
        record = self._open.pop(block, None)
        if record is not None:
            record.owner.clear()
            record.direct.clear()

    def records(self, block: int) -> list[ForwardRecord]:
        """The tracked forward passes of ``block`` in this pass (for profiling)."""
        return self._records.get(block, [])

    @property
    def store(self) -> TensorStore:
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    @property
    def _device_direct(self) -> bool:
        return self._store is not None and self._store.device_tensors

    def _pack(self, block: int, t: torch.Tensor) -> Any:
        record = self._open.get(block)
        if record is None:
            return self._place(block, None, t)
        record.paused = True
        try:
            return self._place(block, record, t)
        finally:
            record.paused = False

    def _param_ref(self, block: int, t: torch.Tensor, storage: int) -> _ParamRef | None:
        """``t`` as a reference to the resident parameters it views (``storage``: its storage's address), read again
        at unpack; ``None`` for any other tensor. Raises where an unwatched block saves a paging placeholder."""
        if block in self.unwatched:
            placeholder = self.pager.placeholder_slot(t)
            if placeholder is not None:
                raise PlaceholderRead(block, placeholder[1].name)
        located = self.pager.param_view(storage)
        if located is None:
            return None
        return _ParamRef(block, located[0], located[1], t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _keep(self, block: int, t: torch.Tensor) -> Any:
        """:meth:`_place` for an untracked block whose activations stay on the device."""
        param = self._param_ref(block, t, t.untyped_storage().data_ptr())
        return param if param is not None else self._pack_as(block, t, "device")

    def _place(self, block: int, record: ForwardRecord | None, t: torch.Tensor) -> Any:
        storage = t.untyped_storage().data_ptr()
        param = self._param_ref(block, t, storage)
        if param is not None:
            return param
        produced = record.producer(t) if record is not None else None
        tier = tier_of(self.placements[block], record.ops[produced[0]].name if produced is not None else None)
        nbytes = t.numel() * t.element_size()
        if record is not None and nbytes >= self.min_bytes:
            record.count_saved(storage, produced[0] if produced is not None else -1, nbytes)
        if tier == "recompute" and produced is not None:
            assert record is not None
            record.targets.add(produced[0])
            return _RecomputeRef(block, record, produced[0], produced[1], tuple(t.size()), tuple(t.stride()),
                                 t.storage_offset(), t.dtype)
        if tier == "recompute":
            tier = "host"
        ref = self._pack_as(block, t, tier)
        if record is not None and produced is not None:
            op = record.direct_op(t)
            # Handed back in a replay as the output of the op that returned it, unless written in place since; a
            # tensor kept as it is, too (else a replay would run every op that led to it again).
            if op is not None and op >= produced[0] and len(record.ops[op].out_meta) == 1:
                record.stored[op] = KeptOutput(t) if ref is t else ref
        return ref

    def _pack_as(self, block: int, t: torch.Tensor, tier: str) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.device != self.device.device:
            return t
        known = self._dedup.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        self.saved_by_block[block] = self.saved_by_block.get(block, 0) + nbytes
        if tier == "device":
            self._dedup[id(t)] = (weakref.ref(t), t)
            return t
        if tier == "host":
            host, event = self.device.to_host(t.detach())
            ref: Any = _HostRef(block, host, event, tuple(t.stride()))
        else:
            ref = self._pack_ssd(block, t.detach(), nbytes)
        self._dedup[id(t)] = (weakref.ref(t), ref)
        return ref

    def _pack_ssd(self, block: int, t: torch.Tensor, nbytes: int) -> _SsdRef:
        key = f"act{block}.{self._counter}.{nbytes}"
        self._counter += 1
        store = self.store
        if self._device_direct:
            # The store orders its transfer after the work queued on this stream, so it is submitted from here.
            flat = t.reshape(-1)
            ref = _SsdRef(block, key, tuple(t.shape), t.dtype, None, device=flat, stride=tuple(t.stride()))
            ref.write = store.write(key, flat)
        else:
            # The store reads raw bytes of a contiguous tensor. With separate device memory they are staged into a
            # page-aligned buffer of the host pool (pinned on CUDA, reused from step to step, and moved without a
            # bounce); on the CPU the tensor already is host memory and is written as it is (kept alive until the
            # write lands; the store bounces blocks that are not page-aligned).
            staged, event = self.device.to_host(t.reshape(-1))
            ref = _SsdRef(block, key, tuple(t.shape), t.dtype, staged, event, stride=tuple(t.stride()))

            def write() -> None:
                event.synchronize()
                store.write(key, staged).result()

            ref.write = self._io.submit(write)
        ref.write.add_done_callback(lambda f, r=ref: self._written(r, f))
        self._pending_writes.append(ref.write)
        self._by_block.setdefault(block, []).append(ref)
        self.ssd_bytes += nbytes
        return ref

    @staticmethod
    def _written(ref: _SsdRef, future: Future) -> None:
        # Free the staging copy once the data is safely on disk; a failed write keeps it so the error surfaces
        # from the future instead of as a missing buffer.
        if future.exception() is None:
            ref.host = None
            ref.device = None

    def prefetch_block(self, block: int) -> None:
        """Start reading ``block``'s swapped tensors back from the store (called one block ahead in backward)."""
        for ref in self._by_block.get(block, ()):
            self._read_back(ref)

    def _read_back(self, ref: _SsdRef) -> None:
        """Start reading ``ref`` back from the store unless its data is in memory or on its way."""
        if ref.read is not None or ref.host is not None or ref.device is not None:
            return
        numel = int(torch.Size(ref.shape).numel())
        if self._device_direct:
            ref.read_buffer = torch.empty(numel, dtype=ref.dtype, device=self.device.device)
        else:
            # Page-aligned, so the read lands without a bounce, and reused from step to step: into fresh memory the
            # same reads took twice the CPU time (benchmarks/store_bandwidth.py). The copy to a separate device is
            # recorded against it, so dropping it never waits; on the CPU the buffer becomes the tensor, and its
            # memory is reused once that dies.
            ref.read_buffer = self.device.host_buffer(numel, ref.dtype)
        # Backward reaches this block next and waits for these reads.
        ref.read = self.store.read(ref.key, ref.read_buffer, urgent=True)

    def _unpack(self, ref: Any) -> torch.Tensor:
        if isinstance(ref, torch.Tensor):
            return ref
        if isinstance(ref, _ParamRef):
            flat = self.pager.device_flat(ref.unit, ref.dtype)
            if flat is None:
                # Backward reached the block without passing through an output of it that carries a gradient (a
                # container returning a custom object): page the unit in now, for the rest of the pass.
                self.pager.hold(ref.unit)
                flat = self.pager.device_flat(ref.unit, ref.dtype)
                assert flat is not None
            return flat.as_strided(ref.size, ref.stride, ref.offset)
        if isinstance(ref, _RecomputeRef):
            ref.record.replay(self._unpack, self._restore)
            out = ref.record.recomputed(ref.op, ref.index)
            if out.dtype != ref.dtype:
                # Size, strides and offset count elements of the saved tensor's dtype: view the memory as that.
                out = torch.empty(0, dtype=ref.dtype, device=out.device).set_(out.untyped_storage())
            return out.as_strided(ref.size, ref.stride, ref.offset)
        if isinstance(ref, _HostRef):
            return _laid_out(self._to_device(ref.host, ref.event), ref.stride)
        return _laid_out(self._unpack_ssd(ref), ref.stride)

    def _unpack_ssd(self, ref: _SsdRef) -> torch.Tensor:
        # Taken once: the write's completion callback may clear them meanwhile.
        host, on_device = ref.host, ref.device
        if on_device is not None:
            return on_device.view(ref.shape)
        if host is not None:
            # Forwarding: the staging copy may still be on its way from the device.
            return self._to_device(host.view(ref.shape), ref.event)
        self._read_back(ref)
        assert ref.read is not None
        start = time.perf_counter()
        host = ref.read.result()
        self._stall += time.perf_counter() - start
        if self._device_direct:
            return host.view(ref.shape)
        return self._to_device(host.view(ref.shape), None)

    def _to_device(self, host: torch.Tensor, filled: Any) -> torch.Tensor:
        """``host`` on the device, for the compute stream, once ``filled`` (the copy writing ``host``) completes."""
        out, event = self.device.to_device(host, after=filled)
        self.device.use(event, out)
        return out

    def _restore(self, tree: Any) -> Any:
        return tree_map(lambda x: x if isinstance(x, torch.Tensor) or not _is_ref(x) else self._unpack(x), tree)

    def take_busy_intervals(self) -> list[tuple[float, float]]:
        """``time.perf_counter`` intervals during which the ssd tier's store moved data, since the last call."""
        return self._store.take_busy_intervals() if self._store is not None else []

    def transferred_bytes(self) -> tuple[int, int]:
        """Bytes the ssd tier's store has read and written since it was opened (zeros before)."""
        return (self._store.bytes_read, self._store.bytes_written) if self._store is not None else (0, 0)

    def take_stall_seconds(self) -> float:
        """Seconds backward waited for swapped activations to come back from disk, since the last call."""
        stall, self._stall = self._stall, 0.0
        return stall

    def done_with(self, block: int) -> None:
        """Backward has left ``block``: drop its recomputed tensors and read-back buffers (device and host memory).

        A tensor unpacked again later is rebuilt the same way (replayed or read), so this only costs time.
        """
        for record in self._records.get(block, ()):
            record.outputs = None
        for ref in self._by_block.get(block, ()):
            if ref.read is not None and ref.read.done() and ref.host is None and ref.device is None:
                ref.read = None
                ref.read_buffer = None

    def end_pass(self) -> None:
        """Forget this pass's tensors once backward is done; waits for writes still in flight (and raises theirs)."""
        pending, self._pending_writes = self._pending_writes, []
        self._by_block.clear()
        self._records.clear()
        self._open.clear()
        self._dedup.clear()
        self._counter = 0
        for future in pending:
            future.result()

    @property
    def host_bytes_in_use(self) -> int:
        return sum(
            ref.host.numel() * ref.host.element_size() if ref.host is not None else 0
            for refs in self._by_block.values()
            for ref in refs
        )

    @property
    def disk_bytes(self) -> int:
        """Bytes reserved in the activation swap files (zero until the first ``ssd`` tensor)."""
        return self._store.nbytes_reserved if self._store is not None else 0

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self._store is not None:
            self._store.close()
            self._store = None
