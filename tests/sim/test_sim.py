"""The simulator: traces, physics of power limits and clocks, noise, virtual clock, shared state, specs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import numpy as np
import pynvml as nvml
import pytest

from zeus_callbacks import sim
from zeus_callbacks.core.heterogeneous.profile_file import shipped_profiles_dir
from zeus_callbacks.sim import SimulatedSystem, load_trace, parse_faults, parse_spec, shipped_trace
from zeus_callbacks.sim.host import HOST_CLOCK

DATA = Path(str(resources.files("zeus_callbacks"))) / "sim" / "data"
ZEUS2 = shipped_profiles_dir()  # the Zeus² profiles, shipped with the heterogeneous planner


def _csv_rows(path: Path, **match: str) -> dict[float, tuple[float, float]]:
    """{power_limit: (time_per_epoch, average_power)} of the NSDI'23 rows matching `match`."""
    with path.open(newline="") as f:
        return {
            float(r["power_limit"]): (float(r["time_per_epoch"]), float(r["average_power"]))
            for r in csv.DictReader(f)
            if all(r[k] == v for k, v in match.items())
        }


# -- traces ------------------------------------------------------------------------------------------
def test_nsdi23_trace_matches_csv():
    rows = _csv_rows(
        DATA / "nsdi23/summary_power_a40.csv", dataset="imagenet", network="resnet50", batch_size="256"
    )
    tr = shipped_trace("a40")  # default workload: imagenet/resnet50/256
    assert tr.workload.startswith("imagenet/resnet50/256/")
    assert list(tr.power_limits_w) == sorted(rows)
    t_max, p_max = rows[300.0]
    for pl, (t, p) in rows.items():
        assert tr.relative_time(pl) == pytest.approx(t / t_max)
        assert tr.power(pl) == pytest.approx(p)
        assert tr.relative_energy(pl) == pytest.approx(t * p / (t_max * p_max))


def test_nsdi23_optimizer_key_required_when_ambiguous():
    path = DATA / "nsdi23/summary_power_v100.csv"
    with open(path, newline="") as f:
        by_opt: dict[str, set[str]] = {}
        for r in csv.DictReader(f):
            by_opt.setdefault(f"{r['dataset']}/{r['network']}/{r['batch_size']}", set()).add(r["optimizer"])
    key, opts = next((k, o) for k, o in sorted(by_opt.items()) if len(o) > 1)
    with pytest.raises(ValueError, match="OPTIMIZER"):
        load_trace(path, key)
    tr = load_trace(path, f"{key}/{sorted(opts)[0]}")
    assert tr.workload == f"{key}/{sorted(opts)[0]}"


def test_zeus2_json_trace_matches_file():
    data = json.loads((ZEUS2 / "cifar_t4.json").read_text())
    tr = shipped_trace("t4")
    points = {float(p["power_limit"]): p for p in data["1024"]}
    assert list(tr.power_limits_w) == sorted(points)
    for pl, p in points.items():
        assert tr.power(pl) == pytest.approx(p["energy"] / p["time"])
        assert tr.relative_energy(pl) == pytest.approx(p["energy"] / points[tr.max_power_limit_w]["energy"])


def test_monitor_csv_trace_matches_file():
    tr = shipped_trace("a40", "resnet50")  # a bare model name selects a Zeus monitor log
    with open(DATA / "zeus_profiles/A40+resnet50+gpu0.csv", newline="") as f:
        rows = {int(r["window_name"].rsplit("_", 1)[1]): r for r in csv.DictReader(f)}
    assert tr.max_power_limit_w == 300 and tr.min_power_limit_w == min(rows)
    r = rows[200]
    assert tr.power(200) == pytest.approx(float(r["gpu0_energy"]) / float(r["elapsed_time"]))
    assert tr.relative_time(200) == pytest.approx(float(r["elapsed_time"]) / float(rows[300]["elapsed_time"]))


@pytest.mark.parametrize("kind", ["a40", "v100", "a10g", "t4"])
def test_every_shipped_workload_loads(kind):
    keys = sim.shipped_workloads(kind)
    assert keys
    for key in keys[:: max(1, len(keys) // 5)]:
        tr = shipped_trace(kind, key)
        assert tr.relative_time(tr.max_power_limit_w) == pytest.approx(1.0)


def test_user_trace_files_in_all_formats(tmp_path):
    nsdi = tmp_path / "mine.csv"
    nsdi.write_text(
        "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"
        "mydata,mynet,64,sgd,100,20.0,90.0\n"
        "mydata,mynet,64,sgd,200,10.0,150.0\n"
    )
    zeus2 = tmp_path / "mine.json"
    zeus2.write_text(
        json.dumps(
            {
                "64": [
                    {"power_limit": 100, "energy": 1800.0, "time": 20.0},
                    {"power_limit": 200, "energy": 1500.0, "time": 10.0},
                ]
            }
        )
    )
    log = tmp_path / "X+mynet+gpu0.csv"
    log.write_text(
        "start_time,window_name,elapsed_time,gpu0_energy\n"
        "1.0,__GlobalPowerLimitOptimizer_200,10.0,1500.0\n"
        "2.0,some_other_window,3.0,7.0\n"
        "3.0,__GlobalPowerLimitOptimizer_100,20.0,1800.0\n"
    )
    for path, key in ((nsdi, "mydata/mynet/64"), (zeus2, "64"), (log, "")):
        tr = load_trace(path, key, gpu_model="a40")
        assert list(tr.power_limits_w) == [100.0, 200.0], path
        assert tr.relative_time(100) == pytest.approx(2.0)
        assert tr.power(100) == pytest.approx(90.0) and tr.power(200) == pytest.approx(150.0)
        assert tr.relative_energy(100) == pytest.approx(1.2)
    # A user file drives a simulated GPU through the spec, and NVML reports its limits.
    system = sim.simulate(f"a40:mydata/mynet/64@{nsdi}", state_dir="")
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetPowerManagementLimitConstraints(h) == [100_000, 200_000]
    assert system.gpus[0].operating_point() == pytest.approx((1.0, 150.0))


def test_trace_interpolates_linearly_between_limits():
    tr = shipped_trace("a40")
    lo, hi = tr.relative_time(100), tr.relative_time(125)
    assert tr.relative_time(112.5) == pytest.approx((lo + hi) / 2)
    assert tr.power(112.5) == pytest.approx((tr.power(100) + tr.power(125)) / 2)
    assert tr.relative_time(400) == pytest.approx(1.0)  # held beyond the measured range


def test_trace_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*Supported trace files"):
        load_trace(tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="Cannot tell the format"):
        load_trace(bad)
    with pytest.raises(ValueError, match="not in .*Known: "):
        load_trace(DATA / "nsdi23/summary_power_a40.csv", "imagenet/resnet50/999")
    with pytest.raises(ValueError, match="Batch size '7' is not in"):
        load_trace(ZEUS2 / "cifar_a10.json", "7")


def test_energy_has_a_valley_inside_the_power_range():
    tr = shipped_trace("a40")
    energies = [tr.relative_energy(p) for p in tr.power_limits_w]
    best = int(np.argmin(energies))
    assert 0 < best < len(energies) - 1
    assert energies[best] < 0.9  # ~19% saved on A40 resnet50


# -- clocks --------------------------------------------------------------------------------------------
def test_clock_locking_moves_along_the_curve(sim_gpus):
    system = sim_gpus("a40", state_dir="")
    gpu = system.gpus[0]
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    clocks = nvml.nvmlDeviceGetSupportedGraphicsClocks(h, nvml.nvmlDeviceGetSupportedMemoryClocks(h)[0])
    assert clocks[0] == 1740 and clocks == sorted(clocks, reverse=True)
    unlocked = gpu.operating_point()
    points = []
    for f in clocks:
        nvml.nvmlDeviceSetGpuLockedClocks(h, clocks[-1], f)
        rel, power = gpu.operating_point()
        points.append((f, rel, power, rel * power))
        assert nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM) <= f
    assert points[0][1:3] == pytest.approx(unlocked)  # locking at the maximum changes nothing
    rels = [p[1] for p in points]
    assert all(a <= b + 1e-12 for a, b in zip(rels, rels[1:], strict=False))  # lower clock, slower
    assert points[-1][1] == pytest.approx(1740 / clocks[-1])  # time ~ 1/f far below the traced range
    energies = [p[3] for p in points]
    best = int(np.argmin(energies))
    assert 0 < best < len(energies) - 1  # an energy valley along the clocks too
    assert energies[best] < 0.9 * energies[0]
    nvml.nvmlDeviceResetGpuLockedClocks(h)
    assert gpu.operating_point() == pytest.approx(unlocked)


def test_clock_cap_above_what_the_power_limit_allows_changes_nothing(sim_gpus):
    system = sim_gpus("a40", state_dir="")
    gpu = system.gpus[0]
    gpu.set_power_limit_mw(150_000)
    at_pl = gpu.operating_point()
    gpu.lock_sm_clocks(210, 1600)  # 150 W already runs slower than 1600 MHz
    assert gpu.operating_point() == pytest.approx(at_pl)


@pytest.mark.system
def test_locked_clock_slows_real_time_work(sim_gpus, burn_cpu, sim_sleeps):
    system = sim_gpus("a40")
    gpu = system.gpus[0]
    gpu.synchronize()
    gpu.lock_sm_clocks(210, 870)  # half the maximum clock: work takes twice as long
    gpu.synchronize()
    sim_sleeps.clear()
    burn_cpu(0.05)
    t0 = HOST_CLOCK.now()
    gpu.synchronize()
    waited = HOST_CLOCK.now() - t0
    assert sim_sleeps == [pytest.approx(0.05, rel=0.1)]  # the GPU catches up the other half
    assert waited >= sim_sleeps[0]  # any timer sees it (the node's: a loaded host wakes late, and catches up)


# -- noise ---------------------------------------------------------------------------------------------
def _steps(seed: int, noise: float) -> list[float]:
    system = SimulatedSystem("2*a40", noise=noise, seed=seed, state_dir="", virtual_clock=True)
    return [system.run_step(1.0) for _ in range(5)]


def test_noise_is_seeded_and_reproducible():
    assert _steps(1, 0.05) == _steps(1, 0.05)
    assert _steps(1, 0.05) != _steps(2, 0.05)
    assert _steps(1, 0.0) == [1.0] * 5
    noisy = _steps(3, 0.05)
    assert all(0.8 < t < 1.2 for t in noisy) and len(set(noisy)) > 1


# -- virtual clock ---------------------------------------------------------------------------------------
def test_run_step_lasts_as_long_as_the_slowest_gpu():
    system = SimulatedSystem("2*a40", state_dir="", virtual_clock=True)
    fast, slow = system.gpus
    tr = fast.trace
    slow.set_power_limit_mw(100_000)
    e0 = [g.true_energy_mj() for g in system.gpus]
    t0 = system.clock.now()
    span = system.run_step(2.0)
    rel = tr.relative_time(100)
    assert span == pytest.approx(2.0 * rel)
    assert system.clock.now() - t0 == pytest.approx(span)
    idle = fast.spec.idle_power_w
    e1 = [g.true_energy_mj() for g in system.gpus]
    assert (e1[0] - e0[0]) / 1000 == pytest.approx(2.0 * tr.power(300) + (span - 2.0) * idle)
    assert (e1[1] - e0[1]) / 1000 == pytest.approx(span * tr.power(100))
    # Per-GPU work: the GPU with no work only idles.
    e0 = e1
    span = system.run_step({0: 1.0})
    assert span == pytest.approx(1.0)
    e1 = [g.true_energy_mj() for g in system.gpus]
    assert (e1[1] - e0[1]) / 1000 == pytest.approx(idle * 1.0)
    # Virtual time stands still between steps: the energy does not move.
    assert [g.true_energy_mj() for g in system.gpus] == e1


def test_run_step_needs_a_virtual_clock():
    with pytest.raises(RuntimeError, match="virtual_clock=True"):
        SimulatedSystem("a40", state_dir="").run_step(1.0)


@pytest.mark.system
def test_multi_gpu_synchronisation_takes_the_slowest_not_the_sum(sim_gpus, burn_cpu, sim_sleeps):
    system = sim_gpus("4*a40")
    for g in system.gpus:
        g.set_power_limit_mw(100_000)
        g.synchronize()
    sim_sleeps.clear()
    burn_cpu(0.05)
    t0 = HOST_CLOCK.now()
    for g in system.gpus:
        g.synchronize()
    waited = HOST_CLOCK.now() - t0
    expected = 0.05 * (system.gpus[0].trace.relative_time(100) - 1)
    assert sum(sim_sleeps) == pytest.approx(expected, rel=0.1)  # the bug this guards against slept 4x as long
    assert waited >= sum(sim_sleeps)


# -- shared state ----------------------------------------------------------------------------------------
@pytest.mark.system
def test_state_outlives_the_process(sim_gpus, run_python, burn_cpu):
    system = sim_gpus("2*a40")
    gpu = system.gpus[1]
    assert gpu.power_limit_mw == 300_000
    before = gpu.true_energy_mj()  # the state under test, not the counter's refresh (tested elsewhere)
    child = run_python(
        "import time\n"
        "from zeus_callbacks import sim\n"
        "import pynvml as nvml\n"
        "sim.active(); nvml.nvmlInit()\n"
        "h = nvml.nvmlDeviceGetHandleByIndex(1)\n"
        "nvml.nvmlDeviceSetPowerManagementLimit(h, 175000)\n"
        # 0.1 s of this thread's CPU and of wall time: a library's native thread may spin at start-up,
        # and the simulator counts the process's CPU time (every thread's) only up to the wall time.
        "t, w = time.thread_time(), time.time()\n"
        "while time.thread_time() - t < 0.1 or time.time() - w < 0.1: pass\n"
        "sim.simulated_gpu(h).synchronize()\n"
    )
    assert child.returncode == 0, child.stderr
    assert gpu.power_limit_mw == 175_000
    assert system.gpus[0].power_limit_mw == 300_000
    # The child's 0.1 s of work at 175 W is in the shared energy counter.
    assert (gpu.true_energy_mj() - before) / 1000 > 0.1 * gpu.trace.power(175)
    # A new system object for the same spec (another process's view) sees the same state.
    again = SimulatedSystem("2*a40", state_dir=system.state_dir)
    assert again.gpus[1].power_limit_mw == 175_000


@pytest.mark.system
def test_another_process_sees_the_work_in_progress_of_the_last_process_that_synchronised(
    sim_gpus, run_python
):
    """A sampler in another process (PowerMonitor's) reads the power of work not synchronised yet: the
    worker's CPU time since its last synchronisation, read from /proc. Before the worker's first
    synchronisation, and once it has exited, the GPU reads idle (the reader, which never issued work,
    adds none of its own)."""
    system = sim_gpus("v100")  # before Ampere, nvmlDeviceGetPowerUsage is the instant power
    gpu = system.gpus[0]
    idle_mw = gpu.spec.idle_power_w * 1000
    reader = (
        "from zeus_callbacks import sim\n"
        "import pynvml as nvml\n"
        "sim.active(); nvml.nvmlInit()\n"
        "print(nvml.nvmlDeviceGetPowerUsage(nvml.nvmlDeviceGetHandleByIndex(0)))\n"
    )
    worker = (
        "import sys, time\n"
        "from zeus_callbacks import sim\n"
        "import pynvml as nvml\n"
        "sim.active(); nvml.nvmlInit()\n"
        "gpu = sim.simulated_gpu(nvml.nvmlDeviceGetHandleByIndex(0))\n"
        "gpu.synchronize()\n"
        "print('synced', flush=True)\n"
        "while True: pass\n"  # host work issued to the GPU, never synchronised
    )
    assert abs(int(run_python(reader).stdout) - idle_mw) <= 1
    proc = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "synced\n"
        time.sleep(0.3)  # a tick of /proc's CPU time at least
        assert int(run_python(reader).stdout) > idle_mw
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.6)  # past the 0.5 s in which its synchronised interval still reads as recent work
    assert abs(int(run_python(reader).stdout) - idle_mw) <= 1  # a worker that is gone works no more


@pytest.mark.system
def test_state_is_per_spec_and_per_directory(sim_gpus, tmp_path):
    a = sim_gpus("a40")
    a.gpus[0].set_power_limit_mw(200_000)
    assert SimulatedSystem("2*a40", state_dir=a.state_dir).gpus[0].power_limit_mw == 300_000
    assert SimulatedSystem("a40", state_dir=str(tmp_path / "other")).gpus[0].power_limit_mw == 300_000
    assert SimulatedSystem("a40", state_dir="").gpus[0].power_limit_mw == 300_000


@pytest.mark.system
def test_simulate_exports_the_environment(sim_gpus, sim_state_dir):
    import os

    sim_gpus("2*a40", noise=0.01, seed=7, faults="no_permission@1")
    assert os.environ["ZEUS_CALLBACKS_SIMULATE"] == "2*a40"
    assert os.environ["ZEUS_CALLBACKS_SIM_SEED"] == "7"
    assert os.environ["ZEUS_CALLBACKS_SIM_FAULTS"] == "no_permission@1"
    assert os.environ["ZEUS_CALLBACKS_SIM_STATE_DIR"] == str(sim_state_dir)
    sim.disable()
    assert sim.active() is None
    assert "ZEUS_CALLBACKS_SIMULATE" not in os.environ


@pytest.mark.system
def test_active_builds_the_node_from_the_environment(monkeypatch):
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "a10g,t4")
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_FAULTS", "no_energy_counter@1")
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_IDEAL", "power_average")
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_ENERGY_REFRESH_MS", "40")
    system = sim.active()
    assert [g.spec.kind for g in system.gpus] == ["t4", "a10g"]  # NVML's order: the T4 on the lower bus
    assert not system.gpus[0].faults.no_energy_counter and system.gpus[1].faults.no_energy_counter
    assert system.ideal_behaviours == {"power_average"}
    assert [g.energy_refresh_s for g in system.gpus] == [0.04, 0.04]
    assert sim.active() is system


# -- specs and faults ------------------------------------------------------------------------------------
def test_parse_spec():
    groups = parse_spec("4*a40:imagenet/resnet50/256, t4 ,a10@/x/y.json")
    assert [(g.kind, g.count, g.workload, g.trace_file) for g in groups] == [
        ("a40", 4, "imagenet/resnet50/256", None),
        ("t4", 1, None, None),
        ("a10", 1, None, "/x/y.json"),
    ]
    assert [g.spec.kind for g in SimulatedSystem("a10", state_dir="").gpus] == ["a10g"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "b200",
            "Unknown simulated GPU 'b200'. Choose one of: a100, a10g, a40, h100, h200, mi300x, t4, v100",
        ),
        ("0*a40", "needs a positive count"),
        ("x*a40", "needs a positive count"),
        ("", "names no GPU; e.g. ZEUS_CALLBACKS_SIMULATE=a40"),
        (" , ", "names no GPU"),
    ],
)
def test_spec_errors_are_clear(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(spec)


def test_unknown_workload_error_names_the_known_ones():
    with pytest.raises(ValueError, match="Known: .*imagenet/resnet50/256"):
        SimulatedSystem("a40:imagenet/resnet50/3", state_dir="")


def test_parse_faults():
    f = parse_faults("no_permission;lost_after=5@1, not_supported=power;not_supported=clocks@1;mig@0")
    assert f[None].no_permission and f[None].not_supported == {"power"}
    assert f[1].lost_after_calls == 5 and f[1].not_supported == {"clocks"}
    assert f[0].mig
    system = SimulatedSystem(
        "2*a40", faults="no_permission;not_supported=power;not_supported=clocks@1", state_dir=""
    )
    assert system.gpus[1].faults.no_permission and system.gpus[1].faults.not_supported == {"power", "clocks"}
    with pytest.raises(ValueError, match="unknown fault 'melt'"):
        parse_faults("melt")


@pytest.mark.system
def test_lost_after_changes_counts_setting_changes_not_calls(sim_gpus):
    sim_gpus("a40", faults="lost_after_changes=2")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    for _ in range(50):  # reads never lose the GPU
        nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    nvml.nvmlDeviceSetPowerManagementLimit(handle, 250_000)
    nvml.nvmlDeviceSetGpuLockedClocks(handle, 1200, 1200)
    with pytest.raises(nvml.NVMLError) as lost:
        nvml.nvmlDeviceGetPowerManagementLimit(handle)
    assert lost.value.value == nvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(ValueError, match="lost_after_changes=0"):
        parse_faults("lost_after_changes=0")


@pytest.mark.system
def test_enqueued_kernels_run_at_the_locked_clock_without_host_cpu(sim_gpus, sim_sleeps):
    import time

    system = sim_gpus("a40")
    gpu = system.gpus[0]
    gpu.lock_sm_clocks(870, 870)  # half the maximum clock: kernels take twice as long
    gpu.synchronize()
    sim_sleeps.clear()
    t0, cpu0 = HOST_CLOCK.now(), time.process_time()
    for _ in range(3):  # back-to-back synchronisations of one GPU: each waits for its own kernels
        sim.enqueue_work(0, 0.02)
        gpu.synchronize()
    elapsed, cpu = HOST_CLOCK.now() - t0, time.process_time() - cpu0
    assert sim_sleeps == [pytest.approx(0.02 * 1740 / 870, rel=0.05)] * 3
    assert elapsed >= sum(sim_sleeps)
    assert cpu < 0.5 * elapsed  # the wait is a sleep: the host's CPU is free for other ranks


def test_enqueue_work_needs_a_simulation():
    sim.disable()
    with pytest.raises(RuntimeError, match="ZEUS_CALLBACKS_SIMULATE"):
        sim.enqueue_work(0, 0.01)
