"""The simulator's tests check what NVML answers (values, units, refreshes, windows) with an ideal sensor gain:
the figures the boards' traces and dumps give, unscaled, in this process and in the processes it starts (the
exported `ZEUS_CALLBACKS_SIM_IDEAL`). The gain itself (`sensor_gain`) is tested in
tests/monitor/test_uncertainty.py."""

from __future__ import annotations

import pytest

from zeus_callbacks import sim
from zeus_callbacks.sim import system


@pytest.fixture(autouse=True)
def _ideal_sensor_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "sensor_gain", lambda uuid: 1.0)  # nodes built here, whatever their `ideal`
    simulate = sim.simulate

    def ideal_gain(spec: str, *, ideal: str = "", **kw) -> sim.SimulatedSystem:
        return simulate(spec, ideal=",".join(filter(None, (ideal, "sensor_gain"))), **kw)

    monkeypatch.setattr(sim, "simulate", ideal_gain)


@pytest.fixture
def host_clock(monkeypatch: pytest.MonkeyPatch):
    """`host_clock(run_queue)`: a fresh `HOST_CLOCK` (no lag, no pacing thread, alone on its node) that reads
    `run_queue(tid)` for a thread's run-queue time, put back as it was after the test; no launcher's
    `WORLD_SIZE` in the environment."""
    from zeus_callbacks.sim.host import HOST_CLOCK

    def install(run_queue) -> None:
        for name in ("wake_lag_s", "_latest", "_pacer", "_queued_at_wake", "_run_queue", "shared"):
            monkeypatch.setattr(HOST_CLOCK, name, getattr(HOST_CLOCK, name))
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        HOST_CLOCK.reset()
        HOST_CLOCK._run_queue = run_queue

    return install
