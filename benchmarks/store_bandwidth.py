"""Bandwidth of the swap store against raw sequential direct I/O on the same directories, with and without checksums.

TensorStore writes and then reads ``--size-gib`` of data cut into ~64 MiB tensors, the size of model-state shards,
all requests in flight at once. The baseline is ``dd`` with ``O_DIRECT`` on the same directories in the same run, one
``dd`` per directory in parallel. Direct I/O keeps the page cache out of both measurements, so no root is needed to
drop it; the output says whether the store really used direct I/O.

The store runs ``--repeats`` times with chunk checksums (``verify=True``, the default) and as often without,
alternating, and the best time of each is compared: the ratio is what verification costs in throughput. Each run also
reads everything once more into memory allocated for that read (huge pages, as the read-backs of swapped activations
were until they came from the device's host pool): against reads into the reused tensors, what fresh memory costs.

Run from the repository root (or anywhere once the package is installed)::

    python -m benchmarks.store_bandwidth --paths /mnt/nvme0/ratel /mnt/nvme1/ratel --size-gib 4
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.storage import TensorStore

MIB = 1 << 20
GIB = 1 << 30
DD_BLOCK = 16 * MIB
STORE_NAME = "ratel-bench"
DD_FILE = "ratel-bench-dd.bin"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", type=Path, help="swap directories (default: a temporary directory here)")
    parser.add_argument("--size-gib", type=float, default=4.0, help="data written and read back (default 4)")
    parser.add_argument("--stripe-mib", type=int, default=1, help="stripe size of the store (default 1)")
    parser.add_argument("--threads-per-path", type=int, default=4, help="I/O threads per directory (default 4)")
    parser.add_argument("--shard-mib", type=int, default=64, help="size of each tensor (default 64)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of the store with and without checksums (default 2)"
    )
    return parser.parse_args(argv)


def timed(action: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds and CPU seconds of this process (all threads) that ``action`` took."""
    start, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - start, time.process_time() - cpu


def fsync_files(paths: Sequence[Path]) -> None:
    """Flush file data and metadata, as ``dd conv=fsync`` does, so both sides measure durable writes."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_shards(total_bytes: int, shard_bytes: int) -> list[torch.Tensor]:
    """Allocate the tensors once and fill them, so page faults stay out of the timed region."""
    shards = []
    for index, offset in enumerate(range(0, total_bytes, shard_bytes)):
        numel = min(shard_bytes, total_bytes - offset) // 4
        # Huge pages, as the engine's long-lived state buffers have.
        shard = aligned_empty(numel, torch.float32, huge=True)
        shard.fill_(float(index))
        shards.append(shard)
    return shards


def bench_store(
    paths: Sequence[Path], shards: list[torch.Tensor], args: argparse.Namespace, verify: bool
) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float], bool]:
    """Wall and CPU seconds to write every shard, to read it back into its tensor and into fresh memory, and whether
    direct I/O was in use."""
    with TensorStore(
        paths, name=STORE_NAME, stripe_bytes=args.stripe_mib * MIB, io_threads_per_path=args.threads_per_path,
        verify=verify,
    ) as store:
        for index, shard in enumerate(shards):
            store.reserve(f"shard{index}", shard.numel() * shard.element_size())
        # Training preallocates its swap files, so the measured writes go to allocated space as they would there.
        store.preallocate()
        swap_files = [path / f"{STORE_NAME}.swap" for path in store.paths]

        def write_all() -> None:
            for future in [store.write(f"shard{i}", shard) for i, shard in enumerate(shards)]:
                future.result()
            fsync_files(swap_files)

        fresh: list[torch.Tensor] = []

        def read_all() -> None:
            for future in [store.read(f"shard{i}", shard) for i, shard in enumerate(shards)]:
                future.result()

        def read_fresh() -> None:
            targets = [aligned_empty(shard.numel(), shard.dtype, huge=True) for shard in shards]
            fresh.extend(future.result() for future in [store.read(f"shard{i}", t) for i, t in enumerate(targets)])

        write = timed(write_all)
        for shard in shards:
            shard.zero_()
        read = timed(read_all)
        read_new = timed(read_fresh)
        for index, (shard, copy) in enumerate(zip(shards, fresh)):
            if any(t[0].item() != index or t[-1].item() != index for t in (shard, copy)):
                raise RuntimeError(f"shard {index} read back wrong data")
        return write, read, read_new, store.direct


def run_parallel(commands: list[list[str]]) -> tuple[float, str | None]:
    """Run the commands at once; returns the wall time and the first error output, if any failed."""
    start = time.perf_counter()
    processes = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True) for command in commands]
    results = [(process.wait(), process.stderr.read()) for process in processes]
    seconds = time.perf_counter() - start
    for process in processes:
        process.stderr.close()
    failures = [f"{' '.join(command)}: {error.strip()}" for command, (code, error) in zip(commands, results) if code]
    return seconds, failures[0] if failures else None


def bench_dd(paths: Sequence[Path], total_bytes: int) -> tuple[float | None, float | None, int, str | None]:
    """Seconds for the parallel dd write and read (None where dd failed), the bytes moved, and any error."""
    count = max(1, math.ceil(total_bytes / len(paths) / DD_BLOCK))
    files = [path / DD_FILE for path in paths]
    moved = count * DD_BLOCK * len(paths)
    try:
        write = ["oflag=direct", "conv=fsync", f"bs={DD_BLOCK}", f"count={count}", "status=none"]
        write_seconds, error = run_parallel([["dd", "if=/dev/zero", f"of={file}", *write] for file in files])
        if error:
            return None, None, moved, error
        read_seconds, error = run_parallel(
            [["dd", f"if={file}", "of=/dev/null", f"bs={DD_BLOCK}", "iflag=direct", "status=none"] for file in files]
        )
        return write_seconds, (None if error else read_seconds), moved, error
    finally:
        for file in files:
            file.unlink(missing_ok=True)


def rate(nbytes: int, seconds: float | None) -> float | None:
    return None if seconds is None else nbytes / seconds / 1e9


def show(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console()
    if shutil.which("dd") is None:
        raise SystemExit("dd is needed for the baseline but is not on PATH")
    own_directory = None
    if args.paths:
        paths = [path.resolve() for path in args.paths]
    else:
        own_directory = Path(tempfile.mkdtemp(prefix="ratel-bench-", dir=os.getcwd()))
        paths = [own_directory]
    total_bytes = int(args.size_gib * GIB) // 4096 * 4096
    shard_bytes = args.shard_mib * MIB
    # Per verify setting: the best (wall, CPU) seconds of the writes, the reads and the reads into fresh memory.
    best = {verify: [(math.inf, math.inf)] * 3 for verify in (True, False)}
    try:
        shards = make_shards(total_bytes, shard_bytes)
        for repeat in range(args.repeats):
            # Alternating (and swapping which goes first) spreads slow phases of a shared machine over both.
            for verify in (True, False) if repeat % 2 == 0 else (False, True):
                *seconds, direct = bench_store(paths, shards, args, verify)
                best[verify] = [min(old, new) for old, new in zip(best[verify], seconds)]
        del shards
        dd_write, dd_read, dd_bytes, dd_error = bench_dd(paths, total_bytes)
    finally:
        if own_directory is not None:
            shutil.rmtree(own_directory, ignore_errors=True)

    console.print(f"directories: {', '.join(str(path) for path in paths)}")
    console.print(
        f"data: {total_bytes / GIB:.2f} GiB in {math.ceil(total_bytes / shard_bytes)} tensors of up to "
        f"{args.shard_mib} MiB; stripe {args.stripe_mib} MiB; {args.threads_per_path} I/O threads per directory"
    )
    console.print(f"TensorStore direct I/O (O_DIRECT): {'active' if direct else 'NOT active (page cache in use)'}")
    if not direct:
        console.print("[yellow]Without direct I/O the read figure can come from the page cache, not the drive.")
    if dd_error:
        console.print(f"[red]dd baseline failed: {dd_error}")

    # Store with checksums (verify) and without; dd is raw O_DIRECT on the same directories.
    table = Table(title=f"TensorStore bandwidth (GB/s = 10^9 bytes/s), best of {args.repeats}")
    table.add_column("operation")
    table.add_column("verify GB/s", justify="right")
    table.add_column("no verify GB/s", justify="right")
    table.add_column("verify / no verify", justify="right")
    table.add_column("dd GB/s", justify="right")
    table.add_column("verify / dd", justify="right")
    for index, (operation, dd_seconds) in enumerate((("write", dd_write), ("read", dd_read))):
        checked = rate(total_bytes, best[True][index][0])
        unchecked = rate(total_bytes, best[False][index][0])
        raw = rate(dd_bytes, dd_seconds)
        table.add_row(
            operation, show(checked), show(unchecked), show(checked / unchecked, 3), show(raw),
            show(None if raw is None else checked / raw),
        )
    console.print(table)
    # CPU time depends less on what else the machine runs than wall time does.
    gib = total_bytes / GIB
    for index, operation in enumerate(("write", "read")):
        console.print(
            f"{operation}: CPU seconds per GiB (all threads, in the fastest run) verify "
            f"{best[True][index][1] / gib:.3f}, no verify {best[False][index][1] / gib:.3f}"
        )
    reused, fresh = best[True][1], best[True][2]
    console.print(
        f"read into fresh memory (verify): {show(rate(total_bytes, fresh[0]))} GB/s, CPU seconds per GiB "
        f"{fresh[1] / gib:.3f}; against reads into reused memory, wall {show(fresh[0] / reused[0])}x, "
        f"CPU {show(fresh[1] / reused[1])}x"
    )


if __name__ == "__main__":
    main()
