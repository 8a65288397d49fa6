"""Set a GPU's locked SM clock from a background thread, so that the vendor library's call stays off the
critical path."""

from __future__ import annotations

import logging
import threading
from collections import deque

from zeus_callbacks.core.device.errors import GPUError
from zeus_callbacks.core.device.gpus import GPU

__all__ = ["FrequencyController"]

logger = logging.getLogger(__name__)


class FrequencyController:
    """Locks one GPU's SM clock to the frequency requested last, from a worker thread.

    `request(mhz)` returns at once; the worker applies the newest request (older ones still queued are
    stale and skipped) and skips a change to the clock already in force. `set_now(mhz)` applies a clock
    before returning. Every change goes through the GPU-state guard, so the clock is reset at the end.
    After `close()` returns, no further change is made. A failed change stops the controller; `error`
    says why.

    Args:
        gpu: The GPU whose SM clock is controlled.
    """

    def __init__(self, gpu: GPU) -> None:
        self.gpu = gpu
        self.changes = 0  # clock changes made (redundant requests excluded)
        self.error: GPUError | None = None
        self._requested: int | None = None
        self._applied: int | None = None
        self._pending: deque[int] = deque()
        self._cond = threading.Condition()
        self._calling = threading.Lock()  # held around every call to the GPU, and by close()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zeus-callbacks-frequency", daemon=True)
        self._thread.start()

    @property
    def frequency_mhz(self) -> int | None:
        """The clock most recently locked by this controller (None: not locked by it)."""
        return self._applied

    def request(self, mhz: int) -> None:
        """Ask for `mhz` (applied in the background; a repeat of the last request costs nothing)."""
        if mhz == self._requested or self._closed or self.error is not None:
            return
        self._requested = mhz
        with self._cond:
            self._pending.append(mhz)
            self._cond.notify()

    def set_now(self, mhz: int) -> None:
        """Lock the clock to `mhz` before returning (after any queued request).

        Raises:
            GPUError: the change was refused (no permission, not supported, GPU lost).
        """
        self.wait()
        self._requested = mhz
        self._apply(mhz, raise_error=True)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every request so far is applied; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    def close(self) -> None:
        """Stop the worker; no change is made after this returns (the caller restores the clock)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()
        # A call to the GPU in flight finishes before close returns. From a signal handler the main thread may
        # itself hold the lock (inside `set_now`): do not wait for ourselves.
        if self._calling.acquire(timeout=2):
            self._calling.release()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def forget(self) -> None:
        """Forget the clock in force (after something else reset it), so the next request is applied."""
        self._requested = self._applied = None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                mhz = self._pending[-1]
                self._pending.clear()
                self._busy = True
            try:
                self._apply(mhz, raise_error=False)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _apply(self, mhz: int, raise_error: bool) -> None:
        with self._calling:
            if self._closed or mhz == self._applied:
                return
            try:
                self.gpu.lock_sm_clocks(mhz, mhz)
            except GPUError as e:
                if raise_error:
                    raise
                self.error = e
                logger.warning("Could not lock the SM clock of %s to %d MHz: %s", self.gpu.label, mhz, e)
                return
            self._applied = mhz
            self.changes += 1
