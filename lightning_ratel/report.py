"""Human-readable views of a plan: a terminal table and a PNG comparing the prediction with measured steps."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from rich.console import Console
from rich.table import Table

from lightning_ratel.plan.cost import bottleneck
from lightning_ratel.plan.search import Plan
from lightning_ratel.sizes import format_bytes
from lightning_ratel.tiers import TIERS

STEP_KEYS = ("wall", "compute", "h2d", "d2h", "ssd", "cpu_optimizer", "idle")
"""The per-step measurements :func:`write_report` draws: the wall time, then the resources in bar order."""
_MIB = 1 << 20
_GIB = 1 << 30
_MAX_TICKS = 20


def _phase_text(plan: Plan, phase: str, seconds: float) -> str:
    """``"<phase> <seconds> s (bound: <resource>)"``, the bound left out where the plan has no resource times."""
    resources = plan.resource_times.get(phase)
    if not resources:
        return f"{phase} {seconds:.3g} s"
    unified = plan.hardware is not None and plan.hardware.unified_memory
    return f"{phase} {seconds:.3g} s (bound: {bottleneck(resources, unified=unified)})"


def _common_prefix(names: Sequence[str]) -> str:
    """The dotted module path all ``names`` start with (``"model.model."``), leaving at least one part of each."""
    parts = [name.split(".") for name in names]
    if not parts:
        return ""
    prefix: list[str] = []
    for group in zip(*parts):
        if len(set(group)) > 1:
            break
        prefix.append(group[0])
    prefix = prefix[:min(len(p) for p in parts) - 1]
    return "".join(part + "." for part in prefix)


def _size(n: float) -> str:
    """A byte count in at most five characters (``"0"``, ``"512"``, ``"96K"``, ``"1.2M"``, ``"38G"``)."""
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{n:.0f}"


def plan_table(plan: Plan) -> Table:
    """Per block, how many ops and how many bytes of saved activations go to each tier.

    Block names lose the module path they all share (named in the title), so that rows differ where the names do;
    a name too long for the terminal wraps instead of being cut. Byte counts are short (``"1.2M"``): the table fits
    80 columns.

    Args:
        plan: the plan to show.

    Returns:
        A table with one row per block and a total row; its caption gives the predicted forward, backward and
        iteration time and the resource that bounds each phase.
    """
    rows = plan.summary()
    prefix = _common_prefix([row["block"] for row in rows])
    title = "Activation placement (ops · bytes)" + (f" of {prefix}*" if prefix else "")
    table = Table(title=title, caption=" · ".join([
        _phase_text(plan, "forward", plan.predicted_forward_time),
        _phase_text(plan, "backward", plan.predicted_backward_time),
        f"iteration {plan.predicted_iteration_time:.3g} s",
    ]))
    table.add_column("block", overflow="fold")
    for tier in TIERS:
        table.add_column(tier, justify="right", no_wrap=True)
    table.add_column("re-run", justify="right", no_wrap=True)
    total_ops = dict.fromkeys(TIERS, 0)
    total_bytes = dict.fromkeys(TIERS, 0)
    for n, row in enumerate(rows):
        for tier in TIERS:
            total_ops[tier] += row["ops"][tier]
            total_bytes[tier] += row["bytes"][tier]
        cells = [f"{row['ops'][tier]} · {_size(row['bytes'][tier])}" for tier in TIERS]
        table.add_row(row["block"][len(prefix):], *cells, str(row["rerun"]), end_section=n == len(rows) - 1)
    table.add_row("total", *[f"{total_ops[tier]} · {_size(total_bytes[tier])}" for tier in TIERS],
                  str(sum(row["rerun"] for row in rows)))
    return table


@rank_zero_only
def show_plan(plan: Plan, planning_seconds: float | None = None) -> None:
    """Print the plan as a table, with the search time and the predicted step time (rank zero)."""
    Console().print(plan_table(plan))
    took = f" (search {planning_seconds * 1000:.0f} ms)" if planning_seconds is not None else ""
    rank_zero_info(f"RatelStrategy: plan applied{took}; predicted {plan.predicted_iteration_time:.3f} s/step"
                   + read_ahead_text(plan))


def read_ahead_text(plan: Plan) -> str:
    """``"; optimizer states read ahead during forward: <bytes>, the disk busy <s> of forward's <s>"``, or nothing
    where the plan reads none ahead."""
    settings = plan.settings
    if settings is None or not settings.state_read_ahead_bytes_per_param:
        return ""
    numel = sum(layer.trainable_numel for layer in plan.layers) / settings.ranks_on_node
    disk = plan.resource_times.get("forward", {}).get("ssd", 0.0)
    ahead = int(numel * settings.state_read_ahead_bytes_per_param)
    return (f"; optimizer states read ahead during forward: {format_bytes(ahead)}, the disk busy {disk:.3g} s of "
            f"forward's {plan.predicted_forward_time:.3g} s")


def curve_axis(plan: Plan) -> tuple[list[float], str, str, str]:
    """The x values of the report's search curve, its title, the axis label and how the chosen point is named.

    The x axis is the offloaded activation volume, unless every point offloads the same bytes: on a CPU, device and
    host are one memory and the search trades recomputation for memory only, so the points go by search order (an
    axis of one value would draw them on top of each other).
    """
    offloaded = [x for x, _ in plan.curve]
    if max(offloaded) > min(offloaded):
        scale, unit = (_GIB, "GiB") if max(offloaded) >= _GIB else (_MIB, "MiB")
        xs = [x / scale for x in offloaded]
        return (xs, "(a) predicted iteration time vs offloaded activations",
                f"offloaded activations, host + SSD ({unit})", f"{xs[plan.chosen]:.3g} {unit}")
    return (list(range(len(plan.curve))), "(a) predicted iteration time at each search point",
            f"search point (each offloads {format_bytes(offloaded[0])} to host + SSD)", f"point {plan.chosen}")


def write_report(path: str | os.PathLike[str], plan: Plan, steps: Sequence[dict[str, float]]) -> None:
    """Write a two-panel PNG: the search curve, and measured step times against the prediction.

    Panel (a) is the predicted iteration time over the offloaded activation volume at each search point, with the
    chosen point marked (Ratel's Figure 9b; by search order where no point offloads more than another, see
    :func:`curve_axis`). Panel (b) shows, per measured step, the wall time as a wide grey bar
    with the busy seconds of each resource as grouped bars in front of it, and the predicted iteration time as a
    dashed line.

    Args:
        path: where the PNG goes; missing parent directories are created.
        plan: the plan the steps ran with.
        steps: one dict per step with ``"step"`` and the seconds of :data:`STEP_KEYS` (missing keys count as 0).

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    # matplotlib is an optional dependency; the table above must work without it.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("write_report needs matplotlib: pip install 'lightning_ratel[examples]'") from err

    # A bare Figure on the Agg canvas leaves pyplot's global backend, and the user's session, alone.
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    curve_ax, steps_ax = fig.subplots(1, 2, width_ratios=(1, 1.4))

    curve_ax.set_ylabel("predicted iteration time (s)")
    if plan.curve:
        xs, title, xlabel, where = curve_axis(plan)
        ys = [t for _, t in plan.curve]
        curve_ax.set_title(title)
        curve_ax.set_xlabel(xlabel)
        curve_ax.plot(xs, ys, marker=".", linewidth=1)
        curve_ax.plot([xs[plan.chosen]], [ys[plan.chosen]], marker="*", markersize=16, color="tab:red",
                      linestyle="none", label=f"chosen: {ys[plan.chosen]:.3g} s at {where}")
        curve_ax.legend(loc="best")
    else:
        curve_ax.set_title("(a) predicted iteration time vs offloaded activations")
        curve_ax.text(0.5, 0.5, "no search curve", transform=curve_ax.transAxes, ha="center", va="center")

    steps_ax.set_title("(b) measured time per step")
    steps_ax.set_ylabel("seconds")
    steps_ax.axhline(plan.predicted_iteration_time, color="black", linestyle="--",
                     label=f"predicted iteration {plan.predicted_iteration_time:.3g} s")
    if steps:
        positions = range(len(steps))
        # Resources overlap in time, so they stand side by side in front of the step's wall time, not stacked.
        steps_ax.bar(positions, [step.get("wall", 0.0) for step in steps], width=0.9, color="0.85", label="wall")
        resources = STEP_KEYS[1:]
        width = 0.8 / len(resources)
        for k, key in enumerate(resources):
            offsets = [n - 0.4 + (k + 0.5) * width for n in positions]
            steps_ax.bar(offsets, [step.get(key, 0.0) for step in steps], width=width, label=key)
        every = max(1, math.ceil(len(steps) / _MAX_TICKS))
        ticks = list(range(0, len(steps), every))
        steps_ax.set_xticks(ticks, [f"{steps[n].get('step', n):g}" for n in ticks])
        steps_ax.set_xlabel("step")
    else:
        steps_ax.text(0.5, 0.5, "no measured steps", transform=steps_ax.transAxes, ha="center", va="center")
    steps_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

    if plan.hardware is not None:
        fig.suptitle(f"Ratel plan on {plan.hardware.device_type}, prefetch_depth={plan.prefetch_depth}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(os.fspath(path), dpi=110, format="png")
