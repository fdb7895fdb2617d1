"""The commit/abort ledger of the CPU optimizer: which state of each shard a step may read, and when a step commits.

Each shard's fp32 master and moments have two slots in the swap store. Its *committed* version is what the last
committed step left (what checkpoints read and what a failed run falls back to); its *latest* version is what the
next update reads: the committed one, or the output of an update of a step not committed yet, in the other slot.

Steps are numbered by boundary micro-batch. A step commits once the training thread has *decided* it (every gradient
is in and nothing can skip it any more) and every update queued for it has run; steps commit oldest first, and
commit moves each updated shard's committed version to its latest. An abort drops the open (undecided) step: its
queued updates never run, and the shards it already updated go back to their committed version, which the caller
then restores where the pager reads compute copies. A speculative step whose guess was wrong is aborted the same way
and then queued again: its redone updates read the committed slots, which nothing wrote since the last commit.

Pure bookkeeping: no threads, no I/O, so the protocol is tested on its own (``tests/test_ledger.py``). The CPU
optimizer's worker thread is its only user.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_ratel.runtime.units import Shard


@dataclass(frozen=True)
class ShardVersion:
    """One state of a shard in the store.

    Attributes:
        slot: which of the shard's two state slots holds it.
        steps: ``torch.optim.AdamW``'s step count of each parameter of the shard.
        moments: whether moments were ever written (otherwise they are zeros).
    """

    slot: int
    steps: tuple[int, ...]
    moments: bool

    def updated(self, steps: Sequence[int]) -> ShardVersion:
        """The version an update of this one writes: the other slot, the new step counts, moments written."""
        return ShardVersion(1 - self.slot, tuple(steps), True)


class StepLedger:
    """Committed and latest versions of every shard, and the steps that are open, decided or committed.

    Args:
        shards: every shard the optimizer holds.
    """

    def __init__(self, shards: Sequence[Shard]) -> None:
        self._committed = {s.index: ShardVersion(0, (0,) * len(s.params), False) for s in shards}
        self._latest = dict(self._committed)
        self.step = 0
        self._decided: set[int] = set()
        # Updates queued and not run, per step, and the shards they are for.
        self._queued: dict[int, int] = {}
        self._pending: set[int] = set()
        self._updated: dict[int, list[Shard]] = {}

    def committed(self, shard: Shard) -> ShardVersion:
        """The version of ``shard`` the last committed step left."""
        return self._committed[shard.index]

    def latest(self, shard: Shard) -> ShardVersion:
        """The version of ``shard`` its next update reads."""
        return self._latest[shard.index]

    def pending(self, shard: Shard) -> bool:
        """Whether an update of ``shard`` is queued and has not run: its state in the store is about to change."""
        return shard.index in self._pending

    def open_step(self) -> int:
        """Start the next step (a boundary micro-batch); returns its number."""
        self.step += 1
        return self.step

    def queue(self, shard: Shard) -> int:
        """An update of ``shard`` is queued in the current step; returns the step."""
        self._queued[self.step] = self._queued.get(self.step, 0) + 1
        self._pending.add(shard.index)
        return self.step

    def ran(self, shard: Shard, step: int, steps: Sequence[int]) -> ShardVersion:
        """The queued update of ``shard`` in ``step`` ran and left per-parameter step counts ``steps``; returns the
        version it wrote."""
        version = self._latest[shard.index].updated(steps)
        self._latest[shard.index] = version
        self._queued[step] -= 1
        self._pending.discard(shard.index)
        self._updated.setdefault(step, []).append(shard)
        return version

    def decide(self) -> None:
        """The training thread finished the current step: it will commit once its updates have run."""
        self._decided.add(self.step)

    def decided(self, step: int) -> bool:
        return step in self._decided

    def commit(self) -> list[int]:
        """Commit, oldest first, every decided step whose updates have all run; returns the steps committed."""
        done = []
        for step in sorted(self._decided):
            if self._queued.get(step, 0):
                break
            self._decided.discard(step)
            self._queued.pop(step, None)
            for shard in self._updated.pop(step, []):
                self._committed[shard.index] = self._latest[shard.index]
            done.append(step)
        return done

    def abort(self, dropped: Iterable[Shard]) -> tuple[int | None, list[Shard]]:
        """Abandon the open step's updates, if the training thread has not decided it. The step stays open: updates
        queued afterwards belong to it (a speculative step redone from the committed state).

        Args:
            dropped: the shards whose queued updates of that step will not run (the caller took them off its
                queues).

        Returns:
            The aborted step (``None`` where the current step is decided: it completes and commits), and the shards
            its updates already changed, now back at their committed version: the caller restores their values.
        """
        step = self.step
        if step in self._decided:
            return None, []
        for shard in dropped:
            self._pending.discard(shard.index)
        self._queued.pop(step, None)
        reverted = self._updated.pop(step, [])
        for shard in reverted:
            self._latest[shard.index] = self._committed[shard.index]
        return step, reverted

    def load(self, shard: Shard, steps: Sequence[int]) -> ShardVersion:
        """Moments and step counts of ``shard`` were written into its committed slot (from a checkpoint)."""
        version = ShardVersion(self._committed[shard.index].slot, tuple(steps), True)
        self._committed[shard.index] = self._latest[shard.index] = version
        return version
