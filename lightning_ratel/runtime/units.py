"""The layout the runtime works on: units of parameters, their optimizer shards, and each unit's ready signal.

A *unit* is the set of parameters owned by one block, laid out as one flat tensor per compute dtype, so a page-in is
one copy (or one set of store reads) per dtype. A *shard* is the part of a unit that shares one optimizer parameter
group and one compute dtype: one contiguous range of the unit's compute copies, and three flat fp32 tensors (master,
``exp_avg``, ``exp_avg_sq``) in the swap store.

A :class:`Layout` holds every unit and shard of one model. It is immutable once built
(:mod:`lightning_ratel.engine.layout` builds it) and lives here, below the engine and whole-model I/O, because both read
it. What changes while training lives with the part that owns it: the pager's residency, the optimizer worker's
per-shard state, and :class:`UnitReady`, the one signal through which the optimizer tells the pager that a unit's
compute copy is current.

Threads: ``Unit.host`` (the host cache) is written by the optimizer worker while it updates a shard of the unit and
read by the training thread while the unit is paged in; :class:`UnitReady` keeps the two apart (the pager pages a
unit in only once every update asked for has landed, and an update of a unit runs only once backward has left it).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_ratel.tiers import ParamCache, StateTier

if TYPE_CHECKING:
    from lightning_ratel.runtime.generic import GenericUpdate


@dataclass(frozen=True, eq=False)
class ParamSlot:
    """Where one parameter's compute copy lives inside its unit."""

    name: str
    param: nn.Parameter
    dtype: torch.dtype
    offset: int
    numel: int
    shape: torch.Size

    def view(self, flats: Mapping[torch.dtype, torch.Tensor]) -> torch.Tensor:
        """This parameter's compute copy inside flat tensors laid out like its unit."""
        return flats[self.dtype][self.offset : self.offset + self.numel].view(self.shape)


class UnitReady:
    """Whether a unit's compute copy is current where the pager reads it.

    The training thread calls :meth:`expect` once for each update of the unit that belongs to the step it finishes;
    the optimizer worker calls :meth:`complete` once for each update it has run (an overlapped update may complete
    before the training thread expects it, since it runs during backward), and :meth:`retract` for one it undid (a
    step abandoned before it was finished). The unit is ready when at least as many updates completed as were
    expected and the last writes of its new compute copy to the store, if any, landed.

    It also tells the pager where a shard's current compute copy is in the store, when that moves with the
    optimizer's state slots (an fp32 shard's compute copy is its master).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._expected = 0
        self._done = 0
        self._writes: list[Future] = []
        # The store writes of the new compute copies, also those this rank's pager copies from memory meanwhile.
        self._stored: list[Future] = []
        self._error: BaseException | None = None
        self._compute_keys: dict[int, str] = {}

    def expect(self) -> None:
        """One more update of the unit belongs to the step being finished (training thread)."""
        with self._cond:
            self._expected += 1

    def complete(self, write: Future | None = None, shard: Shard | None = None, compute_key: str | None = None,
                 stored: Future | None = None) -> None:
        """An update of the unit ran; ``write`` is the store write of its new compute copy that a page-in waits for,
        if it goes there, ``compute_key`` the key it went to, if not ``shard``'s own, and ``stored`` that write even
        where a page-in copies the copy from memory instead (other ranks read it from the drive:
        :meth:`wait_stored`)."""
        with self._cond:
            self._done += 1
            if write is not None:
                # A failed write stays: the next wait raises its error instead of paging in the bytes it left behind.
                self._writes = [w for w in self._writes if not _landed(w)]
                self._writes.append(write)
            if stored is not None:
                self._stored = [w for w in self._stored if not _landed(w)]
                self._stored.append(stored)
            if shard is not None and compute_key is not None:
                self._compute_keys[shard.index] = compute_key
            self._cond.notify_all()

    def retract(self, shard: Shard | None = None, compute_key: str | None = None) -> None:
        """An update that :meth:`complete` announced was undone; ``compute_key`` is where ``shard``'s compute copy
        is again."""
        with self._cond:
            self._done -= 1
            if shard is not None and compute_key is not None:
                self._compute_keys[shard.index] = compute_key

    def place(self, shard: Shard, compute_key: str) -> None:
        """``shard``'s compute copy is kept under ``compute_key`` from now on, not its own key (a rank that does not
        own an fp32 shard keeps a copy apart from the master, which another rank holds)."""
        with self._cond:
            self._compute_keys[shard.index] = compute_key

    def compute_key(self, shard: Shard) -> str:
        """The store key of ``shard``'s current compute copy."""
        with self._cond:
            return self._compute_keys.get(shard.index, shard.compute_key)

    def fail(self, error: BaseException) -> None:
        """No update will complete any more: waiters raise ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def is_set(self) -> bool:
        """Whether the unit can be paged in without waiting (not where a write failed: :meth:`wait` raises its
        error)."""
        with self._cond:
            return self._done >= self._expected and self._error is None and all(map(_landed, self._writes))

    def wait(self) -> None:
        """Block until the unit is ready; raise the error of a failed update or store write."""
        with self._cond:
            while self._done < self._expected and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            writes = list(self._writes)
        for write in writes:
            write.result()

    def wait_stored(self) -> None:
        """After :meth:`wait`: block until the new compute copies are in the store, not only in memory a page-in
        copies; raise a write's error."""
        with self._cond:
            stored = list(self._stored)
        for write in stored:
            write.result()


def _landed(write: Future) -> bool:
    """Whether a store write has completed without an error."""
    return write.done() and not write.cancelled() and write.exception() is None


@dataclass(frozen=True, eq=False)
class Unit:
    """The parameters owned by one block.

    Attributes:
        index: the owning block.
        slots: where each parameter lives in the flat tensors.
        numels: elements of the flat tensor of each compute dtype (slots plus alignment padding).
        host: the host cache, one flat tensor per dtype (pinned on CUDA; shared by the ranks of a node when they
            train data parallel, see :class:`~lightning_ratel.runtime.collectives.NodeCache`); empty when the compute
            copies are read from the swap store on every page-in.
        ready: set while no optimizer update of the unit is pending.
        resident: ``host`` is device memory (every trainable shard of the unit is on the device tier): the pager
            binds it without a copy.
    """

    index: int
    slots: tuple[ParamSlot, ...]
    numels: Mapping[torch.dtype, int]
    host: Mapping[torch.dtype, torch.Tensor] = field(default_factory=dict)
    ready: UnitReady = field(default_factory=UnitReady, repr=False)
    resident: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's compute copies (what a page-in brings to the device)."""
        return sum(n * d.itemsize for d, n in self.numels.items())

    @property
    def host_nbytes(self) -> int:
        """Bytes of the unit's host cache."""
        return sum(t.numel() * t.element_size() for t in self.host.values())


@dataclass(frozen=True, eq=False)
class ShardParam:
    """One parameter's place in a shard.

    Attributes:
        name: the parameter's qualified name.
        param: the parameter.
        index: its position in the optimizer's ``state_dict`` order (-1 outside the optimizer).
        offset: its first element in the shard's flat tensors.
        numel: its number of elements.
        shape: its shape.
    """

    name: str
    param: nn.Parameter
    index: int
    offset: int
    numel: int
    shape: torch.Size

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter inside a flat tensor laid out like its shard (gradient, master, moments)."""
        return flat[self.offset : self.offset + self.numel].view(self.shape)


@dataclass(frozen=True, eq=False)
class Shard:
    """Parameters of one unit, one parameter group and one compute dtype.

    Attributes:
        index: position among every shard of the model; names its keys in the store.
        unit: the unit it belongs to.
        group: the optimizer parameter group (-1: not in the optimizer, a frozen shard).
        dtype: the compute dtype.
        host_offset: its first element in the unit's flat tensor of ``dtype``.
        params: its parameters, contiguous from offset 0.
        numel: elements of its flat tensors.
        master_in_host: an fp32 shard whose compute copy stays in the unit's host cache: that copy is the master
            itself, updated there in place (the store keeps its committed copy).
        state_tier: where its master and moments live: ``"host"`` (host memory), ``"ssd"`` (the swap files) or
            ``"device"`` (device memory, updated there: :mod:`~lightning_ratel.runtime.device_adam`).
    """

    index: int
    unit: Unit
    group: int
    dtype: torch.dtype
    host_offset: int
    params: tuple[ShardParam, ...]
    numel: int
    master_in_host: bool = False
    state_tier: StateTier = "ssd"

    STATES = ("master", "exp_avg", "exp_avg_sq", "state")
    """What :meth:`key` names in the optimizer's state slots."""

    def state_keys(self) -> list[str]:
        """The store keys of every flat state this shard may have, in both slots."""
        return [self.key(what, slot) for what in self.STATES for slot in (0, 1)]

    def key(self, what: str, slot: int = 0) -> str:
        """The store key of one of its flat states: ``master``, ``exp_avg`` or ``exp_avg_sq`` (fp32) in one of the
        optimizer's two state slots, or ``compute`` (its 16-bit compute copy)."""
        return f"shard{self.index}.{what}" + (f".{slot}" if slot else "")

    @property
    def compute_key(self) -> str:
        """The store key of the compute copy when it is read from the store: an fp32 master is its own copy (the one
        in slot 0 until the optimizer says otherwise, see :meth:`UnitReady.compute_key`)."""
        return self.key("master") if self.dtype == torch.float32 else self.key("compute")

    def compute_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This shard's range of a flat tensor laid out like its unit's compute copies."""
        return flat[self.host_offset : self.host_offset + self.numel]

    def host_master(self) -> torch.Tensor:
        """The master of a ``master_in_host`` shard: its range of the unit's fp32 host cache."""
        return self.compute_view(self.unit.host[torch.float32])


class FrozenValues:
    """Where the exact values of frozen shards are, as materialization found them.

    A frozen shard's compute copy is its value unless rounding to the compute dtype changed one of its parameters; such
    a shard also keeps its values in their own dtype on the store, under :meth:`key`. Frozen parameters whose values
    came from the ``pretrained`` folder are remembered by the tensor name there, so a checkpoint can refer to the folder
    instead of copying weights that never change.
    """

    def __init__(self) -> None:
        self.exact_copies: dict[int, torch.dtype] = {}
        self.pretrained: dict[int, str] = {}

    @staticmethod
    def key(shard: Shard) -> str:
        """The store key of a frozen shard's values in their own dtype."""
        return shard.key("value")

    def value_dtype(self, shard: Shard) -> torch.dtype:
        """The dtype a frozen shard's exact values are read in: the kept copy's, or the compute copy's."""
        return self.exact_copies.get(shard.index, shard.dtype)

    def nbytes(self, shards: Sequence[Shard]) -> int:
        """Store bytes of the kept copies among ``shards``."""
        return sum(s.numel * self.exact_copies[s.index].itemsize for s in shards if s.index in self.exact_copies)


@dataclass(frozen=True)
class Layout:
    """Units and shards of one model.

    Attributes:
        units: unit by owning block index.
        block_units: for each block found at setup, the units its forward uses (its own and any it shares); what is
            learnt later lives with the engine's block membership.
        shards: the shards the optimizer updates, in block order.
        frozen_shards: shards of parameters outside the optimizer (values kept, never updated).
        param_cache: ``"host"`` (compute copies live in the units' host caches) or ``"ssd"`` (read from the swap
            store on every page-in).
        orig_dtype: each parameter's own dtype, by parameter id (what the module holds outside training).
        frozen_values: where the frozen shards' exact values are (filled in by materialization).
        generic: the update and state layout of an optimizer the fused AdamW kernel does not run; ``None`` for
            AdamW/Adam (moments ``exp_avg``/``exp_avg_sq``) and for evaluation.
        read_ahead_sets: buffer sets the CPU optimizer keeps beyond the pipeline's, to read more states ahead of
            their updates (planned with the states' tiers, in host memory the host tier could not use).
    """

    units: dict[int, Unit]
    block_units: tuple[tuple[int, ...], ...]
    shards: list[Shard]
    frozen_shards: list[Shard]
    param_cache: ParamCache
    orig_dtype: dict[int, torch.dtype]
    frozen_values: FrozenValues = field(default_factory=FrozenValues)
    generic: GenericUpdate | None = None
    read_ahead_sets: int = 0

    @property
    def all_shards(self) -> list[Shard]:
        """Trainable then frozen shards."""
        return self.shards + self.frozen_shards

    def unit_shards(self) -> dict[int, list[Shard]]:
        """Every shard by unit index."""
        by_unit: dict[int, list[Shard]] = {}
        for shard in self.all_shards:
            by_unit.setdefault(shard.unit.index, []).append(shard)
        return by_unit

    @property
    def slots(self) -> list[ParamSlot]:
        """Every parameter's slot, unit by unit."""
        return [slot for unit in self.units.values() for slot in unit.slots]

    @property
    def param_nbytes(self) -> int:
        """Bytes of every parameter in its own dtype: what the module's full state takes in host memory."""
        return sum(s.numel * self.orig_dtype[id(s.param)].itemsize for s in self.slots)

    def nbytes_of(self, shards: Sequence[Shard]) -> int:
        """Bytes of the parameters of ``shards`` in their own dtypes."""
        return sum(sp.numel * self.orig_dtype[id(sp.param)].itemsize for s in shards for sp in s.params)
