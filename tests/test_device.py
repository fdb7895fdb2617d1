"""The device layer below the engine: the CPU path makes no copies, the stream simulation behaves like CUDA's streams
and caching allocator (so that a missing wait or keep_alive shows up on the CPU), the host pool pins exactly what it
says and reuses memory only after the copies using it, the pager neither waits for uploads nor blocks in page-out, the
fp16 loss scale is not copied to the device every step, the device memory cap is undone at teardown, and memory that
the processes of a node share is one memory that leaves nothing behind."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_ratel import RatelConfigError, RatelPrecision, RatelStrategy
from lightning_ratel import strategy as strategy_module
from lightning_ratel.runtime.device import DONE, Device
from lightning_ratel.runtime.hostmem import SharedHostMemory
from lightning_ratel.runtime.pool import HostPool
from lightning_ratel.runtime.simulation import StreamOrderError, take_simulation_errors
from lightning_ratel.runtime.storage import TensorStore
from tests.models import LM, trainer
from tests.test_pager import Tied, _block, _paged


class Gate:
    """An event that completes when the test says so: queued on a simulated stream, it holds up the work after it."""

    def __init__(self) -> None:
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def query(self) -> bool:
        return self._open.is_set()

    def synchronize(self) -> None:
        self._open.wait()


def _hold(device: Device, stream: Any) -> Gate:
    """Hold up every copy queued on ``stream`` from now on until the gate opens."""
    gate = Gate()
    with device.on(stream):
        device.wait(gate)
    return gate


@pytest.fixture
def sim() -> Device:
    return Device(torch.device("cpu"), simulate_streams=True)


# ---------------------------------------------------------------------------------------------------- the CPU path


def test_cpu_device_makes_no_copies() -> None:
    device = Device(torch.device("cpu"), simulate_streams=False)
    t = torch.randn(4, 4)
    assert device.to_host(t)[0] is t
    assert device.to_device(t)[0] is t
    assert device.record() is DONE and not device.separate_memory
    assert device.pinned_bytes == 0
    assert not device.host_empty(10, torch.float32).is_pinned()


def test_environment_turns_the_simulation_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATEL_SIMULATE_STREAMS", "1")
    assert Device(torch.device("cpu")).simulated
    monkeypatch.setenv("RATEL_SIMULATE_STREAMS", "0")
    assert not Device(torch.device("cpu")).simulated


# ---------------------------------------------------------------------------------------------------- simulation


def test_copies_run_later_on_their_stream_and_events_say_when(sim: Device) -> None:
    host = sim.host_buffer(1000, torch.float32).copy_(torch.arange(1000.0))
    gate = _hold(sim, sim.h2d_stream)
    out, event = sim.to_device(host)
    # Nothing has run yet: the new device memory holds poison, not data.
    assert not event.query() and torch.isnan(out).all()
    gate.open()
    sim.use(event, out)
    assert event.query() and torch.equal(out, host)


def test_a_copy_waits_for_the_copy_that_fills_its_source(sim: Device) -> None:
    data = torch.randn(1000)
    held = _hold(sim, sim.d2h_stream)
    host, filled = sim.to_host(data)
    # Without waiting, the host->device copy reads the staging buffer before the device->host copy wrote it.
    early, event = sim.to_device(host)
    sim.use(event, early)
    assert torch.isnan(early).all()
    late, event = sim.to_device(host, after=filled)
    held.open()
    sim.use(event, late)
    assert torch.equal(late, data)


def test_freeing_without_keep_alive_on_the_stream_that_used_it_is_an_error(sim: Device) -> None:
    out, event = sim.to_device(torch.ones(100))
    sim.wait(event)
    del out
    with pytest.raises(StreamOrderError, match="freed without keep_alive"):
        sim.record()
    out, event = sim.to_device(torch.ones(100))
    sim.use(event, out)
    del out
    sim.synchronize()
    assert take_simulation_errors() == []


def test_host_memory_is_reused_only_after_the_copy_that_reads_it(sim: Device) -> None:
    host = sim.host_buffer(1024, torch.float32).fill_(3.0)
    address = host.data_ptr()
    gate = _hold(sim, sim.h2d_stream)
    out, event = sim.to_device(host)
    del host
    # The copy has not run: the memory is not handed out again.
    other = sim.host_buffer(1024, torch.float32)
    assert other.data_ptr() != address
    gate.open()
    sim.use(event, out)
    assert (out == 3.0).all()
    # Now it is, poisoned.
    again = sim.host_buffer(1024, torch.float32)
    assert again.data_ptr() == address and torch.isnan(again).all()


def test_an_event_covers_the_work_queued_before_it(sim: Device) -> None:
    sources = [torch.full((256,), float(i)) for i in range(20)]
    outs = [sim.to_device(s)[0] for s in sources]
    sim.use(sim.record(sim.h2d_stream), *outs)
    assert all(torch.equal(o, s) for o, s in zip(outs, sources))


# ---------------------------------------------------------------------------------------------------- host pool


def test_host_pool_counts_exactly_what_it_allocates() -> None:
    pool = HostPool()
    cache = pool.allocate(3000, torch.float32)
    assert cache.numel() == 3000 and cache.data_ptr() % 4096 == 0
    assert pool.dedicated_nbytes == 12288 and pool.nbytes == 0
    a = pool.take(1000, torch.float32)
    b = pool.take(5000, torch.bfloat16)
    assert pool.nbytes == pool.nbytes_in_use == 4096 + 12288
    address = a.data_ptr()
    view = a[10:20]
    del a
    # A view still uses the memory.
    assert pool.nbytes_in_use == 4096 + 12288
    del view
    assert pool.nbytes_in_use == 12288
    # Reused for a request that fits, but not for one less than half its size.
    held = pool.take(900, torch.float32)
    assert held.data_ptr() == address
    big = b.data_ptr()
    del b
    small = pool.take(1000, torch.float32)
    assert small.data_ptr() != big
    assert pool.take(2000, torch.float32).data_ptr() == big
    assert pool.nbytes == 4096 + 12288 + 4096 and pool.nbytes_in_use == 4096 * 2
    pool.clear()
    assert pool.nbytes == 4096 * 2
    del cache
    assert pool.dedicated_nbytes == 0


def test_given_back_buffer_waits_for_io_still_writing_it() -> None:
    pool = HostPool()
    buffer = pool.take(1024, torch.float32)
    address = buffer.data_ptr()
    read: Future = Future()
    pool.give(buffer, after=[read])
    assert pool.take(1024, torch.float32).data_ptr() != address
    read.set_result(None)
    assert pool.take(1024, torch.float32).data_ptr() == address


class FakeOffer:
    """What a store would do with a given-back buffer's bytes: offer them (while ``offered``) to reads whose copies
    (``copies``) the reuse must wait for."""

    def __init__(self, *copies: Future) -> None:
        self.copies = list(copies)
        self.is_offered = True
        self.withdrawn = 0

    def offered(self) -> bool:
        return self.is_offered

    def withdraw(self) -> list[Future]:
        self.withdrawn += 1
        self.is_offered = False
        return self.copies


def test_a_free_buffer_keeps_its_offered_bytes_until_the_pool_reuses_it() -> None:
    """A buffer given back with an offer keeps its bytes while free (even when poisoning), is reused after the free
    buffers nobody wants, and only after its offer is withdrawn and the copies from it have finished."""
    pool = HostPool(poison=True)
    offered = pool.take(1024, torch.float32).fill_(1.5)
    plain = pool.take(1024, torch.float32)
    plain_address = plain.data_ptr()
    copy: Future = Future()
    offer = FakeOffer(copy)
    pool.give(offered, offer=offer)
    del plain
    assert pool.nbytes_in_use == 0
    assert torch.all(offered == 1.5)
    # The buffer no read wants goes first, although it came back later.
    again = pool.take(1024, torch.float32)
    assert again.data_ptr() == plain_address and offer.withdrawn == 0
    # Then the offered one: withdrawn, and handed out only once the copy from it is done.
    threading.Timer(0.2, copy.set_result, [None]).start()
    reused = pool.take(1024, torch.float32)
    assert reused.data_ptr() == offered.data_ptr() and offer.withdrawn == 1 and copy.done()
    assert torch.isnan(reused).all()
    assert pool.nbytes == 2 * 4096


def test_the_pool_grows_to_keep_offered_buffers_up_to_its_keep_limit() -> None:
    pool = HostPool()
    pool.keep_limit = 2 * 4096
    first, second, third, fourth = (FakeOffer() for _ in range(4))
    a = pool.take(1024, torch.float32)
    pool.give(a, offer=first)
    # A new buffer rather than the offered one, while the offered ones fit in the limit.
    b = pool.take(1024, torch.float32)
    assert b.data_ptr() != a.data_ptr()
    pool.give(b, offer=second)
    # Past it, the offered buffer given back longest ago.
    c = pool.take(1024, torch.float32)
    assert c.data_ptr() == a.data_ptr() and first.withdrawn == 1 and second.withdrawn == 0
    assert pool.nbytes == 2 * 4096
    pool.give(c, offer=third)
    # One no longer offered (its key was written) goes before an older one still offered.
    third.is_offered = False
    d = pool.take(1024, torch.float32)
    assert d.data_ptr() == a.data_ptr() and third.withdrawn == 1 and second.withdrawn == 0
    pool.give(d, offer=fourth)
    # Freeing the memory withdraws what is still offered.
    pool.clear()
    assert second.withdrawn == 1 and fourth.withdrawn == 1 and pool.nbytes == 0


def test_simulated_device_accounts_pinned_memory(sim: Device) -> None:
    cache = sim.host_empty((10, 100), torch.bfloat16)
    staging, _ = sim.to_host(torch.randn(3000))
    assert sim.pinned_bytes == 4096 + 12288
    del cache, staging
    sim.synchronize()
    assert sim.pinned_bytes == 12288


def test_shared_host_memory_is_the_same_bytes_in_each_mapping_and_leaves_no_name(sim: Device) -> None:
    # Two "processes": each maps the file and takes the same allocations in the same order.
    first = SharedHostMemory.create()
    second = SharedHostMemory.open(first.path)
    path = Path(first.path)
    first.unlink()
    assert not path.exists()
    a = [sim.shared_host_empty(first, 1000, torch.bfloat16), sim.shared_host_empty(first, 10, torch.float32)]
    a[0].fill_(1.5)
    a[1].fill_(-2.0)
    # Taken after the other side wrote: not poisoned (with simulated streams a pool's memory would be NaN).
    b = [sim.shared_host_empty(second, 1000, torch.bfloat16), sim.shared_host_empty(second, 10, torch.float32)]
    assert torch.equal(b[0], a[0]) and torch.equal(b[1], a[1])
    b[1][3] = 7.0
    assert a[1][3].item() == 7.0
    assert a[0].data_ptr() % 4096 == 0 and a[1].data_ptr() % 4096 == 0
    assert first.nbytes == second.nbytes == 2 * 4096
    assert sim.pinned_bytes == 4 * 4096  # each process page-locks its own mapping (on CUDA)
    first.close()
    second.close()
    # Closed, the allocations stay mapped.
    assert a[0][999].item() == 1.5


# ---------------------------------------------------------------------------------------------------- pager


def test_pager_uploads_as_soon_as_the_reads_land_and_never_waits_in_page_out(tmp_path: Path, simulated_streams: None
                                                                             ) -> None:
    module = Tied()
    optimizer = torch.optim.AdamW(module.parameters())
    with TensorStore([tmp_path]) as store:
        layout, pager, values = _paged(module, optimizer, "ssd", store)
        device = pager.device
        assert device.simulated
        first, second = _block(layout, module, "layers.0"), _block(layout, module, "layers.1")
        pager.prefetch(first)
        unit = pager._state[layout.block_units[first][0]]
        for read in unit.reads:
            read.result()
        gate = _hold(device, device.h2d_stream)
        # Any pager call notices that the reads have landed and starts the upload, before the block is acquired.
        pager.prefetch(second)
        assert unit.event is not None and not unit.reads
        # Page-out returns although the upload has not run; its staging buffers are not handed out meanwhile.
        staged = {b.data_ptr() for b in unit.staging.values()}
        pager.release_all()
        pager.prefetch(first)
        assert not staged & {b.data_ptr() for b in unit.staging.values()}
        gate.open()
        pager.acquire(first)
        assert torch.equal(module.layers[0].weight, values["layers.0.weight"])
        pager.release_all()


# ---------------------------------------------------------------------------------------------------- fp16 scale


def test_loss_scale_is_copied_to_the_device_once_and_then_changed_there() -> None:
    precision = RatelPrecision("16-mixed", device="cpu")
    meta = torch.device("meta")
    copy = precision._scale_on(meta)
    precision._update_scale(found_inf=True)
    precision.load_state_dict({"scale": 8.0, "growth_tracker": 0})
    assert precision._scale_on(meta) is copy
    # Every change applies to the host scale and its device copy alike (shown with a CPU stand-in for the copy).
    precision._device_scale = precision._scale.clone()
    precision._update_scale(found_inf=True)
    precision.growth_interval = 1
    precision._update_scale(found_inf=False)
    precision._update_scale(found_inf=False)
    assert precision._scale.item() == precision._device_scale.item() == 16.0
    precision.load_state_dict({"scale": 2.0, "growth_tracker": 0})
    assert precision._device_scale.item() == 2.0
    assert precision.state_dict() == {"scale": 2.0, "growth_tracker": 0}
    assert precision._scale_on(torch.device("cpu")) is precision._scale


# ---------------------------------------------------------------------------------------------------- memory cap


def test_device_memory_cap_is_undone_after_a_failed_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 0.75)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 1 << 30}))
    limit_on_cpu = RatelStrategy._limit_device_memory
    cuda = torch.device("cuda", 0)

    def limit_as_on_cuda(self: RatelStrategy) -> None:
        # Only this step sees a CUDA device: the rest of setup and teardown runs on the CPU.
        with monkeypatch.context() as m:
            m.setattr(RatelStrategy, "root_device", property(lambda s: cuda))
            limit_on_cpu(self)

    def failing_engine(*args: object, **kwargs: object) -> None:
        raise RatelConfigError("the engine could not be built")

    monkeypatch.setattr(RatelStrategy, "_limit_device_memory", limit_as_on_cuda)
    monkeypatch.setattr(strategy_module, "RatelEngine", failing_engine)
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], device_memory_limit=1 << 28)
    with pytest.raises(RatelConfigError, match="could not be built"):
        trainer(strategy, max_steps=1).fit(LM("mlp"))
    assert calls == [(0.25, cuda), (0.75, cuda)]


def test_device_memory_cap_is_undone_at_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 1 << 30}))
    cuda = torch.device("cuda", 0)
    strategy = RatelStrategy(device_memory_limit=1 << 29)
    with monkeypatch.context() as m:
        m.setattr(RatelStrategy, "root_device", property(lambda s: cuda))
        strategy._limit_device_memory()
    strategy.accelerator = L.pytorch.accelerators.CPUAccelerator()
    strategy.teardown()
    strategy.teardown()
    assert calls == [(0.5, cuda), (1.0, cuda)]


# ---------------------------------------------------------------------------------------------------- accounting


class _Pinned(L.Callback):
    """What the engine reports as pinned after each step, and what it is made of."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        engine = trainer.strategy.engine
        caches = sum(-(-flat.numel() * flat.element_size() // 4096) * 4096
                     for unit in engine.layout.units.values() for flat in unit.host.values())
        self.steps.append((engine.byte_placement()["pinned"], caches, engine.device.pool.nbytes))


@pytest.mark.parametrize("param_cache", ["host", "ssd"])
def test_engine_reports_exactly_what_is_pinned_and_reuses_it(tmp_path: Path, simulated_streams: None,
                                                             param_cache: str) -> None:
    pinned = _Pinned()
    policy = {"*layers.0": "ssd", "*layers.1": "recompute", "*": "host"}
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=policy, param_cache=param_cache),
            precision="bf16-mixed", max_steps=8, callbacks=[pinned]).fit(LM("llama"))
    assert len(pinned.steps) == 8
    for total, caches, pool in pinned.steps:
        # The host caches at their own size (rounded to pages) and the pool's staging buffers, nothing else.
        assert total == caches + pool
        assert (caches > 0) == (param_cache == "host")
    # Staging buffers are reused from step to step: the pool stops growing after the first steps.
    first = pinned.steps[1][2]
    assert all(pool <= 1.5 * first for _, _, pool in pinned.steps)
