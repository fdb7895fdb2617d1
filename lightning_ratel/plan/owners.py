"""Which rank owns each unit's optimizer states when several ranks train data parallel (pure Python).

Every unit's fp32 master, its optimizer states and their CPU update belong to one rank, so that the ranks together hold
each state once. A rank's share costs it disk (and host buffer) bytes and CPU time for the updates; the two need not be
proportional (an fp32 shard whose master is its host copy keeps no master on disk, another optimizer than AdamW keeps
other states), so the balance is over both: units are taken largest first and each goes to the rank whose larger
relative load (bytes or time, as a fraction of the whole) stays lowest, ties to the lower rank. The result only depends
on the numbers, so every rank computes the same owners without talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class UnitCost:
    """What owning one unit costs a rank.

    Attributes:
        unit: the unit's index.
        nbytes: bytes of its optimizer states on disk (both slots) and in host buffers.
        work: the CPU time of its update, in any unit common to all (elements updated for AdamW).
    """

    unit: int
    nbytes: int
    work: float


def assign_owners(costs: Sequence[UnitCost], ranks: int) -> dict[int, int]:
    """Give each unit an owner rank, balancing bytes and CPU time over ``ranks``.

    Args:
        costs: every unit that has optimizer states.
        ranks: the number of ranks (the world size).

    Returns:
        The owner rank of every unit in ``costs``, by unit index.

    Raises:
        ValueError: ``ranks`` is not positive.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    total_bytes = sum(c.nbytes for c in costs) or 1
    total_work = sum(c.work for c in costs) or 1.0
    loads = [(0, 0.0)] * ranks
    owners: dict[int, int] = {}
    # Largest first (the greedy rule's guarantee needs it); equal costs by unit index, so the order is total.
    for cost in sorted(costs, key=lambda c: (-max(c.nbytes / total_bytes, c.work / total_work), c.unit)):

        def after(rank: int, cost: UnitCost = cost) -> float:
            nbytes, work = loads[rank]
            return max((nbytes + cost.nbytes) / total_bytes, (work + cost.work) / total_work)

        rank = min(range(ranks), key=lambda r: (after(r), r))
        nbytes, work = loads[rank]
        loads[rank] = (nbytes + cost.nbytes, work + cost.work)
        owners[cost.unit] = rank
    return owners


def imbalance(costs: Sequence[UnitCost], owners: dict[int, int], ranks: int) -> tuple[float, float]:
    """The largest rank's share of the bytes and of the CPU time over an even share (1.0: perfectly even).

    Args:
        costs: the units' costs.
        owners: their owners (:func:`assign_owners`).
        ranks: the number of ranks.
    """
    nbytes = [0] * ranks
    work = [0.0] * ranks
    for cost in costs:
        nbytes[owners[cost.unit]] += cost.nbytes
        work[owners[cost.unit]] += cost.work
    total_bytes = sum(nbytes) or 1
    total_work = sum(work) or 1.0
    return max(nbytes) * ranks / total_bytes, max(work) * ranks / total_work
