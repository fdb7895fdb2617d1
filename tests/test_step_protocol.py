"""The step protocol between the precision plugin and the engine, with a stand-in engine: no Trainer, no threads.

What is decided where: the plugin passes on what the Trainer and the module ask for (clipping value and algorithm, a
custom ``configure_gradient_clipping``, fp16 loss scaling); :class:`~lightning_ratel.engine.coordinator.StepRule` decides from
that whether updates wait for the end of backward and how they clip; the plugin hands a clipping request made after
the closure to the engine and moves the fp16 loss scale as ``torch.amp.GradScaler`` does from whether the engine took
the step.
"""

from __future__ import annotations

import types
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_ratel.engine.coordinator import StepRule
from lightning_ratel.precision import RatelPrecision


class FakeEngine:
    """Records the calls of a step; ``taken`` is what ``finish_step`` answers."""

    def __init__(self, taken: bool = True) -> None:
        self.taken = taken
        self.calls: list[tuple[Any, ...]] = []

    def begin_step(self, optimizer: Any, clip_val: Any, clip_algorithm: str, custom_clipping: bool,
                   loss_scale: torch.Tensor | None) -> None:
        self.calls.append(("begin", clip_val, clip_algorithm, custom_clipping, loss_scale is not None))

    def finish_step(self, loss_scale: torch.Tensor | None = None) -> bool:
        self.calls.append(("finish", None if loss_scale is None else float(loss_scale)))
        return self.taken

    def request_clip(self, clip_val: float, algorithm: str) -> None:
        self.calls.append(("clip", clip_val, algorithm))

    def pre_backward(self) -> None:
        self.calls.append(("pre_backward",))

    def post_backward(self) -> None:
        self.calls.append(("post_backward",))

    def backward_stopped(self) -> None:
        self.calls.append(("backward_stopped",))


class Plain(pl.LightningModule):
    pass


class CustomClipping(pl.LightningModule):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def _model(cls: type[pl.LightningModule], clip_val: float | None = None, algorithm: str | None = None) -> Any:
    model = cls()
    # The Trainer holds the algorithm as Lightning's enum (None where it was not given).
    kind = GradClipAlgorithmType(algorithm) if algorithm is not None else None
    model._trainer = types.SimpleNamespace(gradient_clip_val=clip_val, gradient_clip_algorithm=kind)
    return model


def _plugin(precision: str, engine: FakeEngine, **kwargs: Any) -> RatelPrecision:
    """The plugin bound to ``engine``; Lightning's callback hooks after the closure are not part of this protocol."""
    plugin = RatelPrecision(precision, device="cpu", **kwargs)
    plugin.bind(engine, "cpu")
    plugin._after_closure = lambda model, optimizer: None  # type: ignore[method-assign]
    return plugin


def _step(precision: RatelPrecision, model: Any, loss: float = 1.0) -> torch.Tensor:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    return precision.optimizer_step(optimizer, model, lambda: torch.tensor(loss))


@pytest.mark.parametrize(
    ("cls", "clip_val", "algorithm", "precision", "passed"),
    [
        (Plain, None, None, "32-true", (None, "norm", False, False)),  # Lightning's default algorithm is the norm
        (Plain, 1.0, "value", "bf16-mixed", (1.0, "value", False, False)),
        (Plain, 1.0, "norm", "32-true", (1.0, "norm", False, False)),
        (CustomClipping, None, None, "32-true", (None, "norm", True, False)),
        (Plain, None, None, "16-mixed", (None, "norm", False, True)),
    ],
)
def test_the_plugin_passes_what_is_asked_for(cls, clip_val, algorithm, precision, passed):
    engine = FakeEngine()
    plugin = _plugin(precision, engine)
    _step(plugin, _model(cls, clip_val, algorithm))
    assert engine.calls[0] == ("begin", *passed)
    assert engine.calls[-1][0] == "finish"


@pytest.mark.parametrize(
    ("clip_val", "algorithm", "custom", "scaled", "overlap", "clip_value"),
    [
        (None, "norm", False, False, True, None),
        (0.0, "value", False, False, True, None),
        (1.0, "value", False, False, True, 1.0),  # element-wise: each shard clips its own gradients, overlapped
        (1.0, "norm", False, False, False, None),  # the norm needs every gradient
        (None, "norm", True, False, False, None),  # the module's own clipping may need every gradient
        (1.0, "value", True, False, False, None),  # ... and clips them itself, at the end of backward
        (None, "norm", False, True, False, None),  # an overflow check needs every gradient
        (1.0, "value", False, True, False, None),
    ],
)
def test_step_rule_without_speculation(clip_val, algorithm, custom, scaled, overlap, clip_value):
    rule = StepRule.decide(clip_val, algorithm, custom, scaled)
    assert (rule.overlap, rule.clip_value, rule.speculative) == (overlap, clip_value, False)


@pytest.mark.parametrize(
    ("clip_val", "algorithm", "custom", "scaled", "overlap", "speculative", "clip_value"),
    [
        (None, "norm", False, False, True, False, None),  # nothing global: plainly overlapped
        (1.0, "value", False, False, True, False, 1.0),
        (1.0, "norm", False, False, True, True, None),  # the norm is guessed to leave the gradients as they are
        (None, "norm", False, True, True, True, None),  # ... and so is the overflow check
        (1.0, "value", False, True, True, True, 1.0),  # unscaled, then clipped element-wise, shard by shard
        (None, "norm", True, False, False, False, None),  # the module's own clipping can do anything: deferred
        (1.0, "norm", True, True, False, False, None),
    ],
)
def test_step_rule_with_speculation(clip_val, algorithm, custom, scaled, overlap, speculative, clip_value):
    rule = StepRule.decide(clip_val, algorithm, custom, scaled, speculate=True)
    assert (rule.overlap, rule.speculative, rule.clip_value) == (overlap, speculative, clip_value)


@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.parametrize(
    ("clip_val", "algorithm", "custom", "scaled"),
    [
        (None, "norm", False, False),
        (1.0, "value", False, False),  # clipped at the end of backward (Lightning's clip_gradients), not per shard
        (1.0, "norm", False, False),
        (None, "norm", False, True),
        (1.0, "value", False, True),
        (None, "norm", True, False),
    ],
)
def test_step_rule_where_overlapping_cannot_pay(clip_val, algorithm, custom, scaled, speculate):
    """Where the cost model says overlapping cannot shorten the step (a run on the CPU), every step waits for the end
    of backward, and nothing is speculated."""
    rule = StepRule.decide(clip_val, algorithm, custom, scaled, speculate=speculate, overlap_pays=False)
    assert (rule.overlap, rule.speculative, rule.clip_value) == (False, False, None)


def test_a_clip_requested_in_the_closure_reaches_the_engine_before_the_step_finishes():
    engine = FakeEngine()
    plugin = _plugin("32-true", engine)
    model = _model(CustomClipping, 0.5, "norm")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])

    def closure() -> torch.Tensor:
        plugin.clip_gradients(optimizer, 0.5, "norm")
        return torch.tensor(1.0)

    plugin.optimizer_step(optimizer, model, closure)
    assert [call[0] for call in engine.calls] == ["begin", "clip", "finish"]
    assert engine.calls[1] == ("clip", 0.5, "norm")
    plugin.clip_gradients(optimizer, 0.0, "norm")  # nothing to clip: nothing asked
    assert len(engine.calls) == 3


def test_fp16_loss_scale_follows_gradscaler():
    engine = FakeEngine(taken=False)
    plugin = _plugin("16-mixed", engine, init_scale=1024.0, growth_interval=2)
    model = _model(Plain)
    _step(plugin, model)  # an overflow: the step is skipped and the scale backs off
    assert engine.calls[-1] == ("finish", 1024.0)
    assert float(plugin.loss_scale) == 512.0 and plugin.steps_skipped == 1
    engine.taken = True
    _step(plugin, model)
    _step(plugin, model)  # two steps without overflow: the scale grows
    assert float(plugin.loss_scale) == 1024.0
    assert plugin.state_dict() == {"scale": 1024.0, "growth_tracker": 0}


def test_a_step_without_an_engine_is_refused():
    plugin = RatelPrecision("32-true", device="cpu")
    with pytest.raises(RuntimeError, match="no engine is bound"):
        _step(plugin, _model(Plain))
