"""The figures adapters give the trainers' loggers: every metric name and prefix is made here, once."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

__all__ = [
    "ENERGY_PREFIX",
    "POWER_LIMIT_PREFIX",
    "PIPELINE_FREQUENCY_PREFIX",
    "EnergyReporter",
    "run_summary",
    "power_limit_metrics",
    "pipeline_frequency_metrics",
]

ENERGY_PREFIX = "energy/"
"""Prefix of the energy monitor's metrics (`energy/interval_j`, `energy/total_j`, ...)."""
POWER_LIMIT_PREFIX = "power_limit_optimizer/"
"""Prefix of the power-limit optimizer's metrics, its energy figures included (`.../energy_interval_j`)."""
PIPELINE_FREQUENCY_PREFIX = "pipeline_frequency_optimizer/"
"""Prefix of the pipeline-frequency optimizer's metrics."""

_ids = itertools.count()


def _prefixed(prefix: str, metrics: Mapping[str, float | str], numbers_only: bool) -> dict[str, float | str]:
    return {f"{prefix}{k}": v for k, v in metrics.items() if not numbers_only or isinstance(v, (int, float))}


def power_limit_metrics(
    metrics: Mapping[str, float | str], *, numbers_only: bool = True
) -> dict[str, float | str]:
    """`GlobalPowerLimitOptimizer.metrics()` named for the loggers (`power_limit_optimizer/...`): numbers
    only (trackers take numbers; MLflow warns at every string), the same names for every framework.
    """
    return _prefixed(POWER_LIMIT_PREFIX, metrics, numbers_only)


def pipeline_frequency_metrics(
    metrics: Mapping[str, float | str], *, numbers_only: bool = False
) -> dict[str, float | str]:
    """`PipelineFrequencyOptimizer.metrics()` named for the loggers (`pipeline_frequency_optimizer/...`).

    `numbers_only` drops the strings (the phase), for loggers that take numbers only (Lightning's).
    """
    return _prefixed(PIPELINE_FREQUENCY_PREFIX, metrics, numbers_only)


class EnergyReporter:
    """Keeps two overlapping monitor windows: the current logging interval and the whole run.

    Metric names are built here, once, for every adapter: `energy/interval_j`, `energy/interval_avg_power_w`,
    `energy/interval_time_s`, `energy/total_j`, `energy/total_time_s`, and `energy/simulated` (1.0 when the
    figures come from simulated GPUs). Under torch.distributed the energy figures are the whole job's
    (summed over ranks), so every rank must call `interval` and `stop` at the same points, as trainers'
    logging hooks do; `gpu<i>_interval_j` is this rank's GPU i.

    Args:
        monitor: The monitor of this process's GPUs.
        prefix: Prefix of the names; `ENERGY_PREFIX` by default. `for_power_limit_optimizer` gives the
            figures the power-limit optimizer's adapters log.
    """

    def __init__(self, monitor: ZeusMonitor, prefix: str = ENERGY_PREFIX) -> None:
        self.monitor = monitor
        self.prefix = prefix
        self.total_energy_j = 0.0
        self.total_time_s = 0.0
        self._running = False
        n = next(_ids)
        self._interval_window = f"__zeus_callbacks_log_interval_{n}"
        self._total_window = f"__zeus_callbacks_run_total_{n}"

    @classmethod
    def for_power_limit_optimizer(cls, monitor: ZeusMonitor) -> EnergyReporter:
        """The reporter whose names sit with the optimizer's (`power_limit_optimizer/energy_interval_j`)."""
        return cls(monitor, prefix=f"{POWER_LIMIT_PREFIX}energy_")

    @property
    def running(self) -> bool:
        """Whether a run is being reported (between `start` and `stop`)."""
        return self._running

    def start(self) -> None:
        """Open the run and the first interval (at train begin)."""
        if self._running:
            return
        self.monitor.begin_window(self._total_window)
        self.monitor.begin_window(self._interval_window, sync_execution=False)
        self._running = True

    def interval(self) -> dict[str, float]:
        """Close the current interval, open the next, and return its figures (at each log event)."""
        if not self._running:
            return {}
        try:
            m = self.monitor.end_window(self._interval_window)
            self.monitor.begin_window(self._interval_window, sync_execution=False)
        except GPUError as e:
            m = self._gpu_failed(e)
        # Every rank learns in the same collective that a GPU failed, and they stop reporting together.
        energy, failed = dist.all_reduce([m.total_energy if m else 0.0, float(m is None)], op="sum")
        if failed:
            self._running = False
            return {}
        p = self.prefix
        out = {
            f"{p}interval_j": energy,
            f"{p}interval_time_s": m.time,
            f"{p}interval_avg_power_w": energy / m.time if m.time > 0 else 0.0,
            f"{p}simulated": float(m.simulated),
        }
        for i, e in m.gpu_energy.items():
            out[f"{p}gpu{i}_interval_j"] = e
        return out

    def _gpu_failed(self, error: GPUError) -> None:
        """A GPU failed: this reporter's figures stop (training goes on)."""
        logging.getLogger(__name__).warning("Energy reporting stops: %s", error)
        self.cancel()

    def cancel(self) -> None:
        """Close both windows without figures and without a collective (training failed on this rank)."""
        if not self._running:
            return
        self._running = False
        for window in (self._interval_window, self._total_window):
            if window in self.monitor.open_windows:
                self.monitor.end_window(window, sync_execution=False, cancel=True)

    def stop(self) -> dict[str, float]:
        """Close both windows and return the run's totals (at train end)."""
        if not self._running:
            return {}
        self.monitor.end_window(self._interval_window, sync_execution=False, cancel=True)
        self._running = False
        try:
            m = self.monitor.end_window(self._total_window)
        except GPUError as e:
            m = self._gpu_failed(e)
        energy, failed = dist.all_reduce([m.total_energy if m else 0.0, float(m is None)], op="sum")
        if failed:
            return {}
        self.total_energy_j, self.total_time_s = energy, m.time
        p = self.prefix
        return {
            f"{p}total_j": energy,
            f"{p}total_time_s": m.time,
            f"{p}total_avg_power_w": energy / m.time if m.time > 0 else 0.0,
            f"{p}simulated": float(m.simulated),
        }


def run_summary(report: Mapping[str, Any], totals: Mapping[str, float]) -> dict[str, float]:
    """The end-of-training figures of a power-limit optimizer's run, numbers only, named once
    (`power_limit_optimizer/run_energy_j`, ...): the run's energy, time and average power (`totals`:
    `EnergyReporter.stop()`), the profiling cost, the chosen limit and the saving against the maximum
    limit (from `GlobalPowerLimitOptimizer.report()`), and `simulated`."""
    p = POWER_LIMIT_PREFIX
    energy = next((v for k, v in totals.items() if k.endswith("total_j")), 0.0)
    time_s = next((v for k, v in totals.items() if k.endswith("total_time_s")), 0.0)
    out = {
        f"{p}run_energy_j": float(energy),
        f"{p}run_time_s": float(time_s),
        f"{p}run_avg_power_w": float(energy / time_s) if time_s > 0 else 0.0,
        f"{p}profiling_steps": float(report.get("profiling_steps", 0)),
        f"{p}profiling_energy_j": float(report.get("profiling_energy_j", 0.0)),
        f"{p}simulated": float(bool(report.get("simulated"))),
    }
    for key in ("optimal_power_limit_w", "energy_saved_pct", "time_lost_pct"):
        if report.get(key) is not None:
            out[f"{p}{key}"] = float(report[key])
    return out
