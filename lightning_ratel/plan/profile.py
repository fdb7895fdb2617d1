"""Measured inputs of the planner: what each block computes and saves for backward, and (from
:mod:`lightning_ratel.hardware`) what the machine can move and compute.

The profiler fills these records from one instrumented step; the cost model and the search read them. Everything is
plain numbers (bytes, seconds, counts) so a plan can be computed, stored and tested without a device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.tiers import CONTAINER_OP, INPUT_OP, placement_key


@dataclass
class OpProfile:
    """One op of a block as the profiler saw it in forward.

    Attributes:
        name: the op's name inside its block, e.g. ``"self_attn.q_proj:mm"``; ``"input"`` is the block's inputs.
        forward_time: measured seconds (0 for ``"input"``).
        flops: floating-point operations of one execution.
        saved_bytes: bytes of this op's outputs that autograd saved for backward (deduplicated), parameters excluded.
        inputs: names of the ops of the same block whose outputs this op reads (``"input"`` allowed).
    """

    name: str
    forward_time: float
    flops: float
    saved_bytes: int
    inputs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpProfile:
        """The profile :meth:`to_dict` produced."""
        values = dict(data)
        values["inputs"] = list(values.get("inputs", []))
        return cls(**values)


@dataclass
class LayerProfile:
    """One block: the unit of parameter paging and of activation placement.

    Attributes:
        name: the block's module name, e.g. ``"model.layers.3"``.
        index: execution position (0 runs first in forward).
        forward_time: seconds for the whole block's forward.
        backward_time: seconds for the whole block's backward, without recompute.
        param_bytes: bytes of the compute copy paged to the device for each pass.
        grad_bytes: gradient bytes moved device->host per step.
        trainable_numel: parameters the CPU AdamW updates.
        ops: the block's ops in forward order.
        op_level: ``False`` for a block profiled as a whole: ``ops`` is one op named ``"*"`` holding everything the
            block saves, placed on ``"device"``, ``"host"`` or ``"ssd"`` but never recomputed.
        peak_device_bytes: measured peak device bytes while the block's backward runs (its parameters, gradients,
            everything it saved, rematerialized outputs and temporaries); 0 where not measured.
    """

    name: str
    index: int
    forward_time: float
    backward_time: float
    param_bytes: int
    grad_bytes: int
    trainable_numel: int
    ops: list[OpProfile]
    op_level: bool = True
    peak_device_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        """Bytes the block saves for backward, all ops together."""
        return sum(op.saved_bytes for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerProfile:
        """The profile :meth:`to_dict` produced."""
        values = dict(data)
        values["ops"] = [OpProfile.from_dict(op) for op in values["ops"]]
        return cls(**values)


def validate_layers(layers: list[LayerProfile]) -> None:
    """Check that the profiles describe blocks the planner can reason about.

    Args:
        layers: the profiled blocks.

    Raises:
        RatelConfigError: duplicate block or op names, negative sizes or times, a container block that is not a
            single ``"*"`` op, or an op reading something that is neither an op of its block nor ``"input"``.
    """
    seen_blocks: set[str] = set()
    for layer in layers:
        if layer.name in seen_blocks:
            raise RatelConfigError(f"block {layer.name!r} is profiled twice")
        seen_blocks.add(layer.name)
        numbers = (layer.forward_time, layer.backward_time, layer.param_bytes, layer.grad_bytes, layer.trainable_numel,
                   layer.peak_device_bytes)
        if min(numbers) < 0:
            raise RatelConfigError(f"block {layer.name!r} has a negative time or size in its profile")
        if not layer.op_level and [op.name for op in layer.ops] != [CONTAINER_OP]:
            raise RatelConfigError(f"block {layer.name!r} is profiled as a whole, so its only op must be named "
                                   f"{CONTAINER_OP!r}; got {[op.name for op in layer.ops]}")
        names = [op.name for op in layer.ops]
        if len(set(names)) != len(names):
            raise RatelConfigError(f"block {layer.name!r} has duplicate op names")
        known = set(names) | {INPUT_OP}
        for op in layer.ops:
            if op.saved_bytes < 0 or op.forward_time < 0:
                raise RatelConfigError(f"op {placement_key(layer.name, op.name)!r} has a negative time or size")
            unknown = [name for name in op.inputs if name not in known]
            if unknown:
                raise RatelConfigError(f"op {placement_key(layer.name, op.name)!r} reads {unknown}, which are not ops "
                                       f"of its block (outputs of other blocks arrive as {INPUT_OP!r})")
