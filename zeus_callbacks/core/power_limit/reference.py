"""The reference limit: the grid's first (`grid[0]`), every other limit's slowdown and saving is judged
against it. How often the search may visit it to get a valid measurement, and what the choice saves and
costs against it (`saving`).

A slowdown bound without its reference is no bound: judged against whatever limit is left when the
reference's samples were set aside (as burst-ridden), `MaxSlowdownConstraint(1.1)` once chose a limit 22%
slower than the reference. So the reference is measured until it has valid samples, within the search's
budget or beyond it (`REFERENCE_VISITS` visits at most), and a selector that `needs_reference` does not
decide without it: the job then keeps the reference limit.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from zeus_callbacks.core.power_limit.costs import Z, needs_reference, valid
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats, pooled_noise, rses
from zeus_callbacks.core.power_limit.selectors import OptimumSelector

__all__ = ["REFERENCE_VISITS", "reference_lost", "kept_reference", "saving"]

logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")  # the optimizer's decisions

# Visits of the reference after which its samples are no longer set aside and it is not measured again:
# whatever the budget, each visit costs a settling and `min_measured_steps` samples (more while a burst it
# began in lasts, `bursts.BURST_STEPS` steps at most). Two more than other limits get (`bursts.MAX_VISITS`).
REFERENCE_VISITS = 5


def reference_lost(stats: dict[float, PowerLimitStats], grid: list[float]) -> bool:
    """Whether the reference was visited and has no valid sample (every one set aside, or none read)."""
    ref = stats.get(grid[0]) if grid else None
    return ref is not None and not ref.steps


def kept_reference(
    stats: dict[float, PowerLimitStats], grid: list[float], selector: OptimumSelector, max_power_w: float
) -> float | None:
    """The reference limit, kept as the choice (and logged), when it has no valid measurement, the selector
    `needs_reference` and other limits were measured; None otherwise (the selector chooses)."""
    ref = stats.get(grid[0])
    if (ref is not None and ref.steps) or not valid(stats) or not needs_reference(selector, max_power_w):
        return None
    logger.warning(
        "GlobalPowerLimitOptimizer: the reference limit %d W has no valid measurement (%d visits, every sample "
        "set aside as slowed by a burst, or none read); %r judges every other limit against it, so %d W is "
        "kept rather than a limit judged against another.",
        grid[0],
        ref.visits if ref is not None else 0,
        selector,
        grid[0],
    )
    return grid[0]


def saving(
    stats: dict[float, PowerLimitStats], grid: list[float], power_limit_w: float | None
) -> dict[str, Any]:
    """What `power_limit_w` saves and costs against the reference, by the measurements, with margins of
    `Z` standard errors of each ratio (the two limits' errors, the pooled noise as a floor: `rses`).

    `time_lost_pct` is never negative: a lower limit never makes steps faster, so a measured speed-up is
    noise (or a wiggle of a trace) and the slowdown's best estimate is none; the measured figure is
    `time_lost_measured_pct`. Only `reference_power_limit_w` when either limit has no valid measurement, or
    the reference's measured no energy.
    """
    if not grid:
        return {}
    out: dict[str, Any] = {"reference_power_limit_w": grid[0]}
    ref, best = stats.get(grid[0]), stats.get(power_limit_w if power_limit_w is not None else -1)
    if ref is None or not ref.steps or best is None or not best.steps:
        return out
    if not (ref.mean_time_s > 0 and ref.mean_energy_j > 0):
        # e.g. `search="sweep"` windows shorter than the energy counter's refresh read 0 J: no ratio to give
        return out
    if best is ref:
        return {**out, **dict.fromkeys(_FIGURES, 0.0)}
    noise = pooled_noise(stats)
    (rt_ref, re_ref), (rt_best, re_best) = rses(ref, noise), rses(best, noise)
    time_ratio = best.mean_time_s / ref.mean_time_s
    energy_ratio = best.mean_energy_j / ref.mean_energy_j
    measured = 100 * (time_ratio - 1)
    return {
        **out,
        "energy_saved_pct": 100 * (1 - energy_ratio),
        "energy_saved_margin_pct": 100 * Z * energy_ratio * math.hypot(re_ref, re_best),
        "time_lost_pct": max(0.0, measured),
        "time_lost_measured_pct": measured,
        "time_lost_margin_pct": 100 * Z * time_ratio * math.hypot(rt_ref, rt_best),
    }


_FIGURES = (
    "energy_saved_pct",
    "energy_saved_margin_pct",
    "time_lost_pct",
    "time_lost_measured_pct",
    "time_lost_margin_pct",
)
