"""What the chosen power limit saves and costs against the reference, in words: the one sentence the demo,
the examples and the HTML report print (from `GlobalPowerLimitOptimizer.report()`'s figures)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["saving_text"]


def saving_text(figures: Mapping[str, Any]) -> str:
    """`15.5% ± 1.2% less energy and 2.0% ± 0.8% more time per step than at 300 W`.

    The time lost is never negative: a lower limit never makes steps faster, so a measured speed-up is
    noise, said as what was measured beside no more time: `... and no more time per step than at 300 W
    (measured 0.6% ± 0.9% faster)`. Margins are the report's (`Z` standard errors). Reads
    `reference_power_limit_w`, `energy_saved_pct`, `time_lost_pct` and, where the report has them,
    `energy_saved_margin_pct`, `time_lost_measured_pct` and `time_lost_margin_pct` (a record written before
    them holds the measured slowdown in `time_lost_pct`).
    """
    ref = figures.get("reference_power_limit_w")
    against = f"than at {ref} W" if ref is not None else "than at the reference limit"
    saved, lost = _number(figures.get("energy_saved_pct")), _number(figures.get("time_lost_pct"))
    if saved is None or lost is None:
        return f"no saving figure: the reference limit{f' ({ref} W)' if ref else ''} has no valid measurement"
    measured = _number(figures.get("time_lost_measured_pct"))
    measured = lost if measured is None else measured
    margin = _margin(figures.get("energy_saved_margin_pct"))
    energy = f"{abs(saved):.1f}%{margin} {'less' if saved >= 0 else 'more'} energy"
    margin = _margin(figures.get("time_lost_margin_pct"))
    if measured >= 0:
        return f"{energy} and {measured:.1f}%{margin} more time per step {against}"
    return f"{energy} and no more time per step {against} (measured {-measured:.1f}%{margin} faster)"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _margin(value: Any) -> str:
    margin = _number(value)
    return f" ± {margin:.1f}%" if margin else ""
