"""Checkpoints that never gather the model: a directory written and read one shard at a time.

A sharded checkpoint is a directory (named like the file Lightning asked for, as Lightning's FSDP strategy does for
``state_dict_type="sharded"``):

- ``unit-00000.safetensors``...: one file per block of the model, holding for each trainable parameter its fp32 master
  (``master/<name>``) and, when the checkpoint has the optimizer state, its Adam moments (``exp_avg/<name>``,
  ``exp_avg_sq/<name>``) or, for another optimizer, each entry of its state (``state/<entry>/<name>``, in its own
  shape and dtype; Python numbers as 0-dim int64/float64 tensors, listed with their type in the index); for each
  frozen parameter its value (``value/<name>``), unless it came unchanged from the ``pretrained`` folder, which the
  checkpoint then refers to instead of copying;
- ``meta.pt``: everything else Lightning puts into a checkpoint (loop state, callbacks, among them the
  :class:`~lightning_ratel.RatelProfiler` plan, LR schedulers, the precision plugin, the optimizer's parameter groups,
  persistent buffers), as ``torch.save`` writes it;
- ``ratel_checkpoint.json``: the index (every parameter's shape, dtype, step count, file; the pretrained folder
  referred to; the Hugging Face layout for :mod:`lightning_ratel.io.convert`; the xxh3-64 checksum of every tensor's
  bytes, of ``meta.pt`` and of the index's own content, verified whenever they are read). It is written last, into a
  temporary directory swapped into place in one step once everything is on the drive
  (:func:`~lightning_ratel.io.tensorfiles.replace_directory`): a checkpoint directory with an index is complete, and
  replacing one (``last.ckpt``) never leaves neither.

Writing reads the committed state of the last finished step from the store once the optimizer is idle
(:meth:`~lightning_ratel.io.checkpoint.ModelState.stream`: two shards' worth of one state in host memory). Reading goes
the other way: masters as the model is materialized (:class:`ShardedSource`), moments and step counts into the CPU
optimizer's store shard by shard (:func:`load_moments`).

With several ranks the format is the same, so a checkpoint resumes at any world size. Each rank writes the unit files
of the units whose states it owns (:func:`unit_writers`), in parallel, into one staging directory (on a filesystem
every rank reaches); rank 0 writes ``meta.pt`` and the index once every rank has its files on the drive, and a failure
on any rank stops every rank with the previous checkpoint in place. Resuming, each rank reads the masters and moments
of the units it owns (and every frozen value); the other ranks' compute copies come from their owners.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.io.checkpoint import ModelState
from lightning_ratel.io.export import HFLayout, ParamRecord, hf_layout
from lightning_ratel.io.pretrained import PretrainedFolder
from lightning_ratel.io.sources import SourceValue, ValueSource
from lightning_ratel.io.tensorfiles import (
    TensorFileReader,
    TensorFileWriter,
    dtype_name,
    fsync_directory,
    remove_stale_staging,
    replace_directory,
    staging_path,
)
from lightning_ratel.progress import progress_bar
from lightning_ratel.runtime.collectives import DataParallelAdam
from lightning_ratel.runtime.generic import ParamStates, StateEntry
from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.units import Layout, ParamSlot, Shard
from lightning_ratel.sizes import round_up

INDEX = "ratel_checkpoint.json"
META = "meta.pt"
FORMAT = "lightning_ratel sharded checkpoint"
VERSION = 2
"""Version 2 added the checksums; version 1 checkpoints are read without them."""
READS = (1, 2)


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded checkpoint directory written by this package."""
    return Path(path).is_dir() and (Path(path) / INDEX).is_file()


def not_a_checkpoint(path: Path) -> str:
    """Why a path given as a sharded checkpoint is not one, and what to do."""
    if not path.is_dir():
        return (f"{path} is not a sharded checkpoint of lightning_ratel (a directory with {INDEX}): "
                f"{'an ordinary checkpoint file, which needs no conversion' if path.is_file() else 'it does not exist'}")
    if path.name.startswith(".") and path.name.endswith((".tmp", ".old")):
        return (f"{path} is the staging directory of a checkpoint save that did not finish (or the replaced one); "
                "it is not a checkpoint. Resume from a complete checkpoint beside it; the next save removes it.")
    return (f"{path} is a directory without {INDEX}, so not a sharded checkpoint of lightning_ratel (an interrupted "
            "save never leaves one under the checkpoint's name). Resume from a complete checkpoint.")


def tensor_name(what: str, name: str) -> str:
    """The name of a parameter's state in a checkpoint file (``master``, ``exp_avg``, ``exp_avg_sq``, ``value`` or
    ``state/<entry>``)."""
    return f"{what}/{name}"


def save_sharded(path: str | os.PathLike[str], checkpoint: dict[str, Any], state: ModelState, module: nn.Module,
                 pretrained: PretrainedFolder | None = None, progress: bool = False) -> Path:
    """Write a sharded checkpoint of the committed state (see the module docstring).

    With several ranks (``state.adam`` a :class:`~lightning_ratel.runtime.collectives.DataParallelAdam`) this is a
    collective, called by every rank with its own ``checkpoint`` (rank 0's goes to ``meta.pt``): each rank writes the
    files of the units whose states it owns (:func:`unit_writers`) into one staging directory, in parallel, and rank 0
    writes the index once every rank's files are on the drive. When any rank fails, every rank raises and the previous
    checkpoint at ``path`` stays as it was.

    Args:
        path: the checkpoint directory (an existing checkpoint there is replaced once the new one is complete); with
            several ranks, on a filesystem every rank reaches.
        checkpoint: what Lightning dumped, minus parameter values and optimizer state (``state_dict`` holds the
            persistent buffers, ``optimizer_states`` the parameter groups); saved as ``meta.pt``.
        state: the engine's model state.
        module: the LightningModule (names, aliases, the transformers model).
        pretrained: the folder the run's frozen weights came from, referred to instead of copied.
        progress: show a progress bar.

    Returns:
        The checkpoint directory.
    """
    target = Path(path)
    if isinstance(state.adam, DataParallelAdam):
        return _save_parallel(target, checkpoint, state, state.adam, module, pretrained, progress)
    staging = _make_staging(target)
    try:
        parts = _write_files(staging, checkpoint, state, module, pretrained, progress)
        _write_index(staging, target, checkpoint, parts, state.layout, module, pretrained)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _make_staging(target: Path) -> Path:
    """A fresh staging directory beside ``target``, after removing what interrupted saves left there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    staging = staging_path(target)
    staging.mkdir()
    return staging


def unit_writers(layout: Layout, adam: DataParallelAdam) -> dict[int, int]:
    """Which rank writes each unit's file of a sharded checkpoint: the owner of the unit's trainable shards (it holds
    their states); a unit of frozen shards only (every rank holds their values) goes to the rank with the fewest bytes
    to write so far, largest unit first. Every rank computes the same from the same layout."""
    load = [0] * adam.ranks.world
    writers: dict[int, int] = {}
    frozen: list[tuple[int, int]] = []
    for unit, shards in layout.unit_shards().items():
        trainable = [s for s in shards if s.group >= 0]
        # The master and two moments of a trainable shard, the value of a frozen one.
        nbytes = sum(s.numel * (12 if s.group >= 0 else s.dtype.itemsize) for s in shards)
        if trainable:
            writers[unit] = adam.owner(trainable[0])
            load[writers[unit]] += nbytes
        else:
            frozen.append((unit, nbytes))
    for unit, nbytes in sorted(frozen, key=lambda item: (-item[1], item[0])):
        writers[unit] = min(range(len(load)), key=lambda r: (load[r], r))
        load[writers[unit]] += nbytes
    return writers


def _save_parallel(target: Path, checkpoint: dict[str, Any], state: ModelState, adam: DataParallelAdam,
                   module: nn.Module, pretrained: PretrainedFolder | None, progress: bool) -> Path:
    """:func:`save_sharded` on several ranks: three agreed stages (the staging directory, every rank's unit files, the
    index), each ending with every rank learning whether all of them succeeded."""
    rank = adam.ranks.rank
    failed = f"the sharded checkpoint {target} was not written (the one there before, if any, is unchanged)"
    state.quiesce()
    made = state.agree(lambda: str(_make_staging(target)) if rank == 0 else None, failed)
    staging = Path(made[0])
    try:
        mine = {unit for unit, writer in unit_writers(state.layout, adam).items() if writer == rank}

        def write_mine() -> list[_UnitPart]:
            if not staging.is_dir():
                raise RatelConfigError(
                    f"rank {rank} does not see the staging directory {staging} rank 0 made for the checkpoint: "
                    "checkpoints of several ranks must go to a directory every rank reaches (a shared filesystem)")
            parts = _write_files(staging, checkpoint, state.local(), module, pretrained, progress and rank == 0,
                                 units=mine)
            # The files of this rank are on the drive before rank 0 can write the index that names them.
            fsync_directory(staging)
            return parts

        written = state.agree(write_mine, failed)
        parts = sorted((part for rank_parts in written for part in rank_parts), key=lambda part: part.unit)
        state.agree(lambda: _write_index(staging, target, checkpoint, parts, state.layout, module, pretrained)
                    if rank == 0 else None, failed)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


@dataclass
class _UnitPart:
    """What writing one unit's file leaves for the index: its parameters' records and, when the unit has tensors to
    store, the file's name and the checksum of every tensor in it."""

    unit: int
    records: list[dict[str, Any]]
    file: str | None = None
    checksums: dict[str, int] = field(default_factory=dict)


def _write_index(staging: Path, target: Path, checkpoint: dict[str, Any], parts: Sequence[_UnitPart],
                 layout: Layout, module: nn.Module, pretrained: PretrainedFolder | None) -> None:
    """Write ``meta.pt`` and the index of the unit files ``parts`` (every unit's, in unit order), then swap the staging
    directory into place."""
    referred = layout.frozen_values.pretrained if pretrained is not None else {}
    index = {
        "format": FORMAT,
        "version": VERSION,
        "global_step": checkpoint.get("global_step"),
        "files": [part.file for part in parts if part.file is not None],
        "checksums": {part.file: part.checksums for part in parts if part.file is not None},
        "params": [record for part in parts for record in part.records],
        "pretrained": pretrained.fingerprint() if pretrained is not None and referred else None,
        "hf": hf_layout(module).to_json(),
    }
    meta = io.BytesIO()
    torch.save(checkpoint, meta)
    index["meta_checksum"] = _write_bytes(staging / META, meta.getbuffer())
    index["checksum"] = _index_checksum(index)
    _write_bytes(staging / INDEX, json.dumps(index, indent=1).encode())
    replace_directory(staging, target)


def _write_files(directory: Path, checkpoint: dict[str, Any], state: ModelState, module: nn.Module,
                 pretrained: PretrainedFolder | None, progress: bool, units: set[int] | None = None
                 ) -> list[_UnitPart]:
    """Write the file of each unit of ``units`` (``None``: all) whose state takes bytes; returns the part of the index
    of each of those units, in unit order."""
    layout = state.layout
    generic = layout.generic
    state.quiesce()
    with_moments = "optimizer_states" in checkpoint and state.adam is not None
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    referred = layout.frozen_values.pretrained if pretrained is not None else {}
    parts: list[_UnitPart] = []
    # (part, [(shard, state, tensor names)], entries) per unit with a file, in block order.
    plan: list[tuple[_UnitPart, list[tuple[Shard, str, list[str]]], list[tuple[str, torch.dtype, Sequence[int]]]]] = []
    unit_shards = layout.unit_shards()
    for unit_index in sorted(unit_shards):
        if units is not None and unit_index not in units:
            continue
        file = f"unit-{unit_index:05d}.safetensors"
        part = _UnitPart(unit_index, [])
        parts.append(part)
        jobs: list[tuple[Shard, str, list[str]]] = []
        entries: list[tuple[str, torch.dtype, Sequence[int]]] = []
        for shard in unit_shards[unit_index]:
            trainable = shard.group >= 0
            steps = state.param_steps(shard)
            whats = ["master"]
            if trainable and with_moments and state.has_moments(shard):
                whats += ["exp_avg", "exp_avg_sq"] if generic is None else ["state"] if generic.nbytes(shard) else []
            dtype = state.dtype_of(shard, "master")
            described: dict[int, list[list[Any]]] = {}
            for what in whats:
                if what == "state":
                    assert generic is not None
                    names = []
                    for i, sp in enumerate(shard.params):
                        if not steps[i]:
                            continue
                        stored = _stored_entries(generic.param_states(shard, sp.shape))
                        described[i] = [_describe(e) for e in generic.param_states(shard, sp.shape).entries]
                        names += [tensor_name(f"state/{e.name}", sp.name) for e in stored]
                        entries += [(tensor_name(f"state/{e.name}", sp.name), e.dtype, e.shape) for e in stored]
                    if names:
                        jobs.append((shard, what, names))
                    continue
                names = [tensor_name(what if trainable else "value", sp.name) for sp in shard.params
                         if trainable or id(sp.param) not in referred]
                if names:
                    jobs.append((shard, what, names))
                    entries += [(tensor_name(what if trainable else "value", sp.name), dtype, sp.shape)
                                for sp in shard.params if trainable or id(sp.param) not in referred]
            for i, (sp, step) in enumerate(zip(shard.params, steps)):
                location: dict[str, Any] = {"pretrained": referred[id(sp.param)]} if id(sp.param) in referred else {
                    "file": file, "moments": len(whats) == 3}
                if i in described:
                    location["state"] = described[i]
                part.records.append(ParamRecord(
                    sp.name, tuple(sp.shape), layout.orig_dtype[id(sp.param)], trainable, aliases[id(sp.param)][1:],
                    sp.index, step, dtype, location).to_json())
        if entries:
            part.file = file
            plan.append((part, jobs, entries))
    items = [(shard, what) for _, jobs, _ in plan for shard, what, _ in jobs]
    steps_of = {shard.index: state.param_steps(shard) for shard, _ in items}
    total = sum(state.numel_of(s, w) * state.dtype_of(s, w).itemsize for s, w in items)
    bar = progress_bar(total, f"RatelStrategy: checkpoint {directory.name.split('.tmp')[0].lstrip('.')}", progress)
    stream = state.stream(items)
    try:
        for part, jobs, entries in plan:
            assert part.file is not None
            writer = TensorFileWriter(directory / part.file, entries, metadata={"format": "pt"})
            try:
                for shard, what, names in jobs:
                    got, _, flat = next(stream)
                    assert got is shard
                    if what == "state":
                        assert generic is not None
                        for i, sp in enumerate(shard.params):
                            if steps_of[shard.index][i]:
                                record = generic.record(shard, i, flat)
                                for e in _stored_entries(generic.param_states(shard, sp.shape)):
                                    writer.write(tensor_name(f"state/{e.name}", sp.name), e.view(record))
                    elif len(names) == len(shard.params):
                        writer.write_run(names, flat[: shard.numel])
                    else:
                        wanted = set(names)
                        for sp in shard.params:
                            name = tensor_name("value", sp.name)
                            if name in wanted:
                                writer.write(name, sp.view(flat))
                    bar.update(flat.numel() * flat.element_size())
            except BaseException:
                writer.abort()
                raise
            writer.close()
            part.checksums = writer.checksums
    finally:
        stream.close()
        bar.close()
    return parts


def _stored_entries(states: ParamStates) -> list[StateEntry]:
    """The entries of a parameter's optimizer state that take bytes (a ``None`` entry is only listed in the index)."""
    return [e for e in states.entries if e.nbytes]


def _describe(entry: StateEntry) -> list[Any]:
    """An optimizer state entry in the index: name, dtype, shape and the Python type of a number (``None``: tensor)."""
    return [entry.name, dtype_name(entry.dtype), list(entry.shape),
            None if entry.python is None else entry.python.__name__]


def _write_bytes(path: Path, data: bytes | memoryview) -> int:
    """Write a small file durably; returns the xxh3-64 of its bytes."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return xxhash.xxh3_64_intdigest(data)


def _index_checksum(index: dict[str, Any]) -> int:
    """The checksum of an index's content (without its own checksum), independent of the JSON's layout."""
    # Through JSON first, so the index being written (tuples, integer keys) and the one read back hash the same.
    content = json.loads(json.dumps({k: v for k, v in index.items() if k != "checksum"}))
    return xxhash.xxh3_64_intdigest(json.dumps(content, sort_keys=True, separators=(",", ":")).encode())


class ShardedReader:
    """A sharded checkpoint's parameters and their values, read one tensor at a time.

    Args:
        path: the checkpoint directory.
        pretrained: the folder its frozen weights refer to, if not where the index says.

    Raises:
        RatelConfigError: the directory is not a complete sharded checkpoint of a version this package reads, or the
            pretrained folder it refers to is missing or different.
    """

    def __init__(self, path: str | os.PathLike[str], pretrained: PretrainedFolder | str | None = None) -> None:
        self.path = Path(path)
        if not is_sharded_checkpoint(self.path):
            raise RatelConfigError(not_a_checkpoint(self.path))
        index = self._read_index()
        self.index = index
        try:
            self.records = [ParamRecord.from_json(r) for r in index["params"]]
            self.hf = HFLayout.from_json(index.get("hf"))
            self._checksums: dict[str, dict[str, int]] | None = index["checksums"] if index["version"] >= 2 else None
        except (KeyError, TypeError, ValueError) as err:
            raise self._damaged(self.path / INDEX, f"an entry is missing or malformed ({err!r})") from err
        self.by_name = {}
        for record in self.records:
            for name in [record.name, *record.aliases]:
                self.by_name[name] = record
        self.pretrained: PretrainedFolder | None = None
        recorded = index.get("pretrained")
        if recorded is not None:
            folder = pretrained if pretrained is not None else recorded["path"]
            try:
                self.pretrained = folder if isinstance(folder, PretrainedFolder) else PretrainedFolder(folder)
            except RatelConfigError as err:
                raise RatelConfigError(f"the checkpoint {self.path} takes its frozen weights from the pretrained "
                                       f"folder {recorded['path']}, which cannot be read: {err}") from err
            self.pretrained.check_fingerprint(recorded)
        self._readers: dict[str, TensorFileReader] = {}

    def _damaged(self, file: Path, what: str) -> RatelConfigError:
        return RatelConfigError(f"the checkpoint file {file} is damaged or was edited: {what}. Resume from another "
                                "checkpoint (or write this one again).")

    def _read_index(self) -> dict[str, Any]:
        path = self.path / INDEX
        try:
            index = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise self._damaged(path, f"it is not JSON ({err})") from err
        except OSError as err:
            raise RatelConfigError(f"cannot read {path}: {err.strerror}") from err
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise self._damaged(path, f"it is not the index of a {FORMAT}")
        if index.get("version") not in READS:
            raise RatelConfigError(f"{path} is version {index.get('version')!r} of the {FORMAT}; this package reads "
                                   f"versions {', '.join(map(str, READS))}: use the lightning_ratel that wrote it")
        if index["version"] >= 2 and index.get("checksum") != _index_checksum(index):
            raise self._damaged(path, "its content does not match its checksum")
        return index

    def meta(self) -> dict[str, Any]:
        """``meta.pt``: Lightning's checkpoint without parameter values and optimizer state.

        Raises:
            RatelConfigError: the file is missing, damaged or not the one the index was written with.
        """
        path = self.path / META
        try:
            data = path.read_bytes()
        except OSError as err:
            raise RatelConfigError(f"cannot read {path}: {err.strerror}") from err
        if self._checksums is not None and xxhash.xxh3_64_intdigest(data) != self.index.get("meta_checksum"):
            raise self._damaged(path, "its bytes do not match the checksum in the index")
        try:
            return torch.load(io.BytesIO(data), weights_only=False)
        except Exception as err:
            raise self._damaged(path, f"it cannot be unpickled ({err!r})") from err

    def _reader(self, file: str) -> TensorFileReader:
        if file not in self._readers:
            self._readers[file] = TensorFileReader(self.path / file)
        return self._readers[file]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def read_into(self, record: ParamRecord, what: str, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` with ``what`` (``master``, ``exp_avg``, ``exp_avg_sq``) of ``record`` (a frozen parameter's
        ``master`` is its value), converting the dtype if needed."""
        if "pretrained" in record.location:
            assert self.pretrained is not None
            with self.pretrained.read([record.location["pretrained"]]) as tensors:
                return out.copy_(tensors[record.location["pretrained"]].to(record.dtype).view(out.shape))
        name = tensor_name(what if record.trainable else "value", record.name)
        file = record.location.get("file")
        if not isinstance(file, str) or "/" in file or file not in self.index.get("files", []):
            raise self._damaged(self.path / INDEX, f"{record.name} has no valid file ({file!r})")
        checksum = None
        if self._checksums is not None:
            checksum = self._checksums.get(file, {}).get(name)
            if checksum is None:
                raise self._damaged(self.path / INDEX, f"no checksum for {name} in {file}")
        return self._reader(file).read_into(name, out, checksum)

    def values(self, records: Sequence[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
        """Each record's full-precision value (fp32 master, or a frozen parameter's value); each tensor is valid until
        the next one is yielded."""
        largest = max((r.numel * r.stored.itemsize for r in records), default=0)
        buffer = aligned_empty(largest, torch.uint8)
        for record in records:
            yield record, self.read_into(record, "master", buffer.view(record.stored)[: record.numel])

    def moments(self, records: Sequence[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor, torch.Tensor]]:
        """Each trainable record with stored moments: its ``exp_avg`` and ``exp_avg_sq`` (valid until the next)."""
        largest = max((r.numel for r in records), default=0)
        m, v = aligned_empty(largest, torch.float32), aligned_empty(largest, torch.float32)
        for record in records:
            if record.trainable and record.location.get("moments"):
                yield (record, self.read_into(record, "exp_avg", m[: record.numel]),
                       self.read_into(record, "exp_avg_sq", v[: record.numel]))


class ShardedSource(ValueSource):
    """The first values of a resumed run's parameters from a sharded checkpoint: trainable ones get their fp32 masters
    as they are, frozen ones their values.

    Args:
        reader: the checkpoint.
        buffers: the persistent buffers from its ``meta.pt``.
    """

    def __init__(self, reader: ShardedReader, buffers: dict[str, torch.Tensor]) -> None:
        self.reader = reader
        self.description = f"loading {reader.path.name}"
        self._buffers = buffers
        self._records: dict[int, ParamRecord] = {}

    def prepare(self, names: dict[int, list[str]], layout: Layout, buffers: Sequence[str] = ()) -> None:
        slots = {id(s.param): s for s in layout.slots}
        missing, wrong = [], []
        for pid, aliases in names.items():
            record = next((self.reader.by_name[a] for a in aliases if a in self.reader.by_name), None)
            if record is None:
                missing.append(aliases[0])
            elif tuple(record.shape) != tuple(slots[pid].shape):
                wrong.append(f"{aliases[0]} {tuple(slots[pid].shape)} vs {tuple(record.shape)}")
            else:
                self._records[pid] = record
        if missing or wrong:
            problems = ([f"missing {', '.join(missing[:8])}"] if missing else []) + (
                [f"different shapes {', '.join(wrong[:8])}"] if wrong else [])
            raise RatelConfigError(f"the checkpoint {self.reader.path} does not fit the model: {'; '.join(problems)}")

    def provides(self, param: nn.Parameter) -> bool:
        return id(param) in self._records

    @contextlib.contextmanager
    def read(self, slots: Sequence[ParamSlot]) -> Iterator[dict[int, SourceValue]]:
        records = [self._records[id(slot.param)] for slot in slots]
        # One mapping for the block, unmapped when it is written: host memory holds one block of values.
        buffer = aligned_empty(sum(round_up(r.numel * r.stored.itemsize, 64) for r in records), torch.uint8)
        out = {}
        offset = 0
        for slot, record in zip(slots, records):
            nbytes = record.numel * record.stored.itemsize
            value = buffer[offset : offset + nbytes].view(record.stored).view(record.shape)
            offset += round_up(nbytes, 64)
            self.reader.read_into(record, "master", value)
            out[id(slot.param)] = SourceValue(value, master=record.trainable and slot.param.requires_grad)
        yield out

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def pretrained_key(self, param: nn.Parameter) -> str | None:
        record = self._records.get(id(param))
        return record.location.get("pretrained") if record is not None else None


def load_moments(state: ModelState, reader: ShardedReader, param_groups: list[dict[str, Any]]) -> None:
    """Put a sharded checkpoint's Adam moments (or another optimizer's state), step counts and parameter groups into
    the run's optimizer, one shard at a time (the next shard's state is read while the current one's is written to the
    store). With several ranks each reads the states of the shards it owns, whatever world size wrote them.

    Raises:
        RatelConfigError: the checkpoint was written for another model or optimizer.
    """
    assert state.optimizer is not None and state.adam is not None
    adam = state.adam
    state.quiesce()
    try:
        state.optimizer.load_state_dict({"state": {}, "param_groups": param_groups})
    except ValueError as err:
        sizes = [len(g["params"]) for g in state.optimizer.param_groups]
        saved = [len(g.get("params", [])) for g in param_groups]
        raise RatelConfigError(
            f"the checkpoint {reader.path} was written for another model or optimizer: its parameter groups hold "
            f"{saved} parameters, this run's optimizer {sizes} ({err}). Resume it with the model and "
            "configure_optimizers() that wrote it, or start from its weights alone (strategy `pretrained` or a "
            "converted checkpoint).") from err
    generic = state.layout.generic
    jobs = []
    for shard in state.layout.shards:
        if not state.holds(shard):
            # Another rank owns its states and reads them.
            continue
        records = [reader.by_name.get(sp.name) for sp in shard.params]
        key = "moments" if generic is None else "state"
        stored = [r if r is not None and r.trainable and r.location.get(key) else None for r in records]
        if any(stored):
            jobs.append((shard, stored))
    if not jobs:
        return
    if generic is not None:
        _load_states(state, reader, jobs)
        return
    largest = max(shard.numel for shard, _ in jobs)
    buffers = [(aligned_empty(largest, torch.float32), aligned_empty(largest, torch.float32)) for _ in range(2)]

    def read(index: int) -> list[int]:
        shard, stored = jobs[index]
        m, v = (b[: shard.numel] for b in buffers[index % 2])
        m.zero_()
        v.zero_()
        for sp, record in zip(shard.params, stored):
            if record is not None:
                reader.read_into(record, "exp_avg", sp.view(m))
                reader.read_into(record, "exp_avg_sq", sp.view(v))
        return [r.step if r is not None else 0 for r in stored]

    with ThreadPoolExecutor(1, thread_name_prefix="ratel-checkpoint-read") as pool:
        pending = pool.submit(read, 0)
        for i, (shard, _) in enumerate(jobs):
            steps = pending.result()
            if i + 1 < len(jobs):
                pending = pool.submit(read, i + 1)
            m, v = (b[: shard.numel] for b in buffers[i % 2])
            adam.load_state(shard, m, v, steps)


def _load_states(state: ModelState, reader: ShardedReader,
                 jobs: list[tuple[Shard, list[ParamRecord | None]]]) -> None:
    """:func:`load_moments` for an optimizer other than AdamW/Adam: each parameter's state entries into its shard's
    state record, checked against the entries this run's optimizer gives it."""
    assert state.adam is not None and state.layout.generic is not None
    generic = state.layout.generic
    for shard, stored in jobs:
        blob = aligned_empty(generic.nbytes(shard), torch.uint8).zero_()
        for i, (sp, record) in enumerate(zip(shard.params, stored)):
            if record is None:
                continue
            states = generic.param_states(shard, sp.shape)
            if record.location["state"] != [_describe(e) for e in states.entries]:
                raise RatelConfigError(
                    f"the checkpoint {reader.path} holds another optimizer state for {sp.name} "
                    f"({[e[0] for e in record.location['state']]}) than this run's {type(state.optimizer).__name__} "
                    f"gives it ({[e.name for e in states.entries]}). Resume it with the configure_optimizers() that "
                    "wrote it.")
            param_record = generic.record(shard, i, blob)
            for entry in _stored_entries(states):
                reader.read_into(record, f"state/{entry.name}", entry.view(param_record))
        state.adam.load_record(shard, blob, [r.step if r is not None else 0 for r in stored])
