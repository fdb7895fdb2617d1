"""The parameter pager on its own: residency by reference, prefetch, the ready signal, page-ins from the store."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_ratel.engine.blocks import BlockMembership, discover_blocks
from lightning_ratel.engine.layout import build_layout
from lightning_ratel.engine.materialize import Materializer
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.units import Layout


class Tied(nn.Module):
    """Three layers and a head that reuses the embedding (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


def _paged(module: nn.Module, optimizer: torch.optim.Optimizer | None = None, param_cache: str = "host",
           store: TensorStore | None = None) -> tuple[Layout, ParameterPager, dict[str, torch.Tensor]]:
    values = {n: p.detach().clone() for n, p in module.named_parameters()}
    blocks = discover_blocks(module)
    device = Device(torch.device("cpu"))
    layout = build_layout(module, blocks, optimizer, None, param_cache, None, device.host_empty)
    Materializer(module, blocks, layout, device.device, None).load(store)
    membership = BlockMembership(blocks, layout.block_units)
    pager = ParameterPager(device, layout.units, membership.units_of,
                           store=store if param_cache == "ssd" else None, unit_shards=layout.unit_shards())
    return layout, pager, values


def _adopt(pager: ParameterPager, block: int, unit: int, param: nn.Parameter) -> None:
    """What the engine does when block ``block``'s forward uses ``param`` of ``unit``: change the membership the
    pager reads."""
    membership = pager.units_of.__self__  # type: ignore[attr-defined]
    assert membership.adopt(membership[block], unit, param)


def _block(layout: Layout, module: nn.Module, name: str) -> int:
    return next(b.index for b in discover_blocks(module) if b.name == name)


def test_placeholders_until_acquired_then_the_values() -> None:
    module = Tied()
    layout, pager, values = _paged(module)
    layer = _block(layout, module, "layers.1")
    assert pager.holds_placeholder(module.layers[1].weight)
    assert torch.isnan(module.layers[1].weight).all()
    pager.acquire(layer)
    assert torch.equal(module.layers[1].weight, values["layers.1.weight"])
    assert pager.resident_bytes == layout.units[layer].nbytes
    pager.release(layer)
    assert pager.holds_placeholder(module.layers[1].weight)
    assert pager.resident_bytes == 0
    assert pager.device_flat(layer, torch.float32) is None


def test_shared_unit_stays_resident_while_any_user_holds_it() -> None:
    module = Tied()
    layout, pager, values = _paged(module)
    embed, head = _block(layout, module, "embed"), _block(layout, module, "head")
    assert layout.block_units[head] == (embed,)
    pager.acquire(embed)
    pager.acquire(head)
    pager.release(embed)
    # The head still uses the embedding's unit.
    assert torch.equal(module.head.weight, values["embed.weight"])
    pager.release(head)
    assert pager.holds_placeholder(module.embed.weight)


def test_a_unit_a_block_gains_while_resident_is_released_only_by_references_taken_after() -> None:
    module = Tied()
    layout, pager, values = _paged(module)
    first, last = _block(layout, module, "layers.0"), _block(layout, module, "layers.2")
    pager.acquire(last)
    pager.hold(first)
    # The block's forward used a parameter of another unit: from now on it pages that unit in too.
    _adopt(pager, last, first, module.layers[0].weight)
    pager.release(last)
    # The reference taken before the change did not hold layers.0's unit; the hold does, until release_all.
    assert torch.equal(module.layers[0].weight, values["layers.0.weight"])
    pager.release_all()
    assert pager.holds_placeholder(module.layers[0].weight) and pager.resident_bytes == 0
    pager.acquire(last)
    assert torch.equal(module.layers[0].weight, values["layers.0.weight"])
    pager.release(last)
    assert pager.holds_placeholder(module.layers[0].weight) and pager.resident_bytes == 0


def test_a_prefetch_made_before_the_block_gained_a_unit_pages_that_unit_in_at_acquire() -> None:
    module = Tied()
    layout, pager, values = _paged(module)
    first, last = _block(layout, module, "layers.0"), _block(layout, module, "layers.2")
    pager.prefetch(last)
    _adopt(pager, last, first, module.layers[0].weight)
    pager.acquire(last)
    assert torch.equal(module.layers[0].weight, values["layers.0.weight"])
    assert torch.equal(module.layers[2].weight, values["layers.2.weight"])
    pager.release(last)
    assert pager.resident_bytes == 0


def test_prefetch_is_taken_over_by_acquire_and_undone_by_release_all() -> None:
    module = Tied()
    layout, pager, _ = _paged(module)
    first, second = _block(layout, module, "layers.0"), _block(layout, module, "layers.1")
    pager.prefetch(first)
    assert pager.resident_bytes == layout.units[first].nbytes
    pager.acquire(first)
    pager.release(first)
    assert pager.resident_bytes == 0
    pager.prefetch(second)
    pager.release_all()
    assert pager.resident_bytes == 0 and pager.holds_placeholder(module.layers[1].weight)


def test_page_in_waits_for_the_units_pending_update() -> None:
    module = Tied()
    layout, pager, _ = _paged(module)
    layer = _block(layout, module, "layers.2")
    unit = layout.units[layer]
    unit.ready.expect()
    # A unit with an update pending is not prefetched: that would block the caller.
    pager.prefetch(layer)
    assert pager.resident_bytes == 0
    new = torch.full_like(unit.host[torch.float32], 7.0)
    # The update lands only once the page-in waits for it, however late the training thread gets there.
    waiting = threading.Event()
    wait = unit.ready.wait

    def signalled_wait() -> None:
        waiting.set()
        wait()

    unit.ready.wait = signalled_wait  # type: ignore[method-assign]
    held: list[float] = []

    def update() -> None:
        if not waiting.wait(10):
            return
        start = time.perf_counter()
        time.sleep(0.01)
        unit.host[torch.float32].copy_(new)
        held.append(time.perf_counter() - start)
        unit.ready.complete()

    worker = threading.Thread(target=update)
    worker.start()
    pager.acquire(layer)
    worker.join()
    # The forward saw the updated compute copy, never the old one.
    assert torch.equal(module.layers[2].weight, torch.full((8, 8), 7.0))
    # The stall spans the whole time the update held the unit (measured inside it).
    assert held and pager.take_stall_seconds() >= held[0]
    pager.release(layer)


def test_failed_update_surfaces_at_page_in() -> None:
    module = Tied()
    layout, pager, _ = _paged(module)
    layer = _block(layout, module, "layers.0")
    layout.units[layer].ready.expect()
    layout.units[layer].ready.fail(OSError(5, "disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        pager.acquire(layer)


def test_a_failed_write_of_a_compute_copy_surfaces_at_page_in() -> None:
    """An update whose new compute copy could not be written fails the unit's next page-in, even once the write has
    ended and another of the unit's updates completed after it (each shard of a unit completes on its own)."""
    module = Tied()
    layout, pager, _ = _paged(module)
    layer = _block(layout, module, "layers.0")
    ready = layout.units[layer].ready
    failed: Future = Future()
    failed.set_exception(OSError(28, "No space left on device"))
    landed: Future = Future()
    landed.set_result(None)
    for write in (failed, landed):
        ready.expect()
        ready.complete(write)
    assert not ready.is_set()
    with pytest.raises(OSError, match="No space left"):
        pager.acquire(layer)


def test_page_in_from_the_store(tmp_path: Path) -> None:
    module = Tied()
    optimizer = torch.optim.AdamW(module.parameters())
    with TensorStore([tmp_path]) as store:
        layout, pager, values = _paged(module, optimizer, "ssd", store)
        assert all(not unit.host for unit in layout.units.values())
        layer = _block(layout, module, "layers.0")
        pager.acquire(layer)
        assert torch.equal(module.layers[0].weight, values["layers.0.weight"])
        assert torch.equal(module.layers[0].bias, values["layers.0.bias"])
        pager.release(layer)
        # Staging buffers go back to the pool and are reused by the next page-in.
        pooled = pager.pool.nbytes
        pager.acquire(layer)
        assert pager.pool.nbytes == pooled
        pager.release_all()
