"""Energy of GPUs without an energy counter: their power sampled in the background and integrated per window."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from zeus_callbacks.core.device.gpus import GPU
from zeus_callbacks.core.monitor.uncertainty import EnergyBound

__all__ = ["PowerSampler", "SampledEnergy"]


class SampledEnergy(NamedTuple):
    """Per sampled GPU (in the sampler's order): the window's energy (J) and what the readings may miss of it
    (J, `EnergyBound.sampled`)."""

    energy_j: list[float]
    variation_j: list[float]


class PowerSampler:
    """Samples power of GPUs without an energy counter in a daemon thread and integrates it per window.

    Args:
        gpus: The GPUs to sample.
        clock: The device layer's clock.
        interval_s: Seconds between two samples.
        bounds: Per GPU, the bound of its windows (the power it may draw).
    """

    def __init__(
        self, gpus: list[GPU], clock: Callable[[], float], interval_s: float, bounds: Sequence[EnergyBound]
    ) -> None:
        self._gpus = gpus
        self._clock = clock
        self._interval = interval_s
        self._bounds = list(bounds)
        self._samples: deque[tuple[float, list[float]]] = deque(maxlen=1_000_000)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost: dict[int, str] = {}  # position in `gpus` -> why it stopped answering
        self.sample()
        self._thread = threading.Thread(target=self._run, name="zeus-callbacks-power-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """Read every GPU's power once, now."""
        t = self._clock()
        watts = []
        for k, g in enumerate(self._gpus):
            if k in self.lost:
                watts.append(math.nan)
                continue
            try:
                watts.append(g.power_mw() / 1000)
            except Exception as e:  # a lost GPU: it drops out, the others are still sampled
                self.lost[k] = str(e)
                watts.append(math.nan)
        with self._lock:
            self._samples.append((t, watts))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def energy_j(self, start: float, end: float) -> SampledEnergy:
        """Trapezoidal integral of each GPU's power over [start, end] (a sample taken now ends it), and what it
        may miss between readings: per sampling interval, the change between its two readings times half the
        part of the interval inside the window; where a reading is missing (no sample on one side of
        the window's edge, or none for over two intervals), the readings' distance to any power the GPU may
        draw, times that time."""
        self.sample()
        with self._lock:
            pts = [s for s in self._samples if start - self._interval <= s[0] <= end + self._interval]
        out = [0.0] * len(self._gpus)
        variation = [0.0] * len(self._gpus)
        if not pts:
            return SampledEnergy(out, variation)
        for (t0, p0), (t1, p1) in zip(pts, pts[1:], strict=False):
            lo, hi = max(t0, start), min(t1, end)
            if hi <= lo:
                continue
            missed = t1 - t0 > 2 * self._interval  # the thread was late: samples are missing in between
            for i, bound in enumerate(self._bounds):
                out[i] += (p0[i] + p1[i]) / 2 * (hi - lo)
                if missed:
                    variation[i] += max(bound.held_error_w(p0[i]), bound.held_error_w(p1[i])) * (hi - lo)
                else:
                    variation[i] += abs(p1[i] - p0[i]) * (hi - lo) / 2
        # Before the first / after the last sample inside the window: hold the nearest value.
        first_t, first_p = pts[0]
        last_t, last_p = pts[-1]
        before, after = max(0.0, min(first_t, end) - start), max(0.0, end - max(last_t, start))
        for i, bound in enumerate(self._bounds):
            out[i] += first_p[i] * before + last_p[i] * after
            variation[i] += bound.held_error_w(first_p[i]) * before + bound.held_error_w(last_p[i]) * after
        return SampledEnergy(out, variation)

    def close(self) -> None:
        """Stop sampling."""
        self._stop.set()
