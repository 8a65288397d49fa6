"""PowerMonitor's sampling process: the GPUs' power read in another interpreter, so sampling never takes the
training thread's GIL.

A thread that samples in the training process must take the GIL for every reading (and a ctypes call into
NVML gives it up and takes it back), so a step that holds the GIL pays for each of the thread's wake-ups
(`benchmarks/monitor_overhead.py --section step` measures it). Zeus samples in spawned processes for the same
reason. This process is started with `python -m` (not `multiprocessing`'s spawn), so it never re-imports the
user's main module, and it needs neither torch nor the training process's CUDA numbering: it opens the GPUs
by the UUIDs the parent resolved.

The protocol is lines on the child's stdin and stdout: the parent writes one JSON line (what to read, how
often), the child answers `{"ready": ...}` after its first reading; then, on each `flush` (or `poll`: read
once now, then flush) line, one JSON line of the readings since the last flush, each run of equal readings
reduced to its first and last point (what `Series` keeps), and the GPUs that stopped answering. The child
exits when its stdin closes (the parent stopped, or died) or on `stop`; it ignores SIGINT, so Ctrl-C in a
terminal stops training, which then stops it.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["SamplingProcess", "SamplingProcessError", "Flushed"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a loaded host: the child imports nvidia-ml-py (and the simulator)
REPLY_TIMEOUT_S = 10.0
COMMAND = [sys.executable, "-m", __name__]  # how the child is started


class SamplingProcessError(RuntimeError):
    """The sampling process did not start, or stopped answering."""


Reading = tuple[str, int, float, float]  # (domain name, GPU index, time, mW)


@dataclass(frozen=True, slots=True)
class Flushed:
    """What one flush brought: readings in time order per GPU and domain, and GPUs that stopped answering."""

    readings: list[Reading]
    failed: dict[int, str]


class SamplingProcess:
    """The parent's handle on one sampling process (see the module's docstring).

    Args:
        targets: Per GPU: (index, UUID, [domain name read in one call, ...], the domain the standard power
            reading gives or None).
        period_s: Seconds between two readings.
        max_samples: Readings kept per GPU and domain between two flushes (None: all).

    Raises:
        SamplingProcessError: the process did not start within `START_TIMEOUT_S` or failed to open the GPUs
            (the message carries its error).
    """

    def __init__(
        self,
        targets: Sequence[tuple[int, str, Sequence[str], str | None]],
        period_s: float,
        max_samples: int | None,
    ) -> None:
        spec = {"targets": [list(t) for t in targets], "period_s": period_s, "max_samples": max_samples}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            COMMAND,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # stderr is the parent's: a child that cannot start says why where the user looks
            env=os.environ.copy(),
            close_fds=True,
        )
        self._send(json.dumps(spec))
        reply = self._reply(START_TIMEOUT_S)
        if "ready" not in reply:
            raise SamplingProcessError(str(reply.get("error", reply)))
        self.pid: int = self._proc.pid

    def _send(self, line: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(line.encode() + b"\n")
        self._proc.stdin.flush()

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            why = (
                f"did not answer within {timeout_s:.0f} s"
                if not ready
                else f"ended (exit status {proc.poll()})"
            )
            raise SamplingProcessError(f"the power sampling process {why}")
        return json.loads(line)

    @property
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self._proc is not None and self._proc.poll() is None

    def flush(self, poll_now: bool = False) -> Flushed:
        """The readings since the last flush (after one more reading, with `poll_now`).

        Raises:
            SamplingProcessError: the process ended or stopped answering (it is stopped).
        """
        with self._lock:
            if self._proc is None:
                raise SamplingProcessError("the power sampling process was stopped")
            try:
                self._send("poll" if poll_now else "flush")
            except OSError:
                self.stop()
                raise SamplingProcessError("the power sampling process ended") from None
            reply = self._reply(REPLY_TIMEOUT_S)
        readings = [(str(d), int(i), float(t), float(mw)) for d, i, t, mw in reply["readings"]]
        return Flushed(readings, {int(k): str(v) for k, v in reply["failed"].items()})

    def stop(self) -> None:
        """Stop the process and wait for it (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()  # EOF: the child stops sampling and exits
        except OSError:
            pass
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- the child -------------------------------------------------------------------------------------------
class _Runs:
    """Readings of one GPU and domain since the last flush, a run of equal values kept as its first and last."""

    def __init__(self, max_samples: int | None) -> None:
        self.points: deque[tuple[float, float]] = deque(
            maxlen=None if max_samples is None else max_samples + 1
        )

    def add(self, t: float, mw: float) -> None:
        p = self.points
        if len(p) >= 2 and p[-1][1] == mw and p[-2][1] == mw:
            p[-1] = (t, mw)
        else:
            p.append((t, mw))


def _open_targets(spec: dict[str, Any]) -> tuple[Any, list[tuple[Any, int, Any]]]:
    """The backend and (GPU, index, reader) of each GPU the parent named, opened by UUID."""
    from zeus_callbacks.core.device.backend import active_backend
    from zeus_callbacks.core.device.gpus import GPU
    from zeus_callbacks.core.monitor.power_readings import PowerDomain, PowerReader

    backend = active_backend()
    backend.init()
    targets = []
    for index, uuid, fields, usage in spec["targets"]:
        reader = PowerReader(
            tuple(PowerDomain(d) for d in fields), None if usage is None else PowerDomain(usage)
        )
        device = backend.open_device(str(uuid), int(index))
        targets.append((GPU(backend, int(index), device), int(index), reader))
    return backend, targets


class _ChildSampler:
    """The child's readings since the last flush, taken by `poll` (from its sampling thread or on request)."""

    def __init__(self, targets: list[tuple[Any, int, Any]], clock: Any, max_samples: int | None) -> None:
        self._targets, self._clock, self._max = targets, clock, max_samples
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, int], _Runs] = {}
        self._failed: dict[int, str] = {}

    def poll(self) -> None:
        from zeus_callbacks.core.device.errors import GPUError
        from zeus_callbacks.core.monitor.power_readings import read_power

        for gpu, index, reader in self._targets:
            if index in self._failed:
                continue
            t = self._clock()
            try:
                values = read_power(gpu, reader)
            except GPUError as e:
                with self._lock:
                    self._failed[index] = str(e)
                continue
            with self._lock:
                for domain, mw in values:
                    self._runs.setdefault((domain.value, index), _Runs(self._max)).add(t, mw)

    def flushed(self) -> dict[str, Any]:
        with self._lock:
            readings = [[d, i, t, mw] for (d, i), r in self._runs.items() for t, mw in r.points]
            self._runs.clear()
            return {"readings": readings, "failed": {str(k): v for k, v in self._failed.items()}}


def _child(stdin: IO[str], stdout: IO[str]) -> int:
    from zeus_callbacks.core.monitor.timeline import Poller

    def answer(message: dict[str, Any]) -> None:
        stdout.write(json.dumps(message) + "\n")
        stdout.flush()

    spec = json.loads(stdin.readline() or "null")
    if spec is None:
        return 0
    try:
        backend, targets = _open_targets(spec)
    except Exception as e:  # noqa: BLE001 - the parent shows it and samples in its own thread instead
        answer({"error": f"{type(e).__name__}: {e}"})
        return 1
    sampler = _ChildSampler(targets, backend.clock, spec["max_samples"])
    sampler.poll()
    answer({"ready": os.getpid()})
    poller = Poller("zeus-callbacks-power-sampler", float(spec["period_s"]), sampler.poll)
    try:
        for line in stdin:
            command = line.strip()
            if command == "poll":
                sampler.poll()
            if command in ("poll", "flush"):
                answer(sampler.flushed())
            elif command == "stop":
                break
    finally:
        poller.stop()
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="zeus-callbacks power sampler: %(message)s")
    sys.exit(_child(sys.stdin, sys.stdout))
