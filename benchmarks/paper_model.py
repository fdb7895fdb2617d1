"""The planner's cost model on the Ratel paper's machine and GPT models, against the figures the paper published.

Ratel (ICDE 2025; its artifact is RC4ML/LoHan on GitHub) fine-tunes GPT models on one RTX 4090 with model states on
NVMe SSDs. This benchmark hands the planner (:func:`lightning_ratel.plan.search`) that machine and those models
through hand-built profiles, with no device at all, and prints what it predicts next to what was measured:

- GPT 13B at batch 64 with 1, 2, 3, 6 and 12 SSDs: 70.3, 111.7, 136.3, 151.5 and 148.2 TFLOPS (the artifact's
  ``evaluation_data.md``, Figure 10(b));
- every model below 70B at 90-95% of the in-GPU block peak, GPT 175B at about 53% of it because GPU memory caps its
  batch at 16 (the paper's reading of its end-to-end figure, as issue 13 quotes it; the artifact lists 52.6 and 86.9
  TFLOPS at batch 8 and 16, and out of memory at 32).

Where every number comes from
-----------------------------

The machine (the artifact's testbed table in ``evaluation_data.md``: dual Xeon Gold 5320, 768 GB DDR4-3200 on 16
channels, one RTX 4090, 12 D7-P5510 3.84 TB SSDs):

- GPU compute: 165.2 TFLOPS, the RTX 4090's dense FP16/BF16 tensor rate with FP32 accumulation (NVIDIA Ada
  Lovelace architecture whitepaper, RTX 4090 column). Assumption: large GEMMs run at that rate; the artifact's own
  155.8 TFLOPS end to end for 13B at batch 64 (Figure 7(a)) is 94% of it, so the card sustains at least that much.
- Attention: FlashAttention (the artifact's ``flash_attn.flash_attention.FlashAttention``) at half the GEMM rate,
  an assumption (the FlashAttention-2 paper puts version 1 at 25-40% and version 2 at 50-73% of an A100's peak);
  attention is 3.3% of a 13B block's FLOPs and 1.4% of a 175B block's, so the figure hardly matters.
- GPU memory: 24,564 MiB (what the driver reports for a 24 GB card) less 512 MiB for the CUDA context
  (assumption); 1008 GB/s GDDR6X bandwidth (whitepaper), of which element-wise kernels get 90% (assumption).
- PCIe 4.0 x16 between GPU and host: 31.5 GB/s per direction raw (16 GT/s x 16 lanes, 128b/130b); pinned copies
  reach 25 GB/s (assumption, the usual ~80% of raw).
- SSDs: 6.5 GB/s sequential read and 3.4 GB/s sequential write per D7-P5510 3.84 TB (Intel/Solidigm product brief;
  the figures as we know them, not re-read for this benchmark), striped as one RAID 0 array (the artifact's
  ``make_raid.sh``), so ``n`` drives give ``n`` times that.
- Host DRAM: 16 channels x 3200 MT/s x 8 bytes = 409.6 GB/s, shared by the CPU optimizer and every transfer.
- Host-side PCIe: 2 sockets x 64 PCIe 4.0 lanes (Intel ARK) x 1.97 GB/s = 252 GB/s per direction for the GPU and the
  SSDs together; on this machine it never binds, but the model counts it.
- CPU AdamW: 1.2 G parameters/s, the one number fitted rather than sourced. Nothing published gives the rate of the
  artifact's optimizer (DeepSpeedCPUAdam in a second process, fed one sub-group at a time through multiprocessing
  queues, ``main.py``); 1.2 G/s is what makes GPT 175B at batch 8 take the artifact's 52.6 TFLOPS (that point is the
  furthest from compute-bound). Every other published figure is then a prediction. For scale: DeepSpeedCPUAdam ran at
  0.37 G/s per core in this repository's ``benchmarks/cpu_adam.py`` (RESULTS.md), so 52 cores would allow far more;
  the 13B figures do not depend on it (their updates hide under backward at any rate above 0.6 G/s).
- Host memory for the run: 768 GB; the artifact's ``config.json`` pins 6 x 1.2 GB of parameter and 4 x 1.2 GB of
  activation swap buffers (held by the run, :data:`HOST_STATIC_BYTES`).

The models (sequence length 1024, vocabulary 50257, the artifact's ``gpt_model.py``): GPT-2-style pre-norm blocks
with a 4x MLP, GELU, dropout 0.1, FlashAttention, token and position embeddings, no LM head (the artifact's loss is a
mean squared error on the last hidden state). Rows: 13B (40 layers, 40 heads, hidden 5120) and 175B (96, 96, 12288)
as the artifact lists them; 70B (80, 64, 8192) from the artifact's multi-GPU figures; 6.7B (32, 32, 4096) from
GPT-3's Table 2.1, a second model below 70B. The paper's Table IV itself could not be read here.

How the artifact trains them, and so the profiles: fp16 weights and activations; the fp32 master, the Adam moments
and the fp16 compute copies live on the SSDs (``offload_param`` and ``offload_optimizer`` on NVMe), so compute copies
are read from the SSDs in forward and again in backward (``param_cache="ssd"``) and each update writes the fp16 copy
back besides master and moments (14 bytes written, 12 read per parameter). State writes that do not fit in backward
are deferred into the next forward (``state_spill``, delayed write-back; without it the 1-SSD point drops from 0.86
to 0.79 of the published figure and the 2-SSD point from 1.08 to 0.89). Each layer is two checkpointed halves
(attention, MLP), so each half is one planner block whose input is stored and whose other outputs the planner may
keep, swap or recompute. Per op, FLOPs and saved bytes follow from the shapes (:func:`gpt_layers`); an op's time is
its FLOPs at the GEMM or attention rate, or its memory traffic at the GDDR6X rate for element-wise ops; backward is
twice forward (2.5 times for attention, whose backward recomputes the scores).

Several GPUs in one server (the artifact's Figure 11(a)-(d): 13B and 70B on 2 and 4 RTX 4090s, by global batch).
What is published of that server, and what is assumed:

- The machine: ``evaluation_data.md`` lists Figure 11 under the same testbed table as every other figure (dual Xeon
  Gold 5320, 768 GB, 12 D7-P5510), so the CPUs, DRAM and SSD array are those above, shared by the GPUs.
- The run: the artifact's ``run.sh`` shows the multi-GPU launch as ``torchrun main.py`` with the single-GPU flags
  (``--batch_size 64`` per process, the same model flags) except ``--swap_ratio 0.8`` instead of 0.3, and a
  ``config.json`` from a private repository; the public ``main.py`` has no data-parallel code (no process group, no
  gradient reduction), so how the ranks split the optimizer is not published. 64 per process on 2 and 4 GPUs is the
  largest global batch of Figure 11(a)/(c) (128, 256), so the global batch is split evenly; 70B's largest (48, 96)
  is 24 per GPU.
- The PCIe topology is not published. 2 sockets x 64 lanes = 128 lanes hold 4 GPUs at x16 and 12 SSDs at x4 (112
  lanes) without a switch, so the model gives each GPU a PCIe 4.0 x16 link of its own (an assumption).
- GeForce RTX 4090s have no peer-to-peer path (NVIDIA/nccl issue 1127 and NVIDIA/nccl-tests issue 117, maintainers'
  and users' reports): collectives between them pass through host memory, over each GPU's own link.
- The paper's own section on the multi-GPU server could not be read here (the stored copies of arXiv 2403.06504
  hold its abstract only); its ZeRO-Infinity comparison is known as the ratios issue 23 quotes: Ratel 2.21x (13B)
  and 1.69x (70B) ZeRO-Infinity's throughput on 4 GPUs, batch not stated; they are compared at the largest batch.

Ratel on N GPUs: one rank per card, the global batch split evenly. The ranks share what the node has once: the 12
SSDs, the host side of PCIe, DRAM's bandwidth and the cores that run the CPU AdamW (``CostSettings.ranks_on_node``:
each rank sees ``1 / N`` of those rates), host memory and SSD space (each rank plans with ``1 / N`` of them); each
rank owns ``1 / N`` of the states (as ``lightning_ratel.plan.owners`` partitions them), while every rank pages in
every compute copy (from its own swap files, which hold each one: ``lightning_ratel.runtime.collectives.StoredCopies``)
and sends its whole gradient to host memory, where the owners add them up. Nothing is fitted to these figures.

ZeRO-Infinity on N GPUs (:func:`zero_infinity_step`): DeepSpeed ZeRO-3 with parameters and optimizer states on NVMe,
as its source has it (``deepspeed/runtime/zero/stage3.py``, ``offload_config.py``), on the same node, blocks and
rates: each rank owns ``1 / N`` of every parameter; for each pass it reads its part of the fp16 compute copies from
the SSDs and the ranks all-gather the rest through host memory (every GPU receives the whole model, 2 bytes a
parameter, over its link, and sends its part); activation checkpoints (each block's input) go to host memory in
forward and come back in backward (the paper's first version, arXiv 2403.06504v1, as emergentmind.com summarises
it: ZeRO-Infinity keeps activations in DRAM), and
backward recomputes each block's forward; gradients are reduce-scattered through host memory and each rank's fp32
gradient partition is written to the SSDs (``swap_out_gradients``, 4 bytes a parameter). Only after backward does
the optimizer step run, sub-group by sub-group: read master, moments and gradient (16 bytes), AdamW, write master
and moments and the fp16 copy (14 bytes), one after the other, since ``pipeline_read`` and ``pipeline_write``
default to off. The CPU AdamW rate is the same 1.2 G parameters/s (the same DeepSpeedCPUAdam kernel), shared by the
ranks. Host-side PCIe and DRAM are left out: four x16 links carry at most 100 GB/s each way and the array 78 GB/s
in and 41 GB/s out, under the 252 GB/s a direction and 409.6 GB/s the node has. With the activation checkpoints on
the host, what must fit the card is one block's backward (:func:`zero_infinity_step` raises where it does not).

Where the predictions miss (see :func:`multi_gpu_rows` and :func:`zero_infinity_rows`): at the largest batches of
13B (278.2 and 514.4 TFLOPS, the figures the artifact's README quotes) Ratel is within 15%; everywhere the step is
bound by the CPU optimizer (70B, and 13B at small batches) it is 1.4-2x too high. The published steps there take
about 23-25 s for 13B and 100-111 s for 70B at every batch and on 2 as on 4 GPUs, so the bound is node-wide and does
not grow with the GPUs; read as the CPU AdamW's rate, it is 0.57-0.76 G parameters/s for the whole node (the
"published implies" column), where the single-GPU figures imply 1.07-1.19 G/s (175B) and 0.95-1.04 G/s (13B at batch
8 and 16). Nothing in the hardware description accounts for that (the artifact holds no multi-GPU code to read it
from), so the model is left without a factor for it. The rate is not a hardware figure in any case: 52 cores at the
0.37 G/s per core DeepSpeedCPUAdam ran at here would update about 19 G/s, and DRAM (409.6 GB/s, 28 bytes an update)
allows 14.6 G/s, so the artifact's optimizer is bound by its own design (one process, fed one tensor at a time
through queues), which the published steps alone cannot size.

ZeRO-Infinity: at 70B its predicted throughput is within 15% of what the published 1.69x implies; at 13B it is 1.39x
too high (the implied figure would need a 0.37 G/s AdamW with the rest as predicted), so neither predicted ratio is
within 15% (1.74x against 2.21x, and 2.31x against 1.69x, where Ratel's own 70B prediction is 1.49x too high).
With the node rate Ratel's own optimizer-bound steps imply (0.59 G/s at 13B, 0.72 G/s at 70B: not a model input,
it is read from the figures being checked), ZeRO-Infinity would come out at 274.6 and 185.5 TFLOPS, 1.18 and 0.90 of
what the ratios imply: nearer, one still outside 15%, so a slower optimizer on the multi-GPU runs is consistent with
both systems' figures but does not account for all of ZeRO-Infinity's at 13B.

Throughput is model FLOPs (forward and backward of every matmul and of attention, recompute not counted) over the
predicted iteration time; the in-GPU block peak is the same FLOPs over the time of a layer's forward and backward with
everything resident (Ratel's "green line"). How the artifact counted its TFLOPS is not written down (its scripts print
times only); these are the usual model FLOPs.

Run from the repository root::

    python -m benchmarks.paper_model
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.plan.cost import CostModel, CostSettings, DeviceOverhead, bottleneck
from lightning_ratel.plan.profile import LayerProfile, OpProfile
from lightning_ratel.plan.search import Plan, search

GB = 10**9
MIB = 1 << 20

GEMM_FLOPS = 165.2e12
"""RTX 4090 dense FP16/BF16 tensor FLOP/s with FP32 accumulation (Ada whitepaper), taken as the GEMM rate."""
ATTENTION_FLOPS = 0.5 * GEMM_FLOPS
"""FlashAttention's rate, an assumption (see the module docstring)."""
ELEMENTWISE_BYTES = 0.9 * 1008 * GB
"""Bytes/s element-wise kernels move: 90% of the RTX 4090's 1008 GB/s (assumption)."""
DEVICE_MEMORY = (24564 - 512) * MIB
"""What a 24 GB RTX 4090 reports, less 512 MiB for the CUDA context (assumption)."""
PCIE_BANDWIDTH = 25 * GB
"""Pinned host<->device copies over PCIe 4.0 x16 per direction (about 80% of the raw 31.5 GB/s, assumption)."""
SSD_READ = 6.5 * GB
"""One D7-P5510 3.84 TB, sequential read (product brief)."""
SSD_WRITE = 3.4 * GB
"""One D7-P5510 3.84 TB, sequential write (product brief)."""
SSD_CAPACITY = 3.84e12
"""One D7-P5510's capacity in bytes."""
DRAM_BANDWIDTH = 16 * 3200e6 * 8
"""16 channels of DDR4-3200, 8 bytes a transfer: 409.6 GB/s (the artifact's testbed table)."""
HOST_IO_BANDWIDTH = 2 * 64 * 1.969e9
"""Host-side PCIe per direction, GPU link and SSDs together: 2 sockets x 64 PCIe 4.0 lanes (Intel ARK)."""
CPU_ADAM_PARAMS_PER_S = 1.2e9
"""The artifact's CPU AdamW rate, fitted to GPT 175B at batch 8 (see the module docstring)."""
HOST_MEMORY = 768 * GB
"""The testbed's DRAM."""
HOST_STATIC_BYTES = int((6 + 4) * 1.2e9)
"""Pinned swap buffers the artifact's config.json sets up: 6 x 1.2 GB for parameters, 4 x 1.2 GB for activations."""
ACT_BYTES = 2
"""fp16 activations."""
PARAM_BYTES = 2
"""fp16 compute copies and gradients."""
STATE_READ_BYTES = 12
"""fp32 master and two Adam moments read per parameter and step."""
STATE_WRITE_BYTES = 14
"""Master and moments written back, plus the fp16 compute copy the next forward reads from the SSDs."""
SEQ = 1024
VOCAB = 50257


@dataclass(frozen=True)
class GPT:
    """A GPT model of the paper's evaluation."""

    name: str
    layers: int
    heads: int
    hidden: int

    def params(self) -> int:
        """Parameters: the blocks' weights and biases, their layer norms, the embeddings and the final norm."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (VOCAB + SEQ) * h + 2 * h


MODELS = {
    "6.7B": GPT("6.7B", 32, 32, 4096),
    "13B": GPT("13B", 40, 40, 5120),
    "70B": GPT("70B", 80, 64, 8192),
    "175B": GPT("175B", 96, 96, 12288),
}
"""The models, by name (see the module docstring for where each row comes from)."""

PUBLISHED_13B_BY_SSDS = {1: 70.3, 2: 111.7, 3: 136.3, 6: 151.5, 12: 148.2}
"""GPT 13B, batch 64: TFLOPS by number of SSDs (artifact's evaluation_data.md, Figure 10(b))."""
PUBLISHED_175B = {8: 52.6, 16: 86.9}
"""GPT 175B, 12 SSDs: TFLOPS by batch; batch 32 ran out of GPU memory (artifact, Figure 7(b))."""
PUBLISHED_MULTI_GPU = {
    (2, "13B"): {16: 55.0, 32: 103.2, 64: 194.7, 128: 278.2},
    (2, "70B"): {16: 64.6, 32: 128.8, 48: 183.5},
    (4, "13B"): {32: 106.5, 64: 209.7, 128: 358.7, 256: 514.4},
    (4, "70B"): {32: 124.8, 64: 249.7, 96: 348.4},
}
"""(GPUs, model) -> global batch -> global TFLOPS, RTX 4090s in one server (artifact's evaluation_data.md, Figure
11(a)-(d)); the largest batch of each is the figure the artifact's README and issue 23 quote."""
PUBLISHED_13B_BY_BATCH = {8: 42.8, 16: 84.3, 32: 143.1, 64: 155.8}
"""GPT 13B, one GPU, 12 SSDs: TFLOPS by batch (artifact's evaluation_data.md, Figure 5(a)/7(a)); batch 128 (153.8)
is left out: the search finds 13B's backward working set at batch 128 larger than the card (25.3 GiB of fixed
device bytes; :func:`batch_limit` says 13B holds at most 106 samples on the card, 17% short of what the artifact ran).
"""
RATEL_OVER_ZERO_INFINITY_4_GPUS = {"13B": 2.21, "70B": 1.69}
"""Ratel's throughput over ZeRO-Infinity's on 4 RTX 4090s (the paper's multi-GPU section as issue 23 quotes it; no
batch stated: compared at the largest published batch). ZeRO-Infinity trains nothing larger than 70B there."""
ZI_GRAD_BYTES = 4
"""fp32 gradient partition ZeRO-Infinity writes to the SSDs in backward (``swap_out_gradients``) and reads back."""
ZI_STEP_READ_BYTES = 12 + ZI_GRAD_BYTES
"""Read per parameter by ZeRO-Infinity's step: fp32 master, two moments, fp32 gradient."""
ZI_STEP_WRITE_BYTES = 12 + PARAM_BYTES
"""Written per parameter by ZeRO-Infinity's step: master and moments, and the fp16 copy to its parameter swap."""
WITHIN = 0.15
"""The check every published figure is held to: predicted within 15% of published."""
PAPER_BATCH = 64
"""The batch the paper's 13B sweep runs at; below-70B models are compared there."""
BELOW_70B = ("6.7B", "13B")
"""The models below 70B (the 70B row is the boundary, compared but with no published share)."""
SHARE_OF_PEAK_BELOW_70B = (0.90, 0.95)
"""The paper's reading: models below 70B reach 90-95% of the in-GPU block peak."""
SHARE_OF_PEAK_175B = 0.53
"""The paper's reading: GPT 175B reaches about 53% of it, its batch held to 16 by GPU memory."""


def paper_hardware(ssds: int = 12) -> HardwareProfile:
    """The testbed with ``ssds`` D7-P5510 drives striped."""
    return HardwareProfile(
        device_type="cuda",
        h2d_bandwidth=PCIE_BANDWIDTH,
        d2h_bandwidth=PCIE_BANDWIDTH,
        ssd_read_bandwidth=ssds * SSD_READ,
        ssd_write_bandwidth=ssds * SSD_WRITE,
        adam_params_per_s=CPU_ADAM_PARAMS_PER_S,
        host_memory_free=HOST_MEMORY,
        device_memory_free=DEVICE_MEMORY,
        ssd_free=int(ssds * SSD_CAPACITY),
        host_io_bandwidth=HOST_IO_BANDWIDTH,
        host_memory_bandwidth=DRAM_BANDWIDTH,
    )


def _gemm(name: str, tokens: int, n_in: int, n_out: int, saved: int, inputs: list[str]) -> tuple[OpProfile, float]:
    """A linear layer: its op and its backward seconds."""
    flops = 2.0 * tokens * n_in * n_out
    seconds = flops / GEMM_FLOPS
    return OpProfile(name, seconds, flops, saved, inputs), 2 * seconds


def _elementwise(name: str, moved: int, saved: int, inputs: list[str]) -> tuple[OpProfile, float]:
    """A memory-bound op moving ``moved`` bytes in forward (and twice that in backward)."""
    seconds = moved / ELEMENTWISE_BYTES
    return OpProfile(name, seconds, 0.0, saved, inputs), 2 * seconds


def _half(name: str, index: int, ops: list[tuple[OpProfile, float]], params: int) -> LayerProfile:
    """One checkpointed half of a layer as a planner block."""
    return LayerProfile(name=name, index=index, forward_time=sum(op.forward_time for op, _ in ops),
                        backward_time=sum(backward for _, backward in ops), param_bytes=params * PARAM_BYTES,
                        grad_bytes=params * PARAM_BYTES, trainable_numel=params, ops=[op for op, _ in ops])


def gpt_layers(model: GPT, batch: int) -> list[LayerProfile]:
    """Hand-built profiles of ``model`` at ``batch``: the embeddings, then an attention and an MLP half per layer.

    Saved bytes per token of a layer (``h`` the hidden size, 2-byte activations, 1-byte dropout masks): attention
    half 13h (its input 2h, layer norm output 2h, q/k/v 6h, attention output 2h, dropout mask h) plus norm statistics
    and FlashAttention's log-sum-exp; MLP half 21h (input 2h, norm output 2h, up-projection 8h, GELU output 8h, mask
    h): 34h in all, as Korthikanti et al. (2022) count with FlashAttention.
    """
    h, t = model.hidden, batch * SEQ
    act = t * h * ACT_BYTES
    stats = t * 8  # layer norm mean and reciprocal std, fp32
    lse = batch * model.heads * SEQ * 4  # FlashAttention's log-sum-exp, fp32
    attention_flops = 4.0 * batch * SEQ * SEQ * h
    layers = [LayerProfile(name="embed", index=0, forward_time=3 * act / ELEMENTWISE_BYTES,
                           backward_time=6 * act / ELEMENTWISE_BYTES, param_bytes=(VOCAB + SEQ) * h * PARAM_BYTES,
                           grad_bytes=(VOCAB + SEQ) * h * PARAM_BYTES, trainable_numel=(VOCAB + SEQ) * h,
                           ops=[OpProfile("*", 0.0, 0.0, 0)], op_level=False)]
    for i in range(model.layers):
        attention = [
            (OpProfile("input", 0.0, 0.0, act), 0.0),
            _elementwise("ln_1", 2 * act, act + stats, ["input"]),
            _gemm("c_attn", t, h, 3 * h, 3 * act, ["ln_1"]),
            (OpProfile("flash", attention_flops / ATTENTION_FLOPS, attention_flops, act + lse, ["c_attn"]),
             2.5 * attention_flops / ATTENTION_FLOPS),
            _gemm("c_proj", t, h, h, 0, ["flash"]),
            _elementwise("dropout", 2 * act + act // 2, act // 2, ["c_proj"]),
            _elementwise("residual", 3 * act, 0, ["dropout", "input"]),
        ]
        mlp = [
            (OpProfile("input", 0.0, 0.0, act), 0.0),
            _elementwise("ln_2", 2 * act, act + stats, ["input"]),
            _gemm("c_fc", t, h, 4 * h, 4 * act, ["ln_2"]),
            _elementwise("gelu", 8 * act, 4 * act, ["c_fc"]),
            _gemm("c_proj", t, 4 * h, h, 0, ["gelu"]),
            _elementwise("dropout", 2 * act + act // 2, act // 2, ["c_proj"]),
            _elementwise("residual", 3 * act, 0, ["dropout", "input"]),
        ]
        layers.append(_half(f"layers.{i}.attn", 2 * i + 1, attention, 4 * h * h + 6 * h))
        layers.append(_half(f"layers.{i}.mlp", 2 * i + 2, mlp, 8 * h * h + 7 * h))
    return layers


def model_flops(model: GPT, batch: int) -> float:
    """Model FLOPs of one step: forward and backward (twice forward) of every matmul and of attention."""
    tokens = batch * SEQ
    return 3.0 * model.layers * (2.0 * tokens * 12 * model.hidden**2 + 4.0 * batch * SEQ * SEQ * model.hidden)


def in_gpu_peak(model: GPT, batch: int) -> float:
    """TFLOPS of one layer's forward and backward with everything on the device (Ratel's in-GPU block peak)."""
    halves = gpt_layers(GPT(model.name, 1, model.heads, model.hidden), batch)[1:]
    seconds = sum(half.forward_time + half.backward_time for half in halves)
    return model_flops(GPT(model.name, 1, model.heads, model.hidden), batch) / seconds / 1e12


def device_overhead(model: GPT, batch: int) -> DeviceOverhead:
    """The documented margin (:meth:`DeviceOverhead.margin`) with the loss's tensors as the "logits".

    The artifact's loss compares the last hidden state with a target of the same shape: output, target and the
    output's gradient, 2 bytes each per hidden value.
    """
    return DeviceOverhead.margin(logits_bytes=3 * batch * SEQ * model.hidden * ACT_BYTES)


def batch_limit(model: GPT, *, prefetch_depth: int = 1, most: int = 4096) -> int:
    """The largest batch (at most ``most``) whose device bytes, as the search estimates them, fit the 4090's memory.

    The estimate is not a straight line in the batch: which block's backward working set is the largest changes with
    it (at one sample the paging buffers and the embedding's weights weigh more than any block's activations), so the
    limit is found by bisection on the estimate itself, not extrapolated from small batches.
    """

    def fits(batch: int) -> bool:
        overhead = device_overhead(model, batch)
        cost = CostModel(paper_hardware(), gpt_layers(model, batch),
                         CostSettings(prefetch_depth=prefetch_depth, device_overhead=overhead))
        return overhead.fragmented(cost.fixed_device_bytes) <= DEVICE_MEMORY

    low, high = 0, most + 1  # fits(low) holds (no samples), fits(high) is taken not to
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def plan(model: GPT, batch: int, ssds: int = 12, gpus: int = 1) -> Plan:
    """The plan the search picks for one rank of ``gpus`` training ``model`` at ``batch`` samples per GPU on the
    testbed with ``ssds`` SSDs.

    The ranks share the node: each has ``1 / gpus`` of host memory and of the SSDs' space for its activations, and
    the cost model divides the SSDs', DRAM's, host-side PCIe's and the CPU optimizer's rates among them
    (``CostSettings.ranks_on_node``); each rank owns ``1 / gpus`` of the states, and stores the fp16 copies of the
    other ranks' parameters each step (2 bytes each: ``2 * (gpus - 1)`` per parameter it owns). Every rank keeps the
    artifact's pinned swap buffers of its own.
    """
    hw = paper_hardware(ssds)
    return search(hw, gpt_layers(model, batch), device_budget=hw.device_memory_free,
                  host_budget=HOST_STATIC_BYTES + int(0.9 * hw.host_memory_free / gpus),
                  store_budget=int(0.95 * hw.ssd_free / gpus),
                  settings=CostSettings(host_static_bytes=HOST_STATIC_BYTES,
                                        state_read_bytes_per_param=STATE_READ_BYTES,
                                        state_write_bytes_per_param=STATE_WRITE_BYTES + 2 * (gpus - 1),
                                        param_cache="ssd",
                                        state_spill=True, device_overhead=device_overhead(model, batch),
                                        ranks_on_node=gpus))


@dataclass
class Row:
    """One comparison: what the model predicts against what was published."""

    case: str
    predicted: float
    unit: str = ""
    published: float | None = None
    published_text: str = ""
    bound: str = ""
    implied: str = ""

    @property
    def ratio(self) -> float | None:
        """Predicted over published, where a figure was published."""
        return self.predicted / self.published if self.published else None

    @property
    def within(self) -> bool | None:
        """Whether the prediction is within :data:`WITHIN` of the published figure, where one was published."""
        return None if self.ratio is None else abs(self.ratio - 1.0) <= WITHIN


def _bound(result: Plan) -> str:
    """The resources that set forward's and backward's time."""
    forward = bottleneck(result.resource_times["forward"], unified=False)
    backward = bottleneck(result.resource_times["backward"], unified=False)
    return f"fwd {forward}, bwd {backward}"


def _tflops_row(case: str, model: GPT, batch: int, ssds: int, published: float) -> Row:
    """Predicted model TFLOPS of ``model`` at ``batch`` with ``ssds`` SSDs against a published figure (and, where the
    CPU AdamW bounds backward, the rate the published figure implies; see :func:`multi_gpu_rows`)."""
    result = plan(model, batch, ssds)
    tflops = model_flops(model, batch) / result.predicted_iteration_time / 1e12
    return Row(case, tflops, "TFLOPS", published, f"{published:.1f}", _bound(result),
               _optimizer_implied(model, batch, published, result))


def multi_gpu_tflops(model: GPT, global_batch: int, gpus: int) -> tuple[float, Plan]:
    """Predicted global TFLOPS of ``gpus`` ranks at ``global_batch`` (split evenly), and one rank's plan."""
    result = plan(model, global_batch // gpus, gpus=gpus)
    return gpus * model_flops(model, global_batch // gpus) / result.predicted_iteration_time / 1e12, result


def implied_adam_rate(model: GPT, step_seconds: float, other_seconds: float) -> float:
    """The node's CPU AdamW rate (parameters/s) that makes a step bound by it last ``step_seconds``, where
    ``other_seconds`` of the step are not the optimizer's (``inf`` where those alone take as long)."""
    left = step_seconds - other_seconds
    return model.params() / left if left > 0 else float("inf")


def published_step_seconds(model: GPT, global_batch: int, tflops: float) -> float:
    """Seconds of one step of ``global_batch`` samples at ``tflops`` (the model FLOPs this benchmark counts)."""
    return model_flops(model, global_batch) / (tflops * 1e12)


def _implied_text(rate: float) -> str:
    """A node-wide AdamW rate for the table."""
    return f"AdamW {rate / 1e9:.2f} G/s" if rate != float("inf") else "AdamW: faster than the rest allows"


def _optimizer_implied(model: GPT, global_batch: int, published: float, result: Plan) -> str:
    """Where the CPU AdamW bounds ``result``'s backward, the rate the published TFLOPS imply with forward as predicted
    and backward all optimizer; empty otherwise."""
    if bottleneck(result.resource_times["backward"], unified=False) != "cpu_optimizer":
        return ""
    step = published_step_seconds(model, global_batch, published)
    return _implied_text(implied_adam_rate(model, step, result.predicted_forward_time))


def multi_gpu_rows() -> list[Row]:
    """Every published multi-GPU figure against the prediction.

    Where the CPU AdamW bounds the predicted backward, the row also says what node-wide AdamW rate the published
    figure implies, with forward as predicted and backward all optimizer.
    """
    out = []
    for (gpus, name), figures in PUBLISHED_MULTI_GPU.items():
        model = MODELS[name]
        for global_batch, published in figures.items():
            tflops, result = multi_gpu_tflops(model, global_batch, gpus)
            implied = _optimizer_implied(model, global_batch, published, result)
            out.append(Row(f"{name}, {gpus} GPUs, global batch {global_batch}", tflops, "TFLOPS", published,
                           f"{published:.1f}", _bound(result), implied))
    return out


@dataclass
class ZeroInfinityStep:
    """ZeRO-Infinity's predicted step on one rank of a node: busy seconds per resource of each phase.

    Attributes:
        forward: ``"compute"``, ``"h2d"``, ``"d2h"`` (this GPU's link) and ``"ssd"`` (this rank's share of the node's
            array, reads and writes added: the SSDs are simplex).
        backward: the same, recompute in ``"compute"``.
        optimizer: ``"ssd_read"``, ``"cpu_optimizer"``, ``"ssd_write"``: run one after the other, after backward.
        device_bytes: predicted peak device memory.
    """

    forward: dict[str, float]
    backward: dict[str, float]
    optimizer: dict[str, float]
    device_bytes: int

    @property
    def seconds(self) -> float:
        """Forward and backward each as long as their busiest resource, then the whole optimizer step."""
        return max(self.forward.values()) + max(self.backward.values()) + sum(self.optimizer.values())

    @property
    def bound(self) -> str:
        """The resources that set forward's and backward's time, and the optimizer step's share of the step."""
        forward = max(self.forward, key=self.forward.__getitem__)
        backward = max(self.backward, key=self.backward.__getitem__)
        return f"fwd {forward}, bwd {backward}, step {sum(self.optimizer.values()) / self.seconds:.0%}"


def zero_infinity_step(model: GPT, batch: int, gpus: int,
                       adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S) -> ZeroInfinityStep:
    """ZeRO-Infinity (ZeRO-3, parameters and optimizer states on NVMe) on one of ``gpus`` ranks of the testbed, each
    with ``batch`` samples (see the module docstring for the mechanism and its sources).

    Raises:
        RuntimeError: one block's backward does not fit the RTX 4090 at ``batch``.
    """
    hw = paper_hardware()
    layers = gpt_layers(model, batch)
    params = model.params()
    settings = CostSettings(prefetch_depth=1, device_overhead=device_overhead(model, batch))
    cost = CostModel(hw, layers, settings)
    # Every activation but the working block's is on the host: what stays is paging, one block's backward, overheads.
    device_bytes = cost.overhead.fragmented(cost.fixed_device_bytes)
    if device_bytes > DEVICE_MEMORY:
        raise RuntimeError(f"ZeRO-Infinity at batch {batch} per GPU needs {device_bytes / 2**30:.1f} GiB of the "
                           f"RTX 4090's {DEVICE_MEMORY / 2**30:.1f} GiB")
    checkpoints = sum(op.saved_bytes for layer in layers[1:] for op in layer.ops if op.name == "input")
    forward_compute = sum(layer.forward_time for layer in layers)
    backward_compute = sum(layer.backward_time for layer in layers)
    weights = params * PARAM_BYTES
    own = weights / gpus
    read, write = hw.ssd_read_bandwidth / gpus, hw.ssd_write_bandwidth / gpus
    forward = {"compute": forward_compute, "h2d": weights / PCIE_BANDWIDTH,
               "d2h": (own + checkpoints) / PCIE_BANDWIDTH, "ssd": own / read}
    # Backward pages every weight in again, receives its peers' share of the reduce-scatter, sends its gradient.
    backward = {"compute": forward_compute + backward_compute,
                "h2d": (weights + weights * (gpus - 1) / gpus + checkpoints) / PCIE_BANDWIDTH,
                "d2h": weights / PCIE_BANDWIDTH,
                "ssd": own / read + params / gpus * ZI_GRAD_BYTES / write}
    # Each rank updates its share at its share of the node's AdamW rate: the node's time for every parameter.
    optimizer = {"ssd_read": params / gpus * ZI_STEP_READ_BYTES / read,
                 "cpu_optimizer": params / adam_params_per_s,
                 "ssd_write": params / gpus * ZI_STEP_WRITE_BYTES / write}
    return ZeroInfinityStep(forward, backward, optimizer, device_bytes)


def zero_infinity_tflops(model: GPT, global_batch: int, gpus: int,
                         adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S) -> tuple[float, ZeroInfinityStep]:
    """Predicted global TFLOPS of ZeRO-Infinity on ``gpus`` ranks at ``global_batch`` (split evenly), and one
    rank's step."""
    step = zero_infinity_step(model, global_batch // gpus, gpus, adam_params_per_s)
    return model_flops(model, global_batch) / step.seconds / 1e12, step


def zero_infinity_rows() -> list[Row]:
    """ZeRO-Infinity on 4 GPUs at each model's largest published batch: its predicted throughput against the one the
    published ratio implies (Ratel's published figure over the ratio), and the predicted ratio against the published.

    The throughput row also says what node-wide AdamW rate the implied figure would need, the rest of the step as
    predicted.
    """
    out = []
    gpus = 4
    for name, ratio in RATEL_OVER_ZERO_INFINITY_4_GPUS.items():
        model = MODELS[name]
        global_batch, ratel_published = max(PUBLISHED_MULTI_GPU[(gpus, name)].items())
        tflops, step = zero_infinity_tflops(model, global_batch, gpus)
        implied = ratel_published / ratio
        rest = step.seconds - step.optimizer["cpu_optimizer"]
        rate = implied_adam_rate(model, published_step_seconds(model, global_batch, implied), rest)
        out.append(Row(f"ZeRO-Infinity, {name}, {gpus} GPUs, global batch {global_batch}", tflops, "TFLOPS", implied,
                       f"{implied:.1f} ({ratel_published:.1f} / {ratio})", step.bound, _implied_text(rate)))
        ratel, _ = multi_gpu_tflops(model, global_batch, gpus)
        out.append(Row(f"Ratel / ZeRO-Infinity, {name}, {gpus} GPUs, global batch {global_batch}", ratel / tflops,
                       "x", ratio, f"{ratio:.2f}"))
    return out


def compared_batch(model: GPT) -> int:
    """The batch a model is compared at: the paper's 64, or the largest power of two the device holds if smaller."""
    limit = batch_limit(model)
    return min(PAPER_BATCH, 1 << (limit.bit_length() - 1)) if limit else 0


def rows() -> list[Row]:
    """Every comparison the benchmark prints."""
    out = [_tflops_row(f"13B, batch {PAPER_BATCH}, {ssds} SSD{'s' if ssds > 1 else ''}", MODELS["13B"], PAPER_BATCH,
                       ssds, published) for ssds, published in PUBLISHED_13B_BY_SSDS.items()]
    out += [_tflops_row(f"13B, batch {batch}, 12 SSDs (Figure 7(a))", MODELS["13B"], batch, 12, published)
            for batch, published in PUBLISHED_13B_BY_BATCH.items()]
    out += [_tflops_row(f"175B, batch {batch}, 12 SSDs", MODELS["175B"], batch, 12, published)
            for batch, published in PUBLISHED_175B.items()]
    low, high = SHARE_OF_PEAK_BELOW_70B
    for name, model in MODELS.items():
        limit = batch_limit(model)
        seen = {"13B": "128 ran", "175B": "16 ran, 32 out of memory"}.get(name, "")
        out.append(Row(f"{name}: largest batch the GPU holds", limit, "samples", published_text=seen))
        batch = compared_batch(model)
        result = plan(model, batch)
        share = model_flops(model, batch) / result.predicted_iteration_time / 1e12 / in_gpu_peak(model, batch)
        if name == "175B":
            published, text = SHARE_OF_PEAK_175B, f"about {SHARE_OF_PEAK_175B:.2f}"
        elif name in BELOW_70B:
            published, text = (low + high) / 2, f"{low:.2f}-{high:.2f}"
        else:
            published, text = None, ""
        out.append(Row(f"{name}, batch {batch}: share of the in-GPU block peak "
                       f"({in_gpu_peak(model, batch):.1f} TFLOPS)", share, "", published, text, _bound(result)))
    return out


def _table(title: str, rows: list[Row]) -> Table:
    """Rows as a table: predicted, published, their ratio, the 15% check, what binds and what the figure implies."""
    table = Table(title=title)
    table.add_column("case")
    table.add_column("predicted", justify="right")
    table.add_column("published", justify="right")
    table.add_column("predicted / published", justify="right")
    table.add_column(f"within {WITHIN:.0%}")
    table.add_column("bound by")
    table.add_column("published implies")
    for row in rows:
        if row.unit == "samples":
            number = f"{row.predicted:.0f} {row.unit}"
        elif row.unit == "x":
            number = f"{row.predicted:.2f}x"
        else:
            number = f"{row.predicted:.1f} {row.unit}" if row.unit else f"{row.predicted:.3f}"
        check = "-" if row.within is None else ("yes" if row.within else "NO")
        table.add_row(row.case, number, row.published_text or "-", "-" if row.ratio is None else f"{row.ratio:.2f}",
                      check, row.bound, row.implied)
    return table


def main() -> None:
    """Print predicted against published figures: one GPU, then several in one server."""
    console = Console(width=200)
    console.print(_table("Ratel's published figures against the planner's cost model (one RTX 4090, D7-P5510 SSDs)",
                         rows()))
    console.print("Shares are predicted model TFLOPS over the in-GPU block peak of the same model and batch; a share "
                  "row's ratio is against the middle of the published range.")
    console.print(_table("2 and 4 RTX 4090s in one server: Ratel, and ZeRO-Infinity against the ratios published",
                         multi_gpu_rows() + zero_infinity_rows()))
    console.print(f"'published implies': the node-wide CPU AdamW rate that makes the published step as long as "
                  f"published, the rest of the step as predicted (the model's rate: {CPU_ADAM_PARAMS_PER_S / 1e9:.1f} "
                  f"G/s). ZeRO-Infinity's published throughput is Ratel's published figure over the published ratio.")


if __name__ == "__main__":
    main()
