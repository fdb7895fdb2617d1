"""Flattening what ops take and return, fast for the shapes ATen ops and block forwards use.

The dispatch modes and hooks here see every op of a watched or tracked forward, and every block's output. torch's
``tree_flatten`` is general (dicts, dataclasses, registered nodes) and costs tens of microseconds even for a single
tensor, several times the op itself on a GPU; these functions answer the common shapes directly (a tensor, a flat
tuple or list of leaves) with exactly what ``tree_flatten`` gives, and hand anything else to it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

# What ``tree_flatten`` treats as leaves that may sit in a flat tuple or list answered here; any other item (a
# container, a registered node) sends the whole value to ``tree_flatten``.
_LEAF_TYPES = (torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, complex, str, torch.dtype,
               torch.device, torch.layout, torch.memory_format)
_LEAF_SPEC = tree_flatten(0)[1]


@functools.cache
def _flat_spec(kind: type, length: int) -> TreeSpec:
    """The spec ``tree_flatten`` gives a ``kind`` (tuple or list) of ``length`` leaves."""
    return tree_flatten(kind(range(length)))[1]


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """``tree_flatten(tree)``: the same leaves and spec."""
    kind = type(tree)
    if kind in _LEAF_TYPES:
        return [tree], _LEAF_SPEC
    if (kind is tuple or kind is list) and all(type(item) in _LEAF_TYPES for item in tree):
        return list(tree), _flat_spec(kind, len(tree))
    return tree_flatten(tree)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors among ``tree_flatten(tree)``'s leaves, in order."""
    return [t for t in flatten(tree)[0] if isinstance(t, torch.Tensor)]


def tensor_args(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an ATen op's arguments: tensors, and tensors in lists (``Tensor[]``, ``Tensor?[]``), the only
    nesting an operator schema has."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
