"""How the power-limit optimizer measures its steps: the monitor's step window, the profiling cost, and
the collectives of each measured step and chunk (records whose fields say how they reduce over ranks).

Each measured step's time is maxed over ranks (the job's step is its slowest rank's) and dated by the
latest rank clock, so that every rank closes the same chunks, finds the same one-second power windows and
decides the same; a chunk's energy is summed over ranks. One collective per measured step and one per
chunk, on every rank, whatever happened to its GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.errors import GPUError, GPULostError
from zeus_callbacks.core.device.power import MAX_REFRESH_PERIOD_S, energy_refresh_period_s
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.power_limit.estimates import PowerLimitStats
from zeus_callbacks.core.power_limit.grid import milliwatts
from zeus_callbacks.core.power_limit.phases import OpenChunk, Profiling
from zeus_callbacks.core.power_limit.search import Search

__all__ = ["StepMeter", "SettlingStep", "MeasuredStep", "ChunkTotal", "CHUNK_REFRESHES"]

logger = logging.getLogger("zeus_callbacks.core.power_limit.optimizer")

_WINDOW = "__GlobalPowerLimitOptimizer_step"
# A sample (chunk of contiguous steps) spans at least this many refreshes of the energy counter, so that
# the counter's rounding (up to one refresh's energy at either end) is a small part of it.
CHUNK_REFRESHES = 1
_Record = TypeVar("_Record")


@dataclass(frozen=True)
class SettlingStep:
    """A settling step as the job sees it."""

    step_s: float = field(metadata=dist.reduce_by("max"))  # the slowest rank's time
    unmeasured: bool = field(metadata=dist.reduce_by("max"))  # a rank has no measurement of it
    end_s: float = field(metadata=dist.reduce_by("max"))  # its end: the latest rank clock


@dataclass(frozen=True)
class MeasuredStep:
    """A measured step as the job sees it."""

    step_s: float = field(metadata=dist.reduce_by("max"))  # the slowest rank's time
    failed: bool = field(metadata=dist.reduce_by("max"))  # a rank's GPU failed
    chunk_own_s: float = field(metadata=dist.reduce_by("min"))  # the least of the ranks' own chunk times
    refresh_s: float = field(metadata=dist.reduce_by("max"))  # the slowest rank's energy-counter refresh
    moved: bool = field(metadata=dist.reduce_by("max"))  # a rank's limit was changed outside the optimizer
    end_s: float = field(metadata=dist.reduce_by("max"))  # its end: the latest rank clock


@dataclass(frozen=True)
class ChunkTotal:
    """A closed chunk as the job sees it."""

    energy_j: float = field(metadata=dist.reduce_by("sum"))  # every rank's energy
    stuck_ranks: int = field(metadata=dist.reduce_by("sum"))  # ranks whose counter did not move
    power_w: float = field(metadata=dist.reduce_by("sum"))  # every rank's one-second power
    unread_ranks: int = field(metadata=dist.reduce_by("sum"))  # ranks without a one-second power


class StepMeter:
    """The step window on `monitor` for `gpus` and what was measured with it: `steps` and `energy_j` of
    profiling cost, the job's energy-counter `refresh_s` (learned at the first measured step), `failed`
    (a GPU failed: `on_failure(error)` was called), `collective` (every rank takes part: reduce)."""

    def __init__(
        self, monitor: ZeusMonitor, gpus: list[Any], on_failure: Callable[[Exception], None]
    ) -> None:
        self.monitor = monitor
        self.gpus = gpus
        self.on_failure = on_failure
        self.collective = False
        self.failed = False
        self.refresh_s: float | None = None  # 0: steps are long enough, or the counter is always current
        self.steps = 0
        self.energy_j = 0.0
        self._timed = (0, 0.0)  # measured steps of this rank's and their time (s)

    def reduce(self, record: _Record) -> _Record:
        """`record` over the ranks when every rank takes part; this rank's otherwise."""
        return dist.all_reduce_record(record) if self.collective else record

    def open_step(self) -> None:
        """Open the step's window (a stale one is cancelled)."""
        if self.failed:
            return
        try:
            self.cancel()
            self.monitor.begin_window(_WINDOW)
        except GPUError as e:
            self.on_failure(e)

    def cancel(self, sync: bool = True) -> None:
        """Cancel the step's window, if open."""
        if _WINDOW in self.monitor.open_windows:
            if sync:
                self.monitor.end_window(_WINDOW, cancel=True)
            else:
                self.monitor.end_window(_WINDOW, sync_execution=False, cancel=True)

    def close_step(self) -> Any:
        """Close the step's window and add it to the profiling cost: its `Measurement`, or None when a
        GPU failed (`on_failure`)."""
        self.steps += 1
        m = None
        if not self.failed:
            try:
                m = self.monitor.end_window(_WINDOW)
                lost = getattr(self.monitor, "lost_gpus", None)  # the monitor measures on without them
                if lost:
                    raise GPULostError(next(iter(lost.values())))
                self.energy_j += m.total_energy
            except (GPUError, ValueError) as e:
                self.on_failure(e)
        return m

    def settling_step(self, stats: PowerLimitStats, own_s: float | None) -> None:
        """Add a settling step's time (the job's) to `stats`: the limit is in force already, and its time
        (not its energy: the counter lags) is one more look at whether a burst begins."""
        clock = self.monitor.gpus.clock()
        step = self.reduce(SettlingStep(own_s if own_s is not None else 0.0, own_s is None, clock))
        if not step.unmeasured and step.step_s > 0:
            stats.add_settling(step.step_s, step.end_s)

    def measure(self, phase: Profiling, m: Any, power_limit_w: float | None, search: Search) -> str:
        """Add the job's step (measured as `m`, None when this rank's GPU failed) to the chunk being
        measured; once the chunk spans `CHUNK_REFRESHES` refreshes of the energy counter on every rank (or
        closes a limit measured by steps), add it to the limit's samples. Returns `failed` (a rank's GPU
        failed), `moved` (a rank's limit changed outside the optimizer), `open` or `closed`."""
        t, e = (m.time, m.total_energy) if m is not None else (0.0, 0.0)
        if m is not None:
            self._timed = (self._timed[0] + 1, self._timed[1] + t)
        chunk = phase.chunk
        chunk.own_s += t
        moved = self._limit_moved(power_limit_w)
        clock = self.monitor.gpus.clock()  # before the refresh is learned: polling for it takes time
        step = self.reduce(MeasuredStep(t, self.failed, chunk.own_s, self._own_refresh_s(t), moved, clock))
        if step.failed:
            return "failed"
        if step.moved:
            return "moved"
        if self.refresh_s is None:
            self.refresh_s = step.refresh_s
            phase.stats.refresh_s = step.refresh_s
        chunk.steps += 1
        chunk.time_s += step.step_s
        chunk.energy_j += e
        if step.chunk_own_s < CHUNK_REFRESHES * self.refresh_s and not search.last_fixed_step(
            phase.stats, chunk.steps
        ):
            return "open"
        # A counter that did not move is not a sample, unless it moves by refreshes: then 0 J is its
        # rounding (a refresh fell between steps), which the next chunk's reading makes up for.
        stuck = chunk.energy_j <= 0 and not self.refresh_s
        power_w, unread = self._one_second_power_w()
        total = self.reduce(ChunkTotal(chunk.energy_j, int(stuck), power_w, int(unread)))
        if total.stuck_ranks == 0 and chunk.time_s > 0:
            power_w = total.power_w if total.unread_ranks == 0 else math.nan
            phase.stats.add(chunk.time_s, total.energy_j, chunk.steps, power_w, step.end_s)
        phase.chunk = OpenChunk()
        phase.samples_done += 1
        return "closed"

    def steps_per_sample(self) -> float:
        """Steps a sample takes at the pace measured so far: enough for their time to span `CHUNK_REFRESHES`
        refreshes of the energy counter, whole steps (1 before a step is measured, or where the counter is
        always current)."""
        steps, time_s = self._timed
        if not self.refresh_s or not steps or time_s <= 0:
            return 1.0
        return float(max(1, math.ceil(CHUNK_REFRESHES * self.refresh_s * steps / time_s - 1e-9)))

    def _one_second_power_w(self) -> tuple[float, bool]:
        """(this rank's GPUs' power averaged over the last second in W, True if a GPU does not report it
        or the monitor replays a log). Read only where the energy counter's rounding matters."""
        if not self.refresh_s or self.failed:
            return 0.0, True
        try:
            power_w = self.monitor.one_second_power_w()
        except GPUError:
            return 0.0, True
        return (0.0, True) if power_w is None else (power_w, False)

    def _limit_moved(self, power_limit_w: float | None) -> bool:
        """Whether a GPU's power limit is no longer `power_limit_w`, the one being profiled (restored on a
        signal, or changed by another process)."""
        if power_limit_w is None or self.failed:
            return False
        try:
            return any(g.power_limit_mw() != milliwatts(power_limit_w) for g in self.gpus)
        except GPUError:
            return False

    def _own_refresh_s(self, step_s: float) -> float:
        """This rank's energy-counter refresh period, learned (once per GPU: polling up to 1.5 s) at the
        first measured step when that step is short enough for the counter's rounding to matter."""
        if self.refresh_s is not None:
            return self.refresh_s
        if self.monitor.approx_instant_energy or step_s >= 4 * MAX_REFRESH_PERIOD_S:
            return 0.0
        try:
            return max((energy_refresh_period_s(g) or 0.0 for g in self.gpus), default=0.0)
        except GPUError:
            return 0.0
