"""How the package writes and reads its files on a machine shared with other users.

Every file is written by `write_atomic`: a private new file in the target's directory, unnamed
(`O_TMPFILE`) until it is whole, or, where the file system has no `O_TMPFILE`, under an unpredictable name
opened with `O_EXCL | O_NOFOLLOW` (so nothing planted there, a symbolic link least of all, is ever written
through); written, `fsync`ed and renamed over the target (a rename replaces a link at the
target, never follows it), then the directory is `fsync`ed. A reader sees the old file or the new one,
whole; a failure (a full disk, a quota, `ulimit -f`, a read-only file system) leaves the last complete file
and no temporary behind.

Directories are walked one component at a time (`open_directory`: `O_DIRECTORY | O_NOFOLLOW` from the
descriptor of the one before), following a symbolic link only when this user or root owns it: a link
another user owns could be pointed anywhere at any moment, and the kernel's `protected_symlinks` guards only
world-writable sticky directories, not a group-writable project directory or another user's home.

A log written as training goes (`open_log`) starts as a new file made the same way, so a link planted at
its name is replaced, not written through; its first failed write is said once and ends it (`LogFile`),
never raising into training.

`read_regular` reads a regular file the same way, opened `O_NONBLOCK` so that a FIFO or a device given
where a file was expected is refused instead of waited on; a file that chooses a power limit or a clock is
refused when another user owns it (or anyone may write it).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import pwd
import secrets
import stat
from collections import deque
from pathlib import Path

__all__ = [
    "ForeignFileError",
    "LogFile",
    "UnsafePathError",
    "open_directory",
    "open_log",
    "read_regular",
    "warn_write_failed",
    "write_atomic",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # the kernel's own bound on links followed in one lookup (MAXSYMLINKS, include/linux/namei.h)
_NAME_MAX = 255  # bytes in one file name (NAME_MAX, include/uapi/linux/limits.h)
_TMP_SUFFIX = ".tmp"
_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")  # Linux 3.11+, with /proc mounted
_warned: set[str] = set()
_logger = logging.getLogger(__name__)


class _Said(OSError):
    """An `OSError` whose message is a sentence about its file: `<file> <strerror>`."""

    def __str__(self) -> str:
        return str(self.strerror) if self.filename is None else f"{self.filename} {self.strerror}"


class UnsafePathError(_Said):
    """A path that goes through a symbolic link another user owns, or names something other than a regular
    file; `strerror` says what and what to do."""


class ForeignFileError(_Said):
    """A file that chooses a GPU setting but another user owns (or anyone may write); `strerror` says whose
    it is and what to do."""


def user_name(uid: int) -> str:
    """`name (uid N)`, or `uid N` where the account has no name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _check_link(st: os.stat_result, shown: str) -> None:
    if not _trusted(st.st_uid):
        raise UnsafePathError(
            errno.EPERM,
            f"is a symbolic link owned by {user_name(st.st_uid)}, who could point it anywhere: it is not "
            "followed. Pass the path it leads to, or a directory of your own",
            shown,
        )


def _make(fd: int, name: str, mode: int, here: str) -> None:
    try:
        os.mkdir(name, mode, dir_fd=fd)
    except FileExistsError:
        pass  # made meanwhile by another process: opened next
    except OSError as e:
        raise OSError(e.errno, e.strerror, here) from None


def _link_target(fd: int, name: str, here: str, error: OSError) -> str:
    """Where the link `name` in `fd` leads, if this user or root owns it (`error`: why it was not opened)."""
    if error.errno not in (errno.ELOOP, errno.ENOTDIR):
        raise OSError(error.errno, error.strerror, here) from None
    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), here) from None
    _check_link(st, here)
    return os.readlink(name, dir_fd=fd)


def _walk(fd: int, parts: deque[str], shown: str, create: bool, mode: int) -> int:
    """Open the directories `parts` one by one from the directory `fd` (closed on the way); returns the
    last one's descriptor."""
    links = 0
    try:
        while parts:
            name = parts.popleft()
            if name in ("", "."):
                continue
            here = os.path.join(shown, name)
            try:
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), here) from None
                _make(fd, name, mode, here)
                parts.appendleft(name)
                continue
            except OSError as e:
                target = _link_target(fd, name, here, e)
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), here) from None
                if target.startswith("/"):  # else its parts follow from this directory, `shown`
                    os.close(fd)
                    fd = -1
                    fd, shown = os.open("/", _DIR_FLAGS), "/"
                parts.extendleft(reversed(target.split("/")))
                continue
            os.close(fd)
            fd, shown = next_fd, here
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def open_directory(path: str | os.PathLike[str], *, create: bool = False, mode: int = 0o700) -> int:
    """A descriptor of the directory `path` (close it), reached without following a symbolic link that
    another user owns at any component; with `create`, missing directories are made with `mode`.

    Raises:
        UnsafePathError: a component is a symbolic link another user owns.
        OSError: a component is missing (without `create`), not a directory, or cannot be made.
    """
    text = os.fspath(path)
    start = os.open("/" if text.startswith("/") else ".", _DIR_FLAGS)
    return _walk(start, deque(text.split("/")), "/" if text.startswith("/") else "", create, mode)


def _temporary_name(name: str) -> str:
    token = secrets.token_hex(8)  # 64 random bits: another user cannot guess it to plant something there
    room = _NAME_MAX - len(token) - len(_TMP_SUFFIX) - 3
    stem = os.fsencode(name)[:room].decode(errors="ignore")
    return f".{stem}.{token}{_TMP_SUFFIX}"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o600) -> None:
    """Replace the file `path` with `data` atomically and durably (see the module's docstring); missing
    directories are made (mode 700 for a private file, else 777; less the umask). `mode` is the new file's
    (less the umask).

    Raises:
        UnsafePathError: a directory of `path` is reached through another user's symbolic link.
        OSError: the file cannot be written (no space, quota, `ulimit -f`, read-only, no permission); the
            last complete file is left as it was, and no temporary file.
    """
    _replace(Path(path), data.encode() if isinstance(data, str) else data, mode)


def _replace(path: Path, payload: bytes, mode: int, keep_open: bool = False) -> int | None:
    """`_write_new` in `path`'s directory, walked and made by `open_directory`; an error names `path`."""
    if path.name in ("", ".", ".."):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(path))
    # Missing directories of a private file are private; of one made to be shared, as mkdir makes them.
    dir_fd = open_directory(path.parent, create=True, mode=0o777 if mode & 0o044 else 0o700)
    try:
        fd = _write_new(dir_fd, path.name, payload, mode, keep_open)
        with contextlib.suppress(OSError):  # the rename is durable once the directory is (EINVAL on some)
            os.fsync(dir_fd)
        return fd
    except OSError as e:  # about the file, whatever name (a temporary's) the call gave
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(dir_fd)


def _create_temporary(dir_fd: int, name: str, mode: int) -> tuple[int, str | None]:
    """A new file in `dir_fd`: unnamed (O_TMPFILE, open(2)) where the file system allows, so a process killed
    while writing leaves nothing; else under an unpredictable name. Returns its descriptor and name."""
    if _TMPFILE:
        try:
            return os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, mode, dir_fd=dir_fd), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    tmp = _temporary_name(name)
    return os.open(tmp, _TMP_FLAGS, mode, dir_fd=dir_fd), tmp


def _write_new(dir_fd: int, name: str, payload: bytes, mode: int, keep_open: bool = False) -> int | None:
    """Write `payload` to a new file and rename it to `name`, in the directory `dir_fd`; with `keep_open`,
    its descriptor (open for writing) is returned."""
    fd, tmp = _create_temporary(dir_fd, name, mode)
    try:
        try:
            _write_all(fd, payload)
            os.fsync(fd)
            if tmp is None:  # named once whole, as open(2) shows for O_TMPFILE (linkat, AT_SYMLINK_FOLLOW)
                tmp = _temporary_name(name)
                os.link(f"/proc/self/fd/{fd}", tmp, dst_dir_fd=dir_fd, follow_symlinks=True)
        finally:
            if not keep_open:
                os.close(fd)  # NFS reports a full quota here
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        if keep_open:
            os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        raise
    return fd if keep_open else None


def _open_regular(path: str) -> int:
    """`path` opened for reading: a regular file, its directories and links checked as `open_directory`
    does (a link at the file itself is followed when this user or root owns it)."""
    for _ in range(_MAX_LINKS):
        parent, name = os.path.split(path)
        if not name:
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", path)
        dir_fd = open_directory(parent or ".")
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                _check_link(st, path)
                path = os.path.join(parent, os.readlink(name, dir_fd=dir_fd))
                continue
            if not stat.S_ISREG(st.st_mode):  # refused before opening: a FIFO would block, a device act
                raise UnsafePathError(errno.EINVAL, f"is not a regular file ({_kind(st.st_mode)})", path)
            return os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    return next((what for test, what in kinds.items() if test(mode)), "a device")


def read_regular(path: str | os.PathLike[str], *, chooses: str | None = None) -> bytes:
    """The contents of the regular file `path`, never waiting on a FIFO or a device.

    Args:
        path: The file.
        chooses: What the file chooses (`"a power limit"`), when it does: then a file that another user
            owns (not this user nor root), or that anyone may write, is refused.

    Raises:
        ForeignFileError: (with `chooses`) another user's file; the message says whose and what to do.
        UnsafePathError: not a regular file, or reached through another user's symbolic link.
        OSError: it cannot be read (missing, no permission, ...).
    """
    shown = os.fspath(path)
    fd = _open_regular(shown)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped since it was looked at
            raise UnsafePathError(errno.EINVAL, f"is not a regular file ({_kind(st.st_mode)})", shown)
        if chooses is not None:
            _check_owner(st, shown, chooses)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check_owner(st: os.stat_result, shown: str, chooses: str) -> None:
    if not _trusted(st.st_uid):
        raise ForeignFileError(
            errno.EPERM,
            f"is owned by {user_name(st.st_uid)}, not by you ({user_name(os.geteuid()).split(' (')[0]})"
            f"{'' if os.geteuid() == 0 else ' nor root'}, and it chooses {chooses}: another user's file is not trusted with that. If you trust its "
            "contents, copy it to a file of your own (`cp`); else pass a path of your own",
            shown,
        )
    if st.st_mode & stat.S_IWOTH:
        raise ForeignFileError(
            errno.EPERM,
            f"may be written by any user (mode {stat.S_IMODE(st.st_mode):o}) and it chooses {chooses}. "
            f"Run `chmod o-w {shown}` if you trust its contents",
            shown,
        )


_KEPT = "the last complete file (if any) is kept, and saving is tried again at the next save"


def warn_write_failed(
    logger: logging.Logger, what: str, path: str | os.PathLike[str], error: OSError, after: str = _KEPT
) -> None:
    """Say once per file and process that `what` could not be written to `path`, that training goes on,
    and `after` (what becomes of the file); later failures of the same file are logged at DEBUG."""
    key = f"{what}\0{os.fspath(path)}"
    level = logging.DEBUG if key in _warned else logging.WARNING
    _warned.add(key)
    reason = error.strerror or str(error)
    logger.log(
        level, "Cannot write the %s %s: %s. Training goes on; %s.", what, os.fspath(path), reason, after
    )


class LogFile(io.TextIOBase):
    """A log opened by `open_log`, written as training goes. The first write that fails (a full disk, a
    quota, `ulimit -f`) is said once and ends the log there: it never raises into training."""

    def __init__(self, fd: int, path: Path, what: str) -> None:
        self._file = open(fd, "w", encoding="utf-8")  # noqa: SIM115 - held open across the run
        self._path, self._what, self._failed = path, what, False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not self._failed:
            try:
                self._file.write(text)
            except OSError as e:
                self._fail(e)
        return len(text)

    def flush(self) -> None:
        if not self._failed and not self._file.closed:
            try:
                self._file.flush()
            except OSError as e:
                self._fail(e)

    def close(self) -> None:
        if self.closed:
            return
        self.flush()
        with contextlib.suppress(OSError):  # after a failure its buffer holds what cannot be written
            self._file.close()
        super().close()

    def _fail(self, error: OSError) -> None:
        self._failed = True
        warn_write_failed(_logger, self._what, self._path, error, "the log ends at the failed write")


def open_log(path: str | os.PathLike[str], what: str, *, mode: int = 0o600) -> LogFile:
    """A new, empty log file at `path` (what was there replaced, a link there never followed; directories
    made and walked as `write_atomic` does), open for writing; `what` names it in the warning of a failed
    write.

    Raises:
        UnsafePathError: a directory of `path` is reached through another user's symbolic link.
        OSError: it cannot be created.
    """
    path = Path(path)
    fd = _replace(path, b"", mode, keep_open=True)
    assert fd is not None
    return LogFile(fd, path, what)
