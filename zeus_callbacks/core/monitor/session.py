"""One training run of the energy monitor, as every framework adapter drives it.

The contract is the power-limit session's (`zeus_callbacks.core.power_limit.session`, whose docstring lists
every adapter and its registration points), less the optimizer: an adapter (`HFZeusMonitor`,
`LightningZeusMonitor`, `ZeusMonitorHelper`, `IgniteZeusMonitor`) builds one `EnergySession` and turns its
framework's events into these calls, and into nothing else:

=============================  =================================================================
framework event                session call
=============================  =================================================================
training begins                `start()`
a micro-batch begins / ends    `step_begin(optimizer_steps)` / `step_end(optimizer_steps)` (as the
                               power-limit session's: the report's energy per optimizer step)
a log event                    log `interval_metrics()` with the framework's loggers
a checkpoint is saved          `checkpoint(global_step)`: this rank's ledger line so far
training ends                  log `summary()` (the run's totals), then `end()`
training raised                `fail()`: no figures and no collective
=============================  =================================================================

The failure rule is the power-limit session's: a rank that raised must not enter a collective, since its
peers may be waiting in one of their own (or training on): `fail` closes the windows with
`EnergyReporter.cancel`, never `EnergyReporter.stop`.
"""

from __future__ import annotations

import os
from typing import Any

from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import EnergyReporter, Rates
from zeus_callbacks.core.monitor.steps import OptimizerSteps

__all__ = ["EnergySession"]


class EnergySession:
    """The energy reporter and its step boundaries for one energy-monitor adapter (see the module's
    docstring for the contract).

    Args:
        owner: The adapter's name, for messages (`"HFZeusMonitor"`).
        monitor: The `ZeusMonitor` of this process's GPU(s).
        carbon_intensity: gCO2eq/kWh or a region (`Rates.resolve`); default the environment's, else none.
        price_per_kwh: Price per kWh or a U.S. state (`Rates.resolve`); default the environment's, else none.
        report_path: Write the run's HTML report there at the end of training; None: no report.

    Raises:
        TypeError: `monitor` is not a `ZeusMonitor`.
        InvalidInputError: (a ValueError) a bad rate; the message names it.
    """

    def __init__(
        self,
        owner: str,
        monitor: ZeusMonitor,
        carbon_intensity: float | str | None = None,
        price_per_kwh: float | str | None = None,
        report_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(monitor, ZeusMonitor):
            raise TypeError(
                f"`{owner}(monitor={monitor!r})`: expected a zeus_callbacks.ZeusMonitor "
                "(`from zeus_callbacks import ZeusMonitor`)."
            )
        self.owner = owner
        self.monitor = monitor
        rates = Rates.resolve(carbon_intensity, price_per_kwh)
        self.reporter = EnergyReporter(monitor, rates=rates, report_path=report_path)
        self._steps = OptimizerSteps()

    @property
    def total_energy_j(self) -> float:
        """GPU energy of the last finished run (J), summed over the job's ranks."""
        return self.reporter.total_energy_j

    @property
    def total_time_s(self) -> float:
        """Duration of the last finished run (s), from `start` to `summary` or `end`."""
        return self.reporter.total_time_s

    def start(self) -> None:
        """Training begins: the run and its first interval are measured from here (idempotent)."""
        self.reporter.start()

    def step_begin(self, optimizer_steps: int = 0) -> None:
        """A micro-batch begins, with the optimizer steps taken so far; the first one opens a step."""
        if self._steps.begin(optimizer_steps):
            self.reporter.step_begin()

    def step_end(self, optimizer_steps: int | None = None) -> bool:
        """A micro-batch ended (None: the optimizer stepped in it); returns whether it closed a step."""
        if not self._steps.end(optimizer_steps):
            return False
        self.reporter.step_end()
        return True

    def interval_metrics(self, numbers_only: bool = True) -> dict[str, Any]:
        """The energy since the last log event (`energy/interval_j`, ...). A collective under
        torch.distributed: every rank calls it at the same points. `numbers_only`: as the power-limit
        session's (these figures are all numbers)."""
        return self.reporter.interval()

    def checkpoint(self, step: int | None = None) -> None:
        """The trainer saved a checkpoint at training `step`: this rank's energy so far goes to the per-job
        ledger, if one is set (`EnergyReporter.checkpoint`). No collective."""
        self.reporter.checkpoint(step)

    def summary(self, numbers_only: bool = True) -> dict[str, Any]:
        """The run's totals (`energy/total_j`, ...); the windows close and the report is written. A
        collective; empty once the run is closed."""
        return self.reporter.stop()

    def end(self) -> None:
        """Training ended: the windows are closed if `summary` did not (idempotent)."""
        self.reporter.stop()

    def fail(self) -> None:
        """Training raised on this rank: the windows are closed without figures or a collective, and the
        report is marked failed."""
        self.reporter.cancel()
