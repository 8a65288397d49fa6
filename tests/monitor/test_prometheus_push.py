"""Zeus's `zeus.metric` classes (`EnergyHistogram`, `EnergyCumulativeCounter`, `PowerGauge`) pushed to a real
Pushgateway on simulated GPUs: Zeus's metric names and labels, values against the monitor's own, Zeus's
example with only the import changed; and, without a gateway, their errors."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_servers import Pushgateway, free_port, needs_pushgateway

from zeus_callbacks import EnergyCumulativeCounter, EnergyHistogram, PowerGauge, ZeusMonitor
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.power import instant_power_mw

pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gateway(tmp_path):
    gw = Pushgateway(tmp_path / "pushgateway")
    yield gw
    gw.stop()


def ours(samples, name: str, **labels) -> dict[tuple[str, str], float]:
    """`name`'s samples matching `labels`, by (window, index)."""
    return {
        (s.labels["window"], s.labels["index"]): s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    }


@pytest.mark.slow
@needs_pushgateway
def test_histogram_counter_and_gauge_share_one_job_with_zeus_names(sim_gpus, gateway):
    """Virtual clock: the counters stand still between steps, so each pushed figure is exactly the monitor's."""
    system = sim_gpus("2*a40", virtual_clock=True)
    monitor = ZeusMonitor()
    histogram = EnergyHistogram(cpu_indices=[], gpu_indices=[0, 1], pushgateway_url=gateway.url, job="train")
    counter = EnergyCumulativeCounter(
        cpu_indices=[], gpu_indices=[0, 1], update_period=0.05, pushgateway_url=gateway.url, job="train"
    )
    gauge = PowerGauge(gpu_indices=[1], update_period=0.05, prometheus_url=gateway.url, job="train")
    monitor.begin_window("all")
    counter.begin_window("run")
    gauge.begin_window("run")
    steps = []
    for _ in range(3):
        monitor.begin_window("step")
        histogram.begin_window("step")
        system.run_step(0.5)
        histogram.end_window("step")
        steps.append(monitor.end_window("step"))
        time.sleep(0.1)  # the counter's and gauge's threads push in between
    time.sleep(0.3)  # the power timeline samples the GPUs' last state
    counter.end_window("run")
    gauge.end_window("run")
    run = monitor.end_window("all")

    samples = gateway.samples()
    job = {"job": "train", "simulated": "true"}  # simulated GPUs: pushed in the group simulated="true"
    sums = ours(samples, "energy_monitor_gpu_energy_joules_sum", **job)
    counts = ours(samples, "energy_monitor_gpu_energy_joules_count", **job)
    for i in (0, 1):
        assert sums["step", str(i)] == pytest.approx(sum(m.gpu_energy[i] for m in steps), abs=1e-6)
        assert counts["step", str(i)] == 3
    buckets = [s for s in samples if s.name == "energy_monitor_gpu_energy_joules_bucket"]
    assert {float(s.labels["le"]) for s in buckets} == {50, 100, 200, 500, 1000, float("inf")}
    totals = ours(samples, "energy_monitor_gpu_energy_joules_total", **job)
    assert set(totals) == {("run", "0"), ("run", "1")}
    for i in (0, 1):  # the last partial period is counted too
        assert totals["run", str(i)] == pytest.approx(run.gpu_energy[i], abs=1e-6)
    power = ours(samples, "power_monitor_gpu_power_watts", **job)
    assert power == {("run", "1"): pytest.approx(instant_power_mw(monitor.gpus[1]) / 1000)}
    assert not [s for s in samples if s.name.startswith("energy_monitor_cpu") or "dram" in s.name]


@pytest.mark.slow
@needs_pushgateway
def test_zeus_example_runs_with_only_the_import_changed(tmp_path, gateway, sim_gpus):
    sim_gpus("a40")  # a real-clock node, exported to the child
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/zeus/prometheus_metrics.py"),
            "--epochs=2",
            "--steps_per_epoch=5",
            f"--pushgateway={gateway.url}",
            "--update_period=0.2",
            "--linger=0.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Epoch 1 done." in out.stdout
    samples = gateway.samples()
    counts = ours(samples, "energy_monitor_gpu_energy_joules_count", job="training_energy_histogram")
    assert counts == {("training_energy", "0"): 2}
    total = ours(samples, "energy_monitor_gpu_energy_joules_total", job="training_energy_counter")
    assert total[("epoch_energy", "0")] > 0
    power = ours(samples, "power_monitor_gpu_power_watts", job="training_power_gauge", simulated="true")
    assert power[("epoch_power", "0")] > 0


def test_a_gateway_that_does_not_answer_is_logged_not_raised(sim_gpus, caplog):
    system = sim_gpus("a40", virtual_clock=True)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    histogram = EnergyHistogram(cpu_indices=[], gpu_indices=[0], pushgateway_url=url, job="j")
    with caplog.at_level(logging.WARNING, logger="zeus_callbacks"):
        for _ in range(3):
            histogram.begin_window("step")
            system.run_step(0.2)
            histogram.end_window("step")
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and url in failed[0].getMessage()  # said once, not at every push
    outside = [r for r in caplog.records if "outside the buckets" in r.getMessage()]
    assert len(outside) == 1  # ~47 J under the lowest bucket (50 J): said once per window and GPU


@pytest.mark.system
def test_bad_arguments_say_what_to_pass(sim_gpus):
    sim_gpus("a40")
    url = "http://localhost:9091"
    with pytest.raises(InvalidInputError, match="bucket range cannot be empty"):
        EnergyHistogram([], [0], url, "j", gpu_bucket_range=[])
    with pytest.raises(InvalidInputError, match="expected the Pushgateway's URL"):
        EnergyHistogram([], [0], job="j")
    with pytest.raises(InvalidInputError, match="give the Pushgateway's URL once"):
        EnergyHistogram([], [0], url, "j", prometheus_url="http://other:9091")
    with pytest.raises(InvalidInputError, match="expected the Pushgateway job name"):
        PowerGauge([0], 1, url)
    with pytest.raises(InvalidInputError, match="update_period"):
        EnergyCumulativeCounter([], [0], 0, url, "j")
    with pytest.raises(InvalidInputError, match="list of device indices"):
        PowerGauge("0", 1, url, "j")
    counter = EnergyCumulativeCounter([], [0], 1, url, "j")
    with pytest.raises(ValueError, match="No active monitoring process found for 'x'"):  # Zeus's words
        counter.end_window("x")
