"""RatelStrategy's settings, checked in one place when the strategy is built, before anything is allocated."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from torch import nn

from lightning_ratel.errors import RatelConfigError
from lightning_ratel.plan.exchange import GRADIENT_EXCHANGES
from lightning_ratel.plan.search import Plan
from lightning_ratel.sizes import parse_bytes
from lightning_ratel.tiers import OPTIMIZER_STATES, PARAM_CACHES, OptimizerStates, ParamCache, check_policy

ActivationPolicy = str | dict[str, str]


class PlanLike(Protocol):
    """A plan object, as the strategy's ``plan`` argument takes it: a :class:`~lightning_ratel.Plan`.

    The signature names this protocol rather than the ``Plan`` dataclass because LightningCLI (jsonargparse) reads a
    string given for a dataclass type as a file of its fields: a plan file's path would be parsed field by field
    (minutes) and the whole plan copied into every saved ``config.yaml``. A path stays a path this way.
    """

    activation_placement: dict[str, str]

    def to_json(self) -> str: ...

ParamInitFn = Callable[[nn.Module], None]
CheckpointFormat = Literal["auto", "full", "sharded"]
BlockSpec = Sequence[str] | Callable[[nn.Module], Sequence[str]] | None
"""The blocks a user names: module names, a callable returning them from the module, or ``None`` to detect them."""
CHECKPOINT_FORMATS: tuple[CheckpointFormat, ...] = ("auto", "full", "sharded")


@dataclass
class RatelConfig:
    """What :class:`~lightning_ratel.RatelStrategy` was asked for, validated and normalized.

    See the strategy for the meaning of each field. Byte limits are byte counts here, ``plan`` is ``"auto"``, a
    :class:`~lightning_ratel.plan.Plan` (a plan file is loaded when the config is made) or ``None`` when an
    ``activation_policy`` replaces planning.

    Raises:
        RatelConfigError: any field has the wrong type or an unusable value.
    """

    ssd_paths: list[str] | None = None
    prefetch_depth: int = 1
    read_ahead_sets: int | None = None
    keep_swap_files: bool = False
    activation_policy: ActivationPolicy | None = None
    plan: str | Plan | None = "auto"
    host_memory_limit: int | None = None
    device_memory_limit: int | None = None
    blocks: BlockSpec = None
    param_cache: ParamCache = "auto"
    optimizer_states: OptimizerStates = "auto"
    param_init_fn: ParamInitFn | None = None
    pretrained: str | None = None
    checkpoint_format: CheckpointFormat = "auto"
    gradient_exchange: str = "auto"
    log_metrics: bool = True
    name: str = "ratel"

    def __post_init__(self) -> None:
        self.ssd_paths = _paths(self.ssd_paths)
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise RatelConfigError(f"`prefetch_depth` must be an integer >= 0, got {self.prefetch_depth!r}")
        sets = self.read_ahead_sets
        if sets is not None and (isinstance(sets, bool) or not isinstance(sets, int) or sets < 0):
            raise RatelConfigError(f"`read_ahead_sets` must be None or an integer >= 0, got {sets!r}")
        if not isinstance(self.keep_swap_files, bool):
            raise RatelConfigError(f"`keep_swap_files` must be True or False, got {self.keep_swap_files!r}")
        if self.activation_policy is not None:
            check_policy(self.activation_policy)
            self.plan = None
        self.plan = _plan(self.plan)
        self.host_memory_limit = parse_bytes(self.host_memory_limit, "host_memory_limit")
        self.device_memory_limit = parse_bytes(self.device_memory_limit, "device_memory_limit")
        _check_blocks(self.blocks)
        if self.param_cache not in PARAM_CACHES:
            raise RatelConfigError(f"`param_cache` must be one of {PARAM_CACHES}, got {self.param_cache!r}")
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise RatelConfigError(
                f"`optimizer_states` must be one of {OPTIMIZER_STATES}, got {self.optimizer_states!r}")
        if self.optimizer_states == "host" and self.keep_swap_files:
            raise RatelConfigError(
                "`keep_swap_files=True` keeps the optimizer states in the swap files for later use, so they cannot "
                "live in host memory (`optimizer_states='host'`): give optimizer_states='ssd' (or 'auto'), or "
                "keep_swap_files=False")
        if self.optimizer_states == "device" and self.keep_swap_files:
            raise RatelConfigError(
                "`keep_swap_files=True` keeps the optimizer states in the swap files for later use, so they cannot "
                "live on the device (`optimizer_states='device'`): give optimizer_states='ssd' (or 'auto'), or "
                "keep_swap_files=False")
        if self.optimizer_states == "device" and self.param_cache == "ssd":
            raise RatelConfigError(
                "`optimizer_states='device'` keeps every compute copy resident on the device, so none is read from "
                "the swap files (`param_cache='ssd'`): give param_cache='auto' (or 'host'), or another "
                "optimizer_states")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise RatelConfigError(f"`param_init_fn` must be callable, got {type(self.param_init_fn).__name__}")
        self.pretrained = _pretrained(self.pretrained)
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise RatelConfigError(
                f"`checkpoint_format` must be one of {CHECKPOINT_FORMATS}, got {self.checkpoint_format!r}")
        if self.gradient_exchange not in GRADIENT_EXCHANGES:
            raise RatelConfigError(
                f"`gradient_exchange` must be one of {GRADIENT_EXCHANGES}, got {self.gradient_exchange!r}")
        if not isinstance(self.log_metrics, bool):
            raise RatelConfigError(f"`log_metrics` must be True or False, got {self.log_metrics!r}")

    @property
    def plans_automatically(self) -> bool:
        """Whether the first training step is profiled and a plan made from it (``plan="auto"``)."""
        return self.activation_policy is None and self.plan == "auto"

    @property
    def states_request(self) -> OptimizerStates:
        """Where the optimizer states are to live: ``optimizer_states``, except that kept swap files hold them."""
        return "ssd" if self.keep_swap_files else self.optimizer_states

    def with_ssd_paths(self, ssd_paths: Sequence[str]) -> RatelConfig:
        """A copy whose swap directories are ``ssd_paths`` (the run's default when none were given)."""
        return replace(self, ssd_paths=list(ssd_paths))


def _paths(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, str)):
        raise RatelConfigError(f"`ssd_paths` must be a list of directories, got {value!r}")
    if not value:
        raise RatelConfigError("`ssd_paths` is empty: give at least one directory, or None for the default")
    bad = [p for p in value if not isinstance(p, (str, os.PathLike)) or not os.fspath(p)]
    if bad:
        raise RatelConfigError(f"`ssd_paths` must name directories (strings or paths), got {bad!r}")
    paths = [os.fspath(p) for p in value]
    # Missing directories are created when a run starts; a file in the way can be refused now.
    files = [p for p in paths if os.path.exists(p) and not os.path.isdir(p)]
    if files:
        raise RatelConfigError(f"`ssd_paths` must name directories; {files!r} exist and are not directories")
    return paths


def _pretrained(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise RatelConfigError(f"`pretrained` must be the path of a Hugging Face checkpoint folder, got {value!r}")
    path = os.path.abspath(os.fspath(value))
    if not os.path.isdir(path):
        raise RatelConfigError(f"`pretrained` must be a Hugging Face checkpoint folder; {path!r} is not a directory")
    return path


def _plan(value: object) -> str | Plan | None:
    if value is None or value == "auto" or isinstance(value, Plan):
        return value  # type: ignore[return-value]
    if not isinstance(value, (str, os.PathLike)):
        raise RatelConfigError(f"`plan` must be 'auto', a Plan or a plan JSON file, got {value!r}")
    if not os.path.isfile(value):
        raise RatelConfigError(f"`plan` must be 'auto', a Plan or a plan JSON file; {os.fspath(value)!r} is not a file")
    try:
        return Plan.load(value)
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = f"{type(err).__name__}: {err}" if not isinstance(err, json.JSONDecodeError) else f"invalid JSON: {err}"
        raise RatelConfigError(f"`plan` file {os.fspath(value)!r} cannot be read as a plan ({reason})") from err


def _check_blocks(blocks: object) -> None:
    if blocks is None or callable(blocks):
        return
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence) or isinstance(blocks, Mapping):
        raise RatelConfigError(
            f"`blocks` must be a list of module names or a callable returning one, got {blocks!r}"
            + (f" (did you mean [{blocks!r}]?)" if isinstance(blocks, str) else ""))
    bad = [b for b in blocks if not isinstance(b, str)]
    if bad:
        raise RatelConfigError(f"`blocks` must hold module names (strings), got {bad!r}")
