"""What the machine one model trains on can move and compute: measured by :mod:`lightning_ratel.runtime.probe`, read by
the planner (:mod:`lightning_ratel.plan`). Plain numbers, so neither side depends on the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class HardwareProfile:
    """Measured speeds and free capacities of the machine one model trains on.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"``.
        h2d_bandwidth: bytes/s host->device from pinned memory; on cpu the measured memcpy bandwidth.
        d2h_bandwidth: bytes/s device->host.
        ssd_read_bandwidth: bytes/s, striped over all swap directories.
        ssd_write_bandwidth: bytes/s, striped over all swap directories.
        adam_params_per_s: parameters per second the CPU AdamW kernel in use updates.
        host_memory_free: bytes of host memory available to the run.
        device_memory_free: bytes of device memory available to the run (on cpu: the same as host).
        ssd_free: bytes free on the swap directories, summed.
        per_path: swap directory -> ``{"read": bytes/s, "write": bytes/s}``.
        host_io_bandwidth: bytes/s the host side of PCIe moves in each direction, the GPU link and the SSDs together
            (where they share a root complex or switch uplink, their traffic contends there); 0: not a limit.
        host_memory_bandwidth: bytes/s of host DRAM, shared by the CPU optimizer and every transfer into or out of
            host memory; 0: not a limit.
        activation_write_bandwidth: bytes/s the swap files take activations at where they are written from the
            memory their ops allocated, not page-aligned, through the store's bounce buffers (the CPU as the device;
            a GPU's activations reach the drives from the host pool, aligned); 0: ``ssd_write_bandwidth``.
    """

    device_type: str
    h2d_bandwidth: float
    d2h_bandwidth: float
    ssd_read_bandwidth: float
    ssd_write_bandwidth: float
    adam_params_per_s: float
    host_memory_free: int
    device_memory_free: int
    ssd_free: int = 0
    per_path: dict[str, dict[str, float]] = field(default_factory=dict)
    host_io_bandwidth: float = 0.0
    host_memory_bandwidth: float = 0.0
    activation_write_bandwidth: float = 0.0

    @property
    def unified_memory(self) -> bool:
        """Whether "device" and "host" are one RAM and copies run on the compute cores (``device_type == "cpu"``)."""
        return self.device_type == "cpu"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """The profile :meth:`to_dict` produced."""
        values = dict(data)
        values["per_path"] = {path: dict(bw) for path, bw in values.get("per_path", {}).items()}
        return cls(**values)
