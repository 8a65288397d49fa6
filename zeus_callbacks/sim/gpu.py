"""One simulated GPU driven by a measured trace: speed and energy under power limits and SM clocks, faults."""

from __future__ import annotations

import bisect
import hashlib
import math
import os
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from zeus_callbacks.sim.gpu_state import (
    ENERGY_OFFSET,
    RING_OFFSET,
    RING_SLOT,
    RING_SLOTS,
    RING_TICK_S,
    GPUState,
    others_power_w,
    read_energy,
)
from zeus_callbacks.sim.host import (
    HOST_CLOCK,
    HOST_WAIT,
    VirtualClock,
    busy_power_w,
    process_cpu_s,
)
from zeus_callbacks.sim.node_spec import Faults
from zeus_callbacks.sim.specs import GPUSpec
from zeus_callbacks.sim.traces import Trace, operating_point, provenance

if TYPE_CHECKING:
    from zeus_callbacks.sim.dump_node import DumpBoardModel


class SimulatedGPU:
    """One simulated GPU: a trace-driven model of speed and power under power limits and SM clocks.

    Speed: the host's CPU time between two synchronisation points stands for the GPU's work at the
    maximum power limit; at the synchronisation the GPU "catches up" by sleeping so that the work takes
    `relative_time` as long, so any timer sees the slowdown. Once this process queues work as kernels
    (`enqueue`), the work runs from its launch instead and the host's CPU time is never GPU work on this GPU.
    Energy: busy time at the traced power, the rest at idle power, accumulated in a counter that persists
    across processes. On the wall clock, times are the node's (`HOST_CLOCK`): how late the host wakes from a
    synchronisation moves neither.
    """

    def __init__(
        self,
        index: int,
        spec: GPUSpec,
        trace: Trace,
        uuid: str,
        state_path: Path | None,
        clock: VirtualClock | None,
        noise: float,
        seed: int,
        faults: Faults,
        energy_refresh_s: float = 0.0,
        power_usage_averaged: bool = False,
        blocking_sync: bool = False,
        pci_bus_id: str = "",
        bursts: bool = False,
        power_update_s: float = 0.0,
        power_window_s: float = 0.0,
        board: DumpBoardModel | None = None,
        sensor_gain: float = 1.0,
    ) -> None:
        self.index = index
        self.sensor_gain = sensor_gain  # what NVML reads is the truth times this (`specs.sensor_gain`)
        self.bursts = bursts  # stalls and bursts between and within steps (virtual clock), seeded
        self._burst_left, self._burst_factor = 0, 1.0
        self.spec = spec
        self.trace = trace
        self.uuid = uuid
        self.faults = faults
        self.noise = noise
        self._clock = clock
        self._rng = random.Random(seed * 1_000_003 + index)
        self._calls = 0
        self._changes = 0
        self._idle_mw = spec.idle_power_w * 1000
        self.pci_bus_id = pci_bus_id
        self.power_usage_averaged = power_usage_averaged and not faults.no_energy_counter
        self.blocking_sync = blocking_sync
        # The driver refreshes the energy counter every `energy_refresh_s` (0: every read sees the truth),
        # at a phase of its own so that the GPUs of a node do not refresh together.
        self.energy_refresh_s = energy_refresh_s
        phase = int(hashlib.sha1(uuid.encode()).hexdigest()[:8], 16) / 16**8
        self._phase_s = phase * energy_refresh_s
        # On a virtual clock the instant power reading is the mean power over the last `power_window_s` of
        # each `power_update_s` period, updated at the period's end (0: the last interval's power); the
        # true energy's breakpoints of the last ~1.2 s serve it (`_energy_history`).
        self.power_update_s, self.power_window_s = power_update_s, min(power_window_s, power_update_s)
        self._power_phase_s = phase * power_update_s
        self._history: list[tuple[float, float]] = []
        self.provenance = provenance(spec, trace)  # a modelled board's label; None for a traced one
        # Reads that no injected fault can touch skip the fault checks (the monitor's hot path).
        self.plain_reads = (
            faults.lost_after_calls is None
            and faults.lost_after_changes is None
            and not faults.no_energy_counter
            and not (faults.missing or faults.unknown)
        )
        # A board from a dump has its own settable range, default and requested limits; others the trace's.
        self.board = board
        limits = None if board is None else board.gpu_limits
        self.min_power_limit_mw = limits.min_mw if limits else int(trace.min_power_limit_w * 1000)
        self.max_power_limit_mw = limits.max_mw if limits else int(trace.max_power_limit_w * 1000)
        default_mw = limits.default_mw if limits else int(trace.max_power_limit_w * 1000)
        if faults.default_limit_w is not None:
            default_mw = int(faults.default_limit_w * 1000)
        self.default_power_limit_mw = default_mw
        in_force = limits.requested_mw if limits and faults.default_limit_w is None else default_mw
        module = None if board is None else board.module_limits
        self._state = GPUState(
            state_path,
            {
                "power_limit_mw": in_force,
                "module_limit_mw": module.requested_mw if module else 0.0,
                "persistence": float(bool(board and board.persistence)),
                "energy_mj": 0.0,
                "updated_at": self.now(),
                "refreshed_mj": 0.0,  # the last refresh before the state began, as if nothing was drawn yet
                "refreshed_at": self._last_refresh(self.now()) if energy_refresh_s else float("-inf"),
            },
        )
        self._buf = self._state._buf
        self._queued_s = 0.0  # work enqueued without host CPU (simulated kernels), at the maximum clock
        self._kernels = False  # this process queued kernels here: its CPU time is not GPU work
        self._kernels_end = 0.0  # when the GPU ends the queued kernels (the node's time, noiseless)
        self._op_version = -1.0
        self._op = (1.0, trace.power(trace.max_power_limit_w))
        self._last_sync = self.now()
        self._last_cpu = time.process_time()
        self._issued_work = False  # a process that never synchronised nor queued work is a reader only
        self._busy_until = 0.0
        self._mutex = threading.Lock()

    # -- time -------------------------------------------------------------------------------------
    def now(self) -> float:
        """The simulator's clock: the node's time (`HOST_CLOCK`), or virtual time for offline runs."""
        return self._clock.now() if self._clock is not None else HOST_CLOCK.now()

    @property
    def virtual(self) -> bool:
        """Whether this GPU runs on a virtual clock."""
        return self._clock is not None

    # -- faults -----------------------------------------------------------------------------------
    def count_call(self) -> bool:
        """Count one NVML call; True once the GPU has fallen off the bus."""
        self._calls += 1
        after_calls, after_changes = self.faults.lost_after_calls, self.faults.lost_after_changes
        return (after_calls is not None and self._calls > after_calls) or (
            after_changes is not None and self._changes >= after_changes
        )

    # -- state ------------------------------------------------------------------------------------
    @property
    def power_limit_mw(self) -> int:
        """The power limit in force (mW)."""
        return int(self._state.get("power_limit_mw"))

    def _change(self, **fields: float) -> None:
        """Change settings that move the operating point (already validated by the NVML layer), the counter
        settled first at the old one."""
        self._account_idle()
        self._changes += 1
        with self._state.lock():
            for name, value in fields.items():
                self._state.set(name, value)
            self._state.set("version", self._state.get("version") + 1)

    def set_power_limit_mw(self, value: int) -> None:
        """Change the power limit."""
        self._change(power_limit_mw=value)

    @property
    def enforced_power_limit_mw(self) -> int:
        """The limit the driver enforces after every limiter (`nvmlDeviceGetEnforcedPowerLimit`): the one set,
        or lower on a board from a dump (`DumpBoardModel.enforced_mw`)."""
        limit = self.power_limit_mw
        return limit if self.board is None else self.board.enforced_mw(limit, self.module_limit_mw)

    @property
    def module_limit_mw(self) -> int:
        """The module-scope limit requested (mW; 0 on a board without a module scope)."""
        return int(self._state.get("module_limit_mw"))

    def set_module_limit_mw(self, value: int) -> None:
        """Change the module-scope limit."""
        self._change(module_limit_mw=value)

    @property
    def persistence(self) -> bool:
        """Persistence mode."""
        return bool(self._state.get("persistence"))

    def set_persistence(self, enabled: bool) -> None:
        """Change persistence mode."""
        self._state.set("persistence", 1.0 if enabled else 0.0)

    @property
    def locked_sm_clocks_mhz(self) -> tuple[int, int] | None:
        """The locked SM clock range, or None when not locked."""
        hi = self._state.get("sm_lock_max_mhz")
        return None if hi <= 0 else (int(self._state.get("sm_lock_min_mhz")), int(hi))

    def lock_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into a range."""
        self._change(sm_lock_min_mhz=min_mhz, sm_lock_max_mhz=max_mhz)

    def reset_sm_clocks(self) -> None:
        """Unlock the SM clock."""
        self.lock_sm_clocks(0, 0)

    @property
    def memory_clocks_locked(self) -> bool:
        """Whether memory clocks are locked."""
        return bool(self._state.get("mem_locked"))

    def set_memory_clocks_locked(self, locked: bool) -> None:
        """Record a memory clock lock (memory clocks do not change the traced model)."""
        self._state.set("mem_locked", 1.0 if locked else 0.0)

    # -- physics ----------------------------------------------------------------------------------
    def operating_point(self) -> tuple[float, float]:
        """(relative time of work vs the maximum limit, busy power in W) for the current state."""
        version = self._state.get("version")
        if version != self._op_version:
            pl_w = self.enforced_power_limit_mw / 1000
            self._op = self._compute_operating_point(pl_w, self.locked_sm_clocks_mhz)
            self._op_version = version
        return self._op

    def _compute_operating_point(self, pl_w: float, locked: tuple[int, int] | None) -> tuple[float, float]:
        return operating_point(self.trace, self.spec, pl_w, locked)

    def _noisy(self, value: float) -> float:
        if self.noise <= 0:
            return value
        return value * min(1.5, max(0.5, self._rng.gauss(1.0, self.noise)))

    # -- energy -----------------------------------------------------------------------------------
    def energy_mj(self) -> float:
        """The energy counter at the driver's last refresh (mJ); NVML reports it times `sensor_gain`.

        Between refreshes (every `energy_refresh_s`) the counter stands still, as on real boards.
        """
        energy, updated, refreshed, refreshed_at = read_energy(self._buf, ENERGY_OFFSET)
        now = HOST_CLOCK.now() if self._clock is None else self._clock.now()
        period = self.energy_refresh_s
        if period:
            now -= (now - self._phase_s) % period  # the last refresh
            if now <= refreshed_at:
                return refreshed
        since = now - updated
        return energy + self._idle_mw * since if since > 0 else energy

    def _last_refresh(self, t: float) -> float:
        """The time of the driver's last refresh of the energy counter at or before `t`."""
        return t - (t - self._phase_s) % self.energy_refresh_s

    def true_energy_mj(self) -> float:
        """The energy the GPU has drawn up to now (mJ), unrounded by the counter's refresh: ground truth."""
        energy, updated, _, _ = read_energy(self._buf, ENERGY_OFFSET)
        since = self.now() - updated
        return energy + self._idle_mw * since if since > 0 else energy

    def _energy_at(self, t: float) -> float:
        """The true energy (mJ) at time `t`, no earlier than about 1.1 s before the last accounting."""
        energy, updated, _, _ = read_energy(self._buf, ENERGY_OFFSET)
        if t >= updated:
            return energy + self._idle_mw * (t - updated)
        k = math.floor(t / RING_TICK_S)
        t0, e0 = self._ring(k)
        if t0 != t0:  # nothing accounted then: the GPU idled
            return energy - self._idle_mw * (updated - t)
        t1, e1 = (updated, energy) if (k + 1) * RING_TICK_S > updated else self._ring(k + 1)
        if t1 != t1 or t1 <= t0:
            return e0
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def _ring(self, tick: int) -> tuple[float, float]:
        """(time, true energy in mJ) at a tick of the power-average grid; (nan, nan) when not stored."""
        stored, mj = RING_SLOT.unpack_from(self._buf, RING_OFFSET + 16 * (tick % RING_SLOTS))
        return (tick * RING_TICK_S, mj) if stored == tick else (math.nan, math.nan)

    def average_power_mw(self) -> float:
        """Power averaged over the last second (mW), as Ampere and newer boards report `nvmlDeviceGetPowerUsage`."""
        now = self.now()
        if self.virtual:
            return self._energy_at(now) - self._energy_at(now - 1.0)
        # Work issued since the last synchronisation is not accounted yet: the instantaneous estimate covers it.
        unsynced_from = min(max(now - 1.0, self._last_sync), now)
        accounted = self._energy_at(unsynced_from) - self._energy_at(now - 1.0)
        return accounted + self.power_mw() * (now - unsynced_from)

    def power_mw(self) -> float:
        """Instantaneous power draw (mW).

        The higher of this process's work queued on the GPU (busy power while its kernels run; without
        kernels, busy power in proportion to the host CPU time since the last synchronisation; full busy
        power while a synchronisation catches up) and another process's work on it (`others_power_w`), as a
        sampler in another process sees it; else idle power.
        """
        st = self._state
        now = self.now()
        idle = self.spec.idle_power_w
        last_at = st.get("last_power_at")
        if self.virtual:
            if self.power_window_s > 0:
                update = now - (now - self._power_phase_s) % self.power_update_s
                window = self.power_window_s
                return (self._energy_history(update) - self._energy_history(update - window)) / window
            return (st.get("last_power_w") if now - last_at < 0.5 else idle) * 1000
        _, busy_power = self.operating_point()
        if now < self._busy_until:  # catching up
            return busy_power * 1000
        if self._kernels:  # busy while the kernels run; the host's CPU time is not GPU work
            if now < self._kernels_end:
                return busy_power * 1000
            local = idle
        else:
            local = (
                busy_power_w(idle, busy_power, time.process_time() - self._last_cpu, now - self._last_sync)
                if self._issued_work
                else idle
            )
        return max(local, others_power_w(st, now, self._last_sync, idle, busy_power)) * 1000

    def _add(self, start: float, end: float, energy_j: float) -> None:
        st = self._state
        with st.lock():
            updated = st.get("updated_at")
            before = st.get("energy_mj")
            gap_mj = max(0.0, start - updated) * self._idle_mw
            work_from = max(start, updated)

            def energy_at(t: float) -> float:  # the true energy (mJ) at t in [updated, end]
                if t <= work_from or end <= work_from:
                    return before + self._idle_mw * max(0.0, min(t, work_from) - updated)
                return before + gap_mj + 1000 * energy_j * min(1.0, (t - work_from) / (end - work_from))

            new_updated = max(updated, end)
            period = self.energy_refresh_s
            if period:  # the driver refreshed the counter at its last tick up to now: remember that value
                tick = self._last_refresh(new_updated)
                if tick > updated:
                    st.set("refreshed_mj", energy_at(tick))
                    st.set("refreshed_at", tick)
            first = max(math.ceil(updated / RING_TICK_S), math.ceil((end - 1.2) / RING_TICK_S))
            for k in range(first, math.floor(end / RING_TICK_S) + 1):
                RING_SLOT.pack_into(
                    st._buf, RING_OFFSET + 16 * (k % RING_SLOTS), k, energy_at(k * RING_TICK_S)
                )
            st.set("energy_mj", before + gap_mj + 1000 * energy_j)
            st.set("updated_at", new_updated)
            if self.virtual and self.power_window_s > 0:
                after = before + gap_mj
                self._remember((updated, before), (work_from, after), (end, after + 1000 * energy_j))
            if end - start >= 0.01:  # a shorter interval's average is mostly noise
                st.set("last_power_w", energy_j / (end - start))
                st.set("last_power_at", end)

    def _remember(self, *points: tuple[float, float]) -> None:
        """Add (time, true energy in mJ) breakpoints, forgetting those older than the power window needs."""
        history = self._history
        for t, mj in points:
            if not history or t > history[-1][0]:
                history.append((t, mj))
        if len(history) > 64 and history[32][0] < history[-1][0] - 1.2:
            keep_from = bisect.bisect_left(history, (history[-1][0] - 1.2,)) - 1  # >= 32
            del history[:keep_from]

    def _energy_history(self, t: float) -> float:
        """The true energy (mJ) at `t` from the breakpoints (linear between them, idle power outside)."""
        history = self._history
        if not history:
            return self._energy_at(t)
        i = bisect.bisect_left(history, (t,))
        if i == len(history):
            return history[-1][1] + self._idle_mw * (t - history[-1][0])
        t1, e1 = history[i]
        if i == 0:
            return e1 - self._idle_mw * (t1 - t)
        t0, e0 = history[i - 1]
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0) if t1 > t0 else e1

    def settle(self) -> None:
        """Settle the counter before another process changes the state (what `_account_idle` does for a change
        made here)."""
        self._account_idle()

    def _account_idle(self) -> None:
        """Settle the counter before a state change so that past energy uses the old operating point."""
        if self.virtual:
            return
        # A signal handler restoring the GPU may interrupt this thread inside `synchronize` (which holds the
        # lock while the GPU catches up): never wait for ourselves; that synchronisation settles the counter.
        if not self._mutex.acquire(blocking=False):
            return
        self._mutex.release()
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for the work issued since the last synchronisation (real-clock mode)."""
        if self.virtual:
            return
        with self._mutex:
            self._issued_work = True
            start = self._last_sync
            now = HOST_CLOCK.now()
            cpu = time.process_time()
            rel0, power = self.operating_point()
            rel, power = self._noisy(rel0), self._noisy(power)
            queued, self._queued_s = self._queued_s, 0.0
            st = self._state
            st.set("kernels_pid", os.getpid() if self._kernels else 0.0)  # as other processes see it
            if self._kernels:
                # Queued kernels ran from their launch, beside the host's own work, which is not GPU work: the
                # host's speed and load move neither their time nor their energy (unless the host is slower).
                gpu_busy = queued * rel
                gpu_end = self._kernels_end + queued * (rel - rel0)
            else:
                busy = min(max(0.0, cpu - self._last_cpu), max(0.0, now - start))
                gpu_busy = busy * rel
                # Time the host already spent waiting for other GPUs counts: this GPU worked meanwhile.
                gpu_end = now + gpu_busy - busy - HOST_WAIT.credit(cpu, self.index)
            end = now
            if gpu_end > now:
                self._busy_until = gpu_end
                end = HOST_CLOCK.wait_until(gpu_end, defer_signals=self.blocking_sync)
                HOST_WAIT.add(cpu, end - now, time.process_time(), self.index)
            busy_span = min(gpu_busy, end - start)
            idle_span = max(0.0, (end - start) - busy_span)
            self._add(start, end, busy_span * power + idle_span * self.spec.idle_power_w)
            self._last_sync = end
            self._last_cpu = time.process_time()
            st.set("worker_pid", os.getpid())
            st.set("worker_cpu_s", process_cpu_s(os.getpid()) or 0.0)  # as another process reads it
            st.set("worker_sync_at", end)

    def enqueue(self, work_s: float) -> None:
        """Queue `work_s` seconds of work (at the maximum limit and clock) that uses no host CPU: a stand-in
        for a CUDA kernel. It runs from its launch (once the kernels queued before it are done), at the
        operating point in force then, beside the host's own work; the next synchronisation waits for it.
        From then on, the host's CPU time is not GPU work on this GPU, nor since the last synchronisation; other
        processes learn it here, so a process queues one (`enqueue(0.0)`) before it synchronises first."""
        if work_s < 0:
            raise ValueError(f"Simulated work must be >= 0 s, got {work_s!r}.")
        with self._mutex:
            self._issued_work = self._kernels = True
            self._queued_s += work_s
            if not self.virtual:  # it runs once the GPU is done with the kernels before it
                rel, _ = self.operating_point()
                self._kernels_end = max(self._kernels_end, HOST_CLOCK.now()) + work_s * rel
                # Others see the GPU busy until then, on the wall clock: their node time lags it by their own lag.
                self._state.set("kernels_end", self._kernels_end + HOST_CLOCK.lag_s)
                self._state.set("kernels_pid", os.getpid())

    def busy_time(self, work_s: float) -> tuple[float, float]:
        """(time, power) of `work_s` seconds of work-at-maximum-limit at the current state, with noise
        (and, with `bursts`, a step's share of stalls and bursts: the GPU idles for that time)."""
        rel, power = self.operating_point()
        busy, power = work_s * self._noisy(rel), self._noisy(power)
        if not self.bursts or busy <= 0:
            return busy, power
        idle = self._stall_s(busy)
        return busy + idle, (busy * power + idle * self.spec.idle_power_w) / (busy + idle)

    def _stall_s(self, busy_s: float) -> float:
        """Idle time added to a step: a stall (data loader, checkpoint) in 2% of steps, 0.5-3x the step;
        a burst (another job, throttling) starting at 1% of steps, 5-20 steps 10-50% slower."""
        extra = busy_s * self._rng.uniform(0.5, 3.0) if self._rng.random() < 0.02 else 0.0
        if self._burst_left <= 0 and self._rng.random() < 0.01:
            self._burst_left, self._burst_factor = self._rng.randint(5, 20), self._rng.uniform(1.1, 1.5)
        if self._burst_left > 0:
            self._burst_left -= 1
            extra += busy_s * (self._burst_factor - 1)
        return extra

    def run_virtual(self, start: float, busy_s: float, power_w: float, span_s: float) -> None:
        """Account one virtual interval: `busy_s` at `power_w`, then idle until `span_s`."""
        idle = max(0.0, span_s - busy_s) * self.spec.idle_power_w
        self._add(start, start + span_s, busy_s * power_w + idle)
