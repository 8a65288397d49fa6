"""Which power limit to profile next, and which one wins: pure functions over the measurements so far.

Two searches over the grid of power limits (highest first, the minimum always included):
- `sweep`: every limit, as Zeus does.
- `adaptive` (default): uses the shape of the cost curve. A cap above the power the GPU draws at the
  maximum limit barely changes anything, so after the maximum it jumps to the first limit below that
  draw, descends while the cost improves (one valley in most workloads), then checks both neighbours
  of the best limit. Each limit is first profiled for a quarter of `profile_steps`; a limit that is
  already clearly worse than the best (its optimistic cost above the best's pessimistic cost, two
  standard errors each way) stops there, the others are profiled in full.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from zeus_callbacks.core.selectors import OptimumSelector, PowerLimitMeasurement

__all__ = [
    "PowerLimitStats",
    "power_limit_grid",
    "next_power_limit",
    "clearly_worse",
    "best_power_limit",
    "choose_power_limit",
    "SEARCHES",
]

SEARCHES = ("adaptive", "sweep")
_Z = 2.0


@dataclass
class PowerLimitStats:
    """Per-step time and energy sums at one power limit (time maxed and energy summed over ranks)."""

    power_limit_w: int
    steps: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    time_sq: float = 0.0
    energy_sq: float = 0.0
    pruned: bool = False

    @property
    def mean_time_s(self) -> float:
        return self.time_s / self.steps if self.steps else math.nan

    @property
    def mean_energy_j(self) -> float:
        return self.energy_j / self.steps if self.steps else math.nan

    def _rse(self, total: float, sq: float) -> float:
        if self.steps < 2 or total <= 0:
            return math.inf
        mean = total / self.steps
        var = max(0.0, (sq - self.steps * mean * mean) / (self.steps - 1))
        return math.sqrt(var / self.steps) / mean

    @property
    def time_rse(self) -> float:
        """Relative standard error of the mean step time."""
        return self._rse(self.time_s, self.time_sq)

    @property
    def energy_rse(self) -> float:
        """Relative standard error of the mean step energy."""
        return self._rse(self.energy_j, self.energy_sq)

    def measurement(self, steps: int) -> PowerLimitMeasurement:
        """Zeus's view: time and energy of `steps` steps at this limit."""
        return PowerLimitMeasurement(self.power_limit_w, self.mean_energy_j * steps, self.mean_time_s * steps)

    def to_dict(self) -> dict:
        return asdict(self)


def power_limit_grid(min_w: float, max_w: float, step_w: int) -> list[int]:
    """Power limits from the maximum down by `step_w`, always ending at the minimum."""
    if step_w <= 0:
        raise ValueError(f"pl_step must be positive, got {step_w!r}.")
    hi, lo = int(max_w), int(math.ceil(min_w))
    grid = list(range(hi, lo - 1, -step_w))
    if grid[-1] != lo:
        grid.append(lo)
    return grid


def _score(selector: OptimumSelector, t: float, e: float, max_power_w: float, ref_time: float) -> float:
    return float(selector.score(np.array([t]), np.array([e]), max_power_w, ref_time)[0])


def clearly_worse(
    a: PowerLimitStats, b: PowerLimitStats, selector: OptimumSelector, max_power_w: float, ref_time: float
) -> bool:
    """Whether `a`'s cost is above `b`'s even at `a`'s optimistic and `b`'s pessimistic bounds.

    Valid for selectors whose score does not decrease as time or energy grows (all the built-in ones).
    """
    if a.steps < 2:
        return False
    opt = _score(
        selector,
        a.mean_time_s * max(0.0, 1 - _Z * a.time_rse),
        a.mean_energy_j * max(0.0, 1 - _Z * a.energy_rse),
        max_power_w,
        ref_time,
    )
    pes = _score(
        selector,
        b.mean_time_s * (1 + _Z * min(b.time_rse, 1.0)),
        b.mean_energy_j * (1 + _Z * min(b.energy_rse, 1.0)),
        max_power_w,
        ref_time,
    )
    return opt > pes


def best_power_limit(
    stats: dict[int, PowerLimitStats], selector: OptimumSelector, max_power_w: float, ref_time: float
) -> int:
    """The limit with the lowest cost by mean step time and energy (ties go to the higher limit)."""
    valid = [s for s in stats.values() if s.steps > 0 and not s.pruned]
    scores = [
        (_score(selector, s.mean_time_s, s.mean_energy_j, max_power_w, ref_time), -s.power_limit_w)
        for s in valid
    ]
    return -min(scores)[1]


def next_power_limit(
    grid: list[int],
    stats: dict[int, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    num_gpus: int,
    search: str = "adaptive",
) -> int | None:
    """The next power limit to profile, or None when the search is over."""
    if search == "sweep" or not selector.has_score():
        return next((pl for pl in grid if pl not in stats), None)
    top = grid[0]
    if top not in stats:
        return top
    ref = stats[top]
    ref_time = ref.mean_time_s
    if not ref.steps:
        return None
    draw_w = ref.mean_energy_j / ref.mean_time_s / max(1, num_gpus)
    start = next((pl for pl in grid[1:] if pl < draw_w), grid[-1])
    i = grid.index(start)
    # Descend while the cost improves.
    while True:
        pl = grid[i]
        if pl not in stats:
            return pl
        s = stats[pl]
        best = best_power_limit({k: v for k, v in stats.items() if k > pl}, selector, max_power_w, ref_time)
        if s.pruned or _score(selector, s.mean_time_s, s.mean_energy_j, max_power_w, ref_time) > _score(
            selector, stats[best].mean_time_s, stats[best].mean_energy_j, max_power_w, ref_time
        ):
            break
        if i == len(grid) - 1:
            break
        i += 1
    # Both neighbours of the best limit must be known for the valley to be bracketed.
    best = best_power_limit(stats, selector, max_power_w, ref_time)
    j = grid.index(best)
    for k in (j - 1, j + 1):
        if 0 <= k < len(grid) and grid[k] not in stats:
            return grid[k]
    return None


def choose_power_limit(
    stats: dict[int, PowerLimitStats], selector: OptimumSelector, max_power_w: float, steps: int
) -> int:
    """The selector's choice among the fully profiled limits."""
    full = [s.measurement(steps) for s in stats.values() if s.steps > 0 and not s.pruned]
    return selector.select(full, max_power_w)
