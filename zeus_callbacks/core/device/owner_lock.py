"""One owner per GPU: a lock held, from the first change of a GPU's settings until they are restored, by the
one process that may change them.

Two locks make one owner. Within a journal directory (one user's jobs), a POSIX record lock on
`owner-<uuid>.lock`: the kernel releases it when the process dies, however it dies, and a forked child does
not inherit it, so a DataLoader worker is never taken for the owner. Across users (each has their own
journal directory), an owner record in the node's lock directory (`global_lock`), where an administrator
made one. Measuring needs no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

from zeus_callbacks.core.device import global_lock
from zeus_callbacks.core.device.global_lock import Owner

__all__ = ["Owner", "acquire", "release", "holder", "held", "owner"]

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


def acquire(directory: Path, uuid: str, label: str, journal: Path | None = None) -> Owner | None:
    """Take the owner lock of GPU `uuid` (`label` names it in messages), in `directory` and across users;
    None when taken (or already held), else its owner. `journal`: this process's journal file, which a
    repair after its death empties.

    Raises:
        OSError: the lock file cannot be opened (the journal directory is unusable);
            `global_lock.ClaimError` (one): this process's record cannot be written in the node's lock
            directory.
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
            return Owner.of(pid or 0, os.geteuid())
        try:
            other = global_lock.claim(uuid, label, journal)
        except BaseException:
            os.close(fd)
            raise
        if other is not None:
            os.close(fd)  # closing releases the lock
            return other
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
        global_lock.release(uuid)
        with contextlib.suppress(OSError):
            os.ftruncate(held[0], 0)
        os.close(held[0])  # closing releases the lock


def held(directory: Path, uuid: str) -> bool:
    """Whether this process holds the owner lock of GPU `uuid`."""
    held = _held.get(_path(directory, uuid))
    return held is not None and held[1] == os.getpid()


def holder(directory: Path, uuid: str) -> int | None:
    """The pid of another live process owning GPU `uuid` (0: unknown pid), or None when nobody else does."""
    found = owner(directory, uuid)
    return None if found is None else found.pid


def owner(directory: Path, uuid: str) -> Owner | None:
    """Another live process owning GPU `uuid`, in `directory` or across users, or None when nobody else does."""
    if held(directory, uuid):
        return None
    pid = _local_holder(_path(directory, uuid))
    return global_lock.owner(uuid) if pid is None else Owner.of(pid, os.geteuid())


def _local_holder(path: Path) -> int | None:
    if not path.exists():
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
