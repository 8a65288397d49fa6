"""PowerMonitor (Zeus's `zeus.monitor.power` interface) on simulated GPUs through the real nvidia-ml-py: the
domains each generation offers, energy from the timeline against the simulator's own energy counter, no
busy polling, clean stops and clear errors."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time

import pytest

from zeus_callbacks import PowerDomain, PowerMonitor
from zeus_callbacks import sim as zeus_sim
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor import power as power_module
from zeus_callbacks.core.monitor import power_readings, sampling_process
from zeus_callbacks.core.monitor.timeline import Series, integrate
from zeus_callbacks.sim import fake_nvml

ALL = ["device_instant", "device_average", "memory_average"]


def _domains(monitor: PowerMonitor) -> list[str]:
    return [d.value for d in monitor.measurement_domains]


@pytest.mark.parametrize(
    ("spec", "domains"),
    [
        ("h100", ALL),  # Hopper: memory power too (Zeus: "Confirmed working on H100")
        ("a40", ["device_instant", "device_average"]),  # GA102: no memory power (Zeus: "not working on A40")
        ("a100", ["device_instant"]),  # GA100: nvml.h's "except GA100" for the 1-second average
        ("v100", ["device_instant"]),
        ("t4", ["device_instant"]),
    ],
)
def test_each_generation_offers_the_domains_nvml_documents(sim_gpus, spec: str, domains: list[str]) -> None:
    sim_gpus(spec, virtual_clock=True)
    monitor = PowerMonitor(update_period=0.05, background=False)
    assert _domains(monitor) == domains
    assert set(monitor.get_all_power_timelines()) == set(domains)
    assert monitor.simulated


def test_a_domain_the_gpu_lacks_is_refused_with_what_it_offers(sim_gpus) -> None:
    sim_gpus("a100", virtual_clock=True)
    with pytest.raises(
        InvalidInputError, match=r"does not offer 'device_average' \(it offers \['device_instant'\]\)"
    ):
        PowerMonitor(update_period=0.05, power_domains=["device_average"], background=False)
    monitor = PowerMonitor(update_period=0.05, power_domains=[PowerDomain.DEVICE_INSTANT], background=False)
    with pytest.raises(InvalidInputError, match="not being monitored"):
        monitor.get_power_timeline("memory_average")


def test_a_mixed_node_monitors_the_domains_every_gpu_offers(sim_gpus) -> None:
    sim_gpus("a40,h100", virtual_clock=True)
    monitor = PowerMonitor(update_period=0.05, background=False)
    assert _domains(monitor) == ["device_instant", "device_average"]


@pytest.mark.parametrize(("spec", "domains"), [("a40", ["device_average"]), ("v100", ["device_instant"])])
def test_without_field_values_power_usage_stands_for_its_domain(
    sim_gpus, spec: str, domains: list[str]
) -> None:
    """An old driver's NVML lacks nvmlDeviceGetFieldValues: nvmlDeviceGetPowerUsage is the 1-second average on
    Ampere (except GA100) and newer, the instant reading before."""
    sim_gpus(spec, virtual_clock=True, faults="missing=nvmlDeviceGetFieldValues")
    monitor = PowerMonitor(update_period=0.05, background=False)
    assert _domains(monitor) == domains
    if "device_instant" not in domains:
        with pytest.raises(InvalidInputError, match="needs device_instant"):
            monitor.get_power()


def _steady_steps(sim_gpus, steps: int = 40) -> tuple[PowerMonitor, float, float, float]:
    """`steps` steady 100 ms steps on a virtual-clock A40 (ideal counter and power window: the counter is
    exact and the instant reading is the last step's power), polled after each; the monitor, the steps' start
    and end, and the energy (J) the counter moved by over them."""
    system = sim_gpus("a40", virtual_clock=True, ideal="energy_counter,power_window")
    gpu = get_gpus()[0]
    monitor = PowerMonitor(update_period=0.1, background=False)
    system.run_step(0.1)  # the first reading saw the idle GPU; integrate from the first busy one
    monitor.poll()
    start, counter_start = system.clock.now(), gpu.energy_mj()
    for _ in range(steps):
        system.run_step(0.1)
        monitor.poll()
    end, counter_end = system.clock.now(), gpu.energy_mj()
    return monitor, start, end, (counter_end - counter_start) / 1000


def test_energy_from_the_timeline_equals_the_energy_counter(sim_gpus) -> None:
    """Steady steps on a virtual clock: the integral of sampled power over whole steps is the energy the
    simulator's counter moved by, to rounding (a real A40's reading lags by up to its 100 ms update)."""
    monitor, start, end, truth = _steady_steps(sim_gpus)
    energy = monitor.get_energy(start, end)
    assert energy is not None
    assert energy[0] == pytest.approx(truth, rel=1e-3)
    # The average domain tracks the same power once its one-second window is full of busy steps.
    late = monitor.get_power_timeline("device_average", start_time=start + 1.0)[0]
    assert late and all(w == pytest.approx(late[-1][1], rel=1e-3) for _, w in late)


def test_a_run_of_equal_readings_is_not_taken_for_missing_ones(sim_gpus) -> None:
    """Steady steps read the same power every poll, and the timeline keeps only a run's first and last
    readings (`Series`). The bound counts the run as read (what the readings may miss is half their change:
    none), not as four seconds of missing readings, each worth anything up to the board's top power. Fails
    if the gap between a run's ends is taken for missing readings (the bound was then 516 J on a 2 s window
    of examples/zeus/monitors.py's steps, against 88 J)."""
    monitor, start, end, truth = _steady_steps(sim_gpus)
    timeline = monitor.get_power_timeline("device_instant", start_time=start)[0]
    assert len(timeline) == 2  # one run: its ends
    energy, bound = monitor.get_energy(start, end)[0], monitor.get_energy_bound(start, end)[0]
    assert abs(energy - truth) <= bound
    held_w = monitor._bound(0, power_readings.PowerDomain.DEVICE_INSTANT).held_error_w(timeline[0][1])
    assert bound < held_w * (end - start) / 2  # what four seconds of missing readings would add alone


def test_energy_across_a_power_change_is_within_one_poll_of_the_counter(sim_gpus) -> None:
    system = sim_gpus("a40", virtual_clock=True, ideal="energy_counter,power_window")
    gpu = get_gpus()[0]
    monitor = PowerMonitor(update_period=0.1, background=False)
    system.run_step(0.1)
    monitor.poll()
    start, counter_start = system.clock.now(), gpu.energy_mj()
    for limit_w in (300, 150):
        gpu.set_power_limit_mw(limit_w * 1000)
        for _ in range(10):
            system.run_step(0.1)
            monitor.poll()
    end, counter_end = system.clock.now(), gpu.energy_mj()
    truth = (counter_end - counter_start) / 1000
    timeline = monitor.get_power_timeline("device_instant", start_time=start)[0]
    busy = [w for _, w in timeline]
    longest = max(b - a for (a, _), (b, _) in zip(timeline, timeline[1:], strict=False))
    # The trapezoid spreads the step between two readings over one poll (a step, longer at the lower limit):
    # at most half that poll times the difference.
    error = abs(monitor.get_energy(start, end)[0] - truth)
    assert 0 < error <= 0.5 * longest * (max(busy) - min(busy)) + 1e-6


def test_get_power_is_the_latest_or_the_nearest_reading(sim_gpus) -> None:
    system = sim_gpus("a40", virtual_clock=True)
    monitor = PowerMonitor(update_period=0.1, background=False)
    first_t = system.clock.now()
    idle = monitor.get_power()[0]
    for _ in range(5):
        system.run_step(0.1)
        monitor.poll()
    busy = monitor.get_power()[0]
    assert busy > idle
    assert monitor.get_power(first_t)[0] == idle
    assert monitor.get_power(system.clock.now() + 100)[0] == busy
    timeline = monitor.get_power_timeline("device_instant", gpu_index=0)[0]
    assert timeline == sorted(timeline) and timeline[0] == (first_t, idle)


def test_equal_readings_keep_the_first_and_last_point_of_their_run() -> None:
    s = Series(None)
    for t, v in [(0, 5), (1, 5), (2, 5), (3, 7), (4, 7)]:
        s.add(t, v)
    assert s.points() == [(0, 5), (2, 5), (3, 7), (4, 7)]
    assert s.points(1, 3) == [(2, 5), (3, 7)]
    assert integrate(s.points(), 0, 4) == pytest.approx(5 * 2 + 6 + 7)
    assert integrate(s.points(), 1, 2.5) == pytest.approx(5 + 5.5 * 0.5)  # a window between readings
    bounded = Series(2)
    for t in range(5):
        bounded.add(t, t)
    assert bounded.points() == [(3, 3), (4, 4)]


def test_the_inferred_period_is_half_the_refresh_floored_at_10_ms(sim_gpus, monkeypatch) -> None:
    """The inference's figures where the refresh is known (the virtual clock: nothing is polled): half the
    A40's 100 ms, and a 4 ms refresh floored at `MIN_UPDATE_PERIOD_S`. Fails if the halving or the floor
    goes; the system tier checks only the order of magnitude of what it measures on the real clock."""
    for refresh_ms, want in ((None, 0.05), (4, power_module.MIN_UPDATE_PERIOD_S)):
        monkeypatch.setattr(power_readings, "_refresh_s", {})
        sim_gpus("a40", virtual_clock=True, energy_refresh_ms=refresh_ms)
        assert power_readings.infer_counter_update_period([0]) == pytest.approx(want)
        zeus_sim.disable()


@pytest.mark.system
def test_the_inferred_period_sleeps_and_is_never_zero(sim_gpus) -> None:
    """Zeus 0.16.0's inference starts from 0 and takes the minimum, so it always returns 0 s: busy polling.
    Here it is half the measured refresh (A40: 100 ms), floored at 10 ms."""
    sim_gpus("a40")
    monitor = PowerMonitor()
    # Measured on the real clock: never 0 (it sleeps), and the order of magnitude of half of 100 ms.
    assert 0.01 <= monitor.update_period < 0.5
    system = sim_gpus("v100")
    system.gpus[0].synchronize()  # a GPU in use: its readings move (an idle simulated one reads constant)
    power_readings._refresh_s.clear()
    fast = PowerMonitor()
    assert power_module.MIN_UPDATE_PERIOD_S <= fast.update_period < 0.1  # half of 20 ms, floored at 10 ms
    monitor.stop()
    fast.stop()


def test_zeus_0160_infers_a_zero_period(sim_gpus, monkeypatch) -> None:
    """The behaviour this package does not copy: PyPI zeus 0.16.0's `infer_counter_update_period` begins at 0.0
    and keeps the minimum (zeus/monitor/power.py), so `PowerMonitor(update_period=None)` polls without sleeping.
    Given the same counter (an A40's, refreshed every 100 ms), Zeus's answers 0 s and this package's 50 ms."""
    zeus = pytest.importorskip("zeus")
    if zeus.__version__ != "0.16.0":
        pytest.skip(f"Zeus {zeus.__version__}: the zero period is 0.16.0's")
    import zeus.monitor.power as zeus_power

    class OneA40:
        def get_name(self, index: int) -> str:
            return "NVIDIA A40"

    monkeypatch.setattr(zeus_power, "get_gpus", OneA40)
    # What Zeus's sampling loop measures on an A40 (its counter refreshes every 100 ms).
    monkeypatch.setattr(zeus_power, "_infer_counter_update_period_single", lambda index: 0.1)
    assert zeus_power.infer_counter_update_period([0]) == 0.0
    monkeypatch.setattr(power_readings, "_refresh_s", {})
    sim_gpus("a40", virtual_clock=True)
    assert power_readings.infer_counter_update_period([0]) == pytest.approx(0.05)


@pytest.mark.system
def test_the_background_thread_reads_nvml_at_most_once_per_period(sim_gpus, monkeypatch) -> None:
    """Count the NVML calls beneath pynvml over a wall-clock second: sleeping between ticks bounds them by
    the elapsed time over the period (a slower host only makes fewer)."""
    sim_gpus("a40")
    calls: list[float] = []
    real = fake_nvml.nvmlDeviceGetFieldValues

    def counted(handle, fields):
        calls.append(time.monotonic())
        return real(handle, fields)

    monitor = PowerMonitor(update_period=0.05, sampling="thread")
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetFieldValues", counted)
    start = time.monotonic()
    time.sleep(1.0)
    monitor.stop()
    elapsed = time.monotonic() - start
    assert 1 <= len(calls) <= elapsed / 0.05 + 1
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert all(g > 0.01 for g in gaps)  # never back to back
    settled = len(calls)
    time.sleep(0.2)
    assert len(calls) == settled  # stopped means stopped


@pytest.mark.system
def test_stop_is_idempotent_and_a_dropped_monitor_stops_its_thread(sim_gpus) -> None:
    sim_gpus("a40")
    monitor = PowerMonitor(update_period=0.02, sampling="thread")
    monitor.stop()
    monitor.stop()
    before = {t for t in threading.enumerate() if t.name == "zeus-callbacks-power-monitor"}
    dropped = PowerMonitor(update_period=0.02, sampling="thread")
    (thread,) = {t for t in threading.enumerate() if t.name == "zeus-callbacks-power-monitor"} - before
    del dropped
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_gpu_that_is_lost_ends_its_timeline_and_the_others_go_on(sim_gpus) -> None:
    system = sim_gpus("2*a40", virtual_clock=True, faults="lost_after=25@1")
    monitor = PowerMonitor(update_period=0.1, background=False)
    for _ in range(40):
        system.run_step(0.1)
        monitor.poll()
    (lost,) = monitor.failed_gpus  # NVML index 1 is one of the two CUDA indices (identical boards)
    assert "lost" in monitor.failed_gpus[lost]
    timelines = monitor.get_power_timeline("device_instant")
    assert timelines[1 - lost][-1][0] > timelines[lost][-1][0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_indices": []}, "name at least one GPU"),
        ({"gpu_indices": [3]}, r"\[3\] not among the 1 visible"),
        ({"gpu_indices": "0"}, "expected a list of GPU indices"),
        ({"gpu_indices": [0, 0]}, "named twice"),
        ({"update_period": 0}, "greater than 0"),
        ({"update_period": "fast"}, "greater than 0"),
        ({"max_samples_per_gpu": 1}, "at least 2"),
        ({"power_domains": []}, "at least one domain"),
        ({"power_domains": "device_instant"}, "expected a list of power domains"),
        ({"power_domains": ["gpu"]}, "'gpu' is not a power domain"),
    ],
)
def test_bad_arguments_say_what_to_pass(sim_gpus, kwargs: dict, message: str) -> None:
    sim_gpus("a40", virtual_clock=True)
    with pytest.raises(InvalidInputError, match=message):
        PowerMonitor(**{"update_period": 0.05, "background": False, **kwargs})


def test_get_energy_refuses_times_out_of_order(sim_gpus) -> None:
    sim_gpus("a40", virtual_clock=True)
    monitor = PowerMonitor(update_period=0.05, background=False)
    with pytest.raises(InvalidInputError, match="end_time is before start_time"):
        monitor.get_energy(10.0, 5.0)
    assert monitor.get_energy(0.0, 1.0) == {0: 0.0}  # no reading in that window: nothing counted


# -- the sampling process (the default where another process reaches the GPUs) --------------------------
def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own child: reap it, else it lingers as a zombie that kill(0) still finds
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


@pytest.mark.system
def test_another_process_samples_the_power_of_the_work_this_process_runs(sim_gpus) -> None:
    """The child reads the node this process works on: GPU 0, given twice GPU 1's work, drew more energy
    than GPU 1, which drew more than idling, and no thread of this process samples."""
    sim_gpus("2*a40")
    gpus = get_gpus()
    monitor = PowerMonitor(update_period=0.05)
    assert monitor.sampling == "process"
    assert not any(t.name == "zeus-callbacks-power-monitor" for t in threading.enumerate())
    start = time.time()
    for _ in range(10):
        zeus_sim.enqueue_work(0, 0.1)
        zeus_sim.enqueue_work(1, 0.05)
        for g in gpus:
            g.synchronize()
    end = time.time()
    energy = monitor.get_energy(start, end)
    monitor.stop()
    idle_j = gpus[0].backend.gpu(gpus[0].device).spec.idle_power_w * (end - start)
    assert energy is not None and energy[0] > energy[1] > idle_j


@pytest.mark.system
def test_the_sampling_process_ends_with_the_monitor_when_dropped_and_when_its_parent_dies(
    sim_gpus, run_python
) -> None:
    sim_gpus("a40")
    monitor = PowerMonitor(update_period=0.05)
    pid = monitor._process.pid
    monitor.stop()
    monitor.stop()
    assert _gone(pid)
    assert monitor.get_power() is not None  # what was read stays
    dropped = PowerMonitor(update_period=0.05)
    pid = dropped._process.pid
    del dropped
    gc.collect()
    assert _gone(pid)
    # A parent killed hard (SIGKILL: no finalizer runs) closes the child's stdin, and the child exits.
    code = (
        "import os, signal, sys\n"
        "from zeus_callbacks import PowerMonitor\n"
        "m = PowerMonitor(update_period=0.05)\n"
        "print(m._process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = run_python(code)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert _gone(int(result.stdout.split()[0]))


@pytest.mark.system
def test_a_gpu_the_sampling_process_loses_ends_its_timeline(sim_gpus) -> None:
    """The child counts its own NVML calls: GPU 1 is lost after 40 of them, GPU 0 goes on."""
    sim_gpus("2*a40", faults="lost_after=40@1")
    monitor = PowerMonitor(update_period=0.02)
    deadline = time.monotonic() + 60
    while 1 not in monitor.failed_gpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "GPU 1" in monitor.failed_gpus[1]
    assert 0 not in monitor.failed_gpus
    monitor.stop()


@pytest.mark.system
def test_a_sampling_process_that_cannot_start_or_dies_leaves_a_thread_or_the_readings_so_far(
    sim_gpus, monkeypatch, caplog
) -> None:
    sim_gpus("a40")
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
        patch.setattr(sampling_process, "COMMAND", [sys.executable, "-c", "import sys; sys.exit(3)"])
        fallback = PowerMonitor(update_period=0.05)
    assert fallback.sampling == "thread"
    assert "ended (exit status 3); sampling in a thread of this process instead" in caplog.text
    fallback.stop()
    monitor = PowerMonitor(update_period=0.05)
    before = monitor.get_power_timeline("device_instant")[0]
    os.kill(monitor._process.pid, signal.SIGKILL)
    assert _gone(monitor._process.pid)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        after = monitor.get_power_timeline("device_instant")[0]
        monitor.get_power()
    assert after[: len(before)] == before
    assert caplog.text.count("the timelines end at its last readings") == 1
    monitor.stop()


def test_a_node_no_other_process_can_reach_is_sampled_in_a_thread(sim_gpus) -> None:
    for kept_in_memory in ({"virtual_clock": True}, {"state_dir": "", "export_env": False}):
        sim_gpus("a40", **kept_in_memory)
        monitor = PowerMonitor(update_period=0.05)
        assert monitor.sampling == "thread"
        monitor.stop()
    with pytest.raises(InvalidInputError, match="expected 'process'"):
        PowerMonitor(update_period=0.05, sampling="spawn")
