"""The adaptive search's rules for a slowdown bound, the first pass, power windows and bursts, tested on
hand-made measurements (each rule here was missing before and cost a choice in the search benchmark)."""

from __future__ import annotations

import pytest
from helpers import alternating_stats as _stats

from zeus_callbacks.core.power_limit.bursts import robust_chunks, visit_bursts
from zeus_callbacks.core.power_limit.chunk import Chunk
from zeus_callbacks.core.power_limit.costs import contenders
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats, pooled_noise
from zeus_callbacks.core.power_limit.search import Search
from zeus_callbacks.core.power_limit.selectors import Energy, MaxSlowdownConstraint


def _verdict(current: PowerLimitStats, stats: dict, selector) -> str:
    """`Search.measurement_verdict` on a 250 W..100 W grid (40 profile steps: 5 samples at least)."""
    search = Search(
        [250, 225, 200, 175, 150, 125, 100], selector, 250.0, "adaptive", warmup_steps=10, profile_steps=40
    )
    search.stats = stats
    return search.measurement_verdict(current)


def test_the_reference_is_measured_to_precision_for_a_slowdown_bound():
    """Fails if the reference (the maximum limit) under a slowdown bound stops before its time is known to
    `PRECISION`."""
    # Alone at the maximum limit, 6 samples of 2% noise: its time is known to +-1.6%, not the 1.25% every
    # other limit's slowdown is judged against (a bound that changes the cost only near 1.1x).
    ref = _stats(250, 0.1, 22.0, 6)
    stats = {250: ref}
    assert _verdict(ref, stats, MaxSlowdownConstraint(1.1)) == "more"
    ref = _stats(250, 0.1, 22.0, 14)
    assert _verdict(ref, {250: ref}, MaxSlowdownConstraint(1.1)) == "measured"


def test_the_reference_is_a_contender_while_it_decides_a_contender_side_of_the_bound():
    """Fails if the reference is not measured again while its error decides on which side of the bound a
    contender lies."""
    # 175 W is 11.1% slower than 250 W: within the bound, or not, by the errors of both times together
    # (though not by the reference's alone); it would save energy, so the reference is measured again too.
    stats = {
        250: _stats(250, 0.1000, 22.0, 16),
        200: _stats(200, 0.1055, 19.5, 16),
        175: _stats(175, 0.1111, 18.0, 16),
    }
    out = contenders(stats, MaxSlowdownConstraint(1.1), 250.0, stats[250], pooled_noise(stats))
    assert 175 in out and 250 in out


def test_a_best_within_the_tolerance_past_the_bound_is_settled():
    """Fails if a best that is at most `_TOLERANCE` past the bound stays a contender."""
    # The best is 9.6% slower, known to +-0.9%: at worst 1% past the bound, as good a choice as one on it.
    # Lower limits are far past the bound; the higher ones use more energy.
    stats = {
        250: _stats(250, 0.1000, 22.0, 40),
        225: _stats(225, 0.1030, 21.5, 40),
        200: _stats(200, 0.1096, 19.0, 40),
        175: _stats(175, 0.1400, 18.0, 10),
    }
    assert contenders(stats, MaxSlowdownConstraint(1.1), 250.0, stats[250], pooled_noise(stats)) == []


def test_a_contender_is_measured_for_half_of_profile_steps_in_the_first_pass():
    """Fails if the first pass measures a contender for more or fewer than half of `profile_steps`."""
    # A near-tie with 10% noise stays a contender; the first pass stops it at half of profile_steps and
    # leaves the rest to the refinement pass, which measures the contenders with fewest steps first.
    best = _stats(250, 0.1, 20.0, 40, rel_sd=0.1)
    current = _stats(225, 0.1, 20.1, 19, rel_sd=0.1)
    stats = {250: best, 225: current}
    assert _verdict(current, stats, Energy()) == "more"
    current.add(0.1, 20.1)
    assert _verdict(current, stats, Energy()) == "measured"


def test_settling_steps_count_towards_a_one_second_power_window():
    """Fails if settling steps do not count towards a power window, or count whatever their time."""
    # 0.9 s of samples after 0.2 s of settling steps at the same limit: one window, the energy from the
    # one-second average (200 W x 0.1 s), not from the counter's rounding (0 or 40 J a sample).
    s = PowerLimitStats(250, refresh_s=0.1)
    s.add_settling(0.1, end_s=0.1)
    s.add_settling(0.1, end_s=0.2)
    for i in range(9):
        s.add(0.1, 40.0 if i % 2 else 0.0, power_w=200.0, end_s=0.2 + 0.1 * (i + 1))
    assert s.power_windows_w == [200.0] and s.mean_energy_j == pytest.approx(20.0)
    # A settling step more than `OUTLIER_FLOOR` (3%) slower than the samples does not count, even one too
    # mild to shift the visit's level (a far slower one is set aside as a burst anyway): no window.
    stalled = PowerLimitStats(250, refresh_s=0.1)
    stalled.add_settling(0.1045, end_s=0.1045)
    for i in range(9):
        stalled.add(0.1, 40.0 if i % 2 else 0.0, power_w=200.0, end_s=0.1045 + 0.1 * (i + 1))
    assert stalled.power_windows_w == []


def test_a_burst_that_began_before_the_visit_is_seen_behind_a_stronger_one():
    """Fails if bursts are looked for only once per visit: the earlier, weaker one hides behind the stronger."""
    # Steps 25% slow from the visit's start (a burst met on the way in), one fast sample, then a 45% burst
    # inside, then the true pace: the 25% one began before the visit, so the visits before it ran in it.
    per_step = [1.24, 1.28, 1.33, 0.98, 1.24, 1.41, 1.42, 1.46, 1.47, 1.43, 1.46]
    per_step += [0.99, 0.99, 1.01, 1.00, 0.99, 1.03, 1.01, 1.00]
    chunks = [Chunk(1, 0.1 * t, 20.0, visit=2) for t in per_step]
    chunks[0] = Chunk(1, chunks[0].time_s, 0.0, visit=2, settling=True)
    inside, began_before, goes_on = visit_bursts(chunks, 2)
    assert began_before and not goes_on
    assert set(range(5, 11)) <= set(inside)


def test_a_sample_well_above_the_median_is_set_aside_more_readily_than_one_below():
    """Fails if a sample above the median is set aside by the same bound as one below."""
    # 2% noise (a robust SD of 2.2%): 7% below the median is noise; 7% above it is a mild burst (steps
    # are never faster than the limit allows, but a burst slows a few of them).
    base = [1.00, 1.02, 0.98, 1.01, 0.99] * 2
    kept = robust_chunks([Chunk(1, 0.1 * t, 20.0 * t) for t in [*base, 0.93, 1.07]])
    per_step = sorted(round(c.time_s / 0.1, 4) for c in kept)
    assert 0.93 in per_step and 1.07 not in per_step


def test_a_revisit_slower_than_a_lower_limit_is_set_aside():
    """Fails if a later visit of a higher limit that is more than 10% slower than a lower limit's is kept
    (the reference measured again inside a burst: every limit's slowdown would be judged against it)."""
    from dataclasses import replace

    from zeus_callbacks.core.power_limit.bursts import BurstWatch

    ref = _stats(300, 0.1, 22.0, 5)
    ref.set_aside_visit(1)  # its first visit ran inside a burst
    ref = replace(ref, visits=2, chunks=list(ref.chunks))
    for t in (0.118, 0.12, 0.119, 0.121, 0.12):  # 17% slower than 250 W: inside a burst again
        ref.add(t, 22.0)
    stats = {300: ref, 250: _stats(250, 0.103, 21.0, 10)}
    BurstWatch().end_visit(ref, stats, lambda pl: True)
    assert 2 in ref.bad_visits and ref.steps == 0
    # Within 10% of the lower limit: kept.
    calm = replace(_stats(300, 0.1, 22.0, 5), visits=2)
    for t in (0.103, 0.104, 0.1035, 0.103, 0.1035):
        calm.add(t, 22.0)
    BurstWatch().end_visit(calm, {300: calm, 250: stats[250]}, lambda pl: True)
    assert calm.bad_visits == []
