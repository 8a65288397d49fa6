"""The Prometheus endpoint: scraped by a real Prometheus server during a simulated training run, its series and
values checked through Prometheus's HTTP API against the monitor's and the optimizer's own; and, without a
server, its exposition, labels, ports and errors."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
import urllib.request

import pytest
from prometheus_servers import Prometheus, free_port, get, needs_prometheus

from zeus_callbacks import GlobalPowerLimitOptimizer, Time, ZeusMonitor
from zeus_callbacks.core.device.errors import InvalidInputError
from zeus_callbacks.core.device.power import instant_power_mw
from zeus_callbacks.core.device.telemetry import clocks_mhz, temperature_c
from zeus_callbacks.core.observability.endpoint import (
    EXPORTED_METRICS,
    PORT_ENV,
    serve_metrics,
    serve_metrics_from_env,
)

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

GPU_METRICS = {
    "zeus_callbacks_gpu_power_watts",
    "zeus_callbacks_gpu_temperature_celsius",
    "zeus_callbacks_gpu_power_limit_watts",
    "zeus_callbacks_gpu_sm_clock_mhz",
    "zeus_callbacks_gpu_memory_clock_mhz",
}


def scrape(url: str) -> dict[str, list]:
    """The endpoint's samples by name, parsed by prometheus_client's own parser."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(get(url).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_exposition_labels_every_gpu_with_uuid_rank_job_and_simulated(sim_gpus, monkeypatch):
    system = sim_gpus("2*a40", virtual_clock=True)
    # The job's scheduler, user and partition from Slurm's variables (issue 41); `job=` names the job.
    for name, value in {
        "SLURM_JOB_ID": "99",
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_PARTITION": "gpu",
    }.items():
        monkeypatch.setenv(name, value)
    monitor = ZeusMonitor()
    plo = GlobalPowerLimitOptimizer(monitor, Time(), warmup_steps=1, profile_steps=2, pl_step=100)
    with serve_metrics(
        port=0, monitor=monitor, optimizers=[plo], job="exp-1", addr="127.0.0.1", cache_s=0
    ) as server:
        samples = scrape(server.url)
        for name in GPU_METRICS | {"zeus_callbacks_gpu_energy_joules_total"}:
            assert len(samples[name]) == 2, name
            for s, gpu in zip(
                sorted(samples[name], key=lambda s: s.labels["gpu"]), monitor.gpus, strict=True
            ):
                assert s.labels == {
                    "gpu": str(gpu.index),
                    "uuid": gpu.uuid,
                    "name": "NVIDIA A40",
                    "rank": "0",
                    "train_job": "exp-1",
                    "scheduler": "slurm",
                    "user": "alice",
                    "partition": "gpu",
                    "simulated": "true",
                }
        energy = {s.labels["gpu"]: s.value for s in samples["zeus_callbacks_gpu_energy_joules_total"]}
        assert energy["0"] == pytest.approx(monitor.gpus[0].energy_mj() / 1000)
        phases = {s.labels["phase"]: s.value for s in samples["zeus_callbacks_optimizer_phase"]}
        assert phases == {"waiting": 1.0, "warmup": 0.0, "profiling": 0.0, "done": 0.0, "inactive": 0.0}
        assert samples["zeus_callbacks_optimizer_phase"][0].labels["simulated"] == "true"
        assert "zeus_callbacks_optimizer_optimal_power_limit_watts" not in samples  # nothing chosen yet
        for _ in range(200):
            plo.on_step_begin()
            system.run_step(0.1)
            plo.on_step_end()
        assert plo.phase == "done"
        samples = scrape(server.url)
        chosen = samples["zeus_callbacks_optimizer_optimal_power_limit_watts"]
        assert [s.value for s in chosen] == [plo.optimal_power_limit_w]
        limits = {s.value for s in samples["zeus_callbacks_gpu_power_limit_watts"]}
        assert limits == {plo.optimal_power_limit_w}
        # Every name written out is one the endpoint declares (the dashboard test relies on this list).
        declared = {n + ("_total" if k == "counter" else "") for n, (k, _) in EXPORTED_METRICS.items()}
        assert set(samples) <= declared
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


def test_the_train_job_label_defaults_to_the_schedulers_job(sim_gpus, monkeypatch):
    sim_gpus("a40", virtual_clock=True)
    monkeypatch.delenv("ZEUS_CALLBACKS_JOB", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with serve_metrics(port=0, addr="127.0.0.1", cache_s=0) as server:
        (power,) = scrape(server.url)["zeus_callbacks_gpu_power_watts"]
    assert (power.labels["train_job"], power.labels["scheduler"]) == ("4242", "slurm")


@pytest.mark.system
def test_one_port_per_rank_and_the_environment_switch(sim_gpus, monkeypatch):
    sim_gpus("a40")
    monkeypatch.delenv(PORT_ENV, raising=False)
    assert serve_metrics_from_env() is None
    base = free_port()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(PORT_ENV, str(base))
    monkeypatch.setenv("ZEUS_CALLBACKS_PROMETHEUS_ADDR", "127.0.0.1")
    server = serve_metrics_from_env()
    try:
        assert server is not None and server.port == base
        # The next local rank listens on the next port; the port taken is refused with a clear error.
        monkeypatch.setenv("LOCAL_RANK", "1")
        try:
            other = serve_metrics(port=base, addr="127.0.0.1")
        except InvalidInputError:
            pytest.skip(f"port {base + 1} is taken on this host")
        other.stop()
        assert other.port == base + 1
        with pytest.raises(InvalidInputError, match=r"cannot listen on 127.0.0.1:\d+ .*Choose a free port"):
            serve_metrics(port=base - 1, addr="127.0.0.1")
    finally:
        server.stop()
    monkeypatch.setenv(PORT_ENV, "nine")
    with pytest.raises(InvalidInputError, match="is not a port number"):
        serve_metrics_from_env()


@pytest.mark.system
def test_bad_arguments_say_what_to_pass(sim_gpus):
    sim_gpus("a40")
    with pytest.raises(InvalidInputError, match=r"serve_metrics\(port=-1\)"):
        serve_metrics(port=-1)
    with pytest.raises(InvalidInputError, match="cache_s"):
        serve_metrics(port=0, cache_s=-1)
    with pytest.raises(InvalidInputError, match="GlobalPowerLimitOptimizer or PipelineFrequencyOptimizer"):
        serve_metrics(port=0, optimizers=[object()])


@pytest.mark.system
def test_prometheus_client_missing_says_how_to_install(sim_gpus, monkeypatch):
    sim_gpus("a40")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install 'zeus-callbacks\[prometheus\]'"):
        serve_metrics(port=0)


@pytest.mark.system
def test_importing_the_package_does_not_import_prometheus_client(run_python):
    code = (
        "import sys, zeus_callbacks; from zeus_callbacks import *; print('prometheus_client' in sys.modules)"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.slow
@needs_prometheus
def test_real_prometheus_scrapes_a_simulated_training_run(sim_gpus, tmp_path):
    """Prometheus scrapes the endpoint while a power-limit search runs on two simulated A40s (a virtual clock:
    the counters stand still between steps, so the values Prometheus stored are exactly comparable). The
    training loop waits for a scrape after every change of phase or power limit, so Prometheus sees each."""
    system = sim_gpus("2*a40", virtual_clock=True)
    monitor = ZeusMonitor()
    plo = GlobalPowerLimitOptimizer(monitor, Time(), warmup_steps=1, profile_steps=4, pl_step=50)
    server = serve_metrics(port=0, monitor=monitor, optimizers=[plo], job="e2e", addr="127.0.0.1", cache_s=0)
    prom = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{server.port}"])
    try:
        monitor.begin_window("run")
        start = time.time()
        prom.wait_for_scrape(after=start)
        seen: set[tuple[str, int | None]] = set()
        for _ in range(500):
            plo.on_step_begin()
            system.run_step(0.1)
            plo.on_step_end()
            if (plo.phase, plo.power_limit_w) not in seen:
                seen.add((plo.phase, plo.power_limit_w))
                prom.wait_for_scrape(after=time.time())
            if plo.phase == "done":
                break
        run = monitor.end_window("run")
        prom.wait_for_scrape(after=time.time())
        assert plo.phase == "done"

        # The series: every GPU, labelled with its UUID, rank, job and simulated="true".
        job = '{job="zeus",train_job="e2e"}'
        energy = prom.query(f"zeus_callbacks_gpu_energy_joules_total{job}")
        assert {s["metric"]["uuid"] for s in energy} == {g.uuid for g in monitor.gpus}
        assert all(s["metric"]["simulated"] == "true" and s["metric"]["rank"] == "0" for s in energy)
        for name in GPU_METRICS:
            assert len(prom.query(f"{name}{job}")) == 2, name

        # Energy over the run as Prometheus stored it (last minus first sample) = the monitor's window.
        for gpu in monitor.gpus:
            sel = f'zeus_callbacks_gpu_energy_joules_total{{uuid="{gpu.uuid}"}}'
            stored = prom.value(f"{sel} - min_over_time({sel}[1h])")
            assert stored == pytest.approx(run.gpu_energy[gpu.index], abs=1e-3)
            assert prom.value(f"increase({sel}[1h])") > 0
            # Power, temperature and clocks: what the device layer reads now (nothing moves between steps).
            uuid = f'{{uuid="{gpu.uuid}"}}'
            assert prom.value(f"zeus_callbacks_gpu_power_watts{uuid}") == pytest.approx(
                instant_power_mw(gpu) / 1000
            )
            assert prom.value(f"zeus_callbacks_gpu_temperature_celsius{uuid}") == temperature_c(gpu)
            sm, mem = clocks_mhz(gpu)
            assert prom.value(f"zeus_callbacks_gpu_sm_clock_mhz{uuid}") == sm
            assert prom.value(f"zeus_callbacks_gpu_memory_clock_mhz{uuid}") == mem
            assert prom.value(f"zeus_callbacks_gpu_power_limit_watts{uuid}") == plo.optimal_power_limit_w

        # Every power limit the search measured was in force at some scrape, and no other one.
        body = json.loads(
            get(
                f"{prom.url}/api/v1/query_range?query=zeus_callbacks_gpu_power_limit_watts"
                f"&start={start - 1:.3f}&end={time.time():.3f}&step=0.1"
            )
        )
        limits = {float(v) for series in body["data"]["result"] for _, v in series["values"]}
        measured = {float(r["power_limit_w"]) for r in plo.report()["power_limits"]}
        assert measured <= limits <= measured | {300.0}
        # The phases it went through, and its choice.
        for phase in ("waiting", "warmup", "profiling", "done"):
            assert prom.value(f'max_over_time(zeus_callbacks_optimizer_phase{{phase="{phase}"}}[1h])') == 1
        assert prom.value('zeus_callbacks_optimizer_phase{phase="done"}') == 1
        assert prom.value("zeus_callbacks_optimizer_optimal_power_limit_watts") == plo.optimal_power_limit_w
        assert prom.value("zeus_callbacks_optimizer_profiling_steps") == plo.report()["profiling_steps"]
        opt = prom.query("zeus_callbacks_optimizer_phase")[0]["metric"]
        assert (opt["optimizer"], opt["simulated"], opt["train_job"]) == ("power_limit", "true", "e2e")
    finally:
        prom.stop()
        server.stop()


_RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from zeus_callbacks import ZeusMonitor, sim
    from zeus_callbacks.core.observability.endpoint import serve_metrics_from_env

    monitor = ZeusMonitor()
    server = serve_metrics_from_env(monitor=monitor)
    print(server.port, flush=True)
    for _ in range(20):  # a real-clock simulated run: work issued to the GPU, paced by the simulator
        sim.enqueue_work(0, 0.05)
        monitor.sync()
    print("trained", flush=True)
    sys.stdin.readline()  # Prometheus scrapes the idle process until the test says stop
    server.stop()
    """
)


@pytest.mark.slow
@needs_prometheus
def test_real_prometheus_scrapes_one_port_per_rank(sim_gpus, tmp_path, monkeypatch):
    """Two processes on one node (LOCAL_RANK 0 and 1) with `ZEUS_CALLBACKS_PROMETHEUS_PORT`: each serves on
    its own port, and Prometheus scrapes both on a real-clock simulation."""
    import subprocess

    sim_gpus("2*a40")  # a real-clock node, exported to the children
    base = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = {
                **os.environ,
                PORT_ENV: str(base),
                "ZEUS_CALLBACKS_PROMETHEUS_ADDR": "127.0.0.1",
                "LOCAL_RANK": str(rank),
                "RANK": str(rank),
                "CUDA_VISIBLE_DEVICES": str(rank),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _RANK_SCRIPT],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        ports = [int(p.stdout.readline()) for p in procs]
        assert ports == [base, base + 1]
        prom = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{p}" for p in ports])
        try:
            assert [p.stdout.readline().strip() for p in procs] == ["trained", "trained"]
            prom.wait_for_scrape(after=time.time())
            energy = prom.query("zeus_callbacks_gpu_energy_joules_total")
            assert sorted(s["metric"]["gpu"] for s in energy) == ["0", "0"]  # each rank sees its one GPU as 0
            assert len({s["metric"]["uuid"] for s in energy}) == 2
            by_port = {s["metric"]["instance"].rsplit(":", 1)[1]: s["metric"] for s in energy}
            assert set(by_port) == {str(base), str(base + 1)}
            assert all(s["metric"]["simulated"] == "true" for s in energy)
            assert {m["rank"] for m in by_port.values()} == {"0", "1"}
            assert all(float(s["value"][1]) > 0 for s in energy)
        finally:
            prom.stop()
    finally:
        for p in procs:
            if p.poll() is None:
                p.communicate("stop\n", timeout=30)
