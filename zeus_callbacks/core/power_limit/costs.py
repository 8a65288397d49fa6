"""How limits compare under the selector's cost, with each limit's standard errors: whether one is clearly
worse than another, which is best, and which the choice is still unsure between (`contenders`).

Standard errors use the noise pooled over every limit (`pooled_noise`) as a floor (`estimates.rses`).
"""

from __future__ import annotations

import math

import numpy as np

from zeus_callbacks.core.power_limit.estimates import PowerLimitStats, rses
from zeus_callbacks.core.power_limit.selectors import OptimumSelector

__all__ = [
    "clearly_worse",
    "best_power_limit",
    "contenders",
    "valid",
    "score",
    "bounds",
    "uses_reference",
    "needs_reference",
    "Z",
    "PRECISION",
]

# Standard errors either way before a limit counts as clearly worse than the best.
Z = 2.0
# A limit is measured enough when its cost's confidence half-width (`Z` standard errors, time and
# energy errors added as if fully correlated) is below this fraction of the cost. Tuned with
# benchmarks/power_limit_search.py: 1% costs a third more steps for no gain in accuracy there.
PRECISION = 0.0125
# Two limits whose costs are within this fraction of each other are equally good choices.
_TOLERANCE = 0.01
# Standard errors each way (each limit's own, so about 1.4 times as many of their difference) within
# which a rival might still beat the best by more than `_TOLERANCE`, and is measured again.
_Z_CHOICE = 1.75
# Slowdowns at which a selector is asked whether the reference time changes its cost (1.01x to about 4x):
# a bound changes the cost only near it.
_SLOWDOWN_PROBES = 1.0 + 0.01 * 1.1 ** np.arange(60)
# Slowdowns (1.01x to about 900x, 10% apart) at which `needs_reference` asks whether a 25% longer reference
# time changes a cost: no bound between them is missed.
_ANY_SLOWDOWN = 1.0 + 0.01 * 1.1 ** np.arange(120)


def score(selector: OptimumSelector, t: float, e: float, max_power_w: float, ref_time: float) -> float:
    return float(selector.score(np.array([t]), np.array([e]), max_power_w, ref_time)[0])


def bounds(
    s: PowerLimitStats,
    selector: OptimumSelector,
    max_power_w: float,
    ref: PowerLimitStats,
    noise: tuple[float, float] = (0.0, 0.0),
    z: float = Z,
    slack: float = 0.0,
) -> tuple[float, float, float]:
    """(optimistic, mean, pessimistic) cost of `s`, `z` standard errors each way; the reference time's
    own error counts too. `slack` loosens a slowdown bound for the pessimistic cost (by that fraction
    of the reference time)."""
    rt, re_ = (min(x, 1.0) for x in rses(s, noise))
    rr = min(rses(ref, noise)[0], 1.0) if ref is not s else 0.0
    t, e, r = s.mean_time_s, s.mean_energy_j, ref.mean_time_s
    # A longer reference time loosens a slowdown bound, so it is the optimistic one.
    opt = score(selector, t * max(0.0, 1 - z * rt), e * max(0.0, 1 - z * re_), max_power_w, r * (1 + z * rr))
    mean = score(selector, t, e, max_power_w, r)
    pes_r = r * max(0.0, 1 - z * rr) * (1 + slack)
    pes = score(selector, t * (1 + z * rt), e * (1 + z * re_), max_power_w, pes_r)
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
    opt_a = bounds(a, selector, max_power_w, ref, noise)[0]
    pes_b = bounds(b, selector, max_power_w, ref, noise)[2]
    return opt_a > pes_b


def valid(stats: dict[float, PowerLimitStats]) -> list[PowerLimitStats]:
    return [s for s in stats.values() if s.steps > 0 and not s.pruned]


def best_power_limit(
    stats: dict[float, PowerLimitStats], selector: OptimumSelector, max_power_w: float, ref_time: float
) -> float | None:
    """The limit with the lowest mean cost among the measured ones (ties go to the higher limit)."""
    scores = [
        (score(selector, s.mean_time_s, s.mean_energy_j, max_power_w, ref_time), -s.power_limit_w)
        for s in valid(stats)
    ]
    return -min(scores)[1] if scores else None


def contenders(
    stats: dict[float, PowerLimitStats],
    selector: OptimumSelector,
    max_power_w: float,
    ref: PowerLimitStats,
    noise: tuple[float, float],
) -> list[float]:
    """The limits the choice is still unsure between: the best by mean cost, and every limit whose cost
    might be more than `_TOLERANCE` below the best's (optimistic bound, `_Z_CHOICE` standard errors, more
    than the tolerance under the best's pessimistic one); the best alone while its cost is not known to
    within `PRECISION`. Empty when the best is settled."""
    best = best_power_limit(stats, selector, max_power_w, ref.mean_time_s)
    if best is None:
        return []
    b = stats[best]
    bound = uses_reference(selector, b, max_power_w)
    if bound:
        # A slowdown bound: the best is within it at its mean. Whether a rival's cost beats the best's is
        # a question of energy; whether the best stays within the bound is the best's own (below), where
        # a slowdown within `_TOLERANCE` past the bound is as good as one on it.
        re_ = min(rses(b, noise)[1], 1.0)
        pes_e = b.mean_energy_j * (1 + _Z_CHOICE * re_)
        pes_best = score(selector, b.mean_time_s, pes_e, max_power_w, ref.mean_time_s)
    else:
        pes_best = bounds(b, selector, max_power_w, ref, noise, _Z_CHOICE)[2]
    rivals = [
        s.power_limit_w
        for s in valid(stats)
        if s.power_limit_w != best
        and bounds(s, selector, max_power_w, ref, noise, _Z_CHOICE)[0] * (1 + _TOLERANCE) < pes_best
    ]
    if not rivals:
        # Settled, once the best's own cost is known to within `PRECISION` (a visit too short for the
        # energy counter's rounding to average out can be off by more than the gaps between limits).
        slack = _TOLERANCE if bound else 0.0
        opt, mean, pes = bounds(b, selector, max_power_w, ref, noise, slack=slack)
        return [] if math.isfinite(pes) and pes - opt <= 4 * PRECISION * mean else [best]
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
    rt = min(rses(s, noise)[0], 1.0)
    rr = min(rses(ref, noise)[0], 1.0)
    z = _Z_CHOICE * math.sqrt(rt**2 + rr**2)
    t, e, r = s.mean_time_s, s.mean_energy_j, ref.mean_time_s
    return score(selector, t, e, max_power_w, r * (1 + z)) != score(
        selector, t, e, max_power_w, r * max(0.0, 1 - z)
    )


def uses_reference(
    selector: OptimumSelector,
    s: PowerLimitStats,
    max_power_w: float,
    probes: np.ndarray = _SLOWDOWN_PROBES,
    longer: float = 1.05,
) -> bool:
    """Whether the selector's cost near `s` depends on the reference time (a slowdown bound does), probed
    at slowdowns `probes` of `s`'s time with the reference `longer` times as long."""
    t, e = s.mean_time_s, s.mean_energy_j
    times, energies = probes * t, np.full(len(probes), e)
    return bool(
        np.any(
            selector.score(times, energies, max_power_w, t)
            != selector.score(times, energies, max_power_w, longer * t)
        )
    )


def needs_reference(selector: OptimumSelector, max_power_w: float) -> bool:
    """Whether the selector's choice depends on the reference's time at all: a slowdown bound's does (at
    any factor up to about 900x: `_ANY_SLOWDOWN`), a selector with only Zeus's `select` is taken to (Zeus
    judges slowdowns against the highest limit measured), `Time`, `Energy` and `ZeusCost` do not."""
    if not selector.has_score():
        return True
    unit = PowerLimitStats(-1, 1, 1.0, 1.0, 1.0, 1.0, samples=1)
    return uses_reference(selector, unit, max_power_w, _ANY_SLOWDOWN, 1.25)
