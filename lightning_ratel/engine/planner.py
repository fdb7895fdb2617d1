"""Planning activation placement for one run: profile, build the planner's inputs, search, apply.

:class:`Planner` owns the whole cycle. It measures the machine (:mod:`lightning_ratel.runtime.probe`), runs profiled
passes under the safe default placement (every op recomputed from host-stored block inputs, so each op's time and
saved bytes can be measured), turns what the scheduler timed and the activation cache recorded into
:class:`~lightning_ratel.plan.LayerProfile` objects, searches the placement with the least predicted iteration time
under this run's memory budgets (:func:`~lightning_ratel.plan.search`), and hands the chosen placement to the
activation cache. A fixed ``activation_policy`` bypasses all of it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_ratel.config import RatelConfig
from lightning_ratel.engine.accounting import ByteAccount, StepBreakdown
from lightning_ratel.engine.blocks import BlockMembership
from lightning_ratel.engine.placement import plan_placements, profiling_placements, resolve_policies
from lightning_ratel.engine.schedule import BlockScheduler, BlockTimer
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.plan.cost import OPTIMIZER_MEMORY_BYTES_PER_PARAM, CostSettings, DeviceOverhead
from lightning_ratel.plan.profile import LayerProfile, OpProfile
from lightning_ratel.plan.search import Plan, search
from lightning_ratel.report import show_plan
from lightning_ratel.runtime.activations import ActivationCache
from lightning_ratel.runtime.adamw import adamw_step
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.optimizer import CpuAdam
from lightning_ratel.runtime.probe import measure_hardware
from lightning_ratel.runtime.units import Layout
from lightning_ratel.tiers import CONTAINER_OP, INPUT_OP


class Planner:
    """Profiles, plans and applies activation placement for one run.

    Args:
        config: the run's settings (budgets, prefetch depth, swap directories, a fixed policy).
        device: the compute device.
        blocks: the model's blocks.
        layout: their units and shards.
        cache: the activation cache the placement is applied to.
        scheduler: times blocks while profiling and knows the execution order.
        accounts: bytes the run holds (the plan's host budget starts from them).
        breakdown: measures where each step's time went (for the report).
        adam: the CPU optimizer (its thread count is what the AdamW probe measures with); ``None`` for evaluation.
    """

    def __init__(self, config: RatelConfig, device: Device, blocks: BlockMembership, layout: Layout,
                 cache: ActivationCache, scheduler: BlockScheduler, accounts: ByteAccount, breakdown: StepBreakdown,
                 adam: CpuAdam | None) -> None:
        self.config = config
        self.device = device
        self.blocks = blocks
        self.layout = layout
        self.cache = cache
        self.scheduler = scheduler
        self.accounts = accounts
        self.breakdown = breakdown
        self.adam = adam
        self.plan: Plan | None = None
        self._hardware: HardwareProfile | None = None
        self._profile_steps = 0
        self._profiled_steps = 0
        # Times the blocks while profiling (the scheduler's observer then), else None.
        self._timer: BlockTimer | None = None
        self._profiled: dict[int, list] = {}
        self._profiled_times: dict[int, list[dict[str, float]]] = {}
        # Bytes and elements of each block's output in the profiled passes (the last block's are the logits).
        self._outputs: dict[int, tuple[float, float]] = {}
        cache.set_placements(resolve_policies(blocks, config.activation_policy or "host"))

    @property
    def profiling(self) -> bool:
        """Whether the passes now running are profiled."""
        return self._timer is not None

    def start(self, profile_steps: int, restored: Plan | None = None, reprofile: bool = False) -> None:
        """Training starts: with ``plan="auto"``, apply the plan a checkpoint restored, or measure the machine and
        profile the next ``profile_steps`` micro-batches.

        Args:
            profile_steps: micro-batches run under the safe default while profiling; each measured time is the least
                over them, because the first step of a run also pays one-off costs.
            restored: the plan of the run this one resumes.
            reprofile: profile again even when a plan was restored.
        """
        if not self.config.plans_automatically:
            return
        if restored is not None and not reprofile:
            self.apply_plan(restored)
            rank_zero_info("RatelProfiler: using the plan from the checkpoint (reprofile=True to measure again)")
            return
        start = time.perf_counter()
        self._hardware = self.measure_hardware(fresh=reprofile)
        self.begin_profile()
        self._profile_steps = profile_steps
        self._profiled_steps = 0
        rank_zero_info(
            f"RatelProfiler: hardware measured in {time.perf_counter() - start:.2f} s; profiling the first step"
        )

    def micro_batch_done(self) -> Plan | None:
        """A training micro-batch ended; after the last profiled one, plan and apply. Returns the new plan then."""
        if not self.profiling:
            return None
        self._profiled_steps += 1
        if self._profiled_steps < self._profile_steps:
            return None
        layers = self.end_profile()
        start = time.perf_counter()
        assert self._hardware is not None
        plan = self.make_plan(self._hardware, layers)
        self.apply_plan(plan)
        show_plan(plan, planning_seconds=time.perf_counter() - start)
        return plan

    def measure_hardware(self, fresh: bool = False) -> HardwareProfile:
        """Measure links, swap directories, CPU AdamW and free memory (see :mod:`lightning_ratel.runtime.probe`),
        reusing the speeds measured on this machine recently unless ``fresh``."""
        threads = self.adam.threads if self.adam is not None else torch.get_num_threads()
        assert self.config.ssd_paths is not None
        # Named after the run's store: the ranks of one node probe the same directories at once.
        return measure_hardware(self.device, self.config.ssd_paths,
                                functools.partial(adamw_step(), num_threads=threads), threads=threads, fresh=fresh,
                                name=f"{self.config.name}-probe")

    def begin_profile(self) -> None:
        """Run the next passes under the safe default, timing every op and counting its FLOPs and saved bytes."""
        self._timer = BlockTimer(self.device)
        self.scheduler.observer = self._timer
        self._profiled.clear()
        self._profiled_times.clear()
        self.cache.set_placements(profiling_placements(self.blocks))

    def record_pass(self) -> None:
        """A profiled pass's backward ended: keep what it measured (the cache forgets its records next)."""
        if self._timer is None:
            return
        for b in range(len(self.blocks)):
            self._profiled.setdefault(b, []).extend(self.cache.records(b))
            self._profiled_times.setdefault(b, []).append(self._timer.block_times.pop(b, {}))

    def end_profile(self) -> list[LayerProfile]:
        """Stop profiling and return one :class:`LayerProfile` per block, in execution order.

        Each time is the least seen over the profiled passes: the first pass of a run also pays one-off costs
        (first touch of fresh memory, lazy initialisation) that later steps do not.
        """
        self.scheduler.observer = self._timer = None
        layers = []
        for pos, b in enumerate(self.scheduler.order):
            block = self.blocks[b]
            passes = self._profiled_times.get(b) or [{}]
            records = self._profiled.get(b, [])
            forward = min(t.get("forward", 0.0) for t in passes)
            replays = [r.replay_time for r in records] or [0.0]
            backward = min(t.get("backward", 0.0) for t in passes) - min(replays)
            backward = backward if backward > 0 else 2.0 * forward
            owned = [s for s in self.layout.shards if s.unit.index == b]
            if records and not block.direct_only:
                record = records[0]
                same = [r for r in records if len(r.ops) == len(record.ops)]
                names = [op.name for op in record.ops]
                times = [min(r.ops[k].forward_time for r in same) for k in range(len(record.ops))]
                # The block's forward also pays Python and dispatch work between its ops, and so does a replay:
                # spread it over the ops in proportion, so recomputing all of them costs the block's forward.
                scale = forward / sum(times) if sum(times) > 0 and forward > sum(times) else 1.0
                ops_ = [OpProfile(INPUT_OP, 0.0, 0.0, record.saved.get(-1, 0), [])]
                ops_ += [
                    OpProfile(op.name, times[k] * scale, op.flops, record.saved.get(k, 0),
                              [names[i] if i >= 0 else INPUT_OP for i in op.inputs])
                    for k, op in enumerate(record.ops)
                ]
            else:
                ops_ = [OpProfile(CONTAINER_OP, 0.0, 0.0, self.cache.saved_by_block.get(b, 0), [])]
            param_bytes = sum(self.layout.units[u].nbytes for u in self.blocks.units_of(b))
            saved = sum(op.saved_bytes for op in ops_)
            # On the device: what backward allocated beyond what it found, plus the block's own resident bytes.
            peak = max(t.get("backward_peak", 0.0) for t in passes)
            layers.append(LayerProfile(
                name=block.name,
                index=pos,
                forward_time=forward,
                backward_time=backward,
                param_bytes=param_bytes,
                grad_bytes=sum(s.numel * s.dtype.itemsize for s in owned),
                trainable_numel=sum(s.numel for s in owned),
                ops=ops_,
                op_level=not block.direct_only,
                peak_device_bytes=int(peak) + param_bytes + saved if peak > 0 else 0,
            ))
            self._outputs[b] = (max(t.get("output_bytes", 0.0) for t in passes),
                                max(t.get("output_elements", 0.0) for t in passes))
        self._profiled.clear()
        self._profiled_times.clear()
        return layers

    def state_traffic(self) -> dict[str, int]:
        """Bytes each optimizer step must move between the swap files and the CPU optimizer: the moments and masters
        of the shards whose states are in the swap files (masters are not read where the host cache holds them), and
        the new 16-bit compute copies where the pager reads them from the swap files. The least a step can move for
        its model states; the pager's reads of compute copies and activations sent to the SSD come on top."""
        on_disk = [s for s in self.layout.shards if s.state_tier == "ssd"]
        moments = sum(s.numel * 8 for s in on_disk)
        copies = sum(s.numel * s.dtype.itemsize for s in self.layout.shards
                     if self.layout.param_cache == "ssd" and s.dtype != torch.float32)
        return {"read": moments + sum(s.numel * 4 for s in on_disk if not s.master_in_host),
                "written": moments + sum(s.numel * 4 for s in on_disk) + copies}

    def make_plan(self, hardware: HardwareProfile, layers: list[LayerProfile]) -> Plan:
        """Search the placement with the least predicted iteration time under this run's memory budgets."""
        static = self.accounts.held()["host"]
        if self.config.host_memory_limit is not None:
            host_budget = self.config.host_memory_limit
        else:
            # What the kernel can still hand out, less a tenth for the page cache, the dataloader and the like.
            host_budget = static + int(hardware.host_memory_free * 0.9)
        device_budget = self.config.device_memory_limit or hardware.device_memory_free
        if hardware.unified_memory:
            device_budget = host_budget
        store_budget = int(hardware.ssd_free * 0.95)
        shards = self.layout.shards
        trainable = sum(s.numel for s in shards) or 1
        traffic = self.state_traffic()
        # States in host memory cost a copy of the committed slot into the other (12 bytes read, 12 written) besides
        # the update's own traffic.
        in_host = sum(s.numel for s in shards if s.state_tier == "host")
        settings = CostSettings(
            prefetch_depth=self.config.prefetch_depth, host_static_bytes=static,
            optimizer_memory_bytes_per_param=OPTIMIZER_MEMORY_BYTES_PER_PARAM + round(24 * in_host / trainable),
            state_read_bytes_per_param=round(traffic["read"] / trainable),
            state_write_bytes_per_param=round(traffic["written"] / trainable),
            param_cache=self.layout.param_cache,
            # Write-backs are waited for only by the next update of the same shard.
            state_spill=True,
            device_overhead=self._device_overhead(layers) if self.device.is_cuda else None)
        plan = search(hardware, layers, device_budget=device_budget, host_budget=host_budget,
                      store_budget=store_budget, settings=settings)
        plan.budgets["host_static"] = static
        return plan

    def _device_overhead(self, layers: Sequence[LayerProfile]) -> DeviceOverhead:
        last = self.scheduler.order[-1] if self.scheduler.order else -1
        logits_bytes, logits_elements = self._outputs.get(last, (0.0, 0.0))
        return device_overhead(int(logits_bytes), int(logits_elements),
                               peaks_measured=bool(layers) and all(layer.peak_device_bytes for layer in layers))

    def apply_plan(self, plan: Plan) -> None:
        """Place activations as ``plan`` says from the next forward pass on.

        Raises:
            RatelConfigError: the plan was made for a model with other blocks.
        """
        names = {block.name for block in self.blocks}
        if plan.blocks:
            mismatch = set(plan.blocks) != names
        else:
            # A hand-written plan may name only some blocks, but at least one of this model's.
            mismatch = not {key.rpartition("/")[0] for key in plan.activation_placement} & names
        if mismatch:
            planned = sorted(plan.blocks or {key.rpartition("/")[0] for key in plan.activation_placement})
            raise RatelConfigError(
                f"the plan was made for a model with other blocks ({', '.join(planned[:4])}, ...) than this one "
                f"({', '.join(sorted(names)[:4])}, ...). Make a plan for this model (plan='auto').")
        self.plan = plan
        self.cache.set_placements(plan_placements(self.blocks, plan.activation_placement))


def device_overhead(logits_bytes: int, logits_elements: int, peaks_measured: bool) -> DeviceOverhead:
    """What a step needs on the device beyond paging buffers and one block's working set.

    The documented margin (:meth:`~lightning_ratel.plan.cost.DeviceOverhead.margin`), with the logits measured while
    profiling: the last block's output, plus the loss's fp32 copy of it and its gradient (4 bytes each per element).
    Where every block's backward peak was measured, those peaks already hold the activation gradients.

    Args:
        logits_bytes: bytes of the last block's output.
        logits_elements: its elements.
        peaks_measured: every block has a measured ``peak_device_bytes``.
    """
    overhead = DeviceOverhead.margin(logits_bytes=logits_bytes + 8 * logits_elements)
    return dataclasses.replace(overhead, grad_temp_ratio=0.0) if peaks_measured else overhead
