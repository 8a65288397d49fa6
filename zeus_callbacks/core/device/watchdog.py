"""The restore watchdog: a small process that puts the GPU back the moment the process that changed it dies,
however it dies (SIGKILL, the OOM killer, SIGHUP, a SIGTERM it could not handle while blocked in C code).

Started with the first journaled change, which waits (up to `READY_TIMEOUT_S`) until the watchdog has
discovered the GPUs and says it is ready, so that a death even in the first second is repaired at once. It holds nothing but the read end of a pipe whose write end only the
changing process holds: the kernel closes that end when the process dies, the watchdog reads end-of-file,
waits until the process is dead (the pipe closes a moment before), repairs its journal exactly as the next
run would (so it never touches a GPU a live process owns), and exits. A process that restores normally says
so on the pipe and closes it, so the watchdog exits then too; it never outlives its purpose. Set `ZEUS_CALLBACKS_WATCHDOG=0` to do without it (a killed run is then repaired
by the next one, or by `zeus-callbacks restore`).

A SIGTERM or SIGINT that reaches the changing process while it is blocked in native code (a collective
waiting for a rank that never comes) cannot run the Python handler that restores the GPU until the call
returns, which may be never (the scheduler's SIGKILL follows its grace period). CPython's own C-level handler
still runs at once and writes the signal's number to the wakeup file descriptor (`signal.set_wakeup_fd`):
that descriptor is a second pipe to the watchdog, which restores the process's journaled settings on the
spot, as its handler would (no NVML call is ever made from a signal handler). A wakeup descriptor set before
(asyncio's, say) is kept in the chain: the watchdog passes every byte on to it, and it is put back when the
watchdog is let go.

Why a process: signal handlers cannot run on SIGKILL, nor while the main thread is blocked in a collective;
`PR_SET_PDEATHSIG` works the other way round (it tells a child of its parent's death); a system service
would need installing. A watchdog per changing process costs one idle interpreter while settings are changed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

__all__ = ["WATCHDOG_ENV", "Watchdog", "main"]

logger = logging.getLogger(__name__)

WATCHDOG_ENV = "ZEUS_CALLBACKS_WATCHDOG"
READY_TIMEOUT_S = 30.0  # how long the first change waits for the watchdog to be ready
_READY = b"ready\n"  # what the watchdog writes on its stdout once it could repair at once
_STOP = b"stop"  # what the changing process writes before it closes the pipe after a normal restore
_ENTRY = "import sys; from zeus_callbacks.core.device.watchdog import main; sys.exit(main(sys.argv[1:]))"
# The signals whose arrival the watchdog acts on at once: those this package's signal chain restores on.
_TERMINATING = frozenset({signal.SIGINT, signal.SIGTERM})


class Watchdog:
    """The handle the changing process keeps: the pipe's write end (see the module docstring)."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._wakeup_w: int | None = None  # this process's wakeup fd (the signal pipe's write end)
        # This process keeps the read end open too, so that a write after the watchdog has gone fills the pipe
        # (silent, as `warn_on_full_buffer=False`) instead of failing with EPIPE, which CPython reports on
        # stderr as "Exception ignored when trying to write to the signal wakeup fd" at every later signal.
        self._wakeup_r: int | None = None
        self._previous_wakeup = -1  # the wakeup fd it replaced, passed on to
        argv, pass_fds, wakeup_r = [str(self._pid)], [], self._take_wakeup_fd()
        if wakeup_r is not None:
            argv += ["--signals", str(wakeup_r)]
            pass_fds.append(wakeup_r)
            if self._previous_wakeup >= 0:
                argv += ["--chain", str(self._previous_wakeup)]
                pass_fds.append(self._previous_wakeup)
        try:
            self._proc = subprocess.Popen(
                # `-c`, not `-m`: the package already imported this module, which `-m` would run again.
                [sys.executable, "-c", _ENTRY, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=pass_fds,
                start_new_session=True,  # a Ctrl-C or a hang-up of the terminal does not reach it
            )
        except OSError:
            self._give_back_wakeup_fd()
            raise
        os.register_at_fork(after_in_child=self._forget)
        self.ready = self._wait_ready(READY_TIMEOUT_S)

    @property
    def pid(self) -> int:
        """The watchdog process's id."""
        return self._proc.pid

    def _take_wakeup_fd(self) -> int | None:
        """Make a new pipe's write end this process's signal wakeup fd; its read end (None: only the main
        thread may set the wakeup fd, so signals are then handled in Python alone)."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # `set_wakeup_fd` requires it: a signal handler must not block
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(read_end)
            os.close(write_end)
            return None
        self._wakeup_w, self._wakeup_r = write_end, read_end
        return read_end

    def _give_back_wakeup_fd(self) -> None:
        """Put back the wakeup fd found (main thread only; elsewhere ours stays, harmless while open)."""
        if self._wakeup_w is None:
            return
        try:
            current = signal.set_wakeup_fd(self._previous_wakeup)
        except ValueError:
            return
        if current != self._wakeup_w:  # someone set another since: leave theirs in place
            signal.set_wakeup_fd(current)
        for fd in (self._wakeup_w, self._wakeup_r):
            with contextlib.suppress(OSError, TypeError):
                os.close(fd)  # type: ignore[arg-type]
        self._wakeup_w = self._wakeup_r = None

    def _wait_ready(self, timeout_s: float) -> bool:
        """Wait until the watchdog says it is ready (or exits: no GPU to watch, or it failed to start)."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], timeout_s)
        said = os.read(fd, len(_READY)) if readable else b""
        self._proc.stdout.close()
        if said != _READY:
            logger.debug("The restore watchdog is not ready (said %r); changes go on without waiting.", said)
        return said == _READY

    @classmethod
    def start(cls) -> Watchdog | None:
        """A watchdog for this process, or None when disabled or it cannot start (then: a debug line)."""
        switch = os.environ.get(WATCHDOG_ENV, "1")
        if switch not in ("0", "1", ""):
            from zeus_callbacks.core.device.errors import InvalidInputError

            raise InvalidInputError(
                f"{WATCHDOG_ENV}={switch!r}: set 0 to change GPUs without the restore watchdog, or 1 (default)."
            )
        if switch == "0":
            return None
        try:
            return cls()
        except OSError as e:
            logger.debug("No restore watchdog: %s", e)
            return None

    def _forget(self) -> None:
        # A forked child must not keep the pipe open: the watchdog waits for the changing process only; nor
        # may a signal to the child (a DataLoader worker's SIGTERM) restore its parent's GPU.
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                os.close(self._proc.stdin.fileno())
        self._give_back_wakeup_fd()

    def stop(self) -> None:
        """Let the watchdog go (the settings are restored): it reads end-of-file and exits."""
        if os.getpid() != self._pid or self._proc.stdin is None:
            return
        self._give_back_wakeup_fd()
        with contextlib.suppress(OSError):
            self._proc.stdin.write(_STOP)  # a deliberate end, not a death: the watchdog need not wait for one
            self._proc.stdin.close()
        # Reap it once it has exited, so that no zombie is left behind for the life of this process.
        threading.Thread(target=self._proc.wait, name="zeus-callbacks-watchdog-reaper", daemon=True).start()


def main(argv: list[str]) -> int:
    """Wait for end-of-file on stdin, then repair the journals of dead processes on the GPUs visible here.

    `argv`: the changing process's pid, then optionally `--signals FD` (the read end of its wakeup fd: a
    SIGTERM/SIGINT byte there restores its settings at once) and `--chain FD` (the wakeup fd it replaced,
    which gets every byte read from `FD`).
    """
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # a job's clean-up signals must not stop the clean-up
    logging.basicConfig(level=logging.WARNING, format="zeus-callbacks restore watchdog: %(message)s")
    import zeus_callbacks  # noqa: F401  (registers the NVML backends)
    from zeus_callbacks.core.device.gpus import get_gpus
    from zeus_callbacks.core.device.process_identity import start_time
    from zeus_callbacks.core.device.state_guard import guard

    options = dict(zip(argv[1::2], (int(fd) for fd in argv[2::2]), strict=False))
    argv = argv[:1]
    start = start_time(int(argv[0])) if argv else None  # the parent's identity, read while it lives
    try:
        gpus = get_gpus()  # discovered before it is needed, so that the restore is quick
    except Exception as e:  # noqa: BLE001 - no GPU: nothing to watch
        logger.debug("No GPUs to watch: %s", e)
        return 0
    with contextlib.suppress(OSError):
        os.write(1, _READY)  # the changing process goes on: from here a death is repaired at once
        os.close(1)
    stopped = _watch(
        int(argv[0]) if argv else None, start, gpus, options.get("--signals"), options.get("--chain")
    )
    if not stopped and argv:
        _wait_for_death(int(argv[0]), start)
    guard().repair_dead_runs(gpus)
    return 0


def _watch(pid: int | None, start: str | None, gpus, signals_fd: int | None, chain_fd: int | None) -> bool:
    """Until end-of-file on stdin (the parent closed the pipe, or died): act on the parent's terminating
    signals as they arrive; True when the parent said it stopped deliberately."""
    from zeus_callbacks.core.device.state_guard import guard

    stopped, watched = False, [0] if signals_fd is None else [0, signals_fd]
    while True:
        readable, _, _ = select.select(watched, [], [])
        if signals_fd in readable:
            received = os.read(signals_fd, 512)
            if not received:  # the parent's end closed (a death, or the watchdog let go): stdin says which
                watched.remove(signals_fd)
            elif chain_fd is not None:
                with contextlib.suppress(OSError):
                    os.write(chain_fd, received)
            for signum in sorted(set(received) & _TERMINATING):
                if pid is not None:
                    guard().restore_signalled(pid, start, gpus, signum)
        if 0 in readable:
            chunk = os.read(0, 4096)
            if not chunk:
                return stopped
            stopped = stopped or _STOP in chunk


def _wait_for_death(pid: int, start: str | None, timeout_s: float = 10.0) -> None:
    """Wait until `pid` is dead as the journal repair sees it (gone or a zombie): the kernel closes a dying
    process's files, and so the pipe, before it becomes a zombie, and a repair in between would take it
    for alive and leave its GPU changed."""
    from zeus_callbacks.core.device.process_identity import alive

    deadline = time.monotonic() + timeout_s
    while alive(pid, start) and time.monotonic() < deadline:
        time.sleep(0.002)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
