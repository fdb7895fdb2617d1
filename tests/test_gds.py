"""GdsStore and the kvikio probe without a GPU: a stand-in kvikio moves CPU tensors with plain file calls."""

from __future__ import annotations

import errno
import os
import stat
import sys
import types

import pytest
import torch

from lightning_ratel.errors import RatelConfigError, RatelStoreError
from lightning_ratel.runtime import gds
from lightning_ratel.runtime.checksum import tensor_checksum
from lightning_ratel.runtime.gds import GdsStore, kvikio_available, kvikio_unavailable_reason
from lightning_ratel.runtime.kept import KeptStore
from lightning_ratel.runtime.swapfile import HEADER_BYTES

STRIPE = 4096


class FakeCuFile:
    """kvikio.CuFile on CPU tensors: ``raw_read``/``raw_write`` become ``pread``/``pwrite`` of the tensor's bytes."""

    opened: list[FakeCuFile] = []
    calls: list[tuple[str, str, int, int]] = []
    fail: dict[tuple[str, int], BaseException] = {}
    short_reads = False

    def __init__(self, path: str, flags: str = "r") -> None:
        assert flags == "r+"
        self.path = path
        self.fd = os.open(path, os.O_RDWR)
        self.closed = False
        FakeCuFile.opened.append(self)

    def fileno(self) -> int:
        return self.fd

    def _check(self, operation: str, size: int, file_offset: int) -> None:
        FakeCuFile.calls.append((operation, os.path.basename(os.path.dirname(self.path)), file_offset, size))
        error = FakeCuFile.fail.get((operation, len(FakeCuFile.calls)))
        if error is not None:
            raise error

    def raw_write(self, buf: torch.Tensor, size: int, file_offset: int = 0, dev_offset: int = 0) -> int:
        self._check("write", size, file_offset)
        return os.pwrite(self.fd, buf[:size].numpy().tobytes(), file_offset)

    def raw_read(self, buf: torch.Tensor, size: int, file_offset: int = 0, dev_offset: int = 0) -> int:
        self._check("read", size, file_offset)
        if FakeCuFile.short_reads:
            return 0
        data = os.pread(self.fd, size, file_offset)
        buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
            self.closed = True


def _kvikio_module(monkeypatch: pytest.MonkeyPatch, defaults: types.ModuleType | types.SimpleNamespace,
                   api: str) -> types.ModuleType:
    """A stand-in ``kvikio`` package in ``sys.modules`` shaped like a release line: ``"26"`` leaves ``defaults`` an
    importable submodule the package does not import (kvikio 26.x), ``"older"`` sets it as an attribute."""
    module = types.ModuleType("kvikio")
    module.__path__ = []  # a package, so that ``kvikio.defaults`` is a submodule
    module.CuFile = FakeCuFile
    if api == "26":
        submodule = types.ModuleType("kvikio.defaults")
        submodule.__dict__.update(vars(defaults))
        monkeypatch.setitem(sys.modules, "kvikio.defaults", submodule)
    else:
        module.defaults = defaults
        monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.setitem(sys.modules, "kvikio", module)
    return module


# The compatibility-mode query of each kvikio release line the code supports, all answering "POSIX path".
KVIKIO_APIS = {
    "26": types.SimpleNamespace(is_compat_mode_preferred=lambda: True),
    "24": types.SimpleNamespace(get=lambda key: types.SimpleNamespace(name="ON")),
    "older": types.SimpleNamespace(compat_mode=lambda: True),
}


@pytest.fixture(params=sorted(KVIKIO_APIS))
def fake_kvikio(monkeypatch, request):
    module = _kvikio_module(monkeypatch, KVIKIO_APIS[request.param], "26" if request.param == "26" else "older")
    FakeCuFile.opened = []
    FakeCuFile.calls = []
    FakeCuFile.fail = {}
    FakeCuFile.short_reads = False
    kvikio_unavailable_reason.cache_clear()
    yield module
    kvikio_unavailable_reason.cache_clear()


@pytest.fixture
def dirs(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    for p in paths:
        p.mkdir()
    return paths


def _store(dirs, **kwargs) -> GdsStore:
    return GdsStore([str(d) for d in dirs], stripe_bytes=STRIPE, device="cpu", **kwargs)


def test_unavailable_without_kvikio(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio raises ImportError
    kvikio_unavailable_reason.cache_clear()
    assert not kvikio_available()
    assert not kvikio_available(str(tmp_path))
    reason = kvikio_unavailable_reason(str(tmp_path))
    if torch.cuda.is_available():
        assert "kvikio" in reason
    else:
        assert "CUDA" in reason
    with pytest.raises(RatelConfigError, match="kvikio cannot be imported"):
        GdsStore([str(tmp_path)], device="cpu")
    assert os.listdir(tmp_path) == []
    kvikio_unavailable_reason.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_importable_kvikio_without_cuda_is_not_available(fake_kvikio, tmp_path):
    assert not kvikio_available(str(tmp_path))
    assert "CUDA" in kvikio_unavailable_reason(str(tmp_path))


def test_round_trip_striped_over_directories(fake_kvikio, dirs):
    with _store(dirs) as store:
        data = torch.arange(3 * STRIPE // 4 + 25, dtype=torch.float32)  # 3 stripes and 100 bytes
        small = torch.arange(10, dtype=torch.bfloat16)
        store.write("x", data).result()
        store.write("y", small).result()
        # One chunk per stripe, round robin over the directories and on across keys, at 4096-byte file offsets.
        writes = [(d, off - HEADER_BYTES, n) for op, d, off, n in FakeCuFile.calls if op == "write"]
        assert sorted(writes) == sorted([("a", 0, STRIPE), ("b", 0, STRIPE), ("a", STRIPE, STRIPE), ("b", STRIPE, 100),
                                         ("a", 2 * STRIPE, 20)])
        out = torch.empty_like(data)
        assert store.read("x", out).result() is out
        assert torch.equal(out, data)
        back = torch.zeros_like(small)
        store.read("y", back).result()
        assert torch.equal(back, small)
        assert store.nbytes_reserved == data.numel() * 4 + small.numel() * 2
        assert store.bytes_written == store.nbytes_reserved
        assert store.bytes_read == store.nbytes_reserved
        assert not store.gds and not store.direct


def test_reserve_preallocate_and_size_checks(fake_kvikio, dirs):
    with _store(dirs) as store:
        store.reserve("k", 3 * STRIPE)
        store.preallocate()
        sizes = [os.stat(d / "ratel.swap").st_size - HEADER_BYTES for d in dirs]
        assert sizes == [2 * STRIPE, STRIPE]
        with pytest.raises(ValueError, match="holds"):
            store.read("k", torch.empty(10, dtype=torch.uint8))
        with pytest.raises(ValueError, match="keeps its size"):
            store.write("k", torch.empty(10, dtype=torch.uint8))
        with pytest.raises(KeyError):
            store.read("missing", torch.empty(1))
        with pytest.raises(ValueError, match="contiguous"):
            store.write("t", torch.empty(4, 4).t())


def test_rejects_tensors_on_another_device(fake_kvikio, dirs):
    with GdsStore([str(d) for d in dirs], device="cuda") as store:
        with pytest.raises(ValueError, match="moves cuda tensors"):
            store.write("x", torch.zeros(4))


def test_oserror_becomes_store_error_with_path_errno_and_offset(fake_kvikio, dirs):
    with _store(dirs) as store:
        FakeCuFile.fail[("write", 2)] = OSError(errno.ENOSPC, "No space left on device")
        future = store.write("x", torch.zeros(2 * STRIPE // 4))
        with pytest.raises(RatelStoreError) as info:
            future.result()
        error = info.value
        assert error.errno == errno.ENOSPC
        assert os.path.dirname(error.filename) in {str(d) for d in dirs}
        assert error.filename.endswith("ratel.swap")
        assert "key 'x'" in str(error) and f"at offset {HEADER_BYTES}" in str(error)


def test_kvikio_runtime_error_becomes_eio(fake_kvikio, dirs):
    with _store(dirs) as store:
        store.write("x", torch.zeros(8)).result()
        FakeCuFile.fail[("read", len(FakeCuFile.calls) + 1)] = RuntimeError("cuFile error: CU_FILE_IO_NOT_SUPPORTED")
        with pytest.raises(RatelStoreError, match="CU_FILE_IO_NOT_SUPPORTED") as info:
            store.read("x", torch.empty(8)).result()
        assert info.value.errno == errno.EIO
        assert info.value.filename == str(dirs[0] / "ratel.swap")


def test_short_transfer_is_an_error(fake_kvikio, dirs):
    with _store(dirs) as store:
        store.write("x", torch.zeros(8)).result()
        FakeCuFile.short_reads = True
        with pytest.raises(RatelStoreError, match="stopped short") as info:
            store.read("x", torch.empty(8)).result()
        assert info.value.errno == errno.EIO


def test_busy_intervals(fake_kvikio, dirs):
    with _store(dirs) as store:
        assert store.take_busy_intervals() == []
        store.write("x", torch.zeros(3 * STRIPE // 4)).result()
        busy = store.take_busy_intervals()
        assert len(busy) == 3 and all(start <= end for start, end in busy)
        assert store.take_busy_intervals() == []


def test_close_removes_files_and_handles(fake_kvikio, dirs):
    store = _store(dirs)
    store.write("x", torch.zeros(16)).result()
    for d in dirs:
        assert stat.S_IMODE(os.stat(d / "ratel.swap").st_mode) == 0o600
        assert (d / "ratel.lock").exists()
    store.close()
    store.close()
    assert all(handle.closed for handle in FakeCuFile.opened)
    assert [os.listdir(d) for d in dirs] == [[], []]
    with pytest.raises(RuntimeError, match="closed"):
        store.write("y", torch.zeros(1))


def test_keep_files(fake_kvikio, dirs):
    with _store(dirs, keep_files=True) as store:
        store.write("x", torch.zeros(16)).result()
    assert [sorted(os.listdir(d)) for d in dirs] == [["ratel.index.json", "ratel.swap"], ["ratel.swap"]]


def test_second_store_on_the_same_directory_is_refused(fake_kvikio, dirs):
    with _store(dirs):
        with pytest.raises(RatelConfigError, match="in use by another run"):
            _store(dirs[:1])


def test_replaced_swap_file_is_refused_and_nothing_is_left(fake_kvikio, dirs, monkeypatch):
    class Swapped(FakeCuFile):
        def __init__(self, path: str, flags: str = "r") -> None:
            os.replace(path, path + ".moved")
            with open(path, "wb"):
                pass
            super().__init__(path, flags)

    monkeypatch.setattr(fake_kvikio, "CuFile", Swapped)
    with pytest.raises(RatelConfigError, match="was replaced"):
        _store(dirs[:1])
    assert os.listdir(dirs[0]) == ["ratel.swap.moved"]


def test_kvikio_open_failure_cleans_up(fake_kvikio, dirs, monkeypatch):
    def refuse(path: str, flags: str = "r") -> None:
        raise RuntimeError("cuFile handle register failed")

    monkeypatch.setattr(fake_kvikio, "CuFile", refuse)
    with pytest.raises(RatelConfigError, match="cannot open the swap file"):
        _store(dirs)
    assert [os.listdir(d) for d in dirs] == [[], []]


@pytest.mark.parametrize(
    ("defaults", "expected"),
    [
        (types.SimpleNamespace(is_compat_mode_preferred=lambda: False), True),
        (types.SimpleNamespace(get=lambda key: types.SimpleNamespace(name="OFF")), True),
        (types.SimpleNamespace(get=lambda key: types.SimpleNamespace(name="AUTO")), False),
        (types.SimpleNamespace(compat_mode=lambda: False), True),
        (types.SimpleNamespace(compat_mode=lambda: True), False),
    ],
)
@pytest.mark.parametrize("api", ["26", "older"])
def test_gds_mode_detection(monkeypatch, defaults, expected, api):
    assert gds._uses_gds(_kvikio_module(monkeypatch, defaults, api)) is expected


def test_measure_compares_both_routes(fake_kvikio, dirs):
    figures = gds.measure([str(d) for d in dirs], "cpu", nbytes=64 << 10, repeats=1)
    values = figures.to_dict()
    assert all(values[k] > 0 for k in ("kvikio_read", "kvikio_write", "host_read", "host_write"))
    assert values["gds"] is False
    assert isinstance(figures.prefer_kvikio(), bool)
    assert [os.listdir(d) for d in dirs] == [[], []]


def test_prefer_kvikio_compares_round_trip_time():
    fast = gds.DeviceSsdBandwidth(kvikio_read=4.0, kvikio_write=4.0, host_read=2.0, host_write=8.0, gds=True)
    assert fast.prefer_kvikio()
    slow = gds.DeviceSsdBandwidth(kvikio_read=1.0, kvikio_write=8.0, host_read=2.0, host_write=8.0, gds=False)
    assert not slow.prefer_kvikio()


def _flip(path, offset: int, mask: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ mask]))


def test_corruption_is_detected_with_path_key_and_offset(fake_kvikio, dirs, monkeypatch):
    devices = []
    real = gds.tensor_checksum

    def spy(data):
        devices.append(data.device.type)
        return real(data)

    monkeypatch.setattr(gds, "tensor_checksum", spy)
    with _store(dirs) as store:
        data = torch.randn(3 * STRIPE // 4 + 25, generator=torch.Generator().manual_seed(0))
        store.write("x", data).result()
        assert torch.equal(store.read("x", torch.empty_like(data)).result().view(torch.int32), data.view(torch.int32))
        # One checksum per chunk written and per chunk read, computed with torch where the tensor lives.
        assert devices == ["cpu"] * 8
        chunks = store._extents["x"].chunks
        # The top exponent bit of element 1500 (in stripe 1, so in the second directory).
        chunk = chunks[1500 * 4 // STRIPE]
        path = store.swap_files[chunk.file].path
        offset = chunk.file_offset + 1500 * 4 - chunk.key_offset + 3
        _flip(path, offset, 0x40)
        with pytest.raises(RatelStoreError) as info:
            store.read("x", torch.empty_like(data)).result()
        error = info.value
        assert error.errno == errno.EBADMSG and error.filename == str(path)
        assert "key 'x'" in str(error) and f"offset {chunk.file_offset}" in str(error)
        assert f"key offset {chunk.key_offset}" in str(error)
        _flip(path, offset, 0x40)
        assert torch.equal(store.read("x", torch.empty_like(data)).result().view(torch.int32), data.view(torch.int32))
        # A whole 4 KiB block replaced.
        block = chunks[2]
        path = store.swap_files[block.file].path
        with open(path, "r+b") as file:
            file.seek(block.file_offset)
            file.write(os.urandom(STRIPE))
        with pytest.raises(RatelStoreError) as info:
            store.read("x", torch.empty_like(data)).result()
        assert info.value.errno == errno.EBADMSG and info.value.filename == str(path)
        assert f"offset {block.file_offset}" in str(info.value) and "key 'x'" in str(info.value)


def test_kept_device_store_reads_back_into_host_tensors(fake_kvikio, dirs):
    data = torch.randn(2 * STRIPE // 4 + 3)
    small = torch.arange(7, dtype=torch.bfloat16)
    with _store(dirs, keep_files=True) as store:
        store.write("x", data).result()
        store.write("y", small).result()
    with KeptStore(dirs) as kept:
        assert type(kept) is KeptStore and kept.verify
        assert kept.keys() == ["x", "y"]
        assert torch.equal(kept.read("x", torch.empty_like(data)).result(), data)
        assert torch.equal(kept.read("y", torch.empty_like(small)).result(), small)
        chunk = kept._extents["x"].chunks[0]
        _flip(kept.swap_files[chunk.file].path, chunk.file_offset + 10, 0x01)
        with pytest.raises(RatelStoreError, match="checksum mismatch"):
            kept.read("x", torch.empty_like(data)).result()


def test_tensor_checksum_detects_every_flipped_bit_and_a_replaced_block():
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (61,), dtype=torch.uint8, generator=generator)  # seven words and a 5-byte tail
    reference = tensor_checksum(data)
    for byte in range(data.numel()):
        for bit in range(8):
            flipped = data.clone()
            flipped[byte] ^= 1 << bit
            assert tensor_checksum(flipped) != reference, (byte, bit)
    # Independent of where the bytes sit in memory (unaligned views are copied), and zeros sum to zero.
    shifted = torch.empty(62, dtype=torch.uint8)
    shifted[1:] = data
    assert tensor_checksum(shifted[1:]) == reference
    assert tensor_checksum(torch.zeros(4096 + 5, dtype=torch.uint8)) == 0
    chunk = torch.randint(0, 256, (4 * 4096,), dtype=torch.uint8, generator=generator)
    replaced = chunk.clone()
    replaced[4096:8192] = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=generator)
    assert tensor_checksum(replaced) != tensor_checksum(chunk)
