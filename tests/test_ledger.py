"""The CPU optimizer's commit/abort protocol on its own: no threads, no store, no Trainer.

A step commits once it is decided and every update queued for it has ran, oldest step first; an abort undoes the open
step's updates and keeps a decided one; checkpoints load into the committed slot.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_ratel.runtime.ledger import ShardVersion, StepLedger
from lightning_ratel.runtime.units import Shard, ShardParam, Unit


def _shards(count: int = 3, params: int = 2) -> list[Shard]:
    shards = []
    for i in range(count):
        unit = Unit(i, (), {torch.float32: 4 * params})
        members = tuple(ShardParam(f"s{i}.p{k}", nn.Parameter(torch.zeros(4)), i * params + k, 4 * k, 4, (4,))
                        for k in range(params))
        shards.append(Shard(i, unit, 0, torch.float32, 0, members, 4 * params))
    return shards


def test_versions_alternate_slots():
    fresh = ShardVersion(0, (0, 0), False)
    assert fresh.updated([1, 1]) == ShardVersion(1, (1, 1), True)
    assert fresh.updated([1, 1]).updated([2, 1]) == ShardVersion(0, (2, 1), True)


def test_a_step_commits_when_decided_and_every_update_ran():
    a, b, c = _shards()
    ledger = StepLedger([a, b, c])
    step = ledger.open_step()
    ledger.queue(a)
    ledger.queue(b)
    ledger.ran(a, step, [1, 1])
    assert ledger.latest(a).slot == 1 and ledger.committed(a).slot == 0
    assert ledger.commit() == []  # not decided
    ledger.decide()
    assert ledger.commit() == []  # b's update has not run
    assert ledger.pending(b) and not ledger.pending(a)
    ledger.ran(b, step, [1, 1])
    assert ledger.commit() == [step]
    assert ledger.committed(a) == ledger.latest(a) == ShardVersion(1, (1, 1), True)
    assert ledger.committed(c) == ShardVersion(0, (0, 0), False)


def test_steps_commit_oldest_first():
    a, b, _ = _shards()
    ledger = StepLedger([a, b])
    first = ledger.open_step()
    ledger.queue(a)
    ledger.decide()
    second = ledger.open_step()
    ledger.queue(b)
    ledger.ran(b, second, [1, 1])
    ledger.decide()
    assert ledger.commit() == []  # the first step still waits for a's update
    assert ledger.committed(b).slot == 0
    ledger.ran(a, first, [1, 1])
    assert ledger.commit() == [first, second]
    assert ledger.committed(b).slot == 1


def test_abort_undoes_the_open_step_only():
    a, b, c = _shards()
    ledger = StepLedger([a, b, c])
    first = ledger.open_step()
    ledger.queue(a)
    ledger.ran(a, first, [1, 1])
    ledger.decide()
    ledger.commit()
    second = ledger.open_step()
    ledger.queue(a)
    ledger.queue(b)
    ledger.ran(a, second, [2, 2])
    step, reverted = ledger.abort([b])
    assert step == second and reverted == [a]
    assert ledger.latest(a) == ledger.committed(a) == ShardVersion(1, (1, 1), True)
    assert not ledger.pending(b)
    # The next step starts from the committed state and commits normally.
    third = ledger.open_step()
    ledger.queue(a)
    ledger.ran(a, third, [2, 2])
    ledger.decide()
    assert ledger.commit() == [third]
    assert ledger.committed(a) == ShardVersion(0, (2, 2), True)


def test_abort_keeps_a_decided_step():
    a, b, _ = _shards()
    ledger = StepLedger([a, b])
    step = ledger.open_step()
    ledger.queue(a)
    ledger.queue(b)
    ledger.ran(a, step, [1, 1])
    ledger.decide()
    assert ledger.abort([]) == (None, [])
    assert ledger.latest(a).slot == 1 and ledger.pending(b)
    ledger.ran(b, step, [1, 1])
    assert ledger.commit() == [step]


def test_a_loaded_checkpoint_is_committed():
    a, _, _ = _shards()
    ledger = StepLedger([a])
    version = ledger.load(a, [7, 7])
    assert version == ledger.committed(a) == ledger.latest(a) == ShardVersion(0, (7, 7), True)


def test_a_redone_step_reads_the_committed_slot_again_and_commits_once():
    """A speculative step whose guess was wrong: its updates are aborted (one ran, one was still queued), queued again
    in the same step, and the step then commits the redone versions."""
    a, b, _ = _shards()
    ledger = StepLedger([a, b])
    step = ledger.open_step()
    ledger.queue(a)
    ledger.queue(b)
    ledger.ran(a, step, [1, 1])
    aborted, reverted = ledger.abort([b])
    assert aborted == step and reverted == [a]
    assert ledger.latest(a) == ledger.committed(a) == ShardVersion(0, (0, 0), False)
    assert not ledger.pending(b)
    assert ledger.queue(a) == ledger.queue(b) == step
    assert ledger.ran(a, step, [1, 1]).slot == 1
    assert ledger.ran(b, step, [1, 1]).slot == 1
    ledger.decide()
    assert ledger.commit() == [step]
    assert ledger.committed(a) == ledger.committed(b) == ShardVersion(1, (1, 1), True)
