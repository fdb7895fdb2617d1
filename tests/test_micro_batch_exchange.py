"""The gradient exchange that reduces each micro-batch onto the owners (``gradient_exchange="micro_batch"``), on two
spawned gloo processes with a hand-made layout: each bucket of one owner's parameters goes in one collective, a
parameter larger than a bucket goes in parts, the sums the owner receives are bit for bit those of reducing each
parameter's gradient by itself (16-bit, missing and non-contiguous gradients included; over three or more ranks gloo
orders the sums otherwise), the bucket buffers are allocated once for every micro-batch and hold no more than the cap
whatever the largest parameter, a buffer the owner's optimizer has not taken in yet is never reused, and a rank that
fails is named instead of hanging the other. The same on the device (``gradient_exchange="device"``): buckets
reduced where the gradients are (here the CPU, also with CUDA's streams simulated), the owner's copy of each in one of
two host buffers reused."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_ratel.errors import RatelRankFailed
from lightning_ratel.runtime.buckets import MICRO_BATCH_BUCKETS, Bucket
from lightning_ratel.runtime.collectives import (
    Faults,
    Ranks,
    _Begin,
    _DeviceExchange,
    _Flush,
    _Gradient,
    _MicroBatchExchange,
    exchange_micro_batch_nbytes,
)
from lightning_ratel.runtime.device import DONE, Device
from lightning_ratel.runtime.hostmem import ALIGNMENT
from lightning_ratel.runtime.units import Shard, ShardParam, Unit
from lightning_ratel.sizes import round_up
from tests.forked_ranks import START_METHOD

TIMEOUT = timedelta(minutes=10)
# Each shard's parameter sizes: the largest shard (550 elements and 3 flags) caps a bucket at 277 elements.
SIZES = [[300, 200, 50], [40, 30], [500], [10, 10, 10]]
# Units 0 and 1 belong to rank 0, units 2 and 3 to rank 1.
OWNERS = {0: 0, 1: 0, 2: 1, 3: 1}
# Backward's order (last shard first), one owner's consecutive parameters up to the cap, a larger one in parts of
# 276 elements and a flag, its last part opening the next bucket:
# [s3: 10 10 10] [s2: 500 0-275] [s2: 500 276-499] | [s1: 40 30] [s0: 300 0-275] [s0: 300 276-299, 200, 50].
BUCKETS = 6
LARGEST_BUCKET = 277
# Parts each owner receives per micro-batch (rank 0 those of s0's 300, rank 1 those of s2's 500).
PARTS = 2
MICRO_BATCHES = 3


def _shards() -> list[Shard]:
    shards = []
    for index, sizes in enumerate(SIZES):
        params, offset = [], 0
        for position, numel in enumerate(sizes):
            shape = torch.Size([numel // 10, 10] if numel % 10 == 0 else [numel])
            param = nn.Parameter(torch.zeros(shape))
            params.append(ShardParam(f"s{index}.p{position}", param, 0, offset, numel, shape))
            offset += numel
        shards.append(Shard(index, Unit(index, (), {}), 0, torch.float32, 0, tuple(params), offset))
    return shards


def _gradient(shard: Shard, position: int, rank: int, micro_batch: int) -> torch.Tensor | None:
    """This rank's gradient of a parameter in a micro-batch: ``None`` where it has none."""
    if (shard.index, position) == (0, 2):
        return None  # no rank has one: never reduced, never delivered
    if (shard.index, position) == (1, 1) and rank == 1:
        return None  # only rank 0 has one: rank 1 reduces zeros
    sp = shard.params[position]
    generator = torch.Generator().manual_seed(1000 * rank + 100 * micro_batch + 10 * shard.index + position)
    grad = torch.randn(sp.shape, generator=generator) * 10 ** (shard.index - 2)
    if (shard.index, position) == (2, 0):
        return grad.to(torch.bfloat16)
    if (shard.index, position) == (0, 0):
        return grad.t().contiguous().t()  # a non-contiguous gradient
    return grad


def _per_parameter(shards: list[Shard], rank: int, micro_batch: int, group: object
                   ) -> dict[tuple[int, int], torch.Tensor]:
    """What the owners receive reducing each parameter by itself (the exchange before buckets)."""
    received = {}
    for shard in reversed(shards):
        for position, sp in enumerate(shard.params):
            grad = _gradient(shard, position, rank, micro_batch)
            flag = torch.tensor([0 if grad is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if not flag.item():
                continue
            tensor = torch.zeros(sp.shape) if grad is None else grad.to(torch.float32).clone()
            tensor.mul_(0.5)
            dist.reduce(tensor, dst=OWNERS[shard.index], op=dist.ReduceOp.SUM, group=group)
            if OWNERS[shard.index] == rank:
                received[(shard.index, position)] = tensor
    return received


class _Optimizer:
    """The owner's optimizer as the exchange sees it: views delivered are held until taken in, then copied (parts
    into their place of a parameter's gradient, NaN where none came)."""

    def __init__(self) -> None:
        self.held: list[tuple[Shard, int, torch.Tensor, int | None]] = []
        self.taken: dict[tuple[int, int], torch.Tensor] = {}
        self.take_ins = 0
        self.parts = 0

    def deliver(self, shard: Shard, position: int, grad: torch.Tensor, start: int | None) -> None:
        self.held.append((shard, position, grad, start))

    def begin(self, plan: object) -> None:
        pass

    def take_in(self) -> None:
        self.take_ins += 1
        for shard, position, grad, start in self.held:
            if start is None:
                self.taken[(shard.index, position)] = grad.clone()
                continue
            sp = shard.params[position]
            whole = self.taken.setdefault((shard.index, position), torch.full(sp.shape, float("nan")))
            whole.view(-1)[start : start + grad.numel()] = grad
            self.parts += 1
        self.held.clear()


def _two_ranks(rank: int, init: str) -> tuple[Ranks, Faults, object, object, list[Shard], dict[int, int]]:
    """This process as ``rank`` of two gloo ranks: its place, the failure watch, a group for the reference reduces
    and one for the exchange, the shards and each shard's owner."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=TIMEOUT)
    ranks = Ranks(rank=rank, world=2, timeout=TIMEOUT, fault_timeout=timedelta(seconds=60))
    faults = Faults(ranks, "test-exchange")
    reference_group = dist.new_group(backend="gloo")
    group = dist.new_group(backend="gloo")
    shards = _shards()
    return ranks, faults, reference_group, group, shards, {s.index: OWNERS[s.unit.index] for s in shards}


def _hand_over(shards: list[Shard], rank: int, micro_batch: int, give: Callable[[Shard, int, torch.Tensor], None]
               ) -> None:
    """Give this rank's gradients of a micro-batch, the last shard first, as backward completes them."""
    for shard in reversed(shards):
        for position in range(len(shard.params)):
            grad = _gradient(shard, position, rank, micro_batch)
            if grad is not None:
                give(shard, position, grad)


def _check_received(optimizer: _Optimizer, shards: list[Shard], rank: int, micro_batch: int, group: object) -> None:
    """The owner's optimizer took in, bit for bit, what reducing each parameter by itself gives; then forgets it."""
    expected = _per_parameter(shards, rank, micro_batch, group)
    assert optimizer.taken.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(optimizer.taken[key], tensor), (micro_batch, key)
    optimizer.taken.clear()


def _worker(rank: int, init: str, scenario: str) -> None:
    ranks, faults, reference_group, group, shards, owner = _two_ranks(rank, init)
    optimizer = _Optimizer()
    exchange = _MicroBatchExchange(shards, owner, ranks, group, optimizer.deliver, faults, optimizer.begin,
                                   optimizer.take_in)

    def put(shard: Shard, position: int, grad: torch.Tensor) -> None:
        exchange.put(_Gradient(shard, position, grad, DONE))

    try:
        if scenario == "fails":
            exchange.put(_Begin(False))
            if rank == 1:
                faults.report(RuntimeError("rank 1 fails"))
                return
            _hand_over(shards, rank, 0, put)
            with pytest.raises(RatelRankFailed, match=r"rank 1 failed \(RuntimeError: rank 1 fails\)"):
                exchange.wait(_Flush)
            return
        assert exchange.collectives == BUCKETS
        for micro_batch in range(MICRO_BATCHES):
            exchange.put(_Begin(micro_batch == MICRO_BATCHES - 1))
            _hand_over(shards, rank, micro_batch, put)
            exchange.wait(_Flush)
            optimizer.take_in()
            _check_received(optimizer, shards, rank, micro_batch, reference_group)
        assert exchange.reduces == MICRO_BATCHES * BUCKETS
        assert optimizer.parts == MICRO_BATCHES * PARTS
        buffer = round_up(LARGEST_BUCKET * 4, ALIGNMENT)
        # Two buffers for every bucket of every micro-batch: allocated once, within the estimate.
        assert exchange.nbytes == MICRO_BATCH_BUCKETS * buffer <= exchange_micro_batch_nbytes(shards)
        # Each owner delivers more buckets than the pool holds: it waited for its optimizer to take them in.
        assert optimizer.take_ins > MICRO_BATCHES
    finally:
        exchange.stop()
        dist.destroy_process_group()


@pytest.mark.parametrize("scenario", ["healthy", "fails"])
def test_micro_batch_exchange_of_two_ranks(tmp_path: Path, scenario: str) -> None:
    mp.start_processes(_worker, args=(f"file://{tmp_path}/init", scenario), nprocs=2, join=True,
                       start_method=START_METHOD)


def _device_worker(rank: int, init: str, scenario: str, simulate: bool) -> None:
    ranks, faults, reference_group, group, shards, owner = _two_ranks(rank, init)
    optimizer = _Optimizer()
    device = Device(torch.device("cpu"), simulate_streams=simulate)
    exchange = _DeviceExchange(device, shards, owner, ranks, group, optimizer.deliver, faults, optimizer.begin)
    reduce = exchange.reduce
    try:
        if scenario == "fails":
            reduce.begin()
            exchange.put(_Begin(False))
            if rank == 1:
                faults.report(RuntimeError("rank 1 fails"))
                return
            with pytest.raises(RatelRankFailed, match=r"rank 1 failed \(RuntimeError: rank 1 fails\)"):
                _hand_over(shards, rank, 0, reduce.gradient)
                reduce.close()
                exchange.wait(_Flush)
            return
        assert exchange.collectives == BUCKETS
        for micro_batch in range(MICRO_BATCHES):
            reduce.begin()
            exchange.put(_Begin(micro_batch == MICRO_BATCHES - 1))
            _hand_over(shards, rank, micro_batch, reduce.gradient)
            reduce.close()
            exchange.wait(_Flush)
            optimizer.take_in()
            _check_received(optimizer, shards, rank, micro_batch, reference_group)
        assert reduce.reduces == MICRO_BATCHES * BUCKETS
        assert optimizer.parts == MICRO_BATCHES * PARTS
        # Two buckets on the device for every bucket of every micro-batch, within the estimate; the owner's copies
        # are the device's pool's (views held by its optimizer keep them).
        assert reduce.device_nbytes == MICRO_BATCH_BUCKETS * LARGEST_BUCKET * 4 <= exchange_micro_batch_nbytes(shards)
        assert exchange.nbytes == 0
        with pytest.raises(RuntimeError, match="gradient_exchange='device' expects each parameter's gradient once"):
            reduce.gradient(shards[3], 0, torch.ones(10))
            reduce.gradient(shards[3], 1, torch.ones(10))
            reduce.gradient(shards[3], 2, torch.ones(10))
            reduce.gradient(shards[3], 0, torch.ones(10))
    finally:
        exchange.stop()
        dist.destroy_process_group()


@pytest.mark.parametrize("simulate", [False, True], ids=["cpu", "simulated-streams"])
@pytest.mark.parametrize("scenario", ["healthy", "fails"])
def test_device_exchange_of_two_ranks(tmp_path: Path, scenario: str, simulate: bool) -> None:
    mp.start_processes(_device_worker, args=(f"file://{tmp_path}/init", scenario, simulate), nprocs=2, join=True,
                       start_method=START_METHOD)


def _kept_worker(rank: int, init: str) -> None:
    """Every rank's buckets stay on the device (the states on the devices): the owner's callback takes each reduced
    bucket there and copies its flags to the host on the device->host stream, held up by a slow copy queued before it,
    while the next buckets are packed. Each bucket's gradients and flags are what reducing each parameter gives."""
    ranks, faults, reference_group, group, shards, owner = _two_ranks(rank, init)
    device = Device(torch.device("cpu"), simulate_streams=True)
    received: dict[tuple[int, int], torch.Tensor] = {}
    flags: list[tuple[Bucket, torch.Tensor, Any]] = []
    release = threading.Event()

    def kept(bucket: Bucket, reduced: torch.Tensor) -> Any:
        for item in bucket.items:
            part = reduced[item.offset : item.offset + item.numel].clone()
            sp = item.shard.params[item.position]
            whole = received.setdefault((item.shard.index, item.position), torch.full((sp.numel,), float("nan")))
            whole[item.start or 0 : (item.start or 0) + item.numel] = part
        # A copy queued on the device->host stream before the flags' copy holds it back until the next buckets are
        # packed (if the packing does not wait for the flags' copy, it reads their bytes).
        device.d2h_stream.submit(lambda: release.wait(timeout=0.2), delay=False)
        out, event = device.to_host(reduced[bucket.numel : bucket.size], out=device.host_buffer(len(bucket.items),
                                                                                                 torch.float32))
        flags.append((bucket, out, event))
        return event

    exchange = _DeviceExchange(device, shards, owner, ranks, group, lambda *a: None, faults, lambda plan: None, kept,
                               frozenset(s.index for s in shards))
    reduce = exchange.reduce
    try:
        reduce.begin()
        _hand_over(shards, rank, 0, reduce.gradient)
        reduce.close()
        release.set()
        expected = _per_parameter(shards, rank, 0, reference_group)
        flagged = set()
        for bucket, out, event in flags:
            event.synchronize()
            for item, flag in zip(bucket.items, out.tolist()):
                if flag > 0:
                    flagged.add((item.shard.index, item.position))
                assert flag in (0.0, 1.0, 2.0), (item.shard.index, item.position, flag)
        assert flagged == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(received[key], tensor.reshape(-1)), key
    finally:
        exchange.stop()
        dist.destroy_process_group()


def test_buckets_kept_on_the_device_are_packed_again_only_after_their_flags_left(tmp_path: Path) -> None:
    mp.start_processes(_kept_worker, args=(f"file://{tmp_path}/init",), nprocs=2, join=True,
                       start_method=START_METHOD)
