"""The out-of-core CPU optimizer pipeline (AdamW's fused kernel, or any per-parameter optimizer's own step).

Optimizer state is kept per shard (see :mod:`lightning_ratel.runtime.units`): a shard's fp32 master, ``exp_avg`` and
``exp_avg_sq`` are three flat tensors in the swap store. An fp32 shard whose compute copy lives in the host cache has
no master on the store: that copy is the master. Another optimizer than AdamW/Adam keeps one state record per shard
instead of the moments (:mod:`~lightning_ratel.runtime.generic`), read, written and committed the same way.

Gradients reach a single worker thread in the order backward produces them. The worker accumulates them into a host
fp32 buffer that the shard takes from a pool with its first gradient and gives back after its update, so gradient
memory follows the shards in flight rather than the model. When a shard's last gradient of the boundary micro-batch
arrives (and nothing global such as a norm is still unknown) it runs the shard's update: read master and moments from
the store, AdamW in place (for states in host memory: from the latest slot into the other, in the same pass, with no
copy first), write the new compute copy where the pager reads it (the host cache, or the store), tell
the unit's :class:`~lightning_ratel.runtime.units.UnitReady`, and write master and moments back (finishing while the
next shard computes). The reads do not wait for the gradient: during the boundary micro-batch, every free buffer set
is filled ahead with the states of the shards expected next, in the order the previous step's updates ran, so an
update starts as soon as its last gradient is in. Without that, the shards backward finishes last (the first block
and the embedding, which the next forward needs first) would each wait for a disk read after backward. While the
gradients held exceed a budget and the worker has work that will release some, the thread handing gradients over
waits, so backward cannot run arbitrarily far ahead of the optimizer.

Where the step needs something global about its gradients (the norm for clipping, the fp16 overflow check), the
updates still run during backward, speculatively: as if the clip coefficient were 1 and nothing overflowed, each
shard's gradients unscaled as it completes, and each shard keeping its gradient until :meth:`CpuAdam.resolve` knows.
A wrong guess is undone like an abort and redone from the committed state with the clipped gradients (or dropped, on
an overflow), so the numbers are those of updating after backward.

A step commits as a whole. Each shard's master and moments have two slots in the store: an update reads the newest
state and writes the other slot, and the shard's *committed* state (what checkpoints read and what a failed run
leaves) moves to the new slot only when the step commits: once the training thread has finished the step
(:meth:`CpuAdam.schedule`, after every gradient is in and nothing can skip it any more) and every update of the step
has run. Until then the previous master and moments stay in the store. An exception before the step is finished
(in backward, in a hook, Ctrl-C) leaves the committed state at the last step; :meth:`CpuAdam.abort` then undoes the
updates that already ran (puts the committed values back where the pager reads compute copies). Updates still run
while backward runs: committing costs the second slot on disk, and writing fp32 masters kept in the host cache
back to the store each step.

The parts, each in its own module: gradient accumulation and back-pressure
(:mod:`~lightning_ratel.runtime.accumulation`), the commit/abort ledger (:mod:`~lightning_ratel.runtime.ledger`), the
buffer sets and reads ahead (:mod:`~lightning_ratel.runtime.state_buffers`) and the AdamW arithmetic
(:mod:`~lightning_ratel.runtime.adamw`). This module holds the worker: its jobs, their dispatch, and the update with
its write-back.

Threads. Jobs reach the worker as typed records through one queue. The accumulator, the ledger and the buffer sets
belong to the worker thread. The training thread reads them only while the worker is idle:
:meth:`CpuAdam.unscale_`, :meth:`CpuAdam.clip_`, :meth:`CpuAdam.param_steps`, :meth:`CpuAdam.load_state` and
:meth:`CpuAdam.moments_on_store` first wait for everything handed over so far; :meth:`CpuAdam.resolve` reads the kept
gradients while speculative updates still run, which only read them too. The gradient budget is the one object both
threads use, under its own lock.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from lightning_ratel.runtime.accumulation import GradientAccumulator, GradientBudget
from lightning_ratel.runtime.adamw import GroupHyper, adamw_step
from lightning_ratel.runtime.checksum import blocks_of
from lightning_ratel.runtime.generic import GenericUpdate
from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.ledger import StepLedger
from lightning_ratel.runtime.pool import BufferPool
from lightning_ratel.runtime.state_buffers import BUFFER_SETS, Loaded, SlotViews, StateBuffers, StateBufferSet
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.timeline import Timeline
from lightning_ratel.runtime.units import Shard

_OPENMP_BACKEND = "parallel backend: OpenMP" in torch.__config__.parallel_info()

Outcome = Literal["stand", "redo", "skip"]
"""How :meth:`CpuAdam.resolve` settles a speculative step."""


def clip_coefficient(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s clamped coefficient, from the same reductions over the same gradients.

    Args:
        grads: the gradients, in the optimizer's parameter order.
        max_norm: the largest total 2-norm allowed.

    Returns:
        A 0-dim tensor: ``max_norm / (norm + 1e-6)`` clamped to at most 1.0.
    """
    total_norm = torch.nn.utils.get_total_norm(grads, 2.0)
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


@dataclass(frozen=True)
class StepPlan:
    """How this optimizer step's updates run.

    Attributes:
        hyper: hyperparameters per group (:class:`GroupHyper` for the fused AdamW, each group's settings as a dict
            for another optimizer).
        overlap: updates start during backward, as each shard's gradients complete. Otherwise global transforms
            (norm clipping, loss unscaling) are applied by :meth:`CpuAdam.finish` once backward has ended, and then
            the updates are scheduled.
        speculative: with ``overlap``: each update runs as if the clip coefficient were 1 and no gradient overflowed,
            and the shard keeps its gradient until :meth:`CpuAdam.resolve` knows; a wrong guess is undone and redone
            from the committed state (or dropped on an overflow).
        inv_scale: with ``overlap``: the reciprocal of the fp16 loss scale, multiplied into each shard's gradients
            when they complete (as ``torch.amp.GradScaler.unscale_``), which also checks them for inf/NaN.
        clip_value: the element-wise clip each shard applies to its own gradients before its update.
    """

    hyper: list[GroupHyper] | list[dict[str, Any]]
    overlap: bool
    speculative: bool = False
    inv_scale: torch.Tensor | None = None
    clip_value: float | None = None


class StepOptimizer(Protocol):
    """What :func:`finish_step` needs: the CPU optimizer of one process or of one rank among several."""

    def unscale_(self, shards: Sequence[Shard], loss_scale: torch.Tensor) -> bool: ...

    def clip_(self, shards: Sequence[Shard], value: float, algorithm: str) -> bool: ...

    def discard(self, shards: Sequence[Shard]) -> None: ...

    def schedule(self, plan: StepPlan, shards: Sequence[Shard]) -> None: ...

    def resolve(self, shards: Sequence[Shard], max_norm: float | None) -> Outcome: ...


@dataclass(frozen=True)
class Finished:
    """How :meth:`CpuAdam.finish` ended a step.

    Attributes:
        taken: the step's updates are scheduled (``False``: no shard had a gradient, or an fp16 overflow skipped it).
        missed: the norm clipped or the gradients overflowed, so a speculative update would not have stood (the
            predictor of the next step's speculation).
    """

    taken: bool
    missed: bool = False


def finish_step(optimizer: StepOptimizer, shards: list[Shard], plan: StepPlan, unit_order: Sequence[int],
                loss_scale: torch.Tensor | None, clip: tuple[float, str] | None) -> Finished:
    """Finish a step on ``shards`` (its window) as :meth:`CpuAdam.finish` describes."""
    if not shards:
        return Finished(False)
    missed = False
    if plan.speculative:
        outcome = optimizer.resolve(shards, clip[0] if clip is not None and clip[1] == "norm" else None)
        if outcome == "skip":
            return Finished(False, missed=True)
        missed = outcome != "stand"
    elif not plan.overlap:
        if loss_scale is not None and not optimizer.unscale_(shards, loss_scale):
            optimizer.discard(shards)
            return Finished(False, missed=True)
        missed = clip is not None and optimizer.clip_(shards, *clip)
    position: dict[int, int] = {}
    for i, unit in enumerate(unit_order):
        position.setdefault(unit, i)
    optimizer.schedule(plan, sorted(shards, key=lambda s: position.get(s.unit.index, len(unit_order))))
    return Finished(True, missed)


@dataclass(frozen=True)
class _Gradient:
    shard: Shard
    position: int
    grad: torch.Tensor
    event: Any
    start: int | None = None


@dataclass(frozen=True)
class _Gradients:
    """Gradients handed over together, in the order they arrived (see :meth:`CpuAdam.gradient`)."""

    items: tuple[_Gradient, ...]


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
class _Gather:
    shards: tuple[Shard, ...]
    future: Future


@dataclass(frozen=True)
class _Undo:
    coef: torch.Tensor | None
    future: Future


@dataclass(frozen=True)
class _Abort:
    future: Future


@dataclass(frozen=True)
class _Assign:
    shard: Shard
    master: torch.Tensor
    future: Future


@dataclass(frozen=True)
class _Written:
    buffers: StateBufferSet | SlotViews


@dataclass(frozen=True)
class _WriteLanded:
    """A write-back that a barrier waits for landed after its buffer set had come back."""


@dataclass(frozen=True)
class _Barrier:
    future: Future
    include_writes: bool


@dataclass(frozen=True)
class _TakenIn:
    """Resolved once the worker has handled every job before it (see :meth:`CpuAdam.take_in`)."""

    future: Future


@dataclass(frozen=True)
class _Stop:
    pass


_Job = (_Gradients | _Begin | _Schedule | _Discard | _Gather | _Undo | _Abort | _Assign | _Written | _WriteLanded
        | _Barrier | _TakenIn | _Stop)


@dataclass(frozen=True)
class _Queued:
    """An update waiting for a buffer set (``loaded`` is ``None``) or for its reads and its turn; ``urgent``: queued
    when its step was finished, so the next forward waits for it and its reads go before queued write-backs."""

    shard: Shard
    plan: StepPlan
    step: int
    loaded: Loaded | None = None
    urgent: bool = False


class CpuAdam:
    """Consumes gradients as backward produces them and updates shards on the CPU, overlapped with backward.

    Args:
        shards: every shard the optimizer holds, in the order of their units' forward.
        store: the swap store holding masters and moments.
        depth: buffer sets in flight (reading ahead, computing, writing back), in sets that hold the largest shard: a
            fraction buys a smaller set (:func:`~lightning_ratel.runtime.state_buffers.set_capacities`).
        timeline: where updates and reads ahead are recorded; a new one by default.
        compute_on_store: the pager reads compute copies from the store, so an update writes the new compute copy
            there (the fp32 master itself for fp32 shards) and a unit is ready only once those writes have landed.
        grad_budget_bytes: gradient bytes (pooled buffers plus gradients handed over but not yet taken in) above
            which :meth:`gradient` waits for the worker to release some; ``None`` never waits.
        threads: OpenMP threads of the worker (the AdamW kernel and its torch operations); defaults to
            ``torch.get_num_threads()``. Training on the CPU itself wants 1: a second thread team on cores the
            compute team already fills makes OpenMP stop spinning between parallel regions in both teams, and every
            region of the forward and backward then waits for sleeping threads to wake.
        generic: the update of an optimizer other than AdamW/Adam (its own step, its state records); ``None`` runs
            the fused AdamW.
    """

    def __init__(self, shards: Sequence[Shard], store: TensorStore, depth: float = BUFFER_SETS,
                 timeline: Timeline | None = None, compute_on_store: bool = False,
                 grad_budget_bytes: int | None = None, threads: int | None = None,
                 generic: GenericUpdate | None = None) -> None:
        self.shards = list(shards)
        self.generic = generic
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.store = store
        self.compute_on_store = compute_on_store
        self.timeline = timeline if timeline is not None else Timeline()
        self.ledger = StepLedger(self.shards)
        self._reserve_slots()
        self.accumulator = GradientAccumulator(self.shards)
        self.budget = GradientBudget(grad_budget_bytes, lambda: self.accumulator.pool.nbytes_in_use)
        self.buffers = StateBuffers(self.shards, store, self.ledger, self.timeline, depth, compute_on_store, generic)
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        # Gradients handed over and not queued yet, in arrival order, and the positions each shard has among them:
        # they are queued together once one completes its shard, or before any other job, so that the worker wakes
        # (and takes the GIL, and a core from the compute's threads) once per shard rather than once per parameter.
        self._held: list[_Gradient] = []
        self._held_positions: dict[int, set[int]] = {}
        self._held_lock = threading.Lock()
        # Updates waiting for a buffer set, then for their reads and their turn (worker thread).
        self._ready: deque[_Queued] = deque()
        self._inflight: deque[_Queued] = deque()
        # Shards whose update of this window is queued (or found nothing to do).
        self._scheduled: set[int] = set()
        self._barriers: list[_Barrier] = []
        # The write-back a barrier waiting for writes has asked to be woken for, once its buffer set came back.
        self._awaited: Future | None = None
        self._error: BaseException | None = None
        self._plan: StepPlan | None = None
        # Shards that received a gradient since the last finish or discard: added on autograd's thread, taken on the
        # training thread once backward has finished.
        self._window: set[int] = set()
        # The boundary micro-batch's fp16 overflow flag (GradScaler's ``found_inf``) and the shards unscaled so far.
        self._found_inf = torch.zeros(1)
        self._unscaled: set[int] = set()
        # The speculative step not resolved yet, if any: its updates keep their shards' gradients, which a redo needs.
        # Per step: updates of the step before may still run after the next one began, and must release theirs.
        self._keep_step: int | None = None
        # The newest step committed, for the training thread (the device tier commits its updates with it).
        self._committed_step = 0
        self._committed_cond = threading.Condition()
        # The AdamW kernel's checksums of the new master and moments of one shard, handed to the store with their
        # writes (worker thread); allocated once, for the largest shard, on first use.
        self._block_sums: torch.Tensor | None = None
        self.counts: Counter[str] = Counter()
        """Updates by how they were queued: ``overlapped`` (during backward), ``deferred`` (when the step was finished,
        a redo included); and speculative updates undone: ``redone`` (the norm clipped), ``dropped`` (an overflow).
        Worker thread; read it after :meth:`barrier`."""
        self._worker = threading.Thread(target=self._run, name="ratel-cpu-adam", daemon=True)
        self._worker.start()

    def _reserve_slots(self) -> None:
        """Lay out both state slots of every shard in the store, and give masters kept in the host cache their first
        copy in the store (a step abandoned halfway restores them from there)."""
        for shard in self.shards:
            for what, nbytes in self.state_sizes(shard).items():
                for slot in (0, 1):
                    self.store.reserve(shard.key(what, slot), nbytes)
        self.store.preallocate()
        writes = [self.store.write(shard.key("master"), shard.host_master())
                  for shard in self.shards if shard.master_in_host]
        for write in writes:
            write.result()

    def state_sizes(self, shard: Shard) -> dict[str, int]:
        """Bytes of each flat state of ``shard`` in one slot of the store: its master, and its moments (AdamW/Adam)
        or its state record (another optimizer, where it has any state)."""
        if self.generic is None:
            return {what: shard.numel * 4 for what in ("master", "exp_avg", "exp_avg_sq")}
        record = self.generic.nbytes(shard)
        return {"master": shard.numel * 4, **({"state": record} if record else {})}

    @property
    def grads(self) -> BufferPool:
        """The pool of gradient buffers."""
        return self.accumulator.pool

    @property
    def host_buffer_bytes(self) -> int:
        """Host bytes of the state buffer sets and the gradient pool."""
        return self.buffers.nbytes + self.accumulator.nbytes

    # ------------------------------------------------------------------ autograd thread

    def gradient(self, shard: Shard, position: int, grad: torch.Tensor, event: Any, start: int | None = None
                 ) -> None:
        """Hand over the gradient of ``shard.params[position]``, already on (or travelling to) host memory; with
        ``start``, the flat part of it from that element on (a parameter's parts come in order, and it counts as
        delivered with its last one).

        The worker gets it with the other gradients held once this one completes its shard (or before the next job
        of any other kind); handing them over waits first while the gradients held exceed the budget (see
        :class:`~lightning_ratel.runtime.accumulation.GradientBudget`)."""
        self._window.add(shard.index)
        with self._held_lock:
            self._held.append(_Gradient(shard, position, grad, event, start))
            if start is not None and start + grad.numel() < shard.params[position].numel:
                return
            positions = self._held_positions.setdefault(shard.index, set())
            positions.add(position)
            if len(positions) == len(shard.params):
                self._queue(None)

    def _put(self, job: _Job) -> None:
        """Queue ``job`` after the gradients held (any thread but the worker)."""
        with self._held_lock:
            self._queue(job)

    def _queue(self, job: _Job | None) -> None:
        """Queue the gradients held, then ``job`` (under ``_held_lock``)."""
        if self._held:
            held, self._held = tuple(self._held), []
            self._held_positions.clear()
            self.budget.wait_for_room(sum(g.grad.numel() * g.grad.element_size() for g in held))
            self._jobs.put(_Gradients(held))
        if job is not None:
            self._jobs.put(job)

    # ------------------------------------------------------------------ training thread

    def begin(self, plan: StepPlan | None) -> None:
        """Start a micro-batch; ``plan`` is set on the boundary micro-batch of an accumulation window."""
        self._put(_Begin(plan))

    def finish(self, plan: StepPlan, unit_order: Sequence[int], loss_scale: torch.Tensor | None = None,
               clip: tuple[float, str] | None = None) -> Finished:
        """Finish the step on the shards that received a gradient since the last one (after backward). Where ``plan``
        deferred the updates to now, first divide the gradients by ``loss_scale`` and drop them if one is not finite,
        then clip them by ``clip`` (value, algorithm: see :meth:`clip_`); where it speculated, settle the updates that
        ran (:meth:`resolve`). The updates are scheduled units first in ``unit_order`` (the forward's order; units it
        does not list last), so the next forward waits least.

        Returns:
            Whether the step is taken (``False`` when no shard received a gradient or an overflow skipped it), and
            whether a speculative update would have missed.
        """
        return finish_step(self, self.take_window(), plan, unit_order, loss_scale, clip)

    def discard_window(self) -> None:
        """Drop the gradients received since the last step without updating anything (``zero_grad``)."""
        shards = self.take_window()
        if shards:
            self.discard(shards)

    def take_window(self) -> list[Shard]:
        """The shards that received a gradient since the last step, in forward order; the next window starts empty."""
        window, self._window = self._window, set()
        return [s for s in self.shards if s.index in window]

    def schedule(self, plan: StepPlan, shards: Sequence[Shard]) -> None:
        """Close the step: update ``shards`` under ``plan`` (those not already updated during backward); the step
        commits once they all have run.

        Each shard's unit stops being ready now, on the calling thread, so that a forward paging it in after this call
        waits for the update (which may also have run already).
        """
        for shard in shards:
            shard.unit.ready.expect()
        self._put(_Schedule(plan, tuple(shards)))

    def discard(self, shards: Sequence[Shard]) -> None:
        """Drop the gradients ``shards`` hold without updating them (a skipped step), and any states read ahead."""
        self._put(_Discard(tuple(shards)))

    def abort(self) -> None:
        """Abandon the step the training thread has not finished (an exception stopped it): drop its gradients and
        queued updates, and undo the updates that already ran, so every shard is at its committed state again (also
        where the pager reads it). A step already finished still completes and commits. Waits until done."""
        future: Future = Future()
        self._put(_Abort(future))
        self.barrier()
        future.result()

    def resolve(self, shards: Sequence[Shard], max_norm: float | None) -> Outcome:
        """Settle a speculative step once backward has ended: say whether the updates it ran during backward stand.

        The worker first unscales the gradients no completed shard unscaled yet (fp16). The norm is then computed here,
        on the training thread, from the gradients the shards kept, exactly as :meth:`clip_` computes it (the same
        reductions with the same threads), while the worker goes on with the updates still queued. Where nothing
        overflowed and the clip coefficient is 1 (torch's multiply by it then changes no bit) the updates stand.
        Otherwise they are undone (:meth:`abort`'s way, the committed slots were never written): on an overflow the
        gradients are dropped; on a clip they are multiplied by the coefficient and :meth:`schedule` then updates
        every shard again from its committed state, as the deferred path would have.

        Args:
            shards: the shards holding gradients this step.
            max_norm: the norm to clip to, or ``None``.

        Returns:
            ``"stand"`` or ``"redo"``: schedule the step; ``"skip"``: an overflow, the step is not taken.
        """
        finite, grads, _ = self.kept_gradients(shards)
        if not finite:
            self.undo_speculation(None)
            return "skip"
        if max_norm is None:
            return "stand"
        coef = clip_coefficient(grads, max_norm)
        if coef.item() == 1.0:
            return "stand"
        self.undo_speculation(coef)
        return "redo"

    def kept_gradients(self, shards: Sequence[Shard]) -> tuple[bool, list[torch.Tensor], list[int]]:
        """The first half of :meth:`resolve`: once the worker has unscaled what no completed shard unscaled yet,
        whether every gradient of the step is finite, and the gradients ``shards`` kept, in the optimizer's parameter
        order, with their parameters' positions in that order (for a norm over several ranks' shards)."""
        future: Future = Future()
        self._put(_Gather(tuple(shards), future))
        return self._wait(future)

    def undo_speculation(self, coef: torch.Tensor | None) -> None:
        """The second half of :meth:`resolve` where the guess missed: undo the speculative updates of the open step,
        then clip its gradients by ``coef`` (or drop them, for ``None``). Waits: until the undo is done the units
        those updates completed still look ready to the pager."""
        future: Future = Future()
        self._put(_Undo(coef, future))
        self._wait(future)

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

    def clip_(self, shards: Sequence[Shard], value: float, algorithm: str) -> bool:
        """Clip the gradients of ``shards`` as ``torch.nn.utils.clip_grad_norm_`` (``"norm"``, the same reductions
        and the same clamped coefficient) or ``clip_grad_value_`` (``"value"``) would.

        Returns:
            Whether the norm clipped (its coefficient was below 1): a speculative update would have been redone.
        """
        grads = self._ordered_grads(shards)
        if algorithm == "norm":
            coef = clip_coefficient(grads, value)
            torch._foreach_mul_(grads, coef)
            return coef.item() != 1.0
        for g in grads:
            g.clamp_(min=-value, max=value)
        return False

    def gradients(self, shards: Sequence[Shard]) -> tuple[list[torch.Tensor], list[int]]:
        """After every gradient is taken in: the gradients of ``shards`` that arrived, in the optimizer's parameter
        order, and their parameters' positions in that order (for a norm over several ranks' shards)."""
        self.barrier()
        indexed = self.accumulator.indexed_views(shards)
        return [v for _, v in indexed], [i for i, _ in indexed]

    def _ordered_grads(self, shards: Sequence[Shard]) -> list[torch.Tensor]:
        """After every gradient is taken in: the gradients that arrived, in the optimizer's parameter order."""
        self.barrier()
        return self.accumulator.views(shards)

    def committed_through(self) -> int:
        """The newest step committed (steps are numbered by boundary micro-batch, from 1; 0: none yet). Any thread."""
        with self._committed_cond:
            return self._committed_step

    def wait_committed(self, step: int) -> None:
        """Wait until ``step`` committed, or raise the error that stopped the worker first. Any thread but the
        worker's; ``step`` must be finished (:meth:`schedule`), or this waits forever."""
        with self._committed_cond:
            while self._committed_step < step:
                if self._error is not None:
                    raise RuntimeError(f"the CPU optimizer failed before step {step} committed: {self._error!r}"
                                       ) from self._error
                if not self._worker.is_alive():
                    raise RuntimeError("the CPU optimizer worker stopped")
                self._committed_cond.wait(timeout=1.0)

    def take_in(self) -> None:
        """Wait until the worker has taken in every gradient handed over so far (those held for an incomplete shard
        too), and dropped them: it folded them into its window. Unlike :meth:`barrier` it waits for no update beyond
        the one the worker may be running. Any thread but the worker's."""
        future: Future = Future()
        self._put(_TakenIn(future))
        self._wait(future)

    def barrier(self, include_writes: bool = False) -> None:
        """Wait until all work handed over so far is done (and, optionally, written back); re-raise its error."""
        future: Future = Future()
        self._put(_Barrier(future, include_writes))
        self._wait(future)

    def _wait(self, future: Future) -> Any:
        """The result of a job's ``future``, or an error once the worker has stopped without giving one."""
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if not self._worker.is_alive():
                    raise RuntimeError(f"the CPU optimizer worker stopped: {self._error!r}") from self._error

    def close(self) -> None:
        """Stop the worker and free the buffers (whatever still references this object keeps no memory)."""
        self._put(_Stop())
        self._worker.join()
        self.buffers.release_memory()
        self._inflight.clear()
        self.accumulator.release_memory()

    def release_memory(self) -> None:
        """Free the state buffers and pooled gradient buffers once no more updates will run (before teardown gathers
        state into host memory). Waits for pending work first."""
        # A run stopped inside a boundary micro-batch may still hold states read ahead.
        self.discard([])
        self.barrier(include_writes=True)
        self.buffers.release_memory()
        self.accumulator.release_memory()

    def check(self) -> None:
        """Raise the worker's error, if it had one."""
        if self._error is not None:
            raise self._error

    def state_key(self, shard: Shard, what: str) -> str:
        """The store key holding ``shard``'s committed ``master``, ``exp_avg``, ``exp_avg_sq`` or ``state`` (the values
        of the last step taken). Every update handed over so far must have run: call :meth:`barrier` first."""
        return shard.key(what, self.ledger.committed(shard).slot)

    def param_steps(self, shard: Shard) -> list[int]:
        """``torch.optim.AdamW``'s committed step count of each parameter of ``shard`` (0: never updated)."""
        self.barrier(include_writes=True)
        return list(self.ledger.committed(shard).steps)

    def moments_on_store(self, shard: Shard) -> bool:
        """Whether ``shard``'s committed moments were ever written (otherwise they are zeros)."""
        self.barrier(include_writes=True)
        return self.ledger.committed(shard).moments

    def load_state(self, shard: Shard, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: Sequence[int]) -> None:
        """Replace ``shard``'s committed moments and step counts (from a checkpoint)."""
        self.barrier(include_writes=True)
        slot = self.ledger.committed(shard).slot
        self.store.write(shard.key("exp_avg", slot), exp_avg).result()
        self.store.write(shard.key("exp_avg_sq", slot), exp_avg_sq).result()
        self.ledger.load(shard, steps)

    def load_record(self, shard: Shard, record: torch.Tensor, steps: Sequence[int]) -> None:
        """Replace ``shard``'s committed state record (another optimizer than AdamW/Adam) and update counts."""
        self.barrier(include_writes=True)
        if record.numel():
            self.store.write(shard.key("state", self.ledger.committed(shard).slot), record).result()
        self.ledger.load(shard, steps)

    def assign(self, shard: Shard, master: torch.Tensor) -> None:
        """Give ``shard`` new values between steps (a callback or ``load_state_dict`` wrote its parameters): ``master``
        (fp32, the shard's flat layout) replaces its committed master and its compute copy wherever the pager reads it,
        as a committed step would; moments and step counts stay as they are. Waits until done."""
        self.barrier(include_writes=True)
        future: Future = Future()
        self._put(_Assign(shard, master, future))
        self.barrier()
        future.result()

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
        if self._error is None:
            self._error = err
        with self._committed_cond:
            self._committed_cond.notify_all()
        # Nobody may wait forever for an update that will not come.
        self.budget.fail()
        for shard in self.shards:
            shard.unit.ready.fail(err)
        self._ready.clear()

    def _handle(self, job: _Job) -> None:
        if isinstance(job, _Gradients):
            for item in job.items:
                self._take_gradient(item)
        elif isinstance(job, _Begin):
            self._plan = job.plan
            if job.plan is not None:
                self.ledger.open_step()
                self._found_inf.zero_()
                self._unscaled.clear()
                self._keep_step = self.ledger.step if job.plan.speculative else None
                self.budget.keeping(job.plan.speculative)
            self.buffers.start_micro_batch(boundary=job.plan is not None)
            self._scheduled.clear()
            self.accumulator.new_micro_batch()
        elif isinstance(job, _Schedule):
            if self._keep_step is not None:
                self._stop_keeping()
            for shard in job.shards:
                if shard.index not in self._scheduled:
                    self._enqueue(shard, job.plan, "deferred")
            # Every update of the step is queued: states read ahead for shards without one are dropped.
            pending = {shard.index for shard in self.shards if self.ledger.pending(shard)}
            self.buffers.stop_reading_ahead(keep=pending.__contains__)
            self.ledger.decide()
            self._commit()
        elif isinstance(job, _Discard):
            for shard in job.shards:
                self.accumulator.clear(shard)
            self.buffers.reading_ahead = False
            self.buffers.drop_ahead()
        elif isinstance(job, _Gather):
            try:
                self._gather(job.shards, job.future)
            except BaseException as err:
                job.future.set_exception(err)
        elif isinstance(job, _Undo):
            try:
                self._redo(job.coef)
            except BaseException as err:
                job.future.set_exception(err)
            else:
                job.future.set_result(None)
        elif isinstance(job, _Abort):
            self._abort()
            job.future.set_result(None)
        elif isinstance(job, _Assign):
            try:
                self._assign(job.shard, job.master)
            except BaseException as err:
                job.future.set_exception(err)
            else:
                job.future.set_result(None)
        elif isinstance(job, _Written):
            self.buffers.written(job.buffers)
        elif isinstance(job, _WriteLanded):
            self._awaited = None
        elif isinstance(job, _Barrier):
            self._barriers.append(job)
        elif isinstance(job, _TakenIn):
            job.future.set_result(None)

    def _take_gradient(self, job: _Gradient) -> None:
        shard, position, grad = job.shard, job.position, job.grad
        self.budget.taken(grad.numel() * grad.element_size())
        if self._error is not None:
            return
        job.event.synchronize()
        plan = self._plan
        overlap = plan is not None and plan.overlap
        if overlap and shard.index in self._scheduled:
            raise RuntimeError(
                f"a gradient of {shard.params[position].name} arrived after its shard was updated; RatelStrategy "
                "expects each parameter's gradient once per backward pass"
            )
        complete = self.accumulator.add(shard, position, grad, job.start)
        if overlap and complete:
            assert plan is not None
            if plan.inv_scale is not None:
                self._unscale([shard], plan.inv_scale)
            if plan.speculative and self._found_inf.item():
                # The step will be skipped: an update now would only be undone.
                self._scheduled.add(shard.index)
            else:
                self._enqueue(shard, plan, "overlapped")

    def _enqueue(self, shard: Shard, plan: StepPlan, kind: str) -> None:
        self._scheduled.add(shard.index)
        if self.accumulator.holds(shard):
            step = self.ledger.queue(shard)
            self._ready.append(_Queued(shard, plan, step, urgent=kind == "deferred"))
            self.buffers.queued(shard)
            self.budget.updates_queued(1)
            self.counts[kind] += 1

    def _unscale(self, shards: Sequence[Shard], inv_scale: torch.Tensor) -> None:
        """Unscale the gradients of those of ``shards`` not unscaled yet this step, into the step's overflow flag
        (``torch.amp.GradScaler.unscale_``'s operation: element-wise, so shard by shard gives the same bits)."""
        todo = [s for s in shards if s.index not in self._unscaled and self.accumulator.holds(s)]
        self._unscaled.update(s.index for s in todo)
        if todo:
            torch._amp_foreach_non_finite_check_and_unscale_(self.accumulator.views(todo), self._found_inf, inv_scale)

    def _gather(self, shards: Sequence[Shard], future: Future) -> None:
        """See :meth:`resolve` (worker thread): unscale what is left, hand over the overflow flag and the gradients.
        Every gradient handed over before is in (jobs run in order); the updates still queued only read them."""
        if self._error is not None:
            raise self._error
        plan = self._plan
        assert plan is not None and plan.speculative
        if plan.inv_scale is not None:
            self._unscale(shards, plan.inv_scale)
        indexed = self.accumulator.indexed_views(shards)
        future.set_result((self._found_inf.item() == 0, [v for _, v in indexed], [i for i, _ in indexed]))

    def _redo(self, coef: torch.Tensor | None) -> None:
        """See :meth:`resolve` (worker thread): undo the open step's updates; clip its gradients by ``coef`` for the
        updates :meth:`schedule` queues again, or drop them (``None``)."""
        undone = self._undo_open_step()
        held = [shard for shard in self.shards if self.accumulator.holds(shard)]
        if coef is None:
            self.counts["dropped"] += undone
            for shard in held:
                self.accumulator.clear(shard)
            self.buffers.reading_ahead = False
            self.buffers.drop_ahead()
            return
        self.counts["redone"] += undone
        if held:
            torch._foreach_mul_(self.accumulator.views(held), coef)
        # Every shard is updated again, in the order schedule gives, from the committed state (reads ahead of shards
        # not updated yet hold it too: the committed slots were not written).
        self._scheduled.clear()

    def _stop_keeping(self) -> None:
        """The speculative updates stand: the gradients of those that ran are not needed any more."""
        self._keep_step = None
        self.budget.keeping(False)
        for shard in self.shards:
            if shard.index in self._scheduled and not self.ledger.pending(shard):
                self.accumulator.clear(shard)

    def _undo_open_step(self) -> int:
        """Take the open step's updates off the queues and undo those that ran: the ledger forgets them and their
        shards get their committed values back, also where the pager reads them. Returns how many were undone or
        dropped."""
        step = self.ledger.step
        dropped = [item for item in (*self._ready, *self._inflight) if item.step == step]
        self._ready = deque(item for item in self._ready if item.step != step)
        self._inflight = deque(item for item in self._inflight if item.step != step)
        for item in dropped:
            if item.loaded is not None:
                self.buffers.give_back(item.loaded)
        self.budget.updates_queued(-len(dropped))
        _, reverted = self.ledger.abort(item.shard for item in dropped)
        for shard in reverted:
            self._revert(shard)
        self._keep_step = None
        self.budget.keeping(False)
        self.buffers.forget_order()
        return len(dropped) + len(reverted)

    def _commit(self) -> None:
        for step in self.ledger.commit():
            self.timeline.record(f"commit:{step}")
            with self._committed_cond:
                self._committed_step = step
                self._committed_cond.notify_all()

    def _abort(self) -> None:
        """See :meth:`abort` (worker thread)."""
        step = None
        if not self.ledger.decided(self.ledger.step):
            step = self.ledger.step
            self._undo_open_step()
        for shard in self.shards:
            # The gradients of a finished step's update still to run are its input.
            if not self.ledger.pending(shard):
                self.accumulator.clear(shard)
                self._scheduled.discard(shard.index)
        self.buffers.reading_ahead = False
        self.buffers.drop_ahead()
        self.buffers.forget_order()
        self.timeline.record(f"abort:{step if step is not None else -1}")

    def _revert(self, shard: Shard) -> None:
        """Put ``shard``'s committed values back where the pager reads its compute copy (the ledger already forgot its
        update)."""
        self.buffers.settle(shard)
        master_key = shard.key("master", self.ledger.committed(shard).slot)
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

    def _assign(self, shard: Shard, master: torch.Tensor) -> None:
        """See :meth:`assign` (worker thread)."""
        if self.ledger.pending(shard):
            raise RuntimeError(f"shard {shard.index} was given new values while an update of it is pending")
        # States read ahead hold the old master.
        if shard.index in self.buffers.ahead:
            self.buffers.give_back(self.buffers.ahead.pop(shard.index))
        self.buffers.settle(shard)
        self.store.write(self.state_key(shard, "master"), master).result()
        if shard.master_in_host:
            shard.host_master().copy_(master)
        elif not self.compute_on_store:
            shard.compute_view(shard.unit.host[shard.dtype]).copy_(master)
        elif shard.dtype != torch.float32:
            # An fp32 shard's compute copy on the store is its committed master, written above.
            self.store.write(shard.compute_key, master.to(shard.dtype)).result()

    def _advance(self) -> None:
        while True:
            while self._ready and self._error is None:
                loaded = self.buffers.take(self._ready[0].shard, urgent=self._ready[0].urgent)
                if loaded is None:
                    break
                item = self._ready.popleft()
                self._inflight.append(_Queued(item.shard, item.plan, item.step, loaded, item.urgent))
            if self._error is None:
                self.buffers.read_ahead(
                    skip=lambda shard: shard.index in self._scheduled or self.ledger.pending(shard))
            # Gradients are cheap to take in and unblock backward's memory; updates wait for an empty queue.
            if not self._inflight or not self._jobs.empty() or self._error is not None:
                return
            item = self._inflight.popleft()
            assert item.loaded is not None
            self._update(item.shard, item.plan, item.step, *item.loaded)
            self._commit()

    def _update(self, shard: Shard, plan: StepPlan, step: int, b: StateBufferSet | SlotViews,
                reads: list[Future]) -> None:
        for r in reads:
            r.result()
        # The update changes the master in place: no page-in may copy it from here any more.
        self.buffers.unshare(b)
        self.timeline.record(f"update_start:{shard.index}")
        version = self.ledger.latest(shard)
        # States updated in place must be in the slot this update writes, not in the one it reads.
        assert not isinstance(b, SlotViews) or b.slot == 1 - version.slot
        n = shard.numel
        master = shard.host_master() if shard.master_in_host else b.master[:n]
        grad = self.accumulator.grad(shard)
        if plan.clip_value is not None:
            grad.clamp_(min=-plan.clip_value, max=plan.clip_value)
        out = self._compute_out(shard, b)
        with_grad = self.accumulator.with_grad(shard)
        steps = list(version.steps)
        sums: dict[str, torch.Tensor] = {}
        if self.generic is not None:
            states = {"state": b.state[: self.generic.nbytes(shard)]}
            settings = plan.hyper[shard.group]
            assert isinstance(settings, dict)
            self.generic.update(shard, master, grad, states["state"], with_grad, [steps[i] == 0 for i in with_grad],
                                settings)
            if out is not None:
                # Parameters without a gradient keep their values, so the whole copy is theirs too.
                out.copy_(master)
        else:
            states = {"exp_avg": b.exp_avg[:n], "exp_avg_sq": b.exp_avg_sq[:n]}
            sources = b.source if isinstance(b, SlotViews) else {}
            sums = self._adamw_shard(shard, plan, master, grad, states, out, with_grad, steps, version.moments,
                                     sources)
        for i in with_grad:
            steps[i] += 1
        slot = self.ledger.ran(shard, step, steps).slot
        if step != self._keep_step:
            self.accumulator.clear(shard)
        self.timeline.record(f"update_end:{shard.index}")
        writes = [self.store.write(shard.key(what, slot), flat, sums=sums.get(what))
                  for what, flat in states.items() if flat.numel()]
        # The new compute copy and master stay offered from the buffer set until it is reused (StateBuffers.read):
        # the next forward's page-in of the unit, which follows right behind updates run after backward, copies them
        # instead of reading back what was just written.
        if out is not None and self.compute_on_store:
            writes.append(self.store.write(shard.compute_key, out, share=True))
        writes.append(self.store.write(shard.key("master", slot), master, share=not shard.master_in_host,
                                       sums=sums.get("master")))
        # A master in the host cache (written last) does not hold the buffer set: the set goes back without waiting
        # for it, so the next update's reads need not queue behind it.
        done = self._joined(writes, b, len(writes) - 1 if shard.master_in_host else len(writes))
        self.buffers.writing(shard, done)
        # Only now, with the write-back recorded: a pager reading compute copies from the store waits for that write
        # (an fp32 shard's compute copy is its master, in the new slot), unless the store offers the copy: a read
        # then waits for the write itself, and the set offering it returns to the pool only once its writes landed.
        compute_key = shard.key("master", slot) if shard.dtype == torch.float32 else shard.compute_key
        moved = compute_key if self.compute_on_store and shard.dtype == torch.float32 else None
        offered = self.compute_on_store and self.store.shares(compute_key)
        shard.unit.ready.complete(done if self.compute_on_store and not offered else None, shard, moved,
                                  stored=done if self.compute_on_store else None)
        self.budget.updates_queued(-1)

    def _adamw_shard(self, shard: Shard, plan: StepPlan, master: torch.Tensor, grad: torch.Tensor,
                     moments: dict[str, torch.Tensor], out: torch.Tensor | None, with_grad: list[int],
                     steps: list[int], written: bool, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fused AdamW step of a shard: in one call where every parameter has a gradient and the same step
        count, else parameter by parameter. ``sources`` holds the states it reads from elsewhere (the latest slot,
        :attr:`~lightning_ratel.runtime.state_buffers.SlotViews.source`) instead of from ``master`` and ``moments``,
        which it then only writes. Returns the checksums of the new master and moments' blocks that the native kernel
        computed on the way, by state (empty where it did not), for their writes (:meth:`TensorStore.write
        <lightning_ratel.runtime.storage.TensorStore.write>`'s ``sums``)."""
        exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
        if not written:
            exp_avg.zero_()
            exp_avg_sq.zero_()
        hyper = plan.hyper[shard.group]
        assert isinstance(hyper, GroupHyper)
        states = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        source_args = {"master": "param_src", "exp_avg": "exp_avg_src", "exp_avg_sq": "exp_avg_sq_src"}
        if len(with_grad) == len(shard.params) and len({steps[i] for i in with_grad}) == 1:
            sums = self._sums_buffer(shard.numel)
            if self._adamw(master, grad, exp_avg, exp_avg_sq, out, hyper, steps[0] + 1, sums=sums,
                           **{source_args[what]: src for what, src in sources.items()}):
                return dict(zip(("master", "exp_avg", "exp_avg_sq"), sums.unbind()))
            return {}
        # Parameters without a gradient keep their states: the slot this update writes gets them as they are.
        stepped = set(with_grad)
        for i in (i for i in range(len(shard.params)) if i not in stepped):
            sl = slice(shard.params[i].offset, shard.params[i].offset + shard.params[i].numel)
            for what, src in sources.items():
                states[what][sl].copy_(src[sl])
        if out is not None and self.compute_on_store:
            # The whole staging buffer goes to the store: parameters without a gradient keep their copies.
            out.copy_(master)
        for i in with_grad:
            sp = shard.params[i]
            sl = slice(sp.offset, sp.offset + sp.numel)
            self._adamw(master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], out[sl] if out is not None else None,
                        hyper, steps[i] + 1, **{source_args[what]: src[sl] for what, src in sources.items()})
        return {}

    def _sums_buffer(self, numel: int) -> torch.Tensor:
        """Room for the kernel's block checksums of a shard of ``numel`` elements (three states), reused: the store
        turns them into its chunks' checksums before :meth:`_update`'s writes return."""
        blocks = blocks_of(numel * 4)
        if self._block_sums is None:
            self._block_sums = torch.empty(3 * blocks_of(max(shard.numel for shard in self.shards) * 4),
                                           dtype=torch.int64)
        return self._block_sums[: 3 * blocks].view(3, blocks)

    def _joined(self, writes: list[Future], buffers: StateBufferSet | SlotViews, holding: int) -> Future:
        """A future that completes when every write has (with the first error). The first ``holding`` writes read
        ``buffers`` (all of them for a state slot in host memory): ``buffers`` is handed back once those have ended,
        while the others (from the host cache) may still run."""
        if isinstance(buffers, SlotViews) or not holding:
            holding = len(writes)
        done: Future = Future()
        remaining = [holding, len(writes)]
        lock = threading.Lock()

        def finished(index: int, f: Future) -> None:
            with lock:
                if index < holding:
                    remaining[0] -= 1
                remaining[1] -= 1
                released = index < holding and remaining[0] == 0
                last = remaining[1] == 0
            if f.exception() is not None and not done.done():
                done.set_exception(f.exception())
            elif last and not done.done():
                done.set_result(None)
            if released:
                self._jobs.put(_Written(buffers))

        for index, w in enumerate(writes):
            w.add_done_callback(functools.partial(finished, index))
        return done

    def _compute_out(self, shard: Shard, b: StateBufferSet | SlotViews) -> torch.Tensor | None:
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
               out: torch.Tensor | None, h: GroupHyper, step: int, **kwargs: torch.Tensor) -> bool:
        return adamw_step()(master, grad, exp_avg, exp_avg_sq, out, h, step=step, num_threads=self.threads, **kwargs)

    def _writing(self) -> bool:
        """Whether a write-back is still running; one whose buffer set came back already wakes the worker when it
        lands (nothing else would)."""
        if self.buffers.writes_pending:
            return True
        landing = self.buffers.landing()
        if landing and self._awaited is None:
            self._awaited = landing[0]
            landing[0].add_done_callback(lambda _: self._jobs.put(_WriteLanded()))
        return bool(landing)

    def _resolve_barriers(self) -> None:
        if not self._barriers:
            return
        busy = bool(self._ready or self._inflight) and self._error is None
        keep = []
        for barrier in self._barriers:
            if self._error is not None:
                barrier.future.set_exception(self._error)
            elif busy or not self._jobs.empty() or (barrier.include_writes and self._writing()):
                keep.append(barrier)
            else:
                err = self.buffers.write_error()
                if err is not None:
                    self._fail(err)
                    barrier.future.set_exception(err)
                else:
                    barrier.future.set_result(None)
        self._barriers = keep
