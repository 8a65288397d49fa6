"""PowerLimitSession, the one power-limit session every adapter drives, on the virtual clock: the figures its
log events and its end-of-training summary give, exactly (the adapters' system tests assert outcomes only)."""

from __future__ import annotations

import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import POWER_LIMIT_PREFIX as P
from zeus_callbacks.core.power_limit.session import PowerLimitOptions, PowerLimitSession

STEPS, LOG_EVERY, WORK_S = 60, 15, 0.1


@pytest.fixture
def system():
    node = sim.simulate("a40", virtual_clock=True, noise=0.02, seed=3)
    yield node
    sim.disable()


def _train(system: sim.SimulatedSystem, session: PowerLimitSession) -> list[dict[str, float]]:
    """STEPS steps of WORK_S, a log event every LOG_EVERY; host time between steps (logging) is in the run."""
    logs = []
    for i in range(STEPS):
        session.step_begin()
        system.run_step(WORK_S)
        session.step_end()
        system.run_step(0.01)  # between steps: in the run's energy, in no step's
        if (i + 1) % LOG_EVERY == 0:
            logs.append(session.interval_metrics())
    return logs


def test_summary_is_the_runs_energy_and_the_intervals_add_up_to_it(system) -> None:
    """Fails if the summary's run energy is not the energy of the run's window (a window of the same monitor
    opened and closed at the same instants measures it), or if the log events' intervals miss or repeat
    some of it."""
    monitor = ZeusMonitor([0])
    session = PowerLimitSession(
        "test", monitor, PowerLimitOptions(wait_steps=1, warmup_steps=1, profile_steps=4, pl_step=100)
    )
    monitor.begin_window("the same run")
    session.start()
    logs = _train(system, session)
    summary = session.summary()
    same_run = monitor.end_window("the same run")
    session.end()

    assert summary[f"{P}run_energy_j"] == pytest.approx(same_run.total_energy, rel=1e-9)
    assert summary[f"{P}run_time_s"] == pytest.approx(same_run.time, rel=1e-9)
    assert summary[f"{P}run_avg_power_w"] == pytest.approx(same_run.total_energy / same_run.time, rel=1e-9)
    # The intervals cover the run up to the last log event (the last one is at the run's last step).
    assert sum(log[f"{P}energy_interval_j"] for log in logs) == pytest.approx(same_run.total_energy, rel=1e-9)
    # The choice and its cost, as the optimizer reports them.
    report = session.optimizer.report()
    assert summary[f"{P}optimal_power_limit_w"] == report["optimal_power_limit_w"] < 300
    assert summary[f"{P}energy_saved_pct"] == pytest.approx(report["energy_saved_pct"])
    assert 0 < summary[f"{P}profiling_energy_j"] < summary[f"{P}run_energy_j"]
    assert summary[f"{P}simulated"] == 1.0
    assert system.gpus[0].power_limit_mw == 300_000  # restored by end()
