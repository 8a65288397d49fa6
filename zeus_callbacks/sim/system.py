"""Simulated GPUs driven by measured traces: state that outlives the process, energy, speed, faults."""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import math
import mmap
import os
import random
import signal
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zeus_callbacks.core.device.backend import cuda_visible_uuids
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.journal import open_trusted_file
from zeus_callbacks.sim.specs import GPUSpec, spec_for
from zeus_callbacks.sim.traces import Trace, load_trace, provenance, shipped_trace

__all__ = [
    "SimulatedGPU",
    "SimulatedSystem",
    "Faults",
    "VirtualClock",
    "parse_spec",
    "parse_faults",
    "parse_ideal",
    "IDEAL_BEHAVIOURS",
]

IDEAL_BEHAVIOURS = ("energy_counter", "power_average", "power_window", "device_order", "interruptible_sync")
"""Hardware behaviours a simulation can switch off (`simulate(ideal=...)`, `ZEUS_CALLBACKS_SIM_IDEAL`)."""

# Persistent per-GPU state: a small file of float64 fields, mapped into memory so that reads cost
# about a microsecond and every process on the "node" sees the same GPU, as with a real one.
# A ring of the true energy at the ticks of a 0.1 s grid over the last ~1.2 s, for the 1-second moving
# average of power that `nvmlDeviceGetPowerUsage` reports on Ampere and newer boards.
_RING_SLOTS = 12
_RING_TICK_S = 0.1
_FIELDS = (
    "power_limit_mw",
    "sm_lock_min_mhz",
    "sm_lock_max_mhz",
    "persistence",
    "energy_mj",  # the true energy, accounted up to `updated_at`
    "updated_at",
    "refreshed_mj",  # the counter as the driver last refreshed it, at `refreshed_at` (a refresh tick)
    "refreshed_at",
    "version",
    "mem_locked",
    "last_power_w",
    "last_power_at",
    "worker_pid",  # the process that last synchronised the GPU, its CPU time then (s), and when
    "worker_cpu_s",
    "worker_sync_at",
    *(f"ring{i}_{part}" for i in range(_RING_SLOTS) for part in ("tick", "mj")),
)
_IDX = {name: i for i, name in enumerate(_FIELDS)}
_FMT = f"<{len(_FIELDS)}d"
_SIZE = struct.calcsize(_FMT)
# The energy counter, its timestamp and the driver's refreshed value are adjacent: the hot read is one unpack.
_ENERGY = struct.Struct("<4d")
_ENERGY_OFFSET = 8 * _IDX["energy_mj"]
_read_energy = _ENERGY.unpack_from  # bound once: the energy read is the monitor's hot path
_wall = time.time
assert _IDX["refreshed_at"] == _IDX["energy_mj"] + 3
_RING_OFFSET = 8 * _IDX["ring0_tick"]
_RING_SLOT = struct.Struct("<2d")
# Signals whose Python handlers a native synchronisation defers until it returns.
_DEFERRED_SIGNALS = {
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
}


def _busy_power_w(idle_w: float, busy_w: float, cpu_s: float, span_s: float) -> float:
    """Power of a GPU fed by a host that spent `cpu_s` of CPU over `span_s` since its last synchronisation:
    busy power in that proportion. Right after a synchronisation the ratio of two tiny spans is noise: it
    is averaged over >= 10 ms."""
    busy = min(max(0.0, cpu_s), max(0.0, span_s))
    return idle_w + (busy_w - idle_w) * busy / max(span_s, 0.01)


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (/proc/PID/stat, fields 14 and 15 of proc(5)); None when
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


_CLK_TCK = os.sysconf("SC_CLK_TCK")


class _HostWait:
    """How long the host has waited in simulated synchronisations since it last did CPU work.

    GPUs work in parallel: while the host waits for one GPU, the others keep working on the work queued
    before, so synchronising several GPUs in a row takes as long as the slowest, not the sum.
    """

    _CPU_EPS_S = 0.002  # CPU time the host may spend between the synchronisations of one batch

    def __init__(self) -> None:
        self._cpu_mark = float("-inf")
        self._waited_s: dict[int, float] = {}  # GPU index -> time waited for it since the mark

    def credit(self, cpu_s: float, gpu: int) -> float:
        """Time already waited for *other* GPUs since the host's last CPU work (0 once it did more work).

        A GPU's own earlier waits never count: its next interval starts after them.
        """
        if cpu_s - self._cpu_mark >= self._CPU_EPS_S:
            return 0.0
        return sum(w for g, w in self._waited_s.items() if g != gpu)

    def add(self, cpu_before_s: float, waited_s: float, cpu_after_s: float, gpu: int) -> None:
        """Record a wait of `waited_s` for `gpu` that began at process CPU time `cpu_before_s`."""
        if cpu_before_s - self._cpu_mark >= self._CPU_EPS_S:
            self._waited_s.clear()
        self._waited_s[gpu] = self._waited_s.get(gpu, 0.0) + waited_s
        self._cpu_mark = cpu_after_s


_HOST_WAIT = _HostWait()


class VirtualClock:
    """A clock that only moves when simulated work runs (offline what-if runs)."""

    def __init__(self, start: float = 1_000.0) -> None:
        self._now = start

    def now(self) -> float:
        """Current virtual time (s)."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self._now += max(0.0, seconds)


@dataclass
class Faults:
    """Faults injected into one simulated GPU."""

    no_permission: bool = False
    not_supported: frozenset[str] = frozenset()  # subset of {"power", "clocks", "persistence"}
    lost_after_calls: int | None = None
    lost_after_changes: int | None = None  # lost once this process has changed a setting this many times
    no_energy_counter: bool = False
    mig: bool = False
    hidden: bool = False  # counted by NVML, but the job's cgroup does not grant it
    no_cap_sys_admin: bool = False  # root without CAP_SYS_ADMIN: every setter is refused
    empty_clocks: bool = False  # the supported graphics clocks list is empty
    empty_memory_clocks: bool = False  # the supported memory clocks list is empty
    missing: frozenset[str] = frozenset()  # NVML functions an old driver's library lacks: FUNCTION_NOT_FOUND
    unknown: frozenset[str] = frozenset()  # NVML functions whose whole call answers UNKNOWN
    default_limit_w: float | None = None  # a default power limit below the maximum settable (GeForce)


class _State:
    """Field access over a mapped file (shared) or a bytearray (in-memory)."""

    def __init__(self, path: Path | None, initial: dict[str, float]) -> None:
        self.path = path
        if path is None:
            self._buf: mmap.mmap | bytearray = bytearray(_SIZE)
            self._fd = None
            self._write_all(initial)
            return
        try:  # the journal's trust rules: a planted symbolic link or another user's file is never written
            fd = open_trusted_file(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise InvalidInputError(
                f"Simulated GPU state {e.filename or path}: {e.strerror or e}. Remove it, or set "
                f"ZEUS_CALLBACKS_SIM_STATE_DIR to a directory only you may write (e.g. `mkdir -m 700`)."
            ) from None
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            fresh = os.fstat(fd).st_size < _SIZE
            if fresh:
                os.ftruncate(fd, _SIZE)
            self._buf = mmap.mmap(fd, _SIZE)
            if fresh:
                self._write_all(initial)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._fd = fd

    def _write_all(self, values: dict[str, float]) -> None:
        struct.pack_into(_FMT, self._buf, 0, *(float(values.get(n, 0.0)) for n in _FIELDS))

    def get(self, name: str) -> float:
        return struct.unpack_from("<d", self._buf, 8 * _IDX[name])[0]

    def set(self, name: str, value: float) -> None:
        struct.pack_into("<d", self._buf, 8 * _IDX[name], float(value))

    def lock(self) -> _Lock:
        return _Lock(self._fd)


class _Lock:
    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


class SimulatedGPU:
    """One simulated GPU: a trace-driven model of speed and power under power limits and SM clocks.

    Speed: the host's CPU time between two synchronisation points stands for the GPU's work at the
    maximum power limit; at the synchronisation the GPU "catches up" by sleeping so that the work takes
    `relative_time` as long, so any timer sees the slowdown. Energy: busy time at the traced power,
    the rest at idle power, accumulated in a counter that persists across processes.
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
    ) -> None:
        self.index = index
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
        default_w = trace.max_power_limit_w if faults.default_limit_w is None else faults.default_limit_w
        self.default_power_limit_mw = int(default_w * 1000)
        self._state = _State(
            state_path,
            {
                "power_limit_mw": self.default_power_limit_mw,
                "persistence": 0.0,
                "energy_mj": 0.0,
                "updated_at": self.now(),
                "refreshed_mj": 0.0,  # the last refresh before the state began, as if nothing was drawn yet
                "refreshed_at": self._last_refresh(self.now()) if energy_refresh_s else float("-inf"),
            },
        )
        self._buf = self._state._buf
        self._queued_s = 0.0  # work enqueued without host CPU (simulated kernels), at the maximum clock
        self._op_version = -1.0
        self._op = (1.0, trace.power(trace.max_power_limit_w))
        self._last_sync = self.now()
        self._last_cpu = time.process_time()
        self._issued_work = False  # a process that never synchronised nor queued work is a reader only
        self._busy_until = 0.0
        self._mutex = threading.Lock()

    # -- time -------------------------------------------------------------------------------------
    def now(self) -> float:
        """The simulator's clock: wall time, or virtual time for offline runs."""
        return self._clock.now() if self._clock is not None else time.time()

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

    def set_power_limit_mw(self, value: int) -> None:
        """Change the power limit (already validated by the NVML layer)."""
        self._account_idle()
        self._changes += 1
        with self._state.lock():
            self._state.set("power_limit_mw", value)
            self._state.set("version", self._state.get("version") + 1)

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
        self._account_idle()
        self._changes += 1
        with self._state.lock():
            self._state.set("sm_lock_min_mhz", min_mhz)
            self._state.set("sm_lock_max_mhz", max_mhz)
            self._state.set("version", self._state.get("version") + 1)

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
            self._op = self._compute_operating_point(self.power_limit_mw / 1000, self.locked_sm_clocks_mhz)
            self._op_version = version
        return self._op

    def _compute_operating_point(self, pl_w: float, locked: tuple[int, int] | None) -> tuple[float, float]:
        tr = self.trace
        rel = tr.relative_time(pl_w)
        power = tr.power(pl_w)
        if locked is None:
            return rel, power
        # A clock cap moves the GPU along the same time/power curve a power cap does: time scales as
        # 1/f, and each traced limit corresponds to the clock f_max / relative_time it achieves.
        f_max = self.spec.max_sm_clock_mhz
        mono = tr.monotone_relative_time()
        f_pl = f_max / float(np.interp(pl_w, tr.power_limits_w, mono))
        f = min(float(locked[1]), f_pl)
        if f >= f_pl:
            return rel, power
        f_low = f_max / float(mono[0])
        if f >= f_low:
            # Find the lowest traced limit that runs at clock f (mono is non-increasing in the limit).
            eq_pl = float(np.interp(f_max / f, mono[::-1], tr.power_limits_w[::-1]))
            return f_max / f, tr.power(eq_pl)
        # Below every traced limit: continue the traced power-vs-clock line of the two lowest limits
        # (never below idle), so energy per unit of work keeps the trend the trace shows there instead
        # of a model the data does not support.
        p_low = tr.power(tr.min_power_limit_w)
        slope = 0.0
        if len(mono) > 1:
            f_next = f_max / float(mono[1])
            if f_next > f_low:
                slope = max(0.0, (tr.power(float(tr.power_limits_w[1])) - p_low) / (f_next - f_low))
        return f_max / f, max(self.spec.idle_power_w, p_low - slope * (f_low - f))

    def _noisy(self, value: float) -> float:
        if self.noise <= 0:
            return value
        return value * min(1.5, max(0.5, self._rng.gauss(1.0, self.noise)))

    # -- energy -----------------------------------------------------------------------------------
    def energy_mj(self) -> float:
        """The energy counter as NVML reports it (mJ): its value at the driver's last refresh.

        Between refreshes (every `energy_refresh_s`) the counter stands still, as on real boards.
        """
        energy, updated, refreshed, refreshed_at = _read_energy(self._buf, _ENERGY_OFFSET)
        now = _wall() if self._clock is None else self._clock.now()
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
        energy, updated, _, _ = _read_energy(self._buf, _ENERGY_OFFSET)
        since = self.now() - updated
        return energy + self._idle_mw * since if since > 0 else energy

    def _energy_at(self, t: float) -> float:
        """The true energy (mJ) at time `t`, no earlier than about 1.1 s before the last accounting."""
        energy, updated, _, _ = _read_energy(self._buf, _ENERGY_OFFSET)
        if t >= updated:
            return energy + self._idle_mw * (t - updated)
        k = math.floor(t / _RING_TICK_S)
        t0, e0 = self._ring(k)
        if t0 != t0:  # nothing accounted then: the GPU idled
            return energy - self._idle_mw * (updated - t)
        t1, e1 = (updated, energy) if (k + 1) * _RING_TICK_S > updated else self._ring(k + 1)
        if t1 != t1 or t1 <= t0:
            return e0
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def _ring(self, tick: int) -> tuple[float, float]:
        """(time, true energy in mJ) at a tick of the power-average grid; (nan, nan) when not stored."""
        stored, mj = _RING_SLOT.unpack_from(self._buf, _RING_OFFSET + 16 * (tick % _RING_SLOTS))
        return (tick * _RING_TICK_S, mj) if stored == tick else (math.nan, math.nan)

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

        The highest of this process's work queued on the GPU (busy power in proportion to the host CPU
        time since the last synchronisation; full busy power while a synchronisation catches up), another
        process's recent work on it (the average power of its last interval), and the work in progress of
        the process that synchronised it last (the same proportion, from that process's CPU time in
        /proc), as a sampler in another process sees it; else idle power.
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
        # Another process's recent work (this process's own syncs are covered by the local estimate).
        shared = st.get("last_power_w") if now - last_at < 0.5 and last_at > self._last_sync else idle
        _, busy_power = self.operating_point()
        if now < self._busy_until or self._queued_s > 0:  # catching up, or kernels queued and running
            return busy_power * 1000
        local = (
            _busy_power_w(idle, busy_power, time.process_time() - self._last_cpu, now - self._last_sync)
            if self._issued_work
            else idle
        )
        worker = int(st.get("worker_pid"))
        if worker and worker != os.getpid():
            cpu = _process_cpu_s(worker)
            if cpu is not None:
                since = now - st.get("worker_sync_at")
                shared = max(shared, _busy_power_w(idle, busy_power, cpu - st.get("worker_cpu_s"), since))
        return max(local, shared) * 1000

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
            first = max(math.ceil(updated / _RING_TICK_S), math.ceil((end - 1.2) / _RING_TICK_S))
            for k in range(first, math.floor(end / _RING_TICK_S) + 1):
                _RING_SLOT.pack_into(
                    st._buf, _RING_OFFSET + 16 * (k % _RING_SLOTS), k, energy_at(k * _RING_TICK_S)
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
            now = time.time()
            cpu = time.process_time()
            busy = min(max(0.0, cpu - self._last_cpu), max(0.0, now - start))
            rel, power = self.operating_point()
            rel, power = self._noisy(rel), self._noisy(power)
            queued, self._queued_s = self._queued_s, 0.0
            gpu_busy = (busy + queued) * rel
            # Time the host already spent waiting for other GPUs counts: this GPU worked meanwhile.
            extra = gpu_busy - busy - _HOST_WAIT.credit(cpu, self.index)
            if extra > 0:
                self._busy_until = now + extra
                self._wait(extra)
                _HOST_WAIT.add(cpu, time.time() - now, time.process_time(), self.index)
            end = time.time()
            busy_span = min(gpu_busy, end - start)
            idle_span = max(0.0, (end - start) - busy_span)
            self._add(start, end, busy_span * power + idle_span * self.spec.idle_power_w)
            self._last_sync = end
            self._last_cpu = time.process_time()
            st = self._state
            st.set("worker_pid", os.getpid())
            st.set("worker_cpu_s", _process_cpu_s(os.getpid()) or 0.0)  # as another process reads it
            st.set("worker_sync_at", end)

    def _wait(self, seconds: float) -> None:
        """Wait for the GPU; like CUDA's synchronisation, in native code that defers Python signal handlers."""
        if not self.blocking_sync:
            time.sleep(seconds)
            return
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
        try:
            time.sleep(seconds)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def enqueue(self, work_s: float) -> None:
        """Queue `work_s` seconds of work (at the maximum limit and clock) that uses no host CPU: a stand-in
        for a CUDA kernel. The next synchronisation waits for it at the operating point in force then."""
        if work_s < 0:
            raise ValueError(f"Simulated work must be >= 0 s, got {work_s!r}.")
        with self._mutex:
            self._issued_work = True
            self._queued_s += work_s

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


def _uuid_for(system_id: str, index: int) -> str:
    h = hashlib.sha1(f"{system_id}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass
class GPUGroup:
    """`COUNT*KIND[:WORKLOAD][@TRACE_FILE]` of a simulation spec."""

    kind: str
    count: int = 1
    workload: str | None = None
    trace_file: str | None = None

    def trace(self) -> Trace:
        if self.trace_file:
            return load_trace(self.trace_file, self.workload or "", gpu_model=self.kind)
        return shipped_trace(spec_for(self.kind).kind, self.workload)


def parse_spec(spec: str) -> list[GPUGroup]:
    """Parse `ZEUS_CALLBACKS_SIMULATE`: comma-separated `[COUNT*]KIND[:WORKLOAD][@TRACE_FILE]` groups.

    Examples: `a40`, `4*a40:imagenet/resnet50/256`, `a10g,t4`, `2*v100:resnet50`,
    `a40:mydata/mynet/64@/data/my_profile.csv`.
    """
    groups = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        count = 1
        if "*" in item:
            n, item = item.split("*", 1)
            if not n.strip().isdigit() or int(n) < 1:
                raise InvalidInputError(
                    f"{_SPEC_INPUT} {spec!r}: {raw!r} needs a positive count before '*', e.g. 4*a40."
                )
            count = int(n)
        trace_file = None
        if "@" in item:
            item, trace_file = item.split("@", 1)
        kind, _, workload = item.partition(":")
        try:
            spec_for(kind)
        except ValueError as e:
            raise InvalidInputError(f"{_SPEC_INPUT} {spec!r}: {e}") from None
        groups.append(GPUGroup(kind.strip().lower(), count, workload or None, trace_file))
    if not groups:
        raise InvalidInputError(f"{_SPEC_INPUT} {spec!r} names no GPU; e.g. ZEUS_CALLBACKS_SIMULATE=a40.")
    return groups


def parse_faults(text: str) -> dict[int | None, Faults]:
    """Parse `ZEUS_CALLBACKS_SIM_FAULTS`: `;`-separated `NAME[=VALUE][@GPU_INDEX]`.

    Names: `no_permission` (a user without the right to change settings), `no_cap_sys_admin` (root in a
    container without CAP_SYS_ADMIN), `not_supported=power|clocks|persistence` (repeatable),
    `lost_after=N` (NVML calls), `lost_after_changes=N` (lost once this process has changed the power limit
    or SM clocks N times), `no_energy_counter`, `mig`, `hidden` (NVML counts the GPU but the job's
    cgroup does not grant it: opening it raises NO_PERMISSION), `empty_clocks` (no supported graphics
    clocks listed), `empty_memory_clocks` (no supported memory clocks listed), `default_limit_w=W` (a default
    power limit below the maximum, as on GeForce boards), `missing=FUNCTION` (the NVML library lacks it, as
    an old driver's: FUNCTION_NOT_FOUND), `unknown=FUNCTION` (the whole call answers UNKNOWN); both
    repeatable, FUNCTION one of `FAULTABLE_CALLS`.
    Without `@GPU_INDEX` a fault applies to every GPU; `GPU_INDEX` is the NVML index (PCI bus order).
    """
    out: dict[int | None, Faults] = {}
    for raw in filter(None, (t.strip() for t in text.replace(",", ";").split(";"))):
        item, _, where = raw.partition("@")
        name, eq, value = (t.strip() for t in item.partition("="))
        target = _fault_number(text, raw, where, int, 0) if where else None
        f = out.setdefault(target, Faults())
        if name == "not_supported":
            if (value or "clocks") not in _UNSUPPORTABLE:
                raise _bad_fault(text, raw, f"not_supported takes one of {', '.join(_UNSUPPORTABLE)}")
            f.not_supported = f.not_supported | {value or "clocks"}
        elif name in ("missing", "unknown"):
            if value not in FAULTABLE_CALLS:
                raise _bad_fault(text, raw, f"{name} takes one of {', '.join(FAULTABLE_CALLS)}")
            setattr(f, name, getattr(f, name) | {value})
        elif name == "lost_after":
            f.lost_after_calls = _fault_number(text, raw, value, int, 0)
        elif name == "lost_after_changes":
            f.lost_after_changes = _fault_number(text, raw, value, int, 1)
        elif name in _FLAG_FAULTS:
            if eq:
                raise _bad_fault(text, raw, f"{name} takes no value")
            setattr(f, name, True)
        elif name == "default_limit_w":
            f.default_limit_w = _fault_number(text, raw, value, float, 1)
        else:
            raise _bad_fault(text, raw, f"unknown fault {name!r}")
    return out


_UNSUPPORTABLE = ("power", "clocks", "persistence")
# NVML functions the `missing=` and `unknown=` faults may name (the simulated NVML checks these).
FAULTABLE_CALLS = (
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetTotalEnergyConsumption",
)
_FAULTS_INPUT = "Simulated faults (ZEUS_CALLBACKS_SIM_FAULTS, or simulate(faults=...))"
_SPEC_INPUT = "Simulated GPUs (ZEUS_CALLBACKS_SIMULATE, or simulate(spec))"
_FAULTS_KNOWN = (
    "Known: no_permission, no_cap_sys_admin, not_supported=power|clocks|persistence, lost_after=N, "
    "lost_after_changes=N, no_energy_counter, mig, hidden, empty_clocks, empty_memory_clocks, default_limit_w=W, "
    "missing=FUNCTION, unknown=FUNCTION, each optionally @GPU_INDEX."
)


def _bad_fault(text: str, raw: str, why: str) -> InvalidInputError:
    where = repr(text) if raw == text.strip() else f"{text!r}, in {raw!r}"
    return InvalidInputError(f"{_FAULTS_INPUT} {where}: {why}. {_FAULTS_KNOWN}")


def _fault_number(text: str, raw: str, value: str, kind: type, lowest: float) -> Any:
    """`value` as a finite `kind` (int or float) >= `lowest`, or an error naming the fault."""
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or not math.isfinite(number) or number < lowest:
        what = "a whole number" if kind is int else "a number"
        raise _bad_fault(text, raw, f"{value!r} is not {what} >= {lowest}")
    return number


_FLAG_FAULTS = (
    "no_permission",
    "no_cap_sys_admin",
    "no_energy_counter",
    "mig",
    "hidden",
    "empty_clocks",
    "empty_memory_clocks",
)


def _merge(a: Faults | None, b: Faults | None) -> Faults:
    a, b = a or Faults(), b or Faults()
    return Faults(
        not_supported=a.not_supported | b.not_supported,
        missing=a.missing | b.missing,
        unknown=a.unknown | b.unknown,
        lost_after_calls=b.lost_after_calls if b.lost_after_calls is not None else a.lost_after_calls,
        lost_after_changes=b.lost_after_changes if b.lost_after_changes is not None else a.lost_after_changes,
        default_limit_w=b.default_limit_w if b.default_limit_w is not None else a.default_limit_w,
        **{name: getattr(a, name) or getattr(b, name) for name in _FLAG_FAULTS},
    )


def parse_ideal(text: str) -> frozenset[str]:
    """Parse `ZEUS_CALLBACKS_SIM_IDEAL`: comma-separated hardware behaviours to switch off (`IDEAL_BEHAVIOURS`)."""
    names = frozenset(filter(None, (t.strip() for t in text.replace(";", ",").split(","))))
    unknown = sorted(names - set(IDEAL_BEHAVIOURS))
    if unknown:
        raise InvalidInputError(
            f"Unknown ideal simulator behaviour(s) {', '.join(unknown)} in {text!r} (ZEUS_CALLBACKS_SIM_IDEAL, "
            f"or simulate(ideal=...)). Known: {', '.join(IDEAL_BEHAVIOURS)}."
        )
    return names


def _pci_bus_id(nvml_index: int) -> str:
    return f"00000000:{0x17 + 0x10 * nvml_index:02X}:00.0"


@dataclass
class SimulatedSystem:
    """A node of simulated GPUs built from a spec string.

    `gpus` lists them in NVML's order, by PCI bus. Unless `device_order` is ideal, the slower models sit
    on the lower buses, so that on a mixed node NVML's order differs from CUDA's default (fastest first)
    as it does on real ones; `cuda_gpus()` gives CUDA's. A GPU's UUID and persistent state follow its
    place in the spec string, whatever its bus.
    """

    spec: str
    noise: float = 0.0
    seed: int = 0
    faults: str = ""
    state_dir: str | None = None  # None: a per-user directory under the temp dir; "" : in memory only
    virtual_clock: bool = False
    ideal: str = ""  # comma-separated IDEAL_BEHAVIOURS to switch off
    energy_refresh_ms: float | None = None  # None: each model's own period
    bursts: bool = False  # stalls and bursts in steps (virtual clock), besides the Gaussian noise
    gpus: list[SimulatedGPU] = field(init=False)
    clock: VirtualClock | None = field(init=False)

    def __post_init__(self) -> None:
        groups = parse_spec(self.spec)
        faults = parse_faults(self.faults)
        self.ideal_behaviours = parse_ideal(self.ideal)
        self._check_numbers()
        self.clock = VirtualClock() if self.virtual_clock else None
        directory = self.state_path()
        # A node's GPUs have UUIDs of their own: two simulated nodes (two state directories) never share one.
        node = "" if directory is None else str(directory.resolve())
        system_id = hashlib.sha1(f"{self.spec}|{node}".encode()).hexdigest()[:12]
        try:
            traces = [g.trace() for g in groups]
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"{_SPEC_INPUT} {self.spec!r}: {e}") from None
        models = [(spec_for(g.kind), t) for g, t in zip(groups, traces, strict=True) for _ in range(g.count)]
        slots = list(range(len(models)))  # place in the spec string
        if "device_order" not in self.ideal_behaviours:
            slots.sort(key=lambda s: models[s][0].fp32_tflops)  # stable: the spec's order among equals
        self._check_faults(faults, [models[slot][1] for slot in slots])
        self.gpus = []
        for i, slot in enumerate(slots):
            spec, trace = models[slot]
            refresh_ms = spec.energy_refresh_ms if self.energy_refresh_ms is None else self.energy_refresh_ms
            update_s = spec.power_update_ms / 1000
            self.gpus.append(
                SimulatedGPU(
                    index=i,
                    spec=spec,
                    trace=trace,
                    uuid=_uuid_for(system_id, slot),
                    state_path=None if directory is None else directory / f"gpu{slot}.state",
                    clock=self.clock,
                    noise=self.noise,
                    seed=self.seed,
                    faults=_merge(faults.get(None), faults.get(i)),
                    energy_refresh_s=0.0 if "energy_counter" in self.ideal_behaviours else refresh_ms / 1000,
                    power_usage_averaged=spec.power_usage_averaged
                    and "power_average" not in self.ideal_behaviours,
                    blocking_sync="interruptible_sync" not in self.ideal_behaviours,
                    pci_bus_id=_pci_bus_id(i),
                    bursts=self.bursts,
                    # Power update period and window per board: sim/specs.py (Yang et al., SC'24).
                    power_update_s=0.0 if "power_window" in self.ideal_behaviours else update_s,
                    power_window_s=spec.power_window_ms / 1000,
                )
            )
        self._cuda_cache: tuple[tuple[str | None, str | None], list[SimulatedGPU]] | None = None

    def _check_numbers(self) -> None:
        if (
            isinstance(self.noise, bool)
            or not isinstance(self.noise, (int, float))
            or not 0 <= self.noise <= 0.5
        ):
            raise InvalidInputError(
                f"Simulated noise {self.noise!r} (ZEUS_CALLBACKS_SIM_NOISE, or simulate(noise=...)) must be a "
                "number from 0 to 0.5: the relative run-to-run spread, e.g. 0.02."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidInputError(
                f"Simulation seed {self.seed!r} (ZEUS_CALLBACKS_SIM_SEED, or simulate(seed=...)) must be a "
                "whole number, e.g. 0."
            )
        refresh = self.energy_refresh_ms
        if refresh is not None and not (isinstance(refresh, (int, float)) and 0 <= refresh <= 10_000):
            raise InvalidInputError(
                f"Energy-counter refresh period {refresh!r} (ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS, or "
                "simulate(energy_refresh_ms=...)) must be a number of ms from 0 to 10000 (0: every read is "
                "exact); unset it for each model's own."
            )

    def _check_faults(self, faults: dict[int | None, Faults], traces: list[Trace]) -> None:
        """Faults must name GPUs of this node (`traces` in NVML order) and limits within their range."""
        missing = sorted(i for i in faults if i is not None and i >= len(traces))
        if missing:
            raise InvalidInputError(
                f"{_FAULTS_INPUT} {self.faults!r} target GPU {missing[0]}, but {self.spec!r} has "
                f"{len(traces)} GPU(s) (NVML indices 0-{len(traces) - 1})."
            )
        for i, trace in enumerate(traces):
            w = _merge(faults.get(None), faults.get(i)).default_limit_w
            if w is not None and not trace.min_power_limit_w <= w <= trace.max_power_limit_w:
                raise InvalidInputError(
                    f"{_FAULTS_INPUT} {self.faults!r}: default_limit_w={w:g} is outside GPU {i}'s power-limit "
                    f"range {trace.min_power_limit_w:g}-{trace.max_power_limit_w:g} W."
                )

    def cuda_gpus(self) -> list[SimulatedGPU]:
        """The GPUs CUDA shows this process, in CUDA's numbering (element i is `cuda:i`).

        CUDA cannot open a GPU the job's cgroup hides. It numbers the rest fastest first, then by PCI
        bus, unless `CUDA_DEVICE_ORDER=PCI_BUS_ID` (NVML's order); `CUDA_VISIBLE_DEVICES` then selects
        and renumbers them by that numbering or by UUID prefix.
        """
        key = (os.environ.get("CUDA_DEVICE_ORDER"), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if self._cuda_cache is not None and self._cuda_cache[0] == key:
            return self._cuda_cache[1]
        order = [g for g in self.gpus if not g.faults.hidden]
        if key[0] != "PCI_BUS_ID" and "device_order" not in self.ideal_behaviours:
            order.sort(key=lambda g: -g.spec.fp32_tflops)
        by_uuid = {g.uuid: g for g in order}
        gpus = [by_uuid[u] for u in cuda_visible_uuids(key[1], [g.uuid for g in order])]
        self._cuda_cache = (key, gpus)
        return gpus

    def state_path(self) -> Path | None:
        """Directory where this node's GPU state lives (None when kept in memory)."""
        if self.state_dir == "":
            return None
        base = (
            Path(self.state_dir)
            if self.state_dir
            else Path(tempfile.gettempdir()) / f"zeus_callbacks-sim-{os.getuid()}"
        )
        return base / hashlib.sha1(self.spec.encode()).hexdigest()[:12]

    def run_step(self, work_s: float | dict[int, float]) -> float:
        """Virtual clock only: run one synchronous step of work on every GPU; returns its duration (s).

        `work_s` is the work of each GPU in seconds at its maximum power limit (one value for all, or per
        GPU index). The step lasts as long as the slowest GPU; the others idle until it ends.
        """
        if self.clock is None:
            raise RuntimeError("run_step needs a virtual clock: SimulatedSystem(..., virtual_clock=True).")
        per = work_s if isinstance(work_s, dict) else {g.index: float(work_s) for g in self.gpus}
        start = self.clock.now()
        runs = {i: self.gpus[i].busy_time(w) for i, w in per.items()}
        span = max((t for t, _ in runs.values()), default=0.0)
        for i, (t, p) in runs.items():
            self.gpus[i].run_virtual(start, t, p, span)
        self.clock.advance(span)
        return span
