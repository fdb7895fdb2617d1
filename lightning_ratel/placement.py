"""The vocabulary of activation placement, shared by the planner and the runtime.

A saved activation lives in one of four *tiers* between forward and backward: kept on the ``device``, copied to
``host`` memory, written to the ``ssd`` swap files, or dropped and ``recompute``-d in backward. A *plan* names a tier
per op, keyed ``"<block>/<op>"``, where ``"input"`` stands for the block's inputs (the starting point of any
recomputation, so never recomputed themselves) and ``"*"`` for every op a block saves when it is handled as a whole (a
container block holding other blocks, whose ops cannot be told apart). The runtime places activations per block: one
tier for everything the block saves, or a mapping from op names to tiers (:data:`Placement`). This module turns a
user's policy or a plan into those per-block placements.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lightning_ratel.errors import RatelConfigError

if TYPE_CHECKING:
    from lightning_ratel.blocks import Block

TIERS = ("device", "host", "ssd", "recompute")
"""Where a saved activation can live between forward and backward."""
STORED_TIERS = ("device", "host", "ssd")
"""The tiers that keep an op's output (everything except ``"recompute"``)."""
POLICIES = ("keep", *TIERS)
"""Block-level policy names a user may give; ``"keep"`` is the older name of ``"device"``."""
INPUT_OP = "input"
"""The op standing for a block's inputs."""
CONTAINER_OP = "*"
"""The op standing for everything a block saves: the only op of a block handled as a whole, and in a runtime
placement the tier of the ops it does not name."""
DEFAULT_TIER = "device"
"""The tier of an op a placement does not mention (the activation cache keeps what it has no rule for)."""

Placement = str | dict[str, str]
"""One block's placement in the runtime: a tier for everything it saves, or op name -> tier."""


def placement_key(block: str, op: str) -> str:
    """The key of ``op`` of ``block`` in a plan's activation placement."""
    return f"{block}/{op}"


def stored(tier: str) -> str:
    """The tier of something that cannot be recomputed (a block's inputs, a block handled as a whole): ``"host"``
    stands in for ``"recompute"``, the cheapest tier that keeps the data without device memory."""
    return "host" if tier == "recompute" else tier


def check_policy(policy: str | Mapping[str, str]) -> None:
    """Raise :class:`RatelConfigError` unless ``policy`` is a policy name or a mapping of patterns to policy names."""
    if isinstance(policy, str):
        names = [policy]
    elif isinstance(policy, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in policy.items()):
        names = list(policy.values())
    else:
        raise RatelConfigError(
            f"`activation_policy` must be one of {POLICIES} or a mapping from block-name patterns to those, got "
            f"{policy!r}")
    bad = [name for name in names if name not in POLICIES]
    if bad:
        raise RatelConfigError(f"`activation_policy` values must be one of {POLICIES}, got {bad}")


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


def tier_of(placement: Placement, op: str | None) -> str:
    """The tier ``placement`` gives an op by name; ``None`` names the block's inputs."""
    if isinstance(placement, str):
        return placement
    if op is None:
        return stored(placement.get(INPUT_OP, "host"))
    return placement.get(op, placement.get(CONTAINER_OP, DEFAULT_TIER))
