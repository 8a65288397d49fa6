"""The profiling-steps estimate a run cut short is told ("profiling needs at most N steps") against what a
deterministic run of the same job takes (issue 37): where steps are shorter than the energy counter's refresh,
a sample groups several of them, and the estimate counts that from the first steps on, before any sample is
closed. Virtual clock."""

from __future__ import annotations

import logging
import re

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import MaxSlowdownConstraint

# The Lightning example's options; an A40's counter refreshes every 100 ms, so a 2 ms step is 1/50 of a sample.
OPTIONS = {"wait_steps": 5, "warmup_steps": 2, "profile_steps": 8}
STEP_S = 0.002


def _run(steps: int) -> tuple[int, GlobalPowerLimitOptimizer]:
    """Train at most `steps` steps of `STEP_S` on a simulated A40 (the same seed each time); (steps run, the
    optimizer)."""
    system = sim.simulate("a40", virtual_clock=True, noise=0.02, seed=1)
    opt = GlobalPowerLimitOptimizer(ZeusMonitor([0]), MaxSlowdownConstraint(1.1), **OPTIONS)
    for i in range(steps):
        opt.on_step_begin()
        system.run_step(STEP_S)
        opt.on_step_end()
        if opt.phase == "done":
            return i + 1, opt
    return steps, opt


def test_a_run_cut_short_before_any_sample_is_told_what_a_whole_run_takes(caplog):
    """Fails if the estimate counts one step a sample while no sample has closed yet: 40 steps of 2 ms were
    told "profiling needs at most 72 steps", and the search then took 2,213."""
    ran, cut = _run(40)
    assert ran == 40 and not any(s.steps for s in cut.stats.values())  # no sample closed yet
    estimate = cut.steps_needed()
    with caplog.at_level(logging.WARNING):
        cut.on_train_end()
    (said,) = [r.getMessage() for r in caplog.records if "profiling needs" in r.getMessage()]
    assert f"profiling needs at most {estimate} steps" in said
    per_sample = float(re.search(r"([0-9.]+) steps per sample", said).group(1))
    assert 50 <= per_sample <= 51  # 100 ms of 2 ms steps, in whole steps
    sim.disable()

    whole, done = _run(100_000)
    assert done.phase == "done"
    assert whole <= estimate <= 1.5 * whole  # an upper bound, and a close one with these options
    assert done.steps_needed() >= whole
