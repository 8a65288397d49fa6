"""Which power limit to profile next, how long to measure it, and which one wins: the `Search`.

Searches over the grid of power limits (highest first, the minimum always included):
- `sweep`: every limit for `profile_steps` steps, as Zeus does.
- `zeus`: the sweep, and the optimizer also lets an epoch's end interrupt a limit as Zeus does.
- `adaptive` (default): two passes. The first visits every limit from the highest down; after
  `min_measured_steps` steps a limit stops as soon as it is clearly worse than the best so far (its
  optimistic cost above the best's pessimistic cost, `costs.Z` standard errors each way) or is not one of the
  `contenders` (it cannot beat the best by more than `costs._TOLERANCE`); a contender goes on until its cost
  is known to within `costs.PRECISION`, for `_FIRST_PASS_SHARE` of `profile_steps` at most. The refinement
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

What a limit's measurement rests on (`estimates.PowerLimitStats`, `bursts.robust_chunks`):
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
  lower one (`slower_above`), ran inside a burst. The search carries what one visit saw into the
  next (`bursts.BurstWatch`: a visit that begins inside a burst waits for it to end; visits before one that saw a burst end
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

Module map: `chunk` (one sample), `estimates` (a limit's means, variances and power windows), `bursts`
(slow stretches, and which samples are kept), `costs` (comparisons under the selector), `budget` (what
the search spends), `reference` (the reference's rules and the saving against it), this module (the
`Search`: policy, budget, choice), `schema` (the saved form), `optimizer` (phases, hooks and I/O).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import numpy as np

from zeus_callbacks.core.power_limit.budget import (
    adaptive_budget_steps,
    min_measured_steps,
    settle_steps,
    spent_steps,
)
from zeus_callbacks.core.power_limit.bursts import MAX_VISITS, BurstWatch, burst_suspects
from zeus_callbacks.core.power_limit.chunk import Chunk
from zeus_callbacks.core.power_limit.costs import (
    PRECISION,
    Z,
    best_power_limit,
    bounds,
    clearly_worse,
    contenders,
    needs_reference,
    uses_reference,
    valid,
)
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats, chunk_steps, pooled_noise, rses
from zeus_callbacks.core.power_limit.grid import power_limit_grid
from zeus_callbacks.core.power_limit.reference import (
    REFERENCE_VISITS,
    kept_reference,
    reference_lost,
    saving,
)
from zeus_callbacks.core.power_limit.selectors import OptimumSelector, select_power_limit

__all__ = [
    "Search",
    "SEARCHES",
    "power_limit_grid",
    "min_measured_steps",
    "adaptive_budget_steps",
    "spent_steps",
    "settle_steps",
    "choose_power_limit",
    "Chunk",  # the records the search rests on, for the callers that read profiles
    "PowerLimitStats",
]

logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")  # the optimizer's decisions

SEARCHES = ("adaptive", "sweep", "zeus")
# The most of `profile_steps` a contender is measured in the first pass (the refinement pass goes on).
_FIRST_PASS_SHARE = 0.5


class Search:
    """The search over one job's `grid` (W, highest first) for `selector`: which limit to visit next, how
    long each visit lasts, and which limit wins. Built once the grid is known; owns the measurements
    (`stats`), the budget and what one visit tells the next about bursts.

    Args:
        grid: The power limits to profile (`power_limit_grid`).
        selector: The objective.
        max_power_w: The job's maximum power (every GPU's maximum limit summed).
        mode: One of `SEARCHES`.
        warmup_steps: Steps at a limit before it is measured (the run's first; later ones settle).
        profile_steps: Steps measured at each limit (the most, for the adaptive search).
    """

    def __init__(
        self,
        grid: list[float],
        selector: OptimumSelector,
        max_power_w: float,
        mode: str,
        warmup_steps: int,
        profile_steps: int,
    ) -> None:
        self.grid = grid
        self.selector = selector
        self.max_power_w = max_power_w
        self.mode = mode
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.min_steps = min_measured_steps(profile_steps) if mode == "adaptive" else profile_steps
        self.stats: dict[float, PowerLimitStats] = {}
        self.spent_before = 0  # steps of a reused profile that do not count against the budget
        self.warmed_up = False  # this run's first limit had its full warm-up (later ones settle)
        self.bursts = BurstWatch()

    @property
    def by_steps(self) -> bool:
        """Whether each limit is measured for `profile_steps` steps (the sweeps, or a selector without a
        score), rather than for as long as the adaptive search needs."""
        return self.mode != "adaptive" or not self.selector.has_score()

    # -- a run and its visits ---------------------------------------------------------------------------
    def new_run(self) -> None:
        """A training run begins: its first limit warms up fully, and no burst carries over."""
        self.warmed_up = False
        self.bursts = BurstWatch()

    def next_power_limit(self) -> float | None:
        """The next power limit to profile, or None when the search is over.

        Every search first visits every limit, highest first; they differ in how long each is measured
        (`verdict`). The adaptive search then refines: while the `contenders` are unsettled and the
        budget (`adaptive_budget_steps`) allows a settling and `min_measured_steps` more, it revisits
        first a limit whose every visit ran inside a burst, then a `burst_suspects`, then the contender
        with the fewest steps among those below `profile_steps`. Before all of these, and whatever the
        budget, the reference (`grid[0]`) once it lost every sample to bursts (`REFERENCE_VISITS`).
        """
        stats, grid = self.stats, self.grid
        if self._reference_to_measure_again():
            return grid[0]
        unvisited = next((pl for pl in grid if pl not in stats), None)
        if unvisited is not None or self.by_steps or not stats:
            return unvisited
        per = chunk_steps(stats)
        budget = adaptive_budget_steps(len(grid), self.warmup_steps, self.profile_steps, per)
        spent = spent_steps(stats, self.warmup_steps) - self.spent_before
        if (
            spent + settle_steps(self.warmup_steps, per) + min_measured_steps(self.profile_steps) * per
            > budget
        ):
            return None
        lost = [
            pl
            for pl in grid
            if not stats[pl].steps and stats[pl].bad_visits and stats[pl].visits < MAX_VISITS
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
            for pl in contenders(stats, self.selector, self.max_power_w, ref, noise)
            if stats[pl].steps < self.profile_steps * per
        ]
        if not unsettled:
            return None
        return min(unsettled, key=lambda s: (s.steps, -s.power_limit_w)).power_limit_w

    def begin_visit(self, power_limit_w: float, refresh_s: float) -> tuple[PowerLimitStats, int]:
        """A visit to `power_limit_w` begins: what its samples add to (a new measurement, or a revisit's
        copy of the earlier visits'), and the steps it runs before it is measured (the run's first limit
        warms up, a later one settles for one sample's worth)."""
        earlier = self.stats.get(power_limit_w)
        if earlier is None:
            stats = PowerLimitStats(power_limit_w, refresh_s=refresh_s)
        else:
            stats = replace(earlier, visits=earlier.visits + 1, chunks=list(earlier.chunks))
        warmup = self.warmup_steps
        if self.warmed_up and not self.by_steps:
            warmup = settle_steps(self.warmup_steps, chunk_steps(self.stats))
        stats.warmed_steps = max(0, stats.warmed_steps) + warmup
        self.bursts.begin_visit()
        if warmup <= 0:
            self.warmed_up = True
        return stats, warmup

    def last_fixed_step(self, current: PowerLimitStats, chunk_steps_so_far: int) -> bool:
        """Whether a limit measured by steps has all its `profile_steps` with the chunk being measured."""
        return self.by_steps and current.spent_steps + chunk_steps_so_far >= self.profile_steps

    def verdict(self, current: PowerLimitStats, samples_done: int) -> str:
        """After a sample of `current`: `more`, `pruned` or `measured` (`measurement_verdict`, within the
        budget; a visit that began inside a burst goes on until it is seen to end; a visit of the reference
        goes on, whatever the budget, until it has `min_measured_steps` samples and a valid one)."""
        if self.by_steps:
            verdict = "measured" if current.spent_steps >= self.profile_steps else "more"
        else:
            # The budget is a hard cap on the whole search, whatever the noise: what is left of it, less
            # the least the limits not yet visited need.
            left = self.budget_left_steps(current) - self._unvisited_need_steps(current)
            is_reference = current.power_limit_w == self.grid[0]
            reference_left = self.budget_left_steps(current, True) if is_reference else 0
            if (left > 0 or reference_left > 0) and self.bursts.waits_for_end(current):
                verdict = "more"
            elif reference_left > 0 and (
                not current.steps or current.visit_samples(current.visits) < self.min_steps
            ):
                verdict = "more"  # beyond the budget if need be: the reference has a valid measurement
            elif is_reference and reference_left <= 0:
                verdict = "measured"  # its own budget spent too
            else:
                verdict = self.measurement_verdict(current, left)
        if verdict == "more" and samples_done >= 4 * self.profile_steps:
            verdict = "measured"  # the counter barely moves: settle for what was measured
        return verdict

    def end_visit(self, current: PowerLimitStats, verdict: str, samples_done: int) -> None:
        """Keep a finished visit's measurement (pruned, or empty: skipped) and what it says of bursts."""
        if not current.steps and current.power_limit_w == self.grid[0]:
            logger.info(
                "No valid measurement at %d W, the reference, after visit %d.",
                current.power_limit_w,
                current.visits,
            )
        elif not current.steps:
            logger.warning(
                "No valid measurement at %d W in %d samples (%s); skipping it.",
                current.power_limit_w,
                samples_done,
                "every sample set aside as slowed by a burst, and the search's budget is spent"
                if current.spent_steps
                else "energy counter not moving",
            )
        current.pruned = verdict == "pruned" or not current.steps
        self.stats[current.power_limit_w] = current
        if not self.by_steps:
            self.bursts.end_visit(current, self.stats, lambda pl: self._may_measure_again(pl, current))
        if self._stand_in_reference():
            # Pruned against a reference now set aside as burst-ridden: judged again once it is measured.
            for s in self.stats.values():
                s.pruned = not s.steps

    def measurement_verdict(self, current: PowerLimitStats, budget_left_steps: float = math.inf) -> str:
        """Whether the adaptive search keeps measuring `current`: `more`, `pruned` (clearly worse than the
        best so far) or `measured` (its cost known well enough, or `profile_steps` reached).

        On a revisit (`current.visits > 1`, the refinement pass) `current` is measured while it is one of
        the `contenders`, up to `profile_steps` steps in all and `budget_left_steps` more.
        """
        sel, max_power_w, max_steps = self.selector, self.max_power_w, self.profile_steps
        revisit = any(c.visit < current.visits for c in current.kept_chunks)
        if current.samples < self.min_steps and not revisit:
            return "more"
        # Every visit takes `min_steps` samples, enough to see a burst begin or end within it.
        if revisit and current.visit_samples(current.visits) < self.min_steps and budget_left_steps > 0:
            return "more"
        reference = self.stats.get(self.grid[0], current)
        same = not reference.steps or reference.power_limit_w == current.power_limit_w
        ref = current if same else reference
        others = {k: v for k, v in self.stats.items() if k != current.power_limit_w}
        measured = {**others, current.power_limit_w: current}
        noise = pooled_noise(measured)
        best = best_power_limit(others, sel, max_power_w, ref.mean_time_s)
        # A revisit is for the choice's sake (or the reference's): it ends when that is settled.
        if (
            not revisit
            and best is not None
            and not self._stand_in_reference()
            and clearly_worse(current, self.stats[best], sel, max_power_w, ref, noise)
        ):
            return "pruned"
        per = chunk_steps({0: current})
        if current.steps >= max_steps * per or budget_left_steps <= 0:
            return "measured"
        if same and not revisit and uses_reference(sel, current, max_power_w):
            # The reference: every other limit's slowdown is judged against its time, so it is known to
            # within `PRECISION` before any of them is, however alike its first samples look.
            return "measured" if Z * rses(current, noise)[0] <= PRECISION else "more"
        if current.power_limit_w not in contenders(measured, sel, max_power_w, ref, noise):
            return "measured"
        if revisit:
            return "more"
        # A contender of the best so far: known to within `PRECISION` on the first pass, as the choice
        # may still fall elsewhere, for half of `max_steps` at most; the refinement pass measures the final
        # contenders further, fewest steps first (on a flat curve every limit is a contender: measured to the
        # full `max_steps` in the first pass, the first limits spend what the last ones would need).
        if current.steps >= _FIRST_PASS_SHARE * max_steps * per:
            return "measured"
        opt, mean, pes = bounds(current, sel, max_power_w, ref, noise)
        if math.isfinite(pes) and mean > 0 and pes - opt <= 2 * PRECISION * mean:
            return "measured"
        return "more"

    # -- the budget ---------------------------------------------------------------------------------------
    def budget_left_steps(self, current: PowerLimitStats | None = None, reference: bool = False) -> int:
        """Steps the adaptive search may still spend (`adaptive_budget_steps`), `current` counted; with
        `reference`, what the reference may still take: one limit's share of a sweep more (`warmup_steps`
        and `profile_steps` samples), so that it is measured however bursts fell, within a bound."""
        stats = self.stats if current is None else {**self.stats, current.power_limit_w: current}
        per = chunk_steps(stats)
        budget = adaptive_budget_steps(len(self.grid), self.warmup_steps, self.profile_steps, per)
        if reference:
            budget += int(self.warmup_steps + self.profile_steps * per)
        return budget - (spent_steps(stats, self.warmup_steps) - self.spent_before)

    def _unvisited_need_steps(self, current: PowerLimitStats) -> float:
        """Steps the limits not visited yet (`current` aside) need at least: a settling and
        `min_measured_steps` samples each."""
        unvisited = sum(1 for pl in self.grid if pl not in self.stats and pl != current.power_limit_w)
        per = chunk_steps({**self.stats, current.power_limit_w: current})
        return unvisited * (settle_steps(self.warmup_steps, per) + self.min_steps * per)

    def _may_measure_again(self, power_limit_w: float, current: PowerLimitStats) -> bool:
        """Whether a limit's visit may still be set aside and measured again: not once the limit has had
        `MAX_VISITS` visits or the search's budget is spent (noise that keeps looking like bursts, e.g. the
        host's own on ms-long steps, must not keep profiling going for ever); the reference, until it has
        had `REFERENCE_VISITS` or its own budget is spent (`budget_left_steps`)."""
        if power_limit_w == self.grid[0]:
            visits = self.stats[power_limit_w].visits
            return visits < REFERENCE_VISITS and self.budget_left_steps(current, True) > 0
        return self.stats[power_limit_w].visits < MAX_VISITS and self.budget_left_steps(current) > 0

    def _reference_to_measure_again(self) -> bool:
        """Whether the reference lost every sample to bursts and may be visited again: under
        `REFERENCE_VISITS` visits, and its budget (`budget_left_steps`) allows a settling and
        `min_measured_steps` samples."""
        ref = self.stats.get(self.grid[0]) if self.grid else None
        if ref is None or ref.steps or not ref.dropped_steps or ref.visits >= REFERENCE_VISITS:
            return False
        per = chunk_steps(self.stats)
        need = settle_steps(self.warmup_steps, per) + self.min_steps * per
        return self.budget_left_steps(reference=True) >= need

    def _stand_in_reference(self) -> bool:
        """Whether the selector's costs rest on a stand-in for the reference (it lost every sample, and the
        selector `needs_reference`): nothing is pruned against one."""
        return reference_lost(self.stats, self.grid) and needs_reference(self.selector, self.max_power_w)

    def steps_needed(self, per_sample: float = 1.0) -> int:
        """Steps a run needs for the search to finish from the start: a sweep's `warmup_steps + profile_steps` per
        limit; the adaptive search's budget (it usually stops well before), `per_sample` steps a sample at least."""
        if self.by_steps:
            return len(self.grid) * (self.warmup_steps + self.profile_steps)
        per = max(chunk_steps(self.stats), per_sample)
        return adaptive_budget_steps(len(self.grid), self.warmup_steps, self.profile_steps, per)

    def steps_needed_text(self, wait_steps: int, per_sample: float = 1.0) -> str:
        """`steps_needed` (after `wait_steps`) in words, for the message of a run cut short."""
        limits, per_sample = len(self.grid), max(chunk_steps(self.stats), per_sample)
        needed = wait_steps + self.steps_needed(per_sample)
        if self.by_steps:
            zeus = self.mode == "zeus"
            return (
                f"profiling needs {needed} steps in one run ({wait_steps} wait + {limits} "
                f"limits x ({self.warmup_steps} warm-up + {self.profile_steps} measured)"
                + (
                    ", and epochs longer than warmup_steps + profile_steps, as an epoch's end restarts a limit"
                    if zeus
                    else ""
                )
                + ")"
            )
        grouped = (
            f"; {per_sample:.1f} steps per sample, as these steps are shorter than the energy counter's refresh"
            if per_sample > 1
            else ""
        )
        return (
            f"profiling needs at most {needed} steps in one run ({wait_steps} wait + 3/4 of "
            f"{limits} limits x ({self.warmup_steps} warm-up + {self.profile_steps} samples){grouped}), "
            "usually far fewer"
        )

    # -- saved measurements and the choice ------------------------------------------------------------
    def reuse(self, stats: dict[float, PowerLimitStats], same_search: bool) -> None:
        """Take a saved profile's measurements. Searched for another selector or search, what it pruned is
        only worse for that one: measured again if this one needs it, and its steps do not count against
        this search's budget (a sweep keeps only the limits measured fully)."""
        if not same_search:
            for s in stats.values():
                s.pruned = False
            if self.by_steps:
                stats = {pl: s for pl, s in stats.items() if s.spent_steps >= self.profile_steps}
            self.spent_before = spent_steps(stats, self.warmup_steps)
        self.stats = stats

    def choose(self) -> float:
        """The selector's choice (`choose_power_limit`), against the reference; the reference itself when it
        has no valid measurement and the selector needs it (`kept_reference`). Raises ValueError when
        nothing was measured."""
        kept = kept_reference(self.stats, self.grid, self.selector, self.max_power_w)
        if kept is not None:
            return kept
        return choose_power_limit(
            self.stats, self.selector, self.max_power_w, self.profile_steps, self.grid[0]
        )

    def rows(self) -> list[dict[str, Any]]:
        """One row per measured limit, highest first: mean step time and energy, cost, steps, pruned."""
        ref = self.stats.get(self.grid[0]) if self.grid else None
        ref_time = ref.mean_time_s if ref is not None and ref.steps else float("nan")
        rows = []
        for pl in sorted(self.stats, reverse=True):
            s = self.stats[pl]
            if not s.steps:
                continue
            m = s.measurement(self.profile_steps)
            cost = (
                float(
                    self.selector.score(
                        np.array([m.time]),
                        np.array([m.energy]),
                        self.max_power_w,
                        ref_time * self.profile_steps,
                    )[0]
                )
                if self.selector.has_score()
                else float("nan")
            )
            rows.append(
                {
                    "power_limit_w": pl,
                    "time_per_step_s": s.mean_time_s,
                    "energy_per_step_j": s.mean_energy_j,
                    "cost": cost,
                    "steps": s.steps,
                    "pruned": s.pruned,
                }
            )
        return rows

    def saving(self, power_limit_w: float | None) -> dict[str, Any]:
        """What `power_limit_w` saves and costs against the reference (`reference.saving`)."""
        return saving(self.stats, self.grid, power_limit_w)


def choose_power_limit(
    stats: dict[float, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    steps: int,
    reference_w: float | None = None,
) -> float:
    """The selector's choice among the measured limits that were not pruned, and the reference
    (`reference_w`, pruned or not, when measured: `select` judges slowdowns against the highest limit it
    is given). Highest limit first, as Zeus lists them; a Zeus-style `select(measurements)` gets only the
    measurements."""
    chosen = valid(stats)
    ref = stats.get(reference_w) if reference_w is not None else None
    if ref is not None and ref.steps and ref not in chosen:
        chosen.append(ref)
    full = [s.measurement(steps) for s in sorted(chosen, key=lambda s: -s.power_limit_w)]
    if not full:
        raise ValueError("No power limit has a valid measurement to choose from.")
    return select_power_limit(selector, full, max_power_w)
