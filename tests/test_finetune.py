"""Fine-tuning end to end: pretrained weights streamed in, sharded checkpoints, the Hugging Face export, LoRA and frozen
parameters at their real cost, and nothing lost when the result does not fit back into host memory.

Every numeric check compares against plain Lightning (``from_pretrained`` and strategy ``"auto"``) on tiny models, or
against an uninterrupted RatelStrategy run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import lightning_ratel
from lightning_ratel import RatelConfigError, RatelHFExport, RatelStrategy
from lightning_ratel.io import checkpoint, pretrained
from lightning_ratel.io.convert import main as convert_main
from lightning_ratel.io.convert import sharded_to_hf, sharded_to_lightning
from lightning_ratel.io.sharded import INDEX, META, is_sharded_checkpoint
from tests.models import LM, SEQ, VOCAB, compare_states, final_state, max_rel_err, tiny_gpt2, tiny_llama, trainer

peft = pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]


def save_llama(path: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
               layers: int = 3) -> Path:
    """A tiny Llama with seeded random weights, saved the way Hugging Face publishes checkpoints."""
    torch.manual_seed(1)
    model = tiny_llama(layers).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def swap(tmp_path: Path, name: str = "swap") -> str:
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    return str(directory)


def from_pretrained_lm(folder: Path, **kwargs: Any) -> LM:
    """The reference: LM whose model is ``from_pretrained(folder)`` in fp32, as a plain Lightning user builds it."""
    lm = LM("llama", **kwargs)
    lm.model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return lm


def meta_lm(model: str = "llama", **kwargs: Any) -> LM:
    with torch.device("meta"):
        return LM(model, **kwargs)


def lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def is_placeholder(p: torch.Tensor) -> bool:
    return p.numel() > 1 and not any(p.stride())


class RecordReads:
    """Counts the tensors each read of the pretrained folder asks for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[str]] = []
        original = pretrained.PretrainedFolder.read

        def read(folder: pretrained.PretrainedFolder, keys: list[str]) -> Any:
            self.calls.append(list(keys))
            return original(folder, keys)

        monkeypatch.setattr(pretrained.PretrainedFolder, "read", read)


# ---------------------------------------------------------------------------------------------------- pretrained in


@pytest.mark.parametrize(("file_dtype", "shards", "param_cache"),
                         [(torch.float32, None, "host"), (torch.bfloat16, "60KB", "ssd")])
def test_pretrained_meta_model_trains_like_from_pretrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           file_dtype: torch.dtype, shards: str | None,
                                                           param_cache: str) -> None:
    folder = save_llama(tmp_path / "hf", file_dtype, shards)
    assert (folder / "model.safetensors.index.json").is_file() == (shards is not None)
    reference = from_pretrained_lm(folder)
    t = trainer("auto")
    t.fit(reference)
    ref = final_state(reference, t)

    reads = RecordReads(monkeypatch)
    module = meta_lm()
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(folder), param_cache=param_cache)
    t = trainer(strategy)
    t.fit(module)
    compare_states(ref, final_state(module, t), 1e-5)
    # Block by block: no read asks for more than one decoder layer's tensors.
    layer = len(list(reference.model.model.layers[0].parameters()))
    assert len(reads.calls) >= 6 and max(len(c) for c in reads.calls if c) <= layer
    assert all(not b.is_meta for b in module.buffers())


def test_pretrained_from_lightning_cli_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["cli"])
    folder = save_llama(tmp_path / "hf")
    config = {
        "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "root"),
                    "strategy": {"class_path": "lightning_ratel.RatelStrategy",
                                 "init_args": {"ssd_paths": [swap(tmp_path)], "pretrained": str(folder),
                                               "checkpoint_format": "sharded"}}},
        "model": {"model": "llama"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    cli = LightningCLI(LM, args=["--config", str(path)], run=False, save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RatelStrategy)
    assert strategy.pretrained == str(folder) and strategy.checkpoint_format == "sharded"
    with torch.device("meta"):
        module = LM("llama")
    cli.trainer.fit(module)
    reference = from_pretrained_lm(folder)
    t = trainer("auto", max_steps=1)
    t.fit(reference)
    assert max_rel_err(final_state(reference, t)[0], dict(module.state_dict())) <= 1e-5


class CountSteps(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.steps += 1


def _delete_tensor(folder: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _reshape_tensor(folder: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


class FrozenBase(LM):
    """Everything frozen but the last layer's MLP."""

    def __init__(self) -> None:
        super().__init__("llama")
        for name, p in self.named_parameters():
            p.requires_grad = ".layers.2.mlp." in name


@pytest.mark.parametrize(("damage", "words"), [
    ("missing", "model.model.layers.1.self_attn.q_proj.weight"),
    ("shape", "model.model.layers.0.mlp.up_proj.weight"),
    ("foreign", "none of the model's parameters"),
])
def test_pretrained_mismatch_rejected_before_training(tmp_path: Path, damage: str, words: str) -> None:
    folder = save_llama(tmp_path / "hf")
    if damage == "missing":
        _delete_tensor(folder, "model.layers.1.self_attn.q_proj.weight")
    elif damage == "shape":
        _reshape_tensor(folder, "model.layers.0.mlp.up_proj.weight")
    else:
        tiny_gpt2().save_pretrained(folder)
    with torch.device("meta"):
        module = FrozenBase()
    counter = CountSteps()
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(folder))
    with pytest.raises(RatelConfigError, match=words.replace(".", r"\.").replace("'", ".")):
        trainer(strategy, callbacks=[counter]).fit(module)
    assert counter.steps == 0
    assert os.listdir(tmp_path / "swap") == []


def test_pretrained_tensors_the_model_does_not_use_are_listed(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_llama(tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(folder))
    with pytest.warns(UserWarning, match=r"1 tensors of the pretrained folder .* not used: model\.layers\.9\.extra"):
        trainer(strategy, max_steps=1).fit(meta_lm())


def test_pretrained_folder_checked_at_construction(tmp_path: Path) -> None:
    with pytest.raises(RatelConfigError, match="not a directory"):
        RatelStrategy(pretrained=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(tmp_path / "empty"))
    with pytest.raises(RatelConfigError, match="model.safetensors"):
        trainer(strategy).fit(meta_lm())


def test_pretrained_peft_on_meta_device(tmp_path: Path) -> None:
    folder = save_llama(tmp_path / "hf")
    base = from_pretrained_lm(folder)
    batch = next(iter(base.train_dataloader()))
    with torch.no_grad():
        base_loss = base.model(input_ids=batch, labels=batch).loss.item()

    with torch.device("meta"):
        module = LM("llama")
        module.model = lora(module.model)
    losses: list[float] = []

    class FirstLoss(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                               *args: Any) -> None:
            losses.append(float(outputs["loss"]))

    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(folder))
    trainer(strategy, callbacks=[FirstLoss()]).fit(module)
    # peft's initialization (B = 0): before the first update the adapted model is the base model.
    assert losses[0] == pytest.approx(base_loss, rel=1e-6)
    assert losses[-1] < losses[0]
    params = dict(module.named_parameters())
    assert torch.equal(params["model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
                       base.model.model.layers[0].self_attn.q_proj.weight)
    assert params["model.base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"].abs().sum() > 0


def tiny_gemma() -> GemmaForCausalLM:
    """Tied embeddings, and an embedding module that keeps its scale in a buffer ``reset_parameters()`` leaves alone."""
    cfg = GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ)
    return GemmaForCausalLM(cfg)


def test_pretrained_meta_model_gets_buffers_its_reset_parameters_leaves(tmp_path: Path) -> None:
    torch.manual_seed(1)
    tiny_gemma().save_pretrained(tmp_path / "hf")
    reference = LM("llama", n_batches=2)
    reference.model = GemmaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    t = trainer("auto", max_steps=2)
    t.fit(reference)
    with torch.device("meta"):
        module = LM("llama", n_batches=2)
        module.model = tiny_gemma()
    t2 = trainer(RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(tmp_path / "hf")), max_steps=2)
    t2.fit(module)
    # The embedding's scale (sqrt(hidden)) is set as from_pretrained sets it, not left as uninitialized memory.
    assert module.model.model.embed_tokens.embed_scale.item() == pytest.approx(32**0.5)
    compare_states(final_state(reference, t), final_state(module, t2), 1e-5)


class ScaledHead(nn.Linear):
    """A layer whose buffer is computed in ``__init__`` only: on the meta device nothing can give it its value."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def test_meta_buffer_nothing_sets_is_rejected_before_training(tmp_path: Path) -> None:
    with torch.device("meta"):
        module = LM("mlp", n_batches=2)
        module.model.head = ScaledHead(32, VOCAB)
    counter = CountSteps()
    with pytest.raises(RatelConfigError, match=r"model\.head\.scale \(ScaledHead\).*param_init_fn"):
        trainer(RatelStrategy(ssd_paths=[swap(tmp_path)]), max_steps=1, callbacks=[counter]).fit(module)
    assert counter.steps == 0


# ------------------------------------------------------------------------------------------------ sharded checkpoints


def sharded_trainer(tmp_path: Path, name: str, steps: int, every: int = 2, **kwargs: Any) -> L.Trainer:
    kwargs = {"activation_policy": "host", **kwargs}
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path, f"swap-{name}")], checkpoint_format="sharded", **kwargs)
    callback = ModelCheckpoint(dirpath=str(tmp_path / name), every_n_train_steps=every, save_top_k=-1)
    return trainer(strategy, max_steps=steps, enable_checkpointing=True, callbacks=[callback])


def step_dir(directory: Path, step: int) -> Path:
    found = sorted(directory.glob(f"*step={step}.ckpt"))
    assert len(found) == 1, sorted(os.listdir(directory))
    return found[0]


def test_sharded_checkpoint_resume_equals_uninterrupted(tmp_path: Path) -> None:
    module = LM("llama", n_batches=2)
    t = sharded_trainer(tmp_path, "straight", 4, activation_policy=None)
    t.fit(module)
    straight = final_state(module, t)
    ckpt = step_dir(tmp_path / "straight", 2)
    assert is_sharded_checkpoint(ckpt)
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("unit-")) == [META, INDEX]
    meta = torch.load(ckpt / META, weights_only=False)
    assert meta["global_step"] == 2 and meta["loops"] and meta["lr_schedulers"]
    assert meta["optimizer_states"][0]["state"] == {}
    # The plan made after the profiled steps travels with the checkpoints written after it.
    later = torch.load(step_dir(tmp_path / "straight", 4) / META, weights_only=False)
    assert next(v for k, v in later["callbacks"].items() if "RatelProfiler" in k)["plan"] is not None

    # Resumed into a model built on the meta device, its values from the checkpoint only.
    resumed = meta_lm(n_batches=2)
    t = trainer(RatelStrategy(ssd_paths=[swap(tmp_path, "swap-resumed")], param_cache="ssd"), max_steps=4)
    t.fit(resumed, ckpt_path=str(ckpt))
    assert t.global_step == 4
    compare_states(straight, final_state(resumed, t), 1e-5)


def test_sharded_checkpoint_converts_to_the_ordinary_one(tmp_path: Path) -> None:
    module = LM("llama", n_batches=2)
    sharded_trainer(tmp_path, "sharded", 2).fit(module)
    module = LM("llama", n_batches=2)
    full = ModelCheckpoint(dirpath=str(tmp_path / "full"), every_n_train_steps=2, save_top_k=-1)
    trainer(RatelStrategy(ssd_paths=[swap(tmp_path, "swap-full")], checkpoint_format="full",
                          activation_policy="host"), max_steps=2, enable_checkpointing=True,
            callbacks=[full]).fit(module)
    reference = torch.load(step_dir(tmp_path / "full", 2), weights_only=False)

    assert convert_main([str(step_dir(tmp_path / "sharded", 2)), str(tmp_path / "converted.ckpt"), "--to",
                         "lightning", "--no-progress"]) == 0
    converted = torch.load(tmp_path / "converted.ckpt", weights_only=False)
    assert max_rel_err(reference["state_dict"], converted["state_dict"]) == 0.0
    compare_states((reference["state_dict"], reference["optimizer_states"][0]),
                   (converted["state_dict"], converted["optimizer_states"][0]), 0.0)
    assert converted["global_step"] == 2 and converted["loops"] == reference["loops"]

    # Plain Lightning resumes from the converted file as from its own.
    plain = LM("llama", n_batches=2)
    t = trainer("auto", max_steps=4)
    t.fit(plain, ckpt_path=str(tmp_path / "converted.ckpt"))
    straight = LM("llama", n_batches=2)
    s = trainer("auto", max_steps=4)
    s.fit(straight)
    compare_states(final_state(straight, s), final_state(plain, t), 1e-5)


def test_checkpoint_format_follows_size(tmp_path: Path) -> None:
    # Room for the run's own buffers (a smaller budget is refused before the model is built), and less than twice
    # what a gathered checkpoint takes. No read-ahead sets: planned without a limit they would take the available
    # memory's share, not this budget's.
    need = lightning_ratel.estimate(LM("llama"), precision="32-true", param_cache="host", checkpoint_format="full",
                                    optimizer_states="ssd", read_ahead_sets=0)
    limit = need.host + need.device
    assert need.checkpoint > limit // 2
    sharded_by_size = RatelStrategy(ssd_paths=[swap(tmp_path, "a")], host_memory_limit=limit,
                                    activation_policy="host", optimizer_states="ssd", read_ahead_sets=0)
    for strategy, name, expect_dir in [
        (RatelStrategy(ssd_paths=[swap(tmp_path, "b")], activation_policy="host"), "small", False),
        (sharded_by_size, "large", True),
    ]:
        callback = ModelCheckpoint(dirpath=str(tmp_path / name), every_n_train_steps=2, save_top_k=-1)
        trainer(strategy, max_steps=2, enable_checkpointing=True, callbacks=[callback]).fit(LM("llama", n_batches=2))
        path = step_dir(tmp_path / name, 2)
        assert path.is_dir() == expect_dir and is_sharded_checkpoint(path) == expect_dir


RSS_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import lightning as L
    from torch import nn
    from lightning_ratel import RatelStrategy

    def vm(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    class Deep(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(32))
        def training_step(self, batch, batch_idx):
            h = batch
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
            return h.pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(4, 8, 512), batch_size=None)

    class Peak(L.Callback):
        def on_train_start(self, trainer, pl_module):
            print("PEAK", vm("VmHWM") - BASE, flush=True)

    mode, swap, ckpt, limit = sys.argv[1:5]
    kwargs = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=os.path.dirname(ckpt))
    if mode == "save":
        module = Deep()
        saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.dirname(ckpt), filename="deep")
        trainer = L.Trainer(strategy=RatelStrategy(ssd_paths=[swap], checkpoint_format="sharded",
                                                    activation_policy="host"), max_steps=2, callbacks=[saver],
                            **kwargs)
        trainer.fit(module)
    else:
        with torch.device("meta"):
            module = Deep()
        trainer = L.Trainer(strategy=RatelStrategy(ssd_paths=[swap], host_memory_limit=int(limit),
                                                    activation_policy="host"),
                            max_steps=3, callbacks=[Peak()], enable_checkpointing=False, **kwargs)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        BASE = vm("VmRSS")
        trainer.fit(module, ckpt_path=ckpt)
""")


def test_loading_a_sharded_checkpoint_stays_within_host_memory_limit(tmp_path: Path) -> None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to reset the peak resident set size")
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ckpt = tmp_path / "ckpt" / "deep.ckpt"
    limit = 16 << 20

    def run(mode: str) -> str:
        result = subprocess.run([sys.executable, str(script), mode, swap(tmp_path, mode), str(ckpt), str(limit)],
                                capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    run("save")
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    assert size > 4 * limit
    peak = int(next(line for line in run("load").splitlines() if line.startswith("PEAK")).split()[1])
    # Masters and moments went through host memory a shard at a time, besides the engine's own buffers.
    assert peak < limit, f"loading a {size >> 20} MiB checkpoint raised the peak RSS by {peak >> 20} MiB"


# ---------------------------------------------------------------------------------------------------- export


def test_export_round_trips_bitwise(tmp_path: Path) -> None:
    module = LM("llama", n_batches=2)
    export = RatelHFExport(str(tmp_path / "export"), every_n_train_steps=2, dtype="fp32", max_shard_size="60KB")
    bf16 = RatelHFExport(str(tmp_path / "export-bf16"))
    t = trainer(RatelStrategy(ssd_paths=[swap(tmp_path)], param_cache="ssd", checkpoint_format="sharded"),
                max_steps=4, callbacks=[export, bf16, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"),
                                                                      every_n_train_steps=4)],
                enable_checkpointing=True)
    t.fit(module)
    final = tmp_path / "export" / "final"
    assert (final / "model.safetensors.index.json").is_file() and (final / "config.json").is_file()
    assert (tmp_path / "export" / "step=2" / "config.json").is_file()
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    loaded = LlamaForCausalLM.from_pretrained(final, dtype=torch.float32)
    trained = dict(module.model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name]), name
    half = LlamaForCausalLM.from_pretrained(tmp_path / "export-bf16" / "final")
    assert half.dtype == torch.bfloat16
    for name, p in half.named_parameters():
        assert torch.equal(p, trained[name].to(torch.bfloat16)), name

    # The same weights from the step-4 sharded checkpoint, and from the module after fit.
    sharded_to_hf(step_dir(tmp_path / "ckpt", 4), tmp_path / "converted", dtype="fp32")
    t.strategy.save_pretrained(tmp_path / "after", dtype="fp32")
    for folder in ("converted", "after"):
        again = LlamaForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float32)
        for name, p in again.named_parameters():
            assert torch.equal(p, trained[name]), (folder, name)


def test_exported_config_is_the_users_not_the_fits(tmp_path: Path) -> None:
    module = LM("llama", n_batches=2)
    assert module.model.config.use_cache is True
    module.model.config.save_pretrained(tmp_path / "expected")
    expected = json.loads((tmp_path / "expected" / "config.json").read_text())
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], checkpoint_format="sharded")
    trainer(strategy, max_steps=1, enable_checkpointing=True,
            callbacks=[RatelHFExport(str(tmp_path / "out"), dtype="fp32"), checkpoints]).fit(module)
    sharded_to_hf(step_dir(tmp_path / "ckpt", 1), tmp_path / "converted")
    for folder, dtype in ((tmp_path / "out" / "final", "float32"), (tmp_path / "converted", "bfloat16")):
        config = json.loads((folder / "config.json").read_text())
        # What save_pretrained writes: the KV cache the fit switched off is on, no defaults spelled out.
        assert config == {**expected, "architectures": ["LlamaForCausalLM"], "dtype": dtype}, folder


def test_sequence_classifier_trains_without_filling_a_kv_cache(tmp_path: Path) -> None:
    def classifier() -> LM:
        module = LM("llama", n_batches=2)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, num_labels=3,
                          pad_token_id=0)
        torch.manual_seed(0)
        module.model = LlamaForSequenceClassification(cfg)
        return module

    class Classify(LM):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch[:, 0] % 3).loss

    reference, module = classifier(), classifier()
    reference.__class__ = module.__class__ = Classify
    t = trainer("auto", max_steps=2)
    t.fit(reference)
    # A replayed forward would append to the cache the first pass filled.
    t2 = trainer(RatelStrategy(ssd_paths=[swap(tmp_path)], activation_policy="recompute"), max_steps=2)
    t2.fit(module)
    compare_states(final_state(reference, t), final_state(module, t2), 1e-5)
    assert module.model.config.use_cache is True


def test_export_writes_tied_weights_once(tmp_path: Path) -> None:
    module = LM("gpt2", n_batches=2)
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)])
    trainer(strategy, max_steps=2, callbacks=[RatelHFExport(str(tmp_path / "out"), dtype="fp32")]).fit(module)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "final" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "final", dtype=torch.float32)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for name, p in loaded.named_parameters():
        assert torch.equal(p, dict(module.model.named_parameters())[name]), name


# ---------------------------------------------------------------------------------------------------- LoRA and frozen


class Reserved(Callback):
    """What the swap store holds, by key, at the end of training."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine
        store = engine.store
        self.keys = {k: store.nbytes(k) for k in store.keys()}
        self.layout = engine.layout


def lora_lm(folder: Path, meta: bool = False) -> LM:
    with torch.device("meta") if meta else contextlib.nullcontext():
        module = LM("llama", n_batches=3)
        if not meta:
            module.model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        torch.manual_seed(3)
        module.model = lora(module.model)
    return module


@pytest.mark.parametrize(("precision", "param_cache"), [("32-true", "ssd"), ("bf16-mixed", "ssd"),
                                                        ("bf16-mixed", "host")])
def test_lora_trains_like_plain_without_fp32_copies_of_frozen_weights(tmp_path: Path, precision: str,
                                                                       param_cache: str) -> None:
    # A bf16 checkpoint, as published models are: its values are exact in a bf16 compute copy.
    folder = save_llama(tmp_path / "hf", torch.bfloat16)
    reference = lora_lm(folder)
    t = trainer("auto", precision=precision)
    t.fit(reference)
    ref = final_state(reference, t)

    module = lora_lm(folder)
    reserved = Reserved()
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], param_cache=param_cache, pretrained=str(folder))
    t = trainer(strategy, precision=precision, callbacks=[reserved])
    t.fit(module)
    compare_states(ref, final_state(module, t), 1e-5)

    layout = reserved.layout
    trainable = sum(s.numel for s in layout.shards)
    assert trainable == sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen_keys = {k: n for k, n in reserved.keys.items()
                   if any(k.startswith(f"shard{s.index}.") for s in layout.frozen_shards)}
    if param_cache == "host":
        assert frozen_keys == {}
    else:
        # One compute copy per frozen shard: 2 bytes per linear weight under bf16-mixed, nothing else.
        expected = {s.compute_key: s.numel * s.dtype.itemsize for s in layout.frozen_shards}
        assert frozen_keys == expected
        if precision == "bf16-mixed":
            assert all(s.dtype == torch.bfloat16 for s in layout.frozen_shards if s.params[0].shape[0] > 1
                       and len(s.params[0].shape) == 2 and "embed" not in s.params[0].name)
    frozen_numel = sum(s.numel for s in layout.frozen_shards)
    # Masters and moments (two slots) of the trainable parameters only.
    assert sum(reserved.keys.values()) - sum(frozen_keys.values()) <= trainable * 26 + 4096 * len(layout.shards)
    assert sum(frozen_keys.values()) <= frozen_numel * 4


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lora_with_every_unit_on_the_device_trains_like_plain(tmp_path: Path, precision: str) -> None:
    """LoRA with every state on the device and every activation kept: the frozen weights' units are resident too, and
    the passes hold every unit from forward to backward."""
    folder = save_llama(tmp_path / "hf", torch.bfloat16)
    reference = lora_lm(folder)
    t = trainer("auto", precision=precision)
    t.fit(reference)
    module = lora_lm(folder)
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], optimizer_states="device", activation_policy="keep",
                             pretrained=str(folder))
    bound: list[bool] = []
    def seen(loss: torch.Tensor) -> None:
        bound.append(strategy.engine.scheduler.bound)

    module.on_before_backward = seen  # type: ignore[method-assign]
    t2 = trainer(strategy, precision=precision)
    t2.fit(module)
    assert bound and all(bound)
    compare_states(final_state(reference, t), final_state(module, t2), 1e-5)


def test_lora_adapter_exported_in_peft_format(tmp_path: Path) -> None:
    folder = save_llama(tmp_path / "hf", torch.bfloat16)
    module = lora_lm(folder, meta=True)
    strategy = RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(folder))
    trainer(strategy, max_steps=2, callbacks=[RatelHFExport(str(tmp_path / "out"))]).fit(module)
    adapter = tmp_path / "out" / "final" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    base = LlamaForCausalLM.from_pretrained(tmp_path / "out" / "final", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    trained = dict(module.model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p.float(), trained[name].float()), name


def test_frozen_weights_rounded_by_bf16_keep_their_exact_values(tmp_path: Path) -> None:
    folder = save_llama(tmp_path / "hf", torch.float32)
    reference = lora_lm(folder)
    t = trainer("auto", precision="bf16-mixed")
    t.fit(reference)
    module = lora_lm(folder)
    reserved = Reserved()
    t2 = trainer(RatelStrategy(ssd_paths=[swap(tmp_path)], param_cache="ssd"), precision="bf16-mixed",
                 callbacks=[reserved])
    t2.fit(module)
    compare_states(final_state(reference, t), final_state(module, t2), 1e-5)
    # fp32 values that bf16 rounds: kept once in their own dtype, beside the bf16 compute copy.
    kept = reserved.layout.frozen_values.exact_copies
    assert kept and all(dtype == torch.float32 for dtype in kept.values())
    for name, p in module.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, dict(reference.named_parameters())[name]), name


# ---------------------------------------------------------------------------------------------------- end of fit


def test_trainable_parameters_copied_back_when_the_model_does_not_fit(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_llama(tmp_path / "hf", torch.bfloat16)
    module = lora_lm(folder, meta=True)
    trainable = sum(p.numel() * 4 for p in module.parameters() if p.requires_grad)
    # Room for the adapter, not for the base.
    monkeypatch.setattr(checkpoint, "available_host_memory", lambda: 4 * trainable)
    with pytest.warns(UserWarning, match="trainable parameters .* are copied back"):
        trainer(RatelStrategy(ssd_paths=[swap(tmp_path)], pretrained=str(folder)), max_steps=2).fit(module)
    for name, p in module.named_parameters():
        assert is_placeholder(p) != p.requires_grad, name
        if p.requires_grad:
            assert torch.isfinite(p).all(), name
    # The frozen values are the pretrained folder's: nothing to keep.
    assert os.listdir(tmp_path / "swap") == []
    module.model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_result_kept_in_swap_files_and_exported_when_nothing_fits(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    reference = LM("llama", n_batches=2)
    trainer(RatelStrategy(ssd_paths=[swap(tmp_path, "ref")]), max_steps=3).fit(reference)

    monkeypatch.setattr(checkpoint, "available_host_memory", lambda: 4096)
    module = LM("llama", n_batches=2)
    directories = [swap(tmp_path, "a"), swap(tmp_path, "b")]
    with pytest.warns(UserWarning, match=r"ratel-convert --swap"):
        trainer(RatelStrategy(ssd_paths=directories), max_steps=3).fit(module)
    assert all(is_placeholder(p) for p in module.parameters() if p.numel() > 1)
    assert sorted(os.listdir(directories[0])) == ["ratel.index.json", "ratel.swap"]

    args = [a for d in directories for a in ("--swap", d)] + [str(tmp_path / "out"), "--dtype", "fp32",
                                                              "--no-progress"]
    assert convert_main(args) == 0
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    expected = dict(reference.model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_no_swap_files_kept_when_a_checkpoint_holds_the_last_step(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "available_host_memory", lambda: 4096)
    t = sharded_trainer(tmp_path, "ckpt", 2)
    with pytest.warns(UserWarning, match="checkpoint saved at the last step"):
        t.fit(LM("llama", n_batches=2))
    assert os.listdir(tmp_path / "swap-ckpt") == []
    assert is_sharded_checkpoint(step_dir(tmp_path / "ckpt", 2))
    sharded_to_lightning(step_dir(tmp_path / "ckpt", 2), tmp_path / "plain.ckpt")
    assert torch.load(tmp_path / "plain.ckpt", weights_only=False)["global_step"] == 2
