"""Training throughput of RatelStrategy on one GPU capped to a consumer card, against DeepSpeed ZeRO-Infinity/Offload.

What one run measures, for GPT-style decoders (transformers GPT-2 blocks) at sequence length 1024:

- per model and batch size (default 8, 16, 32): seconds per step, tokens/s, model TFLOPS and hardware TFLOPS of
  RatelStrategy (``plan="auto"``), of DeepSpeed ZeRO-Infinity (stage 3, parameters and optimizer states on NVMe) and
  of DeepSpeed ZeRO-Offload (stage 2, optimizer states and step on the CPU), all through Lightning, all in
  ``bf16-mixed``, all with the device capped to ``--device-memory`` (24 GiB: an RTX 4090);
- the in-GPU peak of one transformer block at the same batch size (forward and backward of one block with all of its
  data resident: Ratel's "green line") and each system's hardware TFLOPS as a fraction of it;
- the largest model (layers of the same width) each system trains at batch size 1 under the same caps, found by a
  doubling-then-bisection search over the layer count;
- for RatelStrategy, its cost model's predicted step, forward and backward against the measured ones (issue 22: within
  15%), the phases measured over :data:`PHASE_STEPS` more steps synchronised at each phase's end.

Model construction. Under RatelStrategy the model is built on the meta device and the strategy materializes it one
block at a time (``param_init_fn``: GPT-2's own initialization, module by module), writing each block to the swap
files before the next, so neither the module nor the search for the largest model depends on host memory holding the
whole model. DeepSpeed builds it in ``configure_model``: inside ``deepspeed.zero.Init`` for stage 3, which partitions
every parameter to NVMe as it is created; on the host for stage 2, which keeps the fp32 states there anyway.

Swap directories. RatelStrategy stripes every swap file over all ``--ssd`` directories (1 MiB chunks, round-robin).
DeepSpeed 0.19 takes one ``nvme_path`` per offload kind (``offload_param`` and ``offload_optimizer``) and stripes
nothing itself; its own multi-drive figures (the DeepNVMe posts) use one RAID-0 volume over the drives. What it
supports is used: with one directory, ZeRO-Infinity keeps parameters and optimizer states there; with two or more, its
optimizer states and the fp32 gradients it swaps out (16 of its 18 bytes per parameter, and most of its traffic per
step) go to the first directory and its 16-bit parameters to the second. A third directory or more is Ratel's alone,
and the report says so. For a comparison with every drive behind both systems, combine the drives into one RAID-0
volume and pass it as the single ``--ssd``.

DeepSpeed's buffers (:func:`deepspeed_config`). ZeRO-3 cuts the parameters into sub-groups of consecutive parameters,
closing one as soon as it holds ``sub_group_size`` elements or more, and its optimizer step swaps one sub-group in,
updates it and swaps it out before the next. The swap buffers are pinned and sized by the largest sub-group (at most
``sub_group_size`` plus the largest parameter): ``buffer_count`` (4) fp32 buffers for master, moments and gradient,
and one 16-bit buffer for the updated parameters, about 18 bytes per element. Lightning's default (``1e12``) makes
the whole model one sub-group, so those buffers are model-sized; :data:`DS_SUB_GROUP_SIZE` (``1e8``) bounds them
while each state still moves in 400 MB transfers, hundreds of aio blocks, so the drives see the same large requests.
aio (:data:`DS_AIO`): 1 MiB blocks (Ratel's stripe size, so both systems issue requests of one size), queue depth 32
and 8 threads per request, the settings DeepSpeed's tuner (``ds_nvme_tune``) reports for one consumer NVMe drive in
DeepSpeed's DeepNVMe tutorial; ``--ds-aio`` replaces any of them with what ``ds_nvme_tune`` finds on the machine.

Every training run and every search attempt is its own subprocess, so an out-of-memory error, a DeepSpeed process
group or a memory-fraction setting never leaks into the next. Results are printed as tables and written to
``<out>/gpu_throughput.json`` after every run, so a run stopped by its time budget keeps what it measured.

Model sizes. The evaluation of Ratel (and of its artifact, LoHan) uses GPT-3-style models whose rows keep heads equal
to layers and hidden size 128 times layers (13B: 40 layers, 40 heads, hidden 5120; 175B: 96 layers, 96 heads, hidden
12288). ``auto`` picks the largest model of that family whose states fit the machine for every system compared (free
disk under ``--ssd``, available host memory, the device cap; see :data:`BYTES_PER_PARAM` and
:func:`disk_bytes_per_dir`); ``13B:5`` is the 13B row's width with 5 layers; ``LxHxD`` gives layers, heads and hidden
size.

FLOPs. Model FLOPs per step are ``tokens * (6 * N + 12 * layers * hidden * seq)``: ``N`` counts every weight a matmul
multiplies (the blocks' 12 hidden^2 per layer and the LM head), the second term is attention scores and weighted sum
in forward and backward (no causal halving); recomputation is not counted. Hardware FLOPs add what is computed again:
for Ratel, the FLOPs (counted by ``torch.utils.flop_counter`` while profiling) of the ops its plan re-executes in
backward; for DeepSpeed with ``--ds-checkpointing`` (default on, as its baselines need at these batch sizes) one more
forward of every block.

Run from the repository root on the GPU machine::

    python -m benchmarks.gpu_throughput --ssd /mnt/nvme0/bench --out results/
    python -m benchmarks.gpu_throughput --ssd /mnt/nvme0/bench /mnt/nvme1/bench --out results/   # two drives
    python -m benchmarks.gpu_throughput --ssd /mnt/nvme0/bench --out results/ --quick   # a smoke run in ~10 min
    python -m benchmarks.gpu_throughput --ssd /mnt/nvme0/bench --out results/ --devices 2   # 2 GPUs, data parallel

With ``--devices N`` every training run (and every attempt of the search for the largest model) launches N ranks
through Lightning, data parallel: the batch size is each rank's micro-batch, and the figures of a step are the totals
of all ranks (N x batch sequences per step; the in-GPU block peak is one GPU's, times N). RatelStrategy then keeps
each state once per node, and the compute copies where ``param_cache="auto"`` puts them: a host cache the node's
ranks share, or each rank's own swap files.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

RESULT_PREFIX = "GPU_THROUGHPUT_RESULT "
SYSTEMS = ("ratel", "zero-infinity", "zero-offload")
DEEPSPEED_SYSTEMS = ("zero-infinity", "zero-offload")
GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]

TABLE_IV = {"13B": (40, 40, 5120), "175B": (96, 96, 12288)}
"""Rows of the Ratel/LoHan evaluation models: name -> (layers, heads, hidden)."""

HEAD_DIM = 128
"""Hidden size per layer (and per head) of that family: hidden = 128 * layers, heads = layers."""

BYTES_PER_PARAM = {
    "ratel": {"disk": 14, "host": 0, "device": 0},
    "zero-infinity": {"disk": 18, "host": 2, "device": 0},
    "zero-offload": {"disk": 0, "host": 18, "device": 4},
}
"""Bytes each system keeps per parameter on its swap disks (in all), in host memory and on the device, for sizing only.

Ratel: fp32 master and Adam moments (12) and, when the compute copies are not cached in host memory
(``param_cache="ssd"``), the 16-bit compute copies (2) on disk, striped over every directory. Nothing in host memory
grows with the model: it starts on the meta device and each block is materialized, written to the swap files and
released in turn, so the module holds no copy; the host cache of 16-bit compute copies (2 per parameter) is used only
where ``param_cache="auto"`` finds that it takes at most half the host memory, and otherwise the copies are read from
disk; gradient buffers come from a pool bounded by the shards in flight (``GRAD_BUDGET_SHARDS`` of the largest), not
by the model. ZeRO-Infinity: 16-bit parameters (2), fp32 master and moments (12) and the fp32 gradients it swaps out
at the accumulation boundary (4) on NVMe; in host memory the pinned 16-bit gradient partitions of every parameter
(2), plus buffers bounded by ``sub_group_size``, the parameter buffers and ``max_in_cpu``. ZeRO-Offload: fp32 master,
moments and gradients in host memory plus a pinned 16-bit copy (18); 16-bit parameters and gradients on the device
(4).
"""

DS_PARAM_DISK = 2
"""Of ZeRO-Infinity's disk bytes per parameter, those in its parameter directory (the 16-bit parameters)."""

SIZING_FRACTION = {"disk": 0.7, "host": 0.7, "device": 0.5}
"""Share of each resource sizing may plan for: the rest is swap buffers, activations, the CUDA context, the OS."""

DS_SUB_GROUP_SIZE = 100_000_000
"""ZeRO-3 ``sub_group_size``: elements per optimizer sub-group, the unit its step swaps in and out (see above)."""

DS_AIO = {"block_size": 1 << 20, "queue_depth": 32, "intra_op_parallelism": 8, "single_submit": False,
          "overlap_events": True, "use_gds": False}
"""DeepSpeed's ``aio`` settings (the keys deepspeed 0.19 reads); ``--ds-aio`` overrides any of them."""


@dataclass(frozen=True)
class ModelShape:
    """A GPT-2-style decoder: learned positions, pre-norm blocks with a 4x MLP, LM head tied to the embeddings."""

    layers: int
    heads: int
    hidden: int
    vocab: int = 50257
    seq: int = 1024

    @property
    def name(self) -> str:
        return f"{self.layers}L-{self.hidden}h-{self.heads}a"

    def params(self) -> int:
        """Parameter count, exactly as transformers' ``GPT2LMHeadModel`` builds it."""
        h = self.hidden
        return self.vocab * h + self.seq * h + self.layers * (12 * h * h + 13 * h) + 2 * h

    def matmul_params(self) -> int:
        """Weights that a matmul multiplies in a step: the blocks' projections and the LM head."""
        return 12 * self.layers * self.hidden**2 + self.vocab * self.hidden


def proportional(layers: int, vocab: int = 50257, seq: int = 1024) -> ModelShape:
    """The member of the Table IV family with ``layers`` layers (heads = layers, hidden = 128 * layers)."""
    return ModelShape(layers, layers, HEAD_DIM * layers, vocab, seq)


def parse_model(spec: str, vocab: int = 50257, seq: int = 1024) -> ModelShape:
    """A model from ``"13B"``, ``"13B:5"`` (that row's width, 5 layers) or ``"LxHxD"`` (layers, heads, hidden).

    Raises:
        ValueError: If the spec is none of these or the hidden size is not a multiple of the heads.
    """
    row, _, layers = spec.partition(":")
    if row in TABLE_IV:
        depth, heads, hidden = TABLE_IV[row]
        shape = ModelShape(int(layers) if layers else depth, heads, hidden, vocab, seq)
    else:
        parts = spec.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"model {spec!r} is not a Table IV row ({', '.join(TABLE_IV)}), ROW:LAYERS or LxHxD")
        shape = ModelShape(int(parts[0]), int(parts[1]), int(parts[2]), vocab, seq)
    if shape.layers < 1 or shape.heads < 1 or shape.hidden % shape.heads:
        raise ValueError(f"model {spec!r}: need layers >= 1 and a hidden size divisible by the heads")
    return shape


def model_flops(shape: ModelShape, batch: int) -> float:
    """Model FLOPs of one training step (forward and backward, no recomputation)."""
    tokens = batch * shape.seq
    return float(tokens * (6 * shape.matmul_params() + 12 * shape.layers * shape.hidden * shape.seq))


def block_flops(shape: ModelShape, batch: int) -> float:
    """FLOPs of forward and backward of one transformer block."""
    tokens = batch * shape.seq
    return float(tokens * (6 * 12 * shape.hidden**2 + 12 * shape.hidden * shape.seq))


def checkpoint_recompute_flops(shape: ModelShape, batch: int) -> float:
    """FLOPs of the extra forward of every block that activation checkpointing runs in backward."""
    tokens = batch * shape.seq
    return float(tokens * shape.layers * (2 * 12 * shape.hidden**2 + 4 * shape.hidden * shape.seq))


def plan_recompute_flops(plan: Any) -> float:
    """FLOPs the plan re-executes in backward: per block, the profiled FLOPs of each op it recomputes."""
    from lightning_ratel.plan.cost import recompute_ops

    total = 0.0
    for layer in plan.layers:
        rerun = recompute_ops(layer, plan.activation_placement)
        total += sum(op.flops for op in layer.ops if op.name in rerun)
    return total


def disk_bytes_per_dir(system: str, dirs: int) -> float:
    """Bytes per parameter ``system`` puts on the fullest of the ``dirs`` swap directories it is given.

    Ratel stripes its swap files evenly over all of them. ZeRO-Infinity uses at most two (see the module docstring):
    with one, all of its bytes are there; with more, its optimizer directory is the fuller one.
    """
    total = BYTES_PER_PARAM[system]["disk"]
    if system == "ratel":
        return total / dirs
    if system == "zero-infinity" and dirs > 1:
        return total - DS_PARAM_DISK
    return total


def params_that_fit(budgets: dict[str, float], systems: Sequence[str], dirs: int = 1) -> int:
    """The most parameters every one of ``systems`` can hold within ``budgets``.

    Args:
        budgets: bytes per resource; ``"disk"`` is what each of the ``dirs`` swap directories may take.
        systems: the systems that must all fit.
        dirs: how many swap directories (``--ssd``) the systems are given.
    """
    limits = []
    for system in systems:
        for resource, per_param in BYTES_PER_PARAM[system].items():
            if resource == "disk":
                per_param = disk_bytes_per_dir(system, dirs)
            if per_param:
                limits.append(budgets[resource] / per_param)
    return int(min(limits)) if limits else 0


def largest_layers(make: Callable[[int], ModelShape], max_params: int, cap: int = 1024) -> int:
    """The most layers (at most ``cap``) for which ``make(layers)`` has at most ``max_params`` parameters; 0 if none."""
    best = 0
    for layers in range(1, cap + 1):
        if make(layers).params() > max_params:
            break
        best = layers
    return best


def largest_passing(trial: Callable[[int], bool], *, start: int = 1, limit: int | None = None) -> int:
    """The largest ``n >= start`` (and ``<= limit``) for which ``trial(n)`` holds, assuming it holds up to a point.

    Doubles from ``start`` until a trial fails (or ``limit`` passes), then bisects between the last success and the
    first failure: about ``2 log2(answer)`` trials.

    Returns:
        The largest passing ``n``, or ``start - 1`` if ``start`` fails already.
    """
    if limit is not None and limit < start:
        return start - 1
    if not trial(start):
        return start - 1
    good, bad = start, None
    while bad is None:
        n = good * 2 if limit is None else min(good * 2, limit)
        if n == good:
            return good
        if trial(n):
            good = n
        else:
            bad = n
    while bad - good > 1:
        middle = (good + bad) // 2
        if trial(middle):
            good = middle
        else:
            bad = middle
    return good


# ---------------------------------------------------------------------------------------------------- worker side


def _gpt2_config(shape: ModelShape) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=shape.vocab, n_positions=shape.seq, n_embd=shape.hidden, n_layer=shape.layers, n_head=shape.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def gpt2_initializer(model: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
    """GPT-2's initialization of one module at a time, for ``RatelStrategy(param_init_fn=...)`` on a meta model.

    transformers' ``_init_weights`` sets each linear, embedding and norm; GPT-2 scales the projections onto the
    residual stream (``c_proj``) by ``1 / sqrt(2 * layers)`` from the attention or MLP module, whose parameters the
    strategy materializes one submodule at a time, so that scaling is applied to the projection itself here.
    """
    config = model.config
    residual = {id(m) for name, m in model.named_modules() if name.endswith(("attn.c_proj", "mlp.c_proj"))}
    residual_std = config.initializer_range / math.sqrt(2 * config.n_layer)

    def init(module: torch.nn.Module) -> None:
        with torch.no_grad():
            model._init_weights(module)
            if id(module) in residual:
                module.weight.normal_(0.0, residual_std)
            # transformers 4.x registers a causal mask and its fill value on each attention module (5.x has none).
            if "bias" in module._buffers:
                module.bias.copy_(torch.ones_like(module.bias).tril())
            if "masked_bias" in module._buffers:
                module.masked_bias.fill_(-1e4)

    return init


def _local_device() -> int:
    """This rank's GPU: Lightning's launcher sets ``LOCAL_RANK`` for the ranks it starts (0 in the first)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def _cap_device_memory(cap: int) -> None:
    device = _local_device()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)


def _bench_module(shape: ModelShape, batch: int, steps: int, deepspeed: bool, checkpointing: bool) -> Any:
    import lightning as L
    from transformers import GPT2LMHeadModel

    class Causal(L.LightningModule):
        """Random token ids through a GPT-2 model; nothing logged, so no host syncs are added."""

        def __init__(self) -> None:
            super().__init__()
            self.model: GPT2LMHeadModel | None = None
            if not deepspeed:
                # No host memory: RatelStrategy materializes and initializes it block by block (gpt2_initializer).
                # DeepSpeed builds it in configure_model, inside deepspeed.zero.Init for stage 3.
                with torch.device("meta"):
                    self.model = GPT2LMHeadModel(_gpt2_config(shape))

        def configure_model(self) -> None:
            if self.model is None:
                self.model = GPT2LMHeadModel(_gpt2_config(shape))
                if checkpointing:
                    self.model.gradient_checkpointing_enable()

        def training_step(self, batch_ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch_ids, labels=batch_ids).loss

        def configure_optimizers(self) -> Any:
            if deepspeed:
                # DeepSpeed refuses a client torch optimizer when the optimizer is offloaded; its CPU Adam is the
                # fair comparison anyway.
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=1e-5, adamw_mode=True)
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            generator = torch.Generator().manual_seed(0)
            data = torch.randint(0, shape.vocab, (steps * batch, shape.seq), generator=generator)
            return torch.utils.data.DataLoader(data, batch_size=batch)

    return Causal()


def _step_timer(skip: int, last: int, drain: Callable[[Any], None],
                synchronize: Callable[[], None] = torch.cuda.synchronize) -> Any:
    import lightning as L

    class StepTimer(L.Callback):
        """Wall time from the start of batch ``skip`` to the end of batch ``last``, pending updates included (with
        several ranks each times its own steps, which every rank's collectives keep in step)."""

        def __init__(self) -> None:
            self.start: float | None = None
            self.end: float | None = None
            self.steps = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == skip:
                synchronize()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.start is None or batch_idx > last:
                return
            self.steps += 1
            if batch_idx == last:
                drain(trainer)
                synchronize()
                self.end = time.perf_counter()

        @property
        def seconds_per_step(self) -> float | None:
            if self.start is None or self.end is None or not self.steps:
                return None
            return (self.end - self.start) / self.steps

    return StepTimer()


PHASE_STEPS = 4
"""Steps a RatelStrategy run trains after its timed ones, each synchronised at batch start, where backward starts and
at batch end: their medians split a step into forward and the rest, to set against the cost model's phases (the timed
steps run without those synchronisations)."""


def deepspeed_nvme_dirs(swap_dirs: Sequence[str]) -> tuple[str, str]:
    """ZeRO-Infinity's (optimizer directory, parameter directory): the first two swap directories, or the one."""
    return swap_dirs[0], swap_dirs[1] if len(swap_dirs) > 1 else swap_dirs[0]


def deepspeed_layout_note(swap_dirs: Sequence[Path]) -> str:
    """A line for the report saying which swap directories ZeRO-Infinity used, and which it could not."""
    optimizer, params = deepspeed_nvme_dirs([str(d) for d in swap_dirs])
    if optimizer == params:
        return f"zero-infinity: parameters and optimizer states in {optimizer} (one swap directory)."
    note = (f"zero-infinity: optimizer states and swapped fp32 gradients in {optimizer}, 16-bit parameters in "
            f"{params} (DeepSpeed takes one nvme_path per offload kind)")
    unused = [str(d) for d in swap_dirs[2:]]
    if unused:
        note += (f"; only Ratel uses {', '.join(unused)}. Combine the drives into one RAID-0 volume and pass it as "
                 "the single --ssd to put every drive behind both systems")
    return note + "."


def deepspeed_config(system: str, shape: ModelShape, swap_dirs: Sequence[str],
                     aio: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config of ``system`` for ``shape``; Lightning adds precision, batch size and clipping.

    Args:
        system: ``"zero-infinity"`` or ``"zero-offload"``.
        shape: the model, for the size of its largest parameter.
        swap_dirs: the run's swap directories (see :func:`deepspeed_nvme_dirs`).
        aio: settings that replace those of :data:`DS_AIO`.

    Raises:
        ValueError: If ``system`` is not a DeepSpeed system.
    """
    zero: dict[str, Any] = {"contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
                            "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}
    if system == "zero-offload":
        zero.update(stage=2, offload_optimizer={"device": "cpu", "pin_memory": True})
        return {"zero_allow_untested_optimizer": True, "zero_optimization": zero}
    if system != "zero-infinity":
        raise ValueError(f"unknown DeepSpeed system {system!r}")
    optimizer_dir, param_dir = deepspeed_nvme_dirs(swap_dirs)
    # The largest parameter: the embedding or the MLP's up matrix.
    zero.update(zero_infinity_offload(optimizer_dir, param_dir, max(shape.vocab * shape.hidden, 4 * shape.hidden**2)))
    return {"zero_allow_untested_optimizer": True, "zero_optimization": zero, "aio": {**DS_AIO, **(aio or {})}}


def zero_infinity_offload(optimizer_dir: str, param_dir: str, largest_param: int,
                          pin_memory: bool = True) -> dict[str, Any]:
    """ZeRO-Infinity's part of a ``zero_optimization`` config: stage 3 with parameters and optimizer states on NVMe,
    each parameter buffer large enough for the model's largest parameter (``largest_param`` elements)."""
    return {
        "stage": 3,
        "sub_group_size": DS_SUB_GROUP_SIZE,
        "offload_param": {"device": "nvme", "nvme_path": param_dir, "pin_memory": pin_memory, "buffer_count": 5,
                          "buffer_size": max(100_000_000, largest_param), "max_in_cpu": 1_000_000_000},
        "offload_optimizer": {"device": "nvme", "nvme_path": optimizer_dir, "pin_memory": pin_memory,
                              "buffer_count": 4},
    }


def _strategy(system: str, module: Any, shape: ModelShape, swap_dirs: list[str], cap: int,
              aio: dict[str, Any] | None = None, ratel_states: str = "auto") -> Any:
    if system == "ratel":
        from lightning_ratel import RatelStrategy

        return RatelStrategy(ssd_paths=swap_dirs, device_memory_limit=cap, optimizer_states=ratel_states,
                             param_cache="auto", param_init_fn=gpt2_initializer(module.model))
    from lightning.pytorch.strategies import DeepSpeedStrategy

    config = deepspeed_config(system, shape, swap_dirs, aio)
    # zero.Init creates each stage-3 parameter straight in its NVMe partition.
    return DeepSpeedStrategy(config=config, remote_device="nvme" if system == "zero-infinity" else None)


def _drain(trainer: Any) -> None:
    """Wait for work a step leaves running after it returns: RatelStrategy's CPU updates and write-backs."""
    from lightning_ratel import RatelStrategy

    if isinstance(trainer.strategy, RatelStrategy):
        trainer.strategy.synchronize()


def train_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["system"]`` on one model and batch size; seconds per step and what the FLOP counts need.

    With ``spec["devices"]`` above 1 Lightning's launcher starts the other ranks (this script again, with the same
    spec); each rank returns its own result, ``"rank"`` saying whose. ``spec["accelerator"]`` (``"gpu"`` unless a test
    runs it on the CPU) picks the device.
    """
    import lightning as L

    from benchmarks.plan_accuracy import StepClock

    shape = ModelShape(**spec["shape"])
    system = spec["system"]
    cap = spec["device_memory"]
    devices = spec.get("devices", 1)
    gpu = spec.get("accelerator", "gpu") == "gpu"
    if gpu:
        _cap_device_memory(cap)
    deepspeed = system in DEEPSPEED_SYSTEMS
    timed = spec["warmup"] + spec["steps"]
    # The phases are timed as plan_accuracy times its points, synchronised at each one's end.
    clock = StepClock(first=timed) if system == "ratel" else None
    steps = timed + (PHASE_STEPS if clock is not None else 0)
    # Every rank reads its own part of the data (Lightning's distributed sampler): `steps` batches each.
    module = _bench_module(shape, spec["batch"], steps * devices, deepspeed, deepspeed and spec["ds_checkpointing"])
    timer = _step_timer(spec["warmup"], timed - 1, _drain, torch.cuda.synchronize if gpu else lambda: None)
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=devices,
        strategy=_strategy(system, module, shape, spec["swap_dirs"], cap, spec.get("ds_aio"),
                           spec.get("ratel_states", "auto")),
        precision="bf16-mixed", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[timer, *([clock] if clock is not None else [])],
    )
    if gpu:
        torch.cuda.reset_peak_memory_stats(_local_device())
    trainer.fit(module)
    result: dict[str, Any] = {
        "ok": timer.seconds_per_step is not None,
        "seconds_per_step": timer.seconds_per_step,
        "timed_steps": timer.steps,
        "devices": devices,
        "rank": trainer.global_rank,
        "peak_allocated": torch.cuda.max_memory_allocated(_local_device()) if gpu else None,
    }
    if not result["ok"]:
        result["error"] = f"no step was timed (ran {trainer.global_step} steps, warmup {spec['warmup']})"
    if system == "ratel":
        from lightning_ratel.plan.cost import bottleneck

        result["optimizer_states"] = trainer.strategy.state_placement()
        profiler = trainer.strategy.profiler
        plan = profiler.plan if profiler is not None else None
        if plan is not None:
            result["recompute_flops"] = plan_recompute_flops(plan)
            result["predicted_seconds_per_step"] = plan.predicted_iteration_time
            result["predicted_forward"] = plan.predicted_forward_time
            result["predicted_backward"] = plan.predicted_backward_time
            result["bound"] = {phase: bottleneck(resources, unified=not gpu)
                               for phase, resources in plan.resource_times.items()}
            assert clock is not None
            if clock.steps:
                result["measured_forward"] = statistics.median(forward for _, _, forward in clock.steps)
                result["measured_backward"] = statistics.median(wall - forward for wall, _, forward in clock.steps)
            # The profile and hardware the prediction came from, so that it can be predicted again offline.
            result["plan"] = json.loads(plan.to_json())
            result["placement"] = {tier: sum(1 for t in plan.activation_placement.values() if t == tier)
                                   for tier in ("device", "host", "ssd", "recompute")}
    return result


def block_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds for forward and backward of one resident block, halving the micro-batch until it fits the cap."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    shape = ModelShape(**spec["shape"])
    _cap_device_memory(spec["device_memory"])
    block = GPT2Block(_gpt2_config(shape), layer_idx=0).to("cuda", torch.bfloat16)
    batch = spec["batch"]
    while True:
        try:
            seconds = _time_block(block, shape, batch, spec.get("repeats", 5))
            return {"ok": True, "batch_used": batch, "seconds": seconds,
                    "tflops": block_flops(shape, batch) / seconds / 1e12}
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        # Outside the handler, so the failed attempt's tensors are freed before the cache is emptied.
        torch.cuda.empty_cache()
        # The per-token rate of a block hardly depends on the batch once it fills the GPU.
        batch //= 2


def _time_block(block: torch.nn.Module, shape: ModelShape, batch: int, repeats: int) -> float:
    """Seconds per forward and backward of ``block`` on ``batch`` sequences, after two untimed ones."""
    weight = next(block.parameters())
    x = torch.randn(batch, shape.seq, shape.hidden, device=weight.device, dtype=weight.dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        block.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(2):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def io_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """kvikio's availability in the swap directory and, where it works, both routes' bandwidths."""
    from lightning_ratel.runtime import gds

    reason = gds.kvikio_unavailable_reason(spec["swap_dirs"][0])
    if reason is not None:
        return {"ok": True, "kvikio": reason}
    figures = gds.measure(spec["swap_dirs"], "cuda", nbytes=spec.get("nbytes", 256 << 20))
    return {"ok": True, "kvikio": "available", **figures.to_dict(), "prefer_kvikio": figures.prefer_kvikio()}


WORKERS = {"train": train_worker, "block": block_worker, "io": io_worker}


def worker_main(spec: dict[str, Any]) -> None:
    """Run one measurement and print its result as one JSON line (also a failure, with the reason)."""
    try:
        result = WORKERS[spec["kind"]](spec)
    except BaseException as exc:  # reported to the parent, which decides what the failure means
        result = {
            "ok": False,
            "oom": isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower(),
            "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            "traceback": traceback.format_exc(limit=8),
        }
    # One write of the whole line: the ranks of one run share the worker's stdout, and a pipe keeps a short write
    # whole where print's separate writes of text and newline could interleave with another rank's.
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------- parent side


def parse_worker_output(returncode: int, output: str) -> dict[str, Any]:
    """The result a worker printed, or a failure naming why it printed none (killed, crashed). Ranks of one run each
    print theirs: a failure of any rank is the run's, else rank 0's result is."""
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    if results:
        failed = [r for r in results if not r.get("ok")]
        return (failed or [r for r in results if r.get("rank", 0) == 0] or results)[-1]
    tail = [line for line in output.strip().splitlines() if line.strip()][-3:]
    if returncode < 0:
        signal = -returncode
        cause = " (SIGKILL: most likely the kernel's out-of-memory killer)" if signal == 9 else ""
        error = f"killed by signal {signal}{cause}"
    else:
        error = f"exited with status {returncode} without a result"
    oom = any("out of memory" in line.lower() for line in tail)
    return {"ok": False, "oom": oom or returncode == -9, "error": error, "output_tail": tail}


class Budget:
    """The run's wall-clock allowance: each subprocess gets what is left, up to its own limit."""

    def __init__(self, seconds: float, per_run: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.per_run = per_run

    def timeout(self) -> float | None:
        """Seconds the next run may take, or ``None`` when too little is left to start one."""
        left = self.deadline - time.monotonic()
        return None if left < 30 else min(left, self.per_run)


class OutOfTime(Exception):
    """The run's time budget is spent."""


class Runner:
    """Starts workers in subprocesses, each with swap directories of its own that are removed afterwards."""

    def __init__(self, ssd: Sequence[Path], budget: Budget) -> None:
        self.ssd = list(ssd)
        self.budget = budget
        self.count = 0

    def __call__(self, spec: dict[str, Any]) -> dict[str, Any]:
        timeout = self.budget.timeout()
        if timeout is None:
            raise OutOfTime
        self.count += 1
        swap_dirs = [path / f"gpu-throughput-{os.getpid()}-{self.count}" for path in self.ssd]
        for swap_dir in swap_dirs:
            swap_dir.mkdir(parents=True)
        command = [sys.executable, "-m", "benchmarks.gpu_throughput", "--worker", json.dumps(
            {**spec, "swap_dirs": [str(d) for d in swap_dirs]})]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            return parse_worker_output(done.returncode, done.stdout + done.stderr)
        except subprocess.TimeoutExpired:
            return {"ok": False, "oom": False, "error": f"timed out after {timeout:.0f} s", "timeout": True}
        finally:
            # A crashed or killed worker leaves its swap files behind; they must not eat the next run's disk.
            for swap_dir in swap_dirs:
                shutil.rmtree(swap_dir, ignore_errors=True)


def throughput_row(shape: ModelShape, batch: int, system: str, result: dict[str, Any], ds_checkpointing: bool,
                   block: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of one training run: tokens/s, model and hardware TFLOPS, share of the block peak. With several
    ranks (``result["devices"]``) ``batch`` is each rank's micro-batch and the figures are the totals of all ranks
    (a step trains ``batch x devices`` sequences); the block peak is one GPU's, multiplied by the ranks."""
    devices = result.get("devices", 1)
    row: dict[str, Any] = {"model": shape.name, "params": shape.params(), "batch": batch, "devices": devices,
                           "system": system}
    if not result.get("ok"):
        row["error"] = "OOM" if result.get("oom") else result.get("error", "failed")
        return row
    seconds = result["seconds_per_step"]
    flops = model_flops(shape, batch) * devices
    if system == "ratel":
        recompute = result.get("recompute_flops")
        # Each rank's plan re-executes its ops on its own micro-batch.
        recompute = recompute * devices if recompute is not None else None
        row["recompute"] = "plan: profiled FLOPs of the ops it re-executes"
    elif ds_checkpointing:
        recompute = checkpoint_recompute_flops(shape, batch) * devices
        row["recompute"] = "activation checkpointing: one more forward of every block"
    else:
        recompute = 0.0
        row["recompute"] = "none"
    row.update(seconds_per_step=seconds, tokens_per_s=batch * devices * shape.seq / seconds,
               model_tflops=flops / seconds / 1e12, peak_allocated=result.get("peak_allocated"))
    if recompute is not None:
        row["hardware_tflops"] = (flops + recompute) / seconds / 1e12
    if block and block.get("ok") and "hardware_tflops" in row:
        row["block_peak_tflops"] = block["tflops"] * devices
        row["of_block_peak"] = row["hardware_tflops"] / row["block_peak_tflops"]
    for key in ("predicted_seconds_per_step", "predicted_forward", "predicted_backward", "measured_forward",
                "measured_backward", "bound", "placement", "plan"):
        if key in result:
            row[key] = result[key]
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Ratel's speedup over each other system on the same model and batch (tokens/s ratio)."""
    ratel = {(r["model"], r["batch"]): r for r in rows if r["system"] == "ratel" and "tokens_per_s" in r}
    for row in rows:
        base = ratel.get((row["model"], row["batch"]))
        if row["system"] != "ratel" and base is not None and "tokens_per_s" in row:
            row["ratel_speedup"] = base["tokens_per_s"] / row["tokens_per_s"]


def parse_ds_aio(text: str) -> dict[str, Any]:
    """DeepSpeed aio settings from JSON: a flat object, or ``{"aio": {...}}`` as ``ds_nvme_tune`` prints it (which
    writes booleans as the strings ``"true"`` and ``"false"``).

    Raises:
        argparse.ArgumentTypeError: If it is not such an object or names a key :data:`DS_AIO` does not have.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if isinstance(value, dict) and set(value) == {"aio"}:
        value = value["aio"]
    if not isinstance(value, dict) or set(value) - set(DS_AIO):
        raise argparse.ArgumentTypeError(f"need a JSON object with keys among {', '.join(DS_AIO)}, got {text!r}")
    return {k: v.lower() == "true" if isinstance(v, str) and v.lower() in ("true", "false") else v
            for k, v in value.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ssd", nargs="+", type=Path,
                        help="swap directories, one per NVMe drive. Ratel stripes over all of them; ZeRO-Infinity "
                             "takes one path per offload kind: optimizer states in the first, parameters in the "
                             "second (both in the first if alone) and no others. For every drive behind both, pass "
                             "one RAID-0 volume over the drives")
    parser.add_argument("--out", type=Path, help="directory for gpu_throughput.json")
    parser.add_argument("--models", nargs="+", default=["auto"],
                        help="'auto', a Table IV row (13B, 175B), ROW:LAYERS or LxHxD (default: auto)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, help="default 8 16 32 (--quick: 8)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--device-memory", default="24GiB", help="device memory cap for every system (default 24GiB)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first; RatelStrategy profiles 2 and plans before the 3rd (default 3)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    parser.add_argument("--devices", type=int, default=1,
                        help="GPUs of each training run (default 1): Lightning launches one rank per GPU, data "
                             "parallel; the batch size is each rank's, and s/step, tokens/s and TFLOPS are totals")
    parser.add_argument("--ratel-states", choices=["auto", "host", "ssd"], default="auto",
                        help="RatelStrategy's optimizer_states (default auto: host memory while it holds them)")
    parser.add_argument("--ds-aio", type=parse_ds_aio, default={},
                        help="JSON object replacing DeepSpeed aio settings, e.g. '{\"queue_depth\": 64}' or what "
                             f"ds_nvme_tune prints; keys: {', '.join(DS_AIO)}")
    parser.add_argument("--ds-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="activation checkpointing in the DeepSpeed runs (default on)")
    parser.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                        help="search the largest model each system trains at batch size 1 (default on)")
    parser.add_argument("--search-max-layers", type=int, help="upper end of that search (default: what fits on disk)")
    parser.add_argument("--max-seconds", type=float, default=6 * 3600, help="time budget of the whole run")
    parser.add_argument("--run-timeout", type=float, default=3600, help="time limit of one subprocess")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: an 8-layer model of the family, batch 8, 2 timed steps, search up to 8 "
                             "layers, 9 minutes at most")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None and (args.ssd is None or args.out is None):
        parser.error("--ssd and --out are required")
    if args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")
    if args.quick:
        args.models = ["8x8x1024"] if args.models == ["auto"] else args.models
        args.batch_sizes = args.batch_sizes or [8]
        args.steps = min(args.steps, 2)
        args.search_max_layers = args.search_max_layers or 8
        args.max_seconds = min(args.max_seconds, 540)
        args.run_timeout = min(args.run_timeout, 240)
    args.batch_sizes = args.batch_sizes or [8, 16, 32]
    return args


def _deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _available_host_memory() -> int:
    from lightning_ratel.runtime.probe import available_host_memory

    return available_host_memory()


def auto_models(specs: Sequence[str], budgets: dict[str, float], systems: Sequence[str], vocab: int,
                seq: int, dirs: int = 1) -> tuple[list[ModelShape], list[str]]:
    """The models to run and, for ``auto``, a line saying how the size was chosen (``dirs``: swap directories)."""
    models, notes = [], []
    for spec in specs:
        if spec != "auto":
            models.append(parse_model(spec, vocab, seq))
            continue
        limit = params_that_fit(budgets, systems, dirs)
        layers = largest_layers(lambda n: proportional(n, vocab, seq), limit)
        if layers == 0:
            raise SystemExit(f"gpu_throughput: not even a 1-layer model fits every system in {budgets}")
        shape = proportional(layers, vocab, seq)
        models.append(shape)
        held = [f"{k} {v / GIB:.0f} GiB" for k, v in budgets.items()]
        if dirs > 1:
            held = [f"{h} in each of {dirs} swap directories" if h.startswith("disk") else h for h in held]
        notes.append(f"auto: {shape.name} ({shape.params() / 1e9:.2f} B parameters), the largest of the Table IV "
                     f"family (heads = layers, hidden = 128 x layers) within {limit / 1e9:.2f} B parameters that "
                     f"{', '.join(systems)} all hold in {', '.join(held)}")
    return models, notes


def machine_info(ssd: Sequence[Path], device_memory: int) -> dict[str, Any]:
    properties = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "gpu": properties.name,
        "gpu_memory": properties.total_memory,
        "device_memory_cap": device_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host_memory_available": _available_host_memory(),
        "ssd_free": {str(p): shutil.disk_usage(p).free for p in ssd},
    }
    for package in ("deepspeed", "lightning", "transformers", "kvikio-cu13", "kvikio-cu12", "kvikio"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


def _print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"Throughput, seq {report['config']['seq']}, device capped to "
                        f"{report['machine']['device_memory_cap'] / GIB:.0f} GiB")
    for column in ("model", "batch", "GPUs", "system", "s/step", "tokens/s", "model TFLOPS", "hw TFLOPS", "block peak",
                   "hw/peak", "Ratel x", "note"):
        table.add_column(column)

    def fmt(value: Any, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    for row in report["throughput"]:
        table.add_row(
            row["model"], str(row["batch"]), str(row.get("devices", 1)), row["system"],
            fmt(row.get("seconds_per_step"), "{:.2f}"),
            fmt(row.get("tokens_per_s"), "{:.0f}"), fmt(row.get("model_tflops"), "{:.1f}"),
            fmt(row.get("hardware_tflops"), "{:.1f}"), fmt(row.get("block_peak_tflops"), "{:.1f}"),
            fmt(row.get("of_block_peak"), "{:.0%}"), fmt(row.get("ratel_speedup"), "{:.2f}"),
            row.get("error", ""),
        )
    console.print(table)
    predicted = [row for row in report["throughput"] if "predicted_seconds_per_step" in row]
    if predicted:
        table = Table(title="RatelStrategy's cost model against the measured steps (seconds; x = measured / predicted)",
                      caption=f"step: the timed steps' mean; forward and backward (the step after forward): medians "
                              f"of {PHASE_STEPS} steps after them, synchronised at each phase's end")
        for column in ("model", "batch", "step predicted", "measured", "x", "forward predicted", "measured", "x",
                       "backward predicted", "measured", "x", "bound (fwd, bwd)"):
            table.add_column(column)
        for row in predicted:
            cells = []
            for p, m in (("predicted_seconds_per_step", "seconds_per_step"), ("predicted_forward", "measured_forward"),
                         ("predicted_backward", "measured_backward")):
                guess, seen = row.get(p), row.get(m)
                cells += [fmt(guess, "{:.4f}"), fmt(seen, "{:.4f}"),
                          fmt(seen / guess if guess and seen is not None else None, "{:.2f}")]
            bound = row.get("bound", {})
            table.add_row(row["model"], str(row["batch"]), *cells,
                          f"{bound.get('forward', '-')}, {bound.get('backward', '-')}")
        console.print(table)
    if report["largest"]:
        table = Table(title="Largest model trained at batch size 1 (layers of the same width)")
        for column in ("system", "layers", "parameters", "attempts", "note"):
            table.add_column(column)
        for system, entry in report["largest"].items():
            params = entry.get("params")
            table.add_row(system, str(entry.get("layers", "-")), "-" if params is None else f"{params / 1e9:.2f} B",
                          " ".join(f"{n}{'+' if ok else '-'}" for n, ok in entry.get("attempts", [])),
                          entry.get("note", ""))
        console.print(table)
    for line in report["notes"]:
        console.print(line)


def _write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "gpu_throughput.json.partial"
    partial.write_text(json.dumps(report, indent=1))
    partial.replace(out / "gpu_throughput.json")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return
    if not torch.cuda.is_available():
        raise SystemExit(
            f"gpu_throughput measures training on a CUDA GPU, and torch {torch.__version__} sees none here "
            "(torch.cuda.is_available() is False). Nothing was measured."
        )
    if args.devices > 1 and args.devices > torch.cuda.device_count():
        raise SystemExit(f"gpu_throughput: --devices {args.devices}, and torch sees {torch.cuda.device_count()} GPUs "
                         "here. Nothing was measured.")
    from lightning_ratel.sizes import parse_bytes

    for path in args.ssd:
        if not path.is_dir():
            raise SystemExit(f"gpu_throughput: --ssd {path} is not a directory")
    cap = parse_bytes(args.device_memory, "--device-memory")
    budgets = {
        # Per swap directory: the least free space, which sizing multiplies out per system (disk_bytes_per_dir).
        "disk": SIZING_FRACTION["disk"] * min(shutil.disk_usage(p).free for p in args.ssd),
        "host": SIZING_FRACTION["host"] * _available_host_memory(),
        "device": SIZING_FRACTION["device"] * cap,
    }
    deepspeed = _deepspeed_installed()
    models, notes = auto_models(args.models, budgets, args.systems, args.vocab, args.seq, len(args.ssd))
    if not deepspeed:
        notes.append("DeepSpeed is not installed here: its rows say so and nothing of it was measured.")
    elif "zero-infinity" in args.systems:
        notes.append(deepspeed_layout_note(args.ssd))
    report: dict[str, Any] = {
        "machine": machine_info(args.ssd, cap),
        "config": {**{k: v for k, v in vars(args).items() if k not in ("worker", "ssd", "out")},
                   "ssd": [str(p) for p in args.ssd], "out": str(args.out)},
        "models": [{**asdict(m), "name": m.name, "params": m.params()} for m in models],
        "flops": {
            "model": "tokens * (6 * (12 * layers * hidden^2 + vocab * hidden) + 12 * layers * hidden * seq)",
            "hardware_ratel": "model + FLOPs of the ops the plan re-executes (torch.utils.flop_counter, profiled)",
            "hardware_deepspeed": "model + one forward of every block when --ds-checkpointing, else model",
            "block_peak": "tokens * (72 * hidden^2 + 12 * hidden * seq) per forward+backward of one resident block",
        },
        "io": None,
        "block_peak": [],
        "throughput": [],
        "largest": {},
        "notes": notes,
    }
    run = Runner(args.ssd, Budget(args.max_seconds, args.run_timeout))
    base = {"device_memory": cap, "ds_checkpointing": args.ds_checkpointing, "ds_aio": args.ds_aio,
            "ratel_states": args.ratel_states, "devices": args.devices}
    try:
        report["io"] = run({**base, "kind": "io"})
        _write(report, args.out)
        for shape in models:
            for batch in args.batch_sizes:
                common = {**base, "shape": asdict(shape), "batch": batch}
                block = run({**common, "kind": "block"})
                report["block_peak"].append({"model": shape.name, "batch": batch, **block})
                for system in args.systems:
                    if system in DEEPSPEED_SYSTEMS and not deepspeed:
                        result = {"ok": False, "error": "DeepSpeed is not installed"}
                    else:
                        result = run({**common, "kind": "train", "system": system, "warmup": args.warmup,
                                      "steps": args.steps})
                    report["throughput"].append(
                        throughput_row(shape, batch, system, result, args.ds_checkpointing, block))
                    add_ratios(report["throughput"])
                    _write(report, args.out)
        if args.search:
            _search_largest(args, models[0], budgets, deepspeed, run, base, report)
    except OutOfTime:
        report["notes"].append(f"The time budget (--max-seconds {args.max_seconds:.0f}) ran out; later runs were "
                               "not started.")
    _write(report, args.out)
    _print_tables(report)
    print(f"written: {args.out / 'gpu_throughput.json'}")


def _search_largest(args: argparse.Namespace, width: ModelShape, budgets: dict[str, float], deepspeed: bool,
                    run: Callable[[dict[str, Any]], dict[str, Any]], base: dict[str, Any],
                    report: dict[str, Any]) -> None:
    """For each system, the most layers of ``width``'s width it trains at batch size 1."""
    for system in args.systems:
        entry: dict[str, Any] = {"attempts": []}
        report["largest"][system] = entry
        if system in DEEPSPEED_SYSTEMS and not deepspeed:
            entry["note"] = "DeepSpeed is not installed"
            continue
        try:
            _search_system(system, args.search_max_layers, width, budgets, len(args.ssd), run, base, entry)
        finally:
            _write(report, args.out)


def _search_system(system: str, max_layers: int | None, width: ModelShape, budgets: dict[str, float], dirs: int,
                   run: Callable[[dict[str, Any]], dict[str, Any]], base: dict[str, Any],
                   entry: dict[str, Any]) -> None:
    """Fill ``entry`` with the attempts and the most layers ``system`` trains; re-raises :class:`OutOfTime`."""

    def make(layers: int) -> ModelShape:
        return ModelShape(layers, width.heads, width.hidden, width.vocab, width.seq)

    # Beyond what the whole free space could hold an attempt must fail; no need to run it.
    whole = {k: v / SIZING_FRACTION[k] for k, v in budgets.items()}
    limit = max(1, max_layers or largest_layers(make, params_that_fit(whole, [system], dirs), cap=4096))

    def trial(layers: int) -> bool:
        # Three steps: RatelStrategy profiles two, then runs one under its plan (which must fit the budgets).
        result = run({**base, "kind": "train", "system": system, "shape": asdict(make(layers)), "batch": 1,
                      "warmup": 2, "steps": 1})
        entry["attempts"].append((layers, bool(result.get("ok"))))
        if not result.get("ok"):
            entry.setdefault("failures", {})[str(layers)] = result.get("error")
        return bool(result.get("ok"))

    try:
        entry["layers"] = largest_passing(trial, start=1, limit=limit)
    except OutOfTime:
        entry["layers"] = max((n for n, ok in entry["attempts"] if ok), default=0)
        entry["note"] = "incomplete: the time budget ran out; it trains at least this many layers"
        raise
    finally:
        entry["params"] = make(entry["layers"]).params() if entry.get("layers") else None
    if entry["layers"] == limit:
        entry["note"] = f"reached the search limit ({limit} layers)"


if __name__ == "__main__":
    main()
