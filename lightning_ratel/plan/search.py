"""Choose where each saved activation lives: Ratel's Algorithm 1 under explicit memory budgets.

The search starts from the cheapest placement that can run at all (each block's inputs stored, everything else
recomputed) and stores one more op per step, best recompute-seconds-per-byte first, on the best tier that still has
room: the device (no traffic), else pinned host memory, else the SSDs. Storing the ops with the most benefit first
makes predicted iteration time a convex curve over the stored volume; the point with the least time is the plan.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import NoReturn

from lightning_ratel.errors import RatelConfigError, RatelPlanError
from lightning_ratel.hardware import HardwareProfile
from lightning_ratel.plan.cost import (
    CostModel,
    CostSettings,
    DeviceOverhead,
    LayerCost,
    Prediction,
    largest_batch,
    layer_cost,
    node_models,
    recompute_ops,
    slowest_node,
)
from lightning_ratel.plan.profile import LayerProfile, OpProfile
from lightning_ratel.sizes import format_bytes, round_up
from lightning_ratel.tiers import INPUT_OP, STORED_TIERS, TIERS, placement_key

PLAN_FORMAT = 1
"""Version of the plan file format :meth:`Plan.to_json` writes; a file of another version is refused."""


@dataclass
class Plan:
    """An activation placement with the prediction and the search that produced it.

    Attributes:
        activation_placement: ``"<block>/<op>"`` -> ``"device"``, ``"host"``, ``"ssd"`` or ``"recompute"``.
        predicted_iteration_time: predicted seconds of one micro-batch.
        predicted_forward_time: predicted seconds of its forward.
        predicted_backward_time: predicted seconds of its backward.
        resource_times: ``{"forward": {...}, "backward": {...}}``: busy seconds per resource
            (see :class:`~lightning_ratel.plan.cost.Prediction`).
        memory: predicted peak bytes of ``"device"``, ``"host"`` and ``"ssd"`` (of several nodes, the first one's:
            the budgets are checked against its settings).
        budgets: the budgets searched under, same keys as ``memory``.
        curve: ``(offloaded bytes (host + ssd), predicted iteration time)`` at each search point.
        chosen: index of this plan's point in ``curve``.
        prefetch_depth: blocks paged in ahead of the one computing.
        hardware: the hardware profile searched with; of several nodes', the one whose predicted time is the plan's.
        layers: the block profiles searched with.
        blocks: names of every block of the model the plan was made for, so a plan is never applied to another one.
        format_version: :data:`PLAN_FORMAT` of the code that wrote it.
        settings: the cost model's settings searched with, so another placement can be predicted as this one was; of
            several nodes', those of the node whose predicted time is the plan's (``None`` in plans written before
            they were kept).
    """

    activation_placement: dict[str, str]
    predicted_iteration_time: float
    predicted_forward_time: float
    predicted_backward_time: float
    resource_times: dict[str, dict[str, float]]
    memory: dict[str, int]
    budgets: dict[str, int]
    curve: list[tuple[int, float]]
    chosen: int
    prefetch_depth: int = 1
    hardware: HardwareProfile | None = None
    layers: list[LayerProfile] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    format_version: int = PLAN_FORMAT
    settings: CostSettings | None = None

    def placement(self, block: str, op: str, default: str = "device") -> str:
        """The tier of ``op`` of ``block``, or ``default`` where the plan does not mention it."""
        return self.activation_placement.get(placement_key(block, op), default)

    def to_json(self) -> str:
        """The plan as JSON (profiles included, so a stored plan can be re-predicted and reported)."""
        data = asdict(self)
        data["hardware"] = self.hardware.to_dict() if self.hardware is not None else None
        data["layers"] = [layer.to_dict() for layer in self.layers]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan :meth:`to_json` produced.

        Raises:
            RatelConfigError: the text is not a plan of this format version.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or "activation_placement" not in data:
            raise RatelConfigError("not a plan: no activation_placement")
        version = data.get("format_version")
        if version != PLAN_FORMAT:
            raise RatelConfigError(f"plan format version {version!r}, this version of lightning_ratel reads "
                                   f"{PLAN_FORMAT}; make the plan again (plan='auto')")
        data["hardware"] = HardwareProfile.from_dict(data["hardware"]) if data.get("hardware") else None
        data["layers"] = [LayerProfile.from_dict(layer) for layer in data.get("layers", [])]
        data["curve"] = [(int(offloaded), float(seconds)) for offloaded, seconds in data["curve"]]
        data["settings"] = CostSettings.from_dict(data["settings"]) if data.get("settings") else None
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan :meth:`save` wrote."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def summary(self) -> list[dict]:
        """Per block, in execution order: where its saved activations go.

        Returns:
            One dict per block: ``"block"`` (name), ``"ops"`` (tier -> number of ops with saved bytes placed there),
            ``"bytes"`` (tier -> saved bytes) and ``"rerun"`` (ops re-executed in backward, recompute chains
            included). Without layer profiles the blocks come from the placement keys, every op counts and bytes
            are 0.
        """
        if not self.layers:
            rows: dict[str, dict] = {}
            for key, tier in self.activation_placement.items():
                block = key.partition("/")[0]
                row = rows.setdefault(block, {"block": block, "ops": dict.fromkeys(TIERS, 0),
                                              "bytes": dict.fromkeys(TIERS, 0), "rerun": 0})
                row["ops"][tier] += 1
                row["rerun"] += tier == "recompute"
            return list(rows.values())
        rows_in_order = []
        for layer in sorted(self.layers, key=lambda layer: layer.index):
            counts = dict.fromkeys(TIERS, 0)
            for op in layer.ops:
                if op.saved_bytes > 0:
                    counts[self.placement(layer.name, op.name)] += 1
            rows_in_order.append({
                "block": layer.name,
                "ops": counts,
                "bytes": layer_cost(layer, self.activation_placement).bytes,
                "rerun": len(recompute_ops(layer, self.activation_placement)),
            })
        return rows_in_order


def fixed(layers: Sequence[LayerProfile], tier: str) -> dict[str, str]:
    """Every op on ``tier``; where ``tier`` is ``"recompute"`` the ops that must be stored go to ``"host"``.

    Raises:
        RatelConfigError: ``tier`` is not one of the tiers.
    """
    if tier not in TIERS:
        raise RatelConfigError(f"tier {tier!r} is not one of {TIERS}")
    placement = {}
    for layer in layers:
        for op in layer.ops:
            must_store = op.name == INPUT_OP or not layer.op_level
            placement[placement_key(layer.name, op.name)] = "host" if tier == "recompute" and must_store else tier
    return placement


class _Walk:
    """The placement being built, with each block's bytes per tier kept up to date for cheap budget checks.

    Args:
        model: the cost model.
        budgets: bytes per ``"device"``, ``"host"``, ``"ssd"``.
        staging_reserve: host bytes kept free for SSD staging whatever the SSDs hold so far.
    """

    def __init__(self, model: CostModel, budgets: dict[str, int], staging_reserve: int = 0) -> None:
        self.model = model
        self.budgets = budgets
        self.staging_reserve = staging_reserve
        self.placement: dict[str, str] = {}
        self.layer_bytes = [dict.fromkeys(TIERS, 0) for _ in model.layers]

    def copy(self, staging_reserve: int) -> _Walk:
        twin = _Walk(self.model, self.budgets, staging_reserve)
        twin.placement = dict(self.placement)
        twin.layer_bytes = [dict(counts) for counts in self.layer_bytes]
        return twin

    def memory(self) -> dict[str, int]:
        return self.model.memory(self.layer_bytes, staging_reserve=self.staging_reserve)

    def fits(self) -> bool:
        memory = self.memory()
        return all(memory[name] <= self.budgets[name] for name in memory)

    def move(self, layer: int, op: OpProfile, old: str | None, tiers: Sequence[str]) -> str | None:
        """Put ``op`` on the first of ``tiers`` that keeps every budget (``old``: its tier now, if counted)."""
        counts = self.layer_bytes[layer]
        if old is not None:
            counts[old] -= op.saved_bytes
        for tier in tiers:
            counts[tier] += op.saved_bytes
            if self.fits():
                self.placement[placement_key(self.model.layers[layer].name, op.name)] = tier
                return tier
            counts[tier] -= op.saved_bytes
        if old is not None:
            counts[old] += op.saved_bytes
        return None


@dataclass
class _Descent:
    """One greedy walk: the placement it started from, its moves and the predicted time after each."""

    start: dict[str, str]
    moves: list[tuple[str, str]]
    curve: list[tuple[int, float]]
    recompute: list[float]

    def rank(self, n: int) -> tuple[float, int, float]:
        """Sort key of search point ``n``: predicted time, then offloaded bytes, then recompute seconds.

        Of equally fast plans the one moving the least data wins, then the one recomputing least: keeping on the
        device is free, and fewer recomputes leave margin where the model misjudges the bottleneck.
        """
        return self.curve[n][1], self.curve[n][0], self.recompute[n]

    @property
    def chosen(self) -> int:
        return min(range(len(self.curve)), key=self.rank)

    def record(self, prediction: Prediction) -> None:
        """Add the search point ``prediction`` describes."""
        self.curve.append((prediction.bytes["host"] + prediction.bytes["ssd"], prediction.iteration_time))
        self.recompute.append(prediction.backward["recompute"])

    def placement(self) -> dict[str, str]:
        placement = dict(self.start)
        placement.update(self.moves[: self.chosen])
        return placement


def _descend(walk: _Walk, candidates: list[tuple[int, OpProfile]], models: Sequence[CostModel]) -> _Descent:
    """Store the candidates in order, each on the best tier with room, predicting after every step (on the slowest of
    the nodes ``models`` describe)."""
    model = walk.model
    start = dict(walk.placement)
    costs = [layer_cost(layer, walk.placement) for layer in model.layers]
    descent = _Descent(start, [], [], [])

    def evaluate(costs: list[LayerCost]) -> Prediction:
        return slowest_node(models, costs)[1]

    descent.record(evaluate(costs))
    for i, op in candidates:
        # An op that fits nowhere stays recomputed; a smaller one later in the order may still fit.
        tier = walk.move(i, op, "recompute", STORED_TIERS)
        if tier is None:
            continue
        descent.moves.append((placement_key(model.layers[i].name, op.name), tier))
        costs[i] = layer_cost(model.layers[i], walk.placement)
        descent.record(evaluate(costs))
    return descent


def _check_fixed_memory(walk: _Walk, unified: bool) -> None:
    """Raise if paging and the backward working set alone exceed a budget."""
    model = walk.model
    memory = walk.memory()
    largest, working = model.largest_block, model.working_block
    device_need = (f"{model.buffers} x the largest block {largest.name!r} ({format_bytes(largest.param_bytes)}) "
                   f"for paging with prefetch_depth={model.prefetch_depth}, plus the backward working set of block "
                   f"{working.name!r} ({format_bytes(model.working_bytes(working))}: parameters, gradients and every "
                   f"activation it saves{_overhead_text(model.overhead)})") if largest else "nothing"
    if not unified and memory["device"] > walk.budgets["device"]:
        raise RatelPlanError(
            f"device budget too small: the plan needs {format_bytes(memory['device'])} of device memory "
            f"({device_need}) but the budget is {format_bytes(walk.budgets['device'])}: short by "
            f"{format_bytes(memory['device'] - walk.budgets['device'])}. Use a smaller batch size or sequence length"
            f"{_batch_hint(model, walk.budgets['device'])}, lower prefetch_depth, or raise device_memory_limit.")
    if memory["host"] > walk.budgets["host"]:
        parts = f"{format_bytes(model.host_static_bytes)} held by the rest of the run"
        if unified:
            parts += f" plus {format_bytes(memory['device'] - model.host_static_bytes)} for compute ({device_need})"
        raise RatelPlanError(
            f"host budget too small: the plan needs {format_bytes(memory['host'])} of host memory ({parts}) before "
            f"storing any activation, but the budget is {format_bytes(walk.budgets['host'])}: short by "
            f"{format_bytes(memory['host'] - walk.budgets['host'])}. Raise host_memory_limit, lower prefetch_depth, "
            f"or use a smaller batch size or sequence length.")


def _batch_hint(model: CostModel, budget: int) -> str:
    """How much smaller the profiled batch must be for the device need to fit ``budget`` (empty if none does).

    What the working block saves, the gradients of its activations and the logits grow with the batch; parameters,
    gradients, paging buffers and workspaces do not."""
    working = model.working_block
    if working is None:
        return ""
    per_batch = model.working_bytes(working) - working.param_bytes - working.grad_bytes + model.overhead.logits_bytes
    fixed = model.fixed_device_bytes - per_batch
    # In thousandths of the profiled batch.
    fits = largest_batch(budget, fixed, max(1, round_up(per_batch, 1000) // 1000),
                         fragmentation=model.overhead.fragmentation, limit=999)
    if not fits:
        return " (none fits: the rest alone is too big)"
    return f" (at most {fits / 10:.1f}% of the profiled one fits)"


def _overhead_text(overhead: DeviceOverhead) -> str:
    """What the device need counts beyond paging and the working set, for the budget error (empty where nothing)."""
    parts = [f"{label} {format_bytes(n)}" for label, n in (("workspaces", overhead.workspace_bytes),
                                                           ("logits", overhead.logits_bytes),
                                                           ("autocast cache", overhead.autocast_cache_bytes)) if n]
    if overhead.grad_temp_ratio:
        parts.insert(0, f"gradient temporaries ({overhead.grad_temp_ratio:g} of its saved bytes)")
    if overhead.fragmentation:
        parts.append(f"{overhead.fragmentation:.0%} for allocator fragmentation")
    return f"; with {', '.join(parts)}" if parts else ""


def _place_required(walk: _Walk, unified: bool) -> None:
    """Store what cannot be recomputed (block inputs, blocks profiled as a whole) on the best tiers with room.

    All of it starts on the SSDs where that fits and is then moved up block by block, so the host staging that
    SSD traffic needs is never crowded out by earlier choices; where it does not fit, each item takes the best
    tier left in turn.
    """
    model = walk.model
    required = [(i, op) for i, layer in enumerate(model.layers) for op in layer.ops
                if op.name == INPUT_OP or not layer.op_level]
    # Later blocks first: backward reads them first, so they get the fast tiers.
    required.sort(key=lambda item: -model.layers[item[0]].index)
    for i, op in required:
        walk.layer_bytes[i]["ssd"] += op.saved_bytes
    start_on_ssd = walk.fits()
    if not start_on_ssd:
        for i, op in required:
            walk.layer_bytes[i]["ssd"] -= op.saved_bytes
    for n, (i, op) in enumerate(required):
        if walk.move(i, op, "ssd" if start_on_ssd else None, STORED_TIERS) is None:
            _raise_required(walk, [op for _, op in required], [op for _, op in required[n:]], op, i, unified)


def _raise_required(walk: _Walk, required: list[OpProfile], left: list[OpProfile], op: OpProfile, layer: int,
                    unified: bool) -> NoReturn:
    """Raise the error for required activations that fit no tier, with what each budget lacks."""
    memory = walk.memory()
    budgets = walk.budgets
    remaining = sum(item.saved_bytes for item in left)
    host_room = budgets["host"] - memory["host"]
    store_room = budgets["ssd"] - memory["ssd"]
    if op.saved_bytes > store_room:
        ssd_text = (f"the store budget {format_bytes(budgets['ssd'])} has {format_bytes(store_room)} left: short by "
                    f"{format_bytes(remaining - store_room)}")
    else:
        walk.layer_bytes[layer]["ssd"] += op.saved_bytes
        staging_need = walk.memory()["host"] - memory["host"]
        walk.layer_bytes[layer]["ssd"] -= op.saved_bytes
        ssd_text = (f"the SSDs have room, but staging their traffic needs {format_bytes(staging_need)} more host "
                    f"memory, {format_bytes(host_room)} left: short by {format_bytes(staging_need - host_room)}")
    what = "block inputs" if all(item.name == INPUT_OP for item in required) else "block inputs and whole blocks"
    host_name = "host budget (shared with compute on a CPU run)" if unified else "host budget"
    raise RatelPlanError(
        f"{what} cannot be recomputed and need {format_bytes(sum(item.saved_bytes for item in required))} of "
        f"storage, but {format_bytes(remaining)} of it fits nowhere: the {host_name} {format_bytes(budgets['host'])} "
        f"has {format_bytes(host_room)} left: short by {format_bytes(remaining - host_room)}; {ssd_text}. Raise "
        f"host_memory_limit, add or free ssd_paths, lower prefetch_depth, or use a smaller batch size or sequence "
        f"length.")


def _start(model: CostModel, device_budget: int, host_budget: int,
           store_budget: int) -> tuple[_Walk, dict[str, tuple[int, OpProfile]]]:
    """The safe minimum every search point starts from: budgets checked, what cannot be recomputed stored, every
    other op that saves bytes recomputed (returned by key with its layer index), ops that save nothing on the device.
    """
    unified = model.hw.unified_memory
    budgets = {"device": host_budget if unified else device_budget, "host": host_budget, "ssd": store_budget}
    walk = _Walk(model, budgets)
    _check_fixed_memory(walk, unified)
    _place_required(walk, unified)
    candidates: dict[str, tuple[int, OpProfile]] = {}
    for i, layer in enumerate(model.layers):
        for op in layer.ops:
            key = placement_key(layer.name, op.name)
            if key in walk.placement:
                continue
            if op.saved_bytes > 0:
                walk.placement[key] = "recompute"
                walk.layer_bytes[i]["recompute"] += op.saved_bytes
                candidates[key] = (i, op)
            else:
                walk.placement[key] = "device"
    return walk, candidates


def _staging_reserve(model: CostModel) -> int:
    """Host bytes that SSD staging for whole blocks needs (the second walk keeps them free from the start)."""
    return model.buffers * max((layer.saved_bytes for layer in model.layers), default=0)


def search(hw: HardwareProfile | Sequence[HardwareProfile], layers: Sequence[LayerProfile], *, device_budget: int,
           host_budget: int, store_budget: int,
           settings: CostSettings | Sequence[CostSettings] | None = None) -> Plan:
    """Find the activation placement with the least predicted iteration time within the budgets.

    For several nodes that all apply the plan, a placement's time is that of the node slowest under it (each node is
    predicted with its own speeds and settings, and the slowest may differ from one placement to the next): the plan
    is the placement whose slowest node is fastest. The budgets hold for the first node's settings (its
    ``host_static_bytes``): give budgets that leave every node's ranks room (see ``host_room`` in the planner).

    Args:
        hw: the machine, or each node's profile.
        layers: the profiled blocks.
        device_budget: bytes of device memory the run may use (ignored on unified memory, where device and host
            share ``host_budget``).
        host_budget: bytes of host memory the run may use.
        store_budget: bytes the swap directories may hold for activations.
        settings: the run's settings (``None``: the defaults of
            :class:`~lightning_ratel.plan.cost.CostSettings`), or each node's, in the order of ``hw`` (see
            :func:`~lightning_ratel.plan.cost.node_models`).

    Returns:
        The plan at the best point of the search, with the whole curve.

    Raises:
        RatelPlanError: even the minimum placement does not fit; the message names the budget, the shortfall and
            what to change.
        RatelConfigError: the profiles are inconsistent, the nodes have different device types, or ``settings`` are
            for another number of nodes.
    """
    nodes = [hw] if isinstance(hw, HardwareProfile) else list(hw)
    models = node_models(nodes, layers, settings)
    # Memory does not depend on the speeds; the first node's settings (the planning rank's host bytes) count it.
    model = models[0]
    walk, candidates = _start(model, device_budget, host_budget, store_budget)
    order = [candidates[key] for key in candidate_order(model.layers) if key in candidates]

    # Filling host memory first can leave no room for the staging buffers SSD traffic needs, and then nothing
    # spills; a second walk keeps staging for a whole block free from the start. The faster one wins.
    descents = [_descend(walk.copy(0), order, models)]
    reserve = _staging_reserve(model)
    reserved = walk.copy(reserve)
    if reserve and reserved.fits():
        descents.append(_descend(reserved, order, models))
    best = min(descents, key=lambda descent: descent.rank(descent.chosen))
    costs = [layer_cost(layer, best.placement()) for layer in model.layers]
    slowest, prediction = slowest_node(models, costs)
    return Plan(
        activation_placement=best.placement(),
        predicted_iteration_time=prediction.iteration_time,
        predicted_forward_time=prediction.forward_time,
        predicted_backward_time=prediction.backward_time,
        resource_times={"forward": prediction.forward, "backward": prediction.backward},
        memory=model.memory([cost.bytes for cost in costs]),
        budgets=dict(walk.budgets),
        curve=best.curve,
        chosen=best.chosen,
        prefetch_depth=model.prefetch_depth,
        hardware=nodes[slowest],
        layers=list(layers),
        blocks=[layer.name for layer in layers],
        settings=models[slowest].settings,
    )


def candidate_order(layers: Sequence[LayerProfile]) -> list[str]:
    """Keys of the ops :func:`search` chooses between storing and recomputing, in the order it tries to store them.

    These are the ops of blocks profiled op by op that save bytes, ``"input"`` excluded: most recompute seconds
    saved per stored byte first; on ties the ops backward reaches first.
    """
    candidates = []
    for layer in layers:
        if not layer.op_level:
            continue
        for position, op in enumerate(layer.ops):
            if op.name != INPUT_OP and op.saved_bytes > 0:
                rank = (-op.forward_time / op.saved_bytes, -layer.index, -position)
                candidates.append((rank, placement_key(layer.name, op.name)))
    return [key for _, key in sorted(candidates)]


def storing(
    hw: HardwareProfile,
    layers: Sequence[LayerProfile],
    stored: Collection[str],
    *,
    device_budget: int,
    host_budget: int,
    store_budget: int,
    settings: CostSettings | None = None,
    tiers: Sequence[str] = STORED_TIERS,
    keep_staging: bool = False,
) -> dict[str, str]:
    """The placement that stores the candidate ops ``stored`` and recomputes the other candidates.

    Block inputs and blocks profiled as a whole are placed as :func:`search` places them. Then each op of
    ``stored``, in :func:`candidate_order`, goes on the first of ``tiers`` that keeps every budget; one that fits
    none stays recomputed, as in the search. This is one point of the search's walk chosen by hand, for measuring
    the cost model away from the point the search picks.

    Args:
        hw: the machine.
        layers: the profiled blocks.
        stored: keys (``"<block>/<op>"``) of candidate ops to store.
        device_budget: bytes of device memory (ignored on unified memory, as in :func:`search`).
        host_budget: bytes of host memory.
        store_budget: bytes the swap directories may hold for activations.
        settings: the run's settings, as for :func:`search`.
        tiers: where stored ops may go, tried in this order; a subset of ``("device", "host", "ssd")``.
        keep_staging: keep host room for one block's SSD staging from the start, as the search's second walk
            does, so that ops can still spill to the SSDs once the faster tiers are full.

    Returns:
        ``"<block>/<op>"`` -> tier for every op of every block.

    Raises:
        RatelConfigError: a key of ``stored`` is not a candidate, ``tiers`` names something else than a storing
            tier, or the profiles are inconsistent.
        RatelPlanError: the budgets do not hold what cannot be recomputed.
    """
    bad_tiers = [tier for tier in tiers if tier not in STORED_TIERS]
    if bad_tiers or not tiers:
        raise RatelConfigError(f"tiers must be a non-empty subset of {STORED_TIERS}, got {list(tiers)}")
    order = candidate_order(layers)
    unknown = set(stored) - set(order)
    if unknown:
        raise RatelConfigError(f"{sorted(unknown)} are not ops that can be either stored or recomputed")
    model = CostModel(hw, layers, settings)
    walk, where = _start(model, device_budget, host_budget, store_budget)
    reserve = _staging_reserve(model)
    if keep_staging and reserve and walk.copy(reserve).fits():
        walk = walk.copy(reserve)
    for key in order:
        if key in stored:
            i, op = where[key]
            walk.move(i, op, "recompute", tiers)
    return walk.placement
