"""From a user's activation policy or a plan to the runtime's per-block placements.

The words (tiers, the ``"input"`` and ``"*"`` ops, :data:`~lightning_ratel.tiers.Placement`) are defined in
:mod:`lightning_ratel.tiers`, below both the planner and the runtime; this module applies them to a model's blocks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.tiers import CONTAINER_OP, DEFAULT_TIER, INPUT_OP, TIERS, Placement, check_policy, stored

if TYPE_CHECKING:
    from lightning_ratel.engine.blocks import Block

def resolve_policies(blocks: Sequence[Block], policy: str | Mapping[str, str]) -> list[Placement]:
    """The placement of each block: one policy for all, or the first matching ``fnmatch`` pattern (unmatched blocks
    stay on the device).

    ``recompute`` becomes an op-level placement (every op recomputed, the block's inputs kept): the replay then
    reruns the block's forward from its inputs, as activation checkpointing does. A container block cannot be
    replayed and keeps what it saves on the device.
    """
    check_policy(policy)
    patterns = {"*": policy} if isinstance(policy, str) else dict(policy)
    resolved: list[Placement] = []
    for block in blocks:
        pattern = _first_match(block.name, patterns)
        tier = DEFAULT_TIER if pattern is None or patterns[pattern] == "keep" else patterns[pattern]
        if tier == "recompute":
            resolved.append(DEFAULT_TIER if block.direct_only else {CONTAINER_OP: "recompute", INPUT_OP: "device"})
        else:
            resolved.append(tier)
    return resolved


def _first_match(name: str, patterns: Mapping[str, str]) -> str | None:
    """The first of ``patterns`` that matches block ``name`` (the one that places it), or ``None``."""
    return next((pattern for pattern in patterns if fnmatch.fnmatchcase(name, pattern)), None)


def check_patterns(blocks: Sequence[Block], policy: str | Mapping[str, str]) -> None:
    """Raise :class:`RatelConfigError` for a pattern of ``policy`` that places no block of ``blocks``: a typo there
    would otherwise leave the blocks it meant on the device without a word."""
    if isinstance(policy, str):
        return
    chosen = {_first_match(block.name, policy) for block in blocks}
    # A closing "*" (the default for the rest) is no typo when earlier patterns happen to take every block.
    unused = [pattern for pattern in policy if pattern not in chosen and pattern != "*"]
    if not unused:
        return
    shadowed = [p for p in unused if any(fnmatch.fnmatchcase(block.name, p) for block in blocks)]
    names = [block.name for block in blocks]
    shown = ", ".join(names) if len(names) <= 12 else f"{', '.join(names[:8])}, ... {', '.join(names[-2:])}"
    problems = []
    if len(shadowed) < len(unused):
        problems.append(f"{[p for p in unused if p not in shadowed]} match no block")
    if shadowed:
        problems.append(f"{shadowed} only match blocks an earlier pattern already places (the first match wins)")
    raise RatelConfigError(
        f"`activation_policy` patterns {' and '.join(problems)}. The model's {len(names)} blocks are: {shown}. "
        "Patterns are fnmatch patterns over these names (`*` matches dots too), e.g. '*layers.0' or '*layers.*'.")


def profiling_placements(blocks: Sequence[Block]) -> list[Placement]:
    """The safe default a first step is profiled under: least device memory without SSD traffic.

    Each block's inputs (and everything a container block saves) go to host memory, everything else is recomputed,
    so a block's backward replays its forward and every op's time and saved bytes can be measured.
    """
    return ["host" if block.direct_only else {INPUT_OP: "host", CONTAINER_OP: "recompute"} for block in blocks]


def plan_placements(blocks: Sequence[Block], placement: Mapping[str, str]) -> list[Placement]:
    """Per-block placements from a plan's ``"<block>/<op>"`` -> tier mapping.

    A container block cannot be tracked op by op; its ``"<block>/*"`` entry (or ``device``) applies to everything it
    saves. Ops the plan does not name stay on the device, and a block whose ops all stay is not tracked.
    """
    by_block: dict[str, dict[str, str]] = {}
    for key, tier in placement.items():
        if tier not in TIERS:
            raise RatelConfigError(f"the plan places {key!r} on {tier!r}, which is not one of {', '.join(TIERS)}")
        block, _, op = key.rpartition("/")
        by_block.setdefault(block, {})[op] = tier
    resolved: list[Placement] = []
    for block in blocks:
        ops = by_block.get(block.name, {})
        if block.direct_only or not ops:
            resolved.append(stored(ops.get(CONTAINER_OP, DEFAULT_TIER)))
        elif set(ops.values()) == {DEFAULT_TIER}:
            # Everything stays: no op needs to be told apart, so the forward runs without op tracking.
            resolved.append(DEFAULT_TIER)
        else:
            resolved.append(ops)
    return resolved
