"""Power readings of a GPU, and how often a reading changes: the one refresh-period probe.

A GPU's standard power reading is a one-second moving average on NVIDIA's Ampere and newer boards (except the
A100 class); the instantaneous draw is its own reading (`Device.instant_power_mw`). The energy counter only
moves when the driver refreshes it, every 20-100 ms depending on the board, so a window shorter than that reads
0 J or one whole refresh. Drivers do not report the refresh period: `measure_refresh_s` polls a reading to find
it (the energy counter here, the power reading in `monitor/power_readings.py`).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from zeus_callbacks.core.device.errors import GPUError

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = [
    "instant_power_mw",
    "average_power_mw",
    "one_second_power_mw",
    "measure_refresh_s",
    "energy_refresh_period_s",
    "forget_refresh_periods",
    "MAX_REFRESH_PERIOD_S",
]

logger = logging.getLogger(__name__)

# No board refreshes its counter more slowly than this; a counter still frozen after the measurement's
# time budget is reported as unknown rather than guessed.
MAX_REFRESH_PERIOD_S = 0.25
_CHANGES = 4  # counter steps observed to estimate the period (the first one only marks a start)
_BUDGET_S = 1.5
_POLL_S = 0.0005

_periods: dict[str, float | None] = {}
_periods_lock = threading.Lock()


def average_power_mw(gpu: GPU) -> int:
    """Power as the vendor averages it (NVIDIA: `nvmlDeviceGetPowerUsage`, a 1 s average on Ampere and newer)."""
    return gpu.device.average_power_mw()


def one_second_power_mw(gpu: GPU) -> int | None:
    """Power averaged over the last second (mW); None where the GPU does not offer it (NVIDIA: before Ampere,
    the A100 class)."""
    return gpu.device.one_second_power_mw()


def instant_power_mw(gpu: GPU) -> int:
    """The instantaneous power draw (mW) where offered, else `power_mw()`."""
    return gpu.device.instant_power_mw()


def measure_refresh_s(
    read: Callable[[], object],
    *,
    changes: int,
    budget_s: float,
    poll_s: float,
    min_changes: int = 2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """How often `read()` changes (s): the median time between its first `changes` changes, polled every
    `poll_s` for at most `budget_s` on `clock`; None if it changed fewer than `min_changes` times.

    The median, not the mean, so that one late wake-up of the poller does not move it.
    """
    last = read()
    seen: list[float] = []
    deadline = clock() + budget_s
    while len(seen) < changes and clock() < deadline:
        sleep(poll_s)
        value = read()
        if value != last:
            seen.append(clock())
            last = value
    if len(seen) < min_changes:
        return None
    return statistics.median(b - a for a, b in zip(seen, seen[1:], strict=False))


def energy_refresh_period_s(gpu: GPU, clock=time.monotonic) -> float | None:
    """How often `gpu`'s energy counter moves (s), measured once per GPU by polling it; None if unknown.

    Takes up to a few refresh periods (at most about 1.5 s) the first time it is asked for a GPU, and
    nothing afterwards. Unknown when the GPU has no counter, or when the counter did not move often
    enough within the time budget (an idle board, or a simulated GPU on a virtual clock).
    """
    with _periods_lock:
        if gpu.uuid in _periods:
            return _periods[gpu.uuid]
    known = gpu.backend.known_energy_refresh_s(gpu.device)
    if known is not None:
        period: float | None = known or None  # 0: a counter that is always current
    elif gpu.supports_energy_counter and not gpu.backend.virtual_clock:
        period = _measure(gpu, clock)
    else:  # a virtual clock only moves with simulated work, so polling cannot see the counter refresh
        period = None
    if period is not None:
        logger.info("%s: energy counter refreshes every %.0f ms.", gpu.label, period * 1000)
    with _periods_lock:
        _periods[gpu.uuid] = period
    return period


def _measure(gpu: GPU, clock, sleep=time.sleep) -> float | None:
    """The energy counter's period by `measure_refresh_s` (`_CHANGES` moves, polled every `_POLL_S` for at most
    `_BUDGET_S`); None if it moved fewer than twice, or more slowly than `MAX_REFRESH_PERIOD_S`."""
    try:
        period = measure_refresh_s(
            gpu.energy_mj, changes=_CHANGES, budget_s=_BUDGET_S, poll_s=_POLL_S, clock=clock, sleep=sleep
        )
    except GPUError as e:
        logger.warning("Could not measure the energy counter's refresh period of %s: %s", gpu.label, e)
        return None
    return period if period is not None and period <= MAX_REFRESH_PERIOD_S else None


def forget_refresh_periods() -> None:
    """Forget measured periods (the GPU set changed, e.g. a new simulation)."""
    with _periods_lock:
        _periods.clear()
