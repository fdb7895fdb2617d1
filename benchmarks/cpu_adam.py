"""Throughput of lightning_ratel's fused host-side AdamW step against torch's and DeepSpeed's CPU optimizers.

Every contender does the same job per step on fp32 master weights: take a bf16 gradient, update the weights and both
fp32 moments, and leave a bf16 copy of the new weights for the next upload to the GPU. The fused kernel does all of
it in one pass over memory; the others upcast the gradient into an fp32 ``.grad`` first and copy the weights down
afterwards, and those casts are timed with the step.

Where torch takes its float32 sqrt from MKL, the kernel calls that same function chunk by chunk to give torch's numbers
bit for bit (what the engine uses); a second row then times the kernel with the IEEE sqrt instruction in a single
fused pass, which is faster but not torch's numbers there, so the table shows what exactness costs.

Run from the repository root::

    python -m benchmarks.cpu_adam                 # 100M parameters, all CPUs this process may use
    python -m benchmarks.cpu_adam --numel 10_000_000 --iters 5 --threads 1 --isa avx2
    python -m benchmarks.cpu_adam --slots         # also the update of states kept in two slots, both ways

With ``--slots`` two more rows time a shard's update as the optimizer runs it on states in host memory, which keep
the committed step's master and moments in one slot and write the next step's into the other: copying the committed
slot into the other first and stepping there in place, or reading one slot and writing the other in the kernel's
single pass (same numbers, 12 bytes per parameter less read and written). Two more time that update as the swap store
needs it, with a checksum of every 4096 bytes written: added up by the kernel while the values are in registers (what
the optimizer does), or taken afterwards by one thread over the written states with xxHash, as the store's I/O thread
did before the kernel computed them.

DeepSpeedCPUAdam joins the table when ``import deepspeed`` works (it JIT-compiles its op with ninja on first use);
otherwise the table says why it was skipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import xxhash
from rich.console import Console
from rich.table import Table

from lightning_ratel.runtime import adamw as ops
from lightning_ratel.runtime import checksum

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01
HYPER = ops.GroupHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=True)
"""The step's hyperparameters as the native kernel takes them (AdamW)."""
# Bytes per checksum of the store's chunks (a GPU run's stripe); the hashing's cost hardly depends on it.
STORE_STRIPE = 1 << 20

Step = Callable[[], None]
MakeOptimizer = Callable[[torch.nn.Parameter], torch.optim.Optimizer]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _filled(numel: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    # Written once here so that no contender pays for first-touch page faults inside the timed loop.
    return torch.randn(numel, generator=generator).to(dtype)


def fused_step(grad: torch.Tensor, threads: int, ieee_sqrt: bool) -> Step:
    """The whole job as one ``fused_adamw_`` call, with torch's sqrt or (``ieee_sqrt``) the IEEE instruction."""
    param = _filled(grad.numel(), torch.float32, torch.Generator().manual_seed(1))
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    out = torch.zeros_like(grad)
    step = 0

    def run() -> None:
        nonlocal step
        step += 1
        ops.set_native_sqrt(ieee_sqrt)
        ops.fused_adamw_(param, grad, exp_avg, exp_avg_sq, out, HYPER, step=step, num_threads=threads)

    return run


def slot_step(grad: torch.Tensor, threads: int, copy_first: bool, checksums: str | None = None) -> Step:
    """The job on states in two slots, each step reading the slot the last one wrote and writing the other: after a
    copy of master and moments into that slot (``copy_first``, torch's parallel copy), or from the kernel's sources;
    with ``checksums`` ``"kernel"`` the kernel also returns the written states' block checksums, with ``"after"`` one
    thread takes xxHash's of the written states once it is done."""
    slots = [[_filled(grad.numel(), torch.float32, torch.Generator().manual_seed(1)),
              torch.zeros(grad.numel()), torch.zeros(grad.numel())] for _ in range(2)]
    out = torch.zeros_like(grad)
    sums = torch.zeros((3, -(-grad.numel() * 4 // checksum.BLOCK_BYTES)), dtype=torch.int64)
    views = [[memoryview(state.view(torch.uint8).numpy()) for state in slot] for slot in slots]
    step = 0

    def run() -> None:
        nonlocal step
        step += 1
        source, target = slots[(step + 1) % 2], slots[step % 2]
        ops.set_native_sqrt(False)
        if copy_first:
            torch._foreach_copy_(target, source)
            ops.fused_adamw_(target[0], grad, target[1], target[2], out, HYPER, step=step, num_threads=threads)
        else:
            ops.fused_adamw_(target[0], grad, target[1], target[2], out, HYPER, step=step, num_threads=threads,
                             param_src=source[0], exp_avg_src=source[1], exp_avg_sq_src=source[2],
                             sums=sums if checksums == "kernel" else None)
        if checksums == "after":
            for view in views[step % 2]:
                for start in range(0, len(view), STORE_STRIPE):
                    xxhash.xxh3_64_intdigest(view[start : start + STORE_STRIPE])

    return run


def optimizer_step(grad: torch.Tensor, make: MakeOptimizer) -> Step:
    """The same job around a ``torch.optim.Optimizer``: upcast the gradient, step, copy the weights down."""
    param = torch.nn.Parameter(_filled(grad.numel(), torch.float32, torch.Generator().manual_seed(1)))
    param.grad = torch.zeros_like(param)
    out = torch.zeros_like(grad)
    optimizer = make(param)

    def run() -> None:
        param.grad.copy_(grad)
        optimizer.step()
        with torch.no_grad():
            out.copy_(param)

    return run


def torch_adamw(**kwargs) -> MakeOptimizer:
    return lambda p: torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kwargs)


def deepspeed_adam() -> tuple[MakeOptimizer | None, str]:
    """DeepSpeedCPUAdam in AdamW mode, or why it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # Building the op is the step that fails without ninja or a compiler, so do it now, untimed.
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])
    except Exception as err:  # noqa: BLE001 - any failure to import or build means "not available here"
        return None, f"skipped: {type(err).__name__}: {err}"
    return (
        lambda p: DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    ), ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=lambda s: int(s.replace("_", "")), default=100_000_000)
    parser.add_argument("--iters", type=int, default=9, help="timed steps per contender; the median is reported")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for everyone")
    parser.add_argument("--isa", choices=("avx512", "avx2", "scalar"), help="force the fused kernel's code path")
    parser.add_argument("--skip-deepspeed", action="store_true")
    parser.add_argument("--slots", action="store_true", help="also time two-slot updates: copy + in place, or not")
    args = parser.parse_args()
    if args.isa and not (ops.NATIVE_AVAILABLE and ops._C.set_isa(args.isa)):
        parser.error(f"--isa {args.isa} is not available here (native kernel: {ops.isa()})")

    # torch and DeepSpeed both take their thread count from the OpenMP setting this makes.
    torch.set_num_threads(args.threads)
    grad = _filled(args.numel, torch.bfloat16, torch.Generator().manual_seed(0))

    if not ops.NATIVE_AVAILABLE:
        parser.error("lightning_ratel._C is not built; run `python setup.py build_ext --inplace` first")
    exact = ops.native_matches_torch()
    torch_sqrt = bool(ops.torch_vml_sqrt()[0])
    names = [
        f"lightning_ratel fused_adamw_ ({ops.isa()}, torch's sqrt)",
        "torch AdamW(fused=True) + casts",
        "torch AdamW(foreach=False) + casts",
        "DeepSpeedCPUAdam + casts",
    ]
    notes = [
        ("MKL vmsSqrt per chunk" if torch_sqrt else "IEEE sqrt, one pass") + f"; bitwise torch: {exact}",
        "",
        "torch.optim's CPU default",
        "",
    ]
    steps: list[Step | None] = [
        fused_step(grad, args.threads, ieee_sqrt=False),
        optimizer_step(grad, torch_adamw(fused=True)),
        optimizer_step(grad, torch_adamw(foreach=False)),
        None,
    ]
    if args.skip_deepspeed:
        notes[3] = "skipped: --skip-deepspeed"
    else:
        make, notes[3] = deepspeed_adam()
        if make is not None:
            steps[3] = optimizer_step(grad, make)
    if torch_sqrt:
        names.append(f"lightning_ratel fused_adamw_ ({ops.isa()}, IEEE sqrt)")
        notes.append("one pass; not torch's numbers here")
        steps.append(fused_step(grad, args.threads, ieee_sqrt=True))
    ieee_row = len(steps) - 1
    if args.slots:
        names += [f"fused_adamw_ ({ops.isa()}), two slots: copy, then in place",
                  f"fused_adamw_ ({ops.isa()}), two slots: one slot into the other"]
        notes += ["12 B/param more read and written", "same numbers, no copy"]
        steps += [slot_step(grad, args.threads, copy_first=True), slot_step(grad, args.threads, copy_first=False)]
        names += [f"fused_adamw_ ({ops.isa()}), one slot into the other, checksums by the kernel",
                  f"fused_adamw_ ({ops.isa()}), one slot into the other, then xxHash of the states"]
        notes += ["the optimizer's update for the swap store", "the store's I/O thread before: one thread"]
        steps += [slot_step(grad, args.threads, copy_first=False, checksums="kernel"),
                  slot_step(grad, args.threads, copy_first=False, checksums="after")]

    # Contenders take turns within each round, so drifting machine load (other tenants, memory bandwidth) hits
    # them alike instead of whichever happened to run during a slow spell.
    for _ in range(args.warmup):
        for step in steps:
            if step is not None:
                step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(args.iters):
        for step, record in zip(steps, times):
            if step is not None:
                start = time.perf_counter()
                step()
                record.append(time.perf_counter() - start)
    seconds = [statistics.median(t) if t else None for t in times]

    torch_seconds, deepspeed_seconds = seconds[1], seconds[3]
    table = Table(
        title=f"AdamW step, {args.numel:,} fp32 params, bf16 grad in, bf16 copy out; {args.threads} threads, "
        f"median of {args.iters}",
        caption=f"{_cpu_name()}; torch {torch.__version__}",
    )
    for column in ("contender", "s / step", "params / s", "vs torch fused", "vs DeepSpeed", "note"):
        table.add_column(column, justify="left" if column in ("contender", "note") else "right")
    for name, sec, note in zip(names, seconds, notes):
        if sec is None:
            table.add_row(name, "-", "-", "-", "-", note)
            continue
        vs_deepspeed = f"{deepspeed_seconds / sec:.2f}x" if deepspeed_seconds else "-"
        table.add_row(
            name, f"{sec:.4f}", f"{args.numel / sec / 1e9:.2f} G", f"{torch_seconds / sec:.2f}x", vs_deepspeed, note
        )
    Console().print(table)
    if torch_sqrt and seconds[0] and seconds[ieee_row]:
        ratio = seconds[0] / seconds[ieee_row]
        print(f"torch's sqrt per chunk vs IEEE sqrt in one pass: {ratio:.2f}x the time per step")
    if args.slots and all(seconds[-4:]):
        copy, apart, kernel, after = seconds[-4:]
        print(f"two slots, one slot into the other vs copy then in place: {apart / copy:.2f}x the time")
        print(f"checksums by the kernel vs none: {kernel / apart:.3f}x the time; vs xxHash after the step: "
              f"{kernel / after:.3f}x")
    ops.set_native_sqrt()


if __name__ == "__main__":
    main()
