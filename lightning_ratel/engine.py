"""The step coordinator: owns the blocks, the host cache, the swap store and the CPU optimizer of one model.

The Lightning adapters call into this class at a handful of points (setup, start of a micro-batch, the boundary
optimizer step, backward, checkpointing, teardown); everything that moves data lives in :mod:`lightning_ratel.runtime`.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ratel.blocks import Block, BlockSpec, discover_blocks
from lightning_ratel.errors import RatelConfigError
from lightning_ratel.runtime.activations import POLICIES, ActivationCache
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.optimizer import CpuAdam, GroupHyper, Shard, ShardParam, StepPlan
from lightning_ratel.runtime.pager import ParameterPager, ParamSlot, Unit
from lightning_ratel.runtime.storage import TensorStore, aligned_empty

ActivationPolicy = str | dict[str, str]
SUPPORTED_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam)


@dataclass
class EngineConfig:
    """What the strategy passes down; see :class:`~lightning_ratel.RatelStrategy` for the meaning of each field."""

    ssd_paths: list[str]
    prefetch_depth: int = 1
    keep_swap_files: bool = False
    activation_policy: ActivationPolicy = "host"
    blocks: BlockSpec = None
    name: str = "ratel"


def resolve_policies(blocks: Sequence[Block], policy: ActivationPolicy) -> list[str]:
    """The activation policy of each block: one name for all, or the first matching ``fnmatch`` pattern."""
    if isinstance(policy, str):
        policy = {"*": policy}
    for name in policy.values():
        if name not in POLICIES:
            raise RatelConfigError(f"activation_policy {name!r} is not one of {', '.join(POLICIES)}")
    resolved = []
    for block in blocks:
        match = next((p for pat, p in policy.items() if fnmatch.fnmatchcase(block.name, pat)), "keep")
        resolved.append(match)
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
        self.timeline: list[tuple[str, float]] = []
        self.blocks = discover_blocks(module, config.blocks)
        if not self.blocks:
            raise RatelConfigError("the model has no parameters to manage")
        self.policies = resolve_policies(self.blocks, config.activation_policy)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._orig_dtype = {id(p): p.dtype for _, p in module.named_parameters()}
        groups = self._optimizer_groups(optimizer)
        self.units, block_units = self._build_units(groups)
        self.shards: list[Shard] = []
        self.frozen_shards: list[Shard] = []
        self.store: TensorStore | None = None
        self.adam: CpuAdam | None = None
        self._originals: dict[int, torch.Tensor] = {}
        if optimizer is not None:
            self._build_shards(groups)
            self.store = TensorStore(config.ssd_paths, name=config.name, keep_files=config.keep_swap_files)
            try:
                self._write_masters()
                self.adam = CpuAdam(self.shards, self.store, clock=time.perf_counter)
                self.adam.timeline = self.timeline
            except BaseException:
                self.store.close()
                raise
        else:
            # Evaluation only: the original tensors are the masters, kept in host memory to restore at teardown.
            self._originals = {id(p): p.data for unit in self.units.values() for p in (s.param for s in unit.slots)}
        self.pager = ParameterPager(
            self.device,
            self.units,
            block_units,
            wait_ready=self.adam.wait_unit if self.adam else (lambda u: None),
            is_ready=self.adam.unit_ready if self.adam else (lambda u: True),
        )
        self.cache = ActivationCache(self.device, self.pager, self.policies, self._activation_store, self._enter_backward)
        self._order = [b.index for b in self.blocks]
        self._order_pass: list[int] = []
        self._hook_stack: list[tuple[int, Any]] = []
        self._bw_held: list[int] = []
        self._bw_current: int | None = None
        self._handles: list[Any] = []
        self._patched_forwards: list[tuple[nn.Module, Any]] = []
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
            for i in order:
                p = params[i]
                d = dtypes[id(p)]
                slots.append(ParamSlot(self._names[id(p)], p, d, offsets.get(d, 0), p.numel(), p.shape))
                offsets[d] = offsets.get(d, 0) + p.numel()
            host = {d: self.device.host_empty(n, d) for d, n in offsets.items()}
            for slot in slots:
                host[slot.dtype][slot.offset : slot.offset + slot.numel].copy_(slot.param.data.reshape(-1))
            units[b] = Unit(b, slots, host)
        block_units = [sorted({owner[id(p)] for p in block.uses}) for block in self.blocks]
        return units, block_units

    def _build_shards(self, groups: dict[int, tuple[int, int]]) -> None:
        for unit in self.units.values():
            runs: dict[tuple[torch.dtype, int], list[ParamSlot]] = {}
            for slot in unit.slots:
                g = groups[id(slot.param)][0] if id(slot.param) in groups else -1
                runs.setdefault((slot.dtype, g), []).append(slot)
            for (dtype, g), slots in runs.items():
                params = []
                offset = 0
                for slot in slots:
                    index = groups[id(slot.param)][1] if g >= 0 else -1
                    params.append(ShardParam(slot.name, slot.param, index, offset, slot.numel, slot.shape))
                    offset += slot.numel
                shard = Shard(len(self.shards) + len(self.frozen_shards), unit, g, dtype, slots[0].offset, params,
                              offset)
                if g >= 0:
                    shard.grad = torch.zeros(offset, dtype=torch.float32)
                    self.shards.append(shard)
                else:
                    self.frozen_shards.append(shard)

    def _write_masters(self) -> None:
        """Put every parameter's fp32 master into the store; moments start as zeros without a write."""
        assert self.store is not None
        for shard in self.shards:
            for what in ("master", "exp_avg", "exp_avg_sq"):
                self.store.reserve(shard.key(what), shard.numel * 4)
        for shard in self.frozen_shards:
            self.store.reserve(shard.key("master"), shard.numel * 4)
        self.store.preallocate()
        largest = max(s.numel for s in self.shards + self.frozen_shards)
        staging = [aligned_empty(largest, torch.float32) for _ in range(2)]
        pending: list[Any] = [None, None]
        for i, shard in enumerate(self.shards + self.frozen_shards):
            k = i % 2
            if pending[k] is not None:
                pending[k].result()
            buf = staging[k][: shard.numel]
            for sp in shard.params:
                buf[sp.offset : sp.offset + sp.numel].copy_(sp.param.data.reshape(-1))
            pending[k] = self.store.write(shard.key("master"), buf)
        for f in pending:
            if f is not None:
                f.result()

    def _activation_store(self) -> TensorStore:
        return TensorStore(self.config.ssd_paths, name=f"{self.config.name}-act", keep_files=False)

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self) -> None:
        for block in self.blocks:
            b = block.index
            self._handles.append(block.module.register_forward_pre_hook(functools.partial(self._pre_forward, b)))
            self._handles.append(
                block.module.register_forward_hook(functools.partial(self._post_forward, b), always_call=True)
            )
            if self.policies[b] == "recompute":
                original = block.module.forward
                block.module.forward = functools.partial(self._recompute_forward, b, original)
                self._patched_forwards.append((block.module, original))
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

    def _position(self, block: int) -> int:
        try:
            return self._order.index(block)
        except ValueError:
            return len(self._order)

    def _pre_forward(self, b: int, module: nn.Module, args: Any) -> None:
        self._check()
        self.pager.acquire(b)
        pos = self._position(b)
        for nxt in self._order[pos + 1 : pos + 1 + self.config.prefetch_depth]:
            self.pager.prefetch(nxt)
        if torch.is_grad_enabled():
            self._order_pass.append(b)
            hooks = self.cache.hooks(b)
            hooks.__enter__()
            self._hook_stack.append((b, hooks))

    def _post_forward(self, b: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._hook_stack and self._hook_stack[-1][0] == b:
            self._hook_stack.pop()[1].__exit__(None, None, None)
        self.pager.release(b)

    def _recompute_forward(self, b: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)

        def run(*a: Any, **k: Any) -> Any:
            if self.device.in_backward():
                # Recomputation in backward bypasses the module's hooks: page the block in here.
                self._enter_backward(b)
            return original(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    def _enter_backward(self, b: int) -> None:
        """Backward reached block ``b``: keep it resident, release the blocks behind it, prefetch the ones ahead."""
        if self._bw_current == b:
            return
        self._bw_current = b
        if b not in self._bw_held:
            self.pager.acquire(b)
            self._bw_held.append(b)
        pos = self._position(b)
        for held in [h for h in self._bw_held if self._position(h) > pos]:
            self._bw_held.remove(held)
            self.pager.release(held)
        ahead = self._order[max(0, pos - self.config.prefetch_depth) : pos]
        for nxt in reversed(ahead):
            self.pager.prefetch(nxt)
            self.cache.prefetch_block(nxt)

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
        self.timeline.append(("backward_start", time.perf_counter()))

    def post_backward(self) -> None:
        """Backward finished: release what backward held and learn the execution order from the first pass."""
        self.timeline.append(("backward_end", time.perf_counter()))
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
                for shard in shards:
                    for sp in shard.params:
                        sp.has_grad = False
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
        torch._amp_foreach_non_finite_check_and_unscale_([s.grad for s in shards], found_inf, inv_scale)
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

    # ------------------------------------------------------------------ state

    def synchronize(self) -> None:
        """Wait for every pending update and write-back."""
        if self.adam is not None:
            self.adam.barrier(include_writes=True)

    def _read_flat(self, shard: Shard, what: str) -> torch.Tensor:
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

    def state_dict(self) -> dict[str, Any]:
        """The module's state_dict with full-precision parameter values (as plain training would save)."""
        masters = self._masters()
        state = self.module.state_dict()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name in state:
                state[name] = masters[id(p)]
        return state

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state in ``torch.optim.AdamW``'s own format, so a plain run can load it."""
        assert self.optimizer is not None
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
        host = sum(u.nbytes for u in self.units.values()) + self.cache.host_bytes_in_use
        host += sum(s.grad.numel() * 4 for s in self.shards)
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
                self._hook_stack.pop()[1].__exit__(None, None, None)
            self.pager.release_all()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            for module, original in self._patched_forwards:
                module.forward = original
            self._patched_forwards.clear()
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
        its last compute copy from the host cache. Its value may be mid-step, but the module can load a checkpoint."""
        placeholders = {t.data_ptr() for t in self.pager._placeholders.values()}
        for unit in self.units.values():
            for slot in unit.slots:
                if slot.param.data_ptr() in placeholders:
                    copy = unit.host[slot.dtype][slot.offset : slot.offset + slot.numel].view(slot.shape)
                    slot.param.data = copy.to(self._orig_dtype[id(slot.param)]).clone()

    def _restore(self) -> None:
        masters = self._masters()
        for unit in self.units.values():
            for slot in unit.slots:
                slot.param.data = masters[id(slot.param)].view(slot.shape)
        if self.optimizer is None:
            return
        needed = sum(s.numel for s in self.shards) * 8
        if needed > _available_memory() // 2:
            rank_zero_warn(
                f"RatelStrategy: the optimizer state ({needed / 2**30:.1f} GiB) is not copied back into the optimizer "
                "after training because it would not fit comfortably in host memory; the last checkpoint holds it."
            )
            return
        state = self.optimizer_state_dict()["state"]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, entry in state.items():
            self.optimizer.state[params[index]] = entry


def _available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
