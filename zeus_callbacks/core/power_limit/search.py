"""Which power limit to profile next, how long to measure it, and which one wins: pure functions.

Searches over the grid of power limits (highest first, the minimum always included):
- `sweep`: every limit for `profile_steps` steps, as Zeus does.
- `zeus`: the sweep, and the optimizer also lets an epoch's end interrupt a limit as Zeus does.
- `adaptive` (default): two passes. The first visits every limit from the highest down; after
  `min_measured_steps` steps a limit stops as soon as it is clearly worse than the best so far (its
  optimistic cost above the best's pessimistic cost, `_Z` standard errors each way) or is not one of the
  `contenders` (it cannot beat the best by more than `_TOLERANCE`); a contender goes on until its cost
  is known to within `_PRECISION`. The refinement pass then revisits the final contenders, fewest steps
  first, each until it is no longer one or has `profile_steps` steps, while the budget
  (`adaptive_budget_steps`, warm-ups included) lasts. Standard errors use the noise pooled over every
  limit (`pooled_noise`) as a floor, since a handful of similar steps says little about the noise.

Why a refinement pass: the misses of a single pass were near-ties, two limits within 1-2% of each
other, one measured for a few steps as the best so far and the other, met later, measured against it;
only more steps of both settle them, and which limits tie is known only once every limit was seen.
Its budget is three quarters of a sweep for one run, so that a flat curve with several near-ties can be
settled; over the shipped traces the search averages under half a sweep's steps (the benchmark).

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

from zeus_callbacks.core.power_limit.selectors import (
    OptimumSelector,
    PowerLimitMeasurement,
    select_power_limit,
)

__all__ = [
    "PowerLimitStats",
    "power_limit_grid",
    "min_measured_steps",
    "adaptive_budget_steps",
    "spent_steps",
    "pooled_noise",
    "contenders",
    "next_power_limit",
    "measurement_verdict",
    "clearly_worse",
    "best_power_limit",
    "choose_power_limit",
    "SEARCHES",
]

SEARCHES = ("adaptive", "sweep", "zeus")
# Standard errors either way before a limit counts as clearly worse than the best.
_Z = 2.0
# A limit is measured enough when its cost's confidence half-width (`_Z` standard errors, time and
# energy errors added as if fully correlated) is below this fraction of the cost. Tuned with
# benchmarks/power_limit_search.py: 1% costs a third more steps for no gain in accuracy there.
_PRECISION = 0.0125
# Two limits whose costs are within this fraction of each other are equally good choices.
_TOLERANCE = 0.01
# Standard errors each way (each limit's own, so about 1.4 times as many of their difference) within
# which a rival might still beat the best by more than `_TOLERANCE`, and is measured again.
_Z_CHOICE = 1.75


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
    visits: int = 1  # times the search set this limit and warmed it up (the refinement pass revisits)

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

    def _rel_var(self, total: float, sq: float) -> float:
        """Sample variance of one step's value relative to the mean squared (inf below 2 steps)."""
        if self.steps < 2 or total <= 0:
            return math.inf
        mean = total / self.steps
        return max(0.0, (sq - self.steps * mean * mean) / (self.steps - 1)) / (mean * mean)

    def _rse(self, total: float, sq: float) -> float:
        return math.sqrt(self._rel_var(total, sq) / self.steps) if self.steps else math.inf

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


def adaptive_budget_steps(num_limits: int, warmup_steps: int, profile_steps: int) -> int:
    """Steps (warm-up included) past which the adaptive search does not refine: 3/4 of a sweep's."""
    return num_limits * (warmup_steps + profile_steps) * 3 // 4


def spent_steps(stats: dict[int, PowerLimitStats], warmup_steps: int) -> int:
    """Steps the search has spent on `stats` so far: each visit's warm-up and every measured step."""
    return sum(s.steps + warmup_steps * s.visits for s in stats.values())


def pooled_noise(stats: dict[int, PowerLimitStats]) -> tuple[float, float]:
    """Relative per-step variance of time and of energy, pooled over every limit with 2 steps or more.

    The noise of a step is a property of the job rather than of the limit, so the pool, with many more
    degrees of freedom than one limit's few steps, keeps a lucky run of similar steps from passing for
    precision. (0, 0) before any limit has 2 steps.
    """
    dof = sum(s.steps - 1 for s in stats.values() if s.steps >= 2)
    if not dof:
        return 0.0, 0.0
    time_var = sum((s.steps - 1) * s._rel_var(s.time_s, s.time_sq) for s in stats.values() if s.steps >= 2)
    energy_var = sum(
        (s.steps - 1) * s._rel_var(s.energy_j, s.energy_sq) for s in stats.values() if s.steps >= 2
    )
    return time_var / dof, energy_var / dof


def _rses(s: PowerLimitStats, noise: tuple[float, float]) -> tuple[float, float]:
    """Relative standard errors of `s`'s mean time and energy, never below the pooled noise's."""
    if s.steps < 2:
        return math.inf, math.inf
    time_var = max(s._rel_var(s.time_s, s.time_sq), noise[0])
    energy_var = max(s._rel_var(s.energy_j, s.energy_sq), noise[1])
    return math.sqrt(time_var / s.steps), math.sqrt(energy_var / s.steps)


def _score(selector: OptimumSelector, t: float, e: float, max_power_w: float, ref_time: float) -> float:
    return float(selector.score(np.array([t]), np.array([e]), max_power_w, ref_time)[0])


def _bounds(
    s: PowerLimitStats,
    selector: OptimumSelector,
    max_power_w: float,
    ref: PowerLimitStats,
    noise: tuple[float, float] = (0.0, 0.0),
    z: float = _Z,
) -> tuple[float, float, float]:
    """(optimistic, mean, pessimistic) cost of `s`, `z` standard errors each way; the reference time's
    own error counts too."""
    rt, re_ = (min(x, 1.0) for x in _rses(s, noise))
    rr = min(_rses(ref, noise)[0], 1.0) if ref is not s else 0.0
    t, e, r = s.mean_time_s, s.mean_energy_j, ref.mean_time_s
    # A longer reference time loosens a slowdown bound, so it is the optimistic one.
    opt = _score(selector, t * max(0.0, 1 - z * rt), e * max(0.0, 1 - z * re_), max_power_w, r * (1 + z * rr))
    mean = _score(selector, t, e, max_power_w, r)
    pes = _score(selector, t * (1 + z * rt), e * (1 + z * re_), max_power_w, r * max(0.0, 1 - z * rr))
    return opt, mean, pes


def _as_reference(ref: PowerLimitStats | float) -> PowerLimitStats:
    if isinstance(ref, PowerLimitStats):
        return ref
    return PowerLimitStats(-1, 1, float(ref), 0.0, float(ref) ** 2, 0.0)


def clearly_worse(
    a: PowerLimitStats,
    b: PowerLimitStats,
    selector: OptimumSelector,
    max_power_w: float,
    ref: PowerLimitStats | float,
    noise: tuple[float, float] = (0.0, 0.0),
) -> bool:
    """Whether `a`'s cost is above `b`'s even at `a`'s optimistic and `b`'s pessimistic bounds.

    `ref` is the reference point (the maximum limit), or just its mean step time; `noise` the pooled
    per-step variances (`pooled_noise`), a floor under each limit's own. Valid for selectors whose score
    does not decrease as time or energy grows (all the built-in ones).
    """
    if a.steps < 2 or b.steps < 1:
        return False
    ref = _as_reference(ref)
    opt_a = _bounds(a, selector, max_power_w, ref, noise)[0]
    pes_b = _bounds(b, selector, max_power_w, ref, noise)[2]
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


def contenders(
    stats: dict[int, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    ref: PowerLimitStats,
    noise: tuple[float, float],
) -> list[int]:
    """The limits the choice is still unsure between: the best by mean cost, and every limit whose cost
    might be more than `_TOLERANCE` below the best's (optimistic bound, `_Z_CHOICE` standard errors, more
    than the tolerance under the best's pessimistic one). Empty when the best is settled."""
    best = best_power_limit(stats, selector, max_power_w, ref.mean_time_s)
    if best is None:
        return []
    pes_best = _bounds(stats[best], selector, max_power_w, ref, noise, _Z_CHOICE)[2]
    rivals = [
        s.power_limit_w
        for s in _valid(stats)
        if s.power_limit_w != best
        and _bounds(s, selector, max_power_w, ref, noise, _Z_CHOICE)[0] * (1 + _TOLERANCE) < pes_best
    ]
    if not rivals:
        return []
    out = [best, *rivals]
    # Where the reference time decides a contender's cost (a slowdown bound), the reference is one too.
    rr = _Z_CHOICE * min(_rses(ref, noise)[0], 1.0)
    r = ref.mean_time_s
    if ref.power_limit_w not in out and any(
        _score(selector, stats[pl].mean_time_s, stats[pl].mean_energy_j, max_power_w, r * (1 + rr))
        != _score(selector, stats[pl].mean_time_s, stats[pl].mean_energy_j, max_power_w, r * max(0.0, 1 - rr))
        for pl in out
    ):
        out.append(ref.power_limit_w)
    return out


def measurement_verdict(
    current: PowerLimitStats,
    stats: dict[int, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    reference: PowerLimitStats,
    min_steps: int,
    max_steps: int,
    budget_left_steps: float = math.inf,
) -> str:
    """Whether the adaptive search keeps measuring `current`: `more`, `pruned` (clearly worse than the
    best so far) or `measured` (its cost known well enough, or `max_steps` reached).

    On a revisit (`current.visits > 1`, the refinement pass) `current` is measured while it is one of
    the `contenders`, up to `max_steps` steps in all and `budget_left_steps` more.
    """
    revisit = current.visits > 1
    if current.steps < min_steps and not revisit:
        return "more"
    same = reference is None or not reference.steps or reference.power_limit_w == current.power_limit_w
    ref = current if same else reference
    others = {k: v for k, v in stats.items() if k != current.power_limit_w}
    noise = pooled_noise({**others, current.power_limit_w: current})
    best = best_power_limit(others, selector, max_power_w, ref.mean_time_s)
    # A revisit is for the choice's sake (or the reference's): it ends when that is settled.
    if (
        not revisit
        and best is not None
        and clearly_worse(current, stats[best], selector, max_power_w, ref, noise)
    ):
        return "pruned"
    if current.steps >= max_steps or budget_left_steps <= 0:
        return "measured"
    measured = {**others, current.power_limit_w: current}
    if current.power_limit_w not in contenders(measured, selector, max_power_w, ref, noise):
        return "measured"
    if revisit:
        return "more"
    # A contender of the best so far: known to within `_PRECISION` on the first pass, as the choice
    # may still fall elsewhere; the refinement pass measures the final contenders further.
    opt, mean, pes = _bounds(current, selector, max_power_w, ref, noise)
    if math.isfinite(pes) and mean > 0 and pes - opt <= 2 * _PRECISION * mean:
        return "measured"
    return "more"


def next_power_limit(
    grid: list[int],
    stats: dict[int, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    num_gpus: int = 1,
    search: str = "adaptive",
    warmup_steps: int = 0,
    profile_steps: int = 40,
    spent_before: int = 0,
) -> int | None:
    """The next power limit to profile, or None when the search is over.

    Every search first visits every limit, highest first; they differ in how long each is measured
    (`measurement_verdict`). The adaptive search then refines: while the `contenders` are unsettled
    and the budget (`adaptive_budget_steps`) allows a warm-up and `min_measured_steps` more, it revisits
    the contender with the fewest steps among those below `profile_steps`. `spent_before` steps of
    `stats` do not count against the budget (a saved profile reused for another selector).
    """
    unvisited = next((pl for pl in grid if pl not in stats), None)
    if unvisited is not None or search != "adaptive" or not selector.has_score() or not stats:
        return unvisited
    budget = adaptive_budget_steps(len(grid), warmup_steps, profile_steps)
    spent = spent_steps(stats, warmup_steps) - spent_before
    if spent + warmup_steps + min_measured_steps(profile_steps) > budget:
        return None
    ref = stats.get(grid[0])
    if ref is None or not ref.steps:
        return None
    noise = pooled_noise(stats)
    unsettled = [
        stats[pl]
        for pl in contenders(stats, selector, max_power_w, ref, noise)
        if stats[pl].steps < profile_steps
    ]
    if not unsettled:
        return None
    return min(unsettled, key=lambda s: (s.steps, -s.power_limit_w)).power_limit_w


def choose_power_limit(
    stats: dict[int, PowerLimitStats], selector: OptimumSelector, max_power_w: float, steps: int
) -> int:
    """The selector's choice among the measured limits that were not pruned (highest limit first, as
    Zeus lists them; a Zeus-style `select(measurements)` gets only the measurements)."""
    full = [s.measurement(steps) for s in sorted(_valid(stats), key=lambda s: -s.power_limit_w)]
    if not full:
        raise ValueError("No power limit has a valid measurement to choose from.")
    return select_power_limit(selector, full, max_power_w)
