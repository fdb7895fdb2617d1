"""What only a CUDA device can show: no host syncs in steady-state steps, the numbers of plain Lightning on CUDA,
the device memory cap, and kvikio moving device memory to the swap files.

Skipped where ``torch.cuda.is_available()`` is false.

Host syncs that are by design, and outside the steady-state steps checked here:

- the profiled micro-batches of ``plan="auto"`` (the first ``profile_steps``) synchronize to time every op;
- Lightning turns logged progress-bar metrics into numbers with ``.item()`` every ``log_every_n_steps`` (the modules
  here log nothing);
- checkpoints and teardown wait for the CPU optimizer and read the states back from the swap files.

The fp16 overflow check reads ``found_inf`` from the host fp32 gradients, so it costs no device sync, and the loss
scale's device copy is made once and changed in place, so scaling the loss copies nothing.
"""

from __future__ import annotations

import fcntl
import gc
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ratel import RatelConfigError, RatelStrategy
from lightning_ratel.callbacks import RatelProfiler
from lightning_ratel.plan.states import device_bytes
from lightning_ratel.runtime import gds
from lightning_ratel.runtime.collectives import Faults, Ranks, _Begin, _DeviceExchange, _Flush
from lightning_ratel.runtime.device import Device
from tests.forked_ranks import START_METHOD
from tests.models import LM, MIXED_POLICY, MODELS, SEQ, VOCAB, HostAdamLM, cache_off, final_state, max_rel_err, trainer
from tests.syncs import SyncCounter, extra_syncs
from tests.test_micro_batch_exchange import _hand_over, _Optimizer, _shards
from tests.test_state_tiers import LateUpdates

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# cuBLAS reduces deterministically only with a fixed workspace, set before its first use in the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# The yardstick on CUDA is plain Lightning's own spread: its default AdamW (foreach CUDA kernels) against the same
# AdamW computed on the CPU (``HostAdamW``), which is RatelStrategy's arithmetic. Rounding differences of the last bit
# grow over steps, in bf16 by far (a master that moves by one fp32 ulp now and then rounds to the neighbouring bf16
# value, and Adam's normalised update turns tiny gradient differences into updates of the learning rate's size), so
# the test allows plain's own spread with a margin, and the tight check is against plain with the CPU arithmetic.
SPREAD_MARGIN = 2.0
TOLERANCE = {"32-true": 1e-5, "bf16-mixed": 1e-3}
# RatelStrategy against plain Lightning stepping the same AdamW on the CPU: the training step's own path on CUDA.
SAME_ARITHMETIC = {"32-true": 1e-6, "bf16-mixed": 1e-6}


class Quiet(LM):
    """The shared test module without ``self.log``, whose progress-bar value Lightning reads back with ``.item()``."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss


class Wide(Quiet):
    """A Llama whose fp32 parameters (about 170 MB) are more than the device cap of the memory test."""

    def __init__(self) -> None:
        super().__init__("llama")
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=24,
                             num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=SEQ,
                             tie_word_embeddings=False)
        self.model = LlamaForCausalLM(config)


def gpu_trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    return trainer(strategy, accelerator="gpu", devices=1, **kwargs)


def swap_dirs(tmp_path: Any, count: int = 2) -> list[str]:
    paths = [tmp_path / f"swap{i}" for i in range(count)]
    for path in paths:
        path.mkdir()
    return [str(p) for p in paths]


# Under ``pytest -n N`` the workers share the device: a test that caps its process's device memory takes the device
# alone (an exclusive lock), every other CUDA test shares it (a shared lock), so no allocation of another worker's test
# runs beside a capped one.
DEVICE_LOCK = Path(tempfile.gettempdir()) / "lightning_ratel_test_cuda.lock"


@pytest.fixture(autouse=True)
def _device_share(request: pytest.FixtureRequest) -> Iterator[None]:
    alone = request.node.get_closest_marker("device_alone") is not None
    with open(DEVICE_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _fresh_device(_device_share: None) -> Iterator[None]:
    """Each test starts with nothing cached and ends with the whole device and no debug mode."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.set_per_process_memory_fraction(1.0)


# ---------------------------------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize(
    ("model", "precision", "policy", "states"),
    [("llama", "bf16-mixed", None, "auto"), ("gpt2", "32-true", MIXED_POLICY, "auto"),
     ("mlp", "16-mixed", MIXED_POLICY, "host")],
)
def test_no_host_sync_in_steady_state(tmp_path, model, precision, policy, states):
    """RatelStrategy adds no host sync to a steady-state step: each place that syncs (transformers' GPT-2 mask code
    does, once per forward) syncs as often under plain Lightning on the same model. (``"auto"`` puts these small
    models' states on the device tier; under fp16 that tier reads the overflow flag of its device gradients on the
    training thread, as plain GradScaler's step does, so the fp16 case keeps the states in host memory.)"""
    # plan=auto profiles micro-batches 0 and 1 and plans after batch 1; batch 2 is the first under the plan.
    plain = SyncCounter(first=3)
    reference = Quiet(model)
    # The model as RatelStrategy trains it: with the KV cache off, transformers checks the position ids for packed
    # sequences (``find_packed_sequence_indices``, one sync per forward), as under plain training with use_cache=False.
    cache_off(reference)
    gpu_trainer("auto", precision=precision, max_steps=8, callbacks=[plain]).fit(reference)
    ratel = SyncCounter(first=3)
    strategy = RatelStrategy(ssd_paths=swap_dirs(tmp_path), activation_policy=policy, optimizer_states=states)
    # The counter after the profiler, so the profiler's per-step breakdown is inside the checked span too. The span
    # ends before Lightning copies the next batch from pageable memory, which is a sync of Lightning's.
    gpu_trainer(strategy, precision=precision, max_steps=8,
                callbacks=[RatelProfiler(report=False), ratel]).fit(Quiet(model))
    assert ratel.checked == plain.checked == 5
    assert extra_syncs(ratel, plain) == {}, f"syncs beyond plain Lightning's: {dict(extra_syncs(ratel, plain))}"


class EventSyncTrap(L.Callback):
    """Fails any host wait on a CUDA event by the training thread during the micro-batches from ``first`` on (the
    sync debug mode above does not see event waits). The optimizer's worker waits for gradient copies by design."""

    def __init__(self, first: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.first = first
        self.armed = False
        self.checked = 0
        self.caught: list[str] = []
        trainer_thread = threading.get_ident()
        original = torch.cuda.Event.synchronize

        def synchronize(event: torch.cuda.Event) -> None:
            if self.armed and threading.get_ident() == trainer_thread:
                self.caught.append("torch.cuda.Event.synchronize on the training thread")
            original(event)

        monkeypatch.setattr(torch.cuda.Event, "synchronize", synchronize)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.armed = batch_idx >= self.first

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.armed:
            self.checked += 1
        self.armed = False


@pytest.mark.parametrize("param_cache", ["host", "ssd"])
def test_no_event_waits_on_the_training_thread(tmp_path, monkeypatch, param_cache):
    """Page-outs hand staging buffers back without waiting for their uploads, and nothing else on the training thread
    waits for an event in a steady-state step (with every tier, fp16 loss scaling and paging from the swap files)."""
    events = EventSyncTrap(first=3, monkeypatch=monkeypatch)
    trap = SyncCounter(first=3)
    # The host tier: the device tier reads fp16's overflow flag on the training thread (see the test above).
    strategy = RatelStrategy(ssd_paths=swap_dirs(tmp_path), activation_policy=MIXED_POLICY, param_cache=param_cache,
                             optimizer_states="host")
    gpu_trainer(strategy, precision="16-mixed", max_steps=8,
                callbacks=[RatelProfiler(report=False), events, trap]).fit(Quiet("mlp"))
    assert events.checked == trap.checked == 5
    assert events.caught == []
    assert trap.places == {}, f"host syncs on the training thread: {dict(trap.places)}"


def test_a_profiled_block_costs_its_ops_device_time(tmp_path):
    """Profiling times each op between two events on the compute stream, without a host sync between ops, and an
    op-level block's forward is the sum of its ops' device times: on the H200 the host syncs around every op and the
    op tracking's dispatch work made the profiled blocks several times slower than the steady state's."""
    profiler = RatelProfiler(report=False)
    gpu_trainer(RatelStrategy(ssd_paths=swap_dirs(tmp_path)), precision="bf16-mixed", max_steps=4,
                callbacks=[profiler]).fit(Quiet("gpt2"))
    assert profiler.plan is not None
    op_level = [layer for layer in profiler.plan.layers if layer.op_level]
    assert op_level
    for layer in op_level:
        assert all(op.forward_time >= 0 for op in layer.ops)
        assert layer.forward_time == pytest.approx(sum(op.forward_time for op in layer.ops))


def test_pinned_memory_is_the_pool_sized_exactly(tmp_path):
    """Every pinned byte comes from the engine's pool at the size asked for, not from torch's caching host allocator
    (which rounds each request up to a power of two and keeps it)."""
    seen: dict[str, Any] = {}

    class Inspect(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            engine = trainer.strategy.engine
            caches = [flat for unit in engine.layout.units.values() for flat in unit.host.values()]
            seen["caches_pinned"] = all(flat.is_pinned() for flat in caches)
            seen["cache_bytes"] = sum(-(-flat.numel() * flat.element_size() // 4096) * 4096 for flat in caches)
            seen["placement"] = engine.byte_placement()
            seen["pool"] = engine.device.pool.nbytes

    before = _pinned_by_torch()
    # States in host memory: on the device tier (what "auto" picks for a model this small) the compute copies live in
    # device memory and nothing is pinned.
    strategy = RatelStrategy(ssd_paths=swap_dirs(tmp_path), activation_policy=MIXED_POLICY, optimizer_states="host")
    gpu_trainer(strategy, precision="bf16-mixed", max_steps=6, callbacks=[Inspect()]).fit(Quiet("llama"))
    assert seen["caches_pinned"]
    assert seen["placement"]["pinned"] == seen["cache_bytes"] + seen["pool"]
    after = _pinned_by_torch()
    if before is not None and after is not None:
        # Bytes handed out by torch's caching host allocator during the run: the engine's traffic does not go there.
        assert after - before < 1 << 20


def _pinned_by_torch() -> int | None:
    """Bytes torch's caching host allocator has handed out so far (``None`` where this torch does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return stats().get("active_bytes.allocated") if stats is not None else None


# ---------------------------------------------------------------------------------------------------- equivalence


@contextmanager
def reproducible() -> Iterator[None]:
    """Deterministic kernels and the math attention backend, so two runs compute bit-identical gradients."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _on_host(state: tuple[dict, dict]) -> tuple[dict, dict]:
    params, optimizer = state
    moved = {i: {k: v.cpu() for k, v in entry.items()} for i, entry in optimizer["state"].items()}
    return {k: v.cpu() for k, v in params.items()}, {**optimizer, "state": moved}


def _fit(strategy: Any, module: LM, precision: str) -> tuple[dict, dict]:
    t = gpu_trainer(strategy, precision=precision)
    t.fit(module)
    return _on_host(final_state(module, t))


def _moment_error(ref: dict, got: dict) -> float:
    worst = 0.0
    for i in ref["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            scale = ref["state"][i][key].abs().max().clamp(min=1e-20)
            worst = max(worst, ((ref["state"][i][key] - got["state"][i][key]).abs().max() / scale).item())
    return worst


@pytest.mark.parametrize("plan", ["every tier", "auto"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("model", ["llama", "gpt2", "mlp"])
def test_matches_plain_lightning_on_cuda(tmp_path, model, precision, plan):
    policy = MIXED_POLICY if plan == "every tier" else None
    with reproducible():
        ref = _fit("auto", LM(model), precision)
        host = _fit("auto", HostAdamLM(model), precision)
        # The CPU optimizer's arithmetic is the check here: the states in host memory ("auto" would put these small
        # models on the device tier, see test_device_tier_matches_plain_lightning_on_cuda).
        got = _fit(RatelStrategy(ssd_paths=swap_dirs(tmp_path), activation_policy=policy, optimizer_states="host"),
                   LM(model), precision)
    spread = max_rel_err(ref[0], host[0])
    allowed = max(TOLERANCE[precision], SPREAD_MARGIN * spread)
    error = max_rel_err(ref[0], got[0])
    assert error <= allowed, f"parameters differ by {error:.3g}; plain's CUDA and CPU AdamW by {spread:.3g}"
    same = max_rel_err(host[0], got[0])
    assert same <= SAME_ARITHMETIC[precision], f"{same:.3g} from plain Lightning with the CPU AdamW arithmetic"
    assert _moment_error(host[1], got[1]) <= SAME_ARITHMETIC[precision]
    ref_state, got_state = ref[1]["state"], got[1]["state"]
    assert ref_state.keys() == got_state.keys()
    for i in ref_state:
        assert got_state[i]["step"].item() == ref_state[i]["step"].item()
    assert got[1]["param_groups"] == ref[1]["param_groups"]
    assert all(os.listdir(path) == [] for path in (tmp_path / "swap0", tmp_path / "swap1"))


def test_late_updates_copy_the_masters_backward_paged_in_on_cuda(tmp_path, monkeypatch):
    """fp32 masters paged in from the swap files through pinned staging buffers: an update held up behind backward
    copies its master from the page-in's buffer the host pool keeps (never a third read from the drive in a step),
    with the numbers of plain Lightning stepping the same AdamW on the CPU."""
    strategy = RatelStrategy(ssd_paths=swap_dirs(tmp_path), activation_policy="host", optimizer_states="ssd",
                             param_cache="ssd", read_ahead_sets=0)
    lm = LM("llama")
    late = LateUpdates(monkeypatch, strategy, lm)
    with reproducible():
        ref = HostAdamLM("llama")
        plain = gpu_trainer("auto", precision="32-true", max_steps=5)
        plain.fit(ref)
        ratel = gpu_trainer(strategy, precision="32-true", max_steps=5)
        ratel.fit(lm)
    error = max_rel_err(_on_host(final_state(ref, plain))[0], _on_host(final_state(lm, ratel))[0])
    assert error <= SAME_ARITHMETIC["32-true"]
    # Not the last step: the copy back into the module after it reads every master.
    late.assert_at_most_two_reads(range(1, 4))


@pytest.mark.parametrize(("states", "policy"), [("device", None), ("auto", None), ("device", "keep")])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_device_tier_matches_plain_lightning_on_cuda(tmp_path, precision, states, policy):
    """The device tier's update is torch's foreach AdamW on the GPU, plain Lightning's own there: every state on the
    device (and ``"auto"``, which puts these small models there whole) gives plain Lightning's numbers, with
    accumulation and clipping by norm (one norm over every gradient, on the GPU); with every activation kept, on
    passes that hold every unit from forward to backward."""
    kwargs = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    with reproducible():
        ref = _on_host(final_state(*_fit_with(gpu_trainer("auto", precision=precision, **kwargs), LM("llama"))))
        strategy = RatelStrategy(ssd_paths=swap_dirs(tmp_path), optimizer_states=states, activation_policy=policy)
        t = gpu_trainer(strategy, precision=precision, **kwargs)
        module = LM("llama")
        tiers: list[str] = []
        module.on_train_start = lambda: tiers.extend(s.state_tier for s in strategy.engine.layout.shards)
        bound: list[bool] = []
        module.on_before_backward = lambda loss: bound.append(strategy.engine.scheduler.bound)
        got = _on_host(final_state(*_fit_with(t, module)))
    assert set(tiers) == {"device"}
    assert bound and all(bound) == (policy == "keep")
    error = max_rel_err(ref[0], got[0])
    assert error <= SAME_ARITHMETIC[precision], f"parameters differ from plain Lightning's by {error:.3g}"
    assert _moment_error(ref[1], got[1]) <= SAME_ARITHMETIC[precision]


class _SamplesBetweenSteps(L.Callback):
    """Runs the model on each batch after its step (a callback sampling from it), under CUDA autocast or not."""

    def __init__(self, autocast: bool) -> None:
        self.autocast = autocast
        self.sums: list[float] = []
        self.dtypes: set[torch.dtype] = set()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.dtypes |= {p.dtype for p in pl_module.parameters()}
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            self.sums.append(pl_module.model(input_ids=batch).logits.double().sum().item())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_a_forward_between_steps_matches_plain_lightning_on_cuda(tmp_path, autocast):
    """bf16-mixed with every state on the device and every activation kept (passes that hold every unit): a
    callback's forward between steps computes as under plain Lightning, outside autocast with the fp32 values, under it
    with the bf16 compute copies, and every parameter reads its own dtype (fp32) there."""
    sums, dtypes = [], []
    for strategy in ("auto", RatelStrategy(ssd_paths=swap_dirs(tmp_path), optimizer_states="device",
                                           activation_policy="keep")):
        probe = _SamplesBetweenSteps(autocast)
        with reproducible():
            gpu_trainer(strategy, precision="bf16-mixed", max_steps=3, callbacks=[probe]).fit(LM("llama"))
        sums.append(probe.sums)
        dtypes.append(probe.dtypes)
    assert len(sums[0]) == 3
    assert sums[1] == pytest.approx(sums[0], rel=SAME_ARITHMETIC["bf16-mixed"], abs=0)
    assert dtypes == [{torch.float32}] * 2


def _fit_with(t: L.Trainer, module: LM) -> tuple[LM, L.Trainer]:
    t.fit(module)
    return module, t


@pytest.mark.parametrize("model", ["conv_bn", "spectral_norm"])
def test_replay_leaves_buffers_and_random_state_as_plain_training_on_cuda(tmp_path, monkeypatch, model):
    """cuDNN's batch norm writes its running statistics without saying so in its schema, and dropout draws from the
    CUDA generator: a replayed block must do neither a second time."""
    from tests.test_replay import BUILDERS

    monkeypatch.setitem(MODELS, model, BUILDERS[model])
    with reproducible():
        ref = _fit("auto", HostAdamLM(model), "32-true")
        plain_rng = torch.cuda.get_rng_state()
        got = _fit(RatelStrategy(ssd_paths=swap_dirs(tmp_path), activation_policy="recompute"), LM(model), "32-true")
        ratel_rng = torch.cuda.get_rng_state()
    error = max_rel_err(ref[0], got[0])  # parameters and buffers (running statistics, power-iteration vectors)
    assert error <= SAME_ARITHMETIC["32-true"], f"{error:.3g} from plain Lightning with the CPU AdamW arithmetic"
    assert torch.equal(ratel_rng, plain_rng)


# ---------------------------------------------------------------------------------------------------- memory cap


@pytest.mark.device_alone
def test_device_memory_limit_caps_the_allocator_and_the_plan(tmp_path):
    limit = 128 << 20
    module = Wide()
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert model_bytes > limit
    held: list[int] = []

    class DeviceTier(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            layout = trainer.strategy.engine.layout
            held.append(sum(device_bytes(s.numel) for s in layout.shards if s.state_tier == "device")
                        + sum(u.nbytes for u in layout.units.values() if u.resident))

    t = gpu_trainer(RatelStrategy(ssd_paths=swap_dirs(tmp_path, 1), device_memory_limit=limit), precision="32-true",
                    max_steps=5, callbacks=[DeviceTier()])
    t.fit(module)
    assert torch.cuda.max_memory_allocated() <= limit
    # The cap is the run's: teardown puts the allocator back as it was.
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    plan = t.strategy.profiler.plan
    assert plan is not None
    # The device tier's states, gradient sums and resident compute copies come out of the limit first.
    assert held and held[0] > 0
    assert plan.budgets["device"] == limit - held[0]
    assert plan.memory["device"] <= limit


@pytest.mark.device_alone
def test_device_memory_limit_is_undone_after_a_failed_setup(tmp_path):
    strategy = RatelStrategy(ssd_paths=swap_dirs(tmp_path, 1), device_memory_limit=128 << 20, blocks=["no.such"])
    with pytest.raises(RatelConfigError, match="does not have"):
        gpu_trainer(strategy, max_steps=1).fit(Quiet("mlp"))
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0


@pytest.mark.device_alone
def test_device_memory_limit_above_the_device_is_refused(tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory
    strategy = RatelStrategy(ssd_paths=swap_dirs(tmp_path, 1), device_memory_limit=2 * total)
    with pytest.raises(RatelConfigError, match="exceeds the device"):
        gpu_trainer(strategy, max_steps=1).fit(Quiet("mlp"))


# ---------------------------------------------------------------------------------------------------- kvikio


@pytest.fixture
def kvikio_dirs(tmp_path) -> list[str]:
    dirs = swap_dirs(tmp_path)
    reason = gds.kvikio_unavailable_reason(dirs[0])
    if reason is not None:
        pytest.skip(f"kvikio cannot be used here: {reason}")
    return dirs


def _busy_matmuls(n: int = 4096, rounds: int = 30) -> torch.Tensor:
    """Queue a few hundred milliseconds of device work and return its (late) result, values of order one."""
    a = torch.randn(n, n, device="cuda")
    for _ in range(rounds):
        a = torch.tanh((a @ a) / n**0.5)
    return a


def test_kvikio_round_trip_striped(kvikio_dirs):
    with gds.GdsStore(kvikio_dirs, stripe_bytes=1 << 20) as store:
        data = torch.randn(3 * (1 << 20) // 2 + 77, dtype=torch.bfloat16, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        write = store.write("x", data)  # submitting records an event; it must not block the host on the device
        torch.cuda.set_sync_debug_mode("default")
        write.result()
        out = torch.empty_like(data)
        assert store.read("x", out).result() is out
        assert torch.equal(out, data)
        assert store.nbytes_reserved == data.numel() * 2
        assert store.take_busy_intervals()
    assert all(os.listdir(d) == [] for d in kvikio_dirs)


def test_kvikio_write_waits_for_the_producer_and_read_for_earlier_users(kvikio_dirs):
    with gds.GdsStore(kvikio_dirs, stripe_bytes=1 << 20) as store:
        target = torch.zeros(1 << 20, device="cuda")
        late = _busy_matmuls()
        target.copy_(late.reshape(-1)[: target.numel()])
        store.write("late", target).result()  # the copy above is still queued when this is submitted
        back = torch.empty_like(target)
        store.read("late", back).result()
        assert torch.equal(back, target)

        stored = torch.full((1 << 20,), 7.0, device="cuda")
        store.write("sevens", stored).result()
        buffer = torch.zeros(1 << 20, device="cuda")
        buffer.copy_(_busy_matmuls().reshape(-1)[: buffer.numel()])  # a queued kernel still writes the buffer
        store.read("sevens", buffer).result()
        assert torch.equal(buffer, stored)


def test_kvikio_measure(kvikio_dirs):
    figures = gds.measure(kvikio_dirs, "cuda", nbytes=64 << 20)
    assert min(figures.kvikio_read, figures.kvikio_write, figures.host_read, figures.host_write) > 0
    assert isinstance(figures.prefer_kvikio(), bool)
    assert all(os.listdir(d) == [] for d in kvikio_dirs)


def _device_exchange_worker(rank: int, init: str) -> None:
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=1, device_id=torch.device("cuda", 0))
    ranks = Ranks(rank=0, world=1, timeout=timedelta(minutes=5))
    faults = Faults(ranks, "cuda-device-exchange")
    group = dist.new_group(backend="nccl")
    shards = _shards()
    optimizer = _Optimizer()
    exchange = _DeviceExchange(Device(torch.device("cuda", 0)), shards, {s.index: 0 for s in shards}, ranks, group,
                               optimizer.deliver, faults, optimizer.begin)
    reduce = exchange.reduce
    try:
        for micro_batch in range(3):
            reduce.begin()
            exchange.put(_Begin(micro_batch == 2))
            expected = {}

            def give(shard: Any, position: int, grad: torch.Tensor) -> None:
                expected[(shard.index, position)] = grad.float()
                reduce.gradient(shard, position, grad.cuda())

            # Autograd's thread hands the gradients over, as backward completes them.
            thread = threading.Thread(target=_hand_over, args=(shards, 0, micro_batch, give))
            thread.start()
            thread.join()
            reduce.close()
            exchange.wait(_Flush)
            optimizer.take_in()
            assert optimizer.taken.keys() == expected.keys()
            for key, tensor in expected.items():
                assert torch.equal(optimizer.taken[key], tensor), (micro_batch, key)
            optimizer.taken.clear()
        assert reduce.reduces == 3 * len(reduce.buckets) and reduce.device_nbytes > 0
    finally:
        exchange.stop()
        dist.destroy_process_group()


def test_gradients_reduced_on_the_device_reach_the_owner(tmp_path):
    """``gradient_exchange="device"`` on CUDA, on the one rank a single GPU allows (NCCL refuses two ranks on one
    device): each bucket packed on the device from gradients handed over on another thread, reduced by NCCL, copied
    to pinned host memory on the device->host stream after the reduce, and delivered with the bits of the gradients
    (16-bit, missing and non-contiguous ones, a parameter in parts; the two device buckets reused)."""
    mp.start_processes(_device_exchange_worker, args=(f"file://{tmp_path}/init",), nprocs=1, join=True,
                       start_method=START_METHOD)
