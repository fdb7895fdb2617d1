"""Saving cannot lose the run: failed saves, interrupted replacements, damaged or foreign checkpoints."""

from __future__ import annotations

import errno
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from transformers import LlamaForCausalLM

from lightning_ratel import RatelConfigError, RatelStrategy
from lightning_ratel.io import tensorfiles
from lightning_ratel.io.convert import sharded_to_lightning
from lightning_ratel.io.export import ModuleReader, write_hf_folder
from tests.models import LM, final_state, max_rel_err, trainer

SHARDED = {"checkpoint_format": "sharded"}
ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def plain_params(steps: int) -> dict[str, torch.Tensor]:
    """The parameters of plain Lightning after ``steps`` steps."""
    module = LM("llama")
    t = trainer("auto", max_steps=steps)
    t.fit(module)
    return final_state(module, t)[0]


def _failing_writes(monkeypatch: pytest.MonkeyPatch, under: Path, error: BaseException) -> None:
    """Checkpoint files written below ``under`` fail with ``error``; others are written."""
    write = tensorfiles.pwrite_all

    def pwrite_all(fd: int, data: memoryview, offset: int, path: Path | str) -> None:
        if Path(path).is_relative_to(under):
            raise error
        write(fd, data, offset, path)

    monkeypatch.setattr(tensorfiles, "pwrite_all", pwrite_all)


def _lightning_state(directory: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{directory.name}.converted"
    sharded_to_lightning(directory, out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("param_cache", ["host", "ssd"])
def test_a_full_checkpoint_disk_leaves_the_run_recoverable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           param_cache: str) -> None:
    swap, ckpt, exc = tmp_path / "swap", tmp_path / "ckpt", tmp_path / "exc"
    swap.mkdir()
    _failing_writes(monkeypatch, ckpt,
                    tensorfiles._io_error(OSError(errno.ENOSPC, "No space left on device"), "write", ckpt, 0))
    module = LM("llama")
    callbacks = [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1), OnExceptionCheckpoint(exc)]
    strategy = RatelStrategy(ssd_paths=[str(swap)], param_cache=param_cache, **SHARDED)
    with pytest.raises(OSError) as raised:
        trainer(strategy, callbacks=callbacks, enable_checkpointing=True).fit(module)
    assert raised.value.errno == errno.ENOSPC
    # As in plain Lightning: the on-exception checkpoint holds the last committed step, the module its values.
    saved = _lightning_state(exc / "on_exception.ckpt", tmp_path)
    assert saved["global_step"] == 2
    assert max_rel_err(plain_params(2), saved["state_dict"]) <= 1e-5
    assert max_rel_err(plain_params(2), module.state_dict()) <= 1e-5
    # Nothing half-written is left, and the swap files are gone as after any run.
    assert not ckpt.exists() or list(ckpt.iterdir()) == []
    assert os.listdir(swap) == []


def test_a_full_disk_for_the_on_exception_checkpoint_too_still_restores_the_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    swap, disk = tmp_path / "swap", tmp_path / "full"
    swap.mkdir()
    _failing_writes(monkeypatch, disk,
                    tensorfiles._io_error(OSError(errno.ENOSPC, "No space left on device"), "write", disk, 0))
    module = LM("llama")
    callbacks = [ModelCheckpoint(dirpath=disk / "ckpt", every_n_train_steps=2), OnExceptionCheckpoint(disk / "exc")]
    strategy = RatelStrategy(ssd_paths=[str(swap)], param_cache="ssd", optimizer_states="ssd", **SHARDED)
    with pytest.raises(OSError) as raised:
        trainer(strategy, callbacks=callbacks, enable_checkpointing=True).fit(module)
    assert raised.value.errno == errno.ENOSPC
    # Lightning skips teardown after a failed on-exception save: the strategy restored the module itself.
    assert max_rel_err(plain_params(2), module.state_dict()) <= 1e-5
    assert os.listdir(swap) == []


class TruncateSwap(L.Callback):
    """Cuts the swap file short after the second step (a full or failing swap disk)."""

    def __init__(self, swap: Path) -> None:
        self.swap = swap

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 2:
            for file in self.swap.glob("*.swap"):
                os.truncate(file, 4096)


def test_a_truncated_swap_file_with_on_exception_checkpoint_is_reported(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    module = LM("llama")
    strategy = RatelStrategy(ssd_paths=[str(swap)], param_cache="ssd", optimizer_states="ssd", **SHARDED)
    callbacks = [TruncateSwap(swap), OnExceptionCheckpoint(tmp_path / "exc")]
    with pytest.warns(UserWarning, match="state could not be read back.*Resume from the last checkpoint"):
        with pytest.raises(OSError, match="swap"):
            trainer(strategy, callbacks=callbacks, enable_checkpointing=True).fit(module)
    assert not (tmp_path / "exc" / "on_exception.ckpt").exists()


# ---------------------------------------------------------------------------------------------- Hugging Face exports


def _export(module: LM, out: Path, tmp_path: Path) -> None:
    write_hf_folder(ModuleReader(module), out, torch.float32, max_shard_size="20KB")


def test_an_interrupted_export_leaves_the_earlier_one_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "hf"
    first = LM("llama")
    _export(first, out, tmp_path)
    assert len(list(out.glob("model-*.safetensors"))) >= 8
    (out / "tokenizer.json").write_text("{}")
    second = LM("llama")
    with torch.no_grad():
        for p in second.parameters():
            p.add_(1.0)
    closed = []
    close = tensorfiles.TensorFileWriter.close

    def close_then_stop(writer: tensorfiles.TensorFileWriter) -> None:
        close(writer)
        closed.append(writer.path)
        if len(closed) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(tensorfiles.TensorFileWriter, "close", close_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _export(second, out, tmp_path)
    monkeypatch.undo()
    loaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    expected = dict(first.model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, expected[name]), name
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == []

    # A kill leaves its staging directory behind; the next export removes it, and carries the tokenizer over.
    (tmp_path / ".hf.0badc0de.tmp").mkdir()
    _export(second, out, tmp_path)
    assert not (tmp_path / ".hf.0badc0de.tmp").exists()
    assert (out / "tokenizer.json").read_text() == "{}"
    loaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    expected = dict(second.model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, expected[name]), name


# ---------------------------------------------------------------------------------------------- sharded checkpoints


def _sharded(tmp_path: Path, steps: int = 2, **kwargs: Any) -> Path:
    """A sharded checkpoint after ``steps`` steps: ``tmp_path/ckpt/last.ckpt``."""
    swap = tmp_path / "swap-save"
    swap.mkdir(exist_ok=True)
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1)
    trainer(RatelStrategy(ssd_paths=[str(swap)], **SHARDED), max_steps=steps, callbacks=[callback],
            enable_checkpointing=True, **kwargs).fit(LM("llama"))
    return tmp_path / "ckpt" / "last.ckpt"


def _resume(tmp_path: Path, ckpt: str | Path, module: LM | None = None, steps: int = 4) -> L.Trainer:
    swap = tmp_path / "swap-resume"
    swap.mkdir(exist_ok=True)
    t = trainer(RatelStrategy(ssd_paths=[str(swap)], **SHARDED), max_steps=steps)
    t.fit(module or LM("llama"), ckpt_path=str(ckpt))
    return t


def test_replacing_last_ckpt_never_leaves_neither(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replacement is swapped into place in one step: a save stopped at any point before it leaves the earlier
    last.ckpt, and ckpt_path="last" resumes from it."""
    last = _sharded(tmp_path, steps=1)
    fsync = tensorfiles.fsync_directory

    def stop_before_the_swap(path: Path) -> None:
        if path.name.startswith(".last.ckpt."):
            raise OSError(errno.EIO, "injected: the save stops just before the swap")
        fsync(path)

    monkeypatch.setattr(tensorfiles, "fsync_directory", stop_before_the_swap)
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path / "swap-save")], **SHARDED), max_steps=2, callbacks=[callback],
                enable_checkpointing=True)
    with pytest.raises(OSError, match="injected"):
        t.fit(LM("llama"), ckpt_path=str(last))
    monkeypatch.undo()
    assert json.loads((last / "ratel_checkpoint.json").read_text())["global_step"] == 1
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path / "swap-save")], **SHARDED), max_steps=2,
                callbacks=[callback], enable_checkpointing=True)
    t.fit(LM("llama"), ckpt_path="last")
    assert t.global_step == 2


def test_flipped_bytes_in_a_shard_are_refused_on_resume_and_by_convert(tmp_path: Path) -> None:
    ckpt = _sharded(tmp_path)
    unit = max(ckpt.glob("unit-*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(unit.read_bytes())
    for i in range(len(data) - 64, len(data)):
        data[i] ^= 0xFF
    unit.write_bytes(bytes(data))
    with pytest.raises(OSError, match=f"{unit.name}.*do not match their checksum") as raised:
        _resume(tmp_path, ckpt)
    assert raised.value.errno == errno.EBADMSG
    with pytest.raises(OSError, match="do not match their checksum"):
        sharded_to_lightning(ckpt, tmp_path / "converted.ckpt")


@pytest.mark.parametrize("edit", ["step", "dtype", "not-json", "not-utf8", "missing-key"])
def test_an_edited_or_damaged_index_is_refused(tmp_path: Path, edit: str) -> None:
    ckpt = _sharded(tmp_path)
    path = ckpt / "ratel_checkpoint.json"
    index = json.loads(path.read_text())
    if edit == "step":
        index["params"][0]["step"] += 1
        path.write_text(json.dumps(index))
    elif edit == "dtype":
        index["params"][0]["stored"] = "BF16"
        path.write_text(json.dumps(index))
    elif edit == "not-json":
        path.write_text(path.read_text()[:-10])
    elif edit == "not-utf8":
        path.write_bytes(b"\xff\xfe" + path.read_bytes())
    else:
        del index["params"]
        path.write_text(json.dumps(index))
    for attempt in (lambda: _resume(tmp_path, ckpt), lambda: sharded_to_lightning(ckpt, tmp_path / "out.ckpt")):
        with pytest.raises(RatelConfigError, match="ratel_checkpoint.json is damaged or was edited.*another"):
            attempt()


def test_a_damaged_meta_is_refused(tmp_path: Path) -> None:
    ckpt = _sharded(tmp_path)
    meta = ckpt / "meta.pt"
    meta.write_bytes(meta.read_bytes()[:-100])
    with pytest.raises(RatelConfigError, match="meta.pt is damaged or was edited"):
        _resume(tmp_path, ckpt)


def test_directories_that_are_not_checkpoints_are_refused(tmp_path: Path) -> None:
    staging = tmp_path / ".last.ckpt.0badc0de.tmp"
    staging.mkdir()
    with pytest.raises(RatelConfigError, match="staging directory of a checkpoint save that did not finish"):
        _resume(tmp_path, staging)
    empty = tmp_path / "empty.ckpt"
    empty.mkdir()
    with pytest.raises(RatelConfigError, match="directory without ratel_checkpoint.json"):
        _resume(tmp_path, empty)


class OneGroup(LM):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def test_a_checkpoint_of_another_optimizer_setup_is_refused(tmp_path: Path) -> None:
    ckpt = _sharded(tmp_path)
    with pytest.raises(RatelConfigError, match="written for another model or optimizer"):
        _resume(tmp_path, ckpt, OneGroup("llama"))


def test_stale_staging_directories_are_cleaned_by_the_next_save(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    stale = [tmp_path / "ckpt" / ".last.ckpt.0badc0de.tmp", tmp_path / "ckpt" / ".last.ckpt.0badc0de.old"]
    for path in stale:
        path.mkdir()
    _sharded(tmp_path, steps=1)
    assert not any(p.exists() for p in stale)


_CTRL_C_IN_THE_WRITER = """
import os, signal, sys, time
from pathlib import Path
# Python's own Ctrl-C, whatever the launching shell or test left (a background job starts with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning_ratel import RatelStrategy
from lightning_ratel.io import tensorfiles
from tests.models import LM, trainer

write = tensorfiles.pwrite_all

def interrupted(fd, data, offset, path):
    if Path(path).is_relative_to({ckpt!r}):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    write(fd, data, offset, path)

tensorfiles.pwrite_all = interrupted
callbacks = [ModelCheckpoint(dirpath={ckpt!r}, every_n_train_steps=2), OnExceptionCheckpoint({exc!r})]
t = trainer(RatelStrategy(ssd_paths=[{swap!r}], param_cache="ssd", checkpoint_format="sharded"), callbacks=callbacks,
            enable_checkpointing=True)
t.fit(LM("llama"))
"""


def test_ctrl_c_in_the_checkpoint_writer_leaves_the_run_recoverable(tmp_path: Path) -> None:
    swap, ckpt, exc = tmp_path / "swap", tmp_path / "ckpt", tmp_path / "exc"
    swap.mkdir()
    script = _CTRL_C_IN_THE_WRITER.format(root=str(ROOT), swap=str(swap), ckpt=str(ckpt), exc=str(exc))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "KeyboardInterrupt" in run.stdout + run.stderr
    saved = _lightning_state(exc / "on_exception.ckpt", tmp_path)
    assert saved["global_step"] == 2
    assert max_rel_err(plain_params(2), saved["state_dict"]) <= 1e-5
    assert not ckpt.exists() or list(ckpt.iterdir()) == []
    assert os.listdir(swap) == []


def test_replacing_a_directory_where_the_filesystem_cannot_swap(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without RENAME_EXCHANGE the old directory is renamed aside first: a kill between the renames leaves no target
    (never a mix) and the old one beside it; the next save of that name removes the leftovers."""
    monkeypatch.setattr(tensorfiles, "_exchange", lambda a, b: False)
    target = tmp_path / "last.ckpt"
    for step in (1, 2):
        staging = tensorfiles.staging_path(target)
        staging.mkdir()
        (staging / "step").write_text(str(step))
        tensorfiles.replace_directory(staging, target)
        assert (target / "step").read_text() == str(step)
    staging = tensorfiles.staging_path(target)
    staging.mkdir()
    replace = os.replace

    def killed_after_the_first(source: Any, destination: Any) -> None:
        if Path(source) == staging:
            raise KeyboardInterrupt
        replace(source, destination)

    monkeypatch.setattr(os, "replace", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        tensorfiles.replace_directory(staging, target)
    monkeypatch.setattr(os, "replace", replace)
    assert not target.exists()
    assert [p.name.endswith(".old") for p in tmp_path.glob(".last.ckpt.*")].count(True) == 1
    tensorfiles.remove_stale_staging(target)
    assert list(tmp_path.iterdir()) == []
