"""What a limit's measurement says: its means, their variances, and the one-second power windows.

- Energy from whole seconds: where the counter's refresh is long against the steps, its rounding (up
  to one refresh's energy at either end of a visit) dwarfs the differences between limits. The GPU's
  one-second average power (`NVML_FI_DEV_POWER_AVERAGE`), read at the end of samples whose times cover
  that second back to back, is the exact mean power of those steps; disjoint such seconds
  (`power_windows`) times the mean step time give the step energy without rounding.
- Noise: each limit's own spread of samples, with the noise pooled over every limit (`pooled_noise`) as a
  floor, since a handful of similar steps says little about the noise (`rses`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from zeus_callbacks.core.power_limit.bursts import OUTLIER_FLOOR, kept_indices
from zeus_callbacks.core.power_limit.chunk import Chunk
from zeus_callbacks.core.power_limit.selectors import PowerLimitMeasurement

__all__ = ["PowerLimitStats", "power_windows", "pooled_noise", "rses", "chunk_steps"]

# The one-second average power: the length of its window (s), the most time between a window's samples
# that is not theirs (a fraction of theirs), and the windows a limit needs before its energy rests on them.
_WINDOW_S = 1.0
_GAP = 0.05
_MIN_WINDOWS = 1


def _reading(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


@dataclass
class PowerLimitStats:
    """Measurements at one power limit, in samples: `Chunk`s of contiguous whole steps (each step's time
    maxed and its energy summed over ranks).

    A chunk spans enough refreshes of the energy counter to be read (`refresh_s`, the slowest rank's
    period; one step when the counter is always current). Its energy carries the counter's rounding at
    either end (up to one refresh's energy each), which cancels between consecutive chunks of one visit;
    the noise model (`rses`) counts it once per unbroken run of chunks, not once per chunk. `chunks`
    keeps every chunk; the sums are over the chunks kept by `robust_chunks` (a stalled or burst chunk is
    set aside). `time_sq`/`energy_sq` are the chunks' per-step means squared, weighted by their steps
    (for one-step chunks: the sum of squared steps).
    """

    power_limit_w: float  # W; a fractional grid (137.5) too
    steps: int = 0
    time_s: float = 0.0
    energy_j: float = 0.0
    time_sq: float = 0.0
    energy_sq: float = 0.0
    pruned: bool = False
    visits: int = 1  # times the search set this limit and warmed it up (the refinement pass revisits)
    samples: int = -1  # chunks kept (-1: one per step, as in profiles without chunks)
    refresh_s: float = 0.0  # the energy counter's refresh period when it was measured (0: always current)
    chunks: list[Chunk] = field(default_factory=list)
    dropped_steps: int = 0  # steps of chunks set aside as stalls or bursts
    warmed_steps: int = -1  # warm-up steps run at this limit over its visits (-1: `warmup_steps` per visit)
    bad_visits: list[int] = field(default_factory=list)  # visits found inside a burst: all set aside

    def __post_init__(self) -> None:
        if self.samples < 0:
            self.samples = self.steps
        self._kept: list[Chunk] = []  # `robust_chunks(chunks, bad_visits)`, kept up to date
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
        on average over the last second (nan: not read)."""
        chunk = Chunk(
            int(steps), float(time_s), float(energy_j), self.visits, _reading(power_w), _reading(end_s)
        )
        self.chunks.append(chunk)
        self._recount()

    def add_settling(self, step_s: float, end_s: float = math.nan) -> None:
        """Note the time of a settling step of the current visit, ending at `end_s` (not a sample: the
        energy counter still lags; it helps `level_shift` see a burst begin with the visit, and, the limit
        being in force, its time counts towards a one-second power window)."""
        self.chunks.append(Chunk(1, float(step_s), 0.0, self.visits, None, _reading(end_s), settling=True))
        self._recount()

    def set_aside_visit(self, visit: int) -> None:
        """Set aside every sample of `visit` (it ran inside a burst seen only later)."""
        if visit not in self.bad_visits:
            self.bad_visits.append(visit)
        self._recount()

    def visit_samples(self, visit: int) -> int:
        """Samples taken in `visit`, kept or not."""
        return sum(1 for c in self.chunks if c.visit == visit and not c.settling)

    def visit_steps(self, visit: int) -> int:
        """Steps of `visit`'s chunks, settling steps included."""
        return sum(c.steps for c in self.chunks if c.visit == visit)

    @property
    def kept_chunks(self) -> list[Chunk]:
        """The chunks the measurement rests on (`robust_chunks`)."""
        return self._kept

    @property
    def power_windows_w(self) -> list[float]:
        """Power over disjoint one-second windows of kept samples (`power_windows`)."""
        return self._windows

    def _recount(self) -> None:
        kept_at = kept_indices(self.chunks, self.bad_visits)
        kept = self._kept = [self.chunks[i] for i in kept_at]
        self._windows = power_windows(self.chunks, set(kept_at))
        self.steps = sum(int(c.steps) for c in kept)
        self.dropped_steps = sum(int(c.steps) for c in self.chunks if not c.settling) - self.steps
        self.samples = len(kept)
        self.time_s = sum(c.time_s for c in kept)
        self.energy_j = sum(c.energy_j for c in kept)
        self.time_sq = sum(c.time_s * c.time_s / c.steps for c in kept)
        self.energy_sq = sum(c.energy_j * c.energy_j / c.steps for c in kept)

    @property
    def breaks(self) -> int:
        """Unbroken runs of chunks: each visit is one, and each chunk set aside splits one."""
        measured = sum(1 for c in self.chunks if not c.settling)
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
            rounding = sum(
                c.steps * self.refresh_s**2 / (6 * c.time_s**2) for c in kept if c.time_s > 0
            ) / len(kept)
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

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers, for checkpoints and profile files (`schema` version 2: chunks as dicts)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**out, "chunks": [c.to_saved() for c in self.chunks], "bad_visits": list(self.bad_visits)}

    def measurement(self, steps: int) -> PowerLimitMeasurement:
        """Zeus's view: time and energy of `steps` steps at this limit."""
        return PowerLimitMeasurement(self.power_limit_w, self.mean_energy_j * steps, self.mean_time_s * steps)


def _end_s(chunk: Chunk) -> float:
    return chunk.end_s if chunk.end_s is not None else -1.0


def power_windows(chunks: Sequence[Chunk], kept: Collection[int]) -> list[float]:
    """Readings of the one-second average power (`NVML_FI_DEV_POWER_AVERAGE`) whose second is covered by
    steps of one visit at this limit, back to back (their times add up to the clock's, within `_GAP`),
    and no two of which overlap: each is the exact mean power of a second of this limit's steps, with none
    of the energy counter's rounding (up to a refresh's energy at each end of a window).

    `kept` holds the indices into `chunks` of the kept samples (`kept_indices`). The steps are kept
    samples and the visit's settling steps (the limit is in force from the first: only the energy counter
    lags) as long as a settling step's time is not an outlier among the kept samples' (`OUTLIER_FLOOR`): a
    short visit, under a second of samples, still gets a window. Latest first within each visit, as the
    first second of a visit may still carry the previous limit.
    """
    out: list[float] = []
    for visit in sorted({c.visit for c in chunks}):
        own = [(c, i in kept) for i, c in enumerate(chunks) if c.visit == visit]
        out.extend(_visit_windows(own))
    return out


def _visit_windows(own: list[tuple[Chunk, bool]]) -> list[float]:
    """`power_windows` of one visit's chunks (each with whether it is kept), latest first."""
    samples = [c.step_s for c, kept in own if kept]
    if not samples:
        return []
    med = float(np.median(samples))
    out: list[float] = []
    i = len(own) - 1
    while i >= 0:
        c, kept = own[i]
        # `c.dated`, spelt out so that the type checker knows `c.power_w` is a float below
        if c.settling or not kept or c.power_w is None or c.end_s is None:
            i -= 1
            continue
        span, j = 0.0, i
        while j >= 0 and span < _WINDOW_S and _in_window(*own[j], med):
            span += own[j][0].time_s
            j -= 1
        first = own[j + 1][0]
        before = own[j][0] if j >= 0 else None
        start = (
            _end_s(before)
            if before is not None and before.end_s is not None
            else _end_s(first) - first.time_s
        )
        if span >= _WINDOW_S and _end_s(c) - start <= span * (1 + _GAP) + 1e-9:
            out.append(c.power_w)
            i = j
            continue
        i -= 1
    return out


def _in_window(chunk: Chunk, kept: bool, median_step_s: float) -> bool:
    """Whether `chunk` may make up part of a power window: a kept sample, or a settling step with its end
    time whose step time is within `OUTLIER_FLOOR` of the kept samples' median."""
    if kept:
        return True
    return (
        chunk.settling
        and chunk.end_s is not None
        and abs(chunk.step_s - median_step_s) <= OUTLIER_FLOOR * median_step_s
    )


def pooled_noise(stats: dict[float, PowerLimitStats]) -> tuple[float, float]:
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


def rses(s: PowerLimitStats, noise: tuple[float, float]) -> tuple[float, float]:
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


def chunk_steps(stats: dict[float, PowerLimitStats]) -> float:
    """Steps a limit's sample is worth: 1 where steps last at least the energy counter's refresh
    period, else the period over the mean step time, so that a limit is measured for as long (in time)
    with short steps as with long ones."""
    measured = [s for s in stats.values() if s.steps]
    if not measured:
        return 1.0
    refresh = max(s.refresh_s for s in measured)
    mean_time = sum(s.time_s for s in measured) / sum(s.steps for s in measured)
    return max(1.0, refresh / mean_time) if mean_time > 0 else 1.0
