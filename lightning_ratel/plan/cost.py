"""Iteration-time and memory model of one micro-batch under an activation placement (Ratel, section IV-B/IV-D).

Each phase takes as long as its busiest resource: GPU compute, host->device and device->host PCIe (duplex, so two
resources) and the SSDs (simplex, so reads and writes add up). The CPU AdamW and the optimizer states' SSD traffic
overlap backward, or, where the updates wait for the end of backward, the CPU AdamW delays the next forward. Where the
"device" is the CPU itself (unified memory) nothing is copied between "device" and host: compute copies, gradients and
host-tier activations are used where they are, SSD-tier activations are written from and read into their own memory; the
optimizer runs on the compute cores, so it adds to compute instead of overlapping it, and so does the SSD traffic: its
staging copies and checksums run on the same cores (measured on the 2-core CPU box: each step's forward grew by the
bytes written at about the probed write rate, and its CPU seconds with it).

What profiling measures beyond the blocks refines the compute (:class:`CostSettings`): the forward's and the
backward's work outside any block, and the rate of the whole optimizer step (not only its kernel's).

Optional inputs refine this where a machine needs it, each leaving the model as above when not given: compute copies
read from the SSDs on every use (``param_cache="ssd"``), a host side whose PCIe (``host_io_bandwidth``) or DRAM
(``host_memory_bandwidth``) the transfers and the CPU optimizer contend for, optimizer-state writes that do not fit
in backward deferred into the next forward (``state_spill``), and device memory a step needs beyond parameters,
gradients and saved activations (:class:`DeviceOverhead`, :attr:`LayerProfile.peak_device_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.plan.profile import LayerProfile, validate_layers
from lightning_ratel.tiers import DEFAULT_TIER, INPUT_OP, PARAM_CACHE_TIERS, STORED_TIERS, TIERS, placement_key

CORE_RESOURCES = ("compute", "h2d", "d2h", "cpu_optimizer", "ssd")
"""The resources that run on the compute cores where the device is the CPU (unified memory)."""
OPTIMIZER_MEMORY_BYTES_PER_PARAM = 28
"""Host DRAM bytes one AdamW update touches per parameter: fp32 master, m and v each read and written (24), the 16-bit
gradient read (2) and the 16-bit compute copy written (2)."""


@dataclass
class Prediction:
    """Predicted times, peak memory and activation volumes of one micro-batch.

    Attributes:
        forward: resource -> busy seconds in forward: ``"compute"``, ``"h2d"``, ``"d2h"``, ``"ssd"``, and
            ``"cpu_optimizer"`` where the updates run after backward (:attr:`CostSettings.updates_after_backward`).
        backward: resource -> busy seconds in backward: ``"compute"`` (recompute included), ``"recompute"``,
            ``"h2d"``, ``"d2h"``, ``"ssd"``, and ``"cpu_optimizer"`` where the updates overlap backward (beside a GPU,
            all but the one the next forward waits for).
        forward_time: predicted seconds of forward.
        backward_time: predicted seconds of backward.
        iteration_time: ``forward_time + backward_time``.
        memory: predicted peak bytes of ``"device"``, ``"host"`` and ``"ssd"``.
        bytes: saved-activation bytes per tier: ``"device"``, ``"host"``, ``"ssd"``, ``"recompute"``.
        spilled: optimizer-state bytes written to the SSDs during the next forward instead of backward.

    With ``host_io_bandwidth`` the phases also have ``"host_in"`` and ``"host_out"`` (host-side PCIe, into and out of
    host memory), with ``host_memory_bandwidth`` a ``"dram"`` resource. On a GPU each phase also has ``"host"``: the
    training thread's work outside the blocks where some was measured (:attr:`CostSettings.forward_overhead`), and
    forward has ``"update_wait"`` where the CPU optimizer updates: the wait for the update of the unit it needs first
    (backward hands its gradients over last, and the step ends without waiting for it), then forward's compute.
    """

    forward: dict[str, float]
    backward: dict[str, float]
    forward_time: float
    backward_time: float
    iteration_time: float
    memory: dict[str, int]
    bytes: dict[str, int]
    spilled: int = 0


@dataclass(frozen=True)
class DeviceOverhead:
    """Device bytes a step needs beyond the paging buffers and one block's parameters, gradients and saved bytes.

    A block whose profile has a measured :attr:`~lightning_ratel.plan.profile.LayerProfile.peak_device_bytes` uses
    that where it is larger than the estimate with ``grad_temp_ratio``.

    Attributes:
        workspace_bytes: cuBLAS (and cuDNN) workspaces of the streams compute runs on.
        logits_bytes: what the head's output costs at the turn from forward to backward: the logits, what the loss
            saves of them and their gradient.
        autocast_cache_bytes: 16-bit copies of fp32 weights that autocast keeps while a block computes.
        grad_temp_ratio: gradients of activations alive during a block's backward, as a share of what the block
            saves (the gradient flowing into an op and the one it produces exist together).
        fragmentation: share of the allocated device bytes the caching allocator cannot hand out again.

    Raises:
        RatelConfigError: a negative value.
    """

    workspace_bytes: int = 0
    logits_bytes: int = 0
    autocast_cache_bytes: int = 0
    grad_temp_ratio: float = 0.0
    fragmentation: float = 0.0

    def __post_init__(self) -> None:
        values = (self.workspace_bytes, self.logits_bytes, self.autocast_cache_bytes, self.grad_temp_ratio,
                  self.fragmentation)
        if min(values) < 0:
            raise RatelConfigError(f"device overheads cannot be negative, got {self}")

    @classmethod
    def margin(cls, *, logits_bytes: int = 0, autocast_cache_bytes: int = 0) -> DeviceOverhead:
        """The margin to plan with where nothing was measured.

        - ``workspace_bytes``: 64 MiB, two streams' worth of cuBLAS workspace: PyTorch sizes the cuBLAS workspace
          by ``CUBLAS_WORKSPACE_CONFIG`` (default 2 x 4 MiB + 8 x 16 KiB per handle and stream) and cuBLASLt's by
          ``CUBLASLT_WORKSPACE_SIZE`` (cuBLAS recommends 4 MiB before Hopper, 32 MiB on Hopper).
        - ``grad_temp_ratio``: 0.5. In a transformer block the largest pair of activation gradients alive together
          is the MLP's (its up-projection output and its activation, 2 x 4h values per token, 16h bytes in 16 bits),
          about half of the 34h bytes per token the block saves (Korthikanti et al. 2022, with FlashAttention).
        - ``fragmentation``: 0.1 of the allocated bytes, the share PyTorch's caching allocator typically reserves
          beyond what it hands out in steady training.

        Args:
            logits_bytes: what the head's output costs at the forward/backward turn (see the attribute).
            autocast_cache_bytes: 16-bit copies of fp32 weights autocast keeps (0 where weights are 16-bit).
        """
        return cls(workspace_bytes=64 << 20, logits_bytes=logits_bytes, autocast_cache_bytes=autocast_cache_bytes,
                   grad_temp_ratio=0.5, fragmentation=0.1)

    def fragmented(self, nbytes: int) -> int:
        """``nbytes`` allocated bytes with what fragmentation loses on top."""
        return nbytes + math.ceil(nbytes * self.fragmentation) if self.fragmentation else nbytes


def largest_batch(device_budget: int, fixed_bytes: int, per_sample_bytes: int, *, fragmentation: float = 0.0,
                  limit: int | None = None) -> int:
    """The largest batch whose device memory fits ``device_budget``.

    A batch of ``b`` needs ``fixed_bytes + b * per_sample_bytes`` allocated bytes, plus ``fragmentation`` of that.

    Args:
        device_budget: bytes of device memory the run may use.
        fixed_bytes: bytes that do not grow with the batch (paging buffers, a block's parameters and gradients,
            workspaces).
        per_sample_bytes: bytes each sample adds (what the working block saves for it, its activation gradients,
            its share of the logits and of the activations kept on the device).
        fragmentation: share of the allocated bytes the caching allocator loses.
        limit: the largest batch worth running (``None``: no limit).

    Returns:
        The batch size, 0 when not even one sample fits.

    Raises:
        RatelConfigError: ``per_sample_bytes`` is not positive or another input is negative.
    """
    if per_sample_bytes <= 0:
        raise RatelConfigError(f"per_sample_bytes must be positive, got {per_sample_bytes}")
    if min(device_budget, fixed_bytes, fragmentation, 0 if limit is None else limit) < 0:
        raise RatelConfigError("device_budget, fixed_bytes, fragmentation and limit cannot be negative")
    overhead = DeviceOverhead(fragmentation=fragmentation)

    def fits(batch: int) -> bool:
        return overhead.fragmented(fixed_bytes + batch * per_sample_bytes) <= device_budget

    if not fits(0):
        return 0
    # The float estimate is within one of the answer; the exact check settles it.
    batch = max(0, int((device_budget / (1 + fragmentation) - fixed_bytes) // per_sample_bytes))
    while batch > 0 and not fits(batch):
        batch -= 1
    while fits(batch + 1) and (limit is None or batch < limit):
        batch += 1
    return batch if limit is None else min(batch, limit)


@dataclass
class LayerCost:
    """What a placement costs one block, the part of a prediction that depends on the placement.

    Attributes:
        bytes: saved-activation bytes per tier (every key of :data:`TIERS`).
        recompute_time: seconds of forward re-executed in backward.
    """

    bytes: dict[str, int]
    recompute_time: float


def _tier(layer: LayerProfile, op_name: str, placement: Mapping[str, str]) -> str:
    """The checked placement of one op."""
    tier = placement.get(placement_key(layer.name, op_name), DEFAULT_TIER)
    if tier not in TIERS:
        raise RatelConfigError(f"placement of {placement_key(layer.name, op_name)!r} is {tier!r}, not one of {TIERS}")
    if tier == "recompute" and (op_name == INPUT_OP or not layer.op_level):
        what = "a block's input" if op_name == INPUT_OP else f"block {layer.name!r}, profiled as a whole,"
        raise RatelConfigError(f"{placement_key(layer.name, op_name)!r} cannot be recomputed: {what} has to be stored")
    return tier


def recompute_ops(layer: LayerProfile, placement: Mapping[str, str]) -> set[str]:
    """The ops of ``layer`` that re-execute in backward.

    Every op with saved bytes placed ``"recompute"`` re-executes, and so, transitively, does each op whose output a
    re-executed op reads but that is not available: available outputs are ``"input"`` and those of ops with saved
    bytes placed on ``"device"``, ``"host"`` or ``"ssd"``.

    Args:
        layer: the block.
        placement: activation placement keyed by ``"<block>/<op>"``; missing ops count as ``"device"``.

    Returns:
        Names of the re-executed ops (never ``"input"``).

    Raises:
        RatelConfigError: a placement value is not a tier, ``"input"`` or a container block is placed
            ``"recompute"``, or an op reads a name that is not an op of the block.
    """
    ops = {op.name: op for op in layer.ops}
    tiers = {op.name: _tier(layer, op.name, placement) for op in layer.ops}

    def available(name: str) -> bool:
        if name == INPUT_OP:
            return True
        if name not in ops:
            raise RatelConfigError(f"an op of block {layer.name!r} reads {name!r}, which is not an op of the block")
        return ops[name].saved_bytes > 0 and tiers[name] in STORED_TIERS

    pending = [op.name for op in layer.ops if op.saved_bytes > 0 and tiers[op.name] == "recompute"]
    rerun = set(pending)
    while pending:
        for name in ops[pending.pop()].inputs:
            if name not in rerun and not available(name):
                rerun.add(name)
                pending.append(name)
    return rerun


def layer_cost(layer: LayerProfile, placement: Mapping[str, str]) -> LayerCost:
    """Bytes per tier and recompute seconds of one block under ``placement`` (see :func:`recompute_ops`)."""
    per_tier = dict.fromkeys(TIERS, 0)
    for op in layer.ops:
        per_tier[_tier(layer, op.name, placement)] += op.saved_bytes
    rerun = recompute_ops(layer, placement)
    # Summed in op order, not set order, so the same placement always predicts the same float.
    return LayerCost(per_tier, sum(op.forward_time for op in layer.ops if op.name in rerun))


def _seconds(amount: float, rate: float) -> float:
    """Time to move or process ``amount`` at ``rate``; nothing takes no time even where the rate is 0."""
    if amount == 0:
        return 0.0
    return amount / rate if rate > 0 else math.inf


def _lanes(resources: Mapping[str, float], unified: bool) -> dict[str, float]:
    """Busy seconds of what runs side by side in a phase; on unified memory ``"compute"`` holds all work on the cores.

    Every other resource (the host side's PCIe and DRAM) runs beside the cores.
    """
    if not unified:
        return {name: t for name, t in resources.items() if name != "recompute"}
    lanes = {"compute": sum(t for name, t in resources.items() if name in CORE_RESOURCES)}
    lanes.update((name, t) for name, t in resources.items() if name not in CORE_RESOURCES and name != "recompute")
    return lanes


def phase_time(resources: Mapping[str, float], *, unified: bool) -> float:
    """Seconds of one phase given its resources' busy seconds (``"recompute"`` is part of ``"compute"``)."""
    return max(_lanes(resources, unified).values())


def bottleneck(resources: Mapping[str, float], *, unified: bool) -> str:
    """The resource that sets a phase's time; on unified memory ``"compute"`` stands for all work on the cores."""
    lanes = _lanes(resources, unified)
    return max(lanes, key=lambda name: lanes[name])


DEFERRED_GRADIENT_SHARE = 0.25
"""Of the host memory a run on the CPU has left once it is set up, the most its updates may take by waiting for the end
of backward: every shard's fp32 gradient is held until then (the rest is for activations, the data loader and the page
cache)."""


def updates_overlap(*, unified: bool, gradient_bytes: int, host_room: int) -> bool:
    """Whether a step's CPU optimizer updates run during backward, each as its shard's gradients complete, rather than
    in one pass after backward.

    Time decides first: overlapping pays only where it makes backward shorter than backward followed by the updates.
    Where the optimizer has a lane of its own (a GPU computes), the overlapped phase lasts as long as its busiest lane,
    shorter than the sum whenever both compute and update. On unified memory the optimizer runs on the compute cores
    (:data:`CORE_RESOURCES`), so both orders take the same time here, and overlapping costs what the model does not
    hold: the optimizer's thread and the compute's thread team take turns on the same cores, each switch waking
    threads and evicting the other's cache lines. A tie runs the updates after backward, where memory allows: that
    holds every shard's fp32 gradient until backward ends, where overlapping holds a few shards' worth, so a step whose
    gradients take more than :data:`DEFERRED_GRADIENT_SHARE` of ``host_room`` still overlaps.

    Args:
        unified: "device" and host are one memory and the device computes on the CPU's cores
            (:attr:`~lightning_ratel.hardware.HardwareProfile.unified_memory`).
        gradient_bytes: host bytes of one step's fp32 gradients, every shard's.
        host_room: host bytes the run has left once set up.
    """
    # One second of each is enough: only which lanes they share matters, not their length.
    overlapped = phase_time({"compute": 1.0, "cpu_optimizer": 1.0}, unified=unified)
    after = phase_time({"compute": 1.0}, unified=unified) + 1.0
    return overlapped < after or gradient_bytes > DEFERRED_GRADIENT_SHARE * host_room


@dataclass(frozen=True)
class CostSettings:
    """What the cost model needs to know of a run besides the machine and the blocks: one definition for
    :class:`CostModel`, :func:`predict` and :func:`~lightning_ratel.plan.search.search`.

    Attributes:
        prefetch_depth: blocks paged in ahead of the one computing.
        state_read_bytes_per_param: optimizer-state bytes read from the SSD per trainable parameter and step (fp32
            master and two moments: 12).
        state_write_bytes_per_param: optimizer-state bytes written to the SSD per trainable parameter and step.
        host_static_bytes: host memory the rest of the run holds (parameter cache, optimizer buffers, ...).
        param_cache: ``"host"``: compute copies are paged to the device from host memory; ``"ssd"``: they are read
            from the SSDs for every use, once in forward and once in backward.
        optimizer_memory_bytes_per_param: host DRAM bytes one AdamW update touches per parameter, averaged over the
            parameters this rank updates (those on the device tier touch none; counted only where
            ``hw.host_memory_bandwidth`` is set).
        state_spill: optimizer-state writes that do not fit in backward are deferred into the next forward (as much
            as makes the iteration shortest). Reads are never deferred: the update they feed has to finish before
            the next forward uses its parameters.
        state_read_ahead_bytes_per_param: optimizer-state bytes read during forward instead of backward per trainable
            parameter and step (at most ``state_read_bytes_per_param``): where updates overlap backward, the CPU
            optimizer's buffer sets fill during the boundary micro-batch's forward with the states of the shards
            backward updates first.
        device_overhead: device memory beyond paging buffers and one block's working set (workspaces, logits,
            autocast cache, gradient temporaries, fragmentation); ``None``: nothing more.
        forward_overhead: seconds of a micro-batch's forward outside its blocks' own forwards (the model's code
            between and around them: embeddings without parameters, masks, the loss; the engine's hooks and waits),
            measured while profiling on the host's clock. Where the CPU computes it is charged to compute; on a GPU
            to the training thread's own lane (``"host"``), which queues the kernels and runs beside them.
        backward_overhead: the same for backward: what it runs outside its blocks' backwards (the loss's backward,
            the gradients' hand-over outside a block), measured while profiling; charged as ``forward_overhead``.
        update_params_per_s: parameters per second this rank's whole optimizer step runs at, measured while profiling
            with the updates run alone after backward (reading the states, the kernel, the new compute copies, the
            write-back copies and checksums on the optimizer's thread); 0: not measured, the hardware's AdamW kernel
            rate (``adam_params_per_s``, which counts the kernel alone) instead. Measured with the node's other ranks
            updating at the same time, so it is not divided among them again.
        device_update_share: of the parameters this rank updates, the share whose states are on the device tier:
            their updates run where the model computes (on its lane, at the same measured rate), and they move
            nothing through host memory.
        device_updated: the blocks whose units are updated on the device tier whole: ready as soon as backward
            ends, so the next forward waits for the first unit the CPU updates only once it reaches that block.
        updates_after_backward: the optimizer's updates wait for the end of backward and run while the next forward
            starts (that forward pages each unit in only once its update ran): their time is charged to forward. Where
            ``False`` they overlap backward, each as its shard's gradients complete.
        ranks_on_node: data-parallel ranks training on this node at once, each with its own device and the same
            work. They share the node's SSDs, host-side PCIe, DRAM and CPU cores, so each rank sees ``1 /
            ranks_on_node`` of those rates; each owns ``1 / ranks_on_node`` of the optimizer states and updates
            (``state_*_bytes_per_param`` count per owned parameter). Every rank pages every compute copy in (where
            ``param_cache="ssd"`` each from its own swap files, which hold every copy) and sends its whole gradient to
            the host, where the owners add the ranks' copies of their share (one more DRAM read of each peer's copy):
            the gradient's reduction passes through host memory, as on GPUs without peer-to-peer links.
        gradients_reduced_on_device: with several ranks, the gradients are reduced on the devices
            (``gradient_exchange="device"``, NCCL) and each owner copies its share to host memory, where nothing more
            is added up. Counted as on GPUs without peer-to-peer links, where NCCL passes through host memory: each
            rank's whole gradient leaves its device once, in fp32 (4 bytes per trainable parameter; the owner's copy
            of its share is one part of that).
    """

    prefetch_depth: int = 1
    state_read_bytes_per_param: int = 12
    state_write_bytes_per_param: int = 12
    host_static_bytes: int = 0
    param_cache: str = "host"
    optimizer_memory_bytes_per_param: int = OPTIMIZER_MEMORY_BYTES_PER_PARAM
    state_spill: bool = False
    device_overhead: DeviceOverhead | None = None
    forward_overhead: float = 0.0
    backward_overhead: float = 0.0
    update_params_per_s: float = 0.0
    device_update_share: float = 0.0
    device_updated: tuple[str, ...] = ()
    updates_after_backward: bool = False
    ranks_on_node: int = 1
    state_read_ahead_bytes_per_param: float = 0.0
    gradients_reduced_on_device: bool = False

    def __post_init__(self) -> None:
        if min(self.forward_overhead, self.backward_overhead, self.update_params_per_s) < 0:
            raise RatelConfigError(f"measured overheads and rates cannot be negative, got forward_overhead="
                                   f"{self.forward_overhead}, backward_overhead={self.backward_overhead}, "
                                   f"update_params_per_s={self.update_params_per_s}")
        if not 0.0 <= self.device_update_share <= 1.0:
            raise RatelConfigError(f"device_update_share is a share of the parameters, between 0 and 1; got "
                                   f"{self.device_update_share}")

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CostSettings:
        """The settings ``dataclasses.asdict`` made of them (as in a plan file)."""
        values = dict(data)
        values["device_updated"] = tuple(values.get("device_updated", ()))
        overhead = values.get("device_overhead")
        if isinstance(overhead, Mapping):
            values["device_overhead"] = DeviceOverhead(**overhead)
        return cls(**values)  # type: ignore[arg-type]


def rank_share(hw: HardwareProfile, ranks: int) -> HardwareProfile:
    """What one of ``ranks`` ranks training side by side on a node sees of its shared resources: ``1 / ranks`` of the
    SSDs', host-side PCIe's and DRAM's bandwidths and of the CPU AdamW rate (the cores); its own device link whole.

    Raises:
        RatelConfigError: ``ranks`` is below 1.
    """
    if ranks < 1:
        raise RatelConfigError(f"ranks_on_node must be at least 1, got {ranks}")
    if ranks == 1:
        return hw
    return replace(hw, ssd_read_bandwidth=hw.ssd_read_bandwidth / ranks,
                   ssd_write_bandwidth=hw.ssd_write_bandwidth / ranks,
                   activation_write_bandwidth=hw.activation_write_bandwidth / ranks,
                   adam_params_per_s=hw.adam_params_per_s / ranks,
                   host_io_bandwidth=hw.host_io_bandwidth / ranks,
                   host_memory_bandwidth=hw.host_memory_bandwidth / ranks)


class CostModel:
    """The placement-independent part of the model, computed once so a search can evaluate many placements cheaply.

    Args:
        hw: the machine (the whole node; with ``settings.ranks_on_node`` above 1, :attr:`hw` is one rank's share).
        layers: the blocks.
        settings: the run's settings (``None``: the defaults of :class:`CostSettings`).

    Raises:
        RatelConfigError: the profiles are inconsistent (see :func:`~lightning_ratel.plan.profile.validate_layers`),
            ``prefetch_depth`` or a host bandwidth is negative, ``ranks_on_node`` is below 1, or ``param_cache`` is
            not one of :data:`~lightning_ratel.tiers.PARAM_CACHE_TIERS`.
    """

    def __init__(self, hw: HardwareProfile, layers: Sequence[LayerProfile],
                 settings: CostSettings | None = None) -> None:
        settings = settings or CostSettings()
        prefetch_depth, param_cache = settings.prefetch_depth, settings.param_cache
        validate_layers(list(layers))
        if prefetch_depth < 0:
            raise RatelConfigError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        if param_cache not in PARAM_CACHE_TIERS:
            raise RatelConfigError(f"param_cache must be one of {PARAM_CACHE_TIERS}, got {param_cache!r}")
        if min(hw.host_io_bandwidth, hw.host_memory_bandwidth) < 0:
            raise RatelConfigError("host_io_bandwidth and host_memory_bandwidth cannot be negative (0: no limit)")
        ranks = settings.ranks_on_node
        hw = rank_share(hw, ranks)
        self.hw = hw
        self.layers = list(layers)
        self.settings = settings
        self.prefetch_depth = prefetch_depth
        self.host_static_bytes = settings.host_static_bytes
        self.param_cache = param_cache
        self.state_spill = settings.state_spill
        self.overhead = settings.device_overhead or DeviceOverhead()
        self.buffers = prefetch_depth + 1
        param_bytes = sum(layer.param_bytes for layer in self.layers)
        # The states, their updates and the compute copies' SSD reads of the units this rank owns.
        numel = sum(layer.trainable_numel for layer in self.layers) / ranks
        self._forward_compute = sum(layer.forward_time for layer in self.layers)
        self._backward_compute = sum(layer.backward_time for layer in self.layers)
        # The training thread's work around the blocks: on the CPU it takes the cores from the blocks; on a GPU it
        # queues the next kernels while the device runs the last ones.
        self._host = {"forward": settings.forward_overhead, "backward": settings.backward_overhead}
        if hw.unified_memory:
            self._forward_compute += self._host.pop("forward")
            self._backward_compute += self._host.pop("backward")
        self._param_bytes = param_bytes
        self._grad_bytes = sum(layer.grad_bytes for layer in self.layers)
        # What crosses the device's link: nothing on unified memory (see the module docstring).
        self._linked_params = 0 if hw.unified_memory else param_bytes
        # Reduced on the devices, a rank's link carries its whole gradient in fp32 (see gradients_reduced_on_device).
        grads_out = 4 * numel * ranks if settings.gradients_reduced_on_device and ranks > 1 else self._grad_bytes
        self._linked_grads = 0 if hw.unified_memory else grads_out
        self._forward_h2d = _seconds(self._linked_params, hw.h2d_bandwidth)
        self._backward_d2h = _seconds(self._linked_grads, hw.d2h_bandwidth)
        self._state_read = math.ceil(numel * settings.state_read_bytes_per_param)
        self._state_ahead = min(self._state_read, math.ceil(numel * settings.state_read_ahead_bytes_per_param))
        self._state_ahead_ssd = _seconds(self._state_ahead, hw.ssd_read_bandwidth)
        self._state_write = math.ceil(numel * settings.state_write_bytes_per_param)
        self._state_ssd = (_seconds(self._state_read, hw.ssd_read_bandwidth)
                           + _seconds(self._state_write, hw.ssd_write_bandwidth))
        # The whole update as measured, else the kernel's probed rate (rank_share divided that one among the ranks);
        # the device tier's share runs where the model computes.
        updates = _seconds(numel, settings.update_params_per_s or hw.adam_params_per_s)
        self._device_update = updates * settings.device_update_share
        self._cpu_optimizer = updates - self._device_update
        self._updates_after_backward = settings.updates_after_backward
        # The owners read each peer's copy of their share of the gradients once more to add them up.
        peers = 0 if settings.gradients_reduced_on_device else self._grad_bytes * (ranks - 1) / ranks
        self._optimizer_memory = math.ceil(numel * settings.optimizer_memory_bytes_per_param + peers)
        # The unit forward uses first gets its gradient last in backward; beside a GPU, its update (on the cores or
        # the memory bus, whichever is slower) starts only then, and the next forward waits for it. On the CPU the
        # cores' lane already runs every update after the compute it follows. With several ranks one owns that unit
        # whole and updates it at its own share of the node's rates. Units updated on the device are ready at once:
        # forward computes their blocks first, then waits for the first unit the CPU updates.
        first, ahead = 0, 0.0
        for layer in self.layers:
            if layer.name in settings.device_updated:
                ahead += layer.forward_time
            elif layer.trainable_numel:
                first = layer.trainable_numel
                break
        cpu_numel = numel * (1 - settings.device_update_share)
        self._first_update = min(self._cpu_optimizer, self._cpu_optimizer * first / cpu_numel) if cpu_numel else 0.0
        self._update_wait = 0.0 if hw.unified_memory or not updates else max(0.0, max(
            self._first_update,
            _seconds(first * settings.optimizer_memory_bytes_per_param, hw.host_memory_bandwidth)
            if hw.host_memory_bandwidth else 0.0) - ahead)
        # Compute copies read from the SSDs for each pass: every rank reads each from its own swap files.
        self._param_ssd_bytes = param_bytes if param_cache == "ssd" else 0
        self._param_ssd = _seconds(self._param_ssd_bytes, hw.ssd_read_bandwidth)
        self.largest_block = max(self.layers, key=lambda layer: layer.param_bytes, default=None)
        # A block's backward materialises all it saved (recomputed outputs included) next to its params and grads.
        self.working_block = max(self.layers, key=self.working_bytes, default=None)
        self.fixed_device_bytes = (self.buffers * (self.largest_block.param_bytes if self.largest_block else 0)
                                   + (self.working_bytes(self.working_block) if self.working_block else 0)
                                   + self.overhead.workspace_bytes + self.overhead.logits_bytes
                                   + self.overhead.autocast_cache_bytes)

    def working_bytes(self, layer: LayerProfile) -> int:
        """Device bytes of ``layer``'s backward: params, grads, what it saved and the gradients of activations."""
        saved = layer.saved_bytes
        temporaries = math.ceil(saved * self.overhead.grad_temp_ratio) if self.overhead.grad_temp_ratio else 0
        return max(layer.param_bytes + layer.grad_bytes + saved + temporaries, layer.peak_device_bytes)

    def memory(self, layer_bytes: Sequence[Mapping[str, int]], *, staging_reserve: int = 0) -> dict[str, int]:
        """Predicted peak bytes of ``"device"``, ``"host"`` and ``"ssd"``.

        Args:
            layer_bytes: each block's saved-activation bytes per tier.
            staging_reserve: host bytes to count for SSD staging at least (room a search keeps for later spills).
        """
        kept = sum(b["device"] for b in layer_bytes)
        ssd = sum(b["ssd"] for b in layer_bytes)
        # SSD traffic goes through host staging buffers, one block's worth per block in flight.
        staging = max(self.buffers * max((b["ssd"] for b in layer_bytes), default=0), staging_reserve)
        device = self.overhead.fragmented(kept + self.fixed_device_bytes)
        host = self.host_static_bytes + sum(b["host"] for b in layer_bytes) + staging
        if self.hw.unified_memory:
            host += device
            device = host
        return {"device": device, "host": host, "ssd": ssd}

    def _host_resources(self, resources: dict[str, float], into_host: int, out_of_host: int,
                        optimizer: int = 0) -> None:
        """Add the host side's PCIe (``into_host``/``out_of_host`` bytes) and DRAM (those plus ``optimizer``)."""
        hw = self.hw
        if hw.host_io_bandwidth:
            resources["host_in"] = _seconds(into_host, hw.host_io_bandwidth)
            resources["host_out"] = _seconds(out_of_host, hw.host_io_bandwidth)
        if hw.host_memory_bandwidth:
            resources["dram"] = _seconds(into_host + out_of_host + optimizer, hw.host_memory_bandwidth)

    def _spill_rates(self) -> dict[str, float]:
        """Seconds per optimizer-state byte written, on each resource such a write keeps busy."""
        hw = self.hw
        rates = {"ssd": 1 / hw.ssd_write_bandwidth if hw.ssd_write_bandwidth > 0 else math.inf}
        if hw.host_io_bandwidth:
            rates["host_out"] = 1 / hw.host_io_bandwidth
        if hw.host_memory_bandwidth:
            rates["dram"] = 1 / hw.host_memory_bandwidth
        return rates

    def _best_spill(self, forward: dict[str, float], backward: dict[str, float]) -> int:
        """State-write bytes to defer into the next forward so that forward plus backward is shortest.

        Both phases are maxima of lines in the deferred bytes, so their sum is convex and piecewise linear: its
        least value lies at 0, at everything, or where two lines of one phase cross. Of equal times the least
        deferral wins.
        """
        unified = self.hw.unified_memory
        rates = self._spill_rates()
        if any(math.isinf(rate) for rate in rates.values()):
            return 0
        lines = []
        for resources, sign in ((forward, 1.0), (backward, -1.0)):
            lanes = _lanes(resources, unified)
            lines.append([(lanes[name], sign * rates.get(name, 0.0)) for name in lanes])
        candidates = {0.0, float(self._state_write)}
        for phase in lines:
            for i, (a, slope_a) in enumerate(phase):
                for b, slope_b in phase[i + 1:]:
                    if slope_a != slope_b:
                        x = (b - a) / (slope_a - slope_b)
                        if 0 < x < self._state_write:
                            candidates.add(x)

        def total(x: float) -> float:
            return sum(max(a + slope * x for a, slope in phase) for phase in lines)

        best = min(sorted(candidates), key=total)
        return math.ceil(best)

    def evaluate(self, costs: Sequence[LayerCost]) -> Prediction:
        """The prediction for the blocks' costs (one per layer, in the order of ``layers``)."""
        hw = self.hw
        per_tier = {tier: sum(c.bytes[tier] for c in costs) for tier in TIERS}
        # Activations swapped to host memory or the SSDs cross the device's link, except on unified memory.
        swapped = 0 if hw.unified_memory else per_tier["host"] + per_tier["ssd"]
        recompute = sum(c.recompute_time for c in costs)
        forward = {
            "compute": self._forward_compute,
            "h2d": self._forward_h2d,
            "d2h": _seconds(swapped, hw.d2h_bandwidth),
            "ssd": (_seconds(per_tier["ssd"], hw.activation_write_bandwidth or hw.ssd_write_bandwidth)
                    + self._param_ssd + self._state_ahead_ssd),
        }
        backward = {
            "compute": self._backward_compute + recompute,
            "recompute": recompute,
            "h2d": _seconds(self._linked_params + swapped, hw.h2d_bandwidth),
            "d2h": self._backward_d2h,
            "ssd": (_seconds(per_tier["ssd"], hw.ssd_read_bandwidth) + self._state_ssd - self._state_ahead_ssd
                    + self._param_ssd),
        }
        for name, phase in (("forward", forward), ("backward", backward)):
            if self._host.get(name):
                phase["host"] = self._host[name]
        # The updates run in the phase that waits for them: backward where they overlap it, else the next forward.
        updating = forward if self._updates_after_backward else backward
        updating["cpu_optimizer"] = self._cpu_optimizer
        updating["compute"] += self._device_update
        if self._update_wait:
            # The step ends without waiting for the last update, that of the unit the next forward needs first: that
            # forward starts by waiting for it. Where the updates overlap backward, that one is no part of it.
            forward["update_wait"] = forward["compute"] + self._update_wait
            if not self._updates_after_backward:
                backward["cpu_optimizer"] -= self._first_update
        # Host-side traffic: what reaches host memory (from the device or the SSDs) and what leaves it.
        after = self._optimizer_memory if self._updates_after_backward else 0
        self._host_resources(forward, swapped + self._param_ssd_bytes + self._state_ahead,
                             self._linked_params + per_tier["ssd"], after)
        self._host_resources(backward, self._linked_grads + per_tier["ssd"] + self._state_read - self._state_ahead
                             + self._param_ssd_bytes,
                             self._linked_params + swapped + self._state_write, self._optimizer_memory - after)
        spilled = self._best_spill(forward, backward) if self.state_spill and self._state_write else 0
        for name, rate in self._spill_rates().items() if spilled else ():
            forward[name] += spilled * rate
            backward[name] -= spilled * rate
        forward_time = phase_time(forward, unified=hw.unified_memory)
        backward_time = phase_time(backward, unified=hw.unified_memory)
        return Prediction(
            forward=forward,
            backward=backward,
            forward_time=forward_time,
            backward_time=backward_time,
            iteration_time=forward_time + backward_time,
            memory=self.memory([c.bytes for c in costs]),
            bytes=per_tier,
            spilled=spilled,
        )


def check_device_types(device_types: Sequence[str], local_world: int = 1) -> None:
    """Raise where ranks train on different kinds of device: one plan cannot fit them all (a plan's memory differs
    where the device is the host), nor can one process group serve them (NCCL on CUDA, gloo on the CPU).

    Args:
        device_types: each rank's (or each node's, with ``local_world`` 1), in rank order.
        local_world: the ranks of each node (a node's ranks are consecutive).

    Raises:
        RatelConfigError: two device types differ; the message names each node's.
    """
    if len(set(device_types)) <= 1:
        return
    named = []
    for first in range(0, len(device_types), local_world):
        kinds = list(dict.fromkeys(device_types[first:first + local_world]))
        named.append(f"node {first // local_world}: {'/'.join(kinds)}")
    raise RatelConfigError(
        f"the nodes train on different device types ({', '.join(named)}); RatelStrategy needs one type on every rank "
        f"(one plan and one process group serve them all). Give every node the same accelerator.")


def node_settings(ranks: Sequence[CostSettings]) -> CostSettings:
    """The settings of one node from those of its ranks (:attr:`CostSettings.ranks_on_node` of them).

    The node's SSDs, host-side PCIe and DRAM carry every one of its ranks' optimizer-state traffic, so per parameter a
    rank owns the node moves the mean of its ranks' bytes: a rank with all its states in the swap files and one with
    none load the drives as two ranks with half of them each. What each rank measured of its own work counts at the
    slowest rank, which the others wait for: the most seconds outside the blocks, the least measured update rate (of
    those that measured one). What is neither comes from the first rank (``host_static_bytes``, ``device_overhead``:
    the memory a plan is checked against is the planning rank's).

    Raises:
        RatelConfigError: no ranks, or ranks that disagree on how their node runs (``prefetch_depth``,
            ``param_cache``, ``state_spill``, ``updates_after_backward``, ``ranks_on_node``).
    """
    if not ranks:
        raise RatelConfigError("a node's settings need the settings of at least one of its ranks")
    first = ranks[0]
    for name in ("prefetch_depth", "param_cache", "state_spill", "updates_after_backward", "ranks_on_node"):
        values = [getattr(settings, name) for settings in ranks]
        if len(set(values)) > 1:
            raise RatelConfigError(f"the ranks of a node plan with different {name} ({values}); they must agree")

    def mean(name: str) -> int:
        return round(sum(getattr(settings, name) for settings in ranks) / len(ranks))

    rates = [settings.update_params_per_s for settings in ranks if settings.update_params_per_s > 0]
    return replace(first, state_read_bytes_per_param=mean("state_read_bytes_per_param"),
                   state_write_bytes_per_param=mean("state_write_bytes_per_param"),
                   optimizer_memory_bytes_per_param=mean("optimizer_memory_bytes_per_param"),
                   state_read_ahead_bytes_per_param=sum(s.state_read_ahead_bytes_per_param for s in ranks) / len(ranks),
                   forward_overhead=max(settings.forward_overhead for settings in ranks),
                   backward_overhead=max(settings.backward_overhead for settings in ranks),
                   update_params_per_s=min(rates, default=0.0))


def node_models(nodes: Sequence[HardwareProfile], layers: Sequence[LayerProfile],
                settings: CostSettings | Sequence[CostSettings] | None = None) -> list[CostModel]:
    """One cost model per node, for a plan that every node of a data-parallel run applies.

    Args:
        nodes: each node's profile.
        layers: the blocks.
        settings: each node's settings, in the order of ``nodes`` (their optimizer-state traffic differs where one
            node keeps more of its states in the swap files than another, see :func:`node_settings`); one
            :class:`CostSettings`, or ``None`` for the defaults, alike on every node.

    Raises:
        RatelConfigError: no node, nodes of different device types (see :func:`check_device_types`), settings for
            another number of nodes, or what :class:`CostModel` raises.
    """
    if not nodes:
        raise RatelConfigError("a plan needs the profile of at least one node")
    check_device_types([hw.device_type for hw in nodes])
    if settings is None or isinstance(settings, CostSettings):
        per_node = [settings] * len(nodes)
    else:
        per_node = list(settings)
        if len(per_node) != len(nodes):
            raise RatelConfigError(f"{len(per_node)} nodes' settings for the profiles of {len(nodes)} nodes")
    return [CostModel(hw, layers, node) for hw, node in zip(nodes, per_node)]


def slowest_node(models: Sequence[CostModel], costs: Sequence[LayerCost]) -> tuple[int, Prediction]:
    """The node whose predicted iteration time for the blocks' costs is the longest, and its prediction.

    Data-parallel ranks wait for one another every step (gradients reach their owners, new compute copies every rank),
    so the slowest node sets every node's time; of equally slow nodes, the first.

    Args:
        models: each node's cost model (:func:`node_models`).
        costs: the blocks' costs, one per layer in the order of ``layers``.
    """
    predictions = [model.evaluate(costs) for model in models]
    node = max(range(len(predictions)), key=lambda n: predictions[n].iteration_time)
    return node, predictions[node]


def predict(hw: HardwareProfile, layers: Sequence[LayerProfile], placement: Mapping[str, str],
            settings: CostSettings | None = None) -> Prediction:
    """Predict one micro-batch's times and memory under an activation placement.

    Args:
        hw: the machine.
        layers: the blocks in any order.
        placement: ``"<block>/<op>"`` -> tier; ops it does not mention count as ``"device"``.
        settings: the run's settings (``None``: the defaults of :class:`CostSettings`).

    Returns:
        The prediction.

    Raises:
        RatelConfigError: inconsistent profiles or an invalid placement.
    """
    model = CostModel(hw, layers, settings)
    return model.evaluate([layer_cost(layer, placement) for layer in model.layers])
