"""The power limits a job profiles: its grid, from the highest down, in watts exact to the milliwatt."""

from __future__ import annotations

import os

from zeus_callbacks.core.device.errors import InvalidInputError

__all__ = ["power_limit_grid", "watts", "milliwatts", "raising_allowed", "ALLOW_RAISING_ENV"]

ALLOW_RAISING_ENV = "ZEUS_CALLBACKS_ALLOW_RAISING_POWER_LIMIT"
"""Set to 1 to let power limits above the one in force when the job started be profiled (as Zeus does)."""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def watts(mw: int) -> float:
    """`mw` milliwatts in watts: an `int` when whole (most boards: `300`), else a `float` (`137.5`)."""
    whole, rest = divmod(int(mw), 1000)
    return whole if rest == 0 else mw / 1000


def milliwatts(w: float) -> int:
    """`w` watts in NVML's unit, exactly (`137.5` -> `137500`; never `int(w * 1000)`, which floors 1.001 W
    to 1000 mW)."""
    return round(w * 1000)


def power_limit_grid(min_w: float, max_w: float, step_w: int) -> list[float]:
    """Power limits from `max_w` down by `step_w`, always ending at `min_w`; both ends as given, to the
    milliwatt (a board's range need not be whole watts: 137.5-575.5 W gives `[575.5, 550.5, ..., 150.5,
    137.5]`).

    A point above the minimum by less than half a step is left out, so that no two limits are closer than
    half a step (a 200-310 W range by 25 W: `[310, 285, 260, 235, 200]`, not `..., 210, 200`): measuring two
    nearly equal limits costs a visit and tells little. A range narrower than a step holds its two ends.
    """
    if step_w <= 0:
        raise ValueError(f"pl_step must be positive, got {step_w!r}.")
    hi, lo, step = milliwatts(max_w), milliwatts(min_w), int(round(step_w * 1000))
    if lo > hi:
        raise ValueError(f"The power-limit range {min_w:g}-{max_w:g} W is empty.")
    grid = list(range(hi, lo, -step))
    if len(grid) > 1 and grid[-1] - lo < step / 2:
        grid.pop()
    grid.append(lo)
    return [watts(mw) for mw in grid]


def raising_allowed() -> bool:
    """`ALLOW_RAISING_ENV` as a flag (unset: False).

    Raises:
        InvalidInputError: a value that is not a yes or a no.
    """
    text = os.environ.get(ALLOW_RAISING_ENV, "").strip().lower()
    if text not in _TRUE + _FALSE:
        raise InvalidInputError(
            f"{ALLOW_RAISING_ENV}={os.environ[ALLOW_RAISING_ENV]!r} is neither 1 nor 0: set it to 1 to let the "
            "power-limit search go above the limit in force when the job started, or unset it."
        )
    return text in _TRUE
