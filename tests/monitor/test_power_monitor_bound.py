"""PowerMonitor.get_energy_bound over a timeline of equal readings (virtual clock, deterministic)."""

from __future__ import annotations

from zeus_callbacks import PowerMonitor
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor.power_readings import PowerDomain


def test_a_run_of_equal_readings_is_not_taken_for_missing_ones(sim_gpus) -> None:
    """Steady steps read the same power every poll, and the timeline keeps only a run's first and last
    readings (`Series`). The bound counts the run as read (what the readings may miss is half their change:
    none), not as four seconds of missing readings, each worth anything up to the board's top power. Fails
    if the gap between a run's ends is taken for missing readings (the bound was then 516 J on a 2 s window
    of examples/zeus/monitors.py's steps, against 88 J)."""
    system = sim_gpus("a40", virtual_clock=True, ideal="energy_counter,power_window")
    gpu = get_gpus()[0]
    monitor = PowerMonitor(update_period=0.1, background=False)
    system.run_step(0.1)  # the first reading saw the idle GPU
    monitor.poll()
    start, counter_start = system.clock.now(), gpu.energy_mj()
    for _ in range(40):
        system.run_step(0.1)
        monitor.poll()
    end, counter_end = system.clock.now(), gpu.energy_mj()
    timeline = monitor.get_power_timeline("device_instant", start_time=start)[0]
    assert len(timeline) == 2  # one run: its ends
    truth = (counter_end - counter_start) / 1000
    energy, bound = monitor.get_energy(start, end)[0], monitor.get_energy_bound(start, end)[0]
    assert abs(energy - truth) <= bound
    held_w = monitor._bound(0, PowerDomain.DEVICE_INSTANT).held_error_w(timeline[0][1])
    assert bound < held_w * (end - start) / 2  # what four seconds of missing readings would add alone
