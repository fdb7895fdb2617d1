"""Tests of the striped NVMe swap store (lightning_ratel.runtime.storage)."""

from __future__ import annotations

import collections
import errno
import mmap
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_ratel.errors import RatelConfigError, RatelStoreError
from lightning_ratel.runtime import storage, swapfile
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.swapfile import HEADER_BYTES, check_free_space

STRIPE = 64 * 1024  # small stripes keep multi-stripe tensors small and the tests fast


def _direct_supported(directory: Path) -> bool:
    """Whether an aligned O_DIRECT write works in ``directory``, probed independently of the store."""
    path = directory / "direct.probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, ALIGNMENT, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:
            os.pwrite(fd, block, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def _random(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator).to(dtype)
    return torch.randint(-128, 128, (numel,), generator=generator, dtype=torch.int64).to(dtype)


def _buffer(numel: int, dtype: torch.dtype, aligned: bool) -> torch.Tensor:
    if aligned:
        return aligned_empty(numel, dtype)
    # Starting one element into a storage puts the data off any 4096-byte boundary.
    return torch.empty(numel + 1, dtype=dtype)[1:]


@pytest.fixture
def ssd(tmp_path: Path) -> Path:
    directory = tmp_path / "ssd0"
    directory.mkdir()
    return directory


@pytest.fixture
def two_ssds(tmp_path: Path) -> list[Path]:
    directories = [tmp_path / "ssd0", tmp_path / "ssd1"]
    for directory in directories:
        directory.mkdir()
    return directories


@pytest.fixture
def no_direct(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every O_DIRECT open fail with EINVAL, as on tmpfs; returns the messages the store reports."""
    real_open = swapfile.open_file
    messages: list[str] = []

    def refusing_open(path: str, flags: int, mode: int = 0o600) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(swapfile, "open_file", refusing_open)
    monkeypatch.setattr(storage, "rank_zero_info", messages.append)
    return messages


def _sizes(itemsize: int) -> list[int]:
    per_stripe = STRIPE // itemsize
    return [1, 1001, per_stripe, 3 * per_stripe + 77]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_round_trip(ssd: Path, dtype: torch.dtype, aligned: bool) -> None:
    with TensorStore([ssd], stripe_bytes=STRIPE, io_threads_per_path=2) as store:
        for index, numel in enumerate(_sizes(dtype.itemsize)):
            source = _buffer(numel, dtype, aligned)
            source.copy_(_random(numel, dtype, seed=index))
            store.write(f"t{index}", source).result()
            out = _buffer(numel, dtype, aligned)
            assert store.read(f"t{index}", out).result() is out
            assert torch.equal(out, source)


def test_mixed_alignment_round_trip(ssd: Path) -> None:
    numel = 2 * STRIPE // 4 + 5
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        source = _buffer(numel, torch.float32, aligned=False)
        source.copy_(_random(numel, torch.float32))
        store.write("w", source).result()
        out = aligned_empty(numel, torch.float32)
        store.read("w", out).result()
        assert torch.equal(out, source)


@pytest.mark.parametrize("numel", [1001, 2 * STRIPE // 4 + 5])
def test_padding_of_a_shared_buffer_is_left_alone(ssd: Path, numel: int) -> None:
    # A view at the start of a larger buffer: the bytes after it belong to its neighbour and must survive a read.
    flat = aligned_empty(numel + 4 * ALIGNMENT, torch.float32)
    head = flat[:numel]
    neighbour = flat[numel:]
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        source = _random(numel, torch.float32)
        store.write("head", source).result()
        neighbour.fill_(7.0)
        store.read("head", head).result()
        assert torch.equal(head, source)
        assert bool((neighbour == 7.0).all())


def test_striping_over_two_directories(two_ssds: list[Path]) -> None:
    with TensorStore(two_ssds, stripe_bytes=STRIPE) as store:
        source = aligned_empty(3 * STRIPE, torch.uint8)
        source.copy_(_random(3 * STRIPE, torch.int8).view(torch.uint8))
        store.write("w", source).result()
        swap_files = [directory / "ratel.swap" for directory in two_ssds]
        assert [path.stat().st_size for path in swap_files] == [HEADER_BYTES + 2 * STRIPE, HEADER_BYTES + STRIPE]
        data = [path.read_bytes()[HEADER_BYTES:] for path in swap_files]
        raw = source.numpy().tobytes()
        # Round-robin: stripes 0 and 2 on the first directory, stripe 1 on the second.
        assert data[0] == raw[:STRIPE] + raw[2 * STRIPE :]
        assert data[1] == raw[STRIPE : 2 * STRIPE]
        out = aligned_empty(3 * STRIPE, torch.uint8)
        store.read("w", out).result()
        assert torch.equal(out, source)


def test_chunks_occupy_whole_blocks(ssd: Path) -> None:
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        store.reserve("a", 10)
        store.reserve("b", STRIPE + 1)
        store.reserve("c", 3)
        chunks = [chunk for key in "abc" for chunk in store._extents[key].chunks]
        assert [chunk.file_offset - HEADER_BYTES for chunk in chunks] == [
            0, ALIGNMENT, ALIGNMENT + STRIPE, 2 * ALIGNMENT + STRIPE
        ]
        assert all(chunk.disk_length % ALIGNMENT == 0 for chunk in chunks)
        assert store.nbytes_reserved == 10 + STRIPE + 1 + 3


def test_many_concurrent_futures(two_ssds: list[Path]) -> None:
    generator = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 3 * STRIPE // 4, (48,), generator=generator).tolist()
    with TensorStore(two_ssds, stripe_bytes=STRIPE, io_threads_per_path=3) as store:
        sources = [_random(numel, torch.float32, seed=i) for i, numel in enumerate(sizes)]
        writes = [store.write(f"k{i}", tensor) for i, tensor in enumerate(sources)]
        for future in writes:
            assert future.result() is None
        outs = [aligned_empty(numel, torch.float32) if i % 2 else torch.empty(numel) for i, numel in enumerate(sizes)]
        reads = [store.read(f"k{i}", out) for i, out in enumerate(outs)]
        for source, future in zip(sources, reads):
            assert torch.equal(future.result(), source)
        total = sum(sizes) * 4
        assert store.bytes_written == total
        assert store.bytes_read == total


def test_direct_io_matches_probe(tmp_path: Path, ssd: Path) -> None:
    with TensorStore([ssd]) as store:
        assert store.direct == _direct_supported(tmp_path)


def test_a_slice_of_a_larger_buffer_is_written_in_one_transfer(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its last partial block is written from the buffer itself (the bytes after the slice land in the chunk's
    # padding), not through the bounce buffer in a second transfer; reading it back leaves the neighbour alone.
    numel = ALIGNMENT // 2 + 5  # two whole blocks and 20 bytes of a third
    flat = aligned_empty(numel + 4 * ALIGNMENT, torch.float32)
    head, neighbour = flat[:numel], flat[numel:]
    lengths: list[int] = []
    real = storage._pwrite
    monkeypatch.setattr(storage, "_pwrite", lambda fd, buf, offset: lengths.append(len(buf)) or real(fd, buf, offset))
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        if not store.direct:
            pytest.skip("the filesystem refuses O_DIRECT, so every transfer takes the tensor's own bytes")
        source = _random(numel, torch.float32)
        head.copy_(source)
        neighbour.fill_(7.0)
        store.write("head", head).result()
        assert lengths == [3 * ALIGNMENT]
        head.zero_()
        store.read("head", head).result()
        assert torch.equal(head, source) and bool((neighbour == 7.0).all())


def test_aligned_buffers_need_no_bounce_buffer(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = storage.aligned_empty

    def counting(numel: int, dtype: torch.dtype, *, pin: bool = False, huge: bool = False) -> torch.Tensor:
        calls.append(numel)
        return real(numel, dtype, pin=pin, huge=huge)

    monkeypatch.setattr(storage, "aligned_empty", counting)
    with TensorStore([ssd], stripe_bytes=STRIPE, io_threads_per_path=2) as store:
        if not store.direct:
            pytest.skip("the filesystem refuses O_DIRECT, so no bounce buffer is ever used")
        numel = 2 * STRIPE // 4 + 3
        source = real(numel, torch.float32)
        source.copy_(_random(numel, torch.float32))
        store.write("w", source).result()
        store.read("w", real(numel, torch.float32)).result()
        assert calls == []
        # Unaligned tensors go through one bounce buffer per worker thread, allocated once, not per call.
        for _ in range(10):
            store.write("w", _buffer(numel, torch.float32, aligned=False).copy_(source)).result()
            store.read("w", _buffer(numel, torch.float32, aligned=False)).result()
        assert 1 <= len(calls) <= 2
        assert set(calls) == {STRIPE}


def test_partial_transfers_are_continued(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pread, real_pwrite = storage._pread, storage._pwrite
    monkeypatch.setattr(storage, "_pread", lambda fd, buf, offset: real_pread(fd, buf[:ALIGNMENT], offset))
    monkeypatch.setattr(storage, "_pwrite", lambda fd, buf, offset: real_pwrite(fd, buf[:ALIGNMENT], offset))
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        source = _random(STRIPE // 2 + 11, torch.float32)
        store.write("w", source).result()
        assert torch.equal(store.read("w", torch.empty_like(source)).result(), source)


def test_lock_refuses_a_second_store_and_is_freed_at_close(ssd: Path) -> None:
    first = TensorStore([ssd])
    lock = ssd / "ratel.lock"
    assert lock.read_text().strip() == str(os.getpid())
    with pytest.raises(RatelConfigError, match="in use by another run") as info:
        TensorStore([ssd])
    assert str(os.getpid()) in str(info.value)
    assert str(ssd) in str(info.value)
    # Another name in the same directory is a separate store.
    TensorStore([ssd], name="other").close()
    first.close()
    assert not lock.exists()
    TensorStore([ssd]).close()


def test_lock_held_by_another_process(ssd: Path) -> None:
    holder = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", holder, str(ssd / "ratel.lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout.readline().strip() == b"locked"
        with pytest.raises(RatelConfigError, match=f"in use by another run \\(pid {child.pid}"):
            TensorStore([ssd])
        assert not (ssd / "ratel.swap").exists()
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    TensorStore([ssd]).close()


def test_lock_on_second_directory_releases_the_first(two_ssds: list[Path]) -> None:
    with TensorStore([two_ssds[1]]):
        with pytest.raises(RatelConfigError, match="in use"):
            TensorStore(two_ssds)
        assert list(two_ssds[0].iterdir()) == []


def test_files_are_owner_only(ssd: Path) -> None:
    previous = os.umask(0)
    try:
        store = TensorStore([ssd])
    finally:
        os.umask(previous)
    with store:
        for name in ("ratel.swap", "ratel.lock"):
            assert stat.S_IMODE((ssd / name).stat().st_mode) == 0o600


def test_stale_files_from_a_crashed_run_are_replaced(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    messages: list[str] = []
    monkeypatch.setattr(storage, "rank_zero_info", messages.append)
    swap = ssd / "ratel.swap"
    # What a run that died leaves behind: its swap file (header "in use") and its lock file with a dead pid.
    with TensorStore([ssd]) as dead:
        dead.write("w", torch.ones(1000)).result()
        left_behind = swap.read_bytes()
    swap.write_bytes(left_behind)
    swap.chmod(0o644)
    (ssd / "ratel.lock").write_text("999999\n")
    with TensorStore([ssd]) as store:
        assert swap.stat().st_size == HEADER_BYTES
        assert stat.S_IMODE(swap.stat().st_mode) == 0o600
        assert store.run_id != dead.run_id and store.run_id in swap.read_bytes().decode("ascii", "replace")
        source = _random(100, torch.float32)
        store.write("w", source).result()
        assert torch.equal(store.read("w", torch.empty(100)).result(), source)
    assert len(messages) == 1
    assert str(swap) in messages[0] and dead.run_id in messages[0]


def test_files_removed_at_close(ssd: Path) -> None:
    store = TensorStore([ssd])
    store.write("w", torch.ones(10)).result()
    store.close()
    assert list(ssd.iterdir()) == []


def test_keep_files(ssd: Path) -> None:
    with TensorStore([ssd], keep_files=True) as store:
        store.write("w", torch.ones(10)).result()
    assert sorted(path.name for path in ssd.iterdir()) == ["ratel.index.json", "ratel.swap"]


def test_close_is_idempotent_and_waits_for_io(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = storage._pwrite

    def slow_pwrite(fd: int, buf: memoryview, offset: int) -> int:
        time.sleep(0.005)
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(storage, "_pwrite", slow_pwrite)
    store = TensorStore([ssd], stripe_bytes=STRIPE, io_threads_per_path=2)
    futures = [store.write(f"k{i}", _random(STRIPE // 2, torch.float32)) for i in range(8)]
    store.close()
    assert all(future.done() and future.exception() is None for future in futures)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.write("k0", torch.ones(1))
    with pytest.raises(RuntimeError, match="closed"):
        store.read("k0", torch.empty(STRIPE // 2))
    with pytest.raises(RuntimeError, match="closed"):
        store.reserve("x", 1)


def test_missing_path(tmp_path: Path, ssd: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(RatelConfigError, match="does not exist") as info:
        TensorStore([ssd, missing])
    assert str(missing) in str(info.value)
    assert list(ssd.iterdir()) == []


def test_file_as_path(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("x")
    with pytest.raises(RatelConfigError, match="not a directory") as info:
        TensorStore([not_a_directory])
    assert str(not_a_directory) in str(info.value)


@pytest.mark.parametrize(
    "error",
    [PermissionError(errno.EACCES, os.strerror(errno.EACCES)), OSError(errno.EROFS, os.strerror(errno.EROFS))],
    ids=["EACCES", "EROFS"],
)
def test_unwritable_directory_simulated(ssd: Path, monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    real_open = swapfile.open_file

    def refusing_probe(path: str, flags: int, mode: int = 0o600) -> int:
        if ".probe." in path:
            raise error
        return real_open(path, flags, mode)

    monkeypatch.setattr(swapfile, "open_file", refusing_probe)
    with pytest.raises(RatelConfigError, match="not writable") as info:
        TensorStore([ssd])
    assert str(ssd) in str(info.value)
    assert error.strerror in str(info.value)
    assert list(ssd.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_directory_chmod(ssd: Path) -> None:
    ssd.chmod(0o500)
    try:
        with pytest.raises(RatelConfigError, match="not writable") as info:
            TensorStore([ssd])
        assert str(ssd) in str(info.value)
    finally:
        ssd.chmod(0o700)


def test_duplicate_directory(ssd: Path) -> None:
    with pytest.raises(RatelConfigError, match="more than once"):
        TensorStore([ssd, ssd / "."])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"stripe_bytes": 1000}, "stripe_bytes"), ({"io_threads_per_path": 0}, "io_threads"), ({"name": "a/b"}, "name")],
)
def test_bad_arguments(ssd: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(RatelConfigError, match=message):
        TensorStore([ssd], **kwargs)
    assert list(ssd.iterdir()) == []


def test_no_paths(ssd: Path) -> None:
    with pytest.raises(RatelConfigError, match="at least one"):
        TensorStore([])
    with pytest.raises(RatelConfigError, match="sequence"):
        TensorStore(str(ssd))


def test_misuse(ssd: Path) -> None:
    with TensorStore([ssd]) as store:
        store.reserve("w", 40)
        store.reserve("w", 40)
        with pytest.raises(ValueError, match="keeps its size"):
            store.reserve("w", 44)
        with pytest.raises(ValueError, match="keeps its size"):
            store.write("w", torch.ones(11))
        with pytest.raises(ValueError, match="bytes"):
            store.read("w", torch.empty(11))
        with pytest.raises(KeyError):
            store.read("unknown", torch.empty(10))
        with pytest.raises(ValueError, match="contiguous"):
            store.write("t", torch.ones(4, 4).t())


def test_injected_enospc_on_write(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, buf: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        monkeypatch.setattr(storage, "_pwrite", full)
        future = store.write("moments", _random(STRIPE // 2, torch.float32))
        with pytest.raises(RatelStoreError) as info:
            future.result()
        error = info.value
        assert error.errno == errno.ENOSPC
        assert error.filename == str(ssd / "ratel.swap")
        assert str(ssd / "ratel.swap") in str(error)
        assert "write of key 'moments'" in str(error)
        assert "offset" in str(error)
        assert isinstance(error, OSError)


def test_injected_eio_on_read(two_ssds: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with TensorStore(two_ssds, stripe_bytes=STRIPE) as store:
        source = _random(STRIPE, torch.float32)  # four stripes, two per directory
        store.write("w", source).result()
        real_pread = storage._pread
        broken_fd = store._files[1].fd

        def failing(fd: int, buf: memoryview, offset: int) -> int:
            if fd == broken_fd:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_pread(fd, buf, offset)

        monkeypatch.setattr(storage, "_pread", failing)
        with pytest.raises(RatelStoreError) as info:
            store.read("w", torch.empty_like(source)).result()
        assert info.value.errno == errno.EIO
        assert info.value.filename == str(two_ssds[1] / "ratel.swap")
        assert str(two_ssds[1] / "ratel.swap") in str(info.value)
        monkeypatch.setattr(storage, "_pread", real_pread)
        assert torch.equal(store.read("w", torch.empty_like(source)).result(), source)


def test_every_failed_chunk_is_reported(two_ssds: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int, buf: memoryview, offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with TensorStore(two_ssds, stripe_bytes=STRIPE) as store:
        store.reserve("w", 3 * STRIPE)
        monkeypatch.setattr(storage, "_pread", failing)
        with pytest.raises(RatelStoreError) as info:
            store.read("w", aligned_empty(3 * STRIPE, torch.uint8)).result()
        notes = getattr(info.value, "__notes__", [])
        assert len(notes) == 2
        assert all("also failed" in note for note in notes)


def test_read_past_end_of_data(ssd: Path) -> None:
    with TensorStore([ssd]) as store:
        store.reserve("never_written", 100)
        with pytest.raises(RatelStoreError, match="end of data") as info:
            store.read("never_written", torch.empty(25)).result()
        assert info.value.errno == errno.EIO


def test_preallocate(two_ssds: list[Path]) -> None:
    with TensorStore(two_ssds, stripe_bytes=STRIPE) as store:
        store.reserve("a", 3 * STRIPE)
        store.reserve("b", 5)
        store.preallocate()
        sizes = [(directory / "ratel.swap").stat() for directory in two_ssds]
        assert [info.st_size - HEADER_BYTES for info in sizes] == [2 * STRIPE, STRIPE + ALIGNMENT]
        assert all(info.st_blocks * 512 >= info.st_size for info in sizes)
        # Reserving after preallocate still works; the file grows on write.
        source = _random(STRIPE // 4 + 1, torch.float32)
        store.write("late", source).result()
        assert torch.equal(store.read("late", torch.empty_like(source)).result(), source)


def test_preallocate_refuses_when_space_is_short(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 8192, 8192))
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        store.reserve("big", 3 * STRIPE)
        with pytest.raises(RatelConfigError, match="Not enough free space") as info:
            store.preallocate()
        assert str(ssd) in str(info.value)
        assert str(3 * STRIPE) in str(info.value)
        assert "ssd_paths" in str(info.value)
        assert (ssd / "ratel.swap").stat().st_size == HEADER_BYTES


def test_free_space_is_shared_by_paths_on_one_filesystem(
    two_ssds: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 1500))
    check_free_space(two_ssds, [1000, 0])
    with pytest.raises(RatelConfigError) as info:
        check_free_space(two_ssds, [1000, 1000])
    assert all(str(directory) in str(info.value) for directory in two_ssds)
    assert "2000 bytes" in str(info.value)


def test_fallocate_enospc_and_unsupported(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(code: int):
        def fallocate(fd: int, offset: int, length: int) -> None:
            raise OSError(code, os.strerror(code))

        return fallocate

    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        store.reserve("w", STRIPE + 1)
        monkeypatch.setattr(storage.os, "posix_fallocate", refuse(errno.ENOSPC))
        with pytest.raises(RatelConfigError, match="Not enough free space") as info:
            store.preallocate()
        assert str(ssd / "ratel.swap") in str(info.value)
        monkeypatch.setattr(storage.os, "posix_fallocate", refuse(errno.EOPNOTSUPP))
        store.preallocate()
        assert (ssd / "ratel.swap").stat().st_size == HEADER_BYTES + STRIPE + ALIGNMENT


def test_buffered_fallback_when_direct_is_refused(two_ssds: list[Path], no_direct: list[str]) -> None:
    with TensorStore(two_ssds, stripe_bytes=STRIPE) as store:
        assert not store.direct
        for aligned in (True, False):
            numel = 3 * STRIPE // 2 + 3
            source = _buffer(numel, torch.bfloat16, aligned).copy_(_random(numel, torch.bfloat16))
            store.write(f"w{aligned}", source).result()
            out = store.read(f"w{aligned}", _buffer(numel, torch.bfloat16, aligned)).result()
            assert torch.equal(out, source)
    assert len(no_direct) == 1
    assert all(str(directory) in no_direct[0] for directory in two_ssds)


def test_direct_required_but_refused(ssd: Path, no_direct: list[str]) -> None:
    with pytest.raises(RatelConfigError, match="direct I/O") as info:
        TensorStore([ssd], direct=True)
    assert str(ssd) in str(info.value)
    assert list(ssd.iterdir()) == []


def test_direct_false_uses_buffered_io_silently(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    messages: list[str] = []
    monkeypatch.setattr(storage, "rank_zero_info", messages.append)
    with TensorStore([ssd], direct=False) as store:
        assert not store.direct
        source = _random(1001, torch.float16)
        store.write("w", source).result()
        assert torch.equal(store.read("w", torch.empty_like(source)).result(), source)
    assert messages == []


def test_empty_tensor(ssd: Path) -> None:
    with TensorStore([ssd]) as store:
        assert store.write("empty", torch.empty(0)).result() is None
        out = torch.empty(0)
        assert store.read("empty", out).result() is out


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 1023, 1024, 5000, 3 << 20])
def test_aligned_empty(dtype: torch.dtype, numel: int, huge: bool) -> None:
    tensor = aligned_empty(numel, dtype, pin=True, huge=huge)  # pin is ignored without CUDA
    assert tensor.shape == (numel,)
    assert tensor.dtype == dtype
    assert tensor.device.type == "cpu"
    assert tensor.data_ptr() % ALIGNMENT == 0
    storage_bytes = tensor.untyped_storage().nbytes()
    assert storage_bytes % ALIGNMENT == 0
    assert storage_bytes >= max(numel * dtype.itemsize, 1)
    if numel:
        assert tensor.untyped_storage().data_ptr() == tensor.data_ptr()
        tensor.fill_(1)
        assert bool((tensor == 1).all())


def test_aligned_empty_rejects_negative() -> None:
    with pytest.raises(ValueError):
        aligned_empty(-1, torch.float32)


def test_io_runs_on_the_pool(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[str] = set()
    real_pwrite = storage._pwrite

    def recording(fd: int, buf: memoryview, offset: int) -> int:
        threads.add(threading.current_thread().name)
        return real_pwrite(fd, buf, offset)

    with TensorStore([ssd], name="pool", stripe_bytes=STRIPE, io_threads_per_path=3) as store:
        monkeypatch.setattr(storage, "_pwrite", recording)
        store.write("w", _random(3 * STRIPE, torch.float32)).result()
    assert threads and all(name.startswith("ratel-io-pool") for name in threads)
    assert len(threads) <= 3


def test_urgent_requests_overtake_queued_ones(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page-in marked urgent runs before background requests queued earlier; each priority keeps its order."""
    started = threading.Event()
    release = threading.Event()
    order: list[str] = []
    real = TensorStore._transfer_chunk

    def gated(self: TensorStore, request: object, chunk: object) -> None:
        order.append(request.key)
        if request.key == "first":
            started.set()
            release.wait(10)
        real(self, request, chunk)

    monkeypatch.setattr(TensorStore, "_transfer_chunk", gated)
    with TensorStore([ssd], io_threads_per_path=1) as store:
        data = torch.ones(1024)
        futures = [store.write("first", data)]
        assert started.wait(10)
        futures += [store.write(f"background{i}", data) for i in range(3)]
        futures.append(store.write("urgent", data, urgent=True))
        release.set()
        for future in futures:
            future.result()
    assert order == ["first", "urgent", "background0", "background1", "background2"]


# ------------------------------------------------------------------ reads served from another read's memory


def test_a_shared_read_serves_later_reads_of_the_key_from_memory(ssd: Path) -> None:
    """A read with ``share`` lets later reads of its key copy its tensor: the drive is read once, both get the bytes."""
    data = _random(5 * STRIPE // 4 + 3, torch.float32)
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        store.write("k", data).result()
        store.take_busy_intervals()
        holder = aligned_empty(data.numel(), torch.float32)
        store.read("k", holder, share=True).result()
        copies = [aligned_empty(data.numel(), torch.float32), _buffer(data.numel(), torch.float32, aligned=False)]
        for out in copies:
            store.read("k", out).result()
        assert all(torch.equal(t, data) for t in (holder, *copies))
        nbytes = data.numel() * 4
        assert store.bytes_read == nbytes and store.bytes_shared == 2 * nbytes
        # Only reads of the drive are the drive's busy time and bytes; the copies are not.
        assert sum(1 for _ in store.take_busy_intervals()) == len(range(0, nbytes, STRIPE))


def test_reads_share_only_until_unshare_or_a_write(ssd: Path) -> None:
    first, second = _random(2048, torch.float32, seed=1), _random(2048, torch.float32, seed=2)
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        store.write("k", first).result()
        store.write("other", second).result()
        holder = aligned_empty(2048, torch.float32)
        store.read("k", holder, share=True).result()
        out = aligned_empty(2048, torch.float32)
        # Another key is not served from it.
        store.read("other", out).result()
        assert torch.equal(out, second) and store.bytes_shared == 0
        # A write of the key stops the sharing: the new bytes come from the drive.
        store.write("k", second).result()
        store.read("k", out).result()
        assert torch.equal(out, second) and store.bytes_shared == 0
        store.read("k", holder, share=True).result()
        assert store.unshare(holder) == []
        read = store.bytes_read
        store.read("k", out).result()
        assert store.bytes_read == read + 2048 * 4 and store.bytes_shared == 0


def test_a_changed_shared_tensor_fails_the_checksum(ssd: Path) -> None:
    """Bytes copied from a shared tensor are verified like bytes from the drive: a holder that changed its tensor
    while sharing it shows up as a checksum mismatch, never as wrong values."""
    data = _random(2048, torch.float32)
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        store.write("k", data).result()
        holder = aligned_empty(2048, torch.float32)
        store.read("k", holder, share=True).result()
        holder[100] += 1.0
        with pytest.raises(RatelStoreError, match="checksum mismatch") as info:
            store.read("k", aligned_empty(2048, torch.float32)).result()
        assert info.value.errno == errno.EBADMSG


def _hold_the_blocker(monkeypatch: pytest.MonkeyPatch, note: Callable[[storage.Request], None]
                      ) -> tuple[threading.Event, threading.Event]:
    """Make every chunk transfer of a store call ``note`` with its request first, and hold the transfer of the key
    ``"blocker"`` (its only I/O thread with it) from ``started`` until ``release``."""
    started, release = threading.Event(), threading.Event()
    real = TensorStore._transfer_chunk

    def gated(self: TensorStore, request: storage.Request, chunk: storage.Chunk) -> Any:
        note(request)
        if request.key == "blocker":
            started.set()
            release.wait(10)
        return real(self, request, chunk)

    monkeypatch.setattr(TensorStore, "_transfer_chunk", gated)
    return started, release


def test_a_read_waits_for_the_shared_read_in_flight_and_urgent_moves_it_ahead(
        ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of a key that a shared read is still filling copies it once that lands; an urgent one moves that read
    ahead of the background requests queued before it. ``unshare`` hands back the copies still running."""
    copying, finish_copy = threading.Event(), threading.Event()
    order: list[str] = []

    def note(request: storage.Request) -> None:
        if request.source is not None:
            copying.set()
            finish_copy.wait(10)
        else:
            order.append(request.key)

    data = _random(1024, torch.float32)
    with TensorStore([ssd], stripe_bytes=STRIPE, io_threads_per_path=1) as store:
        for key in ("k", "background"):
            store.write(key, data).result()
        started, release = _hold_the_blocker(monkeypatch, note)
        blocker = store.write("blocker", data)
        assert started.wait(10)
        background = store.read("background", aligned_empty(1024, torch.float32))
        holder = aligned_empty(1024, torch.float32)
        shared = store.read("k", holder, share=True)
        out = aligned_empty(1024, torch.float32)
        copy = store.read("k", out, urgent=True)
        release.set()
        assert copying.wait(10)
        assert shared.done() and not background.done() and not copy.done()
        # The holder may not reuse its tensor before the copy from it is done.
        assert store.unshare(holder) == [copy]
        finish_copy.set()
        for future in (blocker, background, shared, copy):
            future.result()
    assert order == ["blocker", "k", "background"]
    assert torch.equal(out, data) and torch.equal(holder, data)
    assert store.bytes_shared == 1024 * 4


def test_unshare_moves_the_copies_from_the_memory_ahead_and_offers_says_what_is_offered(
        ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder of a shared tensor unshares it to reuse the memory and waits for the copies from it: those still
    queued behind background requests move to the urgent lane. ``offers`` says whether reads of some key would copy
    from a tensor's memory: not once unshared, nor once the key was written since."""
    order: list[str] = []
    data = _random(1024, torch.float32)
    with TensorStore([ssd], stripe_bytes=STRIPE, io_threads_per_path=1) as store:
        for key in ("k", "background"):
            store.write(key, data).result()
        holder = aligned_empty(1024, torch.float32)
        store.read("k", holder, share=True).result()
        assert store.offers(holder) and not store.offers(data)
        started, release = _hold_the_blocker(
            monkeypatch, lambda request: order.append(request.key + (" copied" if request.source is not None else "")))
        blocker = store.write("blocker", data)
        assert started.wait(10)
        background = store.read("background", aligned_empty(1024, torch.float32))
        out = aligned_empty(1024, torch.float32)
        copy = store.read("k", out)
        assert store.unshare(holder) == [copy] and not store.offers(holder)
        release.set()
        for future in (blocker, background, copy):
            future.result()
        assert order == ["blocker", "k copied", "background"]
        assert torch.equal(out, data)
        store.read("k", holder, share=True).result()
        store.write("k", data).result()
        assert not store.offers(holder)


def test_a_shared_write_serves_reads_of_the_key_from_memory_once_it_lands(
        ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write with ``share`` offers its tensor to reads of its key: a read started while the write is still in
    flight (which a plain write would refuse) waits for it and copies, verified, and an urgent one moves the write to
    the urgent lane; ``unshare`` hands back the copies still running, and from then on (or after another write of the
    key) reads go to the drive."""
    landing, land = threading.Event(), threading.Event()
    real = TensorStore._transfer_chunk

    def held(self: TensorStore, request: storage.Request, chunk: storage.Chunk) -> Any:
        if request.is_write and request.key == "k":
            landing.set()
            land.wait(10)
        return real(self, request, chunk)

    old, new = _random(3 * STRIPE // 4, torch.float32, seed=1), _random(3 * STRIPE // 4, torch.float32, seed=2)
    with TensorStore([ssd], stripe_bytes=STRIPE, io_threads_per_path=1) as store:
        store.write("k", old).result()
        assert not store.shares("k")
        monkeypatch.setattr(TensorStore, "_transfer_chunk", held)
        holder = new.clone()
        written = store.write("k", holder, share=True)
        assert landing.wait(10) and store.shares("k")
        out = aligned_empty(new.numel(), torch.float32)
        copy = store.read("k", out, urgent=True)
        assert not copy.done()
        land.set()
        written.result()
        copy.result()
        nbytes = new.numel() * 4
        assert torch.equal(out, new) and store.bytes_shared == nbytes and store.bytes_read == 0
        assert store.unshare(holder) == [] and not store.shares("k")
        store.read("k", out).result()
        assert torch.equal(out, new) and store.bytes_read == nbytes and store.bytes_shared == nbytes
        # A later write of the key makes the offered tensor stale.
        store.write("k", holder, share=True).result()
        store.write("k", old).result()
        assert not store.shares("k")
        store.read("k", out).result()
        assert torch.equal(out, old) and store.bytes_shared == nbytes


def test_a_changed_tensor_a_write_shares_fails_the_checksum(ssd: Path) -> None:
    """Bytes copied from a tensor a write offered are checked against what the write stored."""
    data = _random(2048, torch.float32)
    with TensorStore([ssd], stripe_bytes=STRIPE) as store:
        holder = data.clone()
        store.write("k", holder, share=True).result()
        holder[7] += 1.0
        with pytest.raises(RatelStoreError, match="checksum mismatch"):
            store.read("k", aligned_empty(2048, torch.float32)).result()


def test_a_failed_shared_read_leaves_the_others_to_the_drive(ssd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _random(1024, torch.float32)
    real = storage._pread
    failures = [OSError(errno.EIO, "Input/output error")]

    def failing(fd: int, buf: memoryview, offset: int) -> int:
        if failures:
            raise failures.pop()
        return real(fd, buf, offset)

    with TensorStore([ssd], stripe_bytes=STRIPE, io_threads_per_path=1) as store:
        store.write("k", data).result()
        monkeypatch.setattr(storage, "_pread", failing)
        holder = aligned_empty(1024, torch.float32)
        shared = store.read("k", holder, share=True)
        out = aligned_empty(1024, torch.float32)
        later = store.read("k", out)
        with pytest.raises(RatelStoreError, match="Input/output error"):
            shared.result()
        later.result()
        assert torch.equal(out, data) and store.bytes_shared == 0
