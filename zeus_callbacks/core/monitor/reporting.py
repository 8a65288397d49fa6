"""Energy figures for the trainers' loggers: per logging interval and run totals, from monitor windows."""

from __future__ import annotations

import itertools

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.monitor.monitor import ZeusMonitor

__all__ = ["EnergyReporter"]

_ids = itertools.count()


class EnergyReporter:
    """Keeps two overlapping monitor windows: the current logging interval and the whole run.

    Metric names are built here, once, for every adapter: `energy/interval_j`, `energy/interval_avg_power_w`,
    `energy/interval_time_s`, `energy/total_j`, `energy/total_time_s`, and `energy/simulated` (1.0 when the
    figures come from simulated GPUs). Under torch.distributed the energy figures are the whole job's
    (summed over ranks), so every rank must call `interval` and `stop` at the same points, as trainers'
    logging hooks do; `gpu<i>_interval_j` is this rank's GPU i.
    """

    def __init__(self, monitor: ZeusMonitor, prefix: str = "energy/") -> None:
        self.monitor = monitor
        self.prefix = prefix
        self.total_energy_j = 0.0
        self.total_time_s = 0.0
        self._running = False
        n = next(_ids)
        self._interval_window = f"__zeus_callbacks_log_interval_{n}"
        self._total_window = f"__zeus_callbacks_run_total_{n}"

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
        m = self.monitor.end_window(self._interval_window)
        self.monitor.begin_window(self._interval_window, sync_execution=False)
        energy = dist.all_reduce([m.total_energy], op="sum")[0]
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

    def stop(self) -> dict[str, float]:
        """Close both windows and return the run's totals (at train end)."""
        if not self._running:
            return {}
        self.monitor.end_window(self._interval_window, sync_execution=False, cancel=True)
        m = self.monitor.end_window(self._total_window)
        self._running = False
        energy = dist.all_reduce([m.total_energy], op="sum")[0]
        self.total_energy_j, self.total_time_s = energy, m.time
        p = self.prefix
        return {
            f"{p}total_j": energy,
            f"{p}total_time_s": m.time,
            f"{p}total_avg_power_w": energy / m.time if m.time > 0 else 0.0,
            f"{p}simulated": float(m.simulated),
        }
