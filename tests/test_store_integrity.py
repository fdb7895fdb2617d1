"""What the swap store reads is what it wrote, it writes only through files it created, and kept files can be read
back later (lightning_ratel.runtime.storage, swapfile and kept: checksums, swap file headers, KeptStore)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import stat
import threading
from pathlib import Path

import pytest
import torch

from lightning_ratel.engine.coordinator import store_io
from lightning_ratel.errors import RatelConfigError, RatelStoreError
from lightning_ratel.runtime import checksum, storage
from lightning_ratel.runtime.adamw import GroupHyper, fused_adamw_
from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.kept import KeptStore
from lightning_ratel.runtime.peerstore import PeerStore
from lightning_ratel.runtime.storage import Chunk, TensorStore
from lightning_ratel.runtime.swapfile import HEADER_BYTES
from tests.test_storage import STRIPE, _buffer, _random

NUMEL = 3 * STRIPE // 4 + 77  # three whole stripes of fp32 and a partial fourth


@pytest.fixture(params=["direct", "buffered"])
def io_mode(request: pytest.FixtureRequest, tmp_path: Path) -> bool:
    """``direct`` argument of the store; skips the direct case where the filesystem refuses O_DIRECT."""
    if request.param == "buffered":
        return False
    probe = tmp_path / "probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError:
        pytest.skip("the filesystem refuses O_DIRECT")
    finally:
        probe.unlink(missing_ok=True)
    return True


def _dirs(tmp_path: Path, count: int) -> list[Path]:
    paths = [tmp_path / f"ssd{i}" for i in range(count)]
    for path in paths:
        path.mkdir()
    return paths


def _locate(store: TensorStore, key: str, key_byte: int) -> tuple[Path, int, Chunk]:
    """The swap file, file offset and chunk that hold byte ``key_byte`` of ``key``, from the store's layout."""
    for chunk in store._extents[key].chunks:
        if chunk.key_offset <= key_byte < chunk.key_offset + chunk.length:
            path = store.swap_files[chunk.file].path
            return path, chunk.file_offset + key_byte - chunk.key_offset, chunk
    raise AssertionError(f"byte {key_byte} is not in key {key!r}")


def _patch(path: Path, offset: int, data: bytes) -> bytes:
    """Overwrite bytes of a swap file behind the store's back; returns what was there."""
    fd = os.open(path, os.O_RDWR)
    try:
        before = os.pread(fd, len(data), offset)
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return before


def _assert_names(error: RatelStoreError, path: Path, key: str, chunk: Chunk) -> None:
    message = str(error)
    assert error.filename == str(path)
    assert str(path) in message
    assert f"key {key!r}" in message
    assert f"offset {chunk.file_offset}" in message
    assert f"key offset {chunk.key_offset}" in message


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("ndirs", [1, 2])
def test_flipped_exponent_bit_is_detected(tmp_path: Path, io_mode: bool, aligned: bool, ndirs: int) -> None:
    with TensorStore(_dirs(tmp_path, ndirs), stripe_bytes=STRIPE, direct=io_mode) as store:
        assert store.direct == io_mode
        source = _buffer(NUMEL, torch.float32, aligned).copy_(_random(NUMEL, torch.float32))
        other = _random(100, torch.float32, seed=1)
        store.write("w", source).result()
        store.write("other", other).result()
        out = _buffer(NUMEL, torch.float32, aligned)
        store.read("w", out).result()
        assert torch.equal(out.view(torch.int32), source.view(torch.int32))

        for element in (STRIPE // 4 + 5, NUMEL - 1):  # inside a whole stripe, and in the partial last block
            # Bit 30 is the top exponent bit of an fp32; little-endian, it is bit 6 of the element's last byte.
            path, offset, chunk = _locate(store, "w", element * 4 + 3)
            before = _patch(path, offset, bytes([path.read_bytes()[offset] ^ 0x40]))
            with pytest.raises(RatelStoreError) as info:
                store.read("w", _buffer(NUMEL, torch.float32, aligned)).result()
            assert info.value.errno == errno.EBADMSG
            assert "checksum mismatch" in str(info.value)
            _assert_names(info.value, path, "w", chunk)
            # Only that chunk is wrong: the other key still reads, and undoing the flip heals the key.
            assert torch.equal(store.read("other", torch.empty(100)).result(), other)
            _patch(path, offset, before)
            out = store.read("w", _buffer(NUMEL, torch.float32, aligned)).result()
            assert torch.equal(out.view(torch.int32), source.view(torch.int32))


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("ndirs", [1, 2])
def test_replaced_block_is_detected(tmp_path: Path, io_mode: bool, aligned: bool, ndirs: int) -> None:
    generator = random.Random(ndirs * 2 + aligned)
    with TensorStore(_dirs(tmp_path, ndirs), stripe_bytes=STRIPE, direct=io_mode) as store:
        source = _buffer(NUMEL, torch.float32, aligned).copy_(_random(NUMEL, torch.float32))
        store.write("w", source).result()
        block = generator.randrange(-(-NUMEL * 4 // 4096))
        path, offset, chunk = _locate(store, "w", block * 4096)
        _patch(path, offset, generator.randbytes(4096))
        with pytest.raises(RatelStoreError) as info:
            store.read("w", _buffer(NUMEL, torch.float32, aligned)).result()
        assert info.value.errno == errno.EBADMSG
        _assert_names(info.value, path, "w", chunk)


def test_rewritten_key_gets_new_checksums(tmp_path: Path, io_mode: bool) -> None:
    with TensorStore(_dirs(tmp_path, 2), stripe_bytes=STRIPE, direct=io_mode) as store:
        for seed in range(3):
            source = _random(NUMEL, torch.float32, seed=seed)
            store.write("w", source).result()
            assert torch.equal(store.read("w", torch.empty(NUMEL)).result(), source)


def test_never_written_key_reads_as_verified_zeros(tmp_path: Path, io_mode: bool) -> None:
    with TensorStore(_dirs(tmp_path, 2), stripe_bytes=STRIPE, direct=io_mode) as store:
        store.reserve("reserved", NUMEL * 4)
        store.reserve("beyond", 10)
        store.preallocate()
        out = store.read("reserved", torch.full((NUMEL,), 7.0)).result()
        assert bool((out == 0).all())
        # Zeros is what such a key holds, so something else there is caught like any other corruption.
        path, offset, chunk = _locate(store, "reserved", 4 * 4096)
        _patch(path, offset, b"\x01")
        with pytest.raises(RatelStoreError) as info:
            store.read("reserved", torch.empty(NUMEL)).result()
        assert info.value.errno == errno.EBADMSG
        _assert_names(info.value, path, "reserved", chunk)


def test_failed_write_leaves_the_chunk_undefined_until_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwrite = storage._pwrite
    failing = {"offsets": set()}

    def faulty(fd: int, buf: memoryview, offset: int) -> int:
        if offset in failing["offsets"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(storage, "_pwrite", faulty)
    with TensorStore(_dirs(tmp_path, 1), stripe_bytes=STRIPE) as store:
        first = _random(NUMEL, torch.float32, seed=1)
        store.write("w", first).result()
        path, offset, chunk = _locate(store, "w", STRIPE)
        failing["offsets"] = {offset}
        with pytest.raises(RatelStoreError) as info:
            store.write("w", _random(NUMEL, torch.float32, seed=2)).result()
        assert info.value.errno == errno.ENOSPC
        # The message says how much more space the write needed, and how much is free.
        assert f"{STRIPE} more bytes" in str(info.value) and "free on its filesystem" in str(info.value)
        with pytest.raises(RatelStoreError, match="holds no defined data because its last write failed") as info:
            store.read("w", torch.empty(NUMEL)).result()
        assert info.value.errno == errno.EIO
        _assert_names(info.value, path, "w", chunk)
        failing["offsets"] = set()
        store.write("w", first).result()
        assert torch.equal(store.read("w", torch.empty(NUMEL)).result(), first)


def test_overlapping_requests_on_one_key_fail_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract says wait for a write before the next request on its key; a caller that does not gets a clear
    error, never a crash or a false corruption report, and writing the key again heals it."""
    real_pwrite = storage._pwrite
    started = threading.Event()
    release = threading.Event()
    held = {"armed": True}

    def holding(fd: int, buf: memoryview, offset: int) -> int:
        if held["armed"]:
            held["armed"] = False
            started.set()
            assert release.wait(10)
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(storage, "_pwrite", holding)
    with TensorStore(_dirs(tmp_path, 1), stripe_bytes=STRIPE, io_threads_per_path=3) as store:
        first = _random(100, torch.float32, seed=1)
        second = _random(100, torch.float32, seed=2)
        slow = store.write("w", first)
        assert started.wait(10)
        with pytest.raises(RatelStoreError, match="overlapped a write") as info:
            store.read("w", torch.empty(100)).result()
        assert info.value.errno == errno.EBUSY
        store.write("w", second).result()
        release.set()
        slow.result()
        with pytest.raises(RatelStoreError, match="two writes of the key ran at the same time") as info:
            store.read("w", torch.empty(100)).result()
        assert info.value.errno == errno.EIO
        store.write("w", second).result()
        assert torch.equal(store.read("w", torch.empty(100)).result(), second)


def test_metadata_must_be_json(tmp_path: Path) -> None:
    with TensorStore(_dirs(tmp_path, 1)) as store:
        with pytest.raises(ValueError, match="JSON"):
            store.set_metadata({"bad": object()})
        data = {"shape": [2, 3]}
        store.set_metadata(data)
        data["shape"].append(4)
        assert store.metadata == {"shape": [2, 3]}


def test_verify_off_reads_without_checking(tmp_path: Path) -> None:
    with TensorStore(_dirs(tmp_path, 1), stripe_bytes=STRIPE, verify=False) as store:
        assert not store.verify
        store.write("w", torch.ones(100)).result()
        path, offset, _ = _locate(store, "w", 0)
        _patch(path, offset, b"\0\0\0\0")
        out = store.read("w", torch.empty(100)).result()
        assert out[0] == 0 and bool((out[1:] == 1).all())


# ------------------------------------------------------------------------------------ files that are not ours


def _refused(directory: Path, *expected: str) -> RatelConfigError:
    with pytest.raises(RatelConfigError) as info:
        TensorStore([directory])
    for text in expected:
        assert text in str(info.value)
    assert not (directory / "ratel.lock").exists()
    return info.value


def test_hard_link_to_a_file_elsewhere_is_left_alone(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"do not touch" * 1000)
    os.link(precious, ssd / "ratel.swap")
    _refused(ssd, str(ssd / "ratel.swap"), "2 hard links", "rm ")
    assert precious.read_bytes() == b"do not touch" * 1000
    assert os.listdir(ssd) == ["ratel.swap"]


def test_hard_linked_lock_file_is_left_alone(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    precious = tmp_path / "precious.txt"
    precious.write_text("important\n")
    os.link(precious, ssd / "ratel.lock")
    with pytest.raises(RatelConfigError, match="hard links") as info:
        TensorStore([ssd])
    assert str(ssd / "ratel.lock") in str(info.value)
    assert precious.read_text() == "important\n"
    assert not (ssd / "ratel.swap").exists()


@pytest.mark.parametrize("dangling", [False, True], ids=["to_a_file", "dangling"])
def test_symlink_is_left_alone(tmp_path: Path, dangling: bool) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    target = tmp_path / "target.bin"
    if not dangling:
        target.write_bytes(b"x" * 5000)
    (ssd / "ratel.swap").symlink_to(target)
    _refused(ssd, "symbolic link", str(target))
    assert (ssd / "ratel.swap").is_symlink()
    assert dangling or target.read_bytes() == b"x" * 5000
    assert not dangling or not target.exists()


def test_foreign_file_is_left_alone(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    (ssd / "ratel.swap").write_bytes(b"someone's data" * 500)
    _refused(ssd, "not a lightning_ratel swap file", str(ssd / "ratel.swap"))
    assert (ssd / "ratel.swap").read_bytes() == b"someone's data" * 500


def test_empty_file_of_a_run_that_died_creating_it_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    messages: list[str] = []
    monkeypatch.setattr(storage, "rank_zero_info", messages.append)
    ssd = _dirs(tmp_path, 1)[0]
    (ssd / "ratel.swap").touch()
    with TensorStore([ssd]) as store:
        store.write("w", torch.ones(3)).result()
    assert len(messages) == 1 and "empty swap file" in messages[0]


def test_directory_in_the_way_is_left_alone(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    (ssd / "ratel.swap").mkdir()
    _refused(ssd, "not a regular file")
    assert (ssd / "ratel.swap").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_swap_file_of_another_user_is_left_alone(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    with TensorStore([ssd]) as other:
        other.write("w", torch.ones(10)).result()
        stale = (ssd / "ratel.swap").read_bytes()
    (ssd / "ratel.swap").write_bytes(stale)
    os.chown(ssd / "ratel.swap", 4321, -1)
    _refused(ssd, "user id 4321")
    assert (ssd / "ratel.swap").read_bytes() == stale


def test_refusal_in_a_later_directory_leaves_the_first_clean(tmp_path: Path) -> None:
    first, second = _dirs(tmp_path, 2)
    (second / "ratel.swap").write_bytes(b"foreign")
    with pytest.raises(RatelConfigError, match="not a lightning_ratel swap file"):
        TensorStore([first, second])
    assert os.listdir(first) == []
    assert os.listdir(second) == ["ratel.swap"]


def test_kept_files_are_refused_and_left_alone(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    with TensorStore([ssd], keep_files=True) as kept:
        kept.write("w", torch.ones(10)).result()
    before = {name: (ssd / name).read_bytes() for name in os.listdir(ssd)}
    error = _refused(ssd, "was kept by", kept.run_id, "lightning_ratel.convert")
    assert str(ssd / "ratel.index.json") in str(error)
    assert {name: (ssd / name).read_bytes() for name in os.listdir(ssd)} == before


def test_files_of_a_crashed_run_that_wanted_to_keep_them_are_left_alone(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    with TensorStore([ssd], keep_files=True) as crashed:
        crashed.write("w", torch.ones(10)).result()
        left_behind = (ssd / "ratel.swap").read_bytes()
    for name in os.listdir(ssd):
        (ssd / name).unlink()
    (ssd / "ratel.swap").write_bytes(left_behind)
    _refused(ssd, "was to be kept by", crashed.run_id, "ended without closing its store")
    assert (ssd / "ratel.swap").read_bytes() == left_behind
    with pytest.raises(RatelConfigError, match="not marked as kept"):
        KeptStore([ssd])


def test_swap_file_header(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 2)[1]
    with TensorStore([tmp_path / "ssd0", ssd], name="hdr") as store:
        block = (ssd / "hdr.swap").read_bytes()[:HEADER_BYTES]
        magic, body = block.rstrip(b"\0").split(b"\n", 1)
        assert magic == b"lightning_ratel swap file"
        header = json.loads(body)
        assert header["name"] == "hdr" and header["run_id"] == store.run_id
        assert header["pid"] == os.getpid() and header["host"] == os.uname().nodename
        assert header["slot"] == 1 and header["files"] == 2 and header["state"] == "in use"
        assert header["version"] == 1


# ------------------------------------------------------------------------------------ kept stores read later


def _kept_store(paths: list[Path], **kwargs: object) -> dict[str, torch.Tensor]:
    """Fill and keep a store; returns what each written key holds."""
    written = {
        "master.0": _random(NUMEL, torch.float32, seed=1),
        "exp_avg.0": _random(1001, torch.float32, seed=2),
        "compute.0": _random(STRIPE // 2 + 3, torch.bfloat16, seed=3),
    }
    with TensorStore(paths, stripe_bytes=STRIPE, keep_files=True, **kwargs) as store:
        store.set_metadata({"params": {"layer.weight": {"key": "master.0", "offset": 0, "shape": [NUMEL]}}})
        store.reserve("never_written", 3 * STRIPE)
        for key, value in written.items():
            store.write(key, value).result()
        store.preallocate()
    return written


def test_kept_store_reads_back(tmp_path: Path, io_mode: bool) -> None:
    paths = _dirs(tmp_path, 2)
    written = _kept_store(paths, direct=io_mode)
    files = {path / "ratel.swap": (path / "ratel.swap").read_bytes() for path in paths}
    assert all(json.loads(data[:HEADER_BYTES].rstrip(b"\0").split(b"\n", 1)[1])["state"] == "kept"
               for data in files.values())
    assert stat.S_IMODE((paths[0] / "ratel.index.json").stat().st_mode) == 0o600
    # The directories may come in any order: each file's header names its slot.
    with KeptStore(list(reversed(paths)), direct=io_mode) as kept:
        assert kept.read_only and kept.verify and kept.direct == io_mode
        assert kept.paths == tuple(path.resolve() for path in paths)
        assert kept.keys() == ["never_written", *written]
        assert kept.stripe_bytes == STRIPE
        assert kept.metadata == {"params": {"layer.weight": {"key": "master.0", "offset": 0, "shape": [NUMEL]}}}
        for swap in kept.swap_files:
            assert fcntl.fcntl(swap.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        for key, value in written.items():
            assert kept.nbytes(key) == value.numel() * value.element_size()
            out = kept.read(key, aligned_empty(value.numel(), value.dtype)).result()
            assert torch.equal(out.view(torch.uint8), value.view(torch.uint8))
        assert bool((kept.read("never_written", torch.ones(3 * STRIPE, dtype=torch.uint8)).result() == 0).all())
        for refused in (
            lambda: kept.write("master.0", written["master.0"]),
            lambda: kept.write("new", torch.ones(3)),
            lambda: kept.reserve("new", 12),
            kept.preallocate,
            lambda: kept.set_metadata({}),
        ):
            with pytest.raises(RatelStoreError, match="read-only") as info:
                refused()
            assert info.value.errno == errno.EROFS
    # Reading and closing changed nothing, and left nothing behind.
    assert {path: path.read_bytes() for path in files} == files
    assert sorted(os.listdir(paths[0])) == ["ratel.index.json", "ratel.swap"]
    assert os.listdir(paths[1]) == ["ratel.swap"]


@pytest.mark.parametrize("is_cuda", [True, False])
def test_kept_stores_open_whatever_stripe_their_run_chose(tmp_path: Path, is_cuda: bool) -> None:
    # A GPU run (and every run before the stripe depended on the device) keeps 1 MiB stripes, a CPU run larger ones:
    # the index records the stripe, and the kept store reads with it.
    stripe = store_io(is_cuda, cores=2).stripe_bytes
    paths = _dirs(tmp_path, 2)
    values = {"large": _random(stripe // 2 + 1001, torch.float32, seed=4), "small": _random(1001, torch.float32)}
    with TensorStore(paths, stripe_bytes=stripe, keep_files=True) as store:
        for key, value in values.items():
            store.write(key, value).result()
    with KeptStore(paths) as kept:
        assert kept.stripe_bytes == stripe
        for key, value in values.items():
            assert torch.equal(kept.read(key, torch.empty_like(value)).result(), value)


def test_kept_store_detects_corruption(tmp_path: Path) -> None:
    paths = _dirs(tmp_path, 2)
    written = _kept_store(paths)
    with TensorStore.open_kept(paths) as kept:
        path, offset, chunk = _locate(kept, "master.0", 2 * STRIPE + 7)
        _patch(path, offset, b"\xff")
        with pytest.raises(RatelStoreError) as info:
            kept.read("master.0", torch.empty(NUMEL)).result()
        assert info.value.errno == errno.EBADMSG
        _assert_names(info.value, path, "master.0", chunk)
        assert torch.equal(kept.read("exp_avg.0", torch.empty(1001)).result(), written["exp_avg.0"])


def test_kept_store_without_verification_reads_unchecked(tmp_path: Path) -> None:
    paths = _dirs(tmp_path, 1)
    written = _kept_store(paths, verify=False)
    with KeptStore(paths) as kept:
        assert not kept.verify
        assert torch.equal(kept.read("exp_avg.0", torch.empty(1001)).result(), written["exp_avg.0"])


def test_open_kept_refuses_what_does_not_fit(tmp_path: Path) -> None:
    paths = _dirs(tmp_path, 2)
    _kept_store(paths)
    index_path = paths[0] / "ratel.index.json"
    index = json.loads(index_path.read_text())

    with pytest.raises(RatelConfigError, match="slots \\[0\\]; add the directories of slots \\[1\\]"):
        KeptStore(paths[:1])
    with pytest.raises(RatelConfigError, match="no swap file"):
        KeptStore(paths, name="other")
    index_path.write_text(json.dumps({**index, "run_id": "0123456789abcdef"}))
    with pytest.raises(RatelConfigError, match="is of run '0123456789abcdef'"):
        KeptStore(paths)
    index_path.unlink()
    with pytest.raises(RatelConfigError, match="has no index"):
        KeptStore(paths)

    # Files of another run in one directory.
    (tmp_path / "other").mkdir()
    other = _dirs(tmp_path / "other", 2)
    _kept_store(other)
    os.replace(other[1] / "ratel.swap", paths[1] / "ratel.swap")
    with pytest.raises(RatelConfigError, match="different runs"):
        KeptStore(paths)


def test_open_kept_refuses_a_store_that_was_not_kept(tmp_path: Path) -> None:
    ssd = _dirs(tmp_path, 1)[0]
    with TensorStore([ssd]) as store:
        store.write("w", torch.ones(10)).result()
        with pytest.raises(RatelConfigError, match="not marked as kept"):
            KeptStore([ssd])
    (ssd / "foreign").mkdir()
    (ssd / "foreign" / "ratel.swap").write_bytes(b"no header")
    with pytest.raises(RatelConfigError, match="not a swap file of store 'ratel'"):
        KeptStore([ssd / "foreign"])


def _words_checksum(data: bytes, key_offset: int) -> int:
    """WEIGHTED32 from its definition, word by word in Python."""
    padded = data + bytes(-len(data) % 4)
    total = 0
    for i in range(0, len(padded), 4):
        k = key_offset // 4 + i // 4
        weight = ((k * 0x9E3779B1) % 2**32) | 1
        total += int.from_bytes(padded[i : i + 4], "little") * weight
    total %= 2**64
    return total - 2**64 if total >= 2**63 else total


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_the_stores_checksum_is_its_definition(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap store's checksum, natively on every code path and with torch where the extension is not built, is
    the weighted sum its docstring defines, for lengths around the vectors and words and wherever the bytes start in
    their key (weights wrap after 2**32 words)."""
    isas = ("avx512", "avx2", "scalar")
    if native and checksum._C is None:
        pytest.skip("lightning_ratel._C is not built")
    if not native:
        monkeypatch.setattr(checksum, "_C", None)
        isas = ("torch",)
    data = bytearray(random.Random(3).getrandbits(8) for _ in range(5000))
    try:
        for isa in isas:
            if native and not checksum._C.set_isa(isa):
                continue
            for length in (0, 1, 3, 4, 5, 63, 64, 65, 255, 257, 4096, 5000):
                for key_offset in (0, 4, 4096, 2**34 - 4096):
                    expected = _words_checksum(bytes(data[:length]), key_offset)
                    assert checksum.weighted32_checksum(memoryview(data[:length]), key_offset) == expected, (
                        isa, length, key_offset)
    finally:
        if native:
            checksum._C.set_isa("avx512") or checksum._C.set_isa("avx2")


def test_the_stores_checksum_sees_any_change_to_a_word_and_where_words_are() -> None:
    """Every flipped bit changes the checksum, and so do swapped words and a chunk checked at another key offset."""
    words = torch.randint(-2**31, 2**31, (256,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    raw = words.to(torch.int32).view(torch.uint8)
    original = checksum.weighted32_checksum(memoryview(raw.numpy()))
    for byte in (0, 3, 517, 1023):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert checksum.weighted32_checksum(memoryview(flipped.numpy())) != original
    swapped = raw.view(torch.int32).clone()
    swapped[[10, 200]] = swapped[[200, 10]]
    assert checksum.weighted32_checksum(memoryview(swapped.view(torch.uint8).numpy())) != original
    assert checksum.weighted32_checksum(memoryview(raw.numpy()), 4096) != original


def _kernel_states(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step's new master and moments (the kernel's outputs), and their block checksums."""
    gen = torch.Generator().manual_seed(n)
    master, exp_avg, exp_avg_sq = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    sums = torch.empty((3, -(-n * 4 // checksum.BLOCK_BYTES)), dtype=torch.int64)
    hyper = GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
    if not fused_adamw_(master, torch.randn(n, generator=gen), exp_avg, exp_avg_sq, None, hyper, step=1,
                        sums=sums):
        pytest.skip("lightning_ratel._C is not built")
    return master, exp_avg, exp_avg_sq, sums


def test_writes_take_the_kernels_checksums_and_reads_verify_them(tmp_path: Path, io_mode: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A write handed the AdamW kernel's block checksums stores its bytes without the I/O thread reading them to
    checksum them; reading back verifies them like any other write's, and damage on the drive is caught."""
    master, exp_avg, exp_avg_sq, sums = _kernel_states(NUMEL)
    counted: list[bool] = []
    real = storage.host_checksum

    def counting(algorithm: str, data: memoryview, key_offset: int = 0) -> int:
        counted.append(True)
        return real(algorithm, data, key_offset)

    monkeypatch.setattr(storage, "host_checksum", counting)
    with TensorStore(_dirs(tmp_path, 2), stripe_bytes=STRIPE, direct=io_mode) as store:
        assert store._algorithm == checksum.WEIGHTED32
        for name, (value, row) in {"master": (master, sums[0]), "exp_avg": (exp_avg, sums[1]),
                                   "exp_avg_sq": (exp_avg_sq, sums[2])}.items():
            store.write(name, value, sums=row).result()
        assert not counted
        chunks = len(store._extents["master"].chunks)
        for name, value in {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}.items():
            assert torch.equal(store.read(name, torch.empty(NUMEL)).result(), value)
        assert len(counted) == 3 * chunks
        path, offset, chunk = _locate(store, "exp_avg_sq", STRIPE + 12)
        _patch(path, offset, b"\x01")
        with pytest.raises(RatelStoreError) as info:
            store.read("exp_avg_sq", torch.empty(NUMEL)).result()
        assert info.value.errno == errno.EBADMSG
        _assert_names(info.value, path, "exp_avg_sq", chunk)


def test_wrong_checksums_handed_in_fail_the_read_loudly(tmp_path: Path) -> None:
    """Checksums that do not belong to the bytes written (a writer's mistake) never pass silently: the read fails."""
    master, exp_avg, _, sums = _kernel_states(NUMEL)
    with TensorStore(_dirs(tmp_path, 1), stripe_bytes=STRIPE) as store:
        store.write("exp_avg", exp_avg, sums=sums[0]).result()
        with pytest.raises(RatelStoreError) as info:
            store.read("exp_avg", torch.empty(NUMEL)).result()
        assert info.value.errno == errno.EBADMSG
        with pytest.raises(ValueError, match="block sums"):
            store.write("master", master, sums=sums[0, :-1])


def test_kept_store_verifies_its_checksums_without_the_extension(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Files kept by a run with the native checksum are verified where the extension is not built (torch computes the
    same sums), and damage is still caught there."""
    if checksum._C is None:
        pytest.skip("lightning_ratel._C is not built")
    paths = _dirs(tmp_path, 2)
    written = _kept_store(paths)
    monkeypatch.setattr(checksum, "_C", None)
    _verifies_and_catches_damage(paths, written, checksum.WEIGHTED32, "master.0", 7)


def _verifies_and_catches_damage(paths: list[Path], written: dict[str, torch.Tensor], algorithm: str, key: str,
                                 key_byte: int) -> None:
    """The kept store in ``paths`` checks with ``algorithm``, reads back what was ``written``, and fails the read of
    ``key`` once its byte ``key_byte`` is changed on the drive."""
    with KeptStore(paths) as kept:
        assert kept.verify and kept._algorithm == algorithm
        for name, value in written.items():
            out = kept.read(name, aligned_empty(value.numel(), value.dtype)).result()
            assert torch.equal(out.view(torch.uint8), value.view(torch.uint8))
        path, offset, _ = _locate(kept, key, key_byte)
        _patch(path, offset, b"\xee")
        with pytest.raises(RatelStoreError, match="checksum mismatch"):
            kept.read(key, torch.empty_like(written[key])).result()


def test_kept_store_of_an_xxh3_run_still_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files kept by a run whose store checksummed with xxh3 (before WEIGHTED32, or without the extension) read back
    verified with xxh3, whatever the store of this run uses, and damage is caught."""
    paths = _dirs(tmp_path, 2)
    monkeypatch.setattr(TensorStore, "_checksum_algorithm", checksum.XXH3_64)
    written = _kept_store(paths)
    monkeypatch.undo()
    assert json.loads((paths[0] / "ratel.index.json").read_text())["checksum"] == checksum.XXH3_64
    _verifies_and_catches_damage(paths, written, checksum.XXH3_64, "exp_avg.0", 40)


@pytest.mark.parametrize("ndirs", [1, 2])
def test_another_ranks_store_reads_only_what_its_owner_announced(tmp_path: Path, io_mode: bool, ndirs: int) -> None:
    """A :class:`PeerStore` on another store's live files (a rank reading the compute copies its node's other ranks
    own): a key reads back only once its owner announced its checksums, then verified like the owner's own reads; a
    rewrite not announced yet, or damage on the drive, fails the check naming the owner's file; nothing can be
    written; a file of another run is refused; closing it leaves the owner's files as they are."""
    dirs = _dirs(tmp_path, ndirs)
    value = _random(NUMEL, torch.float32, seed=1)
    with TensorStore(dirs, name="ratel-rank0", stripe_bytes=STRIPE, direct=io_mode) as owner:
        owner.write("copy", value).result()
        with pytest.raises(RatelConfigError, match="not the swap file of store 'ratel-rank0' of run nope"):
            PeerStore(owner.paths, owner.name, "nope", owner.stripe_bytes, owner.checksum_algorithm)
        peer = PeerStore(owner.paths, owner.name, owner.run_id, owner.stripe_bytes, owner.checksum_algorithm,
                         direct=io_mode or None)
        try:
            peer.adopt("rank0/copy", owner.extent("copy"))
            out = _buffer(NUMEL, torch.float32, aligned=True)
            with pytest.raises(RatelStoreError, match="has not announced a write of it yet"):
                peer.read("rank0/copy", out).result()
            peer.announce("rank0/copy", owner.checksums("copy"))
            assert torch.equal(peer.read("rank0/copy", out).result(), value)
            # The owner rewrites the key: until it announces the new checksums, a read fails instead of passing.
            newer = _random(NUMEL, torch.float32, seed=2)
            owner.write("copy", newer).result()
            with pytest.raises(RatelStoreError, match="checksum mismatch") as caught:
                peer.read("rank0/copy", out).result()
            assert caught.value.errno == errno.EBADMSG
            peer.announce("rank0/copy", owner.checksums("copy"))
            assert torch.equal(peer.read("rank0/copy", out).result(), newer)
            path, offset, chunk = _locate(owner, "copy", 5 * 4)
            # One bit of the owner's file flipped on the drive.
            before = _patch(path, offset, b"\0")
            _patch(path, offset, bytes([before[0] ^ 0x40]))
            with pytest.raises(RatelStoreError, match="checksum mismatch") as caught:
                peer.read("rank0/copy", out).result()
            _assert_names(caught.value, path, "rank0/copy", chunk)
            with pytest.raises(RatelStoreError) as refused:
                peer.write("rank0/copy", newer).result()
            assert refused.value.errno == errno.EROFS
        finally:
            peer.close()
        assert all(f.path.exists() for f in owner.swap_files)
        owner.write("copy", value).result()
        assert torch.equal(owner.read("copy", torch.empty(NUMEL)).result(), value)
