"""One owner per GPU: a lock held, from the first change of a GPU's settings until they are restored, by the
one process that may change them.

The lock is a POSIX record lock on `owner-<uuid>.lock` in the journal directory. The kernel releases it when
the process dies, however it dies, so a stale lock cannot exist; a forked child does not inherit it, so a
DataLoader worker is never taken for the owner. Measuring needs no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

__all__ = ["acquire", "release", "holder", "held"]

_held: dict[Path, tuple[int, int]] = {}  # lock path -> (fd, pid that took it)
_lock = threading.Lock()


def _path(directory: Path, uuid: str) -> Path:
    return directory / f"owner-{uuid}.lock"


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).split()[0])
    return None


def acquire(directory: Path, uuid: str) -> int | None:
    """Take the owner lock of GPU `uuid`; None when taken (or already held), else the holder's pid (0: unknown).

    Raises:
        OSError: the lock file cannot be opened (the journal directory is unusable).
    """
    path = _path(directory, uuid)
    with _lock:
        held = _held.get(path)
        if held is not None and held[1] == os.getpid():
            return None
        fd = _open(path)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = _read_pid(fd)
            os.close(fd)
            return pid or 0
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[path] = (fd, os.getpid())
        return None


def release(directory: Path, uuid: str) -> None:
    """Give up the owner lock of GPU `uuid` (no-op when this process does not hold it)."""
    path = _path(directory, uuid)
    with _lock:
        held = _held.get(path)
        if held is None or held[1] != os.getpid():
            return
        del _held[path]
        with contextlib.suppress(OSError):
            os.ftruncate(held[0], 0)
        os.close(held[0])  # closing releases the lock


def held(directory: Path, uuid: str) -> bool:
    """Whether this process holds the owner lock of GPU `uuid`."""
    held = _held.get(_path(directory, uuid))
    return held is not None and held[1] == os.getpid()


def holder(directory: Path, uuid: str) -> int | None:
    """The pid of another live process owning GPU `uuid` (0: unknown pid), or None when nobody else does."""
    path = _path(directory, uuid)
    if held(directory, uuid) or not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # F_GETLK through a shared-lock probe: a read lock conflicts only with the owner's write lock.
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_pid(fd) or 0
        return None
    finally:
        os.close(fd)  # also drops the probe's lock


def _forget_after_fork() -> None:
    # A forked child holds none of its parent's locks (POSIX record locks are not inherited).
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
