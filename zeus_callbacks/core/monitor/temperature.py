"""TemperatureMonitor: a background temperature timeline per GPU, with Zeus's `zeus.monitor.temperature`
interface."""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from zeus_callbacks.core.device.errors import GPUError, GPUNotSupportedError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.telemetry import temperature_c
from zeus_callbacks.core.monitor.timeline import (
    Poller,
    Series,
    check_gpu_indices,
    check_max_samples,
    check_period,
    weak_poll,
)

__all__ = ["TemperatureMonitor", "TemperatureSample"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TemperatureSample:
    """One temperature reading (Zeus's `TemperatureSample`)."""

    timestamp: float
    gpu_index: int
    temperature_c: int


class TemperatureMonitor:
    """Sample GPU core temperatures (`nvmlDeviceGetTemperature`, °C) in the background.

    Zeus's `zeus.monitor.temperature.TemperatureMonitor`, drop-in: one daemon thread reads every GPU once per
    `update_period` and stores a reading when it changes. Timestamps come from the device layer's clock, as
    in `PowerMonitor`. A GPU without a temperature sensor (NOT_SUPPORTED) is said once and left out.

    Args:
        gpu_indices: GPUs to monitor (framework numbering); None: every visible GPU.
        update_period: Seconds between two readings (default 1 s: temperature changes slowly).
        max_samples_per_gpu: Readings kept per GPU (None: all).
        background: False starts no thread; readings are taken by `poll()`.

    Raises:
        InvalidInputError: (a ValueError) a bad argument.

    Example::

        monitor = TemperatureMonitor(gpu_indices=[0], update_period=0.5)
        train()
        timeline = monitor.get_temperature_timeline()[0]  # [(time, degrees C), ...]
        monitor.stop()
    """

    def __init__(
        self,
        gpu_indices: list[int] | None = None,
        update_period: float = 1.0,
        max_samples_per_gpu: int | None = None,
        *,
        background: bool = True,
    ) -> None:
        self.update_period: float = check_period("TemperatureMonitor", "update_period", update_period)
        max_samples = check_max_samples("TemperatureMonitor", max_samples_per_gpu)
        gpus = get_gpus()
        self.gpu_indices: list[int] = check_gpu_indices("TemperatureMonitor", gpu_indices, len(gpus))
        self.simulated: bool = gpus.simulated
        self._clock = gpus.clock
        self._gpus = [gpus[i] for i in self.gpu_indices]
        self._series = {i: Series(max_samples) for i in self.gpu_indices}
        self._skipped: dict[int, str] = {}
        self._lock = threading.Lock()
        logger.info(
            "TemperatureMonitor on %sGPUs %s every %g s.",
            "SIMULATED " if self.simulated else "",
            self.gpu_indices,
            self.update_period,
        )
        self.poll()
        self._poller: Poller | None = None
        if background:
            self._poller = Poller("zeus-callbacks-temperature-monitor", self.update_period, weak_poll(self))
            self._finalizer = weakref.finalize(self, self._poller.stop)

    def poll(self) -> None:
        """Read every monitored GPU's temperature once, now."""
        with self._lock:
            for gpu, index in zip(self._gpus, self.gpu_indices, strict=True):
                if index in self._skipped:
                    continue
                t = self._clock()
                try:
                    self._series[index].add(t, temperature_c(gpu))
                except GPUError as e:
                    self._skipped[index] = str(e)
                    why = (
                        "has no temperature sensor"
                        if isinstance(e, GPUNotSupportedError)
                        else "stopped answering"
                    )
                    logger.warning("TemperatureMonitor: %s %s (%s); left out.", gpu.label, why, e)

    def stop(self) -> None:
        """Stop sampling (idempotent; also done at garbage collection or exit)."""
        if self._poller is not None:
            self._finalizer()

    def get_temperature_timeline(
        self, gpu_index: int | None = None, start_time: float | None = None, end_time: float | None = None
    ) -> dict[int, list[tuple[float, int]]]:
        """{GPU index: [(timestamp, °C), ...]}, oldest first, within [start_time, end_time] where given."""
        indices = self.gpu_indices if gpu_index is None else [gpu_index]
        with self._lock:
            return {
                i: [(t, int(c)) for t, c in self._series[i].points(start_time, end_time)]
                for i in indices
                if i in self._series
            }

    def get_temperature(self, time: float | None = None) -> dict[int, int] | None:
        """°C per GPU: the latest reading, or the one closest to `time`; None while some GPU has none."""
        out: dict[int, int] = {}
        with self._lock:
            for i in self.gpu_indices:
                point = self._series[i].latest() if time is None else self._series[i].nearest(time)
                if point is None:
                    return None
                out[i] = int(point[1])
        return out
