"""The host's lateness never moves a simulated GPU's figures (issue 36; sim/host.py's `HostClock`).

A host that waits for a wall-clock simulated GPU sleeps and wakes when the OS schedules it: beside CPU burners,
2-24 ms late a step. Here the host is a deterministic stand-in whose wall clock moves only when it works or
sleeps, and whose every sleep oversleeps by a fixed amount, so the figures are exact and need no real load:
the node's time and the GPU's energy per step are the model's (queued work stretched by the limit, busy at
the traced power, idle only where the host did not submit work) whether the host wakes on time or late.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from zeus_callbacks.sim import gpu as sim_gpu
from zeus_callbacks.sim import host as sim_host
from zeus_callbacks.sim.host import HOST_CLOCK
from zeus_callbacks.sim.system import SimulatedSystem

LATE_S = 0.02  # within the 2-24 ms a step measured beside five CPU burners on 2 cores
WORK_S = 0.25  # a kernel's work at the maximum limit (the demo's step)


class _Host:
    """Wall and CPU time that move only when the host works (both), sleeps (wall, `late_s` past the asked)
    or waits for a CPU while others hold them (wall and run-queue time, `queued_s`: `preempted_s` of every
    stretch of work)."""

    def __init__(self, late_s: float, preempted_s: float = 0.0) -> None:
        self.wall_s, self.cpu_s, self.late_s = 1_000.0, 0.0, late_s
        self.queued_s, self.preempted_s = 0.0, preempted_s

    def work(self, seconds: float) -> None:
        self.wall_s += seconds + self.preempted_s
        self.cpu_s += seconds
        self.queued_s += self.preempted_s

    def sleep(self, seconds: float) -> None:
        self.wall_s += seconds + self.late_s


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, host_clock):
    """`host(late_s, preempted_s=0)`: the deterministic host in place of the `time` module and the run-queue
    figures of the simulator's host pacing and GPUs, its lag reset."""

    def install(late_s: float, preempted_s: float = 0.0) -> _Host:
        h = _Host(late_s, preempted_s)
        fake = SimpleNamespace(
            time=lambda: h.wall_s, sleep=lambda s: h.sleep(s), process_time=lambda: h.cpu_s
        )
        monkeypatch.setattr(sim_host, "time", fake)
        monkeypatch.setattr(sim_gpu, "time", fake)
        host_clock(lambda tid: h.queued_s)
        return h

    return install


def _figures(steps: list[tuple]) -> list[float]:
    """Every number of a list of steps, in order (pytest.approx compares flat sequences)."""
    out: list[float] = []
    for step in steps:
        for v in step:
            out.extend(v if isinstance(v, list) else [v])
    return out


def _node(spec: str = "a40") -> SimulatedSystem:
    # Wall clock (no virtual clock), in memory, an exact counter: every read is the model's energy.
    return SimulatedSystem(spec, state_dir="", ideal="energy_counter,sensor_gain,power_average")


def _kernel_steps(h: _Host, limits_w: list[int], steps: int = 5) -> list[tuple[float, list[float]]]:
    """(node time, each GPU's energy in J) of each step: a window's synchronisation, 2 ms of host work, a
    kernel on every GPU, 7 ms of host work beside it, the closing synchronisation, 5 ms between steps."""
    system = _node(",".join(["a40"] * len(limits_w)))
    for g, w in zip(system.gpus, limits_w, strict=True):
        g.set_power_limit_mw(w * 1000)
    out = []
    for _ in range(steps):
        for g in system.gpus:
            g.synchronize()
        t0, e0 = HOST_CLOCK.now(), [g.energy_mj() for g in system.gpus]
        h.work(0.002)
        for g in system.gpus:
            g.enqueue(WORK_S)
        h.work(0.007)
        for g in system.gpus:
            g.synchronize()
        out.append(
            (
                HOST_CLOCK.now() - t0,
                [(g.energy_mj() - e) / 1000 for g, e in zip(system.gpus, e0, strict=True)],
            )
        )
        h.work(0.005)
    return out


def test_a_late_wake_moves_neither_the_step_time_nor_the_energy(host):
    """Fails if the host's lateness becomes node time or idle energy (each step 20 ms longer, 20 ms more idle
    energy), or if catching it up shortens the GPU's work."""
    on_time = _kernel_steps(host(0.0), [175])
    late = _kernel_steps(host(LATE_S), [175])
    assert _figures(late) == pytest.approx(_figures(on_time), rel=1e-9, abs=1e-9)
    tr = _node().gpus[0].trace
    busy_s, idle_w = WORK_S * tr.relative_time(175), _node().gpus[0].spec.idle_power_w
    for time_s, (energy_j,) in late:
        # The kernel runs from its launch, 2 ms into the window; the 7 ms of host work beside it is not GPU work.
        assert time_s == pytest.approx(0.002 + busy_s)
        assert energy_j == pytest.approx(busy_s * tr.power(175) + 0.002 * idle_w)


def test_the_slowest_gpu_sets_the_step_late_or_not(host):
    """Two GPUs synchronised in a row, the faster first: the host wakes late from the first, already past the
    second's end. Fails if either GPU's step depends on the lateness."""
    on_time = _kernel_steps(host(0.0), [300, 275])
    late = _kernel_steps(host(LATE_S), [300, 275])
    assert _figures(late) == pytest.approx(_figures(on_time), rel=1e-9, abs=1e-9)
    tr = _node().gpus[0].trace
    assert late[-1][0] == pytest.approx(0.002 + WORK_S * tr.relative_time(275))


def test_time_others_hold_the_cpu_moves_neither_the_step_time_nor_the_energy(host):
    """The host waits for a CPU between its waits (other programs' load: 10 ms in each stretch of its work,
    three a step): the node's time leaves that out, so the kernel starts when a host of its own would have
    queued it and the GPU idles between steps no longer. Fails if run-queue time becomes node time (each step
    10 ms longer, idle energy with it) or is caught up at the next wait by shortening the GPU's work."""
    own = _kernel_steps(host(0.0), [175])
    loaded = _kernel_steps(host(LATE_S, preempted_s=0.01), [175])
    assert _figures(loaded) == pytest.approx(_figures(own), rel=1e-9, abs=1e-9)
    assert HOST_CLOCK.lag_s == pytest.approx(LATE_S + 0.01)  # the wake, and the 5 ms between steps
    tr = _node().gpus[0].trace
    assert loaded[-1][0] == pytest.approx(0.002 + WORK_S * tr.relative_time(175))


def test_a_distributed_jobs_rank_keeps_its_run_queue_time(host, monkeypatch):
    """A rank of several (`WORLD_SIZE=2`) compares its times with the other ranks', whose lags are their own:
    its node time leaves out only the wake's lateness, so the preemption before the kernel's launch is in
    the step. Fails if a rank leaves its run-queue time out (the ranks' timelines drift apart by it)."""
    h = host(LATE_S, preempted_s=0.01)
    monkeypatch.setenv("WORLD_SIZE", "2")
    steps = _kernel_steps(h, [175])
    tr = _node().gpus[0].trace
    assert HOST_CLOCK.shared
    # The kernel is launched 2 ms of host work and 10 ms of waiting for a CPU into the window.
    assert steps[-1][0] == pytest.approx(0.012 + WORK_S * tr.relative_time(175))


def test_another_live_process_on_the_gpu_shares_the_node(host, tmp_path):
    """Another process that synchronised this GPU (its pid in the GPU's shared state, alive) times it too: this
    one keeps its run-queue time. A pid that is gone (a state left by an earlier run) changes nothing."""
    host(0.0)
    ideal = "energy_counter,sensor_gain,power_average"
    gpu = SimulatedSystem("a40", state_dir=str(tmp_path), ideal=ideal).gpus[0]
    gpu._settings.state.set("worker_pid", 2**22 + 4321)  # no such process
    gpu.synchronize()
    assert not HOST_CLOCK.shared
    gpu._settings.state.set("worker_pid", os.getppid())  # alive: the test runner's parent
    gpu.synchronize()
    assert HOST_CLOCK.shared


def test_a_thread_without_run_queue_figures_falls_back_to_the_wake(host_clock):
    """A kernel without schedstat (or a pacing thread gone): the lag is the last wake's lateness alone."""
    host_clock(lambda tid: None)
    HOST_CLOCK.wake_lag_s = 0.003
    HOST_CLOCK._pacer = 1
    assert HOST_CLOCK.lag_s == 0.003
    assert HOST_CLOCK._pacer is None


def test_run_queue_time_is_read_from_this_threads_schedstat():
    """On Linux the pacing thread's run-queue time is its schedstat's second field; it never decreases; a
    thread that is not this process's answers None."""
    import threading

    read = sim_host.RunQueueTime()
    tid = threading.get_native_id()
    first = read(tid)
    if first is None:
        pytest.skip("this kernel keeps no schedstat")
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        assert first <= int(f.read().split()[1]) / 1e9 <= read(tid)
    assert read(2**22 + 12345) is None  # no such thread of this process
    assert read(tid) is not None  # the next thread asked about is read again
    read.close()


def test_the_lag_is_caught_up_not_accumulated(host):
    """The node's time stays within one wake's lateness of the wall clock: each sleep is shorter by the lag of
    the one before. Fails if the lag builds up (the node's time drifting from every other process's)."""
    h = host(LATE_S)
    _kernel_steps(h, [175], steps=20)
    assert HOST_CLOCK.lag_s == pytest.approx(LATE_S)
    assert h.wall_s - HOST_CLOCK.now() == pytest.approx(LATE_S)


def test_a_wake_past_the_cap_is_idle_time(host):
    """A host stopped for longer than `MAX_LAG_S` (not scheduling latency): the GPU idles for the rest."""
    host(HOST_CLOCK.MAX_LAG_S + 0.3)
    (gpu,) = _node().gpus
    gpu.synchronize()
    gpu.enqueue(WORK_S)
    t0, e0 = HOST_CLOCK.now(), gpu.energy_mj()
    gpu.synchronize()
    assert HOST_CLOCK.lag_s == HOST_CLOCK.MAX_LAG_S
    assert HOST_CLOCK.now() - t0 == pytest.approx(WORK_S + 0.3)
    tr = gpu.trace
    assert (gpu.energy_mj() - e0) / 1000 == pytest.approx(
        WORK_S * tr.power(300) + 0.3 * gpu.spec.idle_power_w
    )


def test_the_nodes_time_never_runs_backwards_for_another_thread(host):
    """Another thread (a power sampler) reads the node's time while the host oversleeps: after the wake the
    node's time is no earlier than what it read, and only that part of the lateness is the GPU's idle time.
    Fails if the node's time runs backwards (the sampler's intervals would overlap)."""
    h = host(LATE_S)
    (gpu,) = _node().gpus
    gpu.synchronize()
    seen: list[float] = []
    sleep = h.sleep

    def sampled_sleep(seconds: float) -> None:
        sleep(seconds)
        h.wall_s -= LATE_S / 2
        seen.append(HOST_CLOCK.now())  # half-way through the oversleep
        h.wall_s += LATE_S / 2

    h.sleep = sampled_sleep
    gpu.enqueue(WORK_S)
    t0 = HOST_CLOCK.now()
    gpu.synchronize()
    assert HOST_CLOCK.now() == seen[0] == pytest.approx(t0 + WORK_S + LATE_S / 2)


def test_host_cpu_time_paces_the_gpu_without_kernels_late_or_not(host):
    """Without kernels the host's CPU time stands for the GPU's work at the maximum limit: the step lasts it
    times the slowdown of the limit, whether the host wakes from the catch-up on time or late."""

    def steps(h: _Host) -> list[tuple[float, float]]:
        (gpu,) = _node().gpus
        gpu.set_power_limit_mw(150_000)
        gpu.synchronize()
        out = []
        for _ in range(4):
            t0, e0 = HOST_CLOCK.now(), gpu.energy_mj()
            h.work(0.05)
            gpu.synchronize()
            out.append((HOST_CLOCK.now() - t0, (gpu.energy_mj() - e0) / 1000))
        return out

    late, on_time = steps(host(LATE_S)), steps(host(0.0))
    assert _figures(late) == pytest.approx(_figures(on_time), rel=1e-9, abs=1e-9)
    tr = _node().gpus[0].trace
    rel = tr.relative_time(150)
    assert late[-1] == pytest.approx((0.05 * rel, 0.05 * rel * tr.power(150)))


def test_once_kernels_are_queued_host_cpu_time_is_not_gpu_work(host):
    """A synchronisation with nothing queued, after the process queued kernels: the host's CPU time since the
    last one was bookkeeping (the optimizer's, the trainer's), not GPU work. Fails if it is counted busy at
    the traced power and waited for, stretched by the limit (which a late wake then lengthens)."""
    h = host(LATE_S)
    (gpu,) = _node().gpus
    gpu.set_power_limit_mw(150_000)
    gpu.enqueue(WORK_S)
    gpu.synchronize()
    t0, e0 = HOST_CLOCK.now(), gpu.energy_mj()
    h.work(0.01)
    gpu.synchronize()
    assert HOST_CLOCK.now() - t0 == pytest.approx(0.01)
    assert (gpu.energy_mj() - e0) / 1000 == pytest.approx(0.01 * gpu.spec.idle_power_w)
    assert gpu.power_mw() == pytest.approx(gpu.spec.idle_power_w * 1000)


def test_a_monitor_window_leaves_the_lateness_out(host):
    """Through NVML and `ZeusMonitor` (the clock the simulated backend gives it is the node's): each step's
    window is the model's time and energy whether the host wakes on time or late. Fails if the monitor times
    windows on the wall clock (each window then lasts the last wake's lateness less the one before)."""
    from zeus_callbacks import sim
    from zeus_callbacks.core.monitor.monitor import ZeusMonitor

    def windows(late_s: float) -> list[tuple[float, float]]:
        h = host(late_s)
        sim.simulate("a40", state_dir="", ideal="energy_counter,sensor_gain", export_env=False)
        monitor = ZeusMonitor(gpu_indices=[0])
        monitor.gpus[0].set_power_limit_mw(175_000)
        out = []
        for step in range(6):
            monitor.begin_window("step")
            h.work(0.002)
            sim.enqueue_work(0, WORK_S)
            h.work(0.007 if step % 2 else 0.001)  # unequal host work: the lateness differs between wakes
            h.late_s = late_s * (step % 3)
            m = monitor.end_window("step")
            out.append((m.time, m.total_energy))
            h.work(0.005)
        monitor.close()
        sim.disable()
        return out

    on_time, late = windows(0.0), windows(LATE_S)
    assert _figures(late) == pytest.approx(_figures(on_time), rel=1e-9, abs=1e-9)
    tr = _node().gpus[0].trace
    assert late[-1][0] == pytest.approx(0.002 + WORK_S * tr.relative_time(175))
