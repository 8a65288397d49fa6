"""ZeusMonitor: named, nestable, overlapping windows of time and GPU energy."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from zeus_callbacks.core.device.errors import GPUError, GPULostError, InvalidInputError
from zeus_callbacks.core.device.gpus import GPU, get_gpus
from zeus_callbacks.core.device.power import (
    MAX_REFRESH_PERIOD_S,
    energy_refresh_period_s,
    instant_power_mw,
    one_second_power_mw,
)
from zeus_callbacks.core.monitor import checks, rapl
from zeus_callbacks.core.monitor.power_sampler import PowerSampler
from zeus_callbacks.core.monitor.timeline import check_gpu_indices
from zeus_callbacks.core.monitor.uncertainty import EnergyBound, power_sensor

__all__ = ["ZeusMonitor", "Measurement", "MeasurementState", "energy_bound_of"]

logger = logging.getLogger(__name__)

# An open window: its start, the GPU counters (mJ) and the indices they are of, the RAPL counters (µJ) or None.
_WindowState = tuple[float, list[int], list[int], list[tuple[int, int | None]] | None]


@dataclass(slots=True)
class Measurement:
    """Time and energy of one window.

    Attributes:
        time: Elapsed time (s).
        gpu_energy: Energy (J) per GPU index.
        cpu_energy: Energy (J) per CPU package (RAPL), or None when CPU energy is not measured.
        dram_energy: DRAM energy (J) per CPU package, or None where RAPL has no DRAM counter.
        simulated: True when the GPUs are simulated: the figures are a simulation, not a measurement.
        gpu_energy_bound: How far each GPU's true energy may lie from `gpu_energy` (J, either way), per GPU
            index; a GPU whose bound cannot be known is absent (`core/monitor/uncertainty.py`).
    """

    time: float
    gpu_energy: dict[int, float]
    cpu_energy: dict[int, float] | None = None
    dram_energy: dict[int, float] | None = None
    simulated: bool = False
    gpu_energy_bound: dict[int, float] = field(default_factory=dict)

    @property
    def total_energy(self) -> float:
        """GPU energy summed over GPUs (J)."""
        return sum(self.gpu_energy.values())

    @property
    def total_energy_bound(self) -> float | None:
        """How far the true `total_energy` may lie from it (J): the GPUs' bounds summed; None when some GPU's
        bound is not known."""
        bound = self.gpu_energy_bound
        if len(bound) < len(self.gpu_energy) and any(i not in bound for i in self.gpu_energy):
            return None
        return sum(bound[i] for i in self.gpu_energy)


@dataclass(slots=True)
class MeasurementState:
    """Where an open window began (Zeus's `MeasurementState`): its start time and the counters then.

    Attributes:
        time: Start time (s, the monitor's clock).
        gpu_energy: Energy counter (J) per GPU index with a counter.
        cpu_energy: RAPL package counter (J) per CPU package, or None.
        dram_energy: RAPL DRAM counter (J) per CPU package, or None.
    """

    time: float
    gpu_energy: dict[int, float]
    cpu_energy: dict[int, float] | None = None
    dram_energy: dict[int, float] | None = None

    @property
    def total_energy(self) -> float:
        """GPU counters summed (J)."""
        return sum(self.gpu_energy.values())


class ZeusMonitor:
    """Measure the time and GPU energy of named windows, as Zeus's `ZeusMonitor` does.

    Windows may nest and overlap; each is opened with `begin_window(name)` and closed with
    `end_window(name)`, which returns a `Measurement`. Energy comes from NVML's energy counter (Volta and
    newer) or, on older GPUs, from power sampled in the background and integrated over the window. CPU
    package and DRAM energy come from RAPL (`/sys/class/powercap`) where the machine lets this process
    read it; otherwise they are None (said once, when `cpu_indices` asked for them).

    Args:
        gpu_indices: GPUs to measure, as the framework numbers them (after `CUDA_VISIBLE_DEVICES`).
            Default: every visible GPU. Under torch.distributed, pass only this rank's GPU. A single
            index is taken as a list of one.
        cpu_indices: CPU packages to measure through RAPL. Default: every readable package (none, quietly,
            where RAPL is absent or root-only); `[]`: none. Packages asked for but not readable are
            reported once with the reason and left out.
        approx_instant_energy: For a window shorter than a GPU's energy-counter refresh period (which
            would read 0 J or one whole refresh), report instantaneous power x time instead, as Zeus does.
            Without it such a window keeps the counter's figure and the monitor warns once per GPU.
        log_file: Path of a CSV log in Zeus's format (`start_time,window_name,elapsed_time,gpu<i>_energy`).
        sync_execution_with: "torch" to wait for queued GPU work before reading the counters.
        power_sample_interval_s: Sampling period for GPUs without an energy counter.

    Raises:
        InvalidInputError: (a ValueError) `gpu_indices` is not a list of distinct visible GPU indices, no
            GPU is visible (with the default `gpu_indices`), or `power_sample_interval_s` is under 1 ms.
        NVMLUnavailableError: no GPU and no simulation selected (the message says how to select one).

    Example::

        monitor = ZeusMonitor(gpu_indices=[0])
        monitor.begin_window("epoch")
        train_one_epoch()
        m = monitor.end_window("epoch")
        seconds, joules = m.time, m.total_energy
    """

    def __init__(
        self,
        gpu_indices: Sequence[int] | None = None,
        cpu_indices: Sequence[int] | None = None,
        approx_instant_energy: bool = False,
        log_file: str | Path | None = None,
        sync_execution_with: str = "torch",
        power_sample_interval_s: float = 0.1,
    ) -> None:
        interval = power_sample_interval_s
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not 0.001 <= interval < math.inf
        ):
            raise InvalidInputError(
                f"`ZeusMonitor(power_sample_interval_s={interval!r})`: expected a number of seconds of at "
                "least 0.001 (default 0.1)."
            )
        self.gpus = get_gpus()
        gpu_indices = check_gpu_indices("ZeusMonitor", gpu_indices, len(self.gpus), cpu_only=True)
        if sync_execution_with not in ("torch",):
            raise ValueError(
                f"`ZeusMonitor(sync_execution_with={sync_execution_with!r})`: only 'torch' is supported."
            )
        self.gpu_indices: list[int] = list(gpu_indices)
        self.approx_instant_energy = checks.flag(
            "ZeusMonitor", "approx_instant_energy", approx_instant_energy
        )
        self._short_warned: set[int] = set()
        # Windows shorter than this may fall between two refreshes of a GPU's energy counter.
        self._short_s = MAX_REFRESH_PERIOD_S
        self.simulated = self.gpus.simulated
        self._clock = self.gpus.clock
        devices = [self.gpus[i] for i in self.gpu_indices]
        self._counter = [g for g in devices if g.supports_energy_counter]
        self._counter_indices = [g.index for g in self._counter]
        self._read_counters = self.gpus.energy_reader(self._counter_indices)
        sampled = [g for g in devices if not g.supports_energy_counter and g.supports_power_reading]
        self._sampled_indices = [g.index for g in sampled]
        # The bound of each GPU's windows: its generation's sensor and its counter's refresh (uncertainty.py).
        self._bounds = {g.index: energy_bound_of(g) for g in devices}
        bounds = [self._bounds[i] for i in self._sampled_indices]
        self._sampler = (
            PowerSampler(sampled, self._clock, power_sample_interval_s, bounds) if sampled else None
        )
        # GPUs that stopped answering -> why: left out of every later window (said once each).
        self._lost: dict[int, str] = {}
        self._live_indices: list[int] = list(self.gpu_indices)
        self._rapl = rapl.monitored_packages(checks.cpu_indices(cpu_indices))
        self.cpu_indices: list[int] = [p.index for p in self._rapl]
        self._windows: dict[str, _WindowState] = {}
        self._log: TextIO | None = None
        if log_file is not None:
            self._log = checks.open_log("ZeusMonitor", log_file)
            cols = ",".join(f"gpu{i}_energy" for i in self.gpu_indices)
            self._log.write(f"start_time,window_name,elapsed_time,{cols}\n")
            self._log.flush()
        if self.simulated:
            logger.info("ZeusMonitor on SIMULATED GPUs %s: figures are a simulation.", self.gpu_indices)

    def sync(self) -> None:
        """Wait for the work queued on the monitored GPUs (those still answering)."""
        self.gpus.synchronize(self._live_indices)

    @property
    def lost_gpus(self) -> dict[int, str]:
        """GPUs that stopped answering (index -> why), left out of every window since: their energy is
        missing from `Measurement.gpu_energy` (not 0 J) while the others are still measured."""
        return dict(self._lost)

    def _read_answering(self) -> list[int]:
        """The counters of the GPUs that still answer, read one by one after a batched read failed: a GPU
        that does not answer is left out from now on (said once), the reader rebuilt for the others.

        Raises:
            GPULostError: no monitored GPU answers any more (nothing is left to measure).
        """
        counters, answering = [], []
        for i in self._counter_indices:
            try:
                counters.extend(self.gpus.energy_reader([i])())
                answering.append(i)
            except GPUError as e:
                self._lose(i, e)
        self._counter_indices = answering  # a new list: open windows keep the one they began with
        self._read_counters = self.gpus.energy_reader(answering)
        if not answering and self._sampler is None:
            raise GPULostError(
                f"ZeusMonitor: no monitored GPU answers any more ({'; '.join(self._lost.values())})"
            )
        return counters

    def _lose(self, index: int, error: Exception) -> None:
        self._lost[index] = str(error)
        self._live_indices = [i for i in self._live_indices if i != index]
        logger.warning(
            "ZeusMonitor: %s. GPU %d is left out of every window from now on (its energy is missing from "
            "`gpu_energy`, not 0 J); the other GPUs are still measured.",
            str(error).rstrip("."),
            index,
        )

    def one_second_power_w(self) -> float | None:
        """The monitored GPUs' power averaged over the last second (W, summed), as they report it
        (`NVML_FI_DEV_POWER_AVERAGE`, Ampere and newer except the A100 class); None where one does not."""
        readings = [one_second_power_mw(self.gpus[i]) for i in self._live_indices]
        known = [r for r in readings if r is not None]
        return sum(known) / 1000 if len(known) == len(readings) else None

    # begin_window/end_window are the hot path (called every step): plain tuples and inlined reads.
    def begin_window(self, key: str, sync_execution: bool = True, restart: bool = False) -> None:
        """Open the window `key`; with `restart`, an open window of that name is dropped and begun again
        (as in Zeus: for a notebook cell that failed between `begin_window` and `end_window`).

        Raises:
            ValueError: a window named `key` is already open (and not `restart`).
        """
        if not isinstance(key, str):
            checks.window_key(key)
        if key in self._windows:
            if not restart:
                raise ValueError(
                    f"Measurement window {key!r} already exists: it is already open. End it before "
                    "beginning it again, or pass `restart=True`."
                )
            del self._windows[key]
            logger.info("Measurement window %r restarted.", key)
        if sync_execution:
            self.gpus.synchronize(self._live_indices)
        start = self._clock()
        indices = self._counter_indices
        try:
            counters = self._read_counters()
        except GPUError:
            counters = self._read_answering()
            indices = self._counter_indices
        cpu = [p.read_uj() for p in self._rapl] if self._rapl else None
        self._windows[key] = (start, counters, indices, cpu)

    def end_window(self, key: str, sync_execution: bool = True, cancel: bool = False) -> Measurement:
        """Close the window `key` and return its time and energy, each GPU's with its bound (`gpu_energy_bound`:
        the sensor's gain, the counter's refresh against the window, sampled or approximated power;
        docs/energy-uncertainty.md). Zeros when `cancel`, and not logged.

        Raises:
            ValueError: no window named `key` is open.
        """
        state = self._open_window(key)
        del self._windows[key]
        return self._measure(key, state, sync_execution, cancel)

    def read_window(self, key: str, sync_execution: bool = True) -> Measurement:
        """The window `key` so far, as `end_window` would give it now, and leave it open (a checkpoint's
        figures, or a figure that is not reported until the window is long enough); not logged.

        Raises:
            ValueError: no window named `key` is open.
        """
        return self._measure(key, self._open_window(key), sync_execution, log=False)

    def _open_window(self, key: str) -> _WindowState:
        try:
            return self._windows[key]
        except KeyError:
            raise ValueError(
                f"Measurement window {key!r} does not exist: it was not begun (open: {sorted(self._windows)})."
            ) from None

    def energy_bound(self, index: int) -> EnergyBound:
        """What the monitor knows of GPU `index`'s energy figures (`uncertainty.EnergyBound`): its counter's
        refresh (`refresh_s`), its highest settable power limit (`top_w`, 0 where unknown) and the highest
        average power measured on it (`peak_w`). For reading: the monitor updates it."""
        return self._bounds[index]

    def _measure(
        self,
        key: str,
        state: _WindowState,
        sync_execution: bool,
        cancel: bool = False,
        log: bool = True,
    ) -> Measurement:
        """The figures of the window `key` that began at `state`, read now."""
        start, before, indices, cpu_before = state
        # Instantaneous power is read before the synchronisation, while the window's work still runs (Zeus
        # does the same): afterwards the GPU may already have dropped to idle.
        instant = self._instant_power_w() if self.approx_instant_energy and not cancel else None
        if sync_execution:
            self.gpus.synchronize(self._live_indices)
        if cancel:
            cpu = dict.fromkeys(self.cpu_indices, 0.0) if self._rapl else None
            zeros = dict.fromkeys(self._live_indices, 0.0)
            return Measurement(0.0, zeros, cpu, None, self.simulated, dict(zeros))
        end = self._clock()
        elapsed = end - start
        energy = self._counter_energy_j(indices, before)
        bounds = self._bounds
        bound = {i: b for i, e in energy.items() if (b := bounds[i].counter(e, elapsed)) is not None}
        if (elapsed < self._short_s or not all(energy.values())) and (
            self.approx_instant_energy or len(self._short_warned) < len(energy)
        ):
            self._short_window(key, elapsed, energy, instant, bound)
        if self._sampler is not None:
            self._add_sampled_energy(energy, bound, start, end)
        cpu_j, dram_j = self._cpu_energy(cpu_before)
        m = Measurement(elapsed, energy, cpu_j, dram_j, self.simulated, bound)
        if self._log is not None and log:
            values = ",".join(str(energy.get(i, "")) for i in self.gpu_indices)  # a lost GPU: empty
            self._log.write(f"{start},{key},{m.time},{values}\n")
            self._log.flush()
        return m

    def _counter_energy_j(self, indices: list[int], before: list[int]) -> dict[int, float]:
        """Each GPU's energy (J) since its counters read `before`, for the GPUs still answering."""
        try:
            after = self._read_counters()
        except GPUError:
            after = self._read_answering()
        if indices is not self._counter_indices:  # a GPU was lost since the window began
            now = dict(zip(self._counter_indices, after, strict=True))
            return {i: (now[i] - c0) / 1000.0 for i, c0 in zip(indices, before, strict=True) if i in now}
        if len(after) == 1:  # the common case under torch.distributed: one GPU per process
            return {indices[0]: (after[0] - before[0]) / 1000.0}
        return {i: (c1 - c0) / 1000.0 for i, c0, c1 in zip(indices, before, after)}  # noqa: B905

    def _add_sampled_energy(
        self, energy: dict[int, float], bound: dict[int, float], start: float, end: float
    ) -> None:
        """Add the energy of the GPUs without a counter, integrated from their sampled power, and its bound."""
        assert self._sampler is not None
        sampled = self._sampler.energy_j(start, end)
        for k, i in enumerate(self._sampled_indices):
            if k not in self._sampler.lost:
                energy[i] = e = sampled.energy_j[k]
                bound[i] = self._bounds[i].sampled(e, end - start, sampled.variation_j[k])
            elif i not in self._lost:
                self._lose(i, GPUError(self._sampler.lost[k]))
        if not energy and not self._counter_indices:
            raise GPULostError(
                f"ZeusMonitor: no monitored GPU answers any more ({'; '.join(self._lost.values())})"
            )

    def _instant_power_w(self) -> dict[int, float] | None:
        try:
            return {i: instant_power_mw(self.gpus[i]) / 1000.0 for i in self._counter_indices}
        except GPUError as e:
            logger.warning("Could not read instantaneous power: %s", e)
            return None

    def _short_window(
        self,
        key: str,
        elapsed_s: float,
        energy: dict[int, float],
        instant: dict[int, float] | None,
        bound: dict[int, float],
    ) -> None:
        """A window that may be shorter than a counter's refresh: approximate it (and bound the approximation),
        or warn once per GPU."""
        periods = [energy_refresh_period_s(self.gpus[i]) for i in energy]
        known = [p for p in periods if p is not None]
        if len(known) == len(periods):
            self._short_s = max(known, default=0.0)
        for i in list(energy):
            gpu = self.gpus[i]
            period = energy_refresh_period_s(gpu)
            if period is None:
                short = energy[i] == 0.0
                period_text = "its energy counter's refresh period"
            else:
                self._bounds[i].refresh_s = period  # measured now, where the generation's was assumed
                short = elapsed_s < period
                period_text = f"its energy counter's refresh period ({period * 1000:.0f} ms)"
            if not short:
                continue
            if self.approx_instant_energy:
                if instant is not None:
                    bound[i] = self._bounds[i].instant(instant[i], elapsed_s, energy[i])
                    energy[i] = instant[i] * elapsed_s
            elif i not in self._short_warned and not key.startswith(
                "__"
            ):  # internal windows: their owner copes
                self._short_warned.add(i)
                logger.warning(
                    "Window %r (%.1f ms) on %s is shorter than %s, so its energy reads %.3f J (0 J or one whole "
                    "refresh). Measure longer windows, or pass `ZeusMonitor(approx_instant_energy=True)` to use "
                    "instantaneous power x time for such windows. (Warned once per GPU.)",
                    key,
                    elapsed_s * 1000,
                    gpu.label,
                    period_text,
                    energy[i],
                )

    def _cpu_energy(
        self, before: list[tuple[int, int | None]] | None
    ) -> tuple[dict[int, float] | None, dict[int, float] | None]:
        if before is None:
            return None, None
        cpu: dict[int, float] = {}
        dram: dict[int, float] = {}
        for p, (c0, d0) in zip(self._rapl, before, strict=True):
            c1, d1 = p.read_uj()
            cpu[p.index] = rapl.energy_delta_j(c0, c1, p.cpu.max_uj)
            if p.dram is not None and d0 is not None and d1 is not None:
                dram[p.index] = rapl.energy_delta_j(d0, d1, p.dram.max_uj)
        return cpu, dram or None

    @property
    def open_windows(self) -> list[str]:
        """Names of the windows currently open."""
        return list(self._windows)

    @property
    def measurement_states(self) -> dict[str, MeasurementState]:
        """The open windows and where each began (Zeus's attribute of the same name), a snapshot: use
        `begin_window(restart=True)` or `reset_windows()` to drop a window."""
        out = {}
        for key, (start, counters, indices, cpu) in self._windows.items():
            gpu = {i: c / 1000.0 for i, c in zip(indices, counters, strict=True)}
            cpu_j = {p.index: c / 1e6 for p, (c, _) in zip(self._rapl, cpu, strict=True)} if cpu else None
            dram_j = (
                {p.index: d / 1e6 for p, (_, d) in zip(self._rapl, cpu, strict=True) if d is not None} or None
                if cpu
                else None
            )
            out[key] = MeasurementState(start, gpu, cpu_j, dram_j)
        return out

    def reset_windows(self) -> None:
        """Drop every open window (their measurements are lost), as Zeus's `reset_windows`."""
        dropped = list(self._windows)
        self._windows.clear()
        logger.info("ZeusMonitor reset; dropped open windows: %s", dropped or "none")

    def close(self) -> None:
        """Stop background sampling and close the log file."""
        if self._sampler is not None:
            self._sampler.close()
        if self._log is not None:
            self._log.close()
            self._log = None


def energy_bound_of(gpu: GPU) -> EnergyBound:
    """The bound of `gpu`'s energy figures (the monitor's windows, the endpoint's counter): its counter refreshes
    as the backend knows (a virtual clock's model), else as its generation's power updates (ASSUMED the same, as
    sim/specs.py; measured at the first short window); its top power is its highest settable limit (read once
    here; unknown where NVML gives none)."""
    sensor = power_sensor(gpu)
    known = gpu.backend.known_energy_refresh_s(gpu.device)
    try:
        top_w = gpu.power_limit_constraints_mw()[1] / 1000
    except GPUError:
        top_w = 0.0
    return EnergyBound(sensor, sensor.update_s if known is None else known, top_w)
