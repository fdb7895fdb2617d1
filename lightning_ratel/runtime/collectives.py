"""Data-parallel training on torch.distributed: each unit's states and its update on one owner rank.

Every rank runs forward and backward on its own micro-batch and reads every unit's compute copy (the pager needs it)
from a host cache that the ranks of its node share (:class:`NodeCache`; each rank keeps its own where they cannot), or
with ``param_cache="ssd"`` from the swap files of the unit's owner, which the node's ranks read (:class:`NodeCopies`),
or where they cannot from its own (:class:`StoredCopies`), but only the units it owns
(:mod:`lightning_ratel.plan.owners`) have their fp32 master and optimizer states in its swap store and their update on
its CPU optimizer. :class:`DataParallelAdam` stands where :class:`~lightning_ratel.runtime.optimizer.CpuAdam` stands on
one rank and takes the same calls:

1. Gradients (autograd's thread) go to a per-rank exchange thread, ``ratel-grad-reduce``, which sums each shard's
   gradients of the accumulation window in an fp32 host buffer. On the boundary micro-batch a shard whose gradients
   are complete is multiplied by ``1 / world_size`` and reduced (summed) onto its owner, asynchronously, while backward
   goes on: the arithmetic of ``DistributedDataParallel`` (local sum of the window, pre-divided, summed over ranks).
   Shards are reduced in one fixed order on every rank (reverse forward order, the order backward completes them): a
   shard completed out of that order waits for the ones before it, and the end of backward reduces whatever is left,
   so the ranks always issue the same collectives in the same order. Each buffer carries, after the gradient, one flag
   per parameter (1: this rank has its gradient), so the owner knows which parameters got a gradient on any rank.
   That is ``gradient_exchange="window"``: every rank holds a window buffer of every shard. With ``"micro_batch"``
   (:class:`_MicroBatchExchange`, the planner's choice where host memory needs it) each micro-batch's gradients are
   reduced onto the owner in the same order, in buckets of one owner's parameters (one collective each, from a pool of
   two buffers reused every micro-batch), and the owner's ``CpuAdam`` sums the window as on one rank: no rank holds a
   window for shards it does not own, for one reduce per micro-batch instead of one per step (the sum over ranks and
   micro-batches is taken in another order than ``ddp``'s). ``"device"``, the choice on GPUs (:class:`_DeviceExchange`),
   reduces the same buckets on the device instead (:mod:`lightning_ratel.runtime.device_reduce`, NCCL on CUDA), so that
   only each owner's share of the gradients reaches host memory. With the states on the devices
   (``optimizer_states="device"``) the owner's reduced buckets stay there: its optimizer's device lane
   (:class:`~lightning_ratel.runtime.device_adam.DeviceAdam`) adds them up and updates the unit on the device.
2. The owner hands the reduced gradients to its ``CpuAdam``, which updates the shard as on one rank (overlapped with
   backward where the step allows it, speculatively under clipping by norm or fp16 loss scaling; clipping by norm and
   fp16 overflow checks use the norm and the overflow of all ranks, :meth:`DataParallelAdam.clip_`,
   :meth:`DataParallelAdam.unscale_` and, settling a speculative step, :meth:`DataParallelAdam.resolve`).
3. When the training thread finishes the step (:meth:`DataParallelAdam.schedule`) the ranks first agree that every one
   of them got there (a rank that raised never does, and the others then fail in that collective instead of
   committing), then a publisher thread, ``ratel-publish``, broadcasts each updated shard's new compute copy from its
   owner into every rank's host cache (or swap files), in the order the next forward needs them, and completes the
   unit's :class:`~lightning_ratel.runtime.units.UnitReady` there: the pager waits for it as for an update on one
   rank. With a shared cache the copy reaches each node once (the owner wrote it on its own node) and the node's
   writer of the unit tells the node's other ranks when it is there; with the copies shared in the swap files the
   owner announces where the new copy is and its checksums instead of sending it. The owner's update may overwrite the
   shared bytes during backward: it runs on the reduced gradient, so after every rank's backward has left the unit.
   With the states on the devices every rank's units are resident there, and each owner's new compute copies go to
   the other ranks as broadcasts on the device group, issued by the training thread, which the next forward follows.

Each thread issues its collectives on a process group of its own (gloo, on host memory, whatever the default backend;
the device reduces of ``"device"`` on the device's backend), so collectives of different threads never interleave
differently on two ranks. The training thread's own collectives (the agreement, the global norm and overflow, reading
another rank's states for a checkpoint) use a third group; they happen only where every rank runs the same code at the
same point (finishing a step, a checkpoint, the end of fit). With a shared cache both also have a group of the node's
ranks and, with several nodes, one of a rank per node.

A rank that raises never joins the collective the others wait in, and gloo notices only a rank whose process ended:
every wait of these collectives also watches the process group's store, where a failing rank reports itself
(:class:`Faults`), and raises :class:`RatelRankFailed` naming it. After a failure the ranks meet there again
(:meth:`DataParallelAdam.regroup`), so that they can still write the last committed step together (Lightning's
``OnExceptionCheckpoint``), or learn within a bounded time that a rank is gone. The collectives that Lightning's
loops and callbacks run through the strategy (barriers, broadcasts, the reductions of ``self.log(...,
sync_dist=True)``) are watched alike, on a gloo group of their own (:class:`WorldCollectives`), and share the run's
:class:`Faults` with the engine's.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_ratel.errors import RatelConfigError, RatelRankFailed
from lightning_ratel.runtime.buckets import (
    MICRO_BATCH_BUCKETS,
    Bucket,
    bucket_cap,
    bucket_places,
    cut_buckets,
    gradient_order,
    pack,
)
from lightning_ratel.runtime.device import DONE, Device
from lightning_ratel.runtime.device_reduce import DeviceReduce
from lightning_ratel.runtime.hostmem import ALIGNMENT, SharedHostMemory, aligned_empty
from lightning_ratel.runtime.hoststore import TieredStore
from lightning_ratel.runtime.optimizer import CpuAdam, Finished, Outcome, StepPlan, finish_step
from lightning_ratel.runtime.peerstore import PeerStore
from lightning_ratel.runtime.pool import HostPool
from lightning_ratel.runtime.units import Shard, Unit
from lightning_ratel.sizes import round_up


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the ranks training data parallel.

    Attributes:
        rank: its global rank.
        world: the number of ranks.
        local_world: the ranks on its node (they share its cores, drives and host memory).
        timeout: how long a collective of the engine's waits for the other ranks before it fails.
        local_rank: its place on its node; a node's ranks are consecutive (``rank - local_rank`` is the first), as
            Lightning and torchrun number them.
        fault_timeout: after a rank stopped on an error, how long the others wait for every rank to stop (the ranks
            still running finish the collective or step they are in first); a rank not stopped by then is taken as gone.
    """

    rank: int
    world: int
    local_world: int = 1
    timeout: timedelta | None = None
    local_rank: int = 0
    fault_timeout: timedelta = timedelta(minutes=2)

    @property
    def node_ranks(self) -> list[int]:
        """The global ranks on this node."""
        first = self.rank - self.local_rank
        return list(range(first, first + self.local_world))

    @property
    def nodes(self) -> int:
        """The number of nodes."""
        return self.world // self.local_world


def gather_outcomes(gather: Callable[[Any], list[Any]], step: Callable[[], Any], failed: str) -> list[Any]:
    """Run ``step`` here and learn every rank's outcome, so that where one rank fails every rank stops at the same
    point (none waits in a later collective for a rank that raised).

    Args:
        gather: the collective that hands every rank's picklable object to every rank, in rank order
            (:meth:`DataParallelAdam.gather_objects`).
        step: this rank's part; its result must pickle.
        failed: what a failure elsewhere means, for the error the other ranks raise.

    Returns:
        Every rank's result, in rank order.

    Raises:
        BaseException: the error of ``step`` on the rank where it failed; elsewhere a ``RuntimeError`` saying which
            rank failed and how.
    """
    error: BaseException | None = None
    try:
        outcome: tuple[bool, Any] = (True, step())
    except BaseException as err:  # noqa: BLE001 - the other ranks must hear of it, then it is raised
        error = err
        outcome = (False, f"{type(err).__name__}: {err}")
    outcomes = gather(outcome)
    if error is not None:
        raise error
    for rank, (ok, what) in enumerate(outcomes):
        if not ok:
            raise RuntimeError(f"{failed}: rank {rank} failed ({what})")
    return [what for _, what in outcomes]


def every_rank_agrees(ranks: Ranks, verdict: bool, faults: Faults | None = None) -> bool:
    """Collective over every rank, on a gloo group of its own made for it: whether ``verdict`` holds on every rank
    (a decision each rank takes from what it measures, such as its free device memory, made one of all ranks). The
    wait watches ``faults`` for a failed rank (``None``: a watch of its own)."""
    group = dist.new_group(backend="gloo", timeout=ranks.timeout)
    try:
        watch = faults if faults is not None else Faults(ranks, f"ratel-faults/{group.group_name}")
        agreed = watch.all_reduce(torch.tensor([int(verdict)]), dist.ReduceOp.MIN, group)
    finally:
        dist.destroy_process_group(group)
    return bool(agreed.item())


def meet_at_rendezvous(rank: int, world: int, timeout: timedelta, value: str) -> tuple[dist.Store, list[str]]:
    """Meet the other ranks through torch's ``env://`` rendezvous (``MASTER_ADDR``/``MASTER_PORT``, or torchrun's
    agent store) and learn each rank's ``value``, before any process group exists.

    A process group's backend is chosen per rank (NCCL where the device is CUDA, gloo on the CPU). Ranks that chose
    differently never meet in ``init_process_group``: they wait there for its whole timeout and fail without saying
    why. What they must agree on is therefore exchanged first, over the store the process group is then built on.

    Args:
        rank: this process's global rank.
        world: the number of ranks.
        timeout: how long to wait for the other ranks (they may start minutes apart on a cluster).
        value: this rank's part.

    Returns:
        The store, to build the default process group on, and every rank's ``value`` in rank order.
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store.set(f"ratel/meet/{rank}", value)
    return store, [store.get(f"ratel/meet/{other}").decode() for other in range(world)]


# How often a collective's wait looks whether another rank reported a failure (only once it has waited that long).
_POLL = timedelta(milliseconds=200)


class Faults:
    """The ranks' failures, told through the store of the default process group (which every rank reaches apart from
    the collectives, hosted by rank 0's process).

    A rank that stops on an error reports it (:meth:`report`); every wait of the engine's collectives (:meth:`wait`)
    raises :class:`RatelRankFailed` naming it within a poll instead of waiting for the collective's timeout.
    :meth:`assemble` is where the ranks meet after a failure.

    Args:
        ranks: this rank's place.
        prefix: the keys' prefix, unique to one engine's groups (a second fit in the process uses others).
        generation: the meetings after a failure so far (see :meth:`after_meeting`).
    """

    def __init__(self, ranks: Ranks, prefix: str, generation: int = 0) -> None:
        self._ranks = ranks
        self._prefix = prefix
        self._store = dist.distributed_c10d._get_default_store()
        self._reported = False
        # How many times the ranks met after a failure (:meth:`after_meeting`): each meeting's failures have keys of
        # their own.
        self._generation = generation

    def _key(self, what: str, rank: int | None = None) -> str:
        base = f"{self._prefix}/{self._generation}/{what}"
        return base if rank is None else f"{base}/{rank}"

    def report(self, error: BaseException) -> None:
        """This rank stopped on ``error`` (once; another rank's failure that stopped it is not reported as its own)."""
        if self._reported:
            return
        self._reported = True
        rank = self._ranks.rank
        try:
            if not isinstance(error, RatelRankFailed):
                self._store.set(self._key("failed", rank), f"{type(error).__name__}: {error}")
                self._store.set(self._key("any"), str(rank))
            self._store.set(self._key("stopped", rank), "1")
        except Exception as err:  # noqa: BLE001 - the store's host (rank 0) is gone: nobody is left to tell
            error.__notes__ = [*getattr(error, "__notes__", []), f"rank {rank} could not report it: {err!r}"]

    def check(self) -> None:
        """Raise :class:`RatelRankFailed` when a rank reported a failure."""
        try:
            failed = self._store.check([self._key("any")])
        except Exception as err:
            raise RatelRankFailed(f"rank {self._ranks.rank} cannot reach the process group's store, which rank 0's "
                                  f"process hosts: rank 0 stopped ({err})") from err
        if failed:
            raise RatelRankFailed(self.describe() or "another rank failed")

    def describe(self, others: bool = False) -> str:
        """The failures reported so far, rank by rank (of the other ranks only, with ``others``)."""
        failures = []
        for rank in range(self._ranks.world):
            key = self._key("failed", rank)
            if others and rank == self._ranks.rank:
                continue
            if self._store.check([key]):
                failures.append(f"rank {rank} failed ({self._store.get(key).decode()})")
        return "; ".join(failures)

    def wait(self, work: Any) -> None:
        """Wait for ``work``, a collective started with ``async_op=True``, or until a rank reports a failure.

        Raises:
            RatelRankFailed: a rank reported a failure (the collective is abandoned: its group must not be used
                again), or the collective itself failed: a rank's process ended (gloo notices the closed connection)
                or a rank did not join it within the group's timeout.
        """
        while True:
            try:
                work.wait(timeout=_POLL)
                return
            except RuntimeError:
                if work.is_completed():
                    # It ended while the poll gave up, or failed: its own outcome.
                    self._outcome(work)
                    return
            self.check()

    def _outcome(self, work: Any) -> None:
        """The outcome of ``work``, which completed: nothing, or the failure of a collective in the ranks' words."""
        try:
            work.wait()
        except RuntimeError as err:
            # A rank that failed reports before its process ends; one killed reports nothing.
            reported = self.describe(others=True) if self._reachable() else ""
            raise RatelRankFailed(
                f"a collective with the other ranks failed on rank {self._ranks.rank}: "
                + (reported or "a rank's process ended, or a rank did not join it within the timeout")
                + f" ({err})") from err

    def _reachable(self) -> bool:
        """Whether the process group's store still answers (rank 0's process hosts it)."""
        try:
            self._store.check([self._key("any")])
        except Exception:  # noqa: BLE001 - any failure to reach it means it is gone
            return False
        return True

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        """Collective: ``src``'s ``tensor`` on every rank of ``group`` (gloo), waited for as :meth:`wait` does."""
        self.wait(dist.broadcast(tensor, src=src, group=group, async_op=True))

    def barrier(self, group: Any) -> None:
        """Collective: every rank of ``group`` (gloo) got here, waited for as :meth:`wait` does."""
        self.wait(dist.barrier(group=group, async_op=True))

    def all_reduce(self, tensor: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
        """Collective: ``tensor`` (host memory) reduced with ``op`` over ``group`` (gloo), in place, waited for as
        :meth:`wait` does."""
        self.wait(dist.all_reduce(tensor, op=op, group=group, async_op=True))
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
        """Collective: every rank's ``tensor`` (host memory, one shape on every rank), in rank order."""
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        self.wait(dist.all_gather(gathered, tensor, group=group, async_op=True))
        return gathered

    def broadcast_object(self, obj: Any, src: int, group: Any) -> Any:
        """Collective: rank ``src``'s picklable ``obj`` on every rank of ``group`` (its length, then its bytes)."""
        payload = _pickled(obj) if self._ranks.rank == src else None
        length = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
        self.broadcast(length, src, group)
        if payload is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.broadcast(payload, src, group)
        return _unpickled(payload)

    def gather_objects(self, obj: Any, group: Any) -> list[Any]:
        """Collective: every rank's picklable ``obj``, in rank order, on every rank of ``group`` (the lengths, then
        the bytes, padded to the longest)."""
        payload = _pickled(obj)
        lengths = [int(n.item()) for n in self.all_gather(torch.tensor([payload.numel()], dtype=torch.int64), group)]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: payload.numel()] = payload
        return [_unpickled(bytes_[:n]) for bytes_, n in zip(self.all_gather(padded, group), lengths)]

    def assemble(self, error: BaseException) -> None:
        """After ``error`` stopped this rank: report it and wait until every rank stopped (at most the ranks'
        ``fault_timeout``).

        Raises:
            RatelRankFailed: a rank did not stop in time (its process ended, or it hangs), named.
        """
        self.report(error)
        keys = [self._key("stopped", rank) for rank in range(self._ranks.world)]
        try:
            self._store.wait(keys, self._ranks.fault_timeout)
        except Exception as err:
            here = f"rank {self._ranks.rank} stopped on {type(error).__name__}: {error}"
            try:
                missing = [rank for rank, key in enumerate(keys) if not self._store.check([key])]
                reported = self.describe(others=True)
            except Exception:
                raise RatelRankFailed(f"rank 0 stopped: its process hosts the process group's store, which rank "
                                      f"{self._ranks.rank} cannot reach ({here})") from err
            raise RatelRankFailed(f"rank {', '.join(map(str, missing))} did not stop within "
                                  f"{self._ranks.fault_timeout} after training stopped: its process ended or it hangs "
                                  f"({here}{'; ' + reported if reported else ''})") from err

    def meet(self, error: BaseException) -> Faults:
        """After ``error`` stopped this rank: meet the other ranks (:meth:`assemble`), and the view the collectives
        they then run together watch (:meth:`after_meeting`).

        Raises:
            RatelRankFailed: a rank did not stop in time, named.
        """
        self.assemble(error)
        return self.after_meeting()

    def after_meeting(self) -> Faults:
        """Once every rank stopped and met (:meth:`assemble`): a view for the collectives they then run together (the
        save of the last committed step), which the failures behind them no longer stop; it watches for new ones. The
        threads that stopped on those failures keep this one. This rank's own failure was reported and met over:
        Lightning's ``on_exception``, which comes after the callbacks' save, must not report it again as a new one."""
        later = Faults(self._ranks, self._prefix, self._generation + 1)
        later._reported = self._reported
        return later


def _pickled(obj: Any) -> torch.Tensor:
    """``obj`` pickled, as a tensor of bytes a collective sends."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(payload: torch.Tensor) -> Any:
    """The object :func:`_pickled` made ``payload`` of (sent by the ranks of this run only)."""
    return pickle.loads(payload.numpy().tobytes())


class WorldCollectives:
    """The collectives over every rank that Lightning's loops and callbacks run through the strategy (barriers, an
    object broadcast from one rank, the reductions of ``self.log(..., sync_dist=True)`` and of boolean decisions,
    all-gathers), and the strategy's own (every rank's device type, gathered at setup), watched for a failed rank as the
    engine's are (:class:`Faults`), for one run.

    They run on a gloo group of their own, whatever the default backend: a barrier and an object need no device, and a
    wait on gloo can be abandoned when a rank reports a failure. The run's engine shares :attr:`faults`, so a failure
    reported anywhere stops every watched wait on every rank. Tensors on an accelerator are not these collectives' to
    move (the caller sends them over the default group, NCCL, whose wait runs on the device's stream and cannot be
    abandoned from the host: a rank that raises leaves the others there until the collective's timeout).

    Args:
        ranks: this rank's place.
    """

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        # Made on every rank at the same point of the run, as every group must be.
        self._groups = [dist.new_group(backend="gloo", timeout=ranks.timeout)]
        self.faults = Faults(ranks, f"ratel-faults/{self._groups[0].group_name}")
        self._met = False

    @property
    def _group(self) -> Any:
        return self._groups[-1]

    def barrier(self) -> None:
        """Collective: every rank got here."""
        self.faults.barrier(self._group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: rank ``src``'s picklable ``obj`` on every rank."""
        return self.faults.broadcast_object(obj, src, self._group)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Collective: every rank's picklable ``obj``, in rank order."""
        return self.faults.gather_objects(obj, self._group)

    def reduce(self, tensor: torch.Tensor, reduce_op: str | Any | None = "mean") -> torch.Tensor:
        """Collective: ``tensor`` (host memory) reduced over every rank, in place, as Lightning's ``_sync_ddp`` reduces
        on gloo: ``reduce_op`` a ``ReduceOp`` or its name (``None``: a sum); an average (``"mean"``, ``"avg"``) is a
        sum divided by the number of ranks, since gloo has no average."""
        if isinstance(reduce_op, str):
            name = reduce_op.lower()
            mean = name in ("mean", "avg")
            op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, name.upper())
        else:
            mean = reduce_op == dist.ReduceOp.AVG
            op = dist.ReduceOp.SUM if reduce_op is None or mean else reduce_op
        self.faults.all_reduce(tensor, op, self._group)
        if not mean:
            return tensor
        if not torch.is_floating_point(tensor):
            return tensor.copy_(tensor / self.ranks.world)
        return tensor.div_(self.ranks.world)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: every rank's ``tensor`` (host memory, one shape on every rank), stacked in rank order."""
        return torch.stack(self.faults.all_gather(tensor, self._group))

    def all_gather_with_grads(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: :meth:`all_gather` of ``tensor`` (host memory) as an autograd op, as
        ``torch.distributed.nn.functional.all_gather``: its backward is a collective too (every rank's gradient of
        this rank's slice, summed), watched alike, so every rank must run it (as under ``ddp``)."""
        return _GatheredWithGrads.apply(tensor, self)

    def report(self, error: BaseException) -> None:
        """Tell the other ranks that ``error`` stopped this rank (see :meth:`Faults.report`)."""
        self.faults.report(error)

    def regroup(self, error: BaseException) -> None:
        """After ``error`` stopped this rank, before the ranks save together (Lightning's ``OnExceptionCheckpoint``):
        meet (:meth:`Faults.assemble`, a no-op where the engine met over the same failure already) and move to a new
        group, since the old one may hold a collective that a failed rank never joined. Once per run.

        Raises:
            RatelRankFailed: a rank did not stop within ``fault_timeout``, named.
        """
        if self._met:
            return
        self.faults = self.faults.meet(error)
        self._groups.append(dist.new_group(backend="gloo", timeout=self.ranks.timeout))
        self._met = True

    def close(self) -> None:
        """Release the groups."""
        groups, self._groups = self._groups, []
        for group in groups:
            dist.destroy_process_group(group)


class _GatheredWithGrads(torch.autograd.Function):
    """Every rank's tensor stacked (:meth:`WorldCollectives.all_gather_with_grads`); backward sums over the ranks
    what each computed for this rank's slice, with one all-reduce of the whole stacked gradient: the tensors that
    Lightning's callers gather with gradients (embeddings of a contrastive loss) are small, and gloo has no
    reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, world: WorldCollectives) -> torch.Tensor:
        ctx.world = world
        return world.all_gather(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world: WorldCollectives = ctx.world
        summed = world.reduce(grad.contiguous().clone(), "sum")
        return summed[world.ranks.rank], None


class SharedCacheUnavailable(Exception):
    """The ranks of a node cannot share one host cache (:meth:`NodeCache.open`); the message says why."""


class NodeCache:
    """The host cache that the ranks of one node share, and the process groups that order its writes and reads.

    Every rank pages every unit's compute copy from its host cache. Here the caches of a node's ranks are one
    :class:`~lightning_ratel.runtime.hostmem.SharedHostMemory`, so each compute copy is held once per node. Each unit's
    copy is written on a node by one rank, its *writer*: the node's rank with the local index of the unit's owner (the
    owner itself on its own node; on another node the rank that receives the owner's broadcast for that node, over a
    *column* group of one rank per node). The node's other ranks read those bytes only after the writer said that they
    are written, by a token it broadcasts on the node's group (1: written; 0: its update or broadcast failed); a rank
    that dies breaks that collective instead of leaving the others waiting, or reading bytes half written.

    Each thread that issues these collectives has groups of its own: the publisher thread (``publish``,
    ``column_publish``) and the training thread (``control``, ``column_control``); the column groups exist only with
    more than one node.

    Args:
        ranks: this rank's place.
        memory: the node's shared memory, mapped by this rank.
        groups: the node group and the column group of each thread, in the order above (column groups ``None`` on
            one node).
    """

    def __init__(self, ranks: Ranks, memory: SharedHostMemory, groups: tuple[Any, Any, Any, Any]) -> None:
        self.ranks = ranks
        self.memory = memory
        self.control, self.publish, self.column_control, self.column_publish = groups
        self._groups = [g for g in groups if g is not None]

    @classmethod
    def open(cls, ranks: Ranks, nbytes: int, faults: Faults | None = None) -> NodeCache:
        """Collective over every rank: make the groups, and map one shared memory per node, which the node's first
        rank creates where ``/dev/shm`` has room for ``nbytes`` and removes once every rank of its node opened it.
        Its collectives' waits watch ``faults`` for a failed rank (``None``: a watch of its own).

        Raises:
            SharedCacheUnavailable: on every rank alike, when any node cannot share (one rank per node, ranks not
                numbered node by node, no room or no ``/dev/shm``); nothing is left behind.
        """
        lw = ranks.local_world
        if lw < 2 or ranks.world % lw:
            raise SharedCacheUnavailable("one rank per node" if lw < 2 else "the nodes hold different numbers of ranks")
        node_lists = [list(range(n * lw, (n + 1) * lw)) for n in range(ranks.nodes)]
        column_lists = [[n * lw + j for n in range(ranks.nodes)] for j in range(lw)]
        world = dist.new_group(backend="gloo", timeout=ranks.timeout)
        if faults is None:
            faults = Faults(ranks, f"ratel-faults/{world.group_name}")
        groups: list[Any] = []
        memory: SharedHostMemory | None = None
        try:
            for _ in range(2):
                groups.append(dist.new_subgroups_by_enumeration(node_lists, timeout=ranks.timeout, backend="gloo")[0])
            for _ in range(2):
                groups.append(dist.new_subgroups_by_enumeration(column_lists, timeout=ranks.timeout, backend="gloo")[0]
                              if ranks.nodes > 1 else None)
            reason = ""
            if ranks.local_rank == 0:
                try:
                    memory = SharedHostMemory.create()
                    if memory.free_bytes() < nbytes:
                        reason = (f"{memory.path} has {memory.free_bytes()} bytes free and the host cache needs up to "
                                  f"{nbytes}")
                except OSError as err:
                    reason = f"no shared memory file could be made ({err})"
            box = [memory.path if memory is not None and not reason else "", reason]
            box = faults.broadcast_object(box, ranks.node_ranks[0], groups[0])
            reason = box[1]
            if ranks.local_rank != 0 and not reason:
                try:
                    memory = SharedHostMemory.open(box[0])
                except OSError as err:
                    reason = f"rank {ranks.rank} could not open {box[0]} ({err})"
            failed = torch.tensor([1 if reason else 0])
            faults.all_reduce(failed, dist.ReduceOp.MAX, world)
            # Every rank of the node has the file open (or gave up): its name is no longer needed.
            if ranks.local_rank == 0 and memory is not None:
                memory.unlink()
            if failed.item():
                raise SharedCacheUnavailable(reason or "another node could not share its host cache")
        except BaseException:
            if memory is not None:
                memory.unlink()
                memory.close()
            for group in groups:
                if group is not None:
                    dist.destroy_process_group(group)
            raise
        finally:
            dist.destroy_process_group(world)
        assert memory is not None
        return cls(ranks, memory, (groups[0], groups[1], groups[2], groups[3]))

    def writer(self, owner: int) -> int:
        """The rank of this node that writes the compute copies of the units ``owner`` owns."""
        return self.ranks.node_ranks[owner % self.ranks.local_world]

    def written_here(self, owners: dict[int, int], units: Sequence[int]) -> set[int]:
        """The units among ``units`` whose host cache this rank writes on its node, given each unit's owner
        (a unit without one, holding frozen parameters only, goes by its index)."""
        return {u for u in units if self.writer(owners.get(u, u)) == self.ranks.rank}

    def close(self) -> None:
        """Release the groups and the file (the cache stays mapped as long as its tensors live)."""
        self.memory.close()
        groups, self._groups = self._groups, []
        for group in groups:
            dist.destroy_process_group(group)


def _norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each gradient's 2-norm, in host memory, in order (the gradients of the device tier are on the device)."""
    norms = torch.empty(len(grads))
    for device in {g.device for g in grads}:
        at = [i for i, g in enumerate(grads) if g.device == device]
        norms[at] = torch.stack(torch._foreach_norm([grads[i] for i in at], 2.0)).float().cpu()
    return norms


def _scale(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply ``grads`` by ``coef`` in place, wherever each is."""
    for device in {g.device for g in grads}:
        torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a dtype every backend sends (a 16-bit float goes as bytes, bit for bit: gloo sends
    neither bfloat16 nor int16)."""
    return tensor.view(torch.uint8) if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def _compute_copy(shard: Shard) -> torch.Tensor:
    """The shard's compute copy in its unit's host cache (an fp32 master kept there is that copy)."""
    return shard.compute_view(shard.unit.host[shard.dtype])


class StoredCopies:
    """Compute copies in the swap files (``param_cache="ssd"``) of a run on several ranks that the node's ranks do not
    share (:class:`NodeCopies`: an fp32 master held in host memory, ranks on several nodes, files another rank cannot
    open): every rank keeps the copy of each of these shards in its own store, where its pager reads them.

    The owner's update writes the copies of the shards it owns, as on one rank. The copy of a shard another rank owns
    is written here from the owner's broadcast, under the shard's ``compute`` key, also for an fp32 shard (whose
    master, its copy on the owner, is not here). The ranks of a node thus hold each of these copies once each, on
    their drives; each state still once.

    Args:
        store: this rank's swap store.
        shards: the trainable shards whose copies go this way.
        owns: whether this rank owns a shard.
    """

    BUFFERS = 2
    """Host buffers the copies on their way use in turn: one is filled while the write of the other runs."""

    def __init__(self, store: Any, shards: Sequence[Shard], owns: Callable[[Shard], bool]) -> None:
        self.store = store
        self._owns = owns
        size = self.buffer_nbytes(shards) // self.BUFFERS
        self._buffers = [aligned_empty(size, torch.uint8) for _ in range(self.BUFFERS)]
        self._writes: list[Future | None] = [None] * self.BUFFERS
        self._turn = 0
        for shard in shards:
            if not owns(shard):
                shard.unit.ready.place(shard, shard.key("compute"))

    @staticmethod
    def buffer_nbytes(shards: Sequence[Shard]) -> int:
        """Host bytes of the buffers the copies of ``shards`` pass through."""
        largest = max((s.numel * s.dtype.itemsize for s in shards), default=0)
        return StoredCopies.BUFFERS * round_up(largest, ALIGNMENT)

    @property
    def nbytes(self) -> int:
        """Host bytes of its buffers."""
        return sum(b.numel() for b in self._buffers)

    def publish(self, shard: Shard, mine: bool, broadcast: Callable[[torch.Tensor], None]) -> Future | None:
        """One shard's copy from its owner into every rank's store: the owner (``mine``) reads its own and sends it,
        each other rank receives it and starts storing it (``broadcast``: the collective, on the copy's bytes).

        Returns:
            The write's future on a rank that received the copy, ``None`` on the owner.
        """
        turn, copy = self._take(shard)
        if mine:
            self._read(shard, copy)
        broadcast(_wire(copy))
        return None if mine else self.write(turn, shard, copy)

    def store(self, shard: Shard, value: torch.Tensor) -> None:
        """Store ``value`` as the copy of ``shard``, which another rank owns, and wait for every write."""
        turn, copy = self._take(shard)
        copy.copy_(value)
        self.write(turn, shard, copy)
        self.settle()

    def current(self, shard: Shard) -> torch.Tensor:
        """``shard``'s current copy in this rank's store, in a buffer the next call may reuse."""
        return self._read(shard, self._take(shard)[1])

    def write(self, turn: int, shard: Shard, copy: torch.Tensor) -> Future:
        """Start storing ``copy`` (buffer ``turn``) as the copy of ``shard``, which another rank owns; the buffer is
        handed out again once the write has landed."""
        assert not self._owns(shard)
        self._writes[turn] = self.store.write(shard.key("compute"), copy, urgent=True)
        return self._writes[turn]

    def settle(self) -> None:
        """Wait for the writes still running (raising the first error)."""
        for turn, write in enumerate(self._writes):
            self._writes[turn] = None
            if write is not None:
                write.result()

    def _take(self, shard: Shard) -> tuple[int, torch.Tensor]:
        """The buffer next in turn, viewed as ``shard``'s copy, once the write that last read it has landed."""
        turn, self._turn = self._turn, (self._turn + 1) % self.BUFFERS
        write, self._writes[turn] = self._writes[turn], None
        if write is not None:
            write.result()
        return turn, self._buffers[turn][: shard.numel * shard.dtype.itemsize].view(shard.dtype)

    def _read(self, shard: Shard, out: torch.Tensor) -> torch.Tensor:
        """``shard``'s current copy in this rank's store (wherever its compute key is now), into ``out``."""
        self.store.read(shard.unit.ready.compute_key(shard), out, urgent=True).result()
        return out


class SharedCopiesUnavailable(Exception):
    """The ranks of a node cannot read each other's swap files (:meth:`NodeCopies.open`); the message says why."""


class NodeCopies:
    """The compute copies in the swap files (``param_cache="ssd"``) that the ranks of one node share: each trainable
    shard's copy is in its owner's swap files only, and the node's other ranks read it there, through a read-only
    :class:`~lightning_ratel.runtime.peerstore.PeerStore` of the owner's files.

    After each write of a copy (a step's update, an assignment between steps, the first values) the owner announces
    on a collective the key that holds it (an fp32 master moves between the state slots), where that key lives and
    its chunks' checksums; a rank reads the copy only after that (the unit's
    :class:`~lightning_ratel.runtime.units.UnitReady`), verified against those checksums, so bytes the owner is
    rewriting never pass. The owner rewrites a copy only in its update, which runs on the gradient reduced from every
    rank, once every rank's backward has left the unit. Shards whose copy is not in the owner's swap files (an fp32
    master in host memory) and runs of several nodes go as :class:`StoredCopies` does. The copies of frozen shards,
    written once at setup (and where code between steps gives them new values), are rank 0's to write and announce
    alike.

    Args:
        store: this rank's store.
        rank: this rank.
        peers: a read-only store of each other rank of the node, by rank.
        shared: the shards, by index, whose copies the ranks share this way (trainable and frozen).
        written_here: of those, the ones this rank writes into its own swap files.
    """

    def __init__(self, store: TieredStore, rank: int, peers: dict[int, PeerStore], shared: set[int],
                 written_here: set[int]) -> None:
        self.store = store
        self.rank = rank
        self.peers = peers
        self.shared = frozenset(shared)
        self.written_here = frozenset(written_here)

    FROZEN_WRITER = 0
    """The rank that writes the frozen shards' copies (its kept store then holds them, as one rank's would)."""

    @staticmethod
    def in_swap_files(shard: Shard) -> bool:
        """Whether ``shard``'s compute copy is in its writer's swap files, so that the node's ranks can share it: a
        16-bit or frozen copy always is; an fp32 master, a trainable shard's copy, where its states are."""
        return shard.dtype != torch.float32 or shard.group < 0 or shard.state_tier == "ssd"

    @classmethod
    def written_by(cls, rank: int, shards: Sequence[Shard], frozen: Sequence[Shard], owned: set[int]) -> list[int]:
        """The shards, by index, whose compute copies ``rank`` writes into its swap files for the node's ranks: the
        trainable ones it owns (``owned``) whose copies are there, and on :attr:`FROZEN_WRITER` the frozen ones."""
        return [s.index for s in [*shards, *(frozen if rank == cls.FROZEN_WRITER else ())]
                if (s.group < 0 or s.index in owned) and cls.in_swap_files(s)]

    @classmethod
    def open(cls, ranks: Ranks, store: TieredStore, on_disk: Sequence[int], faults: Faults | None = None
             ) -> NodeCopies:
        """Collective over every rank: open the other ranks' swap files read-only.

        Args:
            ranks: this rank's place.
            store: this rank's store (its swap files exist).
            on_disk: the shards, by index, whose compute copy this rank writes into its swap files
                (:meth:`written_by`).
            faults: where the waits watch for a failed rank (``None``: a watch of its own).

        Raises:
            SharedCopiesUnavailable: on every rank alike, where the ranks are not all on one node, or any rank cannot
                open another's files; nothing is left open.
        """
        if ranks.nodes != 1 or ranks.world < 2:
            raise SharedCopiesUnavailable("the ranks are on several nodes" if ranks.nodes != 1 else "one rank")
        world = dist.new_group(backend="gloo", timeout=ranks.timeout)
        if faults is None:
            faults = Faults(ranks, f"ratel-faults/{world.group_name}")
        disk = store.disk
        peers: dict[int, PeerStore] = {}
        try:
            mine = ([str(p) for p in disk.paths], disk.name, disk.run_id, disk.stripe_bytes, disk.checksum_algorithm,
                    disk.direct, sorted(on_disk))
            # Page-ins from another rank's files want the queue depth this rank's own get.
            threads = disk.io_threads_per_path
            described = faults.gather_objects(mine, world)
            reason = ""
            for rank, (paths, name, run_id, stripe, algorithm, direct, _) in enumerate(described):
                if rank == ranks.rank:
                    continue
                try:
                    # As the owner moves them: a direct read of a file written through the page cache could miss
                    # what is still there.
                    peers[rank] = PeerStore(paths, name, run_id, stripe, algorithm, io_threads_per_path=threads,
                                            direct=direct)
                except (OSError, RatelConfigError) as err:
                    reason = f"rank {ranks.rank} could not open rank {rank}'s swap files ({err})"
                    break
            failed = torch.tensor([1 if reason else 0])
            faults.all_reduce(failed, dist.ReduceOp.MAX, world)
            if failed.item():
                raise SharedCopiesUnavailable(reason or "another rank could not open this node's swap files")
        except BaseException:
            for peer in peers.values():
                peer.close()
            raise
        finally:
            dist.destroy_process_group(world)
        for peer in peers.values():
            store.attach_peer(peer)
        return cls(store, ranks.rank, peers, {index for entry in described for index in entry[6]}, set(on_disk))

    def shares(self, shard: Shard) -> bool:
        """Whether ``shard``'s copy is read from its owner's swap files."""
        return shard.index in self.shared

    @property
    def read_elsewhere(self) -> set[int]:
        """The shards, by index, whose copies this rank reads from another rank's swap files."""
        return set(self.shared - self.written_here)

    def publish(self, shard: Shard, owner: int, broadcast: Callable[[Any], Any]) -> None:
        """One shard's new copy announced by its owner, once its write has landed there (``broadcast``: the
        collective of a picklable object from the owner), and on the other ranks read from the owner's files from now
        on."""
        message = None
        if owner == self.rank:
            shard.unit.ready.wait_stored()
            key = shard.unit.ready.compute_key(shard)
            message = (key, self.store.disk.extent(key), self.store.disk.checksums(key))
        key, extent, sums = broadcast(message)
        if owner == self.rank:
            return
        peer = self.peers[owner]
        name = f"rank{owner}/{key}"
        if self.store.peer_of(name) is None:
            self.store.adopt(peer, name, extent)
        peer.announce(name, sums)
        shard.unit.ready.place(shard, name)

    def read(self, shard: Shard) -> torch.Tensor:
        """``shard``'s current copy, read from its owner's files into a new tensor (between steps)."""
        out = aligned_empty(shard.numel * shard.dtype.itemsize, torch.uint8).view(shard.dtype)
        self.store.read(shard.unit.ready.compute_key(shard), out, urgent=True).result()
        return out


@dataclass(frozen=True)
class _Gradient:
    shard: Shard
    position: int
    grad: torch.Tensor
    event: Any


@dataclass(frozen=True)
class _Begin:
    boundary: bool
    plan: StepPlan | None = None


@dataclass(frozen=True)
class _Flush:
    future: Future


@dataclass(frozen=True)
class _Drop:
    future: Future


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass
class _Reducing:
    shard: Shard
    buffer: torch.Tensor
    work: Any


def exchange_window_nbytes(shards: Sequence[Shard]) -> int:
    """The most host memory a rank's gradient exchange holds for the window's sums of ``shards`` (the trainable ones):
    every shard's buffer at once, as between the boundary micro-batches of gradient accumulation, or where the
    reduces fall behind backward."""
    return sum(round_up((s.numel + len(s.params)) * 4, ALIGNMENT) for s in shards)


class _GradientExchange:
    """The exchange thread: sums a rank's gradients of the window and reduces each shard onto its owner.

    Args:
        shards: the trainable shards.
        owner: each shard's owner rank, by shard index.
        ranks: this rank's place.
        group: the process group of its reduces.
        deliver: called on the owner with a shard and its reduced buffer (gradient, then one flag per parameter).
        faults: where the waits for the reduces learn of a failed rank.
    """

    def __init__(self, shards: Sequence[Shard], owner: dict[int, int], ranks: Ranks, group: Any,
                 deliver: Callable[[Shard, torch.Tensor], None], faults: Faults) -> None:
        self._owner = owner
        self._ranks = ranks
        self._group = group
        self._faults = faults
        self._deliver = deliver
        # Positions that get a gradient from autograd (the others never complete a shard).
        self._expected, self._order = gradient_order(shards)
        self._cursor = 0
        self._boundary = False
        self._buffers: dict[int, torch.Tensor] = {}
        # The window's buffers come back when the reduce (and, on the owner, the optimizer) is done with them, and are
        # reused: the memory is touched once, and its footprint is the most held at once (counted by :attr:`nbytes`).
        self.pool = HostPool()
        self._seen: dict[int, set[int]] = {}
        self._complete: set[int] = set()
        self._reducing: deque[_Reducing] = deque()
        # Reduces issued so far (read by the training thread for a run's figures).
        self.reduces = 0
        self._jobs: queue.SimpleQueue[_Gradient | _Begin | _Flush | _Drop | _Stop] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ratel-grad-reduce", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        """Host bytes of the window's buffers, in use or free for the next window."""
        return self.pool.nbytes

    @property
    def collectives(self) -> int:
        """Reduces of one window (one per trainable shard)."""
        return len(self._order)

    def put(self, job: _Gradient | _Begin | _Flush | _Drop | _Stop) -> None:
        self._jobs.put(job)

    def wait(self, job_type: type[_Flush] | type[_Drop]) -> None:
        """Queue a flush (reduce everything left, deliver it) or a drop (forget the window) and wait for it."""
        future: Future = Future()
        self._jobs.put(job_type(future))
        while True:
            try:
                future.result(timeout=1.0)
                return
            except TimeoutError:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the gradient exchange stopped: {self.error!r}") from self.error

    def stop(self) -> None:
        self._jobs.put(_Stop())
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                return
            try:
                self._handle(job)
                # A gradient must not stay alive while waiting for the reduces below or the next job.
                job = None
                # With nothing else to do, deliver each reduce as soon as it lands (the owner's update can start).
                self._collect(block=self._jobs.empty(), everything=True)
            except BaseException as err:  # noqa: BLE001 - handed to the training thread through wait/check
                if self.error is None:
                    self.error = err
                self._forget()
                if isinstance(job, (_Flush, _Drop)) and not job.future.done():
                    job.future.set_exception(err)

    def _handle(self, job: _Gradient | _Begin | _Flush | _Drop) -> None:
        if isinstance(job, _Gradient):
            if self.error is None:
                self._add(job)
        elif isinstance(job, _Begin):
            self._boundary = job.boundary
            self._seen = {}
            if job.boundary:
                self._issue_ready()
        elif isinstance(job, _Flush):
            if self.error is not None:
                job.future.set_exception(self.error)
                return
            while self._cursor < len(self._order):
                self._issue(self._order[self._cursor])
            self._collect(block=True, everything=True)
            self._forget()
            job.future.set_result(None)
        elif isinstance(job, _Drop):
            self._forget()
            job.future.set_result(None)

    def _add(self, job: _Gradient) -> None:
        job.event.synchronize()
        shard = job.shard
        buffer = self._buffers.get(shard.index)
        if buffer is None:
            # The gradient, then one flag per parameter: 1 where this rank has that parameter's gradient.
            buffer = self._buffers[shard.index] = self._zeros(shard)
        sp = shard.params[job.position]
        sp.view(buffer).add_(job.grad)
        buffer[shard.numel + job.position] = 1.0
        seen = self._seen.setdefault(shard.index, set())
        seen.add(job.position)
        if self._boundary and seen >= self._expected[shard.index]:
            self._complete.add(shard.index)
            self._issue_ready()

    def _issue_ready(self) -> None:
        while self._cursor < len(self._order) and self._order[self._cursor].index in self._complete:
            self._issue(self._order[self._cursor])

    def _issue(self, shard: Shard) -> None:
        self._cursor += 1
        buffer = self._buffers.pop(shard.index, None)
        if buffer is None:
            buffer = self._zeros(shard)
        # DistributedDataParallel's arithmetic: each rank's sum multiplied by 1/world, then summed over the ranks.
        buffer[: shard.numel].mul_(1.0 / self._ranks.world)
        work = dist.reduce(buffer, dst=self._owner[shard.index], op=dist.ReduceOp.SUM, group=self._group,
                           async_op=True)
        self.reduces += 1
        self._reducing.append(_Reducing(shard, buffer, work))

    def _zeros(self, shard: Shard) -> torch.Tensor:
        return self.pool.take(shard.numel + len(shard.params), torch.float32).zero_()

    def _collect(self, block: bool, everything: bool = False) -> None:
        """Deliver the reduces that finished, in order; with ``block``, wait for the oldest one (all of them with
        ``everything``)."""
        while self._reducing:
            item = self._reducing[0]
            if not item.work.is_completed():
                if not block:
                    return
                self._faults.wait(item.work)
            self._reducing.popleft()
            if self._owner[item.shard.index] == self._ranks.rank:
                self._deliver(item.shard, item.buffer)
            block = block and everything

    def _forget(self) -> None:
        self._buffers = {}
        self._seen = {}
        self._complete = set()
        self._reducing.clear()
        self._cursor = 0


@dataclass
class _BucketReducing:
    bucket: Bucket
    buffer: torch.Tensor
    work: Any


def exchange_micro_batch_nbytes(shards: Sequence[Shard]) -> int:
    """The most host memory a rank's gradient exchange holds when it reduces each micro-batch's gradients
    (:class:`_MicroBatchExchange`): ``MICRO_BATCH_BUCKETS`` buffers of its largest bucket, at most the cap of
    :func:`~lightning_ratel.runtime.buckets.bucket_cap` and at most every gradient of ``shards`` (the trainable ones)
    with their flags."""
    sizes = [[sp.numel for sp in s.params] for s in shards]
    total = sum(numel + 1 for numels in sizes for numel in numels)
    if not total:
        return 0
    return MICRO_BATCH_BUCKETS * round_up(min(bucket_cap(sizes), total) * 4, ALIGNMENT)


class _MicroBatchExchange(_GradientExchange):
    """The exchange thread that reduces each micro-batch's gradients onto their owners (``gradient_exchange=
    "micro_batch"``): no rank holds a window, the owner's optimizer sums the micro-batches as on one rank.

    Within a micro-batch, shards go in the fixed order of :class:`_GradientExchange`, each as soon as backward completed
    it here (the ones before it first). Their parameters' gradients are copied, as fp32, into buckets
    (:func:`~lightning_ratel.runtime.buckets.cut_buckets`: consecutive parameters of one owner, up to a cap, the same on
    every rank; a parameter larger than the cap in parts, so that the buffers stay at the cap whatever the largest
    parameter, such as a large vocabulary's embedding), zeros where this rank has none, with a flag per item after them;
    a full bucket is multiplied by ``1 / world_size`` and reduced onto its owner in one collective, which then hands
    each parameter (or part) that any rank flagged to its optimizer, as a view of the bucket. On two ranks the sums are
    bit for bit those of reducing each parameter's gradient by itself; over three or more, gloo's reduce orders an
    element's sum over the ranks by the element's place in the buffer, so the bits may differ there (within rounding, as
    either order may). A bucket's memory comes from a pool of ``MICRO_BATCH_BUCKETS`` buffers of the largest bucket,
    taken once and reused: a buffer is taken again once its reduce landed and, on the owner, once the optimizer took in
    the views. The next micro-batch's start (or the step's flush) reduces what is left, and only then starts the local
    optimizer's micro-batch, so that its count of a shard's gradients per micro-batch stays right.

    Args:
        shards, owner, ranks, group, faults: as for :class:`_GradientExchange`.
        deliver: called on the owner with a shard, a parameter's position, its reduced gradient (or a flat part of it)
            and the part's first element (``None`` for the whole gradient).
        begin: starts a micro-batch on the local optimizer (``CpuAdam.begin``), given the step's plan on its boundary.
        take_in: waits until the local optimizer took in the gradients delivered so far (``CpuAdam.take_in``).
    """

    def __init__(self, shards: Sequence[Shard], owner: dict[int, int], ranks: Ranks, group: Any,
                 deliver: Callable[[Shard, int, torch.Tensor, int | None], None], faults: Faults,
                 begin: Callable[[StepPlan | None], None], take_in: Callable[[], None]) -> None:
        self._deliver_param = deliver
        self._begin_local = begin
        self._take_in = take_in
        self._held: dict[int, dict[int, torch.Tensor]] = {}
        self._issued: set[int] = set()
        self._open = False
        self._filling: tuple[int, torch.Tensor] | None = None
        self._delivered: list[torch.Tensor] = []
        self._bucket_reducing: deque[_BucketReducing] = deque()
        super().__init__(shards, owner, ranks, group, lambda shard, buffer: None, faults)
        positions = {s.index: sorted(self._expected[s.index]) for s in self._order}
        self._buckets = cut_buckets(self._order, positions, owner)
        self._places = bucket_places(self._buckets)
        self._buffer_numel = max((b.size for b in self._buckets), default=0)
        self._limit = MICRO_BATCH_BUCKETS * round_up(self._buffer_numel * 4, ALIGNMENT)

    @property
    def collectives(self) -> int:
        """Reduces of one micro-batch."""
        return len(self._buckets)

    def _handle(self, job: _Gradient | _Begin | _Flush | _Drop) -> None:
        if isinstance(job, _Gradient):
            if self.error is None:
                self._add(job)
        elif isinstance(job, _Begin):
            if self.error is None and self._open:
                self._close()
            self._begin_local(job.plan)
            self._open = True
        elif isinstance(job, _Flush):
            if self.error is not None:
                job.future.set_exception(self.error)
                return
            if self._open:
                self._close()
            job.future.set_result(None)
        elif isinstance(job, _Drop):
            self._forget()
            # The buffers the local optimizer may still hold come back to the pool once it dropped them.
            self._delivered.clear()
            # Every rank drops at the same point (``discard`` flushed first); gradients may still come before the next
            # micro-batch's start (a ``zero_grad`` before backward), which then reduces them.
            self._open = True
            job.future.set_result(None)

    def _add(self, job: _Gradient) -> None:
        job.event.synchronize()
        shard = job.shard
        if shard.index in self._issued:
            raise RuntimeError(
                f"a second gradient of {shard.params[job.position].name} arrived in one micro-batch after its shard "
                "was reduced; gradient_exchange='micro_batch' expects each parameter's gradient once per training "
                "step call: use gradient_exchange='window'")
        held = self._held.setdefault(shard.index, {})
        if job.position in held:
            held[job.position].add_(job.grad)
        else:
            held[job.position] = job.grad
        if held.keys() >= self._expected[shard.index]:
            self._complete.add(shard.index)
            self._issue_ready()

    def _close(self) -> None:
        """Reduce what is left of the micro-batch, in order, and deliver every reduce."""
        while self._cursor < len(self._order):
            self._issue(self._order[self._cursor])
        self._collect(block=True, everything=True)
        self._forget()

    def _issue(self, shard: Shard) -> None:
        """Pack the shard's gradients into their buckets, reducing each bucket it fills."""
        self._cursor += 1
        self._issued.add(shard.index)
        held = self._held.pop(shard.index, {})
        for b, i in self._places.get(shard.index, ()):
            bucket = self._buckets[b]
            buffer = self._bucket_buffer(b)
            pack(buffer, bucket, i, held)
            if i == len(bucket.items) - 1:
                self._reduce(bucket, buffer)

    def _bucket_buffer(self, b: int) -> torch.Tensor:
        if self._filling is not None and self._filling[0] == b:
            return self._filling[1]
        self._make_room()
        buffer = self.pool.take(self._buffer_numel, torch.float32)
        self._filling = (b, buffer)
        return buffer

    def _reduce(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        self._filling = None
        # DistributedDataParallel's arithmetic: each rank's gradient multiplied by 1/world, summed over the ranks.
        buffer[: bucket.numel].mul_(1.0 / self._ranks.world)
        work = dist.reduce(buffer[: bucket.size], dst=bucket.owner, op=dist.ReduceOp.SUM, group=self._group,
                           async_op=True)
        self.reduces += 1
        self._bucket_reducing.append(_BucketReducing(bucket, buffer, work))

    def _make_room(self) -> None:
        """Wait until a buffer of the pool is free or another one stays within its limit: for the oldest reduces,
        then for the local optimizer to take in the views of the buffers delivered to it. A buffer goes back to the
        pool explicitly once nothing uses it (gloo may hold a reference for a moment after its collective ended)."""
        need = round_up(self._buffer_numel * 4, ALIGNMENT)
        while self.pool.nbytes_in_use + need > self._limit:
            if self._bucket_reducing:
                self._collect_oldest()
            elif self._delivered:
                self._take_in()
                for buffer in self._delivered:
                    self.pool.give(buffer)
                self._delivered.clear()
            else:
                raise RuntimeError("the gradient exchange's bucket buffers are still in use with no reduce pending")

    def _collect_oldest(self) -> None:
        item = self._bucket_reducing.popleft()
        self._faults.wait(item.work)
        bucket = item.bucket
        if bucket.owner != self._ranks.rank:
            self.pool.give(item.buffer)
            return
        flags = item.buffer[bucket.numel : bucket.size].tolist()
        for part, flag in zip(bucket.items, flags):
            if flag > 0:
                grad = item.buffer[part.offset : part.offset + part.numel]
                if part.start is None:
                    grad = grad.view(part.shard.params[part.position].shape)
                self._deliver_param(part.shard, part.position, grad, part.start)
        # Given back once the local optimizer took the views in (it holds them until their shard is complete).
        self._delivered.append(item.buffer)

    def _collect(self, block: bool, everything: bool = False) -> None:
        while self._bucket_reducing:
            if not self._bucket_reducing[0].work.is_completed() and not block:
                return
            self._collect_oldest()
            block = block and everything

    def _forget(self) -> None:
        super()._forget()
        self._held = {}
        self._issued = set()
        self._filling = None
        self._bucket_reducing.clear()
        self._open = False


@dataclass(frozen=True)
class _Landed:
    bucket: Bucket
    host: torch.Tensor
    event: Any


class _DeviceExchange(_GradientExchange):
    """The exchange thread of ``gradient_exchange="device"``: the reduces run on the device
    (:class:`~lightning_ratel.runtime.device_reduce.DeviceReduce`, :attr:`reduce`, which autograd's and the training
    thread drive); on the owner this thread waits for each reduced bucket's copy to host memory and hands the
    parameters (or parts) any rank flagged to its optimizer, as views of the host buffer (the device's pool takes it
    back once the optimizer dropped them). It also starts the owner's micro-batches (``CpuAdam.begin``) once the last
    one's gradients reached the optimizer.

    Args:
        device: the compute device.
        shards, owner, ranks, faults: as for :class:`_GradientExchange`.
        group: the process group of the reduces on the device (NCCL on CUDA).
        deliver, begin: as for :class:`_MicroBatchExchange`.
        kept, stay: the shards whose reduced gradients stay on the device, and what takes them there (see
            :class:`~lightning_ratel.runtime.device_reduce.DeviceReduce`).
    """

    def __init__(self, device: Device, shards: Sequence[Shard], owner: dict[int, int], ranks: Ranks, group: Any,
                 deliver: Callable[[Shard, int, torch.Tensor, int | None], None], faults: Faults,
                 begin: Callable[[StepPlan | None], None], kept: Callable[[Bucket, torch.Tensor], Any] | None = None,
                 stay: frozenset[int] = frozenset()) -> None:
        self._deliver_param = deliver
        self._begin_local = begin
        self.reduce = DeviceReduce(device, shards, owner, ranks.rank, ranks.world, group, self._landed, kept, stay,
                                   host_wait=faults.wait)
        super().__init__(shards, owner, ranks, group, lambda shard, buffer: None, faults)

    @property
    def nbytes(self) -> int:
        """Host bytes of buffers of its own: none (the owner's copies are the device's pool's, as offloaded
        gradients are on one rank)."""
        return 0

    @property
    def collectives(self) -> int:
        """Reduces of one micro-batch."""
        return len(self.reduce.buckets)

    def _landed(self, bucket: Bucket, host: torch.Tensor, event: Any) -> None:
        self.put(_Landed(bucket, host, event))

    def _handle(self, job: _Gradient | _Begin | _Flush | _Drop) -> None:
        if isinstance(job, _Landed):
            if self.error is None:
                self._deliver_bucket(job)
        elif isinstance(job, _Begin):
            self._begin_local(job.plan)
        elif isinstance(job, _Flush):
            if self.error is not None:
                job.future.set_exception(self.error)
                return
            job.future.set_result(None)
        elif isinstance(job, _Drop):
            job.future.set_result(None)
        else:
            raise RuntimeError("gradient_exchange='device' takes the gradients on the device, not here")

    def _deliver_bucket(self, job: _Landed) -> None:
        waited = 0
        while not job.event.query():
            time.sleep(0.0005)
            waited += 1
            if waited % 400 == 0:
                self._faults.check()
        bucket, host = job.bucket, job.host
        flags = host[bucket.numel : bucket.size].tolist()
        for part, flag in zip(bucket.items, flags):
            if flag > 0:
                grad = host[part.offset : part.offset + part.numel]
                if part.start is None:
                    grad = grad.view(part.shard.params[part.position].shape)
                self._deliver_param(part.shard, part.position, grad, part.start)


@dataclass(frozen=True)
class _Publish:
    items: tuple[tuple[Unit, tuple[Shard, ...]], ...]


class _Publisher:
    """The publisher thread: broadcasts updated compute copies from their owners and completes the units' signals.

    Args:
        owner: each trainable shard's owner rank, by shard index.
        rank: this rank.
        group: the process group of its broadcasts.
        faults: where the waits for the broadcasts learn of a failed rank.
        node: the host cache this rank shares with its node, if it does (each copy then reaches each node once, see
            :class:`NodeCache`).
        copies: where the compute copies are kept when they are in the swap files, not in a host cache.
        node_copies: the copies the node's ranks read from their owners' swap files (announced here, not sent).
    """

    def __init__(self, owner: dict[int, int], rank: int, group: Any, faults: Faults,
                 node: NodeCache | None = None, copies: StoredCopies | None = None,
                 node_copies: NodeCopies | None = None) -> None:
        self._owner = owner
        self._rank = rank
        self._group = group
        self._faults = faults
        self._node = node
        self._copies = copies
        self._node_copies = node_copies
        self._jobs: queue.SimpleQueue[_Publish | _Stop] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ratel-publish", daemon=True)
        self._thread.start()

    def publish(self, items: Sequence[tuple[Unit, Sequence[Shard]]]) -> None:
        with self._cond:
            self._pending += 1
        self._jobs.put(_Publish(tuple((unit, tuple(shards)) for unit, shards in items)))

    def idle(self) -> None:
        """Wait until everything handed over was published; raise the error that stopped publishing."""
        with self._cond:
            while self._pending and self.error is None:
                self._cond.wait(timeout=1.0)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._jobs.put(_Stop())
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                return
            try:
                if self.error is None:
                    self._publish(job)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread through idle/check
                self.error = err
                # The pager must not wait for values that will not come.
                for unit, _ in job.items:
                    unit.ready.fail(err)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _publish(self, job: _Publish) -> None:
        if self._node is not None:
            for unit, shards in job.items:
                self._publish_shared(self._node, unit, shards)
            return
        for unit, shards in job.items:
            mine = [s for s in shards if self._owner[s.index] == self._rank]
            if mine:
                # The owner's updates of this step wrote the copies; they were expected when the step was scheduled.
                unit.ready.wait()
            for shard in shards:
                owner = self._owner[shard.index]
                if self._node_copies is not None and self._node_copies.shares(shard):
                    self._node_copies.publish(
                        shard, owner, lambda message: self._faults.broadcast_object(message, owner, self._group))
                    if owner != self._rank:
                        unit.ready.complete()
                    continue
                if self._copies is None:
                    self._faults.broadcast(_wire(_compute_copy(shard)), owner, self._group)
                    if owner != self._rank:
                        unit.ready.complete()
                    continue
                write = self._copies.publish(shard, owner == self._rank,
                                             lambda wire: self._faults.broadcast(wire, owner, self._group))
                if write is not None:
                    # The next forward's page-in waits for the write, then reads it back.
                    unit.ready.complete(write)

    def _publish_shared(self, node: NodeCache, unit: Unit, shards: Sequence[Shard]) -> None:
        """One unit's new compute copy into the node's shared cache: written there once, by its writer (a unit's
        shards have one owner), then announced to the node's other ranks."""
        owner = self._owner[shards[0].index]
        writer = node.writer(owner)
        failure: BaseException | None = None
        if writer == self._rank:
            try:
                if owner == self._rank:
                    # The owner's updates of this step wrote the copies into the shared cache.
                    unit.ready.wait()
                if node.column_publish is not None:
                    for shard in shards:
                        self._faults.broadcast(_wire(_compute_copy(shard)), owner, node.column_publish)
            except BaseException as err:  # noqa: BLE001 - announced to the node, then raised
                failure = err
        token = torch.tensor([0 if failure is not None else 1])
        self._faults.broadcast(token, writer, node.publish)
        if failure is not None:
            raise failure
        if token.item() != 1:
            raise RuntimeError(f"rank {writer} could not write unit {unit.index}'s new compute copy into this node's "
                               "host cache")
        if owner != self._rank:
            for _ in shards:
                unit.ready.complete()


class DataParallelAdam:
    """The CPU optimizer of one rank among several: the calls of :class:`~lightning_ratel.runtime.optimizer.CpuAdam`,
    over every trainable shard, with the updates of the shards this rank owns run by a ``CpuAdam`` of its own.

    Whole-model reads (:meth:`fetch`, :meth:`param_steps`, :meth:`moments_on_store`) are collectives: every rank makes
    them for the same shards in the same order (a checkpoint, the copy back at the end of fit).

    Args:
        make: builds the local ``CpuAdam`` for the shards given.
        shards: every trainable shard, in forward order.
        owners: each unit's owner rank (:func:`~lightning_ratel.plan.owners.assign_owners`).
        ranks: this rank's place.
        node: the host cache this rank shares with the other ranks of its node, if it does; closed with this.
        faults: where the run's failures are reported (:attr:`WorldCollectives.faults`, so that the strategy's
            collectives and these stop alike); ``None``: a watch of its own.
        exchange: ``"window"``: each rank sums its gradients of the accumulation window and reduces the sum once
            (:class:`_GradientExchange`); ``"micro_batch"``: each micro-batch's gradients are reduced onto their owners
            and summed there (:class:`_MicroBatchExchange`); ``"device"``: the same, reduced on the device, and only
            the owner copies them to host memory (:class:`_DeviceExchange`). The planner's choice
            (:func:`~lightning_ratel.plan.exchange.choose_exchange`).
        node_copies: with the compute copies in the swap files, those the node's ranks read from their owners' files
            (:class:`NodeCopies`, opened before the model was materialized); the others every rank stores.
        device: the compute device, for ``exchange="device"``.
    """

    def __init__(self, make: Callable[[list[Shard]], CpuAdam], shards: Sequence[Shard], owners: dict[int, int],
                 ranks: Ranks, node: NodeCache | None = None, faults: Faults | None = None,
                 exchange: str = "window", node_copies: NodeCopies | None = None, device: Device | None = None
                 ) -> None:
        self.shards = list(shards)
        self.ranks = ranks
        self._owner = {s.index: owners[s.unit.index] for s in self.shards}
        self.owned = [s for s in self.shards if self.owns(s)]
        # Every rank creates the groups in the same order (new_group is itself a collective).
        groups = [dist.new_group(backend="gloo", timeout=ranks.timeout) for _ in range(3)]
        self._groups = groups
        self._control = groups[2]
        self._faults = faults if faults is not None else Faults(ranks, f"ratel-faults/{groups[2].group_name}")
        self._regrouped = False
        self.local = make(self.owned)
        # Shards that received a gradient on this rank since the last step (autograd's thread adds, the training
        # thread takes after backward).
        self._window: set[int] = set()
        self.exchange = exchange
        self._exchange: _GradientExchange
        self._device_reduce: DeviceReduce | None = None
        self._device = device
        # Shards on the device tier: their owner updates them on the device (the local optimizer's device lane) and
        # sends their new compute copies to every rank's resident unit over the device group.
        self._on_device = frozenset(s.index for s in self.shards if s.state_tier == "device")
        # Flags of the reduced buckets kept on the device, on their way to the host: (bucket, flags, copy's event).
        self._device_flags: list[tuple[Bucket, torch.Tensor, Any]] = []
        self._reduce_group: Any = None
        if self._on_device and exchange != "device":
            raise RatelConfigError("the device tier's states with several ranks need gradient_exchange='device'")
        if exchange == "device":
            assert device is not None
            # The device's own backend (NCCL on CUDA) for the gradients; the other groups stay gloo on host memory.
            self._reduce_group = dist.new_group(backend="nccl" if device.is_cuda else "gloo", timeout=ranks.timeout)
            self._groups.append(self._reduce_group)
            on_device = _DeviceExchange(device, self.shards, self._owner, ranks, self._reduce_group,
                                        self._deliver_param, self._faults, self.local.begin, self._keep_on_device,
                                        self._on_device)
            self._exchange, self._device_reduce = on_device, on_device.reduce
        elif exchange == "micro_batch":
            self._exchange = _MicroBatchExchange(self.shards, self._owner, ranks, groups[0], self._deliver_param,
                                                 self._faults, self.local.begin, self.local.take_in)
        else:
            self._exchange = _GradientExchange(self.shards, self._owner, ranks, groups[0], self._deliver, self._faults)
        self._node = node
        # Compute copies in the swap files: read from the owner's where the node's ranks share them, else every rank
        # keeps each one in its own.
        self._node_copies = node_copies
        stored = [s for s in self.shards if not self._node_shares(s)]
        self.copies = (StoredCopies(self.local.store, stored, self.owns) if self.local.compute_on_store and stored
                       else None)
        self._publisher = _Publisher(self._owner, ranks.rank, groups[1], self._faults, node, self.copies,
                                     node_copies)
        # Parameters of every shard in the optimizer's order, for the global norm.
        self._param_count = sum(len(s.params) for s in self.shards)

    def owns(self, shard: Shard) -> bool:
        """Whether this rank holds ``shard``'s states and runs its update."""
        return self._owner[shard.index] == self.ranks.rank

    def _node_shares(self, shard: Shard) -> bool:
        """Whether ``shard``'s compute copy is one the node's ranks read from its writer's swap files
        (:class:`NodeCopies`)."""
        return self._node_copies is not None and self._node_copies.shares(shard)

    def stores_copy(self, shard: Shard) -> bool:
        """Whether this rank keeps ``shard``'s compute copy in its own swap files, written from its owner's broadcast
        (:class:`StoredCopies`; not the shards it owns, nor those its node's ranks share)."""
        return self.copies is not None and not self.owns(shard) and not self._node_shares(shard)

    def owner(self, shard: Shard) -> int:
        """The rank holding ``shard``'s states."""
        return self._owner[shard.index]

    @property
    def threads(self) -> int:
        """OpenMP threads of the local optimizer's updates."""
        return self.local.threads

    @property
    def host_buffer_bytes(self) -> int:
        """Host bytes of the local optimizer's buffers, of the gradient exchange's window, and of the buffers compute
        copies stored in the swap files pass through."""
        return self.local.host_buffer_bytes + self._exchange.nbytes + (self.copies.nbytes if self.copies else 0)

    @property
    def reduces_on_device(self) -> bool:
        """Whether the gradients are handed over on the device (``exchange="device"``), not copied to host memory."""
        return self._device_reduce is not None

    @property
    def exchange_counts(self) -> dict[str, int]:
        """How the gradient exchange ran: ``"reduces"`` issued so far, ``"collectives"`` per exchange (one per
        micro-batch reducing each, else per window)."""
        reduces = self._device_reduce.reduces if self._device_reduce is not None else self._exchange.reduces
        return {"reduces": reduces, "collectives": self._exchange.collectives}

    def _mine(self, shards: Sequence[Shard]) -> list[Shard]:
        return [s for s in shards if self.owns(s)]

    # ------------------------------------------------------------------ gradients

    def gradient(self, shard: Shard, position: int, grad: torch.Tensor, event: Any) -> None:
        """Hand over the gradient of ``shard.params[position]`` (autograd's thread): in host memory, or, where the
        reduces run on the device, the device's gradient itself (``event`` unused)."""
        self._window.add(shard.index)
        if self._device_reduce is not None:
            self._device_reduce.gradient(shard, position, grad)
            return
        self._exchange.put(_Gradient(shard, position, grad, event))

    def take_window(self) -> list[Shard]:
        """The shards that received a gradient on this rank since the last step, in forward order; the next window
        starts empty."""
        window, self._window = self._window, set()
        return [s for s in self.shards if s.index in window]

    def _deliver(self, shard: Shard, buffer: torch.Tensor) -> None:
        """The reduced gradient of an owned shard reaches the local optimizer (exchange thread)."""
        flags = buffer[shard.numel :]
        grad = buffer[: shard.numel]
        for position, sp in enumerate(shard.params):
            if flags[position] > 0:
                self.local.gradient(shard, position, sp.view(grad), DONE)

    def _deliver_param(self, shard: Shard, position: int, grad: torch.Tensor, start: int | None) -> None:
        """One parameter's reduced gradient of a micro-batch (or with ``start`` a flat part of it) reaches the local
        optimizer (exchange thread)."""
        self.local.gradient(shard, position, grad, DONE, start)

    def _keep_on_device(self, bucket: Bucket, reduced: torch.Tensor) -> Any:
        """A reduced bucket of owned device-tier shards reaches the local optimizer's device lane, on the device
        (the thread that reduced it); its flags follow to the host, read when the micro-batch is flushed. Returns
        the flags' copy's event: the bucket's buffer is packed again only after it."""
        lane = self.local.device
        for item in bucket.items:
            grad = reduced[item.offset : item.offset + item.numel]
            lane.receive(item.shard, item.position, grad, item.start)
        assert self._device is not None
        flags, event = self._device.to_host(reduced[bucket.numel : bucket.size],
                                            out=self._device.host_buffer(len(bucket.items), torch.float32))
        self._device_flags.append((bucket, flags, event))
        return event

    def _mark_device_gradients(self) -> None:
        """The device lane learns which parameters of the buckets it kept some rank had a gradient of (training
        thread, after a flush)."""
        pending, self._device_flags = self._device_flags, []
        for bucket, flags, event in pending:
            event.synchronize()
            for item, flag in zip(bucket.items, flags.tolist()):
                if flag > 0:
                    self.local.device.mark(item.shard, item.position)

    # ------------------------------------------------------------------ the step (training thread)

    def begin(self, plan: StepPlan | None) -> None:
        """Start a micro-batch; ``plan`` is set on the boundary micro-batch of an accumulation window."""
        if self.exchange == "window":
            self.local.begin(plan)
        if self._device_reduce is not None:
            self._device_reduce.begin()
        # Reducing each micro-batch, the exchange starts the local optimizer's micro-batch once the last one's
        # gradients reached it.
        self._exchange.put(_Begin(plan is not None, plan))

    def _flush(self) -> None:
        """Reduce whatever is left of the window and wait until the owned shards' gradients are with the optimizer."""
        if self._device_reduce is not None:
            self._device_reduce.close()
        self._exchange.wait(_Flush)
        self._mark_device_gradients()

    def _agree(self, value: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        self._faults.wait(dist.all_reduce(value, op=op, group=self._control, async_op=True))
        return value

    @property
    def control_group(self) -> Any:
        """The gloo group of the training thread's collectives (a new one after :meth:`regroup`)."""
        return self._control

    def wait(self, work: Any) -> None:
        """Wait for ``work``, a collective of gloo's started with ``async_op=True``; raise :class:`RatelRankFailed` as
        soon as a rank reports a failure (see :class:`Faults`)."""
        self._faults.wait(work)

    def report(self, error: BaseException) -> None:
        """Tell the other ranks that ``error`` stopped training here: their collectives raise
        :class:`RatelRankFailed` naming this rank instead of waiting for it (no collective)."""
        self._faults.report(error)

    def regroup(self, error: BaseException) -> None:
        """After ``error`` stopped training on this rank, before the ranks save the last committed step together
        (Lightning's ``OnExceptionCheckpoint``): report it, wait until every rank stopped, and give the training
        thread's collectives a new group (the old one may hold a collective that a failed rank never joined). Once per
        failure; a collective the exchange or the publisher abandoned stays abandoned (they stopped).

        Raises:
            RatelRankFailed: a rank did not stop within ``fault_timeout`` (its process ended, or it hangs), named.
        """
        if self._regrouped:
            return
        # The save's collectives must not stop on the failure every rank has met over (the exchange and the publisher
        # keep watching it: they stopped on it).
        self._faults = self._faults.meet(error)
        # Made through the store, as every group is: the abandoned collectives do not stand in its way.
        self._control = dist.new_group(backend="gloo", timeout=self.ranks.timeout)
        self._groups.append(self._control)
        self._regrouped = True

    def all_agree(self, verdicts: Sequence[bool]) -> list[bool]:
        """Collective: each of ``verdicts`` holds on every rank (a decision each rank takes from what it measures, made
        one decision of all ranks)."""
        agreed = self._agree(torch.tensor([int(v) for v in verdicts], dtype=torch.int64), dist.ReduceOp.MIN)
        return [bool(v) for v in agreed.tolist()]

    def _all_finite(self, finite: bool) -> bool:
        """Collective: whether every rank's gradients are finite, given whether this rank's are."""
        return self._agree(torch.tensor([0 if finite else 1]), dist.ReduceOp.MAX).item() == 0

    def unscale_(self, shards: Sequence[Shard], loss_scale: torch.Tensor) -> bool:
        """Unscale the owned gradients; whether every rank's are finite (the step is skipped everywhere if not)."""
        self._flush()
        mine = self._mine(shards)
        finite = self.local.unscale_(mine, loss_scale) if mine else True
        return self._all_finite(finite)

    def clip_(self, shards: Sequence[Shard], value: float, algorithm: str) -> bool:
        """Clip as ``torch.nn.utils.clip_grad_norm_`` over the gradients of all ranks (each rank's norms of its owned
        parameters gathered in the optimizer's order, so the total is the one a single process computes), or
        element-wise (``"value"``).

        Returns:
            Whether the norm clipped (its coefficient was below 1).
        """
        self._flush()
        mine = self._mine(shards)
        if algorithm != "norm":
            self.local.clip_(mine, value, algorithm)
            return False
        grads, indices = self.local.gradients(mine) if mine else ([], [])
        coef = self._clip_coefficient(grads, indices, value)
        _scale(grads, coef)
        return coef.item() != 1.0

    def _clip_coefficient(self, grads: list[torch.Tensor], indices: list[int], max_norm: float) -> torch.Tensor:
        """Collective: ``torch.nn.utils.clip_grad_norm_``'s clamped coefficient over the gradients of all ranks, from
        each rank's norms of its owned ``grads`` (at ``indices`` in the optimizer's parameter order)."""
        table = torch.zeros(2, self._param_count)
        if grads:
            table[0, indices] = _norms(grads)
            table[1, indices] = 1.0
        self._agree(table)
        total_norm = torch.linalg.vector_norm(table[0][table[1] > 0], 2.0)
        return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)

    def resolve(self, shards: Sequence[Shard], max_norm: float | None) -> Outcome:
        """Settle a speculative step over every rank, as :meth:`CpuAdam.resolve
        <lightning_ratel.runtime.optimizer.CpuAdam.resolve>` does on one: each owner's updates ran during backward on
        the reduced gradients as if nothing overflowed and the clip coefficient were 1; the ranks agree on the overflow
        and compute the global norm as :meth:`unscale_` and :meth:`clip_` do (the same bits), so every rank reaches
        the same outcome, and each undoes its owned updates where the guess missed."""
        self._flush()
        finite, grads, indices = self.local.kept_gradients(self._mine(shards))
        if not self._all_finite(finite):
            self.local.undo_speculation(None)
            self._announce_undone(shards)
            return "skip"
        if max_norm is None:
            return "stand"
        coef = self._clip_coefficient(grads, indices, max_norm)
        if coef.item() == 1.0:
            return "stand"
        self.local.undo_speculation(coef)
        return "redo"

    def _announce_undone(self, shards: Sequence[Shard]) -> None:
        """Collective, after a skipped step's undo: announce again the 16-bit copies of ``shards`` that the node's
        ranks share. The owners' speculative updates replaced them in place and the undo wrote them back; the step
        publishes nothing, so without this a rank could page one in while its owner still rewrites it."""
        for shard in shards:
            if shard.dtype != torch.float32 and self._node_shares(shard):
                self._announce(shard, self.owner(shard))

    def finish(self, plan: StepPlan, unit_order: Sequence[int], loss_scale: torch.Tensor | None = None,
               clip: tuple[float, str] | None = None) -> Finished:
        """Finish the step on the shards that received a gradient on this rank, as
        :meth:`CpuAdam.finish <lightning_ratel.runtime.optimizer.CpuAdam.finish>` does, over every rank."""
        # The local optimizer's own window (the owned shards the reduces delivered) is part of this one.
        self.local.take_window()
        return finish_step(self, self._agreed_window(), plan, unit_order, loss_scale, clip)

    def _agreed_window(self) -> list[Shard]:
        """Collective: the shards that received a gradient on any rank since the last step, in forward order. A rank
        whose forward left a parameter unused has no gradient of it (its share of the reduce is zero, as under
        ``DistributedDataParallel(find_unused_parameters=True)``); every rank still finishes the step on the same
        shards, so that they issue the same collectives and publish the same units."""
        window = {s.index for s in self.take_window()}
        mask = self._agree(torch.tensor([int(s.index in window) for s in self.shards], dtype=torch.int32),
                           dist.ReduceOp.MAX)
        return [s for s, got in zip(self.shards, mask.tolist()) if got]

    def discard_window(self) -> None:
        """Drop the gradients received since the last step without updating anything (``zero_grad``)."""
        if self.exchange != "window":
            # Collective: the micro-batch's reduces (some may have run, on every rank alike) go to their end, and each
            # owner drops what reached its optimizer, whatever this rank's own gradients were.
            self._flush()
            self._exchange.wait(_Drop)
            self.take_window()
            self.local.discard_window()
            return
        self.local.take_window()
        shards = self.take_window()
        if shards:
            self.discard(shards)

    def schedule(self, plan: StepPlan, shards: Sequence[Shard]) -> None:
        """Finish the step on every rank or on none: wait for the reduces, agree that every rank finished its step,
        update the owned shards and publish every updated shard's new compute copy."""
        self._flush()
        # Every rank gets here, or the others fail here (the collective breaks when a rank's process ends): a step
        # never commits on some ranks only.
        self._agree(torch.ones(1))
        self.local.schedule(plan, self._mine(shards))
        by_unit: dict[int, list[Shard]] = {}
        for shard in shards:
            if shard.index in self._on_device:
                continue
            if not self.owns(shard):
                shard.unit.ready.expect()
            by_unit.setdefault(shard.unit.index, []).append(shard)
        self._send_device_copies([s for s in shards if s.index in self._on_device])
        self._publisher.publish([(shards_of[0].unit, shards_of) for shards_of in by_unit.values()])

    def _send_device_copies(self, shards: Sequence[Shard]) -> None:
        """Every rank's resident compute copy of device-tier ``shards`` gets its owner's (the owner's update wrote
        it): broadcasts on the device group, which the current stream follows (training thread)."""
        if not shards:
            return
        device = self._device
        assert device is not None
        # All issued before the current stream waits for any: they run back to back on the group's stream.
        works = [dist.broadcast(_wire(_compute_copy(shard)), self.owner(shard), group=self._reduce_group,
                                async_op=True) for shard in shards]
        for work in works:
            device.wait_collective(work, self._faults.wait)

    def discard(self, shards: Sequence[Shard]) -> None:
        """Drop the window's gradients (a skipped step, ``zero_grad``)."""
        if self.exchange != "window":
            # The reduces of the micro-batch run to their end on every rank (some may have started): then dropped.
            self._flush()
        self._exchange.wait(_Drop)
        self.local.discard(self._mine(shards))

    def abort(self) -> None:
        """Abandon the unfinished step on this rank (no collective: the others may be gone)."""
        if self._device_reduce is not None:
            self._device_reduce.forget()
        self._device_flags.clear()
        self._exchange.wait(_Drop)
        self.local.abort()

    def barrier(self, include_writes: bool = False) -> None:
        """Wait until everything handed over has run and been published (and written back, optionally)."""
        self.local.barrier(include_writes)
        self._publisher.idle()

    def check(self) -> None:
        """Raise the error of the local optimizer, the exchange or the publisher, if one had one."""
        self.local.check()
        for part in (self._exchange, self._publisher):
            if part.error is not None:
                raise part.error

    def release_memory(self) -> None:
        """Free the buffers of the updates (no more will run)."""
        self._exchange.wait(_Drop)
        self._exchange.pool.clear()
        if self._device_reduce is not None:
            self._device_reduce.release()
        self.local.release_memory()

    def close(self) -> None:
        """Stop the threads and the local optimizer, and release the process groups."""
        try:
            self._exchange.stop()
            self._publisher.stop()
            self.local.close()
        finally:
            for group in self._groups:
                dist.destroy_process_group(group)
            self._groups = []
            if self._node is not None:
                self._node.close()

    # ------------------------------------------------------------------ state (whole-model passes)

    def sync_compute_copies(self, frozen: Sequence[Shard] = ()) -> None:
        """Give every rank the owners' compute copies of all trainable shards (after the model is materialized: the
        owners' masters are the values, as rank 0's are under ``DistributedDataParallel``). With a shared cache the
        owner wrote them on its node while materializing, and each other node's writer receives them; then the node's
        other ranks may read (every unit's first copy was written by its writer). With the copies in the swap files
        each owner reads its own back and every other rank stores what it receives, or reads it from the owner's files
        where the node's ranks share them, the copies of the ``frozen`` shards too (see :class:`NodeCopies`)."""
        node = self._node
        if self.local.compute_on_store:
            for shard in frozen:
                self.share_frozen_copy(shard)
            for shard in self.shards:
                owner = self.owner(shard)
                if self._node_shares(shard):
                    self._announce(shard, owner)
                else:
                    assert self.copies is not None
                    self.copies.publish(shard, owner == self.ranks.rank,
                                        lambda wire: self._faults.broadcast(wire, owner, self._control))
            if self.copies is not None:
                self.copies.settle()
            return
        if node is None:
            for shard in self.shards:
                if shard.index not in self._on_device:
                    self._faults.broadcast(_wire(_compute_copy(shard)), self.owner(shard), self._control)
            self._send_device_copies([s for s in self.shards if s.index in self._on_device])
            return
        if node.column_control is not None:
            for shard in self.shards:
                if node.writer(self.owner(shard)) == self.ranks.rank:
                    self._faults.broadcast(_wire(_compute_copy(shard)), self.owner(shard), node.column_control)
        self._faults.barrier(node.control)

    def fetch(self, shard: Shard, flat: torch.Tensor, read: Callable[[CpuAdam], tuple[Future | None, Any]]) -> Any:
        """Collective: the owner reads one of ``shard``'s committed states into ``flat`` with ``read`` (given its local
        optimizer) and every rank receives it there."""
        if self.owns(shard):
            future, _ = read(self.local)
            if future is not None:
                future.result()
        self._faults.broadcast(_wire(flat), self.owner(shard), self._control)
        return flat

    def gather_objects(self, obj: Any) -> list[Any]:
        """Collective: every rank's ``obj`` (picklable), in rank order, on every rank (a checkpoint's bookkeeping)."""
        return self._faults.gather_objects(obj, self._control)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: rank ``src``'s ``obj`` (picklable) on every rank (a decision one rank takes for all)."""
        return self._faults.broadcast_object(obj, src, self._control)

    def _ledger(self, shard: Shard) -> tuple[list[int], bool]:
        """Collective: ``shard``'s committed step counts and whether its moments were ever written."""
        entry = torch.zeros(len(shard.params) + 1, dtype=torch.int64)
        if self.owns(shard):
            entry[0] = int(self.local.moments_on_store(shard))
            entry[1:] = torch.tensor(self.local.param_steps(shard), dtype=torch.int64)
        self._faults.broadcast(entry, self.owner(shard), self._control)
        return [int(s) for s in entry[1:]], bool(entry[0])

    def param_steps(self, shard: Shard) -> list[int]:
        """Collective: ``torch.optim.AdamW``'s committed step count of each parameter of ``shard``."""
        self.barrier(include_writes=True)
        return self._ledger(shard)[0]

    def moments_on_store(self, shard: Shard) -> bool:
        """Collective: whether ``shard``'s committed moments were ever written."""
        self.barrier(include_writes=True)
        return self._ledger(shard)[1]

    def state_key(self, shard: Shard, what: str) -> str:
        """The store key of an owned shard's committed state (another rank's store holds the others)."""
        if not self.owns(shard):
            raise KeyError(f"shard {shard.index}'s states are on rank {self.owner(shard)}, not on {self.ranks.rank}")
        return self.local.state_key(shard, what)

    def load_state(self, shard: Shard, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: Sequence[int]) -> None:
        """Replace an owned shard's committed moments and step counts; the owner keeps them, others skip."""
        if self.owns(shard):
            self.local.load_state(shard, exp_avg, exp_avg_sq, steps)

    def load_record(self, shard: Shard, record: torch.Tensor, steps: Sequence[int]) -> None:
        """Replace an owned shard's committed state record; the owner keeps it, others skip."""
        if self.owns(shard):
            self.local.load_record(shard, record, steps)

    def assign(self, shard: Shard, master: torch.Tensor) -> None:
        """Give ``shard`` new values between steps: its master on the owner, its compute copy on every rank (each
        rank runs the same code that wrote them)."""
        if self._node_shares(shard):
            if self.owns(shard):
                self.local.assign(shard, master)
            self._announce(shard, self.owner(shard))
        elif self.owns(shard):
            self.local.assign(shard, master)
        elif self.copies is not None:
            self.barrier()
            self.copies.store(shard, master)
        else:
            self.barrier()
            # In a shared cache every rank of the node writes the same bytes here: a rank reads the new values once
            # its own copy is made, whichever rank's copy lands last.
            _compute_copy(shard).copy_(master)

    def _announce(self, shard: Shard, writer: int) -> None:
        """Collective on the training thread's group: ``shard``'s copy in ``writer``'s files, announced by it to the
        ranks that read it there (:meth:`NodeCopies.publish`)."""
        assert self._node_copies is not None
        self._node_copies.publish(shard, writer,
                                  lambda message: self._faults.broadcast_object(message, writer, self._control))

    def share_frozen_copy(self, shard: Shard, write: Callable[[], None] | None = None) -> None:
        """Collective: a frozen shard's compute copy, written into the swap files by ``write`` (``None``: already
        written), on every rank: where the node's ranks share them, written by one rank and announced to the others
        (:class:`NodeCopies`), else by each rank into its own."""
        if not self._node_shares(shard):
            if write is not None:
                write()
            return
        if write is not None and self.ranks.rank == NodeCopies.FROZEN_WRITER:
            write()
        self._announce(shard, NodeCopies.FROZEN_WRITER)

    def compute_copy(self, shard: Shard) -> torch.Tensor:
        """``shard``'s current compute copy on this rank, to read between steps (a buffer reused by the next call
        where the copies are in the swap files: copy what is kept)."""
        if self._node_shares(shard):
            assert self._node_copies is not None
            self.barrier()
            return self._node_copies.read(shard)
        if self.copies is None:
            return _compute_copy(shard)
        self.barrier()
        return self.copies.current(shard)
