"""Everything that reads or writes the whole model's state: checkpoints in and out, and the copy back at teardown.

During a run the parameters' values live in the swap store and the host caches, and the module holds paging
placeholders. A checkpoint gathers the full-precision values and the Adam moments into Lightning's ordinary format
(loadable without the plugin), shard by shard, once every pending update has landed; loading goes the other way.
At the end of a run the values are copied back into the module, and the optimizer state into the user's optimizer,
when they fit in host memory.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_ratel.errors import RatelPlanError
from lightning_ratel.layout import Layout
from lightning_ratel.materialize import nan_placeholder
from lightning_ratel.runtime.optimizer import CpuAdam
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.probe import available_host_memory
from lightning_ratel.runtime.storage import TensorStore, aligned_empty
from lightning_ratel.runtime.units import Shard
from lightning_ratel.sizes import format_bytes


class ModelState:
    """Reads and writes the state of one run's model.

    Args:
        module: the model.
        layout: its units and shards.
        pager: the parameter pager (placeholders, buffers to free before gathering).
        store: the swap store; ``None`` for evaluation, where the module's original tensors are the values.
        adam: the CPU optimizer; ``None`` for evaluation.
        optimizer: the user's optimizer; ``None`` for evaluation.
        originals: evaluation only: the module's own tensors by parameter id, the values to put back at teardown.
    """

    def __init__(self, module: nn.Module, layout: Layout, pager: ParameterPager, store: TensorStore | None = None,
                 adam: CpuAdam | None = None, optimizer: torch.optim.Optimizer | None = None,
                 originals: dict[int, torch.Tensor] | None = None) -> None:
        self.module = module
        self.layout = layout
        self.pager = pager
        self.store = store
        self.adam = adam
        self.optimizer = optimizer
        self._originals = originals or {}

    @property
    def originals_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._originals.values())

    def read_flat(self, shard: Shard, what: str) -> torch.Tensor:
        """One of a shard's flat fp32 states (``master``, ``exp_avg``, ``exp_avg_sq``) as of the last committed step.

        A trainable shard's state is read from the store, where the committed copy is (a master kept in the host
        cache may be ahead of it in a step an exception stopped). A frozen master kept in the host cache is returned
        as that view, so callers copy what they keep.
        """
        trainable = self.adam is not None and shard.group >= 0
        if what == "master" and shard.master_in_host and not trainable:
            return shard.host_master()
        assert self.store is not None
        out = aligned_empty(shard.numel, torch.float32)[: shard.numel]
        key = self.adam.state_key(shard, what) if trainable else shard.key(what)
        self.store.read(key, out).result()
        return out

    def _masters(self) -> dict[int, torch.Tensor]:
        """Full-precision values of every parameter, by parameter id, in their original dtype."""
        if self.adam is None:
            return dict(self._originals)
        self.adam.barrier(include_writes=True)
        values: dict[int, torch.Tensor] = {}
        for shard in self.layout.all_shards:
            flat = self.read_flat(shard, "master")
            for sp in shard.params:
                values[id(sp.param)] = sp.view(flat).to(self.layout.orig_dtype[id(sp.param)]).clone()
        return values

    def _ensure_fits(self, nbytes: int, what: str) -> None:
        available = available_host_memory()
        if self.adam is not None and available and nbytes > available:
            raise RatelPlanError(
                f"RatelStrategy: {what} needs {format_bytes(nbytes)} of host memory and only "
                f"{format_bytes(available)} is available. A model whose states exceed host memory can be trained but "
                "not gathered: train without checkpoints (Trainer(enable_checkpointing=False)) or on a machine with "
                "more memory."
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
        """The optimizer's state in ``torch.optim.AdamW``'s own format, so a plain run can load it.

        Raises:
            RatelPlanError: the Adam moments do not fit in the host memory available now.
        """
        assert self.optimizer is not None and self.adam is not None
        stored = [s for s in self.layout.shards if self.adam.moments_on_store(s)]
        self._ensure_fits(sum(s.numel for s in stored) * 8, "gathering the Adam moments")
        result = self.optimizer.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for shard in stored:
            m = self.read_flat(shard, "exp_avg")
            v = self.read_flat(shard, "exp_avg_sq")
            for sp, step in zip(shard.params, self.adam.param_steps(shard)):
                if step:
                    state[sp.index] = {
                        "step": torch.tensor(float(step), dtype=torch.float32),
                        "exp_avg": sp.view(m).clone(),
                        "exp_avg_sq": sp.view(v).clone(),
                    }
        result["state"] = state
        return result

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW``-format state (from this plugin or from plain training)."""
        assert self.optimizer is not None and self.adam is not None
        self.adam.barrier(include_writes=True)
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        saved = {int(k): v for k, v in state_dict["state"].items()}
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

    def restore(self) -> None:
        """Put ordinary tensors with the trained values back into the module (and the optimizer state into the
        user's optimizer) where they fit comfortably in host memory; NaN placeholders otherwise, with a warning."""
        layout = self.layout
        if self.adam is None:
            for slot in layout.slots:
                slot.param.data = self._originals[id(slot.param)].view(slot.shape)
            return
        if not _fits_comfortably(layout.param_nbytes):
            rank_zero_warn(
                f"RatelStrategy: the trained parameters ({format_bytes(layout.param_nbytes)}) are not copied back "
                "into the module after training because they would not fit comfortably in host memory; its "
                "parameters are NaN placeholders now. Checkpoints saved during training hold the values."
            )
            for slot in layout.slots:
                slot.param.data = nan_placeholder(slot.param, layout.orig_dtype[id(slot.param)])
            return
        # Training is over: the buffers for paging and updates are not needed for what comes next.
        self.adam.release_memory()
        self.pager.pool.clear()
        # Shard by shard, so host memory holds the parameters plus one shard, not two copies of the model.
        for shard in layout.all_shards:
            flat = self.read_flat(shard, "master")
            for sp in shard.params:
                sp.param.data = sp.view(flat).to(layout.orig_dtype[id(sp.param)]).clone()
        needed = sum(s.numel for s in layout.shards) * 8
        if not _fits_comfortably(needed):
            rank_zero_warn(
                f"RatelStrategy: the optimizer state ({format_bytes(needed)}) is not copied back into the optimizer "
                "after training because it would not fit comfortably in host memory; the last checkpoint holds it."
            )
            return
        assert self.optimizer is not None
        state = self.optimizer_state_dict()["state"]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, entry in state.items():
            self.optimizer.state[params[index]] = entry

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
                    slot.param.data = slot.view(unit.host).to(dtype).clone()
                else:
                    slot.param.data = nan_placeholder(slot.param, dtype)


def _fits_comfortably(nbytes: int) -> bool:
    """Whether ``nbytes`` take at most half of the available host memory (assumed when it is unknown)."""
    available = available_host_memory()
    return not available or nbytes <= available // 2


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
            f"({format_bytes(needed)}), more than the {format_bytes(available)} available. Train without checkpoints "
            "(Trainer(enable_checkpointing=False)) or on a machine with more memory."
        )
