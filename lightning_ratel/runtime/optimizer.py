"""The out-of-core CPU AdamW pipeline.

Optimizer state is kept per *shard*: the parameters of one unit (block) that share a parameter group and a compute
dtype, so a shard's 16-bit copies are one contiguous range of the unit's compute copies and its fp32 master,
``exp_avg`` and ``exp_avg_sq`` are three flat tensors in the swap store. An fp32 shard whose compute copy lives in the
host cache has no master on the store: that copy is the master.

Gradients reach a single worker thread in the order backward produces them. The worker accumulates them into a host
fp32 buffer that the shard takes from a pool with its first gradient and gives back after its update, so gradient
memory follows the shards in flight rather than the model. When a shard's last gradient of the boundary micro-batch
arrives (and nothing global such as a norm is still unknown) it runs the shard's update: read master and moments from
the store, AdamW in place, write the new compute copy where the pager reads it (the host cache, or the store; the
next forward may page the block in from then on), write master and moments back (finishing while the next shard
computes). The reads do not wait for the gradient: during the boundary micro-batch, every free buffer set is filled
ahead with the states of the shards expected next, in the order the previous step's updates ran, so an update starts
as soon as its last gradient is in. Without that, the shards backward finishes last (the first block and the
embedding, which the next forward needs first) would each wait for a disk read after backward. While the gradients
held exceed a budget and the worker has work that will release some, the thread handing gradients over waits, so
backward cannot run arbitrarily far ahead of the optimizer.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ratel import ops
from lightning_ratel.runtime.pager import Unit
from lightning_ratel.runtime.pool import BufferPool
from lightning_ratel.runtime.storage import ALIGNMENT, TensorStore, aligned_empty
from lightning_ratel.runtime.timeline import Timeline


_OPENMP_BACKEND = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@dataclass
class ShardParam:
    """One parameter's place in a shard; ``step`` mirrors ``torch.optim.AdamW``'s per-parameter step."""

    name: str
    param: nn.Parameter
    index: int
    offset: int
    numel: int
    shape: torch.Size
    step: int = 0
    has_grad: bool = False
    seen: bool = False

    def grad_view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.shape)


@dataclass
class Shard:
    """Parameters of one unit, one parameter group and one compute dtype."""

    index: int
    unit: Unit
    group: int
    dtype: torch.dtype
    host_offset: int
    params: list[ShardParam]
    numel: int
    # Taken from the optimizer's gradient pool with the first gradient of a window, given back after the update.
    grad: torch.Tensor | None = field(repr=False, default=None)
    arrived: int = 0
    scheduled: bool = False
    # Updates asked for by the training thread vs. finished by the worker; the unit is current when they match.
    expected: int = 0
    done: int = 0
    moments_on_store: bool = False
    last_write: Future | None = None
    # An fp32 shard whose compute copy stays in the unit's host cache: that copy is the master itself, updated there in
    # place and never kept on the store.
    master_in_host: bool = False

    def key(self, what: str) -> str:
        return f"shard{self.index}.{what}"

    @property
    def compute_key(self) -> str:
        """The store key of the compute copy when it is read from the store: the fp32 master is its own copy."""
        return self.key("master") if self.dtype == torch.float32 else self.key("compute")

    def compute_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This shard's range of a flat tensor laid out like its unit's compute copies."""
        return flat[self.host_offset : self.host_offset + self.numel]

    def host_master(self) -> torch.Tensor:
        """The master of a ``master_in_host`` shard: its range of the unit's fp32 host cache."""
        return self.compute_view(self.unit.host[torch.float32])


@dataclass(frozen=True)
class GroupHyper:
    """Hyperparameters of one parameter group, read from the user's optimizer at the start of each step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


@dataclass
class StepPlan:
    """How this optimizer step's updates run: hyperparameters per group, whether they start during backward, and
    the element-wise clip each shard applies to its own gradients first (global transforms such as norm clipping and
    loss unscaling are applied by the engine before it schedules the updates)."""

    hyper: list[GroupHyper]
    overlap: bool
    clip_value: float | None = None


class _Buffers:
    def __init__(self, numel: int, master_numel: int, compute_bytes: int) -> None:
        self.master = aligned_empty(master_numel, torch.float32, huge=True)
        self.exp_avg = aligned_empty(numel, torch.float32, huge=True)
        self.exp_avg_sq = aligned_empty(numel, torch.float32, huge=True)
        # The new 16-bit compute copy on its way to the store (only when the pager reads compute copies from there).
        # Whole pages, so any compute dtype can view it.
        pages = -(-compute_bytes // ALIGNMENT) * ALIGNMENT
        self.compute = aligned_empty(pages, torch.uint8, huge=True) if compute_bytes else None

    @property
    def nbytes(self) -> int:
        return 3 * self.master.numel() * 4 + (self.compute.numel() if self.compute is not None else 0)


class CpuAdam:
    """Consumes gradients as backward produces them and updates shards on the CPU, overlapped with backward.

    Args:
        shards: every shard, in the order of their units' forward.
        store: the swap store holding masters and moments.
        depth: buffer sets in flight (reading ahead, computing, writing back).
        timeline: where updates and reads ahead are recorded; a new one by default.
        compute_on_store: the pager reads compute copies from the store, so an update writes the new compute copy
            there (the fp32 master itself for fp32 shards) and a unit is ready only once those writes have landed.
        grad_budget_bytes: gradient bytes (pooled buffers plus gradients handed over but not yet taken in) above
            which :meth:`gradient` waits for the worker to release some; ``None`` never waits.
        threads: OpenMP threads of the worker (the AdamW kernel and its torch operations); defaults to
            ``torch.get_num_threads()``. Training on the CPU itself wants 1: a second thread team on cores the
            compute team already fills makes OpenMP stop spinning between parallel regions in both teams, and every
            region of the forward and backward then waits for sleeping threads to wake.
    """

    def __init__(self, shards: list[Shard], store: TensorStore, depth: int = 3,
                 timeline: Timeline | None = None, compute_on_store: bool = False,
                 grad_budget_bytes: int | None = None, threads: int | None = None) -> None:
        self.shards = shards
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.store = store
        self.compute_on_store = compute_on_store
        self.grad_budget_bytes = grad_budget_bytes
        largest = max((s.numel for s in shards), default=1)
        largest_master = max((s.numel for s in shards if not s.master_in_host), default=0)
        compute_bytes = max(
            (s.numel * s.dtype.itemsize for s in shards if compute_on_store and s.dtype != torch.float32), default=0)
        self._free = [_Buffers(largest, largest_master, compute_bytes) for _ in range(depth)]
        self._buffer_bytes = sum(b.nbytes for b in self._free)
        self.grads = BufferPool()
        self._queued_grad_bytes = 0
        self._pending_updates = 0
        self._jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._ready: deque[tuple[Shard, StepPlan]] = deque()
        self._inflight: deque[tuple[Shard, StepPlan, _Buffers, list[Future]]] = deque()
        # Read-ahead: states read before the shard's gradient is complete, by shard index; only between the start of
        # a boundary micro-batch and its schedule, so nothing else writes those states meanwhile.
        self._ahead: dict[int, tuple[_Buffers, list[Future]]] = {}
        self._reading_ahead = False
        # The order the last step's updates ran in (backward's order), and this step's so far.
        self._order: list[Shard] = list(reversed(shards))
        self._ran: list[Shard] = []
        self._writes_pending = 0
        self._barriers: list[Future] = []
        self._error: BaseException | None = None
        self._plan: StepPlan | None = None
        self._cond = threading.Condition()
        self._unit_shards: dict[int, list[Shard]] = {}
        for shard in shards:
            self._unit_shards.setdefault(shard.unit.index, []).append(shard)
        self.timeline = timeline if timeline is not None else Timeline()
        self._worker = threading.Thread(target=self._run, name="ratel-cpu-adam", daemon=True)
        self._worker.start()

    @property
    def host_buffer_bytes(self) -> int:
        """Host bytes of the state buffer sets and the gradient pool."""
        return self._buffer_bytes + self.grads.nbytes

    # Called from the autograd thread.
    def gradient(self, shard: Shard, sp: ShardParam, grad: torch.Tensor, event: Any) -> None:
        """Hand over one parameter's gradient, already on (or travelling to) host memory.

        Waits first while the gradients held exceed the budget and the worker has something that may release some:
        pending updates, or gradients not taken in yet (which may complete a shard). Once neither is left nothing would
        release memory (deferred updates, accumulation), so it goes on over budget rather than wait forever.
        """
        nbytes = grad.numel() * grad.element_size()
        with self._cond:
            if self.grad_budget_bytes is not None:
                while ((self._pending_updates or self._queued_grad_bytes) and self._error is None
                       and self._queued_grad_bytes + self.grads.nbytes_in_use + nbytes > self.grad_budget_bytes):
                    self._cond.wait()
            self._queued_grad_bytes += nbytes
        self._jobs.put(("grad", shard, sp, grad, event))

    # Called from the training thread.
    def begin(self, plan: StepPlan | None) -> None:
        """Start a micro-batch; ``plan`` is set on the boundary micro-batch of an accumulation window."""
        self._jobs.put(("begin", plan))

    def schedule(self, plan: StepPlan, shards: list[Shard]) -> None:
        """Update ``shards`` under ``plan`` (the ones whose update was not started during backward)."""
        self._jobs.put(("schedule", plan, shards))

    def discard(self, shards: list[Shard]) -> None:
        """Drop the gradients ``shards`` hold without updating them (a skipped step), and any states read ahead."""
        self._jobs.put(("discard", shards))

    def barrier(self, include_writes: bool = False) -> None:
        """Wait until all work handed over so far is done (and, optionally, written back); re-raise its error."""
        future: Future = Future()
        self._jobs.put(("barrier", future, include_writes))
        while True:
            try:
                future.result(timeout=1.0)
                return
            except TimeoutError:
                if not self._worker.is_alive():
                    raise RuntimeError(f"the CPU optimizer worker stopped: {self._error!r}") from self._error

    def close(self) -> None:
        self._jobs.put(("stop",))
        self._worker.join()

    def release_memory(self) -> None:
        """Free the state buffers and pooled gradient buffers once no more updates will run (before teardown gathers
        state into host memory). Waits for pending work first."""
        # A run stopped inside a boundary micro-batch may still hold states read ahead.
        self.discard([])
        self.barrier(include_writes=True)
        self._free.clear()
        self._buffer_bytes = 0
        self.grads.clear()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def expect(self, shards: list[Shard]) -> None:
        """Record that ``shards`` will be updated in this step, before any forward may page their units in."""
        with self._cond:
            for shard in shards:
                shard.expected += 1

    def _updated(self, unit: int) -> bool:
        return all(s.done >= s.expected for s in self._unit_shards.get(unit, ()))

    def unit_ready(self, unit: int) -> bool:
        """Whether every update of ``unit`` asked for so far has put its new compute copy where the pager reads it."""
        if not self._updated(unit):
            return False
        return not self.compute_on_store or all(
            s.last_write is None or s.last_write.done() for s in self._unit_shards.get(unit, ()))

    def wait_unit(self, unit: int) -> None:
        """Block until every update of ``unit`` asked for so far has written its new compute copy."""
        with self._cond:
            while not self._updated(unit) and self._error is None:
                self._cond.wait()
        self.check()
        if self.compute_on_store:
            for shard in self._unit_shards.get(unit, ()):
                if shard.last_write is not None:
                    shard.last_write.result()

    def _run(self) -> None:
        if _OPENMP_BACKEND:
            # With OpenMP the count is per thread: the training thread keeps its own. (torch's native thread pool is
            # one pool for all threads, so there it is left alone.)
            torch.set_num_threads(self.threads)
        while True:
            job = self._jobs.get()
            kind = job[0]
            if kind == "stop":
                return
            try:
                self._handle(job)
                # A gradient must not stay alive through the updates below, or while waiting for the next job.
                del job
                self._advance()
                self._resolve_barriers()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread through barrier/check
                self._fail(err)
                for future, _ in self._barriers:
                    if not future.done():
                        future.set_exception(err)
                self._barriers = []

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = err
            # Nobody may wait forever for an update that will not come.
            self._cond.notify_all()
        self._ready.clear()

    def _handle(self, job: tuple[Any, ...]) -> None:
        kind = job[0]
        if kind == "grad":
            _, shard, sp, grad, event = job
            with self._cond:
                self._queued_grad_bytes -= grad.numel() * grad.element_size()
                self._cond.notify_all()
            if self._error is not None:
                return
            event.synchronize()
            plan = self._plan
            if shard.scheduled and plan is not None and plan.overlap:
                raise RuntimeError(
                    f"a gradient of {sp.name} arrived after its shard was updated; RatelStrategy expects each "
                    "parameter's gradient once per backward pass"
                )
            if shard.grad is None:
                shard.grad = self.grads.take(shard.numel, torch.float32)
            view = sp.grad_view(shard.grad)
            if sp.has_grad:
                view.add_(grad)
            else:
                view.copy_(grad)
                sp.has_grad = True
            if not sp.seen:
                sp.seen = True
                shard.arrived += 1
            if plan is not None and plan.overlap and shard.arrived == len(shard.params) and not shard.scheduled:
                self._enqueue(shard, plan)
        elif kind == "begin":
            self._plan = job[1]
            self._drop_ahead()
            self._reading_ahead = self._plan is not None
            if self._reading_ahead and self._ran:
                ran = {s.index for s in self._ran}
                self._order = self._ran + [s for s in self._order if s.index not in ran]
                self._ran = []
            for shard in self.shards:
                shard.arrived = 0
                shard.scheduled = False
                for sp in shard.params:
                    sp.seen = False
        elif kind == "schedule":
            _, plan, shards = job
            for shard in shards:
                if not shard.scheduled:
                    self._enqueue(shard, plan)
            # Every update of the step is queued: states read ahead for shards without one are dropped.
            self._reading_ahead = False
            self._drop_ahead()
        elif kind == "discard":
            for shard in job[1]:
                for sp in shard.params:
                    sp.has_grad = False
                self._release_grad(shard)
            self._reading_ahead = False
            self._drop_ahead()
        elif kind == "freed":
            self._free.append(job[1])
            self._writes_pending -= 1
        elif kind == "barrier":
            self._barriers.append((job[1], job[2]))

    def _enqueue(self, shard: Shard, plan: StepPlan) -> None:
        shard.scheduled = True
        if any(sp.has_grad for sp in shard.params):
            self._ready.append((shard, plan))
            self._ran.append(shard)
            with self._cond:
                self._pending_updates += 1

    def _release_grad(self, shard: Shard) -> None:
        if shard.grad is not None:
            self.grads.give(shard.grad)
            shard.grad = None

    def _advance(self) -> None:
        while True:
            while self._ready and self._error is None:
                shard, plan = self._ready[0]
                ahead = self._ahead.pop(shard.index, None)
                if ahead is None:
                    if not self._free and not self._evict_ahead():
                        break
                    buffers = self._free.pop()
                    ahead = (buffers, self._read(shard, buffers))
                self._ready.popleft()
                self._inflight.append((shard, plan, *ahead))
            if self._reading_ahead and self._error is None:
                self._read_ahead()
            # Gradients are cheap to take in and unblock backward's memory; updates wait for an empty queue.
            if not self._inflight or not self._jobs.empty() or self._error is not None:
                return
            shard, plan, buffers, reads = self._inflight.popleft()
            self._update(shard, plan, buffers, reads)

    def _read_ahead(self) -> None:
        """Fill free buffer sets with the states of the shards expected next, in last step's order."""
        if not self._free:
            return
        for shard in self._order:
            if shard.scheduled or shard.index in self._ahead:
                continue
            if shard.last_write is not None and not shard.last_write.done():
                # Its previous write-back is still landing; later shards must not take the buffer it will need.
                return
            buffers = self._free.pop()
            self.timeline.record(f"read_ahead:{shard.index}")
            self._ahead[shard.index] = (buffers, self._read(shard, buffers))
            if not self._free:
                return

    def _evict_ahead(self) -> bool:
        """A ready shard needs a buffer set and none will come back from a write: free the read-ahead expected
        last. Returns whether one was freed."""
        if self._writes_pending or not self._ahead:
            return False
        position = {s.index: i for i, s in enumerate(self._order)}
        index = max(self._ahead, key=lambda i: position.get(i, len(position)))
        self._release_ahead(index)
        return True

    def _drop_ahead(self) -> None:
        for index in list(self._ahead):
            self._release_ahead(index)

    def _release_ahead(self, index: int) -> None:
        buffers, reads = self._ahead.pop(index)
        # The buffers are reused only once the reads stop writing them; a read error does not matter, the data is
        # never used.
        for read in reads:
            read.exception()
        self._free.append(buffers)

    def _read(self, shard: Shard, b: _Buffers) -> list[Future]:
        if shard.last_write is not None:
            shard.last_write.result()
        n = shard.numel
        reads = [] if shard.master_in_host else [self.store.read(shard.key("master"), b.master[:n])]
        if shard.moments_on_store:
            reads.append(self.store.read(shard.key("exp_avg"), b.exp_avg[:n]))
            reads.append(self.store.read(shard.key("exp_avg_sq"), b.exp_avg_sq[:n]))
        return reads

    def _update(self, shard: Shard, plan: StepPlan, b: _Buffers, reads: list[Future]) -> None:
        for r in reads:
            r.result()
        self.timeline.record(f"update_start:{shard.index}")
        n = shard.numel
        master = shard.host_master() if shard.master_in_host else b.master[:n]
        exp_avg, exp_avg_sq = b.exp_avg[:n], b.exp_avg_sq[:n]
        if not shard.moments_on_store:
            exp_avg.zero_()
            exp_avg_sq.zero_()
        grad = shard.grad
        assert grad is not None
        if plan.clip_value is not None:
            grad.clamp_(min=-plan.clip_value, max=plan.clip_value)
        hyper = plan.hyper[shard.group]
        out = self._compute_out(shard, b)
        with_grad = [sp for sp in shard.params if sp.has_grad]
        if len(with_grad) == len(shard.params) and len({sp.step for sp in with_grad}) == 1:
            step = with_grad[0].step + 1
            self._adamw(master, grad, exp_avg, exp_avg_sq, out, hyper, step)
        else:
            if out is not None and self.compute_on_store:
                # The whole staging buffer goes to the store: parameters without a gradient keep their copies.
                out.copy_(master)
            for sp in with_grad:
                sl = slice(sp.offset, sp.offset + sp.numel)
                self._adamw(master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], out[sl] if out is not None else None,
                            hyper, sp.step + 1)
        for sp in with_grad:
            sp.step += 1
            sp.has_grad = False
        shard.moments_on_store = True
        self._release_grad(shard)
        self.timeline.record(f"update_end:{shard.index}")
        writes = [self.store.write(shard.key("exp_avg"), exp_avg),
                  self.store.write(shard.key("exp_avg_sq"), exp_avg_sq)]
        if not shard.master_in_host:
            writes.append(self.store.write(shard.key("master"), master))
        if out is not None and self.compute_on_store:
            writes.append(self.store.write(shard.compute_key, out))
        self._writes_pending += 1
        done: Future = Future()
        shard.last_write = done
        remaining = [len(writes)]
        lock = threading.Lock()

        def finished(f: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if f.exception() is not None and not done.done():
                done.set_exception(f.exception())
                self._jobs.put(("freed", b))
                return
            if last and not done.done():
                done.set_result(None)
                self._jobs.put(("freed", b))

        for w in writes:
            w.add_done_callback(finished)
        # Only now: a pager reading compute copies from the store waits for ``last_write``, which must be this one.
        with self._cond:
            shard.done += 1
            self._pending_updates -= 1
            self._cond.notify_all()

    def _compute_out(self, shard: Shard, b: _Buffers) -> torch.Tensor | None:
        """Where the update writes the shard's new compute copy: the host cache, a staging buffer bound for the
        store, or nowhere when the master itself is the compute copy."""
        if shard.master_in_host:
            return None
        if not self.compute_on_store:
            return shard.compute_view(shard.unit.host[shard.dtype])
        if shard.dtype == torch.float32:
            return None
        assert b.compute is not None
        return b.compute.view(shard.dtype)[: shard.numel]

    def _adamw(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               out: torch.Tensor | None, h: GroupHyper, step: int) -> None:
        step_fn = ops.adamw_step()
        step_fn(master, grad, exp_avg, exp_avg_sq, out, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                weight_decay=h.weight_decay, step=step, decoupled=h.decoupled, num_threads=self.threads)

    def _resolve_barriers(self) -> None:
        if not self._barriers:
            return
        busy = bool(self._ready or self._inflight) and self._error is None
        keep = []
        for future, include_writes in self._barriers:
            if self._error is not None:
                future.set_exception(self._error)
            elif busy or not self._jobs.empty() or (include_writes and self._writes_pending):
                keep.append((future, include_writes))
            else:
                for shard in self.shards:
                    if shard.last_write is not None and shard.last_write.done():
                        err = shard.last_write.exception()
                        if err is not None:
                            self._fail(err)
                            future.set_exception(err)
                            break
                else:
                    future.set_result(None)
        self._barriers = keep
