"""The selectors on hand-made measurements, and parity with Zeus 0.16's where the semantics match."""

from __future__ import annotations

import numpy as np
import pytest

from zeus_callbacks.core.power_limit.selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    Time,
    ZeusCost,
)

zeus_pl = pytest.importorskip("zeus.optimizer.power_limit")


M = PowerLimitMeasurement
# (limit W, energy J, time s): energy falls then rises, time grows as the limit falls.
HAND = [M(300, 100.0, 10.0), M(250, 90.0, 10.02), M(200, 85.0, 11.5), M(150, 95.0, 14.0), M(100, 120.0, 20.0)]


def test_choices_on_hand_made_measurements():
    """Fails if an objective changes (ZeusCost with its weights swapped; MaxSlowdownConstraint taking the
    slowest feasible limit rather than the least energy)."""
    assert Time().select(HAND) == 300
    assert Energy().select(HAND) == 200
    # eta=1 is energy, eta=0 is time; 0.5 weighs 300 W x time against energy.
    assert ZeusCost(1.0).select(HAND) == 200
    assert ZeusCost(0.0).select(HAND) == 300
    assert ZeusCost(0.5).select(HAND) == 250
    assert MaxSlowdownConstraint(1.05).select(HAND) == 250
    assert MaxSlowdownConstraint(1.2).select(HAND) == 200
    assert MaxSlowdownConstraint(10.0).select(HAND) == 200  # least energy, not the lowest limit


def test_ties_go_to_the_higher_limit():
    """Fails if a tie goes to a lower limit."""
    flat = [M(300, 50.0, 1.0), M(200, 50.0, 1.0), M(100, 50.0, 1.0)]
    for selector in (Time(), Energy(), ZeusCost(0.5), MaxSlowdownConstraint(1.1)):
        assert selector.select(flat) == 300


def test_zeus_cost_uses_the_jobs_maximum_power():
    """Fails if ZeusCost weighs time by one GPU's maximum power on a job of several (`world_size` ignored)."""
    pts = [M(300, 100.0, 10.0), M(200, 80.0, 10.1)]
    # One GPU: 0.5*100 + 0.5*300*10 = 1550 vs 0.5*80 + 0.5*300*10.1 = 1555 -> 300 W.
    assert ZeusCost(0.5).select(pts) == 300
    # Energy summed over 4 GPUs against 4 x 300 W would flip it if max power stayed 300 W; the job's max
    # power (from world_size or the optimizer) keeps the trade-off the same as on one GPU.
    four = [M(m.power_limit, 4 * m.energy, m.time) for m in pts]
    assert ZeusCost(0.5, world_size=4).select(four) == 300
    assert ZeusCost(0.5).select(four, max_power_w=1200) == 300
    assert ZeusCost(0.5).select(four) == 200  # a 1-GPU max power on a 4-GPU job: the wrong trade-off


def test_max_slowdown_reference_is_the_time_at_the_maximum_limit():
    """Fails if the slowdown is judged against the fastest time rather than the maximum limit's."""
    pts = [M(300, 100.0, 10.0), M(250, 90.0, 9.0), M(200, 80.0, 10.9), M(150, 70.0, 11.1)]
    # 250 W was faster, but the reference is 300 W's time: 200 W (10.9 <= 11.0) is feasible, 150 W not.
    assert MaxSlowdownConstraint(1.1).select(pts) == 200


def test_bad_arguments_quote_the_call():
    """Fails if an argument out of range is accepted, or its error does not quote the call."""
    with pytest.raises(ValueError, match=r"ZeusCost\(eta_knob=1.5\)"):
        ZeusCost(1.5)
    with pytest.raises(ValueError, match=r"ZeusCost\(world_size=0\)"):
        ZeusCost(0.5, world_size=0)
    with pytest.raises(ValueError, match=r"MaxSlowdownConstraint\(factor=0.9\)"):
        MaxSlowdownConstraint(0.9)
    with pytest.raises(ValueError, match="at least one measurement"):
        Energy().select([])


def test_select_only_subclass_is_supported():
    """Fails if a selector that implements only `select` is taken for one with a `score` (which the optimizer
    would then call)."""

    class Highest(OptimumSelector):
        def select(self, measurements, max_power_w=None):
            return max(m.power_limit for m in measurements)

    assert not Highest().has_score() and Energy().has_score()
    assert Highest().select(HAND) == 300


def test_zeus_style_select_with_one_argument_is_called_with_one():
    """Zeus's `OptimumSelector.select(measurements)`: the optimizer must not pass `max_power_w` to it. Fails
    if `select_power_limit` passes `max_power_w` to a one-argument `select`."""
    from zeus_callbacks.core.power_limit.selectors import select_power_limit

    class Lowest(OptimumSelector):
        def select(self, measurements):
            return min(m.power_limit for m in measurements)

    assert select_power_limit(Lowest(), HAND, 300.0) == 100
    assert select_power_limit(ZeusCost(0.5), HAND, 300.0) == 250


def _random_sets(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        limits = sorted(
            rng.choice(np.arange(100, 301, 25), size=rng.integers(2, 9), replace=False), reverse=True
        )
        time_s = 10 * (1 + np.cumsum(rng.uniform(0, 0.1, len(limits))))
        power_w = np.array(limits) * rng.uniform(0.5, 1.0, len(limits))
        # Distinct values: parity is about the objective, not about how ties are broken.
        yield [M(int(pl), float(t * p), float(t)) for pl, t, p in zip(limits, time_s, power_w, strict=True)]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (Time(), zeus_pl.Time()),
        (Energy(), zeus_pl.Energy()),
        (ZeusCost(0.5), zeus_pl.ZeusCost(0.5)),
        (ZeusCost(0.2, world_size=4), zeus_pl.ZeusCost(0.2, world_size=4)),
    ],
    ids=["Time", "Energy", "ZeusCost(0.5)", "ZeusCost(0.2,world_size=4)"],  # Zeus's reprs carry addresses
)
def test_zeus_parity(ours, theirs):
    """Fails if an objective shared with Zeus 0.16 chooses otherwise on any of 200 random measurement sets."""
    for measurements in _random_sets(200):
        zeus_ms = [
            zeus_pl.PowerLimitMeasurement(power_limit=m.power_limit, energy=m.energy, time=m.time)
            for m in measurements
        ]
        assert ours.select(measurements) == theirs.select(zeus_ms)


def test_max_slowdown_differs_from_zeus_on_purpose():
    """Zeus picks the lowest feasible limit; ours the least energy among feasible ones. They agree when
    energy falls with the limit over the feasible range, and ours never uses more energy. Fails if ours uses
    more energy than Zeus's choice or always agrees with it, or if `prefer="lowest_power_limit"` differs from
    Zeus."""
    agree = 0
    for measurements in _random_sets(300, seed=1):
        zeus_ms = [
            zeus_pl.PowerLimitMeasurement(power_limit=m.power_limit, energy=m.energy, time=m.time)
            for m in measurements
        ]
        ours = MaxSlowdownConstraint(1.1).select(measurements)
        theirs = zeus_pl.MaxSlowdownConstraint(1.1).select(zeus_ms)
        energy = {m.power_limit: m.energy for m in measurements}
        assert energy[ours] <= energy[theirs]
        agree += ours == theirs
        # One argument gives Zeus's rule.
        assert MaxSlowdownConstraint(1.1, prefer="lowest_power_limit").select(measurements) == theirs
    assert 0 < agree < 300
    assert not MaxSlowdownConstraint(1.1, prefer="lowest_power_limit").has_score()
    with pytest.raises(ValueError, match="prefer='lowest'"):
        MaxSlowdownConstraint(1.1, prefer="lowest")


@pytest.mark.parametrize(
    "selector", [MaxSlowdownConstraint(1.1), MaxSlowdownConstraint(1.1, prefer="lowest_power_limit")]
)
def test_the_choice_is_judged_against_the_reference_even_once_pruned(selector):
    """Fails if `select` is given the measured limits without the reference (pruned, or left out), so that
    a slowdown bound is judged against the highest limit left: 200 W is within 1.1x of 250 W's time, 14%
    past 300 W's."""
    from helpers import alternating_stats as _stats

    from zeus_callbacks.core.power_limit.search import choose_power_limit

    stats = {
        300: _stats(300, 0.1, 30.0, 20),
        250: _stats(250, 0.1045, 21.0, 20),
        200: _stats(200, 0.114, 18.0, 20),
    }
    stats[300].pruned = True
    assert choose_power_limit(stats, selector, 300.0, 40, reference_w=300) == 250
