"""Measure the machine the plan is made for: link and disk bandwidths, CPU AdamW speed, free memory.

Nothing here is assumed from a datasheet: each figure comes from a short transfer or kernel run on the actual device,
the actual ``ssd_paths`` (through a store that moves its chunks as the run's do) and the AdamW step the optimizer uses;
each figure is the median of several calls after an untimed one (:func:`median_time`). The probes are small (tens of
MiB), so together they cost well under a second on ordinary hardware; still, a short fit (a test, a tuner's trial, a
quick experiment) would spend much of its time on them. The speeds measured are kept per machine, device and filesystem
of the swap directories for :data:`CACHE_SECONDS` (in this process, and in :func:`cache_file` for the next), and free
capacities are always read afresh.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.runtime.adamw import GroupHyper, native_matches_torch
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.storage import TensorStore

CACHE_SECONDS = 24 * 3600
"""How long measured speeds are reused: long enough for a day's runs, short enough to follow a changed machine."""

PROBE_REPEATS = 5
"""Timed calls of each probe (after one untimed), of which the median counts (see :func:`median_time`)."""

PROBE_METHOD = 3
"""How the speeds are measured; part of what they are kept under, so speeds measured another way are not reused."""

UNALIGNED_OFFSET = 64
"""Bytes past a page where :func:`disk_bandwidth`'s unaligned writes start (torch's CPU allocator aligns to 64)."""

CACHE_ENV = "RATEL_HARDWARE_CACHE"
"""The file measured speeds are kept in across processes; empty: only within the process."""

BUSY_CPU_SHARE = 0.5
"""Of the CPU time its threads could have had, the least the AdamW probe must get for its speeds to be kept for other
processes: below it other work held the cores while it ran, and its rate (up to ten times too slow, seen on a GPU
machine whose tests ran beside it) would mislead every plan made from the cache for a day."""

# Measured speeds by cache key: (time measured, the profile's speed fields).
_measured: dict[str, tuple[float, dict[str, Any]]] = {}


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


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_device_memory(device: Device, host_free: int | None = None) -> int:
    """Bytes of ``device`` memory free now (on the CPU: the host's, ``host_free`` where already read)."""
    if device.is_cuda:
        return torch.cuda.mem_get_info(device.device)[0]
    return available_host_memory() if host_free is None else host_free


def best_time(run: Callable[[], object], repeats: int) -> float:
    """The least wall time of ``repeats`` calls of ``run``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def median_time(run: Callable[[], object], repeats: int = PROBE_REPEATS) -> float:
    """The median wall time of ``repeats`` calls of ``run``, after one more whose time is dropped (first touch of its
    memory, lazy initialisation, cold caches).

    A median, not the least: a speed the plan relies on should be what the machine gives most of the time, under the
    load it usually carries, and one lucky or unlucky call (a burst of other work) moves it little.
    """
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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

    return nbytes / median_time(h2d, repeats), nbytes / median_time(d2h, repeats)


def host_memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes/s of host DRAM traffic in a large host-to-host copy (each byte read once and written once)."""
    source = aligned_empty(nbytes, torch.uint8).fill_(1)
    target = aligned_empty(nbytes, torch.uint8).fill_(0)
    return 2 * nbytes / median_time(lambda: target.copy_(source), repeats)


def disk_bandwidth(paths: Sequence[str], nbytes: int = 64 << 20, name: str = "ratel-probe",
                   store_options: Mapping[str, int] | None = None, repeats: int = 3,
                   unaligned: bool = False) -> tuple[float, float]:
    """Read and write bytes/s of a :class:`TensorStore` striped over ``paths`` (direct I/O where supported), made
    with ``store_options`` (its ``stripe_bytes`` and ``io_threads_per_path``: the run's, which set how many requests
    each drive sees and how often a thread wakes).

    With ``unaligned`` the bytes start 64 bytes past a page, as a tensor torch allocated does: the store then moves
    them through its bounce buffers, as it writes activations on the CPU (only the write is timed; the read is 0).
    """
    # Huge pages like the buffers the store moves in training (they change direct I/O speed a lot).
    offset = UNALIGNED_OFFSET if unaligned else 0
    buf = aligned_empty(nbytes // 4 + offset // 4, torch.float32, huge=True).fill_(1.0)[offset // 4:]
    with TensorStore(paths, name=name, keep_files=False, **(store_options or {})) as store:
        store.reserve("probe", nbytes)
        store.preallocate()
        write = median_time(lambda: store.write("probe", buf).result(), repeats)
        if unaligned:
            return 0.0, nbytes / write
        read = median_time(lambda: store.read("probe", buf).result(), repeats)
    return nbytes / read, nbytes / write


def adam_throughput(step: Callable[..., None], numel: int = 1 << 22, repeats: int = PROBE_REPEATS,
                    threads: int = 1) -> tuple[float, float]:
    """Parameters per second of ``step`` (an AdamW step with the optimizer's signature) on fp32 states, and the share
    of the time its ``threads`` could have had on the cores that they got while it ran (process CPU time over wall
    time times ``threads``, at most 1): well below 1, other work held the cores."""
    # A generator of its own: drawing from the global one would change the user's data order and dropout masks.
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator)
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    hyper = GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)

    def run() -> None:
        step(master, grad, m, v, None, hyper, step=1)

    # Only the step's own calls count towards the share: making the states above runs on fewer threads.
    cpu, wall = time.process_time(), time.perf_counter()
    seconds = median_time(run, repeats)
    share = (time.process_time() - cpu) / max((time.perf_counter() - wall) * threads, 1e-9)
    return numel / seconds, min(1.0, share)


def measure_hardware(
    device: Device,
    ssd_paths: Sequence[str],
    adam_step: Callable[..., None],
    *,
    probe_bytes: int = 64 << 20,
    per_path: bool = True,
    threads: int | None = None,
    fresh: bool = False,
    name: str = "ratel-probe",
    store_options: Mapping[str, int] | None = None,
) -> HardwareProfile:
    """Profile the device link, the swap directories (together and, if several, each), the CPU AdamW and memory.

    Speeds measured on this machine for the same device, the same filesystems and the same AdamW threads in the last
    :data:`CACHE_SECONDS` are reused; free memory and disk space are read now.

    Args:
        device: the compute device.
        ssd_paths: the swap directories.
        adam_step: the AdamW step the CPU optimizer uses.
        probe_bytes: bytes moved by each bandwidth probe.
        per_path: also measure each directory alone when there are several.
        threads: the threads ``adam_step`` runs with (part of what the speeds are kept under).
        fresh: measure again even where speeds are kept.
        name: the probe's swap files' name (processes probing the same directories at once each need their own).
        store_options: how the run's swap stores move their chunks (``stripe_bytes``, ``io_threads_per_path`` of
            :class:`TensorStore`); the disk probes use the same.
    """
    options = dict(store_options or {})
    key = _cache_key(device, ssd_paths, probe_bytes, per_path, threads, options)
    speeds = None if fresh else _cached(key)
    if speeds is None:
        # The native kernel runs the optimizer's threads; torch's step (where the kernel does not match it) runs
        # torch's own pool.
        team = min(threads if threads and native_matches_torch() else torch.get_num_threads(), available_cores())
        speeds, cpu_share = _measure_speeds(device, ssd_paths, adam_step, probe_bytes, per_path, name, options, team)
        busy = cpu_share < BUSY_CPU_SHARE
        _remember(key, speeds, persist=not busy)
        if busy and cache_file() is not None:
            rank_zero_warn(
                f"RatelProfiler: other work held the CPU while its speed was measured (the optimizer's {team} "
                f"threads got {cpu_share:.0%} of the time they could have had): the plan of this run may underrate "
                f"the CPU optimizer, and the speeds measured are not kept for the next run.")
    speeds = dict(speeds)
    # Kept by position: the same filesystems under other directory names.
    speeds["per_path"] = dict(zip(map(str, ssd_paths), speeds["per_path"]))
    host_free = available_host_memory()
    device_free = free_device_memory(device, host_free)
    ssd_free = sum(shutil.disk_usage(p).free for p in {os.stat(p).st_dev: p for p in ssd_paths}.values())
    return HardwareProfile(**speeds, host_memory_free=host_free, device_memory_free=device_free, ssd_free=ssd_free)


def cache_file() -> Path | None:
    """Where measured speeds are kept across processes: ``$RATEL_HARDWARE_CACHE`` if set (empty: nowhere), else
    ``lightning_ratel/hardware.json`` in the user's cache directory."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_ratel" / "hardware.json"


def _cache_key(device: Device, ssd_paths: Sequence[str], probe_bytes: int, per_path: bool,
               threads: int | None, store_options: Mapping[str, int]) -> str:
    name = torch.cuda.get_device_name(device.device) if device.is_cuda else "cpu"
    # Separate memory tells a CPU that simulates CUDA's streams (tests) from one that does not.
    return json.dumps([socket.gethostname(), str(device.device), name, device.separate_memory,
                       [os.stat(p).st_dev for p in ssd_paths], probe_bytes, per_path, threads, torch.__version__,
                       sorted(store_options.items()), PROBE_METHOD])


def _cached(key: str) -> dict[str, Any] | None:
    entry = _measured.get(key)
    if entry is None:
        entry = _read_cache_file().get(key)
    if entry is None or time.time() - entry[0] > CACHE_SECONDS:
        return None
    _measured[key] = entry
    return entry[1]


def _read_cache_file() -> dict[str, tuple[float, dict[str, Any]]]:
    path = cache_file()
    if path is None:
        return {}
    try:
        entries = json.loads(path.read_text())
        return {k: (float(v[0]), dict(v[1])) for k, v in entries.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        # Missing, unreadable or from another version: measure (the cache is advice, never a reason to stop).
        return {}


def _remember(key: str, speeds: dict[str, Any], persist: bool = True) -> None:
    """Keep ``speeds`` in this process and, with ``persist``, in :func:`cache_file` for the next."""
    _measured[key] = (time.time(), speeds)
    path = cache_file()
    if path is None or not persist:
        return
    entries = {k: v for k, v in _read_cache_file().items() if time.time() - v[0] <= CACHE_SECONDS}
    entries[key] = _measured[key]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(entries))
        os.replace(partial, path)
    except OSError:
        # A read-only home directory: the speeds are kept in this process only.
        pass


def _measure_speeds(device: Device, ssd_paths: Sequence[str], adam_step: Callable[..., None], probe_bytes: int,
                    per_path: bool, name: str = "ratel-probe", store_options: Mapping[str, int] | None = None,
                    threads: int = 1) -> tuple[dict[str, Any], float]:
    """The fields of a :class:`HardwareProfile` that describe the machine's speeds (``per_path`` as a list in the
    order of ``ssd_paths``), and the share of its ``threads``' time the AdamW probe got on the cores (see
    :func:`adam_throughput`)."""
    adam, cpu_share = adam_throughput(adam_step, threads=threads)
    h2d, d2h = link_bandwidth(device, probe_bytes)
    read, write = disk_bandwidth(ssd_paths, probe_bytes, name, store_options)
    paths = []
    if per_path and len(ssd_paths) > 1:
        for path in ssd_paths:
            r, w = disk_bandwidth([path], probe_bytes, name, store_options)
            paths.append({"read": r, "write": w})
    return {
        # Where the CPU is the device its compute already stands for DRAM traffic; on a GPU machine the optimizer and
        # the transfers share it.
        "host_memory_bandwidth": host_memory_bandwidth() if device.is_cuda else 0.0,
        "device_type": device.device.type,
        "h2d_bandwidth": h2d,
        "d2h_bandwidth": d2h,
        "ssd_read_bandwidth": read,
        "ssd_write_bandwidth": write,
        # On the CPU activations go to the drives from where their ops put them, through the store's bounce buffers.
        "activation_write_bandwidth": (0.0 if device.separate_memory else
                                       disk_bandwidth(ssd_paths, probe_bytes, name, store_options, unaligned=True)[1]),
        "adam_params_per_s": adam,
        "per_path": paths,
    }, cpu_share
