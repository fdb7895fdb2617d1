"""A pytest plugin that runs Lightning's own tests with ``RatelStrategy`` where they leave the strategy to Lightning.

Lightning's ``Trainer`` picks ``SingleDeviceStrategy`` for ``strategy="auto"`` on one device. With this plugin loaded,
that choice becomes ``RatelStrategy(ssd_paths=[<a fresh temporary directory>])`` when the device is the CPU; a test
that names its strategy, or runs on several devices, keeps what it asked for. Lightning's files are not edited: the
plugin wraps the accelerator connector's choice for the session.

Run it from Lightning's ``tests/tests_pytorch`` with this repository on ``PYTHONPATH`` (``make test-lightning`` does)::

    PYTHONPATH=/path/to/lightning_ratel python -m pytest -p tests.upstream.ratel_swap trainer/optimization

``--ratel-swap-log FILE`` writes one line per test (node id, outcome, how many Trainers got RatelStrategy), to tell
the tests that ran under the plugin from those that never built a default Trainer. ``--no-ratel-swap`` leaves
Lightning's choice alone and still writes the log: the baseline to compare with. ``--ratel-swap-config JSON`` gives
every swapped-in strategy these keyword arguments of ``RatelStrategy`` besides ``ssd_paths``, e.g.
``--ratel-swap-config '{"optimizer_states": "device"}'`` runs the same tests with every model state on the device tier;
a value that is not a JSON object, or names ``ssd_paths``, stops the session before any test runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from lightning_ratel import RatelStrategy


class _Swap:
    """The session's replacement of the default strategy, and each test's outcome with the Trainers it swapped."""

    def __init__(self, config: pytest.Config, kwargs: dict[str, Any]) -> None:
        self.config = config
        self.kwargs = kwargs
        self.swaps = 0
        self.total = 0
        # node id -> [outcome, Trainers given RatelStrategy]
        self.tests: dict[str, list] = {}

    def choose(self, original: Strategy | str) -> Strategy | str:
        if type(original) is not SingleDeviceStrategy or original.root_device.type != "cpu":
            return original
        self.swaps += 1
        self.total += 1
        # Each Trainer gets a directory of its own (two Trainers of one test may be alive at once), from pytest's own
        # temporary directories, which the tests' `tmp_path` listings never see.
        factory: pytest.TempPathFactory = self.config._tmp_path_factory  # type: ignore[attr-defined]
        return RatelStrategy(ssd_paths=[str(factory.mktemp("ratel_swap"))], **self.kwargs)


# The session's swap and the method it wraps, set while the plugin is configured.
_swap: _Swap | None = None
_original: Callable[[_AcceleratorConnector], Strategy | str] | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--ratel-swap-log", default=None,
                     help="write each test's node id, outcome and number of Trainers given RatelStrategy to this file")
    parser.addoption("--no-ratel-swap", action="store_true",
                     help="leave Lightning's choice alone (the baseline run), still writing --ratel-swap-log")
    parser.addoption("--ratel-swap-config", default="{}", metavar="JSON",
                     help="keyword arguments of RatelStrategy (ssd_paths excepted) for every swapped-in strategy, as a "
                          "JSON object, e.g. '{\"optimizer_states\": \"device\"}'")


def _strategy_kwargs(text: str) -> dict[str, Any]:
    """The keyword arguments ``--ratel-swap-config`` gives, checked before any test runs."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as error:
        raise pytest.UsageError(f"--ratel-swap-config is not JSON ({error}): {text!r}") from None
    if not isinstance(kwargs, dict):
        raise pytest.UsageError(f"--ratel-swap-config must be a JSON object of RatelStrategy arguments, not {text!r}")
    if "ssd_paths" in kwargs:
        raise pytest.UsageError("--ratel-swap-config: ssd_paths is the plugin's (a fresh temporary directory for each "
                                "Trainer)")
    # Built once here so that a misspelt or refused argument stops the session instead of failing every test.
    try:
        RatelStrategy(**kwargs)
    except (TypeError, ValueError) as error:
        raise pytest.UsageError(f"--ratel-swap-config {text}: {error}") from None
    return kwargs


def pytest_configure(config: pytest.Config) -> None:
    global _swap, _original
    swap = _swap = _Swap(config, _strategy_kwargs(config.getoption("--ratel-swap-config")))
    if config.getoption("--no-ratel-swap"):
        return
    original = _original = _AcceleratorConnector._choose_strategy

    def choose_strategy(connector: _AcceleratorConnector) -> Strategy | str:
        return swap.choose(original(connector))

    _AcceleratorConnector._choose_strategy = choose_strategy  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    global _swap, _original
    if _original is not None:
        _AcceleratorConnector._choose_strategy = _original  # type: ignore[method-assign]
    _swap = _original = None


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    assert _swap is not None
    _swap.swaps = 0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    assert _swap is not None
    entry = _swap.tests.setdefault(report.nodeid, ["passed", 0])
    entry[1] = _swap.swaps
    # A failure anywhere fails the test (an error outside its call, unless its call failed); a skip in setup or call
    # skips it.
    if report.failed and entry[0] != "failed":
        entry[0] = "failed" if report.when == "call" else "error"
    elif report.skipped and entry[0] == "passed":
        entry[0] = "skipped"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    assert _swap is not None
    swapped = sum(1 for _, swaps in _swap.tests.values() if swaps)
    terminalreporter.write_line(f"ratel_swap: {_swap.total} Trainer(s) got RatelStrategy({_swap.kwargs or ''}), in "
                                f"{swapped} of {len(_swap.tests)} tests")
    log = config.getoption("--ratel-swap-log")
    if log is not None:
        with Path(log).open("w") as file:
            for nodeid, (outcome, swaps) in _swap.tests.items():
                file.write(f"{nodeid}\t{outcome}\t{swaps}\n")
