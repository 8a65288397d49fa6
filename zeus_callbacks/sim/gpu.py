"""One simulated GPU driven by a measured trace: speed and energy under power limits and SM clocks, faults."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from zeus_callbacks.sim.gpu_energy import EnergyCounter, PowerSensor, last_refresh
from zeus_callbacks.sim.gpu_state import GPUState, others_power_w
from zeus_callbacks.sim.gpu_work import IssuedWork, WorkVariability
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


class BoardSettings:
    """The settings in force in the state every process shares (power limits, persistence, clock locks), and
    the operating point they give, computed again only when a process changed them."""

    def __init__(self, state: GPUState, spec: GPUSpec, trace: Trace, board: DumpBoardModel | None) -> None:
        self.state = state
        self._spec, self._trace, self._board = spec, trace, board
        self.changes = 0  # the changes this process made (`Faults.lost_after_changes`)
        self._op_version = -1.0
        self._op = (1.0, trace.power(trace.max_power_limit_w))

    def power_limit_mw(self) -> int:
        """The power limit in force (mW)."""
        return int(self.state.get("power_limit_mw"))

    def module_limit_mw(self) -> int:
        """The module-scope limit requested (mW; 0 on a board without a module scope)."""
        return int(self.state.get("module_limit_mw"))

    def enforced_power_limit_mw(self) -> int:
        """The limit the driver enforces after every limiter: the one set, or lower on a board from a dump."""
        limit = self.power_limit_mw()
        return limit if self._board is None else self._board.enforced_mw(limit, self.module_limit_mw())

    def locked_sm_clocks_mhz(self) -> tuple[int, int] | None:
        """The locked SM clock range, or None when not locked."""
        hi = self.state.get("sm_lock_max_mhz")
        return None if hi <= 0 else (int(self.state.get("sm_lock_min_mhz")), int(hi))

    def change(self, fields: dict[str, float]) -> None:
        """Change settings that move the operating point (the counter already settled at the old one)."""
        self.changes += 1
        with self.state.lock():
            for name, value in fields.items():
                self.state.set(name, value)
            self.state.set("version", self.state.get("version") + 1)

    def operating_point(self) -> tuple[float, float]:
        """(relative time of work vs the maximum limit, busy power in W) for the settings in force."""
        version = self.state.get("version")
        if version != self._op_version:
            pl_w = self.enforced_power_limit_mw() / 1000
            self._op = operating_point(self._trace, self._spec, pl_w, self.locked_sm_clocks_mhz())
            self._op_version = version
        return self._op


class SimulatedGPU:
    """One simulated GPU: a trace-driven model of speed and power under power limits and SM clocks.

    Speed: the host's CPU time between two synchronisation points stands for the GPU's work at the
    maximum power limit; at the synchronisation the GPU "catches up" by sleeping so that the work takes
    `relative_time` as long, so any timer sees the slowdown. Once this process queues work as kernels
    (`enqueue`), the work runs from its launch instead and the host's CPU time is never GPU work on this GPU.
    Energy: busy time at the traced power, the rest at idle power, accumulated in a counter that persists
    across processes. On the wall clock, times are the node's (`HOST_CLOCK`): how late the host wakes from a
    synchronisation moves neither.
    Its parts: the settings in force and their operating point (`BoardSettings`), the energy counter and power
    sensor (`gpu_energy`), and the work this process issued (`gpu_work`); it holds what the board is.
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
        # What the board is: its place, names, model and the dump it may come from.
        self.index = index
        self.spec = spec
        self.trace = trace
        self.uuid = uuid
        self.pci_bus_id = pci_bus_id
        self.provenance = provenance(spec, trace)  # a modelled board's label; None for a traced one
        self.board = board
        self._clock = clock
        # What NVML reads is the truth times `sensor_gain` (`specs.sensor_gain`); the power usage is averaged
        # over a second on boards that report it so.
        self.sensor_gain = sensor_gain
        self.power_usage_averaged = power_usage_averaged and not faults.no_energy_counter
        # Injected faults; reads that none can touch skip the fault checks (the monitor's hot path).
        self.faults = faults
        self.plain_reads = (
            faults.lost_after_calls is None
            and faults.lost_after_changes is None
            and not faults.no_energy_counter
            and not (faults.missing or faults.unknown)
        )
        self._calls = 0
        # A board from a dump has its own settable range, default and requested limits; others the trace's.
        limits = None if board is None else board.gpu_limits
        self.min_power_limit_mw = limits.min_mw if limits else int(trace.min_power_limit_w * 1000)
        self.max_power_limit_mw = limits.max_mw if limits else int(trace.max_power_limit_w * 1000)
        default_mw = limits.default_mw if limits else int(trace.max_power_limit_w * 1000)
        if faults.default_limit_w is not None:
            default_mw = int(faults.default_limit_w * 1000)
        self.default_power_limit_mw = default_mw
        in_force = limits.requested_mw if limits and faults.default_limit_w is None else default_mw
        module = None if board is None else board.module_limits
        # The driver refreshes the energy counter every `energy_refresh_s` and updates the power reading every
        # `power_update_s`, at a phase of the board's own, so that the GPUs of a node do not refresh together.
        self.energy_refresh_s = energy_refresh_s
        phase = int(hashlib.sha1(uuid.encode()).hexdigest()[:8], 16) / 16**8
        state = GPUState(
            state_path,
            {
                "power_limit_mw": in_force,
                "module_limit_mw": module.requested_mw if module else 0.0,
                "persistence": float(bool(board and board.persistence)),
                "energy_mj": 0.0,
                "updated_at": self.now(),
                "refreshed_mj": 0.0,  # the last refresh before the state began, as if nothing was drawn yet
                "refreshed_at": (
                    last_refresh(self.now(), phase * energy_refresh_s, energy_refresh_s)
                    if energy_refresh_s
                    else float("-inf")
                ),
            },
        )
        self._settings = BoardSettings(state, spec, trace, board)
        sensor = PowerSensor(power_update_s, power_window_s, phase * power_update_s)
        self._energy = EnergyCounter(
            state, clock, spec.idle_power_w, energy_refresh_s, phase * energy_refresh_s, sensor
        )
        variability = WorkVariability(noise, seed * 1_000_003 + index, bursts)
        self._work = IssuedWork(self.now(), blocking_sync, variability)

    # -- time -------------------------------------------------------------------------------------
    def now(self) -> float:
        """The simulator's clock: the node's time (`HOST_CLOCK`), or virtual time for offline runs."""
        return self._clock.now() if self._clock is not None else HOST_CLOCK.now()

    @property
    def _virtual(self) -> bool:
        """Whether this GPU runs on a virtual clock."""
        return self._clock is not None

    # -- faults -----------------------------------------------------------------------------------
    def count_call(self) -> bool:
        """Count one NVML call; True once the GPU has fallen off the bus."""
        self._calls += 1
        after_calls, after_changes = self.faults.lost_after_calls, self.faults.lost_after_changes
        return (after_calls is not None and self._calls > after_calls) or (
            after_changes is not None and self._settings.changes >= after_changes
        )

    # -- state ------------------------------------------------------------------------------------
    @property
    def power_limit_mw(self) -> int:
        """The power limit in force (mW)."""
        return self._settings.power_limit_mw()

    def _change(self, **fields: float) -> None:
        """Change settings that move the operating point (already validated by the NVML layer), the counter
        settled first at the old one."""
        self._account_idle()
        self._settings.change(fields)

    def set_power_limit_mw(self, value: int) -> None:
        """Change the power limit."""
        self._change(power_limit_mw=value)

    @property
    def enforced_power_limit_mw(self) -> int:
        """The limit the driver enforces after every limiter (`nvmlDeviceGetEnforcedPowerLimit`): the one set,
        or lower on a board from a dump (`DumpBoardModel.enforced_mw`)."""
        return self._settings.enforced_power_limit_mw()

    @property
    def module_limit_mw(self) -> int:
        """The module-scope limit requested (mW; 0 on a board without a module scope)."""
        return self._settings.module_limit_mw()

    def set_module_limit_mw(self, value: int) -> None:
        """Change the module-scope limit."""
        self._change(module_limit_mw=value)

    @property
    def persistence(self) -> bool:
        """Persistence mode."""
        return bool(self._settings.state.get("persistence"))

    def set_persistence(self, enabled: bool) -> None:
        """Change persistence mode."""
        self._settings.state.set("persistence", 1.0 if enabled else 0.0)

    @property
    def locked_sm_clocks_mhz(self) -> tuple[int, int] | None:
        """The locked SM clock range, or None when not locked."""
        return self._settings.locked_sm_clocks_mhz()

    def lock_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into a range."""
        self._change(sm_lock_min_mhz=min_mhz, sm_lock_max_mhz=max_mhz)

    def reset_sm_clocks(self) -> None:
        """Unlock the SM clock."""
        self.lock_sm_clocks(0, 0)

    @property
    def memory_clocks_locked(self) -> bool:
        """Whether memory clocks are locked."""
        return bool(self._settings.state.get("mem_locked"))

    def set_memory_clocks_locked(self, locked: bool) -> None:
        """Record a memory clock lock (memory clocks do not change the traced model)."""
        self._settings.state.set("mem_locked", 1.0 if locked else 0.0)

    # -- physics ----------------------------------------------------------------------------------
    def operating_point(self) -> tuple[float, float]:
        """(relative time of work vs the maximum limit, busy power in W) for the current state."""
        return self._settings.operating_point()

    def _compute_operating_point(self, pl_w: float, locked: tuple[int, int] | None) -> tuple[float, float]:
        return operating_point(self.trace, self.spec, pl_w, locked)

    # -- energy -----------------------------------------------------------------------------------
    def energy_mj(self) -> float:
        """The energy counter at the driver's last refresh (mJ); NVML reports it times `sensor_gain`.

        Between refreshes (every `energy_refresh_s`) the counter stands still, as on real boards.
        """
        return self._energy.reading_mj()

    def true_energy_mj(self) -> float:
        """The energy the GPU has drawn up to now (mJ), unrounded by the counter's refresh: ground truth."""
        return self._energy.true_mj(self.now())

    def average_power_mw(self) -> float:
        """Power averaged over the last second (mW), as Ampere and newer boards report `nvmlDeviceGetPowerUsage`."""
        now = self.now()
        energy_at = self._energy.at
        if self._virtual:
            return energy_at(now) - energy_at(now - 1.0)
        # Work issued since the last synchronisation is not accounted yet: the instantaneous estimate covers it.
        unsynced_from = min(max(now - 1.0, self._work.last_sync), now)
        accounted = energy_at(unsynced_from) - energy_at(now - 1.0)
        return accounted + self.power_mw() * (now - unsynced_from)

    def power_mw(self) -> float:
        """Instantaneous power draw (mW).

        The higher of this process's work queued on the GPU (busy power while its kernels run; without
        kernels, busy power in proportion to the host CPU time since the last synchronisation; full busy
        power while a synchronisation catches up) and another process's work on it (`others_power_w`), as a
        sampler in another process sees it; else idle power. On a virtual clock, the sensor's reading
        (`PowerSensor`), or the last interval's power.
        """
        st = self._settings.state
        now = self.now()
        idle = self.spec.idle_power_w
        last_at = st.get("last_power_at")
        if self._virtual:
            sensor = self._energy.sensor
            if sensor.window_s > 0:
                return sensor.mean_mw(now, self._energy)
            return (st.get("last_power_w") if now - last_at < 0.5 else idle) * 1000
        _, busy_power = self.operating_point()
        work = self._work
        if now < work.busy_until:  # catching up
            return busy_power * 1000
        if work.kernels:  # busy while the kernels run; the host's CPU time is not GPU work
            if now < work.kernels_end:
                return busy_power * 1000
            local = idle
        else:
            local = (
                busy_power_w(idle, busy_power, time.process_time() - work.last_cpu, now - work.last_sync)
                if work.issued
                else idle
            )
        return max(local, others_power_w(st, now, work.last_sync, idle, busy_power)) * 1000

    def settle(self) -> None:
        """Settle the counter before another process changes the state (what `_account_idle` does for a change
        made here)."""
        self._account_idle()

    def _account_idle(self) -> None:
        """Settle the counter before a state change so that past energy uses the old operating point."""
        if self._virtual:
            return
        # A signal handler restoring the GPU may interrupt this thread inside `synchronize` (which holds the
        # lock while the GPU catches up): never wait for ourselves; that synchronisation settles the counter.
        if not self._work.mutex.acquire(blocking=False):
            return
        self._work.mutex.release()
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for the work issued since the last synchronisation (real-clock mode)."""
        if self._virtual:
            return
        work = self._work
        with work.mutex:
            HOST_CLOCK.pace(int(self._settings.state.get("worker_pid")))
            work.issued = True
            start = work.last_sync
            now = HOST_CLOCK.now()
            cpu = time.process_time()
            rel0, power = self.operating_point()
            rel, power = work.variability.noisy(rel0), work.variability.noisy(power)
            queued, work.queued_s = work.queued_s, 0.0
            st = self._settings.state
            st.set("kernels_pid", os.getpid() if work.kernels else 0.0)  # as other processes see it
            if work.kernels:
                # Queued kernels ran from their launch, beside the host's own work, which is not GPU work: the
                # host's speed and load move neither their time nor their energy (unless the host is slower).
                gpu_busy = queued * rel
                gpu_end = work.kernels_end + queued * (rel - rel0)
            else:
                # Capped by the wall-clock span: a process's CPU time counts every thread's, while the node's
                # span leaves out the time this one waited for a CPU.
                busy = min(max(0.0, cpu - work.last_cpu), max(0.0, time.time() - work.last_wall))
                gpu_busy = busy * rel
                # Time the host already spent waiting for other GPUs counts: this GPU worked meanwhile.
                gpu_end = now + gpu_busy - busy - HOST_WAIT.credit(cpu, self.index)
            end = now
            if gpu_end > now:
                work.busy_until = gpu_end
                end = HOST_CLOCK.wait_until(gpu_end, defer_signals=work.blocking_sync)
                HOST_WAIT.add(cpu, end - now, time.process_time(), self.index)
            busy_span = min(gpu_busy, end - start)
            idle_span = max(0.0, (end - start) - busy_span)
            self._energy.add(start, end, busy_span * power + idle_span * self.spec.idle_power_w)
            work.last_sync = end
            work.last_cpu, work.last_wall = time.process_time(), time.time()
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
        work = self._work
        with work.mutex:
            work.issued = work.kernels = True
            work.queued_s += work_s
            if not self._virtual:  # it runs once the GPU is done with the kernels before it
                rel, _ = self.operating_point()
                work.kernels_end = max(work.kernels_end, HOST_CLOCK.now()) + work_s * rel
                # Others see the GPU busy until then, on the wall clock: their node time lags it by their own lag.
                self._settings.state.set("kernels_end", work.kernels_end + HOST_CLOCK.lag_s)
                self._settings.state.set("kernels_pid", os.getpid())

    def busy_time(self, work_s: float) -> tuple[float, float]:
        """(time, power) of `work_s` seconds of work-at-maximum-limit at the current state, with noise
        (and, with `bursts`, a step's share of stalls and bursts: the GPU idles for that time)."""
        rel, power = self.operating_point()
        variability = self._work.variability
        busy, power = work_s * variability.noisy(rel), variability.noisy(power)
        if not variability.bursts or busy <= 0:
            return busy, power
        idle = variability.stall_s(busy)
        return busy + idle, (busy * power + idle * self.spec.idle_power_w) / (busy + idle)

    def run_virtual(self, start: float, busy_s: float, power_w: float, span_s: float) -> None:
        """Account one virtual interval: `busy_s` at `power_w`, then idle until `span_s`."""
        idle = max(0.0, span_s - busy_s) * self.spec.idle_power_w
        self._energy.add(start, start + span_s, busy_s * power_w + idle)
