"""The restore watchdog: a small process that puts the GPU back the moment the process that changed it dies,
however it dies (SIGKILL, the OOM killer, SIGHUP, a SIGTERM it could not handle while blocked in C code).

Started with the first journaled change, which waits (up to `READY_TIMEOUT_S`) until the watchdog has
discovered the GPUs and says it is ready, so that a death even in the first second is repaired at once. It holds nothing but the read end of a pipe whose write end only the
changing process holds: the kernel closes that end when the process dies, the watchdog reads end-of-file,
waits until the process is dead (the pipe closes a moment before), repairs its journal exactly as the next
run would (so it never touches a GPU a live process owns), and exits. A process that restores normally says
so on the pipe and closes it, so the watchdog exits then too; it never outlives its purpose. Set `ZEUS_CALLBACKS_WATCHDOG=0` to do without it (a killed run is then repaired
by the next one, or by `zeus-callbacks restore`).

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


class Watchdog:
    """The handle the changing process keeps: the pipe's write end (see the module docstring)."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._proc = subprocess.Popen(
            # `-c`, not `-m`: the package already imported this module, which `-m` would run a second time.
            [sys.executable, "-c", _ENTRY, str(self._pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C or a hang-up of the terminal does not reach it
        )
        os.register_at_fork(after_in_child=self._forget)
        self.ready = self._wait_ready(READY_TIMEOUT_S)

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
        if os.environ.get(WATCHDOG_ENV, "1") == "0":
            return None
        try:
            return cls()
        except OSError as e:
            logger.debug("No restore watchdog: %s", e)
            return None

    def _forget(self) -> None:
        # A forked child must not keep the pipe open: the watchdog waits for the changing process only.
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                os.close(self._proc.stdin.fileno())

    def stop(self) -> None:
        """Let the watchdog go (the settings are restored): it reads end-of-file and exits."""
        if os.getpid() != self._pid or self._proc.stdin is None:
            return
        with contextlib.suppress(OSError):
            self._proc.stdin.write(_STOP)  # a deliberate end, not a death: the watchdog need not wait for one
            self._proc.stdin.close()
        # Reap it once it has exited, so that no zombie is left behind for the life of this process.
        threading.Thread(target=self._proc.wait, name="zeus-callbacks-watchdog-reaper", daemon=True).start()


def main(argv: list[str]) -> int:
    """Wait for end-of-file on stdin, then repair the journals of dead processes on the GPUs visible here."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # a job's clean-up signals must not stop the clean-up
    logging.basicConfig(level=logging.WARNING, format="zeus-callbacks restore watchdog: %(message)s")
    import zeus_callbacks  # noqa: F401  (registers the NVML backends)
    from zeus_callbacks.core.device.gpus import get_gpus
    from zeus_callbacks.core.device.state_guard import _start_time, guard

    start = _start_time(int(argv[0])) if argv else None  # the parent's identity, read while it lives
    try:
        gpus = get_gpus()  # discovered before it is needed, so that the restore is quick
    except Exception as e:  # noqa: BLE001 - no GPU: nothing to watch
        logger.debug("No GPUs to watch: %s", e)
        return 0
    with contextlib.suppress(OSError):
        os.write(1, _READY)  # the changing process goes on: from here a death is repaired at once
        os.close(1)
    stopped = False
    while chunk := os.read(0, 4096):  # end-of-file: the parent closed the pipe, or died
        stopped = stopped or _STOP in chunk
    if not stopped and argv:
        _wait_for_death(int(argv[0]), start)
    guard().repair_dead_runs(gpus)
    return 0


def _wait_for_death(pid: int, start: str | None, timeout_s: float = 10.0) -> None:
    """Wait until `pid` is dead as the journal repair sees it (gone or a zombie): the kernel closes a dying
    process's files, and so the pipe, before it becomes a zombie, and a repair in between would take it
    for alive and leave its GPU changed."""
    from zeus_callbacks.core.device.state_guard import _alive

    deadline = time.monotonic() + timeout_s
    while _alive(pid, start) and time.monotonic() < deadline:
        time.sleep(0.002)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
