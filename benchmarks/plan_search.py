"""How long the plan search takes on a large model, against the iteration time it plans.

The search runs once per fit (after the profiled steps); a 32-block model with 40 ops per block and every tier in
play is the case to keep fast. The profile is synthetic (deterministic op times and sizes), so the figure measures the
search alone. Prints the search's seconds and their ratio to the predicted iteration time of the plan it found.

    python -m benchmarks.plan_search --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from lightning_ratel.plan import HardwareProfile, LayerProfile, OpProfile, search
from lightning_ratel.plan.cost import CostModel
from lightning_ratel.plan.search import Plan

BIG = 1 << 50  # a budget that never binds


def large_model(blocks: int = 32, ops: int = 39) -> tuple[HardwareProfile, list[LayerProfile], dict[str, int]]:
    """A synthetic profile of ``blocks`` blocks of ``ops`` ops (residual reads every fifth op, some ops saving
    nothing), a CUDA machine, and budgets under which the best plan uses every tier."""
    layers = []
    for i in range(blocks):
        profile = [OpProfile("input", 0.0, 0.0, 4 << 20)]
        for k in range(ops):
            reads = [profile[-1].name] + ([profile[-3].name] if k % 5 == 0 and len(profile) > 2 else [])
            saved = 0 if k % 7 == 3 else ((k * 37 + i * 11) % 13 + 1) << 20
            profile.append(OpProfile(f"op{k}", ((k * 53 + i * 7) % 17 + 1) * 1e-4, 1e9, saved, reads))
        layers.append(LayerProfile(f"model.layers.{i}", i, 0.02, 0.04, 200 << 20, 200 << 20, 1 << 20, profile))
    link, ssd = 20e9, 6e9
    hardware = HardwareProfile(device_type="cuda", h2d_bandwidth=link, d2h_bandwidth=link, ssd_read_bandwidth=ssd,
                               ssd_write_bandwidth=ssd, adam_params_per_s=2e9, host_memory_free=BIG,
                               device_memory_free=BIG, ssd_free=BIG,
                               per_path={"/nvme0": {"read": ssd, "write": ssd}})
    # Paging buffers and the backward working set, as the planner counts them, plus room for some activations.
    fixed = CostModel(hardware, layers).fixed_device_bytes
    budgets = {"device_budget": fixed + (600 << 20), "host_budget": 3 << 30, "store_budget": BIG}
    return hardware, layers, budgets


def timed_search() -> tuple[float, Plan]:
    hardware, layers, budgets = large_model()
    start = time.perf_counter()
    plan = search(hardware, layers, **budgets)
    return time.perf_counter() - start, plan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    runs = [timed_search() for _ in range(args.repeats)]
    seconds = [s for s, _ in runs]
    plan = runs[-1][1]
    median = statistics.median(seconds)
    print(f"plan search, 32 blocks x 40 ops: median {median:.3f} s of {args.repeats} (min {min(seconds):.3f}, "
          f"max {max(seconds):.3f}); {len(plan.curve)} placements tried; predicted iteration "
          f"{plan.predicted_iteration_time:.3f} s; search / iteration = {median / plan.predicted_iteration_time:.2f}")


if __name__ == "__main__":
    main()
