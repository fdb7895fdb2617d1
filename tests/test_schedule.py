"""Block scheduling below the Trainer: forward and backward hooks drive the pager and the activation cache, and a
partial replay rebuilds recomputed activations bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_ratel.engine.blocks import discover_blocks
from lightning_ratel.engine.layout import build_layout
from lightning_ratel.engine.materialize import Materializer
from lightning_ratel.engine.placement import plan_placements, resolve_policies
from lightning_ratel.engine.schedule import BlockScheduler, TrainingState
from lightning_ratel.runtime import recompute
from lightning_ratel.runtime.activations import ActivationCache
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.storage import TensorStore
from lightning_ratel.runtime.timeline import Timeline


class Net(nn.Module):
    """The head is registered before the layers, but runs after them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 32)
        self.head = nn.Linear(32, 16)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


class Parts:
    def __init__(self, tmp_path: Path, prefetch_depth: int = 1) -> None:
        self.net = Net()
        self.device = Device(torch.device("cpu"))
        self.blocks = discover_blocks(self.net)
        self.layout = build_layout(self.net, self.blocks, None, None, "host", None, self.device.host_empty)
        Materializer(self.net, self.blocks, self.layout, self.device.device, None).load(None)
        self.pager = ParameterPager(self.device, self.layout.units, self.layout.block_units.__getitem__)
        self.store = TensorStore([tmp_path], name="act")
        self.cache = ActivationCache(self.device, self.pager, ["device"] * len(self.blocks), lambda: self.store)
        self.scheduler = BlockScheduler(self.blocks, self.pager, self.cache, self.device, prefetch_depth,
                                        Timeline())

    def step(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """One forward and backward as the engine runs them; the gradients by parameter name."""
        self.cache.end_pass()
        loss = self.net(ids)
        self.scheduler.begin_backward()
        loss.backward()
        self.scheduler.end_backward()
        self.cache.end_pass()
        grads = {n: p.grad.clone() for n, p in self.net.named_parameters()}
        self.net.zero_grad(set_to_none=True)
        return grads

    def close(self) -> None:
        self.scheduler.close()
        self.cache.close()
        self.store.close()


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    p = Parts(tmp_path)
    yield p
    p.close()


def _plain_grads(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    net = Net()
    net(ids).backward()
    return {n: p.grad for n, p in net.named_parameters()}


IDS = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("policy", ["device", "host", "ssd", "recompute"])
def test_each_policy_gives_plain_gradients(parts: Parts, policy: str) -> None:
    parts.cache.set_placements(resolve_policies(parts.blocks, {"layers.*": policy, "*": "host"}))
    expected = _plain_grads(IDS)
    for _ in range(2):
        grads = parts.step(IDS)
        for name, grad in expected.items():
            assert torch.equal(grads[name], grad), name
    assert (parts.cache.ssd_bytes > 0) == (policy == "ssd")


def test_execution_order_is_learned_and_states_follow_the_pass(parts: Parts) -> None:
    names = [b.name for b in parts.blocks]
    assert names.index("head") < names.index("layers.0")
    seen = []
    parts.net.head.register_forward_hook(lambda *_: seen.append(parts.scheduler.state))
    parts.net.embed.weight.register_hook(lambda g: seen.append(parts.scheduler.state))
    assert parts.scheduler.state is TrainingState.IDLE
    parts.step(IDS)
    assert seen == [TrainingState.FORWARD, TrainingState.BACKWARD]
    assert parts.scheduler.state is TrainingState.IDLE
    assert [parts.blocks[b].name for b in parts.scheduler.order] == [
        "embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


def test_backward_holds_its_block_and_prefetches_ahead(parts: Parts) -> None:
    parts.step(IDS)
    resident: list[set[int]] = []

    def snapshot(*_: object) -> None:
        resident.append({u for u in parts.layout.units if parts.pager.device_flat(u, torch.float32) is not None})

    for layer in parts.net.layers:
        layer[0].weight.register_hook(snapshot)
    parts.pager.peak_resident_bytes = 0
    parts.step(IDS)
    index = {b.name: b.index for b in parts.blocks}
    # When layer i's weight gradient is computed: layer i is held and layer i-1 is prefetched; layers behind are not.
    for i, units in zip(range(3, -1, -1), resident):
        assert index[f"layers.{i}"] in units
        if i > 0:
            assert index[f"layers.{i - 1}"] in units
        assert not any(index[f"layers.{j}"] in units for j in range(i + 1, 4))
    assert parts.pager.resident_bytes == 0
    largest = max(u.nbytes for u in parts.layout.units.values())
    assert parts.pager.peak_resident_bytes <= 3 * largest


def test_partial_replay_runs_only_what_the_discarded_tensors_need(parts: Parts, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    index = {b.name: b.index for b in parts.blocks}
    parts.cache.set_placements(resolve_policies(parts.blocks, {"layers.*": "recompute", "*": "host"}))
    parts.step(IDS)
    # Only the GELU's output is recomputed, from its input in host memory: one op per replay.
    placement = {f"layers.{i}/input": "host" for i in range(4)}
    placement.update({f"layers.{i}/0:addmm": "host" for i in range(4)})
    placement.update({f"layers.{i}/1:gelu": "recompute" for i in range(4)})
    parts.cache.set_placements(plan_placements(parts.blocks, placement))
    executed: list[int] = []
    original = recompute._Replayer.__torch_dispatch__

    def counting(self: recompute._Replayer, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.k in self.execute:
            executed.append(self.record.block)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(recompute._Replayer, "__torch_dispatch__", counting)
    grads = parts.step(IDS)
    for name, grad in _plain_grads(IDS).items():
        assert torch.equal(grads[name], grad), name
    assert sorted(executed) == sorted(index[f"layers.{i}"] for i in range(4))


def test_close_removes_every_hook(parts: Parts) -> None:
    parts.step(IDS)
    parts.scheduler.close()
    for block in parts.blocks:
        assert not block.module._forward_pre_hooks and not block.module._forward_hooks
