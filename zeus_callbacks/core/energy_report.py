"""Energy figures for the trainers' loggers: per logging interval and run totals, from monitor windows."""

from __future__ import annotations

from zeus_callbacks.core.monitor import ZeusMonitor

__all__ = ["EnergyReporter"]

_INTERVAL = "__zeus_callbacks_log_interval"
_TOTAL = "__zeus_callbacks_run_total"


class EnergyReporter:
    """Keeps two overlapping monitor windows: the current logging interval and the whole run.

    Metric names are built here, once, for every adapter: `energy/interval_j`, `energy/interval_avg_power_w`,
    `energy/interval_time_s`, `energy/total_j`, `energy/total_time_s`, and `energy/simulated` (1.0 when the
    figures come from simulated GPUs).
    """

    def __init__(self, monitor: ZeusMonitor, prefix: str = "energy/") -> None:
        self.monitor = monitor
        self.prefix = prefix
        self.total_energy_j = 0.0
        self.total_time_s = 0.0
        self._running = False

    def start(self) -> None:
        """Open the run and the first interval (at train begin)."""
        if self._running:
            return
        self.monitor.begin_window(_TOTAL)
        self.monitor.begin_window(_INTERVAL, sync_execution=False)
        self._running = True

    def interval(self) -> dict[str, float]:
        """Close the current interval, open the next, and return its figures (at each log event)."""
        if not self._running:
            return {}
        m = self.monitor.end_window(_INTERVAL)
        self.monitor.begin_window(_INTERVAL, sync_execution=False)
        p = self.prefix
        out = {
            f"{p}interval_j": m.total_energy,
            f"{p}interval_time_s": m.time,
            f"{p}interval_avg_power_w": m.total_energy / m.time if m.time > 0 else 0.0,
            f"{p}simulated": float(m.simulated),
        }
        for i, e in m.gpu_energy.items():
            out[f"{p}gpu{i}_interval_j"] = e
        return out

    def stop(self) -> dict[str, float]:
        """Close both windows and return the run's totals (at train end)."""
        if not self._running:
            return {}
        self.monitor.end_window(_INTERVAL, sync_execution=False, cancel=True)
        m = self.monitor.end_window(_TOTAL)
        self._running = False
        self.total_energy_j, self.total_time_s = m.total_energy, m.time
        p = self.prefix
        return {
            f"{p}total_j": m.total_energy,
            f"{p}total_time_s": m.time,
            f"{p}total_avg_power_w": m.total_energy / m.time if m.time > 0 else 0.0,
            f"{p}simulated": float(m.simulated),
        }
