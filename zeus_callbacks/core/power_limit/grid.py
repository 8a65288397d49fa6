"""The power limits a job profiles: its grid, from the highest down."""

from __future__ import annotations

import math

__all__ = ["power_limit_grid"]


def power_limit_grid(min_w: float, max_w: float, step_w: int) -> list[int]:
    """Power limits from the maximum down by `step_w`, always ending at the minimum."""
    if step_w <= 0:
        raise ValueError(f"pl_step must be positive, got {step_w!r}.")
    hi, lo = int(max_w), int(math.ceil(min_w))
    grid = list(range(hi, lo - 1, -step_w))
    if grid[-1] != lo:
        grid.append(lo)
    return grid
