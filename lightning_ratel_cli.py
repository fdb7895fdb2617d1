"""The command lines of lightning_ratel (``ratel-convert``).

A module of its own, outside the package: importing ``lightning_ratel`` imports Lightning (it registers the strategy
name ``"ratel"``), which takes seconds. Here the arguments are parsed first, so ``--help`` and a usage error answer at
once, and the package is imported only to do the work.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--name", default="ratel", help="the store name of the kept swap files (default: ratel)")
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
    from lightning_ratel.convert import run

    return run(args, parser)
