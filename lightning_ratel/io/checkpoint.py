"""Everything that reads or writes the whole model's state: checkpoints in and out, and the copy back at teardown.

During a run the parameters' values live in the swap store and the host caches, and the module holds paging
placeholders. Every whole-model pass reads the state of the last committed step shard by shard, once every pending
update has landed (:meth:`ModelState.stream`): a trainable shard's fp32 master and Adam moments, a frozen shard's
values (its compute copy, or its values in their own dtype where the compute dtype rounds them). An ordinary
Lightning checkpoint gathers them (loadable without the plugin) and fits only small models; the sharded format
(:mod:`lightning_ratel.io.sharded`) and the Hugging Face export (:mod:`lightning_ratel.io.export`) stream them to files.
At the end of a run the values are copied back into the module, and the optimizer state into the user's optimizer,
as far as they fit in host memory: the trainable parameters first (a LoRA adapter always fits), then the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_ratel.config import CheckpointFormat
from lightning_ratel.errors import RatelConfigError, RatelPlanError
from lightning_ratel.runtime.collectives import DataParallelAdam, gather_outcomes
from lightning_ratel.runtime.generic import OptimizerStateError
from lightning_ratel.runtime.hostmem import ALIGNMENT, aligned_empty
from lightning_ratel.runtime.optimizer import CpuAdam
from lightning_ratel.runtime.pager import ParameterPager, nan_placeholder
from lightning_ratel.runtime.probe import available_host_memory
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.units import Layout, Shard
from lightning_ratel.sizes import format_bytes, round_up


@dataclass
class Restored:
    """What the copy back at the end of a run put into the module.

    Attributes:
        trainable: the trainable parameters got their trained values.
        frozen: the frozen parameters got their values.
        optimizer: the user's optimizer got the Adam state.
        lost: names of parameters left as NaN placeholders whose values exist nowhere but in the swap files.
    """

    trainable: bool = False
    frozen: bool = False
    optimizer: bool = False
    lost: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.trainable and self.frozen


class ModelState:
    """Reads and writes the state of one run's model.

    Args:
        module: the model.
        layout: its units and shards.
        pager: the parameter pager (placeholders, buffers to free before gathering).
        store: the swap store; ``None`` for evaluation, where the module's original tensors are the values.
        adam: the CPU optimizer (of several ranks: every whole-model pass is then a collective, made by every rank at
            the same point); ``None`` for evaluation.
        optimizer: the user's optimizer; ``None`` for evaluation.
        originals: evaluation only: the module's own tensors by parameter id, the values to put back at teardown.
        host_memory_limit: the run's host memory budget, which the copy back at the end of fit stays within too;
            ``None``: only what is available then bounds it.
    """

    def __init__(self, module: nn.Module, layout: Layout, pager: ParameterPager, store: TensorStore | None = None,
                 adam: CpuAdam | DataParallelAdam | None = None, optimizer: torch.optim.Optimizer | None = None,
                 originals: dict[int, torch.Tensor] | None = None, host_memory_limit: int | None = None) -> None:
        self.module = module
        self.host_memory_limit = host_memory_limit
        self.layout = layout
        self.pager = pager
        self.store = store
        self.adam = adam
        self.optimizer = optimizer
        self._originals = originals or {}
        # What the copy back at the end of the run does, once restore_plan decided it.
        self._decided: Restored | None = None

    @property
    def originals_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._originals.values())

    # ------------------------------------------------------------------ reading state

    def dtype_of(self, shard: Shard, what: str) -> torch.dtype:
        """The dtype :meth:`read_flat` returns ``what`` of ``shard`` in."""
        if what == "state":
            return torch.uint8
        if shard.group >= 0:
            return torch.float32
        return self.layout.frozen_values.value_dtype(shard)

    def numel_of(self, shard: Shard, what: str) -> int:
        """The elements :meth:`read_flat` returns: the shard's, or the bytes of an optimizer's state record."""
        if what == "state":
            assert self.layout.generic is not None
            return self.layout.generic.nbytes(shard)
        return shard.numel

    def read_flat(self, shard: Shard, what: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """One of a shard's flat states as of the last committed step, in :meth:`dtype_of`.

        ``what`` is ``master``, ``exp_avg`` or ``exp_avg_sq`` for a trainable shard (fp32, from the store), or
        ``state`` (the record of an optimizer other than AdamW/Adam, bytes), ``master``
        for a frozen shard (its exact values: a view of the host cache when that holds them, so callers copy what they
        keep). Every update handed over so far must have landed (:meth:`CpuAdam.barrier`).

        Args:
            shard: the shard.
            what: which state.
            out: a 4096-byte aligned byte buffer to read into (a new one by default).
        """
        future, flat = self._start_read(shard, what, out)
        if future is not None:
            future.result()
        return flat

    def _start_read(self, shard: Shard, what: str, out: torch.Tensor | None) -> tuple[Future | None, torch.Tensor]:
        """Start reading ``what`` of ``shard``; returns the read (``None`` when nothing is read) and where it lands."""
        dtype = self.dtype_of(shard, what)
        numel = self.numel_of(shard, what)
        if out is None:
            out = aligned_empty(round_up(numel * dtype.itemsize, ALIGNMENT), torch.uint8)
        flat = out.view(dtype)[:numel]
        if shard.group < 0:
            frozen = self.layout.frozen_values
            if shard.index in frozen.exact_copies:
                key = frozen.key(shard)
            elif shard.unit.resident:
                return None, flat.copy_(shard.compute_view(shard.unit.host[shard.dtype]))
            elif shard.unit.host:
                return None, shard.compute_view(shard.unit.host[shard.dtype])
            else:
                # Another rank's files where the node's ranks share the copies.
                key = shard.unit.ready.compute_key(shard)
            assert self.store is not None
            return self.store.read(key, flat), flat
        assert self.store is not None and self.adam is not None
        if isinstance(self.adam, DataParallelAdam):
            # Several ranks: the owner reads its store, every rank receives the values.
            return None, self.adam.fetch(shard, flat, lambda adam: self._read_owned(adam, shard, what, flat))
        return self._read_owned(self.adam, shard, what, flat)

    def _read_owned(self, adam: CpuAdam, shard: Shard, what: str, flat: torch.Tensor
                    ) -> tuple[Future | None, torch.Tensor]:
        """Start reading ``what`` of a trainable shard whose states ``adam`` holds."""
        assert self.store is not None
        if what != "master" and (not adam.moments_on_store(shard) or not flat.numel()):
            return None, flat.zero_()
        return self.store.read(adam.state_key(shard, what), flat), flat

    def holds(self, shard: Shard) -> bool:
        """Whether this process keeps ``shard``'s states (with several ranks, only the owner of a trainable shard
        does; every rank holds the frozen shards' values)."""
        return shard.group < 0 or not isinstance(self.adam, DataParallelAdam) or self.adam.owns(shard)

    def local(self) -> ModelState:
        """The state this process holds, read without collectives: with several ranks, the trainable shards it owns
        (through its own optimizer) and the frozen shards; on one rank, this state itself."""
        if not isinstance(self.adam, DataParallelAdam):
            return self
        return ModelState(self.module, self.layout, self.pager, self.store, self.adam.local, self.optimizer)

    def agree(self, step: Callable[[], Any], failed: str) -> list[Any]:
        """Run ``step`` here and learn every rank's outcome (on one rank, just run it).

        Args:
            step: this rank's part of a whole-model pass (writing its files); its result must pickle.
            failed: what a failure elsewhere means, for the error the other ranks raise.

        Returns:
            Every rank's result, in rank order.

        Raises:
            BaseException: the error of ``step`` on the rank where it failed; elsewhere a ``RuntimeError`` saying which
                rank failed and how, so that every rank stops at the same point.
        """
        if not isinstance(self.adam, DataParallelAdam):
            return [step()]
        return gather_outcomes(self.adam.gather_objects, step, failed)

    def quiesce(self) -> None:
        """Wait until every update handed over has run and every write has landed."""
        if self.adam is not None:
            self.adam.barrier(include_writes=True)

    def stream(self, items: Sequence[tuple[Shard, str]]) -> Iterator[tuple[Shard, str, torch.Tensor]]:
        """Read ``items`` (shard, state) in order, the next one's read in flight while the caller uses the current one.

        Waits for the optimizer first. Each yielded tensor is valid until the next iteration; host memory holds two
        shards' worth of one state.
        """
        self.quiesce()
        if not items:
            return
        size = round_up(max(self.numel_of(s, w) * self.dtype_of(s, w).itemsize for s, w in items), ALIGNMENT)
        buffers = [aligned_empty(size, torch.uint8, huge=True) for _ in range(min(2, len(items)))]
        pending = self._start_read(*items[0], buffers[0])
        for i, (shard, what) in enumerate(items):
            upcoming = self._start_read(*items[i + 1], buffers[(i + 1) % 2]) if i + 1 < len(items) else None
            future, flat = pending
            if future is not None:
                future.result()
            yield shard, what, flat
            if upcoming is not None:
                pending = upcoming

    def param_steps(self, shard: Shard) -> list[int]:
        """Committed AdamW step counts of a shard's parameters (zeros for a frozen shard)."""
        if shard.group < 0 or self.adam is None:
            return [0] * len(shard.params)
        return self.adam.param_steps(shard)

    def has_moments(self, shard: Shard) -> bool:
        """Whether a trainable shard's committed moments were ever written (otherwise they are zeros)."""
        return shard.group >= 0 and self.adam is not None and self.adam.moments_on_store(shard)

    # ------------------------------------------------------------------ ordinary checkpoints

    def _masters(self) -> dict[int, torch.Tensor]:
        """Full-precision values of every parameter, by parameter id, in their original dtype."""
        if self.adam is None:
            return dict(self._originals)
        values: dict[int, torch.Tensor] = {}
        for shard, _, flat in self.stream([(s, "master") for s in self.layout.all_shards]):
            for sp in shard.params:
                values[id(sp.param)] = sp.view(flat).to(self.layout.orig_dtype[id(sp.param)]).clone()
        return values

    def unit_values(self, unit: int) -> dict[int, torch.Tensor]:
        """The committed values of one unit's parameters, by parameter id, each a tensor of its own in the parameter's
        own dtype (what the module holds outside training). Every update handed over must have landed
        (:meth:`quiesce`)."""
        slots = self.layout.units[unit].slots
        if self.adam is None:
            return {id(s.param): self._originals[id(s.param)].view(s.shape).clone() for s in slots}
        values: dict[int, torch.Tensor] = {}
        for shard in self.layout.unit_shards().get(unit, ()):
            if isinstance(self.adam, DataParallelAdam) and shard.group >= 0:
                # Read by one rank's code, not all ranks' at once: no collective. Another rank's master is not here;
                # the compute copy is its value (exact in fp32).
                if self.adam.owns(shard):
                    future, flat = self._read_owned(self.adam.local, shard, "master",
                                                    aligned_empty(shard.numel, torch.float32)[: shard.numel])
                    if future is not None:
                        future.result()
                else:
                    flat = self.adam.compute_copy(shard).float()
            else:
                flat = self.read_flat(shard, "master")
            for sp in shard.params:
                values[id(sp.param)] = sp.view(flat).to(self.layout.orig_dtype[id(sp.param)], copy=True)
        return values

    def assign_unit(self, unit: int, values: dict[int, torch.Tensor]) -> None:
        """Give one unit's parameters new values between steps, as a committed step would (a callback or
        ``load_state_dict`` wrote them): a trainable shard's fp32 master and compute copy (its moments stay), a frozen
        shard's compute copy and its values in their own dtype where the compute dtype rounds them.

        Args:
            unit: the unit.
            values: every parameter of the unit, by parameter id, in any dtype and device.
        """
        layout = self.layout
        if self.adam is None:
            # Evaluation: the module's own tensors are the values; the host cache is the compute copy.
            for slot in layout.units[unit].slots:
                original = self._originals[id(slot.param)]
                original.view(slot.shape).copy_(values[id(slot.param)])
                slot.view(layout.units[unit].host).copy_(original.view(slot.shape))
            return
        self.quiesce()
        for shard in layout.unit_shards().get(unit, ()):
            if shard.group >= 0:
                master = aligned_empty(shard.numel, torch.float32)[: shard.numel].zero_()
                for sp in shard.params:
                    sp.view(master).copy_(values[id(sp.param)])
                self.adam.assign(shard, master)
            else:
                self._assign_frozen(shard, values)

    def _assign_frozen(self, shard: Shard, values: dict[int, torch.Tensor]) -> None:
        assert self.store is not None
        layout = self.layout
        frozen = layout.frozen_values
        compute = aligned_empty(shard.numel, shard.dtype)[: shard.numel].zero_()
        for sp in shard.params:
            sp.view(compute).copy_(values[id(sp.param)])
            # Its value is no longer the pretrained folder's: a checkpoint must hold it.
            frozen.pretrained.pop(id(sp.param), None)
        rounded = any(not torch.equal(sp.view(compute).to(layout.orig_dtype[id(sp.param)]),
                                      values[id(sp.param)].to(device="cpu", dtype=layout.orig_dtype[id(sp.param)]))
                      for sp in shard.params)
        if rounded or shard.index in frozen.exact_copies:
            dtype = frozen.exact_copies.get(shard.index, shard.dtype)
            for sp in shard.params:
                dtype = torch.promote_types(dtype, layout.orig_dtype[id(sp.param)])
            exact = aligned_empty(shard.numel, dtype)[: shard.numel].zero_()
            for sp in shard.params:
                sp.view(exact).copy_(values[id(sp.param)])
            frozen.exact_copies[shard.index] = dtype
            self.store.write(frozen.key(shard), exact).result()
        if shard.unit.host:
            shard.compute_view(shard.unit.host[shard.dtype]).copy_(compute)
        elif isinstance(self.adam, DataParallelAdam):
            self.adam.share_frozen_copy(shard, lambda: self.store.write(shard.compute_key, compute).result())
        else:
            self.store.write(shard.compute_key, compute).result()

    def _ensure_fits(self, nbytes: int, what: str) -> None:
        available = available_host_memory()
        if self.adam is not None and available and nbytes > available:
            raise RatelPlanError(
                f"RatelStrategy: {what} needs {format_bytes(nbytes)} of host memory and only "
                f"{format_bytes(available)} is available. Save sharded checkpoints instead "
                "(RatelStrategy(checkpoint_format='sharded')), which never gather the model."
            )

    def state_dict(self) -> dict[str, Any]:
        """The module's state_dict with full-precision parameter values (as plain training would save).

        Raises:
            RatelPlanError: the parameters do not fit in the host memory available now.
        """
        self._ensure_fits(self.layout.param_nbytes, "gathering the parameters")
        masters = self._masters()
        state = self.module.state_dict()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name in state:
                state[name] = masters[id(p)]
        return state

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state in the user's optimizer's own format (``torch.optim.AdamW``'s...), so a plain run can
        load it.

        Raises:
            RatelPlanError: the optimizer state does not fit in the host memory available now.
        """
        assert self.optimizer is not None and self.adam is not None
        if self.layout.generic is not None:
            return self._generic_state_dict()
        stored = [s for s in self.layout.shards if self.has_moments(s)]
        self._ensure_fits(sum(s.numel for s in stored) * 8, "gathering the Adam moments")
        result = self.optimizer.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        moments: dict[int, dict[str, torch.Tensor]] = {}
        for shard, what, flat in self.stream([(s, w) for s in stored for w in ("exp_avg", "exp_avg_sq")]):
            for sp in shard.params:
                moments.setdefault(id(sp.param), {})[what] = sp.view(flat).clone()
        for shard in stored:
            for sp, step in zip(shard.params, self.adam.param_steps(shard)):
                if step:
                    state[sp.index] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                       **moments[id(sp.param)]}
        result["state"] = state
        return result

    def _generic_state_dict(self) -> dict[str, Any]:
        """:meth:`optimizer_state_dict` of an optimizer other than AdamW/Adam: each updated parameter's state as its
        step left it (tensors, and Python numbers as such)."""
        assert self.optimizer is not None and self.adam is not None and self.layout.generic is not None
        generic = self.layout.generic
        stored = [s for s in self.layout.shards if self.has_moments(s) and generic.nbytes(s)]
        self._ensure_fits(sum(generic.nbytes(s) for s in stored), "gathering the optimizer state")
        result = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for shard, _, blob in self.stream([(s, "state") for s in stored]):
            for i, (sp, step) in enumerate(zip(shard.params, self.adam.param_steps(shard))):
                if step:
                    state[sp.index] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                       for k, v in generic.load(shard, i, blob).items()}
        result["state"] = state
        return result

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state in the user's optimizer's format (from this plugin or from plain training)."""
        assert self.optimizer is not None and self.adam is not None
        self.quiesce()
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = {int(k): v for k, v in state_dict["state"].items()}
        if self.layout.generic is not None:
            self._load_generic_state(saved)
            return
        for shard in self.layout.shards:
            if not any(sp.index in saved for sp in shard.params):
                continue
            m = aligned_empty(shard.numel, torch.float32)[: shard.numel].zero_()
            v = aligned_empty(shard.numel, torch.float32)[: shard.numel].zero_()
            steps = self.adam.param_steps(shard)
            for i, sp in enumerate(shard.params):
                entry = saved.get(sp.index)
                if entry is None:
                    continue
                sp.view(m).copy_(entry["exp_avg"])
                sp.view(v).copy_(entry["exp_avg_sq"])
                steps[i] = int(float(entry["step"]))
            self.adam.load_state(shard, m, v, steps)

    def _load_generic_state(self, saved: dict[int, dict[str, Any]]) -> None:
        """:meth:`load_optimizer_state_dict` of an optimizer other than AdamW/Adam, shard by shard.

        Raises:
            RatelConfigError: a parameter's saved state has other entries, shapes or dtypes than this run's optimizer
                gives it.
        """
        assert self.adam is not None and self.layout.generic is not None
        generic = self.layout.generic
        for shard in self.layout.shards:
            if not any(sp.index in saved for sp in shard.params):
                continue
            # Parameters without saved state are never read before their first update.
            blob = aligned_empty(generic.nbytes(shard), torch.uint8).zero_()
            steps = self.adam.param_steps(shard)
            for i, sp in enumerate(shard.params):
                entry = saved.get(sp.index)
                if entry is None:
                    continue
                try:
                    generic.store(shard, i, dict(entry), blob)
                except OptimizerStateError as err:
                    raise RatelConfigError(f"the checkpoint's optimizer state does not fit this run's "
                                           f"{type(self.optimizer).__name__}: {err}") from err
                steps[i] = max(steps[i], 1)
            self.adam.load_record(shard, blob, steps)

    # ------------------------------------------------------------------ the end of a run

    def fits(self, nbytes: int, budgeted: bool = False) -> bool:
        """Whether ``nbytes`` can be put into host memory at the end of a run: at most half of what is available now
        (assumed when that is unknown) and, when ``budgeted`` and a ``host_memory_limit`` is set, no more than the
        limit leaves beside what the run still holds while it copies back (the states kept in host memory, the
        parameter caches)."""
        available = available_host_memory()
        if available and nbytes > available // 2:
            return False
        return (not budgeted or self.host_memory_limit is None
                or nbytes <= self.host_memory_limit - self._held_while_restoring())

    def _held_while_restoring(self) -> int:
        """Host bytes the run holds until it closes, after the optimizer's buffers and the paging pool are freed."""
        host_store = getattr(self.store, "host", None)
        held = host_store.nbytes_allocated if host_store is not None else 0
        return held + sum(unit.host_nbytes for unit in self.layout.units.values())

    def restore_plan(self) -> Restored:
        """What :meth:`restore` will put back (nothing is done yet): the trainable parameters when they fit
        (:meth:`fits`), the frozen ones too when both fit, the optimizer state when it fits besides them within the
        run's host memory budget as well (the parameters were the user's before the run; the moments are new bytes).

        Decided once, by the first call: :meth:`restore` then does what it said. With several ranks it is a collective
        (every rank calls it at the end of the run) and the decision is the same on every rank: what fits on each
        of them.
        """
        if self._decided is not None:
            return self._decided
        layout = self.layout
        if self.adam is None:
            return Restored(True, True, True)
        trainable = layout.nbytes_of(layout.shards)
        frozen = layout.nbytes_of(layout.frozen_shards)
        moments = sum(s.numel for s in layout.shards) * 8
        verdicts = [self.fits(trainable), self.fits(trainable + frozen),
                    self.fits(trainable + frozen + moments) and self.fits(moments, budgeted=True),
                    self.fits(trainable + moments) and self.fits(moments, budgeted=True)]
        if isinstance(self.adam, DataParallelAdam):
            # Each rank measures its own free memory, yet the copy back is a collective (each state comes from its
            # owner): ranks that decided differently would wait for each other forever.
            verdicts = self.adam.all_agree(verdicts)
        result = Restored()
        result.trainable = verdicts[0]
        result.frozen = result.trainable and verdicts[1]
        result.optimizer = result.trainable and verdicts[2 if result.frozen else 3]
        restored = {id(sp.param) for s in self._restored_shards(result) for sp in s.params}
        pretrained = layout.frozen_values.pretrained
        result.lost = [slot.name for slot in layout.slots
                       if id(slot.param) not in restored and id(slot.param) not in pretrained]
        self._decided = result
        return result

    def _restored_shards(self, plan: Restored) -> list[Shard]:
        return ((self.layout.shards if plan.trainable else [])
                + (self.layout.frozen_shards if plan.frozen else []))

    def restore(self) -> Restored:
        """Put ordinary tensors with the trained values back into the module, and the optimizer state into the user's
        optimizer, as :meth:`restore_plan` says; what is not restored keeps a host-memory NaN placeholder.

        Returns:
            What was restored.
        """
        layout = self.layout
        if self.adam is None:
            for slot in layout.slots:
                slot.param.data = self._originals[id(slot.param)].view(slot.shape)
            return Restored(True, True, True)
        plan = self.restore_plan()
        shards = self._restored_shards(plan)
        if shards:
            # Training is over: the buffers for paging and updates are not needed for what comes next.
            self.adam.release_memory()
            self.pager.pool.clear()
        # Shard by shard, so host memory holds the parameters plus two shards, not two copies of the model.
        for shard, _, flat in self.stream([(s, "master") for s in shards]):
            for sp in shard.params:
                sp.param.data = sp.view(flat).to(layout.orig_dtype[id(sp.param)]).clone()
        restored = {id(sp.param) for s in shards for sp in s.params}
        for slot in layout.slots:
            if id(slot.param) not in restored:
                slot.param.data = nan_placeholder(slot.param, layout.orig_dtype[id(slot.param)])
        if plan.optimizer:
            assert self.optimizer is not None
            state = self.optimizer_state_dict()["state"]
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for index, entry in state.items():
                self.optimizer.state[params[index]] = entry
        return plan

    def unplace_leftovers(self) -> None:
        """Give each parameter that still holds a paging placeholder (restore skipped or failed) an ordinary tensor:
        its last compute copy from the host cache. Its value may be mid-step, but the module can load a checkpoint.
        Without a host cache it gets a host-memory NaN placeholder, which costs no memory."""
        for unit in self.layout.units.values():
            for slot in unit.slots:
                if not self.pager.holds_placeholder(slot.param):
                    continue
                dtype = self.layout.orig_dtype[id(slot.param)]
                if unit.host:
                    slot.param.data = slot.view(unit.host).to("cpu", dtype, copy=True)
                else:
                    slot.param.data = nan_placeholder(slot.param, dtype)


def gathered_checkpoint_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Host bytes an ordinary checkpoint gathers: every parameter in its dtype and two fp32 Adam moments per parameter
    the optimizer updates."""
    params = sum(p.numel() * p.dtype.itemsize for p in module.parameters())
    return params + 8 * sum(p.numel() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)


def choose_checkpoint_format(requested: CheckpointFormat, module: nn.Module, optimizer: torch.optim.Optimizer,
                             host_memory_limit: int | None) -> Literal["full", "sharded"]:
    """The format checkpoints of this run are written in.

    ``"auto"`` writes Lightning's ordinary checkpoint (loadable without the plugin) while gathering it takes at most
    half of the host memory budget (``host_memory_limit``, else what is available now), and the sharded format
    otherwise.

    Raises:
        RatelPlanError: ``"full"`` was asked for and the checkpoint would not fit in the available host memory.
    """
    needed = gathered_checkpoint_bytes(module, optimizer)
    available = available_host_memory()
    if requested == "full":
        if available and needed > available:
            raise RatelPlanError(
                f"RatelStrategy: a checkpoint of this model gathers its parameters and Adam moments in host memory "
                f"({format_bytes(needed)}), more than the {format_bytes(available)} available. Use "
                "RatelStrategy(checkpoint_format='sharded') (or 'auto'), which writes the state shard by shard."
            )
        return "full"
    if requested == "sharded":
        return "sharded"
    budget = host_memory_limit if host_memory_limit is not None else available
    return "sharded" if budget and needed > budget // 2 else "full"
