"""Gradients on their way into the CPU optimizer: per-shard accumulation, and back-pressure on backward.

:class:`GradientAccumulator` keeps each shard's fp32 gradient of the current accumulation window in a host buffer
that the shard takes from a pool with its first gradient and gives back after its update, so gradient memory follows
the shards in flight rather than the model. It also counts which parameters delivered a gradient in the current
micro-batch, so the optimizer knows when a shard is complete. Worker thread only. With several ranks it holds the
shards its rank owns; reducing each micro-batch (``gradient_exchange="micro_batch"``,
:class:`~lightning_ratel.runtime.collectives.DataParallelAdam`) it receives each micro-batch's sum over the ranks, so
it is the only window of those shards on any rank.

:class:`GradientBudget` is shared by the thread handing gradients over (autograd's) and the worker: while the
gradients held exceed a budget and the worker has work that will release some, the handing thread waits, so backward
cannot run arbitrarily far ahead of the optimizer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from lightning_ratel.runtime.pool import BufferPool
from lightning_ratel.runtime.units import Shard


class GradientAccumulator:
    """Each shard's gradient of the accumulation window, in pooled fp32 host buffers.

    Args:
        shards: every shard the optimizer holds.
    """

    def __init__(self, shards: Sequence[Shard]) -> None:
        self.pool = BufferPool()
        self._grad: dict[int, torch.Tensor | None] = {s.index: None for s in shards}
        # Per parameter: a gradient is accumulated this window; one arrived in the current micro-batch.
        self._has: dict[int, list[bool]] = {s.index: [False] * len(s.params) for s in shards}
        self._seen: dict[int, list[bool]] = {s.index: [False] * len(s.params) for s in shards}
        self._arrived: dict[int, int] = {s.index: 0 for s in shards}

    def new_micro_batch(self) -> None:
        """Forget which parameters delivered in the last micro-batch (the window's sums stay)."""
        for index, seen in self._seen.items():
            self._seen[index] = [False] * len(seen)
            self._arrived[index] = 0

    def add(self, shard: Shard, position: int, grad: torch.Tensor, start: int | None = None) -> bool:
        """Accumulate the gradient of ``shard.params[position]``, or with ``start`` the flat part of it from that
        element on (the parts of a parameter arrive in order within a micro-batch, see
        :class:`~lightning_ratel.runtime.collectives._MicroBatchExchange`); returns whether every parameter of the
        shard has now delivered its whole gradient in this micro-batch."""
        index = shard.index
        buffer = self._grad[index]
        if buffer is None:
            buffer = self._grad[index] = self.pool.take(shard.numel, torch.float32)
        sp = shard.params[position]
        if start is None:
            view, last = sp.view(buffer), True
        else:
            view = buffer[sp.offset + start : sp.offset + start + grad.numel()]
            last = start + grad.numel() == sp.numel
        if self._has[index][position]:
            view.add_(grad)
        else:
            view.copy_(grad)
            # Set with the last part only: the parts before it in this micro-batch were copied, not added.
            self._has[index][position] = last
        if last and not self._seen[index][position]:
            self._seen[index][position] = True
            self._arrived[index] += 1
        return self._arrived[index] == len(shard.params)

    def grad(self, shard: Shard) -> torch.Tensor:
        """The shard's accumulated gradient (only where :meth:`holds` it)."""
        buffer = self._grad[shard.index]
        assert buffer is not None
        return buffer

    def holds(self, shard: Shard) -> bool:
        """Whether any parameter of ``shard`` has a gradient this window."""
        return any(self._has[shard.index])

    def with_grad(self, shard: Shard) -> list[int]:
        """Positions of the parameters of ``shard`` that have a gradient this window."""
        return [i for i, has in enumerate(self._has[shard.index]) if has]

    def views(self, shards: Sequence[Shard]) -> list[torch.Tensor]:
        """The gradients that arrived, in the optimizer's parameter order, as torch's clipping and unscaling see them
        (the rest of a pooled buffer holds whatever its last user left there)."""
        return [v for _, v in self.indexed_views(shards)]

    def indexed_views(self, shards: Sequence[Shard]) -> list[tuple[int, torch.Tensor]]:
        """:meth:`views`, each with its parameter's position in the optimizer's order."""
        views = []
        for shard in shards:
            buffer = self.grad(shard)
            views.extend((sp.index, sp.view(buffer)) for sp, has in zip(shard.params, self._has[shard.index]) if has)
        return sorted(views, key=lambda t: t[0])

    def clear(self, shard: Shard) -> None:
        """Drop the window's gradient of ``shard`` (used by an update, or discarded) and give its buffer back."""
        self._has[shard.index] = [False] * len(shard.params)
        buffer = self._grad[shard.index]
        if buffer is not None:
            self.pool.give(buffer)
            self._grad[shard.index] = None

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds."""
        return self.pool.nbytes

    def release_memory(self) -> None:
        self.pool.clear()


class GradientBudget:
    """How many gradient bytes are held, and a wait for room (the only state two threads share).

    Args:
        limit: bytes (pooled buffers in use plus gradients handed over and not yet taken in) above which
            :meth:`wait_for_room` waits; ``None`` never waits.
        in_use: the bytes of pooled buffers in use now.
    """

    def __init__(self, limit: int | None, in_use: Callable[[], int]) -> None:
        self.limit = limit
        self._in_use = in_use
        self._queued = 0
        self._pending_updates = 0
        self._keeping = False
        self._failed = False
        self._cond = threading.Condition()

    def wait_for_room(self, nbytes: int) -> None:
        """Count ``nbytes`` handed over, first waiting while the budget is exceeded and the worker has something that
        may release memory: pending updates (unless they keep their gradients), or gradients not taken in yet (which
        may complete a shard). Once neither is left nothing would release memory (deferred updates, accumulation), so
        it goes on over budget rather than wait forever."""
        with self._cond:
            if self.limit is not None:
                while (((self._pending_updates and not self._keeping) or self._queued) and not self._failed
                       and self._queued + self._in_use() + nbytes > self.limit):
                    self._cond.wait()
            self._queued += nbytes

    def taken(self, nbytes: int) -> None:
        """The worker took in a gradient of ``nbytes``."""
        with self._cond:
            self._queued -= nbytes
            self._cond.notify_all()

    def updates_queued(self, count: int) -> None:
        """``count`` updates were queued (negative: ran or dropped), which release gradient memory when they run."""
        with self._cond:
            self._pending_updates += count
            self._cond.notify_all()

    def keeping(self, keep: bool) -> None:
        """Whether updates keep their gradients (a speculative step not resolved yet): then pending updates release
        no memory, and :meth:`wait_for_room` does not wait for them."""
        with self._cond:
            self._keeping = keep
            self._cond.notify_all()

    def fail(self) -> None:
        """The worker failed: nobody may wait for memory it will not release."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()
