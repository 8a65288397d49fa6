"""The figures adapters give the trainers' loggers: every metric name and prefix is made here, once."""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.accounting.ledger import LEDGER_ENV
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor

logger = logging.getLogger(__name__)

__all__ = [
    "ENERGY_PREFIX",
    "POWER_LIMIT_PREFIX",
    "PIPELINE_FREQUENCY_PREFIX",
    "EnergyReporter",
    "Rates",
    "CARBON_INTENSITY_ENV",
    "ELECTRICITY_PRICE_ENV",
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

CARBON_INTENSITY_ENV = "ZEUS_CALLBACKS_CARBON_INTENSITY"
"""gCO2eq/kWh, or a region code of the shipped table (`DE`, `US`): the reporters' default intensity."""
ELECTRICITY_PRICE_ENV = "ZEUS_CALLBACKS_ELECTRICITY_PRICE"
"""Price per kWh, or a U.S. state (`US-CA`): the reporters' default price."""
J_PER_KWH = 3.6e6
# A logging interval under two refreshes of a GPU's energy counter reads 0 J or a whole refresh (its figure is
# the counter's steps, `uncertainty.EnergyBound.edge_power_w`): it is merged into the next. So is one whose
# power reads above the board's highest power limit while it spans under this many refreshes: the refresh
# counted at its start was drawn before it. Past that, such a figure is the sensor's own (its gain), and said.
MERGE_REFRESHES = 50

_ids = itertools.count()
# The run window of a reporter of the plain energy figures (`ENERGY_PREFIX`): open on the shared monitor while
# it reports, which is how another reporter of that monitor knows (`reported_elsewhere`).
_ENERGY_RUN_WINDOW = "__zeus_callbacks_energy_run_total_"


@dataclass(frozen=True)
class Rates:
    """What a kWh emits (gCO2eq) and costs, for the reporters' `co2eq_g` and `cost` figures; None: not given.

    `describe` says where each figure comes from (a region's table row, or "given")."""

    carbon_g_per_kwh: float | None = None
    price_per_kwh: float | None = None
    describe: str = ""

    @classmethod
    def resolve(
        cls, carbon_intensity: float | str | None = None, price_per_kwh: float | str | None = None
    ) -> Rates:
        """From arguments, else `$ZEUS_CALLBACKS_CARBON_INTENSITY` / `$ZEUS_CALLBACKS_ELECTRICITY_PRICE`: a
        number, or a region (carbon: `RegionCarbonIntensity`'s codes; price: `RegionElectricityPrice`'s).

        Raises:
            InvalidInputError: a value is neither a number >= 0 nor a known region (the message says which).
        """
        carbon = _rate(carbon_intensity, CARBON_INTENSITY_ENV, "carbon_intensity")
        price = _rate(price_per_kwh, ELECTRICITY_PRICE_ENV, "price_per_kwh")
        said = []
        if isinstance(carbon, str):
            from zeus_callbacks.core.monitor.carbon import RegionCarbonIntensity

            region = RegionCarbonIntensity(carbon)
            said.append(repr(region))
            carbon = region.g_per_kwh
        if isinstance(price, str):
            from zeus_callbacks.core.monitor.price import RegionElectricityPrice

            state = RegionElectricityPrice(price)
            said.append(repr(state))
            price = state.price_per_kwh
        return cls(carbon, price, "; ".join(said))

    def figures(self, prefix: str, energy_j: float) -> dict[str, float]:
        """`{prefix}co2eq_g` and `{prefix}cost` of `energy_j`, those whose rate is given."""
        out = {}
        if self.carbon_g_per_kwh is not None:
            out[f"{prefix}co2eq_g"] = energy_j / J_PER_KWH * self.carbon_g_per_kwh
        if self.price_per_kwh is not None:
            out[f"{prefix}cost"] = energy_j / J_PER_KWH * self.price_per_kwh
        return out


def _rate(value: float | str | None, env: str, name: str) -> float | str | None:
    from zeus_callbacks.core.device.errors import InvalidInputError

    where = f"`{name}={value!r}`"
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return None
        where, value = f"{env}={raw!r}", raw
        try:
            value = float(raw)
        except ValueError:
            return raw
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidInputError(
            f"{where}: expected a number >= 0 per kWh, or a region code (e.g. 'DE', 'US-CA')."
        )
    return float(value)


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
    figures come from simulated GPUs). `energy/interval_j_bound` and `energy/total_j_bound` say how far the
    true energy may lie from the figure, either way (J, `Measurement.total_energy_bound`; absent where some
    GPU's bound is not known). Under torch.distributed the energy figures and their bounds are the whole job's
    (summed over ranks), so every rank must call `interval` and `stop` at the same points, as trainers'
    logging hooks do; `gpu<i>_interval_j` (and its `gpu<i>_interval_j_bound`) is this rank's GPU i.

    An interval too short for the energy counters is not reported on its own: a log event whose interval spans
    under two refreshes of some GPU's counter (it would read 0 J, and a later one a jump), or reads above the
    board's highest power limit while under `MERGE_REFRESHES` refreshes, gets no energy figures, and its
    energy is in the next log event's interval, which spans both. So no interval's average power is above
    what the boards can draw, for as long as their sensors read them truly.

    With a carbon intensity or a price (`Rates`), each interval and the totals also carry `..._co2eq_g` and
    `..._cost` (`energy/interval_co2eq_g`, `energy/total_cost`, ...).

    Args:
        monitor: The monitor of this process's GPUs.
        prefix: Prefix of the names; `ENERGY_PREFIX` by default. `for_power_limit_optimizer` gives the
            figures the power-limit optimizer's adapters log.
        rates: What a kWh emits and costs; default `Rates.resolve()` (the environment's, or none).
        report_path: Write the run's HTML report there at `stop` (`zeus-callbacks report`'s; its record in
            `<stem>.run/`), with the power timeline, energy per step (`step_begin` / `step_end`) and, given
            to `stop`, the optimizers' profiles.
        ledger_path: Append this rank's line to the per-job energy ledger there at each `checkpoint`, at
            `stop` (`end`) or when the run fails (`failed`); default `$ZEUS_CALLBACKS_LEDGER`, none when unset
            (`zeus_callbacks.core.accounting.ledger`, summed by `zeus-callbacks jobs`).
    """

    def __init__(
        self,
        monitor: ZeusMonitor,
        prefix: str = ENERGY_PREFIX,
        rates: Rates | None = None,
        report_path: str | os.PathLike[str] | None = None,
        ledger_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.monitor = monitor
        self.prefix = prefix
        self.rates = rates if rates is not None else Rates.resolve()
        self.report_path = report_path
        self.ledger_path = ledger_path if ledger_path is not None else os.environ.get(LEDGER_ENV) or None
        self._recorder: Any = None
        self.total_energy_j = 0.0
        self.total_time_s = 0.0
        self._running = False
        n = next(_ids)
        self._interval_window = f"__zeus_callbacks_log_interval_{n}"
        run = _ENERGY_RUN_WINDOW if prefix == ENERGY_PREFIX else "__zeus_callbacks_run_total_"
        self._total_window = f"{run}{n}"

    @classmethod
    def for_power_limit_optimizer(
        cls,
        monitor: ZeusMonitor,
        rates: Rates | None = None,
        report_path: str | os.PathLike[str] | None = None,
    ) -> EnergyReporter:
        """The reporter whose names sit with the optimizer's (`power_limit_optimizer/energy_interval_j`)."""
        return cls(monitor, prefix=f"{POWER_LIMIT_PREFIX}energy_", rates=rates, report_path=report_path)

    @property
    def running(self) -> bool:
        """Whether a run is being reported (between `start` and `stop`)."""
        return self._running

    def reported_elsewhere(self) -> bool:
        """Whether another reporter of the same monitor gives the plain energy figures (`ENERGY_PREFIX`: an
        energy monitor callback) in a run now: then this one's interval energy would say it twice."""
        return any(
            w.startswith(_ENERGY_RUN_WINDOW) and w != self._total_window for w in self.monitor.open_windows
        )

    def start(self) -> None:
        """Open the run and the first interval (at train begin)."""
        if self._running:
            return
        self.monitor.begin_window(self._total_window)
        self.monitor.begin_window(self._interval_window, sync_execution=False)
        self._running = True
        if self.report_path is not None and self._recorder is None:
            from zeus_callbacks.core.report import start_report

            self._recorder = start_report(
                os.fspath(self.report_path),
                self.monitor,
                carbon_intensity_gco2_per_kwh=self.rates.carbon_g_per_kwh,
                price_per_kwh=self.rates.price_per_kwh,
                carbon_intensity_source=self.rates.describe or None,
            )

    def step_begin(self) -> None:
        """A training step begins (the report's energy per step)."""
        if self._recorder is not None:
            self._recorder.on_step_begin()

    def step_end(self) -> None:
        """A training step ended."""
        if self._recorder is not None:
            self._recorder.on_step_end()

    def _finish_report(self, optimizers: tuple[Any, ...] = (), failed: str | None = None) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.finish(optimizers=optimizers, failed=failed)

    def interval(self) -> dict[str, float]:
        """Close the current interval, open the next, and return its figures (at each log event); {} where the
        interval is too short for the energy counters and is merged into the next (see the class)."""
        if not self._running:
            return {}
        m = self._interval_so_far()
        # Every rank learns in the same collective that a GPU failed, and they stop reporting together; and
        # whether some rank's interval is too short, and they all merge it into the next.
        energy, failed, bound, merge = _job_sums(m, self._too_short(m))
        if failed:
            self._running = False
            return {}
        if merge:
            return {}
        try:
            self.monitor.end_window(self._interval_window, sync_execution=False, cancel=True)
            self.monitor.begin_window(self._interval_window, sync_execution=False)
        except GPUError as e:  # said at the next log event, in its collective
            logger.warning("The next logging interval could not be opened: %s", e)
        assert m is not None
        p = self.prefix
        out = {
            f"{p}interval_j": energy,
            f"{p}interval_time_s": m.time,
            f"{p}interval_avg_power_w": energy / m.time if m.time > 0 else 0.0,
            f"{p}simulated": float(m.simulated),
            **self.rates.figures(f"{p}interval_", energy),
        }
        if bound is not None:
            out[f"{p}interval_j_bound"] = bound
        for i, gpu_j in m.gpu_energy.items():
            out[f"{p}gpu{i}_interval_j"] = gpu_j
            if i in m.gpu_energy_bound:
                out[f"{p}gpu{i}_interval_j_bound"] = m.gpu_energy_bound[i]
        return out

    def _interval_so_far(self) -> Measurement | None:
        """The current interval, left open; None (and reporting stops) when a GPU failed, or the interval
        could not be opened again at the last log event."""
        try:
            if self._interval_window not in self.monitor.open_windows:
                raise GPUError("the logging interval could not be opened at the last log event")
            return self.monitor.read_window(self._interval_window)
        except GPUError as e:
            self._gpu_failed(e)
            return None

    def _too_short(self, m: Measurement | None) -> bool:
        """Whether this rank's interval `m` is merged into the next (see the class): on some GPU it spans under
        two of its counter's refreshes, or reads above the board's highest power limit while it spans under
        `MERGE_REFRESHES` of them."""
        if m is None:
            return False
        for i, energy_j in m.gpu_energy.items():
            gpu = self.monitor.energy_bound(i)
            refresh = gpu.refresh_s
            if refresh and m.time < 2 * refresh:
                return True
            if gpu.top_w and m.time < MERGE_REFRESHES * refresh and energy_j > gpu.top_w * m.time:
                return True
        return False

    def _gpu_failed(self, error: GPUError) -> None:
        """A GPU failed: this reporter's figures stop (training goes on)."""
        logger.warning("Energy reporting stops: %s", error)
        self.cancel()

    def cancel(self) -> None:
        """Close both windows without figures and without a collective (training failed on this rank)."""
        if not self._running:
            return
        self._running = False
        if self._interval_window in self.monitor.open_windows:
            self.monitor.end_window(self._interval_window, sync_execution=False, cancel=True)
        if self._total_window in self.monitor.open_windows:
            if self.ledger_path is None:
                self.monitor.end_window(self._total_window, sync_execution=False, cancel=True)
            else:  # this rank's figures so far, read without a collective or a synchronisation
                self._account("failed", self._local_total())
        self._finish_report(failed="training failed")

    def _local_total(self) -> Measurement | None:
        try:
            return self.monitor.end_window(self._total_window, sync_execution=False)
        except GPUError:
            return None

    def checkpoint(self, step: int | None = None, optimizers: tuple[Any, ...] = ()) -> None:
        """The trainer saved a checkpoint: append this rank's figures since the run began to the ledger
        (`checkpoint`, with the training `step`), so that a run killed later is accounted up to here; its
        `end` line supersedes them. No collective and no synchronisation; nothing without a ledger or a run."""
        if not self._running or self.ledger_path is None:
            return
        try:
            m = self.monitor.read_window(self._total_window, sync_execution=False)
        except GPUError as e:
            logger.warning("No ledger line at this checkpoint: %s", e)
            return
        self._account("checkpoint", m, optimizers, step)

    def _account(
        self, event: str, m: Measurement | None, optimizers: tuple[Any, ...] = (), step: int | None = None
    ) -> None:
        """Append this rank's line to the ledger (nothing without a ledger or a measurement)."""
        if self.ledger_path is None or m is None:
            return
        from zeus_callbacks.core.accounting.identity import job_identity
        from zeus_callbacks.core.accounting.ledger import LedgerEntry, append

        job = job_identity()
        if job.rank is None and dist.is_distributed():
            job = replace(job, rank=dist.rank())
        energy = m.total_energy
        figures = self.rates.figures("", energy)
        limits = [getattr(o, "optimal_power_limit_w", None) for o in optimizers]
        entry = LedgerEntry(
            job=job,
            event=event,
            gpus=tuple(self.monitor.gpus[i].uuid for i in m.gpu_energy),
            energy_j=energy,
            time_s=m.time,
            co2eq_g=figures.get("co2eq_g"),
            cost=figures.get("cost"),
            power_limit_w=next((float(w) for w in limits if w is not None), None),
            simulated=m.simulated,
            energy_bound_j=m.total_energy_bound,
            step=step,
        )
        append(self.ledger_path, entry)

    def stop(self, optimizers: tuple[Any, ...] = ()) -> dict[str, float]:
        """Close both windows and return the run's totals (at train end); write the report, with
        `optimizers`' profiles (their cores: `GlobalPowerLimitOptimizer`, `PipelineFrequencyOptimizer`)."""
        if not self._running:
            return {}
        self._finish_report(optimizers)
        self.monitor.end_window(self._interval_window, sync_execution=False, cancel=True)
        self._running = False
        m: Measurement | None
        try:
            m = self.monitor.end_window(self._total_window)
        except GPUError as e:
            self._gpu_failed(e)
            m = None
        self._account("end", m, optimizers)
        energy, failed, bound, _ = _job_sums(m)
        if failed:
            return {}
        assert m is not None  # this rank's None is counted in `failed`
        self.total_energy_j, self.total_time_s = energy, m.time
        p = self.prefix
        out = {
            f"{p}total_j": energy,
            f"{p}total_time_s": m.time,
            f"{p}total_avg_power_w": energy / m.time if m.time > 0 else 0.0,
            f"{p}simulated": float(m.simulated),
            **self.rates.figures(f"{p}total_", energy),
        }
        if bound is not None:
            out[f"{p}total_j_bound"] = bound
        return out


def _job_sums(m: Measurement | None, short: bool = False) -> tuple[float, float, float | None, bool]:
    """The job's energy, whether some rank's GPU failed, the energy's bound (None where some rank's is not
    known), and whether some rank's interval is `short`, summed over ranks in one collective."""
    bound = None if m is None else m.total_energy_bound
    energy, failed, bound_j, unknown, shorts = dist.all_reduce(
        [
            m.total_energy if m else 0.0,
            float(m is None),
            bound or 0.0,
            float(m is not None and bound is None),
            float(short),
        ],
        op="sum",
    )
    return energy, failed, None if unknown else bound_j, bool(shorts)


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
    for name, suffix in (("run_co2eq_g", "total_co2eq_g"), ("run_cost", "total_cost")):
        value = next((v for k, v in totals.items() if k.endswith(suffix)), None)
        if value is not None:
            out[f"{p}{name}"] = float(value)
    for key in ("optimal_power_limit_w", "energy_saved_pct", "time_lost_pct"):
        if report.get(key) is not None:
            out[f"{p}{key}"] = float(report[key])
    return out
