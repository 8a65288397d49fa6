"""One owner per GPU across the node's users: owner records in a lock directory an administrator creates once.

The owner lock in a journal directory (`owner_lock`) sees only the jobs that share that directory, and every
user has their own (a directory other users may write is not trusted with journals). Jobs of different users
on one GPU, through NVML or through one zeusd, see one another here: `ZEUS_CALLBACKS_LOCK_DIR`, else
`/var/lock/zeus_callbacks`, made by root with mode 1777 (`install -d -m 1777 -o root -g root DIR`). Where it
does not exist the cross-user lock is off and each user's jobs see only their own (`status()` says so).

zeusd holds no owner of a GPU (ml-energy/zeus `zeusd/src/routes/gpu.rs` at zeusd-v0.4.0, v0.5.0 and master
75a8b93: each request runs, in order, on the GPU's command queue, whoever sent it; no lock, lease or client
state is kept or exposed), and a client cannot make a lock on the daemon's host, so both routes use this
directory. A job that reaches zeusd on another host over TCP is seen only by the jobs that share its lock
directory.

The first change of a GPU's settings writes `owner-<uuid>.<uid>.json` (created `O_EXCL | O_NOFOLLOW`, mode
644): the owner's user, pid, start time (`/proc`), boot, host and PID namespace, its journal file, and its
restore watchdog. Records are read and written under an `flock` of the directory (the critical section is a
directory listing and a small file), so two claimants never both win. The owner removes its record once its
settings are restored; a record of a process killed hard stays until its restore watchdog (or the next
repair of its journal, by the same user) has put the GPU back, so another user's job does not take the GPU
at the dead owner's limit. A record whose process is dead and whose watchdog is gone is stale: it is
recovered with a warning (and removed where this user may; in a sticky directory only its owner or root may).
A record is believed only as far as the kernel confirms it: the pid must run as the file's owner and have
started when the record says (pid reuse), else it is stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeus_callbacks.core.device.journal import boot_id, read_journal
from zeus_callbacks.core.device.process_identity import alive, start_time
from zeus_callbacks.core.files import open_directory, user_name

__all__ = [
    "ClaimError",
    "DEFAULT_LOCK_DIR",
    "LOCK_DIR_ENV",
    "LockDirStatus",
    "Owner",
    "claim",
    "lock_dir",
    "note_restorer",
    "owner",
    "release",
    "release_dead",
    "status",
]

logger = logging.getLogger(__name__)

LOCK_DIR_ENV = "ZEUS_CALLBACKS_LOCK_DIR"
DEFAULT_LOCK_DIR = Path("/var/lock/zeus_callbacks")
SETUP = "sudo install -d -m 1777 -o root -g root {path}"
_RESTORE_WAIT_S = 10.0  # how long a claim waits for a dead owner's watchdog to put its GPU back
_POLL_S = 0.05
_MAX_RECORD = 4096
_held: dict[str, int] = {}  # GPU uuid -> pid of this process when it claimed it
_warned: set[str] = set()
_lock = threading.RLock()


class ClaimError(OSError):
    """This process's owner record cannot be written in the node's lock directory; `strerror` says why."""


@dataclass(frozen=True)
class Owner:
    """The process that owns a GPU's settings, as another job is told about it."""

    pid: int
    user: str  # "alice (uid 1001)"
    host: str | None
    started: str | None  # "2026-12-05 10:01:02 UTC"
    note: str = ""  # e.g. "it ended; its restore watchdog is putting the GPU back"
    restoring: bool = False  # it ended, and its watchdog is putting the GPU back

    def __str__(self) -> str:
        where = "" if self.host is None else f" on {self.host}"
        when = "" if self.started is None else f", started {self.started}"
        return f"process {self.pid} of {self.user}{where}{when}{f' ({self.note})' if self.note else ''}"

    @classmethod
    def of(cls, pid: int, uid: int) -> Owner:
        """An owner on this host known by its pid and user (its start time from /proc)."""
        return cls(pid, user_name(uid), _HOST, _wall(start_time(pid)))


@dataclass(frozen=True)
class LockDirStatus:
    """Whether the cross-user lock is on, where, and why not (for `zeus-callbacks doctor`)."""

    path: str | None
    on: bool
    problem: str | None  # why it is off (None when on)
    fix: str | None  # how to turn it on


def lock_dir() -> Path | None:
    """`ZEUS_CALLBACKS_LOCK_DIR` (empty: off), else `/var/lock/zeus_callbacks`."""
    value = os.environ.get(LOCK_DIR_ENV)
    if value is None:
        return DEFAULT_LOCK_DIR
    return Path(value) if value else None


_HOST = socket.gethostname()


def _pid_namespace() -> int | None:
    with contextlib.suppress(OSError):
        return os.stat("/proc/self/ns/pid").st_ino
    return None


def _wall(start: str | None) -> str | None:
    """A process start time (clock ticks after boot) as UTC."""
    if start is None:
        return None
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    at = btime + int(start) / os.sysconf("SC_CLK_TCK")
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _uids_of(pid: int) -> set[int] | None:
    """The real and effective user ids `pid` runs as (/proc/<pid>/status), None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {int(u) for u in next(line for line in f if line.startswith("Uid:")).split()[1:3]}
    except (OSError, StopIteration, ValueError):
        return None


def _unsafe(st: os.stat_result) -> str | None:
    """Why a lock directory may not be used (None: it may)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by {user_name(st.st_uid)}, not root: its owner could remove any job's lock"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (
            f"may be written by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): any user "
            "could remove another job's lock"
        )
    return None


def _open_dir(path: Path) -> int | None:
    """A descriptor of the lock directory, or None when it is absent (the lock is off) or unsafe (said once)."""
    try:
        fd = open_directory(path)  # never through a link another user owns
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn_once(path, str(e))
        return None
    problem = _unsafe(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        _warn_once(path, f"{path} {problem}")
        return None
    return fd


def _warn_once(path: Path, why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        logger.warning(
            "The cross-user GPU owner lock is off: %s. Jobs of other users will not see which GPUs this job "
            "changes. Fix: `%s`.",
            why,
            SETUP.format(path=path),
        )


def status() -> LockDirStatus:
    """Whether the cross-user lock is on (read-only)."""
    path = lock_dir()
    if path is None:
        return LockDirStatus(None, False, f"{LOCK_DIR_ENV} is set empty", f"unset {LOCK_DIR_ENV}")
    fix = SETUP.format(path=path)
    try:
        fd = open_directory(path)
    except FileNotFoundError:
        return LockDirStatus(str(path), False, f"{path} does not exist", fix)
    except OSError as e:
        return LockDirStatus(str(path), False, str(e), fix)
    try:
        problem = _unsafe(os.fstat(fd)) or (
            None if os.access(f"/proc/self/fd/{fd}", os.W_OK) else f"{path} is not writable by this user"
        )
    finally:
        os.close(fd)
    return LockDirStatus(str(path), problem is None, problem, None if problem is None else fix)


@contextlib.contextmanager
def _locked(exclusive: bool) -> Iterator[int | None]:
    """The lock directory's descriptor, flock-ed (None: the cross-user lock is off)."""
    path = lock_dir()
    fd = None if path is None else _open_dir(path)
    if fd is None:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield fd
    finally:
        os.close(fd)  # closing releases the flock


def _prefix(uuid: str) -> str:
    return f"owner-{uuid}."


def _name(uuid: str) -> str:
    return f"{_prefix(uuid)}{os.geteuid()}.json"


def _read(dir_fd: int, name: str) -> tuple[dict[str, Any], int] | None:
    """An owner record and its file's owner uid; None when it is not one (a link, a FIFO, malformed)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None  # a planted link (ELOOP) or gone
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD:
            return None
        record = json.loads(os.read(fd, _MAX_RECORD))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return None
    return record, st.st_uid


def _records(dir_fd: int, uuid: str) -> Iterator[tuple[str, dict[str, Any], int]]:
    for name in sorted(os.listdir(dir_fd)):
        if name.startswith(_prefix(uuid)) and name.endswith(".json"):
            got = _read(dir_fd, name)
            if got is not None:
                yield name, *got


def _runs(pid: Any, start: Any, uid: int) -> bool:
    """Whether `pid` is the process that started at `start` and runs as `uid` (the record's file owner)."""
    if not isinstance(pid, int) or not alive(pid, start if isinstance(start, str) else None):
        return False
    runs_as = _uids_of(pid)
    return runs_as is None or uid in runs_as  # unreadable (/proc hidepid): believed


def _judge(record: dict[str, Any], uid: int) -> str:
    """'live', 'restoring' (dead, its watchdog putting the GPU back), 'unknown' (another host or PID namespace:
    cannot be checked from here, so taken as live) or 'dead'."""
    boot = boot_id()
    if record.get("boot") and boot and record["boot"] != boot:
        return "dead"  # the reboot reset the GPU
    if record.get("host") != _HOST or record.get("pidns") != _pid_namespace():
        return "unknown"
    if _runs(record["pid"], record.get("start"), uid):
        return "live"
    restorer = record.get("restorer")
    if isinstance(restorer, list) and len(restorer) == 2 and _runs(restorer[0], restorer[1], uid):
        return "restoring"
    return "dead"


def _owner(record: dict[str, Any], uid: int, verdict: str) -> Owner:
    notes = {
        "restoring": "it ended; its restore watchdog is putting the GPU back",
        "unknown": "on another host or in another PID namespace: cannot be checked from here",
    }
    start = record.get("start")
    return Owner(
        record["pid"],
        user_name(uid),
        record.get("host"),
        _wall(start if isinstance(start, str) else None),
        notes.get(verdict, ""),
        verdict == "restoring",
    )


def _recover(dir_fd: int, name: str, record: dict[str, Any], uid: int, label: str) -> None:
    """Take over a dead owner's record (removed where this user may)."""
    removed = False
    if uid == os.geteuid() or os.geteuid() == 0:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        removed = True
    logger.warning(
        "%s: %s ended without giving up its cross-user owner lock, and nothing restored its settings: this job "
        "takes the GPU, and what that process left (if anything) is what this job puts back at its end. %s can "
        "run `zeus-callbacks restore` once no job uses the GPU to put back what it found.%s",
        label,
        _owner(record, uid, "dead"),
        user_name(uid),
        "" if removed else f" (Its lock file {name} stays: only its owner or root may remove it.)",
    )


def _contest(dir_fd: int, uuid: str, label: str) -> Owner | None:
    """Under the directory's lock: the GPU's owner other than this process (None: free, after the records of
    dead owners were recovered). Nothing is changed while the GPU has an owner."""
    dead, waiting = [], None
    for name, record, uid in _records(dir_fd, uuid):
        if uid == os.geteuid() and record["pid"] == os.getpid():
            continue  # this process's own (a claim after a release that failed)
        verdict = _judge(record, uid)
        if verdict == "dead":
            dead.append((name, record, uid))
        elif verdict == "restoring":
            waiting = _owner(record, uid, verdict)
        else:
            return _owner(record, uid, verdict)
    if waiting is None:
        for name, record, uid in dead:
            _recover(dir_fd, name, record, uid, label)
    return waiting


def _record(journal: Path | None, restorer: int | None) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "version": 1,
        "pid": pid,
        "start": start_time(pid),
        "user": user_name(os.geteuid()),
        "host": _HOST,
        "boot": boot_id(),
        "pidns": _pid_namespace(),
        "since": time.time(),
        "journal": None if journal is None else str(journal),
        "restorer": None if restorer is None else [restorer, start_time(restorer)],
    }


def _create(dir_fd: int, name: str, record: dict[str, Any]) -> None:
    """Write `name` as a new file (`O_EXCL | O_NOFOLLOW`: nothing planted there is written through), 644."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)  # this user's own record: its owner was judged above
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o644)  # readable by other users' jobs whatever this user's umask
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _claim_error(error: OSError, uuid: str) -> ClaimError:
    path = lock_dir() or Path()
    return ClaimError(
        error.errno,
        f"cannot write its owner record {path / _name(uuid)} in the cross-user lock directory "
        f"({error.strerror}). The directory must let every user create files: `{SETUP.format(path=path)}`; a "
        "file of another user at that name must be removed by root",
    )


def claim(uuid: str, label: str, journal: Path | None = None, restorer: int | None = None) -> Owner | None:
    """Record this process as the owner of GPU `uuid` across users; None when it is (or the lock is off),
    else the GPU's owner. A dead owner whose watchdog still restores is waited for (`_RESTORE_WAIT_S`).

    Raises:
        ClaimError: the lock directory is on but this process cannot write its record there.
    """
    with _lock:
        if _held.get(uuid) == os.getpid():
            return None
        deadline = time.monotonic() + _RESTORE_WAIT_S
        while True:
            with _locked(exclusive=True) as dir_fd:
                if dir_fd is None:
                    return None
                other = _contest(dir_fd, uuid, label)
                if other is None:
                    try:
                        _create(dir_fd, _name(uuid), _record(journal, restorer))
                    except OSError as e:
                        raise _claim_error(e, uuid) from None
                    _held[uuid] = os.getpid()
                    return None
            if not other.restoring or time.monotonic() > deadline:
                return other
            time.sleep(_POLL_S)


def release(uuid: str) -> None:
    """Remove this process's record for GPU `uuid` (its settings are restored); no-op when it holds none."""
    with _lock:
        if _held.pop(uuid, None) != os.getpid():
            return
        with _locked(exclusive=True) as dir_fd:
            if dir_fd is None:
                return
            got = _read(dir_fd, _name(uuid))
            if got is not None and got[0]["pid"] == os.getpid():
                with contextlib.suppress(OSError):
                    os.unlink(_name(uuid), dir_fd=dir_fd)


def note_restorer(restorer: int) -> None:
    """Add this process's restore watchdog (`restorer`, a pid) to its records: a job of another user that finds
    this process dead waits while the watchdog puts the GPU back."""
    with _lock, _locked(exclusive=True) as dir_fd:
        if dir_fd is None:
            return
        for uuid, pid in list(_held.items()):
            got = _read(dir_fd, _name(uuid)) if pid == os.getpid() else None
            if got is not None and got[0]["pid"] == pid:
                got[0]["restorer"] = [restorer, start_time(restorer)]
                _create(dir_fd, _name(uuid), got[0])


def owner(uuid: str) -> Owner | None:
    """A live process other than this one that owns GPU `uuid` (None: none, or the lock is off)."""
    with _locked(exclusive=False) as dir_fd:
        if dir_fd is None:
            return None
        for _, record, uid in _records(dir_fd, uuid):
            if uid == os.geteuid() and record["pid"] == os.getpid():
                continue
            verdict = _judge(record, uid)
            if verdict in ("live", "unknown"):
                return _owner(record, uid, verdict)
    return None


def release_dead(journal_dir: Path, uuids: list[str]) -> list[str]:
    """Remove this user's records of dead processes whose journal in `journal_dir` no longer holds their GPU
    (it was restored, by their watchdog or by this repair); the GPUs released."""
    released = []
    with _locked(exclusive=True) as dir_fd:
        if dir_fd is None:
            return []
        for uuid in uuids:
            got = _read(dir_fd, _name(uuid))
            if got is None or _judge(got[0], got[1]) in ("live", "unknown") or got[0]["pid"] == os.getpid():
                continue
            journal = got[0].get("journal")
            if journal is not None and (Path(journal).parent != journal_dir or _holds(Path(journal), uuid)):
                continue  # restored elsewhere, or not yet
            with contextlib.suppress(OSError):
                os.unlink(_name(uuid), dir_fd=dir_fd)
            released.append(uuid)
    return released


def _holds(journal: Path, uuid: str) -> bool:
    """Whether the journal file still records a setting of GPU `uuid` (unreadable: assumed so)."""
    try:
        return any(e.get("uuid") == uuid for e in read_journal(journal)["entries"])
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True


def _forget_after_fork() -> None:
    _held.clear()  # a forked child owns nothing: its parent's records name the parent


os.register_at_fork(after_in_child=_forget_after_fork)
