"""Power readings and the energy counter's refresh period, as real NVML gives them.

`nvmlDeviceGetPowerUsage` is a one-second moving average on Ampere and newer boards (except the A100
class); the instantaneous draw comes from the field value `NVML_FI_DEV_POWER_INSTANT`. The energy counter
(`nvmlDeviceGetTotalEnergyConsumption`, mJ) only moves when the driver refreshes it, every 20-100 ms
depending on the board, so a window shorter than that reads 0 J or one whole refresh.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import TYPE_CHECKING

from zeus_callbacks.core.device.errors import GPUError, nvml_error

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU

__all__ = [
    "instant_power_mw",
    "average_power_mw",
    "one_second_power_mw",
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


def _field_value_mw(gpu: GPU, field_name: str) -> int | None:
    """A power field value (mW), or None where this NVML or GPU does not offer it."""
    nvml = gpu.nvml
    field = getattr(nvml, field_name, None)
    get = getattr(nvml, "nvmlDeviceGetFieldValues", None)
    if field is None or get is None:
        return None
    scope = getattr(nvml, "NVML_POWER_SCOPE_GPU", 0)
    try:
        value = get(gpu.handle, [(field, scope)])[0]
    except nvml.NVMLError as e:
        # Not offered: the field (NOT_SUPPORTED, INVALID_ARGUMENT), the call in an old driver's library
        # (FUNCTION_NOT_FOUND), or the whole call failing without a reason (UNKNOWN).
        if getattr(e, "value", None) in (
            nvml.NVML_ERROR_NOT_SUPPORTED,
            nvml.NVML_ERROR_INVALID_ARGUMENT,
            nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
            nvml.NVML_ERROR_UNKNOWN,
        ):
            return None
        raise nvml_error(nvml, e, "Reading power", gpu.label) from None
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        return None
    return int(value.value.uiVal)


def average_power_mw(gpu: GPU) -> int:
    """Power as `nvmlDeviceGetPowerUsage` reports it (a 1 s average on Ampere and newer), mW."""
    return gpu.power_mw()


def one_second_power_mw(gpu: GPU) -> int | None:
    """Power averaged over the last second (mW), `NVML_FI_DEV_POWER_AVERAGE`; None where the GPU or NVML
    does not offer it (before Ampere, the A100 class)."""
    return _field_value_mw(gpu, "NVML_FI_DEV_POWER_AVERAGE")


def instant_power_mw(gpu: GPU) -> int:
    """The instantaneous power draw (mW): `NVML_FI_DEV_POWER_INSTANT` where offered, else `power_mw()`."""
    value = _field_value_mw(gpu, "NVML_FI_DEV_POWER_INSTANT")
    return gpu.power_mw() if value is None else value


def energy_refresh_period_s(gpu: GPU, clock=time.monotonic) -> float | None:
    """How often `gpu`'s energy counter moves (s), measured once per GPU by polling it; None if unknown.

    Takes up to a few refresh periods (at most about 1.5 s) the first time it is asked for a GPU, and
    nothing afterwards. Unknown when the GPU has no counter, or when the counter did not move often
    enough within the time budget (an idle board, or a simulated GPU on a virtual clock).
    """
    with _periods_lock:
        if gpu.uuid in _periods:
            return _periods[gpu.uuid]
    known = gpu.backend.known_energy_refresh_s(gpu.handle)
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
    """The median time between the counter's first `_CHANGES` moves, polled every `_POLL_S` for at most
    `_BUDGET_S` on `clock`; None if it moved fewer than twice, or more slowly than `MAX_REFRESH_PERIOD_S`."""
    try:
        last = gpu.energy_mj()
        changes: list[float] = []
        deadline = clock() + _BUDGET_S
        while len(changes) < _CHANGES and clock() < deadline:
            sleep(_POLL_S)
            value = gpu.energy_mj()
            if value != last:
                changes.append(clock())
                last = value
    except GPUError as e:
        logger.warning("Could not measure the energy counter's refresh period of %s: %s", gpu.label, e)
        return None
    if len(changes) < 2:
        return None
    period = statistics.median(b - a for a, b in zip(changes, changes[1:]))  # noqa: B905
    return period if period <= MAX_REFRESH_PERIOD_S else None


def forget_refresh_periods() -> None:
    """Forget measured periods (the GPU set changed, e.g. a new simulation)."""
    with _periods_lock:
        _periods.clear()
