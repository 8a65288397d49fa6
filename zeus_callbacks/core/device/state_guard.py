"""Leave the GPU as it was found: journal every setting before changing it, and undo the changes.

The first change of a setting (power limit, SM clocks, persistence) on a GPU takes the GPU's owner lock
(`owner_lock`: one process at a time may change a GPU; across users through the node's lock directory,
`global_lock`), records the value in force and the route the
change takes (`setters`: NVML, or Zeus's daemon zeusd) in a small journal file (`journal`: a directory
only this user or root may write, files replaced atomically), then changes it; a restore goes through the
recorded route first. The process restores the recorded values at normal exit, on an uncaught exception, and
on SIGINT/SIGTERM (then hands the signal to the handler that was installed before); a forked child never
restores its parent's GPU. A process killed hard (SIGKILL, OOM) leaves its journal behind: the next
process that discovers the GPUs, or `zeus-callbacks restore`, puts those values back, one repairer at a
time under the directory's lock. A journal's entries (`journal_entries`), the repair of other processes'
journals (`journal_repair`) and the identity of the process that wrote one (`process_identity`) live apart.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core import distributed as dist
from zeus_callbacks.core.device import global_lock, owner_lock, setters
from zeus_callbacks.core.device.backend import active_backend
from zeus_callbacks.core.device.errors import (
    GPUBusyError,
    GPUError,
    GPUNotSupportedError,
    GPUStateJournalError,
)
from zeus_callbacks.core.device.global_lock import ClaimError
from zeus_callbacks.core.device.journal import (
    JOURNAL_ENV,
    boot_id,
    ensure_trusted_dir,
    read_journal,
    write_atomic,
)
from zeus_callbacks.core.device.journal_entries import KNOBS, JournalEntry, apply_entry, entry_for, to_record
from zeus_callbacks.core.device.journal_repair import JournalRepairer
from zeus_callbacks.core.device.process_identity import alive, start_time
from zeus_callbacks.core.device.watchdog import Watchdog

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU, GPUs

__all__ = [
    "GPUStateGuard",
    "JournalEntry",
    "guard",
    "journal_dir",
    "leftover_entries",
    "reset",
    "restore_defaults",
    "JOURNAL_ENV",
]

logger = logging.getLogger(__name__)


def journal_dir() -> Path | None:
    """Where journals live: `ZEUS_CALLBACKS_JOURNAL_DIR`, else the NVML backend's choice (for real GPUs
    `journal.default_journal_dir()`). None: memory only."""
    if os.environ.get(JOURNAL_ENV):
        return Path(os.environ[JOURNAL_ENV])
    return active_backend().journal_dir()


class GPUStateGuard:
    """Records GPU settings before they change and restores them (one per process; see `guard()`)."""

    def __init__(self, directory: Path | None) -> None:
        self._dir = directory
        self._entries: dict[tuple[str, str], JournalEntry] = {}
        self._gpus: dict[str, GPU] = {}
        self._lock = threading.RLock()
        self._handlers_installed = False
        self._pid = os.getpid()
        self._boot = boot_id()
        self._path = None if directory is None else directory / f"{self._pid}-{start_time(self._pid)}.json"
        self._warned: set[str] = set()  # GPUs whose unexplained power limit was reported
        self._written = False  # whether this process's journal file exists
        self._unrestored: set[tuple[str, str]] = set()  # entries whose restore failed (reported once)
        self._watchdog: Watchdog | None = None  # restores at once if this process dies hard
        self._repairer = None if directory is None else JournalRepairer(directory, self._path, self._boot)

    @property
    def directory(self) -> Path | None:
        """The journal directory (None: journals are kept in memory only)."""
        return self._dir

    # -- recording ------------------------------------------------------------------------------
    def before_change(self, gpu: GPU, knob: str) -> bool:
        """Record `knob`'s current value on `gpu` unless this process already did; True if recorded now.

        Raises:
            GPUBusyError: another live process owns the GPU's settings.
            GPUStateJournalError: the journal cannot be written; the GPU must not be changed.
        """
        if knob not in KNOBS:
            raise ValueError(f"Unknown GPU setting {knob!r}; expected one of {KNOBS}.")
        with self._lock:
            if (gpu.uuid, knob) in self._entries:
                return False
            setters.route()  # an unusable route (InvalidInputError) is refused before the GPU is claimed
            self._claim(gpu)
            original: Any = None
            if knob == "power_limit":
                original = gpu.power_limit_mw()
            elif knob == "persistence":
                original = gpu.persistence_mode()
            self._entries[(gpu.uuid, knob)] = entry_for(gpu, knob, original)
            self._gpus[gpu.uuid] = gpu
            try:
                self._write()
            except OSError as e:
                del self._entries[(gpu.uuid, knob)]
                self._release_unused(gpu.uuid)
                raise self._journal_error(gpu, e) from None
            self._install()
            if self._watchdog is None and self._path is not None:
                self._watchdog = Watchdog.start()
                if self._watchdog is not None:  # another user's job waits while it puts the GPU back
                    global_lock.note_restorer(self._watchdog.pid)
            if knob == "power_limit":
                self._warn_if_unexplained(gpu, original)
            return True

    def recorded(self, gpu: GPU, knob: str) -> Any:
        """The value of `knob` this process recorded on `gpu` before its first change (what `restore` puts
        back), or None when this process has not changed it."""
        with self._lock:
            entry = self._entries.get((gpu.uuid, knob))
        return None if entry is None else entry.original

    def _journal_error(self, gpu: GPU, error: OSError) -> GPUStateJournalError:
        where = error.filename or self._dir
        return GPUStateJournalError(
            f"Cannot write the GPU-state journal ({where}: {error.strerror or error}), so {gpu.label} is "
            f"left unchanged: a change nothing could undo is never made. Set {JOURNAL_ENV} to a directory "
            "only you may write, with free space."
        )

    def _claim(self, gpu: GPU) -> None:
        """Take the GPU's owner lock before its first change."""
        if self._dir is None or any(uuid == gpu.uuid for uuid, _ in self._entries):
            return
        try:
            ensure_trusted_dir(self._dir)
            owner = owner_lock.acquire(self._dir, gpu.uuid, gpu.label, self._path)
        except ClaimError as e:
            raise GPUStateJournalError(f"{gpu.label} is left unchanged: this process {e.strerror}.") from None
        except OSError as e:
            raise self._journal_error(gpu, e) from None
        if owner is not None:
            who = str(owner) if owner.pid else "another process"
            raise GPUBusyError(
                f"{gpu.label} is owned by {who}, which changed its settings first; this process leaves them "
                "alone (it still measures). Run one job per GPU, or wait until that one ends."
            )

    def _release_unused(self, uuid: str) -> None:
        if self._dir is not None and not any(u == uuid for u, _ in self._entries):
            owner_lock.release(self._dir, uuid)

    def _warn_if_unexplained(self, gpu: GPU, original_mw: int) -> None:
        """A limit other than the default that no journal explains was likely left by a run killed hard
        whose journal lived elsewhere (a container's or a job's private /tmp): say so, once."""
        try:
            default = gpu.default_power_limit_mw()
        except GPUError:
            return
        if original_mw == default or gpu.uuid in self._warned or self._explained(gpu.uuid):
            return
        self._warned.add(gpu.uuid)
        logger.warning(
            "%s's power limit is %g W, not its default %g W, and no GPU-state journal explains it: a run "
            "killed hard may have left it (its journal elsewhere, e.g. in a container's or job's private /tmp). "
            "It will be put back to %g W at the end. If %g W is right, run `zeus-callbacks restore "
            "--to-default` when no job uses the GPU.",
            gpu.label,
            original_mw / 1000,
            default / 1000,
            original_mw / 1000,
            default / 1000,
        )

    def _explained(self, uuid: str) -> bool:
        if self._dir is None:
            return False
        for path in self._dir.glob("*.json"):
            if path == self._path:
                continue
            try:
                if any(e["uuid"] == uuid for e in read_journal(path)["entries"]):
                    return True
            except (OSError, ValueError):
                continue
        return False

    def discard(self, gpu: GPU, knob: str) -> None:
        """Forget a record made for a change that was refused (so nothing is to be restored)."""
        with self._lock:
            if self._entries.pop((gpu.uuid, knob), None) is not None:
                try:
                    self._write()
                except OSError as e:
                    logger.warning("Could not update the GPU-state journal %s: %s", self._path, e)
                self._release_unused(gpu.uuid)

    def mark_unconfirmed(self, gpu: GPU, knob: str) -> None:
        """Mark the record of `knob` on `gpu` as possibly applied (a change sent to zeusd got no answer): it
        stays, and every restore sends the original back. No record of it here (a restore of another
        process's change): nothing to mark."""
        with self._lock:
            entry = self._entries.get((gpu.uuid, knob))
            if entry is None or entry.unconfirmed:
                return
            self._entries[(gpu.uuid, knob)] = replace(entry, unconfirmed=True)
            try:
                self._write()
            except OSError as e:
                logger.warning("Could not update the GPU-state journal %s: %s", self._path, e)

    @property
    def entries(self) -> list[JournalEntry]:
        """What this process changed and will restore."""
        with self._lock:
            return list(self._entries.values())

    def _write(self) -> None:
        if self._path is None:
            return
        if not self._entries:
            if self._written:
                self._path.unlink(missing_ok=True)
                self._written = False
            return
        assert self._dir is not None
        ensure_trusted_dir(self._dir)
        data = {
            "pid": self._pid,
            "start": start_time(self._pid),
            "boot": self._boot,
            "entries": [to_record(e) for e in self._entries.values()],
        }
        write_atomic(self._path, data)
        self._written = True

    # -- restoring ------------------------------------------------------------------------------
    def restore(self) -> bool:
        """Put back every recorded setting; True if all of them were restored.

        Settings that could not be restored (a lost GPU) stay in the journal for `zeus-callbacks restore`.
        Only the process that made the changes restores them: in a forked child this does nothing.
        """
        if os.getpid() != self._pid:
            return True
        with self._lock:
            ok = True
            for key, entry in reversed(list(self._entries.items())):
                try:
                    apply_entry(self._gpus[entry.uuid], entry)
                    del self._entries[key]
                    logger.info(
                        "Restored %s of %s to %r.", entry.knob, self._gpus[entry.uuid].label, entry.original
                    )
                except GPUError as e:
                    ok = False
                    # Reported once; the entry stays (in memory and on disk) for later tries.
                    log = logger.debug if key in self._unrestored else logger.warning
                    self._unrestored.add(key)
                    log("Could not restore %s: %s Run `zeus-callbacks restore` later.", entry.knob, e)
            try:
                self._write()
            except OSError as e:
                logger.warning("Could not update the GPU-state journal %s: %s", self._path, e)
            for uuid in list(self._gpus):
                self._release_unused(uuid)
            if not self._entries and self._watchdog is not None:
                self._watchdog.stop()
                self._watchdog = None
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

    # -- repairing other processes' journals ------------------------------------------------------
    def repair_dead_runs(self, gpus: GPUs, include_live: bool = False) -> list[JournalEntry]:
        """Restore the settings journaled by processes that died without restoring them.

        Only GPUs in `gpus` are touched; journals of live processes (and GPUs a live process owns) are
        left alone unless `include_live`. Journals are read only from a trusted directory (see
        `journal.trusted_dir`), and one process at a time repairs them. Returns the entries restored.
        """
        if self._repairer is None:
            return []
        restored = self._repairer.repair_dead_runs(gpus, include_live)
        assert self._dir is not None
        # A dead process's cross-user owner record goes once its journal no longer holds the GPU.
        global_lock.release_dead(self._dir, [g.uuid for g in gpus])
        return restored

    def restore_signalled(self, pid: int, start: str | None, gpus: GPUs, signum: int) -> list[JournalEntry]:
        """Put back the settings journaled by the live process `pid`, which received `signum` (SIGTERM,
        SIGINT) where its own handler cannot run yet (blocked in native code, e.g. a collective).

        Its own handler would restore the same values once it runs, so this does no more than that handler
        ahead of time; the journal is left as it is: the owner's restore, or the repair after its death,
        removes it (applying the same values again is harmless). Returns the entries restored.
        """
        if self._repairer is None:
            return []
        return self._repairer.restore_signalled(pid, start, gpus, signum)


def job_gpu_overlap(gpus: Sequence[GPU]) -> str | None:
    """Why this job must not change its GPUs: two ranks use one GPU (None: no rank shares one).

    A collective over torch.distributed: every rank calls it, and every rank gets the same answer, which
    names the ranks and their GPU indices and says what to pass.
    """
    mine = [(g.uuid, g.label, g.index) for g in gpus]
    owners: dict[str, list[tuple[int, str, int]]] = {}
    for rank, theirs in enumerate(dist.all_gather_object(mine)):
        for uuid, label, index in dict.fromkeys(theirs):
            owners.setdefault(uuid, []).append((rank, label, index))
    shared = {u: o for u, o in owners.items() if len(o) > 1}
    if not shared:
        return None
    uuid, who = next(iter(shared.items()))
    ranks = ", ".join(f"rank {r} (gpu_indices=[{i}])" for r, _, i in who)
    return (
        f"{ranks} all use {who[0][1]} ({uuid}){f' and {len(shared) - 1} more GPU(s)' if len(shared) > 1 else ''}: "
        "GPUs used by more than one rank of this job are left alone (energy is still measured). Each rank "
        "must measure and control its own GPU: pass `ZeusMonitor(gpu_indices=[local_rank])` with the rank's "
        "own CUDA device (torchrun's LOCAL_RANK; transformers' `args.local_process_index` is 0 on every process "
        "of a CPU launch, so use LOCAL_RANK there)."
    )


def restore_defaults(gpus: GPUs, include_live: bool = False) -> list[tuple[GPU, str]]:
    """Put every GPU in `gpus` back to its defaults (power limit, unlocked SM clocks), journals aside.

    For a limit left by a run whose journal is lost. A GPU owned by a live process is skipped unless
    `include_live`. Returns (GPU, what was done) pairs, one per GPU.
    """
    directory = guard().directory
    done: list[tuple[GPU, str]] = []
    for gpu in gpus:
        pid = None if directory is None or include_live else owner_lock.holder(directory, gpu.uuid)
        if pid is not None:
            done.append((gpu, f"skipped: owned by live process {pid or '(unknown)'}"))
            continue
        try:
            default = gpu.default_power_limit_mw()
            apply_entry(gpu, entry_for(gpu, "power_limit", default))
            what = f"power limit {default / 1000:g} W"
        except GPUError as e:
            done.append((gpu, f"not restored: {e}"))
            continue
        try:
            apply_entry(gpu, entry_for(gpu, "sm_clocks", None))
            what += ", SM clocks unlocked"
        except GPUNotSupportedError:
            pass
        except GPUError as e:
            what += f"; SM clocks not reset: {e}"
        done.append((gpu, what))
    return done


def leftover_entries(directory: Path | None = None) -> list[tuple[int, JournalEntry]]:
    """Settings journaled by processes that are no longer running, as (pid, entry); read-only."""
    directory = journal_dir() if directory is None else directory
    if directory is None or not directory.is_dir():
        return []
    out: list[tuple[int, JournalEntry]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = read_journal(path)  # the same trust rules as repair: a planted file is not listed
        except (OSError, ValueError) as e:
            logger.warning("Ignoring %s: not a GPU-state journal this process may trust (%s).", path, e)
            continue
        if not alive(data["pid"], data.get("start")):
            out.extend((data["pid"], JournalEntry(**raw)) for raw in data["entries"])
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
