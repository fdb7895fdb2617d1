"""Cost per parameter of the CPU optimizer's generic path against torch's own CPU step of the same optimizer.

The generic path (:class:`lightning_ratel.runtime.generic.GenericUpdate`) runs any per-parameter optimizer on a shard:
views of the flat fp32 master and gradient shaped as the parameters, the state loaded as views of the shard's state
record (Python numbers decoded), a scratch instance of the optimizer stepped, and the state written back into the
record. This script times that against ``optimizer.step()`` on ordinary parameters holding the same values, in the same
process, for two shards: a few large parameters (where the arithmetic dominates) and many small ones (where the
per-parameter Python work does). Store I/O is not included: it is the same bytes as the state itself.

Run from the repository root::

    python -m benchmarks.generic_optimizer              # 1 thread, as the engine's optimizer worker on a CPU run
    python -m benchmarks.generic_optimizer --threads 2 --iters 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from transformers.optimization import Adafactor

from lightning_ratel.runtime.generic import GenericUpdate, group_settings, probe_states
from lightning_ratel.runtime.units import Shard, ShardParam, Unit

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD (momentum, nesterov)": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
    "RMSprop (centered)": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
    "Adam (amsgrad)": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-3),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-3),
    "AdamW (generic path)": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "Adafactor": lambda p: Adafactor(p, lr=None),
}
SHARDS = {"4 x 1024x1024": [(1024, 1024)] * 4, "256 x 64x64": [(64, 64)] * 256}


def _shard(shapes: list[tuple[int, ...]], params: list[nn.Parameter]) -> Shard:
    sizes = [torch.Size(s).numel() for s in shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    numel = sum(sizes)
    unit = Unit(0, (), {torch.float32: numel})
    entries = tuple(ShardParam(f"p{i}", p, i, o, n, torch.Size(s))
                    for i, (p, o, n, s) in enumerate(zip(params, offsets, sizes, shapes)))
    return Shard(0, unit, 0, torch.float32, 0, entries, numel)


def _paired(first: Callable[[], None], second: Callable[[], None], iters: int) -> tuple[float, float]:
    """Median seconds of each, timed alternately so that drift in the machine's load (shared cores) hits both."""
    first()
    second()
    a, b = [], []
    for _ in range(iters):
        for run, samples in ((first, a), (second, b)):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def measure(make: Callable[[Any], torch.optim.Optimizer], shapes: list[tuple[int, ...]], iters: int
            ) -> tuple[float, float, int]:
    """Seconds per step of torch's own step and of the generic path on the same shard, and its elements."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    params = [nn.Parameter(v.clone()) for v in values]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    own = make(params)

    shard = _shard(shapes, params)
    layouts = {(0, tuple(s)): probe_states(type(own), dict(own.defaults), group_settings(own)[0], tuple(s))
               for s in set(shapes)}
    update = GenericUpdate(own, [shard], layouts)
    master = torch.cat([v.reshape(-1) for v in values])
    grad = torch.cat([g.reshape(-1) for g in grads])
    blob = torch.zeros(update.nbytes(shard), dtype=torch.uint8)
    positions = list(range(len(shapes)))
    settings = group_settings(own)[0]
    first = [True]

    def generic() -> None:
        update.update(shard, master, grad, blob, positions, [first[0]] * len(positions), settings)
        first[0] = False

    torch_seconds, generic_seconds = _paired(own.step, generic, iters)
    return torch_seconds, generic_seconds, shard.numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the engine's worker uses 1 on a CPU run)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per measurement (the median is shown)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    table = Table(title=f"Generic CPU optimizer path vs torch's own step (torch {torch.__version__}, "
                        f"{args.threads} thread(s), median of {args.iters})")
    for column in ("optimizer", "shard", "torch ns/param", "generic ns/param", "generic / torch"):
        table.add_column(column, justify="left" if column in ("optimizer", "shard") else "right")
    for name, make in OPTIMIZERS.items():
        for shard_name, shapes in SHARDS.items():
            torch_s, generic_s, numel = measure(make, shapes, args.iters)
            table.add_row(name, shard_name, f"{torch_s / numel * 1e9:.2f}", f"{generic_s / numel * 1e9:.2f}",
                          f"{generic_s / torch_s:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
