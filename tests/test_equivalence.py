"""RatelStrategy with every offload tier on trains to the numbers of plain Lightning with torch.optim.AdamW."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_ratel import RatelPrecision, RatelStrategy
from lightning_ratel.engine import coordinator
from lightning_ratel.engine.coordinator import RatelEngine
from lightning_ratel.runtime import adamw as ops
from tests.models import LM, MIXED_POLICY, HostAdamLM
from tests.models import compare_states as _compare
from tests.models import final_state, gradscaler_reference, max_rel_err, trainer


def _fit(strategy: object, model: str, **kwargs: object) -> tuple[dict, dict]:
    module = LM(model)
    t = trainer(strategy, **kwargs)
    t.fit(module)
    return final_state(module, t)


@pytest.mark.parametrize("placement", ["mixed", "planned"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("model", ["llama", "gpt2", "mlp"])
@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (3, None), (1, 0.05), (3, 0.05)])
def test_matches_plain_adamw(tmp_path, model, precision, accumulate, clip, placement):
    kwargs = dict(precision=precision, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    ref = _fit("auto", model, **kwargs)
    # "planned": the first steps run under the profiling placement, the rest under the plan made from them.
    policy = MIXED_POLICY if placement == "mixed" else None
    strategy = RatelStrategy(ssd_paths=[str(tmp_path / "a"), str(tmp_path / "b")], activation_policy=policy)
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    got = _fit(strategy, model, **kwargs)
    # bf16-mixed stores exactly the parameters autocast would cast, so it is as close as fp32.
    _compare(ref, got, 1e-5)
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []


@pytest.mark.parametrize("policy", ["keep", "host", "ssd", "recompute"])
def test_each_policy_matches(tmp_path, policy):
    ref = _fit("auto", "llama")
    got = _fit(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=policy), "llama")
    _compare(ref, got, 1e-5)


def test_engine_uses_native_kernel_when_exact(tmp_path, monkeypatch):
    """Where the native kernel reproduces torch, every update runs through it and still ends on plain numbers."""
    if not ops.native_matches_torch():
        pytest.skip("the native kernel does not reproduce torch.optim.AdamW on this machine")
    native = ops.fused_adamw_
    updated: list[int] = []

    def counting(param, *args, **kwargs):
        updated.append(param.numel())
        native(param, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("the CPU optimizer fell back to torch's AdamW")

    monkeypatch.setattr(ops, "fused_adamw_", counting)
    monkeypatch.setattr(ops, "torch_adamw_", forbidden)
    ref = _fit("auto", "llama")
    module = LM("llama")
    # A fixed placement: planning would also run the kernel in its throughput probe.
    got = _fit(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host"), "llama")
    _compare(ref, got, 1e-5)
    # Every parameter is updated once per step, alone or in a shard with others.
    steps = int(got[1]["state"][0]["step"].item())
    assert sum(updated) == steps * sum(p.numel() for p in module.parameters())


def test_engine_falls_back_to_torch_adamw(tmp_path, monkeypatch):
    """Where the native kernel is not exact, the optimizer and the planner's probe run torch's step, with the same
    keyword arguments (the worker's thread count included), and training still ends on plain numbers."""
    monkeypatch.setattr(ops, "native_matches_torch", lambda: False)
    ref = _fit("auto", "llama")
    got = _fit(RatelStrategy(ssd_paths=[str(tmp_path)]), "llama")
    _compare(ref, got, 1e-5)


def test_clip_by_value_matches(tmp_path):
    kwargs = dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")
    ref = _fit("auto", "mlp", **kwargs)
    got = _fit(RatelStrategy(ssd_paths=[str(tmp_path)]), "mlp", **kwargs)
    _compare(ref, got, 1e-5)


class _Record(L.Callback):
    def __init__(self, states: bool = True) -> None:
        self.keep_states = states
        self.states: list[tuple[dict, dict]] = []
        self.peak = 0
        self.timeline: list[tuple[str, float]] = []
        self.unit_bytes: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        if self.keep_states:
            self.states.append((engine.state.state_dict(), engine.state.optimizer_state_dict()))
        self.peak = max(self.peak, engine.pager.peak_resident_bytes)

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        self.timeline = list(engine.timeline)
        self.unit_bytes = [u.nbytes for u in engine.layout.units.values()]


def test_updates_start_while_backward_runs(tmp_path):
    # Enough blocks that backward lasts long enough for the first updates to start inside it.
    module = LM("llama8")
    record = _Record(states=False)
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=3, callbacks=[record]).fit(module)
    timeline = record.timeline
    ends = [t for name, t in timeline if name == "backward_end"]
    starts = [t for name, t in timeline if name == "backward_start"]
    updates = [t for name, t in timeline if name.startswith("update_start")]
    overlapped = 0
    for begin, end in zip(starts, ends):
        inside = [u for u in updates if begin <= u < end]
        overlapped += bool(inside)
    assert overlapped >= 2, timeline


class _Counts(L.Callback):
    """The optimizer's update counts and the timeline at the end of fit."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.timeline: list[tuple[str, float]] = []

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        engine.adam.barrier()
        self.counts = dict(engine.adam.counts)
        self.timeline = list(engine.timeline)


@pytest.mark.parametrize(("states", "accumulate", "clip", "precision"),
                         [("host", 1, None, "32-true"), ("ssd", 3, 0.05, "32-true"), ("ssd", 1, 0.05, "bf16-mixed")])
def test_updates_after_backward_on_the_cpu_match_plain_adamw(tmp_path, monkeypatch, states, accumulate, clip,
                                                             precision):
    """Left to the cost model, a run on the CPU updates after backward (the optimizer shares the compute's cores):
    no update starts while a backward runs, and the numbers are plain AdamW's."""
    monkeypatch.setattr(RatelEngine, "overlap_updates", None)
    kwargs = dict(precision=precision, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    ref = _fit("auto", "llama8", **kwargs)
    record = _Counts()
    got = _fit(RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states=states), "llama8", callbacks=[record],
               **kwargs)
    _compare(ref, got, 1e-5)
    assert record.counts.get("deferred", 0) > 0 and not record.counts.get("overlapped"), record.counts
    assert not record.counts.get("redone") and not record.counts.get("dropped"), record.counts
    starts = [t for name, t in record.timeline if name == "backward_start"]
    ends = [t for name, t in record.timeline if name == "backward_end"]
    updates = [t for name, t in record.timeline if name.startswith("update_start")]
    assert len(starts) == len(ends) > 0 and updates
    assert not [u for begin, end in zip(starts, ends) for u in updates if begin <= u < end], record.timeline


def test_updates_overlap_on_the_cpu_where_gradients_would_crowd_host_memory(tmp_path, monkeypatch):
    """Where holding every gradient until the end of backward would take too much of the host memory left, a run on
    the CPU keeps its updates overlapped (they hold a few shards' gradients), on the same numbers."""
    monkeypatch.setattr(RatelEngine, "overlap_updates", None)
    monkeypatch.setattr(coordinator, "available_host_memory", lambda: 1 << 16)
    ref = _fit("auto", "llama8")
    record = _Counts()
    got = _fit(RatelStrategy(ssd_paths=[str(tmp_path)]), "llama8", callbacks=[record])
    _compare(ref, got, 1e-5)
    assert record.counts.get("overlapped", 0) > 0 and not record.counts.get("deferred"), record.counts


def test_resident_parameters_bounded_by_prefetch_window(tmp_path):
    module = LM("llama8")
    record = _Record(states=False)
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], prefetch_depth=1), max_steps=2, callbacks=[record]).fit(module)
    total = sum(record.unit_bytes)
    largest = max(record.unit_bytes)
    # prefetch_depth + 1 blocks, not the model.
    assert record.peak <= (1 + 1) * largest
    assert record.peak < total / 3


def test_fp16_overflow_skips_the_whole_step(tmp_path):
    class Overflowing(LM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e30 if batch_idx == 2 else loss

    module = Overflowing("mlp")
    record = _Record()
    precision = RatelPrecision("16-mixed", device="cpu")
    t = L.Trainer(accelerator="cpu", strategy=RatelStrategy(ssd_paths=[str(tmp_path)]), plugins=[precision],
                  max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[record])
    t.fit(module)
    assert precision.steps_skipped == 1
    assert precision.loss_scale.item() == 2.0**15
    (p1, o1), (p2, o2) = record.states[1], record.states[2]
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    for i, entry in o1["state"].items():
        assert entry["step"].item() == o2["state"][i]["step"].item() == 2
        assert torch.equal(entry["exp_avg"], o2["state"][i]["exp_avg"])
        assert torch.equal(entry["exp_avg_sq"], o2["state"][i]["exp_avg_sq"])
    p3 = record.states[3][0]
    assert any(not torch.equal(p2[k], p3[k]) for k in p2)


def test_fp16_matches_gradscaler_loop(tmp_path):
    module = LM("mlp")
    precision = RatelPrecision("16-mixed", device="cpu")
    t = L.Trainer(accelerator="cpu", strategy=RatelStrategy(ssd_paths=[str(tmp_path)]), plugins=[precision],
                  max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    t.fit(module)

    # The same steps written by hand with torch's GradScaler, as plain fp16 AMP training does them.
    assert max_rel_err(gradscaler_reference("mlp", 3), module.state_dict()) <= 1e-5


class _HostCacheProbe(L.Callback):
    """Records, inside a forward, whether a block's weight is a view of its unit's host cache."""

    def __init__(self) -> None:
        self.in_host_cache: list[bool] = []
        self.reserved = 0
        self.engine = None

    def on_train_start(self, trainer, pl_module):
        self.engine = trainer.strategy.engine
        self.reserved = self.engine.store.nbytes_reserved
        pl_module.model.model.layers[1].mlp.up_proj.register_forward_hook(self._check)

    def _check(self, module, args, output):
        ptr = module.weight.data_ptr()
        self.in_host_cache.append(any(
            flat.data_ptr() <= ptr < flat.data_ptr() + flat.numel() * flat.element_size()
            for unit in self.engine.layout.units.values() for flat in unit.host.values()))


def test_fp32_masters_live_in_the_host_cache(tmp_path):
    """In fp32 with the host cache, the compute copies are the masters: only the moments go to the swap files, the
    CPU forward computes on the host cache itself (on a copy where device memory is separate: simulated streams), and
    training still ends on plain numbers."""
    ref = _fit("auto", "llama")
    probe = _HostCacheProbe()
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", param_cache="host",
                              optimizer_states="ssd"), callbacks=[probe])
    t.fit(module)
    _compare(ref, final_state(module, t), 1e-5)
    copies = probe.engine.device.separate_memory
    assert probe.in_host_cache and all(seen != copies for seen in probe.in_host_cache)
    assert all(s.master_in_host for s in probe.engine.layout.shards)
    params = sum(p.numel() for p in module.parameters())
    # The master and two moments in each of the two state slots (the committed step and the one being taken), plus each
    # key's alignment to 4096 bytes; the compute copies are the masters, in the host cache, never in the store.
    assert 24 * params <= probe.reserved < 24 * params + 6 * 4096 * len(probe.engine.layout.shards)


def test_mixed_precision_masters_stay_on_disk(tmp_path):
    probe = _HostCacheProbe()
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", optimizer_states="ssd"),
            precision="bf16-mixed", max_steps=1, callbacks=[probe]).fit(LM("llama"))
    half = [s for s in probe.engine.layout.shards if s.dtype == torch.bfloat16]
    # Shards computed in bf16 keep their fp32 masters on disk; those computed in fp32 (norms) keep them in the cache.
    assert half and not any(s.master_in_host for s in half)
    assert all(s.master_in_host for s in probe.engine.layout.shards if s.dtype == torch.float32)
    assert probe.reserved >= 12 * sum(s.numel for s in half)


def test_host_adamw_reference_is_plain_cpu_adamw_and_ratel(tmp_path):
    """The CUDA tests' yardstick for RatelStrategy (plain training with the optimizer's arithmetic on the CPU) is, on
    the CPU, plain Lightning's AdamW exactly, and RatelStrategy's numbers exactly."""
    host = HostAdamLM("llama")
    trainer("auto").fit(host)
    plain = LM("llama")
    trainer("auto").fit(plain)
    ratel = LM("llama")
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host")).fit(ratel)
    assert max_rel_err(plain.state_dict(), host.state_dict()) == 0.0
    assert max_rel_err(ratel.state_dict(), host.state_dict()) == 0.0
