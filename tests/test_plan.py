"""Tests of the planner (lightning_ratel.plan): cost model and search on hand-built profiles, no device needed."""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks.plan_search import large_model
from lightning_ratel.errors import RatelConfigError, RatelPlanError
from lightning_ratel.plan import (
    HardwareProfile,
    LayerProfile,
    OpProfile,
    Plan,
    fixed,
    predict,
    recompute_ops,
    search,
)
from lightning_ratel.plan.cost import (
    CostModel,
    CostSettings,
    DeviceOverhead,
    bottleneck,
    check_device_types,
    largest_batch,
    layer_cost,
    node_models,
    node_settings,
    updates_overlap,
)

BIG = 1 << 50  # a budget that never binds


def _hw(device_type: str = "cuda", *, link: float = 1e9, ssd: float = 1e9, adam: float = 1e12) -> HardwareProfile:
    return HardwareProfile(device_type=device_type, h2d_bandwidth=link, d2h_bandwidth=link, ssd_read_bandwidth=ssd,
                           ssd_write_bandwidth=ssd, adam_params_per_s=adam, host_memory_free=BIG,
                           device_memory_free=BIG, ssd_free=BIG, per_path={"/nvme0": {"read": ssd, "write": ssd}})


def _chain(index: int, times: list[float], op_bytes: int, input_bytes: int, param_bytes: int = 1000) -> LayerProfile:
    """A block whose ops run one after the other, each reading the previous one's output."""
    ops = [OpProfile("input", 0.0, 0.0, input_bytes)]
    for k, seconds in enumerate(times):
        ops.append(OpProfile(f"op{k}", seconds, 1e9 * seconds, op_bytes, [ops[-1].name]))
    return LayerProfile(name=f"layers.{index}", index=index, forward_time=sum(times), backward_time=2 * sum(times),
                        param_bytes=param_bytes, grad_bytes=0, trainable_numel=0, ops=ops)


def _container(index: int, saved: int) -> LayerProfile:
    return LayerProfile(name="lm_head", index=index, forward_time=1e-3, backward_time=2e-3, param_bytes=1000,
                        grad_bytes=0, trainable_numel=0, ops=[OpProfile("*", 1e-3, 1e6, saved)], op_level=False)


def _fixed_device(layers: list[LayerProfile], prefetch_depth: int = 1) -> int:
    """The device bytes every plan needs: paging buffers plus the largest backward working set (written out here, not
    read from ``CostModel.fixed_device_bytes``, so that these tests check the planner's count)."""
    largest = max(layer.param_bytes for layer in layers)
    working = max(layer.param_bytes + layer.grad_bytes + layer.saved_bytes for layer in layers)
    return (prefetch_depth + 1) * largest + working


def _stored_ops(plan: Plan) -> dict[str, str]:
    """Placements of the non-input ops with saved bytes."""
    return {f"{layer.name}/{op.name}": plan.placement(layer.name, op.name)
            for layer in plan.layers if layer.op_level for op in layer.ops if op.name != "input" and op.saved_bytes}


def _hand_layer(name: str, index: int) -> LayerProfile:
    ops = [
        OpProfile("input", 0.0, 0.0, 100),
        OpProfile("a", 0.01, 1.0, 200, ["input"]),
        OpProfile("b", 0.002, 1.0, 0, ["a"]),
        OpProfile("c", 0.02, 1.0, 300, ["b"]),
    ]
    return LayerProfile(name=name, index=index, forward_time=0.04, backward_time=0.08, param_bytes=1000,
                        grad_bytes=500, trainable_numel=10, ops=ops)


HAND_PLACEMENT = {
    "b.0/input": "host", "b.0/a": "device", "b.0/b": "device", "b.0/c": "recompute",
    "b.1/input": "ssd", "b.1/a": "recompute", "b.1/b": "device", "b.1/c": "host",
}


def _hand_predict(device_type: str, *, host_io: float = 0.0, dram: float = 0.0, adam_rate: float = 1000,
                  activation_write: float = 0.0, **options):
    hw = HardwareProfile(device_type=device_type, h2d_bandwidth=1000, d2h_bandwidth=500, ssd_read_bandwidth=100,
                         ssd_write_bandwidth=50, adam_params_per_s=adam_rate, host_memory_free=BIG,
                         device_memory_free=BIG,
                         host_io_bandwidth=host_io, host_memory_bandwidth=dram,
                         activation_write_bandwidth=activation_write)
    layers = [_hand_layer("b.0", 0), _hand_layer("b.1", 1)]
    settings = CostSettings(prefetch_depth=1, state_read_bytes_per_param=4, state_write_bytes_per_param=2,
                            host_static_bytes=50, **options)
    return predict(hw, layers, HAND_PLACEMENT, settings)


def test_recompute_ops_closure():
    ops = [
        OpProfile("input", 0.0, 0.0, 10),
        OpProfile("a", 1.0, 1.0, 10, ["input"]),
        OpProfile("b", 1.0, 1.0, 0, ["a"]),
        OpProfile("c", 1.0, 1.0, 10, ["b"]),
        OpProfile("d", 1.0, 1.0, 10, ["c", "a"]),
        OpProfile("e", 1.0, 1.0, 0, ["d", "input"]),
        OpProfile("f", 1.0, 1.0, 10, ["e"]),
    ]
    layer = LayerProfile("blk", 0, 6.0, 12.0, 0, 0, 0, ops)
    stored = {f"blk/{op.name}": "host" for op in ops}
    assert recompute_ops(layer, stored) == set()
    # f's input e saved nothing, so e re-runs; e reads d (stored) and the block input: the chain stops there.
    assert recompute_ops(layer, {**stored, "blk/f": "recompute"}) == {"f", "e"}
    # d needs c (recomputed anyway) and a (stored); c needs b, which saved nothing; b needs a (stored).
    assert recompute_ops(layer, {**stored, "blk/d": "recompute", "blk/c": "recompute"}) == {"d", "c", "b"}
    # a recomputed: c's chain through b now reaches a and stops at the input.
    assert recompute_ops(layer, {**stored, "blk/a": "recompute", "blk/c": "recompute"}) == {"a", "b", "c"}
    # An op with nothing saved placed "recompute" does not re-run by itself.
    assert recompute_ops(layer, {**stored, "blk/b": "recompute"}) == set()


def test_recompute_ops_rejects_bad_placements_and_graphs():
    layer = _chain(0, [1.0, 1.0], 10, 10)
    with pytest.raises(RatelConfigError, match="input"):
        recompute_ops(layer, {"layers.0/input": "recompute"})
    with pytest.raises(RatelConfigError, match="gpu"):
        recompute_ops(layer, {"layers.0/op0": "gpu"})
    with pytest.raises(RatelConfigError, match="profiled as a whole"):
        predict(_hw(), [_container(0, 10)], {"lm_head/*": "recompute"})
    layer.ops[1].inputs = ["elsewhere"]
    with pytest.raises(RatelConfigError, match="elsewhere"):
        recompute_ops(layer, {"layers.0/op0": "recompute"})


def test_predict_by_hand_cuda():
    p = _hand_predict("cuda")
    # Activations: device b.0/a; host b.0/input + b.1/c; ssd b.1/input; recompute b.0/c + b.1/a.
    assert p.bytes == {"device": 200, "host": 400, "ssd": 100, "recompute": 500}
    # b.0's 10 parameters get their gradients last; the next forward waits for their update (0.01 s) to compute.
    assert p.forward == pytest.approx({"compute": 0.08, "h2d": 2000 / 1000, "d2h": 500 / 500, "ssd": 100 / 50,
                                       "update_wait": 0.08 + 10 / 1000})
    # Recompute: b.0 re-runs c and, through b (saved nothing), b itself: 0.022; b.1 re-runs a: 0.01.
    assert p.backward == pytest.approx({
        "compute": 0.16 + 0.032,
        "recompute": 0.032,
        "h2d": (2000 + 500) / 1000,
        "d2h": 1000 / 500,
        "ssd": 100 / 100 + 20 * 4 / 100 + 20 * 2 / 50,
        # The other 10 parameters' updates.
        "cpu_optimizer": 10 / 1000,
    })
    assert p.forward_time == pytest.approx(2.0)
    assert p.backward_time == pytest.approx(2.6)
    assert p.iteration_time == pytest.approx(4.6)
    # device: kept 200 + 2 paging buffers of 1000 + working set 1000 + 500 + 600; host: 50 + 400 + 2 x 100 staging.
    assert p.memory == {"device": 4300, "host": 650, "ssd": 100}


def test_predict_by_hand_unified_memory():
    p = _hand_predict("cpu")
    # Nothing is copied between "device" and host: compute copies, gradients and host-tier activations are used where
    # they are, the SSD tier writes and reads the tensors' own memory.
    for phase in (p.forward, p.backward):
        assert phase["h2d"] == 0 and phase["d2h"] == 0
    assert p.forward["ssd"] == pytest.approx(100 / 50)
    # The optimizer shares the cores with compute, and so does the SSD traffic (its staging copies and checksums).
    slow_adam = _hand_predict("cpu", adam_rate=5)
    assert slow_adam.backward_time == pytest.approx(0.192 + 20 / 5 + slow_adam.backward["ssd"])
    assert p.forward_time == pytest.approx(0.08 + 2.0)
    assert p.memory == {"device": 4950, "host": 4950, "ssd": 100}


def test_activations_go_to_the_drives_at_the_rate_of_writes_from_their_ops_memory():
    """On the CPU an activation is written from where its op put it, not page-aligned, through the store's bounce
    buffers: the probe's rate of such writes (``activation_write_bandwidth``) times it, and a node's ranks share that
    rate as they share the drives. Read back into aligned buffers, and with the states' traffic, it keeps the
    store's own rates."""
    aligned = _hand_predict("cpu")
    unaligned = _hand_predict("cpu", activation_write=25)
    assert unaligned.forward["ssd"] == pytest.approx(100 / 25) and aligned.forward["ssd"] == pytest.approx(100 / 50)
    assert unaligned.backward["ssd"] == aligned.backward["ssd"]
    assert unaligned.forward_time == pytest.approx(aligned.forward_time + 100 / 25 - 100 / 50)
    assert _hand_predict("cpu", activation_write=25, ranks_on_node=2).forward["ssd"] == pytest.approx(100 / 12.5)


def test_updates_overlap_backward_only_where_the_optimizer_has_cores_of_its_own():
    gpu, cpu = _hw("cuda").unified_memory, _hw("cpu").unified_memory
    # A GPU computes: backward and the CPU optimizer run side by side, so overlapping shortens the step.
    assert updates_overlap(unified=gpu, gradient_bytes=1000, host_room=BIG)
    # On the CPU both run on the same cores: overlapped or after backward, the step takes their sum (as the unified
    # prediction above does), and the updates run after backward...
    assert not updates_overlap(unified=cpu, gradient_bytes=1000, host_room=4000)
    # ... unless holding every gradient until then takes more than its share of the host memory left: overlapping
    # holds a few shards' worth.
    assert updates_overlap(unified=cpu, gradient_bytes=1001, host_room=4000)
    assert updates_overlap(unified=gpu, gradient_bytes=1001, host_room=4000)


def test_work_measured_outside_the_blocks_adds_to_compute_on_the_cpu_and_runs_beside_a_gpu():
    base = _hand_predict("cpu")
    p = _hand_predict("cpu", forward_overhead=0.5, backward_overhead=0.25)
    # The blocks' 0.08 s of forward and 0.16 s of backward (with 0.032 s of recompute) plus what ran around them.
    assert p.forward["compute"] == pytest.approx(0.08 + 0.5)
    assert p.backward["compute"] == pytest.approx(0.192 + 0.25)
    assert "host" not in p.forward and "host" not in p.backward
    assert p.iteration_time == pytest.approx(base.iteration_time + 0.75)
    # On a GPU the training thread queues kernels while the device runs the ones before: its work around the blocks
    # is a lane of its own, beside the device's compute and the 2 s of page-ins that set the forward's time.
    gpu = _hand_predict("cuda", forward_overhead=0.5, backward_overhead=3.0)
    assert gpu.forward["compute"] == pytest.approx(0.08)
    assert (gpu.forward["host"], gpu.backward["host"]) == (0.5, 3.0)
    assert gpu.forward_time == pytest.approx(2.0)
    # Longer than every other lane of backward, it sets that phase's time.
    assert gpu.backward_time == pytest.approx(3.0)


def test_the_device_tiers_updates_run_on_the_compute_lane_and_touch_no_host_memory():
    """Of 20 updated parameters, 5 on the device tier: 25% of the measured update time moves from the CPU optimizer
    to compute, and the DRAM traffic of updates is what the settings count per parameter (the planner averages the
    device tier's none in)."""
    host = _hand_predict("cuda", update_params_per_s=4, dram=1000)
    mixed = _hand_predict("cuda", update_params_per_s=4, dram=1000, device_update_share=0.25,
                          optimizer_memory_bytes_per_param=21)
    # Of what the CPU optimizer updates, b.0's 10 parameters (at 4/s) are the update the next forward waits for.
    assert host.backward["cpu_optimizer"] == pytest.approx((20 - 10) / 4)
    assert mixed.backward["cpu_optimizer"] == pytest.approx((15 - 10) / 4)
    assert mixed.forward["update_wait"] == pytest.approx(0.08 + 10 / 4)
    assert mixed.backward["compute"] == pytest.approx(host.backward["compute"] + 5 / 4)
    assert mixed.backward["dram"] == pytest.approx(host.backward["dram"] - 20 * (28 - 21) / 1000)
    on_device = _hand_predict("cuda", update_params_per_s=4, device_update_share=1.0, updates_after_backward=True)
    assert on_device.forward["cpu_optimizer"] == 0
    assert on_device.forward["compute"] == pytest.approx(0.08 + 20 / 4)
    with pytest.raises(RatelConfigError, match="device_update_share"):
        CostSettings(device_update_share=1.5)


def test_a_measured_update_rate_replaces_the_kernels():
    # 20 parameters at the kernel's 1000/s, or at the 4/s the whole update was measured at.
    assert _hand_predict("cpu").backward["cpu_optimizer"] == pytest.approx(20 / 1000)
    measured = _hand_predict("cpu", update_params_per_s=4)
    assert measured.backward["cpu_optimizer"] == pytest.approx(20 / 4)
    assert measured.backward_time == pytest.approx(0.192 + 20 / 4 + measured.backward["ssd"])
    # Two ranks on a node: the kernel's rate is shared between them (10 parameters at 500/s), the measured one was
    # measured with both updating and is not shared again (10 parameters at 4/s).
    assert _hand_predict("cpu", ranks_on_node=2).backward["cpu_optimizer"] == pytest.approx(10 / 500)
    assert _hand_predict("cpu", ranks_on_node=2, update_params_per_s=4).backward["cpu_optimizer"] == pytest.approx(2.5)


def test_updates_after_backward_are_charged_to_the_next_forward():
    overlapped = _hand_predict("cpu", update_params_per_s=4)
    after = _hand_predict("cpu", update_params_per_s=4, updates_after_backward=True)
    assert "cpu_optimizer" not in after.backward and "cpu_optimizer" not in overlapped.forward
    assert after.forward["cpu_optimizer"] == pytest.approx(20 / 4)
    # On the CPU's cores the step takes the same time in either order; the phases split it differently.
    assert after.forward_time == pytest.approx(overlapped.forward_time + 5)
    assert after.backward_time == pytest.approx(overlapped.backward_time - 5)
    assert after.iteration_time == pytest.approx(overlapped.iteration_time)
    # On a GPU the updates have lanes of their own: 5 s of them, after a forward of 2 s of page-ins and a backward
    # of 2.6 s, lengthen the forward to 5 s and shorten nothing.
    gpu = _hand_predict("cuda", update_params_per_s=4, updates_after_backward=True)
    assert gpu.forward_time == pytest.approx(5.0)
    assert gpu.backward_time == pytest.approx(2.6)
    # Their DRAM traffic (20 updates of 28 B) goes with them.
    dram = _hand_predict("cuda", dram=1000, updates_after_backward=True)
    in_backward = _hand_predict("cuda", dram=1000)
    assert dram.forward["dram"] == pytest.approx(in_backward.forward["dram"] + 20 * 28 / 1000)
    assert dram.backward["dram"] == pytest.approx(in_backward.backward["dram"] - 20 * 28 / 1000)


def test_the_next_forward_waits_for_the_update_of_the_unit_backward_finishes_last():
    """Beside a GPU the CPU optimizer updates each unit as its gradients complete; the first block's arrive last, and
    the step ends without waiting for its update (10 of 20 parameters: half the update time, or its DRAM traffic where
    that is slower): the next forward starts with that wait (where it is measured). On the CPU the cores' one lane
    holds every update already."""
    slow = _hand_predict("cuda", update_params_per_s=40)
    assert slow.forward["update_wait"] == pytest.approx(0.08 + 10 / 40)
    assert slow.backward["cpu_optimizer"] == pytest.approx(10 / 40) and "update_wait" not in slow.backward
    assert slow.backward_time == pytest.approx(2.6) and slow.forward_time == pytest.approx(2.0)
    slower = _hand_predict("cuda", update_params_per_s=4)
    assert slower.forward["update_wait"] == pytest.approx(0.08 + 10 / 4)
    assert slower.forward_time == pytest.approx(0.08 + 10 / 4)
    assert slower.backward_time == pytest.approx(max(10 / 4, slower.backward["ssd"]))
    bus = _hand_predict("cuda", update_params_per_s=40, dram=10)
    assert bus.forward["update_wait"] == pytest.approx(0.08 + 10 * 28 / 10)
    # Updates after backward run in forward order while the next forward waits for the first block's.
    after = _hand_predict("cuda", update_params_per_s=40, updates_after_backward=True)
    assert after.forward["update_wait"] == pytest.approx(0.08 + 10 / 40)
    assert after.forward["cpu_optimizer"] == pytest.approx(20 / 40)
    cpu = _hand_predict("cpu", update_params_per_s=40)
    assert "update_wait" not in cpu.forward and "update_wait" not in cpu.backward
    # Two ranks each update half of the 20 parameters; one owns b.0's 10 whole, and the next forward waits for them.
    two = _hand_predict("cuda", update_params_per_s=40, ranks_on_node=2)
    assert two.backward["cpu_optimizer"] == pytest.approx(0)
    assert two.forward["update_wait"] == pytest.approx(0.08 + 10 / 40)
    assert "update_wait" not in _hand_predict("cuda", device_update_share=1.0).forward
    # b.0 updated on the device: ready at once; forward computes it (0.04 s), then waits for b.1's CPU update.
    first_on_device = _hand_predict("cuda", update_params_per_s=40, device_update_share=0.5, device_updated=("b.0",))
    assert first_on_device.forward["update_wait"] == pytest.approx(0.08 + 10 / 40 - 0.04)
    assert first_on_device.backward["cpu_optimizer"] == pytest.approx(0)


def test_measured_settings_cannot_be_negative():
    for name in ("forward_overhead", "backward_overhead", "update_params_per_s"):
        with pytest.raises(RatelConfigError, match=name):
            CostSettings(**{name: -1.0})


def test_predict_missing_ops_count_as_device():
    layers = [_hand_layer("b.0", 0)]
    assert predict(_hw(), layers, {}).bytes == {"device": 600, "host": 0, "ssd": 0, "recompute": 0}


def test_transfer_bound_swaps_only_the_inputs():
    """Ratel's case 1: slow links, fast compute: store only what cannot be recomputed."""
    layers = [_chain(i, [1e-3] * 5, 100_000, 100_000) for i in range(4)] + [_container(4, 100_000)]
    plan = search(_hw(link=1e6, ssd=1e6), layers, device_budget=_fixed_device(layers), host_budget=BIG,
                  store_budget=BIG)
    for layer in layers[:4]:
        assert plan.placement(layer.name, "input") == "host"
    assert plan.placement("lm_head", "*") == "host"
    assert set(_stored_ops(plan).values()) == {"recompute"}
    assert plan.chosen == 0
    assert len(plan.curve) > 1
    assert plan.curve[0][1] < min(seconds for _, seconds in plan.curve[1:])
    assert plan.memory["device"] <= plan.budgets["device"]


def test_compute_bound_stores_everything_and_spills_to_ssd():
    """Ratel's case 2: fast links, slow compute: store everything; what host memory cannot hold goes to SSD."""
    layers = [_chain(i, [1.0] * 4, 1_000_000, 1_000_000) for i in range(3)]
    host_budget = 14_000_000  # the inputs and a few ops, not all twelve
    plan = search(_hw(link=1e12, ssd=1e12), layers, device_budget=_fixed_device(layers), host_budget=host_budget,
                  store_budget=BIG)
    tiers = list(_stored_ops(plan).values())
    assert "recompute" not in tiers
    assert tiers.count("ssd") >= 1 and tiers.count("host") >= 1
    assert plan.memory["host"] <= host_budget
    assert plan.chosen == len(plan.curve) - 1
    assert plan.resource_times["backward"]["recompute"] == 0


def test_convex_middle_has_an_interior_optimum():
    """Ratel's case 3: storing the most valuable ops pays until the links become the bottleneck."""
    layers = [_chain(i, [10e-3, 6e-3, 3e-3, 1.5e-3, 0.5e-3], 1_000_000, 1_000_000, 1_000_000) for i in range(2)]
    hw = _hw(link=1e8, ssd=1e8)
    plan = search(hw, layers, device_budget=_fixed_device(layers), host_budget=BIG, store_budget=BIG)
    times = [seconds for _, seconds in plan.curve]
    chosen = plan.chosen
    assert 0 < chosen < len(times) - 1
    assert times[chosen] == min(times)
    assert times[chosen] < times[0] and times[chosen] < times[-1]
    # Hand numbers: 168 ms all recomputed, 148 ms with both 10 ms ops stored, 260 ms with all stored.
    assert times[0] == pytest.approx(0.168) and times[chosen] == pytest.approx(0.148)
    assert times[-1] == pytest.approx(0.260)
    assert {key for key, tier in _stored_ops(plan).items() if tier != "recompute"} == {"layers.0/op0", "layers.1/op0"}
    slopes = [(t1 - t0) / (x1 - x0) for (x0, t0), (x1, t1) in zip(plan.curve, plan.curve[1:])]
    assert all(b >= a - 1e-15 for a, b in zip(slopes, slopes[1:]))
    assert slopes[chosen - 1] < 0 < slopes[chosen]
    again = predict(hw, layers, plan.activation_placement)
    assert again.iteration_time == plan.predicted_iteration_time == times[chosen]


def test_device_budget_shortfall_is_reported():
    layers = [_chain(i, [1e-3] * 3, 1000, 1000) for i in range(2)]
    need = _fixed_device(layers)
    with pytest.raises(RatelPlanError, match=r"device budget.*short by 123 B.*prefetch_depth"):
        search(_hw(), layers, device_budget=need - 123, host_budget=BIG, store_budget=BIG)
    # The part that grows with the batch (what the working block saves) must shrink to fit: a little here.
    with pytest.raises(RatelPlanError, match=r"at most 9\d\.\d% of the profiled one fits"):
        search(_hw(), layers, device_budget=need - 123, host_budget=BIG, store_budget=BIG)
    # Parameters and paging buffers alone are too big: no batch fits.
    with pytest.raises(RatelPlanError, match="none fits"):
        search(_hw(), layers, device_budget=100, host_budget=BIG, store_budget=BIG)


def test_host_budget_shortfall_is_reported():
    layers = [_chain(i, [1e-3] * 3, 1000, 1000) for i in range(2)]
    with pytest.raises(RatelPlanError, match=r"host budget.*short by 77 B.*host_memory_limit"):
        search(_hw(), layers, device_budget=BIG, host_budget=5000, store_budget=BIG,
               settings=CostSettings(host_static_bytes=5077))


def test_unified_memory_counts_compute_against_the_host_budget():
    layers = [_chain(i, [1e-3] * 3, 1000, 1000) for i in range(2)]
    with pytest.raises(RatelPlanError, match=r"host budget.*short by 1 B"):
        search(_hw("cpu"), layers, device_budget=BIG, host_budget=_fixed_device(layers) - 1, store_budget=BIG)
    plan = search(_hw("cpu"), layers, device_budget=0, host_budget=BIG, store_budget=BIG)
    assert plan.budgets["device"] == plan.budgets["host"] == BIG
    assert plan.memory["device"] == plan.memory["host"]
    # Keeping is free on the CPU and host copies only cost time, so nothing goes to "host".
    assert "host" not in plan.activation_placement.values()


def test_inputs_that_fit_nowhere_are_reported():
    layers = [_chain(i, [1e-3] * 3, 1000, 1000) for i in range(2)]
    # Room on the host for one block's input; no SSD at all.
    with pytest.raises(RatelPlanError, match=r"block inputs.*host budget.*short by 500 B.*short by 1000 B.*ssd_paths"):
        search(_hw(), layers, device_budget=_fixed_device(layers), host_budget=1500, store_budget=0)


def test_inputs_start_on_ssd_so_staging_fits():
    layers = [_chain(i, [1e-3] * 3, 1000, 8000) for i in range(3)]
    # Host first would take two inputs and leave no room to stage the third; all on SSD needs 2 x 8000 of staging.
    plan = search(_hw(), layers, device_budget=_fixed_device(layers), host_budget=20_000, store_budget=BIG)
    assert plan.memory["host"] <= 20_000
    assert {plan.placement(layer.name, "input") for layer in layers} == {"ssd"}


def test_fixed():
    layers = [_hand_layer("b.0", 0), _container(1, 50)]
    assert fixed(layers, "recompute") == {"b.0/input": "host", "b.0/a": "recompute", "b.0/b": "recompute",
                                          "b.0/c": "recompute", "lm_head/*": "host"}
    assert set(fixed(layers, "ssd").values()) == {"ssd"}
    with pytest.raises(RatelConfigError):
        fixed(layers, "gpu")


def test_plan_json_round_trip_and_placement_default(tmp_path):
    layers = [_hand_layer("b.0", 0), _hand_layer("b.1", 1), _container(2, 50)]
    settings = CostSettings(prefetch_depth=2, device_overhead=DeviceOverhead.margin(logits_bytes=7), ranks_on_node=2)
    plan = search(_hw(), layers, device_budget=BIG, host_budget=BIG, store_budget=BIG, settings=settings)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    # The settings come back whole, so another placement can be predicted as the plan's was.
    assert again.settings == settings
    assert isinstance(again.hardware, HardwareProfile) and again.layers[0].ops[1].inputs == ["input"]
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    bare = Plan({"b.0/a": "host"}, 1.0, 0.25, 0.75, {}, {}, {}, [(0, 1.0)], 0)
    assert Plan.from_json(bare.to_json()) == bare
    assert plan.placement("b.0", "nope") == "device"
    assert plan.placement("b.0", "nope", default="recompute") == "recompute"
    assert plan.placement("lm_head", "*") == plan.activation_placement["lm_head/*"]


def test_summary_counts_and_bytes():
    layers = [_hand_layer("b.0", 0), _hand_layer("b.1", 1)]
    plan = Plan(HAND_PLACEMENT, 1.0, 0.5, 0.5, {}, {}, {}, [(0, 1.0)], 0, layers=layers)
    rows = plan.summary()
    assert [row["block"] for row in rows] == ["b.0", "b.1"]
    assert rows[0]["ops"] == {"device": 1, "host": 1, "ssd": 0, "recompute": 1}
    assert rows[0]["bytes"] == {"device": 200, "host": 100, "ssd": 0, "recompute": 300}
    assert rows[0]["rerun"] == 2
    bare = Plan(HAND_PLACEMENT, 1.0, 0.5, 0.5, {}, {}, {}, [(0, 1.0)], 0).summary()
    assert [row["ops"]["recompute"] for row in bare] == [1, 1]


def test_search_of_a_large_model_uses_every_tier_within_budgets():
    """The model of ``benchmarks/plan_search.py`` (which times this search): every tier in use, budgets kept, and the
    plan's predicted time the cost model's."""
    hw, layers, budgets = large_model()
    plan = search(hw, layers, **budgets)
    assert len(plan.curve) > 1000
    assert set(plan.activation_placement.values()) == {"device", "host", "ssd", "recompute"}
    assert all(plan.memory[name] <= plan.budgets[name] for name in plan.memory)
    assert math.isfinite(plan.predicted_iteration_time)
    assert predict(hw, layers, plan.activation_placement).iteration_time == plan.predicted_iteration_time


def test_free_device_memory_keeps_activations_when_time_is_flat():
    """Backward bound by the optimizer states' SSD traffic: storing changes no time, yet device room is used."""
    layers = [_chain(i, [1e-3] * 3, 1000, 1000) for i in range(2)]
    for layer in layers:
        layer.trainable_numel = 10**9
    plan = search(_hw(), layers, device_budget=BIG, host_budget=BIG, store_budget=BIG)
    assert len({seconds for _, seconds in plan.curve}) == 1
    assert set(plan.activation_placement.values()) == {"device"}
    assert plan.resource_times["backward"]["recompute"] == 0


# ---------------------------------------------------------------- optional terms (each default leaves the model as is)


def test_param_cache_ssd_reads_compute_copies_in_both_passes():
    host = _hand_predict("cuda")
    ssd = _hand_predict("cuda", param_cache="ssd")
    # 2000 parameter bytes from SSDs reading 100 B/s: 20 s more SSD time in forward and again in backward.
    assert ssd.forward["ssd"] == pytest.approx(host.forward["ssd"] + 20.0)
    assert ssd.backward["ssd"] == pytest.approx(host.backward["ssd"] + 20.0)
    assert ssd.forward_time == pytest.approx(22.0) and ssd.backward_time == pytest.approx(22.6)
    assert {k: v for k, v in ssd.forward.items() if k != "ssd"} == {k: v for k, v in host.forward.items() if k != "ssd"}
    with pytest.raises(RatelConfigError, match="param_cache"):
        _hand_predict("cuda", param_cache="gpu")


def test_host_side_pcie_carries_device_and_ssd_traffic_together():
    p = _hand_predict("cuda", host_io=1000)
    # Forward: into host 500 B swapped; out of host 2000 B of params to the device and 100 B to the SSDs.
    assert p.forward["host_in"] == pytest.approx(0.5) and p.forward["host_out"] == pytest.approx(2.1)
    # Backward: in: 1000 B grads + 100 B read back + 80 B states; out: 2000 B params + 500 B swapped + 40 B states.
    assert p.backward["host_in"] == pytest.approx(1.18) and p.backward["host_out"] == pytest.approx(2.54)
    # The GPU link alone (2.0 s) and the SSDs alone (2.0 s) would finish forward sooner than the shared host side.
    assert p.forward_time == pytest.approx(2.1)
    assert bottleneck(p.forward, unified=False) == "host_out"
    with pytest.raises(RatelConfigError, match="host_io_bandwidth"):
        _hand_predict("cuda", host_io=-1)


def test_host_dram_is_shared_by_the_optimizer_and_every_transfer():
    p = _hand_predict("cuda", dram=1000)
    assert p.forward["dram"] == pytest.approx((500 + 2000 + 100) / 1000)
    # 20 parameters x 28 bytes the update touches, besides 1180 B in and 2540 B out.
    assert p.backward["dram"] == pytest.approx((1180 + 2540 + 20 * 28) / 1000)
    assert p.backward_time == pytest.approx(4.28)
    lean = _hand_predict("cuda", dram=1000, optimizer_memory_bytes_per_param=0)
    assert lean.backward["dram"] == pytest.approx(3.72)
    # On unified memory DRAM runs beside the cores' work, like the SSDs; only the SSDs' traffic crosses it there.
    cpu = _hand_predict("cpu", dram=40)
    assert cpu.forward["dram"] == pytest.approx(100 / 40)
    assert cpu.forward_time == pytest.approx(2.5)
    assert bottleneck(cpu.forward, unified=True) == "dram"


def test_ranks_on_a_node_share_its_ssds_host_side_dram_and_cores():
    one = _hand_predict("cuda", host_io=1000, dram=1000)
    two = _hand_predict("cuda", host_io=1000, dram=1000, ranks_on_node=2)
    # Each rank has a device and a link of its own.
    for phase in ("forward", "backward"):
        for lane in ("compute", "h2d", "d2h"):
            assert getattr(two, phase)[lane] == getattr(one, phase)[lane]
    # Its 100 B of activations go to SSDs the other rank writes to at the same time: half of 50 B/s.
    assert two.forward["ssd"] == pytest.approx(4.0) and one.forward["ssd"] == pytest.approx(2.0)
    # It owns 10 of the 20 parameters (b.0's, whose update the next forward waits for) and updates them on half the
    # cores: as long as one rank updating all of them.
    alone, shared = _hand_predict("cuda", host_io=1000), _hand_predict("cuda", host_io=1000, ranks_on_node=2)
    assert shared.backward["cpu_optimizer"] == 0
    assert shared.forward["update_wait"] == pytest.approx(
        alone.forward["update_wait"] + alone.backward["cpu_optimizer"])
    # Its 100 B of activations read back at 50 B/s, its 10 parameters' states (4 B read, 2 B written each).
    assert two.backward["ssd"] == pytest.approx(100 / 50 + 10 * 4 / 50 + 10 * 2 / 25)
    # Host side at half of 1000 B/s: in, 1000 B of gradients, 100 B of activations, 40 B of states; out, 2000 B of
    # compute copies, 500 B swapped, 20 B of states.
    assert two.backward["host_in"] == pytest.approx(1140 / 500)
    assert two.backward["host_out"] == pytest.approx(2520 / 500)
    # DRAM: that traffic, 10 updates of 28 B and the peer's copy of the owned half of the gradients (500 B).
    assert two.backward["dram"] == pytest.approx((1140 + 2520 + 10 * 28 + 500) / 500)
    assert two.iteration_time > one.iteration_time
    # Reduced on the devices, each rank's link carries its whole gradient once in fp32 (20 parameters x 4 B) instead
    # of its 1000 B, and the owners read no peer copy in host memory.
    on_device = _hand_predict("cuda", host_io=1000, dram=1000, ranks_on_node=2, gradients_reduced_on_device=True)
    assert on_device.backward["d2h"] == pytest.approx(80 / 500) and two.backward["d2h"] == pytest.approx(1000 / 500)
    assert on_device.backward["host_in"] == pytest.approx(220 / 500)
    assert on_device.backward["dram"] == pytest.approx((220 + 2520 + 10 * 28) / 500)
    alone_on_device = _hand_predict("cuda", gradients_reduced_on_device=True)
    assert alone_on_device.backward["d2h"] == one.backward["d2h"]
    with pytest.raises(RatelConfigError, match="ranks_on_node"):
        _hand_predict("cuda", ranks_on_node=0)


def test_each_rank_reads_every_compute_copy_from_its_own_swap_files():
    one = _hand_predict("cuda", param_cache="ssd")
    two = _hand_predict("cuda", param_cache="ssd", ranks_on_node=2)
    # 2000 B of compute copies at 100 B/s alone: 20 s in each pass; two ranks read them all at half of it each.
    assert one.forward["ssd"] == pytest.approx(100 / 50 + 20.0)
    assert two.forward["ssd"] == pytest.approx(100 / 25 + 40.0)


def _spill_case(read: int, write: int) -> CostModel:
    """Forward bound by 10 s of compute with idle SSDs; backward bound by optimizer-state SSD traffic."""
    layer = LayerProfile("blk", 0, 10.0, 1.0, 0, 0, 100, [OpProfile("input", 0.0, 0.0, 0)])
    hw = HardwareProfile(device_type="cuda", h2d_bandwidth=1e12, d2h_bandwidth=1e12, ssd_read_bandwidth=100,
                         ssd_write_bandwidth=100, adam_params_per_s=1e12, host_memory_free=BIG,
                         device_memory_free=BIG)
    return CostModel(hw, [layer], CostSettings(state_read_bytes_per_param=read, state_write_bytes_per_param=write,
                                               state_spill=True))


def test_state_writes_that_do_not_fit_in_backward_spill_into_the_next_forward():
    model = _spill_case(read=1, write=12)
    p = model.evaluate([layer_cost(layer, {}) for layer in model.layers])
    # 100 B of reads (1 s) and 1200 B of writes (12 s) keep backward busy 13 s; forward's SSDs idle for 10 s.
    # Deferring 1000 B fills that idle time exactly; deferring more only moves time from one phase to the other.
    # (Forward also waits 1e-10 s for an update: the byte rounded up past it is 10 ms more.)
    assert p.spilled == pytest.approx(1000, abs=1)
    assert p.forward["ssd"] == pytest.approx(10.0, abs=0.01) and p.backward["ssd"] == pytest.approx(3.0, abs=0.01)
    assert p.iteration_time == pytest.approx(13.0)
    model.state_spill = False
    assert model.evaluate([layer_cost(layer, {}) for layer in model.layers]).iteration_time == pytest.approx(23.0)


def test_state_reads_never_spill():
    model = _spill_case(read=12, write=1)
    p = model.evaluate([layer_cost(layer, {}) for layer in model.layers])
    # Only the 100 B of writes can wait; the 1200 B of reads feed updates the next forward waits for.
    assert p.spilled == 100
    assert p.backward["ssd"] == pytest.approx(12.0) and p.iteration_time == pytest.approx(22.0)


def test_states_read_ahead_fill_the_forwards_idle_disk_time():
    """100 trainable parameters, 12 B of states read and 1 B written each at 100 B/s; forward computes 10 s with idle
    SSDs. States read ahead during forward (the buffer sets') take their seconds out of backward: 5 B per parameter
    read ahead is 5 s of forward's idle time, never more than the reads there are."""
    def iteration(ahead: float) -> tuple[float, float, float]:
        layer = LayerProfile("blk", 0, 10.0, 1.0, 0, 0, 100, [OpProfile("input", 0.0, 0.0, 0)])
        hw = HardwareProfile(device_type="cuda", h2d_bandwidth=1e12, d2h_bandwidth=1e12, ssd_read_bandwidth=100,
                             ssd_write_bandwidth=100, adam_params_per_s=1e12, host_memory_free=BIG,
                             device_memory_free=BIG)
        model = CostModel(hw, [layer], CostSettings(state_read_bytes_per_param=12, state_write_bytes_per_param=1,
                                                    state_read_ahead_bytes_per_param=ahead))
        p = model.evaluate([layer_cost(layer, {}) for layer in model.layers])
        return p.forward["ssd"], p.backward["ssd"], p.iteration_time

    assert iteration(0) == pytest.approx((0.0, 13.0, 23.0))
    assert iteration(5) == pytest.approx((5.0, 8.0, 18.0))
    # Past forward's idle time the reads bound forward instead: 12 s of it, 1 s of writes in backward.
    assert iteration(12) == pytest.approx((12.0, 1.0, 13.0))
    assert iteration(20) == iteration(12)


def test_device_overhead_counts_workspaces_logits_temporaries_and_fragmentation():
    layers = [_hand_layer("b.0", 0), _hand_layer("b.1", 1)]
    overhead = DeviceOverhead(workspace_bytes=64, logits_bytes=100, autocast_cache_bytes=30, grad_temp_ratio=0.5,
                              fragmentation=0.1)
    plain = predict(_hw(), layers, HAND_PLACEMENT).memory["device"]
    assert plain == 4300
    # Working set 1000 + 500 + 600 + 300 of gradient temporaries; 194 B of workspaces, logits and autocast cache;
    # then 10% of the 4794 B allocated for fragmentation.
    assert predict(_hw(), layers, HAND_PLACEMENT, CostSettings(device_overhead=overhead)).memory["device"] == 4794 + 480
    model = CostModel(_hw(), layers, CostSettings(device_overhead=overhead))
    assert model.fixed_device_bytes == 2000 + 2400 + 194
    with pytest.raises(RatelConfigError, match="negative"):
        DeviceOverhead(fragmentation=-0.1)
    margin = DeviceOverhead.margin(logits_bytes=7)
    assert (margin.workspace_bytes, margin.logits_bytes, margin.grad_temp_ratio, margin.fragmentation) == (
        64 << 20, 7, 0.5, 0.1)


def test_measured_block_peak_raises_the_working_set():
    layers = [_hand_layer("b.0", 0), _hand_layer("b.1", 1)]
    layers[1].peak_device_bytes = 5000
    # The measured peak of b.1's backward replaces the 2100 B estimate; kept 200 + 2 buffers of 1000 + 5000.
    assert predict(_hw(), layers, HAND_PLACEMENT).memory["device"] == 7200
    layers[1].peak_device_bytes = 10
    assert predict(_hw(), layers, HAND_PLACEMENT).memory["device"] == 4300
    layers[1].peak_device_bytes = -1
    with pytest.raises(RatelConfigError, match="negative"):
        predict(_hw(), layers, HAND_PLACEMENT)


def test_search_refuses_a_device_budget_the_overhead_does_not_fit():
    layers = [_chain(i, [1e-3] * 3, 1000, 1000) for i in range(2)]
    need = _fixed_device(layers)
    overhead = DeviceOverhead(workspace_bytes=100, grad_temp_ratio=0.5, fragmentation=0.1)
    assert search(_hw(), layers, device_budget=need, host_budget=BIG, store_budget=BIG).memory["device"] <= need
    with pytest.raises(RatelPlanError, match=r"gradient temporaries \(0.5 of its saved bytes\), workspaces 100 B, "
                                             r"10% for allocator fragmentation.*short by"):
        search(_hw(), layers, device_budget=need, host_budget=BIG, store_budget=BIG,
               settings=CostSettings(device_overhead=overhead))


def test_largest_batch():
    assert largest_batch(1000, 100, 90) == 10
    # (100 + 90 b) plus 10% must stay within 1000: 8 samples take 902 B, 9 would take 1001 B.
    assert largest_batch(1000, 100, 90, fragmentation=0.1) == 8
    assert largest_batch(1000, 100, 90, limit=5) == 5
    assert largest_batch(1000, 1001, 90) == 0
    assert largest_batch(1000, 1000, 90) == 0
    budget, fixed_bytes, per_sample = (24 << 30) - 3, 9_876_543_210, 123_456_789
    batch = largest_batch(budget, fixed_bytes, per_sample, fragmentation=0.07)
    assert math.ceil((fixed_bytes + batch * per_sample) * 1.07) <= budget
    assert math.ceil((fixed_bytes + (batch + 1) * per_sample) * 1.07) > budget
    with pytest.raises(RatelConfigError, match="per_sample_bytes"):
        largest_batch(1000, 100, 0)
    with pytest.raises(RatelConfigError, match="negative"):
        largest_batch(1000, -1, 90)


def test_profiles_without_the_new_fields_still_load():
    hw = _hw().to_dict()
    del hw["host_io_bandwidth"], hw["host_memory_bandwidth"]
    assert HardwareProfile.from_dict(hw) == _hw()
    layer = _hand_layer("b.0", 0).to_dict()
    del layer["peak_device_bytes"]
    assert LayerProfile.from_dict(layer) == _hand_layer("b.0", 0)


def test_device_overhead_from_what_profiling_measured():
    from lightning_ratel.engine.planner import device_overhead

    # bf16 logits of 1000 elements: themselves, the loss's fp32 copy and the gradient.
    estimated = device_overhead(2000, 1000, peaks_measured=False)
    assert estimated.logits_bytes == 2000 + 8000
    assert estimated.grad_temp_ratio == 0.5 and estimated.workspace_bytes == 64 << 20
    # Measured backward peaks already hold the activation gradients.
    assert device_overhead(2000, 1000, peaks_measured=True).grad_temp_ratio == 0.0


# ---------------------------------------------------------------- several nodes applying one plan


def test_a_plan_for_several_nodes_holds_on_the_slowest():
    """Two nodes, one with a 30 MB/s device link: the placement that is best on the fast node alone (swap the most
    valuable ops to host memory) takes 0.4 s on the slow one, twice what recomputing them does there. Planned for both,
    the search picks what is best on the slow node, whichever comes first, and predicts its time."""
    layers = [_chain(i, [10e-3, 6e-3, 3e-3, 1.5e-3, 0.5e-3], 1_000_000, 1_000_000, 1_000_000) for i in range(2)]
    fast, slow = _hw(link=1e9, ssd=1e8), _hw(link=3e7, ssd=1e8)
    budgets = dict(device_budget=_fixed_device(layers), host_budget=5_000_000, store_budget=BIG)
    alone = search(fast, layers, **budgets)
    assert predict(slow, layers, alone.activation_placement).iteration_time == pytest.approx(0.4)
    for nodes in ([fast, slow], [slow, fast]):
        plan = search(nodes, layers, **budgets)
        assert plan.activation_placement == search(slow, layers, **budgets).activation_placement
        assert plan.activation_placement != alone.activation_placement
        assert plan.hardware is slow
        # Hand numbers on the slow node: forward and backward bound by the link, 2 MB of inputs swapped each way and
        # 2 MB of parameters paged in each pass: (2 + 4) MB / 30 MB/s.
        assert plan.predicted_iteration_time == pytest.approx(0.2)
        assert plan.predicted_iteration_time == predict(slow, layers, plan.activation_placement).iteration_time
        assert predict(fast, layers, plan.activation_placement).iteration_time < plan.predicted_iteration_time
        assert plan.curve[plan.chosen][1] == plan.predicted_iteration_time


def test_nodes_of_one_plan_share_a_device_type():
    layers = [_chain(0, [1e-3], 1000, 1000)]
    with pytest.raises(RatelConfigError, match=r"device types \(node 0: cuda, node 1: cpu\)"):
        search([_hw(), _hw("cpu")], layers, device_budget=BIG, host_budget=BIG, store_budget=BIG)
    with pytest.raises(RatelConfigError, match="at least one node"):
        search([], layers, device_budget=BIG, host_budget=BIG, store_budget=BIG)
    with pytest.raises(RatelConfigError, match="settings for the profiles of 2 nodes"):
        node_models([_hw(), _hw()], layers, [CostSettings()])


def test_device_types_are_named_per_node():
    check_device_types(["cuda"] * 4, local_world=2)
    check_device_types([])
    with pytest.raises(RatelConfigError, match=r"\(node 0: cuda, node 1: cpu\)"):
        check_device_types(["cuda", "cuda", "cpu", "cpu"], local_world=2)
    # Ranks of one node that disagree are named together.
    with pytest.raises(RatelConfigError, match=r"\(node 0: cuda/cpu\)"):
        check_device_types(["cuda", "cpu"], local_world=2)


def test_a_node_with_its_states_on_disk_is_the_slowest_and_decides_the_plan():
    """Two nodes of equal speeds: one keeps its optimizer states in host memory (no state traffic), the other in the
    swap files (12 bytes read and 12 written per parameter). Alone, the first stores every op in host memory (backward
    is compute-bound, so each recompute costs); on the second, backward waits for the drive anyway (48 MB at 100 MB/s)
    and recomputing is free, so the fewest bytes are moved. Planned for both, the second node's settings decide, in
    either order."""
    layers = [dataclasses.replace(_chain(i, [10e-3, 6e-3, 3e-3, 1.5e-3, 0.5e-3], 1_000_000, 1_000_000),
                                  trainable_numel=1_000_000) for i in range(2)]
    hw = _hw(link=1e9, ssd=1e8)
    in_host = CostSettings(state_read_bytes_per_param=0, state_write_bytes_per_param=0, host_static_bytes=1000)
    on_disk = CostSettings(state_read_bytes_per_param=12, state_write_bytes_per_param=12, host_static_bytes=5000)
    budgets = dict(device_budget=_fixed_device(layers), host_budget=20_000_000, store_budget=BIG)
    alone = search(hw, layers, settings=in_host, **budgets)
    assert set(_stored_ops(alone).values()) == {"host"}
    slow = search(hw, layers, settings=on_disk, **budgets)
    assert set(_stored_ops(slow).values()) == {"recompute"}
    for settings in ([in_host, on_disk], [on_disk, in_host]):
        nodes = [hw, dataclasses.replace(hw)]
        plan = search(nodes, layers, settings=settings, **budgets)
        assert plan.activation_placement == slow.activation_placement
        assert plan.hardware is nodes[settings.index(on_disk)] and plan.settings == on_disk
        # Forward's compute (42 ms) after the first block's update (1 M parameters at 1e12/s), and backward bound by
        # the drive: 2 M parameters x 24 B at 100 MB/s.
        assert plan.predicted_iteration_time == pytest.approx(0.042 + 1e6 / 1e12 + 2e6 * 24 / 1e8)
        assert plan.predicted_iteration_time == predict(hw, layers, plan.activation_placement, on_disk).iteration_time
        assert predict(hw, layers, plan.activation_placement, in_host).iteration_time < plan.predicted_iteration_time
        # Memory is checked against the budgets with the first node's settings (the planning rank's host bytes).
        assert plan.memory == predict(hw, layers, plan.activation_placement, settings[0]).memory
    # One set of settings for every node, as before.
    assert search([hw, hw], layers, settings=on_disk, **budgets).activation_placement == slow.activation_placement


def test_a_nodes_settings_are_the_mean_traffic_of_its_ranks():
    """The node's drives carry every rank's state traffic: a rank with all its states on disk and one with none load
    them as two ranks with half each. What is not traffic is the first rank's."""
    on_disk = CostSettings(state_read_bytes_per_param=12, state_write_bytes_per_param=12, host_static_bytes=7,
                           optimizer_memory_bytes_per_param=28, ranks_on_node=2)
    in_host = CostSettings(state_read_bytes_per_param=0, state_write_bytes_per_param=0, host_static_bytes=9,
                           optimizer_memory_bytes_per_param=52, ranks_on_node=2)
    node = node_settings([on_disk, in_host])
    assert (node.state_read_bytes_per_param, node.state_write_bytes_per_param) == (6, 6)
    assert (node.optimizer_memory_bytes_per_param, node.host_static_bytes, node.ranks_on_node) == (40, 7, 2)
    assert node_settings([in_host]) == in_host
    with pytest.raises(RatelConfigError, match="different param_cache"):
        node_settings([on_disk, dataclasses.replace(in_host, param_cache="ssd")])
    with pytest.raises(RatelConfigError, match="different updates_after_backward"):
        node_settings([on_disk, dataclasses.replace(in_host, updates_after_backward=True)])
    with pytest.raises(RatelConfigError, match="at least one"):
        node_settings([])


def test_a_nodes_measured_work_is_its_slowest_ranks():
    """The ranks of a node wait for each other: the most seconds outside the blocks, the least update rate of the
    ranks that measured one."""
    first = CostSettings(forward_overhead=0.1, backward_overhead=0.4, update_params_per_s=300.0, ranks_on_node=3)
    second = dataclasses.replace(first, forward_overhead=0.2, backward_overhead=0.3, update_params_per_s=200.0)
    unmeasured = dataclasses.replace(first, update_params_per_s=0.0)
    node = node_settings([first, second, unmeasured])
    assert (node.forward_overhead, node.backward_overhead, node.update_params_per_s) == (0.2, 0.4, 200.0)
    assert node_settings([unmeasured]).update_params_per_s == 0.0
