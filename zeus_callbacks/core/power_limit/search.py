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
Its budget is three quarters of a sweep for one run (in steps: a sweep of samples that each span a refresh of the
energy counter), enough to settle a flat curve with several near-ties (the benchmark).

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
from dataclasses import asdict, dataclass, field

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
    "chunk_steps",
    "robust_chunks",
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
# A chunk whose per-step time is this many robust standard deviations (median absolute deviations x
# 1.4826) from the median of its limit's chunks, and at least `_OUTLIER_FLOOR` of it, is set aside.
_OUTLIER_MADS = 4.0
_OUTLIER_FLOOR = 0.03


@dataclass
class PowerLimitStats:
    """Measurements at one power limit, in samples: contiguous chunks of whole steps (each step's time
    maxed and its energy summed over ranks).

    A chunk spans enough refreshes of the energy counter to be read (`refresh_s`, the slowest rank's
    period; one step when the counter is always current). Its energy carries the counter's rounding at
    either end (up to one refresh's energy each), which cancels between consecutive chunks of one visit;
    the noise model (`rses`) counts it once per unbroken run of chunks, not once per chunk. `chunks`
    keeps every chunk as `[steps, time_s, energy_j]`; the sums are over the chunks kept by
    `robust_chunks` (a stalled or burst chunk is set aside). `time_sq`/`energy_sq` are the chunks'
    per-step means squared, weighted by their steps (for one-step chunks: the sum of squared steps).
    """

    power_limit_w: int
    steps: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    time_sq: float = 0.0
    energy_sq: float = 0.0
    pruned: bool = False
    visits: int = 1  # times the search set this limit and warmed it up (the refinement pass revisits)
    samples: int = -1  # chunks kept (-1: one per step, as in profiles without chunks)
    refresh_s: float = 0.0  # the energy counter's refresh period when it was measured (0: always current)
    chunks: list[list[float]] = field(default_factory=list)
    dropped_steps: int = 0  # steps of chunks set aside as stalls or bursts

    def __post_init__(self) -> None:
        if self.samples < 0:
            self.samples = self.steps

    @property
    def mean_time_s(self) -> float:
        """Mean step time (s)."""
        return self.time_s / self.steps if self.steps else math.nan

    @property
    def mean_energy_j(self) -> float:
        """Mean step energy (J, all GPUs of the job)."""
        return self.energy_j / self.steps if self.steps else math.nan

    @property
    def spent_steps(self) -> int:
        """Every measured step, kept or set aside (warm-ups not included)."""
        return self.steps + self.dropped_steps

    def add(self, time_s: float, energy_j: float, steps: int = 1) -> None:
        """Add one sample: a chunk of `steps` contiguous steps that took `time_s` and `energy_j` in all."""
        self.chunks.append([int(steps), float(time_s), float(energy_j)])
        kept = robust_chunks(self.chunks)
        self.steps = sum(int(c[0]) for c in kept)
        self.dropped_steps = sum(int(c[0]) for c in self.chunks) - self.steps
        self.samples = len(kept)
        self.time_s = sum(c[1] for c in kept)
        self.energy_j = sum(c[2] for c in kept)
        self.time_sq = sum(c[1] * c[1] / c[0] for c in kept)
        self.energy_sq = sum(c[2] * c[2] / c[0] for c in kept)

    @property
    def breaks(self) -> int:
        """Unbroken runs of chunks: each visit is one, and each chunk set aside splits one."""
        return self.visits + len(self.chunks) - self.samples if self.chunks else self.visits

    def _rel_var(self, total: float, sq: float) -> float:
        """Variance of one step's value relative to the mean squared, from the samples' spread (each
        chunk's mean weighted by its steps); inf below 2 samples."""
        if self.samples < 2 or total <= 0:
            return math.inf
        mean = total / self.steps
        return max(0.0, (sq - self.steps * mean * mean) / (self.samples - 1)) / (mean * mean)

    def rel_vars(self) -> tuple[float, float]:
        """Relative per-step variances of time and energy, the counter's rounding taken out of the
        energy's.

        A chunk of time T read off a counter refreshed every p rounds by up to p of power at either
        end, so its per-step mean carries a relative variance p^2 / (6 T^2) of rounding. Where that is
        most of the chunks' spread, what is left cannot be told apart from it; energy (power x time)
        is then taken to vary per step as much as time does and as much again (power's own variation).
        """
        time_var = self._rel_var(self.time_s, self.time_sq)
        energy_var = self._rel_var(self.energy_j, self.energy_sq)
        if self.refresh_s > 0 and self.chunks and math.isfinite(energy_var):
            kept = robust_chunks(self.chunks)
            rounding = sum(c[0] * self.refresh_s**2 / (6 * c[1] ** 2) for c in kept if c[1] > 0) / len(kept)
            energy_var = max(time_var, energy_var - rounding) if rounding <= energy_var / 2 else 2 * time_var
        return time_var, energy_var

    def rounding_rel_var(self) -> float:
        """Relative variance of the mean energy due to the counter's rounding (once per unbroken run)."""
        if self.refresh_s <= 0 or self.time_s <= 0:
            return 0.0
        return self.breaks * self.refresh_s**2 / (6 * self.time_s**2)

    def _rse(self, total: float, sq: float) -> float:
        return math.sqrt(self._rel_var(total, sq) / self.steps) if self.steps else math.inf

    @property
    def time_rse(self) -> float:
        """Relative standard error of the mean step time."""
        return self._rse(self.time_s, self.time_sq)

    @property
    def energy_rse(self) -> float:
        """Relative standard error of the mean step energy (the counter's rounding included)."""
        if not self.steps:
            return math.inf
        return math.sqrt(self.rel_vars()[1] / self.steps + self.rounding_rel_var())

    def measurement(self, steps: int) -> PowerLimitMeasurement:
        """Zeus's view: time and energy of `steps` steps at this limit."""
        return PowerLimitMeasurement(self.power_limit_w, self.mean_energy_j * steps, self.mean_time_s * steps)

    def to_dict(self) -> dict:
        """Plain numbers, for checkpoints and profile files."""
        return asdict(self)


def robust_chunks(chunks: list[list[float]]) -> list[list[float]]:
    """The chunks whose per-step time is within `_OUTLIER_MADS` robust standard deviations (at least
    `_OUTLIER_FLOOR` of the median) of the median: a data-loader stall, an evaluation or another job
    sharing the GPU makes a chunk far slower than the limit makes it; all of them from 3 chunks down."""
    if len(chunks) < 3:
        return list(chunks)
    per_step = np.array([c[1] / c[0] for c in chunks])
    med = float(np.median(per_step))
    spread = max(_OUTLIER_MADS * 1.4826 * float(np.median(np.abs(per_step - med))), _OUTLIER_FLOOR * med)
    return [c for c, x in zip(chunks, per_step, strict=True) if abs(x - med) <= spread]


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
    """Samples every limit of the adaptive search is measured before it may stop (3 at least, so that
    a stalled one can be told from the others)."""
    return min(profile_steps, max(3, -(-profile_steps // 8)))


def adaptive_budget_steps(
    num_limits: int, warmup_steps: int, profile_steps: int, per_sample: float = 1.0
) -> int:
    """Steps (warm-up included) past which the adaptive search does not refine: 3/4 of a sweep's, a
    sweep measuring `profile_steps` samples of `per_sample` steps (`chunk_steps`) at each limit."""
    return int(num_limits * (warmup_steps + profile_steps * max(1.0, per_sample)) * 3 // 4)


def chunk_steps(stats: dict[int, PowerLimitStats]) -> float:
    """Steps a limit's sample is worth: 1 where steps last at least the energy counter's refresh
    period, else the period over the mean step time, so that a limit is measured for as long (in time)
    with short steps as with long ones."""
    measured = [s for s in stats.values() if s.steps]
    if not measured:
        return 1.0
    refresh = max(s.refresh_s for s in measured)
    mean_time = sum(s.time_s for s in measured) / sum(s.steps for s in measured)
    return max(1.0, refresh / mean_time) if mean_time > 0 else 1.0


def spent_steps(stats: dict[int, PowerLimitStats], warmup_steps: int) -> int:
    """Steps the search has spent on `stats` so far: each visit's warm-up and every measured step."""
    return sum(s.spent_steps + warmup_steps * s.visits for s in stats.values())


def pooled_noise(stats: dict[int, PowerLimitStats]) -> tuple[float, float]:
    """Relative per-step variance of time and of energy, pooled over every limit with 2 steps or more.

    The noise of a step is a property of the job rather than of the limit, so the pool, with many more
    degrees of freedom than one limit's few steps, keeps a lucky run of similar steps from passing for
    precision. (0, 0) before any limit has 2 steps.
    """
    some = [s for s in stats.values() if s.samples >= 2]
    dof = sum(s.samples - 1 for s in some)
    if not dof:
        return 0.0, 0.0
    rel = [(s.samples - 1, s.rel_vars()) for s in some]
    return sum(n * v[0] for n, v in rel) / dof, sum(n * v[1] for n, v in rel) / dof


def _rses(s: PowerLimitStats, noise: tuple[float, float]) -> tuple[float, float]:
    """Relative standard errors of `s`'s mean time and energy, never below the pooled noise's."""
    if s.samples < 2:
        return math.inf, math.inf
    own = s.rel_vars()
    time_var = max(own[0], noise[0])
    energy_var = max(own[1], noise[1])
    return math.sqrt(time_var / s.steps), math.sqrt(energy_var / s.steps + s.rounding_rel_var())


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
    return PowerLimitStats(-1, 1, float(ref), 0.0, float(ref) ** 2, 0.0, samples=1)


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
    if a.samples < 2 or b.steps < 1:
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


def _uses_reference(selector: OptimumSelector, s: PowerLimitStats, max_power_w: float) -> bool:
    """Whether the selector's cost depends on the reference time (a slowdown bound does)."""
    t, e = s.mean_time_s, s.mean_energy_j
    return _score(selector, 1.05 * t, e, max_power_w, t) != _score(
        selector, 1.05 * t, e, max_power_w, 1.1 * t
    )


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
    if current.samples < min_steps and not revisit:
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
    if current.steps >= max_steps * chunk_steps({0: current}) or budget_left_steps <= 0:
        return "measured"
    if same and not revisit and _uses_reference(selector, current, max_power_w):
        # The reference: every other limit's slowdown is judged against its time, so it is known to
        # within `_PRECISION` before any of them is, however alike its first samples look.
        return "measured" if _Z * _rses(current, noise)[0] <= _PRECISION else "more"
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
    per = chunk_steps(stats)
    budget = adaptive_budget_steps(len(grid), warmup_steps, profile_steps, per)
    spent = spent_steps(stats, warmup_steps) - spent_before
    if spent + warmup_steps + min_measured_steps(profile_steps) * per > budget:
        return None
    ref = stats.get(grid[0])
    if ref is None or not ref.steps:
        return None
    noise = pooled_noise(stats)
    unsettled = [
        stats[pl]
        for pl in contenders(stats, selector, max_power_w, ref, noise)
        if stats[pl].steps < profile_steps * per
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
