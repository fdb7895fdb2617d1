"""The out-of-core CPU AdamW pipeline on its own: states read ahead, gradients in any order, few buffer sets."""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_ratel.runtime import adamw as ops
from lightning_ratel.runtime import storage
from lightning_ratel.runtime.accumulation import GradientBudget
from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.hoststore import HostStore, TieredStore
from lightning_ratel.runtime.optimizer import CpuAdam, GroupHyper, StepPlan
from lightning_ratel.runtime.state_buffers import Need, set_bytes, set_capacities
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.units import Shard, ShardParam, Unit

HYPER = GroupHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
SIZES = [1000, 37, 4099, 1, 513, 2048]


class _Landed:
    """A gradient copy that has already landed (what the engine hands over on CPU)."""

    def synchronize(self) -> None:
        return None


def _pipeline(tmp_path: Path, depth: float, sizes: list[int] = SIZES
              ) -> tuple[CpuAdam, list[Shard], list[nn.Parameter], TensorStore]:
    """One single-parameter shard per unit; masters on the store, new values written to each unit's host cache."""
    torch.manual_seed(0)
    store = TensorStore([tmp_path])
    params, shards = [], []
    for i, n in enumerate(sizes):
        value = torch.randn(n)
        param = nn.Parameter(value.clone())
        unit = Unit(i, (), {torch.float32: n}, host={torch.float32: torch.zeros(n)})
        shard = Shard(i, unit, 0, torch.float32, 0, (ShardParam(f"p{i}", param, i, 0, n, value.shape),), n)
        for what in ("master", "exp_avg", "exp_avg_sq"):
            store.reserve(shard.key(what), n * 4)
        store.write(shard.key("master"), value).result()
        params.append(param)
        shards.append(shard)
    return CpuAdam(shards, store, depth=depth), shards, params, store


def _step(adam: CpuAdam, shards: list[Shard], grads: list[torch.Tensor], order: list[int], spaced: bool = False
          ) -> None:
    """One step; ``spaced``: each gradient comes once the previous update is written back, as when backward computes
    between them."""
    plan = StepPlan([HYPER], overlap=True)
    adam.begin(plan)
    # Everything handed over so far is handled, so the reads ahead of this step have been issued.
    adam.barrier()
    for i in order:
        adam.gradient(shards[i], 0, grads[i], _Landed())
        if spaced:
            adam.barrier(include_writes=True)
    adam.schedule(plan, shards)
    adam.barrier(include_writes=True)


@pytest.mark.parametrize("depth", [1, 1.5, 2, 3, 5])
def test_any_gradient_order_matches_torch(tmp_path: Path, depth: float) -> None:
    """Gradients arrive in a new order every step, so reads ahead guess wrong and must give their buffers up (1.5:
    a set for the largest shard and a smaller one, as a rank of two on a node has; 5: sets planned to read ahead
    beyond the pipeline's three)."""
    adam, shards, params, store = _pipeline(tmp_path, depth)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay)
    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(4):
            grads = [torch.randn(n, generator=generator) for n in SIZES]
            order = torch.randperm(len(SIZES), generator=generator).tolist()
            _step(adam, shards, grads, order)
            for p, g in zip(reference, grads):
                p.grad = g.clone()
            torch_adamw.step()
            for shard, p in zip(shards, reference):
                assert torch.equal(shard.unit.host[torch.float32], p.detach()), shard.index
        for shard, p in zip(shards, reference):
            state = torch_adamw.state[p]
            for what in ("exp_avg", "exp_avg_sq"):
                out = torch.empty(shard.numel)
                store.read(adam.state_key(shard, what), out).result()
                assert torch.equal(out, state[what]), (shard.index, what)
    finally:
        adam.close()
        store.close()


def test_a_fraction_of_a_set_buys_a_smaller_one() -> None:
    """The sets a fraction of host memory buys: whole sets for the largest shard, and in the fraction left one set
    for the shards that fit there together; never more bytes than asked, and at least one whole set."""
    needs: list[Need] = [(n, n, 0, 0) for n in SIZES]
    whole = set_bytes((4099, 4099, 0, 0))
    # Half a set holds the shards of up to 2048 elements (24,576 of 24,594 bytes), not the next one.
    assert set_capacities(needs, 1.5) == [(4099, 4099, 0, 0), (2048, 2048, 0, 0)]
    assert sum(map(set_bytes, set_capacities(needs, 1.5))) <= 1.5 * whole
    assert set_capacities(needs, 3) == [(4099, 4099, 0, 0)] * 3
    assert set_capacities(needs, 2.001) == [(4099, 4099, 0, 0)] * 2 + [(1, 1, 0, 0)]
    assert set_capacities(needs, 0.75) == set_capacities(needs, 1) == [(4099, 4099, 0, 0)]
    # Masters kept in the host cache take no room; each field is sized on the largest shard that needs it.
    assert set_capacities([(1000, 0, 0, 0), (500, 500, 1024, 0)], 1.2) == [(1000, 500, 1024, 0)]


def test_each_shard_takes_the_smallest_set_that_holds_it(tmp_path: Path) -> None:
    """With a whole set and a smaller one, a small shard's states are read into the smaller set and the largest
    shard's into the whole one, whichever comes first."""
    adam, shards, _, store = _pipeline(tmp_path, depth=1.5)
    try:
        adam.barrier()
        buffers = adam.buffers
        assert sorted(b.capacity[0] for b in buffers.free) == [2048, 4099]
        assert buffers.nbytes <= 1.5 * set_bytes((4099, 4099, 0, 0))
        small, large = buffers.take(shards[1]), buffers.take(shards[2])
        assert small is not None and large is not None
        assert small[0].capacity[0] == 2048 and large[0].capacity[0] == 4099
        # Nothing is free, and nothing read ahead could give its set up: the shard waits.
        assert buffers.take(shards[0]) is None
        for loaded in (small, large):
            buffers.give_back(loaded)
    finally:
        adam.close()
        store.close()


@pytest.mark.parametrize("depth", [3, 5])
def test_states_are_read_ahead_in_last_steps_order(tmp_path: Path, depth: int) -> None:
    """While the boundary micro-batch runs, the free buffer sets fill with the states of the shards whose updates ran
    first last step, before any of their gradients arrive: as many as there are sets."""
    adam, shards, _, store = _pipeline(tmp_path, depth=depth)
    order = [5, 2, 0, 4, 1, 3]
    try:
        _step(adam, shards, [torch.ones(n) for n in SIZES], order)
        before = len(adam.timeline)
        _step(adam, shards, [torch.ones(n) for n in SIZES], order, spaced=True)
        events = [name for name, _ in adam.timeline][before:]
        first_gradient_update = events.index(f"update_start:{order[0]}")
        ahead = [int(name.split(":")[1]) for name in events[:first_gradient_update] if name.startswith("read_ahead")]
        assert ahead == order[:depth]
        # With backward's time between gradients, every update of the step found its states already read.
        assert sorted(int(n.split(":")[1]) for n in events if n.startswith("read_ahead")) == sorted(order)
    finally:
        adam.close()
        store.close()


def test_worker_thread_count_stays_its_own(tmp_path: Path) -> None:
    """The worker sets its OpenMP thread count for itself only: the training thread keeps its own."""
    before = torch.get_num_threads()
    store = TensorStore([tmp_path])
    adam = CpuAdam([], store, threads=1)
    try:
        adam.barrier()
        assert adam.threads == 1
        assert torch.get_num_threads() == before
    finally:
        adam.close()
        store.close()


def test_release_memory_drops_states_read_ahead(tmp_path: Path) -> None:
    """A run stopped inside a boundary micro-batch (an exception in training_step) still frees every buffer set."""
    adam, shards, _, store = _pipeline(tmp_path, depth=3)
    try:
        _step(adam, shards, [torch.ones(n) for n in SIZES], list(range(len(SIZES))))
        adam.begin(StepPlan([HYPER], overlap=True))
        adam.barrier()
        assert adam.buffers.ahead
        adam.release_memory()
        assert not adam.buffers.ahead and not adam.buffers.free
    finally:
        adam.close()
        store.close()


def test_take_in_returns_once_the_gradients_handed_over_are_folded_in_and_dropped(tmp_path: Path) -> None:
    """``take_in`` (the micro-batch exchange's wait before it reuses a bucket buffer it delivered): every gradient
    handed over is in the window and no longer referenced."""
    adam, shards, _, store = _pipeline(tmp_path, depth=3)
    try:
        adam.begin(StepPlan([HYPER], overlap=False))
        grads = [torch.full((n,), 0.5 * (i + 1)) for i, n in enumerate(SIZES[:2])]
        alive = [weakref.ref(g) for g in grads]
        for i, grad in enumerate(grads):
            adam.gradient(shards[i], 0, grad, _Landed())
        del grads, grad
        assert all(ref() is not None for ref in alive)
        adam.take_in()
        assert all(ref() is None for ref in alive)
        for i in range(2):
            assert torch.equal(adam.accumulator.grad(shards[i]), torch.full((SIZES[i],), 0.5 * (i + 1)))
    finally:
        adam.close()
        store.close()


def test_next_step_starts_while_updates_are_still_queued(tmp_path: Path) -> None:
    """The next boundary micro-batch begins (and reads states ahead) while the last step's updates still run: no
    shard may be read ahead before its pending update has changed it."""
    adam, shards, params, store = _pipeline(tmp_path, depth=3, sizes=SIZES[:2])
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay)
    generator = torch.Generator().manual_seed(3)
    steps = [[torch.randn(s.numel, generator=generator) for s in shards] for _ in range(6)]
    for grads in steps:
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        torch_adamw.step()
    plan = StepPlan([HYPER], overlap=True)
    try:
        for grads in steps:
            adam.begin(plan)
            for shard, grad in zip(shards, grads):
                # As the pager does before the forward that leads to this gradient.
                shard.unit.ready.wait()
                adam.gradient(shard, 0, grad, _Landed())
            adam.schedule(plan, shards)
        adam.barrier(include_writes=True)
        for shard, p in zip(shards, reference):
            assert torch.equal(shard.unit.host[torch.float32], p.detach()), shard.index
    finally:
        adam.close()
        store.close()


def test_abort_undoes_the_updates_of_an_unfinished_step(tmp_path: Path) -> None:
    """Updates that ran during an unfinished step are undone: host copies and committed state are the last step's,
    and training on from there equals torch without the abandoned step."""
    adam, shards, params, store = _pipeline(tmp_path, depth=2)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay)
    generator = torch.Generator().manual_seed(4)

    def torch_step(grads: list[torch.Tensor]) -> None:
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        torch_adamw.step()

    try:
        grads = [torch.randn(n, generator=generator) for n in SIZES]
        _step(adam, shards, grads, list(range(len(SIZES))))
        torch_step(grads)
        # Half the shards get their gradients (and, overlapped, their updates); then the step is abandoned.
        plan = StepPlan([HYPER], overlap=True)
        adam.begin(plan)
        for i in range(3):
            adam.gradient(shards[i], 0, torch.randn(SIZES[i], generator=generator), _Landed())
        adam.barrier(include_writes=True)
        assert not all(torch.equal(shards[i].unit.host[torch.float32], reference[i].detach()) for i in range(3))
        adam.abort()
        for shard, p in zip(shards, reference):
            assert torch.equal(shard.unit.host[torch.float32], p.detach()), shard.index
            assert adam.param_steps(shard) == [1]
            master = torch.empty(shard.numel)
            store.read(adam.state_key(shard, "master"), master).result()
            assert torch.equal(master, p.detach())
        grads = [torch.randn(n, generator=generator) for n in SIZES]
        _step(adam, shards, grads, list(range(len(SIZES))))
        torch_step(grads)
        for shard, p in zip(shards, reference):
            assert torch.equal(shard.unit.host[torch.float32], p.detach()), shard.index
            assert adam.param_steps(shard) == [2]
    finally:
        adam.close()
        store.close()


def test_updates_that_keep_their_gradients_are_not_waited_for():
    """Over budget with an update pending, gradients are handed over at once while updates keep their gradients (a
    speculative step): waiting for that update would free nothing."""
    budget = GradientBudget(limit=10, in_use=lambda: 20)
    budget.updates_queued(1)
    budget.keeping(True)
    budget.wait_for_room(4)
    budget.taken(4)


class _CountedJobs:
    """The optimizer's job queue, recording the kind of every job put."""

    def __init__(self, jobs: Any) -> None:
        self.jobs = jobs
        self.names: list[str] = []

    def put(self, job: Any) -> None:
        self.names.append(type(job).__name__)
        self.jobs.put(job)

    def get(self) -> Any:
        return self.jobs.get()

    def empty(self) -> bool:
        return self.jobs.empty()


def test_a_shards_gradients_reach_the_worker_together(tmp_path: Path) -> None:
    """The worker is woken once per completed shard, not once per parameter: gradients are held until one completes
    its shard (with every other one held), and those of a shard backward never completes go before the next job of
    the training thread. The updates equal torch's AdamW either way."""
    torch.manual_seed(0)
    store = TensorStore([tmp_path])
    sizes = [(300, 5, 70), (40, 9)]
    shards, params = [], []
    for s, numels in enumerate(sizes):
        n = sum(numels)
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        mine = [nn.Parameter(torch.randn(k)) for k in numels]
        unit = Unit(s, (), {torch.float32: n}, host={torch.float32: torch.cat([p.detach() for p in mine])})
        slots = tuple(ShardParam(f"s{s}.p{i}", p, len(params) + i, o, p.numel(), p.shape)
                      for i, (p, o) in enumerate(zip(mine, offsets)))
        shard = Shard(s, unit, 0, torch.float32, 0, slots, n)
        for what in ("master", "exp_avg", "exp_avg_sq"):
            store.reserve(shard.key(what), n * 4)
        store.write(shard.key("master"), torch.cat([p.detach() for p in mine])).result()
        params.extend(mine)
        shards.append(shard)
    adam = CpuAdam(shards, store)
    jobs = _CountedJobs(adam._jobs)
    adam._jobs = jobs  # type: ignore[assignment]
    queued = jobs.names
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay)
    grads = [torch.randn(p.numel()) for p in params]
    plan = StepPlan([HYPER], overlap=True)
    try:
        adam.begin(plan)
        adam.barrier()
        queued.clear()
        # Shard 0 completes with its third gradient; shard 1 gets one of its two (its other parameter is unused).
        adam.gradient(shards[0], 2, grads[2], _Landed())
        adam.gradient(shards[0], 0, grads[0], _Landed())
        assert queued == []
        adam.gradient(shards[0], 1, grads[1], _Landed())
        assert queued == ["_Gradients"]
        adam.gradient(shards[1], 0, grads[3], _Landed())
        assert queued == ["_Gradients"]
        adam.schedule(plan, shards)
        assert queued == ["_Gradients", "_Gradients", "_Schedule"]
        adam.barrier(include_writes=True)
        assert adam.counts["overlapped"] == 1 and adam.counts["deferred"] == 1
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        reference[4].grad = None
        torch_adamw.step()
        for shard in shards:
            for sp in shard.params:
                assert torch.equal(sp.view(shard.unit.host[torch.float32]), reference[sp.index].detach()), sp.name
    finally:
        adam.close()
        store.close()


class _HeldMasters:
    """A store whose writes of masters land only once :attr:`gate` is set (while :attr:`holding`), and which records
    whether each read ran in the urgent lane."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store
        self.gate = threading.Event()
        self.holding = False
        self.held = 0
        self.reads: list[tuple[str, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def read(self, key: str, out: torch.Tensor, *, urgent: bool = False, share: bool = False) -> Future:
        self.reads.append((key, urgent))
        return self.store.read(key, out, urgent=urgent, share=share)

    def write(self, key: str, tensor: torch.Tensor, *, urgent: bool = False, share: bool = False,
              sums: torch.Tensor | None = None) -> Future:
        written = self.store.write(key, tensor, urgent=urgent, share=share, sums=sums)
        if not (self.holding and ".master" in key):
            return written
        self.held += 1
        landed: Future = Future()

        def land() -> None:
            self.gate.wait()
            error = written.exception()
            if error is None:
                landed.set_result(None)
            else:
                landed.set_exception(error)

        threading.Thread(target=land, daemon=True).start()
        return landed


def _host_master_pipeline(tmp_path: Path, sizes: list[int], depth: float
                          ) -> tuple[CpuAdam, list[Shard], list[nn.Parameter], _HeldMasters]:
    """Shards whose masters are their units' host caches (the default on a CPU run), moments in the swap files."""
    torch.manual_seed(0)
    store = _HeldMasters(TensorStore([tmp_path]))
    params, shards = [], []
    for i, n in enumerate(sizes):
        value = torch.randn(n)
        param = nn.Parameter(value.clone())
        unit = Unit(i, (), {torch.float32: n}, host={torch.float32: value.clone()})
        shards.append(Shard(i, unit, 0, torch.float32, 0, (ShardParam(f"p{i}", param, i, 0, n, value.shape),), n,
                            master_in_host=True))
        params.append(param)
    adam = CpuAdam(shards, store, depth=depth)  # type: ignore[arg-type]
    return adam, shards, params, store


def test_a_buffer_set_comes_back_before_the_host_master_is_written(tmp_path: Path) -> None:
    """A master kept in the host cache does not hold the update's buffer set: with one set, the next update runs while
    the last one's master is still being written, a barrier for writes still waits for that write, and the values
    are torch's AdamW's."""
    sizes = [1000, 4099]
    adam, shards, params, store = _host_master_pipeline(tmp_path, sizes, depth=1)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay)
    generator = torch.Generator().manual_seed(5)
    plan = StepPlan([HYPER], overlap=False)
    try:
        for step in range(2):
            grads = [torch.randn(n, generator=generator) for n in sizes]
            for p, g in zip(reference, grads):
                p.grad = g.clone()
            torch_adamw.step()
            store.holding, store.held = True, 0
            store.gate.clear()
            adam.begin(plan)
            for shard, grad in zip(shards, grads):
                adam.gradient(shard, 0, grad, _Landed())
            adam.schedule(plan, shards)
            # Both updates run through the single set although no master write has landed (bounded wait: before,
            # the second update waited for the gate). The worker issues an update's master write just after
            # recording its end.
            last = f"update_end:{shards[-1].index}"
            deadline = time.monotonic() + 30
            while (([name for name, _ in adam.timeline].count(last) <= step or store.held < len(shards))
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            assert [name for name, _ in adam.timeline].count(last) == step + 1
            assert store.held == len(shards)
            writes = Future()
            threading.Thread(target=lambda: writes.set_result(adam.barrier(include_writes=True)), daemon=True).start()
            assert not writes.done()
            store.holding = False
            store.gate.set()
            writes.result(timeout=60)
            for shard, p in zip(shards, reference):
                assert torch.equal(shard.host_master(), p.detach()), shard.index
    finally:
        store.gate.set()
        adam.close()
        store.close()


def test_a_page_in_copies_the_compute_copy_an_update_has_just_written(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 shards whose compute copies (their masters) are read from the store: after an update, the unit is ready
    before the write of its new master has landed, and a page-in's read of it then waits for that write and copies
    the buffer set, verified, instead of reading the drive; once the set is read into for another update, the next
    read goes to the drive. The values are torch's AdamW's either way."""
    sizes = [1000, 4099]
    torch.manual_seed(0)
    store = TensorStore([tmp_path], io_threads_per_path=1)
    params, shards = [], []
    for i, n in enumerate(sizes):
        value = torch.randn(n)
        params.append(nn.Parameter(value.clone()))
        unit = Unit(i, (), {torch.float32: n})
        shards.append(Shard(i, unit, 0, torch.float32, 0, (ShardParam(f"p{i}", params[-1], i, 0, n, value.shape),),
                            n))
        store.reserve(shards[-1].key("master"), n * 4)
        store.write(shards[-1].key("master"), value).result()
    adam = CpuAdam(shards, store, depth=1, compute_on_store=True)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay)
    gate = threading.Event()
    real = TensorStore._transfer_chunk

    def held(self: TensorStore, request: Any, chunk: Any) -> Any:
        if request.is_write and request.key.startswith("shard0.master"):
            gate.wait(30)
        return real(self, request, chunk)

    plan = StepPlan([HYPER], overlap=False)
    grads = [torch.randn(n) for n in sizes]
    for p, g in zip(reference, grads):
        p.grad = g.clone()
    torch_adamw.step()
    first, second = shards
    try:
        monkeypatch.setattr(TensorStore, "_transfer_chunk", held)
        adam.begin(plan)
        for shard, grad in zip(shards, grads):
            adam.gradient(shard, 0, grad, _Landed())
        adam.schedule(plan, shards)
        deadline = time.monotonic() + 30
        while not first.unit.ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        # Ready although its master's write is held back (the second update waits for the only set meanwhile).
        assert first.unit.ready.is_set() and not second.unit.ready.is_set()
        key = first.unit.ready.compute_key(first)
        assert key == first.key("master", 1)
        page_in = aligned_empty(first.numel, torch.float32)
        read = store.read(key, page_in, urgent=True, share=True)
        time.sleep(0.05)
        assert not read.done()
        gate.set()
        read.result(timeout=30)
        assert torch.equal(page_in, reference[0].detach())
        assert store.bytes_shared == first.numel * 4
        assert store.unshare(page_in) == []
        adam.barrier(include_writes=True)
        # The second update read into the only set: the first shard's master comes from the drive now, the second's
        # from the set, which still offers it.
        read_before = store.bytes_read
        store.read(key, page_in).result()
        assert torch.equal(page_in, reference[0].detach()) and store.bytes_read == read_before + first.numel * 4
        out = aligned_empty(second.numel, torch.float32)
        store.read(second.unit.ready.compute_key(second), out).result()
        assert torch.equal(out, reference[1].detach())
        assert store.bytes_shared == (first.numel + second.numel) * 4
    finally:
        gate.set()
        adam.close()
        store.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_only_reads_for_a_finished_steps_updates_are_urgent(tmp_path: Path, overlap: bool) -> None:
    """The reads of an update queued when its step was finished (the next forward waits for it) go before queued
    write-backs; reads ahead and those of updates overlapped with backward do not."""
    sizes = [1000, 37, 4099, 513]
    adam, shards, _, store = _host_master_pipeline(tmp_path, sizes, depth=1)
    plan = StepPlan([HYPER], overlap=overlap)
    try:
        # The first step writes the moments; from the second on, each update reads them.
        for step in range(3):
            store.reads.clear()
            adam.begin(plan)
            adam.barrier()
            ahead = list(store.reads)
            for shard in shards:
                adam.gradient(shard, 0, torch.ones(shard.numel), _Landed())
            adam.schedule(plan, shards)
            adam.barrier(include_writes=True)
            taken = store.reads[len(ahead):]
            if step == 0:
                continue
            assert len(ahead) == 2 and not any(urgent for _, urgent in ahead)
            # One set: every shard but the one read ahead is read when its update takes the set.
            assert len(taken) == 2 * (len(shards) - 1)
            assert all(urgent != overlap for _, urgent in taken)
    finally:
        adam.close()
        store.close()


def _host_pipeline(tmp_path: Path, sizes: list[tuple[int, ...]], master_in_host: list[bool]
                   ) -> tuple[CpuAdam, list[Shard], list[nn.Parameter], TieredStore]:
    """Shards of one or more parameters on the host state tier (both slots in host memory, updated without a buffer
    set), compute copies in each unit's fp32 host cache; where ``master_in_host``, that copy is the master."""
    torch.manual_seed(0)
    params, shards, keys = [], [], []
    for i, (numels, in_host) in enumerate(zip(sizes, master_in_host)):
        n = sum(numels)
        value = torch.randn(n)
        unit = Unit(i, (), {torch.float32: n}, host={torch.float32: value.clone()})
        shard_params, offset = [], 0
        for k, numel in enumerate(numels):
            param = nn.Parameter(value[offset : offset + numel].clone())
            shard_params.append(ShardParam(f"p{i}.{k}", param, len(params), offset, numel, param.shape))
            params.append(param)
            offset += numel
        shard = Shard(i, unit, 0, torch.float32, 0, tuple(shard_params), n, master_in_host=in_host, state_tier="host")
        shards.append(shard)
        keys += shard.state_keys()
    store = TieredStore(TensorStore([tmp_path]), HostStore(threads=0), host_keys=keys)
    adam = CpuAdam(shards, store, depth=1)
    for shard in shards:
        if not shard.master_in_host:
            store.write(shard.key("master"), shard.unit.host[torch.float32].clone()).result()
    return adam, shards, params, store


def _slot_bytes(adam: CpuAdam, store: TieredStore, shards: list[Shard], committed: bool) -> dict[str, torch.Tensor]:
    """A copy of every state each shard has in its committed slot (or in the other one)."""
    adam.barrier(include_writes=True)
    copies = {}
    for shard in shards:
        for what in ("master", "exp_avg", "exp_avg_sq"):
            key = adam.state_key(shard, what)
            if not committed:
                key = shard.key(what, 1 - adam.ledger.committed(shard).slot)
            copies[key] = store.host.view(key, torch.uint8).clone()
    return copies


HOST_SIZES = [(1000,), (37, 515), (4099,), (7, 1, 300)]
HOST_MASTERS = [False, False, True, True]


def test_host_tier_updates_read_the_committed_slot_and_copy_nothing(tmp_path: Path) -> None:
    """On the host tier an update reads master and moments where the last step left them and writes the other slot in
    the same pass: torch's numbers, steps where some parameters have no gradient included (their states reach the new
    slot unchanged), and no state bytes copied but the write-back of masters kept in the host cache."""
    adam, shards, params, store = _host_pipeline(tmp_path, HOST_SIZES, HOST_MASTERS)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay, foreach=False)
    generator = torch.Generator().manual_seed(5)
    plan = StepPlan([HYPER], overlap=True)
    # Step 3 leaves the second parameter of each shard of several without a gradient.
    skipped = {3: {p.index for s in shards for p in s.params[1:2]}}
    try:
        for step in range(1, 6):
            grads = [None if i in skipped.get(step, ()) else torch.randn(p.numel(), generator=generator)
                     for i, p in enumerate(params)]
            copied = store.host.bytes_copied
            adam.begin(plan)
            for shard in shards:
                for position, sp in enumerate(shard.params):
                    if grads[sp.index] is not None:
                        adam.gradient(shard, position, grads[sp.index], _Landed())
            adam.schedule(plan, shards)
            adam.barrier(include_writes=True)
            assert adam.counts["overlapped"] + adam.counts["deferred"] == step * len(shards)
            assert store.host.bytes_copied - copied == sum(4 * s.numel for s in shards if s.master_in_host)
            for p, g in zip(reference, grads):
                p.grad = g
            torch_adamw.step()
            for shard in shards:
                master = torch.empty(shard.numel)
                store.read(adam.state_key(shard, "master"), master).result()
                for sp in shard.params:
                    value = reference[sp.index].detach()
                    assert torch.equal(sp.view(shard.unit.host[torch.float32]), value), (step, sp.name)
                    assert torch.equal(sp.view(master), value), (step, sp.name)
                    state = torch_adamw.state[reference[sp.index]]
                    for what in ("exp_avg", "exp_avg_sq"):
                        moment = store.host.view(adam.state_key(shard, what), torch.float32)
                        assert torch.equal(sp.view(moment), state[what]), (step, sp.name, what)
                assert adam.param_steps(shard) == [int(torch_adamw.state[reference[sp.index]]["step"])
                                                   for sp in shard.params]
    finally:
        adam.close()
        store.close()


def test_gradients_handed_over_in_parts_give_the_bits_of_whole_ones(tmp_path: Path) -> None:
    """A parameter's gradient handed over in flat parts (as the micro-batch exchange delivers a parameter larger than
    its buckets), over an accumulation window of three micro-batches, updates to the same bits as the whole gradient;
    a shard waits for a parameter's last part before it counts as complete."""
    for name in ("whole", "parts"):
        (tmp_path / name).mkdir()
    whole_adam, whole_shards, _, whole_store = _host_pipeline(tmp_path / "whole", HOST_SIZES, HOST_MASTERS)
    parts_adam, parts_shards, _, parts_store = _host_pipeline(tmp_path / "parts", HOST_SIZES, HOST_MASTERS)
    generator = torch.Generator().manual_seed(9)
    try:
        for step in range(2):
            for micro_batch in range(3):
                plan = StepPlan([HYPER], overlap=True) if micro_batch == 2 else None
                whole_adam.begin(plan)
                parts_adam.begin(plan)
                for whole, parts in zip(whole_shards, parts_shards):
                    for position, sp in enumerate(whole.params):
                        grad = torch.randn(sp.shape, generator=generator)
                        whole_adam.gradient(whole, position, grad, _Landed())
                        inner = torch.randint(1, sp.numel, (2,), generator=generator).tolist() if sp.numel > 1 else []
                        starts = sorted({0, *inner})
                        flat = grad.reshape(-1)
                        for start, end in zip(starts, [*starts[1:], sp.numel]):
                            parts_adam.gradient(parts, position, flat[start:end], _Landed(), start)
                if plan is not None:
                    whole_adam.schedule(plan, whole_shards)
                    parts_adam.schedule(plan, parts_shards)
            for adam in (whole_adam, parts_adam):
                adam.barrier(include_writes=True)
            assert parts_adam.counts == whole_adam.counts
            for whole, parts in zip(whole_shards, parts_shards):
                for what in ("master", "exp_avg", "exp_avg_sq"):
                    got = parts_store.host.view(parts_adam.state_key(parts, what), torch.float32)
                    want = whole_store.host.view(whole_adam.state_key(whole, what), torch.float32)
                    assert torch.equal(got, want), (step, whole.index, what)
    finally:
        for adam, store in ((whole_adam, whole_store), (parts_adam, parts_store)):
            adam.close()
            store.close()


@pytest.mark.parametrize("ending", ["abort", "overflow", "failure"])
def test_a_host_tier_update_that_does_not_commit_leaves_the_committed_slot(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            ending: str) -> None:
    """Updates that ran and then were abandoned (an abort, a speculative step that overflowed) or failed wrote only
    the other slot: every byte of the committed slot is what the last committed step left."""
    adam, shards, params, store = _host_pipeline(tmp_path, HOST_SIZES, HOST_MASTERS)
    generator = torch.Generator().manual_seed(6)

    def all_gradients() -> None:
        for shard in shards:
            # As the pager does before the forward that leads to these gradients.
            shard.unit.ready.wait()
            for position, sp in enumerate(shard.params):
                adam.gradient(shard, position, torch.randn(sp.numel, generator=generator), _Landed())

    try:
        plan = StepPlan([HYPER], overlap=True)
        for _ in range(2):
            adam.begin(plan)
            all_gradients()
            adam.schedule(plan, shards)
        committed = _slot_bytes(adam, store, shards, committed=True)
        other = _slot_bytes(adam, store, shards, committed=False)
        if ending == "failure":
            adamw = CpuAdam._adamw

            def fails_after_writing(self: CpuAdam, *args: Any, **kwargs: Any) -> None:
                adamw(self, *args, **kwargs)
                raise RuntimeError("injected failure after the step")

            monkeypatch.setattr(CpuAdam, "_adamw", fails_after_writing)
        speculative = StepPlan([HYPER], overlap=True, speculative=True)
        adam.begin(speculative)
        if ending == "failure":
            # The failure surfaces where the training thread next waits for the worker: the page-in of a later
            # shard's unit if the failed update ran before it, else the barrier.
            with pytest.raises(RuntimeError, match="injected failure"):
                all_gradients()
                adam.barrier(include_writes=True)
        else:
            all_gradients()
            adam.barrier(include_writes=True)
            # The updates ran: they wrote the other slot.
            assert _slot_bytes(adam, store, shards, committed=False).keys() == other.keys()
            assert any(not torch.equal(a, b) for a, b in zip(_slot_bytes(adam, store, shards, False).values(),
                                                                other.values()))
            if ending == "abort":
                adam.abort()
            else:
                adam.undo_speculation(None)
        for key, before in committed.items():
            assert torch.equal(store.host.view(key, torch.uint8), before), key
    finally:
        adam.close()
        store.close()


class _RecordedWrites:
    """A store that records, per key written, whether the writer handed in its block checksums."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store
        self.sums: dict[str, bool] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def write(self, key: str, tensor: torch.Tensor, **kwargs: Any) -> Future:
        self.sums[key] = kwargs.get("sums") is not None
        return self.store.write(key, tensor, **kwargs)


def test_updates_hand_the_kernels_checksums_to_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native kernel steps a whole shard, the writes of its new master and moments carry the checksums the
    kernel computed, so the store's I/O threads checksum none of their bytes; the states read back verified in the
    next step and are torch's AdamW's."""
    # Looked up on the module: another test reloads it.
    if ops.adamw_step() is not ops.fused_adamw_:
        pytest.skip("the native kernel is not built or does not match torch here")
    adam, shards, params, store = _pipeline(tmp_path, 2)
    recorded = _RecordedWrites(store)
    adam.store = recorded
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    torch_adamw = torch.optim.AdamW(reference, lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                    weight_decay=HYPER.weight_decay)
    # Checksums the I/O threads take while writing, by key.
    hashed_writes: list[str] = []
    writing = threading.local()
    real_transfer, real_checksum = storage.TensorStore._transfer_chunk, storage.host_checksum

    def transfer(self: TensorStore, request: Any, chunk: Any) -> int | None:
        writing.key = request.key if request.is_write else None
        try:
            return real_transfer(self, request, chunk)
        finally:
            writing.key = None

    def checksum(algorithm: str, data: memoryview, key_offset: int = 0) -> int:
        if getattr(writing, "key", None) is not None:
            hashed_writes.append(writing.key)
        return real_checksum(algorithm, data, key_offset)

    monkeypatch.setattr(storage.TensorStore, "_transfer_chunk", transfer)
    monkeypatch.setattr(storage, "host_checksum", checksum)
    generator = torch.Generator().manual_seed(2)
    try:
        for _ in range(3):
            grads = [torch.randn(n, generator=generator) for n in SIZES]
            _step(adam, shards, grads, list(range(len(SIZES))))
            for p, g in zip(reference, grads):
                p.grad = g.clone()
            torch_adamw.step()
            assert all(recorded.sums.values()) and len(recorded.sums) >= 3 * len(SIZES)
            assert hashed_writes == []
        for shard, p in zip(shards, reference):
            assert torch.equal(shard.unit.host[torch.float32], p.detach()), shard.index
            for what in ("exp_avg", "exp_avg_sq"):
                out = torch.empty(shard.numel)
                store.read(adam.state_key(shard, what), out).result()
                assert torch.equal(out, torch_adamw.state[p][what]), (shard.index, what)
    finally:
        adam.close()
        store.close()
