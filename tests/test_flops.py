"""FLOP counting for the profile: attention with grouped key/value heads, on every backend, and ops nobody can count.

The count is advice to the planner and the reports; these tests pin that it is right for the attention of current
decoders (GQA) and that no op can make counting raise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ratel.runtime.flops import attention_flops, count_flops

# Llama's tiny test shapes: 4 query heads sharing 2 key/value heads.
B, HQ, HKV, L, E = 2, 4, 2, 16, 8


class Counting(TorchDispatchMode):
    """Sums :func:`count_flops` over every op that runs, as the profiling op tracker does."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total += count_flops(func, args, kwargs, out)
        self.ops.append(func.overloadpacket.__name__)
        return out


def test_attention_flops_of_grouped_heads_equal_those_of_expanded_heads():
    q = torch.empty(B, HQ, L, E, device="meta")
    k = v = torch.empty(B, HKV, L, E, device="meta")
    expanded = torch.empty(B, HQ, L, E, device="meta")
    assert attention_flops(q, k, v) == attention_flops(q, expanded, expanded) == 2 * B * HQ * L * L * 2 * E
    assert attention_flops(q, k, v, backward=True) == 2 * B * HQ * L * L * 5 * E


@pytest.mark.parametrize("heads_kv", [HQ, HKV])
def test_sdpa_on_cpu_is_counted(heads_kv):
    """torch's own counter has no rule for the CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) and so
    counts CPU attention as free; the forward and backward here count what the math says, for MHA and GQA."""
    q = torch.randn(B, HQ, L, E, requires_grad=True)
    k = torch.randn(B, heads_kv, L, E, requires_grad=True)
    v = torch.randn(B, heads_kv, L, E, requires_grad=True)
    counting = Counting()
    with counting:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads_kv != HQ)
    forward = 2 * B * HQ * L * L * 2 * E
    assert counting.total == forward, counting.ops
    with counting:
        out.sum().backward()
    assert counting.total >= forward + 2 * B * HQ * L * L * 4 * E, counting.ops


def test_attention_ops_of_every_backend_are_counted_on_meta_tensors():
    """The CUDA kernels' schemas, called with meta tensors: GQA shapes count right and never assert (torch's
    ``sdpa_flop_count`` asserts that key and value have the query's heads)."""
    q = torch.empty(B, HQ, L, E, device="meta")
    k = v = torch.empty(B, HKV, L, E, device="meta")
    forward = 2 * B * HQ * L * L * 2 * E
    names = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    ops = [getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)]
    assert ops
    for op in ops:
        assert count_flops(op, (q, k, v), {}, None) == forward, op
    backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    assert count_flops(backward, (q, q, k, v), {}, None) == 2 * B * HQ * L * L * 5 * E


def test_an_op_whose_rule_fails_counts_zero(monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("shapes are incompatible")

    from torch.utils import flop_counter

    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, broken)
    a = torch.randn(3, 4)
    assert count_flops(torch.ops.aten.mm.default, (a, a.T), {}, a @ a.T) == 0.0
    assert count_flops(torch.ops.aten.relu.default, (a,), {}, a.relu()) == 0.0
