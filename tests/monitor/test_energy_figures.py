"""The energy figures beside the monitor's windows: logging intervals never read above what the boards can draw
(issue 37), and every other energy figure carries its bound (issue 41): the Prometheus counters, the endpoint,
`PowerMonitor.get_energy` and the per-GPU interval metrics. Deterministic: virtual clock; where the
simulator's truth is known, the true energy is checked to lie within the bound."""

from __future__ import annotations

import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import MERGE_REFRESHES, EnergyReporter, Rates


@pytest.fixture(autouse=True)
def _sim_off():
    yield
    sim.disable()


def _true_j(system: sim.SimulatedSystem) -> list[float]:
    return [g.true_energy_mj() / 1000 for g in system.gpus]


def test_no_logging_interval_reads_above_what_the_board_can_draw():
    """Fails if a logging interval shorter than the energy counter's refresh is reported on its own: on a
    simulated A40 (300 W at most) at the default 100 ms counter refresh, 30 ms intervals read 0 J, then a
    whole refresh: 816 W."""
    system = sim.simulate("a40", virtual_clock=True, ideal="sensor_gain", seed=1)
    monitor = ZeusMonitor([0])
    top_w = monitor.gpus[0].power_limit_constraints_mw()[1] / 1000
    reporter = EnergyReporter(monitor, rates=Rates())
    reporter.start()
    reported, unreported_s = [], 0.0
    for length_s in [0.03, 0.005, 0.03, 0.03, 0.15, 0.01, 0.03, 0.5, 0.03, 0.07] * 5:
        unreported_s += system.run_step(length_s)
        out = reporter.interval()
        if out:
            reported.append(out)
            unreported_s = 0.0
    total = reporter.stop()

    p = "energy/"
    powers = [o[f"{p}interval_avg_power_w"] for o in reported]
    assert top_w == 300 and len(reported) >= 8 and max(powers) <= top_w  # merged, never above the board
    assert all(o[f"{p}interval_j"] > 0 and o[f"{p}interval_time_s"] >= 0.2 for o in reported)
    # Merged, not lost: the reported intervals and the unreported tail make up the run.
    assert sum(o[f"{p}interval_time_s"] for o in reported) + unreported_s == pytest.approx(
        total[f"{p}total_time_s"]
    )
    assert sum(o[f"{p}interval_j"] for o in reported) <= total[f"{p}total_j"]
    # The per-GPU figure carries its bound too (one GPU: the interval's).
    assert all(o[f"{p}gpu0_interval_j_bound"] == o[f"{p}interval_j_bound"] > 0 for o in reported)


def test_an_interval_above_the_board_is_merged_only_so_long():
    """A board whose sensor reads high (a gain above 1) reads above its top power however long the interval:
    after `MERGE_REFRESHES` refreshes the figure is reported, since it is the sensor's, not the counter's."""
    system = sim.simulate("a40", virtual_clock=True, ideal="sensor_gain", seed=1)
    monitor = ZeusMonitor([0])
    monitor.energy_bound(0).top_w = 10.0  # a "board" that can draw 10 W: every interval reads above it
    reporter = EnergyReporter(monitor, rates=Rates())
    reporter.start()
    seen = []
    for _ in range(3 * MERGE_REFRESHES):
        system.run_step(0.1)
        out = reporter.interval()
        if out:
            seen.append(out["energy/interval_time_s"])
    reporter.stop()
    refresh = monitor.energy_bound(0).refresh_s
    assert seen and all(t >= MERGE_REFRESHES * refresh - 1e-9 for t in seen)
