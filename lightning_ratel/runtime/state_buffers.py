"""Host buffer sets for the optimizer states in flight, and the reads ahead that fill them before gradients arrive.

An update needs a shard's fp32 master and moments in host memory. A fixed number of buffer sets, allocated once,
cycle through reading, updating and writing back. During the boundary micro-batch of an accumulation window, every
free set is filled ahead with the states of the shards expected next, in the order the previous step's updates ran,
so an update starts as soon as its last gradient is in. Without that, the shards backward finishes last (the first
block and the embedding, which the next forward needs first) would each wait for a disk read after backward.

Reads ahead happen only between the start of a boundary micro-batch and the step's schedule, so nothing else writes
those states meanwhile; a shard whose previous write-back is still landing is read only once it has landed. Worker
thread only (a write-back's completion comes back to the worker as a job).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from lightning_ratel.runtime.generic import GenericUpdate
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.runtime.ledger import StepLedger
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.timeline import Timeline
from lightning_ratel.runtime.units import Shard
from lightning_ratel.sizes import round_up

BUFFER_SETS = 3
"""State buffer sets kept by default: one reading ahead, one computing, one writing back."""


class StateBufferSet:
    """Host memory for one shard's master, optimizer state and (when compute copies are read from the store) new
    compute copy, sized for the largest shard.

    Args:
        numel: elements of the largest shard (Adam moments; 0 for another optimizer).
        master_numel: elements of the largest shard whose master is not the host cache's compute copy.
        compute_bytes: bytes of the largest 16-bit compute copy written to the store (0: none is).
        state_bytes: bytes of the largest state record of an optimizer other than AdamW/Adam (0 for those).
    """

    def __init__(self, numel: int, master_numel: int, compute_bytes: int, state_bytes: int = 0) -> None:
        self.master = aligned_empty(master_numel, torch.float32, huge=True)
        self.exp_avg = aligned_empty(numel, torch.float32, huge=True)
        self.exp_avg_sq = aligned_empty(numel, torch.float32, huge=True)
        self.state = aligned_empty(state_bytes, torch.uint8, huge=True)
        # Whole pages, so any compute dtype can view it.
        pages = round_up(compute_bytes, ALIGNMENT)
        self.compute = aligned_empty(pages, torch.uint8, huge=True) if compute_bytes else None

    @property
    def nbytes(self) -> int:
        # The master buffer is empty where every master lives in the host cache.
        states = self.master.numel() + self.exp_avg.numel() + self.exp_avg_sq.numel()
        return 4 * states + self.state.numel() + (self.compute.numel() if self.compute is not None else 0)


Loaded = tuple[StateBufferSet, list[Future]]
"""A buffer set and the reads filling it."""


class StateBuffers:
    """The buffer sets, the reads ahead, and each shard's last write-back.

    Args:
        shards: every shard the optimizer holds, in the order of their units' forward.
        store: the swap store holding masters and moments.
        ledger: which version of each shard a read takes (the latest).
        timeline: where reads ahead are recorded.
        depth: buffer sets.
        compute_on_store: updates write 16-bit compute copies to the store (each set gets room for one).
        generic: the state layout of an optimizer other than AdamW/Adam (a state record per shard instead of
            moments), ``None`` for those.
    """

    def __init__(self, shards: Sequence[Shard], store: TensorStore, ledger: StepLedger, timeline: Timeline,
                 depth: int = BUFFER_SETS, compute_on_store: bool = False,
                 generic: GenericUpdate | None = None) -> None:
        self.store = store
        self.ledger = ledger
        self.timeline = timeline
        self.generic = generic
        largest = max((s.numel for s in shards), default=1) if generic is None else 0
        largest_master = max((s.numel for s in shards if not s.master_in_host), default=0)
        compute_bytes = max((s.numel * s.dtype.itemsize for s in shards
                             if compute_on_store and s.dtype != torch.float32), default=0)
        state_bytes = max((generic.nbytes(s) for s in shards), default=0) if generic is not None else 0
        self.free = [StateBufferSet(largest, largest_master, compute_bytes, state_bytes) for _ in range(depth)]
        self.nbytes = sum(b.nbytes for b in self.free)
        self.ahead: dict[int, Loaded] = {}
        self.reading_ahead = False
        # The order the last step's updates ran in (backward's order), and this step's so far.
        self._order: list[Shard] = list(reversed(shards))
        self._ran: list[Shard] = []
        self.writes_pending = 0
        self._last_write: dict[int, Future] = {}

    def start_micro_batch(self, boundary: bool) -> None:
        """Drop reads ahead; on a boundary micro-batch, read ahead in the order the last step's updates ran."""
        self.drop_ahead()
        self.reading_ahead = boundary
        if boundary and self._ran:
            ran = {s.index for s in self._ran}
            self._order = self._ran + [s for s in self._order if s.index not in ran]
            self._ran = []

    def queued(self, shard: Shard) -> None:
        """An update of ``shard`` was queued: next step reads ahead in this order."""
        self._ran.append(shard)

    def forget_order(self) -> None:
        """The step was abandoned: its updates say nothing about the next step's order."""
        self._ran = []

    def take(self, shard: Shard) -> Loaded | None:
        """A buffer set holding (or being filled with) ``shard``'s latest state, or ``None`` while none is free."""
        loaded = self.ahead.pop(shard.index, None)
        if loaded is not None:
            return loaded
        if not self.free and not self._evict_ahead():
            return None
        buffers = self.free.pop()
        return buffers, self.read(shard, buffers)

    def read(self, shard: Shard, buffers: StateBufferSet) -> list[Future]:
        """Start reading ``shard``'s latest state into ``buffers`` (after its last write-back has landed)."""
        self.wait_written(shard)
        n = shard.numel
        version = self.ledger.latest(shard)
        reads = [] if shard.master_in_host else [self.store.read(shard.key("master", version.slot), buffers.master[:n])]
        if version.moments and self.generic is not None:
            nbytes = self.generic.nbytes(shard)
            if nbytes:
                reads.append(self.store.read(shard.key("state", version.slot), buffers.state[:nbytes]))
        elif version.moments:
            reads.append(self.store.read(shard.key("exp_avg", version.slot), buffers.exp_avg[:n]))
            reads.append(self.store.read(shard.key("exp_avg_sq", version.slot), buffers.exp_avg_sq[:n]))
        return reads

    def read_ahead(self, skip: Callable[[Shard], bool]) -> None:
        """Fill free buffer sets with the states of the shards expected next, in last step's order, except those
        ``skip`` names (a shard whose update is scheduled or pending would be read before it changes)."""
        if not self.reading_ahead:
            return
        for shard in self._order:
            if not self.free:
                return
            if skip(shard) or shard.index in self.ahead:
                continue
            last = self._last_write.get(shard.index)
            if last is not None and not last.done():
                # Its previous write-back is still landing; later shards must not take the buffer it will need.
                return
            buffers = self.free.pop()
            self.timeline.record(f"read_ahead:{shard.index}")
            self.ahead[shard.index] = (buffers, self.read(shard, buffers))

    def stop_reading_ahead(self, keep: Callable[[int], bool]) -> None:
        """Every update of the step is queued: drop the states read ahead for shards ``keep`` does not name."""
        self.reading_ahead = False
        for index in [i for i in self.ahead if not keep(i)]:
            self._release_ahead(index)

    def drop_ahead(self) -> None:
        for index in list(self.ahead):
            self._release_ahead(index)

    def give_back(self, loaded: Loaded) -> None:
        """Return a buffer set whose update will not run, once its reads stop writing it."""
        buffers, reads = loaded
        for read in reads:
            read.exception()
        self.free.append(buffers)

    def writing(self, shard: Shard, done: Future) -> None:
        """A write-back of ``shard`` from a buffer set started; :meth:`written` hands the set back."""
        self.writes_pending += 1
        self._last_write[shard.index] = done

    def written(self, buffers: StateBufferSet) -> None:
        """A write-back finished (or failed): its buffer set is free again."""
        self.free.append(buffers)
        self.writes_pending -= 1

    def wait_written(self, shard: Shard) -> None:
        """Wait until ``shard``'s last write-back has landed (raising its error, if any)."""
        last = self._last_write.get(shard.index)
        if last is not None:
            last.result()

    def settle(self, shard: Shard) -> None:
        """Wait until ``shard``'s last write-back has ended, whatever its outcome."""
        last = self._last_write.get(shard.index)
        if last is not None:
            last.exception()

    def write_error(self) -> BaseException | None:
        """The error of a finished write-back, if one failed."""
        for last in self._last_write.values():
            if last.done() and last.exception() is not None:
                return last.exception()
        return None

    def release_memory(self) -> None:
        """Free every buffer set (no update will run any more)."""
        self.free.clear()
        self.ahead.clear()
        self.nbytes = 0

    def _evict_ahead(self) -> bool:
        """A ready shard needs a buffer set and none will come back from a write: free the read-ahead expected
        last. Returns whether one was freed."""
        if self.writes_pending or not self.ahead:
            return False
        position = {s.index: i for i, s in enumerate(self._order)}
        index = max(self.ahead, key=lambda i: position.get(i, len(position)))
        self._release_ahead(index)
        return True

    def _release_ahead(self, index: int) -> None:
        # The buffers are reused only once the reads stop writing them; a read error does not matter, the data is
        # never used.
        self.give_back(self.ahead.pop(index))
