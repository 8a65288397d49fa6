"""Repair of other processes' GPU-state journals: runs that died, and a run signalled while blocked."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeus_callbacks.core.device import owner_lock
from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.journal import directory_lock, read_journal, trusted_dir, write_atomic
from zeus_callbacks.core.device.journal_entries import JournalEntry, apply_entry, invalid_reason
from zeus_callbacks.core.device.process_identity import alive

if TYPE_CHECKING:
    from zeus_callbacks.core.device.gpus import GPU, GPUs

__all__ = ["JournalRepairer"]

logger = logging.getLogger(__name__)


class JournalRepairer:
    """Restores what other processes journaled in `directory` (this process's own journal, `own_path`, aside).

    Journals written before the last reboot (`boot`: this boot's id) are discarded, as the reboot reset the
    GPUs. Used by `GPUStateGuard.repair_dead_runs` and `GPUStateGuard.restore_signalled`.
    """

    def __init__(self, directory: Path, own_path: Path | None, boot: str | None) -> None:
        self._dir = directory
        self._own_path = own_path
        self._boot = boot
        self._warned: set[str] = set()  # names of untrusted journals, reported once

    def repair_dead_runs(self, gpus: GPUs, include_live: bool) -> list[JournalEntry]:
        """Restore the journals of dead processes (live ones too if `include_live`) on `gpus`, one repairer
        at a time; the entries restored."""
        if not trusted_dir(self._dir):
            return []
        by_uuid = {g.uuid: g for g in gpus}
        restored: list[JournalEntry] = []
        try:
            with directory_lock(self._dir):
                for path in sorted(self._dir.glob("*.json")):
                    if path != self._own_path:
                        restored += self._repair(path, by_uuid, include_live)
        except OSError as e:
            logger.warning("Could not repair the GPU-state journals in %s: %s", self._dir, e)
        return restored

    def restore_signalled(self, pid: int, start: str | None, gpus: GPUs, signum: int) -> list[JournalEntry]:
        """Apply the journal of the live process `pid` (started at `start`), which received `signum`, leaving
        the journal as it is; the entries restored."""
        if not trusted_dir(self._dir):
            return []
        path = self._dir / f"{pid}-{start}.json"
        if not path.exists():  # its own handler ran and restored already (or it changed nothing)
            return []
        data = self._read(path)
        if data is None or data.get("pid") != pid:
            return []
        by_uuid = {g.uuid: g for g in gpus}
        restored = []
        for raw in reversed(data["entries"]):
            entry = JournalEntry(**raw)
            gpu = by_uuid.get(entry.uuid)
            try:
                if gpu is None or invalid_reason(gpu, entry) is not None:
                    continue
                apply_entry(gpu, entry)
            except GPUError as e:
                logger.warning("Could not restore %s of %s: %s", entry.knob, gpu.label if gpu else "?", e)
                continue
            restored.append(entry)
            logger.warning(
                "Process %s received %s; restored %s of %s to %r at once (its own handler cannot run while "
                "it is blocked in native code, e.g. a collective).",
                pid,
                signal.Signals(signum).name,
                entry.knob,
                gpu.label,
                entry.original,
            )
        return restored

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            return read_journal(path)
        except (OSError, ValueError) as e:
            if path.name not in self._warned:
                self._warned.add(path.name)
                reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                logger.warning(
                    "Ignoring %s: not a GPU-state journal this process may trust (%s).", path, reason
                )
            return None

    def _repair(self, path: Path, by_uuid: dict[str, GPU], include_live: bool) -> list[JournalEntry]:
        """Repair one journal file (under the directory lock: re-read here, rewritten atomically)."""
        data = self._read(path)
        if data is None:
            return []
        if data.get("boot") is not None and self._boot is not None and data["boot"] != self._boot:
            logger.info("Discarding %s, written before the last reboot (which reset the GPUs).", path)
            path.unlink(missing_ok=True)
            return []
        if alive(data["pid"], data.get("start")) and not include_live:
            return []
        restored, left = [], []
        for raw in reversed(data["entries"]):
            entry = JournalEntry(**raw)
            gpu = by_uuid.get(entry.uuid)
            if gpu is None or (not include_live and self._owned(entry.uuid)):
                left.append(raw)  # not visible here, or a live owner changed it since: later
                continue
            if self._repair_entry(gpu, entry, data["pid"]):
                restored.append(entry)
            elif self._valid_or_warn(gpu, entry, path):
                left.append(raw)
        if left:
            data["entries"] = list(reversed(left))
            write_atomic(path, data)
        else:
            path.unlink(missing_ok=True)
        return restored

    def _owned(self, uuid: str) -> bool:
        return owner_lock.held(self._dir, uuid) or owner_lock.holder(self._dir, uuid) is not None

    def _valid_or_warn(self, gpu: GPU, entry: JournalEntry, path: Path) -> bool:
        try:
            reason = invalid_reason(gpu, entry)
        except GPUError:
            return True
        if reason is not None:
            logger.warning("Dropping an entry of %s for %s: %s.", path, gpu.label, reason)
        return reason is None

    def _repair_entry(self, gpu: GPU, entry: JournalEntry, pid: int) -> bool:
        try:
            if invalid_reason(gpu, entry) is not None:
                return False
            apply_entry(gpu, entry)
        except GPUError as e:
            logger.warning("Could not restore %s of %s: %s", entry.knob, gpu.label, e)
            return False
        logger.warning(
            "Process %s ended without restoring %s of %s; restored it to %r.",
            pid,
            entry.knob,
            gpu.label,
            entry.original,
        )
        return True
