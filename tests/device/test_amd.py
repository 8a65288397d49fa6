"""AMD GPUs through core/device/amd.py, the real `amdsmi` package and the simulated libamd_smi.so beneath it:
readings and settings in this package's units, amdsmi's errors as this package's, HIP's numbering, the CLI, and
the power-limit optimizer choosing a limit on two MI300Xs and leaving them as found."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from zeus_callbacks import sim
from zeus_callbacks.core.device import amd
from zeus_callbacks.core.device.errors import GPULostError, GPUNoPermissionError, GPUNotSupportedError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.monitor.monitor import ZeusMonitor
from zeus_callbacks.core.monitor.uncertainty import power_sensor
from zeus_callbacks.core.power_limit.optimizer import GlobalPowerLimitOptimizer
from zeus_callbacks.core.power_limit.selectors import Energy
from zeus_callbacks.sim.amd_backend import SimulatedAMDBackend

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("amdsmi") is None, reason="the amd extra is not installed"
)


def devices(spec: str = "2*mi300x", **kw) -> tuple[sim.SimulatedSystem, list]:
    system = sim.simulate(spec, virtual_clock=True, ideal="sensor_gain", **kw)
    backend = SimulatedAMDBackend(system)
    backend.init()
    return system, backend.devices()


def test_identity_and_units_through_amdsmi():
    system, (d0, d1) = devices()
    assert (d0.vendor, d0.name, d0.architecture) == ("amd", "AMD Instinct MI300X", "cdna3")
    assert d0.label == "GPU 0 (AMD Instinct MI300X, simulated)"
    assert d0.uuid == system.gpus[0].uuid and d0.uuid.startswith("GPU-") and len(d0.uuid) == 20
    assert d0.pci_bus_id() == "0000:17:00.0" and d1.pci_bus_id() == "0000:27:00.0"
    assert d0.memory_bytes() == 192 * 1024**3 and not d0.mig_enabled()
    assert d0.supports_energy_counter and d0.supports_power_reading
    system.run_step(1.0)
    # mJ from the accumulator's 15.3 uJ ticks (truncated): within 1 mJ of the board's own counter.
    assert system.gpus[0].energy_mj() > 100_000
    assert system.gpus[0].energy_mj() - 1 <= d0.energy_mj() <= system.gpus[0].energy_mj()
    assert d0.energy_reader()() == d0.energy_mj()
    assert d0.power_mw() == round(system.gpus[0].power_mw() / 1000) * 1000  # W -> mW
    assert d0.average_power_mw() == d0.instant_power_mw() == d0.power_mw()  # MI300X: current socket power
    assert d0.one_second_power_mw() is None
    assert d0.power_usage_domain == "device_instant"  # MI300: current_socket_power, no one-second average
    assert d0.power_domains_mw(["device_instant", "device_average", "memory_average"]) == [
        d0.power_mw(),
        None,
        None,
    ]
    assert d0.temperature_c() == 36  # the dump's idle junction temperature, in °C


def test_power_cap_range_default_and_setter_in_milliwatts():
    system, (d0, _) = devices()
    assert d0.power_limit_scope == "gpu"
    assert d0.power_limit_constraints_mw() == (250_000, 750_000)
    assert d0.default_power_limit_mw() == d0.power_limit_mw() == d0.enforced_power_limit_mw() == 750_000
    d0.set_power_limit_mw(425_000)
    assert d0.power_limit_mw() == 425_000 and system.gpus[0].power_limit_mw == 425_000


def test_a_cap_that_cannot_be_lowered_points_at_the_clocks():
    system, (d0, _) = devices()
    system.gpus[0].min_power_limit_mw = system.gpus[0].max_power_limit_mw
    with pytest.raises(GPUNotSupportedError, match="cannot be lowered.*clocks"):
        d0.power_limit_scope  # noqa: B018


def test_clocks_lock_and_reset_in_megahertz():
    system, (d0, _) = devices()
    assert d0.supported_memory_clocks_mhz() == [1300, 1100, 900]
    sm = d0.supported_sm_clocks_mhz()
    assert sm[0] == 2100 and sm[-1] == 500 and sm == sorted(sm, reverse=True)
    d0.lock_sm_clocks(500, 1200)
    assert system.gpus[0].locked_sm_clocks_mhz == (500, 1200) and d0.clocks_mhz()[0] <= 1200
    d0.reset_sm_clocks()
    assert system.gpus[0].locked_sm_clocks_mhz is None and d0.clocks_mhz() == (2100, 900)


def test_one_frequency_is_locked_through_performance_determinism():
    """The pipeline optimizer locks one clock (min == max). The real amdsmi refuses that range (rocm_smi.cc
    `rsmi_dev_clk_range_set`: min >= max is INVAL), so the lock goes through performance determinism: the clock
    is held at it, the soft min back at the lowest level, as amdgpu sets it; AUTO gives it back."""
    system, (d0, _) = devices()
    a = d0.amdsmi
    with pytest.raises(a.AmdSmiLibraryException) as e:  # the simulated library refuses as the real one does
        a.amdsmi_set_gpu_clk_range(d0.handle, 1200, 1200, a.AmdSmiClkType.GFX)
    assert e.value.get_error_code() == a.amdsmi_wrapper.AMDSMI_STATUS_INVAL
    d0.lock_sm_clocks(1200, 1200)
    assert system.gpus[0].locked_sm_clocks_mhz == (500, 1200)
    system.run_step(0.5)
    assert d0.clocks_mhz()[0] == 1200
    d0.reset_sm_clocks()
    assert system.gpus[0].locked_sm_clocks_mhz is None and d0.clocks_mhz()[0] == 2100
    with pytest.raises(GPUNotSupportedError):  # amdgpu: "Invalid max frequency ... for determinism"
        d0.lock_sm_clocks(2500, 2500)


def test_persistence_is_not_an_amd_concept():
    _, (d0, _) = devices()
    with pytest.raises(GPUNotSupportedError, match="AMD GPUs have no persistence mode"):
        d0.persistence_mode()
    with pytest.raises(GPUNotSupportedError, match="AMD GPUs have no persistence mode"):
        d0.set_persistence_mode(True)


@pytest.mark.parametrize(
    ("faults", "call", "error", "words"),
    [
        ("no_permission", lambda d: d.set_power_limit_mw(400_000), GPUNoPermissionError, ("root", "zeusd")),
        ("no_permission", lambda d: d.lock_sm_clocks(500, 1000), GPUNoPermissionError, ("root", "zeusd")),
        (
            "not_supported=power",
            lambda d: d.power_limit_constraints_mw(),
            GPUNotSupportedError,
            ("not supported",),
        ),
        (
            "not_supported=clocks",
            lambda d: d.lock_sm_clocks(500, 1000),
            GPUNotSupportedError,
            ("not supported",),
        ),
        ("lost_after=40", lambda d: [d.energy_mj() for _ in range(100)], GPULostError, ("amd-smi", "reset")),
    ],
)
def test_amdsmi_errors_become_this_packages_with_a_remedy(faults, call, error, words):
    _, (d0, _) = devices(faults=faults)
    with pytest.raises(error) as e:
        call(d0)
    assert d0.label in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_hip_numbering_follows_rocr_then_hip_visible_devices(monkeypatch):
    system, _ = devices("4*mi300x")
    uuids = [g.uuid for g in system.gpus]
    backend = SimulatedAMDBackend(system)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,0")
    assert [d.uuid for d in backend.devices()] == [uuids[2], uuids[0]]
    assert [d.label for d in backend.devices()][0].startswith("GPU 0 ")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "1,3")  # applied first: HIP's 0 and 1 are then GPUs 1 and 3
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert [d.uuid for d in backend.devices()] == [uuids[3]]
    assert system.cuda_gpus() == [system.gpus[3]]  # where the simulator queues HIP device 0's work
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids[1][:10])  # HIP reads it without HIP_VISIBLE_DEVICES
    assert [d.uuid for d in backend.devices()] == [uuids[1]]


def test_a_partitioned_gpu_is_refused():
    from zeus_callbacks.core.device.errors import MIGNotSupportedError

    with pytest.raises(MIGNotSupportedError, match="compute partitions"):
        devices(faults="mig@1")


def test_without_libamd_smi_there_is_no_amd_backend(capsys):
    if any(Path(p, "libamd_smi.so").exists() for p in ("/opt/rocm/lib", Path(amd.__file__).parent)):
        pytest.skip("a real libamd_smi.so is installed")
    sim.disable()
    assert amd.real_backend() is None
    assert "amdsmi" not in sys.modules and capsys.readouterr().out == ""  # amdsmi's own print is swallowed


def test_the_device_layer_finds_the_simulated_mi300xs():
    sim.simulate("2*mi300x", virtual_clock=True)
    gpus = get_gpus()
    assert [g.device.vendor for g in gpus] == ["amd", "amd"]
    assert isinstance(gpus[0].device, amd.AMDDevice)


def test_the_mi300x_power_sensor_is_amds_own_assumption():
    """The energy bound's sensor figures: AMD publishes no update period for Instinct boards, so the entry says
    ASSUMED for AMD, not that a CDNA3 board comes "after Hopper"."""
    sim.simulate("2*mi300x", virtual_clock=True)
    source = power_sensor(get_gpus()[0]).source
    assert source.startswith("ASSUMED") and "AMD" in source and "Hopper" not in source


def test_the_power_limit_optimizer_chooses_a_cap_and_restores_both_mi300xs():
    """Virtual clock, 2 MI300Xs (A40 traces scaled to 250-750 W, MODELLED): Energy() settles on a cap within 2%
    of the modelled curve's least energy, sets both GPUs to it, and train end puts both back at 750 W."""
    system = sim.simulate("2*mi300x", virtual_clock=True, noise=0.02, seed=1)
    opt = GlobalPowerLimitOptimizer(ZeusMonitor(), Energy())
    for _ in range(5000):
        opt.on_step_begin()
        system.run_step(0.1)
        opt.on_step_end()
        if opt.phase == "done":
            break
    assert opt.phase == "done"
    chosen = opt.optimal_power_limit_w
    assert 250 <= chosen < 750
    assert [g.power_limit_mw for g in system.gpus] == [chosen * 1000] * 2
    trace = system.gpus[0].trace
    grid = np.arange(750, 249, -25)
    energy = np.array([trace.relative_time(w) * trace.power(w) for w in grid])
    assert trace.relative_time(chosen) * trace.power(chosen) <= 1.02 * energy.min()
    opt.on_train_end()
    assert [g.power_limit_mw for g in system.gpus] == [750_000, 750_000]


@pytest.mark.system
@pytest.mark.parametrize("command", ["devices", "doctor"])
def test_cli_on_two_simulated_mi300xs(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "2*mi300x")
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_STATE_DIR", str(tmp_path / "state"))
    rc, out, err = run_cli(capsys, [command])
    assert rc == 0, err
    assert out.count("AMD Instinct MI300X") == 2 and "SIMULATED" in out and "250-750" in out
    assert "NVML" not in out and "nvml" not in out  # the vendor library is named as it is: amdsmi
    if command == "devices":
        assert out.splitlines()[1].split()[:2] == ["GPU", "amdsmi"]  # the column of amdsmi's indices
    if command == "doctor":
        from importlib.metadata import version

        assert f"amdsmi {version('amdsmi')}" in out and "OK" in out  # amdsmi_get_lib_version: the package's
        assert "settings go through: direct" in out  # the in-process route's vendor-neutral name


def test_clock_locks_through_the_gpu_policy_are_undone_when_the_gpus_are_released():
    """The pipeline optimizer's knob on AMD: a lock through `GPU` (journalled) and its undoing at release."""
    from zeus_callbacks.core.device import gpus as devices_module

    system = sim.simulate("2*mi300x", virtual_clock=True)
    gpu = get_gpus()[1]
    clocks = gpu.supported_sm_clocks_mhz()
    gpu.lock_sm_clocks(clocks[-1], clocks[len(clocks) // 2])
    assert system.gpus[1].locked_sm_clocks_mhz == (clocks[-1], clocks[len(clocks) // 2])
    devices_module.reset()  # what every end of a run does: restore what this process changed
    assert system.gpus[1].locked_sm_clocks_mhz is None and system.gpus[1].power_limit_mw == 750_000


def test_nvidia_and_amd_gpus_visible_at_once_are_refused_in_one_line():
    """Discovery with both vendors' backends seeing GPUs (a simulated A40 beneath NVML, a simulated MI300X beneath
    amdsmi, each attached on its own as a real node would present them)."""
    from zeus_callbacks.core.device.backend import real_backend
    from zeus_callbacks.core.device.errors import MixedVendorError
    from zeus_callbacks.sim import amd_backend, nvml_library
    from zeus_callbacks.sim.backend import SimulatedBackend

    nvidia = sim.SimulatedSystem("a40", virtual_clock=True, state_dir="")
    amd_node = sim.SimulatedSystem("mi300x", virtual_clock=True, state_dir="")
    nvml_library.attach(nvidia)
    amd_backend.attach(amd_node)
    try:
        found = [SimulatedBackend(nvidia), SimulatedAMDBackend(amd_node)]
        for backend in found:
            backend.init()  # as each vendor's real_backend() does
        assert [b.gpu_count() for b in found] == [1, 1]
        with pytest.raises(MixedVendorError) as e:
            real_backend([lambda: found[0], lambda: found[1]])
        assert "nvidia and amd" in str(e.value) and "HIP_VISIBLE_DEVICES" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        amd_backend.attach(None)
        nvml_library.attach(None)


@pytest.mark.slow
def test_a_hard_death_on_mi300xs_is_undone_by_the_restore_watchdog(sim_gpus):
    """A process that capped one MI300X and locked the other's clock, then died by SIGKILL: its watchdog (a
    process of its own, reaching the GPUs through amdsmi as well) puts both back."""
    import os
    import signal
    import subprocess
    import time

    system = sim_gpus("2*mi300x")
    code = (
        "import os; from zeus_callbacks.core.device.gpus import get_gpus; g = get_gpus();"
        "g[1].set_power_limit_mw(400_000); g[0].lock_sm_clocks(500, 1000); os.kill(os.getpid(), 9)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ), capture_output=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    deadline = time.monotonic() + 30  # an outcome: back at all, however loaded the host
    while system.gpus[1].power_limit_mw != 750_000 or system.gpus[0].locked_sm_clocks_mhz is not None:
        assert time.monotonic() < deadline, (
            system.gpus[1].power_limit_mw,
            system.gpus[0].locked_sm_clocks_mhz,
        )
        time.sleep(0.05)


@pytest.mark.system
def test_no_visible_mi300x_names_hips_variables(capsys, monkeypatch, tmp_path):
    """HIP_VISIBLE_DEVICES='' hides every AMD GPU: `devices` says which variables select them, HIP's among them."""
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "2*mi300x")
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    rc, out, _ = run_cli(capsys, ["devices"])
    assert rc == 0 and "No GPU is visible" in out and "HIP_VISIBLE_DEVICES" in out
