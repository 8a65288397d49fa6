"""Which process wrote a journal, and whether it still runs: its pid and its start time from /proc."""

from __future__ import annotations

import os

__all__ = ["alive", "start_time"]


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state first); [] when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start_of(fields: list[str]) -> str | None:
    """The start time (clock ticks after boot) among /proc/<pid>/stat's fields; None when missing."""
    return fields[19] if len(fields) > 19 else None


def start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks after boot), which tells it apart from a later process of that pid."""
    return _start_of(_stat(pid))


def alive(pid: int, start: str | None) -> bool:
    """Whether `pid` runs and is the process that started at `start` (None: any process of that pid)."""
    try:
        os.kill(pid, 0)
        foreign = False
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: /proc says whether it is the one that started then
        foreign = True
    fields = _stat(pid)
    if not fields and foreign:
        return True  # /proc hides it (hidepid): it exists, which is all that can be told
    if fields and fields[0] in ("Z", "X"):  # dead, not yet reaped
        return False
    return start is None or _start_of(fields) == start
