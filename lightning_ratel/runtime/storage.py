"""Striped swap store on NVMe SSDs for tensors that do not fit in host memory.

A :class:`TensorStore` keeps named, fixed-size byte extents (fp32 master weights, Adam moments) in one swap file per
directory. Each extent is cut into ``stripe_bytes`` chunks placed round-robin over the directories, so one large
read or write keeps every drive busy. Chunks start at 4096-byte file offsets and occupy whole 4096-byte blocks, which
lets the store use ``O_DIRECT`` and move data straight between the drive and the caller's buffer without passing
through the page cache. Reads and writes run on a thread pool and return futures.

Every chunk written gets a checksum (:mod:`lightning_ratel.runtime.checksum`), computed on the I/O thread just before
the write (or handed in by the writer, who computed it while producing the bytes) and kept in memory beside the layout;
every read verifies it, so data the drive or another process changed surfaces as :class:`RatelStoreError`
(``EBADMSG``) naming the file, the key and the offset instead of as silently wrong weights.

The files themselves (header, exclusive creation, locks, stale files) are :mod:`lightning_ratel.runtime.swapfile`'s;
the memory the store reads into and writes from, :mod:`lightning_ratel.runtime.hostmem`'s. A store kept at close
(``keep_files=True``) writes its index, and :class:`~lightning_ratel.runtime.kept.KeptStore` reads it back later.

Subclasses (the device store in :mod:`lightning_ratel.runtime.gds`) build on :class:`Chunk`, :class:`Request` and the
hooks that :class:`TensorStore` documents.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import itertools
import json
import os
import queue
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_ratel.errors import RatelConfigError, RatelStoreError
from lightning_ratel.runtime import swapfile
from lightning_ratel.runtime.checksum import (
    WEIGHTED32,
    XXH3_64,
    block_checksums,
    checksum_of_zeros,
    host_checksum,
    native_checksum,
)
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty, raw_memory
from lightning_ratel.runtime.swapfile import (
    FILE_MODE,
    FORMAT_VERSION,
    HEADER_BYTES,
    IN_USE,
    IN_USE_TO_KEEP,
    INDEX_FORMAT,
    KEPT,
    SwapFile,
    SwapHeader,
    acquire_lock,
    check_directory,
    check_free_space,
    check_unique,
    create_swap,
    resolve_directories,
    space_detail,
    write_block,
)
from lightning_ratel.sizes import format_bytes, round_up


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    """Read into ``buf`` from ``offset``; returns the number of bytes read (possibly fewer than asked)."""
    return os.preadv(fd, [buf], offset)


def _pwrite(fd: int, buf: memoryview, offset: int) -> int:
    """Write ``buf`` at ``offset``; returns the number of bytes written (possibly fewer than asked)."""
    return os.pwrite(fd, buf, offset)


def add_note(error: BaseException, note: str) -> None:
    """Attach a PEP 678 note to ``error`` (shown with the traceback from Python 3.11; ``add_note`` itself is 3.11+)."""
    error.__notes__ = [*getattr(error, "__notes__", []), note]


@dataclass(frozen=True)
class Chunk:
    """One stripe of a key: ``length`` bytes at ``key_offset`` in the key, stored at ``file_offset`` of the swap file
    number ``file`` (its directory's position in the store's paths), occupying ``disk_length`` bytes there."""

    file: int
    file_offset: int
    key_offset: int
    length: int
    disk_length: int


class _Undefined:
    """The checksum entry of a chunk whose bytes on disk are unknown; reading it fails with ``reason``."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason


_WRITE_FAILED = _Undefined("failed", "its last write failed part way")
_WRITES_OVERLAPPED = _Undefined("overlapped", "two writes of the key ran at the same time, so either may have landed")
UNDEFINED = {entry.code: entry for entry in (_WRITE_FAILED, _WRITES_OVERLAPPED)}


@dataclass(frozen=True)
class Extent:
    """Where a key lives, and per chunk what it holds: ``None`` (never written, so zeros), the checksum of the last
    write, the :class:`Request` of a write in flight, or an :class:`_Undefined`."""

    nbytes: int
    chunks: tuple[Chunk, ...]
    sums: list[Any]


class Request:
    """A read or write of one key in flight, as the chunk transfers see it; holds the caller's tensor so its memory
    stays valid. Subclasses add what their transfers need.

    Attributes:
        urgent: its chunks run in the urgent lane.
        source: the address of host memory holding the key's bytes, which a read copies instead of reading the drive
            (see :meth:`TensorStore.read`'s ``share``); ``None`` reads the drive.
        claimed: the chunks a transfer has taken, for a request whose chunks may be queued twice (a shared read or
            write moved to the urgent lane, :meth:`TensorStore._promote`); ``None``: each chunk is queued once.
        queued: its chunks are queued (a read copying another's is queued once that one has landed).
    """

    __slots__ = ("key", "is_write", "tensor", "urgent", "source", "claimed", "queued")

    def __init__(self, key: str, is_write: bool, tensor: torch.Tensor) -> None:
        self.key = key
        self.is_write = is_write
        self.tensor = tensor
        self.urgent = False
        self.source: int | None = None
        self.claimed: set[int] | None = None
        self.queued = False


class _HostRequest(Request):
    """A request on a CPU tensor, with its memory as raw bytes for ``pread``/``pwrite``."""

    __slots__ = ("address", "aligned", "view", "sums")

    def __init__(self, key: str, is_write: bool, tensor: torch.Tensor, nbytes: int) -> None:
        super().__init__(key, is_write, tensor)
        # A write's checksum per chunk, where the writer handed them in (see TensorStore.write).
        self.sums: list[int] | None = None
        self.address = tensor.data_ptr()
        self.aligned = self.address % ALIGNMENT == 0
        span = nbytes
        if self.aligned:
            # The bytes up to the next block boundary may be transferred too, which saves the last block a second
            # transfer through the bounce buffer. A read may fill them only where they are the end of the tensor's
            # storage (as for aligned_empty), else they could belong to a neighbouring tensor; a write only reads
            # them, so any within the storage do (a slice of a larger buffer): they land in the chunk's padding,
            # which nothing reads back.
            storage = tensor.untyped_storage()
            padded = round_up(nbytes, ALIGNMENT)
            end = storage.data_ptr() + storage.nbytes()
            if end == self.address + padded or (is_write and end > self.address + padded):
                span = padded
        self.view = raw_memory(self.address, span) if span else None


@dataclass(eq=False)
class _Share:
    """A caller's tensor that holds (or a read in flight is filling with) a key's bytes, which other reads of the key
    copy instead of reading the drive (see :meth:`TensorStore.read`), or that a write of the key stores (see
    :meth:`TensorStore.write`).

    Attributes:
        tensor: the caller's tensor.
        request: the read filling it, or the write storing it.
        gather: that request's chunk count and future.
        extent: the key's extent when the read started.
        upstream: the share that read copies from once that one has landed, if it is served from memory too.
        copies: the reads copying from it (each as a share of its own, offered or not); the holder waits for those
            still running before reusing its memory.
        stale: the key was written since, so no new read copies from it.
    """

    tensor: torch.Tensor
    request: Request
    gather: Gather
    extent: Extent
    upstream: _Share | None = None
    copies: list[_Share] = field(default_factory=list)
    stale: bool = False

    def usable(self) -> bool:
        """Whether a new read of the key may copy from it: not stale, and its read has not failed."""
        future = self.gather.future
        return not self.stale and not (future.done() and future.exception() is not None)


class Gather:
    """Resolves one caller-facing future once every chunk task of a request has finished (also the pieces of a copy
    in :class:`~lightning_ratel.runtime.hoststore.HostStore`).

    The future resolves only after the last chunk, even when an earlier one failed, because the remaining chunks
    still use the caller's tensor until then.
    """

    def __init__(self, count: int, result: torch.Tensor | None) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        # A request already handed to the pool cannot be withdrawn, so the future must not be cancellable.
        self.future.set_running_or_notify_cancel()
        self._pending = count
        self._result = result
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        if count == 0:
            self.future.set_result(result)

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None:
                self._errors.append(error)
            self._pending -= 1
            if self._pending:
                return
        if not self._errors:
            self.future.set_result(self._result)
            return
        first, *others = self._errors
        for other in others:
            add_note(first, f"Another chunk of the same request also failed: {other}")
        self.future.set_exception(first)


class PriorityPool:
    """Worker threads running queued calls, urgent ones first and in submission order within a priority.

    A page-in that the computation is about to wait for must not queue behind write-backs and reads ahead of the
    optimizer, which have the rest of the step to finish.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[..., None] | None, tuple[Any, ...]]] = (
            queue.PriorityQueue())
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        """Its worker threads."""
        return len(self._threads)

    def submit(self, urgent: bool, call: Callable[..., None], *args: Any) -> None:
        self._queue.put((0 if urgent else 1, next(self._order), call, args))

    def shutdown(self) -> None:
        """Run everything queued, then stop the threads."""
        for _ in self._threads:
            self._queue.put((2, next(self._order), None, ()))
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        while True:
            _, _, call, args = self._queue.get()
            if call is None:
                return
            call(*args)
            # Not kept while waiting for the next: the finished call's request refers to the caller's tensor, and a
            # buffer of the host pool comes back only once nothing does.
            del call, args


class TensorStore:
    """Named tensors striped over swap files on one or more SSD directories, with asynchronous I/O.

    Each key is reserved once with a fixed byte size; :meth:`write` stores a tensor of that size and :meth:`read`
    fills one. Both return a future at once. Until that future is done the caller must keep the tensor alive and
    must neither modify it (write) nor use its contents (read). Requests on different keys run concurrently;
    requests on the same key are not ordered, so wait for a write before reading the key back. A read that overlaps
    a write of its key fails with ``EBUSY``; two overlapping writes leave the key undefined until it is written again.

    With direct I/O, data moves straight between the drive and a tensor that starts on a 4096-byte boundary, such
    as one from :func:`aligned_empty` or a slice of one starting at a multiple of 4096 bytes. The last partial
    block of such a slice, and all of a tensor that is not aligned, go through a per-thread bounce buffer instead.

    With ``verify`` (the default) each chunk's checksum (:data:`~lightning_ratel.runtime.checksum.WEIGHTED32` of
    exactly the key's bytes in it, or :data:`~lightning_ratel.runtime.checksum.XXH3_64` without the native extension)
    is taken on the I/O thread right before the write, unless the writer handed it in (``sums``), and published once
    the write has returned; a read checks the bytes it got and raises :class:`RatelStoreError` with ``EBADMSG`` on a
    mismatch. The checksums live in memory beside the
    layout (and in the index of a kept store). A key reserved but never written reads as zeros, verified like written
    data; where nothing was written or preallocated up to the end of the file, its read fails with ``EIO``.

    Subclasses move other kinds of tensors by overriding these hooks: ``_check_tensor(key, tensor)`` (refuse what
    cannot be moved), ``_request(key, is_write, tensor, nbytes, **extra)`` (a :class:`Request` for the transfers;
    ``extra`` is what the subclass passes to ``_submit``), ``_transfer_chunk(request, chunk)`` (move one
    :class:`Chunk` on an I/O thread and return its checksum when :attr:`verify` is on) and ``_release()`` (free what
    the subclass holds after the base class has drained its I/O). :attr:`swap_files` gives the open files in order.

    Args:
        paths: Directories for the swap files, ideally one per SSD. Several on the same drive are allowed.
        name: Base name of the files: ``<path>/<name>.swap`` and ``<path>/<name>.lock``.
        stripe_bytes: Chunk size of the round-robin striping; a positive multiple of 4096.
        io_threads_per_path: I/O threads per directory; more threads keep more requests queued on each drive.
        direct: ``True`` requires ``O_DIRECT``, ``False`` uses buffered I/O, ``None`` uses ``O_DIRECT`` where the
            filesystem supports it and buffered I/O elsewhere.
        keep_files: Leave the swap files in place at :meth:`close`, marked as kept, with ``<name>.index.json`` beside
            the first one, so that :meth:`open_kept` can read them later; lock files are always removed.
        verify: Checksum every chunk written and verify every chunk read.

    Raises:
        RatelConfigError: If an argument is invalid, a directory is missing, not a directory, not writable or in
            use by another store, ``direct=True`` cannot be honoured, or a file that is not this plugin's stale swap
            file is in the way of a swap file. Nothing is left behind in that case.
    """

    device_tensors = False
    """Whether the tensors it reads and writes are device tensors (moved without host staging)."""
    _checksum_algorithm = WEIGHTED32 if native_checksum() else XXH3_64

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        *,
        name: str = "ratel",
        stripe_bytes: int = 1 << 20,
        io_threads_per_path: int = 4,
        direct: bool | None = None,
        keep_files: bool = False,
        verify: bool = True,
    ) -> None:
        directories = resolve_directories(paths, name)
        if stripe_bytes <= 0 or stripe_bytes % ALIGNMENT:
            raise RatelConfigError(f"stripe_bytes must be a positive multiple of {ALIGNMENT}, got {stripe_bytes}")
        if io_threads_per_path < 1:
            raise RatelConfigError(f"io_threads_per_path must be at least 1, got {io_threads_per_path}")
        for directory in directories:
            check_directory(directory, name)
        check_unique(directories)
        self._init_state(name, directories, stripe_bytes, keep_files=keep_files, verify=verify, read_only=False)
        try:
            # Every lock is taken before any swap file is touched, so a refused store removes nothing.
            for directory in directories:
                lock_path = directory / f"{name}.lock"
                try:
                    self._locks.append((lock_path, acquire_lock(lock_path, directory)))
                except OSError as exc:
                    raise RatelConfigError(f"Cannot take the lock file {lock_path}: {exc.strerror}") from exc
            replaced = []
            for index, directory in enumerate(directories):
                swap_path = directory / f"{name}.swap"
                try:
                    state = IN_USE_TO_KEEP if keep_files else IN_USE
                    swap, stale = create_swap(swap_path, direct, self._header(index, state))
                except OSError as exc:
                    raise RatelConfigError(
                        f"Cannot create the swap file {swap_path}: {exc.strerror}. Remove or fix that file, or "
                        "choose another directory or store name."
                    ) from exc
                self._files.append(swap)
                if stale is not None:
                    replaced.append(stale)
            if replaced:
                rank_zero_info(f"lightning_ratel: {' '.join(replaced)}")
            self._direct = all(f.direct for f in self._files)
            buffered = [str(f.path.parent) for f in self._files if not f.direct]
            if direct is None and buffered:
                rank_zero_info(
                    f"lightning_ratel: direct I/O (O_DIRECT) is not supported in {', '.join(buffered)}; the swap "
                    "store uses buffered I/O there, which goes through the page cache."
                )
            self._pool = PriorityPool(io_threads_per_path * len(directories), f"ratel-io-{name}")
        except BaseException as error:
            self._abandon(error)
            raise

    @classmethod
    def open_kept(cls, paths: Sequence[str | os.PathLike[str]], name: str = "ratel", *, io_threads_per_path: int = 4,
                  direct: bool | None = None) -> TensorStore:
        """The kept store in ``paths``, read-only: :class:`~lightning_ratel.runtime.kept.KeptStore` (this name stays
        for code written against earlier releases)."""
        from lightning_ratel.runtime.kept import KeptStore

        return KeptStore(paths, name, io_threads_per_path=io_threads_per_path, direct=direct)

    def _init_state(
        self, name: str, directories: list[Path], stripe_bytes: int, *, keep_files: bool, verify: bool,
        read_only: bool,
    ) -> None:
        self._name = name
        self._paths = tuple(directories)
        self._stripe_bytes = stripe_bytes
        self._keep_files = keep_files
        self._verify = verify
        self._read_only = read_only
        self._algorithm = self._checksum_algorithm
        self._run_id = secrets.token_hex(8)
        self._created = time.time()
        self._lock = threading.Lock()  # guards the layout and the closed flag
        self._stats_lock = threading.Lock()
        # Guards the start and end of chunk writes in the checksum table (reads only look at single entries).
        self._sums_lock = threading.Lock()
        self._extents: dict[str, Extent] = {}
        self._tails = [HEADER_BYTES] * len(directories)
        self._next_file = 0
        self._nbytes_reserved = 0
        self._bytes_read = 0
        self._busy: list[tuple[float, float]] = []
        self._bytes_written = 0
        self._bytes_shared = 0
        # Tensors holding keys' bytes that reads of those keys copy (under ``_lock``), and the chunks taken by the
        # transfers of requests whose chunks may be queued twice.
        self._shares: dict[str, list[_Share]] = {}
        self._claims_lock = threading.Lock()
        self._locks: list[tuple[Path, int]] = []
        self._files: list[SwapFile] = []
        self._pool: PriorityPool | None = None
        self._direct = False
        self._local = threading.local()
        self._closed = False
        self._metadata: dict[str, Any] = {}

    def _header(self, index: int, state: str) -> SwapHeader:
        return SwapHeader(
            version=FORMAT_VERSION, name=self._name, run_id=self._run_id, slot=index, files=len(self._paths),
            stripe_bytes=self._stripe_bytes, pid=os.getpid(), host=os.uname().nodename, created=self._created,
            state=state,
        )

    @property
    def name(self) -> str:
        """The base name of the swap files (``<path>/<name>.swap``)."""
        return self._name

    @property
    def paths(self) -> tuple[Path, ...]:
        """The swap directories, resolved to absolute paths, in the order of their files' numbers."""
        return self._paths

    @property
    def io_threads_per_path(self) -> int:
        """I/O threads per directory."""
        return self._pool.workers // len(self._paths) if self._pool is not None else 0

    @property
    def checksum_algorithm(self) -> str:
        """The checksum its chunks are verified with (:mod:`lightning_ratel.runtime.checksum`)."""
        return self._algorithm

    @property
    def swap_files(self) -> tuple[SwapFile, ...]:
        """The open swap files, by number (empty once closed)."""
        return tuple(self._files)

    @property
    def direct(self) -> bool:
        """Whether every swap file uses direct I/O (``O_DIRECT``)."""
        return self._direct

    @property
    def stripe_bytes(self) -> int:
        """Size of the chunks that keys are striped in."""
        return self._stripe_bytes

    @property
    def verify(self) -> bool:
        """Whether chunks are checksummed on write and verified on read."""
        return self._verify

    @property
    def read_only(self) -> bool:
        """Whether this store was opened by :meth:`open_kept` (reads only)."""
        return self._read_only

    @property
    def run_id(self) -> str:
        """The random id of the run that created the swap files, as their headers and the index record it."""
        return self._run_id

    @property
    def nbytes_reserved(self) -> int:
        """Total size of all reserved keys, without the padding of chunks to 4096 bytes."""
        with self._lock:
            return self._nbytes_reserved

    @property
    def bytes_read(self) -> int:
        """Bytes read into caller tensors so far."""
        with self._stats_lock:
            return self._bytes_read

    @property
    def bytes_written(self) -> int:
        """Bytes written from caller tensors so far."""
        with self._stats_lock:
            return self._bytes_written

    @property
    def bytes_shared(self) -> int:
        """Bytes reads copied from another read's tensor instead of reading them from the drive (see :meth:`read`)."""
        with self._stats_lock:
            return self._bytes_shared

    def keys(self) -> list[str]:
        """Every reserved key, in the order of reservation."""
        with self._lock:
            return list(self._extents)

    def nbytes(self, key: str) -> int:
        """Size in bytes of ``key``.

        Raises:
            KeyError: If ``key`` was never reserved or written.
        """
        return self.extent(key).nbytes

    def extent(self, key: str) -> Extent:
        """Where ``key`` lives in the swap files (for :class:`~lightning_ratel.runtime.peerstore.PeerStore`, which
        reads it from another process); its checksums are :meth:`checksums`'s.

        Raises:
            KeyError: If ``key`` was never reserved or written.
        """
        with self._lock:
            extent = self._extents.get(key)
        if extent is None:
            raise KeyError(f"Key {key!r} was never reserved or written")
        return extent

    def checksums(self, key: str) -> list[int | str | None]:
        """The checksum of each chunk of ``key`` as its last write left it: an int, ``None`` where it was never
        written (zeros), or the code of :data:`UNDEFINED` where the write failed or two overlapped.

        Raises:
            KeyError: If ``key`` was never reserved or written.
            RuntimeError: If a write of ``key`` is in flight: wait for its future first.
        """
        extent = self.extent(key)
        with self._sums_lock:
            sums = list(extent.sums)
        if any(isinstance(entry, Request) for entry in sums):
            raise RuntimeError(f"a write of key {key!r} is in flight; its checksums are not known yet")
        return [entry.code if isinstance(entry, _Undefined) else entry for entry in sums]

    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the data attached with :meth:`set_metadata` (for a store from :meth:`open_kept`: what the kept
        store's index carries)."""
        return json.loads(json.dumps(self._metadata))

    def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Attach data that the index of a kept store carries, such as how the keys map to model parameters, so that
        whoever opens the kept files later (:meth:`open_kept`) can make sense of them.

        Args:
            metadata: JSON-serialisable data; copied now, so later changes to it have no effect.

        Raises:
            ValueError: If ``metadata`` cannot be written as JSON.
            RuntimeError: If the store is closed.
            RatelStoreError: If the store is read-only (``EROFS``).
        """
        try:
            copied = json.loads(json.dumps(dict(metadata), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata must be JSON-serialisable: {exc}") from exc
        with self._lock:
            self._check_open()
            self._check_writable("set_metadata")
            self._metadata = copied

    def keep_at_close(self) -> None:
        """Keep the swap files at :meth:`close` as ``keep_files=True`` does (marked kept, with the index), decided
        during the run: when they hold a result that exists nowhere else.

        Raises:
            RuntimeError: If the store is closed.
            RatelStoreError: If the store is read-only (``EROFS``).
        """
        with self._lock:
            self._check_open()
            self._check_writable("keep_at_close")
            self._keep_files = True

    def take_busy_intervals(self) -> list[tuple[float, float]]:
        """``time.perf_counter`` intervals during which a chunk transfer ran, since the last call."""
        with self._stats_lock:
            busy, self._busy = self._busy, []
        return busy

    def reserve(self, key: str, nbytes: int) -> None:
        """Lay out the extent of ``key`` in the swap files.

        Reserving all keys before :meth:`preallocate` lets the free-space check cover everything. Reserving an
        existing key again with the same size does nothing.

        Args:
            key: Name of the tensor.
            nbytes: Size of the tensor in bytes.

        Raises:
            ValueError: If ``nbytes`` is negative or ``key`` is already reserved with another size.
            RuntimeError: If the store is closed.
            RatelStoreError: If the store is read-only (``EROFS``).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes} for key {key!r}")
        with self._lock:
            self._check_open()
            self._check_writable(f"reserve of key {key!r}")
            self._reserve_locked(key, nbytes)

    def preallocate(self) -> None:
        """Allocate the swap files to the size of everything reserved so far.

        A full drive is then found now rather than in the middle of training. Keys reserved later make the files
        grow as they are written.

        Raises:
            RatelConfigError: If a filesystem has too little free space for its swap files.
            RatelStoreError: If allocating a file fails for another reason, or the store is read-only (``EROFS``).
            RuntimeError: If the store is closed.
        """
        with self._lock:
            self._check_open()
            self._check_writable("preallocate")
            sizes = list(self._tails)
        # Blocks already allocated (an earlier call, data written) need no new space.
        missing = [max(0, size - os.fstat(f.fd).st_blocks * 512) for f, size in zip(self._files, sizes)]
        check_free_space(self._paths, missing)
        for swap, size in zip(self._files, sizes):
            try:
                try:
                    os.posix_fallocate(swap.fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    # The filesystem cannot allocate ahead (or glibc's emulation cannot write through O_DIRECT):
                    # a sparse file of the final size is the best available.
                    if os.fstat(swap.fd).st_size < size:
                        os.ftruncate(swap.fd, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    free = shutil.disk_usage(swap.path.parent).free
                    raise RatelConfigError(
                        f"Not enough free space for the swap file {swap.path}: {size} bytes ({format_bytes(size)}) are "
                        f"needed, the filesystem ran out with {free} bytes ({format_bytes(free)}) free. Free up space "
                        "there, or add ssd_paths on other drives so the data is spread over more space."
                    ) from exc
                else:
                    raise RatelStoreError(
                        exc.errno, f"preallocate of {size} bytes failed for {swap.path}: {exc.strerror}", str(swap.path)
                    ) from exc

    def write(self, key: str, tensor: torch.Tensor, *, urgent: bool = False, share: bool = False,
              sums: torch.Tensor | None = None) -> concurrent.futures.Future[None]:
        """Start writing ``tensor`` as ``key``; an unknown key is reserved with the tensor's size.

        Keep ``tensor`` alive and unchanged until the returned future is done.

        Args:
            key: Name of the tensor.
            tensor: A contiguous CPU tensor whose size in bytes matches the key's.
            urgent: Run before every request that is not (something will soon wait for it).
            share: Let reads of ``key`` copy from ``tensor`` (once this write has landed, verified as a read from
                the drive is) until :meth:`unshare` or the next write of ``key``, as :meth:`read`'s ``share`` does. A
                read of ``key`` may then start before this write has landed: while the tensor is offered, it waits
                for the write and copies. The caller must not change ``tensor`` until it unshares it, and must wait
                for the futures :meth:`unshare` returns before reusing its memory.
            sums: The :data:`~lightning_ratel.runtime.checksum.WEIGHTED32` checksums of ``tensor``'s 4096-byte
                blocks, as the CPU AdamW kernel computes them while it writes the bytes
                (:func:`~lightning_ratel.runtime.checksum.block_checksums`); the I/O threads then do not read the
                bytes to checksum them. Ignored where the store does not verify or uses another checksum. A wrong
                one is never silent: the next read of the key fails its check.

        Returns:
            A future that resolves to ``None`` once every byte is written, or raises :class:`RatelStoreError`.

        Raises:
            ValueError: If ``tensor`` is not a contiguous CPU tensor or its size differs from the key's.
            RuntimeError: If the store is closed.
            RatelStoreError: If the store is read-only (``EROFS``).
        """
        chunk_sums = None
        if sums is not None and self._verify and self._algorithm == WEIGHTED32:
            chunk_sums = block_checksums(sums, tensor.numel() * tensor.element_size(), self._stripe_bytes)
        return self._submit(key, tensor, is_write=True, urgent=urgent, share=share, sums=chunk_sums)

    def read(self, key: str, out: torch.Tensor, *, urgent: bool = False, share: bool = False
             ) -> concurrent.futures.Future[torch.Tensor]:
        """Start reading ``key`` into ``out``.

        Keep ``out`` alive and do not use its contents until the returned future is done.

        Where a tensor shared by an earlier read of ``key`` holds its bytes (or is being filled with them), the read
        copies them from there instead of reading the drive, once that read has landed, and verifies every chunk's
        checksum as a read from the drive does; an urgent read moves the read it waits for to the urgent lane. Two
        parts of a step that need the same bytes at the same time (a page-in and the optimizer's read of an fp32
        master) then read them from the drive once. The same holds for a tensor a write with ``share`` stores (a
        page-in of the compute copy an update has just written copies the update's memory).

        Args:
            key: Name of a reserved tensor.
            out: A contiguous CPU tensor whose size in bytes matches the key's.
            urgent: Run before every request that is not (something will soon wait for it).
            share: Let later reads of ``key`` copy from ``out`` until :meth:`unshare` (or a write of ``key``). The
                caller must not change ``out`` until then, and must wait for the futures :meth:`unshare` returns
                before reusing its memory.

        Returns:
            A future that resolves to ``out`` once it is filled, or raises :class:`RatelStoreError` (``EBADMSG``
            when a chunk's checksum does not match what was written).

        Raises:
            KeyError: If ``key`` was never reserved or written.
            ValueError: If ``out`` is not a contiguous CPU tensor or its size differs from the key's.
            RuntimeError: If the store is closed.
        """
        if not share and not self._shares:
            return self._submit(key, out, is_write=False, urgent=urgent)
        return self._read_shared(key, out, urgent, share)

    def unshare(self, tensor: torch.Tensor) -> list[concurrent.futures.Future]:
        """Stop offering what reads with ``share`` put into the memory of ``tensor`` (any of them within it).

        Reads still copying from that memory move to the urgent lane: its holder is about to wait for them.

        Returns:
            The futures of reads still copying from that memory: wait for them before changing or reusing it.
        """
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        copies: list[concurrent.futures.Future] = []
        with self._lock:
            for key in list(self._shares):
                kept = []
                for entry in self._shares[key]:
                    if start <= entry.tensor.data_ptr() < end:
                        for copy in entry.copies:
                            if not copy.gather.future.done():
                                self._promote(copy)
                                copies.append(copy.gather.future)
                    else:
                        kept.append(entry)
                if kept:
                    self._shares[key] = kept
                else:
                    del self._shares[key]
        return copies

    def offers(self, tensor: torch.Tensor) -> bool:
        """Whether a new read of some key would copy from the memory of ``tensor`` (a read or write with ``share``
        put the key's bytes there, and the key was not written since)."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(start <= entry.tensor.data_ptr() < end and entry.usable()
                       for entries in self._shares.values() for entry in entries)

    def _read_shared(self, key: str, out: torch.Tensor, urgent: bool, share: bool
                     ) -> concurrent.futures.Future[torch.Tensor]:
        """:meth:`read` where shared tensors are offered or taken."""
        self._check_tensor(key, out)
        nbytes = out.numel() * out.element_size()
        with self._lock:
            self._check_open()
            extent = self._read_extent_locked(key, nbytes)
            offered = self._shares.get(key, [])
            # One that has landed first; of those in flight, the earliest (it lands first).
            usable = [e for e in offered if e.usable()]
            source = min(usable, key=lambda e: not e.gather.future.done(), default=None)
            gather = Gather(len(extent.chunks), out)
            request = self._request(key, False, out, nbytes)
            request.urgent = urgent
            entry = _Share(out, request, gather, extent, upstream=source)
            if share or source is not None:
                # Either may move to the urgent lane (see _promote): a read waiting for this one, or the holder of
                # the memory it copies from wanting that memory back.
                request.claimed = set()
            if share:
                self._shares.setdefault(key, []).append(entry)
            if source is None:
                self._queue_locked(request, gather, extent, urgent)
                return gather.future
            source.copies.append(entry)
            if urgent:
                self._promote(source)
        source.gather.future.add_done_callback(
            lambda landed: self._copy_from(source, landed, request, gather, extent))
        return gather.future

    def _copy_from(self, source: _Share, landed: concurrent.futures.Future, request: Request, gather: Gather,
                   extent: Extent) -> None:
        """The read ``source`` was waiting for has landed: queue the chunks of ``request``, copying from it, or
        reading the drive where that read failed or the key was written since."""
        if landed.exception() is None and not source.stale:
            request.source = source.tensor.data_ptr()
        with self._lock:
            self._queue_locked(request, gather, extent, request.urgent)

    def _promote(self, share: _Share) -> None:
        """Move the request filling or storing ``share`` (and any it waits for) to the urgent lane: an urgent read
        waits for it, or the holder of the memory it copies from.
        Its chunks not taken yet are queued again as urgent; whichever copy of a chunk runs first transfers it. Under
        ``_lock``."""
        request = share.request
        if request.urgent:
            return
        request.urgent = True
        if not request.queued:
            # Its chunks are queued (urgent now) once the read it copies from has landed.
            if share.upstream is not None:
                self._promote(share.upstream)
            return
        assert request.claimed is not None
        with self._claims_lock:
            waiting = [index for index in range(len(share.extent.chunks)) if index not in request.claimed]
        for index in waiting:
            self._pool.submit(True, self._run_chunk, request, share.gather, share.extent, index)

    def close(self) -> None:
        """Wait for I/O in flight, then close the swap files and remove them (unless kept) and the lock files.

        A kept store marks its file headers as kept and writes its index first. Safe to call more than once.

        Raises:
            RatelStoreError: If a file cannot be kept, closed or removed; every other file is still handled first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._release()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _abandon(self, error: BaseException) -> None:
        """Close after a failed start: remove whatever was created, keep nothing, and note a cleanup failure."""
        self._closed = True
        self._keep_files = self._read_only
        try:
            self._release()
        except OSError as cleanup:
            # The reason the store could not be built matters more; keep the cleanup failure beside it.
            add_note(error, f"Cleaning up after that failed too: {cleanup}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TensorStore is closed")

    def _check_writable(self, operation: str) -> None:
        if self._read_only:
            path = self._files[0].path if self._files else self._paths[0]
            raise RatelStoreError(
                errno.EROFS,
                f"{operation} refused: the store {self._name!r} in {', '.join(map(str, self._paths))} was opened "
                "read-only from kept swap files (TensorStore.open_kept)",
                str(path),
            )

    def _reserve_locked(self, key: str, nbytes: int) -> Extent:
        extent = self._extents.get(key)
        if extent is not None:
            if extent.nbytes != nbytes:
                raise ValueError(
                    f"Key {key!r} is reserved with {extent.nbytes} bytes, not {nbytes}; a key keeps its size."
                )
            return extent
        chunks = []
        for key_offset in range(0, nbytes, self._stripe_bytes):
            length = min(self._stripe_bytes, nbytes - key_offset)
            disk_length = round_up(length, ALIGNMENT)
            # The round-robin continues across keys so that many small keys still spread over every drive.
            file = self._next_file
            self._next_file = (file + 1) % len(self._paths)
            chunks.append(Chunk(file, self._tails[file], key_offset, length, disk_length))
            self._tails[file] += disk_length
        extent = Extent(nbytes, tuple(chunks), [None] * len(chunks))
        self._extents[key] = extent
        self._nbytes_reserved += nbytes
        return extent

    def _check_tensor(self, key: str, tensor: torch.Tensor) -> None:
        """Raise ``ValueError`` for a tensor this store cannot move."""
        if tensor.device.type != "cpu":
            raise ValueError(f"TensorStore needs a CPU tensor for key {key!r}, got one on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"TensorStore needs a contiguous tensor for key {key!r}")

    def _request(self, key: str, is_write: bool, tensor: torch.Tensor, nbytes: int, **extra: Any) -> Request:
        """The in-flight record of one read or write, which the chunk transfers work from (``extra``: what a
        subclass's requests carry besides; here a write's checksums per chunk, ``sums``)."""
        request = _HostRequest(key, is_write, tensor, nbytes)
        request.sums = extra.get("sums")
        return request

    def _submit(self, key: str, tensor: torch.Tensor, *, is_write: bool, urgent: bool = False, share: bool = False,
                **extra: Any) -> concurrent.futures.Future:
        self._check_tensor(key, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self._check_open()
            if is_write:
                self._check_writable(f"write of key {key!r}")
                extent = self._reserve_locked(key, nbytes)
                for entry in self._shares.get(key, ()):
                    entry.stale = True
            else:
                extent = self._read_extent_locked(key, nbytes)
            gather = Gather(len(extent.chunks), None if is_write else tensor)
            request = self._request(key, is_write, tensor, nbytes, **extra)
            request.urgent = urgent
            if share:
                # A read waiting for this write may move it to the urgent lane (see _promote).
                request.claimed = set()
                self._shares.setdefault(key, []).append(_Share(tensor, request, gather, extent))
            self._queue_locked(request, gather, extent, urgent)
        return gather.future

    def shares(self, key: str) -> bool:
        """Whether a read of ``key`` started now would copy from a tensor a read or write with ``share`` offered."""
        with self._lock:
            return any(entry.usable() for entry in self._shares.get(key, ()))

    def _read_extent_locked(self, key: str, nbytes: int) -> Extent:
        """The extent a read of ``nbytes`` from ``key`` transfers. Under ``_lock``."""
        extent = self._extents.get(key)
        if extent is None:
            raise KeyError(f"Key {key!r} was never reserved or written")
        if extent.nbytes != nbytes:
            raise ValueError(f"Key {key!r} holds {extent.nbytes} bytes but the output tensor has {nbytes} bytes")
        return extent

    def _queue_locked(self, request: Request, gather: Gather, extent: Extent, urgent: bool) -> None:
        """Queue every chunk transfer of ``request``. Under ``_lock``, which keeps close() from shutting the pool
        down halfway through a request."""
        request.queued = True
        for index in range(len(extent.chunks)):
            self._pool.submit(urgent, self._run_chunk, request, gather, extent, index)

    def _run_chunk(self, request: Request, gather: Gather, extent: Extent, index: int) -> None:
        if request.claimed is not None:
            with self._claims_lock:
                if index in request.claimed:
                    return
                request.claimed.add(index)
        error: BaseException | None = None
        chunk = extent.chunks[index]
        start = time.perf_counter()
        try:
            if not self._verify:
                self._transfer_chunk(request, chunk)
            elif request.is_write:
                self._write_verified(request, extent, index)
            else:
                self._read_verified(request, extent, index)
        except BaseException as exc:  # handed to the caller's future, never dropped
            error = exc
        else:
            with self._stats_lock:
                if request.source is not None:
                    self._bytes_shared += chunk.length
                else:
                    self._busy.append((start, time.perf_counter()))
                    if request.is_write:
                        self._bytes_written += chunk.length
                    else:
                        self._bytes_read += chunk.length
        gather.finish(error)

    def _write_verified(self, request: Request, extent: Extent, index: int) -> None:
        """Write one chunk and publish its checksum once the bytes are in the file.

        While the write runs the entry holds the request itself; a second write of the same chunk that starts before
        this one ends replaces it, so whichever ends second finds a foreign entry and marks the chunk undefined.
        """
        sums = extent.sums
        with self._sums_lock:
            sums[index] = request
        outcome: Any = _WRITE_FAILED
        try:
            outcome = self._transfer_chunk(request, extent.chunks[index])
        finally:
            with self._sums_lock:
                sums[index] = outcome if sums[index] is request else _WRITES_OVERLAPPED

    def _read_verified(self, request: Request, extent: Extent, index: int) -> None:
        """Read one chunk and check it against the checksum of the last write (or of zeros, if never written)."""
        chunk = extent.chunks[index]
        path = self._files[chunk.file].path
        where = f"offset {chunk.file_offset} of {path} (key offset {chunk.key_offset}, {chunk.length} bytes)"
        expected = extent.sums[index]
        if isinstance(expected, _Undefined):
            raise RatelStoreError(
                errno.EIO,
                f"read of key {request.key!r} refused: the chunk at {where} holds no defined data because "
                f"{expected.reason}. Write the key again before reading it.",
                str(path),
            )
        # A write of the chunk in flight before or during the read makes both the bytes and the entry unreliable.
        overlapped = isinstance(expected, Request)
        if not overlapped:
            actual = self._transfer_chunk(request, chunk)
            overlapped = extent.sums[index] is not expected
        if overlapped:
            raise RatelStoreError(
                errno.EBUSY,
                f"read of key {request.key!r} overlapped a write of the same key at {where}; wait for the write's "
                "future before reading the key back.",
                str(path),
            )
        if expected is None:
            expected = checksum_of_zeros(self._algorithm, chunk.length)
        if actual != expected:
            raise RatelStoreError(
                errno.EBADMSG,
                f"checksum mismatch reading key {request.key!r} from {path} at offset {chunk.file_offset} (key "
                f"offset {chunk.key_offset}, {chunk.length} bytes): {self._algorithm} {actual:#x} != {expected:#x} "
                "written. The data on the drive is not what the store wrote there: the drive or filesystem "
                "corrupted it, or something else wrote into the swap file.",
                str(path),
            )

    def _transfer_chunk(self, request: Request, chunk: Chunk) -> int | None:
        """Move one chunk on an I/O thread; returns the checksum of the key's bytes in it when verifying."""
        assert isinstance(request, _HostRequest)
        data = request.view[chunk.key_offset : chunk.key_offset + chunk.length]
        checksum = None
        if request.source is not None:
            # Another read's tensor holds the key's bytes: copied, then verified as if read from the drive.
            ctypes.memmove(request.address + chunk.key_offset, request.source + chunk.key_offset, chunk.length)
            return host_checksum(self._algorithm, data, chunk.key_offset) if self._verify else None
        if self._verify and request.is_write:
            if request.sums is not None:
                checksum = request.sums[chunk.key_offset // self._stripe_bytes]
            else:
                # Right before the write, while the bytes are hot in cache for it.
                checksum = host_checksum(self._algorithm, data, chunk.key_offset)
        self._move_chunk(request, chunk)
        if self._verify and not request.is_write:
            checksum = host_checksum(self._algorithm, data, chunk.key_offset)
        return checksum

    def _move_chunk(self, request: _HostRequest, chunk: Chunk) -> None:
        swap = self._files[chunk.file]
        start = chunk.key_offset
        if not swap.direct:
            # The page cache takes any address and length, so the tensor's own bytes always do.
            self._transfer(request, swap, request.view[start : start + chunk.length], chunk.file_offset)
            return
        # Direct I/O moves whole aligned blocks: the tensor's memory takes every block it covers (including usable
        # padding), and only what is left, a partial last block or an unaligned tensor, goes through the bounce
        # buffer. A read needs only the key's bytes of those blocks: a file written without padding (by the device
        # store) may end right after them.
        in_place = 0
        if request.aligned:
            in_place = min(chunk.disk_length, len(request.view) - start)
            in_place -= in_place % ALIGNMENT
            if in_place:
                self._transfer(
                    request, swap, request.view[start : start + in_place], chunk.file_offset,
                    needed=min(in_place, chunk.length),
                )
        if in_place >= chunk.length:
            return
        bounce, bounce_address = self._bounce_buffer()
        memory = request.address + start + in_place
        length = chunk.length - in_place
        staged = bounce[: chunk.disk_length - in_place]
        if request.is_write:
            ctypes.memmove(bounce_address, memory, length)
            self._transfer(request, swap, staged, chunk.file_offset + in_place)
        else:
            self._transfer(request, swap, staged, chunk.file_offset + in_place, needed=length)
            ctypes.memmove(memory, bounce_address, length)

    def _bounce_buffer(self) -> tuple[memoryview, int]:
        """This worker thread's aligned staging buffer, allocated on its first use and reused afterwards."""
        local = self._local
        if not hasattr(local, "view"):
            local.tensor = aligned_empty(self._stripe_bytes, torch.uint8)
            local.address = local.tensor.data_ptr()
            local.view = raw_memory(local.address, self._stripe_bytes)
        return local.view, local.address

    def _transfer(
        self, request: Request, swap: SwapFile, buf: memoryview, offset: int, *, needed: int | None = None
    ) -> None:
        """Move ``buf`` at ``offset``: all of it, or for a read at least its first ``needed`` bytes (the rest is
        block padding, which the file may end before)."""
        operation = "write" if request.is_write else "read"
        call = _pwrite if request.is_write else _pread
        needed = len(buf) if needed is None else needed
        done = 0
        while done < needed:
            position = offset + done
            try:
                count = call(swap.fd, buf[done:], position)
            except OSError as exc:
                raise RatelStoreError(
                    exc.errno or errno.EIO,
                    f"{operation} of key {request.key!r} failed in {swap.path} at offset {position}: "
                    f"{exc.strerror or exc}{space_detail(exc, swap.path, needed - done)}",
                    str(swap.path),
                ) from exc
            if count == 0:
                raise RatelStoreError(
                    errno.EIO,
                    f"{operation} of key {request.key!r} stopped short in {swap.path} at offset {position}: "
                    f"{needed - done} of {needed} bytes not transferred (end of data)",
                    str(swap.path),
                )
            done += count

    def _index_path(self) -> Path:
        return swapfile.index_path(self._paths[0], self._name)

    def _keep(self) -> list[tuple[OSError, Path, str]]:
        """Mark every swap file as kept (durably), then write the index; the failures, if any."""
        failures: list[tuple[OSError, Path, str]] = []
        for index, swap in enumerate(self._files):
            try:
                write_block(swap.fd, self._header(index, KEPT).encode())
                os.fsync(swap.fd)
            except OSError as exc:
                failures.append((exc, swap.path, "marking as kept"))
        if failures:
            # An index beside files that are not all marked would describe a store that cannot be opened.
            return failures
        path = self._index_path()
        try:
            self._write_index(path)
        except OSError as exc:
            failures.append((exc, path, "writing the index"))
        return failures

    def _write_index(self, path: Path) -> None:
        """Write the layout and checksums as ``path``, atomically (a new file renamed over the name)."""
        keys = {}
        for key, extent in self._extents.items():
            sums = [entry.code if isinstance(entry, _Undefined) else entry for entry in extent.sums]
            keys[key] = {
                "nbytes": extent.nbytes,
                "chunks": [[chunk.file, chunk.file_offset, entry] for chunk, entry in zip(extent.chunks, sums)],
            }
        index = {
            "format": INDEX_FORMAT,
            "version": FORMAT_VERSION,
            "name": self._name,
            "run_id": self._run_id,
            "stripe_bytes": self._stripe_bytes,
            "checksum": self._algorithm if self._verify else None,
            "directories": [str(directory) for directory in self._paths],
            "metadata": self._metadata,
            "keys": keys,
        }
        data = json.dumps(index).encode()
        staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = swapfile.open_file(str(staging), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            try:
                os.fchmod(fd, FILE_MODE)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            # A rename replaces the directory entry; it never writes through whatever had the name before.
            os.replace(staging, path)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._shares.clear()
        failures: list[tuple[OSError, Path, str]] = []
        if self._keep_files and not self._read_only and self._files:
            failures += self._keep()
        for swap in self._files:
            try:
                os.close(swap.fd)
            except OSError as exc:
                failures.append((exc, swap.path, "closing"))
            if not self._keep_files:
                try:
                    os.unlink(swap.path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failures.append((exc, swap.path, "removing"))
        for lock_path, fd in self._locks:
            # Unlink while still holding the lock, so no other run can have locked this file in between.
            try:
                os.unlink(lock_path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                failures.append((exc, lock_path, "removing"))
            try:
                os.close(fd)
            except OSError as exc:
                failures.append((exc, lock_path, "closing"))
        self._files = []
        self._locks = []
        if failures:
            exc, path, operation = failures[0]
            raise RatelStoreError(
                exc.errno, f"{operation} {path} failed while closing the swap store: {exc.strerror}", str(path)
            ) from exc
