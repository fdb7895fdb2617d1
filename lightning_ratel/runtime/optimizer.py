"""The out-of-core CPU AdamW pipeline.

Optimizer state is kept per shard (see :mod:`lightning_ratel.runtime.units`): a shard's fp32 master, ``exp_avg`` and
``exp_avg_sq`` are three flat tensors in the swap store. An fp32 shard whose compute copy lives in the host cache has
no master on the store: that copy is the master.

Gradients reach a single worker thread in the order backward produces them. The worker accumulates them into a host
fp32 buffer that the shard takes from a pool with its first gradient and gives back after its update, so gradient
memory follows the shards in flight rather than the model. When a shard's last gradient of the boundary micro-batch
arrives (and nothing global such as a norm is still unknown) it runs the shard's update: read master and moments from
the store, AdamW in place, write the new compute copy where the pager reads it (the host cache, or the store), tell
the unit's :class:`~lightning_ratel.runtime.units.UnitReady`, and write master and moments back (finishing while the
next shard computes). The reads do not wait for the gradient: during the boundary micro-batch, every free buffer set
is filled ahead with the states of the shards expected next, in the order the previous step's updates ran, so an
update starts as soon as its last gradient is in. Without that, the shards backward finishes last (the first block
and the embedding, which the next forward needs first) would each wait for a disk read after backward. While the
gradients held exceed a budget and the worker has work that will release some, the thread handing gradients over
waits, so backward cannot run arbitrarily far ahead of the optimizer.

A step commits as a whole. Each shard's master and moments have two slots in the store: an update reads the newest
state and writes the other slot, and the shard's *committed* state (what checkpoints read and what a failed run
leaves) moves to the new slot only when the step commits: once the training thread has finished the step
(:meth:`CpuAdam.schedule`, after every gradient is in and nothing can skip it any more) and every update of the step
has run. Until then the previous master and moments stay in the store. An exception before the step is finished
(in backward, in a hook, Ctrl-C) leaves the committed state at the last step; :meth:`CpuAdam.abort` then undoes the
updates that already ran (puts the committed values back where the pager reads compute copies). Updates still run
while backward runs: committing costs the second slot on disk, and writing fp32 masters kept in the host cache
back to the store each step.

Threads. Jobs reach the worker as typed records through one queue. ``_ShardState`` (per-shard gradient, arrival and
step counts), the buffer sets and the reads ahead belong to the worker thread. The training thread touches shard
states only while the worker is idle: :meth:`CpuAdam.unscale_`, :meth:`CpuAdam.clip_`, :meth:`CpuAdam.param_steps`,
:meth:`CpuAdam.load_state` and :meth:`CpuAdam.moments_on_store` first wait for everything handed over so far. The
byte counters of the gradient budget are shared under ``_cond``.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_ratel.ops import adamw_step
from lightning_ratel.runtime.pool import BufferPool
from lightning_ratel.runtime.storage import ALIGNMENT, TensorStore, aligned_empty
from lightning_ratel.runtime.timeline import Timeline
from lightning_ratel.runtime.units import Shard
from lightning_ratel.sizes import round_up

_OPENMP_BACKEND = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@dataclass(frozen=True)
class GroupHyper:
    """Hyperparameters of one parameter group, read from the user's optimizer at the start of each step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> list[GroupHyper]:
        """The current hyperparameters of every group of a ``torch.optim.AdamW`` or ``torch.optim.Adam``."""
        decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        hyper = []
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            hyper.append(cls(
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", decoupled_default)),
            ))
        return hyper


@dataclass(frozen=True)
class StepPlan:
    """How this optimizer step's updates run: hyperparameters per group, whether they start during backward, and
    the element-wise clip each shard applies to its own gradients first (global transforms such as norm clipping and
    loss unscaling are applied through :meth:`CpuAdam.unscale_` and :meth:`CpuAdam.clip_` before the updates are
    scheduled)."""

    hyper: list[GroupHyper]
    overlap: bool
    clip_value: float | None = None


@dataclass(frozen=True)
class _Version:
    """One state of a shard in the store: which slot holds it, ``torch.optim.AdamW``'s step count of each parameter,
    and whether moments were ever written (otherwise they are zeros)."""

    slot: int
    steps: tuple[int, ...]
    moments: bool


@dataclass
class _ShardState:
    """What the worker knows about one shard between steps (worker thread only; see the module docstring)."""

    committed: _Version
    # The newest state: ``committed`` unless an update of a step not committed yet has run.
    latest: _Version
    # Taken from the gradient pool with the first gradient of a window, given back after the update.
    grad: torch.Tensor | None = None
    arrived: int = 0
    scheduled: bool = False
    # An update is queued and has not run: its state in the store is about to change.
    outstanding: bool = False
    last_write: Future | None = None
    # Per parameter: whether a gradient is accumulated in ``grad`` this window, and whether one arrived in the
    # current micro-batch.
    has_grad: list[bool] = field(default_factory=list)
    seen: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class _Gradient:
    shard: Shard
    position: int
    grad: torch.Tensor
    event: Any


@dataclass(frozen=True)
class _Begin:
    plan: StepPlan | None


@dataclass(frozen=True)
class _Schedule:
    plan: StepPlan
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class _Discard:
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class _Abort:
    future: Future


@dataclass(frozen=True)
class _Freed:
    buffers: _Buffers


@dataclass(frozen=True)
class _Barrier:
    future: Future
    include_writes: bool


@dataclass(frozen=True)
class _Stop:
    pass


_Job = _Gradient | _Begin | _Schedule | _Discard | _Abort | _Freed | _Barrier | _Stop


BUFFER_SETS = 3
"""State buffer sets the CPU AdamW keeps by default: one reading ahead, one computing, one writing back."""

class _Buffers:
    def __init__(self, numel: int, master_numel: int, compute_bytes: int) -> None:
        self.master = aligned_empty(master_numel, torch.float32, huge=True)
        self.exp_avg = aligned_empty(numel, torch.float32, huge=True)
        self.exp_avg_sq = aligned_empty(numel, torch.float32, huge=True)
        # The new 16-bit compute copy on its way to the store (only when the pager reads compute copies from there).
        # Whole pages, so any compute dtype can view it.
        pages = round_up(compute_bytes, ALIGNMENT)
        self.compute = aligned_empty(pages, torch.uint8, huge=True) if compute_bytes else None

    @property
    def nbytes(self) -> int:
        # The master buffer is empty where every master lives in the host cache; the moments are always there.
        states = self.master.numel() + self.exp_avg.numel() + self.exp_avg_sq.numel()
        return 4 * states + (self.compute.numel() if self.compute is not None else 0)


class CpuAdam:
    """Consumes gradients as backward produces them and updates shards on the CPU, overlapped with backward.

    Args:
        shards: every shard the optimizer holds, in the order of their units' forward.
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

    def __init__(self, shards: Sequence[Shard], store: TensorStore, depth: int = BUFFER_SETS,
                 timeline: Timeline | None = None, compute_on_store: bool = False,
                 grad_budget_bytes: int | None = None, threads: int | None = None) -> None:
        self.shards = list(shards)
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.store = store
        self.compute_on_store = compute_on_store
        self.grad_budget_bytes = grad_budget_bytes
        fresh = {s.index: _Version(0, (0,) * len(s.params), False) for s in self.shards}
        self._state = {
            s.index: _ShardState(fresh[s.index], fresh[s.index], has_grad=[False] * len(s.params),
                                 seen=[False] * len(s.params))
            for s in self.shards
        }
        self._reserve_slots()
        largest = max((s.numel for s in self.shards), default=1)
        largest_master = max((s.numel for s in self.shards if not s.master_in_host), default=0)
        compute_bytes = max((s.numel * s.dtype.itemsize for s in self.shards
                             if compute_on_store and s.dtype != torch.float32), default=0)
        self._free = [_Buffers(largest, largest_master, compute_bytes) for _ in range(depth)]
        self._buffer_bytes = sum(b.nbytes for b in self._free)
        self.grads = BufferPool()
        self._queued_grad_bytes = 0
        self._pending_updates = 0
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._ready: deque[tuple[Shard, StepPlan, int]] = deque()
        self._inflight: deque[tuple[Shard, StepPlan, int, _Buffers, list[Future]]] = deque()
        # Steps (numbered by boundary micro-batch) whose updates are not all committed: the training thread finished
        # them (``_decided``), updates queued and not run (``_outstanding``), shards updated (``_updated``).
        self._step = 0
        self._decided: set[int] = set()
        self._outstanding: dict[int, int] = {}
        self._updated: dict[int, list[Shard]] = {}
        # Read-ahead: states read before the shard's gradient is complete, by shard index; only between the start of
        # a boundary micro-batch and its schedule, so nothing else writes those states meanwhile.
        self._ahead: dict[int, tuple[_Buffers, list[Future]]] = {}
        self._reading_ahead = False
        # The order the last step's updates ran in (backward's order), and this step's so far.
        self._order: list[Shard] = list(reversed(self.shards))
        self._ran: list[Shard] = []
        self._writes_pending = 0
        self._barriers: list[_Barrier] = []
        self._error: BaseException | None = None
        self._plan: StepPlan | None = None
        self._cond = threading.Condition()
        self.timeline = timeline if timeline is not None else Timeline()
        self._worker = threading.Thread(target=self._run, name="ratel-cpu-adam", daemon=True)
        self._worker.start()

    def _reserve_slots(self) -> None:
        """Lay out both state slots of every shard in the store, and give masters kept in the host cache their first
        copy in the store (a step abandoned halfway restores them from there)."""
        for shard in self.shards:
            for what in ("master", "exp_avg", "exp_avg_sq"):
                for slot in (0, 1):
                    self.store.reserve(shard.key(what, slot), shard.numel * 4)
        self.store.preallocate()
        writes = [self.store.write(shard.key("master"), shard.host_master())
                  for shard in self.shards if shard.master_in_host]
        for write in writes:
            write.result()

    @property
    def host_buffer_bytes(self) -> int:
        """Host bytes of the state buffer sets and the gradient pool."""
        return self._buffer_bytes + self.grads.nbytes

    # ------------------------------------------------------------------ autograd thread

    def gradient(self, shard: Shard, position: int, grad: torch.Tensor, event: Any) -> None:
        """Hand over the gradient of ``shard.params[position]``, already on (or travelling to) host memory.

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
        self._jobs.put(_Gradient(shard, position, grad, event))

    # ------------------------------------------------------------------ training thread

    def begin(self, plan: StepPlan | None) -> None:
        """Start a micro-batch; ``plan`` is set on the boundary micro-batch of an accumulation window."""
        self._jobs.put(_Begin(plan))

    def schedule(self, plan: StepPlan, shards: Sequence[Shard]) -> None:
        """Finish the step: update ``shards`` under ``plan`` (those not already updated during backward); the step
        commits once they all have run.

        Each shard's unit stops being ready now, on the calling thread, so that a forward paging it in after this call
        waits for the update (which may also have run already).
        """
        for shard in shards:
            shard.unit.ready.expect()
        self._jobs.put(_Schedule(plan, tuple(shards)))

    def discard(self, shards: Sequence[Shard]) -> None:
        """Drop the gradients ``shards`` hold without updating them (a skipped step), and any states read ahead."""
        self._jobs.put(_Discard(tuple(shards)))

    def abort(self) -> None:
        """Abandon the step the training thread has not finished (an exception stopped it): drop its gradients and
        queued updates, and undo the updates that already ran, so every shard is at its committed state again (also
        where the pager reads it). A step already finished still completes and commits. Waits until done."""
        future: Future = Future()
        self._jobs.put(_Abort(future))
        self.barrier()
        future.result()

    def unscale_(self, shards: Sequence[Shard], loss_scale: torch.Tensor) -> bool:
        """Divide the gradients of ``shards`` by the fp16 loss scale and check them for inf/NaN.

        Returns:
            Whether every gradient is finite (``torch.amp.GradScaler``'s test for taking the step).
        """
        grads = self._ordered_grads(shards)
        found_inf = torch.zeros(1)
        inv_scale = loss_scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return found_inf.item() == 0

    def clip_(self, shards: Sequence[Shard], value: float, algorithm: str) -> None:
        """Clip the gradients of ``shards`` as ``torch.nn.utils.clip_grad_norm_`` (``"norm"``, the same reductions
        and the same clamped coefficient) or ``clip_grad_value_`` (``"value"``) would."""
        grads = self._ordered_grads(shards)
        if algorithm == "norm":
            total_norm = torch.nn.utils.get_total_norm(grads, 2.0)
            coef = torch.clamp(value / (total_norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        else:
            for g in grads:
                g.clamp_(min=-value, max=value)

    def _ordered_grads(self, shards: Sequence[Shard]) -> list[torch.Tensor]:
        """After every gradient is taken in: the views of the gradients that arrived, in the optimizer's parameter
        order, as torch's clipping and unscaling see them (the rest of a pooled buffer holds whatever its last user
        left there)."""
        self.barrier()
        views = []
        for shard in shards:
            state = self._state[shard.index]
            assert state.grad is not None
            views.extend((sp.index, sp.view(state.grad)) for sp, has in zip(shard.params, state.has_grad) if has)
        return [v for _, v in sorted(views, key=lambda t: t[0])]

    def barrier(self, include_writes: bool = False) -> None:
        """Wait until all work handed over so far is done (and, optionally, written back); re-raise its error."""
        future: Future = Future()
        self._jobs.put(_Barrier(future, include_writes))
        while True:
            try:
                future.result(timeout=1.0)
                return
            except TimeoutError:
                if not self._worker.is_alive():
                    raise RuntimeError(f"the CPU optimizer worker stopped: {self._error!r}") from self._error

    def close(self) -> None:
        """Stop the worker and free the buffers (whatever still references this object keeps no memory)."""
        self._jobs.put(_Stop())
        self._worker.join()
        self._free.clear()
        self._ahead.clear()
        self._inflight.clear()
        self._buffer_bytes = 0
        self.grads.clear()

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
        """Raise the worker's error, if it had one."""
        if self._error is not None:
            raise self._error

    def state_key(self, shard: Shard, what: str) -> str:
        """The store key holding ``shard``'s committed ``master``, ``exp_avg`` or ``exp_avg_sq`` (the values of the
        last step taken). Every update handed over so far must have run: call :meth:`barrier` first."""
        return shard.key(what, self._state[shard.index].committed.slot)

    def param_steps(self, shard: Shard) -> list[int]:
        """``torch.optim.AdamW``'s committed step count of each parameter of ``shard`` (0: never updated)."""
        self.barrier(include_writes=True)
        return list(self._state[shard.index].committed.steps)

    def moments_on_store(self, shard: Shard) -> bool:
        """Whether ``shard``'s committed moments were ever written (otherwise they are zeros)."""
        self.barrier(include_writes=True)
        return self._state[shard.index].committed.moments

    def load_state(self, shard: Shard, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: Sequence[int]) -> None:
        """Replace ``shard``'s committed moments and step counts (from a checkpoint)."""
        self.barrier(include_writes=True)
        state = self._state[shard.index]
        slot = state.committed.slot
        self.store.write(shard.key("exp_avg", slot), exp_avg).result()
        self.store.write(shard.key("exp_avg_sq", slot), exp_avg_sq).result()
        state.committed = state.latest = _Version(slot, tuple(steps), True)

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        if _OPENMP_BACKEND:
            # With OpenMP the count is per thread: the training thread keeps its own. (torch's native thread pool is
            # one pool for all threads, so there it is left alone.)
            torch.set_num_threads(self.threads)
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                return
            try:
                self._handle(job)
                # A gradient must not stay alive through the updates below, or while waiting for the next job.
                del job
                self._advance()
                self._resolve_barriers()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread through barrier/check
                self._fail(err)
                for barrier in self._barriers:
                    if not barrier.future.done():
                        barrier.future.set_exception(err)
                self._barriers = []

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = err
            # Nobody may wait forever for an update that will not come.
            self._cond.notify_all()
        for shard in self.shards:
            shard.unit.ready.fail(err)
        self._ready.clear()

    def _handle(self, job: _Job) -> None:
        if isinstance(job, _Gradient):
            self._take_gradient(job)
        elif isinstance(job, _Begin):
            self._plan = job.plan
            self._drop_ahead()
            self._reading_ahead = self._plan is not None
            if self._plan is not None:
                self._step += 1
            if self._reading_ahead and self._ran:
                ran = {s.index for s in self._ran}
                self._order = self._ran + [s for s in self._order if s.index not in ran]
                self._ran = []
            for state in self._state.values():
                state.arrived = 0
                state.scheduled = False
                state.seen = [False] * len(state.seen)
        elif isinstance(job, _Schedule):
            for shard in job.shards:
                if not self._state[shard.index].scheduled:
                    self._enqueue(shard, job.plan)
            # Every update of the step is queued: states read ahead for shards without one are dropped.
            self._reading_ahead = False
            for index in [i for i in self._ahead if not self._state[i].outstanding]:
                self._release_ahead(index)
            self._decided.add(self._step)
            self._commit()
        elif isinstance(job, _Discard):
            for shard in job.shards:
                state = self._state[shard.index]
                state.has_grad = [False] * len(state.has_grad)
                self._release_grad(shard)
            self._reading_ahead = False
            self._drop_ahead()
        elif isinstance(job, _Abort):
            self._abort()
            job.future.set_result(None)
        elif isinstance(job, _Freed):
            self._free.append(job.buffers)
            self._writes_pending -= 1
        elif isinstance(job, _Barrier):
            self._barriers.append(job)

    def _take_gradient(self, job: _Gradient) -> None:
        shard, position, grad = job.shard, job.position, job.grad
        with self._cond:
            self._queued_grad_bytes -= grad.numel() * grad.element_size()
            self._cond.notify_all()
        if self._error is not None:
            return
        job.event.synchronize()
        state = self._state[shard.index]
        plan = self._plan
        if state.scheduled and plan is not None and plan.overlap:
            raise RuntimeError(
                f"a gradient of {shard.params[position].name} arrived after its shard was updated; RatelStrategy "
                "expects each parameter's gradient once per backward pass"
            )
        if state.grad is None:
            state.grad = self.grads.take(shard.numel, torch.float32)
        view = shard.params[position].view(state.grad)
        if state.has_grad[position]:
            view.add_(grad)
        else:
            view.copy_(grad)
            state.has_grad[position] = True
        if not state.seen[position]:
            state.seen[position] = True
            state.arrived += 1
        if plan is not None and plan.overlap and state.arrived == len(shard.params) and not state.scheduled:
            self._enqueue(shard, plan)

    def _enqueue(self, shard: Shard, plan: StepPlan) -> None:
        state = self._state[shard.index]
        state.scheduled = True
        if any(state.has_grad):
            state.outstanding = True
            self._ready.append((shard, plan, self._step))
            self._outstanding[self._step] = self._outstanding.get(self._step, 0) + 1
            self._ran.append(shard)
            with self._cond:
                self._pending_updates += 1

    def _commit(self) -> None:
        """Commit, oldest first, every finished step whose updates have all run."""
        for step in sorted(self._decided):
            if self._outstanding.get(step, 0):
                return
            self._decided.discard(step)
            self._outstanding.pop(step, None)
            for shard in self._updated.pop(step, []):
                state = self._state[shard.index]
                state.committed = state.latest
            self.timeline.record(f"commit:{step}")

    def _abort(self) -> None:
        """See :meth:`abort` (worker thread)."""
        step = self._step
        if step in self._decided:
            # Finished by the training thread: it completes and commits.
            step = -1
        ready = [item for item in self._ready if item[2] == step]
        inflight = [item for item in self._inflight if item[2] == step]
        self._ready = deque(item for item in self._ready if item[2] != step)
        self._inflight = deque(item for item in self._inflight if item[2] != step)
        for shard, *_ in ready:
            self._state[shard.index].outstanding = False
        for shard, _, _, buffers, reads in inflight:
            self._state[shard.index].outstanding = False
            for read in reads:
                read.exception()
            self._free.append(buffers)
        with self._cond:
            self._pending_updates -= len(ready) + len(inflight)
            self._cond.notify_all()
        self._outstanding.pop(step, None)
        for shard in self._updated.pop(step, []):
            self._revert(shard)
        for shard in self.shards:
            state = self._state[shard.index]
            # The gradients of a finished step's update still to run are its input.
            if not state.outstanding:
                state.has_grad = [False] * len(state.has_grad)
                state.scheduled = False
                self._release_grad(shard)
        self._reading_ahead = False
        self._drop_ahead()
        self._ran = []
        self.timeline.record(f"abort:{step}")

    def _revert(self, shard: Shard) -> None:
        """Put ``shard``'s committed values back where the pager reads its compute copy, and forget its update."""
        state = self._state[shard.index]
        if state.last_write is not None:
            state.last_write.exception()
        state.latest = state.committed
        master_key = shard.key("master", state.committed.slot)
        if shard.master_in_host:
            self.store.read(master_key, shard.host_master()).result()
            shard.unit.ready.retract()
            return
        if self.compute_on_store and shard.dtype == torch.float32:
            shard.unit.ready.retract(shard, master_key)
            return
        master = aligned_empty(shard.numel, torch.float32)[: shard.numel]
        self.store.read(master_key, master).result()
        if self.compute_on_store:
            copy = master.to(shard.dtype)
            self.store.write(shard.compute_key, copy).result()
        else:
            shard.compute_view(shard.unit.host[shard.dtype]).copy_(master)
        shard.unit.ready.retract()

    def _release_grad(self, shard: Shard) -> None:
        state = self._state[shard.index]
        if state.grad is not None:
            self.grads.give(state.grad)
            state.grad = None

    def _advance(self) -> None:
        while True:
            while self._ready and self._error is None:
                shard, plan, step = self._ready[0]
                ahead = self._ahead.pop(shard.index, None)
                if ahead is None:
                    if not self._free and not self._evict_ahead():
                        break
                    buffers = self._free.pop()
                    ahead = (buffers, self._read(shard, buffers))
                self._ready.popleft()
                self._inflight.append((shard, plan, step, *ahead))
            if self._reading_ahead and self._error is None:
                self._read_ahead()
            # Gradients are cheap to take in and unblock backward's memory; updates wait for an empty queue.
            if not self._inflight or not self._jobs.empty() or self._error is not None:
                return
            shard, plan, step, buffers, reads = self._inflight.popleft()
            self._update(shard, plan, buffers, reads)
            self._outstanding[step] -= 1
            self._updated.setdefault(step, []).append(shard)
            self._commit()

    def _read_ahead(self) -> None:
        """Fill free buffer sets with the states of the shards expected next, in last step's order."""
        if not self._free:
            return
        for shard in self._order:
            state = self._state[shard.index]
            # A shard whose update has not run yet would be read before it changes.
            if state.scheduled or state.outstanding or shard.index in self._ahead:
                continue
            if state.last_write is not None and not state.last_write.done():
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
        """Start reading ``shard``'s newest state into ``b``."""
        state = self._state[shard.index]
        if state.last_write is not None:
            state.last_write.result()
        n = shard.numel
        slot = state.latest.slot
        reads = [] if shard.master_in_host else [self.store.read(shard.key("master", slot), b.master[:n])]
        if state.latest.moments:
            reads.append(self.store.read(shard.key("exp_avg", slot), b.exp_avg[:n]))
            reads.append(self.store.read(shard.key("exp_avg_sq", slot), b.exp_avg_sq[:n]))
        return reads

    def _update(self, shard: Shard, plan: StepPlan, b: _Buffers, reads: list[Future]) -> None:
        for r in reads:
            r.result()
        self.timeline.record(f"update_start:{shard.index}")
        state = self._state[shard.index]
        n = shard.numel
        master = shard.host_master() if shard.master_in_host else b.master[:n]
        exp_avg, exp_avg_sq = b.exp_avg[:n], b.exp_avg_sq[:n]
        if not state.latest.moments:
            exp_avg.zero_()
            exp_avg_sq.zero_()
        grad = state.grad
        assert grad is not None
        if plan.clip_value is not None:
            grad.clamp_(min=-plan.clip_value, max=plan.clip_value)
        hyper = plan.hyper[shard.group]
        out = self._compute_out(shard, b)
        with_grad = [i for i, has in enumerate(state.has_grad) if has]
        steps = list(state.latest.steps)
        if len(with_grad) == len(shard.params) and len({steps[i] for i in with_grad}) == 1:
            self._adamw(master, grad, exp_avg, exp_avg_sq, out, hyper, steps[0] + 1)
        else:
            if out is not None and self.compute_on_store:
                # The whole staging buffer goes to the store: parameters without a gradient keep their copies.
                out.copy_(master)
            for i in with_grad:
                sp = shard.params[i]
                sl = slice(sp.offset, sp.offset + sp.numel)
                self._adamw(master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], out[sl] if out is not None else None,
                            hyper, steps[i] + 1)
        for i in with_grad:
            steps[i] += 1
            state.has_grad[i] = False
        slot = 1 - state.latest.slot
        state.latest = _Version(slot, tuple(steps), True)
        state.outstanding = False
        self._release_grad(shard)
        self.timeline.record(f"update_end:{shard.index}")
        writes = [self.store.write(shard.key("exp_avg", slot), exp_avg),
                  self.store.write(shard.key("exp_avg_sq", slot), exp_avg_sq),
                  self.store.write(shard.key("master", slot), master)]
        if out is not None and self.compute_on_store:
            writes.append(self.store.write(shard.compute_key, out))
        self._writes_pending += 1
        done = self._joined(writes, b)
        state.last_write = done
        # Only now, with ``last_write`` set: a pager reading compute copies from the store waits for that write (an
        # fp32 shard's compute copy is its master, in the new slot).
        moved = shard.key("master", slot) if self.compute_on_store and shard.dtype == torch.float32 else None
        shard.unit.ready.complete(done if self.compute_on_store else None, shard, moved)
        with self._cond:
            self._pending_updates -= 1
            self._cond.notify_all()

    def _joined(self, writes: list[Future], buffers: _Buffers) -> Future:
        """A future that completes when every write has (with the first error), handing ``buffers`` back then."""
        done: Future = Future()
        remaining = [len(writes)]
        lock = threading.Lock()

        def finished(f: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if f.exception() is not None and not done.done():
                done.set_exception(f.exception())
                self._jobs.put(_Freed(buffers))
                return
            if last and not done.done():
                done.set_result(None)
                self._jobs.put(_Freed(buffers))

        for w in writes:
            w.add_done_callback(finished)
        return done

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
        step_fn = adamw_step()
        step_fn(master, grad, exp_avg, exp_avg_sq, out, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                weight_decay=h.weight_decay, step=step, decoupled=h.decoupled, num_threads=self.threads)

    def _resolve_barriers(self) -> None:
        if not self._barriers:
            return
        busy = bool(self._ready or self._inflight) and self._error is None
        keep = []
        for barrier in self._barriers:
            if self._error is not None:
                barrier.future.set_exception(self._error)
            elif busy or not self._jobs.empty() or (barrier.include_writes and self._writes_pending):
                keep.append(barrier)
            else:
                for state in self._state.values():
                    if state.last_write is not None and state.last_write.done():
                        err = state.last_write.exception()
                        if err is not None:
                            self._fail(err)
                            barrier.future.set_exception(err)
                            break
                else:
                    barrier.future.set_result(None)
        self._barriers = keep
