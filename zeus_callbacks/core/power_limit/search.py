"""Which power limit to profile next, how long to measure it, and which one wins: pure functions.

Searches over the grid of power limits (highest first, the minimum always included):
- `sweep`: every limit for `profile_steps` steps, as Zeus does.
- `zeus`: the sweep, and the optimizer also lets an epoch's end interrupt a limit as Zeus does.
- `adaptive` (default): two passes. The first visits every limit from the highest down; after
  `min_measured_steps` steps a limit stops as soon as it is clearly worse than the best so far (its
  optimistic cost above the best's pessimistic cost, `_Z` standard errors each way) or is not one of the
  `contenders` (it cannot beat the best by more than `_TOLERANCE`); a contender goes on until its cost
  is known to within `_PRECISION`, for `_FIRST_PASS_SHARE` of `profile_steps` at most. The refinement
  pass then revisits, in this order, the limits whose every sample was set aside as burst-ridden, the
  `burst_suspects` (visited once, slower than a lower limit or above the chord of two others), and the
  final contenders, fewest steps first, each until it is no longer one or has `profile_steps` steps (the
  best is a contender while its own cost is not known to within twice `_PRECISION`; under a slowdown
  bound, also while it may be more than `_TOLERANCE` past the bound, and the reference is one while it
  decides on which side of the bound a contender lies). The budget (`adaptive_budget_steps`) caps the
  whole search, warm-ups, set-aside samples and revisits included, whatever the noise: a visit ends once
  what is left of it is what the limits not yet visited need at least. Standard errors use the noise
  pooled over every limit (`pooled_noise`) as a floor, since a handful of similar steps says little about
  the noise.

Why a refinement pass: the misses of a single pass were near-ties, two limits within 1-2% of each
other, one measured for a few steps as the best so far and the other, met later, measured against it;
only more steps of both settle them, and which limits tie is known only once every limit was seen.
Its budget is three quarters of a sweep for one run (in steps: a sweep of samples that each span a
refresh of the energy counter), enough to settle a flat curve with several near-ties (the benchmark).

What a limit's measurement rests on (`PowerLimitStats`, `robust_chunks`):
- Warm-up once: the run's first limit gets `warmup_steps` (the job warms up there); a power limit takes
  effect within milliseconds, so every later visit only settles for one sample's worth of steps
  (`settle_steps`: the energy counter lags by up to one refresh).
- Energy from whole seconds: where the counter's refresh is long against the steps, its rounding (up
  to one refresh's energy at either end of a visit) dwarfs the differences between limits. The GPU's
  one-second average power (`NVML_FI_DEV_POWER_AVERAGE`), read at the end of samples whose times cover
  that second back to back, is the exact mean power of those steps; disjoint such seconds
  (`power_windows`) times the mean step time give the step energy without rounding.
- Bursts (another job, throttling, a slow stretch of input) slow every step for a while; a limit never
  makes steps faster than it allows. A lasting shift of the step time within one visit (`level_shift`,
  the settling steps included) is a burst beginning or ending: the slower run is set aside. A visit of a
  limit slower all along than another visit of it, or a higher limit slower by more than 10% than a
  lower one (`slower_above`), ran inside a burst. The optimizer carries what one visit saw into the
  next (a visit that begins inside a burst waits for it to end; visits before one that saw a burst end
  are set aside, `burst_lookback`), and a limit left without samples is measured again. A burst as long
  as a visit shifts nothing within it: the limit's time then stands out against the other limits'
  (`burst_suspects`), and it is visited again; the faster visit is kept (`robust_chunks`).

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
    "settle_steps",
    "chunk_steps",
    "robust_chunks",
    "power_windows",
    "level_shift",
    "burst_runs",
    "visit_bursts",
    "pooled_noise",
    "contenders",
    "next_power_limit",
    "measurement_verdict",
    "burst_lookback",
    "slower_above",
    "burst_suspects",
    "clearly_worse",
    "best_power_limit",
    "choose_power_limit",
    "SEARCHES",
    "MAX_VISITS",
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
# Above the median the bound is tighter: nothing makes a step faster than its limit allows, while a mild
# burst (another job, throttling) slows a few chunks by 10% or so without shifting the visit's level.
_OUTLIER_MADS_SLOW = 2.5
# A level shift of the per-step time within one visit (the limit unchanged all along) is a burst (another
# job, throttling, a slow stretch of data) starting or ending: two runs of at least `_SHIFT_MIN` samples
# whose medians differ by `_SHIFT_SDS` standard errors (from the samples' successive differences, at least
# `_SHIFT_NOISE_FLOOR` a step) and at least `_SHIFT_FLOOR`. The slower run is set aside.
_SHIFT_MIN = 2
_SHIFT_SDS = 4.0
_SHIFT_FLOOR = 0.05
_SHIFT_NOISE_FLOOR = 0.01
# The one-second average power: the length of its window (s), the most time between a window's samples
# that is not theirs (a fraction of theirs), and the windows a limit needs before its energy rests on them.
_WINDOW_S = 1.0
_GAP = 0.05
_MIN_WINDOWS = 1
# A higher limit's visit whose steps were this much slower than a lower limit's ran inside a burst: a
# lower limit does not make steps faster (the shipped traces' wiggles stay within about 6%).
_MONOTONE_SLACK = 0.10
# Bursts looked for, one after another, in the samples of one visit.
_BURSTS_PER_VISIT = 3
# Visits of one limit after which its samples are no longer set aside as burst-ridden (noise that keeps
# looking like bursts, e.g. the host's own on ms-long steps, must not keep profiling going); a limit whose
# every sample was set aside is measured again up to this many visits.
MAX_VISITS = 3
# A limit visited once whose mean step time is above a lower limit's by this fraction and by `_Z_SUSPECT`
# standard errors of the difference may have run inside a burst that spanned its whole visit: it is visited
# once more (`burst_suspects`); the slower of its visits is then set aside by `robust_chunks`.
_SUSPECT_FLOOR = 0.015
_Z_SUSPECT = 2.0
# The most of `profile_steps` a contender is measured in the first pass (the refinement pass goes on).
_FIRST_PASS_SHARE = 0.5
# Slowdowns at which a selector is asked whether the reference time changes its cost (1.01x to about 4x):
# a bound changes the cost only near it.
_SLOWDOWN_PROBES = 1.0 + 0.01 * 1.1 ** np.arange(60)
# Time against the limit is convex on the shipped traces (flat near the top, ever steeper below), within
# wiggles of a few percent: a limit's time this far above the chord of a higher and a lower limit's is
# suspect too.
_CHORD_FLOOR = 0.03


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
    warmed_steps: int = -1  # warm-up steps run at this limit over its visits (-1: `warmup_steps` per visit)
    bad_visits: list[int] = field(default_factory=list)  # visits found inside a burst: all set aside

    def __post_init__(self) -> None:
        if self.samples < 0:
            self.samples = self.steps
        self._kept: list[list[float]] = []  # `robust_chunks(chunks, bad_visits)`, kept up to date
        self._windows: list[float] = []  # `power_windows(chunks, kept)`
        if self.chunks:
            self._recount()

    @property
    def mean_time_s(self) -> float:
        """Mean step time (s)."""
        return self.time_s / self.steps if self.steps else math.nan

    @property
    def mean_energy_j(self) -> float:
        """Mean step energy (J, all GPUs of the job): the one-second power windows' mean power times the
        mean step time where there are `_MIN_WINDOWS` of them, else the energy counter's."""
        if not self.steps:
            return math.nan
        if len(self._windows) >= _MIN_WINDOWS:
            return float(np.mean(self._windows)) * self.mean_time_s
        return self.energy_j / self.steps

    def windows_rel_var(self) -> float | None:
        """Relative variance of the mean power of the one-second windows (None: too few windows)."""
        w = self._windows
        if len(w) < _MIN_WINDOWS:
            return None
        mean = float(np.mean(w))
        if mean <= 0:
            return None
        return float(np.var(w, ddof=1)) / (mean * mean) / len(w) if len(w) > 1 else 0.0

    @property
    def spent_steps(self) -> int:
        """Every measured step, kept or set aside (warm-ups not included)."""
        return self.steps + self.dropped_steps

    def add(
        self,
        time_s: float,
        energy_j: float,
        steps: int = 1,
        power_w: float = math.nan,
        end_s: float = math.nan,
    ) -> None:
        """Add one sample of the current visit: a chunk of `steps` contiguous steps that took `time_s` and
        `energy_j` in all, ending at `end_s` (the monitor's clock) with the job's GPUs drawing `power_w`
        on average over the last second (nan: not read; stored as -1, as profile files are strict JSON)."""
        self.chunks.append(
            [int(steps), float(time_s), float(energy_j), self.visits, _or_unread(power_w), _or_unread(end_s)]
        )
        self._recount()

    def add_settling(self, step_s: float, end_s: float = math.nan) -> None:
        """Note the time of a settling step of the current visit, ending at `end_s` (not a sample: the
        energy counter still lags; it helps `level_shift` see a burst begin with the visit, and, the limit
        being in force, its time counts towards a one-second power window)."""
        self.chunks.append([1, float(step_s), 0.0, self.visits, -1.0, _or_unread(end_s), 1])
        self._recount()

    def set_aside_visit(self, visit: int) -> None:
        """Set aside every sample of `visit` (it ran inside a burst seen only later)."""
        if visit not in self.bad_visits:
            self.bad_visits.append(visit)
        self._recount()

    def visit_samples(self, visit: int) -> int:
        """Samples taken in `visit`, kept or not."""
        return sum(1 for c in self.chunks if _visit(c) == visit and not _settling(c))

    @property
    def kept_chunks(self) -> list[list[float]]:
        """The chunks the measurement rests on (`robust_chunks`)."""
        return self._kept

    @property
    def power_windows_w(self) -> list[float]:
        """Power over disjoint one-second windows of kept samples (`power_windows`)."""
        return self._windows

    def _recount(self) -> None:
        kept = self._kept = robust_chunks(self.chunks, self.bad_visits)
        self._windows = power_windows(self.chunks, kept)
        self.steps = sum(int(c[0]) for c in kept)
        self.dropped_steps = sum(int(c[0]) for c in self.chunks if not _settling(c)) - self.steps
        self.samples = len(kept)
        self.time_s = sum(c[1] for c in kept)
        self.energy_j = sum(c[2] for c in kept)
        self.time_sq = sum(c[1] * c[1] / c[0] for c in kept)
        self.energy_sq = sum(c[2] * c[2] / c[0] for c in kept)

    @property
    def breaks(self) -> int:
        """Unbroken runs of chunks: each visit is one, and each chunk set aside splits one."""
        measured = sum(1 for c in self.chunks if not _settling(c))
        return self.visits + measured - self.samples if self.chunks else self.visits

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
            kept = self._kept
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


def _or_unread(value: float) -> float:
    """A reading as stored in a chunk: -1 for none (nan), as profile files are strict JSON."""
    return float(value) if math.isfinite(value) else -1.0


def _visit(chunk: list[float]) -> int:
    return int(chunk[3]) if len(chunk) > 3 else 1


def _settling(chunk: list[float]) -> bool:
    """A settling step's time (`PowerLimitStats.add_settling`), not a sample."""
    return len(chunk) > 6 and bool(chunk[6])


def level_shift(per_step_s: list[float]) -> tuple[int, int] | None:
    """Where a visit's per-step times shift level, if they do: `(k, +1)` when the samples from `k` on
    are slower than those before (a burst began), `(k, -1)` when those before `k` are slower (a burst
    ended); None when no split into runs of `_SHIFT_MIN` samples or more differs significantly.

    The limit is the same all visit long, so a lasting shift is not its doing. Medians keep a single
    stall from passing for a shift (stalls are `robust_chunks`'s to set aside).
    """
    x = np.asarray(per_step_s, dtype=float)
    n = len(x)
    if n < 2 * _SHIFT_MIN or np.any(x <= 0):
        return None
    lx = np.log(x)

    def cost(k: int) -> float:  # absolute deviations of the two runs from their medians
        return float(np.abs(lx[:k] - np.median(lx[:k])).sum() + np.abs(lx[k:] - np.median(lx[k:])).sum())

    k = min(range(_SHIFT_MIN, n - _SHIFT_MIN + 1), key=cost)
    before, after = float(np.median(x[:k])), float(np.median(x[k:]))
    gap = abs(math.log(after / before))
    # The noise from successive differences: a shift moves only one of them.
    sd = max(1.4826 * float(np.median(np.abs(np.diff(lx)))) / math.sqrt(2), _SHIFT_NOISE_FLOOR)
    need = max(_SHIFT_FLOOR, _SHIFT_SDS * sd * math.sqrt(1 / k + 1 / (n - k)))
    if gap < math.log1p(need):
        return None
    return k, 1 if after > before else -1


def burst_runs(per_step_s: list[float]) -> tuple[list[int], bool, bool]:
    """A visit's samples seen inside a burst (indices), whether the burst began before the visit, and
    whether it goes on after it: a `level_shift`, and within the slower run a second one back (a burst
    that began and ended inside the visit)."""
    shift = level_shift(per_step_s)
    if shift is None:
        return [], False, False
    k, sign = shift
    n = len(per_step_s)
    if sign > 0:
        inner = level_shift(per_step_s[k:])
        if inner is not None and inner[1] < 0:
            return list(range(k, k + inner[0])), False, False
        return list(range(k, n)), False, True
    inner = level_shift(per_step_s[:k])
    if inner is not None and inner[1] > 0:
        return list(range(inner[0], k)), False, False
    return list(range(k)), True, False


def visit_bursts(chunks: list[list[float]], visit: int) -> tuple[list[int], bool, bool]:
    """`burst_runs` of the samples of one visit (indices among its chunks, settling steps included),
    looked for again in what is left, up to `_BURSTS_PER_VISIT` bursts: a long visit may see several, and
    one that began before the visit may hide behind a stronger one inside it."""
    own = [c for c in chunks if _visit(c) == visit]
    if any(c[0] <= 0 for c in own):
        return [], False, False
    left = list(range(len(own)))
    inside_all: list[int] = []
    began_before = goes_on = False
    for _ in range(_BURSTS_PER_VISIT):
        inside, before, after = burst_runs([own[i][1] / own[i][0] for i in left])
        if not inside:
            break
        began_before |= before and left[0] == 0
        goes_on |= after and left[-1] == len(own) - 1
        inside_all.extend(left[i] for i in inside)
        drop = set(inside)
        left = [i for k, i in enumerate(left) if k not in drop]
        if len(left) < 2 * _SHIFT_MIN:
            break
    return sorted(inside_all), began_before, goes_on


def power_windows(chunks: list[list[float]], kept: list[list[float]]) -> list[float]:
    """Readings of the one-second average power (`NVML_FI_DEV_POWER_AVERAGE`) whose second is covered by
    steps of one visit at this limit, back to back (their times add up to the clock's, within `_GAP`),
    and no two of which overlap: each is the exact mean power of a second of this limit's steps, with none
    of the energy counter's rounding (up to a refresh's energy at each end of a window).

    The steps are kept samples and the visit's settling steps (the limit is in force from the first: only
    the energy counter lags) as long as a settling step's time is not an outlier among the kept samples'
    (`_OUTLIER_FLOOR`): a short visit, under a second of samples, still gets a window. Latest first
    within each visit, as the first second of a visit may still carry the previous limit.
    """
    kept_ids = {id(c) for c in kept}
    out: list[float] = []
    for visit in sorted({_visit(c) for c in chunks}):
        own = [c for c in chunks if _visit(c) == visit]
        samples = [c[1] / c[0] for c in own if id(c) in kept_ids and c[0] > 0]
        if not samples:
            continue
        med = float(np.median(samples))
        i = len(own) - 1
        while i >= 0:
            c = own[i]
            if _settling(c) or len(c) < 6 or c[4] < 0 or c[5] < 0 or id(c) not in kept_ids:
                i -= 1
                continue
            span, j = 0.0, i
            while j >= 0 and span < _WINDOW_S and _in_window(own[j], kept_ids, med):
                span += own[j][1]
                j -= 1
            first = own[j + 1]
            start = own[j][5] if j >= 0 and own[j][5] >= 0 else first[5] - first[1]
            if span >= _WINDOW_S and c[5] - start <= span * (1 + _GAP) + 1e-9:
                out.append(c[4])
                i = j
                continue
            i -= 1
    return out


def _in_window(chunk: list[float], kept_ids: set[int], median_step_s: float) -> bool:
    """Whether `chunk` may make up part of a power window: a kept sample, or a settling step with its end
    time whose step time is within `_OUTLIER_FLOOR` of the kept samples' median."""
    if id(chunk) in kept_ids:
        return True
    return (
        _settling(chunk)
        and len(chunk) > 5
        and chunk[5] >= 0
        and abs(chunk[1] / chunk[0] - median_step_s) <= _OUTLIER_FLOOR * median_step_s
    )


def _fastest_visits(visits: dict[int, list[list[float]]]) -> list[list[list[float]]]:
    """The visits whose per-step times are not significantly slower (as `level_shift` judges two runs)
    than the fastest visit's: nothing makes a limit's steps faster than it allows, so a visit that is
    slower all along ran inside a burst."""
    per = {v: np.log([c[1] / c[0] for c in own if c[0] > 0]) for v, own in visits.items()}
    some = {v: x for v, x in per.items() if len(x) >= _SHIFT_MIN}
    if len(some) < 2:
        return list(visits.values())
    diffs = np.concatenate([np.diff(x) for x in some.values()])
    sd = max(1.4826 * float(np.median(np.abs(diffs))) / math.sqrt(2), _SHIFT_NOISE_FLOOR)
    fast = min(some, key=lambda v: float(np.median(some[v])))
    lo, n_lo = float(np.median(some[fast])), len(some[fast])
    out = []
    for v, own in visits.items():
        x = some.get(v)
        if x is not None and v != fast:
            need = max(_SHIFT_FLOOR, _SHIFT_SDS * sd * math.sqrt(1 / len(x) + 1 / n_lo))
            if float(np.median(x)) - lo > math.log1p(need):
                continue
        out.append(own)
    return out


def robust_chunks(chunks: list[list[float]], bad_visits: list[int] | tuple = ()) -> list[list[float]]:
    """The chunks a limit's measurement rests on.

    Set aside: the visits in `bad_visits`; within each visit, the slower run of samples on either side of
    a `level_shift` (a burst began or ended during it), then again in what is left (up to
    `_BURSTS_PER_VISIT` bursts); then every chunk whose per-step time is more than
    `_OUTLIER_MADS` robust standard deviations (at least `_OUTLIER_FLOOR` of the median) from the median
    of those left: a data-loader stall, an evaluation or another job sharing the GPU makes a chunk far
    slower than the limit makes it (this last test from 3 chunks up).
    """
    visits = {}
    for visit in sorted({_visit(c) for c in chunks} - set(bad_visits)):
        own = [c for c in chunks if _visit(c) == visit]
        inside = set(visit_bursts(own, visit)[0])
        visits[visit] = [c for i, c in enumerate(own) if i not in inside and not _settling(c)]
    chunks = [c for own in _fastest_visits(visits) for c in own]
    if len(chunks) < 3:
        return list(chunks)
    per_step = np.array([c[1] / c[0] for c in chunks])
    med = float(np.median(per_step))
    sd = 1.4826 * float(np.median(np.abs(per_step - med)))
    below = max(_OUTLIER_MADS * sd, _OUTLIER_FLOOR * med)
    above = max(_OUTLIER_MADS_SLOW * sd, _OUTLIER_FLOOR * med)
    return [c for c, x in zip(chunks, per_step, strict=True) if -below <= x - med <= above]


def burst_lookback(
    timeline: list[tuple[int, int]], stats: dict[int, PowerLimitStats], steps: float
) -> list[tuple[int, int]]:
    """The latest visits of `timeline` (`(power_limit_w, visit)`, oldest first) that may have run inside a
    burst seen only when it ended, early in the visit after them: back over `steps` steps at most, and
    not past a visit in which the burst was seen to begin (its slower end is set aside already)."""
    out: list[tuple[int, int]] = []
    for pl, visit in reversed(timeline):
        s = stats[pl]
        if steps <= 0 or visit_bursts(s.chunks, visit)[2]:
            break
        out.append((pl, visit))
        steps -= sum(c[0] for c in s.chunks if _visit(c) == visit)
    return out


def slower_above(stats: dict[int, PowerLimitStats], current: PowerLimitStats) -> list[tuple[int, int]]:
    """`(power_limit_w, visit)` of the visits to higher limits whose median step time is more than
    `_MONOTONE_SLACK` above `current`'s (a lower limit): they ran inside a burst that began and ended
    with visits, where no visit could see it shift."""
    if len(current.kept_chunks) < _SHIFT_MIN:
        return []
    here = float(np.median([c[1] / c[0] for c in current.kept_chunks]))
    out = []
    for pl, s in stats.items():
        if pl <= current.power_limit_w:
            continue
        for visit in sorted({_visit(c) for c in s.kept_chunks}):
            own = [c[1] / c[0] for c in s.kept_chunks if _visit(c) == visit]
            if len(own) >= _SHIFT_MIN and float(np.median(own)) > here * (1 + _MONOTONE_SLACK):
                out.append((pl, visit))
    return out


def burst_suspects(stats: dict[int, PowerLimitStats], noise: tuple[float, float]) -> list[int]:
    """Limits measured in a single visit whose mean step time is above a lower limit's by more than
    `_SUSPECT_FLOOR` and `_Z_SUSPECT` standard errors of the difference (`noise`: `pooled_noise`), highest
    first.

    A lower limit never makes steps faster; a burst as long as a visit (another job for a few seconds)
    slows every sample of it alike, so nothing within the visit shifts and only the comparison with the
    limits measured outside the burst shows it. Traces do wiggle (up to about 6% on flat curves), so a
    suspect is not set aside but measured again: a second visit at its true pace is faster, and
    `robust_chunks` keeps the faster visit; one that agrees with the first keeps both.
    """
    measured = [s for s in stats.values() if s.samples >= _SHIFT_MIN and not s.bad_visits]
    out = []
    for s in sorted(measured, key=lambda s: -s.power_limit_w):
        if s.visits > 1:
            continue
        if _above_lower_limits(s, measured, noise):
            out.append(s.power_limit_w)
    return out


def _above_lower_limits(
    s: PowerLimitStats, measured: list[PowerLimitStats], noise: tuple[float, float]
) -> bool:
    """Whether `s`'s mean step time is significantly above a lower limit's, or above the chord of a higher
    and a lower limit's (`burst_suspects`)."""

    def rel_se(a: PowerLimitStats) -> float:
        return math.sqrt(max(a.rel_vars()[0], noise[0]) / a.steps)

    pl, t = s.power_limit_w, s.mean_time_s
    for low in measured:
        if low.power_limit_w >= pl:
            continue
        se = math.hypot(rel_se(s), rel_se(low))
        if t > low.mean_time_s * (1 + max(_SUSPECT_FLOOR, _Z_SUSPECT * se)):
            return True
        for high in measured:
            if high.power_limit_w <= pl:
                continue
            w = (high.power_limit_w - pl) / (high.power_limit_w - low.power_limit_w)
            chord = high.mean_time_s + w * (low.mean_time_s - high.mean_time_s)
            se = math.sqrt(rel_se(s) ** 2 + ((1 - w) * rel_se(high)) ** 2 + (w * rel_se(low)) ** 2)
            if t > chord * (1 + max(_CHORD_FLOOR, _Z_SUSPECT * se)):
                return True
    return False


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


def settle_steps(warmup_steps: int, per_sample: float = 1.0) -> int:
    """Unmeasured steps the adaptive search runs at a limit after the first it profiles in a run.

    A power limit takes effect within milliseconds; what lags is the energy counter (up to one refresh),
    so a visit skips one sample's worth of steps (`chunk_steps`), never more than `warmup_steps`. The
    first limit of a run gets all `warmup_steps`: that is where the job itself warms up.
    """
    return min(warmup_steps, max(1, math.ceil(per_sample - 1e-9)))


def spent_steps(stats: dict[int, PowerLimitStats], warmup_steps: int) -> int:
    """Steps the search has spent on `stats` so far: each visit's warm-up (`warmup_steps` a visit where
    the limit does not say) and every measured step."""
    return sum(
        s.spent_steps + (s.warmed_steps if s.warmed_steps >= 0 else warmup_steps * s.visits)
        for s in stats.values()
    )


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
    windows = s.windows_rel_var()
    if windows is not None:
        # Mean power of whole seconds times mean step time: no counter rounding; power's own noise
        # averaged over a second is at least the per-step noise spread over the steps of a second.
        per_second = max(energy_var - time_var, time_var) * s.mean_time_s
        power_var = max(windows, per_second / len(s.power_windows_w))
        return math.sqrt(time_var / s.steps), math.sqrt(time_var / s.steps + power_var)
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
    slack: float = 0.0,
) -> tuple[float, float, float]:
    """(optimistic, mean, pessimistic) cost of `s`, `z` standard errors each way; the reference time's
    own error counts too. `slack` loosens a slowdown bound for the pessimistic cost (by that fraction
    of the reference time)."""
    rt, re_ = (min(x, 1.0) for x in _rses(s, noise))
    rr = min(_rses(ref, noise)[0], 1.0) if ref is not s else 0.0
    t, e, r = s.mean_time_s, s.mean_energy_j, ref.mean_time_s
    # A longer reference time loosens a slowdown bound, so it is the optimistic one.
    opt = _score(selector, t * max(0.0, 1 - z * rt), e * max(0.0, 1 - z * re_), max_power_w, r * (1 + z * rr))
    mean = _score(selector, t, e, max_power_w, r)
    pes_r = r * max(0.0, 1 - z * rr) * (1 + slack)
    pes = _score(selector, t * (1 + z * rt), e * (1 + z * re_), max_power_w, pes_r)
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
    than the tolerance under the best's pessimistic one); the best alone while its cost is not known to
    within `_PRECISION`. Empty when the best is settled."""
    best = best_power_limit(stats, selector, max_power_w, ref.mean_time_s)
    if best is None:
        return []
    b = stats[best]
    bound = _uses_reference(selector, b, max_power_w)
    if bound:
        # A slowdown bound: the best is within it at its mean. Whether a rival's cost beats the best's is
        # a question of energy; whether the best stays within the bound is the best's own (below), where
        # a slowdown within `_TOLERANCE` past the bound is as good as one on it.
        re_ = min(_rses(b, noise)[1], 1.0)
        pes_e = b.mean_energy_j * (1 + _Z_CHOICE * re_)
        pes_best = _score(selector, b.mean_time_s, pes_e, max_power_w, ref.mean_time_s)
    else:
        pes_best = _bounds(b, selector, max_power_w, ref, noise, _Z_CHOICE)[2]
    rivals = [
        s.power_limit_w
        for s in _valid(stats)
        if s.power_limit_w != best
        and _bounds(s, selector, max_power_w, ref, noise, _Z_CHOICE)[0] * (1 + _TOLERANCE) < pes_best
    ]
    if not rivals:
        # Settled, once the best's own cost is known to within `_PRECISION` (a visit too short for the
        # energy counter's rounding to average out can be off by more than the gaps between limits).
        slack = _TOLERANCE if bound else 0.0
        opt, mean, pes = _bounds(b, selector, max_power_w, ref, noise, slack=slack)
        return [] if math.isfinite(pes) and pes - opt <= 4 * _PRECISION * mean else [best]
    out = [best, *rivals]
    # Where the reference time decides a contender's cost (a slowdown bound): the reference is a contender
    # too while a contender's cost changes within the two's errors together (whichever of them has fewer
    # steps is then measured first).
    if ref.power_limit_w not in out and any(
        _reference_decides(stats[pl], selector, max_power_w, ref, noise) for pl in out
    ):
        out.append(ref.power_limit_w)
    return out


def _reference_decides(
    s: PowerLimitStats,
    selector: OptimumSelector,
    max_power_w: float,
    ref: PowerLimitStats,
    noise: tuple[float, float],
) -> bool:
    """Whether `s`'s cost at its mean time and energy changes with the reference time within `_Z_CHOICE`
    standard errors of `s`'s time and the reference's together."""
    rt = min(_rses(s, noise)[0], 1.0)
    rr = min(_rses(ref, noise)[0], 1.0)
    z = _Z_CHOICE * math.sqrt(rt**2 + rr**2)
    t, e, r = s.mean_time_s, s.mean_energy_j, ref.mean_time_s
    return _score(selector, t, e, max_power_w, r * (1 + z)) != _score(
        selector, t, e, max_power_w, r * max(0.0, 1 - z)
    )


def _uses_reference(selector: OptimumSelector, s: PowerLimitStats, max_power_w: float) -> bool:
    """Whether the selector's cost depends on the reference time (a slowdown bound does), probed at
    `_SLOWDOWN_PROBES` with the reference 5% longer."""
    t, e = s.mean_time_s, s.mean_energy_j
    times, energies = _SLOWDOWN_PROBES * t, np.full(len(_SLOWDOWN_PROBES), e)
    return bool(
        np.any(
            selector.score(times, energies, max_power_w, t)
            != selector.score(times, energies, max_power_w, 1.05 * t)
        )
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
    revisit = any(_visit(c) < current.visits for c in current.kept_chunks)
    if current.samples < min_steps and not revisit:
        return "more"
    # Every visit takes `min_steps` samples, enough to see a burst begin or end within it.
    if revisit and current.visit_samples(current.visits) < min_steps and budget_left_steps > 0:
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
    # may still fall elsewhere, for half of `max_steps` at most; the refinement pass measures the final
    # contenders further, fewest steps first (on a flat curve every limit is a contender: measured to the
    # full `max_steps` in the first pass, the first limits spend what the last ones would need).
    if current.steps >= _FIRST_PASS_SHARE * max_steps * chunk_steps({0: current}):
        return "measured"
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
    if spent + settle_steps(warmup_steps, per) + min_measured_steps(profile_steps) * per > budget:
        return None
    # A limit whose every visit ran inside a burst is measured again (a few times at most).
    lost = [
        pl for pl in grid if not stats[pl].steps and stats[pl].bad_visits and stats[pl].visits < MAX_VISITS
    ]
    if lost:
        return lost[0]
    suspects = burst_suspects(stats, pooled_noise(stats))
    if suspects:
        return suspects[0]
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
