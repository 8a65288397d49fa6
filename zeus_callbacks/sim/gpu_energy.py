"""A simulated GPU's energy counter and power sensor: the true energy accounted in the shared state, the
counter as the driver refreshes it, and the power readings averaged over the sensor's window."""

from __future__ import annotations

import bisect
import math

from zeus_callbacks.sim.gpu_state import (
    ENERGY_OFFSET,
    RING_OFFSET,
    RING_SLOT,
    RING_SLOTS,
    RING_TICK_S,
    GPUState,
    read_energy,
)
from zeus_callbacks.sim.host import HOST_CLOCK, VirtualClock


def last_refresh(t: float, phase_s: float, period_s: float) -> float:
    """The time of the driver's last refresh of the energy counter at or before `t`."""
    return t - (t - phase_s) % period_s


class PowerSensor:
    """The instant power reading on a virtual clock: the mean power over the last `window_s` of each
    `update_s` period, updated at the period's end (a window of 0: the last interval's power). The true
    energy's breakpoints of the last ~1.2 s serve it."""

    def __init__(self, update_s: float, window_s: float, phase_s: float) -> None:
        self.update_s, self.window_s = update_s, min(window_s, update_s)
        self.phase_s = phase_s
        self._history: list[tuple[float, float]] = []

    def remember(self, *points: tuple[float, float]) -> None:
        """Add (time, true energy in mJ) breakpoints, forgetting those older than the power window needs."""
        history = self._history
        for t, mj in points:
            if not history or t > history[-1][0]:
                history.append((t, mj))
        if len(history) > 64 and history[32][0] < history[-1][0] - 1.2:
            keep_from = bisect.bisect_left(history, (history[-1][0] - 1.2,)) - 1  # >= 32
            del history[:keep_from]

    def mean_mw(self, now: float, counter: EnergyCounter) -> float:
        """The reading at `now` (mW): the mean power over the window of the last update."""
        update = now - (now - self.phase_s) % self.update_s
        window = self.window_s
        return (self._energy_at(update, counter) - self._energy_at(update - window, counter)) / window

    def _energy_at(self, t: float, counter: EnergyCounter) -> float:
        """The true energy (mJ) at `t` from the breakpoints (linear between them, idle power outside)."""
        history = self._history
        if not history:
            return counter.at(t)
        i = bisect.bisect_left(history, (t,))
        if i == len(history):
            return history[-1][1] + counter.idle_mw * (t - history[-1][0])
        t1, e1 = history[i]
        if i == 0:
            return e1 - counter.idle_mw * (t1 - t)
        t0, e0 = history[i - 1]
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0) if t1 > t0 else e1


class EnergyCounter:
    """The GPU's energy in the state every process shares: the truth, accounted interval by interval (idle
    power between them), and the counter NVML reads, which the driver refreshes every `refresh_s` (0: every
    read sees the truth) at a phase of its own, so that the GPUs of a node do not refresh together."""

    def __init__(
        self,
        state: GPUState,
        clock: VirtualClock | None,
        idle_w: float,
        refresh_s: float,
        phase_s: float,
        sensor: PowerSensor,
    ) -> None:
        self.state = state
        self._buf = state._buf
        self._clock = clock
        self.idle_mw = idle_w * 1000
        self.refresh_s, self._phase_s = refresh_s, phase_s
        self.sensor = sensor

    def reading_mj(self) -> float:
        """The counter at the driver's last refresh (mJ): it stands still between refreshes, as on real boards."""
        energy, updated, refreshed, refreshed_at = read_energy(self._buf, ENERGY_OFFSET)
        now = HOST_CLOCK.now() if self._clock is None else self._clock.now()
        period = self.refresh_s
        if period:
            now -= (now - self._phase_s) % period  # the last refresh
            if now <= refreshed_at:
                return refreshed
        since = now - updated
        return energy + self.idle_mw * since if since > 0 else energy

    def true_mj(self, now: float) -> float:
        """The energy drawn up to `now` (mJ), unrounded by the counter's refresh: ground truth."""
        energy, updated, _, _ = read_energy(self._buf, ENERGY_OFFSET)
        since = now - updated
        return energy + self.idle_mw * since if since > 0 else energy

    def at(self, t: float) -> float:
        """The true energy (mJ) at time `t`, no earlier than about 1.1 s before the last accounting."""
        energy, updated, _, _ = read_energy(self._buf, ENERGY_OFFSET)
        if t >= updated:
            return energy + self.idle_mw * (t - updated)
        k = math.floor(t / RING_TICK_S)
        t0, e0 = self._ring(k)
        if t0 != t0:  # nothing accounted then: the GPU idled
            return energy - self.idle_mw * (updated - t)
        t1, e1 = (updated, energy) if (k + 1) * RING_TICK_S > updated else self._ring(k + 1)
        if t1 != t1 or t1 <= t0:
            return e0
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def _ring(self, tick: int) -> tuple[float, float]:
        """(time, true energy in mJ) at a tick of the power-average grid; (nan, nan) when not stored."""
        stored, mj = RING_SLOT.unpack_from(self._buf, RING_OFFSET + 16 * (tick % RING_SLOTS))
        return (tick * RING_TICK_S, mj) if stored == tick else (math.nan, math.nan)

    def add(self, start: float, end: float, energy_j: float) -> None:
        """Account `energy_j` drawn from `start` to `end` (idle power before it since the last accounting)."""
        st = self.state
        idle_mw = self.idle_mw
        with st.lock():
            updated = st.get("updated_at")
            before = st.get("energy_mj")
            gap_mj = max(0.0, start - updated) * idle_mw
            work_from = max(start, updated)

            def energy_at(t: float) -> float:  # the true energy (mJ) at t in [updated, end]
                if t <= work_from or end <= work_from:
                    return before + idle_mw * max(0.0, min(t, work_from) - updated)
                return before + gap_mj + 1000 * energy_j * min(1.0, (t - work_from) / (end - work_from))

            new_updated = max(updated, end)
            period = self.refresh_s
            if period:  # the driver refreshed the counter at its last tick up to now: remember that value
                tick = last_refresh(new_updated, self._phase_s, period)
                if tick > updated:
                    st.set("refreshed_mj", energy_at(tick))
                    st.set("refreshed_at", tick)
            first = max(math.ceil(updated / RING_TICK_S), math.ceil((end - 1.2) / RING_TICK_S))
            for k in range(first, math.floor(end / RING_TICK_S) + 1):
                RING_SLOT.pack_into(
                    self._buf, RING_OFFSET + 16 * (k % RING_SLOTS), k, energy_at(k * RING_TICK_S)
                )
            st.set("energy_mj", before + gap_mj + 1000 * energy_j)
            st.set("updated_at", new_updated)
            if self._clock is not None and self.sensor.window_s > 0:
                after = before + gap_mj
                self.sensor.remember((updated, before), (work_from, after), (end, after + 1000 * energy_j))
            if end - start >= 0.01:  # a shorter interval's average is mostly noise
                st.set("last_power_w", energy_j / (end - start))
                st.set("last_power_at", end)
