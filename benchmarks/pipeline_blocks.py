"""The plan against all-max clocks in the same processes, interleaved in blocks: what the pipeline benchmarks
(`pipeline_example.py`, `pipeline_engines.py`) share.

After profiling and planning, the ranks alternate blocks of iterations with every instruction at its stage's
maximum clock (`PipelineFrequencyOptimizer.hold_max_clocks`) and blocks with the planned clocks, in ABBA
order so that a drift of the host's load falls on both arms alike; the first step after each switch (clocks
change during it) is dropped. Both arms run the same code and the same measurements.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from zeus_callbacks import PipelineFrequencyOptimizer

ARMS = ("max", "plan")
_WINDOW = "pipeline_benchmark_block"
# One block of one arm on one rank: (each step's time s, the block's time s, the block's energy J)
Block = tuple[list[float], float, float]


def add_block_args(p: argparse.ArgumentParser, *, blocks: int, block_steps: int, example: str) -> None:
    """The benchmarks' options: blocks, their steps, and the `example`'s own options after `--`."""
    p.add_argument("--blocks", type=int, default=blocks, help="blocks per arm")
    p.add_argument("--block-steps", type=int, default=block_steps, help="measured iterations per block")
    p.add_argument("--max-steps", type=int, default=300, help="give up if no plan is applied by then")
    p.add_argument("example_args", nargs=argparse.REMAINDER, help=f"after `--`: options of {example}")


def example_args(args: argparse.Namespace) -> list[str]:
    """The options given after `--`, for the example."""
    return [a for a in args.example_args if a != "--"]


def measure_blocks(
    pfo: PipelineFrequencyOptimizer, step: Callable[[], None], blocks: int, block_steps: int, max_steps: int
) -> dict[str, list[Block]]:
    """Train until the plan is applied (at most `max_steps`), then `blocks` blocks per arm in ABBA order.

    Energy is one counter window per block, divided by its steps: a 100 ms counter cannot measure one step.
    """

    def timed_step() -> float:
        step()
        return float(pfo.metrics()["iteration_time_s"])

    out: dict[str, list[Block]] = {arm: [] for arm in ARMS}
    for _ in range(max_steps):
        step()
        if pfo.phase not in ("waiting", "profiling"):
            break
    if pfo.phase != "applying":
        return out
    for b in range(blocks):
        for arm in ARMS if b % 2 == 0 else ARMS[::-1]:
            pfo.hold_max_clocks(arm == "max")
            step()  # the first step after the switch: clocks change during it
            pfo.monitor.begin_window(_WINDOW)
            times = [timed_step() for _ in range(block_steps)]
            m = pfo.monitor.end_window(_WINDOW)
            out[arm].append((times, m.time, m.total_energy))
    return out


def _spread(values: list[float], digits: int) -> str:
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return f"{p50:.{digits}f} [{p10:.{digits}f}, {p90:.{digits}f}]"


def print_comparison(ranks: list[dict[str, list[Block]]], report: dict[str, Any]) -> None:
    """Per arm, the median and 10th/90th percentiles of the iteration time (the slowest rank's step) and of
    the energy per iteration (every GPU); the ratios of the medians, the paired blocks' ratios, the plan."""
    if report.get("phase") != "applying" or not ranks[0]["plan"]:
        print(f"no plan applied: {report.get('reason', report.get('phase'))}")
        return
    blocks, block_steps = len(ranks[0]["plan"]), len(ranks[0]["plan"][0][0])
    print(
        f"{blocks} blocks per arm x {block_steps} iterations, ABBA order, one switch step dropped per block; "
        f"profiling took {report['profiling_steps']} steps; schedule {report.get('schedule')}"
    )
    for stage, freqs in report["plan_frequencies_mhz"].items():
        print(f"  stage {stage} clocks (MHz): {freqs}")
    per_arm = {}
    for arm in ARMS:
        arms = [r[arm] for r in ranks]
        times = [max(r[b][0][i] for r in arms) for b in range(blocks) for i in range(block_steps)]
        block_time = [max(r[b][1] for r in arms) / block_steps for b in range(blocks)]
        block_energy = [sum(r[b][2] for r in arms) / block_steps for b in range(blocks)]
        per_arm[arm] = (times, block_time, block_energy)
    print(
        f"{'arm':<18}{'iteration time (s): median [p10, p90]':>40}{'energy/iteration (J): median [p10, p90]':>44}"
    )
    for arm, label in zip(ARMS, ("all max clocks", "planned clocks"), strict=True):
        times, _, energy = per_arm[arm]
        print(f"{label:<18}{_spread(times, 4):>40}{_spread(energy, 1):>44}")
    t0, t1 = (statistics.median(per_arm[a][0]) for a in ARMS)
    e0, e1 = (statistics.median(per_arm[a][2]) for a in ARMS)
    print(
        f"ratio of medians: energy {100 * (1 - e1 / e0):+.1f}% saved, iteration time {100 * (t1 / t0 - 1):+.2f}%"
    )
    paired_e = [100 * (1 - p / m) for m, p in zip(per_arm["max"][2], per_arm["plan"][2], strict=True)]
    paired_t = [100 * (p / m - 1) for m, p in zip(per_arm["max"][1], per_arm["plan"][1], strict=True)]
    print(
        f"paired blocks: energy saved median {statistics.median(paired_e):+.1f}% "
        f"[p10 {np.percentile(paired_e, 10):+.1f}%, p90 {np.percentile(paired_e, 90):+.1f}%], "
        f"block time median {statistics.median(paired_t):+.2f}% "
        f"[p10 {np.percentile(paired_t, 10):+.2f}%, p90 {np.percentile(paired_t, 90):+.2f}%]"
    )
    pred = report["predicted"]
    print(
        f"planner's prediction: {pred['max_clock_iteration_time_s']:.4f} s -> {pred['iteration_time_s']:.4f} s, "
        f"energy {pred['energy_saved_pct']:+.1f}% saved (measured all-max median {t0:.4f} s: "
        f"{100 * (pred['max_clock_iteration_time_s'] / t0 - 1):+.2f}%)"
    )
