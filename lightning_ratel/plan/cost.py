"""Iteration-time and memory model of one micro-batch under an activation placement (Ratel, section IV-B/IV-D).

Each phase takes as long as its busiest resource: GPU compute, host->device and device->host PCIe (duplex, so two
resources) and the SSDs (simplex, so reads and writes add up). The CPU AdamW and the optimizer states' SSD traffic
overlap backward. Where the "device" is the CPU itself (unified memory) the copies and the optimizer run on the
compute cores, so they add to compute instead of overlapping it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.placement import DEFAULT_TIER, INPUT_OP, STORED_TIERS, TIERS, placement_key
from lightning_ratel.plan.profile import HardwareProfile, LayerProfile, validate_layers


@dataclass
class Prediction:
    """Predicted times, peak memory and activation volumes of one micro-batch.

    Attributes:
        forward: resource -> busy seconds in forward: ``"compute"``, ``"h2d"``, ``"d2h"``, ``"ssd"``.
        backward: resource -> busy seconds in backward: ``"compute"`` (recompute included), ``"recompute"``,
            ``"h2d"``, ``"d2h"``, ``"ssd"``, ``"cpu_optimizer"``.
        forward_time: predicted seconds of forward.
        backward_time: predicted seconds of backward.
        iteration_time: ``forward_time + backward_time``.
        memory: predicted peak bytes of ``"device"``, ``"host"`` and ``"ssd"``.
        bytes: saved-activation bytes per tier: ``"device"``, ``"host"``, ``"ssd"``, ``"recompute"``.
    """

    forward: dict[str, float]
    backward: dict[str, float]
    forward_time: float
    backward_time: float
    iteration_time: float
    memory: dict[str, int]
    bytes: dict[str, int]


@dataclass
class LayerCost:
    """What a placement costs one block, the part of a prediction that depends on the placement.

    Attributes:
        bytes: saved-activation bytes per tier (every key of :data:`TIERS`).
        recompute_time: seconds of forward re-executed in backward.
    """

    bytes: dict[str, int]
    recompute_time: float


def _tier(layer: LayerProfile, op_name: str, placement: Mapping[str, str]) -> str:
    """The checked placement of one op."""
    tier = placement.get(placement_key(layer.name, op_name), DEFAULT_TIER)
    if tier not in TIERS:
        raise RatelConfigError(f"placement of {placement_key(layer.name, op_name)!r} is {tier!r}, not one of {TIERS}")
    if tier == "recompute" and (op_name == INPUT_OP or not layer.op_level):
        what = "a block's input" if op_name == INPUT_OP else f"block {layer.name!r}, profiled as a whole,"
        raise RatelConfigError(f"{placement_key(layer.name, op_name)!r} cannot be recomputed: {what} has to be stored")
    return tier


def recompute_ops(layer: LayerProfile, placement: Mapping[str, str]) -> set[str]:
    """The ops of ``layer`` that re-execute in backward.

    Every op with saved bytes placed ``"recompute"`` re-executes, and so, transitively, does each op whose output a
    re-executed op reads but that is not available: available outputs are ``"input"`` and those of ops with saved
    bytes placed on ``"device"``, ``"host"`` or ``"ssd"``.

    Args:
        layer: the block.
        placement: activation placement keyed by ``"<block>/<op>"``; missing ops count as ``"device"``.

    Returns:
        Names of the re-executed ops (never ``"input"``).

    Raises:
        RatelConfigError: a placement value is not a tier, ``"input"`` or a container block is placed
            ``"recompute"``, or an op reads a name that is not an op of the block.
    """
    ops = {op.name: op for op in layer.ops}
    tiers = {op.name: _tier(layer, op.name, placement) for op in layer.ops}

    def available(name: str) -> bool:
        if name == INPUT_OP:
            return True
        if name not in ops:
            raise RatelConfigError(f"an op of block {layer.name!r} reads {name!r}, which is not an op of the block")
        return ops[name].saved_bytes > 0 and tiers[name] in STORED_TIERS

    pending = [op.name for op in layer.ops if op.saved_bytes > 0 and tiers[op.name] == "recompute"]
    rerun = set(pending)
    while pending:
        for name in ops[pending.pop()].inputs:
            if name not in rerun and not available(name):
                rerun.add(name)
                pending.append(name)
    return rerun


def layer_cost(layer: LayerProfile, placement: Mapping[str, str]) -> LayerCost:
    """Bytes per tier and recompute seconds of one block under ``placement`` (see :func:`recompute_ops`)."""
    per_tier = dict.fromkeys(TIERS, 0)
    for op in layer.ops:
        per_tier[_tier(layer, op.name, placement)] += op.saved_bytes
    rerun = recompute_ops(layer, placement)
    # Summed in op order, not set order, so the same placement always predicts the same float.
    return LayerCost(per_tier, sum(op.forward_time for op in layer.ops if op.name in rerun))


def _seconds(amount: float, rate: float) -> float:
    """Time to move or process ``amount`` at ``rate``; nothing takes no time even where the rate is 0."""
    if amount == 0:
        return 0.0
    return amount / rate if rate > 0 else math.inf


def phase_time(resources: Mapping[str, float], *, unified: bool) -> float:
    """Seconds of one phase given its resources' busy seconds (``"recompute"`` is part of ``"compute"``)."""
    if unified:
        cores = sum(t for name, t in resources.items() if name not in ("ssd", "recompute"))
        return max(cores, resources.get("ssd", 0.0))
    return max(t for name, t in resources.items() if name != "recompute")


def bottleneck(resources: Mapping[str, float], *, unified: bool) -> str:
    """The resource that sets a phase's time; on unified memory ``"compute"`` stands for all work on the cores."""
    if unified:
        cores = sum(t for name, t in resources.items() if name not in ("ssd", "recompute"))
        return "ssd" if resources.get("ssd", 0.0) > cores else "compute"
    return max((name for name in resources if name != "recompute"), key=lambda name: resources[name])


class CostModel:
    """The placement-independent part of the model, computed once so a search can evaluate many placements cheaply.

    Args:
        hw: the machine.
        layers: the blocks.
        prefetch_depth: blocks paged in ahead of the one computing.
        state_read_bytes_per_param: optimizer-state bytes read from the SSD per trainable parameter and step.
        state_write_bytes_per_param: optimizer-state bytes written to the SSD per trainable parameter and step.
        host_static_bytes: host memory the rest of the run holds (parameter cache, optimizer buffers, ...).

    Raises:
        RatelConfigError: the profiles are inconsistent (see :func:`~lightning_ratel.plan.profile.validate_layers`)
            or ``prefetch_depth`` is negative.
    """

    def __init__(
        self,
        hw: HardwareProfile,
        layers: Sequence[LayerProfile],
        *,
        prefetch_depth: int = 1,
        state_read_bytes_per_param: int = 12,
        state_write_bytes_per_param: int = 12,
        host_static_bytes: int = 0,
    ) -> None:
        validate_layers(list(layers))
        if prefetch_depth < 0:
            raise RatelConfigError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        self.hw = hw
        self.layers = list(layers)
        self.prefetch_depth = prefetch_depth
        self.host_static_bytes = host_static_bytes
        self.buffers = prefetch_depth + 1
        param_bytes = sum(layer.param_bytes for layer in self.layers)
        numel = sum(layer.trainable_numel for layer in self.layers)
        self._forward_compute = sum(layer.forward_time for layer in self.layers)
        self._backward_compute = sum(layer.backward_time for layer in self.layers)
        self._forward_h2d = _seconds(param_bytes, hw.h2d_bandwidth)
        self._param_bytes = param_bytes
        self._backward_d2h = _seconds(sum(layer.grad_bytes for layer in self.layers), hw.d2h_bandwidth)
        self._state_ssd = (_seconds(numel * state_read_bytes_per_param, hw.ssd_read_bandwidth)
                           + _seconds(numel * state_write_bytes_per_param, hw.ssd_write_bandwidth))
        self._cpu_optimizer = _seconds(numel, hw.adam_params_per_s)
        self.largest_block = max(self.layers, key=lambda layer: layer.param_bytes, default=None)
        # A block's backward materialises all it saved (recomputed outputs included) next to its params and grads.
        self.working_block = max(self.layers, key=self._working_bytes, default=None)
        self.fixed_device_bytes = (self.buffers * (self.largest_block.param_bytes if self.largest_block else 0)
                                   + (self._working_bytes(self.working_block) if self.working_block else 0))

    @staticmethod
    def _working_bytes(layer: LayerProfile) -> int:
        return layer.param_bytes + layer.grad_bytes + layer.saved_bytes

    def memory(self, layer_bytes: Sequence[Mapping[str, int]], *, staging_reserve: int = 0) -> dict[str, int]:
        """Predicted peak bytes of ``"device"``, ``"host"`` and ``"ssd"``.

        Args:
            layer_bytes: each block's saved-activation bytes per tier.
            staging_reserve: host bytes to count for SSD staging at least (room a search keeps for later spills).
        """
        kept = sum(b["device"] for b in layer_bytes)
        ssd = sum(b["ssd"] for b in layer_bytes)
        # SSD traffic goes through host staging buffers, one block's worth per block in flight.
        staging = max(self.buffers * max((b["ssd"] for b in layer_bytes), default=0), staging_reserve)
        device = kept + self.fixed_device_bytes
        host = self.host_static_bytes + sum(b["host"] for b in layer_bytes) + staging
        if self.hw.unified_memory:
            host += device
            device = host
        return {"device": device, "host": host, "ssd": ssd}

    def evaluate(self, costs: Sequence[LayerCost]) -> Prediction:
        """The prediction for the blocks' costs (one per layer, in the order of ``layers``)."""
        hw = self.hw
        per_tier = {tier: sum(c.bytes[tier] for c in costs) for tier in TIERS}
        swapped = per_tier["host"] + per_tier["ssd"]
        recompute = sum(c.recompute_time for c in costs)
        forward = {
            "compute": self._forward_compute,
            "h2d": self._forward_h2d,
            "d2h": _seconds(swapped, hw.d2h_bandwidth),
            "ssd": _seconds(per_tier["ssd"], hw.ssd_write_bandwidth),
        }
        backward = {
            "compute": self._backward_compute + recompute,
            "recompute": recompute,
            "h2d": _seconds(self._param_bytes + swapped, hw.h2d_bandwidth),
            "d2h": self._backward_d2h,
            "ssd": _seconds(per_tier["ssd"], hw.ssd_read_bandwidth) + self._state_ssd,
            "cpu_optimizer": self._cpu_optimizer,
        }
        forward_time = phase_time(forward, unified=hw.unified_memory)
        backward_time = phase_time(backward, unified=hw.unified_memory)
        return Prediction(
            forward=forward,
            backward=backward,
            forward_time=forward_time,
            backward_time=backward_time,
            iteration_time=forward_time + backward_time,
            memory=self.memory([c.bytes for c in costs]),
            bytes=per_tier,
        )


def predict(
    hw: HardwareProfile,
    layers: Sequence[LayerProfile],
    placement: Mapping[str, str],
    *,
    prefetch_depth: int = 1,
    state_read_bytes_per_param: int = 12,
    state_write_bytes_per_param: int = 12,
    host_static_bytes: int = 0,
) -> Prediction:
    """Predict one micro-batch's times and memory under an activation placement.

    Args:
        hw: the machine.
        layers: the blocks in any order.
        placement: ``"<block>/<op>"`` -> tier; ops it does not mention count as ``"device"``.
        prefetch_depth: blocks paged in ahead of the one computing.
        state_read_bytes_per_param: optimizer-state bytes read from the SSD per trainable parameter (fp32 master and
            two moments: 12).
        state_write_bytes_per_param: optimizer-state bytes written back per trainable parameter.
        host_static_bytes: host memory the rest of the run holds.

    Returns:
        The prediction.

    Raises:
        RatelConfigError: inconsistent profiles or an invalid placement.
    """
    model = CostModel(hw, layers, prefetch_depth=prefetch_depth, state_read_bytes_per_param=state_read_bytes_per_param,
                      state_write_bytes_per_param=state_write_bytes_per_param, host_static_bytes=host_static_bytes)
    return model.evaluate([layer_cost(layer, placement) for layer in model.layers])
