"""The GPU-state journal on disk: where it lives, which directories and files are trusted, atomic writes.

A journal records GPU settings as they were before this package changed them; applying one changes GPUs,
so a journal is read only from a directory and a file that nobody but this user (or root) could have
written, and never through a symbolic link. Every file is replaced atomically, and repairs of other
processes' journals run under one lock per directory (see `directory_lock`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zeus_callbacks.core import files
from zeus_callbacks.core.files import UnsafePathError, open_directory

__all__ = [
    "JOURNAL_ENV",
    "UntrustedJournalError",
    "boot_id",
    "check_trusted_file",
    "default_journal_dir",
    "directory_lock",
    "ensure_trusted_dir",
    "open_trusted_file",
    "read_journal",
    "trusted_dir",
    "write_atomic",
]

logger = logging.getLogger(__name__)

JOURNAL_ENV = "ZEUS_CALLBACKS_JOURNAL_DIR"
_BASE_FIELDS = frozenset({"uuid", "name", "knob", "original"})
_ROUTE_FIELDS = frozenset({"route", "zeusd", "unconfirmed"})  # unconfirmed: a zeusd change with no answer
_LOCK_NAME = ".lock"


class UntrustedJournalError(UnsafePathError):
    """A journal directory or file that another user could have written (or a symbolic link)."""


def default_journal_dir() -> Path:
    """Where journals of real GPUs live unless `ZEUS_CALLBACKS_JOURNAL_DIR` says otherwise.

    Power limits and locked clocks last until reboot or driver reload, whatever happens to a container's
    or a job's private /tmp, so the journal must not live there. Root: `/run/zeus_callbacks/journal`
    (node-wide, cleared at reboot like the settings). Other users: a per-user state directory,
    `$XDG_STATE_HOME/zeus_callbacks/journal` (default `~/.local/state/...`); it survives reboots, so every
    journal carries the boot id and one from an earlier boot is discarded.
    """
    if os.geteuid() == 0:
        return Path("/run" if os.path.isdir("/run") else "/var/run") / "zeus_callbacks" / "journal"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "zeus_callbacks" / "journal"


def boot_id() -> str | None:
    """This boot's id (Linux), or None where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0)


def _check_dir(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedJournalError(errno.ELOOP, "is a symbolic link", str(path))
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "is not a directory", str(path))
    if not _owner_ok(st):
        raise UntrustedJournalError(
            errno.EPERM, f"is owned by uid {st.st_uid}, not by this user or root", str(path)
        )
    if st.st_mode & 0o022:
        raise UntrustedJournalError(
            errno.EPERM, f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})", str(path)
        )


def _check_ancestors(path: Path) -> None:
    # Whoever may rename entries of a parent may swap the journal directory: no link another user owns is
    # followed on the way to it (`files.open_directory`), and each ancestor must be ours or root's, and
    # writable by others only with the sticky bit (as /tmp is).
    os.close(open_directory(path))
    for parent in Path(os.path.realpath(path)).parents:
        st = os.stat(parent)
        if not _owner_ok(st) or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX):
            raise UntrustedJournalError(
                errno.EPERM, "lies in a directory other users may change", f"{path} (through {parent})"
            )


def trusted_dir(path: Path, warn: bool = True) -> bool:
    """Whether `path` exists and is a journal directory this process may trust (else, with `warn`, a
    warning says why)."""
    try:
        _check_dir(path)
        _check_ancestors(path)
    except (FileNotFoundError, NotADirectoryError):
        return False  # nothing to repair there (writing to it is refused with its own message)
    except OSError as e:
        if warn:
            logger.warning("Ignoring the GPU-state journal directory %s: %s. %s", path, e.strerror, _FIX)

        return False
    return True


_FIX = (
    "Remove it, or set ZEUS_CALLBACKS_JOURNAL_DIR to a directory only you (or root) may write "
    "(e.g. `mkdir -m 700`)."
)


def ensure_trusted_dir(path: Path) -> None:
    """Create `path` (mode 700) if missing, and check it may be trusted.

    Raises:
        OSError: it cannot be created, is not a directory, or is not trusted (`UntrustedJournalError`).
    """
    try:  # never through another user's link (`files.open_directory`)
        os.close(open_directory(path, create=True, mode=0o700))
    except NotADirectoryError:
        pass  # a file where the directory should be: reported by the check below
    _check_dir(path)
    _check_ancestors(path)


def check_trusted_file(fd: int, path: Path) -> None:
    """Check that the file open as `fd` (opened with `O_NOFOLLOW`: never a symbolic link) may be trusted: a
    regular file of this user or root that no other user may write.

    Raises:
        UntrustedJournalError: it may not (an `OSError` whose `strerror` says why).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedJournalError(errno.EPERM, "is not a regular file", str(path))
    if not _owner_ok(st):
        raise UntrustedJournalError(errno.EPERM, f"is owned by uid {st.st_uid}", str(path))
    if st.st_mode & 0o022:
        raise UntrustedJournalError(errno.EPERM, "is writable by other users", str(path))


def open_trusted_file(path: Path, flags: int, mode: int = 0o600) -> int:
    """`os.open` under the journal's trust rules: `path`'s directory is created (mode 700) if missing and
    checked (`ensure_trusted_dir`), the file is never opened through a symbolic link, and is checked
    (`check_trusted_file`) before its descriptor is returned.

    Raises:
        OSError: it cannot be opened, or may not be trusted (`UntrustedJournalError`; a symbolic link: ELOOP).
    """
    ensure_trusted_dir(path.parent)
    dir_fd = open_directory(path.parent)
    try:
        fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(dir_fd)
    try:
        check_trusted_file(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to `path` by an atomic replace (readers see the old file or the new, whole;
    `files.write_atomic`).

    Raises:
        OSError: the directory is not writable, the disk is full, ...
    """
    files.write_atomic(path, json.dumps(data))


def read_journal(path: Path) -> dict[str, Any]:
    """Read a journal file that this process may trust.

    Raises:
        OSError: unreadable, a symbolic link, or not trusted (`UntrustedJournalError`).
        ValueError: not a journal (malformed JSON or fields).
    """
    dir_fd = open_directory(path.parent)
    try:  # never through a link, and never waiting on a FIFO planted in its name
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        check_trusted_file(f.fileno(), path)
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError("no list of entries")
    if not isinstance(data.get("pid"), int) or data["pid"] <= 0:
        raise ValueError("no process id")
    for entry in data["entries"]:
        # Journals written before changes could go through zeusd have no route (it was NVML).
        if not isinstance(entry, dict) or not _BASE_FIELDS <= set(entry) <= _BASE_FIELDS | _ROUTE_FIELDS:
            raise ValueError(f"malformed entry {entry!r}")
    return data


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """Hold the directory's lock: one process at a time reads, repairs and rewrites others' journals."""
    dir_fd = open_directory(directory)
    try:
        fd = os.open(_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
