"""Planning activation placement for one run: profile, build the planner's inputs, search, apply.

:class:`Planner` owns the whole cycle. It measures the machine (:mod:`lightning_ratel.runtime.probe`), runs profiled
passes under the safe default placement (every op recomputed from host-stored block inputs, so each op's time and
saved bytes can be measured), turns what the scheduler timed and the activation cache recorded into
:class:`~lightning_ratel.plan.LayerProfile` objects, searches the placement with the least predicted iteration time
under this run's memory budgets (:func:`~lightning_ratel.plan.search`), and hands the chosen placement to the
activation cache. A fixed ``activation_policy`` bypasses all of it.

With several data-parallel ranks the node's local rank 0 measures the machine alone while its other ranks wait, and
they receive its profile: all ranks probing at once would each see a shared drive, and the cost model then divides
the node's rates among its ranks (:attr:`~lightning_ratel.plan.cost.CostSettings.ranks_on_node`) a second time.
Each rank plans for the states it owns and its share of the node's free memory and disk. Global rank 0 makes the
plan and every rank applies it, so all ranks place their activations alike (placements change speed, never values).
Every node's profile and every rank's cost settings reach rank 0: it plans for the least free memory and disk of any
rank, and predicts each placement on every node's speeds with that node's settings (the optimizer-state traffic of
its ranks, which keep more states in the swap files where the node has less memory), the slowest node's time being
the step's.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_ratel.config import RatelConfig
from lightning_ratel.engine.accounting import ByteAccount, StepBreakdown
from lightning_ratel.engine.blocks import BlockMembership
from lightning_ratel.engine.layout import buffer_sets
from lightning_ratel.engine.placement import plan_placements, profiling_placements, resolve_policies
from lightning_ratel.engine.schedule import BlockScheduler, BlockTimer
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.plan.cost import OPTIMIZER_MEMORY_BYTES_PER_PARAM, CostSettings, DeviceOverhead, node_settings
from lightning_ratel.plan.profile import LayerProfile, OpProfile
from lightning_ratel.plan.search import Plan, search
from lightning_ratel.plan.states import device_bytes
from lightning_ratel.report import show_plan
from lightning_ratel.runtime.activations import ActivationCache
from lightning_ratel.runtime.adamw import adamw_step
from lightning_ratel.runtime.collectives import DataParallelAdam, gather_outcomes
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.optimizer import CpuAdam
from lightning_ratel.runtime.probe import free_device_memory, measure_hardware
from lightning_ratel.runtime.recompute import ForwardRecord, OpRecord
from lightning_ratel.runtime.units import Layout, Shard
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
        adam: the CPU optimizer (its thread count is what the AdamW probe measures with); with several ranks the
            :class:`~lightning_ratel.runtime.collectives.DataParallelAdam` whose ranks share the profile and the plan;
            ``None`` for evaluation.
        updates_overlap: the run's updates overlap backward (:func:`~lightning_ratel.plan.cost.updates_overlap`);
            otherwise they run after it, and the cost model charges them to the next forward.
        store_options: how the run's swap stores move their chunks (:class:`~lightning_ratel.runtime.storage.
            TensorStore`'s ``stripe_bytes`` and ``io_threads_per_path``), for the disk probes.
    """

    def __init__(self, config: RatelConfig, device: Device, blocks: BlockMembership, layout: Layout,
                 cache: ActivationCache, scheduler: BlockScheduler, accounts: ByteAccount, breakdown: StepBreakdown,
                 adam: CpuAdam | DataParallelAdam | None, updates_overlap: bool = True,
                 store_options: Mapping[str, int] | None = None) -> None:
        self.config = config
        self.device = device
        self.blocks = blocks
        self.layout = layout
        self.cache = cache
        self.scheduler = scheduler
        self.accounts = accounts
        self.breakdown = breakdown
        self.adam = adam
        self.updates_overlap = updates_overlap
        self.store_options = dict(store_options or {})
        # The ranks planning together, and their control collectives; None on one rank.
        self._parallel = adam if isinstance(adam, DataParallelAdam) else None
        self.plan: Plan | None = None
        # Every node's profile, in node order (one on one rank), once measured.
        self._nodes: list[HardwareProfile] | None = None
        self._profile_steps = 0
        self._profiled_steps = 0
        # Times the blocks while profiling (the scheduler's observer then), else None.
        self._timer: BlockTimer | None = None
        # Per block, per profiled pass: what the cache's records of the block measured, and what the timer did.
        self._profiled: dict[int, list[list[PassRecord]]] = {}
        self._profiled_times: dict[int, list[dict[str, float]]] = {}
        # Per profiled micro-batch: seconds outside the blocks in forward and in backward (see micro_batch_done).
        self._outside: list[dict[str, float]] = []
        # Per profiled optimizer step run alone after backward: (seconds, parameters updated).
        self._updates: list[tuple[float, int]] = []
        # This micro-batch's updates' seconds, which its backward's wall time holds but its blocks do not.
        self._step_updates = 0.0
        # When this profiled micro-batch's own work ended (see micro_batch_ended), if it was marked.
        self._ended: float | None = None
        # What profiling measured outside the blocks, for the cost model's settings (see end_profile).
        self._measured: dict[str, float] = {}
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
                over them after the first (see :func:`settled`).
            restored: the plan of the run this one resumes.
            reprofile: profile again even when a plan was restored.
        """
        if not self.config.plans_automatically:
            return
        if restored is not None and not reprofile:
            if self._fits(restored):
                self.apply_plan(restored)
                rank_zero_info("RatelProfiler: using the plan from the checkpoint (reprofile=True to measure again)")
                return
            # The run that saved it had more blocks by then: those it formed around parameters used outside their
            # block (see Blocks.add) form again only as this run's passes find the same uses.
            rank_zero_info("RatelProfiler: the checkpoint's plan names other blocks than the model has now; "
                           "profiling again")
        start = time.perf_counter()
        self._nodes = self.measure_hardware(fresh=reprofile)
        self.begin_profile()
        self._profile_steps = profile_steps
        self._profiled_steps = 0
        rank_zero_info(
            f"RatelProfiler: hardware measured in {time.perf_counter() - start:.2f} s; profiling the first step"
        )

    def step_started(self) -> None:
        """A training micro-batch starts (its training_step is called): while profiling, its forward is timed from
        here."""
        if self._timer is not None:
            self._timer.step_start()
            self._step_updates = 0.0

    def record_updates(self, seconds: float, numel: int) -> None:
        """A profiled optimizer step's updates ran alone after backward (the engine waited for them): ``seconds`` for
        ``numel`` parameters, this rank's."""
        if self._timer is not None:
            self._step_updates += seconds
            if numel:
                self._updates.append((seconds, numel))

    def micro_batch_ended(self) -> None:
        """The backward or the optimizer step of a training micro-batch ended (the last call counts): while
        profiling, its backward is timed to here rather than to :meth:`micro_batch_done`, so that what runs in
        between at batch end (callbacks, loggers, the profiler's export of a trace) is not charged to it."""
        if self._timer is not None:
            self.device.synchronize()
            self._ended = time.perf_counter()

    def micro_batch_done(self) -> Plan | None:
        """A training micro-batch ended; after the last profiled one, plan and apply. Returns the new plan then."""
        if not self.profiling:
            return None
        assert self._timer is not None
        self.device.synchronize()
        ended, self._ended = self._ended if self._ended is not None else time.perf_counter(), None
        if self._outside and "backward_from" in self._outside[-1]:
            # The backward's wall time ends with the micro-batch's work (finishing the step included), less its
            # blocks' and the updates'.
            last = self._outside[-1]
            last["backward"] = ended - last.pop("backward_from") - last.pop("backward_blocks") - self._step_updates
        self._profiled_steps += 1
        if self._profiled_steps < self._profile_steps:
            return None
        layers = self.end_profile()
        start = time.perf_counter()
        assert self._nodes is not None
        plan = self._agreed_plan(self._nodes, layers)
        self.apply_plan(plan)
        show_plan(plan, planning_seconds=time.perf_counter() - start)
        return plan

    @property
    def ranks_on_node(self) -> int:
        """Data-parallel ranks sharing this node's drives, host memory and cores (1 on one rank)."""
        return self._parallel.ranks.local_world if self._parallel is not None else 1

    def measure_hardware(self, fresh: bool = False) -> list[HardwareProfile]:
        """Measure links, swap directories, CPU AdamW and free memory (see :mod:`lightning_ratel.runtime.probe`),
        reusing the speeds measured on this machine recently unless ``fresh``.

        With several ranks this is a collective: each node's local rank 0 measures the whole node (the AdamW probe
        with the threads of all its ranks' optimizers) while the others wait, and every rank receives every node's
        profile with the least free memory and disk of all ranks (see :func:`node_profiles`).

        Returns:
            Every node's profile, in node order (this machine's alone on one rank).

        Raises:
            RuntimeError: another rank could not measure its node or device (that rank raises its own error).
        """
        threads = self.adam.threads if self.adam is not None else torch.get_num_threads()
        parallel = self._parallel
        if parallel is None:
            return [self._probe(threads, fresh)]
        ranks = parallel.ranks

        def measure() -> HardwareProfile | int:
            if ranks.local_rank == 0:
                return self._probe(threads * ranks.local_world, fresh)
            return free_device_memory(self.device)

        entries = gather_outcomes(parallel.gather_objects, measure, "the nodes' hardware could not be measured")
        return node_profiles(entries, ranks.local_world)

    def _probe(self, threads: int, fresh: bool) -> HardwareProfile:
        assert self.config.ssd_paths is not None
        # Named after the run's store: the nodes of a cluster may probe directories of one shared file system at once.
        return measure_hardware(self.device, self.config.ssd_paths,
                                functools.partial(adamw_step(), num_threads=threads), threads=threads, fresh=fresh,
                                name=f"{self.config.name}-probe", store_options=self.store_options)

    def _agreed_plan(self, nodes: list[HardwareProfile], layers: list[LayerProfile]) -> Plan:
        """The plan of this run: this rank's own on one rank; with several, rank 0's, received by every rank. Rank 0
        plans with the least host room of any rank and every node's speeds and settings (:func:`node_settings` of
        its ranks'), so that the plan fits each rank and its predicted time holds on the slowest node.

        Raises:
            RatelPlanError: no placement fits the budgets (on every rank where rank 0's search found none).
            RuntimeError: another rank could not say its host room or settings (that rank raises its own error).
        """
        parallel = self._parallel
        if parallel is None:
            return self.make_plan(nodes, layers)
        entries = gather_outcomes(parallel.gather_objects, lambda: (self.host_room(nodes), self.cost_settings(layers)),
                                  "the ranks' planning inputs could not be computed")
        local_world = parallel.ranks.local_world
        per_node = [node_settings([settings for _, settings in entries[first:first + local_world]])
                    for first in range(0, len(entries), local_world)]
        plan: Plan | None = None
        failure: Exception | None = None
        if parallel.ranks.rank == 0:
            try:
                plan = self.make_plan(nodes, layers, host_room=min(room for room, _ in entries), settings=per_node)
            except Exception as err:  # noqa: BLE001 - the other ranks must hear of it, then it is raised
                failure = err
        made = parallel.broadcast_object(failure if plan is None else plan.to_json(), src=0)
        if failure is not None:
            raise failure
        if isinstance(made, Exception):
            raise made
        return plan if plan is not None else Plan.from_json(made)

    def begin_profile(self) -> None:
        """Run the next passes under the safe default, timing every op and counting its FLOPs and saved bytes."""
        self._timer = BlockTimer(self.device)
        self.scheduler.observer = self._timer
        self._profiled.clear()
        self._profiled_times.clear()
        self._outside.clear()
        self._updates.clear()
        self.cache.set_placements(profiling_placements(self.blocks))

    def record_pass(self) -> None:
        """A profiled pass's backward ended: keep what it measured (the cache forgets its records next)."""
        timer = self._timer
        if timer is None:
            return
        forward = backward = 0.0
        for b in range(len(self.blocks)):
            self._profiled.setdefault(b, []).append([PassRecord.of(r) for r in self.cache.records(b)])
            times = timer.block_times.pop(b, {})
            self._profiled_times.setdefault(b, []).append(times)
            forward += times.get("forward", 0.0)
            backward += times.get("backward", 0.0)
        if timer.step_started is not None and timer.backward_began is not None:
            # Forward's wall time from the batch's start, less its blocks' and the waits for their parameters: the
            # code around them.
            self._outside.append({"forward": timer.backward_began - timer.step_started - forward - timer.forward_waits,
                                  "backward_from": timer.backward_began, "backward_blocks": backward})

    def end_profile(self) -> list[LayerProfile]:
        """Stop profiling and return one :class:`LayerProfile` per block, in execution order.

        Each block's times are :func:`settled` over the profiled passes: the first pass of a run also pays one-off
        costs (first touch of fresh memory, lazy initialisation) that later steps do not. So are what the passes ran
        outside the blocks and the rate of the optimizer steps that ran alone (kept for :meth:`cost_settings`).
        """
        self.scheduler.observer = self._timer = None
        self._measured = {
            "forward_overhead": max(0.0, settled([o["forward"] for o in self._outside])),
            "backward_overhead": max(0.0, settled([o["backward"] for o in self._outside if "backward" in o])),
            "update_params_per_s": update_rate(self._updates),
        }
        layers = []
        for pos, b in enumerate(self.scheduler.order):
            block = self.blocks[b]
            passes = self._profiled_times.get(b) or [{}]
            per_pass = self._profiled.get(b, [])
            records = [r for pass_records in per_pass for r in pass_records]
            forward = settled([t.get("forward", 0.0) for t in passes])
            # Backward less the replays of recomputed ops, which the cost model charges per op.
            replays = [sum(r.replay_time for r in pass_records) for pass_records in per_pass]
            replays += [0.0] * (len(passes) - len(replays))
            backward = settled([t.get("backward", 0.0) - replay for t, replay in zip(passes, replays)])
            backward = backward if backward > 0 else 2.0 * forward
            owned = [s for s in self.layout.shards if s.unit.index == b]
            if records and not block.direct_only:
                record = records[0]
                same = [r for r in records if len(r.ops) == len(record.ops)]
                names = [op.name for op in record.ops]
                times = [min(r.ops[k].forward_time for r in same) for k in range(len(record.ops))]
                if self.device.is_cuda and sum(times) > 0:
                    # Kernels run behind the host: the block costs its ops' device time. The host's dispatch work,
                    # several times larger under profiling's op tracking than in the steady state, overlaps them.
                    forward = sum(times)
                # On the CPU the block's forward also pays Python and dispatch work between its ops, and so does a
                # replay: spread it over the ops in proportion, so recomputing all of them costs the block's forward.
                scale = forward / sum(times) if sum(times) > 0 and forward > sum(times) else 1.0
                ops_ = [OpProfile(INPUT_OP, 0.0, 0.0, record.saved.get(-1, 0), [])]
                ops_ += [
                    OpProfile(op.name, times[k] * scale, op.flops, record.saved.get(k, 0),
                              [names[i] if i >= 0 else INPUT_OP for i in op.inputs])
                    for k, op in enumerate(record.ops)
                ]
            else:
                ops_ = [OpProfile(CONTAINER_OP, 0.0, 0.0, self.cache.saved_by_block.get(b, 0), [])]
            # What is paged in for each pass and what leaves the device as gradients: a unit resident on the device
            # (the device tier's) neither crosses the link nor takes a paging buffer.
            param_bytes = sum(self.layout.units[u].nbytes for u in self.blocks.units_of(b)
                              if not self.layout.units[u].resident)
            saved = sum(op.saved_bytes for op in ops_)
            # On the device: what backward allocated beyond what it found, plus the block's own resident bytes.
            peak = max(t.get("backward_peak", 0.0) for t in passes)
            layers.append(LayerProfile(
                name=block.name,
                index=pos,
                forward_time=forward,
                backward_time=backward,
                param_bytes=param_bytes,
                grad_bytes=sum(s.numel * s.dtype.itemsize for s in owned if s.state_tier != "device"),
                trainable_numel=sum(s.numel for s in owned),
                ops=ops_,
                op_level=not block.direct_only,
                peak_device_bytes=int(peak) + param_bytes + saved if peak > 0 else 0,
            ))
            self._outputs[b] = (max(t.get("output_bytes", 0.0) for t in passes),
                                max(t.get("output_elements", 0.0) for t in passes))
        self._profiled.clear()
        self._profiled_times.clear()
        self._outside.clear()
        self._updates.clear()
        return layers

    def owned_shards(self) -> list[Shard]:
        """The trainable shards whose states and updates are this rank's (all of them on one rank)."""
        parallel = self._parallel
        return [s for s in self.layout.shards if parallel is None or parallel.owns(s)]

    def state_traffic(self) -> dict[str, int]:
        """Bytes each optimizer step of this rank must move between its swap files and its CPU optimizer (see
        :func:`state_traffic`): over the shards it owns; the other ranks' states are in theirs."""
        return state_traffic(self.owned_shards(), self.layout.param_cache)

    def step_traffic(self, after_backward: bool = False) -> dict[str, int]:
        """Bytes each optimizer step of this rank must move through its swap files (see :func:`step_traffic`): its
        model states' traffic, and the page-ins of compute copies read from there; ``after_backward``: the updates
        run after backward (which shards the buffer sets read ahead)."""
        owned = self.owned_shards()
        others = [s for s in self.layout.shards if s not in owned]
        return step_traffic(owned, self.layout.frozen_shards, self.layout.param_cache, self._read_ahead_sets(),
                            after_backward, others, self._stored_copies())

    def _stored_copies(self) -> list[Shard]:
        """The trainable shards other ranks own whose compute copies this rank keeps in its own swap files."""
        parallel = self._parallel
        return [s for s in self.layout.shards if parallel is not None and parallel.stores_copy(s)]

    def host_room(self, nodes: Sequence[HardwareProfile]) -> int:
        """Host bytes this rank's budget leaves beyond what it holds now (see :func:`plan_budgets`), given every node's
        profile (:meth:`measure_hardware`)."""
        static = self.accounts.held()["host"]
        return plan_budgets(nodes[0], static, self.ranks_on_node, self.config.host_memory_limit,
                            self.config.device_memory_limit, device_static_bytes=self._device_tier_bytes())[1] - static

    def cost_settings(self, layers: Sequence[LayerProfile]) -> CostSettings:
        """The cost model's settings of this rank (see :func:`plan_settings`): the states it owns and where they
        are, the host bytes it holds now, and on a GPU what a step needs on the device beyond its working set."""
        settings = plan_settings(
            self.layout.shards, self.owned_shards(), self.layout.param_cache, self.ranks_on_node,
            prefetch_depth=self.config.prefetch_depth, host_static_bytes=self.accounts.held()["host"],
            device_overhead=self._device_overhead(layers) if self.device.is_cuda else None,
            read_ahead_sets=self._read_ahead_sets(), slot_copy=self.layout.generic is not None,
            stored_copies=self._stored_copies(), block_names={b.index: b.name for b in self.blocks})
        return dataclasses.replace(settings, updates_after_backward=not self.updates_overlap,
                                   gradients_reduced_on_device=self._parallel is not None
                                   and self._parallel.reduces_on_device, **self._measured)

    def _device_tier_bytes(self) -> int:
        """Device bytes the device tier holds: its shards' states and gradient sums, and the resident units."""
        return (sum(device_bytes(s.numel) for s in self.layout.shards if s.state_tier == "device")
                + sum(u.nbytes for u in self.layout.units.values() if u.resident))

    def _read_ahead_sets(self) -> int:
        """This rank's whole buffer sets (each reads one shard's states ahead during forward): its share of the
        pipeline's and those planned with the states' tiers."""
        return int(buffer_sets(self.ranks_on_node)) + self.layout.read_ahead_sets

    def make_plan(self, nodes: Sequence[HardwareProfile], layers: list[LayerProfile],
                  host_room: int | None = None, settings: Sequence[CostSettings] | None = None) -> Plan:
        """Search the placement with the least predicted iteration time, on the slowest node, under this run's memory
        budgets.

        Args:
            nodes: every node's profile (:meth:`measure_hardware`'s: the cost model gives each rank its share of its
                node's rates; each profile holds the least free capacities of all ranks, so any one sets the budgets).
            layers: the blocks' profiles.
            host_room: host bytes the plan may use beyond what this rank holds, where less than its own budget
                leaves (another rank's, for a plan every rank applies).
            settings: each node's cost settings, in the order of ``nodes``, the first node's with this rank's host
                bytes (:func:`node_settings`); ``None``: this rank's own (:meth:`cost_settings`) on every node.
        """
        static = self.accounts.held()["host"]
        device_budget, host_budget, store_budget = plan_budgets(
            nodes[0], static, self.ranks_on_node, self.config.host_memory_limit, self.config.device_memory_limit,
            host_room, self._device_tier_bytes())
        plan = search(nodes, layers, device_budget=device_budget, host_budget=host_budget,
                      store_budget=store_budget, settings=settings or self.cost_settings(layers))
        plan.budgets["host_static"] = static
        if len(nodes) > 1:
            slowest = next(n for n, node in enumerate(nodes) if node is plan.hardware)
            rank_zero_info(f"RatelProfiler: planned for {len(nodes)} nodes; node {slowest} is the slowest under this "
                           f"plan and sets its predicted step time")
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
        if not self._fits(plan):
            names = {block.name for block in self.blocks}
            planned = sorted(plan.blocks or {key.rpartition("/")[0] for key in plan.activation_placement})
            raise RatelConfigError(
                f"the plan was made for a model with other blocks ({', '.join(planned[:4])}, ...) than this one "
                f"({', '.join(sorted(names)[:4])}, ...). Make a plan for this model (plan='auto').")
        self.plan = plan
        self.cache.set_placements(plan_placements(self.blocks, plan.activation_placement))

    def _fits(self, plan: Plan) -> bool:
        """Whether ``plan`` was made for this model's blocks (a hand-written one, naming no blocks, for at least one
        of them: it may place only some)."""
        names = {block.name for block in self.blocks}
        if plan.blocks:
            return set(plan.blocks) == names
        return bool({key.rpartition("/")[0] for key in plan.activation_placement} & names)


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """What a block's forward record measured in one profiled pass, without the record itself: a record holds the
    pass's inputs and stored tensors, and keeping those until planning would keep their (pinned) buffers from the
    next pass, which then allocates and page-locks new ones inside its measured forward."""

    ops: list[OpRecord]
    saved: dict[int, int]
    replay_time: float

    @classmethod
    def of(cls, record: ForwardRecord) -> PassRecord:
        return cls(list(record.ops), dict(record.saved), record.replay_time)


def settled(samples: Sequence[float]) -> float:
    """What a profiled quantity settles to: the least of ``samples`` (one per profiled pass, in order) after the
    first, which also pays a run's one-off costs (first touch of fresh memory, lazy initialisation, the first pass's
    watch for parameters used outside their block); the first alone where it is the only one, 0 where there is none.
    The least rather than a median: what other processes take of the cores and the memory bus only ever adds time,
    and with two or three passes a median still follows one pass they slowed (one profiled update's rate was seen to
    vary tenfold on a loaded machine)."""
    if not samples:
        return 0.0
    return min(samples[1:] or samples)


def update_rate(updates: Sequence[tuple[float, int]]) -> float:
    """Parameters per second of the profiled optimizer steps that ran alone, ``(seconds, parameters)`` each in order:
    the one of :func:`settled` seconds per parameter (so the fastest after the first); 0 where none was timed."""
    per_param = settled([seconds / numel for seconds, numel in updates if seconds > 0 and numel > 0])
    return 1 / per_param if per_param > 0 else 0.0


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


def state_traffic(shards: Sequence[Shard], param_cache: str) -> dict[str, int]:
    """Bytes each optimizer step must move between the swap files and the CPU optimizer for ``shards``: the moments
    and masters of those whose states are in the swap files (masters are not read where the host cache holds them),
    and the new 16-bit compute copies where the pager reads them from the swap files (``param_cache="ssd"``). The
    least a step can move for those model states; the pager's reads of compute copies and activations sent to the SSD
    come on top.

    Returns:
        ``{"read": bytes, "written": bytes}``.
    """
    on_disk = [s for s in shards if s.state_tier == "ssd"]
    moments = sum(s.numel * 8 for s in on_disk)
    copies = sum(s.numel * s.dtype.itemsize for s in shards if param_cache == "ssd" and s.dtype != torch.float32)
    return {"read": moments + sum(s.numel * 4 for s in on_disk if not s.master_in_host),
            "written": moments + sum(s.numel * 4 for s in on_disk) + copies}


def step_traffic(shards: Sequence[Shard], frozen_shards: Sequence[Shard], param_cache: str,
                 read_ahead_sets: int = 0, after_backward: bool = False, others: Sequence[Shard] = (),
                 stored: Sequence[Shard] | None = None) -> dict[str, int]:
    """The least a training step moves through the swap files: :func:`state_traffic` of ``shards``, and where the
    pager reads compute copies from the swap files (``param_cache="ssd"``), each unit's copies read for its forward
    and again for its backward, except where a page-in and the optimizer use the same bytes (an fp32 shard whose
    master, its compute copy, is in the swap files: one of its page-ins shares the update's, see
    :func:`shared_master_reads`; the other one does too where a buffer set read the shard's states ahead during
    forward, see :func:`read_ahead_traffic`). Activations sent to the SSD come on top.

    Args:
        shards: the trainable shards (those whose states this rank holds).
        frozen_shards: the shards outside the optimizer (their compute copies are paged in too).
        param_cache: where compute copies live between uses (``"host"`` or ``"ssd"``).
        read_ahead_sets: this rank's whole buffer sets, each reading one shard's states ahead during forward.
        after_backward: the updates run after backward, in forward order, so the sets read the first shards ahead
            (``False``: they overlap backward, which updates the last shards first).
        others: the trainable shards other ranks own. Where the pager reads compute copies from the swap files, this
            rank pages the copy of each in like a frozen one, from its own swap files or from its owner's (see
            :class:`~lightning_ratel.runtime.collectives.NodeCopies`).
        stored: those of ``others`` whose copies this rank stores in its own swap files, once a step (see
            :func:`others_copies`); ``None``: all of them.

    Returns:
        ``{"read": bytes, "written": bytes}``.
    """
    traffic = state_traffic(shards, param_cache)
    if param_cache != "ssd":
        return traffic
    # A compute copy is on the swap files unless it is an fp32 master kept in host memory.
    on_disk = [s for s in [*shards, *frozen_shards]
               if not (s.dtype == torch.float32 and s.group >= 0 and s.state_tier == "host")]
    forward = sum(s.numel * s.dtype.itemsize for s in on_disk) + others_copies(others, param_cache)
    shared = shared_master_reads(shards) + shared_master_reads(_read_ahead(shards, read_ahead_sets, after_backward))
    return {"read": traffic["read"] + 2 * forward - shared,
            "written": traffic["written"] + others_copies(others if stored is None else stored, param_cache)}


def others_copies(others: Sequence[Shard], param_cache: str) -> int:
    """Bytes of the compute copies of ``others``, trainable shards other ranks own, where the pager reads compute
    copies from the swap files (``param_cache="ssd"``): what a rank reads of them for each forward and backward, and
    where it keeps them in its own files (:class:`~lightning_ratel.runtime.collectives.StoredCopies`: not where its
    node's ranks share them, :class:`~lightning_ratel.runtime.collectives.NodeCopies`) what it writes from the owner's
    broadcast once a step; none otherwise."""
    return sum(s.numel * s.dtype.itemsize for s in others) if param_cache == "ssd" else 0


def shared_master_reads(shards: Sequence[Shard]) -> int:
    """Bytes of the reads a page-in and the optimizer share with compute copies in the swap files
    (``param_cache="ssd"``): the fp32 masters of ``shards`` (trainable) whose states are there, each its own compute
    copy, read from the drive once for its update and one page-in: where updates overlap backward, the backward's
    page-in and the update's read share one read; where they run after backward, the next forward's page-in copies
    the master the update has just written from its buffer set (see
    :class:`~lightning_ratel.runtime.state_buffers.StateBuffers`)."""
    return sum(s.numel * 4 for s in shards if s.dtype == torch.float32 and s.state_tier == "ssd")


def read_ahead_traffic(shards: Sequence[Shard], sets: int) -> int:
    """State bytes the CPU optimizer's ``sets`` buffer sets read from the swap files during forward: those of the
    first shards backward updates (the last in forward order) whose states are there, one a set (masters the host
    cache holds are not read)."""
    return sum(s.numel * 8 + (0 if s.master_in_host else s.numel * 4) for s in _read_ahead(shards, sets))


def _read_ahead(shards: Sequence[Shard], sets: int, after_backward: bool = False) -> list[Shard]:
    """The shards whose states ``sets`` buffer sets read ahead during forward: of those in the swap files, one a set,
    the first updated: the last in forward order where updates overlap backward, the first where they run after it
    (``after_backward``)."""
    order = shards if after_backward else list(reversed(shards))
    return [s for s in order if s.state_tier == "ssd"][:max(0, sets)]


def plan_settings(shards: Sequence[Shard], owned: Sequence[Shard], param_cache: str, ranks_on_node: int,
                  *, prefetch_depth: int, host_static_bytes: int,
                  device_overhead: DeviceOverhead | None, read_ahead_sets: int = 0,
                  slot_copy: bool = False, stored_copies: Sequence[Shard] | None = None,
                  block_names: Mapping[int, str] | None = None) -> CostSettings:
    """The cost model's settings for one rank of ``ranks_on_node`` on its node.

    The cost model counts the optimizer's state bytes per parameter a rank owns, ``1 / ranks_on_node`` of the
    trainable ones: this rank's traffic (:func:`state_traffic` of ``owned``) per that many parameters, so that its
    prediction moves exactly this rank's bytes.

    Args:
        shards: every trainable shard of the model.
        owned: those whose states this rank holds (``shards`` on one rank).
        param_cache: where compute copies live between uses (``"host"`` or ``"ssd"``).
        ranks_on_node: data-parallel ranks on this node.
        prefetch_depth: blocks paged in ahead of the one computing.
        host_static_bytes: host bytes the run holds apart from activations.
        device_overhead: device memory a step needs beyond its working set (``None``: none counted).
        read_ahead_sets: this rank's whole buffer sets, each reading a shard's states ahead during forward (see
            :func:`read_ahead_traffic`).
        slot_copy: the update copies a shard's committed state into the other slot before stepping there (the
            generic optimizer path; AdamW reads one slot and writes the other in its single pass).
        stored_copies: the shards of other ranks whose compute copies this rank keeps in its own swap files;
            ``None``: every one it does not own.
        block_names: each block's name by index, naming the units updated on the device tier whole
            (:attr:`CostSettings.device_updated`); ``None``: none named.
    """
    share = (sum(s.numel for s in shards) or 1) / ranks_on_node
    traffic = state_traffic(owned, param_cache)
    mine = {id(s) for s in owned}
    # The copies of other ranks' shards this rank stores each step travel with its own state writes.
    if stored_copies is None:
        stored_copies = [s for s in shards if id(s) not in mine]
    traffic["written"] += others_copies(stored_copies, param_cache)
    if param_cache == "ssd":
        # The cost model counts every compute copy's page-ins; an fp32 master in the swap files is that copy, and
        # the optimizer's read of it shares one page-in's bytes (see shared_master_reads).
        traffic["read"] -= shared_master_reads(owned)
    # The device tier's updates touch no host memory. States in host memory updated through a slot copy cost it
    # (12 bytes read, 12 written) besides the update's own traffic.
    updated = sum(s.numel for s in owned)
    on_device = sum(s.numel for s in owned if s.state_tier == "device")
    in_host = sum(s.numel for s in owned if s.state_tier == "host") if slot_copy else 0
    device_updated: tuple[str, ...] = ()
    if block_names is not None:
        tiers: dict[int, set[str]] = {}
        for shard in shards:
            tiers.setdefault(shard.unit.index, set()).add(shard.state_tier)
        device_updated = tuple(block_names[u] for u, unit_tiers in sorted(tiers.items())
                               if unit_tiers == {"device"} and u in block_names)
    return CostSettings(
        prefetch_depth=prefetch_depth, host_static_bytes=host_static_bytes,
        optimizer_memory_bytes_per_param=round((OPTIMIZER_MEMORY_BYTES_PER_PARAM * (updated - on_device)
                                                + 24 * in_host) / share),
        device_update_share=on_device / (updated or 1),
        device_updated=device_updated,
        state_read_bytes_per_param=round(traffic["read"] / share),
        state_write_bytes_per_param=round(traffic["written"] / share),
        state_read_ahead_bytes_per_param=min(traffic["read"], read_ahead_traffic(owned, read_ahead_sets)) / share,
        param_cache=param_cache,
        # Write-backs are waited for only by the next update of the same shard.
        state_spill=True,
        device_overhead=device_overhead,
        ranks_on_node=ranks_on_node)


def plan_budgets(hardware: HardwareProfile, host_static_bytes: int, ranks_on_node: int,
                 host_memory_limit: int | None, device_memory_limit: int | None,
                 host_room: int | None = None, device_static_bytes: int = 0) -> tuple[int, int, int]:
    """Device, host and swap-file bytes one rank's placement may use.

    Without ``host_memory_limit`` a rank may use its share of what the kernel can still hand out (less a tenth for
    the page cache, the dataloader and the like) on top of what it holds (``host_static_bytes``); each rank of the
    node gets its share of the swap directories' free space too. On unified memory the device is the host.

    Args:
        hardware: the node's profile (free capacities read when it was measured, after every rank set up).
        host_static_bytes: host bytes this rank holds apart from activations.
        ranks_on_node: data-parallel ranks sharing the node's memory and drives.
        host_memory_limit: this rank's host budget, if the user gave one.
        device_memory_limit: this rank's device budget, if the user gave one.
        host_room: at most this many host bytes beyond ``host_static_bytes`` (``None``: no further bound).
        device_static_bytes: device bytes the run holds for the whole fit (the device tier's states, gradient sums and
            resident compute copies), taken out of ``device_memory_limit`` (the free memory measured already lacks
            them).

    Returns:
        ``(device_budget, host_budget, store_budget)``.
    """
    if host_memory_limit is not None:
        host_budget = host_memory_limit
    else:
        host_budget = host_static_bytes + int(hardware.host_memory_free * 0.9) // ranks_on_node
    if host_room is not None:
        host_budget = min(host_budget, host_static_bytes + host_room)
    device_budget = (device_memory_limit - device_static_bytes if device_memory_limit
                     else hardware.device_memory_free)
    if hardware.unified_memory:
        device_budget = host_budget
    return device_budget, host_budget, int(hardware.ssd_free * 0.95) // ranks_on_node


def node_profiles(entries: Sequence[HardwareProfile | int], local_world: int) -> list[HardwareProfile]:
    """Every node's profile, from what every rank contributed (:meth:`Planner.measure_hardware`).

    Each node's local rank 0 contributes its node's profile, the others their device's free bytes. Each profile keeps
    its node's speeds; its free capacities are the least of all ranks and nodes, because the plan rank 0 makes is every
    rank's and must fit the fullest device, host and drive.

    Args:
        entries: by global rank, a node's profile or a device's free bytes.
        local_world: the ranks of each node (a node's ranks are consecutive).

    Returns:
        The profiles in node order.

    Raises:
        RuntimeError: the first rank of a node contributed no profile.
    """
    nodes: list[HardwareProfile] = []
    for first in range(0, len(entries), local_world):
        entry = entries[first]
        if not isinstance(entry, HardwareProfile):
            raise RuntimeError(f"rank {first} sent no hardware profile of its node (got {entry!r})")
        nodes.append(entry)
    host = min(node.host_memory_free for node in nodes)
    device = min(e.device_memory_free if isinstance(e, HardwareProfile) else int(e) for e in entries)
    ssd = min(node.ssd_free for node in nodes)
    return [dataclasses.replace(node, host_memory_free=host, device_memory_free=device, ssd_free=ssd) for node in nodes]
