"""The step coordinator: owns the blocks, the host cache, the swap store and the CPU optimizer of one model.

The Lightning adapters call into this class at a handful of points (setup, start of a micro-batch, the boundary
optimizer step, backward, checkpointing, teardown); everything that moves data lives in :mod:`lightning_ratel.runtime`.

Host memory is bounded by blocks, not by the model, wherever the model's states may exceed it: parameters on the meta
device are materialized and initialized one block at a time and go straight to the swap store, compute copies can be
read from the store on every use instead of a host cache (``param_cache="ssd"``), gradient buffers come from a pool
sized by the shards in flight, and nothing larger than comfortably fits is gathered back into host memory.
"""

from __future__ import annotations

import fnmatch
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_ratel import ops
from lightning_ratel.blocks import Block, BlockSpec, discover_blocks
from lightning_ratel.errors import RatelConfigError, RatelPlanError
from lightning_ratel.plan.profile import HardwareProfile, LayerProfile, OpProfile
from lightning_ratel.plan.search import Plan, search
from lightning_ratel.runtime import gds
from lightning_ratel.runtime.activations import TIERS, ActivationCache, Placement
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.optimizer import CpuAdam, GroupHyper, Shard, ShardParam, StepPlan
from lightning_ratel.runtime.probe import available_host_memory, measure_hardware
from lightning_ratel.runtime.pager import ParameterPager, ParamSlot, Unit
from lightning_ratel.runtime.recompute import INPUT, ForwardRecord, OpTracker
from lightning_ratel.runtime.storage import ALIGNMENT, TensorStore, aligned_empty
from lightning_ratel.runtime.timeline import Timeline

ActivationPolicy = str | dict[str, str]
ParamInitFn = Callable[[nn.Module], None]
SUPPORTED_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam)
# Block-level policy names a user may give; "keep" is the older name of "device".
POLICIES = ("keep", *TIERS)
ParamCache = Literal["auto", "host", "ssd"]
PARAM_CACHES: tuple[ParamCache, ...] = ("auto", "host", "ssd")
# Gradient bytes backward may hold, in largest-shard buffers, before it waits for pending updates to free some: the
# shard being updated, one waiting for its turn, and the ones backward is filling.
GRAD_BUDGET_SHARDS = 4


@dataclass
class EngineConfig:
    """What the strategy passes down; see :class:`~lightning_ratel.RatelStrategy` for the meaning of each field."""

    ssd_paths: list[str]
    prefetch_depth: int = 1
    keep_swap_files: bool = False
    activation_policy: ActivationPolicy = "host"
    blocks: BlockSpec = None
    name: str = "ratel"
    host_memory_limit: int | None = None
    device_memory_limit: int | None = None
    param_cache: ParamCache = "auto"
    param_init_fn: ParamInitFn | None = None


def resolve_policies(blocks: Sequence[Block], policy: ActivationPolicy) -> list[Placement]:
    """The activation placement of each block: one policy for all, or the first matching ``fnmatch`` pattern.

    ``recompute`` becomes an op-level placement (every op recomputed, the block's inputs kept): the replay then
    reruns the block's forward from its inputs, as activation checkpointing does.
    """
    if isinstance(policy, str):
        policy = {"*": policy}
    for name in policy.values():
        if name not in POLICIES:
            raise RatelConfigError(f"activation_policy {name!r} is not one of {', '.join(POLICIES)}")
    resolved: list[Placement] = []
    for block in blocks:
        match = next((p for pat, p in policy.items() if fnmatch.fnmatchcase(block.name, pat)), "device")
        match = "device" if match == "keep" else match
        if match == "recompute":
            resolved.append({"*": "recompute", INPUT: "device"} if not block.direct_only else "device")
        else:
            resolved.append(match)
    return resolved


def plan_placements(blocks: Sequence[Block], placement: dict[str, str]) -> list[Placement]:
    """Per-block placements from a plan's ``"<block>/<op>" -> tier`` mapping.

    A container block (one that holds other blocks) cannot be tracked op by op; its ``"<block>/*"`` entry (or
    ``device``) applies to everything it saves. Ops the plan does not name stay on the device, and a block whose
    ops all stay is not tracked.
    """
    by_block: dict[str, dict[str, str]] = {}
    for key, tier in placement.items():
        if tier not in TIERS:
            raise RatelConfigError(f"the plan places {key!r} on {tier!r}, which is not one of {', '.join(TIERS)}")
        block, _, op = key.rpartition("/")
        by_block.setdefault(block, {})[op] = tier
    resolved: list[Placement] = []
    for block in blocks:
        ops = by_block.get(block.name, {})
        if block.direct_only or not ops:
            tier = ops.get("*", "device")
            resolved.append("host" if tier == "recompute" else tier)
        elif set(ops.values()) == {"device"}:
            # Everything stays: no op needs to be told apart, so the forward runs without op tracking.
            resolved.append("device")
        else:
            resolved.append(ops)
    return resolved


def _autocast_only(modules: list[nn.Module]) -> bool:
    """Whether every module using a parameter feeds it only to ops that autocast runs in 16-bit.

    Storing such a parameter in 16-bit gives bit-identical results to autocast casting an fp32 copy, at half the
    bytes; anything else (embeddings, norms) keeps fp32 to match plain mixed-precision training exactly.
    """
    linear_like = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return bool(modules) and all(
        isinstance(m, linear_like) or type(m).__name__ == "Conv1D" for m in modules
    )


class RatelEngine:
    """Runs a model with its parameters paged, its optimizer states on disk and its activations placed by policy.

    Args:
        module: the model (the LightningModule).
        device: the compute device.
        config: the strategy's settings.
        half_dtype: the 16-bit compute dtype of mixed precision, ``None`` for fp32.
        optimizer: the user's optimizer when fitting; ``None`` for evaluation-only runs (no store is created).
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        config: EngineConfig,
        half_dtype: torch.dtype | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.device = Device(device)
        self.half_dtype = half_dtype
        self.optimizer = optimizer
        self.timeline = Timeline()
        self.blocks = discover_blocks(module, config.blocks)
        if not self.blocks:
            raise RatelConfigError("the model has no parameters to manage")
        self.placements = resolve_policies(self.blocks, config.activation_policy)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._orig_dtype = {id(p): p.dtype for _, p in module.named_parameters()}
        groups = self._optimizer_groups(optimizer)
        self.units, block_units = self._build_units(groups)
        # Parameters still on the meta device: materialized and initialized block by block while loading.
        self._meta = {id(p) for unit in self.units.values() for p in (s.param for s in unit.slots) if p.is_meta}
        self._was_meta = set(self._meta)
        self._check_materializable()
        self.param_cache = self._resolve_param_cache(config.param_cache, optimizer is not None)
        if self.param_cache == "host":
            for unit in self.units.values():
                unit.host = {d: self.device.host_empty(n, d) for d, n in unit.numels.items()}
        self.shards: list[Shard] = []
        self.frozen_shards: list[Shard] = []
        self._unit_shards: dict[int, list[Shard]] = {}
        self.store: TensorStore | None = None
        self.adam: CpuAdam | None = None
        self._originals: dict[int, torch.Tensor] = {}
        self._cache_configs = _disable_kv_cache(module) if optimizer is not None else []
        if optimizer is not None:
            self._build_shards(groups)
            self.store = TensorStore(config.ssd_paths, name=config.name, keep_files=config.keep_swap_files)
            try:
                self._load_units()
                largest = max((s.numel for s in self.shards), default=0)
                self.adam = CpuAdam(self.shards, self.store, timeline=self.timeline,
                                    compute_on_store=self.param_cache == "ssd",
                                    grad_budget_bytes=GRAD_BUDGET_SHARDS * largest * 4,
                                    # On the CPU the compute's own thread team already fills every core.
                                    threads=None if self.device.is_cuda else 1)
            except BaseException:
                self._unmaterialize()
                self.store.close()
                raise
        else:
            try:
                self._load_units()
            except BaseException:
                self._unmaterialize()
                raise
            # Evaluation only: the original tensors are the masters, kept in host memory to restore at teardown.
            self._originals = {id(p): p.data for unit in self.units.values() for p in (s.param for s in unit.slots)}
        self.pager = ParameterPager(
            self.device,
            self.units,
            block_units,
            wait_ready=self._wait_unit,
            is_ready=self.adam.unit_ready if self.adam else (lambda u: True),
            read_unit=self._read_unit if self.param_cache == "ssd" else None,
        )
        self.cache = ActivationCache(self.device, self.pager, self.placements, self._activation_store,
                                     self._enter_backward)
        self._order = [b.index for b in self.blocks]
        self._order_pass: list[int] = []
        self._hook_stack: list[tuple[int, list[Any]]] = []
        # The submodule path inside the block whose forward is running, for op names (tracked blocks only).
        self._path_stack: list[str] = []
        self._paths = {id(m): name for block in self.blocks if not block.direct_only
                       for name, m in block.module.named_modules() if name}
        self.profiling = False
        self.plan: Plan | None = None
        self._profiled: dict[int, list[ForwardRecord]] = {}
        self._profiled_times: dict[int, list[dict[str, float]]] = {}
        self.stall_seconds = 0.0
        self._timeline_cursor = 0
        self.block_times: dict[int, dict[str, float]] = {}
        self._bw_entered: float | None = None
        self._bw_held: list[int] = []
        self._bw_current: int | None = None
        self._handles: list[Any] = []
        self._window: set[int] = set()
        self._pending_plan: StepPlan | None = None
        self._step_plan = StepPlan([], overlap=False)
        self._clip: tuple[float, str] | None = None
        self._install_hooks()

    # ------------------------------------------------------------------ construction

    def _optimizer_groups(self, optimizer: torch.optim.Optimizer | None) -> dict[int, tuple[int, int]]:
        """Map parameter id -> (group index, index in the optimizer's state_dict order)."""
        if optimizer is None:
            return {}
        if not isinstance(optimizer, SUPPORTED_OPTIMIZERS):
            raise RatelConfigError(
                f"RatelStrategy runs the optimizer itself and supports torch.optim.AdamW and torch.optim.Adam; "
                f"`configure_optimizers` returned {type(optimizer).__name__}"
            )
        model_params = {id(p) for p in self.module.parameters()}
        mapping: dict[int, tuple[int, int]] = {}
        index = 0
        for g, group in enumerate(optimizer.param_groups):
            for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
                if group.get(flag):
                    raise RatelConfigError(f"RatelStrategy's CPU AdamW does not support `{flag}=True`")
            for p in group["params"]:
                if id(p) not in model_params:
                    raise RatelConfigError("the optimizer holds a parameter that is not part of the LightningModule")
                mapping[id(p)] = (g, index)
                index += 1
        return mapping

    def _compute_dtype(self, p: nn.Parameter, users: dict[int, list[nn.Module]]) -> torch.dtype:
        if not p.is_floating_point():
            raise RatelConfigError(f"parameter {self._names[id(p)]} is not floating point ({p.dtype})")
        if self.half_dtype is not None and _autocast_only(users.get(id(p), [])):
            return self.half_dtype
        return p.dtype

    def _build_units(self, groups: dict[int, tuple[int, int]]) -> tuple[dict[int, Unit], list[list[int]]]:
        users: dict[int, list[nn.Module]] = {}
        for m in self.module.modules():
            for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
                users.setdefault(id(p), []).append(m)
        owner: dict[int, int] = {}
        owned: dict[int, list[nn.Parameter]] = {}
        for block in self.blocks:
            for p in block.uses:
                if id(p) not in owner:
                    owner[id(p)] = block.index
                    owned.setdefault(block.index, []).append(p)
        dtype_rank: dict[torch.dtype, int] = {}
        units: dict[int, Unit] = {}
        for b, params in owned.items():
            dtypes = {id(p): self._compute_dtype(p, users) for p in params}
            for d in dtypes.values():
                dtype_rank.setdefault(d, len(dtype_rank))
            # Sorted so that each (dtype, group) is one contiguous range: one shard, one kernel call, one output.
            order = sorted(
                range(len(params)),
                key=lambda i: (dtype_rank[dtypes[id(params[i])]], groups.get(id(params[i]), (1 << 30, 0))[0], i),
            )
            offsets: dict[torch.dtype, int] = {}
            slots = []
            run = None
            for i in order:
                p = params[i]
                d = dtypes[id(p)]
                start = offsets.get(d, 0)
                if (d, self._group_of(p, groups)) != run:
                    # Each shard starts on a 4096-byte boundary, so the store reads it straight into the flat buffer.
                    run = (d, self._group_of(p, groups))
                    start = -(-start * d.itemsize // ALIGNMENT) * ALIGNMENT // d.itemsize
                slots.append(ParamSlot(self._names[id(p)], p, d, start, p.numel(), p.shape))
                offsets[d] = start + p.numel()
            units[b] = Unit(b, slots, offsets)
        block_units = [sorted({owner[id(p)] for p in block.uses}) for block in self.blocks]
        return units, block_units

    @staticmethod
    def _group_of(p: nn.Parameter, groups: dict[int, tuple[int, int]]) -> int:
        """The parameter's optimizer group, -1 when the optimizer does not hold it."""
        return groups[id(p)][0] if id(p) in groups else -1

    def _resolve_param_cache(self, requested: ParamCache, fitting: bool) -> ParamCache:
        """``"host"`` or ``"ssd"``: where the compute copies live between uses."""
        if requested not in PARAM_CACHES:
            raise RatelConfigError(f"param_cache must be one of {', '.join(PARAM_CACHES)}, got {requested!r}")
        if not fitting:
            # Without an optimizer there is no swap store; the original tensors are the values.
            return "host"
        if requested != "auto":
            return requested
        cache_bytes = sum(u.nbytes for u in self.units.values())
        limit = self.config.host_memory_limit
        budget = limit if limit is not None else available_host_memory()
        choice = "ssd" if budget and cache_bytes > budget // 2 else "host"
        if choice == "ssd":
            what = "host_memory_limit" if limit is not None else "the available host memory"
            rank_zero_info(
                f"RatelStrategy: the compute copies of the parameters ({_gib(cache_bytes)}) would take more than half "
                f"of {what} ({_gib(budget)}); they are read from the swap files on every use (param_cache='ssd')."
            )
        return choice

    def _build_shards(self, groups: dict[int, tuple[int, int]]) -> None:
        for unit in self.units.values():
            runs: dict[tuple[torch.dtype, int], list[ParamSlot]] = {}
            for slot in unit.slots:
                runs.setdefault((slot.dtype, self._group_of(slot.param, groups)), []).append(slot)
            for (dtype, g), slots in runs.items():
                params = []
                offset = 0
                for slot in slots:
                    index = groups[id(slot.param)][1] if g >= 0 else -1
                    params.append(ShardParam(slot.name, slot.param, index, offset, slot.numel, slot.shape))
                    offset += slot.numel
                shard = Shard(len(self.shards) + len(self.frozen_shards), unit, g, dtype, slots[0].offset, params,
                              offset, master_in_host=self.param_cache == "host" and dtype == torch.float32)
                (self.shards if g >= 0 else self.frozen_shards).append(shard)
                self._unit_shards.setdefault(unit.index, []).append(shard)

    def _check_materializable(self) -> None:
        """Fail before anything is allocated if parameters on the meta device cannot be initialized block by block."""
        if not self._meta:
            return
        unit_of = {id(s.param): u.index for u in self.units.values() for s in u.slots}
        for name, m in self.module.named_modules():
            direct = [p for p in m.parameters(recurse=False)]
            if not any(id(p) in self._meta for p in direct) and not any(b.is_meta for b in m.buffers(recurse=False)):
                continue
            if self.config.param_init_fn is None and not callable(getattr(m, "reset_parameters", None)):
                raise RatelConfigError(
                    f"the model is on the meta device and module {name!r} ({type(m).__name__}) has no "
                    "reset_parameters(); pass RatelStrategy(param_init_fn=...) to initialize each module"
                )
            if len({unit_of[id(p)] for p in direct}) > 1:
                raise RatelConfigError(
                    f"module {name!r} is on the meta device and holds parameters owned by different blocks (tied "
                    "weights); it cannot be initialized one block at a time. Build it off the meta device."
                )

    def _materialize(self, modules: Sequence[nn.Module]) -> None:
        """Give the meta parameters and buffers of ``modules`` host memory and initialize them, module by module."""
        init = self.config.param_init_fn or _reset_parameters
        for m in modules:
            params = [p for p in m.parameters(recurse=False) if id(p) in self._meta]
            buffers = [n for n, b in m.named_buffers(recurse=False) if b.is_meta]
            if not params and not buffers:
                continue
            for p in params:
                # Swapped in place, so the optimizer's and the blocks' references stay the same objects.
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
                self._meta.discard(id(p))
            for n in buffers:
                m._buffers[n] = torch.empty_like(m._buffers[n], device="cpu")
            init(m)
            for n in buffers:
                m._buffers[n] = m._buffers[n].to(self.device.device)

    def _load_units(self) -> None:
        """Materialize meta parameters, fill the host cache and write masters (and stored compute copies).

        Block by block: a parameter that was on the meta device holds host memory only until its unit is written,
        so the whole model never has to fit in host memory. Moments start as zeros without a write.
        """
        store = self.store
        if store is not None:
            for shard in self.shards:
                for what in ("exp_avg", "exp_avg_sq"):
                    store.reserve(shard.key(what), shard.numel * 4)
            for shard in self.shards + self.frozen_shards:
                if not shard.master_in_host:
                    store.reserve(shard.key("master"), shard.numel * 4)
                if self.param_cache == "ssd" and shard.dtype != torch.float32:
                    store.reserve(shard.compute_key, shard.numel * shard.dtype.itemsize)
            store.preallocate()
        writer = _ShardWriter(store, self.shards + self.frozen_shards, self.param_cache == "ssd")
        try:
            for block in self.blocks:
                materialized = set(self._meta)
                self._materialize([block.module] if block.direct_only else list(block.module.modules()))
                unit = self.units.get(block.index)
                if unit is None:
                    continue
                if unit.host:
                    for slot in unit.slots:
                        unit.host[slot.dtype][slot.offset : slot.offset + slot.numel].copy_(slot.param.data.reshape(-1))
                for shard in self._unit_shards.get(unit.index, ()):
                    writer.write(shard)
                if store is not None:
                    for slot in unit.slots:
                        if id(slot.param) in materialized:
                            slot.param.data = _nan_placeholder(slot.param)
            # Buffers of modules outside every block (rotary tables, masks).
            self._materialize(list(self.module.modules()))
        finally:
            writer.finish()

    def _unmaterialize(self) -> None:
        """Put parameters that came on the meta device back there after a failed setup, so a retry initializes them
        again instead of training from whatever they hold."""
        for unit in self.units.values():
            for slot in unit.slots:
                p = slot.param
                if id(p) in self._was_meta and not p.is_meta:
                    torch.utils.swap_tensors(
                        p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))

    def _read_unit(self, unit: Unit, flats: dict[torch.dtype, torch.Tensor]) -> list[Any]:
        assert self.store is not None
        # A page-in: the forward or backward of this block will wait for it.
        return [self.store.read(s.compute_key, s.compute_view(flats[s.dtype]), urgent=True)
                for s in self._unit_shards[unit.index]]

    def _activation_store(self) -> TensorStore:
        """The swap store for ``ssd``-tier activations: device-direct through kvikio where it is installed, works
        and measures faster than staging through pinned host memory; the POSIX store otherwise."""
        name = f"{self.config.name}-act"
        paths = self.config.ssd_paths
        if self.device.is_cuda and gds.kvikio_available(paths[0]):
            bandwidth = gds.measure(paths, self.device.device)
            if bandwidth.prefer_kvikio():
                self.cache.device_direct = True
                return gds.GdsStore(paths, name=name, keep_files=False)
        return TensorStore(paths, name=name, keep_files=False)

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self) -> None:
        for block in self.blocks:
            b = block.index
            self._handles.append(block.module.register_forward_pre_hook(
                functools.partial(self._pre_forward, b), with_kwargs=True))
            self._handles.append(
                block.module.register_forward_hook(functools.partial(self._post_forward, b), always_call=True)
            )
            if not block.direct_only:
                for name, sub in block.module.named_modules():
                    if name:
                        self._handles.append(sub.register_forward_pre_hook(self._enter_submodule))
                        self._handles.append(sub.register_forward_hook(self._leave_submodule, always_call=True))
        for shard in self.shards:
            for sp in shard.params:
                if sp.param.requires_grad:
                    self._handles.append(sp.param.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad, shard, sp)))
        for shard in self.frozen_shards:
            for sp in shard.params:
                if sp.param.requires_grad:
                    # Not in the optimizer: its gradient has no consumer, so it must not pile up on the device.
                    self._handles.append(sp.param.register_post_accumulate_grad_hook(self._drop_grad))

    def _enter_submodule(self, module: nn.Module, args: Any) -> None:
        self._path_stack.append(self._paths.get(id(module), ""))

    def _leave_submodule(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._path_stack:
            self._path_stack.pop()

    def _op_path(self) -> str:
        return self._path_stack[-1] if self._path_stack else ""

    def set_placements(self, placements: list[Placement]) -> None:
        """Place activations differently from the next forward pass on (a new plan)."""
        self.placements[:] = placements

    def _position(self, block: int) -> int:
        try:
            return self._order.index(block)
        except ValueError:
            return len(self._order)

    def _sync(self) -> None:
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.device)

    def _pre_forward(self, b: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._check()
        self.pager.acquire(b)
        pos = self._position(b)
        for nxt in self._order[pos + 1 : pos + 1 + self.config.prefetch_depth]:
            self.pager.prefetch(nxt)
        if not torch.is_grad_enabled():
            return
        self._order_pass.append(b)
        contexts: list[Any] = [self.cache.hooks(b)]
        if self.cache.tracked(b):
            device_type = self.device.device.type
            record = ForwardRecord(
                b,
                name=self.blocks[b].name,
                forward=module.forward,
                rng_state=torch.get_rng_state(),
                cuda_rng_state=torch.cuda.get_rng_state(self.device.device) if self.device.is_cuda else None,
                autocast=(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)),
            )
            self.cache.begin_record(record, args, kwargs)
            self._path_stack.clear()
            contexts.append(OpTracker(record, self._op_path, profile=self.profiling, synchronize=self._sync))
        if self.profiling:
            self._sync()
            self.block_times.setdefault(b, {})["forward_start"] = time.perf_counter()
        for context in contexts:
            context.__enter__()
        self._hook_stack.append((b, contexts))

    def _post_forward(self, b: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._hook_stack and self._hook_stack[-1][0] == b:
            for context in reversed(self._hook_stack.pop()[1]):
                context.__exit__(None, None, None)
            if self.profiling:
                self._sync()
                times = self.block_times.setdefault(b, {})
                times["forward"] = times.get("forward", 0.0) + time.perf_counter() - times.pop("forward_start")
            self.cache.end_record(b)
        self.pager.release(b)

    def _enter_backward(self, b: int) -> None:
        """Backward reached block ``b``: keep it resident, release the blocks behind it, prefetch the ones ahead."""
        if self._bw_current == b:
            return
        if self.profiling:
            self._close_backward_interval()
        self._bw_current = b
        if b not in self._bw_held:
            self.pager.acquire(b)
            self._bw_held.append(b)
        pos = self._position(b)
        for held in [h for h in self._bw_held if self._position(h) > pos]:
            self._bw_held.remove(held)
            self.pager.release(held)
            self.cache.done_with(held)
        ahead = self._order[max(0, pos - self.config.prefetch_depth) : pos]
        for nxt in reversed(ahead):
            self.pager.prefetch(nxt)
            self.cache.prefetch_block(nxt)

    def _close_backward_interval(self) -> None:
        """Profiling: charge the time since backward last changed block to that block."""
        self._sync()
        now = time.perf_counter()
        if self._bw_current is not None and self._bw_entered is not None:
            times = self.block_times.setdefault(self._bw_current, {})
            times["backward"] = times.get("backward", 0.0) + now - self._bw_entered
        self._bw_entered = now

    def _on_grad(self, shard: Shard, sp: ShardParam, param: nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        host, event = self.device.to_host(grad)
        self._window.add(shard.index)
        assert self.adam is not None
        self.adam.gradient(shard, sp, host, event)

    @staticmethod
    def _drop_grad(param: nn.Parameter) -> None:
        param.grad = None

    # ------------------------------------------------------------------ the step

    def begin_micro_batch(self) -> None:
        """Called before each training_step: forget stale activations and tell the optimizer what this pass is."""
        self._check()
        self.cache.end_pass()
        if self.adam is not None:
            plan, self._pending_plan = self._pending_plan, None
            self.adam.begin(plan)

    def begin_step(self, optimizer: torch.optim.Optimizer, clip_val: float | None, clip_algorithm: str | None,
                   deferred: bool) -> None:
        """The boundary micro-batch is about to run: snapshot hyperparameters and decide how updates run.

        Args:
            optimizer: the user's optimizer, whose param_groups hold the current hyperparameters.
            clip_val: the Trainer's gradient clipping value (``None`` or 0 for none).
            clip_algorithm: ``"norm"`` or ``"value"``.
            deferred: updates must wait for the end of backward (global gradient norm, fp16 overflow check, or a
                user-defined ``configure_gradient_clipping``).
        """
        hyper = []
        decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            hyper.append(GroupHyper(
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", decoupled_default)),
            ))
        clip_value = float(clip_val) if clip_val and clip_algorithm == "value" and not deferred else None
        self._pending_plan = self._step_plan = StepPlan(hyper, overlap=not deferred, clip_value=clip_value)
        self._clip = None

    def request_clip(self, clip_val: float, algorithm: str) -> None:
        """Record a clipping request made (through Lightning) after the closure ran."""
        self._clip = (float(clip_val), algorithm)

    def pre_backward(self) -> None:
        self.timeline.record("backward_start")
        self._bw_entered = time.perf_counter()

    def post_backward(self) -> None:
        """Backward finished: release what backward held and learn the execution order from the first pass."""
        if self.profiling:
            self._close_backward_interval()
            for b in range(len(self.blocks)):
                self._profiled.setdefault(b, []).extend(self.cache.records(b))
                self._profiled_times.setdefault(b, []).append(self.block_times.pop(b, {}))
        self.timeline.record("backward_end")
        for held in self._bw_held:
            self.pager.release(held)
        self._bw_held.clear()
        self._bw_current = None
        self.pager.release_all()
        if self._order_pass:
            order = list(dict.fromkeys(self._order_pass))
            if len(order) == len(self.blocks) or len(order) > len(self._order):
                self._order = order + [b for b in self._order if b not in order]
            self._order_pass = []
        self.cache.end_pass()

    def finish_step(self, plan_overlap: bool, loss_scale: torch.Tensor | None = None) -> bool:
        """Run (or finish) the updates of the boundary micro-batch.

        Args:
            plan_overlap: whether updates already started during backward.
            loss_scale: the fp16 loss scale, to unscale gradients and check them for overflow.

        Returns:
            Whether the step was taken (``False`` when nothing had a gradient or an fp16 overflow skipped it).
        """
        assert self.adam is not None
        shards = [s for s in self.shards if s.index in self._window]
        self._window = set()
        plan = self._step_plan
        if not shards:
            return False
        if plan.overlap and self._clip is not None and self._clip[0] > 0 and self._clip[1] == "norm":
            raise RatelConfigError("gradient clipping by norm was requested after updates had started")
        if not plan.overlap:
            self.adam.barrier()
            if loss_scale is not None and not self._unscale(shards, loss_scale):
                self.adam.discard(shards)
                return False
            self._apply_clip(shards)
        self.adam.expect(shards)
        self.adam.schedule(plan, sorted(shards, key=lambda s: self._position(s.unit.index)))
        return True

    def _ordered_grads(self, shards: list[Shard]) -> list[torch.Tensor]:
        """Gradient views in the optimizer's parameter order, as torch's clipping utilities would see them."""
        views = [(sp.index, sp.grad_view(s.grad)) for s in shards for sp in s.params if sp.has_grad]
        return [v for _, v in sorted(views, key=lambda t: t[0])]

    def _unscale(self, shards: list[Shard], loss_scale: torch.Tensor) -> bool:
        found_inf = torch.zeros(1)
        inv_scale = loss_scale.double().reciprocal().float()
        # Only the gradients that arrived: the rest of a pooled buffer holds whatever its last user left there.
        torch._amp_foreach_non_finite_check_and_unscale_(self._ordered_grads(shards), found_inf, inv_scale)
        return found_inf.item() == 0

    def _apply_clip(self, shards: list[Shard]) -> None:
        if self._clip is None or self._clip[0] <= 0:
            return
        value, algorithm = self._clip
        grads = self._ordered_grads(shards)
        if algorithm == "norm":
            # The same reductions and the same clamped coefficient as torch.nn.utils.clip_grad_norm_.
            total_norm = torch.nn.utils.get_total_norm(grads, 2.0)
            coef = torch.clamp(value / (total_norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        else:
            for g in grads:
                g.clamp_(min=-value, max=value)

    # ------------------------------------------------------------------ planning

    def _wait_unit(self, unit: int) -> None:
        if self.adam is None:
            return
        start = time.perf_counter()
        self.adam.wait_unit(unit)
        self.stall_seconds += time.perf_counter() - start

    def measure_hardware(self) -> HardwareProfile:
        """Measure links, swap directories, CPU AdamW and free memory (see :mod:`lightning_ratel.runtime.probe`)."""
        threads = self.adam.threads if self.adam is not None else torch.get_num_threads()
        return measure_hardware(self.device, self.config.ssd_paths,
                                functools.partial(ops.adamw_step(), num_threads=threads))

    def begin_profile(self) -> None:
        """Run the next pass under the safe default (block inputs swapped to host, everything else recomputed),
        timing every op and counting its FLOPs and saved bytes."""
        self.profiling = True
        self.block_times.clear()
        self._profiled.clear()
        self._profiled_times.clear()
        self.set_placements([
            "host" if block.direct_only else {INPUT: "host", "*": "recompute"} for block in self.blocks
        ])

    def end_profile(self) -> list[LayerProfile]:
        """Stop profiling and return one :class:`LayerProfile` per block, in execution order.

        Each time is the least seen over the profiled passes: the first pass of a run also pays one-off costs
        (first touch of fresh memory, lazy initialisation) that later steps do not.
        """
        self.profiling = False
        layers = []
        for pos, b in enumerate(self._order):
            block = self.blocks[b]
            passes = self._profiled_times.get(b) or [{}]
            records = self._profiled.get(b, [])
            forward = min(t.get("forward", 0.0) for t in passes)
            replays = [r.replay_time for r in records] or [0.0]
            backward = min(t.get("backward", 0.0) for t in passes) - min(replays)
            backward = backward if backward > 0 else 2.0 * forward
            owned = [s for s in self.shards if s.unit.index == b]
            if records and not block.direct_only:
                record = records[0]
                same = [r for r in records if len(r.ops) == len(record.ops)]
                names = [op.name for op in record.ops]
                times = [min(r.ops[k].forward_time for r in same) for k in range(len(record.ops))]
                # The block's forward also pays Python and dispatch work between its ops, and so does a replay:
                # spread it over the ops in proportion, so recomputing all of them costs the block's forward.
                scale = forward / sum(times) if sum(times) > 0 and forward > sum(times) else 1.0
                ops = [OpProfile(INPUT, 0.0, 0.0, record.saved.get(-1, 0), [])]
                ops += [
                    OpProfile(op.name, times[k] * scale, op.flops, record.saved.get(k, 0),
                              [names[i] if i >= 0 else INPUT for i in op.inputs])
                    for k, op in enumerate(record.ops)
                ]
            else:
                ops = [OpProfile("*", 0.0, 0.0, self.cache.saved_by_block.get(b, 0), [])]
            layers.append(LayerProfile(
                name=block.name,
                index=pos,
                forward_time=forward,
                backward_time=backward,
                param_bytes=sum(self.units[u].nbytes for u in self.pager.block_units[b]),
                grad_bytes=sum(s.numel * torch.empty((), dtype=s.dtype).element_size() for s in owned),
                trainable_numel=sum(s.numel for s in owned),
                ops=ops,
                op_level=not block.direct_only,
            ))
        self._profiled.clear()
        self._profiled_times.clear()
        self.block_times.clear()
        return layers

    def make_plan(self, hardware: HardwareProfile, layers: list[LayerProfile]) -> Plan:
        """Search the placement with the least predicted iteration time under this run's memory budgets."""
        static = self.byte_placement()["host"]
        if self.config.host_memory_limit is not None:
            host_budget = self.config.host_memory_limit
        else:
            # What the kernel can still hand out, less a tenth for the page cache, the dataloader and the like.
            host_budget = static + int(hardware.host_memory_free * 0.9)
        device_budget = self.config.device_memory_limit or hardware.device_memory_free
        if hardware.unified_memory:
            device_budget = host_budget
        store_budget = int(hardware.ssd_free * 0.95)
        # Moments always go through the store; masters unless the host cache holds them, and 16-bit compute copies
        # when the pager reads them from there.
        trainable = sum(s.numel for s in self.shards) or 1
        masters = sum(s.numel * 4 for s in self.shards if not s.master_in_host)
        copies = sum(s.numel * s.dtype.itemsize for s in self.shards
                     if self.param_cache == "ssd" and s.dtype != torch.float32)
        plan = search(hardware, layers, device_budget=device_budget, host_budget=host_budget,
                      store_budget=store_budget, prefetch_depth=self.config.prefetch_depth, host_static_bytes=static,
                      state_read_bytes_per_param=round(8 + masters / trainable),
                      state_write_bytes_per_param=round(8 + (masters + copies) / trainable))
        plan.budgets["host_static"] = static
        return plan

    def apply_plan(self, plan: Plan) -> None:
        """Place activations as ``plan`` says from the next forward pass on."""
        self.plan = plan
        self.set_placements(plan_placements(self.blocks, plan.activation_placement))

    def take_breakdown(self, start: float, end: float) -> dict[str, float]:
        """Where the time of the interval ``[start, end]`` (a training step) went, measured.

        ``compute`` is the wall time the training thread did not spend stalled waiting for an update or a read;
        ``h2d``/``d2h`` the busy time of each link direction; ``ssd`` the time any swap-file transfer ran;
        ``cpu_optimizer`` the time any AdamW update ran; ``idle`` the training thread's stalls. Resources overlap,
        so the parts do not add up to the wall time.
        """
        copies = self.device.take_copy_seconds()
        busy: list[tuple[float, float]] = []
        for store in (self.store, self.cache._store):
            if store is not None:
                busy.extend(store.take_busy_intervals())
        updates: list[tuple[float, float]] = []
        opened: dict[str, float] = {}
        events, self._timeline_cursor = self.timeline.since(self._timeline_cursor)
        for name, t in events:
            kind, _, shard = name.partition(":")
            if kind == "update_start":
                opened[shard] = t
            elif kind == "update_end" and shard in opened:
                updates.append((opened.pop(shard), t))
        stall, self.stall_seconds = self.stall_seconds + self.cache.take_stall_seconds(), 0.0
        wall = end - start
        copy_time = copies["h2d"] + copies["d2h"] if not self.device.is_cuda else 0.0
        return {
            "wall": wall,
            "compute": max(wall - stall - copy_time, 0.0),
            "h2d": copies["h2d"],
            "d2h": copies["d2h"],
            "ssd": _union(busy, start, end),
            "cpu_optimizer": _union(updates, start, end),
            "idle": stall,
        }

    # ------------------------------------------------------------------ state

    def synchronize(self) -> None:
        """Wait for every pending update and write-back."""
        if self.adam is not None:
            self.adam.barrier(include_writes=True)

    def _read_flat(self, shard: Shard, what: str) -> torch.Tensor:
        """One of a shard's flat fp32 states (``master``, ``exp_avg``, ``exp_avg_sq``); a master kept in the host
        cache is returned as that view, so callers copy what they keep."""
        if what == "master" and shard.master_in_host:
            return shard.host_master()
        assert self.store is not None
        out = aligned_empty(shard.numel, torch.float32)[: shard.numel]
        self.store.read(shard.key(what), out).result()
        return out

    def _masters(self) -> dict[int, torch.Tensor]:
        """Full-precision values of every parameter, by parameter id, in their original dtype."""
        if self.adam is None:
            return dict(self._originals)
        self.synchronize()
        values: dict[int, torch.Tensor] = {}
        for shard in self.shards + self.frozen_shards:
            flat = self._read_flat(shard, "master")
            for sp in shard.params:
                values[id(sp.param)] = sp.grad_view(flat).to(self._orig_dtype[id(sp.param)]).clone()
        return values

    @property
    def param_nbytes(self) -> int:
        """Bytes of every parameter in its original dtype: what the module's full state takes in host memory."""
        return sum(s.numel * self._orig_dtype[id(s.param)].itemsize for u in self.units.values() for s in u.slots)

    def _ensure_fits(self, nbytes: int, what: str) -> None:
        available = available_host_memory()
        if self.adam is not None and available and nbytes > available:
            raise RatelPlanError(
                f"RatelStrategy: {what} needs {_gib(nbytes)} of host memory and only {_gib(available)} is available. "
                "A model whose states exceed host memory can be trained but not gathered: train without checkpoints "
                "(Trainer(enable_checkpointing=False)) or on a machine with more memory."
            )

    def state_dict(self) -> dict[str, Any]:
        """The module's state_dict with full-precision parameter values (as plain training would save).

        Raises:
            RatelPlanError: the parameters do not fit in the host memory available now.
        """
        self._ensure_fits(self.param_nbytes, "gathering the parameters")
        masters = self._masters()
        state = self.module.state_dict()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name in state:
                state[name] = masters[id(p)]
        return state

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state in ``torch.optim.AdamW``'s own format, so a plain run can load it.

        Raises:
            RatelPlanError: the Adam moments do not fit in the host memory available now.
        """
        assert self.optimizer is not None
        self._ensure_fits(sum(s.numel for s in self.shards if s.moments_on_store) * 8, "gathering the Adam moments")
        self.synchronize()
        result = self.optimizer.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for shard in self.shards:
            if not shard.moments_on_store:
                continue
            m = self._read_flat(shard, "exp_avg")
            v = self._read_flat(shard, "exp_avg_sq")
            for sp in shard.params:
                if sp.step:
                    state[sp.index] = {
                        "step": torch.tensor(float(sp.step), dtype=torch.float32),
                        "exp_avg": sp.grad_view(m).clone(),
                        "exp_avg_sq": sp.grad_view(v).clone(),
                    }
        result["state"] = state
        return result

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW``-format state (from this plugin or from plain training)."""
        assert self.optimizer is not None and self.store is not None
        self.synchronize()
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = {int(k): v for k, v in state_dict["state"].items()}
        for shard in self.shards:
            if not any(sp.index in saved for sp in shard.params):
                continue
            m = aligned_empty(shard.numel, torch.float32)[: shard.numel].zero_()
            v = aligned_empty(shard.numel, torch.float32)[: shard.numel].zero_()
            for sp in shard.params:
                entry = saved.get(sp.index)
                if entry is None:
                    continue
                sp.grad_view(m).copy_(entry["exp_avg"])
                sp.grad_view(v).copy_(entry["exp_avg_sq"])
                sp.step = int(float(entry["step"]))
            self.store.write(shard.key("exp_avg"), m).result()
            self.store.write(shard.key("exp_avg_sq"), v).result()
            shard.moments_on_store = True

    def byte_placement(self) -> dict[str, int]:
        """Bytes the engine holds right now on the device, in host memory and on disk."""
        host = sum(u.host_nbytes for u in self.units.values()) + self.cache.host_bytes_in_use
        pool = self.pager.pool
        # On CPU the pool's buffers in use are the resident compute copies, counted as the device's.
        host += pool.nbytes if self.device.is_cuda else pool.nbytes - pool.nbytes_in_use
        if self.adam is not None:
            host += self.adam.host_buffer_bytes
        host += sum(t.numel() * t.element_size() for t in self._originals.values())
        disk = (self.store.nbytes_reserved if self.store is not None else 0) + self.cache.disk_bytes
        device = self.pager.resident_bytes
        if self.device.is_cuda:
            device = torch.cuda.memory_allocated(self.device.device)
        return {"device": device, "host": host, "disk": disk}

    def _check(self) -> None:
        if self.adam is not None:
            self.adam.check()

    # ------------------------------------------------------------------ teardown

    def close(self, restore: bool = True) -> None:
        """Remove every hook, put ordinary tensors back into the module, and close the store.

        Args:
            restore: copy parameters (and the optimizer state, into the user's optimizer) back from the store.
                After an I/O error the store may be unreadable; the last checkpoint then holds the state.
        """
        try:
            while self._hook_stack:
                for context in reversed(self._hook_stack.pop()[1]):
                    context.__exit__(None, None, None)
            self.pager.release_all()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            for config in self._cache_configs:
                config.use_cache = True
            self._cache_configs.clear()
            if restore:
                self._restore()
        finally:
            if self.adam is not None:
                self.adam.close()
            # After the worker has stopped: it writes the host copies this reads.
            self._unplace_leftovers()
            self.cache.close()
            if self.store is not None:
                self.store.close()

    def _unplace_leftovers(self) -> None:
        """Give each parameter that still holds a paging placeholder (restore skipped or failed) an ordinary tensor:
        its last compute copy from the host cache. Its value may be mid-step, but the module can load a checkpoint.
        Without a host cache it gets a host-memory NaN placeholder, which costs no memory."""
        placeholders = {t.data_ptr() for t in self.pager._placeholders.values()}
        for unit in self.units.values():
            for slot in unit.slots:
                if slot.param.data_ptr() not in placeholders:
                    continue
                if unit.host:
                    copy = unit.host[slot.dtype][slot.offset : slot.offset + slot.numel].view(slot.shape)
                    slot.param.data = copy.to(self._orig_dtype[id(slot.param)]).clone()
                else:
                    slot.param.data = _nan_placeholder(slot.param, self._orig_dtype[id(slot.param)])

    def _restore(self) -> None:
        if self.adam is None:
            for unit in self.units.values():
                for slot in unit.slots:
                    slot.param.data = self._originals[id(slot.param)].view(slot.shape)
            return
        if not _fits_comfortably(self.param_nbytes):
            rank_zero_warn(
                f"RatelStrategy: the trained parameters ({_gib(self.param_nbytes)}) are not copied back into the "
                "module after training because they would not fit comfortably in host memory; its parameters are "
                "NaN placeholders now. Checkpoints saved during training hold the values."
            )
            for unit in self.units.values():
                for slot in unit.slots:
                    slot.param.data = _nan_placeholder(slot.param, self._orig_dtype[id(slot.param)])
            return
        # Training is over: the buffers for paging and updates are not needed for what comes next.
        self.adam.release_memory()
        self.pager.pool.clear()
        # Shard by shard, so host memory holds the parameters plus one shard, not two copies of the model.
        for shard in self.shards + self.frozen_shards:
            flat = self._read_flat(shard, "master")
            for sp in shard.params:
                sp.param.data = sp.grad_view(flat).to(self._orig_dtype[id(sp.param)]).clone()
        needed = sum(s.numel for s in self.shards) * 8
        if not _fits_comfortably(needed):
            rank_zero_warn(
                f"RatelStrategy: the optimizer state ({needed / 2**30:.1f} GiB) is not copied back into the optimizer "
                "after training because it would not fit comfortably in host memory; the last checkpoint holds it."
            )
            return
        state = self.optimizer_state_dict()["state"]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, entry in state.items():
            self.optimizer.state[params[index]] = entry


def _union(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[start, end]``."""
    total = 0.0
    reach = start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def _disable_kv_cache(module: nn.Module) -> list[Any]:
    """Turn off transformers' KV cache for training, as transformers does under gradient checkpointing.

    A training step never reads the cache, but filling it is a side effect a replayed forward would repeat.
    Returns the configs changed, to restore after the run.
    """
    changed = []
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is not None and getattr(config, "use_cache", False) is True and hasattr(m, "generation_config"):
            config.use_cache = False
            changed.append(config)
    return changed


def _fits_comfortably(nbytes: int) -> bool:
    """Whether ``nbytes`` take at most half of the available host memory (assumed when it is unknown)."""
    available = available_host_memory()
    return not available or nbytes <= available // 2


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _reset_parameters(module: nn.Module) -> None:
    """Lightning's convention for materializing a module from the meta device."""
    module.reset_parameters()  # type: ignore[operator]


def _nan_placeholder(param: nn.Parameter, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor of ``param``'s shape that costs no memory (one NaN, expanded) and reads as NaN if used."""
    return torch.full((), float("nan"), dtype=dtype or param.dtype).expand(param.shape)


def ensure_checkpoint_fits(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a run whose checkpoints cannot be gathered in host memory.

    A checkpoint holds every parameter in its dtype and two fp32 Adam moments per parameter the optimizer holds, all
    in host memory at once (Lightning's checkpoint format).

    Raises:
        RatelPlanError: that is more than the host memory available now.
    """
    params = sum(p.numel() * p.dtype.itemsize for p in module.parameters())
    needed = params + 8 * sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    available = available_host_memory()
    if available and needed > available:
        raise RatelPlanError(
            f"RatelStrategy: a checkpoint of this model gathers its parameters and Adam moments in host memory "
            f"({_gib(needed)}), more than the {_gib(available)} available. Train without checkpoints "
            "(Trainer(enable_checkpointing=False)) or on a machine with more memory."
        )


class _ShardWriter:
    """Writes shards' fp32 masters (but not those the host cache holds; and, when the pager reads them from the store,
    16-bit compute copies) from the parameters' current values, through two staging buffer sets so one fills while
    the other is written.

    Args:
        store: the swap store; ``None`` writes nothing.
        shards: every shard that will be written (sizes the staging buffers).
        compute_copies: also write each 16-bit shard's compute copy.
    """

    def __init__(self, store: TensorStore | None, shards: list[Shard], compute_copies: bool) -> None:
        self.store = store
        self.compute_copies = compute_copies
        largest = max((s.numel for s in shards), default=0) if store is not None else 0
        half = max((s.numel * s.dtype.itemsize for s in shards if s.dtype != torch.float32), default=0)
        half = -(-half // ALIGNMENT) * ALIGNMENT if compute_copies and store is not None else 0
        self._staging = [
            (aligned_empty(largest, torch.float32, huge=True),
             aligned_empty(half, torch.uint8, huge=True) if half else None)
            for _ in range(2 if store is not None else 0)
        ]
        self._pending: list[list[Any]] = [[], []]
        self._count = 0

    def write(self, shard: Shard) -> None:
        if self.store is None or shard.master_in_host:
            return
        k = self._count % 2
        self._count += 1
        for future in self._pending[k]:
            future.result()
        master_buf, half_buf = self._staging[k]
        buf = master_buf[: shard.numel]
        for sp in shard.params:
            buf[sp.offset : sp.offset + sp.numel].copy_(sp.param.data.reshape(-1))
        futures = [self.store.write(shard.key("master"), buf)]
        if self.compute_copies and shard.dtype != torch.float32:
            assert half_buf is not None
            copy = half_buf.view(shard.dtype)[: shard.numel]
            copy.copy_(buf)
            futures.append(self.store.write(shard.compute_key, copy))
        self._pending[k] = futures

    def finish(self) -> None:
        """Wait for every write (raising the first error)."""
        pending, self._pending = self._pending, [[], []]
        for futures in pending:
            for future in futures:
                future.result()
