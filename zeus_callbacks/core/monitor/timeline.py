"""Timelines sampled in the background (power, temperature): deduplicated series and the sampling thread."""

from __future__ import annotations

import bisect
import logging
import math
import operator
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from zeus_callbacks.core.device.errors import SIMULATION_HINT, InvalidInputError

__all__ = [
    "Series",
    "Poller",
    "weak_poll",
    "integrate",
    "trapezoid_error",
    "check_gpu_indices",
    "check_period",
    "check_max_samples",
]

logger = logging.getLogger(__name__)


class Series:
    """One reading of one GPU over time, stored when it changes.

    A run of equal readings keeps its first and its last point (the last one is stored when the value
    changes, and reported while the run lasts), so that the timeline says how long a value held: what
    integrating it needs, where Zeus's deduplicated timeline keeps only the first point of each run.
    """

    def __init__(self, max_samples: int | None) -> None:
        self._points: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._last: tuple[float, float] | None = None

    def add(self, t: float, value: float) -> None:
        """Record a reading taken at `t`."""
        last = self._last
        if last is not None and last[1] == value:
            self._last = (t, value)
            return
        if last is not None and self._points and self._points[-1][0] != last[0]:
            self._points.append(last)  # the end of the run of equal readings
        self._points.append((t, value))
        self._last = (t, value)

    def points(self, start: float | None = None, end: float | None = None) -> list[tuple[float, float]]:
        """The timeline (time, value), oldest first, within [start, end] where given."""
        out = list(self._points)
        if self._last is not None and (not out or out[-1][0] != self._last[0]):
            out.append(self._last)
        if start is not None:
            out = out[bisect.bisect_left(out, (start, -math.inf)) :]
        if end is not None:
            out = out[: bisect.bisect_right(out, (end, math.inf))]
        return out

    def latest(self) -> tuple[float, float] | None:
        """The latest reading, None before the first."""
        return self._last

    def nearest(self, t: float) -> tuple[float, float] | None:
        """The reading closest in time to `t` (the earlier one on a tie), None before the first."""
        points = self.points()
        if not points:
            return None
        i = bisect.bisect_left(points, (t, -math.inf))
        if i == 0:
            return points[0]
        if i == len(points):
            return points[-1]
        before, after = points[i - 1], points[i]
        return before if t - before[0] <= after[0] - t else after


def integrate(points: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """The integral of the piecewise-linear timeline `points` over [start, end], where it has points.

    Outside its first and last points the timeline is unknown and adds nothing.
    """
    total = 0.0
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        lo, hi = max(t0, start), min(t1, end)
        if hi <= lo or t1 <= t0:
            continue
        slope = (v1 - v0) / (t1 - t0)
        total += (v0 + slope * (lo - t0) + v0 + slope * (hi - t0)) / 2 * (hi - lo)
    return total


def trapezoid_error(
    points: Sequence[tuple[float, float]],
    start: float,
    end: float,
    gap: float,
    held_error: Callable[[float], float],
) -> float:
    """How far `integrate(points, start, end)` may lie from the integral of what the readings read, where they
    do not tell it: between two points at most `gap` apart, half their change times their time within [start,
    end] (the value moved from one to the other, as the sampler's does); between two points further apart
    (readings are missing), `held_error` of either value, the larger, times that time; where the timeline has no
    points (before its first, after its last), `held_error(0.0)` times that time, since `integrate` adds
    nothing there. A run of equal readings keeps its ends (`Series`), so it is not taken for a gap."""
    total, covered = 0.0, 0.0
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        lo, hi = max(t0, start), min(t1, end)
        if hi <= lo:
            continue
        covered += hi - lo
        if t1 - t0 > gap and v1 != v0:  # equal ends: a run of equal readings (`Series`), not missing ones
            total += max(held_error(v0), held_error(v1)) * (hi - lo)
        else:
            total += abs(v1 - v0) * (hi - lo) / 2
    return total + held_error(0.0) * max(0.0, end - start - covered)


def weak_poll(monitor: Any) -> Callable[[], None]:
    """`monitor.poll` without a reference that keeps `monitor` alive (its finalizer stops the thread)."""
    ref = weakref.ref(monitor)

    def poll() -> None:
        target = ref()
        if target is not None:
            target.poll()

    return poll


class Poller:
    """Calls `poll()` every `period_s` seconds in a daemon thread, sleeping in between, until `stop()`.

    Ticks are scheduled `period_s` apart; a tick that would fall in the past (a slow poll, a loaded host)
    is skipped rather than run late, so the thread never polls more often than once per period. An
    exception in `poll` is logged and the thread keeps going.
    """

    def __init__(self, name: str, period_s: float, poll: Callable[[], None]) -> None:
        self._period = period_s
        self._poll = poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period, clock = self._period, time.monotonic
        next_at = clock() + period
        while not self._stop.wait(max(0.0, next_at - clock())):
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - a background reader must not die silently, nor kill training
                logger.exception("%s: a reading failed; sampling goes on.", self._thread.name)
            next_at += period
            now = clock()
            if next_at <= now:
                next_at = now + period

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def check_gpu_indices(owner: str, gpu_indices: object, visible: int, cpu_only: bool = False) -> list[int]:
    """`gpu_indices` as distinct visible GPU indices (None: every visible GPU), or a clear error.

    With `cpu_only` (`ZeusMonitor`'s), `[]` measures no GPU and a single index stands for a list of one, as in
    Zeus's DDP example."""
    call = f"`{owner}(gpu_indices={gpu_indices!r})`"
    if gpu_indices is None:
        if visible == 0:
            instead = " Make one visible, or pass gpu_indices=[] to measure only the CPU." if cpu_only else ""
            raise InvalidInputError(
                f"`{owner}()`: no GPU is visible to this process (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}).{instead} {SIMULATION_HINT}"
            )
        return list(range(visible))
    items = [gpu_indices] if cpu_only and isinstance(gpu_indices, int) else gpu_indices
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence | set | frozenset | range):
        raise InvalidInputError(f"{call}: expected a list of GPU indices, e.g. [0] or [0, 1].")
    if not items and not cpu_only:
        raise InvalidInputError(f"{call}: name at least one GPU, or pass None for every visible GPU.")
    indices = []
    for i in items:
        try:
            if isinstance(i, bool):
                raise TypeError
            indices.append(operator.index(i))
        except TypeError:
            raise InvalidInputError(
                f"{call}: {i!r} is not a GPU index; expected whole numbers, e.g. [0]."
            ) from None
    bad = [i for i in indices if not 0 <= i < visible]
    if bad:
        raise InvalidInputError(
            f"{call}: {bad} not among the {visible} visible GPU(s); indices count from 0 after "
            "CUDA_VISIBLE_DEVICES."
        )
    if len(set(indices)) != len(indices):
        raise InvalidInputError(f"{call}: a GPU is named twice; name each once.")
    return indices


def check_period(owner: str, name: str, value: object) -> float:
    """A sampling period in seconds: a finite number > 0, or a clear error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidInputError(
            f"`{owner}({name}={value!r})`: expected a number of seconds greater than 0, e.g. 0.1."
        )
    return float(value)


def check_max_samples(owner: str, value: object) -> int | None:
    """`max_samples_per_gpu`: None (unbounded) or a whole number >= 2."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise InvalidInputError(
            f"`{owner}(max_samples_per_gpu={value!r})`: expected None (keep every sample) or a whole number "
            "of at least 2."
        )
    return value
