"""The fast flattening of op arguments and results gives what torch's pytree gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

from lightning_ratel.runtime.trees import flatten, tensor_args, tensor_leaves

T = torch.zeros(2)
P = torch.nn.Parameter(torch.ones(3))
CASES: list[Any] = [
    T, P, None, 3, 2.5, True, "s", torch.float16, torch.device("cpu"),
    (T, T), [T, None], (T, 1, 2.0, None), (), [],
    # Answered by tree_flatten: nesting, dicts, a tuple subclass, a structseq.
    (T, [T, T]), {"a": T, "b": (T,)}, torch.Size([2, 3]), torch.max(torch.randn(3, 3), 0),
]


@pytest.mark.parametrize("tree", CASES, ids=lambda c: type(c).__name__)
def test_flatten_gives_tree_flattens_leaves_and_spec(tree: Any) -> None:
    leaves, spec = flatten(tree)
    want_leaves, want_spec = tree_flatten(tree)
    assert spec == want_spec
    assert len(leaves) == len(want_leaves) and all(a is b for a, b in zip(leaves, want_leaves))
    assert tensor_leaves(tree) == [t for t in want_leaves if isinstance(t, torch.Tensor)]


def test_tensor_args_finds_tensors_in_arguments_and_tensor_lists() -> None:
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    found = list(tensor_args((a, [b, None], 4, (c,)), {"out": a, "dim": 0}))
    assert [id(t) for t in found] == [id(a), id(b), id(c), id(a)]
