"""Data-parallel RatelStrategy on several processes (gloo on the CPU), against Lightning's own ``ddp`` strategy.

Each run is :mod:`tests.distributed_run`, its ranks forked from a process that imported it once
(:mod:`tests.forked_ranks`) as a cluster's launcher starts them; a few runs are ``python -m tests.distributed_run``
whose other ranks Lightning's launcher starts, as a user's script does. The runs are small (a 3-layer transformers
Llama or T5, 3 steps).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import lightning_ratel
from lightning_ratel.engine.coordinator import rank_threads
from lightning_ratel.errors import RatelConfigError, RatelRankFailed
from lightning_ratel.io.convert import main as convert_main
from lightning_ratel.io.convert import sharded_to_lightning
from lightning_ratel.io.sharded import ShardedReader, unit_writers
from lightning_ratel.plan import Plan, predict
from lightning_ratel.plan.exchange import choose_exchange
from lightning_ratel.plan.owners import UnitCost, assign_owners, imbalance
from lightning_ratel.runtime.collectives import Faults, Ranks, gather_outcomes
from tests import forked_ranks
from tests.distributed_run import arguments, node_speeds
from tests.forked_ranks import COMMAND, Ended, rank_environments
from tests.models import LM, max_rel_err

ROOT = Path(__file__).resolve().parent.parent
# AdamW's eps is 1e-5 in these runs, not torch's 1e-8. A step divides each gradient sum by its own size plus eps,
# so where a sum nearly cancels, a rounding of it in the last bit moves the parameter by up to lr * rounding / eps.
# Summed in another order than ddp's (below), with eps 1e-8, one parameter in 32k moved 4e-4 of a step on 2 ranks,
# and some moved 3e-3 of one on 4 ranks (relative errors 1.4e-5 and 1.3e-4, on an Intel host; under 1e-5 on AMD
# hosts): rounding that no bound told from an error. With eps 1e-5 the same runs are within 3.4e-6 and 1.3e-6. A sum
# that is wrong, not reordered, still moves the moments, and the steps, by far more.
ACCUMULATE_CLIP = ["--accumulate", "2", "--clip", "0.5", "--adam-eps", "1e-5"]
# Reducing each micro-batch sums a window's gradients over ranks and micro-batches in another order than ddp (which
# sums each rank's micro-batches first): fp32 rounding apart (measured on the test Llama after 3 steps, on an Intel
# host: parameters within 3.4e-6 of ddp's, moments within 2.3e-6).
ROUNDING = 1e-5


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(extra)
    return env


def _run(out: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None,
         lightning_launcher: bool = False) -> Ended:
    """One run of :mod:`tests.distributed_run`: its ranks forked (:mod:`tests.forked_ranks`), or, with
    ``lightning_launcher``, ``python -m tests.distributed_run`` whose second rank Lightning's launcher starts (what a
    user's ``python train.py`` does; the ranks' stderr is then rank 0's, and its return code the only one)."""
    env = env or _env()
    argv = [str(out), *args]
    if lightning_launcher:
        done = subprocess.run([*COMMAND, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return Ended([done.returncode], [done.stderr])
    parsed = arguments().parse_args(argv)
    world = parsed.devices * parsed.num_nodes
    return forked_ranks.run(argv, rank_environments(env, parsed.devices, parsed.num_nodes) if world > 1 else [env],
                            timeout)


def _ok(result: Ended) -> None:
    assert result.returncodes == [0] * len(result.returncodes), result.stderr[-4000:]


def _failed(result: Ended) -> None:
    """Every process of the run stopped with an error."""
    assert all(code != 0 for code in result.returncodes), (result.returncodes, result.stderr[-4000:])


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


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Plain Lightning ``ddp`` on 2 processes: a Llama with accumulation over 2 micro-batches and clipping by norm."""
    out = tmp_path_factory.mktemp("ddp")
    _ok(_run(out, "--strategy", "ddp", *ACCUMULATE_CLIP, "--sync-dist"))
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


def test_gradient_exchange_reduces_each_micro_batch_where_host_memory_needs_it() -> None:
    """The planner's choice in plain numbers: a rank holding 1000 bytes without the exchange, whose window buffers
    take 400 (a rank's sums of every gradient)."""
    choose = functools.partial(choose_exchange, "auto", 4, 2, 1000, 400)
    # On one rank nothing is exchanged; without accumulation the window stays while it fits (the same sums either
    # way, and the buckets' memory where it does not).
    assert choose_exchange("micro_batch", 4, 1, 1000, 400).reduces_per_step == 0
    assert choose_exchange("auto", 1, 2, 1000, 400, host_budget=1400).mode == "window"
    alone = choose_exchange("auto", 1, 2, 1000, 400, host_budget=1399)
    assert (alone.mode, alone.reduces_per_step) == ("micro_batch", 1) and "the same sums" in alone.describe()
    assert choose_exchange("micro_batch", 1, 2, 1000, 400).reduces_per_step == 1
    # A budget the windows fit: the window (ddp's sums); one they do not fit: reduce each micro-batch.
    assert choose(host_budget=1400).mode == "window"
    tight = choose(host_budget=1399)
    assert (tight.mode, tight.reduces_per_step) == ("micro_batch", 4) and "host budget" in tight.describe()
    assert choose().mode == "window" and "fit the host budget" in choose().describe()
    # Manual optimization keeps the window unless asked; an explicit choice stands.
    assert choose(host_budget=1399, automatic=False).mode == "window"
    assert choose_exchange("micro_batch", 4, 2, 1000, 400, automatic=False).mode == "micro_batch"
    assert choose_exchange("window", 4, 2, 1000, 400, host_budget=1).mode == "window"
    # On GPUs the reduces run on the device whatever the budget, each micro-batch's; asked for, also on the CPU; under
    # manual optimization only where asked for; on one rank nothing is exchanged.
    on_gpus = choose(host_budget=1400, gpu=True)
    assert (on_gpus.mode, on_gpus.reduces_per_step) == ("device", 4) and "NCCL" in on_gpus.describe()
    assert choose_exchange("device", 4, 2, 1000, 400).mode == "device"
    assert choose(gpu=True, automatic=False).mode == "window"
    assert choose_exchange("device", 4, 2, 1000, 400, automatic=False).mode == "device"
    assert choose_exchange("auto", 4, 1, 1000, 400, gpu=True).mode == "window"
    with pytest.raises(RatelConfigError, match="gradient_exchange"):
        choose_exchange("sometimes", 4, 2, 1000, 400)


def test_unit_files_of_a_sharded_checkpoint_go_to_owners_and_frozen_units_are_spread() -> None:
    """The owner of a unit's trainable shards writes its file (a LoRA block: frozen base and trainable adapter); units
    of frozen shards only go, largest first, to the rank with the fewest bytes to write."""

    def shard(unit: int, group: int, numel: int) -> SimpleNamespace:
        return SimpleNamespace(unit=unit, group=group, numel=numel, dtype=torch.bfloat16)

    units = {0: [shard(0, -1, 1000)], 1: [shard(1, -1, 600), shard(1, 0, 10)], 2: [shard(2, -1, 600), shard(2, 0, 10)],
             3: [shard(3, -1, 100)], 4: [shard(4, -1, 400)]}
    layout = SimpleNamespace(unit_shards=lambda: units)
    adam = SimpleNamespace(ranks=SimpleNamespace(world=2), owner=lambda s: {1: 1, 2: 0}[s.unit])
    # Rank 0 writes unit 2 (1320 bytes) and rank 1 unit 1 (1320); then 0 (2000 bytes) goes to rank 0, 4 (800) and
    # 3 (200) to rank 1.
    assert unit_writers(layout, adam) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 1}  # type: ignore[arg-type]


def test_gathered_outcomes_raise_mine_or_name_the_failed_rank() -> None:
    """This rank is rank 1 of 3; ``gather`` stands in for the collective, with the other ranks' outcomes given."""

    def gather(*others: tuple[bool, object]):
        return lambda mine: [others[0], mine, *others[1:]]

    assert gather_outcomes(gather((True, "a"), (True, "c")), lambda: "b", "unused") == ["a", "b", "c"]
    # Another rank failed: this one stops too, naming the first rank that failed and its error.
    with pytest.raises(RuntimeError, match=r"the export failed: rank 0 failed \(OSError: disk gone\)"):
        gather_outcomes(gather((False, "OSError: disk gone"), (False, "ValueError: x")), lambda: "b",
                        "the export failed")
    # This rank failed: the others hear of it first, then it raises its own error.
    sent = []

    def fail() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        gather_outcomes(lambda mine: sent.append(mine) or [(True, "a"), mine, (True, "c")], fail, "unused")
    assert sent == [(False, "OSError: disk gone")]


def test_failures_the_ranks_met_over_do_not_stop_the_save_that_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' fault watchers on one store: rank 1's failure stops rank 0's collectives until both met
    (``assemble``); the collectives they then run together (the save) watch only for a new failure, while the
    threads that stopped on the first keep seeing it."""
    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    first = [Faults(Ranks(rank=r, world=2, fault_timeout=timedelta(seconds=5)), "test") for r in (0, 1)]
    first[0].check()
    first[1].report(RuntimeError("rank 1 fails"))
    with pytest.raises(RatelRankFailed, match=r"rank 1 failed \(RuntimeError: rank 1 fails\)"):
        first[0].check()
    for faults, error in zip(first, (RatelRankFailed("rank 1 failed"), RuntimeError("rank 1 fails"))):
        faults.assemble(error)
    later = [faults.after_meeting() for faults in first]
    later[0].check()
    with pytest.raises(RatelRankFailed):
        first[0].check()
    # Lightning tells the strategy of the exception after the callbacks saved: nothing new to report.
    later[1].report(RuntimeError("rank 1 fails"))
    later[0].check()
    new = Faults(Ranks(rank=1, world=2), "test", generation=1)
    new.report(OSError("disk full"))
    with pytest.raises(RatelRankFailed, match=r"rank 1 failed \(OSError: disk full\)"):
        later[0].check()


@pytest.mark.parametrize("cores", [1, 2, 16, 64, 96])
def test_ranks_of_a_node_share_its_cores(cores: int) -> None:
    for ranks in range(1, 9):
        optimizer, copies = rank_threads(True, ranks, cores)
        # The node's CPU optimizers together run one thread per core (one each where there are fewer cores).
        assert ranks * optimizer <= max(cores, ranks) and optimizer >= max(1, cores // ranks)
        assert 1 <= copies <= max(1, optimizer // 4)
    # On the CPU the compute's own threads fill the cores: one thread updates, and copies on its own.
    assert rank_threads(False, 2, cores) == (1, 0)


def _shared_caches() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("ratel-host-cache-*")} if Path("/dev/shm").is_dir() else set()


def test_two_processes_equal_ddp_with_accumulation_and_clipping(tmp_path: Path, ddp_reference: dict) -> None:
    """The states of ``ddp``'s, and the loss logged with ``sync_dist`` (reduced over the strategy's own collectives)
    is ``ddp``'s mean of the ranks' losses."""
    _ok(_run(tmp_path, *ACCUMULATE_CLIP, "--sync-dist", lightning_launcher=True))
    for rank in (0, 1):
        _assert_same(ddp_reference, _load(tmp_path, rank))
        assert _load(tmp_path, rank)["metrics"]["train_loss"] == pytest.approx(
            ddp_reference["metrics"]["train_loss"], rel=1e-6, abs=0)
    # Each rank's gradient exchange held every shard's window at once (accumulation): the host accounting counts it,
    # as the pre-flight estimate of two ranks does.
    lm = LM("llama")
    estimate = lightning_ratel.estimate(lm, precision="32-true", optimizer=lm.configure_optimizers()["optimizer"],
                                        ranks=2, accelerator="cpu", param_cache="host")
    assert [_load(tmp_path, rank)["exchange_bytes"] for rank in (0, 1)] == [estimate.exchange_buffers] * 2
    # The first step speculated (each owner updated during backward as if nothing clipped), clipped, and was redone;
    # the steps after it waited for the end of backward.
    counts = [_load(tmp_path, rank)["counts"] for rank in (0, 1)]
    assert all(c.get("redone", 0) > 0 and c.get("deferred", 0) > 0 for c in counts), counts


def test_updates_after_backward_on_the_cpu_equal_ddp(tmp_path: Path, ddp_reference: dict) -> None:
    """Left to the cost model, a run on the CPU updates after backward on every owner: nothing overlapped, nothing
    speculated, the numbers ddp's."""
    _ok(_run(tmp_path, "--updates-after-backward", *ACCUMULATE_CLIP))
    for rank in (0, 1):
        _assert_same(ddp_reference, _load(tmp_path, rank))
        counts = _load(tmp_path, rank)["counts"]
        assert counts.get("deferred", 0) > 0 and not counts.get("overlapped") and not counts.get("redone"), counts


def test_plan_auto_on_two_ranks_applies_rank_zeros_plan_and_equals_ddp(tmp_path: Path, ddp_reference: dict) -> None:
    """plan="auto": every rank profiles its first step, rank 0 plans for a rank of two on the node, and both ranks apply
    that plan (measured times differ between ranks, so plans made on each would too); the numbers stay ddp's. Each
    rank's state traffic is that of the states it owns, together the model's once."""
    _ok(_run(tmp_path, "--plan-auto", "--states", "ssd", *ACCUMULATE_CLIP))
    got = [_load(tmp_path, rank) for rank in (0, 1)]
    for rank in (0, 1):
        _assert_same(ddp_reference, got[rank])
    assert got[0]["plan"] == got[1]["plan"]
    plan = Plan.from_json(got[0]["plan"])
    assert plan.settings is not None and plan.settings.ranks_on_node == 2 and plan.layers
    # Masters and both moments written once per step (12 bytes per parameter), each by its owner.
    numel = sum(entry["exp_avg"].numel() for entry in ddp_reference["optimizer"]["state"].values())
    written = [g["state_traffic"]["written"] for g in got]
    assert all(0 < w < 12 * numel for w in written) and sum(written) == 12 * numel


def test_a_plan_that_does_not_fit_one_rank_stops_every_rank(tmp_path: Path) -> None:
    """Rank 1 has no host room for activations: rank 0 plans within the least room of any rank, finds no placement,
    and every rank raises its RatelPlanError (none waits for a plan that will not come)."""
    result = _run(tmp_path, "--plan-auto", "--tight-host", "1", timeout=180)
    _failed(result)
    assert result.stderr.count("RatelPlanError: ") >= 2, result.stderr[-4000:]
    assert not (tmp_path / "rank0.pt").exists()


def test_bf16_mixed_equals_ddp(tmp_path: Path) -> None:
    """16-bit compute copies travel between ranks as bytes (gloo sends no bfloat16 and no int16). Reduced on the
    device (CUDA's streams simulated), the 16-bit gradients go into fp32 buckets there: ddp's numbers up to the order
    of the sums; so too with the states on the devices (the owners' new 16-bit copies sent over the device group)."""
    args = ["--precision", "bf16-mixed", *ACCUMULATE_CLIP]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", *args))
    _ok(_run(tmp_path / "ratel", *args))
    _ok(_run(tmp_path / "device", "--exchange", "device", *args, env=_env(RATEL_SIMULATE_STREAMS="1")))
    _ok(_run(tmp_path / "device_states", "--states", "device", *args, env=_env(RATEL_SIMULATE_STREAMS="1")))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", rank))
        for run in ("device", "device_states"):
            _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / run, rank), tol=ROUNDING)


def test_compute_copies_in_the_swap_files_equal_ddp(tmp_path: Path, ddp_reference: dict) -> None:
    """``param_cache="ssd"`` on two ranks of one node: each trainable shard's compute copy (in fp32 its master) is in
    its owner's swap files only, written by its updates, and the other rank pages it in from there (NodeCopies), under
    accumulation and clipping; the numbers are ddp's. A parameter read between steps on a rank that does not own it
    is its compute copy, read from the owner's files: in fp32 ddp's value."""
    _ok(_run(tmp_path, "--param-cache", "ssd", "--states", "ssd", *ACCUMULATE_CLIP))
    got = [_load(tmp_path, rank) for rank in (0, 1)]
    for rank in (0, 1):
        _assert_same(ddp_reference, got[rank])
        read = got[rank]["read_params"]
        assert max_rel_err({name: ddp_reference["params"][name] for name in read}, read) <= 1e-6
        assert got[rank]["shared_cache"] == (0, 0)
    # Each rank's swap files: the states it owns (both slots, 24 bytes a parameter), nothing of the other rank's.
    states = [g["states"]["ssd"] for g in got]
    assert all(s > 0 for s in states)
    assert [g["placement"]["disk"] for g in got] == states
    # The pre-flight estimate of two ranks counts both ranks' files.
    lm = LM("llama")
    estimate = lightning_ratel.estimate(lm, precision="32-true", optimizer=lm.configure_optimizers()["optimizer"],
                                        ranks=2, accelerator="cpu", param_cache="ssd", optimizer_states="ssd")
    assert estimate.disk == sum(g["placement"]["disk"] for g in got)
    assert [g["exchange_bytes"] for g in got] == [estimate.exchange_buffers] * 2
    # Each rank's optimizer buffer sets, its part of one process's: within the estimate, which counts that part.
    one = lightning_ratel.estimate(lm, precision="32-true", optimizer=lm.configure_optimizers()["optimizer"],
                                   param_cache="ssd", optimizer_states="ssd")
    assert max(g["buffer_sets_bytes"] for g in got) <= estimate.optimizer_buffers < one.optimizer_buffers


def test_compute_copies_in_the_swap_files_through_simulated_streams(tmp_path: Path, ddp_reference: dict) -> None:
    """The same run with CUDA's streams simulated (a GPU's page-ins through the host pool, whose buffers are poisoned
    while free): the numbers are still ddp's."""
    _ok(_run(tmp_path, "--param-cache", "ssd", "--states", "ssd", *ACCUMULATE_CLIP,
             env=_env(RATEL_SIMULATE_STREAMS="1")))
    for rank in (0, 1):
        got = _load(tmp_path, rank)
        _assert_same(ddp_reference, got)
        # The page-ins went through the (simulated) pinned pool.
        assert got["placement"]["pinned"] > 0


def test_compute_copies_in_the_swap_files_under_bf16_mixed(tmp_path: Path) -> None:
    """The same in bf16-mixed, whose 16-bit copies each owner's update writes and the other rank reads from the
    owner's files; without clipping (nothing redone), a step writes what the planner says it does (the owned states
    and their compute copies, nothing of the other rank's), every byte of it; the two ranks' swap files hold what one
    rank's do."""
    args = ["--precision", "bf16-mixed", "--accumulate", "2"]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", *args))
    _ok(_run(tmp_path / "ratel", "--param-cache", "ssd", "--states", "ssd", *args))
    _ok(_run(tmp_path / "one", "--devices", "1", "--param-cache", "ssd", "--states", "ssd", *args))
    reference = _load(tmp_path / "ddp")
    # The node's swap files hold each state and each 16-bit copy once, as one rank's do.
    one = _load(tmp_path / "one")["placement"]["disk"]
    assert sum(_load(tmp_path / "ratel", rank)["placement"]["disk"] for rank in (0, 1)) == one
    for rank in (0, 1):
        got = _load(tmp_path / "ratel", rank)
        _assert_same(reference, got)
        read = got["read_params"]
        # The owner's master, or elsewhere the value rounded to 16 bits.
        assert max_rel_err({name: reference["params"][name] for name in read}, read) <= 2**-8
        assert got["state_traffic"]["written"] == got["step_traffic"]["written"]
        assert got["fit_io"]["written"] == 3 * got["step_traffic"]["written"]


def test_speculation_that_stands_equals_ddp(tmp_path: Path) -> None:
    """A norm that never clips: every step's updates run during backward on their owners and stand."""
    args = ["--accumulate", "2", "--clip", "100"]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", *args))
    _ok(_run(tmp_path / "ratel", *args))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", rank))
        counts = _load(tmp_path / "ratel", rank)["counts"]
        assert counts.get("overlapped", 0) > 0 and not counts.get("redone") and not counts.get("deferred"), counts


@pytest.mark.parametrize("copies, exchange", [("host", "auto"), ("ssd", "auto"), ("host", "device"),
                                              ("device", "device")])
def test_fp16_overflow_on_one_rank_drops_the_speculative_updates_of_all(tmp_path: Path, copies: str,
                                                                       exchange: str) -> None:
    """fp16 loss scaling: at step 1 only rank 1's embedding gradient overflows, so only that shard's owner sees it;
    every rank drops its speculative updates and skips the step, on the very bits of the deferred path (Lightning
    runs no fp16 on the CPU under ``ddp``; the deferred path equals ``ddp`` in the tests above). With the compute
    copies in the swap files, the owners' undo writes back the 16-bit copies their speculative updates replaced, which
    the other rank reads from the owners' files: it reads them only once the undo landed and was announced. The
    same with the gradients reduced on the device, their 16-bit gradients packed into fp32 buckets there, and with
    the states on the devices too (nothing of theirs speculates: the owners skip the step alike)."""
    args = ["--precision", "16-mixed", "--overflow", "1:1", "--exchange", exchange]
    if copies == "ssd":
        args += ["--param-cache", "ssd", "--states", "ssd"]
    if copies == "device":
        args += ["--states", "device"]
    _ok(_run(tmp_path / "deferred", "--no-speculate", *args))
    _ok(_run(tmp_path / "speculative", *args))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "deferred", rank), _load(tmp_path / "speculative", rank), tol=0.0)
        got = _load(tmp_path / "speculative", rank)
        assert copies == "device" or got["counts"].get("dropped", 0) > 0, got["counts"]
        assert all(entry["step"].item() == 2 for entry in got["optimizer"]["state"].values())


def _run_two_nodes(out: Path, devices: int, *args: str, timeout: float, lightning_launcher: bool = False,
                   **env: str) -> Ended:
    """:mod:`tests.distributed_run` as two nodes of ``devices`` ranks each on localhost, every rank forked as a
    cluster's launcher starts it, none watching the others; with ``lightning_launcher``, one process per node whose
    other ranks Lightning's launcher starts (each node's return code and stderr)."""
    if not lightning_launcher:
        return _run(out, "--devices", str(devices), "--num-nodes", "2", *args, timeout=timeout, env=_env(**env))
    port = str(find_free_network_port())
    procs = [subprocess.Popen([*COMMAND, str(out), "--devices", str(devices), "--num-nodes", "2", *args], cwd=ROOT,
                              env=_env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    errs = [proc.communicate(timeout=timeout)[1] for proc in procs]
    return Ended([proc.returncode for proc in procs], errs)


@pytest.mark.parametrize("exchange", ["auto", "device"])
def test_two_nodes_of_one_device_equal_ddp(tmp_path: Path, ddp_reference: dict, exchange: str) -> None:
    """Two nodes of one rank each on localhost: ``ddp``'s numbers (reduced on the device: up to the order of the
    sums)."""
    _ok(_run_two_nodes(tmp_path, 1, "--exchange", exchange, *ACCUMULATE_CLIP, timeout=240))
    for rank in (0, 1):
        _assert_same(ddp_reference, _load(tmp_path, rank), tol=ROUNDING if exchange == "device" else 1e-6)


def test_plan_auto_on_two_nodes_holds_on_the_slower_node(tmp_path: Path) -> None:
    """Two nodes of one rank, the second reporting a tenth of the first's speeds: rank 0 plans with both nodes'
    profiles, so the plan both ranks apply predicts the step time of the slower node, not of rank 0's own."""
    _ok(_run_two_nodes(tmp_path, 1, "--plan-auto", "--states", "ssd", "--slow-node", "1", timeout=240))
    got = [_load(tmp_path, rank)["plan"] for rank in (0, 1)]
    assert got[0] == got[1]
    plan = Plan.from_json(got[0])
    assert plan.hardware is not None and plan.settings is not None
    for name, speed in node_speeds(1, slow_node=1).items():
        assert getattr(plan.hardware, name) == speed, name
    on = [predict(dataclasses.replace(plan.hardware, **node_speeds(node, slow_node=1)), plan.layers,
                  plan.activation_placement, plan.settings).iteration_time for node in (0, 1)]
    assert on[0] < on[1] == pytest.approx(plan.predicted_iteration_time)


def test_plan_auto_on_two_nodes_predicts_each_with_its_own_states(tmp_path: Path) -> None:
    """Two nodes of one rank and equal speeds, the first keeping its optimizer states in host memory, the second in the
    swap files: rank 0 predicts the second node with that node's state traffic, which makes it the slower one."""
    _ok(_run_two_nodes(tmp_path, 1, "--plan-auto", "--node-states", "host,ssd", "--same-speeds", timeout=240))
    got = [_load(tmp_path, rank) for rank in (0, 1)]
    assert got[0]["plan"] == got[1]["plan"]
    assert got[0]["state_traffic"]["written"] == 0 < got[1]["state_traffic"]["written"]
    plan = Plan.from_json(got[0]["plan"])
    assert plan.hardware is not None and plan.settings is not None
    numel = sum(layer.trainable_numel for layer in plan.layers)
    # The second node's own bytes per parameter (each node one rank: per parameter of the model).
    assert plan.settings.state_write_bytes_per_param == round(got[1]["state_traffic"]["written"] / numel) > 0
    on = [predict(plan.hardware, plan.layers, plan.activation_placement, settings).iteration_time
          for settings in (dataclasses.replace(plan.settings, state_read_bytes_per_param=0,
                                               state_write_bytes_per_param=0), plan.settings)]
    assert on[0] < on[1] == pytest.approx(plan.predicted_iteration_time)


def test_nodes_of_different_device_types_stop_at_setup(tmp_path: Path) -> None:
    """The second node says it trains on CUDA, the first on the CPU: both stop in the strategy's setup with an error
    naming each node's device type, before the swap directory is made (so before any step)."""
    ended = _run_two_nodes(tmp_path, 1, "--claim-device", "1:cuda", timeout=180)
    for returncode, err in zip(ended.returncodes, ended.logs):
        assert returncode != 0
        assert "RatelConfigError: the nodes train on different device types (node 0: cpu, node 1: cuda)" in err, \
            err[-4000:]
    assert not (tmp_path / "swap").exists() and not (tmp_path / "rank0.pt").exists()


def test_two_nodes_of_two_ranks_each_share_a_host_cache(tmp_path: Path) -> None:
    """Each node's two ranks page from one host cache, filled over a group of one rank per node: the numbers of ``ddp``
    on four processes (four ranks' gradients are summed in another order than ``ddp``'s: rounding apart), and each
    cache's pages shared by exactly two processes."""
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", "--devices", "4", *ACCUMULATE_CLIP))
    _ok(_run_two_nodes(tmp_path / "ratel", 2, *ACCUMULATE_CLIP, timeout=300, lightning_launcher=True))
    for rank in range(4):
        got = _load(tmp_path / "ratel", rank)
        _assert_same(_load(tmp_path / "ddp"), got, tol=1e-5)
        rss, pss = got["shared_cache"]
        assert rss > 0 and 2 * pss == rss


def test_parameters_unused_on_some_ranks_equal_ddp_finding_unused_parameters(tmp_path: Path) -> None:
    """A layer that runs on rank 1 only, a parameter beside the embedding used on rank 0 only, one used on no rank:
    every rank finishes each step on the shards that any rank has a gradient of (a rank without one reduces zeros), and
    the numbers are those of ``DDPStrategy(find_unused_parameters=True)``, the parameter used nowhere never stepped."""
    args = ["--model", "branch", *ACCUMULATE_CLIP]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp_find_unused_parameters_true", *args))
    _ok(_run(tmp_path / "ratel", *args))
    # Reducing each micro-batch, a rank without a parameter's gradient reduces zeros in its bucket (flagged as none)
    # once the ranks agreed that another rank has one; one that no rank has is reduced by none.
    _ok(_run(tmp_path / "micro", "--exchange", "micro_batch", *args))
    _ok(_run(tmp_path / "device", "--exchange", "device", *args))
    _ok(_run(tmp_path / "device_states", "--states", "device", *args))
    for rank in (0, 1):
        for run, tol in (("ratel", 1e-6), ("micro", ROUNDING), ("device", ROUNDING), ("device_states", ROUNDING)):
            got = _load(tmp_path / run, rank)
            _assert_same(_load(tmp_path / "ddp"), got, tol=tol)
            # Every parameter but the two of `unused` has a state.
            assert len(got["optimizer"]["state"]) == len(got["params"]) - 2
        assert _load(tmp_path / "micro", rank)["exchange_bytes"] > 0


def test_a_loss_over_every_ranks_outputs_equals_ddp(tmp_path: Path) -> None:
    """A loss over every rank's outputs (``self.all_gather(..., sync_grads=True)``, whose backward is a collective
    too, on the strategy's watched collectives) trains as under ``ddp``."""
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", "--gather-loss", *ACCUMULATE_CLIP))
    _ok(_run(tmp_path / "ratel", "--gather-loss", *ACCUMULATE_CLIP))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", rank))


@pytest.mark.parametrize("states", ["auto", "device"])
def test_encoder_decoder_equals_ddp(tmp_path: Path, states: str) -> None:
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", "--model", "t5", "--clip", "0.3"))
    _ok(_run(tmp_path / "ratel", "--model", "t5", "--clip", "0.3", "--states", states))
    _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", 1))


@pytest.mark.parametrize("states", ["auto", "device"])
def test_buffers_are_rank_zeros_as_under_ddp(tmp_path: Path, states: str) -> None:
    """BatchNorm's running statistics, which each rank's forward updates from its own micro-batch, follow rank 0's as
    ``ddp`` broadcasts them (at setup, and before a forward that follows one which reduced gradients), with
    accumulation (micro-batches that do not reduce) and validation during fit (forwards without gradients); also with
    the states on the devices, whose passes hold every resident unit."""
    args = ["--model", "batchnorm", *ACCUMULATE_CLIP, "--validate", "4"]
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", *args))
    _ok(_run(tmp_path / "ratel", "--states", states, *args))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp", rank), _load(tmp_path / "ratel", rank),
                     tol=ROUNDING if states == "device" else 1e-6)
    # Each rank's last forward saw its own data: the ranks' statistics differ, so the comparison per rank tells.
    key = "model.layers.0.norm.running_mean"
    assert not torch.equal(_load(tmp_path / "ratel", 0)["params"][key], _load(tmp_path / "ratel", 1)["params"][key])


def test_ranks_agree_on_the_copy_back(tmp_path: Path) -> None:
    """Each rank measures its own free memory for the copy back at the end of fit, a collective: where one rank finds
    no room, no rank copies the parameters back (each would otherwise wait for the other), and both say so."""
    # A checkpoint of the last step holds the values not copied back: no swap files are kept.
    result = _run(tmp_path, "--no-room", "1", "--save", str(tmp_path / "last.ckpt"), timeout=180)
    _ok(result)
    for rank in (0, 1):
        params = _load(tmp_path, rank)["params"]
        assert all(torch.isnan(v).all() for k, v in params.items() if k.endswith("weight")), rank
    assert "not copied back" in result.stderr
    assert not list((tmp_path / "swap").glob("*"))


def test_without_room_or_checkpoint_every_rank_keeps_its_swap_files(tmp_path: Path) -> None:
    """Where nothing is copied back and no checkpoint holds the last step, every rank keeps its swap files with their
    index (each holds the states it owns), fit ends on every rank with the warning naming the export, not in a hang."""
    result = _run(tmp_path, "--no-room", "0", timeout=180)
    _ok(result)
    assert "ratel-convert" in result.stderr
    kept = sorted(p.name for p in (tmp_path / "swap").iterdir())
    assert kept == ["ratel-rank0.index.json", "ratel-rank0.swap", "ratel-rank1.index.json", "ratel-rank1.swap"]


def test_reducing_each_micro_batch_equals_ddp_and_repeats_exactly(tmp_path: Path, ddp_reference: dict) -> None:
    """``gradient_exchange="micro_batch"`` with accumulation and clipping by norm: ddp's numbers up to the order of the
    sums, the very same bits on a second run, the first step speculated and redone as with the window; the exchange
    held no window, only its two bucket buffers (within what ``estimate`` counts), and reduced each micro-batch in
    one collective per bucket, fewer than the parameters."""
    args = ("--exchange", "micro_batch", *ACCUMULATE_CLIP, "--sync-dist")
    _ok(_run(tmp_path / "a", *args))
    _ok(_run(tmp_path / "b", *args))
    lm = LM("llama")
    estimate = lightning_ratel.estimate(lm, precision="32-true", optimizer=lm.configure_optimizers()["optimizer"],
                                        ranks=2, accelerator="cpu", param_cache="host", accumulate_grad_batches=2,
                                        gradient_exchange="micro_batch")
    assert estimate.exchange is not None and estimate.exchange.mode == "micro_batch"
    for rank in (0, 1):
        got = _load(tmp_path / "a", rank)
        _assert_same(ddp_reference, got, tol=ROUNDING)
        _assert_same(got, _load(tmp_path / "b", rank), tol=0.0)
        assert got["exchange"] == "micro_batch"
        assert 0 < got["exchange_bytes"] <= estimate.exchange_buffers
        counts = got["exchange_counts"]
        assert 2 <= counts["collectives"] < len(got["params"])
        # Three steps of two micro-batches.
        assert counts["reduces"] == 3 * 2 * counts["collectives"]
        assert got["counts"].get("redone", 0) > 0 and got["counts"].get("deferred", 0) > 0, got["counts"]


@pytest.mark.parametrize("simulate", ["0", "1"], ids=["cpu", "simulated-streams"])
def test_reducing_on_the_device_equals_ddp(tmp_path: Path, ddp_reference: dict, simulate: str) -> None:
    """``gradient_exchange="device"`` (``"auto"``'s choice on GPUs: the buckets reduced where the gradients are, NCCL
    there, gloo on these CPU ranks, and only the owner copies each to host memory), with accumulation and clipping by
    norm: ddp's numbers up to the order of the sums, as ``"micro_batch"``; with CUDA's streams simulated too (the
    gradients stay in device memory, the owner's copies land in the pinned pool's buffers). Each micro-batch reduces
    one collective per bucket; the exchange holds no host buffers of its own."""
    _ok(_run(tmp_path, "--exchange", "device", *ACCUMULATE_CLIP, "--sync-dist",
             env=_env(RATEL_SIMULATE_STREAMS=simulate)))
    lm = LM("llama")
    estimate = lightning_ratel.estimate(lm, precision="32-true", optimizer=lm.configure_optimizers()["optimizer"],
                                        ranks=2, param_cache="host", accumulate_grad_batches=2)
    # On a GPU "auto" reduces on the device.
    assert estimate.exchange is not None and estimate.exchange.mode == "device"
    for rank in (0, 1):
        got = _load(tmp_path, rank)
        _assert_same(ddp_reference, got, tol=ROUNDING)
        assert got["exchange"] == "device"
        assert got["exchange_bytes"] == estimate.exchange_buffers == 0
        counts = got["exchange_counts"]
        assert 2 <= counts["collectives"] < len(got["params"])
        assert counts["reduces"] == 3 * 2 * counts["collectives"]


def test_states_on_the_devices_equal_ddp(tmp_path: Path, ddp_reference: dict) -> None:
    """``optimizer_states="device"`` on two ranks: every unit resident on each rank's device, each unit's states on
    its owner's device, updated there from the gradients reduced there, and its new compute copy sent to the other
    rank over the device group. With accumulation and clipping by norm: ddp's numbers up to the order of the sums."""
    _ok(_run(tmp_path / "one", "--devices", "1", "--states", "device", *ACCUMULATE_CLIP))
    _ok(_run(tmp_path / "two", "--states", "device", *ACCUMULATE_CLIP))
    one, two = _load(tmp_path / "one"), [_load(tmp_path / "two", rank) for rank in (0, 1)]
    for got in two:
        _assert_same(ddp_reference, got, tol=ROUNDING)
        assert got["exchange"] == "device"
        # Three steps of two micro-batches, one reduce per bucket.
        assert got["exchange_counts"]["reduces"] == 3 * 2 * got["exchange_counts"]["collectives"]
    # Each state once: the two ranks' device states are one rank's, split between them.
    assert sum(t["states"]["device"] for t in two) == one["states"]["device"] > 0
    assert all(0 < t["states"]["device"] < one["states"]["device"] for t in two)
    # plan="auto" profiles and plans the same run (each rank updating its share on the device) and applies rank 0's
    # plan on both.
    _ok(_run(tmp_path / "planned", "--plan-auto", "--states", "device", *ACCUMULATE_CLIP))
    planned = [_load(tmp_path / "planned", rank) for rank in (0, 1)]
    assert planned[0]["plan"] == planned[1]["plan"]
    settings = Plan.from_json(planned[0]["plan"]).settings
    assert settings is not None and settings.device_update_share == 1.0 and settings.gradients_reduced_on_device
    for got in planned:
        _assert_same(ddp_reference, got, tol=ROUNDING)
    # A device budget below the larger rank's share (its states and every compute copy) stops both ranks before
    # anything trains.
    result = _run(tmp_path / "tight", "--states", "device", "--device-memory-limit", "600KiB", *ACCUMULATE_CLIP)
    _failed(result)
    assert "optimizer_states='device' keeps" in result.stderr


def test_auto_keeps_the_states_on_the_devices_where_every_ranks_share_fits(tmp_path: Path,
                                                                           ddp_reference: dict) -> None:
    """``optimizer_states="auto"`` on two ranks: where the larger rank's share (its states and every compute copy)
    fits half of every rank's device budget (``device_memory_limit``, the way to give the CPU one), every state goes
    to the devices and the gradients are reduced there, whatever exchange the pre-flight planned; where it does not,
    the states stay in host memory, as before."""
    _ok(_run(tmp_path / "roomy", "--device-memory-limit", "64MiB", *ACCUMULATE_CLIP))
    _ok(_run(tmp_path / "tight", "--device-memory-limit", "1MiB", *ACCUMULATE_CLIP))
    for rank in (0, 1):
        roomy, tight = _load(tmp_path / "roomy", rank), _load(tmp_path / "tight", rank)
        _assert_same(ddp_reference, roomy, tol=ROUNDING)
        assert roomy["exchange"] == "device" and roomy["states"]["device"] > 0 == roomy["states"].get("host", 0)
        _assert_same(ddp_reference, tight)
        assert tight["exchange"] == "window" and tight["states"]["host"] > 0 == tight["states"].get("device", 0)


@pytest.mark.parametrize("states", ["ssd", "host"])
def test_each_state_once_per_node(tmp_path: Path, states: str, ddp_reference: dict) -> None:
    """Two ranks on one node hold the optimizer states of one rank between them, in the swap files (whose bytes on
    disk, both ranks' files in one directory, are within 1.1x of one rank's) or in host memory; each rank holds part.
    Reducing each micro-batch onto its owner (``gradient_exchange="micro_batch"``), the engine's host bytes of the two,
    every buffer included (the host cache, the states in host memory, the CPU optimizer's buffer sets that stage the
    states from the swap files, which the ranks split, its gradients summed over the window, which each owner holds
    for its shards only, and the gradient exchange's own), are within 1.1x of one rank's; the numbers are ddp's up to
    the order of the sums. With accumulation and clipping every step holds its gradients until backward ends, so the
    gradients' bytes do not depend on timing. (Under ``"window"`` each rank also holds an fp32 sum of every trainable
    shard, 4 bytes per parameter: ddp's very sums, at 1.15-1.55x one rank's host bytes on these runs.)"""
    _ok(_run(tmp_path / "one", "--devices", "1", "--states", states, *ACCUMULATE_CLIP))
    _ok(_run(tmp_path / "two", "--states", states, "--exchange", "micro_batch", *ACCUMULATE_CLIP))
    one, two = _load(tmp_path / "one"), [_load(tmp_path / "two", r) for r in (0, 1)]
    for got in two:
        _assert_same(ddp_reference, got, tol=ROUNDING)
        assert got["exchange"] == "micro_batch"
    assert sum(t["states"][states] for t in two) == one["states"][states] > 0
    assert all(0 < t["states"][states] < one["states"][states] for t in two)
    held = [t["placement"]["host"] for t in two]
    assert "exchange_bytes" not in one
    assert sum(held) <= 1.1 * one["placement"]["host"]
    assert all(0 < h < one["placement"]["host"] for h in held)
    if states == "ssd":
        assert two[0]["swap_bytes"] <= 1.1 * one["swap_bytes"]
        assert sum(t["placement"]["disk"] for t in two) <= 1.1 * one["placement"]["disk"]
        assert all(0 < t["placement"]["disk"] < one["placement"]["disk"] for t in two)


def test_host_cache_once_per_node(tmp_path: Path) -> None:
    """Two ranks on one node page from one host cache of the compute copies: the node's engine host bytes, every
    buffer included (each rank counts the units whose cache it writes, the optimizer states it owns in host memory,
    and its gradient exchange's two bucket buffers: ``gradient_exchange="micro_batch"``, asked for without
    accumulation), are within 1.1x of one rank's, and the cache's pages are
    resident once (the two ranks' proportional shares of them add up to what each maps). Nothing of it is left in
    /dev/shm."""
    before = _shared_caches()
    args = ("--model", "llama16", "--states", "host")
    _ok(_run(tmp_path / "one", "--devices", "1", *args))
    _ok(_run(tmp_path / "two", "--exchange", "micro_batch", *args))
    one, two = _load(tmp_path / "one"), [_load(tmp_path / "two", r) for r in (0, 1)]
    held = [t["placement"]["host"] for t in two]
    assert all(t["exchange"] == "micro_batch" for t in two)
    assert sum(held) <= 1.1 * one["placement"]["host"]
    assert all(0 < h < one["placement"]["host"] for h in held)
    assert one["shared_cache"] == (0, 0)
    (rss0, pss0), (rss1, pss1) = (t["shared_cache"] for t in two)
    assert rss0 == rss1 > 0 and pss0 + pss1 == rss0
    assert _shared_caches() <= before


@pytest.mark.parametrize("exchange, states", [("auto", "auto"), ("micro_batch", "auto"), ("device", "auto"),
                                             ("device", "device")])
def test_a_killed_rank_stops_the_others(tmp_path: Path, exchange: str, states: str) -> None:
    before = _shared_caches()
    # One run as a user's starts: Lightning's launcher then watches the killed rank's process.
    result = _run(tmp_path, "--fail", "1:1", "--exchange", exchange, "--states", states, "--accumulate", "2",
                  env=_env(RATEL_TEST_KILL="1"), timeout=180, lightning_launcher=exchange == "auto")
    _failed(result)
    assert not (tmp_path / "rank0.pt").exists()
    assert _shared_caches() <= before


@pytest.mark.parametrize("exchange, states", [("auto", "auto"), ("micro_batch", "auto"), ("device", "auto"),
                                             ("device", "device")])
def test_a_raising_rank_stops_the_others(tmp_path: Path, exchange: str, states: str) -> None:
    result = _run(tmp_path, "--fail", "1:1", "--exchange", exchange, "--states", states, "--accumulate", "2",
                  timeout=180)
    _failed(result)
    assert "rank 1 fails at step 1" in result.stderr
    assert not (tmp_path / "rank0.pt").exists()


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_stops_the_others_within_the_fault_timeout(tmp_path: Path, killed: int) -> None:
    """One rank's process ends at step 2, the on-exception checkpoint's path holding step 2's (saved after every step).
    The other (another node: no launcher of Lightning's ends it) fails in its collective, waits at most its
    ``fault_timeout`` of 5 s for the killed rank to stop (its collectives would wait 600 s), names it, and writes
    nothing: the checkpoint there stays whole (every checksum verified) and no staging directory is left. Rank 0's
    process also hosts the process group's store: the other rank finds it gone at once."""
    ckpt = tmp_path / "on_exception.ckpt"
    ended = _run_two_nodes(
        tmp_path / "run", 1, "--fail", f"{killed}:2", "--checkpoint-format", "sharded", "--save", str(ckpt),
        "--save-every-step", "--on-exception", str(tmp_path), "--timeout", "600", "--fault-timeout", "5",
        timeout=180, RATEL_TEST_KILL="1")
    rc, survivor_rc, err = ended.returncodes[killed], ended.returncodes[1 - killed], ended.logs[1 - killed]
    assert rc == 9 and survivor_rc != 0
    expected = "rank 0 stopped: its process hosts" if killed == 0 else "rank 1 did not stop within 0:00:05"
    assert f"RatelRankFailed: {expected}" in err, err[-4000:]
    assert ShardedReader(ckpt).meta()["global_step"] == 2
    sharded_to_lightning(ckpt, tmp_path / "check.ckpt")
    assert not list(tmp_path.glob(".on_exception.ckpt.*"))


def test_a_raising_rank_with_on_exception_checkpoint_saves_the_committed_step_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 raises at step 1 while rank 0 waits for it in the step's agreement (for up to 600 s): rank 0 stops with
    an error naming rank 1 and its error, the ranks meet again and Lightning's ``OnExceptionCheckpoint`` writes the
    last committed step, bit for bit the checkpoint a run that saved at step 1 wrote (each rank's units from its own
    states). Resumed, both train on alike (Lightning restarts a loader that cannot resume from its first batch either
    way)."""
    sharded = ("--checkpoint-format", "sharded")
    _ok(_run(tmp_path / "run", "--steps", "1", *sharded, "--save", str(tmp_path / "saved.ckpt"), "--save-every-step"))
    result = _run(tmp_path / "failed", "--fail", "1:1", *sharded, "--on-exception", str(tmp_path), "--timeout", "600",
                  timeout=180)
    _failed(result)
    assert "RatelRankFailed: rank 1 failed (RuntimeError: rank 1 fails at step 1)" in result.stderr, result.stderr[-4000:]
    converted = {}
    for name in ("saved", "on_exception"):
        sharded_to_lightning(tmp_path / f"{name}.ckpt", tmp_path / f"{name}.pt")
        converted[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    assert converted["on_exception"]["global_step"] == converted["saved"]["global_step"] == 1
    for key in ("state_dict", "optimizer_states"):
        _assert_identical(converted["on_exception"][key], converted["saved"][key])
    for name in ("saved", "on_exception"):
        _ok(_run(tmp_path / f"resumed-{name}", "--steps", "3", "--resume", str(tmp_path / f"{name}.ckpt")))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "resumed-saved", rank), _load(tmp_path / "resumed-on_exception", rank), tol=0.0)


def test_a_rank_raising_before_its_forward_stops_the_others_and_they_save(tmp_path: Path) -> None:
    """Rank 1 raises before the forward of step 1 while rank 0 broadcasts its module buffers to it there: rank 0 stops
    with an error naming rank 1 (not at the timeout of 600 s), and ``OnExceptionCheckpoint`` writes step 1."""
    result = _run(tmp_path / "run", "--fail", "1:1", "--fail-early", "--checkpoint-format", "sharded",
                  "--on-exception", str(tmp_path), "--timeout", "600", timeout=180)
    _failed(result)
    assert "RatelRankFailed: rank 1 failed (RuntimeError: rank 1 fails at step 1)" in result.stderr, result.stderr[-4000:]
    assert ShardedReader(tmp_path / "on_exception.ckpt").meta()["global_step"] == 1


@pytest.mark.parametrize("where", ["barrier", "forward"])
def test_a_rank_raising_while_the_other_waits_in_lightnings_collectives_stops_it_and_they_save(
        tmp_path: Path, where: str) -> None:
    """Rank 1 raises after step 1 while rank 0 waits for it in ``trainer.strategy.barrier()`` (``"barrier"``), or at the
    end of its forward of step 2 while rank 0 reduces the loss it logs with ``sync_dist=True`` (``"forward"``). Rank 0
    stops with an error naming rank 1's (its collectives would wait 600 s), while rank 1 is still there waiting for
    it to stop (``fault_timeout``); the ranks meet and ``OnExceptionCheckpoint`` writes step 1, the last committed,
    from every rank's states."""
    result = _run(tmp_path / "run", "--fail", "1:1", "--fail-in", where, "--sync-dist", "--checkpoint-format",
                  "sharded", "--on-exception", str(tmp_path), "--timeout", "600", "--fault-timeout", "60",
                  timeout=240)
    _failed(result)
    assert "RatelRankFailed: rank 1 failed (RuntimeError: rank 1 fails at step 1)" in result.stderr, result.stderr[-4000:]
    assert ShardedReader(tmp_path / "on_exception.ckpt").meta()["global_step"] == 1
    sharded_to_lightning(tmp_path / "on_exception.ckpt", tmp_path / "check.ckpt")


@pytest.mark.parametrize("where", ["barrier", "forward"])
def test_a_rank_killed_while_the_other_waits_in_lightnings_collectives_stops_it(tmp_path: Path, where: str) -> None:
    """Rank 1's process ends after step 1 while rank 0 waits for it in ``trainer.strategy.barrier()``, or at the end of
    its forward of step 2 while rank 0 reduces the loss it logs with ``sync_dist=True``: rank 0 stops with an error
    saying so (its collectives would wait 600 s)."""
    result = _run(tmp_path, "--fail", "1:1", "--fail-in", where, "--sync-dist", "--timeout", "600",
                  "--fault-timeout", "60", env=_env(RATEL_TEST_KILL="1"), timeout=240)
    _failed(result)
    assert "RatelRankFailed: a collective with the other ranks failed on rank 0: a rank's process ended" in \
        result.stderr, result.stderr[-4000:]


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints written after 2 steps on 2 ranks by ``ddp`` (``ddp.ckpt``) and by RatelStrategy, ordinary
    (``ratel.ckpt``) and sharded (``sharded.ckpt``)."""
    out = tmp_path_factory.mktemp("saved")
    for name in ("ddp", "ratel"):
        _ok(_run(out / name, "--strategy", name, "--steps", "2", "--save", str(out / f"{name}.ckpt")))
    _ok(_run(out / "sharded", "--steps", "2", "--checkpoint-format", "sharded", "--save", str(out / "sharded.ckpt")))
    return out


@pytest.fixture(scope="module")
def resumed_from_ddp(saved_by_two: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """``ddp.ckpt`` resumed to step 4 by plain Lightning on one device and by ``ddp`` on 2 and 3 (rank 0's state): three
    ranks sum in another order than two, so each world size has its own reference."""
    out = tmp_path_factory.mktemp("resumed")
    ckpt = str(saved_by_two / "ddp.ckpt")
    _ok(_run(out / "1", "--strategy", "auto", "--devices", "1", "--steps", "4", "--resume", ckpt))
    for devices in (2, 3):
        _ok(_run(out / str(devices), "--strategy", "ddp", "--devices", str(devices), "--steps", "4", "--resume", ckpt))
    return {devices: _load(out / str(devices)) for devices in (1, 2, 3)}


def test_sharded_checkpoint_of_two_ranks_holds_the_ordinary_one(tmp_path: Path, saved_by_two: Path) -> None:
    """Each rank wrote the files of its units; converted, they are the ordinary checkpoint of the same run, bit for
    bit."""
    index = json.loads((saved_by_two / "sharded.ckpt" / "ratel_checkpoint.json").read_text())
    files = [_load(saved_by_two / "sharded", rank)["reads"]["checkpoint_files"] for rank in (0, 1)]
    assert all(files) and sum(files) == len(index["files"])
    sharded_to_lightning(saved_by_two / "sharded.ckpt", tmp_path / "converted.ckpt")
    converted = torch.load(tmp_path / "converted.ckpt", weights_only=False)
    full = torch.load(saved_by_two / "ratel.ckpt", weights_only=False)
    assert converted["global_step"] == full["global_step"] == 2
    assert converted["state_dict"].keys() == full["state_dict"].keys()
    assert all(torch.equal(converted["state_dict"][k], v) for k, v in full["state_dict"].items())
    _assert_identical(converted["optimizer_states"], full["optimizer_states"])


def _assert_identical(a: object, b: object) -> None:
    """Nested containers of tensors and plain values equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_identical(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("saved, devices", [("ratel.ckpt", 1), ("ratel.ckpt", 3), ("sharded.ckpt", 1),
                                            ("sharded.ckpt", 2), ("sharded.ckpt", 3)])
def test_checkpoint_of_two_ranks_resumes_at_any_world_size(tmp_path: Path, saved_by_two: Path,
                                                           resumed_from_ddp: dict[int, dict], saved: str,
                                                           devices: int) -> None:
    """Resumed on 1, 2 or 3 ranks, as Lightning resumes ``ddp``'s checkpoint there; from a sharded checkpoint each
    rank reads the states of the units it owns, every byte of them once over the ranks."""
    _ok(_run(tmp_path, "--devices", str(devices), "--steps", "4", "--resume", str(saved_by_two / saved)))
    runs = [_load(tmp_path, rank) for rank in range(devices)]
    for run in runs:
        _assert_same(resumed_from_ddp[devices], run)
    if saved == "sharded.ckpt":
        reads = [run["reads"]["checkpoint"] for run in runs]
        assert sum(reads) == _checkpoint_bytes(saved_by_two / saved)
        assert all(reads)


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_states_on_the_devices_save_and_resume_at_another_world_size(tmp_path: Path, saved_by_two: Path,
                                                                     resumed_from_ddp: dict[int, dict],
                                                                     checkpoint_format: str) -> None:
    """A checkpoint two ranks with their states on the devices saved (each owner's states read from its device)
    resumes on one rank as ``ddp``'s does; two ranks with their states on the devices resume an ordinary one so too
    (each owner reads its units' states onto its device)."""
    ckpt = tmp_path / "device.ckpt"
    _ok(_run(tmp_path / "save", "--states", "device", "--steps", "2", "--checkpoint-format", checkpoint_format,
             "--save", str(ckpt)))
    _ok(_run(tmp_path / "one", "--devices", "1", "--steps", "4", "--resume", str(ckpt)))
    _assert_same(resumed_from_ddp[1], _load(tmp_path / "one"))
    _ok(_run(tmp_path / "two", "--states", "device", "--steps", "4", "--resume", str(saved_by_two / "ratel.ckpt")))
    for rank in (0, 1):
        _assert_same(resumed_from_ddp[2], _load(tmp_path / "two", rank))


def test_a_drive_refusing_a_published_copy_stops_every_rank(tmp_path: Path) -> None:
    """``param_cache="ssd"`` with the fp32 masters in host memory (so every rank stores the copies of the other's
    units in its own files): rank 1's store cannot write the compute copies the other rank publishes to it (a full
    drive). Rank 1 stops with the store's error where it waits for that copy, and rank 0 with ``RatelRankFailed`` naming
    rank 1 and the error; neither finishes."""
    result = _run(tmp_path, "--param-cache", "ssd", "--states", "host", "--fail-copy", "1", timeout=180)
    _failed(result)
    assert "rank 1 failed (OSError: [Errno 28] No space left on device (injected)" in result.stderr
    assert not (tmp_path / "rank0.pt").exists() and not (tmp_path / "rank1.pt").exists()


def test_a_damaged_copy_in_another_ranks_files_stops_every_rank(tmp_path: Path) -> None:
    """``param_cache="ssd"``: a byte of a compute copy that rank 1 reads from rank 0's swap files changed on the drive.
    Rank 1's read fails its checksum, naming rank 0's file, instead of computing with it (rank 0 finds the damage in
    its own read of that master, or learns of rank 1's failure); neither finishes."""
    result = _run(tmp_path, "--param-cache", "ssd", "--states", "ssd", "--damage-peer-copy", "1", timeout=180)
    _failed(result)
    damaged = r"RatelStoreError: \[Errno 74\] checksum mismatch reading key 'rank0/\S+' from \S+ratel-rank0\.swap"
    assert re.search(damaged, result.logs[1]), result.logs[1][-4000:]
    assert not (tmp_path / "rank0.pt").exists() and not (tmp_path / "rank1.pt").exists()


def test_a_checkpoint_resumes_on_three_ranks_with_the_compute_copies_in_the_swap_files(
        tmp_path: Path, saved_by_two: Path, resumed_from_ddp: dict[int, dict]) -> None:
    """Resumed with ``param_cache="ssd"`` on 3 ranks: each rank stores the loaded values of the units other ranks own
    as their compute copies, and the run goes on as ``ddp``'s."""
    _ok(_run(tmp_path, "--devices", "3", "--steps", "4", "--param-cache", "ssd", "--states", "ssd",
             "--resume", str(saved_by_two / "ratel.ckpt")))
    for rank in range(3):
        _assert_same(resumed_from_ddp[3], _load(tmp_path, rank))


def _checkpoint_bytes(path: Path) -> int:
    """The bytes of a sharded checkpoint's masters and moments (every one of its parameters is trainable here)."""
    reader = ShardedReader(path)
    return sum(r.numel * (r.stored.itemsize + (8 if r.location.get("moments") else 0)) for r in reader.records)


def test_sharded_checkpoint_of_one_rank_resumes_on_two(tmp_path: Path) -> None:
    """Written by one rank, resumed on two as ``ddp`` resumes the same state (the checkpoint converted to an ordinary
    one)."""
    ckpt = tmp_path / "one.ckpt"
    _ok(_run(tmp_path / "one", "--devices", "1", "--steps", "2", "--checkpoint-format", "sharded", "--save", str(ckpt)))
    sharded_to_lightning(ckpt, tmp_path / "one-full.ckpt")
    _ok(_run(tmp_path / "ddp", "--strategy", "ddp", "--steps", "4", "--resume", str(tmp_path / "one-full.ckpt")))
    _ok(_run(tmp_path / "ratel", "--steps", "4", "--resume", str(ckpt)))
    for rank in (0, 1):
        _assert_same(_load(tmp_path / "ddp"), _load(tmp_path / "ratel", rank))


def test_a_failed_sharded_save_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """Rank 1 cannot write its part of step 2's checkpoint: both ranks stop with the error, and step 1's checkpoint
    stays whole (every checksum verified) without a staging directory left beside it."""
    ckpt = tmp_path / "last.ckpt"
    result = _run(tmp_path / "run", "--steps", "3", "--checkpoint-format", "sharded", "--save", str(ckpt),
                  "--save-every-step", "--fail-save", "1:2", timeout=180)
    _failed(result)
    assert "rank 1 failed (OSError: [Errno 28] No space left on device (injected)" in result.stderr
    assert ShardedReader(ckpt).meta()["global_step"] == 1
    sharded_to_lightning(ckpt, tmp_path / "check.ckpt")
    assert not list(tmp_path.glob(".last.ckpt.*"))


def test_pretrained_on_two_ranks_reads_each_value_once_and_exports(tmp_path: Path, ddp_reference: dict) -> None:
    """Each rank reads from the pretrained folder only the units whose states it owns (every trainable byte once over
    the ranks; the other compute copies come from their owners), training equals ``ddp`` from the same weights, and
    the trained weights export from the running ranks (``RatelHFExport``), after fit (``save_pretrained``, written by
    rank 0) and from the swap files both ranks kept."""
    folder = tmp_path / "pretrained"
    LM("llama").model.save_pretrained(folder, safe_serialization=True)
    _ok(_run(tmp_path / "run", *ACCUMULATE_CLIP, "--pretrained", str(folder), "--keep-swap",
             "--export", str(tmp_path / "export")))
    runs = [_load(tmp_path / "run", rank) for rank in (0, 1)]
    for run in runs:
        _assert_same(ddp_reference, run)
    total = sum(t.numel() * t.element_size() for t in load_file(folder / "model.safetensors").values())
    reads = [run["reads"]["pretrained"] for run in runs]
    assert sum(reads) == total and all(reads)
    args = ["--swap", str(tmp_path / "run" / "swap"), str(tmp_path / "hf"), "--dtype", "fp32", "--no-progress"]
    assert convert_main(args) == 0
    trained = {name.removeprefix("model."): value for name, value in runs[0]["params"].items()}
    for exported in (tmp_path / "hf", tmp_path / "export" / "final", tmp_path / "export" / "after"):
        model = LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32)
        for name, p in model.named_parameters():
            assert torch.equal(p, trained[name]), (exported, name)


@pytest.mark.parametrize("states", ["auto", "device"])
def test_lora_on_two_ranks_checkpoint_refers_to_the_pretrained_folder(tmp_path: Path, states: str) -> None:
    """LoRA on a model built on the meta device: every rank reads the frozen weights (its compute copies), the sharded
    checkpoint the ranks write together refers to the folder for them and holds the trained adapters; also with the
    states on the devices (the adapters' on their owners', every frozen weight resident on every rank)."""
    pytest.importorskip("peft")
    folder = tmp_path / "pretrained"
    LM("llama").model.save_pretrained(folder, safe_serialization=True)
    ckpt = tmp_path / "lora.ckpt"
    _ok(_run(tmp_path / "run", "--lora", "--pretrained", str(folder), "--checkpoint-format", "sharded",
             "--save", str(ckpt), "--states", states))
    runs = [_load(tmp_path / "run", rank) for rank in (0, 1)]
    total = sum(t.numel() * t.element_size() for t in load_file(folder / "model.safetensors").values())
    assert [run["reads"]["pretrained"] for run in runs] == [total, total]
    index = json.loads((ckpt / "ratel_checkpoint.json").read_text())
    frozen = [r for r in index["params"] if not r["trainable"]]
    assert frozen and all("pretrained" in r["location"] for r in frozen)
    files = [run["reads"]["checkpoint_files"] for run in runs]
    assert all(files) and sum(files) == len(index["files"])
    sharded_to_lightning(ckpt, tmp_path / "converted.ckpt")
    converted = torch.load(tmp_path / "converted.ckpt", weights_only=False)["state_dict"]
    for name, value in runs[0]["params"].items():
        assert torch.equal(converted[name], value), name


def test_lora_with_the_compute_copies_in_the_swap_files_holds_the_frozen_weights_once(tmp_path: Path) -> None:
    """LoRA on two ranks with the compute copies in the swap files: the frozen weights' copies are rank 0's to write
    and rank 1 reads them from rank 0's files, as it reads the adapters' from their owners': the two ranks' swap files
    hold what one rank's do, and the trained adapters are those of the same run with the copies in host memory."""
    pytest.importorskip("peft")
    folder = tmp_path / "pretrained"
    LM("llama").model.save_pretrained(folder, safe_serialization=True)
    lora = ["--lora", "--pretrained", str(folder), "--states", "ssd"]
    _ok(_run(tmp_path / "ssd", *lora, "--param-cache", "ssd"))
    _ok(_run(tmp_path / "host", *lora, "--param-cache", "host"))
    _ok(_run(tmp_path / "one", *lora, "--param-cache", "ssd", "--devices", "1"))
    one = _load(tmp_path / "one")["placement"]["disk"]
    assert sum(_load(tmp_path / "ssd", rank)["placement"]["disk"] for rank in (0, 1)) == one
    for rank in (0, 1):
        got, reference = _load(tmp_path / "ssd", rank), _load(tmp_path / "host", rank)
        for name, value in reference["params"].items():
            assert torch.equal(got["params"][name], value), (rank, name)
