"""Op-level activation placement, partial recomputation, profiling and plan="auto" through RatelStrategy."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_ratel import Plan, RatelConfigError, RatelPlanError, RatelProfiler, RatelStrategy
from lightning_ratel.engine.blocks import discover_blocks
from lightning_ratel.engine.coordinator import RatelEngine
from lightning_ratel.engine.placement import plan_placements
from lightning_ratel.engine.planner import (
    node_profiles,
    plan_budgets,
    plan_settings,
    read_ahead_traffic,
    settled,
    state_traffic,
    step_traffic,
    update_rate,
)
from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.plan import LayerProfile, OpProfile
from lightning_ratel.plan.cost import OPTIMIZER_MEMORY_BYTES_PER_PARAM, CostModel, CostSettings, recompute_ops
from lightning_ratel.runtime import recompute
from lightning_ratel.sizes import parse_bytes
from tests.models import LM, final_state, max_rel_err, trainer


def _plain(model: str = "llama", **kwargs: object) -> tuple[dict, dict]:
    module = LM(model)
    t = trainer("auto", **kwargs)
    t.fit(module)
    return final_state(module, t)


def _close(ref: tuple[dict, dict], got: tuple[dict, dict], tol: float = 1e-5) -> None:
    assert max_rel_err(ref[0], got[0]) <= tol
    for i, entry in ref[1]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            scale = entry[key].abs().max().clamp(min=1e-20)
            assert ((entry[key] - got[1]["state"][i][key]).abs().max() / scale).item() <= tol


def _profiler(t: L.Trainer) -> RatelProfiler:
    profiler = t.strategy.profiler
    assert isinstance(profiler, RatelProfiler)
    return profiler


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """One plan="auto" fit of the tiny Llama, with a logger so the report is written."""
    root = tmp_path_factory.mktemp("auto")
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(root)]), logger=CSVLogger(str(root / "logs")))
    t.fit(module)
    return t, final_state(module, t)


def test_auto_plan_matches_plain_training(auto_run):
    t, got = auto_run
    _close(_plain(), got)
    plan = _profiler(t).plan
    assert plan is not None and plan.layers
    # Every block's ops were named at op level (the Llama layers have their projections and norms).
    names = {key.split("/", 1)[1] for key in plan.activation_placement if "layers.0/" in key}
    for op in ("self_attn.q_proj:mm", "self_attn.k_proj:mm", "self_attn.v_proj:mm", "self_attn.o_proj:mm",
               "mlp.gate_proj:mm", "mlp.up_proj:mm", "mlp.act_fn:silu", "mlp.down_proj:mm", "input"):
        assert op in names, op
    assert any(n.startswith("input_layernorm:") for n in names)
    assert any("scaled_dot_product" in n for n in names)


def test_profiling_measures_the_work_around_the_blocks_and_the_whole_update(auto_run):
    """On the CPU the updates run after backward: the profiled steps wait for them, so the planner measures them
    whole, and the cost model charges them to the next forward."""
    t, _ = auto_run
    plan = _profiler(t).plan
    assert plan is not None and plan.settings is not None
    assert plan.settings.updates_after_backward
    assert plan.settings.update_params_per_s > 0
    # The loss, the rotary embedding and the causal mask run outside every block.
    assert plan.settings.forward_overhead > 0
    assert "cpu_optimizer" in plan.resource_times["forward"] and "cpu_optimizer" not in plan.resource_times["backward"]


def test_updates_overlapping_backward_are_not_measured_as_if_alone(tmp_path, monkeypatch):
    """Where the updates overlap backward (a GPU's path, taken here on the CPU) the profiled steps do not wait for
    them: their rate is not measured, and the cost model charges them to backward at the kernel's probed rate."""
    monkeypatch.setattr(RatelEngine, "overlap_updates", True)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=3)
    t.fit(LM("llama"))
    plan = _profiler(t).plan
    assert plan is not None and plan.settings is not None
    assert not plan.settings.updates_after_backward
    assert plan.settings.update_params_per_s == 0
    assert "cpu_optimizer" in plan.resource_times["backward"]


@pytest.mark.parametrize("states", ["host", "device"])
def test_a_profiled_pass_reuses_the_host_buffers_of_the_pass_before(tmp_path, simulated_streams, states):
    """The profile keeps what each pass measured, not its records: a record holds the pass's block inputs, which
    profiling keeps in host memory, and keeping those until planning made every later pass take (on a GPU, allocate
    and page-lock, several milliseconds per block) new buffers inside its measured forward. With the states on the
    device nothing else of a step goes through host memory, so nothing else could have given those buffers back."""
    grown: list[int] = []

    class PoolBytes(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
            self.before = trainer.strategy.engine.device.pool.nbytes

        def on_before_backward(self, trainer: L.Trainer, *args: object) -> None:
            grown.append(trainer.strategy.engine.device.pool.nbytes - self.before)

    profiler = RatelProfiler(report=False, profile_steps=3)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], optimizer_states=states), max_steps=4,
                callbacks=[profiler, PoolBytes()])
    t.fit(LM("llama"))
    assert grown[0] > 0
    # The second pass's loss check takes one page for its flag while the first one's is still held.
    assert grown[1] <= 4096 and grown[2] == 0


def test_waits_for_parameters_are_not_work_between_the_blocks():
    """The cost model charges page-ins to the link and the disks: the profile's forward outside the blocks leaves out
    what it waited for them, and only in forward."""
    from lightning_ratel.engine.schedule import BlockTimer
    from lightning_ratel.runtime.device import Device

    timer = BlockTimer(Device(torch.device("cpu")))
    timer.step_start()
    timer.paged_in(0.5)
    timer.paged_in(0.25)
    timer.backward_started()
    timer.paged_in(1.0)
    assert timer.forward_waits == 0.75
    timer.step_start()
    assert timer.forward_waits == 0.0


@pytest.mark.parametrize(("samples", "expected"), [([], 0.0), ([7.0], 7.0), ([100.0, 1.0], 1.0),
                                                    ([100.0, 1.0, 3.0], 1.0), ([0.5, 4.0, 10.0, 2.0], 2.0)])
def test_a_profiled_quantity_settles_to_the_least_after_the_first_pass(samples, expected):
    assert settled(samples) == expected


def test_the_update_rate_is_the_fastest_profiled_update_after_the_first():
    """A step another process slowed tenfold does not set the rate; nor does the first, which pays one-off costs."""
    assert update_rate([(1.0, 100), (0.5, 100), (5.0, 100)]) == pytest.approx(200.0)
    assert update_rate([(0.1, 100), (2.0, 200), (0.5, 50)]) == pytest.approx(100.0)
    assert update_rate([(0.5, 100)]) == pytest.approx(200.0)
    assert update_rate([]) == 0.0
    assert update_rate([(1.0, 100), (0.0, 100)]) == pytest.approx(100.0)


class _RngAtFirstBatch(L.Callback):
    def __init__(self) -> None:
        self.state: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.state is None:
            self.state = torch.get_rng_state()


def test_hardware_probe_leaves_the_global_rng_alone(tmp_path):
    """The probe at the start of training must not draw from torch's global generator, which also shuffles the
    user's data and draws dropout masks."""
    seen = []
    for strategy in ("auto", RatelStrategy(ssd_paths=[str(tmp_path)])):
        record = _RngAtFirstBatch()
        torch.manual_seed(123)
        trainer(strategy, max_steps=1, callbacks=[record]).fit(LM("llama"))
        seen.append(record.state)
    assert torch.equal(seen[0], seen[1])


def test_blocks_planned_all_on_device_are_not_tracked():
    """A block whose every op stays on the device runs its forward without op tracking; a block with one op
    elsewhere keeps its op-level placement."""
    blocks = discover_blocks(LM("llama"))
    name = next(b.name for b in blocks if b.name.endswith("layers.0"))
    all_device = {f"{name}/input": "device", f"{name}/mlp.act_fn:silu": "device"}
    placements = plan_placements(blocks, all_device)
    assert all(p == "device" for p in placements)
    one_off = {**all_device, f"{name}/mlp.act_fn:silu": "recompute"}
    placed = plan_placements(blocks, one_off)
    assert [p for p in placed if isinstance(p, dict)] == [{"input": "device", "mlp.act_fn:silu": "recompute"}]


def test_auto_plan_writes_report_and_plan(auto_run):
    t, _ = auto_run
    files = os.listdir(t.log_dir)
    assert {"ratel_report.png", "ratel_plan.json", "ratel_steps.json"} <= set(files)
    with open(os.path.join(t.log_dir, "ratel_report.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    steps = json.load(open(os.path.join(t.log_dir, "ratel_steps.json")))
    assert len(steps) == 4 and all(s["wall"] > 0 and s["compute"] > 0 for s in steps)
    assert Plan.load(os.path.join(t.log_dir, "ratel_plan.json")).activation_placement == _profiler(t).plan.activation_placement


def _mixed(plan: Plan) -> Plan:
    """Every tier inside every block: ops take device, host, ssd and recompute in turn."""
    tiers = itertools.cycle(["recompute", "host", "ssd", "device"])
    placement = {}
    for key in plan.activation_placement:
        op = key.rsplit("/", 1)[1]
        placement[key] = "host" if op in ("input", "*") else next(tiers)
    return dataclasses.replace(plan, activation_placement=placement)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("model", ["llama", "gpt2", "mlp"])
def test_mixed_op_level_plan_from_file_matches(tmp_path, auto_run, model, precision):
    if model == "llama":
        plan = _profiler(auto_run[0]).plan
    else:
        t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=2)
        t.fit(LM(model))
        plan = _profiler(t).plan
    path = tmp_path / "plan.json"
    _mixed(plan).save(path)
    module = LM(model)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], plan=str(path)), precision=precision)
    t.fit(module)
    _close(_plain(model, precision=precision), final_state(module, t))
    # A pinned plan is used as it is: nothing is profiled.
    assert _profiler(t).plan is None


def test_partial_recompute_runs_only_what_was_discarded(tmp_path, auto_run, replays):
    plan = _profiler(auto_run[0]).plan
    placement = {k: ("recompute" if k.endswith("mlp.act_fn:silu") else "host") for k in plan.activation_placement}
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], plan=dataclasses.replace(plan, activation_placement=placement)))
    t.fit(module)
    _close(_plain(), final_state(module, t))
    # One replay per layer per step, each running only the SiLU (its input, the gate projection, was stored).
    runs = [(len(record.executed), len(record.ops)) for record in replays]
    assert len(runs) == 3 * 4
    assert all(executed == 1 and total > 40 for executed, total in runs)


_VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "expand", "slice", "reshape", "permute", "select"}


@pytest.mark.parametrize("kept, recomputed", [("device", ("input_layernorm:mul#1", "self_attn:add")),
                                               ("host", ("self_attn.o_proj", "mlp:mul"))])
def test_a_replay_runs_the_ops_the_cost_model_charges(tmp_path, auto_run, replays, kept, recomputed):
    """The ops a replay executes are those :func:`recompute_ops` charges for the placement: what the plan keeps, on
    the device as much as in host memory, is handed back, never recomputed. The model may charge a view more (the
    profile counts saved bytes at the op that made the memory, the replay hands back the view it saved)."""
    plan = _profiler(auto_run[0]).plan
    placement = {key: "recompute" if key.rsplit("/", 1)[1].startswith(recomputed) else kept
                 for key in plan.activation_placement}
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], plan=dataclasses.replace(plan, activation_placement=placement)))
    t.fit(module)
    _close(_plain(), final_state(module, t))
    executed = {record.name: record.executed for record in replays}
    charged = {layer.name: recompute_ops(layer, placement) for layer in plan.layers}
    assert sum(len(ops) for ops in charged.values()) > 0
    assert executed.keys() == {name for name, ops in charged.items() if ops}
    for name, ops in executed.items():
        assert ops <= charged[name]
        assert all(op.rsplit(":", 1)[1].split("#")[0] in _VIEWS for op in charged[name] - ops)


def test_replay_keeps_the_strides_of_stored_outputs(tmp_path, auto_run):
    # The rotary outputs (strided like the transposed projections) go to disk and come back contiguous; attention
    # and what follows are recomputed from them. The replay must restore the forward's strides, or attention's
    # output layout changes and `.contiguous()` in the model takes another path.
    plan = _profiler(auto_run[0]).plan
    placement = {}
    for key in plan.activation_placement:
        op = key.rsplit("/", 1)[1]
        if op.startswith(("self_attn:add", "self_attn:mul")):
            placement[key] = "ssd"
        elif op.startswith("self_attn") and not op.startswith(("self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj")):
            placement[key] = "recompute"
        else:
            placement[key] = "host"
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], plan=dataclasses.replace(plan, activation_placement=placement)))
    t.fit(module)
    _close(_plain(), final_state(module, t))


def test_whole_block_recompute_replays_from_the_inputs(tmp_path, monkeypatch):
    runs: list[int] = []
    original = recompute.ForwardRecord.replay

    def counting(self, unpack, restore):
        fresh = self.outputs is None
        original(self, unpack, restore)
        if fresh:
            runs.append(len(self.needed()[0]))

    monkeypatch.setattr(recompute.ForwardRecord, "replay", counting)
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy={"*layers.*": "recompute", "*": "host"}))
    t.fit(module)
    _close(_plain(), final_state(module, t))
    assert len(runs) == 3 * 4 and min(runs) > 20


class _TightHost(L.Callback):
    """Caps host memory at ``headroom`` bytes beyond what the engine itself holds (measured once it exists)."""

    def __init__(self, headroom: int) -> None:
        self.headroom = headroom

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Runs before the strategy's own profiler, which plans at the end of its last profiled batch.
        engine = trainer.strategy.engine
        engine.config.host_memory_limit = engine.byte_placement()["host"] + self.headroom


def test_small_host_limit_spills_to_ssd_and_still_matches(tmp_path, auto_run):
    # Room for the paging buffers and working set, and for only half the activations the unconstrained plan keeps.
    unconstrained = _profiler(auto_run[0]).plan
    saved = sum(layer.saved_bytes for layer in unconstrained.layers)
    headroom = unconstrained.memory["host"] - unconstrained.budgets["host_static"] - saved // 2
    module = LM("llama")
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), callbacks=[_TightHost(headroom)])
    t.fit(module)
    plan = _profiler(t).plan
    assert plan.memory["host"] <= plan.budgets["host"]
    tiers = set(plan.activation_placement.values())
    # Whatever does not fit in RAM is spilled to disk or recomputed, as the cost model prefers on this machine.
    assert tiers & {"ssd", "recompute"}
    _close(_plain(), final_state(module, t))


def test_plan_that_cannot_fit_says_which_budget(tmp_path):
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), callbacks=[_TightHost(-(1 << 20))])
    with pytest.raises(RatelPlanError, match="host"):
        t.fit(LM("llama"))
    assert os.listdir(tmp_path) == []


def test_resume_keeps_the_plan_without_profiling(tmp_path, monkeypatch):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), enable_checkpointing=True, callbacks=[ckpt], max_steps=3)
    t.fit(LM("llama"))
    first = _profiler(t).plan
    calls = []
    from lightning_ratel.engine.planner import Planner

    original = Planner.measure_hardware
    monkeypatch.setattr(Planner, "measure_hardware", lambda self, **kw: calls.append(1) or original(self, **kw))
    t2 = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt2"))], max_steps=5)
    t2.fit(LM("llama"), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert calls == []
    assert _profiler(t2).plan.activation_placement == first.activation_placement
    # Asked to, it measures again.
    t3 = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), callbacks=[RatelProfiler(reprofile=True)], max_steps=5)
    t3.fit(LM("llama"), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert calls == [1]


def test_chrome_trace_on_request(tmp_path):
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]),
                callbacks=[RatelProfiler(trace_step=3, output_dir=str(tmp_path / "out"))])
    t.fit(LM("llama"))
    trace = json.load(open(tmp_path / "out" / "ratel_trace_step3.json"))
    assert trace["traceEvents"]


def test_a_traced_profiled_step_does_not_charge_the_traces_export_to_backward(tmp_path, monkeypatch):
    """The trace of the second profiled step (the one whose times the plan keeps) is written at that batch's end;
    writing it (half a second here) is not work of the step, and the backward the plan measured outside its blocks
    holds none of it."""
    export = torch.profiler.profile.export_chrome_trace

    def slow_export(self, path):
        time.sleep(0.5)
        return export(self, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow_export)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]),
                callbacks=[RatelProfiler(trace_step=1, output_dir=str(tmp_path / "out"))])
    t.fit(LM("llama"))
    assert (tmp_path / "out" / "ratel_trace_step1.json").is_file()
    settings = _profiler(t).plan.settings
    assert settings is not None and settings.backward_overhead < 0.25, settings


class _SlowBatchEdges(L.Callback):
    """A user's callback that spends ``seconds`` at every batch start and end (logging, a checkpoint every step)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, *args) -> None:
        time.sleep(self.seconds)

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)


def test_the_profiled_steps_leave_out_other_callbacks_work_whatever_their_order(tmp_path):
    """The forward and backward a profiled micro-batch measures outside its blocks run from its training_step to the
    end of its backward and step: callbacks before and after the profiler, busy for 0.3 s at each batch's start and
    end, add nothing to them (before, the ones after the profiler's batch start counted in forward, the ones before
    its batch end in backward)."""
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]),
                callbacks=[_SlowBatchEdges(0.3), RatelProfiler(), _SlowBatchEdges(0.3)])
    t.fit(LM("llama"))
    settings = _profiler(t).plan.settings
    assert settings is not None
    assert settings.forward_overhead < 0.2 and settings.backward_overhead < 0.2, settings


def test_activation_policy_turns_planning_off(tmp_path):
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy="host"))
    t.fit(LM("llama"))
    assert _profiler(t).plan is None
    assert not t.strategy.plans_automatically


@pytest.mark.parametrize(("value", "expected"), [("24GiB", 24 << 30), ("1.5 GB", 1_500_000_000), (4096, 4096),
                                                 ("512MiB", 512 << 20), (None, None)])
def test_parse_bytes(value, expected):
    assert parse_bytes(value, "x") == expected


@pytest.mark.parametrize("value", ["lots", "-1GiB", 0, "3 parsecs"])
def test_parse_bytes_rejects(value):
    with pytest.raises(RatelConfigError):
        parse_bytes(value, "x")


def test_missing_plan_file_is_a_config_error(tmp_path):
    with pytest.raises(RatelConfigError, match="plan"):
        RatelStrategy(ssd_paths=[str(tmp_path)], plan=str(tmp_path / "nope.json"))


def test_device_memory_limit_needs_no_gpu_to_parse(tmp_path):
    strategy = RatelStrategy(ssd_paths=[str(tmp_path)], device_memory_limit="24GiB", host_memory_limit="2GiB")
    assert strategy.device_memory_limit == 24 << 30 and strategy.host_memory_limit == 2 << 30
    assert torch.device("cpu") == strategy.root_device


def test_hardware_speeds_are_kept_per_machine_and_filesystem(tmp_path, monkeypatch):
    from lightning_ratel.runtime import probe
    from lightning_ratel.runtime.adamw import adamw_step
    from lightning_ratel.runtime.device import Device

    monkeypatch.setattr(probe, "_measured", {})
    monkeypatch.setenv(probe.CACHE_ENV, str(tmp_path / "hardware.json"))
    probes = []
    original = probe.disk_bandwidth

    def counted(*args, **kwargs):
        # A measurement on the CPU probes the drives twice: from aligned memory, then as its activations are written.
        if not kwargs.get("unaligned"):
            probes.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(probe, "disk_bandwidth", counted)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    device = Device(torch.device("cpu"))

    def measure(path, **kwargs):
        return probe.measure_hardware(device, [str(path)], adamw_step(), probe_bytes=1 << 20, threads=1, **kwargs)

    measured = measure(first)
    assert 0 < measured.activation_write_bandwidth
    # Another swap directory on the same filesystem: the speeds are kept, the free capacities read again.
    again = measure(second)
    assert probes == [1]
    assert again.ssd_read_bandwidth == measured.ssd_read_bandwidth
    assert again.adam_params_per_s == measured.adam_params_per_s
    # The next process finds them in the cache file.
    monkeypatch.setattr(probe, "_measured", {})
    measure(second)
    assert probes == [1]
    measure(second, fresh=True)
    assert probes == [1, 1]
    # A run whose stores move their chunks otherwise is probed the way it moves them.
    options = {"stripe_bytes": 4 << 20, "io_threads_per_path": 1}
    measure(second, store_options=options)
    measure(second, store_options=options)
    assert probes == [1, 1, 1]


def test_speeds_measured_while_other_work_holds_the_cores_are_not_kept_for_the_next_run(tmp_path, monkeypatch):
    """An AdamW probe whose thread got a tenth of the time it could have had measured a busy machine: its speeds serve
    this run only (with a warning) and are not written to the cache other processes read."""
    from lightning_ratel.runtime import probe
    from lightning_ratel.runtime.adamw import adamw_step
    from lightning_ratel.runtime.device import Device

    monkeypatch.setattr(probe, "_measured", {})
    cache = tmp_path / "hardware.json"
    monkeypatch.setenv(probe.CACHE_ENV, str(cache))
    device = Device(torch.device("cpu"))
    step = adamw_step()

    def starved(*args, **kwargs):
        # Another process holds the core: the step's thread runs a tenth of the wall time it takes.
        start = time.perf_counter()
        step(*args, **kwargs)
        time.sleep(9 * (time.perf_counter() - start))

    with pytest.warns(UserWarning, match="other work held the CPU"):
        busy = probe.measure_hardware(device, [str(tmp_path)], starved, probe_bytes=1 << 20, threads=1)
    assert busy.adam_params_per_s > 0
    assert not cache.exists()
    # Within the process they are kept for this run's later plans.
    assert probe.measure_hardware(device, [str(tmp_path)], starved, probe_bytes=1 << 20,
                                  threads=1).adam_params_per_s == busy.adam_params_per_s
    # A probe that had its core measured the machine: kept for the next process.
    monkeypatch.setattr(probe, "_measured", {})
    probe.measure_hardware(device, [str(tmp_path)], step, probe_bytes=1 << 20, threads=1)
    assert cache.exists()


def test_a_probe_counts_the_median_of_its_calls_after_an_untimed_one(monkeypatch):
    from lightning_ratel.runtime import probe

    # Each call of the probed function takes the next of these seconds on a clock of the test's own.
    durations = iter([9.0, 1.0, 2.0, 50.0, 3.0, 4.0])
    clock = [0.0]

    def run() -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    # The first call (9 s) is dropped; of the other five the median counts, not the lucky or the unlucky one.
    assert probe.median_time(run, 5) == 3.0


def _shard(numel: int, state_tier: str = "ssd", master_in_host: bool = False,
           dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    return SimpleNamespace(numel=numel, dtype=dtype, state_tier=state_tier, master_in_host=master_in_host)


def _node(host_free: int = 10 << 30, device_free: int = 8 << 30, ssd_free: int = 100 << 30,
          ssd: float = 1e9) -> HardwareProfile:
    return HardwareProfile(device_type="cuda", h2d_bandwidth=2e10, d2h_bandwidth=2e10, ssd_read_bandwidth=ssd,
                           ssd_write_bandwidth=ssd, adam_params_per_s=1e9, host_memory_free=host_free,
                           device_memory_free=device_free, ssd_free=ssd_free)


def test_state_traffic_counts_the_shards_given():
    shards = [_shard(100), _shard(50, "host"), _shard(30, master_in_host=True), _shard(20, dtype=torch.bfloat16)]
    # On disk: 150 elements; their moments (8 B) both ways, masters written (4 B) and read where not in the host cache.
    assert state_traffic(shards, "host") == {"read": 150 * 8 + 120 * 4, "written": 150 * 12}  # type: ignore[arg-type]
    # Compute copies read from the swap files are written there anew: the 16-bit shard's 2 B per element.
    assert state_traffic(shards, "ssd")["written"] == 150 * 12 + 20 * 2  # type: ignore[arg-type]


def test_step_traffic_adds_the_page_ins_an_update_does_not_share():
    """With the compute copies in the swap files a step also reads each for forward and again for backward, except
    an fp32 master there: its update reads and writes it anyway, and one page-in shares those bytes (the backward's
    the update's read, or after a deferred update the next forward's the master it wrote)."""
    trainable = [_shard(100), _shard(50, "host"), _shard(20, dtype=torch.bfloat16)]
    for shard in trainable:
        shard.group = 0
    frozen = SimpleNamespace(numel=10, dtype=torch.float32, state_tier="ssd", master_in_host=False, group=-1)
    states = state_traffic(trainable, "ssd")  # type: ignore[arg-type]
    # One pass: the masters on disk (100 x 4 B), the 16-bit copy (20 x 2 B), the frozen shard (10 x 4 B); the other
    # the same but the master its update shares. The master in host memory is paged in from there.
    pages = (100 * 4 + 20 * 2 + 10 * 4) + (20 * 2 + 10 * 4)
    assert step_traffic(trainable, [frozen], "ssd") == {  # type: ignore[arg-type]
        "read": states["read"] + pages, "written": states["written"]}
    assert step_traffic(trainable, [frozen], "host") == state_traffic(trainable, "host")  # type: ignore[arg-type]
    # Buffer sets reading states ahead during forward (the last shards on disk first): the forward's page-in of an fp32
    # master a set holds shares the set's read; the bf16 shard's compute copy is not its master, so one set saves none.
    assert step_traffic(trainable, [frozen], "ssd", 1) == step_traffic(trainable, [frozen], "ssd")  # type: ignore
    assert step_traffic(trainable, [frozen], "ssd", 2) == {  # type: ignore[arg-type]
        "read": states["read"] + pages - 100 * 4, "written": states["written"]}
    # Updates after backward run in forward order: one set reads the first shard on disk ahead, the fp32 one.
    assert step_traffic(trainable, [frozen], "ssd", 1, after_backward=True) == {  # type: ignore[arg-type]
        "read": states["read"] + pages - 100 * 4, "written": states["written"]}
    # The cost model counts both page-ins already: its state reads leave the shared master out.
    settings = plan_settings(trainable, trainable, "ssd", 1, prefetch_depth=1,  # type: ignore[arg-type]
                             host_static_bytes=0, device_overhead=None)
    assert settings.state_read_bytes_per_param == round((states["read"] - 100 * 4) / 170)


def test_settings_leave_the_device_tiers_updates_out_of_host_memory():
    """Of 1000 parameters 250 have their states on the device: they are updated there (a quarter of the updates) and
    touch no host memory, so the 28 B of an AdamW update count for 750 of the 1000."""
    shards = [_shard(250, "device"), _shard(500, "host"), _shard(250)]
    settings = plan_settings(shards, shards, "host", 1, prefetch_depth=1, host_static_bytes=0,  # type: ignore[arg-type]
                             device_overhead=None)
    assert settings.device_update_share == 0.25
    assert settings.optimizer_memory_bytes_per_param == round(OPTIMIZER_MEMORY_BYTES_PER_PARAM * 0.75)
    on_device = plan_settings(shards[:1], shards[:1], "host", 1, prefetch_depth=1,  # type: ignore[arg-type]
                              host_static_bytes=0, device_overhead=None)
    assert (on_device.device_update_share, on_device.optimizer_memory_bytes_per_param) == (1.0, 0)
    # The blocks named as updated on the device: those whose every shard is on the device tier.
    units = [0, 1, 1]
    for shard, unit in zip(shards, units):
        shard.unit = SimpleNamespace(index=unit)
    shards.append(SimpleNamespace(numel=10, dtype=torch.float32, state_tier="device", master_in_host=False,
                                  unit=SimpleNamespace(index=2)))
    named = plan_settings(shards, shards, "host", 1, prefetch_depth=1, host_static_bytes=0,  # type: ignore[arg-type]
                          device_overhead=None, block_names={0: "embed", 1: "layers.0", 2: "norm"})
    assert named.device_updated == ("embed", "norm")
    assert CostSettings.from_dict(dataclasses.asdict(named)) == named


def test_settings_count_the_states_read_ahead_during_forward():
    """Three sets read ahead the states of the last three shards in forward order that are in the swap files (12 B
    a parameter each; the one in host memory is read from there): 12 * (50 + 40 + 20) B of 1000 parameters."""
    shards = [_shard(300), _shard(20), _shard(200, "host"), _shard(40), _shard(50), _shard(390, "host")]
    settings = plan_settings(shards, shards, "host", 1, prefetch_depth=1, host_static_bytes=0,  # type: ignore[arg-type]
                             device_overhead=None, read_ahead_sets=3)
    assert read_ahead_traffic(shards, 3) == 12 * 110  # type: ignore[arg-type]
    assert settings.state_read_ahead_bytes_per_param == pytest.approx(12 * 110 / 1000)
    # As many sets as shards on disk read them all; none, nothing.
    assert read_ahead_traffic(shards, 10) == 12 * 410  # type: ignore[arg-type]
    assert plan_settings(shards, shards, "host", 1, prefetch_depth=1, host_static_bytes=0,  # type: ignore[arg-type]
                         device_overhead=None).state_read_ahead_bytes_per_param == 0


def test_settings_count_this_ranks_states_per_parameter_it_owns():
    """Of 1000 trainable parameters, rank 0 of 2 owns 500 (300 on disk, 200 in host memory); rank 1's are left marked
    as on disk in rank 0's layout and are none of its traffic. The cost model, counting per owned parameter (half the
    model's), moves exactly rank 0's bytes at half the node's SSD rate."""
    owned = [_shard(300), _shard(200, "host")]
    shards = owned + [_shard(500)]
    settings = plan_settings(shards, owned, "host", 2, prefetch_depth=1, host_static_bytes=0,  # type: ignore[arg-type]
                             device_overhead=None)
    assert settings.ranks_on_node == 2
    assert (settings.state_read_bytes_per_param, settings.state_write_bytes_per_param) == (7, 7)  # 3600 B / 500
    # AdamW steps from one slot into the other in its single pass; the generic path first copies the host-tier
    # states' committed slot: 24 B for 200 of 500 owned parameters.
    assert settings.optimizer_memory_bytes_per_param == OPTIMIZER_MEMORY_BYTES_PER_PARAM
    copying = plan_settings(shards, owned, "host", 2, prefetch_depth=1, host_static_bytes=0,  # type: ignore[arg-type]
                            device_overhead=None, slot_copy=True)
    assert copying.optimizer_memory_bytes_per_param == OPTIMIZER_MEMORY_BYTES_PER_PARAM + 10
    layer = LayerProfile("blk", 0, 1.0, 2.0, 4000, 2000, 1000, [OpProfile("input", 0.0, 0.0, 0)])
    model = CostModel(_node(ssd=100.0), [layer], settings)
    assert model._state_read == model._state_write == 3500  # 3600 B, rounded to whole bytes per parameter
    assert model._state_ssd == pytest.approx(2 * 3500 / 50)
    # One rank owns everything: the settings of before.
    alone = plan_settings(shards, shards, "host", 1, prefetch_depth=1, host_static_bytes=0,  # type: ignore[arg-type]
                          device_overhead=None)
    assert (alone.ranks_on_node, alone.state_read_bytes_per_param) == (1, 10)  # 800 on disk x 12 B / 1000


def test_budgets_share_the_nodes_free_memory_and_disk():
    node = _node(host_free=10_000, device_free=8_000, ssd_free=100_000)
    assert plan_budgets(node, 500, 1, None, None) == (8_000, 500 + 9_000, 95_000)
    assert plan_budgets(node, 500, 2, None, None) == (8_000, 500 + 4_500, 47_500)
    # A limit the user gave is this rank's already; a device is each rank's own.
    assert plan_budgets(node, 500, 2, 3_000, 6_000) == (6_000, 3_000, 47_500)
    # Another rank has less room beyond what it holds: the plan every rank applies keeps within that.
    assert plan_budgets(node, 500, 2, 3_000, 6_000, host_room=1_000) == (6_000, 1_500, 47_500)
    assert plan_budgets(node, 500, 2, 3_000, 6_000, host_room=9_000) == (6_000, 3_000, 47_500)
    # On the CPU the device is the host.
    cpu = dataclasses.replace(node, device_type="cpu")
    assert plan_budgets(cpu, 500, 4, None, None) == (500 + 2_250, 500 + 2_250, 23_750)


def test_node_profiles_keep_each_nodes_speeds_with_the_least_free_capacities():
    node0 = _node(host_free=10 << 30, device_free=8 << 30, ssd_free=50 << 30, ssd=1e9)
    node1 = _node(host_free=6 << 30, device_free=9 << 30, ssd_free=80 << 30, ssd=3e9)
    got = node_profiles([node0, 7 << 30, node1, 9 << 30], local_world=2)
    assert [node.ssd_read_bandwidth for node in got] == [1e9, 3e9]
    for node in got:
        assert (node.host_memory_free, node.device_memory_free, node.ssd_free) == (6 << 30, 7 << 30, 50 << 30)
    # One rank per node: every entry is a node's profile.
    assert [node.ssd_read_bandwidth for node in node_profiles([node1, node0], local_world=1)] == [3e9, 1e9]
    with pytest.raises(RuntimeError, match="rank 2 sent no hardware profile"):
        node_profiles([node0, 1, 1, 1], local_world=2)
