"""Checksums of the bytes the swap store and checkpoints write, verified when the bytes are read back.

:data:`WEIGHTED32` is the swap store's on the host: a sum that splits over any partition of a key, so the CPU AdamW
kernel adds it up while the new states are still in registers, and the store writes them without reading them once
more (:func:`block_checksums`). :data:`XXH3_64` (xxHash) runs over bytes in host memory, where the native extension is
not built. :func:`tensor_checksum` (:data:`INT64_WEIGHTED`) is computed with torch where a tensor lives, so the device
store checksums GPU memory without copying it to the host.
"""

from __future__ import annotations

import functools

import torch
import xxhash

try:
    from lightning_ratel import _C
except ImportError:
    _C = None

XXH3_64 = "xxh3_64"
"""Checksum of :class:`~lightning_ratel.runtime.storage.TensorStore`: xxHash XXH3, 64 bits, over a chunk's bytes in
host memory."""

INT64_WEIGHTED = "int64-weighted"
"""Checksum of :func:`tensor_checksum`, computed with torch where the tensor lives (the device store's)."""

WEIGHTED32 = "weighted32"
"""Checksum of :func:`weighted32_checksum`: each 32-bit word of a key times an odd weight of its index in the key,
summed modulo 2**64; the host store's where the native extension is built."""

BLOCK_BYTES = 4096
"""Bytes of a key each of :func:`block_checksums`' sums covers (the store's chunks start on multiples of it)."""



def blocks_of(nbytes: int) -> int:
    """How many :data:`BLOCK_BYTES` blocks (the last one partial) a key of ``nbytes`` has: one block sum each."""
    return -(-nbytes // BLOCK_BYTES)


# 2**32 divided by the golden ratio (csrc/checksum.h's SUM_GOLDEN).
_GOLDEN32 = 0x9E3779B1

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


def native_checksum() -> bool:
    """Whether :func:`weighted32_checksum` runs natively (the extension is built): the swap store then uses it."""
    return _C is not None


def weighted32_checksum(data: memoryview, key_offset: int = 0) -> int:
    """The :data:`WEIGHTED32` checksum of bytes in host memory that start ``key_offset`` bytes into their key.

    Word ``k`` of the key (its bytes ``4k`` to ``4k + 3``, little-endian, a partial last word padded with zeros) is
    multiplied by ``(k * 0x9E3779B1 mod 2**32) | 1`` and the products are summed modulo 2**64. A change confined to
    one word changes the sum (an odd weight times a nonzero difference below 2**32 is nonzero modulo 2**64); other
    damage goes unnoticed only by chance. The sum over a key's chunks is the key's sum, which is what lets the AdamW
    kernel compute it for the store (:func:`block_checksums`).

    Args:
        data: The bytes; ``key_offset`` must be a multiple of 4.
        key_offset: Where they start in their key.

    Returns:
        The checksum as a signed 64-bit integer.
    """
    if key_offset % 4:
        raise ValueError(f"key_offset must be a multiple of 4, got {key_offset}")
    if _C is not None:
        if not data.nbytes:
            return 0
        address = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
        return _C.checksum(address, data.nbytes, key_offset // 4)
    raw = torch.frombuffer(data, dtype=torch.uint8) if data.nbytes else torch.empty(0, dtype=torch.uint8)
    padded = torch.zeros(-(-raw.numel() // 4) * 4, dtype=torch.uint8)
    padded[: raw.numel()] = raw
    words = padded.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    index = torch.arange(key_offset // 4, key_offset // 4 + words.numel(), dtype=torch.int64)
    weights = ((index * _GOLDEN32) & 0xFFFFFFFF) | 1
    # int64 products and sums wrap modulo 2**64, as the native code's unsigned ones do.
    return int((words * weights).sum())


def block_checksums(sums: torch.Tensor, nbytes: int, stripe_bytes: int) -> list[int]:
    """Per chunk of ``stripe_bytes`` of a key of ``nbytes``, its :data:`WEIGHTED32` checksum from ``sums``, the
    checksums of the key's :data:`BLOCK_BYTES` blocks (as the AdamW kernel reports them)."""
    blocks = blocks_of(nbytes)
    if sums.dtype != torch.int64 or sums.numel() != blocks or stripe_bytes % BLOCK_BYTES:
        raise ValueError(f"need {blocks} int64 block sums of a key of {nbytes} bytes and a stripe of whole blocks")
    per_chunk = stripe_bytes // BLOCK_BYTES
    padded = torch.zeros(-(-blocks // per_chunk) * per_chunk, dtype=torch.int64)
    padded[:blocks] = sums
    return padded.view(-1, per_chunk).sum(dim=1).tolist()


@functools.lru_cache(maxsize=16)
def checksum_of_zeros(algorithm: str, nbytes: int) -> int:
    """What a chunk of ``nbytes`` that was reserved but never written holds: zeros (the file was created empty)."""
    if algorithm == XXH3_64:
        return xxhash.xxh3_64_intdigest(bytes(nbytes))
    return 0


def host_checksum(algorithm: str, data: memoryview, key_offset: int = 0) -> int:
    """The ``algorithm`` checksum of bytes in host memory, ``key_offset`` bytes into their key."""
    if algorithm == XXH3_64:
        return xxhash.xxh3_64_intdigest(data)
    if algorithm == WEIGHTED32:
        return weighted32_checksum(data, key_offset)
    return tensor_checksum(torch.frombuffer(data, dtype=torch.uint8))
