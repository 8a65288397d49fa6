"""`zeus-callbacks devices`, `measure` and `restore`, in process and through the installed entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from zeus_callbacks import cli
from zeus_callbacks.core.device.gpus import get_gpus

# Child work for `measure`: 0.1 s of simulated GPU work on GPU 0 at 150 W, then exit with code 3.
_WORK = (
    "import time, sys\n"
    "from zeus_callbacks.core.device.gpus import get_gpus\n"
    "gpus = get_gpus()\n"
    "gpus[0].set_power_limit_mw(150_000)\n"
    "gpus.synchronize([0])\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 1.0: pass\n"
    "gpus.synchronize([0])\n"
    "time.sleep(0.15)\n"  # idle until the 100 ms energy counter has caught up with the work
    "print('child output')\n"
    "sys.exit(3)\n"
)


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("devices", "measure", "restore"):
        assert name in out
    assert cli.main([]) == 2


def test_devices_table(sim_gpus, capsys):
    sim_gpus("a40,t4", faults="no_permission@0")  # NVML index 0: the T4, on the lower PCI bus
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SIMULATED GPUs")
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["GPU", "NVML", "name"]
    a40, t4 = lines[2], lines[3]
    assert a40.split()[:4] == ["0", "1", "NVIDIA", "A40"]  # CUDA 0 (fastest first) is NVML 1
    assert "SIMULATED" in a40 and "100-300" in a40 and "210-1740" in a40 and a40.rstrip().endswith("yes")
    assert "Tesla T4" in t4 and "60-70" in t4 and t4.rstrip().endswith("no")
    assert "CAP_SYS_ADMIN" in out


def test_devices_json(sim_gpus, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    system = sim_gpus("2*v100", faults="no_energy_counter")
    system.gpus[1].set_power_limit_mw(200_000)
    assert cli.main(["devices", "--json"]) == 0
    [gpu] = json.loads(capsys.readouterr().out)
    assert gpu == {
        "index": 0,
        "nvml_index": 1,
        "name": "Tesla V100-PCIE-32GB",
        "uuid": system.gpus[1].uuid,
        "simulated": True,
        "energy_counter": False,
        "power_limit_w": 200.0,
        "requested_power_limit_w": 200.0,
        "min_power_limit_w": 100.0,
        "max_power_limit_w": 250.0,
        "default_power_limit_w": 250.0,
        "min_sm_clock_mhz": min(system.gpus[1].spec.supported_sm_clocks_mhz()),
        "max_sm_clock_mhz": 1380,
        "may_change_settings": True,
    }


def test_devices_unsupported_queries_show_na(sim_gpus, capsys):
    sim_gpus("a40", faults="not_supported=power;not_supported=clocks")
    assert cli.main(["devices"]) == 0
    assert "n/a" in capsys.readouterr().out


def test_devices_without_gpu_or_simulation(no_nvidia_driver, capsys):
    assert cli.main(["devices"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ZEUS_CALLBACKS_SIMULATE=a40" in err[0]
    assert cli.main(["measure", "--", "true"]) == 1
    assert cli.main(["restore"]) == 1


def test_devices_refuses_mig(sim_gpus, capsys):
    sim_gpus("a40", faults="mig")
    assert cli.main(["devices"]) == 1
    assert "MIG" in capsys.readouterr().err


@pytest.mark.system
def test_measure_table(sim_gpus, capfd):
    system = sim_gpus("2*a40")
    rc = cli.main(["measure", "--", sys.executable, "-c", _WORK])
    assert rc == 3
    out = capfd.readouterr().out
    assert "child output" in out
    assert "SIMULATED" in out and "(exit code 3)" in out
    assert system.gpus[0].power_limit_mw == 300_000  # the child restored what it changed
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1] in "01a"}
    assert rows["0"][-3] == "±" and float(rows["0"][-2]) > 0  # each energy with its bound: `J ± J  W`
    busy_j, idle_j = float(rows["0"][-4]), float(rows["1"][-4])
    tr = system.gpus[0].trace
    idle_w = system.gpus[0].spec.idle_power_w
    # Both GPUs idle for the whole window (child start-up included); GPU 0 also ran 1 s of work at 150 W:
    # its extra energy has the sign and the order of magnitude of that work (the real clock sets the rest).
    work_j = 1.0 * tr.relative_time(150) * (tr.power(150) - idle_w)
    assert work_j / 10 < busy_j - idle_j < 10 * work_j
    assert idle_j > 0


@pytest.mark.system
def test_measure_json(sim_gpus, capfd):
    system = sim_gpus("2*a40")
    rc = cli.main(["measure", "--json", "--gpus", "0", "--", sys.executable, "-c", _WORK])
    assert rc == 3
    res = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert res["returncode"] == 3 and res["simulated"] is True
    assert list(res["gpu_energy_j"]) == ["0"]
    tr = system.gpus[0].trace
    assert res["time_s"] > 1.0 * tr.relative_time(150)  # the child's slowed work is inside the window
    assert res["total_energy_j"] == pytest.approx(res["gpu_energy_j"]["0"])


@pytest.mark.system
def test_measure_errors(sim_gpus, capsys):
    sim_gpus("a40")
    assert cli.main(["measure"]) == 2
    assert "after `--`" in capsys.readouterr().err
    assert cli.main(["measure", "--", "no-such-command-zeus-callbacks"]) == 127
    assert "cannot run" in capsys.readouterr().err
    assert cli.main(["measure", "--gpus", "5", "--", "true"]) == 2
    assert cli.main(["measure", "--", "sh", "-c", "kill -TERM $$"]) == 128 + 15


@pytest.mark.system
def test_restore_json_and_include_live(sim_gpus, capsys):
    system = sim_gpus("a40")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORK.replace("sys.exit(3)", "sys.stdout.flush(); time.sleep(30)")],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout.readline().strip() == "child output"
        assert cli.main(["restore", "--json"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["restored"] == [] and res["left"] == 1 and res["simulated"]
        assert system.gpus[0].power_limit_mw == 150_000
        assert cli.main(["restore", "--include-live"]) == 0
        assert "Restored power_limit of GPU 0 (NVIDIA A40, simulated) to 300 W" in capsys.readouterr().out
        assert system.gpus[0].power_limit_mw == 300_000
    finally:
        proc.kill()
        proc.communicate(timeout=20)
    assert get_gpus()[0].power_limit_mw() == 300_000


@pytest.mark.system
def test_entry_point_runs(sim_gpus, tmp_path):
    exe = shutil.which("zeus-callbacks") or os.path.join(os.path.dirname(sys.executable), "zeus-callbacks")
    if not os.path.exists(exe):
        pytest.skip("the zeus-callbacks entry point is not installed")
    sim_gpus("2*a40")
    out = subprocess.run(
        [exe, "measure", "--json", "--", sys.executable, "-c", _WORK],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert out.returncode == 3, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["simulated"] and set(res["gpu_energy_j"]) == {"0", "1"}
    dev = subprocess.run(
        [exe, "devices", "--json"], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert dev.returncode == 0, dev.stderr
    assert len(json.loads(dev.stdout)) == 2
