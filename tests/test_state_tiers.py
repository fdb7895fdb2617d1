"""Optimizer states in host memory, in the swap files, or split between them: placed by the layout, same numbers."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_ratel import RatelStrategy, estimate
from lightning_ratel.engine import layout as layout_module
from lightning_ratel.engine.coordinator import StoreIO, store_io
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.plan.states import describe, place_states, read_ahead_sets, state_bytes
from lightning_ratel.runtime.hoststore import HostStore, TieredStore
from lightning_ratel.runtime.kept import KeptStore
from lightning_ratel.runtime.optimizer import CpuAdam
from lightning_ratel.runtime.state_buffers import BUFFER_SETS
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.swapfile import HEADER_BYTES
from tests.models import LM, compare_states, final_state, tiny_llama, trainer

# ------------------------------------------------------------------ the placement (pure)


def test_auto_places_in_forward_order_while_the_budget_holds():
    # The first shards fit; the third does not, the smaller fourth still does.
    assert place_states([10, 20, 40, 5], "auto", 36) == ["host", "host", "ssd", "host"]
    assert place_states([10, 20], "auto", None) == ["host", "host"]
    assert place_states([10, 20], "auto", 0) == ["ssd", "ssd"]


def test_forced_tiers_and_bad_request():
    assert place_states([10, 20], "ssd", 1 << 40) == ["ssd", "ssd"]
    assert place_states([10, 20], "host", 0) == ["host", "host"]
    with pytest.raises(RatelConfigError, match="optimizer_states"):
        place_states([1], "ram", None)


def test_state_bytes_count_both_slots():
    assert state_bytes(100) == 2 * 12 * 100
    assert state_bytes(100, record_bytes=40) == 2 * (400 + 40)
    line = describe([2400, 4800], ["host", "ssd"])
    assert "in host memory (1 shards" in line and "swap files (1 shards" in line


def test_read_ahead_sets_take_what_the_host_tier_leaves():
    """Sets of 7 bytes beyond 3: the host tier keeps the first two shards (30 of 40 bytes), the 10 bytes left buy
    one set; never a shard moved out of host memory for sets, nor more sets than shards on disk to read ahead."""
    sizes = [10, 20, 40, 40, 40, 40]
    tiers = place_states(sizes, "auto", 40)
    assert tiers == ["host", "host", "ssd", "ssd", "ssd", "ssd"]
    assert read_ahead_sets(tiers, sizes, 40, set_bytes=7, base_sets=3) == 1
    # 3 sets beyond would fill the drives' idle time with more reads, but the 20-byte shard saves 20 bytes of traffic
    # each step for its 20 bytes: it stays in host memory.
    assert read_ahead_sets(tiers, sizes, 30, set_bytes=7, base_sets=3) == 0
    # All of the states in the swap files, a large budget: one set per shard there, no more.
    on_disk = place_states(sizes, "ssd", 1000)
    assert read_ahead_sets(on_disk, sizes, 1000, set_bytes=7, base_sets=3) == 3
    assert read_ahead_sets(on_disk, sizes, 3 * 7 + 6, set_bytes=7, base_sets=3) == 3
    assert read_ahead_sets(on_disk, sizes, 2 * 7 + 6, set_bytes=7, base_sets=3) == 2
    # A rank of two on a node keeps half the pipeline's sets: together the ranks' sets still do not outnumber the
    # shards on disk (3 of them each: 1.5 + 1 sets a rank).
    assert read_ahead_sets(on_disk[:3], sizes[:3], 1000, set_bytes=7, base_sets=1.5) == 1
    # Nothing to read ahead beyond the pipeline's sets, or no budget given.
    assert read_ahead_sets(["host"] * 3 + ["ssd"] * 3, sizes, 1000, set_bytes=7, base_sets=3) == 0
    assert read_ahead_sets(on_disk, sizes, None, set_bytes=7, base_sets=3) == 0


# ------------------------------------------------------------------ the host store


def test_host_store_round_trip_zeros_and_errors():
    store = HostStore(threads=2)
    store.reserve("a", 4 * 1000)
    store.reserve("b", 4 * 10)
    store.preallocate()
    out = torch.full((1000,), 7.0)
    # Never written: zeros, like the swap store.
    assert store.read("a", out).result() is out and not out.any()
    values = torch.randn(1000)
    store.write("a", values).result()
    assert torch.equal(store.read("a", out).result(), values)
    with pytest.raises(ValueError, match="holds 40 bytes"):
        store.write("b", torch.zeros(11))
    with pytest.raises(KeyError):
        store.read("missing", out)
    with pytest.raises(ValueError, match="reserved with"):
        store.reserve("a", 8)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.view("a", torch.float32)


def test_host_store_large_copies_are_split_over_threads(monkeypatch):
    monkeypatch.setattr("lightning_ratel.runtime.hoststore.COPY_PIECE_BYTES", 4096)
    store = HostStore(threads=3)
    values = torch.randn(50_000)
    store.write("x", values).result()
    out = torch.empty_like(values)
    store.read("x", out).result()
    assert torch.equal(out, values)
    store.close()


def test_host_store_without_threads_copies_on_the_callers_thread():
    store = HostStore(threads=0)
    values = torch.randn(10_000)
    before = {t.name for t in threading.enumerate()}
    write = store.write("x", values)
    # Done on return, and no thread of the store's ever ran.
    assert write.done() and write.exception() is None
    out = torch.empty_like(values)
    read = store.read("x", out)
    assert read.done() and read.result() is out and torch.equal(out, values)
    # No thread started (one of an earlier test's may have ended meanwhile).
    assert {t.name for t in threading.enumerate()} <= before
    assert not any(t.name.startswith("ratel-copy") for t in threading.enumerate())
    assert store.bytes_copied == 2 * values.numel() * 4
    store.close()


def test_writing_a_view_of_the_key_copies_nothing():
    store = HostStore()
    store.reserve("m", 4 * 256)
    view = store.view("m", torch.float32)
    view.copy_(torch.arange(256.0))
    before = store.bytes_copied
    store.write("m", view).result()
    assert store.bytes_copied == before and store.written("m")
    out = torch.empty(256)
    store.read("m", out).result()
    assert torch.equal(out, torch.arange(256.0))
    store.close()


def test_tiered_store_routes_each_key(tmp_path: Path):
    disk = TensorStore([str(tmp_path)], name="tiers")
    store = TieredStore(disk, HostStore(), host_keys=["h"])
    store.reserve("h", 4096)
    store.reserve("d", 4096)
    store.preallocate()
    store.write("h", torch.ones(1024)).result()
    assert disk.bytes_written == 0
    store.write("d", torch.ones(1024)).result()
    assert disk.bytes_written >= 4096
    out = torch.empty(1024)
    assert torch.equal(store.read("h", out).result(), torch.ones(1024))
    assert sorted(store.keys()) == ["d", "h"] and store.in_host("h") and not store.in_host("d")
    # What concerns the swap files is the swap store's.
    assert store.paths == disk.paths and store.host_bytes >= 4096
    store.close()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ training


def _split_budget(monkeypatch: pytest.MonkeyPatch, fraction: float) -> None:
    """Give ``optimizer_states="auto"`` a budget that holds about ``fraction`` of a tiny Llama's states."""
    lm = LM("llama")
    total = state_bytes(sum(p.numel() for p in lm.parameters()))
    monkeypatch.setattr(layout_module, "states_budget", lambda *budget: int(total * fraction))


class _Tiers:
    def __init__(self) -> None:
        self.tiers: list[str] = []
        self.reserved = 0
        self.read_ahead_sets = 0
        self.sets = 0

    def __call__(self, strategy: RatelStrategy) -> None:
        engine = strategy.engine
        self.tiers = [s.state_tier for s in engine.layout.shards]
        self.reserved = engine.store.disk.nbytes_reserved
        self.read_ahead_sets = engine.layout.read_ahead_sets
        self.sets = len(engine.adam.buffers.free)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("states", ["host", "split", "ssd"])
def test_every_state_tier_matches_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, states: str,
                                        precision: str):
    kwargs = dict(precision=precision, accumulate_grad_batches=2, gradient_clip_val=0.05, max_steps=3)
    ref = LM("llama")
    t = trainer("auto", **kwargs)
    t.fit(ref)
    if states == "split":
        _split_budget(monkeypatch, 0.5)
    seen = _Tiers()
    lm = LM("llama")
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy={"*.0": "ssd", "*": "host"},
                             optimizer_states="auto" if states == "split" else states)
    lm.on_train_start = lambda: seen(strategy)  # type: ignore[method-assign]
    got = trainer(strategy, **kwargs)
    got.fit(lm)
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)
    expected = {"host": {"host"}, "ssd": {"ssd"}, "split": {"host", "ssd"}}[states]
    assert set(seen.tiers) == expected
    if states == "host":
        # Nothing of the optimizer's is laid out in the swap files.
        assert seen.reserved == 0
    if states == "split":
        # The first blocks in forward order are the ones kept in host memory (a smaller later one may fit too).
        assert seen.tiers[0] == "host" and seen.tiers.index("ssd") > 0
    if states == "ssd":
        # The host memory the states do not take buys a set per shard to read ahead: the same numbers at that depth.
        assert seen.read_ahead_sets == seen.tiers.count("ssd") - BUFFER_SETS > 0
        assert seen.sets == BUFFER_SETS + seen.read_ahead_sets
    assert os.listdir(tmp_path) == []


def test_states_in_host_memory_move_no_disk_bytes_in_a_step(tmp_path: Path):
    """With every state in host memory and compute copies in the host cache, training steps read and write nothing
    on the drives (activations stay off the disk too)."""
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", optimizer_states="host")
    lm = LM("llama")
    counts: list[dict[str, int]] = []
    lm.on_train_batch_end = lambda *args: counts.append(strategy.io_bytes())  # type: ignore[method-assign]
    trainer(strategy, max_steps=3).fit(lm)
    assert len(counts) == 3 and counts[0] == counts[-1]


def test_states_on_disk_move_the_planned_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each step reads every shard's moments once and writes its master and moments once (fp32 masters live in the
    host cache and are not read), whatever the order updates ran in: no state is read twice."""
    reads: Counter[str] = Counter()
    writes: Counter[str] = Counter()
    read, write = TensorStore.read, TensorStore.write

    def counted(counter: Counter[str], call: Any) -> Any:
        def run(self: TensorStore, key: str, tensor: torch.Tensor, **kwargs: Any) -> Any:
            counter[key.removesuffix(".1")] += 1
            return call(self, key, tensor, **kwargs)
        return run

    monkeypatch.setattr(TensorStore, "read", counted(reads, read))
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", optimizer_states="ssd",
                             param_cache="host")
    lm = LM("llama")
    shards: list[int] = []
    lm.on_train_start = lambda: (  # type: ignore[method-assign]
        shards.extend(s.index for s in strategy.engine.layout.shards),
        monkeypatch.setattr(TensorStore, "write", counted(writes, write)))
    steps = 4
    trainer(strategy, max_steps=steps).fit(lm)
    # The first step has no moments to read (they start as zeros); the copy back at the end reads each state once.
    for index in shards:
        for what in ("exp_avg", "exp_avg_sq"):
            assert reads[f"shard{index}.{what}"] == steps - 1 + 1, (index, what)
            assert writes[f"shard{index}.{what}"] == steps, (index, what)
        assert reads[f"shard{index}.master"] == 1 and writes[f"shard{index}.master"] == steps


def test_kept_swap_files_hold_the_states(tmp_path: Path):
    with pytest.raises(RatelConfigError, match="keep_swap_files"):
        RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states="host", keep_swap_files=True)
    assert RatelStrategy(ssd_paths=[str(tmp_path)], keep_swap_files=True).config.states_request == "ssd"
    with pytest.raises(RatelConfigError, match="optimizer_states"):
        RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states="ram")  # type: ignore[arg-type]


def test_store_threads_and_stripes_fit_the_device():
    for cores in (1, 2, 8, 16, 64, 256):
        # A GPU run keeps its queue depth and stripe: the cores are the optimizer's, the drives want requests.
        assert store_io(True, cores) == StoreIO(threads_per_path=4, stripe_bytes=1 << 20)
        # On the CPU the compute fills the cores: few threads, fewer and larger transfers.
        cpu = store_io(False, cores)
        assert 1 <= cpu.threads_per_path <= 2
        assert cpu.stripe_bytes % 4096 == 0 and cpu.stripe_bytes >= 4 << 20
    assert store_io(False, 2).threads_per_path == 1


def test_a_cpu_run_builds_its_stores_for_the_cpu(tmp_path: Path):
    """The states store of a CPU run moves its chunks as :func:`store_io` says for the CPU, its stripes still spread
    over every directory, and the files it keeps open again with the stripe they were written in."""
    paths = [tmp_path / "a", tmp_path / "b"]
    for path in paths:
        path.mkdir()
    strategy = RatelStrategy(ssd_paths=[str(p) for p in paths], activation_policy="host", optimizer_states="ssd",
                             keep_swap_files=True)
    lm = LM("llama")
    seen: dict[str, Any] = {}

    def look() -> None:
        seen["stripe"] = strategy.engine.store.disk.stripe_bytes
        seen["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("ratel-io-ratel_")]

    lm.on_train_start = look  # type: ignore[method-assign]
    trainer(strategy, max_steps=2).fit(lm)
    io = store_io(False, len(os.sched_getaffinity(0)))
    assert seen["stripe"] == io.stripe_bytes
    assert len(seen["threads"]) == io.threads_per_path * len(paths)
    with KeptStore(paths) as kept:
        assert kept.stripe_bytes == io.stripe_bytes
        assert all(os.fstat(swap.fd).st_size > HEADER_BYTES for swap in kept.swap_files)
        for key in kept.keys():
            kept.read(key, torch.empty(kept.nbytes(key), dtype=torch.uint8)).result()


def test_estimate_counts_states_where_they_live():
    model = tiny_llama()
    numel = sum(p.numel() for p in model.parameters())
    on_disk = estimate(model, precision="32-true", optimizer_states="ssd")
    in_host = estimate(model, precision="32-true", optimizer_states="host")
    assert on_disk.host_states == 0 and on_disk.disk >= 24 * numel
    assert in_host.disk == 0 and in_host.host_states >= 24 * numel
    assert in_host.optimizer_buffers == 0 < on_disk.optimizer_buffers
    assert "optimizer states" in str(in_host)


def test_estimate_counts_the_sets_read_ahead():
    """The sets planned to read ahead are in the estimate's host bytes, each as large as a pipeline set; fixing
    ``read_ahead_sets`` replaces the planned count."""
    model = tiny_llama()
    planned = estimate(model, precision="32-true", optimizer_states="ssd")
    none = estimate(model, precision="32-true", optimizer_states="ssd", read_ahead_sets=0)
    one = estimate(model, precision="32-true", optimizer_states="ssd", read_ahead_sets=1)
    assert none.read_ahead_sets == 0 and one.read_ahead_sets == 1 and planned.read_ahead_sets > 1
    per_set = none.optimizer_buffers // BUFFER_SETS
    assert one.optimizer_buffers == none.optimizer_buffers + per_set
    assert planned.optimizer_buffers == none.optimizer_buffers + planned.read_ahead_sets * per_set
    assert planned.host == none.host + planned.read_ahead_sets * per_set
    assert f"{planned.read_ahead_sets} sets beyond the pipeline's" in str(planned)
    # Within a host budget too small for more, none are planned.
    assert estimate(model, precision="32-true", optimizer_states="ssd", host_memory_limit=4096).read_ahead_sets == 0
    with pytest.raises(RatelConfigError, match="read_ahead_sets"):
        RatelStrategy(read_ahead_sets=-1)


def test_fp32_masters_shared_by_page_ins_and_updates_keep_plain_numbers(tmp_path: Path):
    """fp32 with the compute copies and the states in the swap files: a master is the shard's compute copy, so the
    backward's page-in and the optimizer read the same bytes. Whichever read comes first shares its memory and the
    other copies it, verified, instead of reading the drive again (for as long as the memory is offered: an update
    running late, after its block's page-out, copies the page-in's buffer while the host pool keeps it). Every byte a
    step asks for comes from the drive or from such a copy, and the numbers are plain AdamW's, bit for bit."""
    kwargs = dict(precision="32-true", max_steps=4)
    ref = LM("llama")
    t = trainer("auto", **kwargs)
    t.fit(ref)
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", optimizer_states="ssd",
                             param_cache="ssd")
    lm = LM("llama")
    marks: list[dict[str, int]] = []
    lm.on_train_batch_start = lambda *args: marks.append(strategy.io_bytes())  # type: ignore[method-assign]
    got = trainer(strategy, **kwargs)
    got.fit(lm)
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)
    # From the second step's start to the last one's.
    read = marks[-1]["read"] - marks[1]["read"]
    shared = marks[-1]["shared"] - marks[1]["shared"]
    # How much is copied depends on when each read runs (and reads ahead evicted under load are read again), so only
    # that copies happened is certain; the example's summary measures the bytes against the plan's count.
    assert shared > 0 and read > 0


class LateUpdates:
    """Holds every CPU update back 50 ms (as one behind a slow disk is held up) and counts, per step, the bytes of
    fp32 masters read from the drive (copies from another read's memory not counted) in a run of ``module`` under
    ``strategy`` (fp32, compute copies and states in the swap files)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, strategy: RatelStrategy, module: LM) -> None:
        self.step = 0
        self.master_reads: Counter[int] = Counter()
        self.masters = 0
        update, transfer = CpuAdam._update, TensorStore._transfer_chunk

        def late(adam: CpuAdam, *args: Any, **kwargs: Any) -> None:
            time.sleep(0.05)
            update(adam, *args, **kwargs)

        def counted(store: TensorStore, request: Any, chunk: Any) -> Any:
            if not request.is_write and request.source is None and ".master" in request.key:
                self.master_reads[self.step] += chunk.length
            return transfer(store, request, chunk)

        def started() -> None:
            self.masters = sum(s.numel * 4 for s in strategy.engine.layout.shards)

        def batch(batch: Any, index: int) -> None:
            self.step = index

        monkeypatch.setattr(CpuAdam, "_update", late)
        monkeypatch.setattr(TensorStore, "_transfer_chunk", counted)
        module.on_train_start = started  # type: ignore[method-assign]
        module.on_train_batch_start = batch  # type: ignore[method-assign]

    def assert_at_most_two_reads(self, steps: range) -> None:
        """Each of ``steps`` read the masters from the drive at most twice: forward's and backward's page-ins."""
        for index in steps:
            assert 0 < self.master_reads[index] <= 2 * self.masters, (index, self.master_reads, self.masters)


@pytest.mark.parametrize("streams", ["cpu", "simulated"])
def test_an_update_late_behind_backward_copies_the_master_its_page_in_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, streams: str):
    """An update that runs well after its block's backward (here each is held up, as one behind a slow disk is)
    still copies the master the backward's page-in read: the host pool keeps that page-in's buffer offered for it.
    So a step reads each fp32 master from the drive at most twice (its forward's and its backward's page-ins), never
    a third time for the update, and the numbers are plain AdamW's, bit for bit; also on a GPU's path (simulated
    streams, which poison the pool's memory when it is handed out and when it comes back unoffered)."""
    if streams == "simulated":
        request.getfixturevalue("simulated_streams")
    kwargs = dict(precision="32-true", max_steps=5)
    ref = LM("llama")
    t = trainer("auto", **kwargs)
    t.fit(ref)
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", optimizer_states="ssd",
                             param_cache="ssd", read_ahead_sets=0)
    lm = LM("llama")
    late = LateUpdates(monkeypatch, strategy, lm)
    got = trainer(strategy, **kwargs)
    got.fit(lm)
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)
    # Not the last step: the copy back into the module after it reads every master.
    late.assert_at_most_two_reads(range(1, 4))
