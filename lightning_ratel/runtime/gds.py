"""Device memory to SSD and back through kvikio, for the activation ``ssd`` tier.

:class:`GdsStore` is a :class:`~lightning_ratel.runtime.storage.TensorStore` whose tensors live in GPU memory: a saved
activation is written to the swap files straight from the device and read back straight into a device buffer, with
no staging copy in pinned host memory. kvikio moves the bytes with GPUDirect Storage (cuFile) where the platform has
it (driver, filesystem and NVMe support), and otherwise through its own pinned bounce buffers ("compatibility
mode"), which is still one copy fewer on the caller's side than staging by hand.

Everything else is the store's: swap files ``<path>/<name>.swap`` (created exclusively, with a header) striped over
the directories in 4096-byte aligned chunks, an exclusive ``<name>.lock`` per directory, owner-only files removed at
:meth:`~GdsStore.close`, futures that resolve once every chunk is done, a checksum per chunk verified on every read,
busy intervals for the step breakdown and :class:`RatelStoreError` with path, errno and file offset for every failed
transfer. The checksum is :func:`~lightning_ratel.runtime.checksum.tensor_checksum`, computed with torch on the device
where the bytes are, so verifying costs no copy to the host.

:func:`kvikio_available` tells whether kvikio can really move data on this machine (it imports on machines without a
CUDA driver, where its file I/O then fails), and :func:`measure` times both routes between device memory and the swap
directories so the engine can pick the faster one.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import importlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch

from lightning_ratel.errors import RatelConfigError, RatelStoreError
from lightning_ratel.runtime.checksum import INT64_WEIGHTED, tensor_checksum
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.runtime.probe import best_time
from lightning_ratel.runtime.storage import Chunk, Request, TensorStore
from lightning_ratel.runtime.swapfile import SwapFile


def install_hint() -> str:
    """How to install the kvikio build that matches this torch's CUDA major version."""
    major = (torch.version.cuda or "13").split(".")[0]
    return (f"Install it with `pip install 'lightning_ratel[gds-cu{major}]'` (kvikio-cu{major}, for this torch's "
            f"CUDA {major}) on a machine with a CUDA driver.")


def _import_kvikio() -> ModuleType:
    """The kvikio module, imported on first use so that importing this module never needs it."""
    try:
        import kvikio
    except Exception as exc:  # a broken install can fail with OSError from a missing shared library, not ImportError
        raise RatelConfigError(f"kvikio cannot be imported ({type(exc).__name__}: {exc}). {install_hint()}") from exc
    return kvikio


def _defaults(kvikio: ModuleType) -> ModuleType:
    """kvikio's ``defaults`` submodule, which current releases (26.x) do not import with the package."""
    return importlib.import_module(f"{kvikio.__name__}.defaults")


def _uses_gds(kvikio: ModuleType) -> bool:
    """Whether kvikio reads and writes through cuFile (GPUDirect Storage) rather than its POSIX compatibility path.

    The query moved between kvikio releases: ``defaults.is_compat_mode_preferred()`` (25.x, 26.x), ``defaults.get(
    "compat_mode")`` returning a ``CompatMode``, or ``defaults.compat_mode()`` returning a bool (older releases). A
    ``CompatMode.AUTO`` that cannot be resolved counts as the compatibility path.
    """
    defaults = _defaults(kvikio)
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:
        return not preferred()
    mode = defaults.get("compat_mode") if hasattr(defaults, "get") else defaults.compat_mode()
    return mode is False or getattr(mode, "name", None) == "OFF"


@functools.cache
def kvikio_unavailable_reason(directory: str | None = None) -> str | None:
    """Why kvikio cannot move device memory to and from files in ``directory``, or ``None`` when it can.

    Importing kvikio is not enough: it imports without ``libcuda.so.1`` and fails only at the first transfer. So this
    writes 4096 bytes from a device buffer to a scratch file, reads them back into another and compares. The answer
    is cached per directory; the check costs one small file and one device synchronisation.

    Args:
        directory: Where to put the scratch file, ideally a swap directory (GPUDirect Storage depends on the
            filesystem). ``None``: the system's temporary directory.

    Returns:
        ``None`` if the round trip worked, else a sentence naming what failed.
    """
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    try:
        kvikio = _import_kvikio()
    except RatelConfigError as exc:
        return str(exc)
    try:
        fd, path = tempfile.mkstemp(prefix=".ratel-kvikio-probe.", dir=directory)
    except OSError as exc:
        return f"no scratch file can be created in {directory or tempfile.gettempdir()} ({exc.strerror})"
    os.close(fd)
    try:
        sent = torch.arange(ALIGNMENT, device="cuda").to(torch.uint8)
        received = torch.zeros_like(sent)
        torch.cuda.current_stream().synchronize()
        handle = kvikio.CuFile(path, "r+")
        try:
            handle.raw_write(sent, size=ALIGNMENT, file_offset=0)
            handle.raw_read(received, size=ALIGNMENT, file_offset=0)
        finally:
            handle.close()
        if not torch.equal(sent, received):
            return "kvikio wrote and read back a scratch file without an error, but the bytes differ"
    except Exception as exc:  # any failure of the probe means "not usable here", with the reason
        return f"kvikio file I/O fails here ({type(exc).__name__}: {exc})"
    finally:
        os.unlink(path)
    return None


def kvikio_available(directory: str | None = None) -> bool:
    """Whether kvikio imports and really moves device memory to and from a file in ``directory``.

    See :func:`kvikio_unavailable_reason` for the check and for why it failed.
    """
    return kvikio_unavailable_reason(directory) is None


class _DeviceRequest(Request):
    """A read or write of one key in flight: the caller's tensor as flat bytes, and when its memory is ready."""

    __slots__ = ("flat", "ready")

    def __init__(self, key: str, is_write: bool, tensor: torch.Tensor, ready: Any) -> None:
        # The base class holds the tensor, so the memory stays allocated until the last chunk is done.
        super().__init__(key, is_write, tensor)
        self.flat = tensor.detach().reshape(-1).view(torch.uint8)
        self.ready = ready


class GdsStore(TensorStore):
    """Named device tensors striped over swap files on SSDs, moved by kvikio without host staging.

    The same contract as :class:`~lightning_ratel.runtime.storage.TensorStore`: :meth:`write` and :meth:`read` return
    a future at once; keep the tensor alive (and, for a write, unchanged) until it is done. The tensors are CUDA
    tensors. A request waits, on an I/O thread, for the work queued so far on the current CUDA stream (or for
    ``ready``): the tensor a write stores is the value that stream produces, and a read does not overwrite memory
    that earlier work on that stream still uses (the caching allocator hands freed blocks back to the same stream at
    once). When a read's future is done the bytes are in device memory; kernels may use them without waiting.

    Each chunk is one blocking kvikio call (``CuFile.raw_read``/``raw_write``) on the store's own I/O threads, so the
    number of transfers in flight per drive is ``io_threads_per_path``, whatever kvikio's own thread pool size.
    The checksum of a chunk is computed on that thread right before the write and right after the read.

    Args:
        paths: Directories for the swap files, ideally one per SSD.
        stripe_bytes: Chunk size of the round-robin striping; a positive multiple of 4096. Larger than the host
            store's default, since each chunk costs a cuFile call (or a bounce-buffer round) of fixed overhead.
        device: Device type of the tensors: ``"cuda"``. ``"cpu"`` works only with a stand-in for kvikio (kvikio's
            raw calls take device memory only); the tests use it to run the store without a GPU.
        **options: ``name``, ``io_threads_per_path``, ``keep_files`` (the kept files are read later with
            :class:`~lightning_ratel.runtime.kept.KeptStore`, into CPU tensors) and ``verify`` (on the tensor's
            device), as :class:`~lightning_ratel.runtime.storage.TensorStore` takes them. Not ``direct``: chunks move
            through kvikio's own handles, not the store's descriptors.

    Raises:
        RatelConfigError: If kvikio cannot be imported or cannot open a swap file, or for any reason
            :class:`~lightning_ratel.runtime.storage.TensorStore` gives. Nothing is left behind in that case.
    """

    device_tensors = True
    _checksum_algorithm = INT64_WEIGHTED

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        *,
        stripe_bytes: int = 4 << 20,
        device: str | torch.device = "cuda",
        **options: Any,
    ) -> None:
        self._kvikio = _import_kvikio()
        self._device_type = torch.device(device).type
        # Set before the base class runs: its cleanup after a failed start calls _release, which closes these.
        self._handles: list[Any] = []
        super().__init__(paths, stripe_bytes=stripe_bytes, direct=False, **options)
        try:
            for swap in self.swap_files:
                self._handles.append(self._open_handle(swap))
            self._gds = _uses_gds(self._kvikio)
        except BaseException as error:
            self._abandon(error)
            raise

    def _open_handle(self, swap: SwapFile) -> Any:
        """Open ``swap`` through kvikio; the base class created it (owner-only, symlinks refused) and holds it open."""
        try:
            # "r+" opens without creating or truncating, so the file keeps the mode and contents the store gave it.
            handle = self._kvikio.CuFile(str(swap.path), "r+")
        except Exception as exc:
            raise RatelConfigError(
                f"kvikio cannot open the swap file {swap.path} ({type(exc).__name__}: {exc}). Check that the "
                "filesystem allows O_DIRECT or set KVIKIO_COMPAT_MODE=ON, or use the host route for this directory."
            ) from exc
        opened = os.fstat(handle.fileno())
        ours = os.fstat(swap.fd)
        if (opened.st_dev, opened.st_ino) != (ours.st_dev, ours.st_ino):
            handle.close()
            raise RatelConfigError(
                f"The swap file {swap.path} was replaced between its creation and kvikio opening it; another process "
                "is writing into the swap directory. Give this run a directory of its own."
            )
        return handle

    @property
    def gds(self) -> bool:
        """Whether kvikio uses GPUDirect Storage (cuFile); ``False`` on its compatibility path through host memory.

        kvikio may still fall back to the compatibility path for a single file when cuFile refuses it (``AUTO``).
        """
        return self._gds

    @property
    def direct(self) -> bool:
        """Whether data goes between the drive and device memory without passing through host memory (:attr:`gds`)."""
        return self._gds

    def write(self, key: str, tensor: torch.Tensor, *, ready: Any = None, urgent: bool = False
              ) -> concurrent.futures.Future[None]:
        """Start writing the device tensor ``tensor`` as ``key``; an unknown key is reserved with its size.

        Args:
            key: Name of the tensor.
            tensor: A contiguous tensor on the store's device; keep it alive and unchanged until the future is done.
            ready: A CUDA event after which ``tensor`` holds the value to store. ``None``: everything queued so far on
                the current stream of ``tensor``'s device.
            urgent: Run before every request that is not.

        Returns:
            A future that resolves to ``None`` once every byte is written, or raises :class:`RatelStoreError`.

        Raises:
            ValueError: If ``tensor`` is not a contiguous tensor on the store's device, or its size differs from the
                key's.
            RuntimeError: If the store is closed.
        """
        return self._submit(key, tensor, is_write=True, ready=ready, urgent=urgent)

    def read(self, key: str, out: torch.Tensor, *, ready: Any = None, urgent: bool = False
             ) -> concurrent.futures.Future[torch.Tensor]:
        """Start reading ``key`` into the device tensor ``out``.

        Args:
            key: Name of a reserved tensor.
            out: A contiguous tensor on the store's device; keep it alive and do not use its contents until the
                future is done.
            ready: A CUDA event after which nothing uses ``out``'s memory any more. ``None``: everything queued so far
                on the current stream of ``out``'s device.
            urgent: Run before every request that is not.

        Returns:
            A future that resolves to ``out`` once it is filled, or raises :class:`RatelStoreError`.

        Raises:
            KeyError: If ``key`` was never reserved or written.
            ValueError: If ``out`` is not a contiguous tensor on the store's device, or its size differs from the key's.
            RuntimeError: If the store is closed.
        """
        return self._submit(key, out, is_write=False, ready=ready, urgent=urgent)

    def _submit(
        self, key: str, tensor: torch.Tensor, *, is_write: bool, ready: Any = None, urgent: bool = False
    ) -> concurrent.futures.Future:
        self._check_tensor(key, tensor)
        if ready is None and tensor.is_cuda:
            # Recording an event does not block the host; the I/O thread waits for it instead.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        return super()._submit(key, tensor, is_write=is_write, ready=ready, urgent=urgent)

    def _check_tensor(self, key: str, tensor: torch.Tensor) -> None:
        if tensor.device.type != self._device_type:
            raise ValueError(f"GdsStore moves {self._device_type} tensors; key {key!r} got one on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"GdsStore needs a contiguous tensor for key {key!r}")

    def _request(self, key: str, is_write: bool, tensor: torch.Tensor, nbytes: int, ready: Any = None) -> Request:
        return _DeviceRequest(key, is_write, tensor, ready)

    def _transfer_chunk(self, request: Request, chunk: Chunk) -> int | None:
        assert isinstance(request, _DeviceRequest)
        if request.ready is not None:
            request.ready.synchronize()
        flat = request.flat
        if flat.is_cuda and getattr(self._local, "device", None) != flat.device.index:
            # kvikio's raw calls use the calling thread's current CUDA context; a fresh I/O thread has none.
            torch.cuda.set_device(flat.device)
            self._local.device = flat.device.index
        view = flat[chunk.key_offset : chunk.key_offset + chunk.length]
        checksum = None
        if self.verify and request.is_write:
            checksum = self._checksum(view)
        self._move_device_chunk(request, chunk, view)
        if self.verify and not request.is_write:
            checksum = self._checksum(view)
        return checksum

    def _checksum(self, data: torch.Tensor) -> int:
        """:func:`~lightning_ratel.runtime.checksum.tensor_checksum` of ``data`` on its device.

        On CUDA it runs on a stream of this I/O thread's own: the legacy default stream would wait for (and hold up)
        the training streams.
        """
        if not data.is_cuda:
            return tensor_checksum(data)
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(data.device)
        with torch.cuda.stream(stream):
            return tensor_checksum(data)

    def _move_device_chunk(self, request: _DeviceRequest, chunk: Chunk, view: torch.Tensor) -> None:
        swap = self.swap_files[chunk.file]
        handle = self._handles[chunk.file]
        call: Callable[..., int] = handle.raw_write if request.is_write else handle.raw_read
        operation = "write" if request.is_write else "read"
        done = 0
        while done < chunk.length:
            position = chunk.file_offset + done
            try:
                count = call(view[done:], size=chunk.length - done, file_offset=position)
            except Exception as exc:  # kvikio raises RuntimeError for cuFile and POSIX failures (errno only in text)
                code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
                raise RatelStoreError(
                    code,
                    f"{operation} of key {request.key!r} through kvikio failed in {swap.path} at offset {position}: "
                    f"{exc}",
                    str(swap.path),
                ) from exc
            if count <= 0:
                raise RatelStoreError(
                    errno.EIO,
                    f"{operation} of key {request.key!r} through kvikio stopped short in {swap.path} at offset "
                    f"{position}: {chunk.length - done} of {chunk.length} bytes not transferred",
                    str(swap.path),
                )
            done += count

    def _release(self) -> None:
        try:
            # Waits for the I/O threads first, so no transfer still uses a handle closed below.
            super()._release()
        finally:
            handles, self._handles = self._handles, []
            for handle in handles:
                handle.close()


@dataclass(frozen=True)
class DeviceSsdBandwidth:
    """Bytes/s between device memory and the swap directories, by each route.

    Attributes:
        kvikio_read: SSD -> device through :class:`GdsStore`.
        kvikio_write: device -> SSD through :class:`GdsStore`.
        host_read: SSD -> pinned host buffer (:class:`~lightning_ratel.runtime.storage.TensorStore`) -> device.
        host_write: device -> pinned host buffer -> SSD.
        gds: Whether kvikio used GPUDirect Storage (``False``: its compatibility path).
    """

    kvikio_read: float
    kvikio_write: float
    host_read: float
    host_write: float
    gds: bool

    def prefer_kvikio(self) -> bool:
        """Whether a tensor goes out to the SSD and back in less time by kvikio than through pinned host memory."""
        kvikio = 1 / self.kvikio_read + 1 / self.kvikio_write
        host = 1 / self.host_read + 1 / self.host_write
        return kvikio < host

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return asdict(self)


def measure(
    paths: Sequence[str | os.PathLike[str]],
    device: str | torch.device = "cuda",
    *,
    nbytes: int = 64 << 20,
    repeats: int = 2,
    name: str = "ratel-gds-probe",
) -> DeviceSsdBandwidth:
    """Time one device buffer going to the swap directories and back, by kvikio and by the pinned-host route.

    The host route is what the activation cache does without kvikio: a copy into a page-aligned pinned buffer, then a
    :class:`~lightning_ratel.runtime.storage.TensorStore` write (and the reverse), one after the other. Each figure is
    the best of ``repeats`` after one untimed transfer that allocates the file blocks.

    Args:
        paths: The swap directories.
        device: Where the buffer lives.
        nbytes: Size of the buffer.
        repeats: Timed transfers per figure.
        name: Base name of the scratch stores (removed afterwards).

    Returns:
        Both routes' read and write bandwidths.

    Raises:
        RatelConfigError: If kvikio is missing or a directory cannot hold the scratch files.
        RatelStoreError: If a transfer fails.
    """
    device = torch.device(device)
    buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)

    def settle() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with GdsStore(paths, name=name, device=device.type) as store:
        store.reserve("probe", nbytes)
        store.preallocate()
        store.write("probe", buffer).result()
        gds = store.gds
        kvikio_write = best_time(lambda: store.write("probe", buffer).result(), repeats)
        kvikio_read = best_time(lambda: store.read("probe", buffer).result(), repeats)

    staging = aligned_empty(nbytes, torch.uint8, pin=device.type == "cuda")

    with TensorStore(paths, name=f"{name}-host") as host_store:

        def host_write() -> None:
            staging.copy_(buffer)
            settle()
            host_store.write("probe", staging).result()

        def host_read() -> None:
            host_store.read("probe", staging).result()
            buffer.copy_(staging, non_blocking=True)
            settle()

        host_store.reserve("probe", nbytes)
        host_store.preallocate()
        host_write()
        write = best_time(host_write, repeats)
        read = best_time(host_read, repeats)
    return DeviceSsdBandwidth(
        kvikio_read=nbytes / kvikio_read,
        kvikio_write=nbytes / kvikio_write,
        host_read=nbytes / read,
        host_write=nbytes / write,
        gds=gds,
    )
