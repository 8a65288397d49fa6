"""The energy figures beside the monitor's windows: logging intervals never read above what the boards can draw
(issue 37), and every other energy figure carries its bound (issue 41): the Prometheus counters, the endpoint,
`PowerMonitor.get_energy` and the per-GPU interval metrics. Deterministic: virtual clock; where the
simulator's truth is known, the true energy is checked to lie within the bound."""

from __future__ import annotations

import random

import pytest

from zeus_callbacks import PowerMonitor, sim
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.reporting import MERGE_REFRESHES, EnergyReporter, Rates


def _true_j(system: sim.SimulatedSystem) -> list[float]:
    """Each GPU's true energy so far (J), in the simulator's order (NVML's: single-GPU nodes here)."""
    return [g.true_energy_mj() / 1000 for g in system.gpus]


def _true_by_uuid(system: sim.SimulatedSystem) -> dict[str, float]:
    return {g.uuid: g.true_energy_mj() / 1000 for g in system.gpus}


def test_no_logging_interval_reads_above_what_the_board_can_draw():
    """Fails if a logging interval shorter than the energy counter's refresh is reported on its own: on a
    simulated A40 (300 W at most) at the default 100 ms counter refresh, 30 ms intervals read 0 J, then a
    whole refresh: 816 W."""
    system = sim.simulate("a40", virtual_clock=True, ideal="sensor_gain", seed=1)
    monitor = ZeusMonitor([0])
    top_w = monitor.gpus[0].power_limit_constraints_mw()[1] / 1000
    reporter = EnergyReporter(monitor, rates=Rates())
    reporter.start()
    reported, unreported_s = [], 0.0
    for length_s in [0.03, 0.005, 0.03, 0.03, 0.15, 0.01, 0.03, 0.5, 0.03, 0.07] * 5:
        unreported_s += system.run_step(length_s)
        out = reporter.interval()
        if out:
            reported.append(out)
            unreported_s = 0.0
    total = reporter.stop()

    p = "energy/"
    powers = [o[f"{p}interval_avg_power_w"] for o in reported]
    assert top_w == 300 and len(reported) >= 8 and max(powers) <= top_w  # merged, never above the board
    assert all(o[f"{p}interval_j"] > 0 and o[f"{p}interval_time_s"] >= 0.2 for o in reported)
    # Merged, not lost: the reported intervals and the unreported tail make up the run.
    assert sum(o[f"{p}interval_time_s"] for o in reported) + unreported_s == pytest.approx(
        total[f"{p}total_time_s"]
    )
    assert sum(o[f"{p}interval_j"] for o in reported) <= total[f"{p}total_j"]
    # The per-GPU figure carries its bound too (one GPU: the interval's).
    assert all(o[f"{p}gpu0_interval_j_bound"] == o[f"{p}interval_j_bound"] > 0 for o in reported)


def test_an_interval_above_the_board_is_merged_only_so_long():
    """A board whose sensor reads high (a gain above 1) reads above its top power however long the interval:
    after `MERGE_REFRESHES` refreshes the figure is reported, since it is the sensor's, not the counter's."""
    system = sim.simulate("a40", virtual_clock=True, ideal="sensor_gain", seed=1)
    monitor = ZeusMonitor([0])
    monitor.energy_bound(0).top_w = 10.0  # a "board" that can draw 10 W: every interval reads above it
    reporter = EnergyReporter(monitor, rates=Rates())
    reporter.start()
    seen = []
    for _ in range(3 * MERGE_REFRESHES):
        system.run_step(0.1)
        out = reporter.interval()
        if out:
            seen.append(out["energy/interval_time_s"])
    reporter.stop()
    refresh = monitor.energy_bound(0).refresh_s
    assert seen and all(t >= MERGE_REFRESHES * refresh - 1e-9 for t in seen)


def _phases(system: sim.SimulatedSystem, rng: random.Random, every_s: float, length_s: float, poll) -> None:
    """Training steps (with the simulator's stalls and bursts, which may lengthen them) and idle stretches for
    about `length_s`, `poll()` called every `every_s` of virtual time (as a sampler thread would)."""
    end, next_poll = system.clock.now() + length_s, system.clock.now() + every_s
    while end - system.clock.now() > 1e-9:
        step = min(rng.uniform(0.005, 0.08), end - system.clock.now(), next_poll - system.clock.now())
        if step > 1e-9 and rng.random() < 0.2:
            system.clock.advance(step)  # idle
        elif step > 1e-9:
            system.run_step(step)
        if system.clock.now() >= next_poll - 1e-9:
            poll()
            while next_poll <= system.clock.now() + 1e-9:
                next_poll += every_s


@pytest.mark.parametrize("spec", ["a40", "a100", "v100", "h100"])
def test_power_monitor_energy_carries_a_bound_the_truth_lies_in(spec):
    """Fails if `PowerMonitor.get_energy` has no bound, or the true energy lies outside it, over windows of
    0.05-10 s begun at random phases of the readings, on four generations' sensors (device_instant; the A40's
    1-second device_average too)."""
    rng = random.Random(3)
    system = sim.simulate(spec, virtual_clock=True, bursts=True, noise=0.02, seed=2)
    domains = [["device_instant"], ["device_average"]] if spec == "a40" else [["device_instant"]]
    for domain in domains:
        monitor = PowerMonitor([0], update_period=0.05, power_domains=domain, background=False)
        shares = []
        for length_s in (0.05, 0.3, 1.0, 3.0, 10.0):
            for _ in range(6):
                _phases(system, rng, 0.05, rng.uniform(0.0, 0.5), monitor.poll)
                start, before = system.clock.now(), _true_j(system)[0]
                _phases(system, rng, 0.05, length_s, monitor.poll)
                end, true_j = system.clock.now(), _true_j(system)[0] - before
                energy_j, bound_j = monitor.get_energy(start, end)[0], monitor.get_energy_bound(start, end)[0]
                assert abs(energy_j - true_j) <= bound_j, (domain, length_s, energy_j, true_j, bound_j)
                if length_s == 10.0:
                    shares.append(bound_j / true_j)
        assert max(shares) < 0.5, (domain, shares)  # not vacuous
        monitor.stop()
    assert PowerMonitor([0], update_period=0.05, background=False).get_energy_bound(0.0, 1.0) is not None


def test_the_cumulative_counter_carries_the_bound_of_what_it_counted(monkeypatch):
    """Fails if `EnergyCumulativeCounter` pushes no bound beside its GPU counter, or if the true energy since
    the window began lies outside it."""
    prometheus_client = pytest.importorskip("prometheus_client")
    monkeypatch.setattr(prometheus_client, "pushadd_to_gateway", lambda *a, **k: None)  # no Pushgateway
    from zeus_callbacks.core.observability.metric import EnergyCumulativeCounter

    system = sim.simulate("a40", virtual_clock=True, bursts=True, noise=0.02, seed=2)
    counter = EnergyCumulativeCounter([], [0], update_period=1e6, pushgateway_url="http://gw", job="t")
    counter.begin_window("train")
    start_j, rng, labels = _true_j(system)[0], random.Random(5), {"window": "train", "index": "0"}
    for _ in range(12):
        _phases(system, rng, 1e6, rng.uniform(0.2, 2.0), lambda: None)
        counter._count("train")  # what its thread does every update_period, at chosen virtual instants
        counted = counter.registry.get_sample_value("energy_monitor_gpu_energy_joules_total", labels)
        bound = counter.registry.get_sample_value("energy_monitor_gpu_energy_counter_bound_joules", labels)
        true_j = _true_j(system)[0] - start_j
        assert bound is not None and abs(counted - true_j) <= bound < 0.3 * true_j, (counted, true_j, bound)
    counter.end_window("train")


def test_the_endpoint_exports_the_bound_of_its_energy_counter(monkeypatch):
    """Fails if the endpoint exports no bound of its energy counter, or if between two scrapes the counter's
    increase lies further from the true energy than the bound's increase says."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from zeus_callbacks.core.observability.endpoint import serve_metrics

    monkeypatch.setenv("ZEUS_CALLBACKS_JOB", "t")
    system = sim.simulate("a40,v100", virtual_clock=True, bursts=True, noise=0.02, seed=4)
    rng = random.Random(9)

    def scrape(url: str) -> dict[tuple[str, str], float]:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return {
            (s.name, s.labels["uuid"]): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("zeus_callbacks_gpu_energy")
        }

    with serve_metrics(port=0, addr="127.0.0.1", cache_s=0) as server:
        last, last_true = scrape(server.url), _true_by_uuid(system)
        for _ in range(10):
            _phases(system, rng, 1e6, rng.uniform(0.05, 3.0), lambda: None)
            now, true = scrape(server.url), _true_by_uuid(system)
            for gpu in true:
                energy = (
                    now["zeus_callbacks_gpu_energy_joules_total", gpu]
                    - last["zeus_callbacks_gpu_energy_joules_total", gpu]
                )
                bound = (
                    now["zeus_callbacks_gpu_energy_bound_joules_total", gpu]
                    - last["zeus_callbacks_gpu_energy_bound_joules_total", gpu]
                )
                true_j = true[gpu] - last_true[gpu]
                assert abs(energy - true_j) <= bound, (gpu, energy, true_j, bound)
            last, last_true = now, true
