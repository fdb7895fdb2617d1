"""The swap-file format and lifecycle: headers, exclusive creation, locks, stale files of dead runs, free space.

A swap file starts with a 4096-byte header (a magic line, then JSON: format version, store name, a random run id,
pid, host, slot and state) and holds data from offset 4096 on. A store creates its files exclusively, owner-only,
and only ever removes a file whose header shows it is this plugin's, left by a run that died; anything else in the
way is refused with what it is and what to do. One lock file per directory keeps a second run off it. A store kept at
close marks its headers ``kept`` and writes ``<name>.index.json`` beside the first swap file
(:mod:`lightning_ratel.runtime.kept` reads it back).

Every file is opened through :func:`open_file`, so tests can make the filesystem refuse.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import secrets
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.sizes import format_bytes

HEADER_BYTES = 4096
"""Size of the header block at the start of every swap file; data starts at this offset."""

FILE_MODE = 0o600
HEADER_MAGIC = b"lightning_ratel swap file\n"
INDEX_FORMAT = "lightning_ratel swap index"
FORMAT_VERSION = 1
IN_USE = "in use"
IN_USE_TO_KEEP = "in use, to be kept"
KEPT = "kept"


def open_file(path: str, flags: int, mode: int = FILE_MODE) -> int:
    """Open ``path``; every file the store creates or opens goes through here so tests can make the filesystem
    refuse."""
    return os.open(path, flags, mode)


def index_path(directory: Path, name: str) -> Path:
    """Where a kept store of ``name`` keeps its index: beside its first swap file."""
    return directory / f"{name}.index.json"


@dataclass(frozen=True)
class SwapFile:
    """An open swap file: its path, descriptor and whether the descriptor uses ``O_DIRECT``."""

    path: Path
    fd: int
    direct: bool


@dataclass(frozen=True)
class SwapHeader:
    """What the first block of a swap file says about it; ``slot`` is the file's number among the store's files (the
    position of its directory), under the key the format has always used."""

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
        data = HEADER_MAGIC + json.dumps(asdict(self), sort_keys=True).encode() + b"\n"
        if len(data) > HEADER_BYTES:
            raise RatelConfigError(f"The swap file header for store {self.name!r} is longer than {HEADER_BYTES} bytes")
        return data.ljust(HEADER_BYTES, b"\0")

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, started {started})"


def decode_header(data: bytes) -> dict[str, Any] | None:
    """The fields of a header block, or ``None`` when the block does not start like one of ours."""
    if not data.startswith(HEADER_MAGIC):
        return None
    body = data[len(HEADER_MAGIC) :].split(b"\0", 1)[0]
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None


def header_from(decoded: dict[str, Any]) -> SwapHeader | None:
    """A :class:`SwapHeader` from decoded fields of this format version, or ``None`` when they do not fit."""
    expected = {field.name: field.type for field in fields(SwapHeader)}
    if set(decoded) != set(expected):
        return None
    kinds = {"int": int, "str": str, "float": (int, float)}
    if not all(isinstance(decoded[name], kinds[kind]) for name, kind in expected.items()):
        return None
    return SwapHeader(**decoded)


def write_block(fd: int, data: bytes) -> None:
    """Write one header block at offset 0 from aligned memory (``fd`` may use ``O_DIRECT``)."""
    with mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:
        block[:] = data
        if os.pwrite(fd, block, 0) != HEADER_BYTES:
            raise OSError(errno.EIO, "short write of the swap file header")


def read_block(fd: int) -> bytes:
    """Read the header block at offset 0 into aligned memory (``fd`` may use ``O_DIRECT``)."""
    with mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:
        count = os.preadv(fd, [block], 0)
        return bytes(block[:count])


def _same_file(fd: int, other: int) -> bool:
    mine, theirs = os.fstat(fd), os.fstat(other)
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def check_directory(path: Path, name: str, *, writable: bool = True) -> None:
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
        fd = open_file(str(probe), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
    except OSError as exc:
        raise RatelConfigError(
            f"Swap directory {path} is not writable ({exc.strerror}). Fix its permissions or mount options, or "
            "choose another directory in ssd_paths."
        ) from exc
    os.close(fd)
    os.unlink(probe)


def resolve_directories(paths: Sequence[str | os.PathLike[str]], name: str) -> list[Path]:
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
    one that exists must be a directory this process can create files in. :class:`~lightning_ratel.runtime.storage.TensorStore` itself opens only
    existing directories, so this runs first, before the model is built.

    Args:
        paths: the swap directories.
        name: the store's name (the writability probe is a hidden file named after it).

    Returns:
        The resolved directories.

    Raises:
        RatelConfigError: a path is listed twice, is not a directory, cannot be created, or is not writable.
    """
    directories = resolve_directories(paths, name)
    check_unique(directories)
    for directory in directories:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # not a directory: check_directory says what it is
        except OSError as exc:
            raise RatelConfigError(
                f"Swap directory {directory} does not exist and cannot be created ({exc.strerror}). Create it, fix "
                "the permissions of its parent, or correct ssd_paths."
            ) from exc
        check_directory(directory, name)
    return directories


def check_unique(directories: Sequence[Path]) -> None:
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


def acquire_lock(path: Path, directory: Path) -> int:
    """Take the exclusive lock file of a store; returns its descriptor with our pid written inside."""
    while True:
        fd = open_file(str(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW)
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
        os.fchmod(fd, FILE_MODE)
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
    fd = open_file(str(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise RatelConfigError(f"The file {path} changed while it was inspected; another process is writing there.")
        decoded = decode_header(os.pread(fd, HEADER_BYTES, 0))
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
    if decoded.get("version") != FORMAT_VERSION:
        raise RatelConfigError(
            f"The swap file {path} was written in format version {decoded.get('version')!r}, which this release "
            f"(version {FORMAT_VERSION}) does not read. Delete it if it is not needed {elsewhere}."
        )
    header = header_from(decoded)
    if header is None or header.name != name:
        raise RatelConfigError(
            f"The swap file {path} has a damaged header or belongs to another store name, and is left alone. Delete "
            f"it if it is not needed {elsewhere}."
        )
    if header.state == KEPT:
        index = path.parent / f"{name}.index.json"
        raise RatelConfigError(
            f"The swap file {path} was kept by {header.describe()} (keep_swap_files), so this run does not replace "
            f"it. Convert or export what it holds with `python -m lightning_ratel.convert` (README, Checkpoints); "
            f"delete it and the swap files in the other directories of that run (and {index} in the first one) once "
            f"they are no longer needed, {elsewhere}."
        )
    if header.state == IN_USE_TO_KEEP:
        raise RatelConfigError(
            f"The swap file {path} was to be kept by {header.describe()} (keep_swap_files), but that run ended "
            "without closing its store, so no index describes it and it cannot be read back. It is "
            f"left alone as that run asked: delete it once it is no longer needed, {elsewhere}."
        )
    if header.state != IN_USE:
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
        direct_fd = open_file(str(path), mode | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
        if not _same_file(fd, direct_fd):
            raise RatelConfigError(
                f"The swap file {path} was replaced while the store opened it; another process is writing into the "
                "swap directory. Give this run a directory of its own."
            )
        if header is not None:
            write_block(direct_fd, header)
        else:
            read_block(direct_fd)
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


def _swap_file(path: Path, fd: int, direct_fd: int | None) -> SwapFile:
    """The open swap file: its ``O_DIRECT`` descriptor where there is one (the plain one is closed then), else the
    plain one."""
    if direct_fd is None:
        return SwapFile(path, fd, False)
    os.close(fd)
    return SwapFile(path, direct_fd, True)


def create_swap(path: Path, direct: bool | None, header: SwapHeader) -> tuple[SwapFile, str | None]:
    """Create the swap file ``path`` exclusively, owner-only, with its header; ``O_DIRECT`` when wanted and supported.

    A stale file of a dead run is removed first (see :func:`_remove_stale`); nothing else already there is touched.

    Returns:
        The open swap file, and a sentence about the stale file it replaced (``None`` if there was none).
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    replaced = None
    try:
        fd = open_file(str(path), flags)
    except FileExistsError:
        replaced = _remove_stale(path, header.name)
        fd = open_file(str(path), flags)
    try:
        # Owner-only whatever the umask.
        os.fchmod(fd, FILE_MODE)
        block = header.encode()
        write_block(fd, block)
        direct_fd = None if direct is False else _reopen_direct(path, fd, direct, header=block)
    except BaseException:
        try:
            _unlink_created(path, fd)
        finally:
            os.close(fd)
        raise
    return _swap_file(path, fd, direct_fd), replaced


def open_kept_file(path: Path, name: str, direct: bool | None) -> tuple[SwapFile, SwapHeader]:
    """Open a kept swap file read-only and check its header.

    Raises:
        RatelConfigError: If the file is missing, unreadable, a link, or not a swap file kept by store ``name``.
    """
    try:
        fd = open_file(str(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RatelConfigError(f"There is no swap file {path} to open; check paths and name.") from None
    except OSError as exc:
        hint = " (a symbolic link: pass the directory that holds the file itself)" if exc.errno == errno.ELOOP else ""
        raise RatelConfigError(f"The kept swap file {path} cannot be opened{hint}: {exc.strerror}") from exc
    try:
        data = os.pread(fd, HEADER_BYTES, 0)
        decoded = decode_header(data)
        header = None if decoded is None else header_from(decoded)
        if header is None or header.version != FORMAT_VERSION or header.name != name:
            raise RatelConfigError(
                f"{path} is not a swap file of store {name!r} in format version {FORMAT_VERSION} (its header "
                "does not match), so it cannot be opened as a kept store."
            )
        if header.state != KEPT:
            raise RatelConfigError(
                f"The swap file {path} of {header.describe()} is not marked as kept: that run ended without closing "
                "its store (or is still running), so its index and checksums were never written."
            )
        direct_fd = None if direct is False else _reopen_direct(path, fd, direct, header=None)
    except BaseException:
        os.close(fd)
        raise
    return _swap_file(path, fd, direct_fd), header


def open_peer_file(path: Path, name: str, run_id: str, direct: bool | None) -> SwapFile:
    """Open, read-only, a swap file another process of this run has open (a rank of the same node), and check that
    it is that store's file of that run.

    Raises:
        OSError: If the file cannot be opened (missing, no permission, a link).
        RatelConfigError: If its header is not that of store ``name`` of run ``run_id``, in use.
    """
    fd = open_file(str(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        decoded = decode_header(os.pread(fd, HEADER_BYTES, 0))
        header = None if decoded is None else header_from(decoded)
        if header is None or (header.name, header.run_id) != (name, run_id) or header.state not in (IN_USE,
                                                                                                     IN_USE_TO_KEEP):
            raise RatelConfigError(f"{path} is not the swap file of store {name!r} of run {run_id} in use")
        direct_fd = None if direct is False else _reopen_direct(path, fd, direct, header=None)
    except BaseException:
        os.close(fd)
        raise
    return _swap_file(path, fd, direct_fd)


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


def space_detail(err: OSError, path: Path | str, missing: int) -> str:
    """For a write that ran out of space (``ENOSPC``): how many bytes it still needed and how many are free where
    ``path`` lives; empty for any other error."""
    if err.errno != errno.ENOSPC:
        return ""
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        return f"; {missing} more bytes ({format_bytes(missing)}) were to be written"
    return (f"; {missing} more bytes ({format_bytes(missing)}) were to be written and {free} bytes "
            f"({format_bytes(free)}) are free on its filesystem")
