"""Reusable page-aligned host buffers.

Fresh host memory is slow to touch the first time (the kernel maps and zeroes every page), and a model larger than
host memory needs its transient buffers (gradients of one block, one block's parameters) bounded anyway. A pool hands
out buffers and takes them back, so the process touches new memory only while the number of buffers in use grows,
and its footprint is the high-water mark of what was in use at once.

:class:`BufferPool` lends buffers that its user gives back explicitly. :class:`HostPool` is the one source of host
memory that the device copies to or from (pinned on CUDA): its buffers come back by themselves once nothing uses them
any more, neither a tensor on the host nor a device copy still in flight.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.sizes import round_up

_POISON = 0xFF
"""Byte that poisoned buffers are filled with: all-ones is NaN in every floating-point dtype."""


class Offer(Protocol):
    """What may go on reading a buffer's bytes after its owner gave it back (a store offering them to later reads
    of the same key, see :meth:`~lightning_ratel.runtime.storage.TensorStore.read`'s ``share``)."""

    def offered(self) -> bool:
        """Whether the bytes are still offered (worth keeping)."""

    def withdraw(self) -> Iterable[Future]:
        """Stop offering them; returns the futures of reads still copying from them."""


def _fits(need: int, size: int) -> bool:
    """Whether a free buffer of ``size`` bytes serves a request of ``need``: a small request must not tie up a large
    buffer."""
    return need <= size <= 2 * need


class BufferPool:
    """Page-aligned host buffers handed out by size and reused after :meth:`give`.

    A request takes the smallest free buffer that holds it, unless that buffer is more than twice the request (a
    small tensor must not tie up a large buffer); otherwise a new buffer of exactly the requested size (rounded up
    to 4096 bytes) is allocated. Buffers are never freed before the pool is, so its size only grows. Thread-safe.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.nbytes_in_use = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements on a 4096-byte boundary, with undefined contents."""
        need = round_up(max(numel * dtype.itemsize, 1), ALIGNMENT)
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if _fits(need, b.numel())]
            if fitting:
                raw = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            else:
                raw = aligned_empty(need, torch.uint8, huge=True)
                self.nbytes += raw.numel()
            view = raw.view(dtype)[:numel]
            self._lent[view.data_ptr()] = raw
            self.nbytes_in_use += raw.numel()
        return view

    def clear(self) -> None:
        """Free the buffers not in use."""
        with self._lock:
            self.nbytes -= sum(b.numel() for b in self._free)
            self._free.clear()

    def give(self, tensor: torch.Tensor) -> None:
        """Return a tensor from :meth:`take`; the caller must not use it afterwards."""
        with self._lock:
            raw = self._lent.pop(tensor.data_ptr())
            self.nbytes_in_use -= raw.numel()
            self._free.append(raw)


@dataclass(eq=False)
class _Lease:
    """Memory lent out as one tensor storage.

    Attributes:
        raw: the memory (a whole buffer of the pool, or a dedicated allocation).
        nbytes: bytes lent, a prefix of ``raw``.
        pooled: the memory goes back to the free list (otherwise it is released).
        uses: completion signals (``query()``) of device copies and I/O that read or write the memory.
        given: handed back by its owner before its tensor died (the tensor's death is then no news).
        offer: withdrawn before the memory is reused or freed (see :meth:`HostPool.give`).
    """

    raw: torch.Tensor
    nbytes: int
    pooled: bool
    uses: list[Any] = field(default_factory=list)
    given: bool = False
    offer: Offer | None = None

    def idle(self) -> bool:
        """Whether every recorded device copy has completed (drops those that have)."""
        self.uses = [u for u in self.uses if not u.query()]
        return not self.uses


class _Finished:
    """A future as a completion signal."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()


class HostPool:
    """Host memory for transfers between the host and the device, allocated at exact sizes and reused.

    Every tensor it hands out has a storage of its own over the pool's memory, so the memory is known to be unused
    exactly when that storage dies, whichever view of it goes last (an autograd saved tensor, a gradient the optimizer
    has folded in, a staging buffer a store write has finished with). A device copy that still reads or writes the
    memory is recorded against it (:meth:`record`, done by :class:`~lightning_ratel.runtime.device.Device` for every
    copy), and the memory is reused only once that copy's completion signal says so, checked lazily when memory is
    next asked for: freeing never blocks.

    :meth:`take` lends a buffer from the pool, which keeps it for the next request of a fitting size (the smallest free
    buffer that holds the request and is at most twice its size; otherwise a new one of exactly the request, rounded
    up to 4096 bytes). :meth:`allocate` makes a dedicated allocation of exactly the requested size, released when its
    tensor dies (memory held for the whole run, such as the host cache). :attr:`nbytes` and :attr:`dedicated_nbytes`
    are exactly the bytes allocated, so with ``pin`` they are exactly the bytes page-locked.

    Thread-safe: tensors may die on any thread (a store's I/O thread, the optimizer's worker); that only queues their
    memory, and the pool takes it back under its lock on its next call.

    A buffer given back with an :class:`Offer` (see :meth:`give`) keeps its bytes while it is free, for the reads
    its offer serves. A request takes a free buffer whose bytes are no longer offered first; failing that, it makes a
    new one while the free buffers still offered come to at most :attr:`keep_limit` bytes, and only then withdraws
    the offer of the one given back longest ago.

    Args:
        pin: page-lock the memory (``cudaHostRegister``) so device copies from and to it run asynchronously; ignored
            without CUDA.
        poison: fill every buffer with NaN bytes when it is handed out and when it comes back (unless offered), so
            that a read of memory nobody wrote, or of memory after its release, shows up (the stream simulation of
            :class:`~lightning_ratel.runtime.device.Device`).

    Attributes:
        keep_limit: bytes of free buffers still offered that the pool may keep, allocating anew rather than reuse
            them (0: reuse them, the least recently given back first).
    """

    def __init__(self, pin: bool = False, poison: bool = False) -> None:
        self.pin = pin
        self.poison = poison
        self.keep_limit = 0
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        # The offers of free buffers, by address (see give).
        self._offers: dict[int, Offer] = {}
        self._lent: dict[int, _Lease] = {}
        self._returned: deque[_Lease] = deque()
        self._pending: list[_Lease] = []
        self._nbytes = 0
        self._in_use = 0
        self._dedicated = 0

    # ------------------------------------------------------------------ lending

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements on a 4096-byte boundary, with undefined contents (NaN when poisoning),
        whose memory comes back to the pool once its storage dies and its recorded copies have completed."""
        need = round_up(max(numel * dtype.itemsize, 1), ALIGNMENT)
        with self._lock:
            self._reclaim()
            index = self._choose(need)
            if index is not None:
                raw = self._free.pop(index)
                offer = self._offers.pop(raw.data_ptr(), None)
            else:
                raw = self._allocate(need)
                self._nbytes += need
                offer = None
            self._in_use += raw.numel()
        if offer is not None:
            # Outside the lock: the copies run on other threads, which may give memory back meanwhile.
            concurrent.futures.wait(list(offer.withdraw()))
        with self._lock:
            return self._lend(_Lease(raw, need, pooled=True)).view(dtype)[:numel]

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements in memory of its own (exactly that size, rounded up to 4096 bytes),
        released once its storage dies and its recorded copies have completed."""
        need = round_up(max(numel * dtype.itemsize, 1), ALIGNMENT)
        raw = self._allocate(need)
        with self._lock:
            self._reclaim()
            self._dedicated += need
            return self._lend(_Lease(raw, need, pooled=False)).view(dtype)[:numel]

    def record(self, tensor: torch.Tensor, use: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``use`` (an object with ``query()``, a device copy's completion
        signal) has completed; a tensor from elsewhere is ignored."""
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return
        with self._lock:
            lease = self._lent.get(tensor.untyped_storage().data_ptr())
            if lease is not None:
                lease.idle()
                lease.uses.append(use)

    def give(self, tensor: torch.Tensor, after: Iterable[Future] = (), offer: Offer | None = None) -> None:
        """Hand back a buffer from :meth:`take` while references to it may still exist (the futures of the reads
        into it, a request still queued): its owner promises that nothing uses the memory any more, except ``after``
        (I/O still writing it), the copies recorded against it, whose completion the reuse waits for, and ``offer``.

        Args:
            tensor: the buffer.
            after: futures of I/O still writing the memory.
            offer: what may go on reading the bytes while the buffer is free; withdrawn right before the memory is
                reused or freed, which then waits for the reads still copying. Until then the bytes stay as they
                are. ``offered()`` must not call into this pool.
        """
        with self._lock:
            lease = self._lent.pop(tensor.untyped_storage().data_ptr())
            lease.given = True
            lease.uses.extend(_Finished(f) for f in after)
            lease.offer = offer
            self._pending.append(lease)

    def clear(self) -> None:
        """Free the buffers that are not in use (pinned memory is unregistered as it goes)."""
        with self._lock:
            self._reclaim()
            freed, self._free = self._free, []
            offers, self._offers = list(self._offers.values()), {}
            self._nbytes -= sum(b.numel() for b in freed)
        # The memory is freed when `freed` goes, after the reads still copying from it.
        concurrent.futures.wait([future for offer in offers for future in offer.withdraw()])

    # ------------------------------------------------------------------ accounting

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's buffers, free or lent (dedicated allocations not included)."""
        with self._lock:
            self._reclaim()
            return self._nbytes

    @property
    def nbytes_in_use(self) -> int:
        """Bytes of the pool's buffers that are lent out or still used by a device copy."""
        with self._lock:
            self._reclaim()
            return self._in_use

    @property
    def dedicated_nbytes(self) -> int:
        """Bytes of the dedicated allocations alive (or still used by a device copy)."""
        with self._lock:
            self._reclaim()
            return self._dedicated

    # ------------------------------------------------------------------ internals

    def _choose(self, need: int) -> int | None:
        """The index in the free list of the buffer to serve a request of ``need`` bytes, ``None`` for a new one
        (under the lock; see the class docstring). The free list is in the order buffers came back."""
        fitting = [i for i, b in enumerate(self._free) if _fits(need, b.numel())]
        if not fitting:
            return None
        # Each buffer asked at most once: an offer asks its store, under the store's lock.
        asked = {i: self._offered(self._free[i]) for i in fitting}
        unwanted = [i for i in fitting if not asked[i]]
        if unwanted:
            return min(unwanted, key=lambda i: self._free[i].numel())
        offered = [asked[i] if i in asked else self._offered(b) for i, b in enumerate(self._free)]
        kept = sum(b.numel() for b, o in zip(self._free, offered) if o)
        if kept + need <= self.keep_limit:
            return None
        return min(fitting, key=lambda i: self._free[i].numel())

    def _offered(self, raw: torch.Tensor) -> bool:
        offer = self._offers.get(raw.data_ptr())
        return offer is not None and offer.offered()

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, torch.uint8, pin=self.pin, huge=True)

    def _lend(self, lease: _Lease) -> torch.Tensor:
        """A tensor over ``lease``'s memory with a storage of its own, whose death hands the lease back."""
        if self.poison:
            _poison(lease.raw[: lease.nbytes])
        # torch.frombuffer keeps the exporting object alive for as long as the storage lives, so the end of this
        # object's life is the end of the storage's: the memory is no longer reachable from any tensor.
        owner = (ctypes.c_uint8 * lease.nbytes).from_address(lease.raw.data_ptr())
        # The array only points at the memory; the lease holds it (the mapping lives as long as `raw`). The finalizer
        # may run on any thread, maybe one inside this pool's lock, so it only queues the lease (deque.append is
        # atomic).
        finalizer = weakref.finalize(owner, self._returned.append, lease)
        finalizer.atexit = False
        self._lent[lease.raw.data_ptr()] = lease
        return torch.frombuffer(owner, dtype=torch.uint8)

    def _reclaim(self) -> None:
        """Take back the memory of tensors that died, once no device copy uses it (under the lock)."""
        while self._returned:
            lease = self._returned.popleft()
            if lease.given:
                continue
            del self._lent[lease.raw.data_ptr()]
            self._pending.append(lease)
        if not self._pending:
            return
        still = []
        for lease in self._pending:
            if not lease.idle():
                still.append(lease)
                continue
            if lease.pooled:
                if lease.offer is not None:
                    self._offers[lease.raw.data_ptr()] = lease.offer
                elif self.poison:
                    _poison(lease.raw)
                self._in_use -= lease.raw.numel()
                self._free.append(lease.raw)
            else:
                self._dedicated -= lease.nbytes
        self._pending = still


def _poison(buffer: torch.Tensor) -> None:
    # A buffer first allocated under inference mode (a validation pass) may be written only there.
    with torch.inference_mode():
        buffer.fill_(_POISON)
