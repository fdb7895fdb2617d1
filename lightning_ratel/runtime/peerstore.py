"""Another rank's swap files, read where they are: the compute copies that the ranks of a node share.

With the compute copies in the swap files (``param_cache="ssd"``) every rank of a node pages every unit's copy in,
but only the unit's owner writes it. :class:`PeerStore` opens the owner's swap files read-only while the owner's run
has them open, and reads the keys the owner announced: their chunks once (:meth:`PeerStore.adopt`), the checksum of
each chunk after every write (:meth:`PeerStore.announce`). Reads go through the same direct I/O and the same checksum
checks as the owner's own, so bytes the owner is rewriting fail their check instead of reaching compute; a key not
announced yet cannot be read at all. Nothing here writes, reserves, locks or removes a file.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from lightning_ratel.errors import RatelStoreError
from lightning_ratel.runtime.storage import UNDEFINED, Extent, PriorityPool, TensorStore, _Undefined
from lightning_ratel.runtime.swapfile import open_peer_file

_UNANNOUNCED = _Undefined("unannounced", "the rank that writes it has not announced a write of it yet")


class PeerStore(TensorStore):
    """The swap files of another rank's live store, read-only.

    Args:
        paths: the other store's directories, in its order.
        name: its name.
        run_id: its run id (each file's header must carry it).
        stripe_bytes: its stripe size.
        algorithm: its checksum algorithm.
        io_threads_per_path: I/O threads per directory here.
        direct: as for :class:`~lightning_ratel.runtime.storage.TensorStore`.

    Raises:
        OSError: If a file cannot be opened.
        RatelConfigError: If a file is not that store's of that run.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], name: str, run_id: str, stripe_bytes: int,
                 algorithm: str, *, io_threads_per_path: int = 1, direct: bool | None = None) -> None:
        directories = [Path(p) for p in paths]
        self._init_state(name, directories, stripe_bytes, keep_files=True, verify=True, read_only=True)
        try:
            for directory in directories:
                self._files.append(open_peer_file(directory / f"{name}.swap", name, run_id, direct))
            self._run_id = run_id
            self._algorithm = algorithm
            self._direct = all(f.direct for f in self._files)
            self._pool = PriorityPool(io_threads_per_path * len(directories), f"ratel-io-{name}-peer")
        except BaseException as error:
            self._abandon(error)
            raise

    def adopt(self, key: str, extent: Extent) -> None:
        """Read ``key`` where ``extent`` (the other store's, :meth:`TensorStore.extent`) says it is, once announced."""
        with self._lock:
            self._extents[key] = Extent(extent.nbytes, extent.chunks, [_UNANNOUNCED] * len(extent.chunks))
            self._nbytes_reserved += extent.nbytes

    def announce(self, key: str, sums: Sequence[int | str | None]) -> None:
        """The other store wrote ``key``: its chunks' checksums are ``sums`` (:meth:`TensorStore.checksums`). Tensors
        that reads shared with ``share`` no longer stand for it."""
        with self._lock:
            extent = self._read_extent_locked(key, self._extents[key].nbytes)
            if len(sums) != len(extent.chunks):
                raise ValueError(f"{len(sums)} checksums announced for the {len(extent.chunks)} chunks of {key!r}")
            for entry in self._shares.get(key, ()):
                entry.stale = True
        with self._sums_lock:
            extent.sums[:] = [UNDEFINED[s] if isinstance(s, str) else s for s in sums]

    def _check_writable(self, operation: str) -> None:
        raise RatelStoreError(errno.EROFS, f"{operation} refused: {self._name!r} is another rank's store, read here "
                              "only", str(self._paths[0]))
