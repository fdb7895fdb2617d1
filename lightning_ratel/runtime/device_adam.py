"""The device tier of the optimizer states: shards whose master and moments live on the device and update there.

A shard placed on the ``"device"`` state tier keeps both state slots (the committed step's and the one an update
writes) in device memory (:class:`DeviceStates`, which the run's store routes its keys to, so checkpoints, exports and
conversions read them as any other state), its gradient accumulates on the device in fp32 (no copy to host memory),
and its update runs on the training thread (torch's foreach AdamW on a GPU; on the CPU the CPU optimizer's step, bit
for bit torch's) once the step's fate is known: after unscaling, the overflow check and clipping, never speculatively.
Its unit's compute copy is device memory that the pager binds without a copy
(:attr:`~lightning_ratel.runtime.units.Unit.resident`). On the CPU the device is the host: the same code runs there,
which is how it is tested.

A step commits whole on every tier: the update writes the other slot and the shard's committed version moves to it
only once the CPU optimizer (:class:`~lightning_ratel.runtime.optimizer.CpuAdam`, the states of the other tiers) has
committed the same step, so a failure of the CPU optimizer's updates after the device's leaves both at the last
committed step. :class:`TieredAdam` runs the two lanes as one optimizer: the decisions that read every gradient
(overflow, the clip norm over all of them in the optimizer's order) take both lanes' gradients together.

Threads: the gradient hooks run on autograd's thread, everything else on the training thread; the two never run at
the same time. The CPU optimizer's worker is reached only through its own methods.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_ratel.runtime.adamw import GroupHyper, device_adamw_
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.gradients import unseen_backward
from lightning_ratel.runtime.hoststore import HostStore, _done
from lightning_ratel.runtime.ledger import StepLedger
from lightning_ratel.runtime.optimizer import CpuAdam, Finished, Outcome, StepPlan, clip_coefficient, finish_step
from lightning_ratel.runtime.timeline import span
from lightning_ratel.runtime.units import Shard

STATES = ("master", "exp_avg", "exp_avg_sq")
"""The flat fp32 states of a shard on the device tier (AdamW/Adam)."""


class DeviceStates(HostStore):
    """Named extents in device memory, with the contract of the run's other stores: :meth:`write` and :meth:`read`
    return futures, a key never written reads as zeros. A :class:`~lightning_ratel.runtime.hoststore.HostStore`
    whose arenas the device allocates and whose copies run on the calling thread as tensor copies (device copies are
    queued on its current stream; a copy to or from host memory waits for its data, as ``Tensor.copy_`` does).

    Args:
        device: the device.
    """

    def __init__(self, device: Device) -> None:
        super().__init__(name="device states", threads=0)
        self.device = device

    def mark_written(self, key: str) -> None:
        """``key``'s memory was written in place (through :meth:`view`)."""
        self._written.add(key)

    @override
    def _allocate(self, nbytes: int) -> torch.Tensor:
        return self.device.device_empty(nbytes, torch.uint8)

    @override
    def _check(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != self._sizes[key]:
            raise ValueError(f"{self.name}: key {key!r} holds {self._sizes[key]} bytes; got {nbytes}")

    @override
    def _copy(self, key: str, dst: torch.Tensor, src: torch.Tensor, result: Any) -> concurrent.futures.Future:
        dst.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
        return _done(result)


class DeviceAdam:
    """Gradients, updates and the commit of the shards on the device tier (AdamW/Adam).

    With several ranks each rank's holds the shards that rank owns, and their gradients come reduced over the ranks
    instead of from hooks of its own: :meth:`receive` adds each reduced (part of a) gradient on the device, :meth:`mark`
    then says which parameters any rank had a gradient of (see
    :class:`~lightning_ratel.runtime.collectives.DataParallelAdam`).

    Args:
        device: the compute device.
        shards: the shards on the device tier, in forward order; their units are resident on the device.
        states: where their states live (the run's store routes their keys there).
        hooks: take the gradients from hooks on the parameters (one rank); ``False``: through :meth:`receive`.
    """

    def __init__(self, device: Device, shards: Sequence[Shard], states: DeviceStates, hooks: bool = True) -> None:
        self.device = device
        self.shards = list(shards)
        self.states = states
        self.ledger = StepLedger(self.shards)
        for shard in self.shards:
            for what in STATES:
                for slot in (0, 1):
                    states.reserve(shard.key(what, slot), shard.numel * 4)
        states.preallocate()
        # The window's fp32 gradient sums, one flat buffer per shard kept for the run (as plain training keeps
        # ``.grad``), and which parameters have one.
        self._grads: dict[int, torch.Tensor] = {}
        self._has: dict[int, list[bool]] = {s.index: [False] * len(s.params) for s in self.shards}
        self._window: set[int] = set()
        # Views made once, by (shard, state, slot) and (shard, "grad", parameter position): the store's extents and
        # the gradient buffers stay put for the run, so the hooks and the update (host work between a GPU's
        # kernels) do not look them up and slice them at every step.
        self._views: dict[tuple[int, str, int], torch.Tensor] = {}
        # The CPU optimizer's step whose device updates ran and wait for that step's commit there.
        self._awaiting: int | None = None
        # Parameters whose buffer holds a received gradient this window, by shard (copied into first, then added to).
        self._filled: dict[int, list[bool]] = {s.index: [False] * len(s.params) for s in self.shards}
        # Whether the engine's backward pass runs: gradients are its (as GradientOffload's).
        self.open = False
        self._handles: list[Any] = []
        for shard in self.shards if hooks else ():
            for position, sp in enumerate(shard.params):
                if sp.param.requires_grad:
                    self._handles.append(sp.param.register_post_accumulate_grad_hook(
                        functools.partial(self._accumulate, shard, position)))

    # ------------------------------------------------------------------ autograd thread

    def _accumulate(self, shard: Shard, position: int, param: nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        if not self.open:
            raise unseen_backward(shard.params[position].name)
        view = self._grad_view(shard, position)
        has = self._has[shard.index]
        if has[position]:
            view.add_(grad)
        else:
            view.copy_(grad)
            has[position] = True
        self._window.add(shard.index)

    def receive(self, shard: Shard, position: int, grad: torch.Tensor, start: int | None = None) -> None:
        """Add a reduced gradient of ``shard.params[position]`` (with ``start``, the flat part of it from that element
        on; a parameter's parts come in order) on the device; it counts only once :meth:`mark` says some rank had it.
        The thread that issues device work (autograd's or the training thread)."""
        view = self._grad_view(shard, position)
        filled = self._filled[shard.index]
        if start is not None:
            view = view.view(-1)[start : start + grad.numel()]
        if filled[position]:
            view.add_(grad.view(view.shape))
        else:
            view.copy_(grad.view(view.shape))
        if start is None or start + grad.numel() == shard.params[position].numel:
            filled[position] = True

    def mark(self, shard: Shard, position: int) -> None:
        """Some rank had a gradient of ``shard.params[position]`` this window (training thread)."""
        self._has[shard.index][position] = True
        self._window.add(shard.index)

    def _grad_view(self, shard: Shard, position: int) -> torch.Tensor:
        """Where parameter ``position`` of ``shard`` sums its gradient (made once: the buffer is kept for the run)."""
        view = self._views.get((shard.index, "grad", position))
        if view is None:
            buffer = self._grads.get(shard.index)
            if buffer is None:
                buffer = self._grads[shard.index] = self.device.device_empty(shard.numel, torch.float32)
            view = self._views[shard.index, "grad", position] = shard.params[position].view(buffer)
        return view

    # ------------------------------------------------------------------ training thread

    def take_window(self) -> list[Shard]:
        """The shards that received a gradient since the last step, in forward order."""
        window, self._window = self._window, set()
        return [s for s in self.shards if s.index in window]

    def indexed_views(self, shards: Sequence[Shard]) -> list[tuple[int, torch.Tensor]]:
        """The gradients of ``shards`` that arrived, each with its parameter's position in the optimizer's order."""
        views = []
        for shard in shards:
            views.extend((sp.index, self._grad_view(shard, position))
                         for position, (sp, has) in enumerate(zip(shard.params, self._has[shard.index])) if has)
        return sorted(views, key=lambda t: t[0])

    def unscale_(self, shards: Sequence[Shard], inv_scale: torch.Tensor) -> bool:
        """Multiply the gradients of ``shards`` by ``inv_scale`` (GradScaler's reciprocal) and check them for
        inf/NaN; returns whether every one is finite."""
        grads = [v for _, v in self.indexed_views(shards)]
        if not grads:
            return True
        found_inf = torch.zeros(1, device=self.device.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(self.device.device))
        return found_inf.item() == 0

    def discard(self, shards: Iterable[Shard]) -> None:
        """Drop the gradients ``shards`` hold."""
        for shard in shards:
            self._has[shard.index] = [False] * len(shard.params)
            self._filled[shard.index] = [False] * len(shard.params)

    def discard_window(self) -> None:
        """Drop the gradients received since the last step (``zero_grad``)."""
        self.discard(self.take_window())

    def settle(self, committed_through: int) -> None:
        """Commit the device updates of a step the CPU optimizer has committed (its steps up to
        ``committed_through``)."""
        if self._awaiting is not None and self._awaiting <= committed_through:
            self.ledger.decide()
            self.ledger.commit()
            self._awaiting = None

    @property
    def awaiting(self) -> int | None:
        """The CPU optimizer's step whose device updates wait for its commit there, if any."""
        return self._awaiting

    @span("ratel/device_update")
    def update(self, plan: StepPlan, shards: Sequence[Shard], step: int) -> None:
        """Update ``shards`` from their committed states into the other slot, their compute copies in place; the
        updates commit with the CPU optimizer's ``step`` (:meth:`settle`). The last step's must have committed.

        Shards whose parameters all have a gradient and one step count are stepped together, one call per parameter
        group and step count (on a GPU, torch's foreach AdamW over them); the others parameter by parameter. Each
        step reads the committed slot and writes the other (:func:`~lightning_ratel.runtime.adamw.device_adamw_`: on
        a GPU a foreach copy into that slot, then the step there; on the CPU the kernel's single pass, with no copy),
        and the steps write the compute copies (on a GPU one foreach copy after them, on the CPU in the kernel's own
        pass), so a GPU launches a few kernels per step, not per shard."""
        assert self._awaiting is None
        own = self.ledger.open_step()
        todo = [s for s in shards if any(self._has[s.index])]
        versions = {s.index: self.ledger.latest(s) for s in todo}
        for shard in todo:
            self.ledger.queue(shard)
        # Moments never written are zeros: the steps start from those in the slot they write.
        zeros = [self._state(shard, what, 1 - versions[shard.index].slot) for shard in todo
                 if not versions[shard.index].moments for what in STATES[1:]]
        if zeros:
            torch._foreach_zero_(zeros)
        try:
            together: dict[tuple[int, int], list[tuple[torch.Tensor, ...]]] = {}
            for shard in todo:
                version = versions[shard.index]
                targets = [self._state(shard, what, 1 - version.slot) for what in STATES]
                sources = [self._state(shard, what, version.slot) if what == "master" or version.moments else target
                           for what, target in zip(STATES, targets)]
                grad = self._grads[shard.index][: shard.numel]
                compute = shard.compute_view(shard.unit.host[shard.dtype])
                if plan.clip_value is not None:
                    grad.clamp_(min=-plan.clip_value, max=plan.clip_value)
                steps = version.steps
                with_grad = [i for i, has in enumerate(self._has[shard.index]) if has]
                if len(with_grad) == len(shard.params) and len(set(steps)) == 1:
                    together.setdefault((shard.group, steps[0]), []).append(
                        (*targets, grad, compute, *sources))
                    continue
                for i, sp in enumerate(shard.params):
                    sl = slice(sp.offset, sp.offset + sp.numel)
                    if i not in with_grad:
                        # Its states reach the slot the update writes unchanged.
                        for target, source in zip(targets, sources):
                            if source is not target:
                                target[sl].copy_(source[sl])
                        continue
                    master, exp_avg, exp_avg_sq = ([t[sl]] for t in targets)
                    device_adamw_(master, [grad[sl]], exp_avg, exp_avg_sq, [compute[sl]],
                                  self._hyper(plan, shard.group), step=steps[i] + 1,
                                  sources=tuple([source[sl]] for source in sources))
            # The steps write the new compute copies too, in the units resident on the device.
            for (group, count), items in together.items():
                masters, exp_avgs, exp_avg_sqs, grads, computes, *sources = (list(column) for column in zip(*items))
                device_adamw_(masters, grads, exp_avgs, exp_avg_sqs, computes, self._hyper(plan, group), step=count + 1,
                              sources=tuple(sources))
        except BaseException:
            # The steps write compute copies as they go: every one gets its committed master back.
            for shard in todo:
                self._restore_compute(shard)
            raise
        for shard in todo:
            version = versions[shard.index]
            steps = [n + 1 if has else n for n, has in zip(version.steps, self._has[shard.index])]
            written = self.ledger.ran(shard, own, steps)
            for what in STATES:
                self.states.mark_written(shard.key(what, written.slot))
            self._has[shard.index] = [False] * len(shard.params)
            self._filled[shard.index] = [False] * len(shard.params)
        self._awaiting = step

    @staticmethod
    def _hyper(plan: StepPlan, group: int) -> GroupHyper:
        hyper = plan.hyper[group]
        assert isinstance(hyper, GroupHyper)
        return hyper

    def _state(self, shard: Shard, what: str, slot: int) -> torch.Tensor:
        view = self._views.get((shard.index, what, slot))
        if view is None:
            view = self._views[shard.index, what, slot] = self.states.view(shard.key(what, slot),
                                                                          torch.float32)[: shard.numel]
        return view

    def abort(self) -> None:
        """Abandon a step the training thread has not finished: drop its gradients and undo the device updates it
        ran (their compute copies get the committed masters back). A finished step still commits."""
        self.discard(self.shards)
        self._window = set()
        if self._awaiting is None:
            self._revert()

    def revert_uncommitted(self) -> None:
        """The CPU optimizer failed before committing the step the device updates belong to: they never commit, and
        the compute copies get the committed masters back."""
        self._awaiting = None
        self._revert()

    def _revert(self) -> None:
        _, reverted = self.ledger.abort(self.shards)
        for shard in reverted:
            self._restore_compute(shard)

    def _restore_compute(self, shard: Shard) -> None:
        committed = self.ledger.committed(shard)
        shard.compute_view(shard.unit.host[shard.dtype]).copy_(self._state(shard, "master", committed.slot))

    def state_key(self, shard: Shard, what: str) -> str:
        """The key holding ``shard``'s committed ``what`` (settle first)."""
        return shard.key(what, self.ledger.committed(shard).slot)

    def param_steps(self, shard: Shard) -> list[int]:
        return list(self.ledger.committed(shard).steps)

    def moments_on_store(self, shard: Shard) -> bool:
        return self.ledger.committed(shard).moments

    def load_state(self, shard: Shard, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: Sequence[int]) -> None:
        """Replace ``shard``'s committed moments and step counts (from a checkpoint)."""
        slot = self.ledger.committed(shard).slot
        self.states.write(shard.key("exp_avg", slot), exp_avg)
        self.states.write(shard.key("exp_avg_sq", slot), exp_avg_sq)
        self.ledger.load(shard, steps)

    def assign(self, shard: Shard, master: torch.Tensor) -> None:
        """Give ``shard`` new values between steps: its committed master and its compute copy."""
        if self.ledger.latest(shard) != self.ledger.committed(shard):
            raise RuntimeError(f"shard {shard.index} was given new values while an update of it is not committed")
        self.states.write(self.state_key(shard, "master"), master)
        self._restore_compute(shard)

    def release_memory(self) -> None:
        """Free the gradient buffers (no more updates will run)."""
        self._grads.clear()
        self._views.clear()

    def remove(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class TieredAdam:
    """The CPU optimizer and the device tier run as one optimizer: what the engine and whole-model I/O call.

    Everything about the other tiers is the CPU optimizer's (attributes not defined here are looked up on it); the
    calls that concern every shard (the step's decisions, committed states, aborts) go to both lanes by shard.

    Args:
        cpu: the CPU optimizer, holding the shards on the host and ssd tiers.
        device: the device tier's shards.
    """

    def __init__(self, cpu: CpuAdam, device: DeviceAdam) -> None:
        self.cpu = cpu
        self.device = device
        self._on_device = {s.index for s in device.shards}
        # Boundary micro-batches begun: the CPU optimizer numbers its steps the same way.
        self._step = 0
        self._plan: StepPlan | None = None

    def __getattr__(self, name: str) -> Any:
        if name in ("cpu", "device", "_on_device"):
            raise AttributeError(name)
        return getattr(self.cpu, name)

    def _lanes(self, shards: Iterable[Shard]) -> tuple[list[Shard], list[Shard]]:
        cpu, device = [], []
        for shard in shards:
            (device if shard.index in self._on_device else cpu).append(shard)
        return cpu, device

    def _settle(self, wait: bool = False) -> None:
        """Commit the device updates whose step the CPU optimizer committed; ``wait`` for that commit first."""
        step = self.device.awaiting
        if step is None:
            return
        if wait:
            self.cpu.wait_committed(step)
        self.device.settle(self.cpu.committed_through())

    # ------------------------------------------------------------------ the step

    def begin(self, plan: StepPlan | None) -> None:
        """See :meth:`CpuAdam.begin`."""
        if plan is not None:
            self._step += 1
            self._plan = plan
        self.cpu.begin(plan)

    def finish(self, plan: StepPlan, unit_order: Sequence[int], loss_scale: torch.Tensor | None = None,
               clip: tuple[float, str] | None = None) -> Finished:
        """See :meth:`CpuAdam.finish`: the same decisions over both lanes' gradients."""
        return finish_step(self, self.take_window(), plan, unit_order, loss_scale, clip)

    def take_window(self) -> list[Shard]:
        return self.cpu.take_window() + self.device.take_window()

    def discard_window(self) -> None:
        self.cpu.discard_window()
        self.device.discard_window()

    def unscale_(self, shards: Sequence[Shard], loss_scale: torch.Tensor) -> bool:
        cpu, device = self._lanes(shards)
        finite = self.cpu.unscale_(cpu, loss_scale)
        inv_scale = loss_scale.double().reciprocal().float()
        return self.device.unscale_(device, inv_scale) and finite

    def clip_(self, shards: Sequence[Shard], value: float, algorithm: str) -> bool:
        cpu, device = self._lanes(shards)
        if algorithm != "norm":
            self.cpu.clip_(cpu, value, algorithm)
            for g in (v for _, v in self.device.indexed_views(device)):
                g.clamp_(min=-value, max=value)
            return False
        cpu_grads, cpu_positions = self.cpu.gradients(cpu)
        coef = self._coefficient(cpu_grads, cpu_positions, device, value)
        self._multiply(cpu_grads, device, coef)
        return coef.item() != 1.0

    def _coefficient(self, cpu_grads: list[torch.Tensor], cpu_positions: list[int], device: Sequence[Shard],
                     max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient over both lanes' gradients, in the optimizer's parameter order."""
        merged = sorted([*zip(cpu_positions, cpu_grads), *self.device.indexed_views(device)], key=lambda t: t[0])
        return clip_coefficient([g for _, g in merged], max_norm)

    def _multiply(self, cpu_grads: list[torch.Tensor], device: Sequence[Shard], coef: torch.Tensor) -> None:
        if cpu_grads:
            torch._foreach_mul_(cpu_grads, coef.to(cpu_grads[0].device))
        device_grads = [v for _, v in self.device.indexed_views(device)]
        if device_grads:
            torch._foreach_mul_(device_grads, coef.to(device_grads[0].device))

    def discard(self, shards: Sequence[Shard]) -> None:
        cpu, device = self._lanes(shards)
        self.cpu.discard(cpu)
        self.device.discard(device)

    def _merged(self, grads: list[torch.Tensor], positions: list[int], device: Sequence[Shard]
                ) -> tuple[list[torch.Tensor], list[int]]:
        """Both lanes' gradients in the optimizer's parameter order, with their positions in it."""
        merged = sorted([*zip(positions, grads), *self.device.indexed_views(device)], key=lambda t: t[0])
        return [g for _, g in merged], [i for i, _ in merged]

    def gradients(self, shards: Sequence[Shard]) -> tuple[list[torch.Tensor], list[int]]:
        """See :meth:`CpuAdam.gradients`: both lanes' (for a norm over several ranks' shards)."""
        cpu, device = self._lanes(shards)
        grads, positions = self.cpu.gradients(cpu)
        return self._merged(grads, positions, device)

    def kept_gradients(self, shards: Sequence[Shard]) -> tuple[bool, list[torch.Tensor], list[int]]:
        """See :meth:`CpuAdam.kept_gradients`: both lanes', the device's unscaled under fp16 loss scaling (they were
        not, since nothing of the device tier speculates)."""
        cpu, device = self._lanes(shards)
        finite, grads, positions = self.cpu.kept_gradients(cpu)
        plan = self._plan
        if plan is not None and plan.inv_scale is not None:
            finite = self.device.unscale_(device, plan.inv_scale) and finite
        return (finite, *self._merged(grads, positions, device))

    def undo_speculation(self, coef: torch.Tensor | None) -> None:
        """See :meth:`CpuAdam.undo_speculation`; the device tier's gradients are dropped or clipped alike."""
        self.cpu.undo_speculation(coef)
        if coef is None:
            self.device.discard(self.device.shards)
            return
        device_grads = [v for _, v in self.device.indexed_views(self.device.shards)]
        if device_grads:
            torch._foreach_mul_(device_grads, coef.to(device_grads[0].device))

    def resolve(self, shards: Sequence[Shard], max_norm: float | None) -> Outcome:
        """See :meth:`CpuAdam.resolve`: the CPU optimizer's speculative updates stand or are undone as the gradients
        of both lanes say (the device's run only now, after the decision)."""
        finite, grads, _ = self.kept_gradients(shards)
        if not finite:
            self.undo_speculation(None)
            return "skip"
        if max_norm is None:
            return "stand"
        coef = clip_coefficient(grads, max_norm)
        if coef.item() == 1.0:
            return "stand"
        self.undo_speculation(coef)
        return "redo"

    def schedule(self, plan: StepPlan, shards: Sequence[Shard]) -> None:
        """Run the device tier's updates now, then close the step on the CPU optimizer; both commit together."""
        cpu, device = self._lanes(shards)
        self._settle(wait=True)
        self.device.update(plan, device, self._step)
        self.cpu.schedule(plan, cpu)

    def abort(self) -> None:
        """See :meth:`CpuAdam.abort`; a finished step's device updates commit with it."""
        self.cpu.abort()
        self.device.abort()

    # ------------------------------------------------------------------ committed state

    def barrier(self, include_writes: bool = False) -> None:
        """See :meth:`CpuAdam.barrier`; the device updates of a step committed meanwhile commit too."""
        try:
            self.cpu.barrier(include_writes)
        except BaseException:
            self.device.revert_uncommitted()
            raise
        self._settle()

    def state_key(self, shard: Shard, what: str) -> str:
        if shard.index in self._on_device:
            return self.device.state_key(shard, what)
        return self.cpu.state_key(shard, what)

    def param_steps(self, shard: Shard) -> list[int]:
        if shard.index in self._on_device:
            self.barrier(include_writes=True)
            return self.device.param_steps(shard)
        return self.cpu.param_steps(shard)

    def moments_on_store(self, shard: Shard) -> bool:
        if shard.index in self._on_device:
            self.barrier(include_writes=True)
            return self.device.moments_on_store(shard)
        return self.cpu.moments_on_store(shard)

    def load_state(self, shard: Shard, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, steps: Sequence[int]) -> None:
        if shard.index in self._on_device:
            self.barrier(include_writes=True)
            self.device.load_state(shard, exp_avg, exp_avg_sq, steps)
        else:
            self.cpu.load_state(shard, exp_avg, exp_avg_sq, steps)

    def assign(self, shard: Shard, master: torch.Tensor) -> None:
        if shard.index in self._on_device:
            self.barrier(include_writes=True)
            self.device.assign(shard, master)
        else:
            self.cpu.assign(shard, master)

    def release_memory(self) -> None:
        self.cpu.release_memory()
        self._settle()
        self.device.release_memory()

    def close(self) -> None:
        self.device.remove()
        self.cpu.close()
