"""What another process (PowerMonitor's sampling process) reads of a wall-clock simulated GPU while a process
queues kernels on it: the kernels' power while they run, idle power while the host computes, so that the
sampled power integrates to the GPU's true energy, as the energy counter does.

The host is a deterministic stand-in (as in test_host_lateness.py): its wall and CPU time move only when it
works or sleeps. "Another process" is the same node's state read through a second `SimulatedSystem` with
`os.getpid` answering another pid.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from zeus_callbacks.sim import gpu as sim_gpu
from zeus_callbacks.sim import gpu_state as sim_gpu_state
from zeus_callbacks.sim import host as sim_host
from zeus_callbacks.sim.host import HOST_CLOCK
from zeus_callbacks.sim.system import SimulatedSystem

KERNEL_S = 0.05  # the example's step: 50 ms of GPU work (examples/zeus/monitors.py)
HOST_S = 0.08  # the host's own work each step (the CPU model's step, bookkeeping): 50 ms beside the kernel
SLICE_S = 0.001


class _Host:
    """Wall and CPU time that move only when the host works (both) or sleeps (wall, `late_s` past the asked,
    calling `during_sleep(dt)` at the middle of each slice of about a millisecond of it: another process
    reading meanwhile)."""

    def __init__(self) -> None:
        self.wall_s, self.cpu_s, self.late_s = 1_000.0, 0.0, 0.0
        self.during_sleep = lambda dt: None

    def work(self, seconds: float) -> None:
        self.wall_s += seconds
        self.cpu_s += seconds

    def sleep(self, seconds: float) -> None:
        n = max(1, round((seconds + self.late_s) / SLICE_S))
        dt = (seconds + self.late_s) / n  # about a millisecond
        for _ in range(n):
            self.wall_s += dt / 2
            self.during_sleep(dt)
            self.wall_s += dt / 2


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, host_clock) -> _Host:
    h = _Host()
    fake = SimpleNamespace(
        time=lambda: h.wall_s,
        sleep=h.sleep,
        process_time=lambda: h.cpu_s,
    )
    monkeypatch.setattr(sim_host, "time", fake)
    monkeypatch.setattr(sim_gpu, "time", fake)
    host_clock(lambda tid: 0.0)
    # Another process reads the worker's CPU time in /proc: here, the stand-in host's.
    monkeypatch.setattr(sim_gpu, "process_cpu_s", lambda pid: h.cpu_s)
    monkeypatch.setattr(sim_gpu_state, "process_cpu_s", lambda pid: h.cpu_s, raising=False)
    return h


def test_another_process_sees_kernels_run_and_the_hosts_cpu_time_as_idle(host, tmp_path, monkeypatch):
    """A process queues a 50 ms kernel and computes 80 ms on its host beside it, then synchronises; another
    process reads the power every millisecond. It reads busy power exactly while the kernel runs and idle
    power while only the host computes, so its readings integrate to the true energy. Fails if the other
    process counts the worker's host CPU time as GPU work (busy throughout), or holds the last interval's
    average power after it (the host's load then moves the sampled energy: examples/zeus/monitors.py read
    30% above the energy counter)."""
    ideal = "energy_counter,sensor_gain,power_average"
    worker = SimulatedSystem("a40", state_dir=str(tmp_path), ideal=ideal).gpus[0]
    reader = SimulatedSystem("a40", state_dir=str(tmp_path), ideal=ideal).gpus[0]  # the sampler's view
    other_pid = os.getpid() + 1

    def read_w() -> float:
        with monkeypatch.context() as m:
            m.setattr(os, "getpid", lambda: other_pid)
            return reader.power_mw() / 1000

    busy_w, idle_w = worker.operating_point()[1], worker.spec.idle_power_w
    e0, sampled_j, readings = worker.true_energy_mj(), 0.0, []
    for _ in range(4):
        worker.enqueue(KERNEL_S)
        for _ in range(round(HOST_S / SLICE_S)):
            host.work(SLICE_S / 2)
            w = read_w()  # at the middle of each millisecond
            host.work(SLICE_S / 2)
            readings.append(w)
            sampled_j += w * SLICE_S
        worker.synchronize()  # the kernel ended 30 ms ago: no wait
    true_j = (worker.true_energy_mj() - e0) / 1000

    per_step = [busy_w] * round(KERNEL_S / SLICE_S) + [idle_w] * round((HOST_S - KERNEL_S) / SLICE_S)
    assert readings == pytest.approx(per_step * 4, rel=1e-9)
    assert sampled_j == pytest.approx(true_j, rel=1e-9)
    assert true_j == pytest.approx(4 * (KERNEL_S * busy_w + (HOST_S - KERNEL_S) * idle_w), rel=1e-9)


def test_a_late_wake_does_not_shorten_the_kernels_another_process_sees(host, tmp_path, monkeypatch):
    """The worker wakes 3 ms late from each synchronisation, so its node time lags the wall clock by 3 ms
    (`HostClock`); another process, whose own time does not lag, reads each 50 ms kernel busy for 50 ms of its
    time, and its readings integrate to the true energy (plus the last wake's lag of idle power: the two
    clocks' offset at the end). Fails if the kernels' end is shared on the worker's node time: the other
    process then sees each kernel end 3 ms early (a loaded host's lateness moved the sampled energy)."""
    ideal = "energy_counter,sensor_gain,power_average"
    worker = SimulatedSystem("a40", state_dir=str(tmp_path), ideal=ideal).gpus[0]
    reader = SimulatedSystem("a40", state_dir=str(tmp_path), ideal=ideal).gpus[0]
    other_pid = os.getpid() + 1
    readings: list[float] = []

    def read(dt: float) -> None:
        with monkeypatch.context() as m:  # another process: its own pid, and a node time that does not lag
            m.setattr(os, "getpid", lambda: other_pid)
            m.setattr(HOST_CLOCK, "wake_lag_s", 0.0)
            m.setattr(HOST_CLOCK, "_pacer", None)
            m.setattr(HOST_CLOCK, "_latest", float("-inf"))
            readings.append(reader.power_mw() / 1000 * dt / SLICE_S)

    def work(seconds: float) -> None:
        for _ in range(round(seconds / SLICE_S)):
            host.work(SLICE_S / 2)
            read(SLICE_S)
            host.work(SLICE_S / 2)

    host.late_s, host.during_sleep = 0.003, read
    busy_w, idle_w = worker.operating_point()[1], worker.spec.idle_power_w
    e0 = worker.true_energy_mj()
    for _ in range(4):
        worker.enqueue(KERNEL_S)
        work(0.02)  # beside the kernel
        worker.synchronize()  # sleeps to the kernel's end, 3 ms late
        work(0.03)  # the GPU idles
    true_j = (worker.true_energy_mj() - e0) / 1000
    per_step = [busy_w] * round(KERNEL_S / SLICE_S)
    first_idle = readings[len(per_step) : len(per_step) + 3]  # the first step's wake was 3 ms late
    assert readings[: len(per_step)] == pytest.approx(per_step, rel=1e-9)
    assert first_idle == pytest.approx([idle_w] * 3, rel=1e-9)
    for k in range(1, 4):  # each later step: 50 ms busy, then 30 ms idle, on the reader's time
        step = readings[3 + 80 * k : 3 + 80 * (k + 1)]
        assert step == pytest.approx(per_step + [idle_w] * 30, rel=1e-9)
    # The reader's time ran 3 ms longer than the node's (the last wake's lag), the GPU idle then.
    assert HOST_CLOCK.lag_s == pytest.approx(host.late_s)
    assert sum(readings) * SLICE_S == pytest.approx(true_j + idle_w * HOST_CLOCK.lag_s, rel=1e-9)


@pytest.mark.system
def test_the_sampling_process_and_the_energy_counter_agree_within_their_bounds(sim_gpus, burn_cpu):
    """PowerMonitor's sampling process and a ZeusMonitor window over the same steps (50 ms kernels, then 150 ms
    of host work with the GPU idle): the two energies differ by no more than their bounds together, on any
    host. Fails if the sampling process counts the host's CPU time as GPU work (it read the idle half busy)."""
    from zeus_callbacks import PowerMonitor, ZeusMonitor

    gpu = sim_gpus("a40").cuda_gpus()[0]
    gpu.enqueue(0.0)  # this process's GPU work is kernels from its first synchronisation on
    gpu.synchronize()
    power = PowerMonitor(gpu_indices=[0], update_period=0.01)
    assert power.sampling == "process"
    window = ZeusMonitor(gpu_indices=[0])
    window.begin_window("steps")
    start = gpu.now()
    for _ in range(15):
        gpu.enqueue(KERNEL_S)
        gpu.synchronize()
        burn_cpu(3 * KERNEL_S)
    gpu.synchronize()
    end = gpu.now()
    m = window.end_window("steps")
    sampled, sampled_bound = power.get_energy(start, end)[0], power.get_energy_bound(start, end)[0]
    power.stop()
    assert abs(sampled - m.gpu_energy[0]) <= sampled_bound + m.gpu_energy_bound[0]
