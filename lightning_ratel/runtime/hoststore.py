"""Optimizer states held in host memory, and the store that places each key in host memory or in the swap files.

A :class:`HostStore` keeps named extents in host memory with the contract of
:class:`~lightning_ratel.runtime.storage.TensorStore`: :meth:`~HostStore.write` and :meth:`~HostStore.read` return
futures, a key never written reads as zeros. Its bytes never leave the process's memory, so it keeps no checksums.
A copy runs as ``memmove`` calls on the store's threads (the GIL is released during each), cut into pieces so a large
extent keeps several threads busy, or on the calling thread for a store without threads of its own; a write of a tensor
that *is* the key's memory (:meth:`~HostStore.view`) copies nothing, which lets the CPU optimizer update a shard's
states in place in the slot it writes.

A :class:`TieredStore` is what the rest of the run sees: every key goes to the swap files unless it was placed in
host memory (or on the device), and everything that is about the swap files (paths, kept files, their metadata,
bytes moved to and from the drives) is the swap store's.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.runtime.peerstore import PeerStore
from lightning_ratel.runtime.storage import Extent, Gather, TensorStore
from lightning_ratel.sizes import format_bytes, round_up

COPY_PIECE_BYTES = 64 << 20
"""Bytes one thread copies in one go: large enough that a call costs nothing next to it, small enough that a large
extent is spread over every thread."""


def _done(value: Any = None) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


class HostStore:
    """Named extents in host memory, read and written asynchronously.

    Args:
        name: what the store holds, for messages.
        threads: threads that copy; 0 copies on the calling thread (where the compute already fills every core, a
            thread of its own would only take one from the compute, and wake its caller again for every copy).
    """

    def __init__(self, name: str = "ratel-states", threads: int = 1) -> None:
        self.name = name
        self._sizes: dict[str, int] = {}
        self._memory: dict[str, torch.Tensor] = {}
        self._written: set[str] = set()
        # The last copy started per key: the next one on that key waits for it, so reads see the last write and a
        # write never overtakes a read in flight.
        self._last: dict[str, concurrent.futures.Future] = {}
        self._arenas: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                            thread_name_prefix=f"ratel-copy-{name}")
                      if threads > 0 else None)
        self._threads = max(1, threads)
        self._closed = False
        self.bytes_copied = 0

    @property
    def nbytes_reserved(self) -> int:
        """Host bytes of every extent reserved."""
        return sum(round_up(n, ALIGNMENT) for n in self._sizes.values())

    @property
    def nbytes_allocated(self) -> int:
        """Host bytes allocated so far (extents reserved after the last :meth:`preallocate` have none yet)."""
        return sum(a.numel() for a in self._arenas)

    def keys(self) -> list[str]:
        return list(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def nbytes(self, key: str) -> int:
        """Bytes of ``key``'s extent."""
        return self._sizes[key]

    def reserve(self, key: str, nbytes: int) -> None:
        """Lay out ``key``'s extent (memory comes with the next :meth:`preallocate`, or the first use).

        Raises:
            ValueError: ``nbytes`` is negative or ``key`` is reserved with another size.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes} for key {key!r}")
        known = self._sizes.get(key)
        if known is not None and known != nbytes:
            raise ValueError(f"key {key!r} is reserved with {known} bytes, not {nbytes}")
        self._sizes[key] = nbytes

    def preallocate(self) -> None:
        """Allocate host memory for every extent reserved and not allocated yet, in one mapping.

        Raises:
            RatelConfigError: the memory cannot be had (the message says how much and what to change).
        """
        missing = [k for k in self._sizes if k not in self._memory]
        total = sum(round_up(max(self._sizes[k], 1), ALIGNMENT) for k in missing)
        if not missing:
            return
        arena = self._allocate(total)
        self._arenas.append(arena)
        offset = 0
        for key in missing:
            self._memory[key] = arena[offset : offset + self._sizes[key]]
            offset += round_up(max(self._sizes[key], 1), ALIGNMENT)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """One arena of ``nbytes`` for the extents (huge pages where the kernel gives them).

        Raises:
            RatelConfigError: the memory cannot be had (the message says how much and what to change).
        """
        try:
            return aligned_empty(nbytes, torch.uint8, huge=True)
        except (MemoryError, OSError, RuntimeError) as err:
            raise RatelConfigError(
                f"{format_bytes(nbytes)} of host memory for the optimizer states kept in RAM could not be allocated "
                f"({type(err).__name__}: {err}). Give RatelStrategy a lower host_memory_limit, or "
                "optimizer_states='ssd' to keep them in the swap files.") from err

    def view(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """``key``'s memory as a flat tensor of ``dtype``: writing it in place and then :meth:`write`-ing the view
        stores the values without a copy."""
        return self._extent(key).view(dtype)

    def write(self, key: str, tensor: torch.Tensor, *, urgent: bool = False) -> concurrent.futures.Future[None]:
        """Start copying ``tensor`` into ``key``; an unknown key is reserved with its size. See
        :meth:`TensorStore.write <lightning_ratel.runtime.storage.TensorStore.write>`."""
        if key not in self._sizes:
            self.reserve(key, tensor.numel() * tensor.element_size())
        target = self._extent(key)
        self._check(key, tensor)
        self._settle(key)
        self._written.add(key)
        if tensor.data_ptr() == target.data_ptr():
            return _done()
        return self._copy(key, target, tensor, None)

    def read(self, key: str, out: torch.Tensor, *, urgent: bool = False) -> concurrent.futures.Future[torch.Tensor]:
        """Start copying ``key`` into ``out``. See :meth:`TensorStore.read
        <lightning_ratel.runtime.storage.TensorStore.read>`.

        Raises:
            KeyError: ``key`` was never reserved or written.
        """
        if key not in self._sizes:
            raise KeyError(f"{self.name}: no key {key!r}")
        self._check(key, out)
        self._settle(key)
        if key not in self._written:
            out.view(torch.uint8).zero_()
            return _done(out)
        source = self._extent(key)
        if source.data_ptr() == out.data_ptr():
            return _done(out)
        return self._copy(key, out, source, out)

    def written(self, key: str) -> bool:
        """Whether ``key`` holds values (otherwise it reads as zeros)."""
        return key in self._written

    def close(self) -> None:
        """Wait for copies in flight and free the memory. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._memory.clear()
        self._arenas.clear()

    def _extent(self, key: str) -> torch.Tensor:
        if self._closed:
            raise RuntimeError(f"{self.name}: the store is closed")
        memory = self._memory.get(key)
        if memory is None:
            self.preallocate()
            memory = self._memory[key]
        return memory

    def _check(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or nbytes != self._sizes[key]:
            raise ValueError(f"{self.name}: key {key!r} holds {self._sizes[key]} bytes; got a "
                             f"{'contiguous' if tensor.is_contiguous() else 'strided'} {tensor.device.type} tensor "
                             f"of {nbytes}")

    def _settle(self, key: str) -> None:
        last = self._last.get(key)
        if last is not None:
            last.exception()

    def _copy(self, key: str, dst: torch.Tensor, src: torch.Tensor, result: Any) -> concurrent.futures.Future:
        nbytes = dst.numel() * dst.element_size()
        with self._lock:
            self.bytes_copied += nbytes
        pieces = max(1, min(self._threads, -(-nbytes // COPY_PIECE_BYTES)))
        step = max(ALIGNMENT, round_up(-(-nbytes // pieces), ALIGNMENT))
        starts = range(0, nbytes, step)
        gather = Gather(len(starts), result)
        for start in starts:
            if self._pool is None:
                _copy_bytes(dst, src, start, min(step, nbytes - start), gather)
                continue
            # Each task holds both tensors: the caller may drop its references before the copy runs.
            self._pool.submit(_copy_bytes, dst, src, start, min(step, nbytes - start), gather)
        future = gather.future
        self._last[key] = future
        # A finished copy's future (and the tensor it resolves to) need not outlive it.
        future.add_done_callback(lambda f: self._last.pop(key, None) if self._last.get(key) is f else None)
        return future


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor, start: int, nbytes: int, gather: Gather) -> None:
    error = None
    try:
        ctypes.memmove(dst.data_ptr() + start, src.data_ptr() + start, nbytes)
    except BaseException as err:
        error = err
    gather.finish(error)


class DeviceKeys(Protocol):
    """A store of keys held in device memory (:class:`~lightning_ratel.runtime.device_adam.DeviceStates`)."""

    def reserve(self, key: str, nbytes: int) -> None: ...

    def preallocate(self) -> None: ...

    def write(self, key: str, tensor: torch.Tensor, *, urgent: bool = False) -> concurrent.futures.Future: ...

    def read(self, key: str, out: torch.Tensor, *, urgent: bool = False) -> concurrent.futures.Future: ...

    def nbytes(self, key: str) -> int: ...

    def keys(self) -> list[str]: ...

    def written(self, key: str) -> bool: ...

    @property
    def nbytes_allocated(self) -> int: ...

    def close(self) -> None: ...


class TieredStore:
    """The model-state store of a run: each key in host memory (:class:`HostStore`) where it was placed there, in the
    swap files (:class:`~lightning_ratel.runtime.storage.TensorStore`) otherwise.

    Reads and writes follow the key; reserving and preallocating go to both. Whatever concerns the swap files (their
    paths, keeping them at close, their metadata) is the swap store's: attributes not defined here are looked up on
    it. Keys another rank of the node writes into its own swap files (:meth:`attach_peer`) are read from there; the
    bytes moved to and from the drives, and when, count those reads too.

    Args:
        disk: the swap store.
        host: the host-memory store.
        host_keys: the keys that live in ``host``.
        device: the store of the states kept on the device (the device tier's), if any.
        device_keys: the keys that live in ``device``.
    """

    def __init__(self, disk: TensorStore, host: HostStore, host_keys: Iterable[str] = (),
                 device: DeviceKeys | None = None, device_keys: Iterable[str] = ()) -> None:
        self.disk = disk
        self.host = host
        self.host_keys = frozenset(host_keys)
        self.device = device
        self.device_keys = frozenset(device_keys) if device is not None else frozenset()
        self.peers: list[PeerStore] = []
        self._peer_keys: dict[str, PeerStore] = {}

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this class lacks: the swap store's.
        if name in ("disk", "host", "host_keys", "device", "device_keys", "peers", "_peer_keys"):
            raise AttributeError(name)
        return getattr(self.disk, name)

    def attach_peer(self, peer: PeerStore) -> None:
        """Read the keys ``peer`` adopts (another rank's swap files) from it; it closes with this store."""
        self.peers.append(peer)

    def adopt(self, peer: PeerStore, key: str, extent: Extent) -> None:
        """Read ``key`` from ``peer`` (attached), where ``extent`` says it is (:meth:`PeerStore.adopt`)."""
        peer.adopt(key, extent)
        self._peer_keys[key] = peer

    def peer_of(self, key: str) -> PeerStore | None:
        """The other rank's store ``key`` is read from, ``None`` for a key of this rank's."""
        return self._peer_keys.get(key)

    @property
    def bytes_read(self) -> int:
        """Bytes read from the drives: this rank's swap files and other ranks' (see :meth:`attach_peer`)."""
        return self.disk.bytes_read + sum(p.bytes_read for p in self.peers)

    @property
    def bytes_shared(self) -> int:
        """Bytes reads copied from another read's memory instead of reading the drives."""
        return self.disk.bytes_shared + sum(p.bytes_shared for p in self.peers)

    def take_busy_intervals(self) -> list[tuple[float, float]]:
        """Intervals during which a transfer ran, this rank's swap files or other ranks' (since the last call)."""
        busy = self.disk.take_busy_intervals()
        for peer in self.peers:
            busy.extend(peer.take_busy_intervals())
        return busy

    def in_host(self, key: str) -> bool:
        """Whether ``key`` lives in host memory."""
        return key in self.host_keys

    def _route(self, key: str) -> TensorStore | HostStore | DeviceKeys:
        if key in self.device_keys:
            assert self.device is not None
            return self.device
        return self.host if key in self.host_keys else self.disk

    def reserve(self, key: str, nbytes: int) -> None:
        self._route(key).reserve(key, nbytes)

    def preallocate(self) -> None:
        if self.device is not None:
            self.device.preallocate()
        self.host.preallocate()
        self.disk.preallocate()

    def write(self, key: str, tensor: torch.Tensor, *, urgent: bool = False, share: bool = False,
              sums: torch.Tensor | None = None) -> concurrent.futures.Future[None]:
        """Write ``key`` where it lives; ``share`` and ``sums`` apply to the swap files' keys (see
        :meth:`TensorStore.write <lightning_ratel.runtime.storage.TensorStore.write>`): a read of a key in host memory
        is a copy anyway, and nothing checksums it."""
        if key in self.host_keys or key in self.device_keys:
            return self._route(key).write(key, tensor, urgent=urgent)
        # Another rank's key refuses the write (read-only) rather than becoming one of this rank's.
        return self._peer_keys.get(key, self.disk).write(key, tensor, urgent=urgent, share=share, sums=sums)

    def shares(self, key: str) -> bool:
        """See :meth:`TensorStore.shares <lightning_ratel.runtime.storage.TensorStore.shares>` (never for a key in
        host memory)."""
        peer = self._peer_keys.get(key)
        if peer is not None:
            return peer.shares(key)
        return key not in self.host_keys and key not in self.device_keys and self.disk.shares(key)

    def read(self, key: str, out: torch.Tensor, *, urgent: bool = False, share: bool = False
             ) -> concurrent.futures.Future[torch.Tensor]:
        """Read ``key`` from where it lives; ``share`` applies to the swap files' keys (see :meth:`TensorStore.read
        <lightning_ratel.runtime.storage.TensorStore.read>`): a key in host memory is a copy anyway."""
        if key in self.host_keys or key in self.device_keys:
            return self._route(key).read(key, out, urgent=urgent)
        return self._peer_keys.get(key, self.disk).read(key, out, urgent=urgent, share=share)

    def unshare(self, tensor: torch.Tensor) -> list[concurrent.futures.Future]:
        """See :meth:`TensorStore.unshare <lightning_ratel.runtime.storage.TensorStore.unshare>`."""
        copies = self.disk.unshare(tensor)
        for peer in self.peers:
            copies += peer.unshare(tensor)
        return copies

    def offers(self, tensor: torch.Tensor) -> bool:
        """See :meth:`TensorStore.offers <lightning_ratel.runtime.storage.TensorStore.offers>`."""
        return self.disk.offers(tensor) or any(peer.offers(tensor) for peer in self.peers)

    def nbytes(self, key: str) -> int:
        peer = self._peer_keys.get(key)
        return peer.nbytes(key) if peer is not None else self._route(key).nbytes(key)

    def keys(self) -> list[str]:
        return self.disk.keys() + self.host.keys() + (self.device.keys() if self.device is not None else [])

    def keep_at_close(self) -> None:
        """Keep the swap files at close, with every state held in host or device memory written into them first: a
        kept store is read later by another process (``ratel-convert``), from the files alone.

        Raises:
            RatelConfigError: the drives have no room for them.
            RatelStoreError: a write failed.
        """
        held = [key for key in sorted(self.host_keys) if key in self.host and self.host.written(key)]
        on_device = ([key for key in sorted(self.device_keys) if self.device.written(key)]
                     if self.device is not None else [])
        for key in held:
            self.disk.reserve(key, self.host.nbytes(key))
        for key in on_device:
            self.disk.reserve(key, self._route(key).nbytes(key))
        self.disk.preallocate()
        for write in [self.disk.write(key, self.host.view(key, torch.uint8)) for key in held]:
            write.result()
        for key in on_device:
            staging = aligned_empty(self._route(key).nbytes(key), torch.uint8)
            self._route(key).read(key, staging).result()
            self.disk.write(key, staging).result()
        self.disk.keep_at_close()

    @property
    def host_bytes(self) -> int:
        """Host bytes the states kept in RAM take."""
        return self.host.nbytes_allocated

    def close(self) -> None:
        """Free the host memory and close the swap store (see :meth:`TensorStore.close
        <lightning_ratel.runtime.storage.TensorStore.close>`)."""
        try:
            if self.device is not None:
                self.device.close()
            self.host.close()
            for peer in self.peers:
                peer.close()
        finally:
            self.disk.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
