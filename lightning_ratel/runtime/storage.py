"""Striped swap store on NVMe SSDs for tensors that do not fit in host memory.

A :class:`TensorStore` keeps named, fixed-size byte extents (fp32 master weights, Adam moments) in one swap file per
directory. Each extent is cut into ``stripe_bytes`` chunks placed round-robin over the directories, so one large
read or write keeps every drive busy. Chunks start at 4096-byte file offsets and occupy whole 4096-byte blocks, which
lets the store use ``O_DIRECT`` and move data straight between the drive and the caller's buffer without passing
through the page cache. Reads and writes run on a thread pool and return futures.

Every chunk written gets a checksum, computed on the I/O thread just before the write and kept in memory beside the
layout; every read verifies it, so data the drive or another process changed surfaces as :class:`RatelStoreError`
(``EBADMSG``) naming the file, the key and the offset instead of as silently wrong weights.

A swap file starts with a 4096-byte header (a magic line, then JSON: format version, store name, a random run id,
pid, host, slot and state) and holds data from offset 4096 on. The store creates its files exclusively and only ever
removes a file whose header shows it is this plugin's, left by a run that died; anything else in the way is refused.
A store kept at close (``keep_files=True``) marks its headers ``kept`` and writes ``<name>.index.json`` (keys, chunk
layout, checksums) beside the first swap file; :meth:`TensorStore.open_kept` reads such a store back later.

Subclasses (the device store in :mod:`lightning_ratel.runtime.gds`) build on :class:`Chunk`, :class:`SwapFile`,
:class:`Request`, :func:`tensor_checksum` and the hooks that :class:`TensorStore` documents.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import fcntl
import functools
import itertools
import json
import mmap
import os
import queue
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import xxhash
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_ratel.errors import RatelConfigError, RatelStoreError
from lightning_ratel.sizes import format_bytes, round_up

ALIGNMENT = 4096
"""Byte alignment of file offsets, chunk sizes and buffers; covers the logical block size of NVMe drives."""

HEADER_BYTES = ALIGNMENT
"""Size of the header block at the start of every swap file; data starts at this offset."""

XXH3_64 = "xxh3_64"
"""Checksum of :class:`TensorStore`: xxHash XXH3, 64 bits, over a chunk's bytes in host memory."""

INT64_WEIGHTED = "int64-weighted"
"""Checksum of :func:`tensor_checksum`, computed with torch where the tensor lives (the device store's)."""

_FILE_MODE = 0o600
_HUGE_PAGE = 2 << 20
_HEADER_MAGIC = b"lightning_ratel swap file\n"
_INDEX_FORMAT = "lightning_ratel swap index"
_FORMAT_VERSION = 1
_IN_USE = "in use"
_IN_USE_TO_KEEP = "in use, to be kept"
_KEPT = "kept"
# 2**64 divided by the golden ratio, as a signed 64-bit integer: consecutive multiples spread over all 64 bits.
_GOLDEN = -7046029254386353131


def _open(path: str, flags: int, mode: int = _FILE_MODE) -> int:
    """Open ``path``; every file the store creates or opens goes through here so tests can make the filesystem
    refuse."""
    return os.open(path, flags, mode)


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    """Read into ``buf`` from ``offset``; returns the number of bytes read (possibly fewer than asked)."""
    return os.preadv(fd, [buf], offset)


def _pwrite(fd: int, buf: memoryview, offset: int) -> int:
    """Write ``buf`` at ``offset``; returns the number of bytes written (possibly fewer than asked)."""
    return os.pwrite(fd, buf, offset)


def add_note(error: BaseException, note: str) -> None:
    """Attach a PEP 678 note to ``error`` (shown with the traceback from Python 3.11; ``add_note`` itself is 3.11+)."""
    error.__notes__ = [*getattr(error, "__notes__", []), note]


def _memory(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of raw memory at ``address`` (no copy, does not own the memory)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class _PinnedMapping(mmap.mmap):
    """An anonymous mapping registered with CUDA as page-locked memory; unregistered when collected."""

    registered_address = 0

    def __del__(self) -> None:
        if self.registered_address:
            torch.cuda.cudart().cudaHostUnregister(self.registered_address)


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool = False, huge: bool = False) -> torch.Tensor:
    """Allocate an uninitialised 1-D CPU tensor suited to direct I/O.

    The memory comes from its own anonymous mapping, so the data pointer is page (4096-byte) aligned and the
    tensor's storage is padded to a multiple of 4096 bytes. :class:`TensorStore` reads and writes whole 4096-byte
    blocks through such tensors without a bounce buffer; it may overwrite the padding after the last element.

    Args:
        numel: Number of elements.
        dtype: Element type.
        pin: Page-lock the memory for fast host-to-device copies. Ignored when CUDA is not available.
        huge: Ask for transparent huge pages, for a buffer that is allocated once and reused: direct I/O through it
            pins 512x fewer pages per byte, which on the development machine made O_DIRECT reads ~1.8x and writes
            ~1.4x faster at ~40% less CPU, but where the kernel compacts memory on demand its first touch is several
            times slower. Ignored below 2 MiB.

    Returns:
        A tensor of ``numel`` elements whose storage ends at the next 4096-byte boundary (at least 4096 bytes).

    Raises:
        ValueError: If ``numel`` is negative.
        RuntimeError: If CUDA refuses to pin the memory.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    nbytes = round_up(max(numel * dtype.itemsize, 1), ALIGNMENT)
    pin = pin and torch.cuda.is_available()
    # MAP_PRIVATE keeps this ordinary process memory; a shared anonymous mapping would be shmem-backed.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = _PinnedMapping(-1, nbytes, flags=flags) if pin else mmap.mmap(-1, nbytes, flags=flags)
    if huge and nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping's buffer export, so the mapping lives exactly as long as the storage.
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    if pin:
        status = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0))
        if status != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {status}")
        mapping.registered_address = flat.data_ptr()
    return flat.view(dtype)[:numel]


def check_free_space(paths: Sequence[str | os.PathLike[str]], nbytes_per_path: Sequence[int]) -> None:
    """Check that each filesystem has room for what will still be written to it.

    Paths on the same filesystem share its free space, so their needs are added up before comparing.

    Args:
        paths: Directories that will receive data.
        nbytes_per_path: Bytes still to be allocated in each directory, in the order of ``paths``.

    Raises:
        ValueError: If the two sequences differ in length.
        RatelConfigError: If a filesystem has fewer free bytes than its paths need together.
    """
    if len(paths) != len(nbytes_per_path):
        raise ValueError(f"got {len(paths)} paths but {len(nbytes_per_path)} sizes")
    by_device: dict[int, list[tuple[str, int]]] = {}
    for path, nbytes in zip(paths, nbytes_per_path):
        by_device.setdefault(os.stat(path).st_dev, []).append((os.fspath(path), nbytes))
    for entries in by_device.values():
        needed = sum(nbytes for _, nbytes in entries)
        if needed == 0:
            continue
        free = shutil.disk_usage(entries[0][0]).free
        if needed > free:
            names = ", ".join(path for path, _ in entries)
            raise RatelConfigError(
                f"Not enough free space for the swap files: {needed} bytes ({format_bytes(needed)}) are needed on the "
                f"filesystem holding {names}, but only {free} bytes ({format_bytes(free)}) are free. Free up space there, "
                "or add ssd_paths on other drives so the data is spread over more space."
            )


def tensor_checksum(data: torch.Tensor) -> int:
    """A 64-bit checksum of a 1-D ``uint8`` tensor, computed with torch where the tensor lives.

    Each 64-bit word (and each byte of a tail shorter than a word) is multiplied by an odd weight that depends on its
    position, and the products are summed modulo 2**64. A flipped bit changes one word by a power of two below 2**64,
    hence one product by a nonzero amount, so any single flipped bit changes the sum; a replaced block leaves it
    unchanged only by chance (about 2**-64 for random data). Integer sums are exact in any order, so the value is the
    same on every device and for every reduction strategy.

    Args:
        data: The bytes, on any device. Memory not aligned to 8 bytes is copied once.

    Returns:
        The checksum as a signed 64-bit integer.
    """
    count = data.numel()
    whole = count - count % 8
    if data.storage_offset() % 8 or data.data_ptr() % 8:
        data = data.clone()
    weights = torch.arange(whole // 8 + count - whole, dtype=torch.int64, device=data.device)
    weights.mul_(_GOLDEN).bitwise_or_(1)
    total = (data[:whole].view(torch.int64) * weights[: whole // 8]).sum()
    if whole < count:
        total = total + (data[whole:].to(torch.int64) * weights[whole // 8 :]).sum()
    return int(total)


@functools.lru_cache(maxsize=16)
def _checksum_of_zeros(algorithm: str, nbytes: int) -> int:
    """What a chunk of ``nbytes`` that was reserved but never written holds: zeros (the file was created empty)."""
    if algorithm == XXH3_64:
        return xxhash.xxh3_64_intdigest(bytes(nbytes))
    return 0


def _host_checksum(algorithm: str, data: memoryview) -> int:
    """The ``algorithm`` checksum of bytes in host memory."""
    if algorithm == XXH3_64:
        return xxhash.xxh3_64_intdigest(data)
    return tensor_checksum(torch.frombuffer(data, dtype=torch.uint8))


@dataclass(frozen=True)
class Chunk:
    """One stripe of a key: ``length`` bytes at ``key_offset`` in the key, stored at ``file_offset`` of the swap file
    in slot ``slot`` (the directory's position in the store's paths), occupying ``disk_length`` bytes there."""

    slot: int
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
_UNDEFINED = {entry.code: entry for entry in (_WRITE_FAILED, _WRITES_OVERLAPPED)}


@dataclass(frozen=True)
class _Extent:
    """Where a key lives, and per chunk what it holds: ``None`` (never written, so zeros), the checksum of the last
    write, the :class:`Request` of a write in flight, or an :class:`_Undefined`."""

    nbytes: int
    chunks: tuple[Chunk, ...]
    sums: list[Any]


@dataclass(frozen=True)
class SwapFile:
    """An open swap file: its path, descriptor and whether the descriptor uses ``O_DIRECT``."""

    path: Path
    fd: int
    direct: bool


class Request:
    """A read or write of one key in flight, as the chunk transfers see it; holds the caller's tensor so its memory
    stays valid. Subclasses add what their transfers need."""

    __slots__ = ("key", "is_write", "tensor")

    def __init__(self, key: str, is_write: bool, tensor: torch.Tensor) -> None:
        self.key = key
        self.is_write = is_write
        self.tensor = tensor


class _HostRequest(Request):
    """A request on a CPU tensor, with its memory as raw bytes for ``pread``/``pwrite``."""

    __slots__ = ("address", "aligned", "view")

    def __init__(self, key: str, is_write: bool, tensor: torch.Tensor, nbytes: int) -> None:
        super().__init__(key, is_write, tensor)
        self.address = tensor.data_ptr()
        self.aligned = self.address % ALIGNMENT == 0
        span = nbytes
        if self.aligned:
            # The bytes up to the next block boundary may be transferred too, but only when they are the end of the
            # tensor's storage (as for aligned_empty); otherwise they could belong to a neighbouring tensor.
            storage = tensor.untyped_storage()
            padded = round_up(nbytes, ALIGNMENT)
            if storage.data_ptr() + storage.nbytes() == self.address + padded:
                span = padded
        self.view = _memory(self.address, span) if span else None


class _Gather:
    """Resolves one caller-facing future once every chunk task of a request has finished.

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


@dataclass(frozen=True)
class _Header:
    """What the first block of a swap file says about it."""

    version: int
    name: str
    run_id: str
    slot: int
    files: int
    stripe_bytes: int
    pid: int
    host: str
    created: float
    state: str

    def encode(self) -> bytes:
        data = _HEADER_MAGIC + json.dumps(asdict(self), sort_keys=True).encode() + b"\n"
        if len(data) > HEADER_BYTES:
            raise RatelConfigError(f"The swap file header for store {self.name!r} is longer than {HEADER_BYTES} bytes")
        return data.ljust(HEADER_BYTES, b"\0")

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, started {started})"


def _decode_header(data: bytes) -> dict[str, Any] | None:
    """The fields of a header block, or ``None`` when the block does not start like one of ours."""
    if not data.startswith(_HEADER_MAGIC):
        return None
    body = data[len(_HEADER_MAGIC) :].split(b"\0", 1)[0]
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None


def _header_from(decoded: dict[str, Any]) -> _Header | None:
    """A :class:`_Header` from decoded fields of this format version, or ``None`` when they do not fit."""
    expected = {field.name: field.type for field in fields(_Header)}
    if set(decoded) != set(expected):
        return None
    kinds = {"int": int, "str": str, "float": (int, float)}
    if not all(isinstance(decoded[name], kinds[kind]) for name, kind in expected.items()):
        return None
    return _Header(**decoded)


def _write_block(fd: int, data: bytes) -> None:
    """Write one header block at offset 0 from aligned memory (``fd`` may use ``O_DIRECT``)."""
    with mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:
        block[:] = data
        if os.pwrite(fd, block, 0) != HEADER_BYTES:
            raise OSError(errno.EIO, "short write of the swap file header")


def _read_block(fd: int) -> bytes:
    """Read the header block at offset 0 into aligned memory (``fd`` may use ``O_DIRECT``)."""
    with mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:
        count = os.preadv(fd, [block], 0)
        return bytes(block[:count])


def _same_file(fd: int, other: int) -> bool:
    mine, theirs = os.fstat(fd), os.fstat(other)
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _check_directory(path: Path, name: str, *, writable: bool = True) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise RatelConfigError(
            f"Swap directory {path} does not exist. Create it (mkdir -p) or correct ssd_paths."
        ) from None
    except OSError as exc:
        raise RatelConfigError(
            f"Swap directory {path} cannot be accessed ({exc.strerror}). Fix the permissions or correct ssd_paths."
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise RatelConfigError(
            f"Swap path {path} is not a directory. ssd_paths must name directories on the SSDs, not files."
        )
    if not writable:
        return
    # os.access answers yes for root even on read-only mounts, so really create a file.
    probe = path / f".{name}.probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = _open(str(probe), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
    except OSError as exc:
        raise RatelConfigError(
            f"Swap directory {path} is not writable ({exc.strerror}). Fix its permissions or mount options, or "
            "choose another directory in ssd_paths."
        ) from exc
    os.close(fd)
    os.unlink(probe)


def _directories(paths: Sequence[str | os.PathLike[str]], name: str) -> list[Path]:
    """Check the directory list and the store name that both ways of opening a store take; resolved paths."""
    if isinstance(paths, (str, os.PathLike)):
        raise RatelConfigError(f"paths must be a sequence of directories, got the single path {paths!r}")
    if not paths:
        raise RatelConfigError("TensorStore needs at least one directory in paths")
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise RatelConfigError(f"name must be a plain file name without '/', got {name!r}")
    return [Path(os.fspath(path)).resolve() for path in paths]


def prepare_directories(paths: Sequence[str | os.PathLike[str]], name: str = "ratel") -> list[Path]:
    """Create the swap directories that do not exist yet and check that each is a writable directory.

    The rule of Lightning's ``ModelCheckpoint`` for its ``dirpath``: a missing directory is made (parents included);
    one that exists must be a directory this process can create files in. :class:`TensorStore` itself opens only
    existing directories, so this runs first, before the model is built.

    Args:
        paths: the swap directories.
        name: the store's name (the writability probe is a hidden file named after it).

    Returns:
        The resolved directories.

    Raises:
        RatelConfigError: a path is listed twice, is not a directory, cannot be created, or is not writable.
    """
    directories = _directories(paths, name)
    _check_unique(directories)
    for directory in directories:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # not a directory: _check_directory says what it is
        except OSError as exc:
            raise RatelConfigError(
                f"Swap directory {directory} does not exist and cannot be created ({exc.strerror}). Create it, fix "
                "the permissions of its parent, or correct ssd_paths."
            ) from exc
        _check_directory(directory, name)
    return directories


def _check_unique(directories: Sequence[Path]) -> None:
    if len(set(directories)) != len(directories):
        raise RatelConfigError(
            f"A directory is listed more than once in paths {[str(d) for d in directories]}; list each once."
        )


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text or "unknown"


def _not_ours(info: os.stat_result) -> str | None:
    """Why a regular file found under one of the store's names must not be written or removed, or ``None``."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_nlink != 1:
        return (
            f"it has {info.st_nlink} hard links, so another name (possibly outside the directory) shares its data "
            "and writing it would change that file too"
        )
    if info.st_uid != os.geteuid():
        return f"it belongs to user id {info.st_uid}, not to this user ({os.geteuid()})"
    return None


def _acquire_lock(path: Path, directory: Path) -> int:
    """Take the exclusive lock file of a store; returns its descriptor with our pid written inside."""
    while True:
        fd = _open(str(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise RatelConfigError(
                f"Swap directory {directory} is in use by another run (pid {holder}, lock file {path}). Wait for "
                "that run to finish, or give this run a different directory or store name."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # A releasing store unlinks the lock file before unlocking it; a lock won on that unlinked file is void.
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    reason = _not_ours(mine)
    if reason is not None:
        os.close(fd)
        raise RatelConfigError(
            f"The lock file {path} cannot be used: {reason}. The store writes its pid into that file. Remove it "
            f"(rm {path} removes only that name) or give this run a different directory or store name."
        )
    try:
        os.fchmod(fd, _FILE_MODE)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return fd


def _remove_stale(path: Path, name: str) -> str:
    """Remove ``path`` if it is this plugin's swap file left by a run that died; returns what it was.

    The caller holds the directory's lock, so no live store uses the file.

    Raises:
        RatelConfigError: If the file is not ours to remove (say what it is and what to do).
    """
    elsewhere = "or give this run a different directory or store name"
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise RatelConfigError(
            f"The swap file {path} is a symbolic link (to {os.readlink(path)}); the store never writes through a "
            f"link. Remove the link (rm {path}) {elsewhere}."
        )
    reason = _not_ours(info)
    if reason is not None:
        raise RatelConfigError(
            f"A file is in the way of the swap file {path} and is left alone: {reason}. Remove that name (rm {path} "
            f"removes only this name, not data another link shares) {elsewhere}."
        )
    fd = _open(str(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise RatelConfigError(f"The file {path} changed while it was inspected; another process is writing there.")
        decoded = _decode_header(os.pread(fd, HEADER_BYTES, 0))
    finally:
        os.close(fd)
    if decoded is None and opened.st_size == 0:
        # A run that died between creating the file and writing its header; removing it loses no data.
        os.unlink(path)
        return f"removed the empty swap file {path} of a run that died while creating it."
    if decoded is None:
        raise RatelConfigError(
            f"A file that is not a lightning_ratel swap file is in the way of {path} (it has no swap file header) and "
            f"is left alone. Move or delete it if it is not needed (a swap file of a lightning_ratel release before "
            f"headers looks like this too) {elsewhere}."
        )
    if decoded.get("version") != _FORMAT_VERSION:
        raise RatelConfigError(
            f"The swap file {path} was written in format version {decoded.get('version')!r}, which this release "
            f"(version {_FORMAT_VERSION}) does not read. Delete it if it is not needed {elsewhere}."
        )
    header = _header_from(decoded)
    if header is None or header.name != name:
        raise RatelConfigError(
            f"The swap file {path} has a damaged header or belongs to another store name, and is left alone. Delete "
            f"it if it is not needed {elsewhere}."
        )
    if header.state == _KEPT:
        index = path.parent / f"{name}.index.json"
        raise RatelConfigError(
            f"The swap file {path} was kept by {header.describe()} (keep_swap_files), so this run does not replace "
            f"it. Read it with TensorStore.open_kept([...], name={name!r}); delete it and the swap files in the other "
            f"directories of that run (and {index} in the first one) once they are no longer needed, {elsewhere}."
        )
    if header.state == _IN_USE_TO_KEEP:
        raise RatelConfigError(
            f"The swap file {path} was to be kept by {header.describe()} (keep_swap_files), but that run ended "
            "without closing its store, so no index describes it and TensorStore.open_kept cannot read it. It is "
            f"left alone as that run asked: delete it once it is no longer needed, {elsewhere}."
        )
    if header.state != _IN_USE:
        raise RatelConfigError(
            f"The swap file {path} is in the unknown state {header.state!r} and is left alone. Delete it if it is not "
            f"needed {elsewhere}."
        )
    os.unlink(path)
    return f"removed the swap file {path} left by {header.describe()}, which ended without closing its store."


def _unlink_created(path: Path, fd: int) -> None:
    """Remove ``path`` if it still names the file open as ``fd`` (one this store created)."""
    try:
        current = os.lstat(path)
    except FileNotFoundError:
        return
    mine = os.fstat(fd)
    if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
        os.unlink(path)


def _reopen_direct(path: Path, fd: int, direct: bool | None, *, header: bytes | None) -> int | None:
    """A second descriptor of the file open as ``fd``, with ``O_DIRECT``; ``None`` where the filesystem refuses it.

    Some filesystems accept ``O_DIRECT`` at open but refuse the I/O, so this writes ``header`` (or, read-only, reads
    the header block) through the new descriptor.

    Raises:
        RatelConfigError: If ``direct`` is ``True`` and direct I/O is refused, or the path names another file now.
    """
    mode = os.O_RDWR if header is not None else os.O_RDONLY
    direct_fd = None
    try:
        direct_fd = _open(str(path), mode | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
        if not _same_file(fd, direct_fd):
            raise RatelConfigError(
                f"The swap file {path} was replaced while the store opened it; another process is writing into the "
                "swap directory. Give this run a directory of its own."
            )
        if header is not None:
            _write_block(direct_fd, header)
        else:
            _read_block(direct_fd)
    except OSError as exc:
        if direct_fd is not None:
            os.close(direct_fd)
        if exc.errno != errno.EINVAL:
            raise
        if direct:
            raise RatelConfigError(
                f"The filesystem of {path.parent} does not support direct I/O (O_DIRECT: {exc.strerror}). Put the "
                "swap files on a filesystem that does (ext4, xfs on an NVMe drive) or pass direct=None to fall back "
                "to buffered I/O."
            ) from exc
        return None
    except BaseException:
        if direct_fd is not None:
            os.close(direct_fd)
        raise
    return direct_fd


def _create_swap(path: Path, direct: bool | None, header: _Header) -> tuple[SwapFile, str | None]:
    """Create the swap file ``path`` exclusively, owner-only, with its header; ``O_DIRECT`` when wanted and supported.

    A stale file of a dead run is removed first (see :func:`_remove_stale`); nothing else already there is touched.

    Returns:
        The open swap file, and a sentence about the stale file it replaced (``None`` if there was none).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    replaced = None
    try:
        fd = _open(str(path), flags)
    except FileExistsError:
        replaced = _remove_stale(path, header.name)
        fd = _open(str(path), flags)
    try:
        # Owner-only whatever the umask.
        os.fchmod(fd, _FILE_MODE)
        block = header.encode()
        _write_block(fd, block)
        direct_fd = None if direct is False else _reopen_direct(path, fd, direct, header=block)
    except BaseException:
        try:
            _unlink_created(path, fd)
        finally:
            os.close(fd)
        raise
    if direct_fd is None:
        return SwapFile(path, fd, False), replaced
    os.close(fd)
    return SwapFile(path, direct_fd, True), replaced


def _open_kept(path: Path, name: str, direct: bool | None) -> tuple[SwapFile, _Header]:
    """Open a kept swap file read-only and check its header.

    Raises:
        RatelConfigError: If the file is missing, unreadable, a link, or not a swap file kept by store ``name``.
    """
    try:
        fd = _open(str(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RatelConfigError(f"There is no swap file {path} to open; check paths and name.") from None
    except OSError as exc:
        hint = " (a symbolic link: pass the directory that holds the file itself)" if exc.errno == errno.ELOOP else ""
        raise RatelConfigError(f"The kept swap file {path} cannot be opened{hint}: {exc.strerror}") from exc
    try:
        data = os.pread(fd, HEADER_BYTES, 0)
        decoded = _decode_header(data)
        header = None if decoded is None else _header_from(decoded)
        if header is None or header.version != _FORMAT_VERSION or header.name != name:
            raise RatelConfigError(
                f"{path} is not a swap file of store {name!r} in format version {_FORMAT_VERSION} (its header "
                "does not match), so it cannot be opened as a kept store."
            )
        if header.state != _KEPT:
            raise RatelConfigError(
                f"The swap file {path} of {header.describe()} is not marked as kept: that run ended without closing "
                "its store (or is still running), so its index and checksums were never written."
            )
        direct_fd = None if direct is False else _reopen_direct(path, fd, direct, header=None)
    except BaseException:
        os.close(fd)
        raise
    if direct_fd is None:
        return SwapFile(path, fd, False), header
    os.close(fd)
    return SwapFile(path, direct_fd, True), header


class _PriorityPool:
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

    With ``verify`` (the default) each chunk's checksum (:data:`XXH3_64` of exactly the key's bytes in it) is taken on
    the I/O thread right before the write and published once the write has returned; a read checks the bytes it
    got and raises :class:`RatelStoreError` with ``EBADMSG`` on a mismatch. The checksums live in memory beside the
    layout (and in the index of a kept store). A key reserved but never written reads as zeros, verified like written
    data; where nothing was written or preallocated up to the end of the file, its read fails with ``EIO``.

    Subclasses move other kinds of tensors by overriding these hooks: ``_check_tensor(key, tensor)`` (refuse what
    cannot be moved), ``_request(key, is_write, tensor, nbytes, **extra)`` (a :class:`Request` for the transfers;
    ``extra`` is what the subclass passes to ``_submit``), ``_transfer_chunk(request, chunk)`` (move one
    :class:`Chunk` on an I/O thread and return its checksum when :attr:`verify` is on) and ``_release()`` (free what
    the subclass holds after the base class has drained its I/O). :attr:`swap_files` gives the open files by slot.

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
    _checksum_algorithm = XXH3_64

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
        directories = _directories(paths, name)
        if stripe_bytes <= 0 or stripe_bytes % ALIGNMENT:
            raise RatelConfigError(f"stripe_bytes must be a positive multiple of {ALIGNMENT}, got {stripe_bytes}")
        if io_threads_per_path < 1:
            raise RatelConfigError(f"io_threads_per_path must be at least 1, got {io_threads_per_path}")
        for directory in directories:
            _check_directory(directory, name)
        _check_unique(directories)
        self._init_state(name, directories, stripe_bytes, keep_files=keep_files, verify=verify, read_only=False)
        try:
            # Every lock is taken before any swap file is touched, so a refused store removes nothing.
            for directory in directories:
                lock_path = directory / f"{name}.lock"
                try:
                    self._locks.append((lock_path, _acquire_lock(lock_path, directory)))
                except OSError as exc:
                    raise RatelConfigError(f"Cannot take the lock file {lock_path}: {exc.strerror}") from exc
            replaced = []
            for slot, directory in enumerate(directories):
                swap_path = directory / f"{name}.swap"
                try:
                    state = _IN_USE_TO_KEEP if keep_files else _IN_USE
                    swap, stale = _create_swap(swap_path, direct, self._header(slot, state))
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
            self._pool = _PriorityPool(io_threads_per_path * len(directories), f"ratel-io-{name}")
        except BaseException as error:
            self._abandon(error)
            raise

    @classmethod
    def open_kept(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        name: str = "ratel",
        *,
        io_threads_per_path: int = 4,
        direct: bool | None = None,
    ) -> TensorStore:
        """Open the swap files a store kept at :meth:`close` (``keep_files=True``), read-only.

        The files are opened ``O_RDONLY`` and nothing in the directories is created, changed or removed, also not at
        :meth:`close`. Reads verify the checksums the store recorded (whichever store kept the files: a device
        store's files are read into CPU tensors here too); :meth:`write`, :meth:`reserve` and :meth:`preallocate`
        raise :class:`RatelStoreError` with ``EROFS``. :meth:`keys` and :meth:`nbytes` list what is there, and
        :attr:`metadata` is what the store was given with :meth:`set_metadata` (for example how its keys map to model
        parameters, for an export from the kept files).

        Args:
            paths: The directories of the kept store, in any order (each file's header names its slot).
            name: The store's name.
            io_threads_per_path: I/O threads per directory.
            direct: As for the constructor.

        Returns:
            A read-only :class:`TensorStore` (always the host store, whatever class this is called on).

        Raises:
            RatelConfigError: If a directory or swap file is missing, a file is not a swap file of ``name`` marked as
                kept, the files are not all of one run, a directory of that run is not among ``paths``, or the index
                is missing or does not match the files.
        """
        directories = _directories(paths, name)
        if io_threads_per_path < 1:
            raise RatelConfigError(f"io_threads_per_path must be at least 1, got {io_threads_per_path}")
        for directory in directories:
            _check_directory(directory, name, writable=False)
        _check_unique(directories)
        store = TensorStore.__new__(TensorStore)
        store._init_state(name, directories, ALIGNMENT, keep_files=True, verify=False, read_only=True)
        try:
            store._load_kept(direct)
            store._pool = _PriorityPool(io_threads_per_path * len(directories), f"ratel-io-{name}")
        except BaseException as error:
            store._abandon(error)
            raise
        return store

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
        self._extents: dict[str, _Extent] = {}
        self._tails = [HEADER_BYTES] * len(directories)
        self._next_slot = 0
        self._nbytes_reserved = 0
        self._bytes_read = 0
        self._busy: list[tuple[float, float]] = []
        self._bytes_written = 0
        self._locks: list[tuple[Path, int]] = []
        self._files: list[SwapFile] = []
        self._pool: _PriorityPool | None = None
        self._direct = False
        self._local = threading.local()
        self._closed = False
        self._metadata: dict[str, Any] = {}

    def _header(self, slot: int, state: str) -> _Header:
        return _Header(
            version=_FORMAT_VERSION, name=self._name, run_id=self._run_id, slot=slot, files=len(self._paths),
            stripe_bytes=self._stripe_bytes, pid=os.getpid(), host=os.uname().nodename, created=self._created,
            state=state,
        )

    @property
    def paths(self) -> tuple[Path, ...]:
        """The swap directories, resolved to absolute paths, in slot order."""
        return self._paths

    @property
    def swap_files(self) -> tuple[SwapFile, ...]:
        """The open swap files, by slot (empty once closed)."""
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

    def keys(self) -> list[str]:
        """Every reserved key, in the order of reservation."""
        with self._lock:
            return list(self._extents)

    def nbytes(self, key: str) -> int:
        """Size in bytes of ``key``.

        Raises:
            KeyError: If ``key`` was never reserved or written.
        """
        with self._lock:
            extent = self._extents.get(key)
        if extent is None:
            raise KeyError(f"Key {key!r} was never reserved or written")
        return extent.nbytes

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

    def write(self, key: str, tensor: torch.Tensor, *, urgent: bool = False) -> concurrent.futures.Future[None]:
        """Start writing ``tensor`` as ``key``; an unknown key is reserved with the tensor's size.

        Keep ``tensor`` alive and unchanged until the returned future is done.

        Args:
            key: Name of the tensor.
            tensor: A contiguous CPU tensor whose size in bytes matches the key's.
            urgent: Run before every request that is not (something will soon wait for it).

        Returns:
            A future that resolves to ``None`` once every byte is written, or raises :class:`RatelStoreError`.

        Raises:
            ValueError: If ``tensor`` is not a contiguous CPU tensor or its size differs from the key's.
            RuntimeError: If the store is closed.
            RatelStoreError: If the store is read-only (``EROFS``).
        """
        return self._submit(key, tensor, is_write=True, urgent=urgent)

    def read(self, key: str, out: torch.Tensor, *, urgent: bool = False) -> concurrent.futures.Future[torch.Tensor]:
        """Start reading ``key`` into ``out``.

        Keep ``out`` alive and do not use its contents until the returned future is done.

        Args:
            key: Name of a reserved tensor.
            out: A contiguous CPU tensor whose size in bytes matches the key's.
            urgent: Run before every request that is not (something will soon wait for it).

        Returns:
            A future that resolves to ``out`` once it is filled, or raises :class:`RatelStoreError` (``EBADMSG``
            when a chunk's checksum does not match what was written).

        Raises:
            KeyError: If ``key`` was never reserved or written.
            ValueError: If ``out`` is not a contiguous CPU tensor or its size differs from the key's.
            RuntimeError: If the store is closed.
        """
        return self._submit(key, out, is_write=False, urgent=urgent)

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

    def _reserve_locked(self, key: str, nbytes: int) -> _Extent:
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
            slot = self._next_slot
            self._next_slot = (slot + 1) % len(self._paths)
            chunks.append(Chunk(slot, self._tails[slot], key_offset, length, disk_length))
            self._tails[slot] += disk_length
        extent = _Extent(nbytes, tuple(chunks), [None] * len(chunks))
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
        subclass's requests carry besides)."""
        return _HostRequest(key, is_write, tensor, nbytes)

    def _submit(self, key: str, tensor: torch.Tensor, *, is_write: bool, urgent: bool = False,
                **extra: Any) -> concurrent.futures.Future:
        self._check_tensor(key, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self._check_open()
            if is_write:
                self._check_writable(f"write of key {key!r}")
                extent = self._reserve_locked(key, nbytes)
            else:
                extent = self._extents.get(key)
                if extent is None:
                    raise KeyError(f"Key {key!r} was never reserved or written")
                if extent.nbytes != nbytes:
                    raise ValueError(
                        f"Key {key!r} holds {extent.nbytes} bytes but the output tensor has {nbytes} bytes"
                    )
            gather = _Gather(len(extent.chunks), None if is_write else tensor)
            request = self._request(key, is_write, tensor, nbytes, **extra)
            # Submitting under the lock keeps close() from shutting the pool down halfway through a request.
            for index in range(len(extent.chunks)):
                self._pool.submit(urgent, self._run_chunk, request, gather, extent, index)
        return gather.future

    def _run_chunk(self, request: Request, gather: _Gather, extent: _Extent, index: int) -> None:
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
                self._busy.append((start, time.perf_counter()))
                if request.is_write:
                    self._bytes_written += chunk.length
                else:
                    self._bytes_read += chunk.length
        gather.finish(error)

    def _write_verified(self, request: Request, extent: _Extent, index: int) -> None:
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

    def _read_verified(self, request: Request, extent: _Extent, index: int) -> None:
        """Read one chunk and check it against the checksum of the last write (or of zeros, if never written)."""
        chunk = extent.chunks[index]
        path = self._files[chunk.slot].path
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
            expected = _checksum_of_zeros(self._algorithm, chunk.length)
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
        if self._verify and request.is_write:
            # Right before the write, while the bytes are hot in cache for it.
            checksum = _host_checksum(self._algorithm, data)
        self._move_chunk(request, chunk)
        if self._verify and not request.is_write:
            checksum = _host_checksum(self._algorithm, data)
        return checksum

    def _move_chunk(self, request: _HostRequest, chunk: Chunk) -> None:
        swap = self._files[chunk.slot]
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
            local.view = _memory(local.address, self._stripe_bytes)
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
                    f"{exc.strerror or exc}",
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
        return self._paths[0] / f"{self._name}.index.json"

    def _keep(self) -> list[tuple[OSError, Path, str]]:
        """Mark every swap file as kept (durably), then write the index; the failures, if any."""
        failures: list[tuple[OSError, Path, str]] = []
        for slot, swap in enumerate(self._files):
            try:
                _write_block(swap.fd, self._header(slot, _KEPT).encode())
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
                "chunks": [[chunk.slot, chunk.file_offset, entry] for chunk, entry in zip(extent.chunks, sums)],
            }
        index = {
            "format": _INDEX_FORMAT,
            "version": _FORMAT_VERSION,
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
        fd = _open(str(staging), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            try:
                os.fchmod(fd, _FILE_MODE)
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

    def _load_kept(self, direct: bool | None) -> None:
        """Open the kept files of the directories (any order) and the index; lay out their keys."""
        headers = []
        for directory in self._paths:
            swap, header = _open_kept(directory / f"{self._name}.swap", self._name, direct)
            self._files.append(swap)
            headers.append(header)
        first = headers[0]
        for swap, header in zip(self._files, headers):
            if header.run_id != first.run_id:
                raise RatelConfigError(
                    f"The kept swap files {self._files[0].path} and {swap.path} come from different runs "
                    f"({first.describe()} and {header.describe()}); pass the directories of one run."
                )
        slots = sorted(header.slot for header in headers)
        if slots != list(range(first.files)):
            missing = sorted(set(range(first.files)) - set(slots))
            raise RatelConfigError(
                f"The kept store {self._name!r} of {first.describe()} has {first.files} swap files, but paths "
                f"{[str(d) for d in self._paths]} hold slots {slots}; add the directories of slots {missing}."
            )
        order = sorted(range(len(headers)), key=lambda i: headers[i].slot)
        self._files = [self._files[i] for i in order]
        self._paths = tuple(self._paths[i] for i in order)
        self._run_id = first.run_id
        self._created = first.created
        self._direct = all(f.direct for f in self._files)
        self._load_index(self._index_path(), first)

    def _load_index(self, path: Path, header: _Header) -> None:
        """Read the index of a kept store and rebuild its extents and checksums from it."""
        try:
            with open(path, "rb") as file:
                index = json.loads(file.read())
        except FileNotFoundError:
            raise RatelConfigError(
                f"The kept store {self._name!r} of {header.describe()} has no index {path}; without it the layout "
                "of its keys is unknown."
            ) from None
        except (OSError, ValueError) as exc:
            raise RatelConfigError(f"The index {path} of a kept store cannot be read: {exc}") from exc

        def invalid(what: str) -> RatelConfigError:
            return RatelConfigError(f"The index {path} does not match the kept swap files: {what}.")

        if not isinstance(index, dict) or index.get("format") != _INDEX_FORMAT:
            raise invalid("it is not a lightning_ratel swap index")
        if index.get("version") != _FORMAT_VERSION or index.get("name") != self._name:
            raise invalid(f"format version {index.get('version')!r} or store name {index.get('name')!r} differs")
        if index.get("run_id") != header.run_id:
            raise invalid(f"it is of run {index.get('run_id')!r}, the files of run {header.run_id}")
        stripe = index.get("stripe_bytes")
        if stripe != header.stripe_bytes or len(index.get("directories", ())) != header.files:
            raise invalid("its stripe size or number of directories differs from the file headers")
        algorithm = index.get("checksum")
        if algorithm not in (XXH3_64, INT64_WEIGHTED, None):
            raise invalid(f"checksum algorithm {algorithm!r} is unknown")
        self._stripe_bytes = stripe
        self._verify = algorithm is not None
        self._algorithm = algorithm or self._checksum_algorithm
        keys = index.get("keys")
        if not isinstance(keys, dict):
            raise invalid("it lists no keys")
        metadata = index.get("metadata", {})
        if not isinstance(metadata, dict):
            raise invalid("its metadata is not a JSON object")
        self._metadata = metadata
        for key, entry in keys.items():
            try:
                self._extents[key] = self._kept_extent(entry, header.files)
            except (TypeError, ValueError, KeyError) as exc:
                raise invalid(f"the entry of key {key!r} is malformed ({exc})") from exc
            self._nbytes_reserved += entry["nbytes"]
        for extent in self._extents.values():
            for chunk in extent.chunks:
                self._tails[chunk.slot] = max(self._tails[chunk.slot], chunk.file_offset + chunk.disk_length)

    def _kept_extent(self, entry: dict[str, Any], files: int) -> _Extent:
        nbytes = entry["nbytes"]
        listed = entry["chunks"]
        if not isinstance(nbytes, int) or nbytes < 0 or len(listed) != round_up(nbytes, self._stripe_bytes) // self._stripe_bytes:
            raise ValueError(f"{len(listed)} chunks for {nbytes!r} bytes")
        chunks = []
        sums: list[Any] = []
        for index, (slot, file_offset, checksum) in enumerate(listed):
            if not (isinstance(slot, int) and 0 <= slot < files):
                raise ValueError(f"slot {slot!r}")
            if not isinstance(file_offset, int) or file_offset < HEADER_BYTES or file_offset % ALIGNMENT:
                raise ValueError(f"file offset {file_offset!r}")
            if isinstance(checksum, str):
                checksum = _UNDEFINED[checksum]
            elif checksum is not None and not isinstance(checksum, int):
                raise ValueError(f"checksum {checksum!r}")
            key_offset = index * self._stripe_bytes
            length = min(self._stripe_bytes, nbytes - key_offset)
            chunks.append(Chunk(slot, file_offset, key_offset, length, round_up(length, ALIGNMENT)))
            sums.append(checksum)
        return _Extent(nbytes, tuple(chunks), sums)

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
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
