"""The simulator's tests check what NVML answers (values, units, refreshes, windows) with an ideal sensor gain:
the figures the boards' traces and dumps give, unscaled. The gain itself (`ZEUS_CALLBACKS_SIM_IDEAL`'s
`sensor_gain`) is tested in tests/monitor/test_uncertainty.py."""

from __future__ import annotations

import pytest

from zeus_callbacks.sim import system


@pytest.fixture(autouse=True)
def _ideal_sensor_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "sensor_gain", lambda uuid: 1.0)
