"""Reusable page-aligned host buffers.

Fresh host memory is slow to touch the first time (the kernel maps and zeroes every page), and a model larger than
host memory needs its transient buffers (gradients of one block, one block's parameters) bounded anyway. A
:class:`BufferPool` hands out buffers and takes them back, so the process touches new memory only while the number
of buffers in use grows, and its footprint is the high-water mark of what was in use at once.
"""

from __future__ import annotations

import threading

import torch

from lightning_ratel.runtime.storage import ALIGNMENT, aligned_empty
from lightning_ratel.sizes import round_up


class BufferPool:
    """Page-aligned host buffers handed out by size and reused after :meth:`give`.

    A request takes the smallest free buffer that holds it, unless that buffer is more than twice the request (a
    small tensor must not tie up a large buffer); otherwise a new buffer of exactly the requested size (rounded up
    to 4096 bytes) is allocated. Buffers are never freed before the pool is, so its size only grows. Thread-safe.

    Args:
        pin: page-lock the buffers (for asynchronous copies to a CUDA device); ignored without CUDA.
    """

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.nbytes_in_use = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements on a 4096-byte boundary, with undefined contents."""
        need = round_up(max(numel * dtype.itemsize, 1), ALIGNMENT)
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if need <= b.numel() <= 2 * need]
            if fitting:
                raw = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            else:
                raw = aligned_empty(need, torch.uint8, pin=self.pin, huge=True)
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
