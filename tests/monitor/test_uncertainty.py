"""Issue 41: every window's GPU energy carries its bound, and on the simulator, whose truth is known, the true
energy lies within it (deterministic: virtual clock)."""

from __future__ import annotations

import logging
import random

import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.monitor.monitor import Measurement, ZeusMonitor
from zeus_callbacks.core.monitor.reporting import EnergyReporter, Rates
from zeus_callbacks.core.monitor.uncertainty import ABSOLUTE_ERROR_W, GAIN_ERROR, sensor_error_j

BOARDS = ["a40", "v100", "a10g", "t4", "a100", "h100", "h200", "nvidia-smi:H100NVLx2", "nvidia-smi:V100_x8"]
LENGTHS_S = [0.005, 0.02, 0.05, 0.1, 0.3, 1.0, 3.0, 10.0]
SENSOR = GAIN_ERROR / (1 - GAIN_ERROR)  # the gain's share of a reading


def _true_j(system: sim.SimulatedSystem) -> list[float]:
    return [g.true_energy_mj() / 1000 for g in system.gpus]


def _windows(system, monitor, length_s, count, rng, sample=False):
    """`count` windows of `length_s` of training steps (with the simulator's stalls and bursts), each begun
    at a random phase of the counters' refreshes; yields (measurement, true energy per GPU)."""
    for _ in range(count):
        if rng.random() < 0.3:
            system.clock.advance(rng.uniform(0.0, 0.3))  # idle
        else:
            system.run_step(rng.uniform(0.0, 0.2))
        before = _true_j(system)
        monitor.begin_window("w", sync_execution=False)
        left, last = length_s, system.clock.now()
        while left > 1e-12:
            left -= system.run_step(min(0.05, left))
            if sample and system.clock.now() - last >= 0.1 - 1e-9:
                monitor._sampler.sample()  # what its thread does every 100 ms, at chosen virtual instants
                last = system.clock.now()
        m = monitor.end_window("w", sync_execution=False)
        yield m, [after - b for after, b in zip(_true_j(system), before, strict=True)]


def _coverage(spec, length_s, count=30, **kw):
    """(share of windows whose true energy lies within the bound, median bound / true energy)."""
    sample = "no_energy_counter" in kw.get("faults", "")
    approx = kw.pop("approx", False)
    system = sim.simulate(spec, virtual_clock=True, bursts=True, noise=0.02, seed=1, **kw)
    monitor = ZeusMonitor(approx_instant_energy=approx, power_sample_interval_s=0.1)
    inside, shares = [], []
    for m, true in _windows(system, monitor, length_s, count, random.Random(7), sample=sample):
        for i, t in enumerate(true):
            bound = m.gpu_energy_bound.get(i)
            inside.append(bound is not None and abs(m.gpu_energy[i] - t) <= bound)
            if bound is not None:
                shares.append(bound / t)
    monitor.close()
    return sum(inside) / len(inside), sorted(shares)[len(shares) // 2]


def test_the_simulated_sensor_reads_the_truth_times_a_gain_of_its_own():
    """Each board's counter and power read the truth times a gain within 1 +/- 5%, fixed per board (seeded
    from its UUID); `sensor_gain` ideal reads the truth."""
    again = [g.sensor_gain for g in sim.simulate("nvidia-smi:V100_x8", virtual_clock=True).gpus]
    system = sim.simulate("nvidia-smi:V100_x8", virtual_clock=True, ideal="energy_counter")
    gains = [g.sensor_gain for g in system.gpus]
    assert all(1 - GAIN_ERROR <= g <= 1 + GAIN_ERROR for g in gains) and len(set(gains)) == len(gains)
    assert gains == again
    monitor = ZeusMonitor()
    before = _true_j(system)
    monitor.begin_window("w", sync_execution=False)
    system.run_step(10.0)
    m = monitor.end_window("w", sync_execution=False)
    for i, (t0, t1) in enumerate(zip(before, _true_j(system), strict=True)):
        assert m.gpu_energy[i] == pytest.approx((t1 - t0) * gains[i], abs=2e-3)
    ideal = sim.simulate("a40", virtual_clock=True, ideal="sensor_gain")
    assert ideal.gpus[0].sensor_gain == 1.0


def test_the_sensor_gain_is_bounded_by_its_published_error():
    """Source (a): with an always-current counter, the only error is the board's gain, and the bound is the
    gain's share of the reading (5.3% for +/- 5%), or nvidia-smi's +/- 5 W over the window where larger (idle)."""
    system = sim.simulate("a40,h100,t4", virtual_clock=True, ideal="energy_counter,device_order")
    monitor = ZeusMonitor()
    before = _true_j(system)
    monitor.begin_window("busy", sync_execution=False)
    system.run_step(10.0)
    busy = monitor.end_window("busy", sync_execution=False)
    shares = []
    for i, (t0, t1) in enumerate(zip(before, _true_j(system), strict=True)):
        error = abs(busy.gpu_energy[i] - (t1 - t0))
        bound = busy.gpu_energy_bound[i]
        assert error <= bound == pytest.approx(max(SENSOR * busy.gpu_energy[i], ABSOLUTE_ERROR_W * busy.time))
        shares.append(error / (t1 - t0))
    assert max(shares) > 0.01  # the gain is real: a reading is off by more than 1%
    monitor.begin_window("idle", sync_execution=False)
    system.clock.advance(10.0)
    idle = monitor.end_window("idle", sync_execution=False)
    assert idle.gpu_energy_bound[2] == pytest.approx(ABSOLUTE_ERROR_W * 10.0)  # the T4 idles at 10 W


def test_the_counters_refresh_counts_against_the_windows_length():
    """Source (b): each end's read may be stale by one refresh, so a window is off by at most one refresh's
    energy at the power around its ends: the bound beyond the sensor's share is that, shrinking with the
    window's length; a window shorter than a refresh assumes the board's top power (300 W on the A40)."""
    system = sim.simulate("a40", virtual_clock=True, ideal="sensor_gain")
    monitor = ZeusMonitor()
    refresh = system.gpus[0].energy_refresh_s
    shares = {}
    for length in (0.05, 1.0, 10.0):
        system.run_step(0.037)  # a phase of its own against the refresh
        monitor.begin_window("w", sync_execution=False)
        system.run_step(length)
        m = monitor.end_window("w", sync_execution=False)
        beyond = m.gpu_energy_bound[0] - sensor_error_j(m.gpu_energy[0], m.time)
        power = 300.0 if length < 2 * refresh else m.gpu_energy[0] / m.time
        assert beyond == pytest.approx(
            (1 + SENSOR) * max(power, monitor._bounds[0].peak_w) * refresh, rel=1e-6
        )
        shares[length] = m.gpu_energy_bound[0] / m.gpu_energy[0] if m.gpu_energy[0] else float("inf")
    assert shares[0.05] > shares[1.0] > shares[10.0]
    ideal = sim.simulate("a40", virtual_clock=True, ideal="sensor_gain,energy_counter")
    monitor = ZeusMonitor()
    monitor.begin_window("w", sync_execution=False)
    ideal.run_step(1.0)
    m = monitor.end_window("w", sync_execution=False)
    assert m.gpu_energy_bound[0] == pytest.approx(SENSOR * m.gpu_energy[0])  # no refresh: the sensor alone


def test_sampled_and_interpolated_windows_are_bounded_by_what_their_readings_miss():
    """Source (c): a GPU without a counter is integrated from sampled power, bounded by the change between
    readings, their lag and, where samples are missing, any power the board may draw; a window approximated by
    one instantaneous reading is bounded by the distance from it to nothing or to the top power."""
    system = sim.simulate("2*a40", virtual_clock=True, faults="no_energy_counter@1", ideal="sensor_gain")
    monitor = ZeusMonitor(power_sample_interval_s=0.1)
    system.run_step(1.0)
    sampled, missing = [], []
    for every in (True, False):
        before = _true_j(system)
        monitor.begin_window("w", sync_execution=False)
        for _ in range(20):
            system.run_step(0.05)
            system.clock.advance(0.05)
            if every:
                monitor._sampler.sample()  # the thread's samples, at chosen virtual instants
        m = monitor.end_window("w", sync_execution=False)
        true = _true_j(system)[1] - before[1]
        (sampled if every else missing).append((m.gpu_energy[1], m.gpu_energy_bound[1], true))
    (e, bound, true), (e_missing, bound_missing, true_missing) = sampled[0], missing[0]
    assert abs(e - true) <= bound < 0.5 * true  # sampled every 100 ms: a bound well below the energy
    assert abs(e_missing - true_missing) <= bound_missing and bound_missing > 3 * bound  # no sample for 2 s
    approx = sim.simulate("a100", virtual_clock=True, ideal="sensor_gain")
    monitor = ZeusMonitor(approx_instant_energy=True)
    approx.run_step(1.0)
    for _ in range(20):
        before = _true_j(approx)[0]
        monitor.begin_window("w", sync_execution=False)
        approx.run_step(0.02)
        m = monitor.end_window("w", sync_execution=False)
        true = _true_j(approx)[0] - before
        assert abs(m.gpu_energy[0] - true) <= m.gpu_energy_bound[0]
        assert m.gpu_energy_bound[0] < 400.0 * 0.1  # below what the counter's own figure would be bounded by


@pytest.mark.parametrize("spec", BOARDS)
def test_the_true_energy_lies_within_the_bound_on_every_board_and_window_length(spec, caplog):
    """The done-when: in at least 95% of windows, on every board and window length from 5 ms to 10 s. And the
    bound is not vacuous: below 20% of the energy for windows of 1 s and longer (the sensor's 5.3% and, on a
    100 ms counter, one refresh at the window's power: 10% of a 1 s window, then less), below 12% from 3 s."""
    caplog.set_level(logging.ERROR, logger="zeus_callbacks")  # short windows warn once per GPU
    for length in LENGTHS_S:
        covered, share = _coverage(spec, length, count=30 if length < 3 else 12)
        assert covered >= 0.95, (spec, length, covered)
        if length >= 1.0:
            assert share < (0.20 if length < 3 else 0.12), (spec, length, share)


@pytest.mark.parametrize("spec", ["a40", "h100", "nvidia-smi:V100_x8"])
def test_sampled_and_approximated_windows_cover_the_truth_too(spec, caplog):
    """The same 95% for windows of GPUs without a counter (sampled every 100 ms) and for short windows
    approximated by instantaneous power."""
    caplog.set_level(logging.ERROR, logger="zeus_callbacks")
    for length in (0.02, 0.3, 1.0, 10.0):
        covered, _ = _coverage(spec, length, count=20 if length < 3 else 6, faults="no_energy_counter")
        assert covered >= 0.95, ("sampled", spec, length, covered)
    for length in (0.005, 0.02, 0.05):
        covered, _ = _coverage(spec, length, count=30, approx=True)
        assert covered >= 0.95, ("approximated", spec, length, covered)


def test_the_bound_reaches_the_measurement_the_metrics_and_the_ledger(tmp_path):
    """`Measurement.total_energy_bound` sums the GPUs' (None where one is unknown); the reporter's metrics
    carry `interval_j_bound` and `total_j_bound`; the ledger line carries `energy_bound_j`."""
    assert Measurement(1.0, {0: 10.0, 1: 5.0}, gpu_energy_bound={0: 1.0, 1: 0.5}).total_energy_bound == 1.5
    assert Measurement(1.0, {0: 10.0, 1: 5.0}, gpu_energy_bound={0: 1.0}).total_energy_bound is None
    system = sim.simulate("2*a40", virtual_clock=True)
    ledger = tmp_path / "ledger.jsonl"
    reporter = EnergyReporter(ZeusMonitor(), rates=Rates(), ledger_path=ledger)
    reporter.start()
    system.run_step(2.0)
    interval = reporter.interval()
    system.run_step(2.0)
    total = reporter.stop()
    assert 0 < interval["energy/interval_j_bound"] < 0.2 * interval["energy/interval_j"]
    assert 0 < total["energy/total_j_bound"] < 0.2 * total["energy/total_j"]
    assert str(round(total["energy/total_j_bound"], 3))[:5] in ledger.read_text()
