"""Measure the machine the plan is made for: link and disk bandwidths, CPU AdamW speed, free memory.

Nothing here is assumed from a datasheet: each figure comes from a short transfer or kernel run on the actual device,
the actual ``ssd_paths`` and the AdamW step the optimizer uses. The probes are small (tens of MiB), so together they
cost well under a second on ordinary hardware.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence

import torch

from lightning_ratel.plan.profile import HardwareProfile
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.storage import TensorStore


def available_host_memory() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` (memory the kernel can hand out, page cache included)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def best_time(run: Callable[[], object], repeats: int) -> float:
    """The least wall time of ``repeats`` calls of ``run``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def link_bandwidth(device: Device, nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, float]:
    """Host->device and device->host bytes/s (pinned host memory on CUDA, a memory copy on CPU)."""
    host = device.host_empty(nbytes, torch.uint8).fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device.device).fill_(1)

    def h2d() -> None:
        target.copy_(host, non_blocking=True)
        device.synchronize()

    def d2h() -> None:
        if device.is_cuda:
            host.copy_(target, non_blocking=True)
            device.synchronize()
        else:
            # A copy into a freshly allocated aligned buffer, first touch included. The activation cache no longer
            # makes this copy on CPU (host-tier tensors stay where they are, ssd-tier ones are written from their own
            # memory), so on CPU this over-prices those tiers; the cost model still charges it.
            aligned_empty(nbytes, torch.uint8).copy_(target)

    return nbytes / best_time(h2d, repeats), nbytes / best_time(d2h, repeats)


def host_memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 2) -> float:
    """Bytes/s of host DRAM traffic in a large host-to-host copy (each byte read once and written once)."""
    source = aligned_empty(nbytes, torch.uint8).fill_(1)
    target = aligned_empty(nbytes, torch.uint8).fill_(0)
    return 2 * nbytes / best_time(lambda: target.copy_(source), repeats)


def disk_bandwidth(paths: Sequence[str], nbytes: int = 64 << 20, name: str = "ratel-probe") -> tuple[float, float]:
    """Read and write bytes/s of a :class:`TensorStore` striped over ``paths`` (direct I/O where supported)."""
    # Huge pages like the buffers the store moves in training (they change direct I/O speed a lot).
    buf = aligned_empty(nbytes // 4, torch.float32, huge=True).fill_(1.0)
    with TensorStore(paths, name=name, keep_files=False) as store:
        store.reserve("probe", nbytes)
        store.preallocate()
        store.write("probe", buf).result()
        write = best_time(lambda: store.write("probe", buf).result(), 2)
        read = best_time(lambda: store.read("probe", buf).result(), 2)
    return nbytes / read, nbytes / write


def adam_throughput(step: Callable[..., None], numel: int = 1 << 22, repeats: int = 3) -> float:
    """Parameters per second of ``step`` (an AdamW step with the optimizer's signature) on fp32 states."""
    # A generator of its own: drawing from the global one would change the user's data order and dropout masks.
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator)
    m = torch.zeros(numel)
    v = torch.zeros(numel)

    def run() -> None:
        step(master, grad, m, v, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)

    run()
    return numel / best_time(run, repeats)


def measure_hardware(
    device: Device,
    ssd_paths: Sequence[str],
    adam_step: Callable[..., None],
    *,
    probe_bytes: int = 64 << 20,
    per_path: bool = True,
) -> HardwareProfile:
    """Profile the device link, the swap directories (together and, if several, each), the CPU AdamW and memory.

    Args:
        device: the compute device.
        ssd_paths: the swap directories.
        adam_step: the AdamW step the CPU optimizer uses.
        probe_bytes: bytes moved by each bandwidth probe.
        per_path: also measure each directory alone when there are several.
    """
    h2d, d2h = link_bandwidth(device, probe_bytes)
    read, write = disk_bandwidth(ssd_paths, probe_bytes)
    paths: dict[str, dict[str, float]] = {}
    if per_path and len(ssd_paths) > 1:
        for path in ssd_paths:
            r, w = disk_bandwidth([path], probe_bytes)
            paths[str(path)] = {"read": r, "write": w}
    host_free = available_host_memory()
    device_free = torch.cuda.mem_get_info(device.device)[0] if device.is_cuda else host_free
    ssd_free = sum(shutil.disk_usage(p).free for p in {os.stat(p).st_dev: p for p in ssd_paths}.values())
    return HardwareProfile(
        # Where the CPU is the device its compute already stands for DRAM traffic; on a GPU machine the optimizer and
        # the transfers share it.
        host_memory_bandwidth=host_memory_bandwidth() if device.is_cuda else 0.0,
        device_type=device.device.type,
        h2d_bandwidth=h2d,
        d2h_bandwidth=d2h,
        ssd_read_bandwidth=read,
        ssd_write_bandwidth=write,
        adam_params_per_s=adam_throughput(adam_step),
        host_memory_free=host_free,
        device_memory_free=device_free,
        ssd_free=ssd_free,
        per_path=paths,
    )
