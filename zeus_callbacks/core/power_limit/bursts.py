"""Bursts of slow steps (another job, throttling, a slow stretch of input): how they are seen in a limit's
chunks, which chunks a measurement keeps, and what one visit tells the next (`BurstWatch`).

A limit never makes steps faster than it allows. A lasting shift of the step time within one visit
(`level_shift`, the settling steps included) is a burst beginning or ending: the slower run is set aside.
A visit of a limit slower all along than another visit of it, or a higher limit slower by more than 10%
than a lower one (`slower_above`, `slower_than_below`), ran inside a burst. A burst as long as a visit shifts nothing within it:
the limit's time then stands out against the other limits' (`burst_suspects`), and it is visited again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from zeus_callbacks.core.power_limit.chunk import Chunk

if TYPE_CHECKING:
    from zeus_callbacks.core.power_limit.estimates import PowerLimitStats

__all__ = [
    "level_shift",
    "burst_runs",
    "visit_bursts",
    "kept_indices",
    "robust_chunks",
    "burst_lookback",
    "slower_above",
    "slower_than_below",
    "burst_suspects",
    "BurstWatch",
    "BURST_STEPS",
    "MAX_VISITS",
    "OUTLIER_FLOOR",
]

# What the search sets aside is said under the optimizer's logger, where users look for its decisions.
logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")

# A chunk whose per-step time is this many robust standard deviations (median absolute deviations x
# 1.4826) from the median of its limit's chunks, and at least `OUTLIER_FLOOR` of it, is set aside.
_OUTLIER_MADS = 4.0
OUTLIER_FLOOR = 0.03
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
# Time against the limit is convex on the shipped traces (flat near the top, ever steeper below), within
# wiggles of a few percent: a limit's time this far above the chord of a higher and a lower limit's is
# suspect too.
_CHORD_FLOOR = 0.03
# A burst that lasts past the end of a visit runs on into the next: that visit goes on until the burst is
# seen to end, up to this many steps, so that it keeps samples from after it. One seen to end early in a
# visit that did not expect it began before: the visits of up to this many steps before are set aside.
BURST_STEPS = 20


def level_shift(per_step_s: Sequence[float]) -> tuple[int, int] | None:
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


def burst_runs(per_step_s: Sequence[float]) -> tuple[list[int], bool, bool]:
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


def visit_bursts(chunks: Sequence[Chunk], visit: int) -> tuple[list[int], bool, bool]:
    """`burst_runs` of the samples of one visit (indices among its chunks, settling steps included),
    looked for again in what is left, up to `_BURSTS_PER_VISIT` bursts: a long visit may see several, and
    one that began before the visit may hide behind a stronger one inside it."""
    own = [c for c in chunks if c.visit == visit]
    if any(c.steps <= 0 for c in own):
        return [], False, False
    left = list(range(len(own)))
    inside_all: list[int] = []
    began_before = goes_on = False
    for _ in range(_BURSTS_PER_VISIT):
        inside, before, after = burst_runs([own[i].step_s for i in left])
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


def _fastest_visits(visits: dict[int, list[int]], chunks: Sequence[Chunk]) -> list[list[int]]:
    """The visits (chunk indices) whose per-step times are not significantly slower (as `level_shift`
    judges two runs) than the fastest visit's: nothing makes a limit's steps faster than it allows, so a
    visit that is slower all along ran inside a burst."""
    per = {v: np.log([chunks[i].step_s for i in own if chunks[i].steps > 0]) for v, own in visits.items()}
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


def kept_indices(chunks: Sequence[Chunk], bad_visits: Sequence[int] = ()) -> list[int]:
    """Indices into `chunks` of the chunks a limit's measurement rests on (in order).

    Set aside: the visits in `bad_visits`; within each visit, the slower run of samples on either side of
    a `level_shift` (a burst began or ended during it), then again in what is left (up to
    `_BURSTS_PER_VISIT` bursts); then every chunk whose per-step time is more than
    `_OUTLIER_MADS` robust standard deviations (at least `OUTLIER_FLOOR` of the median) from the median
    of those left: a data-loader stall, an evaluation or another job sharing the GPU makes a chunk far
    slower than the limit makes it (this last test from 3 chunks up).
    """
    visits: dict[int, list[int]] = {}
    for visit in sorted({c.visit for c in chunks} - set(bad_visits)):
        own = [i for i, c in enumerate(chunks) if c.visit == visit]
        inside = set(visit_bursts(chunks, visit)[0])
        visits[visit] = [i for k, i in enumerate(own) if k not in inside and not chunks[i].settling]
    kept = [i for own in _fastest_visits(visits, chunks) for i in own]
    if len(kept) < 3:
        return kept
    per_step = np.array([chunks[i].step_s for i in kept])
    med = float(np.median(per_step))
    sd = 1.4826 * float(np.median(np.abs(per_step - med)))
    below = max(_OUTLIER_MADS * sd, OUTLIER_FLOOR * med)
    above = max(_OUTLIER_MADS_SLOW * sd, OUTLIER_FLOOR * med)
    return [i for i, x in zip(kept, per_step, strict=True) if -below <= x - med <= above]


def robust_chunks(chunks: Sequence[Chunk], bad_visits: Sequence[int] = ()) -> list[Chunk]:
    """The chunks a limit's measurement rests on (`kept_indices`)."""
    return [chunks[i] for i in kept_indices(chunks, bad_visits)]


def burst_lookback(
    timeline: list[tuple[float, int]], stats: dict[float, PowerLimitStats], steps: float
) -> list[tuple[float, int]]:
    """The latest visits of `timeline` (`(power_limit_w, visit)`, oldest first) that may have run inside a
    burst seen only when it ended, early in the visit after them: back over `steps` steps at most, and
    not past a visit in which the burst was seen to begin (its slower end is set aside already)."""
    out: list[tuple[float, int]] = []
    for pl, visit in reversed(timeline):
        s = stats[pl]
        if steps <= 0 or visit_bursts(s.chunks, visit)[2]:
            break
        out.append((pl, visit))
        steps -= sum(c.steps for c in s.chunks if c.visit == visit)
    return out


def slower_above(stats: dict[float, PowerLimitStats], current: PowerLimitStats) -> list[tuple[float, int]]:
    """`(power_limit_w, visit)` of the visits to higher limits whose median step time is more than
    `_MONOTONE_SLACK` above `current`'s (a lower limit): they ran inside a burst that began and ended
    with visits, where no visit could see it shift."""
    if len(current.kept_chunks) < _SHIFT_MIN:
        return []
    here = float(np.median([c.step_s for c in current.kept_chunks]))
    out = []
    for pl, s in stats.items():
        if pl <= current.power_limit_w:
            continue
        for visit in sorted({c.visit for c in s.kept_chunks}):
            own = [c.step_s for c in s.kept_chunks if c.visit == visit]
            if len(own) >= _SHIFT_MIN and float(np.median(own)) > here * (1 + _MONOTONE_SLACK):
                out.append((pl, visit))
    return out


def slower_than_below(stats: dict[float, PowerLimitStats], current: PowerLimitStats) -> float | None:
    """A lower limit whose median step time `current`'s latest visit (a revisit, as a rule: the reference
    measured again) is more than `_MONOTONE_SLACK` above, if any: that visit ran inside a burst
    (`slower_above` the other way round)."""
    own = [c.step_s for c in current.kept_chunks if c.visit == current.visits]
    if len(own) < _SHIFT_MIN:
        return None
    here = float(np.median(own))
    for pl, s in sorted(stats.items(), reverse=True):
        lower = [c.step_s for c in s.kept_chunks]
        if pl < current.power_limit_w and len(lower) >= _SHIFT_MIN:
            if here > float(np.median(lower)) * (1 + _MONOTONE_SLACK):
                return pl
    return None


def burst_suspects(stats: dict[float, PowerLimitStats], noise: tuple[float, float]) -> list[float]:
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


class BurstWatch:
    """What one visit tells the next about bursts, within one run: whether the last visit ended inside a
    burst, whether the current one began inside it, and the run's finished visits in order."""

    def __init__(self) -> None:
        self.open = False  # the last visit ended inside a burst
        self.visit_began_inside = False  # the current visit began inside one
        self.timeline: list[tuple[float, int]] = []  # (limit, visit) of this run's finished visits

    def begin_visit(self) -> None:
        """A visit begins (inside the burst the last one ended in, if any)."""
        self.visit_began_inside = self.open

    def waits_for_end(self, s: PowerLimitStats) -> bool:
        """While a visit that began inside a burst waits for it to end: whether it still does (it stops
        once the burst is seen to end, or after `BURST_STEPS` steps)."""
        if not self.open:
            return False
        _, began_before, _ = visit_bursts(s.chunks, s.visits)
        taken = sum(c.steps for c in s.chunks if c.visit == s.visits)
        if began_before or taken >= BURST_STEPS:
            self.open = False
        return self.open

    def end_visit(
        self,
        s: PowerLimitStats,
        stats: dict[float, PowerLimitStats],
        may_measure_again: Callable[[float], bool],
    ) -> None:
        """At a visit's end: note a burst still going on, or set aside the earlier visits that ran inside
        one that this visit saw end (`burst_lookback`) or that were slower than this lower limit
        (`slower_above`), where `may_measure_again(limit)` allows; a limit that loses every sample is
        measured again."""
        inside, began_before, goes_on = visit_bursts(s.chunks, s.visits)
        if began_before and not self.visit_began_inside:
            own = [c for c in s.chunks if c.visit == s.visits]
            lead = next((k for k, i in enumerate(inside) if i != k), len(inside))  # the visit's first run
            before = sum(own[i].steps for i in inside[:lead])  # the burst's steps in this visit
            for pl, visit in burst_lookback(self.timeline, stats, BURST_STEPS - before):
                if may_measure_again(pl):
                    logger.info("Samples at %d W (visit %d) set aside: they ran inside a burst.", pl, visit)
                    stats[pl].set_aside_visit(visit)
                    stats[pl].pruned = False
        for pl, visit in slower_above(stats, s) if s.steps else []:
            if may_measure_again(pl):
                logger.info(
                    "Samples at %d W (visit %d) set aside: slower than at %d W.", pl, visit, s.power_limit_w
                )
                stats[pl].set_aside_visit(visit)
                stats[pl].pruned = False
        faster = slower_than_below(stats, s) if s.steps else None
        if faster is not None and may_measure_again(s.power_limit_w):
            logger.info(
                "Samples at %d W (visit %d) set aside: slower than at %d W.",
                s.power_limit_w,
                s.visits,
                faster,
            )
            s.set_aside_visit(s.visits)
            s.pruned = False
        self.open = goes_on
        self.visit_began_inside = False
        self.timeline.append((s.power_limit_w, s.visits))
