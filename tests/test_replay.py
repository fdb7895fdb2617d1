"""Recomputation replays a block's forward exactly: ops autograd issues, in-place writes, user clones, MoE models."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from lightning_ratel import Plan, RatelStrategy
from lightning_ratel.runtime import recompute
from tests.models import LM, MODELS, SEQ, VOCAB, compare_states, final_state, trainer

HIDDEN = 32


class _Normalize(nn.Module):
    """``x /= x.sum()``: autograd clones ``x`` before the write, since the division's backward needs the old value."""

    def __init__(self, user_clone: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.user_clone = user_clone

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.proj(h).abs() + 1.0
        # The user's own clone is the same op on the same tensor as autograd's, one op earlier.
        kept = x.clone() if self.user_clone else None
        x.div_(x.sum(-1, keepdim=True))
        return x * kept if kept is not None else x


class _NormalizeBlock(nn.Module):
    def __init__(self, user_clone: bool) -> None:
        super().__init__()
        self.norm = _Normalize(user_clone)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(self.norm(h))


class _SliceWriteBlock(nn.Module):
    """Fills a buffer through views of it: its value is the last write plus the writes before it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros_like(h)
        half = HIDDEN // 2
        buf[..., :half] = self.a(h)[..., :half]
        buf[..., half:] = self.b(h)[..., half:]
        return h + buf.sin()


class _ScaleHalfBlock(nn.Module):
    """Scales half of ``x`` in place through a view, after the op that returned ``x``, and then saves ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.proj(h) * 1.0
        x[..., : HIDDEN // 2].mul_(2.0)
        return h + x.sin() + (x * 3.0).cos()


class _InplaceReluBlock(nn.Module):
    """An in-place ReLU whose result is saved: a replay may hand the stored result back at the ``relu_``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu(self.proj(h), inplace=True)
        return h + (x * 3.0).sin()


class _EvalAttentionBlock(nn.Module):
    """Attention frozen in eval mode, which takes its fused path only when no input requires gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.attn.eval()
        return h + self.attn(h, h, h, need_weights=False)[0]


class _CountingBlock(nn.Module):
    """Runs an extra op on every other call, counted in an attribute of its own (which a replay sees as the forward
    did), or in a dict shared with the caller (which it cannot: its replay then runs other ops)."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.calls = 0
        self.shared = {"calls": 0} if shared else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            self.shared["calls"] += 1
            calls = self.shared["calls"]
        else:
            self.calls += 1
            calls = self.calls
        y = self.proj(h)
        if calls % 2:
            y = y * 2.0
        return h + y.sin()


class _RebindingBlock(nn.Module):
    """Updates a buffer and a tensor attribute by binding new tensors to them, not in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("ema", torch.zeros(HIDDEN))
        self.scale = torch.ones(())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.proj(h)
        with torch.no_grad():
            self.ema = 0.9 * self.ema + 0.1 * x.mean((0, 1))
            self.scale = self.scale * 1.1
        return h + (x + self.ema).sin() * self.scale


class _ScaleInputBlock(nn.Module):
    """Scales its own input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h.mul_(0.5)
        return h + self.proj(h).sin()


class _Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        loss = nn.functional.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss})()


class _ConvBNBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions with batch norm, the second BN a cumulative average
    (``momentum=None``, which reads ``num_batches_tracked``), and dropout between them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.bn1(self.conv1(x))))
        return torch.relu(x + self.bn2(self.conv2(y)))


class _ConvNet(nn.Module):
    """The tokens' embeddings as a 4x4 image of 8 channels through a list of conv + BN blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.layers = nn.ModuleList(_ConvBNBlock() for _ in range(2))
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.embed(input_ids).transpose(1, 2).reshape(-1, 8, 4, 4)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x.flatten(2).transpose(1, 2))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.view(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


class _SpectralNormBlock(nn.Module):
    """``spectral_norm`` both ways torch offers: a power iteration in a pre-hook writing buffers ``out=``, and a
    parametrization writing them while the weight is computed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.spectral_norm(nn.Linear(HIDDEN, HIDDEN))
        self.b = nn.utils.parametrizations.spectral_norm(nn.Linear(HIDDEN, HIDDEN))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(h)))


class _Cache:
    """A cache object a block fills in place (like a static KV cache)."""

    def __init__(self) -> None:
        self.keys = torch.zeros(2, SEQ, HIDDEN)


class _StatefulBlock(nn.Module):
    """Updates a buffer, a tensor attribute and a cache object in place, and reads each after the update."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("ema", torch.zeros(HIDDEN))
        self.calls = torch.zeros(())
        self.cache = _Cache()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.proj(h)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.mean((0, 1)), alpha=0.1)
            self.calls += 1
            self.cache.keys.mul_(0.5).add_(x)
        return h + (x + self.ema).sin() * self.calls + self.cache.keys.cos()


class _ComplexRotaryBlock(nn.Module):
    """Rotary embeddings by complex multiplication (``view_as_complex`` / ``view_as_real``, as Llama 4 and Meta's
    Llama code do) around SDPA: saved complex tensors share memory with the float outputs of other ops."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 4
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        half = HIDDEN // self.heads // 2
        angles = torch.outer(torch.arange(SEQ).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * self.freqs[: x.shape[1], None, :]).flatten(3).type_as(x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).unbind(2)
        q, k, v = self._rotate(q).transpose(1, 2), self._rotate(k).transpose(1, 2), v.transpose(1, 2)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h + self.out(attn.transpose(1, 2).reshape(b, s, HIDDEN))


def _llama4() -> nn.Module:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ, num_local_experts=2,
        num_experts_per_tok=1, tie_word_embeddings=False, attn_implementation="sdpa"))


def _gpt2_dropout(use_cache: bool) -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=SEQ,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=use_cache))


def _mixtral() -> nn.Module:
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False))


def _qwen2_moe() -> nn.Module:
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=SEQ,
        tie_word_embeddings=False))


BUILDERS = {
    "normalize": lambda: _Stack(lambda: _NormalizeBlock(user_clone=False)),
    "user_clone": lambda: _Stack(lambda: _NormalizeBlock(user_clone=True)),
    "slice_write": lambda: _Stack(_SliceWriteBlock),
    "scale_half": lambda: _Stack(_ScaleHalfBlock),
    "inplace_relu": lambda: _Stack(_InplaceReluBlock),
    "eval_attention": lambda: _Stack(_EvalAttentionBlock),
    "counting": lambda: _Stack(_CountingBlock),
    "shared_counting": lambda: _Stack(lambda: _CountingBlock(shared=True)),
    "rebinding": lambda: _Stack(_RebindingBlock),
    "scale_input": lambda: _Stack(_ScaleInputBlock),
    "conv_bn": _ConvNet,
    "spectral_norm": lambda: _Stack(_SpectralNormBlock),
    "stateful": lambda: _Stack(_StatefulBlock),
    "complex_rotary": lambda: _Stack(_ComplexRotaryBlock),
    "llama4": _llama4,
    "gpt2_dropout": lambda: _gpt2_dropout(use_cache=True),
    "gpt2_dropout_no_cache": lambda: _gpt2_dropout(use_cache=False),
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
}


@pytest.fixture(autouse=True)
def _models(monkeypatch):
    for name, build in BUILDERS.items():
        monkeypatch.setitem(MODELS, name, build)


_plain_runs: dict[str, tuple[dict, dict]] = {}


def _plain(model: str) -> tuple[dict, dict]:
    if model not in _plain_runs:
        module = LM(model)
        t = trainer("auto", max_steps=3)
        t.fit(module)
        _plain_runs[model] = final_state(module, t)
    return _plain_runs[model]


def _fit(tmp_path, model: str, **strategy: Any) -> tuple[dict, dict]:
    module = LM(model)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], **strategy), max_steps=3)
    t.fit(module)
    return final_state(module, t)


def _op_plan(placement: dict[str, str], prefix: str = "model.layers") -> Plan:
    """A plan that places the ops named ``"<prefix>.<i>/<op>"`` in both layers as given."""
    full = {f"{prefix}.{i}/{op}": tier for i in range(2) for op, tier in placement.items()}
    return Plan(full, predicted_iteration_time=0.0, predicted_forward_time=0.0, predicted_backward_time=0.0,
                resource_times={}, memory={}, budgets={}, curve=[], chosen=0)


@pytest.mark.parametrize("how", ["whole_block", "only_the_clone"])
def test_value_autograd_cloned_before_an_inplace_write_is_recomputed(tmp_path, replays, how):
    """Autograd's clone of ``x`` before ``x.div_`` is part of the replay, and recomputing its output gives ``x``
    before the division, as the forward saved it."""
    if how == "whole_block":
        got = _fit(tmp_path, "normalize", activation_policy="recompute")
    else:
        got = _fit(tmp_path, "normalize", plan=_op_plan({"input": "host", "*": "host", "norm:clone": "recompute"}))
        # Only the clone was recomputed, from stored outputs: its input was rebuilt, the division was not run.
        assert replays and all("norm:clone" in r.executed and "norm:div_" not in r.executed for r in replays)
    compare_states(_plain("normalize"), got, 1e-5)


@pytest.mark.parametrize("how", ["whole_block", "both_clones"])
def test_user_clone_before_an_inplace_write_replays(tmp_path, replays, how):
    """A user's own ``.clone()`` right before autograd's (the same op on the same tensor) is replayed as what it is."""
    if how == "whole_block":
        got = _fit(tmp_path, "user_clone", activation_policy="recompute")
    else:
        placement = {"input": "host", "*": "host", "norm:clone": "recompute", "norm:clone#1": "recompute"}
        got = _fit(tmp_path, "user_clone", plan=_op_plan(placement))
        assert replays and all({"norm:clone", "norm:clone#1"} <= r.executed for r in replays)
    compare_states(_plain("user_clone"), got, 1e-5)


def test_path_chosen_by_gradient_state_is_replayed(tmp_path):
    """The replay takes the path the forward took with inputs requiring gradients, not the fused inference path."""
    compare_states(_plain("eval_attention"), _fit(tmp_path, "eval_attention", activation_policy="recompute"), 1e-5)


def test_write_through_a_view_is_replayed(tmp_path):
    """Recomputing a buffer filled through views runs every write into it, not only the last."""
    compare_states(_plain("slice_write"), _fit(tmp_path, "slice_write", activation_policy="recompute"), 1e-5)


def test_tensor_written_through_a_view_after_its_op_is_not_handed_back_at_that_op(tmp_path):
    """``x`` is saved after a write through a view of it: what was stored is not the output of the op that returned
    ``x``, so a replay that needs ``x`` recomputes it and the write, instead of writing twice."""
    got = _fit(tmp_path, "scale_half", plan=_op_plan({"input": "host", "*": "host", "mul#1": "recompute"}))
    compare_states(_plain("scale_half"), got, 1e-5)


@pytest.mark.parametrize("tier", ["host", "device"])
def test_stored_result_of_an_inplace_op_is_handed_back(tmp_path, replays, tier):
    """The stored result of ``relu_`` reaches the recomputed ops that read it, kept on the device as much as copied
    to host memory."""
    got = _fit(tmp_path, "inplace_relu", plan=_op_plan({"input": tier, "*": tier, "mul": "recompute"}))
    assert replays and all(r.executed == {"mul"} for r in replays)
    compare_states(_plain("inplace_relu"), got, 1e-5)


def test_outputs_kept_on_the_device_are_not_recomputed(tmp_path, replays):
    """A Llama whose ops keep their outputs on the device but for the norms' last multiplications: the replay runs
    those and the ops between them and the nearest kept outputs, never a projection's matrix product."""
    placement = {"input": "device", "*": "device", "input_layernorm:mul#1": "recompute",
                 "post_attention_layernorm:mul#1": "recompute"}
    got = _fit(tmp_path, "llama", plan=_op_plan(placement, prefix="model.model.layers"))
    layers = [r for r in replays if "layers" in r.name]
    assert layers and all({"input_layernorm:mul#1", "post_attention_layernorm:mul#1"} <= r.executed for r in layers)
    assert all(not any(name.endswith(":mm") for name in r.executed) for r in layers)
    compare_states(_plain("llama"), got, 1e-5)


def test_a_kept_output_is_handed_back_only_while_alive_and_unwritten():
    t = torch.ones(4)
    kept = recompute.KeptOutput(t)
    assert kept.get() is t
    t.mul_(2.0)
    assert kept.get() is None
    u = torch.ones(4)
    kept = recompute.KeptOutput(u)
    del u
    assert kept.get() is None


@pytest.mark.parametrize("policy", ["auto", "recompute"])
@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_moe_models_train_exactly(tmp_path, model, policy):
    """Mixtral's and Qwen2-MoE's routers normalise their top-k weights in place (``/=``), which autograd clones."""
    strategy: dict[str, Any] = {"plan": "auto"} if policy == "auto" else {"activation_policy": policy}
    compare_states(_plain(model), _fit(tmp_path, model, **strategy), 1e-5)


def test_forward_that_runs_other_ops_when_replayed_raises(tmp_path):
    with pytest.raises(RuntimeError) as error:
        _fit(tmp_path, "shared_counting", activation_policy="recompute")
    message = str(error.value)
    # Which block, which op, both ops, and what to do instead.
    assert "block 2 ('model.layers.1')" in message
    assert re.search(r"ran aten\.sin\.default as op \d+, where the forward ran aten\.mul\.Tensor \(mul\)", message)
    assert "activation_policy={'model.layers.1': 'host'" in message


def test_forward_that_writes_its_input_cannot_be_recomputed(tmp_path):
    """Its inputs as kept hold the written values: a replay from them would be wrong, so it raises instead."""
    written = r"'model\.layers\.1'\): its forward writes its own input in place \(op \d+, mul_\)"
    with pytest.raises(RuntimeError, match=written):
        _fit(tmp_path, "scale_input", activation_policy="recompute")
    # Stored instead, the activations give plain training's numbers.
    compare_states(_plain("scale_input"), _fit(tmp_path, "scale_input", activation_policy="host"), 1e-5)


def test_memory_of_a_freed_output_has_no_producer():
    """A tensor placed in the memory of an op's output that was freed (a recomputed output is not kept) was not
    produced by that op. Falcon's ``fused_qkv[..., [-2], :]`` builds its int64 index without an op the tracker sees,
    and the allocator may put it there: attributing it to the dead output's op hands that op's float output back as
    the index when backward recomputes it."""
    memory = numpy.zeros(4, dtype=numpy.float32)
    record = recompute.ForwardRecord(0)
    with recompute.OpTracker(record, lambda: ""):
        out = torch.from_numpy(memory)
        torch.mul(torch.ones(4), 2.0, out=out)
        written = record.producer(out)
        assert written is not None and record.ops[written[0]].name == "mul"
        del out
        # The same memory, in a tensor no op of the block made.
        index = torch.from_numpy(memory).view(torch.int32)
        assert record.producer(index) is None


def _fit_module(tmp_path, model: str, strategy: Any) -> tuple[LM, tuple[dict, dict]]:
    module = LM(model)
    t = trainer(strategy, max_steps=3)
    t.fit(module)
    return module, final_state(module, t)


_TIERS = [{"activation_policy": "recompute"}, {"plan": "auto"}, {"activation_policy": "host"},
          {"activation_policy": "ssd"}]


@pytest.mark.parametrize("strategy", _TIERS, ids=lambda s: next(iter(s.values())))
@pytest.mark.parametrize("model", ["conv_bn", "spectral_norm", "stateful", "rebinding", "counting"])
def test_replay_leaves_what_the_forward_mutated_as_the_forward_left_it(tmp_path, model, strategy):
    """Batch-norm statistics, spectral-norm vectors, a buffer, tensor attribute and cache object updated in place, a
    buffer and a tensor attribute rebound, a call counter: each is updated once per forward, as plain training updates
    it, and the replay reads what the forward read; the random state after fit is plain training's too (a replay does
    not draw from it)."""
    plain_module, reference = _fit_module(tmp_path, model, "auto")
    plain_rng = torch.get_rng_state()
    module, got = _fit_module(tmp_path, model, RatelStrategy(ssd_paths=[str(tmp_path)], **strategy))
    compare_states(reference, got, 1e-5)
    assert torch.equal(torch.get_rng_state(), plain_rng)
    for plain_layer, layer in zip(plain_module.model.layers, module.model.layers):
        if model in ("stateful", "counting"):
            assert int(layer.calls) == int(plain_layer.calls) == 3
        if model == "stateful":
            assert torch.allclose(layer.cache.keys, plain_layer.cache.keys, rtol=1e-5, atol=1e-6)
        if model == "rebinding":
            assert layer.scale.item() == plain_layer.scale.item()
    if model == "conv_bn":
        batch = next(iter(module.train_dataloader()))
        plain_module.eval()
        module.eval()
        with torch.no_grad():
            want = plain_module.model(input_ids=batch, labels=batch).logits
            assert torch.allclose(module.model(input_ids=batch, labels=batch).logits, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["auto", "recompute"])
@pytest.mark.parametrize("model", ["complex_rotary", "llama4"])
def test_complex_views_of_recomputed_outputs_train_exactly(tmp_path, model, policy):
    """A saved complex tensor viewing a recomputed float output (or the reverse) is rebuilt in its own dtype: its
    sizes, strides and offset count complex elements."""
    strategy: dict[str, Any] = {"plan": "auto"} if policy == "auto" else {"activation_policy": policy}
    compare_states(_plain(model), _fit(tmp_path, model, **strategy), 1e-5)


@pytest.mark.parametrize("strategy", _TIERS, ids=lambda s: next(iter(s.values())))
def test_dropout_in_attention_trains_as_plain_lightning_without_the_kv_cache(tmp_path, strategy):
    """GPT-2 with attention, residual and embedding dropout: the masks of the forward and of its replays are plain
    training's. RatelStrategy turns transformers' KV cache off during fit, so the reference is plain training with
    ``use_cache=False``: with the cache on, each layer's keys and values reach attention as the cache's contiguous
    copies instead of strided views of the projection, and the CPU attention path taken with dropout (batched matmuls)
    rounds differently on the two layouts: plain training with and without the cache differ by 6.3e-4 relative here,
    most where a gradient is only rounding noise that Adam's first step scales to the learning rate (a key bias)."""
    got = _fit(tmp_path, "gpt2_dropout", **strategy)
    compare_states(_plain("gpt2_dropout_no_cache"), got, 1e-6)
