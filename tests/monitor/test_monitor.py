"""ZeusMonitor on simulated GPUs: windows, errors, the CSV log, and energy/time against the traces."""

from __future__ import annotations

import csv
import time

import pytest

from zeus_callbacks import Measurement, ReplayZeusMonitor, ZeusMonitor, sim
from zeus_callbacks.core.device.errors import GPULostError
from zeus_callbacks.sim import load_trace


def test_nested_and_overlapping_windows(sim_gpus):
    # No time passes between two calls on the virtual clock: sums are exact. Each window spans at least one
    # refresh of the 100 ms energy counter.
    system = sim_gpus("2*a40", virtual_clock=True)
    monitor = ZeusMonitor()
    # a = [0, 2], b = [1, 3], c = [0, 3], d = [1, 2]: counters make a + b = c + d.
    monitor.begin_window("a")
    monitor.begin_window("c")
    system.run_step(0.15)
    monitor.begin_window("b")
    monitor.begin_window("d")
    assert monitor.open_windows == ["a", "c", "b", "d"]
    system.run_step(0.15)
    d = monitor.end_window("d")
    a = monitor.end_window("a")
    system.run_step(0.15)
    b = monitor.end_window("b")
    c = monitor.end_window("c")
    assert monitor.open_windows == []
    assert c.time >= a.time >= d.time > 0 and c.time >= b.time >= d.time
    assert a.time + b.time == pytest.approx(c.time + d.time)
    for i in (0, 1):
        assert c.gpu_energy[i] >= a.gpu_energy[i] >= d.gpu_energy[i] > 0
        assert a.gpu_energy[i] + b.gpu_energy[i] == pytest.approx(c.gpu_energy[i] + d.gpu_energy[i])
    assert c.total_energy == pytest.approx(sum(c.gpu_energy.values()))


@pytest.mark.system
def test_window_errors_and_cancel(sim_gpus):
    sim_gpus("a40")
    monitor = ZeusMonitor()
    monitor.begin_window("step")
    # Zeus's words ('already exists', 'does not exist': its tests match them) beside ours.
    with pytest.raises(ValueError, match="'step' already exists: it is already open"):
        monitor.begin_window("step")
    with pytest.raises(ValueError, match=r"'epoch' does not exist: it was not begun \(open: \['step'\]\)"):
        monitor.end_window("epoch")
    m = monitor.end_window("step", cancel=True)
    assert (m.time, m.gpu_energy, m.total_energy) == (0.0, {0: 0.0}, 0.0)
    assert m.simulated
    with pytest.raises(ValueError, match="was not begun"):
        monitor.end_window("step")
    monitor.begin_window("step")  # a cancelled window can be begun again
    assert monitor.end_window("step").time > 0


def test_a_lost_gpu_leaves_the_others_measured(sim_gpus, tmp_path, caplog):
    """Issue 24: with GPU 1 of two lost after 40 NVML calls, every window still measures GPU 0; GPU 1 is
    said once, named alone, and missing from `gpu_energy` (not 0 J), in the log too."""
    system = sim_gpus("2*a40", virtual_clock=True, faults="lost_after=40@1", ideal="sensor_gain")
    log = tmp_path / "log.csv"
    monitor = ZeusMonitor(log_file=log)
    ms = []
    with caplog.at_level("WARNING", logger="zeus_callbacks"):
        for _ in range(100):
            monitor.begin_window("step")
            system.run_step(0.1)
            ms.append(monitor.end_window("step"))
    assert set(ms[0].gpu_energy) == {0, 1}
    after = [m for m in ms if set(m.gpu_energy) == {0}]
    assert len(after) > 50 and set(ms[-1].gpu_energy) == {0}  # lost once, for good
    assert all(m.gpu_energy[0] == pytest.approx(23.52, rel=0.01) for m in ms[1:])  # the first: a refresh
    assert set(monitor.lost_gpus) == {1}
    said = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert len(said) == 1 and "GPU 1 (" in said[0] and "GPU 0" not in said[0]
    rows = list(csv.DictReader(log.open()))
    assert rows[0]["gpu1_energy"] and rows[-1]["gpu1_energy"] == "" and float(rows[-1]["gpu0_energy"]) > 0
    replay = ReplayZeusMonitor(log_file=log)  # the empty cell replays as a missing GPU, not 0 J
    replayed = []
    for _ in rows:
        replay.begin_window("step")
        replayed.append(replay.end_window("step").gpu_energy)
    assert replayed == [m.gpu_energy for m in ms]
    # A window open when the GPU was lost keeps GPU 0's energy over the whole window.
    system = sim_gpus("2*a40", virtual_clock=True, faults="lost_after=30@1", ideal="sensor_gain")
    monitor = ZeusMonitor()
    monitor.begin_window("long")
    while not monitor.lost_gpus:
        monitor.begin_window("step")
        system.run_step(0.1)
        monitor.end_window("step")
    long = monitor.end_window("long")
    assert set(long.gpu_energy) == {0} and long.gpu_energy[0] == pytest.approx(
        23.5 * long.time / 0.1, rel=0.05
    )
    # Every GPU lost: nothing is left to measure, and the error says so.
    system = sim_gpus("a40", virtual_clock=True, faults="lost_after=20")
    monitor = ZeusMonitor()
    with pytest.raises(GPULostError, match="no monitored GPU answers"):
        for _ in range(20):
            monitor.begin_window("step")
            system.run_step(0.1)
            monitor.end_window("step")


@pytest.mark.system
def test_constructor_errors(sim_gpus):
    sim_gpus("2*a40")
    with pytest.raises(
        ValueError, match=r"`ZeusMonitor\(gpu_indices=\[0, 2\]\)`: \[2\] not among the 2 visible"
    ):
        ZeusMonitor(gpu_indices=[0, 2])
    with pytest.raises(ValueError, match="sync_execution_with='jax'"):
        ZeusMonitor(sync_execution_with="jax")


@pytest.mark.system
def test_subset_of_gpus(sim_gpus):
    sim_gpus("4*a40")
    monitor = ZeusMonitor(gpu_indices=[3, 1])
    monitor.begin_window("w")
    m = monitor.end_window("w")
    assert list(m.gpu_energy) == [3, 1]
    assert isinstance(m, Measurement) and m.simulated and m.cpu_energy is None and m.dram_energy is None


@pytest.mark.system
def test_csv_log_in_zeus_format(sim_gpus, tmp_path, burn_cpu):
    # The file's format is under test, with 30 ms windows: an exact counter keeps every row non-zero so the
    # log loads as a trace (a refreshed counter reads 0 J in such windows).
    sim_gpus("2*a40", ideal="energy_counter")
    log = tmp_path / "logs" / "energy.csv"
    monitor = ZeusMonitor(log_file=log)
    results = {}
    for pl in (300, 200):
        key = f"__GlobalPowerLimitOptimizer_{pl}"
        for g in monitor.gpus:
            g.set_power_limit_mw(pl * 1000)
        monitor.begin_window(key)
        burn_cpu(0.03)
        results[key] = monitor.end_window(key)
    monitor.begin_window("cancelled")
    monitor.end_window("cancelled", cancel=True)
    monitor.close()
    lines = log.read_text().splitlines()
    assert lines[0] == "start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy"
    rows = list(csv.DictReader(lines))
    assert [r["window_name"] for r in rows] == list(results)
    for r in rows:
        m = results[r["window_name"]]
        assert float(r["elapsed_time"]) == m.time
        assert float(r["gpu0_energy"]) == m.gpu_energy[0] and float(r["gpu1_energy"]) == m.gpu_energy[1]
        assert abs(float(r["start_time"]) - time.time()) < 60
    # The log is what Zeus's power-limit optimizer writes, so it is a trace the simulator can load.
    assert list(load_trace(log, gpu_model="a40").power_limits_w) == [200.0, 300.0]


def _window_at(monitor: ZeusMonitor, power_limit_w: int, burn_cpu, sim_sleeps: list[float]):
    """(time, energy of GPU 0, measurement) of 1 s of work, without the wall time that other processes took
    from this one on a shared CPU or that a late wake-up added (and the idle energy drawn meanwhile).

    The energy counter moves only every 100 ms, so a reading lags by up to that: the window starts and ends
    with 0.15 s of idle GPU, so that the lag shifts it within idle time and every joule of the work counts."""
    for g in monitor.gpus:
        g.set_power_limit_mw(power_limit_w * 1000)
    monitor.sync()
    time.sleep(0.15)
    monitor.begin_window("w")
    cpu0 = time.process_time()
    sim_sleeps.clear()
    burn_cpu(1.0)
    monitor.sync()
    time.sleep(0.15)
    m = monitor.end_window("w")
    cpu = time.process_time() - cpu0
    # On an idle host the window lasts this process's CPU time plus the GPU's catch-up (plus the idle tail);
    # the rest is not the simulated GPU's work: count it as idle.
    lost = max(0.0, m.time - cpu - sum(sim_sleeps))
    idle_w = sim.simulated_gpu(monitor.gpus[0]).spec.idle_power_w
    return m.time - lost, m.gpu_energy[0] - idle_w * lost, m


@pytest.mark.system
def test_energy_and_time_follow_the_trace(sim_gpus, burn_cpu, sim_sleeps):
    system = sim_gpus("a40:imagenet/resnet50/256")
    tr = system.gpus[0].trace
    monitor = ZeusMonitor()
    t_hi, e_hi, m_hi = _window_at(monitor, 300, burn_cpu, sim_sleeps)
    t_lo, e_lo, m_lo = _window_at(monitor, 100, burn_cpu, sim_sleeps)
    assert m_hi.simulated and m_lo.simulated
    # Outcomes only, on the real clock: 100 W is slower (2.76x) and uses more energy (1.42x), by the trace's
    # order of magnitude; the exact figures are test_virtual_clock_windows_are_exact's.
    assert t_lo > t_hi and e_lo > e_hi
    assert tr.relative_time(100) / 3 < t_lo / t_hi < 3 * tr.relative_time(100)
    assert tr.power(300) / 10 < e_hi < 10 * tr.power(300)  # about 1 s of work at the maximum limit
    # The valley: 200 W uses less energy than either end for the same work.
    t_mid, e_mid, _ = _window_at(monitor, 200, burn_cpu, sim_sleeps)
    assert e_mid < e_hi and e_mid < e_lo


def test_virtual_clock_windows_are_exact(sim_gpus):
    # Exactness of the virtual clock's accounting is under test: a refreshed counter is off by up to a period.
    system = sim_gpus("2*a40", virtual_clock=True, ideal="energy_counter,sensor_gain")
    tr = system.gpus[0].trace
    monitor = ZeusMonitor()
    assert monitor.gpus.virtual_clock
    monitor.gpus[1].set_power_limit_mw(150_000)
    monitor.begin_window("step")
    system.run_step(1.0)
    m = monitor.end_window("step")
    rel = tr.relative_time(150)
    assert m.time == pytest.approx(rel)
    idle = system.gpus[0].spec.idle_power_w
    assert m.gpu_energy[0] == pytest.approx(tr.power(300) + (rel - 1) * idle, abs=2e-3)
    assert m.gpu_energy[1] == pytest.approx(rel * tr.power(150), abs=2e-3)


def test_power_sampling_fallback_integrates_sensibly(sim_gpus):
    # On the virtual clock time moves only in steps, so wherever the samples fall the integral is exact.
    # GPU 0's counter is the reference the sampled GPU 1 is compared with: keep it exact, and GPU 1's power
    # reading the draw of the last interval (not the driver's update period and window).
    system = sim_gpus(
        "2*a40",
        faults="no_energy_counter@1",
        virtual_clock=True,
        ideal="energy_counter,power_window,sensor_gain",
    )
    system.run_step(0.05)  # GPU 1's last interval is busy when sampling starts
    monitor = ZeusMonitor(power_sample_interval_s=0.005)
    try:
        monitor.begin_window("busy")
        for _ in range(10):
            system.run_step(0.02)
        busy = monitor.end_window("busy")
        system.run_step({0: 0.05, 1: 0.0})  # only GPU 0 works: GPU 1 idles
        monitor.begin_window("idle")
        for _ in range(10):
            system.run_step({0: 0.02, 1: 0.0})
        idle = monitor.end_window("idle")
    finally:
        monitor.close()
    # GPU 0 has the counter, GPU 1 (same work) is sampled: they agree.
    assert busy.gpu_energy[1] == pytest.approx(busy.gpu_energy[0], abs=2e-3)  # the counter counts whole mJ
    assert idle.gpu_energy[1] == pytest.approx(system.gpus[1].spec.idle_power_w * idle.time)
    assert busy.gpu_energy[1] > 2 * idle.gpu_energy[1]


@pytest.mark.system
def test_power_sampling_of_a_slowed_gpu(sim_gpus, sim_sleeps):
    system = sim_gpus("a40", faults="no_energy_counter")
    monitor = ZeusMonitor(power_sample_interval_s=0.005)
    try:
        monitor.gpus[0].set_power_limit_mw(100_000)
        monitor.begin_window("w")
        sim_sleeps.clear()
        # Kernels: the host only waits for them, so its load changes nothing on the node's clock. Over a
        # second at 100 W: the wait lasts that less the host's lag (at most 0.5 s, sim/host.py's `HostClock`)
        # on the wall clock, time enough for the sampling thread to read the busy GPU on a loaded host too.
        sim.enqueue_work(0, 0.5)
        m = monitor.end_window("w")
    finally:
        monitor.close()
    tr = system.gpus[0].trace
    busy_s = 0.5 * tr.relative_time(100)
    # The host waited for the slowed kernels (less the CPU time it spent meanwhile): their order of magnitude.
    assert busy_s / 2 < sum(sim_sleeps) < 2 * busy_s
    # While the host waits for the slow GPU, the GPU is busy at its traced power, and sampling sees it: more
    # than idle power over the window, less than the draw at the maximum limit (the exact integral of the
    # samples is test_power_sampling_fallback_integrates_sensibly's, on the virtual clock).
    assert system.gpus[0].spec.idle_power_w * m.time < m.gpu_energy[0] < tr.power(300) * m.time


@pytest.mark.system
def test_refresh_period_is_measured_once_per_gpu(sim_gpus):
    from zeus_callbacks.core.device.power import energy_refresh_period_s

    sim_gpus("a40,v100")  # counters refresh every 100 ms (A40) and 20 ms (V100)
    monitor = ZeusMonitor()
    periods = {g.name: energy_refresh_period_s(g) for g in monitor.gpus}
    # Polled on the real clock (a late wake-up lengthens it): the order of magnitude only, then the cache.
    assert 0.01 < periods["NVIDIA A40"] < 1.0
    assert 0.002 < periods["Tesla V100-PCIE-32GB"] < 0.2
    assert {g.name: energy_refresh_period_s(g) for g in monitor.gpus} == periods


@pytest.mark.system
def test_short_windows_warn_once_per_gpu(sim_gpus, burn_cpu, caplog):
    sim_gpus("a40")
    monitor = ZeusMonitor()
    with caplog.at_level("WARNING", logger="zeus_callbacks.core.monitor.monitor"):
        readings = []
        for _ in range(6):
            monitor.begin_window("step")
            burn_cpu(0.01)
            readings.append(monitor.end_window("step").gpu_energy[0])
    warnings = [r for r in caplog.records if "shorter than" in r.getMessage()]
    assert len(warnings) == 1 and "approx_instant_energy=True" in warnings[0].getMessage()
    # A 10 ms window on a 100 ms counter mostly falls between two refreshes.
    assert readings.count(0.0) >= 2


@pytest.mark.system
def test_approx_instant_energy_measures_short_windows(sim_gpus, burn_cpu):
    system = sim_gpus("a40:imagenet/resnet50/256")
    monitor = ZeusMonitor(approx_instant_energy=True)
    monitor.begin_window("warm")
    burn_cpu(0.3)  # the GPU draws its working power before the short windows
    monitor.end_window("warm")
    busy_w, idle_w = system.gpus[0].trace.power(300), system.gpus[0].spec.idle_power_w
    ratios = []
    for _ in range(5):
        monitor.begin_window("step")
        cpu0 = time.process_time()
        wall = burn_cpu(0.02)
        cpu = time.process_time() - cpu0
        m = monitor.end_window("step")
        # Wall time other processes took from this one is idle time for the simulated GPU.
        ratios.append(m.gpu_energy[0] / (busy_w * cpu + idle_w * max(0.0, wall - cpu)))
    # Instantaneous power x time, not 0 J nor a whole 100 ms refresh (5x a 20 ms window's): the median
    # within a factor of 3 of the traced power x time.
    assert 1 / 3 < sorted(ratios)[2] < 3
