"""Byte sizes: parsed from what a user writes, formatted for messages, rounded up to an alignment, and taken by a
file or a folder."""

from __future__ import annotations

import os

from lightning_ratel.errors import RatelConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | str | None, name: str) -> int | None:
    """``None``, a byte count, or a string such as ``"24GiB"`` / ``"1.5 GB"`` -> bytes.

    Raises:
        RatelConfigError: ``value`` is not a positive size (``name`` says which setting it was).
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            value = int(float(number) * _UNITS[unit])
        except (ValueError, KeyError):
            raise RatelConfigError(f"`{name}` must be a byte count or a size like '24GiB', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RatelConfigError(f"`{name}` must be a positive byte count, got {value!r}")
    return value


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number at least 1."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def round_up(n: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple


def format_rate(nbytes: float, seconds: float) -> str:
    """``"<bytes> in <seconds> s (<rate>/s)"``, for the lasting line of a long pass."""
    rate = f" ({format_bytes(nbytes / seconds)}/s)" if seconds > 0 else ""
    return f"{format_bytes(nbytes)} in {seconds:.1f} s{rate}"


def path_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of a file, or of every file under a folder."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)
