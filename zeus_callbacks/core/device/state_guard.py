"""Leave the GPU as it was found: journal every setting before changing it, and undo the changes.

The first change of a setting (power limit, SM clocks, persistence) on a GPU records the value in force
in a small journal file on disk, then changes it. The process restores the recorded values at normal
exit, on an uncaught exception, and on SIGINT/SIGTERM (then hands the signal to the handler that was
installed before). A process killed hard (SIGKILL, OOM) leaves its journal behind: the next process that
discovers the GPUs, or `zeus-callbacks restore`, puts those values back.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device.backend import active_backend
from zeus_callbacks.core.device.errors import GPUError, nvml_error

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU, GPUs

__all__ = ["GPUStateGuard", "JournalEntry", "guard", "journal_dir", "leftover_entries", "reset"]

logger = logging.getLogger(__name__)

JOURNAL_ENV = "ZEUS_CALLBACKS_JOURNAL_DIR"
_KNOBS = ("power_limit", "sm_clocks", "persistence")


@dataclass(frozen=True)
class JournalEntry:
    """A setting of one GPU as it was before this package changed it."""

    uuid: str
    name: str
    knob: str  # power_limit | sm_clocks | persistence
    original: Any  # mW for power_limit, bool for persistence, None for sm_clocks (unlocked)


def journal_dir() -> Path | None:
    """Where journals live: `ZEUS_CALLBACKS_JOURNAL_DIR`, else the NVML backend's choice (for real GPUs a
    per-user directory under the temp dir, cleared at reboot like GPU settings). None: memory only."""
    if os.environ.get(JOURNAL_ENV):
        return Path(os.environ[JOURNAL_ENV])
    return active_backend().journal_dir()


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None or _start_time(pid) == start


def _apply(gpu: GPU, entry: JournalEntry) -> None:
    nvml, handle = gpu.nvml, gpu.handle
    try:
        if entry.knob == "power_limit":
            # Already back (restored by another process, or never changed): nothing to do, no permission needed.
            if nvml.nvmlDeviceGetPowerManagementLimit(handle) != int(entry.original):
                nvml.nvmlDeviceSetPowerManagementLimit(handle, int(entry.original))
        elif entry.knob == "sm_clocks":
            nvml.nvmlDeviceResetGpuLockedClocks(handle)
        elif entry.knob == "persistence":
            mode = nvml.NVML_FEATURE_ENABLED if entry.original else nvml.NVML_FEATURE_DISABLED
            nvml.nvmlDeviceSetPersistenceMode(handle, mode)
    except nvml.NVMLError as e:
        raise nvml_error(nvml, e, f"Restoring {entry.knob}", gpu.label) from None


class GPUStateGuard:
    """Records GPU settings before they change and restores them (one per process; see `guard()`)."""

    def __init__(self, directory: Path | None) -> None:
        self._dir = directory
        self._entries: dict[tuple[str, str], JournalEntry] = {}
        self._gpus: dict[str, GPU] = {}
        self._lock = threading.RLock()
        self._handlers_installed = False
        self._pid = os.getpid()
        self._path = None if directory is None else directory / f"{self._pid}-{_start_time(self._pid)}.json"

    # -- recording ------------------------------------------------------------------------------
    def before_change(self, gpu: GPU, knob: str) -> bool:
        """Record `knob`'s current value on `gpu` unless this process already did; True if recorded now."""
        if knob not in _KNOBS:
            raise ValueError(f"Unknown GPU setting {knob!r}; expected one of {_KNOBS}.")
        with self._lock:
            if (gpu.uuid, knob) in self._entries:
                return False
            original: Any = None
            if knob == "power_limit":
                original = gpu.power_limit_mw()
            elif knob == "persistence":
                original = gpu.persistence_mode()
            self._entries[(gpu.uuid, knob)] = JournalEntry(gpu.uuid, gpu.name, knob, original)
            self._gpus[gpu.uuid] = gpu
            self._write()
            self._install()
            return True

    def discard(self, gpu: GPU, knob: str) -> None:
        """Forget a record made for a change that was refused (so nothing is to be restored)."""
        with self._lock:
            if self._entries.pop((gpu.uuid, knob), None) is not None:
                self._write()

    @property
    def entries(self) -> list[JournalEntry]:
        """What this process changed and will restore."""
        with self._lock:
            return list(self._entries.values())

    def _write(self) -> None:
        if self._path is None:
            return
        if not self._entries:
            self._path.unlink(missing_ok=True)
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        data = {
            "pid": self._pid,
            "start": _start_time(self._pid),
            "entries": [asdict(e) for e in self._entries.values()],
        }
        with tmp.open("w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)

    # -- restoring ------------------------------------------------------------------------------
    def restore(self) -> bool:
        """Put back every recorded setting; True if all of them were restored.

        Settings that could not be restored (a lost GPU) stay in the journal for `zeus-callbacks restore`.
        """
        with self._lock:
            ok = True
            for key, entry in reversed(list(self._entries.items())):
                try:
                    _apply(self._gpus[entry.uuid], entry)
                    del self._entries[key]
                    logger.info(
                        "Restored %s of %s to %r.", entry.knob, self._gpus[entry.uuid].label, entry.original
                    )
                except GPUError as e:
                    ok = False
                    logger.warning(
                        "Could not restore %s: %s Run `zeus-callbacks restore` later.", entry.knob, e
                    )
            self._write()
            return ok

    def _install(self) -> None:
        if self._handlers_installed:
            return
        self._handlers_installed = True
        atexit.register(self.restore)
        if not dist.on_termination(self._on_signal):
            logger.debug("Not on the main thread: GPU settings are restored at exit, not on signals.")

    def _on_signal(self, signum: int) -> None:
        self.restore()

    # -- repairing dead runs ----------------------------------------------------------------------
    def repair_dead_runs(self, gpus: GPUs, include_live: bool = False) -> list[JournalEntry]:
        """Restore the settings journaled by processes that died without restoring them.

        Only GPUs in `gpus` are touched; journals of live processes are left alone unless `include_live`.
        Returns the entries restored.
        """
        if self._dir is None or not self._dir.is_dir():
            return []
        by_uuid = {g.uuid: g for g in gpus}
        restored: list[JournalEntry] = []
        for path in sorted(self._dir.glob("*.json")):
            if path == self._path:
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                logger.warning("Ignoring unreadable GPU-state journal %s.", path)
                continue
            if _alive(int(data["pid"]), data.get("start")) and not include_live:
                continue
            left = []
            for raw in reversed(data["entries"]):
                entry = JournalEntry(**raw)
                gpu = by_uuid.get(entry.uuid)
                if gpu is None:
                    left.append(raw)
                    continue
                try:
                    _apply(gpu, entry)
                    restored.append(entry)
                    logger.warning(
                        "Process %s ended without restoring %s of %s; restored it to %r.",
                        data["pid"],
                        entry.knob,
                        gpu.label,
                        entry.original,
                    )
                except GPUError as e:
                    left.append(raw)
                    logger.warning("Could not restore %s of %s: %s", entry.knob, gpu.label, e)
            if left:
                data["entries"] = list(reversed(left))
                path.write_text(json.dumps(data))
            else:
                path.unlink(missing_ok=True)
        return restored


def leftover_entries(directory: Path | None = None) -> list[tuple[int, JournalEntry]]:
    """Settings journaled by processes that are no longer running, as (pid, entry); read-only."""
    directory = journal_dir() if directory is None else directory
    if directory is None or not directory.is_dir():
        return []
    out: list[tuple[int, JournalEntry]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            pid = int(data["pid"])
            if not _alive(pid, data.get("start")):
                out.extend((pid, JournalEntry(**raw)) for raw in data["entries"])
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("Ignoring unreadable GPU-state journal %s.", path)
    return out


_guard: GPUStateGuard | None = None
_guard_lock = threading.Lock()


def guard() -> GPUStateGuard:
    """The process's GPU-state guard."""
    global _guard
    with _guard_lock:
        if _guard is None or _guard._pid != os.getpid():
            _guard = GPUStateGuard(journal_dir())
        return _guard


def reset() -> None:
    """Restore what this process changed, then start a new guard (the GPU set changed)."""
    global _guard
    with _guard_lock:
        old, _guard = _guard, None
    if old is not None and old._pid == os.getpid():
        if old.entries:
            old.restore()
        # What could not be restored stays in the journal on disk for the next discovery or
        # `zeus-callbacks restore`; the replaced guard's GPUs are gone, so it must not retry at exit.
        atexit.unregister(old.restore)
        dist.remove_termination_handler(old._on_signal)
