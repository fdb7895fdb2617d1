"""The command lines of lightning_ratel (``ratel-convert``, ``ratel-estimate``).

A module of its own, outside the package: importing ``lightning_ratel`` imports Lightning (it registers the strategy
name ``"ratel"``), which takes seconds. Here the arguments are parsed first, so ``--help`` and a usage error answer at
once, and the package is imported only to do the work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def convert_parser(prog: str = "ratel-convert") -> argparse.ArgumentParser:
    """The arguments of ``ratel-convert`` (and of ``python -m lightning_ratel.convert``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert a sharded lightning_ratel checkpoint, or the swap files a run kept, into an ordinary "
                    "Lightning checkpoint or a Hugging Face folder, one tensor at a time (the model is never "
                    "gathered in memory).",
        epilog="examples:\n"
               f"  {prog} CKPT_DIR model.ckpt --to lightning\n"
               f"  {prog} CKPT_DIR hf_out --to hf --dtype bf16\n"
               f"  {prog} --swap /mnt/nvme0/ratel --swap /mnt/nvme1/ratel hf_out --dtype fp32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="the sharded checkpoint directory (not with --swap)")
    parser.add_argument("out", help="the output: a folder (--to hf) or a checkpoint file (--to lightning)")
    parser.add_argument("--to", choices=["hf", "lightning"], default="hf", help="the output format (default: hf)")
    parser.add_argument("--swap", action="append", metavar="SWAP_DIR",
                        help="read the swap files a run kept in SWAP_DIR instead of a checkpoint (repeat for each "
                             "directory of the run)")
    parser.add_argument("--name", default="ratel", help="the store name of the kept swap files (default: ratel; "
                        "the files of a run of several ranks, <name>-rank<R>, are read together)")
    parser.add_argument("--dtype", default="bf16",
                        help="dtype of the exported weights: bf16, fp16 or fp32 (default: bf16)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="the largest weight file of a Hugging Face folder (default: 5GB)")
    parser.add_argument("--pretrained", help="the pretrained folder frozen weights come from, if it moved")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def convert(argv: Sequence[str] | None = None, prog: str = "ratel-convert") -> int:
    """Run ``ratel-convert`` with ``argv`` (``sys.argv[1:]`` when ``None``); the exit status."""
    parser = convert_parser(prog)
    args = parser.parse_args(argv)
    from lightning_ratel.io.convert import run

    return run(args, parser)


def estimate_parser(prog: str = "ratel-estimate") -> argparse.ArgumentParser:
    """The arguments of ``ratel-estimate``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Estimate the disk, host memory, device memory and checkpoint bytes a full fine-tuning of a "
                    "Hugging Face model with RatelStrategy needs, before anything is allocated.",
        epilog=f"example:\n  {prog} /data/Llama-3-8B --precision bf16-mixed --param-cache ssd",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a Hugging Face checkpoint folder (only its config.json is read)")
    parser.add_argument("--precision", choices=["bf16-mixed", "16-mixed", "32-true"], default="bf16-mixed",
                        help="the Trainer's precision (default: bf16-mixed)")
    parser.add_argument("--param-cache", choices=["auto", "host", "ssd"], default="auto",
                        help="RatelStrategy's param_cache (default: auto)")
    parser.add_argument("--prefetch-depth", type=int, default=1, help="RatelStrategy's prefetch_depth (default: 1)")
    parser.add_argument("--host-memory-limit", help="RatelStrategy's host_memory_limit, e.g. 64GiB (default: what "
                                                    "is available)")
    parser.add_argument("--checkpoint-format", choices=["auto", "full", "sharded"], default="auto",
                        help="RatelStrategy's checkpoint_format (default: auto)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ranks training data parallel: each holds a gradient exchange's buffers (default: 1)")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1,
                        help="the Trainer's accumulate_grad_batches, for the gradient exchange of several ranks "
                             "(default: 1)")
    parser.add_argument("--gradient-exchange", choices=["auto", "window", "micro_batch", "device"], default="auto",
                        help="RatelStrategy's gradient_exchange (default: auto)")
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu",
                        help="where the run computes; on the CPU the device's memory is the host's (default: gpu)")
    return parser


def estimate(argv: Sequence[str] | None = None, prog: str = "ratel-estimate") -> int:
    """Run ``ratel-estimate`` with ``argv`` (``sys.argv[1:]`` when ``None``); the exit status."""
    args = estimate_parser(prog).parse_args(argv)
    from lightning_ratel import RatelConfigError
    from lightning_ratel.preflight import estimate as estimate_run

    try:
        print(estimate_run(args.folder, precision=args.precision, param_cache=args.param_cache,
                           prefetch_depth=args.prefetch_depth, host_memory_limit=args.host_memory_limit,
                           checkpoint_format=args.checkpoint_format, ranks=args.ranks,
                           accumulate_grad_batches=args.accumulate_grad_batches,
                           gradient_exchange=args.gradient_exchange, accelerator=args.accelerator))
    except RatelConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
