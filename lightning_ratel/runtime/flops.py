"""Floating-point operations of one aten op, for the profile.

A count is advice (the recompute figures of the report and the benchmarks); it must never stop training. torch's
``flop_registry`` asserts on grouped-query attention (key and value with fewer heads than the query, as in Llama 3,
Qwen2, Mistral, Gemma) and has no entry for the CPU kernel of scaled dot-product attention, so attention is counted
here for every backend: a query head attends to its group's key/value head with the same work as in plain multi-head
attention. Like torch's counter, a causal mask is not subtracted. Any other op goes to torch's registry, and an op it
cannot count counts as zero.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

_log = logging.getLogger(__name__)


def _ops(*names: str) -> frozenset[Any]:
    """The overload packets of ``names`` that this torch has."""
    return frozenset(op for op in (getattr(torch.ops.aten, name, None) for name in names) if op is not None)


# query, key, value are the first three arguments, laid out (batch, heads, sequence, head dim).
_ATTENTION_FORWARD = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
# The gradient of the output comes first, then query, key, value.
_ATTENTION_BACKWARD = _ops("_scaled_dot_product_flash_attention_backward",
                           "_scaled_dot_product_flash_attention_for_cpu_backward",
                           "_scaled_dot_product_efficient_attention_backward",
                           "_scaled_dot_product_cudnn_attention_backward")


def attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backward: bool = False) -> int:
    """FLOPs of scaled dot-product attention with any number of key/value heads dividing the query heads.

    Args:
        query: ``(..., query heads, query length, head dim)``.
        key: ``(..., key/value heads, key length, head dim)``.
        value: ``(..., key/value heads, key length, value head dim)``.
        backward: count the backward pass (which recomputes the scores) instead of the forward.

    Returns:
        Two FLOPs per multiply-add of the matrix products; the softmax is not counted.
    """
    *batch, heads, length, dim = query.shape
    keys, value_dim = key.shape[-2], value.shape[-1]
    rows = heads * length * keys
    for size in batch:
        rows *= size
    if backward:
        # Scores again, then the gradients of the probabilities, value, query and key.
        return 2 * rows * (3 * dim + 2 * value_dim)
    return 2 * rows * (dim + value_dim)


def count_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """FLOPs of one call of the aten op ``func`` that returned ``out``; 0.0 where it cannot be counted."""
    packet = func.overloadpacket
    try:
        if packet in _ATTENTION_FORWARD:
            return float(attention_flops(*args[:3]))
        if packet in _ATTENTION_BACKWARD:
            return float(attention_flops(*args[1:4], backward=True))
        counter = flop_registry.get(packet)
        return 0.0 if counter is None else float(counter(*args, **kwargs, out_val=out))
    except Exception as exc:  # a counting rule that does not know these shapes: the run goes on, uncounted
        _log.debug("no FLOP count for %s: %s: %s", func, type(exc).__name__, exc)
        return 0.0
