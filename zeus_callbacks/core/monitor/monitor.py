"""ZeusMonitor: named, nestable, overlapping windows of time and GPU energy."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.gpus import GPU, get_gpus
from zeus_callbacks.core.device.power import MAX_REFRESH_PERIOD_S, energy_refresh_period_s, instant_power_mw

__all__ = ["ZeusMonitor", "Measurement"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Measurement:
    """Time and energy of one window.

    Attributes:
        time: Elapsed time (s).
        gpu_energy: Energy (J) per GPU index.
        cpu_energy: Always None (CPU energy is not measured); kept for Zeus compatibility.
        dram_energy: Always None; kept for Zeus compatibility.
        simulated: True when the GPUs are simulated: the figures are a simulation, not a measurement.
    """

    time: float
    gpu_energy: dict[int, float]
    cpu_energy: dict[int, float] | None = None
    dram_energy: dict[int, float] | None = None
    simulated: bool = False

    @property
    def total_energy(self) -> float:
        """GPU energy summed over GPUs (J)."""
        return sum(self.gpu_energy.values())


class _PowerSampler:
    """Samples power of GPUs without an energy counter in the background and integrates it."""

    def __init__(self, gpus: list[GPU], clock, interval_s: float) -> None:
        self._gpus = gpus
        self._clock = clock
        self._interval = interval_s
        self._samples: deque[tuple[float, list[float]]] = deque(maxlen=1_000_000)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="zeus-callbacks-power-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        t = self._clock()
        try:
            watts = [g.power_mw() / 1000 for g in self._gpus]
        except Exception as e:  # a lost GPU: keep the last value rather than kill the thread
            logger.warning("Power sampling failed: %s", e)
            return
        with self._lock:
            self._samples.append((t, watts))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def energy_j(self, start: float, end: float) -> list[float]:
        """Trapezoidal integral of each GPU's power over [start, end]."""
        self.sample()
        with self._lock:
            pts = [s for s in self._samples if start - self._interval <= s[0] <= end + self._interval]
        out = [0.0] * len(self._gpus)
        if not pts:
            return out
        for (t0, p0), (t1, p1) in zip(pts, pts[1:], strict=False):
            lo, hi = max(t0, start), min(t1, end)
            if hi <= lo:
                continue
            for i in range(len(out)):
                out[i] += (p0[i] + p1[i]) / 2 * (hi - lo)
        # Before the first / after the last sample inside the window: hold the nearest value.
        first_t, first_p = pts[0]
        last_t, last_p = pts[-1]
        for i in range(len(out)):
            out[i] += first_p[i] * max(0.0, min(first_t, end) - start) + last_p[i] * max(
                0.0, end - max(last_t, start)
            )
        return out

    def close(self) -> None:
        self._stop.set()


class ZeusMonitor:
    """Measure the time and GPU energy of named windows, as Zeus's `ZeusMonitor` does.

    Windows may nest and overlap; each is opened with `begin_window(name)` and closed with
    `end_window(name)`, which returns a `Measurement`. Energy comes from NVML's energy counter (Volta and
    newer) or, on older GPUs, from power sampled in the background and integrated over the window.

    Args:
        gpu_indices: GPUs to measure, as the framework numbers them (after `CUDA_VISIBLE_DEVICES`).
            Default: every visible GPU. Under torch.distributed, pass only this rank's GPU.
        cpu_indices: Accepted for Zeus compatibility; CPU energy is not measured.
        approx_instant_energy: For a window shorter than a GPU's energy-counter refresh period (which
            would read 0 J or one whole refresh), report instantaneous power x time instead, as Zeus does.
            Without it such a window keeps the counter's figure and the monitor warns once per GPU.
        log_file: Path of a CSV log in Zeus's format (`start_time,window_name,elapsed_time,gpu<i>_energy`).
        sync_execution_with: "torch" to wait for queued GPU work before reading the counters.
        power_sample_interval_s: Sampling period for GPUs without an energy counter.

    Raises:
        ValueError: an index that is not a visible GPU.
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
        self.gpus = get_gpus()
        if gpu_indices is None:
            gpu_indices = list(range(len(self.gpus)))
        bad = [i for i in gpu_indices if not 0 <= i < len(self.gpus)]
        if bad:
            raise ValueError(
                f"`ZeusMonitor(gpu_indices={list(gpu_indices)!r})`: {bad} not among the {len(self.gpus)} visible "
                "GPU(s). Indices count from 0 after CUDA_VISIBLE_DEVICES."
            )
        if sync_execution_with not in ("torch",):
            raise ValueError(
                f"`ZeusMonitor(sync_execution_with={sync_execution_with!r})`: only 'torch' is supported."
            )
        self.gpu_indices: list[int] = list(gpu_indices)
        self.approx_instant_energy = bool(approx_instant_energy)
        self._short_warned: set[int] = set()
        # Windows shorter than this may fall between two refreshes of a GPU's energy counter.
        self._short_s = MAX_REFRESH_PERIOD_S
        self.simulated = self.gpus.simulated
        self._clock = self.gpus.clock
        devices = [self.gpus[i] for i in self.gpu_indices]
        self._counter = [g for g in devices if g.supports_energy_counter]
        self._counter_indices = [g.index for g in self._counter]
        self._read_counters = self.gpus.energy_reader(self._counter_indices)
        sampled = [g for g in devices if not g.supports_energy_counter]
        self._sampled_indices = [g.index for g in sampled]
        self._sampler = _PowerSampler(sampled, self._clock, power_sample_interval_s) if sampled else None
        self._windows: dict[str, tuple[float, list[int]]] = {}  # key -> (start, counters mJ)
        self._log: TextIO | None = None
        if log_file is not None:
            path = Path(log_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._log = path.open("w")
            cols = ",".join(f"gpu{i}_energy" for i in self.gpu_indices)
            self._log.write(f"start_time,window_name,elapsed_time,{cols}\n")
            self._log.flush()
        if self.simulated:
            logger.info("ZeusMonitor on SIMULATED GPUs %s: figures are a simulation.", self.gpu_indices)

    def sync(self) -> None:
        """Wait for the work queued on the monitored GPUs."""
        self.gpus.synchronize(self.gpu_indices)

    # begin_window/end_window are the hot path (called every step): plain tuples and inlined reads.
    def begin_window(self, key: str, sync_execution: bool = True) -> None:
        """Open the window `key`.

        Raises:
            ValueError: a window named `key` is already open.
        """
        if key in self._windows:
            raise ValueError(f"Measurement window {key!r} is already open; end it before beginning it again.")
        if sync_execution:
            self.gpus.synchronize(self.gpu_indices)
        start = self._clock()
        counters = self._read_counters()
        self._windows[key] = (start, counters)

    def end_window(self, key: str, sync_execution: bool = True, cancel: bool = False) -> Measurement:
        """Close the window `key` and return its time and energy (zeros when `cancel`, and not logged).

        Raises:
            ValueError: no window named `key` is open.
        """
        try:
            start, before = self._windows.pop(key)
        except KeyError:
            raise ValueError(
                f"Measurement window {key!r} was not begun (open: {sorted(self._windows)})."
            ) from None
        if sync_execution:
            self.gpus.synchronize(self.gpu_indices)
        if cancel:
            return Measurement(0.0, dict.fromkeys(self.gpu_indices, 0.0), None, None, self.simulated)
        end = self._clock()
        after = self._read_counters()
        if len(after) == 1:  # the common case under torch.distributed: one GPU per process
            energy = {self._counter_indices[0]: (after[0] - before[0]) / 1000.0}
        else:
            energy = {i: (c1 - c0) / 1000.0 for i, c0, c1 in zip(self._counter_indices, before, after)}  # noqa: B905
        if (end - start < self._short_s or not all(energy.values())) and (
            self.approx_instant_energy or len(self._short_warned) < len(energy)
        ):
            self._short_window(key, end - start, energy)
        if self._sampler is not None:
            energy.update(zip(self._sampled_indices, self._sampler.energy_j(start, end), strict=True))
        m = Measurement(end - start, energy, None, None, self.simulated)
        if self._log is not None:
            values = ",".join(str(energy[i]) for i in self.gpu_indices)
            self._log.write(f"{start},{key},{m.time},{values}\n")
            self._log.flush()
        return m

    def _short_window(self, key: str, elapsed_s: float, energy: dict[int, float]) -> None:
        """A window that may be shorter than a counter's refresh: approximate it, or warn once per GPU."""
        periods = [energy_refresh_period_s(self.gpus[i]) for i in energy]
        if all(p is not None for p in periods):
            self._short_s = max(periods, default=0.0)  # type: ignore[type-var]
        for i in list(energy):
            gpu = self.gpus[i]
            period = energy_refresh_period_s(gpu)
            if period is None:
                short = energy[i] == 0.0
                period_text = "the energy counter's refresh period"
            else:
                short = elapsed_s < period
                period_text = f"its energy counter's refresh period ({period * 1000:.0f} ms)"
            if not short:
                continue
            if self.approx_instant_energy:
                try:
                    energy[i] = instant_power_mw(gpu) / 1000.0 * elapsed_s
                except GPUError as e:
                    logger.warning("Could not approximate the energy of window %r: %s", key, e)
            elif i not in self._short_warned:
                self._short_warned.add(i)
                logger.warning(
                    "Window %r (%.1f ms) is shorter than %s's %s, so its energy reads %.3f J (0 J or one whole "
                    "refresh). Measure longer windows, or pass `ZeusMonitor(approx_instant_energy=True)` to use "
                    "instantaneous power x time for such windows. (Warned once per GPU.)",
                    key,
                    elapsed_s * 1000,
                    gpu.label,
                    period_text,
                    energy[i],
                )

    @property
    def open_windows(self) -> list[str]:
        """Names of the windows currently open."""
        return list(self._windows)

    def close(self) -> None:
        """Stop background sampling and close the log file."""
        if self._sampler is not None:
            self._sampler.close()
        if self._log is not None:
            self._log.close()
            self._log = None
