"""Split a model into blocks: the units of parameter paging and activation placement.

The repeated layers (a transformers model's decoder layers, or the largest ``nn.ModuleList`` of same-class modules)
become one block each. Every parameter outside them lands in a block of its own module (embeddings, final norm, the
head), so the whole model is covered and no module has to change. A block is a module whose forward runs: the
children of an ``nn.ModuleList`` or ``nn.ModuleDict`` (diffusers' ``down_blocks``) are blocks, never the list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_ratel.config import BlockSpec
from lightning_ratel.errors import RatelConfigError


@dataclass
class Block:
    """A module whose forward pass pages in the parameters it uses.

    Attributes:
        index: position in discovery order.
        name: qualified module name (``""`` for the root).
        module: the module whose forward hooks drive paging.
        direct_only: the block holds only the module's own parameters, not its children's (a container that also
            contains other blocks).
        uses: every parameter the block's forward may touch, shared ones included.
    """

    index: int
    name: str
    module: nn.Module
    direct_only: bool
    uses: list[nn.Parameter] = field(default_factory=list)


class BlockMembership(Sequence[Block]):
    """The model's blocks and the units each block's forward uses: the one owner of both, changed only through
    :meth:`adopt` and :meth:`add`.

    It starts from the frozen :attr:`~lightning_ratel.runtime.units.Layout.block_units`. A forward found using a
    parameter of another block (see :mod:`lightning_ratel.runtime.escapes`) makes that unit part of the block, or a
    module running outside every block a block of its own; whoever keeps per-block state registers with
    :meth:`on_add`. The pager, the scheduler and the planner read membership through this object and never hold its
    lists.

    Args:
        blocks: the blocks found at setup, in index order.
        block_units: for each of them, the units its forward uses.
    """

    def __init__(self, blocks: Sequence[Block], block_units: Sequence[Sequence[int]]) -> None:
        self._blocks = list(blocks)
        self._units = [tuple(units) for units in block_units]
        self._listeners: list[Callable[[Block], None]] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self._blocks)

    def __getitem__(self, index: int) -> Block:  # type: ignore[override]
        return self._blocks[index]

    def units_of(self, index: int) -> tuple[int, ...]:
        """The units block ``index``'s forward uses, sorted."""
        return self._units[index]

    def adopt(self, block: Block, unit: int, param: nn.Parameter) -> bool:
        """Make ``unit`` (holding ``param``) part of ``block`` from now on; returns whether it was not already."""
        if unit in self._units[block.index]:
            return False
        self._units[block.index] = tuple(sorted((*self._units[block.index], unit)))
        block.uses.append(param)
        return True

    def add(self, module: nn.Module, name: str) -> Block:
        """A new block of ``module``'s own parameters (none yet), announced to every :meth:`on_add` listener."""
        block = Block(len(self._blocks), name, module, direct_only=True)
        self._blocks.append(block)
        self._units.append(())
        for listener in self._listeners:
            listener(block)
        return block

    def on_add(self, listener: Callable[[Block], None]) -> None:
        """Call ``listener`` with each block :meth:`add` makes."""
        self._listeners.append(listener)


def _repeated_layers(model: nn.Module) -> list[str]:
    """Names of the children of the ``nn.ModuleList`` of same-class modules holding the most parameters."""
    best: list[str] = []
    best_numel = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel > best_numel:
            best_numel = numel
            best = [f"{name}.{i}" if name else str(i) for i in range(len(module))]
    return best


def discover_blocks(model: nn.Module, spec: BlockSpec = None) -> list[Block]:
    """Partition ``model``'s parameters into blocks.

    Args:
        model: the model (typically the LightningModule).
        spec: module names to use as the repeated blocks, a callable returning them, or ``None`` to detect them.

    Returns:
        Blocks in module registration order, covering every parameter.

    Raises:
        RatelConfigError: a name in ``spec`` is not a submodule, or block modules are nested.
    """
    modules = dict(model.named_modules())
    if spec is None:
        names = _repeated_layers(model)
    else:
        names = list(spec(model) if callable(spec) else spec)
        missing = [n for n in names if n not in modules]
        if missing:
            raise RatelConfigError(f"`blocks` names modules that the model does not have: {missing}")
    layer_names = set(names)
    for name in names:
        for other in names:
            if other != name and other.startswith(name + "."):
                raise RatelConfigError(f"`blocks` entries must not be nested: {name!r} contains {other!r}")

    def holds_layer(name: str) -> bool:
        prefix = name + "." if name else ""
        return any(n.startswith(prefix) for n in layer_names)

    blocks: list[Block] = []

    def visit(name: str, module: nn.Module) -> None:
        # A container without a forward of its own (nn.ModuleList, nn.ModuleDict) is never called, so hooks on it
        # never run: its children are the blocks.
        called = type(module).forward is not nn.Module.forward
        if name in layer_names or (called and not holds_layer(name) and any(True for _ in module.parameters())):
            blocks.append(Block(len(blocks), name, module, direct_only=False))
            return
        if any(True for _ in module.parameters(recurse=False)):
            blocks.append(Block(len(blocks), name, module, direct_only=True))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    for block in blocks:
        seen: set[int] = set()
        named = block.module.named_parameters(recurse=not block.direct_only, remove_duplicate=False)
        for _, p in named:
            if id(p) not in seen:
                seen.add(id(p))
                block.uses.append(p)
    return blocks
