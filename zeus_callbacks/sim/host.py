"""Host pacing of the real-clock simulation (what a synchronisation waits for, whose CPU time counts as work,
the node's time as this process sees it) and the virtual clock."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

DEFERRED_SIGNALS = {
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
}


def busy_power_w(idle_w: float, busy_w: float, cpu_s: float, span_s: float) -> float:
    """Power of a GPU fed by a host that spent `cpu_s` of CPU over `span_s` since its last synchronisation:
    busy power in that proportion. Right after a synchronisation the ratio of two tiny spans is noise: it
    is averaged over >= 10 ms."""
    busy = min(max(0.0, cpu_s), max(0.0, span_s))
    return idle_w + (busy_w - idle_w) * busy / max(span_s, 0.01)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (/proc/PID/stat, fields 14 and 15 of proc(5)); None when
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


_CLK_TCK = os.sysconf("SC_CLK_TCK")


class _HostWait:
    """How long the host has waited in simulated synchronisations since it last did CPU work.

    GPUs work in parallel: while the host waits for one GPU, the others keep working on the work queued
    before, so synchronising several GPUs in a row takes as long as the slowest, not the sum.
    """

    _CPU_EPS_S = 0.002  # CPU time the host may spend between the synchronisations of one batch

    def __init__(self) -> None:
        self._cpu_mark = float("-inf")
        self._waited_s: dict[int, float] = {}  # GPU index -> time waited for it since the mark

    def credit(self, cpu_s: float, gpu: int) -> float:
        """Time already waited for *other* GPUs since the host's last CPU work (0 once it did more work).

        A GPU's own earlier waits never count: its next interval starts after them.
        """
        if cpu_s - self._cpu_mark >= self._CPU_EPS_S:
            return 0.0
        return sum(w for g, w in self._waited_s.items() if g != gpu)

    def add(self, cpu_before_s: float, waited_s: float, cpu_after_s: float, gpu: int) -> None:
        """Record a wait of `waited_s` for `gpu` that began at process CPU time `cpu_before_s`."""
        if cpu_before_s - self._cpu_mark >= self._CPU_EPS_S:
            self._waited_s.clear()
        self._waited_s[gpu] = self._waited_s.get(gpu, 0.0) + waited_s
        self._cpu_mark = cpu_after_s


HOST_WAIT = _HostWait()


def in_distributed_job() -> bool:
    """Whether this process is one rank of several: a launcher's `WORLD_SIZE` above 1, or an initialised
    torch.distributed group (looked up only if the program imported it)."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return True
    except ValueError:
        pass
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # a half-imported or stubbed module: not a job this process can see
        return False


class RunQueueTime:
    """Seconds a thread of this process has waited on a run queue, runnable but not running: the second field
    of /proc/self/task/TID/schedstat, in ns (Linux's Documentation/scheduler/sched-stats.rst). The file of
    the last thread asked about stays open (read in about 3 us; `close` after a fork)."""

    def __init__(self) -> None:
        self._tid: int | None = None
        self._fd = -1

    def __call__(self, tid: int) -> float | None:
        """Thread `tid`'s run-queue time (s); None where the kernel does not keep it or the thread is gone."""
        try:
            if tid != self._tid:
                self.close()
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
                self._tid = tid
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            self.close()
            return None

    def close(self) -> None:
        """Close the open file (in a forked child it is the parent's thread's)."""
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._tid = -1, None


class HostClock:
    """The time of a wall-clock simulated node as this process sees it: the wall clock less the host's lag.

    The simulated node is a host of its own, not the machine the simulation runs on: another program's load
    on this machine is not the node's. It reaches the node's timeline two ways, both the host's lag:
    - a host that waits for a simulated GPU sleeps until the GPU's work ends and wakes when the OS schedules
      it, late by a scheduler's latency (2-24 ms a step beside five CPU burners on 2 cores, issue 36);
    - between two waits, the pacing thread (the one that synchronised last) is runnable but not running while other
      programs hold the CPUs (its run-queue time, `RunQueueTime`): 10-50 ms a step beside the same burners,
      which would stretch the host's work between a GPU's kernels and leave the GPU idle meanwhile.
    A real GPU waits for neither, and a simulated one must not either, or the host's load would move every
    step time and energy. The run-queue time is left out only while the process is alone on the node (`share`):
    each process's lag is its own, so processes that compare their times (the ranks of a torch.distributed
    job, processes taking turns on one GPU) keep the wake's lateness alone, a scheduler latency, and their
    timelines stay comparable. So the node's time is the wall clock less the lag, and what the host does next
    (queue a kernel, read a counter, time a window) happens on the GPU's timeline when a host of its own
    would have done it. The host's next wait is shorter by its lag, so the lag never builds up: it is the
    lateness of the last wake plus the run-queue time since, at most `MAX_LAG_S` (longer is a stopped
    process, not scheduling: the GPU idles for the rest). The node's time never runs backwards: where another
    thread (a power sampler) read it meanwhile, that much of the lag is the GPU's idle time.
    """

    MAX_LAG_S = 0.5

    def __init__(self, run_queue: Callable[[int], float | None] | None = None) -> None:
        self.wake_lag_s = 0.0  # how late the pacing thread woke from its last wait
        self._latest = float("-inf")  # the latest node time read by any thread
        self._run_queue = RunQueueTime() if run_queue is None else run_queue
        self._pacer: int | None = None  # the native id of the thread that waited last
        self._queued_at_wake = 0.0  # its run-queue time when it woke
        self.shared = False  # whether other processes time this node too (`share`)

    @property
    def lag_s(self) -> float:
        """How far the node's time is behind the wall clock (s)."""
        return min(self.wake_lag_s + self._queued_since_wake(), self.MAX_LAG_S)

    def reset(self) -> None:
        """Forget the lag and the pacing thread (a process that begins pacing afresh: a forked child, a test)."""
        self.wake_lag_s, self._latest, self._pacer, self._queued_at_wake = 0.0, float("-inf"), None, 0.0
        self.shared = False
        if isinstance(self._run_queue, RunQueueTime):
            self._run_queue.close()

    def _queued_since_wake(self) -> float:
        if self._pacer is None:
            return 0.0
        queued = self._run_queue(self._pacer)
        if queued is None:  # the thread is gone, or the kernel keeps no such figure
            self._pacer = None
            return 0.0
        return max(0.0, queued - self._queued_at_wake)

    def now(self) -> float:
        """The node's time (s since the epoch)."""
        return self._at(time.time(), self.lag_s)

    def pace(self, last_worker_pid: int = 0) -> None:
        """The calling thread synchronises a GPU that process `last_worker_pid` synchronised last (0: none): its
        run-queue time is the lag's from now on (what another thread's added so far stays), unless the process
        is one of a distributed job's or that GPU's last worker is another live process (`share`)."""
        if not self.shared and (
            in_distributed_job()
            or (last_worker_pid not in (0, os.getpid()) and process_cpu_s(last_worker_pid) is not None)
        ):
            self.share()
        tid = threading.get_native_id()
        if tid != self._pacer and not self.shared:
            self.wake_lag_s = self.lag_s
            self._follow(tid)

    def share(self) -> None:
        """Other processes time this node too: from now on the lag is the last wake's lateness alone (what
        the run-queue time added so far stays until the next wait catches it up)."""
        if not self.shared:
            self.wake_lag_s, self._pacer, self.shared = self.lag_s, None, True

    def _follow(self, tid: int) -> None:
        if self.shared:
            return
        queued = self._run_queue(tid)
        self._pacer, self._queued_at_wake = (None, 0.0) if queued is None else (tid, queued)

    def _at(self, wall: float, lag: float) -> float:
        t = wall - lag
        if t > self._latest:
            self._latest = t
        return self._latest

    def wait_until(self, end_s: float, defer_signals: bool) -> float:
        """Wait until the node's time `end_s` (when a GPU's work ends): on the wall clock until then, which
        catches up the lag; with `defer_signals`, as CUDA's synchronisation does (`sleep_deferring_signals`).
        Returns the node's time after: `end_s`, or later when it was past already or the host woke more
        than `MAX_LAG_S` late."""
        wall, lag = time.time(), self.lag_s
        if end_s <= wall - lag:  # the GPU is done: the host was the slower
            return self._at(wall, lag)
        if end_s > wall:
            (sleep_deferring_signals if defer_signals else time.sleep)(end_s - wall)
            wall = time.time()
        self._follow(threading.get_native_id())
        self.wake_lag_s = min(max(0.0, wall - max(end_s, self._latest)), self.MAX_LAG_S)
        return self._at(wall, self.wake_lag_s)


HOST_CLOCK = HostClock()
os.register_at_fork(after_in_child=HOST_CLOCK.reset)  # the child's threads are its own


def sleep_deferring_signals(seconds: float) -> None:
    """Sleep as CUDA's synchronisation waits, in native code: Python signal handlers (`DEFERRED_SIGNALS`) run
    only after it returns."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
    try:
        time.sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class VirtualClock:
    """A clock that only moves when simulated work runs (offline what-if runs)."""

    def __init__(self, start: float = 1_000.0) -> None:
        self._now = start

    def now(self) -> float:
        """Current virtual time (s)."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self._now += max(0.0, seconds)
