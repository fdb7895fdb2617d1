"""A store kept at the end of a run (``keep_swap_files``), opened again read-only.

A :class:`~lightning_ratel.runtime.storage.TensorStore` closed with ``keep_files=True`` marks its swap files ``kept``
and writes ``<name>.index.json`` (keys, chunk layout, checksums, the metadata it was given) beside the first one.
:class:`KeptStore` opens those files ``O_RDONLY`` and reads the index back: the tensors the run left, verified like
any other read, for an export or a conversion after the run (``ratel-convert``). Nothing in the directories is
created, changed or removed, also not at :meth:`~lightning_ratel.runtime.storage.TensorStore.close`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.runtime.checksum import INT64_WEIGHTED, WEIGHTED32, XXH3_64
from lightning_ratel.runtime.hostmem import ALIGNMENT
from lightning_ratel.runtime.storage import UNDEFINED, Chunk, Extent, PriorityPool, TensorStore
from lightning_ratel.runtime.swapfile import (
    FORMAT_VERSION,
    HEADER_BYTES,
    INDEX_FORMAT,
    SwapHeader,
    check_directory,
    check_unique,
    open_kept_file,
    resolve_directories,
)
from lightning_ratel.sizes import round_up


class KeptStore(TensorStore):
    """The swap files a store kept at its close, read-only.

    Reads verify the checksums the store recorded (whichever store kept the files: a device store's files are read
    into CPU tensors here too); :meth:`write`, :meth:`reserve` and :meth:`preallocate` raise
    :class:`~lightning_ratel.errors.RatelStoreError` with ``EROFS``. :meth:`keys` and :meth:`nbytes` list what is
    there, and :attr:`metadata` is what the store was given with :meth:`set_metadata` (for example how its keys map to
    model parameters, for an export from the kept files).

    Args:
        paths: The directories of the kept store, in any order (each file's header names its slot).
        name: The store's name.
        io_threads_per_path: I/O threads per directory.
        direct: As for :class:`~lightning_ratel.runtime.storage.TensorStore`.

    Raises:
        RatelConfigError: If a directory or swap file is missing, a file is not a swap file of ``name`` marked as
            kept, the files are not all of one run, a directory of that run is not among ``paths``, or the index is
            missing or does not match the files.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], name: str = "ratel", *, io_threads_per_path: int = 4,
                 direct: bool | None = None) -> None:
        directories = resolve_directories(paths, name)
        if io_threads_per_path < 1:
            raise RatelConfigError(f"io_threads_per_path must be at least 1, got {io_threads_per_path}")
        for directory in directories:
            check_directory(directory, name, writable=False)
        check_unique(directories)
        self._init_state(name, directories, ALIGNMENT, keep_files=True, verify=False, read_only=True)
        try:
            self._load_kept(direct)
            self._pool = PriorityPool(io_threads_per_path * len(directories), f"ratel-io-{name}")
        except BaseException as error:
            self._abandon(error)
            raise

    def _load_kept(self, direct: bool | None) -> None:
        """Open the kept files of the directories (any order) and the index; lay out their keys."""
        headers = []
        for directory in self._paths:
            swap, header = open_kept_file(directory / f"{self._name}.swap", self._name, direct)
            self._files.append(swap)
            headers.append(header)
        first = headers[0]
        for swap, header in zip(self._files, headers):
            if header.run_id != first.run_id:
                raise RatelConfigError(
                    f"The kept swap files {self._files[0].path} and {swap.path} come from different runs "
                    f"({first.describe()} and {header.describe()}); pass the directories of one run."
                )
        slots = sorted(header.slot for header in headers)
        if slots != list(range(first.files)):
            missing = sorted(set(range(first.files)) - set(slots))
            raise RatelConfigError(
                f"The kept store {self._name!r} of {first.describe()} has {first.files} swap files, but paths "
                f"{[str(d) for d in self._paths]} hold slots {slots}; add the directories of slots {missing}."
            )
        order = sorted(range(len(headers)), key=lambda i: headers[i].slot)
        self._files = [self._files[i] for i in order]
        self._paths = tuple(self._paths[i] for i in order)
        self._run_id = first.run_id
        self._created = first.created
        self._direct = all(f.direct for f in self._files)
        self._load_index(self._index_path(), first)

    def _load_index(self, path: Path, header: SwapHeader) -> None:
        """Read the index of a kept store and rebuild its extents and checksums from it."""
        try:
            with open(path, "rb") as file:
                index = json.loads(file.read())
        except FileNotFoundError:
            raise RatelConfigError(
                f"The kept store {self._name!r} of {header.describe()} has no index {path}; without it the layout "
                "of its keys is unknown."
            ) from None
        except (OSError, ValueError) as exc:
            raise RatelConfigError(f"The index {path} of a kept store cannot be read: {exc}") from exc

        def invalid(what: str) -> RatelConfigError:
            return RatelConfigError(f"The index {path} does not match the kept swap files: {what}.")

        if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
            raise invalid("it is not a lightning_ratel swap index")
        if index.get("version") != FORMAT_VERSION or index.get("name") != self._name:
            raise invalid(f"format version {index.get('version')!r} or store name {index.get('name')!r} differs")
        if index.get("run_id") != header.run_id:
            raise invalid(f"it is of run {index.get('run_id')!r}, the files of run {header.run_id}")
        stripe = index.get("stripe_bytes")
        if stripe != header.stripe_bytes or len(index.get("directories", ())) != header.files:
            raise invalid("its stripe size or number of directories differs from the file headers")
        algorithm = index.get("checksum")
        if algorithm not in (XXH3_64, WEIGHTED32, INT64_WEIGHTED, None):
            raise invalid(f"checksum algorithm {algorithm!r} is unknown")
        self._stripe_bytes = stripe
        self._verify = algorithm is not None
        self._algorithm = algorithm or self._checksum_algorithm
        keys = index.get("keys")
        if not isinstance(keys, dict):
            raise invalid("it lists no keys")
        metadata = index.get("metadata", {})
        if not isinstance(metadata, dict):
            raise invalid("its metadata is not a JSON object")
        self._metadata = metadata
        for key, entry in keys.items():
            try:
                self._extents[key] = self._kept_extent(entry, header.files)
            except (TypeError, ValueError, KeyError) as exc:
                raise invalid(f"the entry of key {key!r} is malformed ({exc})") from exc
            self._nbytes_reserved += entry["nbytes"]
        for extent in self._extents.values():
            for chunk in extent.chunks:
                self._tails[chunk.file] = max(self._tails[chunk.file], chunk.file_offset + chunk.disk_length)

    def _kept_extent(self, entry: dict[str, Any], files: int) -> Extent:
        nbytes = entry["nbytes"]
        listed = entry["chunks"]
        if not isinstance(nbytes, int) or nbytes < 0 or len(listed) != round_up(nbytes, self._stripe_bytes) // self._stripe_bytes:
            raise ValueError(f"{len(listed)} chunks for {nbytes!r} bytes")
        chunks = []
        sums: list[Any] = []
        for index, (file, file_offset, checksum) in enumerate(listed):
            if not (isinstance(file, int) and 0 <= file < files):
                raise ValueError(f"file {file!r}")
            if not isinstance(file_offset, int) or file_offset < HEADER_BYTES or file_offset % ALIGNMENT:
                raise ValueError(f"file offset {file_offset!r}")
            if isinstance(checksum, str):
                checksum = UNDEFINED[checksum]
            elif checksum is not None and not isinstance(checksum, int):
                raise ValueError(f"checksum {checksum!r}")
            key_offset = index * self._stripe_bytes
            length = min(self._stripe_bytes, nbytes - key_offset)
            chunks.append(Chunk(file, file_offset, key_offset, length, round_up(length, ALIGNMENT)))
            sums.append(checksum)
        return Extent(nbytes, tuple(chunks), sums)
