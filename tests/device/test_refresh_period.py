"""The energy counter's refresh period, measured by polling (`core/device/power._measure`), on a fake clock: the
figures the real-clock test in tests/monitor/test_monitor.py can only bound."""

from __future__ import annotations

import logging

import pytest

from zeus_callbacks.core.device import power
from zeus_callbacks.core.device.errors import GPUError


class Counter:
    """A GPU whose energy counter moves by 1 J every `period_s` of a fake clock that only sleeps advance;
    `late` maps a sleep's index to the extra time the poller overslept then."""

    label = "GPU 0 (fake)"

    def __init__(self, period_s: float, late: dict[int, float] | None = None, fail_at: int | None = None):
        self.period_s, self.late, self.fail_at = period_s, late or {}, fail_at
        self.now, self.sleeps, self.reads = 0.0, 0, 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.late.get(self.sleeps, 0.0)
        self.sleeps += 1

    def energy_mj(self) -> int:
        self.reads += 1
        if self.reads == self.fail_at:
            raise GPUError("Reading energy of GPU 0 failed: GPU is lost")
        return int(self.now / self.period_s + 1e-9) * 1000


def measure(gpu: Counter) -> float | None:
    return power._measure(gpu, gpu.clock, gpu.sleep)


@pytest.mark.parametrize("period_s", [0.02, 0.1, 0.2])
def test_the_period_is_the_median_gap_between_counter_moves(period_s: float) -> None:
    """Fails if the period is not measured to within one poll, or if polling runs past the fourth move."""
    gpu = Counter(period_s)
    assert measure(gpu) == pytest.approx(period_s, abs=power._POLL_S)
    assert gpu.now <= power._CHANGES * period_s + power._POLL_S


def test_one_late_wake_up_does_not_move_the_median() -> None:
    """A poller that overslept by 50 ms once sees the last move late; the median of the gaps (not their mean,
    117 ms) is the period."""
    gpu = Counter(0.1, late={780: 0.05})  # asleep from 390 to 440.5 ms: the move at 400 ms is seen at 440.5
    assert measure(gpu) == pytest.approx(0.1, abs=power._POLL_S)


@pytest.mark.parametrize("period_s", [0.3, 2.0])
def test_a_counter_slower_than_any_board_is_unknown_within_the_budget(period_s: float) -> None:
    """Fails if a counter that moves less often than `MAX_REFRESH_PERIOD_S` (or twice in the budget) is
    given a period, or if polling outlasts the budget."""
    gpu = Counter(period_s)
    assert measure(gpu) is None
    assert gpu.now <= power._BUDGET_S + power._POLL_S


def test_a_failing_read_is_unknown_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    gpu = Counter(0.1, fail_at=50)
    with caplog.at_level(logging.WARNING, logger=power.__name__):
        assert measure(gpu) is None
    assert "refresh period of GPU 0 (fake)" in caplog.text and "GPU is lost" in caplog.text
