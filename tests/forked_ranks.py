"""The processes of a multi-process test run, forked from one server process that imported their modules once.

Started with ``python -m``, every rank of a test's run spends most of its time importing: ~7 s of CPU each for torch
and Lightning (through torchmetrics, transformers and sympy) before a step that takes well under a second. Here
:mod:`multiprocessing`'s ``forkserver``, with :mod:`tests.distributed_run` preloaded, forks each rank instead, and
gives it the environment a cluster's launcher gives a rank (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``,
``LOCAL_RANK``, as ``torchrun`` does): Lightning then starts no process of its own, and each rank runs
:func:`tests.distributed_run.main` as ``python -m tests.distributed_run`` would.

A forked rank maps the server's pages: the memory figures of a whole process that :mod:`tests.distributed_run`
records (its proportional set size, private memory and peak RSS, which no test asserts) count them too, so measure
those with ``python -m tests.distributed_run``. Its memory of a host cache shared on the node, which the tests check,
is the rank's own.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.fabric.plugins.environments.lightning import find_free_network_port

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "tests.distributed_run"]
"""The run as a command of its own, whose processes import for themselves (run from :data:`ROOT`)."""
START_METHOD = "forkserver"
"""The start method to give :func:`torch.multiprocessing.start_processes`: its processes are forked from the same
server (one per Python process), with torch, Lightning and this package already imported."""
_SERVER = multiprocessing.get_context(START_METHOD)
_SERVER.set_forkserver_preload(["tests.distributed_run"])


@dataclasses.dataclass
class Ended:
    """How the processes of a run ended: each one's return code (negative: the signal that ended it, as
    :mod:`subprocess` reports it) and what it wrote to stderr, in rank order."""

    returncodes: list[int]
    logs: list[str]

    @property
    def returncode(self) -> int:
        """Rank 0's return code: what ``python -m`` of a run that Lightning's launcher spreads returns."""
        return self.returncodes[0]

    @property
    def stderr(self) -> str:
        return "".join(self.logs)


def rank_environments(env: dict[str, str], devices: int, num_nodes: int) -> list[dict[str, str]]:
    """``env`` with the variables a cluster's launcher sets for each of the ``devices`` ranks of ``num_nodes`` nodes,
    in global rank order."""
    port = str(find_free_network_port())
    return [{**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node),
             "LOCAL_RANK": str(local)} for node in range(num_nodes) for local in range(devices)]


def _rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """One process of the run (in the forked child): its environment, stdout discarded, stderr into ``log``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    with open(os.devnull, "wb") as null, open(log, "wb") as err:
        os.dup2(null.fileno(), 1)
        os.dup2(err.fileno(), 2)
    # Already imported by the server, before it forked this process.
    from tests.distributed_run import main

    main(argv)


def run(argv: list[str], environments: list[dict[str, str]], timeout: float) -> Ended:
    """Run :func:`tests.distributed_run.main` with ``argv`` in one forked process per environment, all at once, and
    wait for every one to end. Past ``timeout`` seconds, every process still running is killed and
    :class:`subprocess.TimeoutExpired` raised, with what each wrote to stderr."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        logs = [Path(tmp) / f"{i}.log" for i in range(len(environments))]
        procs = [_SERVER.Process(target=_rank, args=(argv, env, str(log))) for env, log in zip(environments, logs)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        late = [proc for proc in procs if proc.exitcode is None]
        for proc in late:
            proc.kill()
            proc.join()
        ended = Ended([proc.exitcode for proc in procs], [log.read_text(errors="replace") for log in logs])
    if late:
        raise subprocess.TimeoutExpired([*COMMAND, *argv], timeout, stderr=ended.stderr)
    return ended
