"""The host cache two ranks of one node share (:class:`~lightning_ratel.runtime.collectives.NodeCache`), on two
spawned gloo processes: a unit's new compute copy is read by the other rank only once its owner announced it, an
update that failed is announced as such (the other rank raises instead of waiting or reading), and a node without room
for the cache makes every rank fall back alike and leaves nothing in /dev/shm."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ratel.runtime.collectives import Faults, NodeCache, Ranks, SharedCacheUnavailable, _Publisher
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.units import Shard, Unit
from tests.forked_ranks import START_METHOD

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")


def _shared_caches() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("ratel-host-cache-*")}


def _unit(node: NodeCache) -> tuple[Unit, Shard]:
    host = Device(torch.device("cpu")).shared_host_empty(node.memory, 1000, torch.bfloat16)
    unit = Unit(0, (), {torch.bfloat16: 1000}, host={torch.bfloat16: host})
    return unit, Shard(0, unit, 0, torch.bfloat16, 0, (), 1000)


def _worker(rank: int, init: str, scenario: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    ranks = Ranks(rank=rank, world=2, local_world=2, timeout=timedelta(seconds=60), local_rank=rank)
    try:
        if scenario == "no room":
            with pytest.raises(SharedCacheUnavailable, match="bytes free"):
                NodeCache.open(ranks, 1 << 62)
            return
        node = NodeCache.open(ranks, 1 << 20)
        unit, shard = _unit(node)
        publisher = _Publisher({0: 0}, rank, None, Faults(ranks, "test"), node)
        try:
            # Rank 0 owns the unit: its update writes the shared bytes, rank 1 expects them.
            unit.ready.expect()
            if rank == 0 and scenario == "written":
                unit.host[torch.bfloat16].fill_(2.5)
                unit.ready.complete()
            elif rank == 0:
                unit.ready.fail(RuntimeError("the update failed"))
            publisher.publish([(unit, [shard])])
            if scenario == "written":
                unit.ready.wait()
                assert torch.all(unit.host[torch.bfloat16] == 2.5)
                publisher.idle()
            elif rank == 1:
                with pytest.raises(RuntimeError, match="rank 0 could not write unit 0"):
                    unit.ready.wait()
            else:
                with pytest.raises(RuntimeError, match="the update failed"):
                    publisher.idle()
        finally:
            publisher.stop()
            node.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scenario", ["written", "failed", "no room"])
def test_two_ranks_of_a_node_share_a_unit(tmp_path: Path, scenario: str) -> None:
    before = _shared_caches()
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_worker, args=(init, scenario), nprocs=2, join=True, start_method=START_METHOD)
    assert _shared_caches() <= before
