"""Which power limit to profile next, how long to measure it, and which one wins: pure functions.

Two searches over the grid of power limits (highest first, the minimum always included):
- `sweep`: every limit for `profile_steps` steps, as Zeus does.
- `adaptive` (default): every limit from the highest down, each measured only as long as it takes to
  tell where it stands. After `min_measured_steps` steps a limit stops as soon as it is clearly worse
  than the best so far (its optimistic cost above the best's pessimistic cost, `_Z` standard errors each
  way) or its own cost is known to within `_PRECISION`; at most `profile_steps` steps.

Why every limit and not a shape-guided jump (below the power drawn at the maximum limit, descend while
the cost improves): measured curves are not smooth. Where the GPU never reaches the cap (small batches,
movielens-1m/ncf) the curve is flat and its wiggles are as large as the differences between limits, and
single-epoch measurements jump by several percent at one limit; a search that skips limits on the
strength of a model of the curve missed the best one in about one run in ten on the shipped traces, and
cutting the descent short once lower limits kept getting worse cost more accuracy than it saved steps.
Measuring each limit briefly does not miss; most limits are clearly worse, or known well enough, after a
few steps, which is what makes the search cheap.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from zeus_callbacks.core.selectors import OptimumSelector, PowerLimitMeasurement

__all__ = [
    "PowerLimitStats",
    "power_limit_grid",
    "min_measured_steps",
    "next_power_limit",
    "measurement_verdict",
    "clearly_worse",
    "best_power_limit",
    "choose_power_limit",
    "SEARCHES",
]

SEARCHES = ("adaptive", "sweep")
# Standard errors either way before a limit counts as clearly worse than the best.
_Z = 2.0
# A limit is measured enough when its cost's confidence half-width (`_Z` standard errors, time and
# energy errors added as if fully correlated) is below this fraction of the cost. Tuned with
# benchmarks/power_limit_search.py: 1% costs a third more steps for no gain in accuracy there.
_PRECISION = 0.0125


@dataclass
class PowerLimitStats:
    """Per-step time and energy sums at one power limit (each step: time maxed, energy summed over ranks)."""

    power_limit_w: int
    steps: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    time_sq: float = 0.0
    energy_sq: float = 0.0
    pruned: bool = False

    @property
    def mean_time_s(self) -> float:
        """Mean step time (s)."""
        return self.time_s / self.steps if self.steps else math.nan

    @property
    def mean_energy_j(self) -> float:
        """Mean step energy (J, all GPUs of the job)."""
        return self.energy_j / self.steps if self.steps else math.nan

    def add(self, time_s: float, energy_j: float) -> None:
        """Add one step's measurement."""
        self.steps += 1
        self.time_s += time_s
        self.time_sq += time_s * time_s
        self.energy_j += energy_j
        self.energy_sq += energy_j * energy_j

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
        """Plain numbers, for checkpoints and profile files."""
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


def min_measured_steps(profile_steps: int) -> int:
    """Steps every limit of the adaptive search is measured before it may stop."""
    return min(profile_steps, max(3, -(-profile_steps // 8)))


def _score(selector: OptimumSelector, t: float, e: float, max_power_w: float, ref_time: float) -> float:
    return float(selector.score(np.array([t]), np.array([e]), max_power_w, ref_time)[0])


def _bounds(
    s: PowerLimitStats, selector: OptimumSelector, max_power_w: float, ref: PowerLimitStats
) -> tuple[float, float, float]:
    """(optimistic, mean, pessimistic) cost of `s`; the reference time's own error counts too."""
    rt, re_ = min(s.time_rse, 1.0), min(s.energy_rse, 1.0)
    rr = min(ref.time_rse, 1.0) if ref is not s else 0.0
    t, e, r = s.mean_time_s, s.mean_energy_j, ref.mean_time_s
    # A longer reference time loosens a slowdown bound, so it is the optimistic one.
    opt = _score(
        selector, t * max(0.0, 1 - _Z * rt), e * max(0.0, 1 - _Z * re_), max_power_w, r * (1 + _Z * rr)
    )
    mean = _score(selector, t, e, max_power_w, r)
    pes = _score(selector, t * (1 + _Z * rt), e * (1 + _Z * re_), max_power_w, r * max(0.0, 1 - _Z * rr))
    return opt, mean, pes


def clearly_worse(
    a: PowerLimitStats,
    b: PowerLimitStats,
    selector: OptimumSelector,
    max_power_w: float,
    ref: PowerLimitStats | float,
) -> bool:
    """Whether `a`'s cost is above `b`'s even at `a`'s optimistic and `b`'s pessimistic bounds.

    `ref` is the reference point (the maximum limit), or just its mean step time. Valid for selectors
    whose score does not decrease as time or energy grows (all the built-in ones).
    """
    if a.steps < 2 or b.steps < 1:
        return False
    if not isinstance(ref, PowerLimitStats):
        ref = PowerLimitStats(-1, 1, float(ref), 0.0, float(ref) ** 2, 0.0)
    opt_a = _bounds(a, selector, max_power_w, ref)[0]
    pes_b = _bounds(b, selector, max_power_w, ref)[2]
    return opt_a > pes_b


def _valid(stats: dict[int, PowerLimitStats]) -> list[PowerLimitStats]:
    return [s for s in stats.values() if s.steps > 0 and not s.pruned]


def best_power_limit(
    stats: dict[int, PowerLimitStats], selector: OptimumSelector, max_power_w: float, ref_time: float
) -> int | None:
    """The limit with the lowest mean cost among the measured ones (ties go to the higher limit)."""
    scores = [
        (_score(selector, s.mean_time_s, s.mean_energy_j, max_power_w, ref_time), -s.power_limit_w)
        for s in _valid(stats)
    ]
    return -min(scores)[1] if scores else None


def measurement_verdict(
    current: PowerLimitStats,
    stats: dict[int, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    reference: PowerLimitStats,
    min_steps: int,
    max_steps: int,
) -> str:
    """Whether the adaptive search keeps measuring `current`: `more`, `pruned` (clearly worse than the
    best so far) or `measured` (its cost known well enough, or `max_steps` reached)."""
    if current.steps < min_steps:
        return "more"
    ref = current if reference is None or not reference.steps else reference
    best = best_power_limit(
        {k: v for k, v in stats.items() if k != current.power_limit_w}, selector, max_power_w, ref.mean_time_s
    )
    if best is not None and clearly_worse(current, stats[best], selector, max_power_w, ref):
        return "pruned"
    if current.steps >= max_steps:
        return "measured"
    opt, mean, pes = _bounds(current, selector, max_power_w, ref)
    if not (math.isfinite(pes) and mean > 0):
        return "more"
    if pes - opt <= 2 * _PRECISION * mean:
        return "measured"
    return "more"


def next_power_limit(
    grid: list[int],
    stats: dict[int, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    num_gpus: int = 1,
    search: str = "adaptive",
) -> int | None:
    """The next power limit to profile (the highest not yet profiled), or None when the search is over.

    Both searches visit every limit; they differ in how long each is measured (`measurement_verdict`).
    """
    return next((pl for pl in grid if pl not in stats), None)


def choose_power_limit(
    stats: dict[int, PowerLimitStats], selector: OptimumSelector, max_power_w: float, steps: int
) -> int:
    """The selector's choice among the measured limits that were not pruned."""
    full = [s.measurement(steps) for s in _valid(stats)]
    if not full:
        raise ValueError("No power limit has a valid measurement to choose from.")
    return selector.select(full, max_power_w)
