"""The device tier of the optimizer states: states on the device, updated there after the step's decision, compute
copies resident. On this CPU-only machine the device is the CPU (the same code as on a GPU, see
``runtime/device_adam.py``); the numbers equal plain Lightning's and the host tier's bit for bit, since the update is
torch's own single-tensor AdamW, which the CPU optimizer's kernel reproduces exactly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_ratel import RatelStrategy
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.plan.states import check_device_fit, describe, device_states_budget, on_device, place_states
from lightning_ratel.precision import RatelPrecision
from lightning_ratel.runtime import device_adam
from tests.models import LM, MODELS, VOCAB, compare_states, final_state, max_rel_err, trainer


def test_forced_device_places_every_shard():
    assert place_states([10, 20], "device", 0) == ["device", "device"]
    assert "on the device (2 shards" in describe([10, 20], ["device", "device"])


def test_auto_chooses_whole_units_cheapest_first_within_the_budget():
    # Units 0 (10 + 2 + 8 bytes), 1 (5 + 1) and 2 (40 + 0): 1 then 0 fit in 30 bytes, 2 does not.
    shard_bytes, units, unit_bytes = [10, 2, 5, 40], [0, 0, 1, 2], {0: 8, 1: 1, 2: 0}
    assert on_device(shard_bytes, units, unit_bytes, 30) == [True, True, True, False]
    assert on_device(shard_bytes, units, unit_bytes, 19) == [False, False, True, False]
    assert place_states([1, 1, 1, 1], "auto", 1, [True, True, True, False]) == ["device"] * 3 + ["host"]
    # The unit the next forward needs first goes before the others where it fits (2: 40 bytes), whatever its size;
    # where it does not (0 in 19 bytes), the cheapest first as before.
    assert on_device(shard_bytes, units, unit_bytes, 46, first=2) == [False, False, True, True]
    assert on_device(shard_bytes, units, unit_bytes, 19, first=0) == [False, False, True, False]
    assert on_device(shard_bytes, units, unit_bytes, 30, first=0) == [True, True, True, False]
    # Half the device budget, less the pager's blocks in flight; nothing without a known budget.
    assert device_states_budget(1000, 100) == 400
    assert device_states_budget(100, 400) == 0
    assert device_states_budget(None, 0) == 0
    check_device_fit(100, None)
    check_device_fit(100, 100)
    with pytest.raises(RatelConfigError, match="optimizer_states='auto'"):
        check_device_fit(101, 100)


def test_forced_device_refuses_what_it_cannot_run(tmp_path: Path):
    with pytest.raises(RatelConfigError, match="keep_swap_files"):
        RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states="device", keep_swap_files=True)
    with pytest.raises(RatelConfigError, match="param_cache"):
        RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states="device", param_cache="ssd")


class _Seen:
    def __init__(self) -> None:
        self.tiers: list[str] = []
        self.resident: list[bool] = []
        self.cpu_shards = -1
        self.placement: dict[str, int] = {}

    def __call__(self, strategy: RatelStrategy) -> None:
        engine = strategy.engine
        self.tiers = [s.state_tier for s in engine.layout.shards]
        self.resident = [u.resident for u in engine.layout.units.values()]
        self.cpu_shards = len(engine.adam.cpu.shards)
        self.placement = strategy.state_placement()


@pytest.mark.parametrize("activations", ["host", "keep"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_device_tier_matches_plain_and_host(tmp_path: Path, precision: str, activations: str):
    """Accumulation and clipping by norm (which clips here): the device tier ends on plain Lightning's numbers and on
    the host tier's, bit for bit; with every activation kept, on passes that hold every unit throughout."""
    kwargs = dict(precision=precision, accumulate_grad_batches=2, gradient_clip_val=0.05, max_steps=3)
    ref = LM("llama")
    t = trainer("auto", **kwargs)
    t.fit(ref)
    host = LM("llama")
    th = trainer(RatelStrategy(ssd_paths=[str(tmp_path / "h")], activation_policy="host", optimizer_states="host"),
                 **kwargs)
    th.fit(host)
    seen = _Seen()
    lm = LM("llama")
    strategy = RatelStrategy(ssd_paths=[str(tmp_path / "d")], activation_policy=activations,
                             optimizer_states="device")
    lm.on_train_start = lambda: seen(strategy)  # type: ignore[method-assign]
    bound: list[bool] = []
    lm.on_before_backward = lambda loss: bound.append(strategy.engine.scheduler.bound)  # type: ignore[method-assign]
    got = trainer(strategy, **kwargs)
    got.fit(lm)
    assert set(seen.tiers) == {"device"} and all(seen.resident) and seen.cpu_shards == 0
    # With every activation kept, every pass held every unit.
    assert bound == [activations == "keep"] * 6
    # Both slots of every master and moment, on the device; nothing in host memory or the swap files.
    numel = sum(p.numel() for p in lm.parameters())
    assert seen.placement == {"device": 2 * 12 * numel, "host": 0, "ssd": 0}
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)
    compare_states(final_state(host, th), final_state(lm, got), 0.0)


class _ReadingLM(LM):
    """Reads every parameter between forward and backward (``on_before_backward``), and counts the passes that held
    every unit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: list[list[torch.Tensor]] = []
        self.bound: list[bool] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        strategy = self.trainer.strategy
        if isinstance(strategy, RatelStrategy):
            self.bound.append(strategy.engine.scheduler.bound)
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.read.append([p.detach().clone() for p in self.parameters()])


@pytest.mark.parametrize(("precision", "policy"), [("32-true", "keep"), ("bf16-mixed", "keep"), ("32-true", None)])
def test_a_pass_holding_every_unit_matches_plain(tmp_path: Path, precision: str, policy: str | None):
    """GPT-2 ties its head to the embedding (a parameter used by two blocks); with every state on the device and every
    activation kept (forced, or the plan's choice after the profiled passes), passes hold every unit from forward to
    backward: the hooks and callbacks between the two still read the committed values in the parameters' own dtype,
    evaluation passes run between the steps, and the run ends on plain Lightning's numbers bit for bit."""
    kwargs = dict(precision=precision, max_steps=5, limit_val_batches=2, val_check_interval=2)
    ref = _ReadingLM("gpt2")
    t = trainer("auto", **kwargs)
    t.fit(ref)
    lm = _ReadingLM("gpt2")
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=policy, optimizer_states="device")
    got = trainer(strategy, **kwargs)
    got.fit(lm)
    # Planned, the profiled passes page block by block; the plan keeps every activation on this model.
    assert lm.bound == [True] * 5 if policy == "keep" else (not lm.bound[0] and lm.bound[-1])
    assert len(lm.read) == len(ref.read) == 5
    for mine, plain in zip(lm.read, ref.read):
        for a, b in zip(mine, plain):
            assert a.dtype == b.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got.callback_metrics["val_loss"] == t.callback_metrics["val_loss"]
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)


class _TwoBackwardsLM(LM):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(retain_graph=True)
        (loss * 0.5).backward()


@pytest.mark.parametrize("activations", ["host", "keep"])
def test_two_backwards_on_one_graph_match_plain(tmp_path: Path, activations: str):
    """A ``backward`` override that runs two backward passes over one graph: the second unpacks the saved tensors
    again, the parameters among them too, which a pass holding every unit holds again for it."""
    ref = _TwoBackwardsLM("llama")
    t = trainer("auto", max_steps=3)
    t.fit(ref)
    lm = _TwoBackwardsLM("llama")
    got = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=activations, optimizer_states="device"),
                  max_steps=3)
    got.fit(lm)
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)


class _ForwardBetweenSteps(L.Callback):
    """Runs the model on each batch after its step, as a callback logging samples would, under autocast or not."""

    def __init__(self, autocast: bool) -> None:
        self.autocast = autocast
        self.sums: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            self.sums.append(pl_module.model(input_ids=batch).logits.double().sum().item())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize(("states", "activations"), [("device", "keep"), ("host", "host"), ("ssd", "host")])
def test_a_forward_between_steps_reads_the_committed_values(tmp_path: Path, states: str, activations: str,
                                                             autocast: bool):
    """A forward between steps (a callback's) under bf16-mixed computes as under plain Lightning, after passes that
    hold every unit as after watched ones: outside autocast with the committed values in the parameters' own dtype
    (the blocks leave every read to ParameterReads), under autocast with the 16-bit compute copies the blocks page in
    (what autocast makes of those values)."""
    sums = []
    for strategy in ("auto", RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=activations,
                                           optimizer_states=states)):
        probe = _ForwardBetweenSteps(autocast)
        trainer(strategy, max_steps=3, precision="bf16-mixed", callbacks=[probe]).fit(LM("llama"))
        sums.append(probe.sums)
    assert len(sums[0]) == 3 and sums[1] == sums[0]


class _RaisingLM(LM):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            self.model(input_ids=batch)
            raise RuntimeError("forward failed")
        return super().training_step(batch, batch_idx)


def test_a_pass_holding_every_unit_lets_go_of_them_when_it_raises(tmp_path: Path):
    """A forward that raises in a pass holding every unit leaves them released: the parameters hold their
    placeholders again and read the committed values, as after any failed step."""
    lm = _RaisingLM("llama")
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="keep", optimizer_states="device")
    with pytest.raises(RuntimeError, match="forward failed"):
        trainer(strategy, max_steps=6).fit(lm)
    ref = LM("llama")
    trainer("auto", max_steps=3).fit(ref)
    for (name, a), b in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_pass_that_fails_to_hold_every_unit_lets_go_of_those_it_held(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """A unit that cannot be held (here: made to raise) at the start of a pass holding every unit: the pass raises,
    and the units held before it are released (their parameters hold placeholders again)."""
    from lightning_ratel.runtime.pager import ParameterPager

    hold = ParameterPager.hold
    holds: list[int] = []

    def failing_hold(self: ParameterPager, unit: int) -> None:
        holds.append(unit)
        if len(holds) == 2 * len(self.units) + 2:
            raise OSError("cannot hold")
        hold(self, unit)

    monkeypatch.setattr(ParameterPager, "hold", failing_hold)
    lm = LM("llama")
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="keep", optimizer_states="device")
    left: list[Any] = []

    class Look(L.Callback):
        def on_exception(self, trainer: L.Trainer, module: L.LightningModule, err: BaseException) -> None:
            engine = strategy.engine
            left.append((engine.scheduler.bound, [engine.pager.holds_placeholder(p) for p in module.parameters()]))

    with pytest.raises(OSError, match="cannot hold"):
        trainer(strategy, max_steps=3, callbacks=[Look()]).fit(lm)
    # The second step's forward held one unit, then failed on the next.
    assert left == [(False, [True] * len(list(lm.parameters())))]


class _SkipLM(LM):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


def test_a_skipped_step_matches_plain(tmp_path: Path):
    """``training_step`` returning ``None`` skips that batch's step: 3 steps taken of 4 batches, plain's numbers."""
    ref = _SkipLM("llama", n_batches=4)
    t = trainer("auto", max_steps=-1, max_epochs=1)
    t.fit(ref)
    lm = _SkipLM("llama", n_batches=4)
    got = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", optimizer_states="device"),
                  max_steps=-1, max_epochs=1)
    got.fit(lm)
    state = final_state(lm, got)
    assert {float(s["step"]) for s in state[1]["state"].values()} == {3.0}
    compare_states(final_state(ref, t), state, 0.0)


def test_fp16_overflow_skips_the_step_on_the_device_tier_as_on_the_host_tier(tmp_path: Path):
    """An fp16 overflow skips the whole step (the device tier's gradients are unscaled and checked with the CPU
    optimizer's); the run ends on the host tier's numbers bit for bit."""

    class Overflowing(LM):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * 1e30 if batch_idx == 2 else loss

    outcome = {}
    for states in ("host", "device"):
        lm = Overflowing("mlp")
        precision = RatelPrecision("16-mixed", device="cpu")
        t = L.Trainer(accelerator="cpu", plugins=[precision], max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      strategy=RatelStrategy(ssd_paths=[str(tmp_path / states)], optimizer_states=states))
        t.fit(lm)
        assert precision.steps_skipped == 1
        outcome[states] = final_state(lm, t)
    compare_states(outcome["host"], outcome["device"], 0.0)


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_resume_equals_never_stopping(tmp_path: Path, checkpoint_format: str):
    """Saved at step 2 and resumed on the device tier, the run ends where the uninterrupted one does (bit for bit),
    with accumulation and clipping; the step-2 checkpoint also resumes on the host tier to the same numbers."""
    kwargs = dict(precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.05)

    def strategy(name: str, states: str = "device") -> RatelStrategy:
        return RatelStrategy(ssd_paths=[str(tmp_path / name)], activation_policy="host", optimizer_states=states,
                             checkpoint_format=checkpoint_format)

    straight = LM("llama", n_batches=4)
    t = trainer(strategy("s1"), max_steps=4, **kwargs)
    t.fit(straight)
    first = LM("llama", n_batches=4)
    saves = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    trainer(strategy("s2"), max_steps=2, enable_checkpointing=True, callbacks=[saves], **kwargs).fit(first)
    (saved,) = [p for p in (tmp_path / "ckpt").iterdir() if "step=2" in p.name]
    for states in ("device", "host"):
        resumed = LM("llama", n_batches=4)
        r = trainer(strategy(f"s3-{states}", states), max_steps=4, **kwargs)
        r.fit(resumed, ckpt_path=str(saved))
        assert r.global_step == 4
        compare_states(final_state(straight, t), final_state(resumed, r), 0.0)
    # Nothing of the device tier's states is left in the swap directories.
    assert not any((tmp_path / name).exists() and os.listdir(tmp_path / name) for name in ("s1", "s2", "s3-device"))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("limit", ["256KiB", "1MiB"])
def test_auto_puts_the_cheapest_units_on_the_device_under_its_budget(tmp_path: Path, precision: str, limit: str):
    """``"auto"`` with a device budget: whole units go to the device tier (their compute copies resident there), the
    smallest first, the rest to host memory; with clipping by norm over both tiers' gradients together (the CPU
    optimizer's speculative updates settled by it), and accumulation, the numbers are plain Lightning's bit for bit."""
    kwargs = dict(precision=precision, accumulate_grad_batches=2, gradient_clip_val=0.05, max_steps=3)
    ref = LM("llama")
    t = trainer("auto", **kwargs)
    t.fit(ref)
    shards: list[tuple[str, int, int, bool]] = []
    lm = LM("llama")
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", device_memory_limit=limit)

    def seen() -> None:
        shards.extend((s.state_tier, s.unit.index, s.numel, s.unit.resident) for s in strategy.engine.layout.shards)

    lm.on_train_start = seen  # type: ignore[method-assign]
    got = trainer(strategy, **kwargs)
    got.fit(lm)
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)
    assert {tier for tier, _, _, _ in shards} == {"device", "host"}
    # A unit is on the device whole, and resident there; the others are not.
    assert all(resident == (tier == "device") for tier, _, _, resident in shards)
    sizes: dict[tuple[str, int], int] = {}
    for tier, unit, numel, _ in shards:
        sizes[tier, unit] = sizes.get((tier, unit), 0) + numel
    # Cheapest first: no unit left in host memory is smaller than one on the device.
    assert max(n for (tier, _), n in sizes.items() if tier == "device") <= min(
        n for (tier, _), n in sizes.items() if tier == "host")


def test_auto_keeps_cpu_runs_without_a_device_budget_off_the_device_tier(tmp_path: Path):
    """On the CPU without ``device_memory_limit`` the host memory is the device's: ``"auto"`` keeps the host tier."""
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host")
    lm = LM("llama")
    tiers: list[str] = []
    lm.on_train_start = lambda: tiers.extend(s.state_tier for s in strategy.engine.layout.shards)  # type: ignore
    trainer(strategy, max_steps=1).fit(lm)
    assert tiers and set(tiers) == {"host"}


def test_forced_device_that_cannot_fit_fails_before_training(tmp_path: Path):
    lm = LM("llama")
    steps: list[int] = []
    lm.on_train_batch_start = lambda *args: steps.append(1)  # type: ignore[method-assign]
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states="device", device_memory_limit="64KiB")
    with pytest.raises(RatelConfigError, match="device_memory_limit"):
        trainer(strategy, max_steps=1).fit(lm)
    assert steps == []


class _SometimesLayer(nn.Module):
    """A residual layer whose second linear runs only when told: its parameters share a shard with the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 32)
        self.second = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor, both: bool) -> torch.Tensor:
        h = h + self.first(h)
        return h + self.second(h) if both else h


class _Sometimes(nn.Module):
    """The second linear of each layer runs on every other forward: some steps give part of a shard no gradient, and
    later its parameters' step counts differ from the others'."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(_SometimesLayer() for _ in range(2))
        self.head = nn.Linear(32, VOCAB)
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        both = self.calls % 3 == 0
        self.calls += 1
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, both)
        loss = nn.functional.cross_entropy(self.head(h).float().view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


def _sometimes_matches_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train the model whose forward skips a parameter on some steps under plain Lightning and on the device tier (the
    device tier's hooks patched by the caller, which plain Lightning never calls); the two end on the same numbers."""
    monkeypatch.setitem(MODELS, "sometimes", _Sometimes)
    ref = LM("sometimes")
    t = trainer("auto", max_steps=4)
    t.fit(ref)
    lm = LM("sometimes")
    got = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host", optimizer_states="device"),
                  max_steps=4)
    got.fit(lm)
    compare_states(final_state(ref, t), final_state(lm, got), 0.0)


def test_parameters_without_a_gradient_take_no_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A parameter the forward skipped takes no step on the device tier, as plain AdamW skips it: a shard holding
    parameters with and without a gradient (or with different step counts) steps parameter by parameter."""
    calls: list[tuple[int, int]] = []
    step = device_adam.device_adamw_

    def counting(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        calls.append((len(params), params[0].numel()))
        step(params, *args, **kwargs)

    monkeypatch.setattr(device_adam, "device_adamw_", counting)
    _sometimes_matches_plain(tmp_path, monkeypatch)
    # A layer's weights are one shard of 2 x 32 x 32: one weight alone is stepped where the two differ; shards whose
    # parameters agree are stepped together.
    assert (1, 32 * 32) in calls and max(n for n, _ in calls) > 1


def test_cpu_device_updates_read_the_committed_slot_where_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """On the CPU a device-tier update reads each state in the committed slot and writes the other one in the kernel's
    single pass: nothing copies the committed slot first and nothing writes it, shards stepped whole or parameter by
    parameter (some without a gradient) alike, and the run ends on plain Lightning's numbers."""
    step, update, foreach_copy = device_adam.device_adamw_, device_adam.DeviceAdam.update, torch._foreach_copy_
    calls, copies, updating = [], [], []

    def checking(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], *args: Any, sources: Any = None, **kwargs: Any) -> None:
        # Moments never written are zeros in the slot the step writes, and stepped there.
        apart = [(s, s.clone()) for column, targets in zip(sources, (params, exp_avgs, exp_avg_sqs))
                 for s, target in zip(column, targets) if s.data_ptr() != target.data_ptr()]
        step(params, grads, exp_avgs, exp_avg_sqs, *args, sources=sources, **kwargs)
        assert all(torch.equal(s, before) for s, before in apart)
        calls.append(all(s.data_ptr() != p.data_ptr() for s, p in zip(sources[0], params)))

    def counted_copy(*args: Any, **kwargs: Any) -> Any:
        if updating:
            copies.append(1)
        return foreach_copy(*args, **kwargs)

    def watched_update(self: device_adam.DeviceAdam, *args: Any, **kwargs: Any) -> None:
        updating.append(1)
        try:
            update(self, *args, **kwargs)
        finally:
            updating.clear()

    monkeypatch.setattr(device_adam, "device_adamw_", checking)
    monkeypatch.setattr(device_adam.DeviceAdam, "update", watched_update)
    monkeypatch.setattr(torch, "_foreach_copy_", counted_copy)
    _sometimes_matches_plain(tmp_path, monkeypatch)
    assert calls and all(calls) and not copies


@pytest.mark.parametrize("states", ["device", "auto"])
def test_a_failed_device_update_leaves_the_last_committed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              states: str):
    """An update on the device that fails halfway through a step (after some shards' updates ran, before the CPU
    optimizer's step is closed) leaves every tier at the last committed step: the module holds plain training's
    values after the steps taken, and the on-exception checkpoint resumes to plain training's end."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    from tests.test_step_commit import FAIL_AT, STEPS, FaultyLM, plain

    lm = FaultyLM()
    step = device_adam.device_adamw_
    calls = []

    def failing(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        step(params, *args, **kwargs)
        calls.append(1)
        if lm.trainer.global_step == FAIL_AT and len(calls) > 1:
            raise RuntimeError("injected fault in a device update")

    monkeypatch.setattr(device_adam, "device_adamw_", failing)
    tiers: list[str] = []
    strategy = RatelStrategy(ssd_paths=[str(tmp_path / "swap")], optimizer_states=states,
                             device_memory_limit="512KiB" if states == "auto" else None)
    lm.on_train_start = lambda: tiers.extend(s.state_tier for s in strategy.engine.layout.shards)  # type: ignore
    stale: list[int] = []

    class ComputeCopies(L.Callback):
        # The steps that ran before the fault wrote their compute copies: the abort gives them the committed masters.
        def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
            tier = strategy.engine.adam.device
            for shard in tier.shards:
                committed = tier._state(shard, "master", tier.ledger.committed(shard).slot)
                if not torch.equal(shard.compute_view(shard.unit.host[shard.dtype]), committed.to(shard.dtype)):
                    stale.append(shard.index)

    t = trainer(strategy, max_steps=STEPS, enable_checkpointing=True,
                callbacks=[ComputeCopies(), OnExceptionCheckpoint(str(tmp_path / "ckpt"))])
    with pytest.raises(RuntimeError, match="injected fault"):
        t.fit(lm)
    assert not stale
    assert t.global_step == FAIL_AT
    assert set(tiers) == ({"device"} if states == "device" else {"device", "host"})
    assert max_rel_err(plain(FAIL_AT)[0], lm.state_dict()) <= 1e-5
    monkeypatch.setattr(device_adam, "device_adamw_", step)
    resumed = FaultyLM()
    r = trainer(RatelStrategy(ssd_paths=[str(tmp_path / "resumed")], optimizer_states=states), max_steps=STEPS)
    r.fit(resumed, ckpt_path=str(tmp_path / "ckpt" / "on_exception.ckpt"))
    assert max_rel_err(plain(STEPS)[0], final_state(resumed, r)[0]) <= 1e-5


def test_no_optimizer_trains_without_updates_as_plain_lightning(tmp_path: Path):
    """``configure_optimizers`` returning ``None`` (Lightning runs its placeholder optimizer, which holds no parameter)
    has nothing for the device tier to update: the run trains as plain Lightning's does, leaving the weights alone,
    instead of refusing the placeholder as an optimizer that is not AdamW."""

    class NoOptimizer(LM):
        def configure_optimizers(self) -> None:
            return None

    lm = NoOptimizer()
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states="device"), max_steps=2)
    with pytest.warns(UserWarning, match="no optimizer"):
        t.fit(lm)
    assert t.global_step == 2
    after = lm.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
