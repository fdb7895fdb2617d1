"""The vocabulary of placement, shared by the planner, the runtime and the coordinator (it imports nothing of theirs).

A saved activation lives in one of four *tiers* between forward and backward: kept on the ``device``, copied to
``host`` memory, written to the ``ssd`` swap files, or dropped and ``recompute``-d in backward. A *plan* names a tier
per op, keyed ``"<block>/<op>"``, where ``"input"`` stands for the block's inputs (the starting point of any
recomputation, so never recomputed themselves) and ``"*"`` for every op a block saves when it is handled as a whole (a
container block holding other blocks, whose ops cannot be told apart). The runtime places activations per block: one
tier for everything the block saves, or a mapping from op names to tiers (:data:`Placement`).

The compute copies of the parameters live between uses in a *parameter cache*: host memory or the swap files. The
optimizer states of each shard (fp32 master, moments) live in a *state tier*: host memory or the swap files, or the
device itself, where the shard's update runs too and its unit's compute copy stays resident.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from lightning_ratel.errors import RatelConfigError

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


ParamCache = Literal["auto", "host", "ssd"]
"""Where a user asks the compute copies to live between uses; ``"auto"`` lets the run choose."""
PARAM_CACHES: tuple[ParamCache, ...] = ("auto", "host", "ssd")
"""Every :data:`ParamCache` a user may give."""
PARAM_CACHE_TIERS: tuple[ParamCache, ...] = ("host", "ssd")
"""The parameter caches a run actually uses, once ``"auto"`` is decided."""


def tier_of(placement: Placement, op: str | None) -> str:
    """The tier ``placement`` gives an op by name; ``None`` names the block's inputs."""
    if isinstance(placement, str):
        return placement
    if op is None:
        return stored(placement.get(INPUT_OP, "host"))
    return placement.get(op, placement.get(CONTAINER_OP, DEFAULT_TIER))


StateTier = Literal["device", "host", "ssd"]
"""Where one shard's optimizer states (fp32 master and moments, both slots) live."""
OptimizerStates = Literal["auto", "device", "host", "ssd"]
"""Where a user asks the optimizer states to live; ``"auto"`` keeps in host memory what the budget holds."""
OPTIMIZER_STATES: tuple[OptimizerStates, ...] = ("auto", "device", "host", "ssd")
"""Every :data:`OptimizerStates` a user may give."""
