"""Checksums of the bytes the swap store and checkpoints write, verified when the bytes are read back.

:data:`XXH3_64` (xxHash) runs over bytes in host memory; :func:`tensor_checksum` (:data:`INT64_WEIGHTED`) is computed
with torch where a tensor lives, so the device store checksums GPU memory without copying it to the host.
"""

from __future__ import annotations

import functools

import torch
import xxhash

XXH3_64 = "xxh3_64"
"""Checksum of :class:`~lightning_ratel.runtime.storage.TensorStore`: xxHash XXH3, 64 bits, over a chunk's bytes in
host memory."""

INT64_WEIGHTED = "int64-weighted"
"""Checksum of :func:`tensor_checksum`, computed with torch where the tensor lives (the device store's)."""

# 2**64 divided by the golden ratio, as a signed 64-bit integer: consecutive multiples spread over all 64 bits.
_GOLDEN = -7046029254386353131


def tensor_checksum(data: torch.Tensor) -> int:
    """A 64-bit checksum of a 1-D ``uint8`` tensor, computed with torch where the tensor lives.

    Each 64-bit word (and each byte of a tail shorter than a word) is multiplied by an odd weight that depends on its
    position, and the products are summed modulo 2**64. A flipped bit changes one word by a power of two below 2**64,
    hence one product by a nonzero amount, so any single flipped bit changes the sum; a replaced block leaves it
    unchanged only by chance (about 2**-64 for random data). Integer sums are exact in any order, so the value is the
    same on every device and for every reduction strategy.

    Args:
        data: The bytes, on any device. Memory not aligned to 8 bytes is copied once.

    Returns:
        The checksum as a signed 64-bit integer.
    """
    count = data.numel()
    whole = count - count % 8
    if data.storage_offset() % 8 or data.data_ptr() % 8:
        data = data.clone()
    weights = torch.arange(whole // 8 + count - whole, dtype=torch.int64, device=data.device)
    weights.mul_(_GOLDEN).bitwise_or_(1)
    total = (data[:whole].view(torch.int64) * weights[: whole // 8]).sum()
    if whole < count:
        total = total + (data[whole:].to(torch.int64) * weights[whole // 8 :]).sum()
    return int(total)


@functools.lru_cache(maxsize=16)
def checksum_of_zeros(algorithm: str, nbytes: int) -> int:
    """What a chunk of ``nbytes`` that was reserved but never written holds: zeros (the file was created empty)."""
    if algorithm == XXH3_64:
        return xxhash.xxh3_64_intdigest(bytes(nbytes))
    return 0


def host_checksum(algorithm: str, data: memoryview) -> int:
    """The ``algorithm`` checksum of bytes in host memory."""
    if algorithm == XXH3_64:
        return xxhash.xxh3_64_intdigest(data)
    return tensor_checksum(torch.frombuffer(data, dtype=torch.uint8))
