"""Each micro-batch's gradients reduced onto their owners on the device (``gradient_exchange="device"``).

The exchanges of :mod:`lightning_ratel.runtime.collectives` reduce in host memory over gloo: every rank copies all
of its gradients to the host, and the ranks' copies are summed over the host's loopback network (gloo's reduce of
fp32 moves under 1 GB/s on two CPU ranks of a 2-core box, ``benchmarks/RESULTS.md``), while on a GPU server the
device-to-device path (NCCL over PCIe or NVLink) is one to two orders of magnitude faster. Here the gradients stay on
the device: each micro-batch's are packed into the buckets every rank cuts alike
(:func:`~lightning_ratel.runtime.buckets.cut_buckets`: one owner's consecutive parameters, a large one in parts, the
shards in the exchanges' fixed order), each bucket is multiplied by ``1 / world_size`` and reduced onto its owner by
the process group's backend on the device (NCCL on CUDA, gloo on the CPU), and only the owner copies the reduced
bucket to host memory, where the exchange thread hands its parameters to the owner's optimizer
(:class:`~lightning_ratel.runtime.collectives._DeviceExchange`). So the sums run on the GPUs and their links (NVLink
or PCIe peer to peer where the GPUs have them, through host memory where they do not), not on the host's cores, and
only each owner's share of them reaches the CPU optimizer. The numbers are those of ``gradient_exchange="micro_batch"``:
the owner's optimizer sums the window's micro-batches.

Threads and streams: autograd's thread hands each gradient over (:meth:`DeviceReduce.gradient`) and reduces a shard as
soon as backward completes it, in the fixed order; the training thread reduces what is left at the micro-batch's end
(:meth:`DeviceReduce.begin` of the next, :meth:`DeviceReduce.close`). Both issue device work and collectives, never at
the same time. The packing and the ``1 / world_size`` run on the current stream, which the collective follows; the
owner's copy to host memory runs on the device->host stream once the collective is done; a bucket buffer is packed again
only after the current stream waited for its last collective (and copy). The owner's copy lands in a buffer of the
device's host pool (pinned on CUDA), which takes it back once the optimizer dropped the views it was handed: as the
copies of :class:`~lightning_ratel.runtime.gradients.GradientOffload` on one rank, bounded by the optimizer's
gradient budget, so that backward never waits for the optimizer here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_ratel.runtime.buckets import (
    MICRO_BATCH_BUCKETS,
    Bucket,
    bucket_places,
    cut_buckets,
    gradient_order,
    pack,
)
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.units import Shard


class DeviceReduce:
    """Packs a rank's gradients into device buckets and reduces each onto its owner (see the module docstring).

    Args:
        device: the compute device.
        shards: every trainable shard, in forward order.
        owner: each shard's owner rank, by shard index.
        rank: this rank.
        world: the number of ranks.
        group: the process group of the reduces (NCCL on CUDA).
        landed: called on the owner with a reduced bucket, the host buffer its copy lands in (the gradients, then one
            flag per item: above 0 where some rank had that gradient) and the copy's event.
        kept: for the buckets of ``stay``'s shards: called on the owner instead, with the reduced bucket on the device
            (the current stream ordered after the collective); returns the event of the last copy that reads the
            bucket on another stream (``None``: none), which packing the buffer again waits for.
        stay: the shards, by index, whose reduced gradients stay on the device (their states are on the device tier:
            the owner updates them there). A bucket holds one owner's shards of one tier.
        host_wait: how the host waits for a collective where it must (on the CPU): one that watches for a failed rank.
    """

    def __init__(self, device: Device, shards: Sequence[Shard], owner: dict[int, int], rank: int, world: int,
                 group: Any, landed: Callable[[Bucket, torch.Tensor, Any], None],
                 kept: Callable[[Bucket, torch.Tensor], Any] | None = None, stay: frozenset[int] = frozenset(),
                 host_wait: Callable[[Any], None] | None = None) -> None:
        self.device = device
        self._owner = owner
        self._rank = rank
        self._world = world
        self._group = group
        self._landed = landed
        self._kept = kept
        self._stay = stay
        self._host_wait = host_wait
        # Parameters that get a gradient from autograd; a shard is complete once each of them came.
        self._expected, self._order = gradient_order(shards)
        positions = {s.index: sorted(self._expected[s.index]) for s in self._order}
        self.buckets = cut_buckets(self._order, positions, owner)
        self._places = bucket_places(self.buckets)
        for bucket in self.buckets:
            if len({item.shard.index in stay for item in bucket.items}) > 1:
                raise ValueError("a bucket mixes shards whose gradients stay on the device with others")
        numel = max((b.size for b in self.buckets), default=0)
        self._buffers = [device.device_empty(numel, torch.float32) for _ in range(MICRO_BATCH_BUCKETS if numel else 0)]
        # What packing each buffer again waits for: its last collective, or the owner's copy that followed it.
        self._last_use: list[Callable[[], None] | None] = [None] * len(self._buffers)
        self._next = 0
        # Collectives issued so far (read by the training thread for a run's figures).
        self.reduces = 0
        self._forget()

    @property
    def device_nbytes(self) -> int:
        """Device bytes of the bucket buffers."""
        return sum(t.numel() * t.element_size() for t in self._buffers)

    def gradient(self, shard: Shard, position: int, grad: torch.Tensor) -> None:
        """Hand over the gradient of ``shard.params[position]``, on the device (autograd's thread)."""
        if shard.index in self._issued:
            raise RuntimeError(
                f"a second gradient of {shard.params[position].name} arrived in one micro-batch after its shard was "
                "reduced; gradient_exchange='device' expects each parameter's gradient once per training step call: "
                "use gradient_exchange='window' (with the optimizer states in host memory or the swap files)")
        held = self._held.setdefault(shard.index, {})
        if position in held:
            held[position] = held[position] + grad
        else:
            held[position] = grad
        self._open = True
        if held.keys() >= self._expected[shard.index]:
            self._complete.add(shard.index)
            while self._cursor < len(self._order) and self._order[self._cursor].index in self._complete:
                self._issue(self._order[self._cursor])

    def begin(self) -> None:
        """Start a micro-batch, once the last one's are reduced (training thread)."""
        self.close()
        self._open = True

    def close(self) -> None:
        """Reduce what is left of the open micro-batch, in order (zeros for the gradients this rank has none of)
        (training thread)."""
        if self._open:
            while self._cursor < len(self._order):
                self._issue(self._order[self._cursor])
        self._forget()

    def forget(self) -> None:
        """Drop the micro-batch's gradients without reducing them (a step abandoned on this rank)."""
        self._forget()

    def release(self) -> None:
        """Free the buffers: no more reduces will run (a micro-batch begun after this reduces nothing)."""
        self._buffers = []
        self._last_use = []
        self._order = []
        self._forget()

    def _forget(self) -> None:
        self._held: dict[int, dict[int, torch.Tensor]] = {}
        self._complete: set[int] = set()
        self._issued: set[int] = set()
        self._cursor = 0
        # The bucket being filled and the index of its buffer.
        self._filling: tuple[int, int] | None = None
        # Whether a micro-batch is open: begun, or some gradient came (its reduces are then due).
        self._open = False

    def _issue(self, shard: Shard) -> None:
        """Pack the shard's gradients into their buckets, reducing each bucket it fills."""
        self._cursor += 1
        self._issued.add(shard.index)
        held = self._held.pop(shard.index, {})
        for b, i in self._places.get(shard.index, ()):
            bucket = self.buckets[b]
            k = self._buffer(b)
            pack(self._buffers[k], bucket, i, held)
            if i == len(bucket.items) - 1:
                self._reduce(bucket, k)

    def _buffer(self, b: int) -> int:
        """The index of bucket ``b``'s buffer: the one being filled, else the next of the pool, once the current
        stream waited for its last use."""
        if self._filling is not None and self._filling[0] == b:
            return self._filling[1]
        k = self._next
        self._next = (k + 1) % len(self._buffers)
        last = self._last_use[k]
        if last is not None:
            last()
        self._filling = (b, k)
        return k

    def _reduce(self, bucket: Bucket, k: int) -> None:
        self._filling = None
        sent = self._buffers[k][: bucket.size]
        # DistributedDataParallel's arithmetic: each rank's gradient multiplied by 1/world, summed over the ranks.
        sent[: bucket.numel].mul_(1.0 / self._world)
        work = dist.reduce(sent, dst=bucket.owner, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        self.reduces += 1
        if bucket.owner != self._rank:
            self._last_use[k] = lambda: self.device.wait_collective(work, self._host_wait)
            return
        if bucket.items[0].shard.index in self._stay:
            assert self._kept is not None
            self.device.wait_collective(work, self._host_wait)
            read = self._kept(bucket, sent)
            self._last_use[k] = None if read is None else (lambda: self.device.wait(read))
            return
        # The copy to the host follows the collective on the device->host stream, not the compute stream; into a
        # buffer of its own also where the device is the host, since the bucket is packed again.
        with self.device.on(self.device.d2h_stream):
            self.device.wait_collective(work, self._host_wait)
        host, event = self.device.to_host(sent, out=self.device.host_buffer(bucket.size, torch.float32))
        self._last_use[k] = lambda: self.device.wait(event)
        self._landed(bucket, host, event)
