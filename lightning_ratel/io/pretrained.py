"""Pretrained weights in, streamed: a Hugging Face checkpoint folder as the first values of a model's parameters.

``RatelStrategy(pretrained="path/to/folder")`` reads a folder with ``model.safetensors``, or with shard files listed in
``model.safetensors.index.json``, while the engine materializes the model block by block
(:mod:`lightning_ratel.engine.materialize`): each block's tensors are read with safetensors' memory-mapped ``safe_open``,
cast to the parameter's dtype as ``from_pretrained`` would, written to the swap store, and the file is closed (and
unmapped) before the next block, so host memory holds about one block.

Names are matched through the prefixes a LightningModule adds: the attribute holding the transformers model
(``model.``), peft's wrapping (``base_model.model.``, ``.base_layer``). The prefix is the one under which most of the
model's parameters are found in the folder. Parameters the folder does not hold are initialized (``param_init_fn``, or
:class:`~lightning_ratel.engine.materialize.DefaultInit`: a LoRA adapter as peft initializes it, a new head by its
``reset_parameters()``) when they are trainable; a frozen parameter missing from the folder, a tensor of the wrong
shape, or a folder that holds none of the model's parameters is a :class:`~lightning_ratel.errors.RatelConfigError`
raised before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.io.sources import SourceValue, ValueSource
from lightning_ratel.io.tensorfiles import TensorEntry, TensorFileReader
from lightning_ratel.runtime.units import Layout, ParamSlot

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_SHOWN = 8


def _normalize(name: str) -> str:
    """A peft-wrapped name as the unwrapped model has it (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return ".".join(p for p in name.split(".") if p not in ("base_layer", "original_module"))


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


class PretrainedFolder:
    """A Hugging Face checkpoint folder: which file holds each tensor, and each tensor's dtype and shape.

    Args:
        path: the folder.

    Raises:
        RatelConfigError: it is not a folder, holds neither ``model.safetensors`` nor ``model.safetensors.index.json``,
            or a file the index names is missing or unreadable.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise RatelConfigError(f"`pretrained` must be a Hugging Face checkpoint folder; {self.path} is not a "
                                   "directory")
        index = self.path / SAFE_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise RatelConfigError(f"{index} is not a safetensors index ({err!r})") from err
            files = sorted(set(weight_map.values()))
        elif (self.path / SAFE_WEIGHTS).is_file():
            files = [SAFE_WEIGHTS]
        else:
            raise RatelConfigError(
                f"`pretrained` folder {self.path} holds neither {SAFE_WEIGHTS} nor {SAFE_INDEX}; save the model with "
                "save_pretrained(..., safe_serialization=True)")
        self.entries: dict[str, TensorEntry] = {}
        self.file_of: dict[str, Path] = {}
        self.sizes: dict[str, int] = {}
        self._data_start: dict[Path, int] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise RatelConfigError(f"{index} names {name}, which is not in {self.path}")
            with TensorFileReader(file) as reader:
                for key, entry in reader.entries.items():
                    self.entries[key] = entry
                    self.file_of[key] = file
                self._data_start[file] = reader.data_start
            self.sizes[name] = file.stat().st_size

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint that refers to this folder records, to recognize it later."""
        return {"path": str(self.path), "files": dict(self.sizes)}

    def check_fingerprint(self, recorded: dict[str, Any]) -> None:
        """Raise unless this folder holds the files ``recorded`` (a checkpoint's reference) with the same sizes."""
        if recorded.get("files") != self.sizes:
            raise RatelConfigError(
                f"the checkpoint takes its frozen weights from the pretrained folder {recorded.get('path')}, and "
                f"{self.path} does not hold the same files (names and sizes differ); pass the folder the checkpoint "
                "was trained from")

    def prefetch(self, keys: Sequence[str]) -> None:
        """Ask the kernel to start reading ``keys`` into the page cache (``POSIX_FADV_WILLNEED``), so the next
        :meth:`read` finds them there instead of faulting them in page by page."""
        ranges: dict[Path, list[tuple[int, int]]] = {}
        for key in keys:
            entry = self.entries[key]
            start = self._data_start[self.file_of[key]]
            ranges.setdefault(self.file_of[key], []).append((start + entry.begin, entry.nbytes))
        for file, spans in ranges.items():
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for offset, length in spans:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def read(self, keys: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors ``keys``, memory-mapped by ``safe_open``; valid inside the ``with`` block, whose end closes (and
        unmaps) the files."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.file_of[key], []).append(key)
        with contextlib.ExitStack() as stack:
            out: dict[str, torch.Tensor] = {}
            for file, names in by_file.items():
                handle = stack.enter_context(safe_open(str(file), framework="pt"))
                for key in names:
                    out[key] = handle.get_tensor(key)
            yield out
            out.clear()


def match_names(names: dict[int, list[str]], keys: set[str]) -> tuple[dict[int, str], str]:
    """Find each parameter's tensor among ``keys`` through one common prefix.

    Args:
        names: every name of each parameter, by parameter id.
        keys: the tensor names of the folder.

    Returns:
        The tensor name of each parameter found, and the prefix taken off the module's names.
    """
    votes: Counter[str] = Counter()
    for aliases in names.values():
        found = set()
        for alias in aliases:
            norm = _normalize(alias)
            cut = 0
            while True:
                if norm[cut:] in keys:
                    found.add(norm[:cut])
                dot = norm.find(".", cut)
                if dot < 0:
                    break
                cut = dot + 1
        votes.update(found)
    if not votes:
        return {}, ""
    prefix = min(votes, key=lambda p: (-votes[p], len(p)))
    mapping = {}
    for pid, aliases in names.items():
        for alias in aliases:
            norm = _normalize(alias)
            if norm.startswith(prefix) and norm[len(prefix):] in keys:
                mapping[pid] = norm[len(prefix):]
                break
    return mapping, prefix


class PretrainedSource(ValueSource):
    """The first values of a model's parameters from a :class:`PretrainedFolder` (see the module docstring).

    Args:
        folder: the folder (or its path).
    """

    def __init__(self, folder: PretrainedFolder | str | os.PathLike[str]) -> None:
        self.folder = folder if isinstance(folder, PretrainedFolder) else PretrainedFolder(folder)
        self.description = f"loading {self.folder.path}"
        self._keys: dict[int, str] = {}
        self._buffers: dict[str, str] = {}

    def prepare(self, names: dict[int, list[str]], layout: Layout, buffers: Sequence[str] = ()) -> None:
        entries = self.folder.entries
        self._keys, prefix = match_names(names, set(entries))
        if not self._keys:
            some = sorted(entries)[:3]
            raise RatelConfigError(
                f"none of the model's parameters (e.g. {_listing([n[0] for n in names.values()][:3])}) is in the "
                f"pretrained folder {self.folder.path} (which holds e.g. {_listing(some)}); is it the right model?")
        slots = {id(s.param): s for s in layout.slots}
        frozen = {id(sp.param) for s in layout.frozen_shards for sp in s.params}
        wrong = []
        for pid, key in self._keys.items():
            entry = entries[key]
            if tuple(entry.shape) != tuple(slots[pid].shape):
                wrong.append(f"{names[pid][0]} {tuple(slots[pid].shape)} vs {key} {tuple(entry.shape)}")
        if wrong:
            raise RatelConfigError(f"tensors of the pretrained folder {self.folder.path} do not have the shape of the "
                                   f"model's parameters: {_listing(wrong)}")
        missing = [names[pid][0] for pid in names if pid not in self._keys]
        missing_frozen = [names[pid][0] for pid in names if pid not in self._keys and pid in frozen]
        if missing_frozen:
            raise RatelConfigError(
                f"frozen parameters are not in the pretrained folder {self.folder.path} (looked up without the prefix "
                f"{prefix!r}): {_listing(missing_frozen)}. A frozen parameter would keep its random initialization; "
                "check the folder, or make the parameters trainable if they are new.")
        if missing:
            rank_zero_info(f"RatelStrategy: {len(missing)} trainable parameters are not in {self.folder.path} and are "
                           f"initialized: {_listing(missing)}")
        self._buffers = {}
        for name in buffers:
            norm = _normalize(name)
            if norm.startswith(prefix) and norm[len(prefix):] in entries:
                self._buffers[name] = norm[len(prefix):]
        # Every name the model has for its tensors (tied aliases included), as transformers matches them.
        known = {_normalize(a)[len(prefix):] for aliases in names.values() for a in aliases
                 if _normalize(a).startswith(prefix)}
        unused = sorted(set(entries) - known - set(self._buffers.values()))
        if unused:
            rank_zero_warn(f"RatelStrategy: {len(unused)} tensors of the pretrained folder {self.folder.path} match no "
                           f"parameter or buffer of the model and are not used: {_listing(unused)}. Check that the "
                           "folder is the model's (as transformers' from_pretrained reports them).")

    def provides(self, param: nn.Parameter) -> bool:
        return id(param) in self._keys

    def prefetch(self, slots: Sequence[ParamSlot]) -> None:
        self.folder.prefetch([self._keys[id(s.param)] for s in slots if id(s.param) in self._keys])

    @contextlib.contextmanager
    def read(self, slots: Sequence[ParamSlot]) -> Iterator[dict[int, SourceValue]]:
        wanted = {id(s.param): self._keys[id(s.param)] for s in slots if id(s.param) in self._keys}
        with self.folder.read(list(wanted.values())) as tensors:
            yield {pid: SourceValue(tensors[key]) for pid, key in wanted.items()}

    def buffers(self) -> dict[str, torch.Tensor]:
        with self.folder.read(list(self._buffers.values())) as tensors:
            return {name: tensors[key].clone() for name, key in self._buffers.items()}

    def pretrained_key(self, param: nn.Parameter) -> str | None:
        return self._keys.get(id(param))


class StateDictSource(ValueSource):
    """The first values from an ordinary ``state_dict`` (a full checkpoint loaded into a model on the meta device).

    Args:
        state_dict: tensors by the module's names (parameters and persistent buffers).
    """

    description = "loading the checkpoint"

    def __init__(self, state_dict: dict[str, Any]) -> None:
        self.state_dict = state_dict
        self._keys: dict[int, str] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    def prepare(self, names: dict[int, list[str]], layout: Layout, buffers: Sequence[str] = ()) -> None:
        slots = {id(s.param): s for s in layout.slots}
        missing, wrong = [], []
        for pid, aliases in names.items():
            key = next((a for a in aliases if a in self.state_dict), None)
            if key is None:
                missing.append(aliases[0])
            elif tuple(self.state_dict[key].shape) != tuple(slots[pid].shape):
                wrong.append(f"{key} {tuple(self.state_dict[key].shape)}")
            else:
                self._keys[pid] = key
        if missing or wrong:
            raise RatelConfigError(f"the checkpoint does not fit the model: missing {_listing(missing)}; wrong shape "
                                   f"{_listing(wrong)}")
        self._buffers = {n: self.state_dict[n] for n in buffers if n in self.state_dict}

    def provides(self, param: nn.Parameter) -> bool:
        return id(param) in self._keys

    @contextlib.contextmanager
    def read(self, slots: Sequence[ParamSlot]) -> Iterator[dict[int, SourceValue]]:
        yield {id(s.param): SourceValue(self.state_dict[self._keys[id(s.param)]]) for s in slots
               if id(s.param) in self._keys}

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)
