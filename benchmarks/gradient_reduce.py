"""How fast ranks reduce gradient buckets onto an owner: gloo in host memory against NCCL on the GPUs.

RatelStrategy's gradient exchanges reduce fp32 buckets of up to 25 MiB onto each shard's owner: in host memory over
gloo (``gradient_exchange="window"`` or ``"micro_batch"``), or on the GPUs over NCCL (``"device"``, the choice on
GPUs). This runs ``--ranks`` processes (one per GPU for NCCL) that reduce ``--mib`` MiB buckets onto rank 0, as the
exchanges do (``dist.reduce``, ``async_op=True``, two in flight), and prints each backend's GiB/s of buckets reduced,
and NCCL's over gloo's where both ran. Without as many GPUs as ranks only gloo runs.

    python benchmarks/gradient_reduce.py --ranks 2 --mib 25 --buckets 20
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, args: argparse.Namespace, init: str, results: dict) -> None:
    backend = args.backend
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=args.ranks)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    buffers = [torch.ones(args.mib * 2**20 // 4, device=device) for _ in range(2)]
    seconds = []
    for _ in range(args.repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        pending = []
        for i in range(args.buckets):
            if len(pending) == 2:
                pending.pop(0).wait()
            buffer = buffers[i % 2]
            buffer.mul_(1.0 / args.ranks)
            pending.append(dist.reduce(buffer, dst=0, op=dist.ReduceOp.SUM, async_op=True))
        for work in pending:
            work.wait()
        if backend == "nccl":
            torch.cuda.synchronize(device)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        # The first round makes the connections: not counted.
        results[backend] = sorted(seconds[1:])[len(seconds[1:]) // 2]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes reducing onto rank 0 (default 2)")
    parser.add_argument("--mib", type=int, default=25, help="MiB of fp32 gradients a bucket holds (default 25)")
    parser.add_argument("--buckets", type=int, default=20, help="buckets each round reduces (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, the median reported (default 3)")
    args = parser.parse_args()
    backends = ["gloo"]
    if torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks and dist.is_nccl_available():
        backends.append("nccl")
    gib = args.buckets * args.mib / 1024
    with mp.Manager() as manager:
        results = manager.dict()
        for backend in backends:
            args.backend = backend
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(_worker, args=(args, f"file://{os.path.join(tmp, 'init')}", results),
                                   nprocs=args.ranks, join=True, start_method="spawn")
        found = dict(results)
    for backend in backends:
        where = "GPUs" if backend == "nccl" else "host memory"
        print(f"{backend} ({where}): {args.buckets} buckets of {args.mib} MiB onto rank 0 of {args.ranks} in "
              f"{found[backend]:.3f} s: {gib / found[backend]:.2f} GiB/s")
    if "nccl" in found:
        print(f"nccl over gloo: {found['gloo'] / found['nccl']:.1f}x the reduce rate")
    else:
        print(f"nccl: not run (it needs {args.ranks} GPUs, this machine has {torch.cuda.device_count()})")


if __name__ == "__main__":
    main()
