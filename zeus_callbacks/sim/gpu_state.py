"""The persistent state of a simulated GPU: float64 fields in a file mapped into memory, so that every
process on the simulated node sees the same GPU, as with a real one."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.journal import open_trusted_file
from zeus_callbacks.sim.host import HOST_CLOCK, busy_power_w, process_cpu_s

# Persistent per-GPU state: a small file of float64 fields, mapped into memory so that reads cost
# about a microsecond and every process on the "node" sees the same GPU, as with a real one.
# A ring of the true energy at the ticks of a 0.1 s grid over the last ~1.2 s, for the 1-second moving
# average of power that `nvmlDeviceGetPowerUsage` reports on Ampere and newer boards.
RING_SLOTS = 12
RING_TICK_S = 0.1
_FIELDS = (
    "power_limit_mw",
    "module_limit_mw",
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
    "kernels_pid",  # the process that queues kernels here (0: none, the work is paced by the host's CPU)
    "kernels_end",  # when the kernels it queued so far end (the wall clock's time, `others_power_w`)
    *(f"ring{i}_{part}" for i in range(RING_SLOTS) for part in ("tick", "mj")),
)
_IDX = {name: i for i, name in enumerate(_FIELDS)}
_FMT = f"<{len(_FIELDS)}d"
_SIZE = struct.calcsize(_FMT)
# The energy counter, its timestamp and the driver's refreshed value are adjacent: the hot read is one unpack.
_ENERGY = struct.Struct("<4d")
ENERGY_OFFSET = 8 * _IDX["energy_mj"]
read_energy = _ENERGY.unpack_from  # bound once: the energy read is the monitor's hot path
wall = time.time
assert _IDX["refreshed_at"] == _IDX["energy_mj"] + 3
RING_OFFSET = 8 * _IDX["ring0_tick"]
RING_SLOT = struct.Struct("<2d")


class GPUState:
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
            _allocate(fd, path)
            self._buf = mmap.mmap(fd, _SIZE)
            if fresh:
                self._write_all(initial)
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
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


def others_power_w(state: GPUState, now: float, last_sync: float, idle_w: float, busy_w: float) -> float:
    """What other processes' work on the GPU draws at `now` (W), as this process (last synchronised at
    `last_sync`) sees it through the shared state: busy power until the kernels another process queued end
    (`kernels_end`, on the wall clock, for the node's time of each process lags it by that process's lag),
    and idle power once they have, for its host CPU time is not GPU work (`SimulatedGPU.enqueue`); otherwise
    the average power of another process's interval accounted within 0.5 s, or busy power in proportion to
    the CPU time (/proc) of the process that synchronised last, since then."""
    pid = os.getpid()
    kernels_pid = int(state.get("kernels_pid"))
    if kernels_pid and kernels_pid != pid:
        return busy_w if now + HOST_CLOCK.lag_s < state.get("kernels_end") else idle_w  # on the wall clock
    last_at = state.get("last_power_at")
    shared = state.get("last_power_w") if now - last_at < 0.5 and last_at > last_sync else idle_w
    worker = int(state.get("worker_pid"))
    if worker and worker != pid:
        cpu = process_cpu_s(worker)
        if cpu is not None:
            since = now - state.get("worker_sync_at")
            shared = max(shared, busy_power_w(idle_w, busy_w, cpu - state.get("worker_cpu_s"), since))
    return shared


def _allocate(fd: int, path: Path) -> None:
    """Give the state file its blocks before it is mapped: a store into a page of a mapped file that the
    file system cannot back (a full disk, a quota) kills the process with SIGBUS (mmap(2), "SIGBUS"), while
    `posix_fallocate` says so as an error. Blocks already allocated (a file made earlier) cost nothing."""
    try:
        os.posix_fallocate(fd, 0, _SIZE)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise InvalidInputError(
                f"Simulated GPU state {path}: cannot allocate its {_SIZE} bytes ({e.strerror}). Free space "
                "there, or set ZEUS_CALLBACKS_SIM_STATE_DIR to a directory with free space."
            ) from None
        os.ftruncate(fd, max(_SIZE, os.fstat(fd).st_size))  # no fallocate here: as before, unreserved


class _Lock:
    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
