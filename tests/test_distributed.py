"""Data-parallel RatelStrategy on several processes (gloo on the CPU), against Lightning's own ``ddp`` strategy.

Each run is ``python -m tests.distributed_run`` (:mod:`tests.distributed_run`): Lightning's launcher starts the second
rank, or the test starts one process per node. The runs are small (a 3-layer transformers Llama or T5, 3 steps).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_ratel.plan.owners import UnitCost, assign_owners, imbalance
from tests.models import max_rel_err

ROOT = Path(__file__).resolve().parent.parent
ACCUMULATE_CLIP = ["--accumulate", "2", "--clip", "0.5"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(extra)
    return env


def _run(out: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.distributed_run", str(out), *args], cwd=ROOT,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-4000:]


def _load(out: Path, rank: int = 0) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def _assert_same(ref: dict, got: dict, tol: float = 1e-6) -> None:
    """Parameters, Adam moments, step counts and param groups agree within ``tol`` (relative)."""
    assert max_rel_err(ref["params"], got["params"]) <= tol
    ref_state, got_state = ref["optimizer"]["state"], got["optimizer"]["state"]
    assert ref_state.keys() == got_state.keys() and ref_state
    for i in ref_state:
        assert got_state[i]["step"].item() == ref_state[i]["step"].item()
        for key in ("exp_avg", "exp_avg_sq"):
            scale = ref_state[i][key].abs().max().clamp(min=1e-20)
            assert ((ref_state[i][key] - got_state[i][key]).abs().max() / scale).item() <= tol, (i, key)
    assert got["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Plain Lightning ``ddp`` on 2 processes: a Llama with accumulation over 2 micro-batches and clipping by norm."""
    out = tmp_path_factory.mktemp("ddp")
    _ok(_run(out, "--strategy", "ddp", *ACCUMULATE_CLIP))
    return _load(out)


def test_owners_balance_bytes_and_time() -> None:
    # A Llama-like model: an embedding, 8 equal blocks, a head; bytes and time in proportion.
    costs = [UnitCost(0, 1200, 100.0)] + [UnitCost(u, 600, 50.0) for u in range(1, 9)] + [UnitCost(9, 1200, 100.0)]
    owners = assign_owners(costs, 2)
    assert imbalance(costs, owners, 2) == (1.0, 1.0)
    assert owners == assign_owners(list(reversed(costs)), 2)  # the same on every rank, whatever the order given
    # Bytes and time apart (fp32 masters kept in the host cache cost no master on disk): both within 1.15 of even.
    costs = [UnitCost(u, 800 if u % 2 else 1200, 100.0) for u in range(12)]
    assert all(share <= 1.15 for share in imbalance(costs, assign_owners(costs, 3), 3))
    assert assign_owners(costs, 1) == {u: 0 for u in range(12)}
    with pytest.raises(ValueError):
        assign_owners(costs, 0)


def test_two_processes_equal_ddp_with_accumulation_and_clipping(tmp_path: Path, ddp_reference: dict) -> None:
    _ok(_run(tmp_path, *ACCUMULATE_CLIP))
    for rank in (0, 1):
        _assert_same(ddp_reference, _load(tmp_path, rank))
    # The first step speculated (each owner updated during backward as if nothing clipped), clipped, and was redone;
    # the steps after it waited for the end of backward.
    counts = [_load(tmp_path, rank)["counts"] for rank in (0, 1)]
    assert all(c.get("redone", 0) > 0 and c.get("deferred", 0) > 0 for c in counts), counts


def test_bf16_mixed_equals_ddp(tmp_path: Path) -> None:
    """16-bit compute copies travel between ranks as bytes (gloo sends no bfloat16 and no int16)."""
    args = ["--precision", "bf16-mixed", *ACCUMULATE_CLIP]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", *args))
    _ok(_run(tmp_path / "ratel", *args))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", rank))


def test_speculation_that_stands_equals_ddp(tmp_path: Path) -> None:
    """A norm that never clips: every step's updates run during backward on their owners and stand."""
    args = ["--accumulate", "2", "--clip", "100"]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", *args))
    _ok(_run(tmp_path / "ratel", *args))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", rank))
        counts = _load(tmp_path / "ratel", rank)["counts"]
        assert counts.get("overlapped", 0) > 0 and not counts.get("redone") and not counts.get("deferred"), counts


def test_fp16_overflow_on_one_rank_drops_the_speculative_updates_of_all(tmp_path: Path) -> None:
    """fp16 loss scaling: at step 1 only rank 1's embedding gradient overflows, so only that shard's owner sees it;
    every rank drops its speculative updates and skips the step, on the very bits of the deferred path (Lightning
    runs no fp16 on the CPU under ``ddp``; the deferred path equals ``ddp`` in the tests above)."""
    args = ["--precision", "16-mixed", "--overflow", "1:1"]
    _ok(_run(tmp_path / "deferred", "--no-speculate", *args))
    _ok(_run(tmp_path / "speculative", *args))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "deferred", rank), _load(tmp_path / "speculative", rank), tol=0.0)
        got = _load(tmp_path / "speculative", rank)
        assert got["counts"].get("dropped", 0) > 0, got["counts"]
        assert all(entry["step"].item() == 2 for entry in got["optimizer"]["state"].values())


def test_two_nodes_of_one_device_equal_ddp(tmp_path: Path, ddp_reference: dict) -> None:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed_run", str(tmp_path), "--devices", "1",
                               "--num-nodes", "2", *ACCUMULATE_CLIP], cwd=ROOT,
                              env=_env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-4000:]
    for rank in (0, 1):
        _assert_same(ddp_reference, _load(tmp_path, rank))


def test_encoder_decoder_equals_ddp(tmp_path: Path) -> None:
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", "--model", "t5", "--clip", "0.3"))
    _ok(_run(tmp_path / "ratel", "--model", "t5", "--clip", "0.3"))
    _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", 1))


def test_buffers_are_rank_zeros_as_under_ddp(tmp_path: Path) -> None:
    """BatchNorm's running statistics, which each rank's forward updates from its own micro-batch, follow rank 0's as
    ``ddp`` broadcasts them (at setup, and before a forward that follows one which reduced gradients), with
    accumulation (micro-batches that do not reduce) and validation during fit (forwards without gradients)."""
    args = ["--model", "batchnorm", *ACCUMULATE_CLIP, "--validate", "4"]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", *args))
    _ok(_run(tmp_path / "ratel", *args))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp", rank), _load(tmp_path / "ratel", rank))
    # Each rank's last forward saw its own data: the ranks' statistics differ, so the comparison per rank tells.
    key = "model.layers.0.norm.running_mean"
    assert not torch.equal(_load(tmp_path / "ratel", 0)["params"][key], _load(tmp_path / "ratel", 1)["params"][key])


def test_ranks_agree_on_the_copy_back(tmp_path: Path) -> None:
    """Each rank measures its own free memory for the copy back at the end of fit, a collective: where one rank finds
    no room, no rank copies the parameters back (each would otherwise wait for the other), and both say so."""
    # A checkpoint of the last step holds the values not copied back (several ranks cannot keep their swap files yet).
    result = _run(tmp_path, "--no-room", "1", "--save", str(tmp_path / "last.ckpt"), timeout=180)
    _ok(result)
    for rank in (0, 1):
        params = _load(tmp_path, rank)["params"]
        assert all(torch.isnan(v).all() for k, v in params.items() if k.endswith("weight")), rank
    assert "not copied back" in result.stderr


def test_without_room_or_checkpoint_the_ranks_warn_instead_of_keeping_swap_files(tmp_path: Path) -> None:
    """No rank can keep its swap files for an export yet (each holds only the states it owns): where nothing is copied
    back and no checkpoint holds the last step, fit ends on every rank with the warning, not in a hang."""
    result = _run(tmp_path, "--no-room", "0", timeout=180)
    _ok(result)
    assert "values are lost" in result.stderr
    assert not list(tmp_path.glob("swap/*"))


def test_keeping_swap_files_on_several_ranks_is_refused_before_training(tmp_path: Path) -> None:
    result = _run(tmp_path, "--keep-swap-files", timeout=180)
    assert result.returncode != 0
    assert "cannot keep its swap files" in result.stderr
    assert not (tmp_path / "rank0.pt").exists()


@pytest.mark.parametrize("states", ["ssd", "host"])
def test_each_state_once_per_node(tmp_path: Path, states: str) -> None:
    """Two ranks on one node hold the optimizer states of one rank between them, in the swap files (whose bytes on
    disk, both ranks' files in one directory, are within 1.1x of one rank's) or in host memory; each rank holds part."""
    _ok(_run(tmp_path / "one", "--devices", "1", "--states", states))
    _ok(_run(tmp_path / "two", "--states", states))
    one, two = _load(tmp_path / "one"), [_load(tmp_path / "two", r) for r in (0, 1)]
    assert sum(t["states"][states] for t in two) == one["states"][states] > 0
    assert all(0 < t["states"][states] < one["states"][states] for t in two)
    if states == "ssd":
        assert two[0]["swap_bytes"] <= 1.1 * one["swap_bytes"]
        assert sum(t["placement"]["disk"] for t in two) <= 1.1 * one["placement"]["disk"]
        assert all(0 < t["placement"]["disk"] < one["placement"]["disk"] for t in two)


def test_a_killed_rank_stops_the_others(tmp_path: Path) -> None:
    result = _run(tmp_path, "--fail", "1:1", env=_env(RATEL_TEST_KILL="1"), timeout=180)
    assert result.returncode != 0
    assert not (tmp_path / "rank0.pt").exists()


def test_a_raising_rank_stops_the_others(tmp_path: Path) -> None:
    result = _run(tmp_path, "--fail", "1:1", timeout=180)
    assert result.returncode != 0
    assert "rank 1 fails at step 1" in result.stderr
    assert not (tmp_path / "rank0.pt").exists()


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints written after 2 steps on 2 ranks by ``ddp`` (``ddp.ckpt``) and by RatelStrategy (``ratel.ckpt``)."""
    out = tmp_path_factory.mktemp("saved")
    for name in ("ddp", "ratel"):
        _ok(_run(out / name, "--strategy", name, "--steps", "2", "--save", str(out / f"{name}.ckpt")))
    return out


def test_checkpoint_of_two_ranks_resumes_on_one(tmp_path: Path, saved_by_two: Path) -> None:
    """Resumed on one rank, as plain Lightning resumes ``ddp``'s checkpoint on one device."""
    _ok(_run(tmp_path / "plain", "--strategy", "auto", "--devices", "1", "--steps", "4",
             "--resume", str(saved_by_two / "ddp.ckpt")))
    _ok(_run(tmp_path / "ratel", "--devices", "1", "--steps", "4", "--resume", str(saved_by_two / "ratel.ckpt")))
    _assert_same(_load(tmp_path / "plain"), _load(tmp_path / "ratel"))


def test_checkpoint_of_two_ranks_resumes_on_three(tmp_path: Path, saved_by_two: Path) -> None:
    """Resumed on three ranks, as ``ddp`` resumes its own (three ranks sum in another order: rounding apart)."""
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", "--devices", "3", "--steps", "4",
             "--resume", str(saved_by_two / "ddp.ckpt")))
    _ok(_run(tmp_path / "ratel", "--devices", "3", "--steps", "4", "--resume", str(saved_by_two / "ratel.ckpt")))
    for rank in (0, 2):
        _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", rank))
