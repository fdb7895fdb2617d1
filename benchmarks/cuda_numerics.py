"""How far RatelStrategy's numbers on CUDA are from plain Lightning's, against plain's own spread.

Plain Lightning on CUDA has several AdamW implementations (foreach, the default there; single-tensor; fused) that
round differently, and RatelStrategy steps on the CPU. This trains the tests' tiny models with each plain optimizer,
with plain Lightning stepping torch's AdamW on the CPU (``tests.models.HostAdamW``: RatelStrategy's arithmetic), and
under RatelStrategy (activations on the device, every tier, ``plan="auto"``), all with deterministic kernels and the
math attention backend, and prints the largest relative parameter difference of every run against every plain one.
It also gives, after a single step, how many fp32 units in the last place the fp32 masters differ.

Run on a GPU machine from the repository root::

    python -m benchmarks.cuda_numerics --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from lightning_ratel import RatelStrategy  # noqa: E402
from tests.models import LM, MIXED_POLICY, HostAdamLM, trainer  # noqa: E402

PLAIN = ("foreach", "single-tensor", "fused", "host")
RATEL = {"ratel device": "device", "ratel every tier": MIXED_POLICY, "ratel auto": None}


class OptimizerLM(LM):
    """:class:`LM` with one of torch's CUDA AdamW implementations."""

    def __init__(self, model: str, implementation: str) -> None:
        super().__init__(model)
        self.implementation = implementation

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        flags = {"foreach": {"foreach": True}, "single-tensor": {"foreach": False}, "fused": {"fused": True}}
        opt = torch.optim.AdamW(config["optimizer"].param_groups, **flags[self.implementation])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(run: str, model: str, precision: str, steps: int, accelerator: str = "gpu") -> dict[str, torch.Tensor]:
    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH), tempfile.TemporaryDirectory() as swap:
        if run in RATEL:
            module: LM = LM(model)
            strategy: Any = RatelStrategy(ssd_paths=[swap], activation_policy=RATEL[run])
        else:
            module = HostAdamLM(model) if run == "host" else OptimizerLM(model, run)
            strategy = "auto"
        trainer(strategy, accelerator=accelerator, devices=1, precision=precision, max_steps=steps).fit(module)
    return {k: v.detach().float().cpu() for k, v in module.state_dict().items()}


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest difference relative to each tensor's largest value, and the tensor that has it."""
    worst, where = 0.0, ""
    for k in a:
        err = ((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)).item()
        if err > worst or err != err:
            worst, where = err, k
    return worst, where


def ulps(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    """The largest distance, in fp32 units in the last place, between the same elements of ``a`` and ``b``."""
    worst = 0
    for k in a:
        x, y = a[k].view(torch.int32).long(), b[k].view(torch.int32).long()
        # Two's complement ints order the negative floats backwards: map them onto one monotone line.
        x = torch.where(x < 0, -(x & 0x7FFFFFFF), x)
        y = torch.where(y < 0, -(y & 0x7FFFFFFF), y)
        worst = max(worst, int((x - y).abs().max()))
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for cuda_numerics.json")
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--precisions", nargs="+", default=["bf16-mixed", "32-true"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accelerator", default="gpu", help="cpu: a smoke run of this script (everything is exact)")
    args = parser.parse_args(argv)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        raise SystemExit("cuda_numerics: needs a CUDA device")
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu"
    results: dict[str, Any] = {"device": device, "torch": torch.__version__, "cases": {}}
    for model in args.models:
        for precision in args.precisions:
            case = f"{model} {precision}"
            states = {run: fit(run, model, precision, args.steps, args.accelerator) for run in (*PLAIN, *RATEL)}
            one_step = {run: fit(run, model, precision, 1, args.accelerator) for run in ("foreach", "host", "ratel device")}
            table = {run: {ref: rel_err(states[ref], states[run]) for ref in PLAIN} for run in states}
            results["cases"][case] = {
                "rel_err": table,
                "ulps_after_one_step": {run: {ref: ulps(one_step[ref], one_step[run]) for ref in ("foreach", "host")}
                                        for run in one_step},
            }
            print(f"\n{case}, {args.steps} steps: largest relative parameter difference against plain Lightning with")
            print(f"{'run':<18}" + "".join(f"{ref:>16}" for ref in PLAIN) + "   (tensor of the largest against host)")
            for run, row in table.items():
                print(f"{run:<18}" + "".join(f"{row[ref][0]:>16.3g}" for ref in PLAIN) + f"   {row['host'][1]}")
            print("after one step, fp32 ULPs apart:", results["cases"][case]["ulps_after_one_step"])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cuda_numerics.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
