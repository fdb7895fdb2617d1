"""Bad swap directories, a full disk, a second run on a busy directory and I/O faults during training.

Configuration problems must stop ``trainer.fit`` with a :class:`RatelConfigError` naming the path before the first
training step; an I/O error during training must surface with its errno and the swap path, leave the last checkpoint
intact and release the directory for the next run.
"""

from __future__ import annotations

import collections
import errno
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_ratel import RatelConfigError, RatelStrategy
from lightning_ratel.runtime import storage, swapfile
from lightning_ratel.runtime.storage import TensorStore
from tests.models import LM, final_state, max_rel_err, trainer


class CountingLM(LM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.training_steps = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        return super().training_step(batch, batch_idx)


def fit_expecting_config_error(ssd_paths: list[str], *, name: str = "ratel") -> RatelConfigError:
    lm = CountingLM(n_batches=2)
    # The optimizer states in the swap files, so that the run needs the drives this checks.
    t = trainer(RatelStrategy(ssd_paths=ssd_paths, optimizer_states="ssd"), max_steps=2)
    with pytest.raises(RatelConfigError) as info:
        t.fit(lm)
    assert lm.training_steps == 0, "training started before the configuration error"
    # The module is usable again: ordinary, finite parameters.
    for pname, p in lm.named_parameters():
        assert torch.isfinite(p).all(), pname
        if p.numel() > 1:
            assert all(s != 0 for s in p.stride()), pname
    return info.value


def store_opens(directory: Path) -> bool:
    """Whether a new store can lock ``directory`` under the engine's store name (the lock was released)."""
    with TensorStore([str(directory)], name="ratel") as store:
        store.reserve("probe", 4096)
    return True


# ---------------------------------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ssd_paths": []}, "ssd_paths"),
        ({"prefetch_depth": -1}, "prefetch_depth"),
        ({"prefetch_depth": 1.5}, "prefetch_depth"),
        ({"activation_policy": "disk"}, "activation_policy"),
        ({"activation_policy": {"*layers.0": "ssd", "*": "gpu"}}, "activation_policy"),
        ({"param_cache": "disk"}, "param_cache"),
        ({"param_init_fn": "normal"}, "param_init_fn"),
    ],
)
def test_bad_settings_rejected_at_construction(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(RatelConfigError, match=words):
        RatelStrategy(**kwargs)


def test_single_path_string_accepted(tmp_path: Path) -> None:
    assert RatelStrategy(ssd_paths=str(tmp_path)).ssd_paths == [str(tmp_path)]


def test_unknown_block_name_rejected_before_training(tmp_path: Path) -> None:
    lm = CountingLM(n_batches=2)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], blocks=["model.no_such_layer"]), max_steps=1)
    with pytest.raises(RatelConfigError, match="no_such_layer"):
        t.fit(lm)
    assert lm.training_steps == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("policy", "words"), [
    ({"*layer.1": "recompute", "*": "host"}, r"\['\*layer\.1'\] match no block"),
    ({"*": "host", "*layers.1": "ssd"}, r"\['\*layers\.1'\] only match blocks an earlier pattern already places"),
], ids=["typo", "shadowed"])
def test_activation_policy_pattern_placing_no_block_rejected_before_training(tmp_path: Path, policy: dict[str, str],
                                                                             words: str) -> None:
    lm = CountingLM(n_batches=2)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=policy), max_steps=1)
    with pytest.raises(RatelConfigError, match=words) as info:
        t.fit(lm)
    # The names the patterns are matched against.
    assert "model.model.layers.0, model.model.layers.1" in str(info.value)
    assert lm.training_steps == 0
    assert os.listdir(tmp_path) == []


def test_activation_policy_default_for_no_remaining_block_accepted(tmp_path: Path) -> None:
    """A closing ``"*"`` is the default for whatever the other patterns leave, even when they leave nothing."""
    policy = {"*embed_tokens": "host", "*layers.*": "recompute", "*norm": "host", "*lm_head": "host", "*": "ssd"}
    trainer(RatelStrategy(ssd_paths=[str(tmp_path)], activation_policy=policy), max_steps=1).fit(LM(n_batches=2))


def test_same_directory_twice_rejected(tmp_path: Path) -> None:
    error = fit_expecting_config_error([str(tmp_path), str(tmp_path / ".." / tmp_path.name)])
    assert "more than once" in str(error)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------- bad directories


def test_missing_directory_is_created_and_removed_again(tmp_path: Path) -> None:
    """Like ModelCheckpoint's dirpath, a missing swap directory is created; what the run created goes again with its
    swap files, unless something is left in it (kept swap files)."""
    missing = tmp_path / "does" / "not" / "exist"
    seen: list[bool] = []

    class Look(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen.append(missing.is_dir())

    lm = CountingLM(n_batches=2)
    trainer(RatelStrategy(ssd_paths=[str(missing)]), max_steps=2, callbacks=[Look()]).fit(lm)
    assert lm.training_steps == 2 and seen == [True]
    assert os.listdir(tmp_path) == [], "the directories the run created are removed with the swap files"
    trainer(RatelStrategy(ssd_paths=[str(missing)], keep_swap_files=True), max_steps=1).fit(CountingLM(n_batches=2))
    assert sorted(os.listdir(missing)) == ["ratel.index.json", "ratel.swap"]


def test_directory_that_cannot_be_created(tmp_path: Path) -> None:
    """Refused before the logger makes its version directory and before the model is built."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"a file where a parent directory should be")
    good = tmp_path / "good"
    good.mkdir()
    lm = CountingLM(n_batches=2)
    logs = tmp_path / "logs"
    t = trainer(RatelStrategy(ssd_paths=[str(good), str(blocker / "swap")]), max_steps=2,
                logger=CSVLogger(str(logs)))
    with pytest.raises(RatelConfigError, match="cannot be created") as info:
        t.fit(lm)
    assert str(blocker / "swap") in str(info.value)
    assert lm.training_steps == 0
    assert not logs.exists(), "a refused run left a logger directory behind"
    assert os.listdir(good) == []


def test_regular_file_instead_of_directory(tmp_path: Path) -> None:
    regular = tmp_path / "swapfile"
    regular.write_bytes(b"not a directory")
    with pytest.raises(RatelConfigError, match="not directories") as info:
        RatelStrategy(ssd_paths=[str(regular)])
    assert str(regular) in str(info.value)
    assert regular.read_bytes() == b"not a directory"


def test_unwritable_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # chmod does not stop root, so make the store's own open() refuse files in that directory.
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_open = swapfile.open_file

    def refusing_open(path: str, flags: int, mode: int = 0o600) -> int:
        if os.path.dirname(path) == str(readonly.resolve()) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(swapfile, "open_file", refusing_open)
    error = fit_expecting_config_error([str(readonly)])
    assert str(readonly.resolve()) in str(error)
    assert "writable" in str(error) or "ermission" in str(error)
    assert os.listdir(readonly) == []


def test_not_enough_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssd = tmp_path / "small"
    ssd.mkdir()
    usage = collections.namedtuple("usage", "total used free")
    calls = []

    def tiny_disk(path: Any) -> Any:
        calls.append(os.fspath(path))
        return usage(1 << 30, (1 << 30) - 8192, 8192)

    monkeypatch.setattr(storage.shutil, "disk_usage", tiny_disk)
    error = fit_expecting_config_error([str(ssd)])
    assert calls, "the free-space check never asked the filesystem"
    assert str(ssd.resolve()) in str(error)
    assert "free" in str(error)
    assert os.listdir(ssd) == [], "a refused run must leave nothing behind"


def test_directory_in_use_by_another_store(tmp_path: Path) -> None:
    ssd = tmp_path / "busy"
    ssd.mkdir()
    with TensorStore([str(ssd)], name="ratel") as holder:
        holder.reserve("mine", 4096)
        error = fit_expecting_config_error([str(ssd)])
        assert "in use" in str(error)
        assert str(ssd.resolve()) in str(error)
        assert str(os.getpid()) in str(error)
    # Once the holder is gone, the directory works.
    lm = LM(n_batches=2)
    trainer(RatelStrategy(ssd_paths=[str(ssd)]), max_steps=1).fit(lm)
    assert os.listdir(ssd) == []


def test_directory_in_use_by_a_running_fit(tmp_path: Path) -> None:
    """A fit started while another fit's engine holds the directory is refused; the first fit is not disturbed."""
    ssd = tmp_path / "busy"
    ssd.mkdir()
    errors: list[BaseException] = []

    class SecondRun(Callback):
        def on_train_batch_end(self, first: L.Trainer, *args: Any) -> None:
            if first.global_step != 1:
                return
            second = CountingLM(n_batches=2)
            t2 = trainer(RatelStrategy(ssd_paths=[str(ssd)]), max_steps=1)
            try:
                t2.fit(second)
            except RatelConfigError as err:
                errors.append(err)
            assert second.training_steps == 0

    lm = LM(n_batches=2)
    t = trainer(RatelStrategy(ssd_paths=[str(ssd)]), max_steps=2, callbacks=[SecondRun()])
    t.fit(lm)
    assert len(errors) == 1 and "in use" in str(errors[0])
    ref = LM(n_batches=2)
    t_ref = trainer("auto", max_steps=2)
    t_ref.fit(ref)
    assert max_rel_err(final_state(ref, t_ref)[0], final_state(lm, t)[0]) <= 1e-5
    assert os.listdir(ssd) == []


# ---------------------------------------------------------------------------------------------------- I/O faults


class FailFrom(Callback):
    """Arms ``state['armed']`` when the third optimizer step begins (the step-2 checkpoint is already on disk)."""

    def __init__(self, state: dict[str, bool]) -> None:
        self.state = state

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            self.state["armed"] = True


def inject_io_fault(monkeypatch: pytest.MonkeyPatch, call: str, code: int, state: dict[str, bool]) -> list[int]:
    """Make ``storage.<call>`` (``_pwrite`` or ``_pread``) fail with ``code`` while ``state['armed']``.

    Returns:
        The file offsets of the calls that failed, filled as they happen.
    """
    real = getattr(storage, call)
    failures: list[int] = []

    def faulty(fd: int, buf: memoryview, offset: int) -> int:
        if state["armed"]:
            failures.append(offset)
            raise OSError(code, os.strerror(code))
        return real(fd, buf, offset)

    monkeypatch.setattr(storage, call, faulty)
    return failures


def plain_params(steps: int) -> dict[str, torch.Tensor]:
    lm = LM(n_batches=2)
    t = trainer("auto", max_steps=steps)
    t.fit(lm)
    return final_state(lm, t)[0]


@pytest.mark.parametrize(("call", "code"), [("_pwrite", errno.ENOSPC), ("_pread", errno.EIO)])
def test_io_error_during_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, code: int) -> None:
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    ckpt_dir = tmp_path / "ckpt"
    state = {"armed": False}
    real = getattr(storage, call)
    failures = inject_io_fault(monkeypatch, call, code, state)
    lm = CountingLM(n_batches=2)
    t = trainer(
        RatelStrategy(ssd_paths=[str(ssd)], optimizer_states="ssd"),
        max_steps=6,
        enable_checkpointing=True,
        callbacks=[FailFrom(state), ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=1, save_top_k=-1)],
    )
    with pytest.raises(OSError) as info:
        t.fit(lm)
    assert failures, "the fault was never hit"
    assert info.value.errno == code, repr(info.value)
    assert str(ssd.resolve()) in str(info.value), str(info.value)
    if code == errno.ENOSPC:
        assert "more bytes" in str(info.value) and "free on its filesystem" in str(info.value), str(info.value)
    assert lm.training_steps < 6

    # The last checkpoint written before the fault is intact and holds exactly 2 plain steps.
    monkeypatch.setattr(storage, call, real)
    names = sorted(os.listdir(ckpt_dir))
    step2 = [n for n in names if "step=2" in n]
    assert len(step2) == 1, names
    ckpt = torch.load(ckpt_dir / step2[0], weights_only=False)
    assert ckpt["global_step"] == 2
    ref = plain_params(2)
    assert max_rel_err(ref, ckpt["state_dict"]) <= 1e-5
    # No checkpoint may claim a step whose update failed.
    for later in (n for n in names if n not in step2 and "step=1" not in n):
        bad = torch.load(ckpt_dir / later, weights_only=False)
        assert max_rel_err(plain_params(bad["global_step"]), bad["state_dict"]) <= 1e-5, later

    # The directory is released: its lock is gone and a new store (or run) can use it.
    assert not any(n.endswith(".lock") for n in os.listdir(ssd)), os.listdir(ssd)
    assert store_opens(ssd)


def test_user_exception_restores_parameters_and_releases_directory(tmp_path: Path) -> None:
    """An error in the user's code (not I/O) at step 3 leaves the module at its 2-step state, usable again."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()

    class Boom(LM):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 2:
                raise RuntimeError("user bug")
            return super().training_step(batch, batch_idx)

    lm = Boom(n_batches=2)
    t = trainer(RatelStrategy(ssd_paths=[str(ssd)]), max_steps=4)
    with pytest.raises(RuntimeError, match="user bug"):
        t.fit(lm)
    assert os.listdir(ssd) == []
    ref = plain_params(2)
    assert max_rel_err(ref, lm.state_dict()) <= 1e-5
    assert store_opens(ssd)


def test_io_error_with_on_exception_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's stock ``OnExceptionCheckpoint`` saves from inside the exception handler: that save must neither
    write a broken state nor keep the swap directory locked (Lightning skips teardown when ``on_exception`` raises).
    """
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    exc_dir = tmp_path / "on_exception"
    state = {"armed": False}
    real = storage._pwrite
    inject_io_fault(monkeypatch, "_pwrite", errno.ENOSPC, state)
    lm = LM(n_batches=2)
    t = trainer(
        RatelStrategy(ssd_paths=[str(ssd)], optimizer_states="ssd"),
        max_steps=6,
        enable_checkpointing=True,
        callbacks=[FailFrom(state), OnExceptionCheckpoint(dirpath=str(exc_dir))],
    )
    with pytest.raises(OSError) as info:
        t.fit(lm)
    monkeypatch.setattr(storage, "_pwrite", real)
    assert info.value.errno == errno.ENOSPC, repr(info.value)
    assert str(ssd.resolve()) in str(info.value)
    # Whatever was saved on the way out must be a real training state, not a half-written or NaN one.
    for path in exc_dir.glob("*.ckpt") if exc_dir.exists() else ():
        saved = torch.load(path, weights_only=False)
        assert max_rel_err(plain_params(saved["global_step"]), saved["state_dict"]) <= 1e-5, path.name
    # The run is over: its swap file is removed and the directory is free for the next run.
    assert os.listdir(ssd) == [], os.listdir(ssd)
    assert store_opens(ssd)


def test_same_module_resumes_after_io_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented recovery from an I/O error is the last checkpoint: the same module object must be able to load
    it and a new fit on the (released) directory must then reach the uninterrupted result."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    ckpt_dir = tmp_path / "ckpt"
    state = {"armed": False}
    real = storage._pwrite
    inject_io_fault(monkeypatch, "_pwrite", errno.ENOSPC, state)
    lm = LM(n_batches=2)
    t = trainer(
        RatelStrategy(ssd_paths=[str(ssd)], optimizer_states="ssd"),
        max_steps=4,
        enable_checkpointing=True,
        callbacks=[FailFrom(state), ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=2, save_top_k=-1)],
    )
    with pytest.raises(OSError):
        t.fit(lm)
    monkeypatch.setattr(storage, "_pwrite", real)
    (last,) = ckpt_dir.glob("*step=2.ckpt")

    # The module holds ordinary tensors again (whatever their values), so a checkpoint can be loaded into it...
    for name, p in lm.named_parameters():
        assert p.numel() <= 1 or all(s != 0 for s in p.stride()), f"{name} is still a paging placeholder"
    lm.load_state_dict(torch.load(last, weights_only=False)["state_dict"])
    # ...and training resumes from it to the same place as never failing.
    t2 = trainer(RatelStrategy(ssd_paths=[str(ssd)]), max_steps=4)
    t2.fit(lm, ckpt_path=str(last))
    assert max_rel_err(plain_params(4), lm.state_dict()) <= 1e-5
    assert os.listdir(ssd) == []


# ---------------------------------------------------------------------------------------------------- argument types


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ssd_paths": 123}, "ssd_paths"),
        ({"ssd_paths": [None]}, "ssd_paths"),
        ({"ssd_paths": [""]}, "ssd_paths"),
        ({"activation_policy": ["ssd"]}, "activation_policy"),
        ({"activation_policy": {"*": 3}}, "activation_policy"),
        ({"blocks": "model.layers.0"}, r"\['model.layers.0'\]"),
        ({"blocks": ["a", 1]}, "blocks"),
        ({"prefetch_depth": True}, "prefetch_depth"),
        ({"prefetch_depth": "2"}, "prefetch_depth"),
        ({"keep_swap_files": "no"}, "keep_swap_files"),
        ({"plan": 123}, "plan"),
        ({"host_memory_limit": True}, "host_memory_limit"),
        ({"gradient_exchange": "per_step"}, "gradient_exchange"),
    ],
)
def test_wrong_types_rejected_at_construction(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(RatelConfigError, match=words):
        RatelStrategy(**kwargs)


def test_corrupt_plan_file_names_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "plan.json"
    broken.write_text('{"activation_placement": {"a/b": "host"')
    with pytest.raises(RatelConfigError, match="plan.json") as info:
        RatelStrategy(plan=str(broken))
    assert "JSON" in str(info.value)
    not_a_plan = tmp_path / "other.json"
    not_a_plan.write_text('{"hello": 1}')
    with pytest.raises(RatelConfigError, match="other.json"):
        RatelStrategy(plan=str(not_a_plan))


def _plan_file(tmp_path: Path, model: str) -> Path:
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)]), max_steps=3, logger=CSVLogger(str(tmp_path / "logs")))
    t.fit(LM(model, n_batches=2))
    return Path(t.log_dir) / "ratel_plan.json"


def test_plan_of_another_model_refused_before_training(tmp_path: Path) -> None:
    plan = _plan_file(tmp_path, "llama")
    data = json.loads(plan.read_text())
    assert data["format_version"] == 1 and "model.model.layers.0" in data["blocks"]
    lm = CountingLM("gpt2", n_batches=2)
    with pytest.raises(RatelConfigError, match="other blocks"):
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)], plan=str(plan)), max_steps=2).fit(lm)
    assert lm.training_steps == 0
    # A file of another format version is refused when the strategy is made.
    data["format_version"] = 99
    plan.write_text(json.dumps(data))
    with pytest.raises(RatelConfigError, match="format version"):
        RatelStrategy(plan=str(plan))


def test_device_memory_limit_on_cpu_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="device_memory_limit"):
        trainer(RatelStrategy(ssd_paths=[str(tmp_path)], device_memory_limit="1GiB"), max_steps=1).fit(LM(n_batches=1))


def test_no_prefetch_is_a_valid_setting(tmp_path: Path) -> None:
    lm = LM(n_batches=2)
    t = trainer(RatelStrategy(ssd_paths=[str(tmp_path)], prefetch_depth=0), max_steps=2)
    t.fit(lm)
    assert max_rel_err(plain_params(2), lm.state_dict()) <= 1e-5


def _fit_interrupted(strategy: Any, step: int, call: int = 1) -> tuple[L.Trainer, LM, list[BaseException]]:
    """Fit with Ctrl-C pressed inside a block's forward (the ``call``-th run of its MLP's forward in step ``step``: the
    second is a replay under ``recompute``); the Trainer, the module and the exceptions ``on_exception`` saw."""
    lm = LM(n_batches=2)
    calls: collections.Counter[int] = collections.Counter()

    def ctrl_c(module: torch.nn.Module, args: Any) -> None:
        calls[lm.trainer.global_step] += 1
        if lm.trainer.global_step == step and calls[step] == call:
            raise KeyboardInterrupt

    lm.model.model.layers[1].mlp.register_forward_pre_hook(ctrl_c)
    seen: list[BaseException] = []

    class Seen(Callback):
        def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
            seen.append(exception)

    t = trainer(strategy, max_steps=4, callbacks=[Seen()])
    with pytest.raises(SystemExit) as exit_info:
        t.fit(lm)
    assert exit_info.value.code == 1
    assert calls[step] == call
    return t, lm, seen


@pytest.mark.parametrize(("policy", "call"), [("host", 1), ("recompute", 1), ("recompute", 2)],
                         ids=["host", "recompute", "in_a_replay"])
@pytest.mark.parametrize("step", [0, 2])
def test_ctrl_c_in_a_block_forward_exits_as_lightning_does(tmp_path: Path, sigint_handler: None, policy: str,
                                                           call: int, step: int) -> None:
    """Lightning's own exit (on_exception, teardown, ``SystemExit(1)``, status interrupted), the module at its last
    finished step as plain training leaves it, nothing left on the dispatch-mode or saved-tensor hook stacks, and the
    swap directory released. The first step's forwards run under the escape detector, later ones without it; a
    replay runs in backward."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    plain_trainer, plain_module, _ = _fit_interrupted("auto", step)
    t, lm, seen = _fit_interrupted(RatelStrategy(ssd_paths=[str(ssd)], activation_policy=policy), step, call)
    assert t.interrupted and t.state.status == plain_trainer.state.status == TrainerStatus.INTERRUPTED
    assert len(seen) == 1 and isinstance(seen[0], KeyboardInterrupt)
    assert t.global_step == plain_trainer.global_step == step
    assert max_rel_err(plain_module.state_dict(), lm.state_dict()) <= 1e-5
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert os.listdir(ssd) == []
    assert store_opens(ssd)
