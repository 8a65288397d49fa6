"""Record a training run for its report: power and power limit per GPU over time, energy per step, and the
optimizers' reports at the end, into `RUN_DIR/record.rank{R}.json` (see `records` for the schema)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.power import instant_power_mw
from zeus_callbacks.core.files import warn_write_failed
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.uncertainty import run_energy_bound_j
from zeus_callbacks.core.report.pipeline_plan import pipeline_plan
from zeus_callbacks.core.report.records import (
    GPUInfo,
    PowerLimitRow,
    PowerLimitSummary,
    PowerSample,
    RankRecord,
    StepSpan,
    read_record,
    write_record,
)
from zeus_callbacks.version import __version__

__all__ = ["RunRecorder", "record_path", "load_run", "RECORD_GLOB"]

logger = logging.getLogger(__name__)

RECORD_GLOB = "record.rank*.json"
# Bounds on a record's size: past them neighbours are merged (steps) or every other sample is dropped and
# the period doubled (samples), so a week-long run still makes a report a browser opens at once.
MAX_SAMPLES = 20_000
MAX_STEP_SPANS = 4_000
_MIN_INTERVAL_S = 0.05  # a sampler faster than this would cost the run more than it shows
_WRITE_EVERY_S = 60.0  # a run that dies hard still leaves a record this recent


def record_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank `rank` keeps its record in `run_dir`."""
    return Path(run_dir) / f"record.rank{rank}.json"


class RunRecorder:
    """Record a run's power timeline, energy per step and the optimizers' choices for `zeus-callbacks report`.

    Each process records its monitor's GPUs into `run_dir/record.rank{R}.json`. Power and the power limit in
    force are read through the device layer every `sample_interval_s` (a background thread waiting on an
    event, never polling; at step ends only on a virtual clock), the energy of each step from the energy
    counter (one read per GPU per step). Nothing here raises from a hook for a GPU that stops answering: it
    is logged once and recorded as missing.

    Use `RunRecorder.start(...)`, then `on_step_begin()` / `on_step_end()` each step, `finish(optimizers=...)`.

    Args:
        run_dir: The run's folder (created).
        monitor: The run's monitor; its `gpu_indices` are recorded.
        sample_interval_s: Power sampling period (s), at least 0.05.
        carbon_intensity_gco2_per_kwh: The grid's carbon intensity, for the report's CO2eq (None: not given).
        price_per_kwh: Electricity price per kWh in `currency`, for the report's cost (None: not given).
        currency: Currency of `price_per_kwh`.
        carbon_intensity_source: Where the intensity comes from (e.g. "DE, 2023 yearly average, Ember"), shown
            beside it.
        price_source: Where the price comes from, shown beside it.
        title: The report's title (default: the GPUs' model).
        background: Sample in a background thread (default: unless the GPUs' clock is virtual).
        sync_execution: Wait for the GPUs' queued work at each step's end (`ZeusMonitor.sync`), so that a
            step's energy is its own; without it, work still queued counts in a later step.

    Raises:
        ValueError: a bad interval, intensity or price.

    Example::

        rec = RunRecorder.start("runs/exp1", monitor, carbon_intensity_gco2_per_kwh=380)
        for batch in loader:
            rec.on_step_begin()
            train_step(batch)
            rec.on_step_end()
        rec.finish(optimizers=[plo])  # then: zeus-callbacks report runs/exp1 -o exp1.html
    """

    def __init__(
        self,
        run_dir: str | Path,
        monitor: ZeusMonitor,
        *,
        sample_interval_s: float = 0.5,
        carbon_intensity_gco2_per_kwh: float | None = None,
        price_per_kwh: float | None = None,
        currency: str = "USD",
        carbon_intensity_source: str | None = None,
        price_source: str | None = None,
        title: str | None = None,
        background: bool | None = None,
        sync_execution: bool = True,
    ) -> None:
        if not _is_number(sample_interval_s) or sample_interval_s < _MIN_INTERVAL_S:
            raise ValueError(
                f"`RunRecorder(sample_interval_s={sample_interval_s!r})`: expected at least "
                f"{_MIN_INTERVAL_S} s (default 0.5)."
            )
        for name, value in (
            ("carbon_intensity_gco2_per_kwh", carbon_intensity_gco2_per_kwh),
            ("price_per_kwh", price_per_kwh),
        ):
            if value is not None and (not _is_number(value) or value < 0):
                raise ValueError(f"`RunRecorder({name}={value!r})`: expected a number >= 0, or None.")
        self.path = record_path(run_dir, dist.rank())
        self._gpus = [monitor.gpus[i] for i in monitor.gpu_indices]
        self._monitor = monitor
        self._sync = bool(sync_execution)
        self._clock = monitor.gpus.clock
        self._interval = float(sample_interval_s)
        names = sorted({g.name for g in self._gpus})
        self.record = RankRecord(
            rank=dist.rank(),
            simulated=bool(monitor.simulated),
            title=title or " + ".join(names),
            started_unix_s=time.time(),
            duration_s=0.0,
            gpus=[_gpu_info(g) for g in self._gpus],
            sample_interval_s=self._interval,
            carbon_intensity_gco2_per_kwh=carbon_intensity_gco2_per_kwh,
            price_per_kwh=price_per_kwh,
            currency=str(currency),
            carbon_intensity_source=carbon_intensity_source,
            price_source=price_source,
            package_version=__version__,
        )
        self._lock = threading.Lock()
        self._warned: set[tuple[int, str]] = set()
        self._t0 = self._clock()
        self._counter0 = self._energy()
        self._step = 0
        self._step_start: tuple[float, list[float | None], list[float | None]] | None = None
        self._last_sample_t = -math.inf
        self._last_write = self._t0
        self._finished = False
        self._sample()
        self._step_start = self._now_state()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background if background is not None else not monitor.gpus.virtual_clock:
            self._thread = threading.Thread(target=self._run, name="zeus-callbacks-run-record", daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, run_dir: str | Path, monitor: ZeusMonitor, **kwargs: Any) -> RunRecorder:
        """Begin recording (same arguments as the constructor)."""
        return cls(run_dir, monitor, **kwargs)

    # -- readings ---------------------------------------------------------------------------------
    def _read(self, k: int, what: str, fn) -> float | None:
        try:
            return fn()
        except Exception as e:  # a lost GPU: recorded as missing, said once per GPU and reading
            if (k, what) not in self._warned:
                self._warned.add((k, what))
                logger.warning(
                    "Run record: %s of %s failed (%s); recorded as missing.", what, self._gpus[k], e
                )
            return None

    def _energy(self) -> list[float | None]:
        return [
            self._read(k, "energy", lambda g=g: g.energy_mj() / 1000) if g.supports_energy_counter else None
            for k, g in enumerate(self._gpus)
        ]

    def _power(self) -> tuple[list[float | None], list[float | None]]:
        power = [
            self._read(k, "power", lambda g=g: instant_power_mw(g) / 1000) for k, g in enumerate(self._gpus)
        ]
        limit = self._limits()
        return power, limit

    def _now_state(self) -> tuple[float, list[float | None], list[float | None]]:
        """(time, energy counters, power of the GPUs without a counter: their steps' energy comes from it)."""
        power = [
            None
            if g.supports_energy_counter
            else self._read(k, "power", lambda g=g: instant_power_mw(g) / 1000)
            for k, g in enumerate(self._gpus)
        ]
        return self._clock() - self._t0, self._energy(), power

    def _limits(self) -> list[float | None]:
        return [
            self._read(k, "power limit", lambda g=g: g.power_limit_mw() / 1000)
            for k, g in enumerate(self._gpus)
        ]

    def _sample(self) -> None:
        t = self._clock() - self._t0
        power, limit = self._power()
        with self._lock:
            self._last_sample_t = t
            samples = self.record.samples
            samples.append(PowerSample(round(t, 4), tuple(power), tuple(limit)))
            if len(samples) > MAX_SAMPLES:
                samples[:] = samples[::2]
                self._interval *= 2
                self.record.sample_interval_s = self._interval

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if self._clock() - self._t0 - self._last_sample_t >= 0.5 * self._interval:
                self._sample()

    # -- hooks ------------------------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """A training step begins: the time and energy since the last step's end are not its."""
        if not self._finished:
            self._step_start = self._now_state()

    def on_step_end(self) -> None:
        """A training step ended: record its time and energy per GPU (and a power sample when one is due)."""
        if self._finished or self._step_start is None:
            return
        t0, e0, p0 = self._step_start
        if self._sync:
            try:
                self._monitor.sync()
            except Exception as e:  # a lost GPU: its readings below are recorded as missing
                logger.debug("Run record: sync failed: %s", e)
        t1, e1, p1 = end = self._now_state()
        limit = self._limits()
        energy = tuple(
            _step_energy(a, b, pa, pb, t1 - t0) for a, b, pa, pb in zip(e0, e1, p0, p1, strict=True)
        )
        self._step += 1
        span = StepSpan(self._step, self._step, round(t1, 4), t1 - t0, energy, tuple(limit))
        with self._lock:
            steps = self.record.steps
            steps.append(span)
            if len(steps) > MAX_STEP_SPANS:
                steps[:] = [_merge(a, b) for a, b in zip(steps[::2], steps[1::2], strict=False)] + (
                    [steps[-1]] if len(steps) % 2 else []
                )
        self._step_start = end
        if t1 - self._last_sample_t >= self._interval:
            self._sample()
        if t1 - (self._last_write - self._t0) >= _WRITE_EVERY_S:
            self._last_write = self._clock()
            self._write()

    def finish(self, optimizers: Iterable[Any] = (), failed: str | None = None) -> Path:
        """Stop sampling, take the optimizers' reports and write the record (once; later calls only return
        the path). `optimizers`: `GlobalPowerLimitOptimizer`s and `PipelineFrequencyOptimizer`s (or their
        framework adapters, which hold one as `.optimizer`)."""
        if self._finished:
            return self.path
        self._finished = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample()
        rec = self.record
        end = self._energy()
        rec.total_energy_j = [
            None if a is None or b is None else max(0.0, b - a)
            for a, b in zip(self._counter0, end, strict=True)
        ]
        rec.total_energy_bound_j = [
            None if e is None else run_energy_bound_j(g, e, self._clock() - self._t0)
            for g, e in zip(self._gpus, rec.total_energy_j, strict=True)
        ]
        for opt in optimizers:
            opt = getattr(opt, "optimizer", opt)
            try:
                report = opt.report()
            except Exception as e:  # a report that cannot be made must not lose the rest of the record
                logger.warning("Run record: %r.report() failed: %s", opt, e)
                continue
            if "power_limits" in report:
                rec.power_limit = power_limit_summary(report)
            elif "profiling_steps" in report and "stage" in report:
                rec.pipeline = pipeline_plan(report)
        rec.finished, rec.failed = failed is None, failed
        self._write()
        return self.path

    def _write(self) -> None:
        with self._lock:
            self.record.duration_s = self._clock() - self._t0
            try:
                write_record(self.path, self.record)
            except OSError as e:  # a full disk: said once, training goes on
                warn_write_failed(logger, "run record", self.path, e)


def power_limit_summary(report: dict[str, Any]) -> PowerLimitSummary:
    """The record of `GlobalPowerLimitOptimizer.report()`."""
    rows = tuple(
        PowerLimitRow(
            power_limit_w=int(r["power_limit_w"]),
            time_per_step_s=float(r["time_per_step_s"]),
            energy_per_step_j=float(r["energy_per_step_j"]),
            cost=_finite_or_none(r.get("cost")),
            steps=int(r["steps"]),
            pruned=bool(r["pruned"]),
        )
        for r in report["power_limits"]
    )
    return PowerLimitSummary(
        selector=str(report["selector"]),
        search=str(report["search"]),
        phase=str(report["phase"]),
        rows=rows,
        optimal_power_limit_w=report.get("optimal_power_limit_w"),
        applied=bool(report.get("applied")),
        profiling_steps=int(report.get("profiling_steps", 0)),
        profiling_energy_j=float(report.get("profiling_energy_j", 0.0)),
        energy_saved_pct=_finite_or_none(report.get("energy_saved_pct")),
        time_lost_pct=_finite_or_none(report.get("time_lost_pct")),
        reason=report.get("inactive_reason") or report.get("incomplete_reason"),
        reference_power_limit_w=report.get("reference_power_limit_w"),
        energy_saved_margin_pct=_finite_or_none(report.get("energy_saved_margin_pct")),
        time_lost_measured_pct=_finite_or_none(report.get("time_lost_measured_pct")),
        time_lost_margin_pct=_finite_or_none(report.get("time_lost_margin_pct")),
    )


def load_run(run_dir: str | Path) -> list[RankRecord]:
    """Every rank's record in `run_dir`, by rank.

    Raises:
        InvalidInputError: `run_dir` is not a folder, holds no record, or holds a corrupted one.
    """
    from zeus_callbacks.core.device.errors import InvalidInputError

    path = Path(run_dir)
    if not path.exists():
        raise InvalidInputError(f"{path}: no such folder. Pass the RUN_DIR a run recorded into.")
    if not path.is_dir():
        raise InvalidInputError(
            f"{path}: not a folder. Pass the RUN_DIR a run recorded into (it holds record.rank0.json)."
        )
    files = sorted(path.glob(RECORD_GLOB))
    if not files:
        raise InvalidInputError(
            f"{path}: no run record ({RECORD_GLOB}) here. Record one with the callbacks' report_path= option, "
            "`RunRecorder`, or `zeus-callbacks demo --report demo.html`."
        )
    return sorted((read_record(f) for f in files), key=lambda r: r.rank)


def _gpu_info(gpu: Any) -> GPUInfo:
    try:
        lo, hi = gpu.power_limit_constraints_mw()
        lo_w, hi_w = lo / 1000, hi / 1000
    except Exception:  # not every GPU reports its range; the report then draws without it
        lo_w = hi_w = None
    return GPUInfo(gpu.index, gpu.uuid, gpu.name, lo_w, hi_w)


def _step_energy(
    e0: float | None, e1: float | None, p0: float | None, p1: float | None, time_s: float
) -> float | None:
    """The counter's difference, or (no counter) the mean of the two power readings times the time."""
    if e0 is not None and e1 is not None:
        return max(0.0, e1 - e0)
    if p0 is not None and p1 is not None:
        return (p0 + p1) / 2 * time_s
    return None


def _merge(a: StepSpan, b: StepSpan) -> StepSpan:
    energy = tuple(
        None if x is None or y is None else x + y for x, y in zip(a.energy_j, b.energy_j, strict=True)
    )
    return StepSpan(a.first_step, b.last_step, b.end_s, a.time_s + b.time_s, energy, b.power_limit_w)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite_or_none(value: Any) -> float | None:
    return float(value) if _is_number(value) else None
