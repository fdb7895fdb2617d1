"""EscapeDetector below the Trainer: which forwards it watches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from lightning_ratel.runtime.escapes import EscapeDetector


class NoPlaceholders:
    """A pager stand-in with every parameter resident."""

    def placeholder_slot(self, tensor: torch.Tensor) -> None:
        return None


class Probe(nn.Module):
    """Records the innermost dispatch mode while its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.modes: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(_get_current_dispatch_mode())
        return self.linear(x)


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Probe() for _ in range(2))
        self.modes: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        self.modes.append(_get_current_dispatch_mode())
        return x


class Inner(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_unwatched_forwards_run_without_the_detector_and_the_rest_with_it() -> None:
    model = Parent()
    detector = EscapeDetector(NoPlaceholders(), unwatched=[model.blocks[0]],  # type: ignore[arg-type]
                              blocks=list(model.blocks))
    with detector:
        model(torch.randn(2, 4))
        assert _get_current_dispatch_mode() is detector
    assert model.blocks[0].modes == [None]
    assert model.blocks[1].modes == [detector]
    assert model.modes == [detector]
    assert detector.ran == {id(model.blocks[0]), id(model.blocks[1])}
    assert _get_current_dispatch_mode() is None


def test_a_mode_entered_above_the_detector_keeps_it_on_the_stack() -> None:
    model = Parent()
    detector = EscapeDetector(NoPlaceholders(), unwatched=list(model.blocks))  # type: ignore[arg-type]
    with detector, Inner() as inner:
        model(torch.randn(2, 4))
    # The detector was not on top, so it stayed (watching) under the user's mode; nothing was popped out of order.
    assert model.blocks[0].modes == [inner] and model.blocks[1].modes == [inner]
    assert _get_current_dispatch_mode() is None


def test_the_detector_comes_back_after_a_forward_that_raised() -> None:
    model = Parent()

    def boom(module: nn.Module, args: Any) -> None:
        raise ValueError("boom")

    model.blocks[0].linear.register_forward_pre_hook(boom)
    detector = EscapeDetector(NoPlaceholders(), unwatched=[model.blocks[0]])  # type: ignore[arg-type]
    try:
        with detector:
            try:
                model(torch.randn(2, 4))
            except ValueError:
                pass
            assert _get_current_dispatch_mode() is detector
    finally:
        assert _get_current_dispatch_mode() is None


def test_the_detector_leaves_cleanly_after_ctrl_c_in_an_unwatched_forward() -> None:
    """KeyboardInterrupt is not an ``Exception``: modules skip their always-called hooks for it, so the detector is
    still off the stack when it exits, and must not pop another mode (or an empty flag stack) in its place."""
    model = Parent()

    def ctrl_c(module: nn.Module, args: Any) -> None:
        raise KeyboardInterrupt

    model.blocks[0].linear.register_forward_pre_hook(ctrl_c)
    detector = EscapeDetector(NoPlaceholders(), unwatched=[model.blocks[0]])  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt), detector:
        model(torch.randn(2, 4))
    assert _get_current_dispatch_mode() is None
    # Usable again, and watching again.
    with detector:
        model.blocks[1](torch.randn(2, 4))
    assert model.blocks[1].modes[-1] is detector
    assert _get_current_dispatch_mode() is None
