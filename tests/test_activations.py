"""The activation cache on its own: what each tier does with a saved tensor, parameter views, deduplication."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_ratel.engine.blocks import discover_blocks
from lightning_ratel.engine.layout import build_layout
from lightning_ratel.engine.materialize import Materializer
from lightning_ratel.runtime.activations import ActivationCache
from lightning_ratel.runtime.device import Device
from lightning_ratel.runtime.pager import ParameterPager
from lightning_ratel.runtime.storage import TensorStore


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    net = Net()
    x = x.clone().requires_grad_()
    (torch.tanh(net.layers[0](x)) ** 2).sum().backward()
    return x.grad, net.layers[0].weight.grad


def _setup(tmp_path: Path, placement: str) -> tuple[Net, ParameterPager, ActivationCache, TensorStore]:
    net = Net()
    device = Device(torch.device("cpu"))
    blocks = discover_blocks(net)
    layout = build_layout(net, blocks, None, None, "host", None, device.host_empty)
    Materializer(net, blocks, layout, device.device, None).load(None)
    pager = ParameterPager(device, layout.units, layout.block_units.__getitem__)
    store = TensorStore([tmp_path], name="act")
    cache = ActivationCache(device, pager, [placement] * len(blocks), lambda: store)
    return net, pager, cache, store


def _forward(net: Net, cache: ActivationCache, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block 0's forward on a copy of ``x`` under the cache's hooks: the input that takes the gradient, the output."""
    xg = x.clone().requires_grad_()
    with cache.hooks(0):
        y = torch.tanh(net.layers[0](xg)) ** 2
    return xg, y


def _land_writes(cache: ActivationCache) -> None:
    """Let every write land, which drops its in-memory copy: backward must read the tensors back."""
    for write in cache._pending_writes:
        write.result()


@pytest.mark.parametrize("placement", ["device", "host", "ssd"])
def test_each_tier_gives_backward_the_saved_values(tmp_path: Path, placement: str) -> None:
    x = torch.randn(16, 64)
    net, pager, cache, store = _setup(tmp_path, placement)
    try:
        pager.acquire(0)
        xg, y = _forward(net, cache, x)
        y.sum().backward()
        cache.end_pass()
        expected_x, expected_w = _reference(x)
        assert torch.equal(xg.grad, expected_x)
        assert torch.equal(net.layers[0].weight.grad, expected_w)
        assert (cache.ssd_bytes > 0) == (placement == "ssd")
        assert (store.bytes_written > 0) == (placement == "ssd")
    finally:
        cache.close()
        store.close()


def test_parameter_views_are_references_rebuilt_from_the_resident_copy(tmp_path: Path) -> None:
    x = torch.randn(16, 64)
    net, pager, cache, store = _setup(tmp_path, "host")
    try:
        pager.acquire(0)
        xg = x.clone().requires_grad_()
        with cache.hooks(0):
            y = (torch.tanh(net.layers[0](xg)) ** 2).sum()
        # Nothing keeps the weight itself alive for backward: it is paged in again when backward needs it.
        pager.release(0)
        assert pager.resident_bytes == 0
        y.backward()
        assert pager.resident_bytes > 0
        pager.release_all()
        assert torch.equal(xg.grad, _reference(x)[0])
    finally:
        cache.close()
        store.close()


def test_a_tensor_saved_twice_is_stored_once(tmp_path: Path) -> None:
    x = torch.randn(32, 64, requires_grad=True)
    _, _, cache, store = _setup(tmp_path, "ssd")
    try:
        h = x * 2
        with cache.hooks(1):
            y = (h * h).sum()
        y.backward()
        cache.end_pass()
        assert cache.ssd_bytes == h.numel() * h.element_size()
        assert torch.equal(x.grad, 8 * x.detach())
    finally:
        cache.close()
        store.close()


def test_ssd_tensors_come_back_after_the_staging_copy_is_gone(tmp_path: Path) -> None:
    x = torch.randn(16, 64)
    net, pager, cache, store = _setup(tmp_path, "ssd")
    try:
        pager.acquire(0)
        xg, y = _forward(net, cache, x)
        _land_writes(cache)
        read = store.bytes_read
        cache.prefetch_block(0)
        y.sum().backward()
        assert store.bytes_read - read == cache.ssd_bytes > 0
        assert torch.equal(xg.grad, _reference(x)[0])
    finally:
        cache.close()
        store.close()


def test_ssd_read_backs_reuse_the_host_pools_memory_from_pass_to_pass(tmp_path: Path) -> None:
    """Every pass reads its swapped tensors back into buffers of the device's host pool (on the CPU too), which come
    back once backward and the cache are done with them: the next pass reads into the same memory, none is new."""
    x = torch.randn(16, 64)
    net, pager, cache, store = _setup(tmp_path, "ssd")
    pool = cache.device.pool
    sizes = []
    try:
        pager.acquire(0)
        before = pool.nbytes_in_use
        for _ in range(3):
            xg, y = _forward(net, cache, x)
            _land_writes(cache)
            read = store.bytes_read
            cache.prefetch_block(0)
            assert pool.nbytes_in_use > before
            y.sum().backward()
            cache.done_with(0)
            cache.end_pass()
            assert store.bytes_read - read == cache.ssd_bytes // (len(sizes) + 1) > 0
            assert torch.equal(xg.grad, _reference(x)[0])
            assert pool.nbytes_in_use == before
            sizes.append(pool.nbytes)
        assert sizes[0] > 0 and sizes == [sizes[0]] * 3
    finally:
        cache.close()
        store.close()


class _SavesTransposed(torch.autograd.Function):
    """Saves a transposed (non-contiguous) view and records the strides backward gets it back with."""

    strides: list[tuple[int, ...]] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x.t())
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        _SavesTransposed.strides.append(tuple(saved.stride()))
        return grad * saved.t()


@pytest.mark.parametrize("placement", ["host", "ssd"])
def test_saved_tensor_comes_back_with_its_strides(tmp_path: Path, placement: str, simulated_streams: None) -> None:
    """A copy comes back with the layout the tensor was saved with, not row-major: backward kernels take other paths
    on another layout (attention's transposed heads), and their results round differently from plain training's."""
    x = torch.randn(16, 64)
    _net, _pager, cache, store = _setup(tmp_path, placement)
    _SavesTransposed.strides = []
    try:
        xg = x.clone().requires_grad_()
        with cache.hooks(0):
            y = _SavesTransposed.apply(xg)
        y.sum().backward()
        cache.end_pass()
        assert _SavesTransposed.strides == [(1, 64)]
        assert torch.equal(xg.grad, x)
    finally:
        cache.close()
        store.close()
