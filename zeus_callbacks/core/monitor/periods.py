"""Monitor windows split at the boundaries of a provider's periods (the hours of a carbon intensity or
electricity price), for `CarbonEmissionMonitor` and `EnergyCostMonitor`."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor

__all__ = ["Part", "PeriodSplitter", "period_start", "utc_now", "split", "weigh"]

logger = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def utc_now() -> datetime:
    """The wall-clock time, timezone-aware (UTC)."""
    return datetime.now(timezone.utc)


def period_start(t: datetime, period: timedelta) -> datetime:
    """The start of the period that holds `t`: periods are multiples of `period` since the Unix epoch (UTC),
    so hourly periods start on the hour, as ElectricityMaps' history does."""
    n = (t - _EPOCH) // period
    return _EPOCH + n * period


@dataclass(frozen=True, slots=True)
class Part:
    """The share of one window that fell in one period.

    Attributes:
        start: The period's start (UTC).
        time_share: Its share of the window's time (0-1).
        gpu_share: Its share of each GPU's energy (0-1), by GPU index: from the energy counters, or the time
            share for a GPU without one.
    """

    start: datetime
    time_share: float
    gpu_share: dict[int, float]


class PeriodSplitter:
    """Snapshots of a `ZeusMonitor`'s GPU energy counters at every period boundary while windows are open.

    One daemon thread sleeps until the next boundary, reads the counters once and records the boundary for
    every open window. The window's totals still come from the monitor; the snapshots only split them, so
    the parts of a window always add up to its `Measurement`.
    """

    def __init__(
        self,
        monitor: ZeusMonitor,
        period: timedelta,
        on_boundary: Callable[[datetime], None] | None = None,
        now: Callable[[], datetime] = utc_now,
    ) -> None:
        if period <= timedelta(0):
            raise ValueError(f"A provider's period must be positive, got {period!r}.")
        self._period, self._now, self._on_boundary = period, now, on_boundary
        gpus = monitor.gpus
        self._counted = [i for i in monitor.gpu_indices if gpus[i].supports_energy_counter]
        self._read = gpus.energy_reader(self._counted) if self._counted else (lambda: [])
        self._gpu_indices = list(monitor.gpu_indices)
        # key -> [(period start, wall time, counters mJ)], one entry per boundary the window crossed
        self._open: dict[str, list[tuple[datetime, datetime, list[int]]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _counters(self) -> list[int]:
        try:
            return self._read()
        except GPUError as e:  # a lost GPU: its split falls back to the time share
            logger.warning("Could not read the energy counters at a period boundary: %s", e)
            return []

    def begin(self, key: str) -> None:
        """Start recording the window `key`."""
        t = self._now()
        with self._lock:
            self._open[key] = [(period_start(t, self._period), t, self._counters())]
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_run,
                    args=(weakref.ref(self), self._stop),
                    name="zeus-callbacks-periods",
                    daemon=True,
                )
                self._thread.start()
                weakref.finalize(self, self._stop.set)

    def end(self, key: str) -> list[Part]:
        """Stop recording `key`; its parts, one per period it touched, oldest first."""
        t = self._now()
        with self._lock:
            marks = self._open.pop(key)
            marks.append((period_start(t, self._period), t, self._counters()))
        total_s = (marks[-1][1] - marks[0][1]).total_seconds()
        parts = []
        for (start, t0, c0), (_, t1, c1) in zip(marks, marks[1:], strict=False):
            time_share = (t1 - t0).total_seconds() / total_s if total_s > 0 else 1.0 / (len(marks) - 1)
            parts.append((start, time_share, _deltas(self._counted, c0, c1)))
        totals = {i: sum(d.get(i, 0) for _, _, d in parts) for i in self._counted}
        out = []
        for start, time_share, deltas in parts:
            share = dict.fromkeys(self._gpu_indices, time_share)
            for i in self._counted:
                if i in deltas and totals[i] > 0 and all(i in d for _, _, d in parts):
                    share[i] = deltas[i] / totals[i]
            out.append(Part(start, time_share, share))
        return out

    def _boundary(self) -> None:
        t = self._now()
        start = period_start(t, self._period)
        with self._lock:
            crossed = [marks for marks in self._open.values() if marks[-1][0] < start]
            if crossed:
                counters = self._counters()
                for marks in crossed:
                    marks.append((start, t, counters))
        if crossed and self._on_boundary is not None:
            self._on_boundary(start - self._period)

    def _seconds_to_next(self) -> float:
        t = self._now()
        return max(0.05, (period_start(t, self._period) + self._period - t).total_seconds())

    def close(self) -> None:
        """Stop the boundary thread."""
        self._stop.set()


def _deltas(indices: list[int], c0: list[int], c1: list[int]) -> dict[int, int]:
    if len(c0) != len(indices) or len(c1) != len(indices):
        return {}
    return {i: b - a for i, a, b in zip(indices, c0, c1, strict=True)}


def _run(ref: weakref.ref, stop: threading.Event) -> None:
    while True:
        splitter = ref()
        if splitter is None:
            return
        wait = splitter._seconds_to_next()
        del splitter  # hold no reference while asleep
        if stop.wait(wait):
            return
        splitter = ref()
        if splitter is None:
            return
        try:
            splitter._boundary()
        except Exception:  # noqa: BLE001 - the boundary thread must outlive a provider's failure
            logger.exception("Recording a period boundary failed; the window's split may be coarser.")
        del splitter


def split(
    total: dict[int, float] | None, parts: list[Part], rate: list[float], gpu: bool
) -> dict[int, float] | None:
    """Σ over parts of `total` x share x rate (per index): GPU parts by their energy share, others by time."""
    if total is None:
        return None
    out = {}
    for i, value in total.items():
        out[i] = sum(
            value * (p.gpu_share.get(i, p.time_share) if gpu else p.time_share) * r
            for p, r in zip(parts, rate, strict=True)
        )
    return out


def weigh(
    m: Measurement, parts: list[Part], rates: list[float]
) -> tuple[dict[int, float], dict[int, float] | None, dict[int, float] | None]:
    """A window's GPU, CPU and DRAM energies weighted by the rate (per J) of each period it touched: GPUs by
    their energy share of each period, the CPU and DRAM by the time share. (GPU: {} when none; others: None.)"""
    return (
        split(m.gpu_energy, parts, rates, gpu=True) or {},
        split(m.cpu_energy, parts, rates, gpu=False) or None,
        split(m.dram_energy, parts, rates, gpu=False) or None,
    )


def measurement_parts(
    m: Measurement,
) -> tuple[dict[int, float], dict[int, float] | None, dict[int, float] | None]:
    """A measurement's GPU, CPU and DRAM energies (J)."""
    return m.gpu_energy, m.cpu_energy, m.dram_energy
