"""A Hugging Face folder of the trained weights, written one tensor at a time from wherever the state lives.

The output is what ``PreTrainedModel.save_pretrained`` writes: ``model.safetensors`` (or ``model-0000k-of-0000n``
shard files with ``model.safetensors.index.json``), ``config.json`` and ``generation_config.json`` when the module holds a
transformers model, in the dtype asked for. The tensor names are the transformers model's own: the LightningModule's
attribute prefix (``model.``) and peft's wrapping (``base_model.model.``, ``.base_layer``) are taken off, tied weights
are written once under the name transformers keeps. For a peft model the base weights go there and the adapter goes
to ``adapter/`` in peft's format (``adapter_model.safetensors``, ``adapter_config.json``), in the parameters' own
dtype.

The weights come from a :class:`StateReader`: the running engine (:class:`LiveReader`, after every update has
landed), a sharded checkpoint, or kept swap files (:mod:`lightning_ratel.io.convert`). Each yields one shard's values at
a time, so host memory holds a shard and the tensor being written, never the model.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.io.checkpoint import ModelState
from lightning_ratel.io.tensorfiles import (
    TensorFileWriter,
    dtype_name,
    dtype_of,
    numel_of,
    remove_stale_staging,
    replace_directory,
    staging_path,
)
from lightning_ratel.progress import progress_bar
from lightning_ratel.runtime.collectives import DataParallelAdam
from lightning_ratel.sizes import parse_bytes

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_SHARD_SIZE = "5GB"


@dataclass
class ParamRecord:
    """One parameter of a saved or running model, as the readers describe it.

    Attributes:
        name: its qualified name in the LightningModule (the first, for tied parameters).
        shape: its shape.
        dtype: its own dtype (what the module holds).
        trainable: whether the optimizer updates it (it has an fp32 master and moments).
        aliases: its other names (tied parameters).
        optimizer_index: its position in the optimizer's ``state_dict`` order (-1: none).
        step: its committed AdamW step count.
        stored: the dtype its full-precision value is stored in (fp32 masters; a frozen parameter's value dtype).
        location: where a reader finds it (reader-specific).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    aliases: list[str] = field(default_factory=list)
    optimizer_index: int = -1
    step: int = 0
    stored: torch.dtype = torch.float32
    location: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape)
        out["dtype"] = dtype_name(self.dtype)
        out["stored"] = dtype_name(self.stored)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParamRecord:
        return cls(name=data["name"], shape=tuple(data["shape"]), dtype=dtype_of(data["dtype"]),
                   trainable=bool(data["trainable"]), aliases=list(data.get("aliases", [])),
                   optimizer_index=int(data.get("optimizer_index", -1)), step=int(data.get("step", 0)),
                   stored=dtype_of(data.get("stored", "F32")), location=dict(data.get("location", {})))


@dataclass
class HFLayout:
    """How a LightningModule's parameters map to a Hugging Face folder.

    Attributes:
        names: parameter name -> tensor name in the transformers model's weights.
        adapter: parameter name -> tensor name in the peft adapter file.
        config: ``config.json`` (``None`` without a transformers model).
        generation_config: ``generation_config.json``, if the model generates.
        adapter_config: ``adapter_config.json`` of a peft model.
    """

    names: dict[str, str] = field(default_factory=dict)
    adapter: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    generation_config: dict[str, Any] | None = None
    adapter_config: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> HFLayout:
        return cls(**data) if data else cls()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def _json(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=_jsonable))


def _find_peft(module: nn.Module) -> tuple[str, nn.Module] | None:
    for name, m in module.named_modules():
        if isinstance(getattr(m, "peft_config", None), dict) and hasattr(m, "base_model") and hasattr(
                m, "active_adapter"):
            return name, m
    return None


def _find_transformers(module: nn.Module) -> tuple[str, nn.Module] | None:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel):
            return name, m
    return None


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def _normalize(name: str) -> str:
    """A peft-wrapped parameter's name as the unwrapped model has it."""
    parts = [p for p in name.split(".") if p not in ("base_layer", "original_module")]
    return ".".join(parts)


def _tied_targets(model: nn.Module) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or []
    return set(tied.keys()) if isinstance(tied, dict) else set(tied)


def hf_layout(module: nn.Module) -> HFLayout:
    """Map ``module``'s parameters to a Hugging Face folder (see the module docstring)."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    layout = HFLayout()
    peft = _find_peft(module)
    adapter_ids: set[int] = set()
    if peft is not None:
        peft_name, peft_model = peft
        from peft import get_peft_model_state_dict

        prefix = _prefix(peft_name)
        adapter_name = peft_model.active_adapter
        adapter_name = adapter_name if isinstance(adapter_name, str) else adapter_name[0]
        markers = {}
        for names in aliases.values():
            for n in names:
                if n.startswith(prefix):
                    markers[n[len(prefix):]] = torch.empty(0)
        owner = {id(t): key for key, t in markers.items()}
        selected = get_peft_model_state_dict(peft_model, state_dict=markers, adapter_name=adapter_name)
        by_name = dict(module.named_parameters(remove_duplicate=False))
        for saved, marker in selected.items():
            param = by_name.get(prefix + owner[id(marker)]) if id(marker) in owner else None
            if param is not None:
                layout.adapter[aliases[id(param)][0]] = saved
                adapter_ids.add(id(param))
        config = peft_model.peft_config[adapter_name]
        layout.adapter_config = _json({**config.to_dict(), "inference_mode": True})
    found = _find_transformers(module)
    if found is not None:
        hf_name, hf_model = found
        prefix = _prefix(hf_name)
        tied = _tied_targets(hf_model)
        # Only what differs from the defaults, as save_pretrained writes it.
        layout.config = _json(json.loads(hf_model.config.to_json_string(use_diff=True)))
        layout.config["architectures"] = [type(hf_model).__name__]
        generation = getattr(hf_model, "generation_config", None)
        if generation is not None and hf_model.can_generate():
            layout.generation_config = _json(json.loads(generation.to_json_string(use_diff=True)))
    else:
        # No transformers model: names relative to the module's only child that holds parameters, if there is one.
        holders = {name for name, child in module.named_children() if any(True for _ in child.parameters())}
        prefix = _prefix(next(iter(holders))) if len(holders) == 1 else ""
        tied = set()
    for p in module.parameters():
        if id(p) in adapter_ids:
            continue
        inside = [_normalize(n[len(prefix):]) for n in aliases[id(p)] if n.startswith(prefix)]
        if not inside:
            continue
        kept = [n for n in inside if n not in tied] or inside
        layout.names[aliases[id(p)][0]] = kept[0]
    return layout


class StateReader(Protocol):
    """Parameters of a model and their values, read a shard at a time."""

    records: list[ParamRecord]
    hf: HFLayout

    def values(self, records: Sequence[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
        """Each record's full-precision value (fp32 master, or a frozen parameter's value), in the order given; each
        tensor is valid until the next one is yielded."""
        ...


class LiveReader:
    """The running engine's committed state (:class:`~lightning_ratel.io.checkpoint.ModelState`) as a
    :class:`StateReader`.

    Args:
        state: the engine's model state.
        module: the LightningModule (names, the transformers model and its configuration).
    """

    def __init__(self, state: ModelState, module: nn.Module) -> None:
        self.state = state
        self.hf = hf_layout(module)
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        layout = state.layout
        self._shard_of: dict[str, tuple[Any, Any]] = {}
        self.records = []
        state.quiesce()
        for shard in layout.all_shards:
            steps = state.param_steps(shard)
            for sp, step in zip(shard.params, steps):
                names = aliases[id(sp.param)]
                self.records.append(ParamRecord(
                    sp.name, tuple(sp.shape), layout.orig_dtype[id(sp.param)], shard.group >= 0, names[1:],
                    sp.index, step, state.dtype_of(shard, "master")))
                self._shard_of[sp.name] = (shard, sp)

    def values(self, records: Sequence[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
        wanted = {r.name: r for r in records}
        order = []
        seen: set[int] = set()
        for r in records:
            shard = self._shard_of[r.name][0]
            if shard.index not in seen:
                seen.add(shard.index)
                order.append(shard)
        for shard, _, flat in self.state.stream([(s, "master") for s in order]):
            for sp in shard.params:
                if sp.name in wanted:
                    yield wanted[sp.name], sp.view(flat)


def exported_records(reader: StateReader) -> list[ParamRecord]:
    """The records :func:`write_hf_folder` reads, in the order it reads them."""
    hf = reader.hf
    return [r for r in reader.records if r.name in hf.names or r.name in hf.adapter]


class _Streamed:
    """A :class:`StateReader` whose values are one stream already made (for :func:`write_live_hf_folder`)."""

    def __init__(self, reader: StateReader, stream: Iterator[tuple[ParamRecord, torch.Tensor]]) -> None:
        self.records = reader.records
        self.hf = reader.hf
        self._stream = stream

    def values(self, records: Sequence[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
        return self._stream


def write_live_hf_folder(reader: LiveReader, path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16,
                         max_shard_size: int | str = DEFAULT_SHARD_SIZE, progress: bool = False) -> Path:
    """:func:`write_hf_folder` of the running engine's weights, on one rank or on several.

    With several ranks this is a collective: every rank takes part in reading each value from the rank that owns it,
    in the export's order, and rank 0 alone writes the folder; every rank returns once it is in place, or raises when
    it could not be written (the folder there before is then unchanged).
    """
    state = reader.state
    adam = state.adam
    if not isinstance(adam, DataParallelAdam):
        return write_hf_folder(reader, path, dtype, max_shard_size, progress)
    stream = reader.values(exported_records(reader))

    def step() -> str | None:
        try:
            if adam.ranks.rank == 0:
                return str(write_hf_folder(_Streamed(reader, stream), path, dtype, max_shard_size, progress))
            return None
        finally:
            # The other ranks read every value with rank 0: what it left unread (it failed) is read all the same.
            for _ in stream:
                pass

    return Path(state.agree(step, f"the export to {path} was not written")[0])


def _plan_files(items: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensors (name, bytes) cut into files of at most ``max_bytes`` in the order given (a tensor is never split)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in items:
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def write_hf_folder(reader: StateReader, path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16,
                    max_shard_size: int | str = DEFAULT_SHARD_SIZE, progress: bool = False) -> Path:
    """Write ``reader``'s weights as a Hugging Face folder (see the module docstring).

    The export is built in a fresh staging directory beside ``path`` and swapped into place in one step
    (:func:`~lightning_ratel.io.tensorfiles.replace_directory`): a reader, or a kill at any moment, finds the earlier
    export whole or this one whole, never weights of two steps. Files of the folder that this export does not write
    (a tokenizer) are carried over (hard links where possible); the weight files and the adapter of an earlier export
    are not.

    Args:
        reader: where the weights come from.
        path: the folder (created if needed).
        dtype: the dtype of the weights (the adapter keeps its own).
        max_shard_size: the largest weight file (bytes or a string such as ``"5GB"``); more weights are split into
            shard files ``model-0000k-of-0000n.safetensors`` with an index.
        progress: show a progress bar.

    Returns:
        The folder.
    """
    limit = parse_bytes(max_shard_size, "max_shard_size")
    assert limit is not None
    out = Path(path)
    hf = reader.hf
    model = [r for r in reader.records if r.name in hf.names]
    adapter = [r for r in reader.records if r.name in hf.adapter]
    if not model and not adapter:
        raise RatelConfigError("the model has no parameters to export")
    by_hf = {hf.names[r.name]: r for r in model}
    files = _plan_files([(hf.names[r.name], r.numel * dtype.itemsize) for r in model], limit)
    if len(files) == 1:
        file_names = [SAFE_WEIGHTS]
    else:
        file_names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    file_of = {n: file_names[i] for i, names in enumerate(files) for n in names}
    remaining = {name: len(names) for name, names in zip(file_names, files)}
    writers: dict[str, TensorFileWriter] = {}
    adapter_values: dict[str, torch.Tensor] = {}
    total = sum(r.numel * r.stored.itemsize for r in model + adapter)
    wanted = exported_records(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging = staging_path(out)
    staging.mkdir()
    bar = progress_bar(total, f"RatelStrategy: exporting to {out}", progress)
    try:
        for record, value in reader.values(wanted):
            if record.name in hf.adapter:
                adapter_values[hf.adapter[record.name]] = value.to(record.dtype).reshape(record.shape).clone()
            if record.name in hf.names:
                name = hf.names[record.name]
                file = file_of[name]
                writer = writers.get(file)
                if writer is None:
                    writer = writers[file] = TensorFileWriter(
                        staging / file, [(n, dtype, by_hf[n].shape) for n in files[file_names.index(file)]],
                        metadata={"format": "pt"})
                writer.write(name, value.reshape(record.shape).to(dtype))
                remaining[file] -= 1
                if remaining[file] == 0:
                    writer.close()
            bar.update(record.numel * record.stored.itemsize)
        written = set(file_names)
        if adapter:
            _write_adapter(staging / ADAPTER_DIR, adapter_values, hf.adapter_config or {})
            written.add(ADAPTER_DIR)
        if len(files) > 1:
            data = {"metadata": {"total_size": sum(r.numel * dtype.itemsize for r in model)},
                    "weight_map": {n: file_of[n] for n in sorted(file_of)}}
            _write_json(staging / SAFE_INDEX, data)
        if hf.config is not None:
            config = dict(hf.config)
            config["dtype"] = str(dtype).removeprefix("torch.")
            config.pop("torch_dtype", None)
            _write_json(staging / "config.json", config)
            written.add("config.json")
        if hf.generation_config is not None:
            _write_json(staging / "generation_config.json", hf.generation_config)
            written.add("generation_config.json")
        if out.is_dir():
            _carry_over(out, staging, written)
        replace_directory(staging, out)
    except BaseException:
        for file, writer in writers.items():
            if remaining[file]:
                writer.abort()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        bar.close()
    return out


def _carry_over(out: Path, staging: Path, written: set[str]) -> None:
    """Link (or copy) into ``staging`` the entries of the earlier folder ``out`` that the new export neither writes nor
    replaces: everything but its own names and an earlier export's weights, index and adapter (weights of another
    step)."""
    for entry in out.iterdir():
        name = entry.name
        if name in written or name in (SAFE_INDEX, ADAPTER_DIR) or (
                name.startswith("model") and name.endswith(".safetensors")):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, staging / name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, staging / name)


def _link_or_copy(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _write_adapter(directory: Path, values: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    directory.mkdir()
    names = list(values)
    writer = TensorFileWriter(directory / ADAPTER_WEIGHTS, [(n, values[n].dtype, values[n].shape) for n in names],
                              metadata={"format": "pt"})
    try:
        for n in names:
            writer.write(n, values[n])
    except BaseException:
        writer.abort()
        raise
    writer.close()
    _write_json(directory / ADAPTER_CONFIG, config)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ModuleReader:
    """A module's own parameters (for example after fit, once the trained values were copied back) as a
    :class:`StateReader`.

    Args:
        module: the LightningModule.

    Raises:
        RatelConfigError: a parameter holds a NaN placeholder (its value was not copied back after training).
    """

    def __init__(self, module: nn.Module) -> None:
        self.hf = hf_layout(module)
        aliases: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
            params[id(p)] = p
        placeholders = [aliases[i][0] for i, p in params.items() if p.numel() > 1 and not any(p.stride())]
        if placeholders:
            raise RatelConfigError(
                f"{len(placeholders)} parameters of the module hold no values (e.g. {placeholders[0]}): they were not "
                "copied back after training. Export during fit (RatelHFExport, or strategy.save_pretrained before fit "
                "ends), or convert a sharded checkpoint or the kept swap files with "
                "`ratel-convert`")
        self._params = {aliases[i][0]: p for i, p in params.items()}
        self.records = [ParamRecord(aliases[i][0], tuple(p.shape), p.dtype, p.requires_grad, aliases[i][1:],
                                    stored=p.dtype) for i, p in params.items()]

    def values(self, records: Sequence[ParamRecord]) -> Iterator[tuple[ParamRecord, torch.Tensor]]:
        for record in records:
            yield record, self._params[record.name].detach().reshape(-1)
