"""Turn a sharded checkpoint, or swap files a run kept, into an ordinary checkpoint or a Hugging Face folder.

Nothing here gathers the model: tensors are read one at a time (a shard's key at a time from kept swap files) and
written as they are read. From the command line (``ratel-convert``, or ``python -m lightning_ratel.convert``)::

    ratel-convert CHECKPOINT_DIR OUT_DIR --to hf [--dtype bf16|fp32] [--max-shard-size 5GB]
    ratel-convert CHECKPOINT_DIR OUT.ckpt --to lightning
    ratel-convert --swap SWAP_DIR [--swap SWAP_DIR ...] [--name ratel] OUT_DIR --to hf

``--to lightning`` writes the checkpoint Lightning itself would have written (``torch.load`` reads it; the parameters,
the Adam state in ``torch.optim.AdamW``'s format, and everything in ``meta.pt``): it is loadable without this plugin,
on a machine where the model fits. ``--swap`` reads the files a run kept because its result was not copied back
(:class:`~lightning_ratel.runtime.kept.KeptStore`): they hold the committed weights of its last step; a run of several
ranks kept one store per rank (``ratel-rank<R>``, each with the units that rank owned), read together.
``--pretrained FOLDER`` names the folder frozen weights come from when it moved since the run.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.io.checkpoint import ModelState
from lightning_ratel.io.export import DEFAULT_SHARD_SIZE, HFLayout, ParamRecord, hf_layout, write_hf_folder
from lightning_ratel.io.pretrained import PretrainedFolder
from lightning_ratel.io.sharded import ShardedReader
from lightning_ratel.io.tensorfiles import dtype_of, parse_dtype
from lightning_ratel.progress import progress_bar
from lightning_ratel.runtime.collectives import DataParallelAdam
from lightning_ratel.runtime.hostmem import aligned_empty
from lightning_ratel.runtime.kept import KeptStore
from lightning_ratel.runtime.units import FrozenValues
from lightning_ratel_cli import convert

KEPT_FORMAT = "lightning_ratel kept swap files"
KEPT_VERSION = 1


# ---------------------------------------------------------------------------------------------------- kept swap files


def kept_metadata(state: ModelState, module: nn.Module, pretrained: PretrainedFolder | None) -> dict[str, Any]:
    """What kept swap files need beside them to be exported later: each parameter's committed value (its store key
    and offset), the Hugging Face layout, and the pretrained folder frozen weights may come from. Call once no update
    is pending.

    With several ranks each rank's store describes what it holds, without a collective: the masters of the trainable
    shards it owns and, on rank 0, the frozen values kept on disk; ``order`` (every parameter, in the layout's order)
    and ``rank`` / ``world`` let :class:`KeptReader` put the ranks' stores together."""
    layout = state.layout
    state.quiesce()
    local = state.local()
    ranks = state.adam.ranks if isinstance(state.adam, DataParallelAdam) else None
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    frozen = layout.frozen_values
    records = []
    for shard in layout.all_shards:
        trainable = shard.group >= 0
        if not state.holds(shard) or (not trainable and ranks is not None and ranks.rank != 0):
            continue  # in another rank's store (frozen values, the same on every rank: rank 0's)
        if trainable:
            assert local.adam is not None
            key: str | None = local.adam.state_key(shard, "master")
        elif shard.index in frozen.exact_copies:
            key = FrozenValues.key(shard)
        else:
            key = None if shard.unit.host else shard.compute_key
        steps = local.param_steps(shard)
        for sp, step in zip(shard.params, steps):
            if key is not None:
                location: dict[str, Any] = {"key": key, "offset": sp.offset}
            elif id(sp.param) in frozen.pretrained:
                location = {"pretrained": frozen.pretrained[id(sp.param)]}
            else:
                location = {}
            records.append(ParamRecord(sp.name, tuple(sp.shape), layout.orig_dtype[id(sp.param)], trainable,
                                       aliases[id(sp.param)][1:], sp.index, step, state.dtype_of(shard, "master"),
                                       location).to_json())
    meta: dict[str, Any] = {
        "format": KEPT_FORMAT, "version": KEPT_VERSION, "params": records, "hf": hf_layout(module).to_json(),
        "pretrained": pretrained.fingerprint() if pretrained is not None else None}
    if ranks is not None:
        meta.update(rank=ranks.rank, world=ranks.world, order=[sp.name for s in layout.all_shards for sp in s.params])
    return meta


def _open_kept(paths: Sequence[str | os.PathLike[str]], name: str) -> list[KeptStore]:
    """The kept store ``name`` in ``paths``, or, where a run of several ranks kept them, every rank's store
    (``<name>-rank<r>``), rank 0's first."""
    if any((Path(p) / f"{name}.swap").exists() for p in paths) or not any(
            (Path(p) / f"{name}-rank0.swap").exists() for p in paths):
        return [KeptStore(list(paths), name)]
    stores = [KeptStore(list(paths), f"{name}-rank0")]
    try:
        world = stores[0].metadata.get("world", 1)
        for rank in range(1, world):
            stores.append(KeptStore(list(paths), f"{name}-rank{rank}"))
    except BaseException:
        for store in stores:
            store.close()
        raise
    return stores


class KeptReader:
    """The weights in swap files a run kept, as a :class:`~lightning_ratel.io.export.StateReader`.

    Args:
        paths: the swap directories of that run.
        name: the store name (``ratel`` unless the run named it otherwise); a run of several ranks kept one store per
            rank, ``<name>-rank<r>``, which are read together.
        pretrained: the folder frozen weights come from, if not where the run found it.

    Raises:
        RatelConfigError: the files cannot be opened as a kept store, were not kept by a run of this package, or
            (several ranks) a rank's store is missing or of another run.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], name: str = "ratel",
                 pretrained: PretrainedFolder | str | None = None) -> None:
        self.stores = _open_kept(paths, name)
        try:
            self._read_metadata(paths, pretrained)
        except BaseException:
            self.close()
            raise

    def _read_metadata(self, paths: Sequence[str | os.PathLike[str]], pretrained: PretrainedFolder | str | None
                       ) -> None:
        metas = [store.metadata for store in self.stores]
        if any(meta.get("format") != KEPT_FORMAT for meta in metas):
            raise RatelConfigError(f"the swap files in {', '.join(map(str, paths))} carry no parameter index of "
                                   "lightning_ratel; only files a RatelStrategy run kept can be exported")
        meta = metas[0]
        # The position in ``stores`` of the store holding each parameter.
        self._store_of: dict[str, int] = {}
        self.records = []
        for position, part in enumerate(metas):
            for r in part["params"]:
                record = ParamRecord.from_json(r)
                self.records.append(record)
                self._store_of[record.name] = position
        if len(metas) > 1:
            order = {name: i for i, name in enumerate(meta["order"])}
            odd = [f"rank {part.get('rank')}" for part in metas
                   if part.get("world") != len(metas) or part.get("order") != meta["order"]]
            missing = sorted(set(order) - set(self._store_of))
            if odd or missing:
                raise RatelConfigError(
                    f"the kept swap files of a run of {len(metas)} ranks in {', '.join(map(str, paths))} do not fit "
                    f"together ({'stores of another run: ' + ', '.join(odd) if odd else 'no rank holds ' + missing[0]})"
                    "; give the directories of one run, each rank's files kept")
            self.records.sort(key=lambda r: order[r.name])
        self.hf = HFLayout.from_json(meta.get("hf"))
        self.pretrained: PretrainedFolder | None = None
        recorded = meta.get("pretrained")
        if any("pretrained" in r.location for r in self.records) and recorded is not None:
            folder = pretrained if pretrained is not None else recorded["path"]
            self.pretrained = folder if isinstance(folder, PretrainedFolder) else PretrainedFolder(folder)
            self.pretrained.check_fingerprint(recorded)
        lost = [r.name for r in self.records if not r.location]
        if lost:
            raise RatelConfigError(f"the kept swap files do not hold the values of {len(lost)} parameters, e.g. "
                                   f"{lost[:3]} (frozen parameters that lived in host memory only)")

    def close(self) -> None:
        for store in self.stores:
            store.close()

    def values(self, records: Sequence[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
        current: tuple[int, str] | None = None
        flat = torch.empty(0)
        keys = {(self._store_of[r.name], r.location["key"]) for r in records if "key" in r.location}
        largest = max((self.stores[position].nbytes(k) for position, k in keys), default=0)
        buffer = aligned_empty(largest, torch.uint8)
        for record in records:
            if "pretrained" in record.location:
                assert self.pretrained is not None
                key = record.location["pretrained"]
                with self.pretrained.read([key]) as tensors:
                    yield record, tensors[key].to(record.dtype).reshape(-1)
                continue
            position = self._store_of[record.name]
            key = record.location["key"]
            if (position, key) != current:
                nbytes = self.stores[position].nbytes(key)
                flat = self.stores[position].read(key, buffer[:nbytes]).result()
                current = (position, key)
            start = record.location["offset"]
            yield record, flat.view(record.stored)[start : start + record.numel]


def kept_to_hf(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], name: str = "ratel",
               dtype: str | torch.dtype = "bf16", max_shard_size: int | str = DEFAULT_SHARD_SIZE,
               pretrained: str | None = None, progress: bool = False) -> Path:
    """Export the weights in kept swap files as a Hugging Face folder (see
    :func:`~lightning_ratel.io.export.write_hf_folder`)."""
    reader = KeptReader(paths, name, pretrained)
    try:
        return write_hf_folder(reader, out, parse_dtype(dtype), max_shard_size, progress)
    finally:
        reader.close()


# ------------------------------------------------------------------------------------------------ sharded checkpoints


def sharded_to_hf(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str | torch.dtype = "bf16",
                  max_shard_size: int | str = DEFAULT_SHARD_SIZE, pretrained: str | None = None,
                  progress: bool = False) -> Path:
    """Export a sharded checkpoint's weights as a Hugging Face folder, one tensor at a time."""
    reader = ShardedReader(checkpoint, pretrained)
    try:
        return write_hf_folder(reader, out, parse_dtype(dtype), max_shard_size, progress)
    finally:
        reader.close()


class _Storage:
    """A storage of the checkpoint being written: its record key, dtype and element count."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key = key
        self.dtype = dtype
        self.numel = numel


class _Deferred:
    """A tensor whose bytes are written after the pickle: read from the sharded checkpoint then, or taken from a
    tensor already in memory."""

    def __init__(self, storage: _Storage, shape: Sequence[int], tensor: torch.Tensor | None = None) -> None:
        self.storage = storage
        self.shape = tuple(shape)
        self.tensor = tensor


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    """Pickles a checkpoint as ``torch.save`` does, with the storages' bytes left for later records."""

    def __init__(self, file: io.BytesIO, storages: list[_Deferred]) -> None:
        super().__init__(file, protocol=2)
        self.storages = storages
        self._names = torch.storage._dtype_to_storage_type_map()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", getattr(torch, self._names[obj.dtype]), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().contiguous()
            obj = _Deferred(_Storage(str(len(self.storages)), tensor.dtype, tensor.numel()), tensor.shape, tensor)
            self.storages.append(obj)
        if isinstance(obj, _Deferred):
            args = (obj.storage, 0, torch.Size(obj.shape), _contiguous_stride(obj.shape), False,
                    collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args
        return NotImplemented


def sharded_to_lightning(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str],
                         pretrained: str | None = None, progress: bool = False) -> Path:
    """Write a sharded checkpoint as the ordinary Lightning checkpoint file it stands for.

    The parameters (every name of tied ones, sharing one storage) get their full-precision values in their own dtype,
    the optimizer state is ``torch.optim.AdamW``'s, and the rest comes from ``meta.pt``. The pickle is written first
    with every parameter as a reference to a storage record; the records follow, each read from the checkpoint and
    written before the next is read.
    """
    reader = ShardedReader(checkpoint, pretrained)
    try:
        meta = reader.meta()
        storages: list[_Deferred] = []
        values: dict[str, _Deferred] = {}
        moments: dict[tuple[str, str], _Deferred] = {}

        def deferred(shape: Sequence[int], dtype: torch.dtype) -> _Deferred:
            item = _Deferred(_Storage(str(len(storages)), dtype, int(torch.Size(shape).numel())), shape)
            storages.append(item)
            return item

        state_dict = dict(meta.get("state_dict", {}))
        for record in reader.records:
            values[record.name] = deferred(record.shape, record.dtype)
            for name in [record.name, *record.aliases]:
                state_dict[name] = values[record.name]
        meta["state_dict"] = state_dict
        if "optimizer_states" in meta:
            state = {}
            for record in reader.records:
                if record.trainable and record.location.get("moments") and record.step:
                    entry = {"step": torch.tensor(float(record.step))}
                    for what in ("exp_avg", "exp_avg_sq"):
                        entry[what] = moments[(record.name, what)] = deferred(record.shape, torch.float32)
                    state[record.optimizer_index] = entry
                elif record.trainable and record.location.get("state") and record.step:
                    state[record.optimizer_index] = _optimizer_state(reader, record, deferred, moments)
            meta["optimizer_states"][0]["state"] = state
        target = Path(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        data = io.BytesIO()
        # Storages of tensors already in meta.pt are appended while pickling, after the deferred ones.
        _Pickler(data, storages).dump(meta)
        owner: dict[int, tuple[ParamRecord, str]] = {id(values[r.name]): (r, "master") for r in reader.records}
        by_name = {r.name: r for r in reader.records}
        for (name, what), item in moments.items():
            owner[id(item)] = (by_name[name], what)
        total = sum(d.storage.numel * d.storage.dtype.itemsize for d in storages)
        bar = progress_bar(total, f"RatelStrategy: writing {target.name}", progress)
        writer = torch._C.PyTorchFileWriter(str(tmp))
        try:
            pickled = data.getvalue()
            writer.write_record("data.pkl", pickled, len(pickled))
            writer.write_record(".format_version", "1", 1)
            writer.write_record(".storage_alignment", "64", 2)
            writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            largest = max((d.storage.numel * max(4, d.storage.dtype.itemsize) for d in storages), default=0)
            buffer = aligned_empty(largest, torch.uint8)
            for item in storages:
                nbytes = item.storage.numel * item.storage.dtype.itemsize
                if item.tensor is not None:
                    tensor = item.tensor
                else:
                    record, what = owner[id(item)]
                    # Masters and moments are stored as the record says; another optimizer's entries as declared.
                    dtype = record.stored if what in ("master", "exp_avg", "exp_avg_sq") else item.storage.dtype
                    tensor = buffer[: item.storage.numel * dtype.itemsize].view(dtype)
                    reader.read_into(record, what, tensor)
                    if tensor.dtype != item.storage.dtype:
                        tensor = tensor.to(item.storage.dtype)
                if tensor.storage_offset() != 0:
                    tensor = tensor.clone()
                writer.write_record(f"data/{item.storage.key}", tensor.untyped_storage(), nbytes)
                bar.update(nbytes)
            writer.write_end_of_file()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            bar.close()
        os.replace(tmp, target)
        return target
    finally:
        reader.close()


_PYTHON_TYPES = {"int": int, "float": float, "bool": bool}


def _optimizer_state(reader: ShardedReader, record: ParamRecord, deferred: Callable[..., Any],
                     tensors: dict[tuple[str, str], Any]) -> dict[str, Any]:
    """The state of an optimizer other than AdamW/Adam for one parameter: tensors deferred like the moments (recorded
    in ``tensors``), Python numbers read now (they are single values)."""
    entry: dict[str, Any] = {}
    for name, dtype, shape, python in record.location["state"]:
        what = f"state/{name}"
        if python is None:
            entry[name] = tensors[(record.name, what)] = deferred(shape, dtype_of(dtype))
        elif python == "NoneType":
            entry[name] = None
        else:
            value = reader.read_into(record, what, torch.empty((), dtype=dtype_of(dtype)))
            entry[name] = _PYTHON_TYPES[python](value.item())
    return entry


# ---------------------------------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_ratel.convert``: the ``ratel-convert`` command (see ``--help``); the exit status."""
    return convert(argv, prog="python -m lightning_ratel.convert")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Do what the parsed command line of :func:`lightning_ratel_cli.convert_parser` asks; the exit status."""
    progress = not args.no_progress
    try:
        if args.swap:
            if args.source is not None or args.to != "hf":
                parser.error("--swap takes no checkpoint and exports only to a Hugging Face folder (--to hf)")
            path = kept_to_hf(args.swap, args.out, args.name, args.dtype, args.max_shard_size, args.pretrained,
                              progress)
        elif args.source is None:
            parser.error("give a sharded checkpoint directory, or --swap with the kept swap directories")
        elif args.to == "hf":
            path = sharded_to_hf(args.source, args.out, args.dtype, args.max_shard_size, args.pretrained, progress)
        else:
            path = sharded_to_lightning(args.source, args.out, args.pretrained, progress)
    except RatelConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
