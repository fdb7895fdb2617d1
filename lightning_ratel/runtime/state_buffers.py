"""Host buffer sets for the optimizer states in flight, and the reads ahead that fill them before gradients arrive.

An update needs a shard's fp32 master and moments in host memory. A fixed number of buffer sets, allocated once,
cycle through reading, updating and writing back. During the boundary micro-batch of an accumulation window, every
free set is filled ahead with the states of the shards expected next, in the order the previous step's updates ran,
so an update starts as soon as its last gradient is in. Without that, the shards backward finishes last (the first
block and the embedding, which the next forward needs first) would each wait for a disk read after backward.

The sets are counted in units of a set sized for the largest shard (``depth``). Data-parallel ranks of one node
split one process's sets between them, so a rank may get a fraction: its whole sets, and a smaller one for the shards
that fit in the rest (a set is taken by the smallest free one that holds the shard). Every rank keeps at least one
whole set, so every shard's update can run.

A master read into a set is offered to other reads of its key (the store's ``share``) until the update changes it:
with compute copies on the store, an fp32 master is also the compute copy the pager reads for that block's backward
(and forward), which then copies it instead of reading the drive again, or the other way round. The new master and
compute copy an update writes back from a set are offered in turn until the set is read into again: updates that run
after backward run just ahead of the next forward, whose page-ins then copy them rather than read them back.

Reads ahead happen only between the start of a boundary micro-batch and the step's schedule, so nothing else writes
those states meanwhile; a shard whose previous write-back is still landing is read only once it has landed. Worker
thread only (a write-back's completion comes back to the worker as a job).

A shard whose states live in host memory (:func:`in_place`) needs no buffer set: its "buffers" are the memory of the
state slot its update writes (:class:`SlotViews`), and its write-back copies nothing. Under AdamW/Adam the "read" copies
nothing either: the views name the latest slot's states as the update's sources, and the kernel reads them there and
writes the other slot in the same pass (the latest slot is only read, so an update that does not commit leaves it as it
was). Another optimizer's step runs in place, so its read copies the latest slot into the views first. Such shards
take no set from the pool and are always read ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from lightning_ratel.runtime.generic import GenericUpdate
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.runtime.hoststore import TieredStore
from lightning_ratel.runtime.ledger import ShardVersion, StepLedger
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.timeline import Timeline
from lightning_ratel.runtime.units import Shard
from lightning_ratel.sizes import round_up

BUFFER_SETS = 3
"""The pipeline's state buffer sets: one reading ahead, one computing, one writing back. A run may keep more (the
layout's ``read_ahead_sets``), each reading one more shard's states ahead."""

Need = tuple[int, int, int, int]
"""What a shard's update takes of a buffer set: moment elements, master elements, compute copy bytes, state record
bytes (the arguments of :class:`StateBufferSet`)."""


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
        self.capacity: Need = (numel, master_numel, compute_bytes, state_bytes)
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

    def holds(self, need: Need) -> bool:
        """Whether a shard needing ``need`` fits in this set."""
        return all(n <= c for n, c in zip(need, self.capacity))


def shard_need(shard: Shard, compute_on_store: bool, generic: GenericUpdate | None) -> Need:
    """What ``shard``'s update takes of a buffer set (see :class:`StateBuffers` for the arguments)."""
    numel = shard.numel if generic is None else 0
    master = 0 if shard.master_in_host else shard.numel
    compute = shard.numel * shard.dtype.itemsize if compute_on_store and shard.dtype != torch.float32 else 0
    return numel, master, compute, generic.nbytes(shard) if generic is not None else 0


def set_bytes(need: Need) -> int:
    """Host bytes of a :class:`StateBufferSet` of capacity ``need``."""
    numel, master_numel, compute_bytes, state_bytes = need
    return 4 * (master_numel + 2 * numel) + round_up(compute_bytes, ALIGNMENT) + state_bytes


def set_capacities(needs: Sequence[Need], depth: float) -> list[Need]:
    """The capacities of the buffer sets that ``depth`` sets' worth of host memory buys, for shards needing
    ``needs``: ``int(depth)`` sets (at least one) that hold any of them, and for a fraction left, one set holding the
    shards that fit in those bytes together (none where not even the smallest does).

    Args:
        needs: what each shard's update takes of a set (any order; at least one).
        depth: host bytes of the sets, in sets that hold the largest shard.
    """
    whole: Need = tuple(max(column) for column in zip(*needs))  # type: ignore[assignment]
    capacities = [whole] * max(1, int(depth))
    fraction = depth - int(depth) if depth > 1 else 0.0
    if not fraction:
        return capacities
    smaller: Need | None = None
    running: Need = (0, 0, 0, 0)
    for need in sorted(needs, key=set_bytes):
        running = tuple(map(max, running, need))  # type: ignore[assignment]
        if set_bytes(running) > fraction * set_bytes(whole):
            break
        smaller = running
    if smaller is not None:
        capacities.append(smaller)
    return capacities


class SlotViews:
    """A :class:`StateBufferSet` stand-in for a shard whose states live in host memory: views of the state slot
    ``slot`` its update writes, so the write-back copies nothing, and reading the latest version is one copy, or none
    where the update reads it in the other slot (:attr:`source`).

    Args:
        store: the run's tiered store (the views are of its host memory).
        shard: the shard.
        slot: the state slot the shard's next update writes.
        state_bytes: bytes of its state record under an optimizer other than AdamW/Adam (0 for one that keeps no
            state, such as SGD without momentum); ``None`` for AdamW/Adam, whose moments it views instead.
    """

    compute = None
    nbytes = 0

    def __init__(self, store: TieredStore, shard: Shard, slot: int, state_bytes: int | None) -> None:
        host = store.host
        self.slot = slot
        self.source: dict[str, torch.Tensor] = {}
        """The latest version's states (``"master"``, ``"exp_avg"``, ``"exp_avg_sq"``, flat, ``shard.numel``
        elements) that the update reads where they are, in the other slot, instead of from these views: set by
        :meth:`StateBuffers.read`. A state not named here is in the views already (read into them, or the zeros of
        moments never written), or is not in a slot at all (a master kept in the host cache)."""
        self.master = (torch.empty(0) if shard.master_in_host
                       else host.view(shard.key("master", slot), torch.float32))
        if state_bytes is not None:
            # A stateless optimizer's shard has no record in the store (the optimizer reserves none).
            self.state = (host.view(shard.key("state", slot), torch.uint8) if state_bytes
                          else torch.empty(0, dtype=torch.uint8))
            self.exp_avg = self.exp_avg_sq = torch.empty(0)
        else:
            self.state = torch.empty(0, dtype=torch.uint8)
            self.exp_avg = host.view(shard.key("exp_avg", slot), torch.float32)
            self.exp_avg_sq = host.view(shard.key("exp_avg_sq", slot), torch.float32)


def in_place(shard: Shard, compute_on_store: bool) -> bool:
    """Whether ``shard``'s update runs in place in its host-memory state slot (:class:`SlotViews`) rather than in a
    buffer set: its states live in host memory, and no staging buffer is needed for a compute copy bound for the
    store."""
    return shard.state_tier == "host" and not compute_on_store


Loaded = tuple[StateBufferSet | SlotViews, list[Future]]
"""A buffer set and the reads filling it."""


class StateBuffers:
    """The buffer sets, the reads ahead, and each shard's last write-back.

    Args:
        shards: every shard the optimizer holds, in the order of their units' forward.
        store: the swap store holding masters and moments.
        ledger: which version of each shard a read takes (the latest).
        timeline: where reads ahead are recorded.
        depth: host memory of the buffer sets, in sets that hold the largest shard; a fraction buys a smaller set
            (see :func:`set_capacities`).
        compute_on_store: updates write 16-bit compute copies to the store (each set gets room for one).
        generic: the state layout of an optimizer other than AdamW/Adam (a state record per shard instead of
            moments), ``None`` for those.
    """

    def __init__(self, shards: Sequence[Shard], store: TensorStore, ledger: StepLedger, timeline: Timeline,
                 depth: float = BUFFER_SETS, compute_on_store: bool = False,
                 generic: GenericUpdate | None = None) -> None:
        self.store = store
        self.ledger = ledger
        self.timeline = timeline
        self.generic = generic
        self.compute_on_store = compute_on_store
        needs = [self._need(s) for s in shards if not self._in_place(s)]
        self.free = [StateBufferSet(*capacity) for capacity in set_capacities(needs, depth)] if needs else []
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

    def _need(self, shard: Shard) -> Need:
        return shard_need(shard, self.compute_on_store, self.generic)

    def _in_place(self, shard: Shard) -> bool:
        return isinstance(self.store, TieredStore) and in_place(shard, self.compute_on_store)

    def _views(self, shard: Shard) -> SlotViews:
        assert isinstance(self.store, TieredStore)
        state_bytes = self.generic.nbytes(shard) if self.generic is not None else None
        return SlotViews(self.store, shard, 1 - self.ledger.latest(shard).slot, state_bytes)

    def take(self, shard: Shard, urgent: bool = False) -> Loaded | None:
        """A buffer set holding (or being filled with) ``shard``'s latest state, or ``None`` while none is free;
        ``urgent``: the reads it starts go before queued write-backs (see :meth:`read`)."""
        loaded = self.ahead.pop(shard.index, None)
        if loaded is not None:
            return loaded
        if self._in_place(shard):
            views = self._views(shard)
            return views, self.read(shard, views, urgent)
        buffers = self._free_set(shard)
        if buffers is None and self._evict_ahead(shard):
            buffers = self._free_set(shard)
        if buffers is None:
            return None
        return buffers, self.read(shard, buffers, urgent)

    def read(self, shard: Shard, buffers: StateBufferSet | SlotViews, urgent: bool = False) -> list[Future]:
        """Start reading ``shard``'s latest state into ``buffers`` (after its last write-back has landed);
        ``urgent`` reads run in the store's urgent lane, ahead of the write-backs queued."""
        self.wait_written(shard)
        # What the set's last update wrote is offered until now (see CpuAdam's write-back).
        self.unshare(buffers)
        n = shard.numel
        version = self.ledger.latest(shard)
        if isinstance(buffers, SlotViews) and self.generic is None:
            return self._sources(shard, buffers, version, urgent)
        # The master is offered to the pager's page-in of the same key until the update changes it (see unshare):
        # for an fp32 shard whose compute copy is on the store, it is the same bytes.
        reads = [] if shard.master_in_host else [
            self.store.read(shard.key("master", version.slot), buffers.master[:n], urgent=urgent, share=True)]
        if version.moments and self.generic is not None:
            nbytes = self.generic.nbytes(shard)
            if nbytes:
                reads.append(self.store.read(shard.key("state", version.slot), buffers.state[:nbytes], urgent=urgent))
        elif version.moments:
            reads.append(self.store.read(shard.key("exp_avg", version.slot), buffers.exp_avg[:n], urgent=urgent))
            reads.append(self.store.read(shard.key("exp_avg_sq", version.slot), buffers.exp_avg_sq[:n],
                                         urgent=urgent))
        return reads

    def _sources(self, shard: Shard, views: SlotViews, version: ShardVersion, urgent: bool) -> list[Future]:
        """Name the latest slot's states as the update's sources (see :attr:`SlotViews.source`) rather than copying
        them into ``views``: the AdamW kernel reads them there in its single pass. Its read of the master needs no
        sharing: the pager reads a host-tier shard's compute copy from the host cache, never a master from the store.
        Returns the reads still needed: only that of a master never written, which reads as zeros."""
        assert isinstance(self.store, TieredStore)
        host, n = self.store.host, shard.numel
        views.source = {}
        reads = []
        wanted = ([] if shard.master_in_host else ["master"]) + (["exp_avg", "exp_avg_sq"] if version.moments else [])
        for what in wanted:
            key = shard.key(what, version.slot)
            if host.written(key):
                views.source[what] = host.view(key, torch.float32)[:n]
            else:
                reads.append(self.store.read(key, getattr(views, what)[:n], urgent=urgent))
        return reads

    def read_ahead(self, skip: Callable[[Shard], bool]) -> None:
        """Fill free buffer sets with the states of the shards expected next, in last step's order, except those
        ``skip`` names (a shard whose update is scheduled or pending would be read before it changes)."""
        if not self.reading_ahead:
            return
        for shard in self._order:
            if skip(shard) or shard.index in self.ahead:
                continue
            if self._in_place(shard):
                self.timeline.record(f"read_ahead:{shard.index}")
                views = self._views(shard)
                self.ahead[shard.index] = (views, self.read(shard, views))
                continue
            buffers = self._smallest_free(shard)
            if buffers is None:
                return
            last = self._last_write.get(shard.index)
            if last is not None and not last.done():
                # Its previous write-back is still landing; later shards must not take the buffer it will need.
                return
            self.free.remove(buffers)
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
        """Return a buffer set whose update will not run, once its reads stop writing it (and reading from it)."""
        buffers, reads = loaded
        for read in reads:
            read.exception()
        self.unshare(buffers)
        if isinstance(buffers, StateBufferSet):
            self.free.append(buffers)

    def unshare(self, buffers: StateBufferSet | SlotViews) -> None:
        """Stop offering the master and compute copy ``buffers`` hold to other reads (see :meth:`read`), once those
        copying them are done: they are about to change."""
        if isinstance(buffers, StateBufferSet):
            offered = [buffers.master] if buffers.compute is None else [buffers.master, buffers.compute]
            for copy in [c for tensor in offered for c in self.store.unshare(tensor)]:
                copy.exception()

    def writing(self, shard: Shard, done: Future) -> None:
        """A write-back of ``shard`` from a buffer set started (``done``: all its writes); :meth:`written` hands the
        set back, which may come before ``done`` (a master written from the host cache does not hold the set)."""
        self.writes_pending += 1
        self._last_write[shard.index] = done

    def written(self, buffers: StateBufferSet | SlotViews) -> None:
        """A write-back finished (or failed): its buffer set is free again."""
        if isinstance(buffers, StateBufferSet):
            self.free.append(buffers)
        self.writes_pending -= 1

    def wait_written(self, shard: Shard) -> None:
        """Wait until ``shard``'s last write-back has landed (raising its error, if any)."""
        last = self._last_write.get(shard.index)
        if last is not None:
            last.result()

    def landing(self) -> list[Future]:
        """The write-backs still landing (their buffer sets may have come back already)."""
        return [last for last in self._last_write.values() if not last.done()]

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
        for buffers in [*self.free, *(loaded[0] for loaded in self.ahead.values())]:
            self.unshare(buffers)
        self.free.clear()
        self.ahead.clear()
        self.nbytes = 0

    def _smallest_free(self, shard: Shard) -> StateBufferSet | None:
        """The smallest free buffer set that holds ``shard``, if any."""
        need = self._need(shard)
        fitting = [b for b in self.free if b.holds(need)]
        return min(fitting, key=lambda b: b.nbytes) if fitting else None

    def _free_set(self, shard: Shard) -> StateBufferSet | None:
        """Take the smallest free buffer set that holds ``shard``, if any."""
        buffers = self._smallest_free(shard)
        if buffers is not None:
            self.free.remove(buffers)
        return buffers

    def _evict_ahead(self, shard: Shard) -> bool:
        """``shard`` is ready and needs a buffer set, and none will come back from a write: free the read-ahead
        expected last among those whose set holds it. Returns whether one was freed."""
        need = self._need(shard)
        pooled = [i for i, (buffers, _) in self.ahead.items()
                  if isinstance(buffers, StateBufferSet) and buffers.holds(need)]
        if self.writes_pending or not pooled:
            return False
        position = {s.index: i for i, s in enumerate(self._order)}
        index = max(pooled, key=lambda i: position.get(i, len(position)))
        self._release_ahead(index)
        return True

    def _release_ahead(self, index: int) -> None:
        # The buffers are reused only once the reads stop writing them; a read error does not matter, the data is
        # never used.
        self.give_back(self.ahead.pop(index))
