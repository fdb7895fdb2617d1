"""One data-parallel training run, for the multi-process tests: ``python -m tests.distributed_run OUT [options]``.

Lightning's own launcher starts the other ranks (``devices=N``), or the test starts one process per node
(``--num-nodes``, with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set). Every rank writes ``OUT/rank<r>.pt``:
its parameters and optimizer state after fit (as a user reads them), the bytes the strategy held at the end of training,
the growth of the process's proportional set size from the start of ``main`` to then, and its peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_ratel import RatelStrategy
from lightning_ratel.sizes import path_bytes
from tests.models import LM, cache_off, final_state, trainer


def proportional_set_size() -> int:
    """This process's memory with each page shared with others counted in proportion (Linux ``Pss``; 0 elsewhere):
    summed over the processes of a node, memory they share counts once."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def shared_cache_memory() -> tuple[int, int]:
    """Resident and proportional bytes of this process's mappings of a host cache shared with the node's other ranks
    (Linux; (0, 0) without one)."""
    rss = pss = 0
    inside = False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split()
                if head and "-" in head[0] and not head[0].endswith(":"):
                    inside = "ratel-host-cache-" in line
                elif inside and head[0] == "Rss:":
                    rss += int(head[1]) * 1024
                elif inside and head[0] == "Pss:":
                    pss += int(head[1]) * 1024
    except OSError:
        pass
    return rss, pss


class _Measure(L.Callback):
    """The bytes the strategy holds (engine accounting, swap files on disk) once training ends, before teardown, the
    process's proportional set size then, above ``baseline``, and its memory of a host cache shared on the node."""

    def __init__(self, swap: Path, baseline: int) -> None:
        self.swap = swap
        self.baseline = baseline
        self.figures: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        placement = getattr(trainer.strategy, "byte_placement", dict)()
        states = getattr(trainer.strategy, "state_placement", dict)()
        self.figures = {"placement": placement, "states": states,
                        "swap_bytes": path_bytes(self.swap) if self.swap.exists() else 0,
                        "pss_growth": proportional_set_size() - self.baseline,
                        "shared_cache": shared_cache_memory()}


class _Save(L.Callback):
    """Save a checkpoint at the end of training, on every rank (as ``trainer.save_checkpoint`` is called)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class _Raise(L.Callback):
    """Raise on one rank at one step (the others must stop too)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if os.environ.get("RATEL_TEST_KILL"):
                os._exit(9)
            raise RuntimeError(f"rank {self.rank} fails at step {self.step}")


def main(argv: list[str]) -> None:
    baseline = proportional_set_size()
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ratel")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--checkpoint-format", default="full")
    parser.add_argument("--save", default=None, help="save a checkpoint here at the end of training")
    parser.add_argument("--resume", default=None, help="resume from this checkpoint")
    parser.add_argument("--states", default="auto", help="RatelStrategy's optimizer_states")
    parser.add_argument("--fail", default=None, help="RANK:STEP: raise on that rank at that step")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    swap = out / "swap"
    strategy: Any = args.strategy
    if args.strategy == "ratel":
        strategy = RatelStrategy(ssd_paths=[str(swap)], activation_policy="device", param_cache="host",
                                 optimizer_states=args.states, checkpoint_format=args.checkpoint_format,
                                 timeout=timedelta(seconds=60))
    measure = _Measure(swap, baseline)
    callbacks: list[L.Callback] = [measure]
    if args.save:
        callbacks.append(_Save(args.save))
    if args.fail:
        rank, step = (int(x) for x in args.fail.split(":"))
        callbacks.append(_Raise(rank, step))
    module = LM(args.model, batch_size=2)
    # As RatelStrategy does during fit: with the cache on, attention rounds differently (an encoder-decoder's decoder).
    cache_off(module)
    t = trainer(strategy, devices=args.devices, num_nodes=args.num_nodes, max_steps=args.steps,
                accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip, precision=args.precision,
                callbacks=callbacks)
    t.fit(module, ckpt_path=args.resume)
    params, optimizer = final_state(module, t)
    torch.save({"params": params, "optimizer": optimizer, **measure.figures,
                "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "world": t.world_size},
               out / f"rank{t.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
