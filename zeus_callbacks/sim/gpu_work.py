"""The work one process issues to a simulated GPU: the kernels it queued, the host's pace since the last
synchronisation, and the seeded spread (noise, stalls and bursts) of how long that work takes."""

from __future__ import annotations

import random
import threading
import time


class WorkVariability:
    """The seeded spread of the GPU's work: noise on each interval's time and power and, with `bursts`,
    stalls and bursts between and within steps (virtual clock)."""

    def __init__(self, noise: float, seed: int, bursts: bool) -> None:
        self.noise = noise
        self.bursts = bursts
        self._rng = random.Random(seed)
        self._burst_left, self._burst_factor = 0, 1.0

    def noisy(self, value: float) -> float:
        """`value` times a Gaussian factor of spread `noise`, kept within 0.5-1.5."""
        if self.noise <= 0:
            return value
        return value * min(1.5, max(0.5, self._rng.gauss(1.0, self.noise)))

    def stall_s(self, busy_s: float) -> float:
        """Idle time added to a step: a stall (data loader, checkpoint) in 2% of steps, 0.5-3x the step;
        a burst (another job, throttling) starting at 1% of steps, 5-20 steps 10-50% slower."""
        extra = busy_s * self._rng.uniform(0.5, 3.0) if self._rng.random() < 0.02 else 0.0
        if self._burst_left <= 0 and self._rng.random() < 0.01:
            self._burst_left, self._burst_factor = self._rng.randint(5, 20), self._rng.uniform(1.1, 1.5)
        if self._burst_left > 0:
            self._burst_left -= 1
            extra += busy_s * (self._burst_factor - 1)
        return extra


class IssuedWork:
    """What this process has issued to the GPU since its last synchronisation (real clock): work queued as
    kernels, or else the host's CPU time, which stands for the GPU's work; and the pacing of the next wait.

    Attributes:
        queued_s: Work enqueued without host CPU (simulated kernels), at the maximum clock.
        kernels: Whether this process queued kernels here: its CPU time is then not GPU work.
        kernels_end: When the GPU ends the queued kernels (the node's time, noiseless).
        last_sync, last_cpu, last_wall: The node's time, this process's CPU time and the wall clock at the last
            synchronisation.
        issued: Whether this process synchronised or queued work (one that never did is a reader only).
        busy_until: When the GPU ends the work a synchronisation is catching up with.
        blocking_sync: Whether the synchronisation defers signals while it waits, as a blocking one does.
        mutex: Held while work is issued or waited for.
        variability: The spread of the work's time and power.
    """

    def __init__(self, now: float, blocking_sync: bool, variability: WorkVariability) -> None:
        self.queued_s = 0.0
        self.kernels = False
        self.kernels_end = 0.0
        self.last_sync = now
        self.last_cpu = time.process_time()
        self.last_wall = time.time()
        self.issued = False
        self.busy_until = 0.0
        self.blocking_sync = blocking_sync
        self.mutex = threading.Lock()
        self.variability = variability
