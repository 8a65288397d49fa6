"""A power budget per job (issue 41): `MaxPowerConstraint(watts, per=...)` and a site's
`ZEUS_CALLBACKS_POWER_BUDGET_W` cap every power limit set, profiling and waiting included, and the choice is
the fastest profiled limit whose measured power keeps the job within it. Virtual clock, SIMULATED."""

from __future__ import annotations

import numpy as np
import pytest

from zeus_callbacks import MaxPowerConstraint, sim
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.power_budget import POWER_BUDGET_ENV
from zeus_callbacks.core.power_limit.selectors import Energy

WORK_S = 0.1


def _run(system: sim.SimulatedSystem, opt: GlobalPowerLimitOptimizer) -> list[tuple[list[int], float]]:
    """Train until the optimizer settles; each step's limits in force (mW) and the job's measured power (W)."""
    monitor = ZeusMonitor()
    steps = []
    for _ in range(3000):
        opt.on_step_begin()
        monitor.begin_window("step")
        system.run_step(WORK_S)
        m = monitor.end_window("step")
        opt.on_step_end()
        steps.append(([g.enforced_power_limit_mw for g in system.gpus], m.total_energy / m.time))
        if opt.phase in ("done", "inactive"):
            return steps
    raise AssertionError(f"optimizer still {opt.phase}")


def test_a_job_budget_is_never_exceeded_and_the_fastest_limit_within_it_is_chosen():
    """Fails if any step, waiting and profiling included, runs a GPU above its share of the job's budget,
    or measures the job above it, or if the choice is not the fastest limit within it."""
    # The A40's resnet50 draws its cap at every limit: the budget binds. The sensor and the counter are exact
    # here, so each step's measured power is the true one (a real sensor's bound: test_uncertainty.py).
    system = sim.simulate(
        "4*a40:imagenet/resnet50/256", virtual_clock=True, ideal="sensor_gain,energy_counter"
    )
    opt = GlobalPowerLimitOptimizer(
        ZeusMonitor(), MaxPowerConstraint(800, per="job"), wait_steps=3, warmup_steps=1, profile_steps=8
    )
    steps = _run(system, opt)
    assert opt.grid[0] == 200 and opt.optimal_power_limit_w == 200  # 800 W over 4 GPUs; 200 W is fastest
    assert max(max(limits) for limits, _ in steps) == 200_000  # the first step included (it waits at 200 W)
    assert max(power for _, power in steps) <= 800
    assert opt.report()["selector"] == "MaxPowerConstraint(watts=800.0, per='job')"


def test_a_sites_budget_caps_every_job_under_any_selector(monkeypatch):
    monkeypatch.setenv(POWER_BUDGET_ENV, "250")
    system = sim.simulate(
        "2*a40:imagenet/resnet50/256", virtual_clock=True, ideal="sensor_gain,energy_counter"
    )
    opt = GlobalPowerLimitOptimizer(ZeusMonitor(), Energy(), warmup_steps=1, profile_steps=8)
    steps = _run(system, opt)
    assert opt.grid[0] == 250 and max(max(limits) for limits, _ in steps) <= 250_000
    assert max(power for _, power in steps) <= 2 * 250
    assert opt.optimal_power_limit_w <= 250


def test_a_budget_below_every_limit_is_refused_with_what_to_do():
    sim.simulate("a40", virtual_clock=True)
    with pytest.raises(
        ValueError, match=r"80 W per GPU, is below the lowest limit the GPUs accept \(100 W\)"
    ):
        GlobalPowerLimitOptimizer(ZeusMonitor(), MaxPowerConstraint(80), warmup_steps=1, profile_steps=4)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf"])
def test_a_bad_site_budget_says_what_to_set(monkeypatch, value):
    monkeypatch.setenv(POWER_BUDGET_ENV, value)
    sim.simulate("a40", virtual_clock=True)
    with pytest.raises(InvalidInputError, match=f"{POWER_BUDGET_ENV}=.* is not a power in watts > 0"):
        GlobalPowerLimitOptimizer(ZeusMonitor(), Energy(), warmup_steps=1, profile_steps=4)


def test_the_constraint_keeps_the_fastest_point_whose_measured_power_is_within_the_budget():
    selector = MaxPowerConstraint(250).for_job(2)  # 500 W for the job
    time_s = np.array([1.0, 1.1, 1.3])
    energy_j = np.array([600.0, 540.0, 520.0])  # 600 W, 491 W, 400 W
    scores = selector.score(time_s, energy_j, 600.0, 1.0)
    assert np.isinf(scores[0]) and list(scores[1:]) == [1.1, 1.3]
    assert MaxPowerConstraint(1000, per="job").per_gpu_w(4) == 250
    with pytest.raises(ValueError, match="power budget in watts > 0"):
        MaxPowerConstraint(0)
    with pytest.raises(ValueError, match="must be one of"):
        MaxPowerConstraint(100, per="node")
