"""How each micro-batch's gradients are cut into buckets and packed for their reduces onto the owners (several ranks).

Every rank cuts the same buckets from the trainable shards in the exchange's fixed order: consecutive parameters of
one owner, up to a cap, a larger parameter in parts. Used by the exchange that reduces in host memory
(:class:`~lightning_ratel.runtime.collectives._MicroBatchExchange`) and by the one that reduces on the device
(:class:`~lightning_ratel.runtime.device_reduce.DeviceReduce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_ratel.runtime.units import Shard

MICRO_BATCH_BUCKET_BYTES = 25 * 2**20
"""The most fp32 gradient bytes one reduce of a micro-batch's gradients sends (``DistributedDataParallel``'s default
bucket); a larger parameter is reduced in parts."""

MICRO_BATCH_BUCKETS = 2
"""Buckets a rank holds at once, reducing each micro-batch: one filled while the other's reduce runs."""


@dataclass(frozen=True)
class BucketItem:
    """A parameter's gradient in a bucket, or a part of it: ``numel`` elements of ``shard.params[position]``, flat
    from element ``start`` (``None``: the whole parameter), at element ``offset`` of the bucket."""

    shard: Shard
    position: int
    offset: int
    start: int | None
    numel: int


@dataclass(frozen=True)
class Bucket:
    """Gradients of one owner reduced in one collective: the parameters' fp32 gradients (or parts of them) end to end,
    then one flag per item (1 where this rank has the parameter's gradient, summed over the ranks by the reduce).

    Attributes:
        owner: the rank the bucket is reduced onto.
        items: what it holds, in order.
        numel: elements of the gradients (the flags follow).
    """

    owner: int
    items: tuple[BucketItem, ...]
    numel: int

    @property
    def size(self) -> int:
        """Elements the reduce sends: the gradients and the flags."""
        return self.numel + len(self.items)


def bucket_cap(params: Sequence[Sequence[int]]) -> int:
    """Elements a bucket holds at most, flags included (``params``: each trainable shard's parameter sizes):
    ``MICRO_BATCH_BUCKET_BYTES`` of fp32, or half the largest shard, so that the two buckets in flight hold no more
    than the largest shard's gradients; at least 2 (a part and its flag)."""
    largest = max((sum(numels) + len(numels) for numels in params), default=0)
    return max(2, min(MICRO_BATCH_BUCKET_BYTES // 4, -(-largest // 2)))


def cut_buckets(order: Sequence[Shard], positions: dict[int, list[int]], owner: dict[int, int]) -> list[Bucket]:
    """The buckets of one micro-batch: the parameters in ``order`` (each shard's ``positions``), cut where the owner
    changes or where the next parameter would take a bucket over :func:`bucket_cap`. A parameter larger than the cap
    is cut into parts that fill a bucket each, its last part opening the next bucket. Every rank cuts the same
    buckets."""
    cap = bucket_cap([[s.params[p].numel for p in positions[s.index]] for s in order])
    buckets: list[Bucket] = []
    items: list[BucketItem] = []
    numel = 0

    def close() -> None:
        nonlocal items, numel
        if items:
            buckets.append(Bucket(owner[items[0].shard.index], tuple(items), numel))
        items, numel = [], 0

    for shard in order:
        for position in positions[shard.index]:
            size = shard.params[position].numel
            if items and (owner[items[0].shard.index] != owner[shard.index] or numel + size + len(items) + 1 > cap):
                close()
            if size + 1 <= cap:
                items.append(BucketItem(shard, position, numel, None, size))
                numel += size
                continue
            # Each part but the last fills a bucket of its own (with its flag); the last opens the next bucket.
            for start in range(0, size, cap - 1):
                close()
                items.append(BucketItem(shard, position, 0, start, min(cap - 1, size - start)))
                numel = items[0].numel
    close()
    return buckets


def gradient_order(shards: Sequence[Shard]) -> tuple[dict[int, set[int]], list[Shard]]:
    """The fixed order every rank reduces ``shards`` in (reverse forward order, the order backward completes them;
    shards without a parameter that gets a gradient left out), and each shard's positions that get a gradient from
    autograd, by shard index (the others never complete a shard)."""
    expected = {s.index: {i for i, sp in enumerate(s.params) if sp.param.requires_grad} for s in shards}
    return expected, [s for s in reversed(shards) if expected[s.index]]


def bucket_places(buckets: Sequence[Bucket]) -> dict[int, list[tuple[int, int]]]:
    """Each shard's parameters, by shard index: (bucket, item) in the order they are packed."""
    places: dict[int, list[tuple[int, int]]] = {}
    for b, bucket in enumerate(buckets):
        for i, item in enumerate(bucket.items):
            places.setdefault(item.shard.index, []).append((b, i))
    return places


def pack(buffer: torch.Tensor, bucket: Bucket, i: int, held: dict[int, torch.Tensor]) -> None:
    """Put item ``i`` of ``bucket`` into its ``buffer``: this rank's gradient of the item's parameter (``held``, by
    position; a parameter in parts is made contiguous there once), as fp32, zeros where this rank has none, and the
    item's flag (1 where it has one)."""
    item = bucket.items[i]
    target = buffer[item.offset : item.offset + item.numel]
    grad = held.get(item.position)
    if grad is None:
        target.zero_()
    elif item.start is None:
        target.view(grad.shape).copy_(grad)
    else:
        if not grad.is_contiguous():
            grad = held[item.position] = grad.contiguous()
        target.copy_(grad.view(-1)[item.start : item.start + item.numel])
    buffer[bucket.numel + i].fill_(0.0 if grad is None else 1.0)
