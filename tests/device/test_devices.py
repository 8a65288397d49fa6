"""The NVML layer against the simulator: values, units, settings, CUDA_VISIBLE_DEVICES, faults, errors."""

from __future__ import annotations

import pytest

from zeus_callbacks.core.device import gpus as devices
from zeus_callbacks.core.device.errors import (
    GPULostError,
    GPUNoPermissionError,
    GPUNotSupportedError,
    MIGNotSupportedError,
    NVMLUnavailableError,
)
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.core.device.state_guard import guard
from zeus_callbacks.core.monitor.monitor import ZeusMonitor


def test_identity(sim_gpus):
    sim_gpus("2*a40")
    gpus = get_gpus()
    assert len(gpus) == 2 and gpus.simulated and not gpus.virtual_clock
    g = gpus[1]
    assert (g.index, g.nvml_index, g.name, g.simulated) == (1, 1, "NVIDIA A40", True)
    assert g.uuid.startswith("GPU-") and g.uuid != gpus[0].uuid
    assert g.label == "GPU 1 (NVIDIA A40, simulated)"
    assert g.supports_energy_counter
    assert g.memory_bytes() == 48 * 1024**3


@pytest.mark.system  # energy and power read off the real clock
def test_units(sim_gpus, burn_cpu):
    """Energy in mJ and power in mW, to the order of magnitude (the exact counter on the virtual clock:
    tests/sim/test_strict.py::test_energy_counter_moves_only_at_the_drivers_refreshes)."""
    system = sim_gpus("2*a40")
    g = get_gpus()[1]
    # 1 s of work (10 refreshes of the A40's counter) at 300 W on the A40 trace draws ~235 W.
    g.synchronize()
    e0 = g.energy_mj()
    assert isinstance(e0, int)
    wall = burn_cpu(1.0)
    g.synchronize()
    busy_w, idle_w = system.gpus[1].trace.power(300), system.gpus[1].spec.idle_power_w
    # The GPU idles through the wall time that other processes take from this one on a loaded host.
    expected_j = 1.0 * busy_w + max(0.0, wall - 1.0) * idle_w
    assert expected_j * 1000 / 2 < g.energy_mj() - e0 < expected_j * 1000 * 2  # mJ, not J nor uJ
    # Power in mW: idle when nothing ran for a while, busy right after work.
    assert isinstance(g.power_mw(), int)
    assert 25_000 < g.power_mw() <= 240_000


def test_power_limits(sim_gpus):
    sim_gpus("a40")
    g = get_gpus()[0]
    assert g.power_limit_constraints_mw() == (100_000, 300_000)
    assert g.default_power_limit_mw() == 300_000
    assert g.power_limit_mw() == 300_000
    g.set_power_limit_mw(175_000)
    assert g.power_limit_mw() == 175_000
    assert [e.knob for e in guard().entries] == ["power_limit"]
    assert guard().entries[0].original == 300_000
    with pytest.raises(
        ValueError,
        match=r"Power limit 350 W is outside GPU 0 \(NVIDIA A40, simulated\)'s range \[100, 300\] W",
    ):
        g.set_power_limit_mw(350_000)
    assert g.power_limit_mw() == 175_000


def test_persistence_mode(sim_gpus):
    sim_gpus("a40")
    g = get_gpus()[0]
    assert g.persistence_mode() is False
    g.set_persistence_mode(True)
    assert g.persistence_mode() is True
    assert guard().entries[0].knob == "persistence" and guard().entries[0].original is False


def test_clocks(sim_gpus):
    system = sim_gpus("v100")
    g = get_gpus()[0]
    assert g.supported_memory_clocks_mhz() == [877]
    sm = g.supported_sm_clocks_mhz()
    assert sm[0] == 1380 and sm[-1] >= 135 and sm == sorted(sm, reverse=True)
    assert g.supported_sm_clocks_mhz(877) == sm
    with pytest.raises(Exception, match="Reading SM clocks"):
        g.supported_sm_clocks_mhz(1234)
    g.lock_sm_clocks(sm[-1], 900)
    assert system.gpus[0].locked_sm_clocks_mhz == (sm[-1], 900)
    assert g.device.clocks_mhz()[0] <= 900
    g.reset_sm_clocks()
    assert system.gpus[0].locked_sm_clocks_mhz is None


def test_a10g_and_t4_constraints(sim_gpus):
    sim_gpus("a10g,t4")
    a10g, t4 = get_gpus()
    assert (a10g.name, t4.name) == ("NVIDIA A10G", "Tesla T4")
    assert a10g.power_limit_constraints_mw() == (100_000, 300_000)
    assert t4.power_limit_constraints_mw() == (60_000, 70_000)


def test_may_change_settings(sim_gpus):
    sim_gpus("2*a40", faults="no_permission@1")
    gpus = get_gpus()
    assert gpus[0].may_change_settings() and not gpus[1].may_change_settings()


# -- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("2,0", [2, 0]),
        ("3", [3]),
        ("1,7,0", [1]),  # CUDA stops at the first invalid entry
        ("1,-1,0", [1]),
        ("0,,2", [0]),
        ("", []),
    ],
)
def test_cuda_visible_devices_indices(sim_gpus, monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    sim_gpus("4*a40")
    gpus = get_gpus()
    assert [g.nvml_index for g in gpus] == expected
    assert [g.index for g in gpus] == list(range(len(expected)))


def test_cuda_visible_devices_uuids(sim_gpus, monkeypatch):
    system = sim_gpus("4*a40")
    uuids = [g.uuid for g in system.gpus]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{uuids[3]},{uuids[1][:12]},2")
    devices.reset()
    gpus = get_gpus()
    assert [g.nvml_index for g in gpus] == [3, 1, 2]
    assert gpus[0].uuid == uuids[3]
    # A prefix that matches several GPUs, or none, ends the list as an invalid entry does.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,GPU-,1")
    devices.reset()
    assert [g.nvml_index for g in get_gpus()] == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-zzzz,1")
    devices.reset()
    assert len(get_gpus()) == 0


def test_cuda_visible_devices_refuses_mig_and_duplicates(sim_gpus, monkeypatch):
    sim_gpus("2*a40")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5b3a6a4e-aaaa-bbbb-cccc-0123456789ab")
    devices.reset()
    with pytest.raises(MIGNotSupportedError, match="MIG device.*Select whole GPUs"):
        get_gpus()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,1")
    devices.reset()
    with pytest.raises(ValueError, match="names a GPU twice"):
        get_gpus()


# -- injected faults ---------------------------------------------------------------------------------------
def test_fault_no_permission(sim_gpus):
    sim_gpus("a40", faults="no_permission")
    g = get_gpus()[0]
    assert g.power_limit_mw() == 300_000  # reading needs no permission
    with pytest.raises(GPUNoPermissionError, match="CAP_SYS_ADMIN") as err:
        g.set_power_limit_mw(200_000)
    assert "measuring still works" in str(err.value)
    with pytest.raises(GPUNoPermissionError, match="CAP_SYS_ADMIN"):
        g.lock_sm_clocks(210, 1000)
    with pytest.raises(GPUNoPermissionError):
        g.set_persistence_mode(True)
    assert g.power_limit_mw() == 300_000
    assert guard().entries == []  # refused changes leave nothing to restore


def test_fault_no_permission_from_environment(monkeypatch, sim_state_dir):
    monkeypatch.setenv("ZEUS_CALLBACKS_SIMULATE", "2*a40")
    monkeypatch.setenv("ZEUS_CALLBACKS_SIM_FAULTS", "no_permission@1")
    gpus = get_gpus()
    gpus[0].set_power_limit_mw(200_000)
    with pytest.raises(GPUNoPermissionError):
        gpus[1].set_power_limit_mw(200_000)


@pytest.mark.parametrize(
    ("what", "call"),
    [
        ("power", lambda g: g.power_limit_constraints_mw()),
        ("power", lambda g: g.set_power_limit_mw(200_000)),
        ("clocks", lambda g: g.supported_sm_clocks_mhz()),
        ("clocks", lambda g: g.lock_sm_clocks(210, 1000)),
        ("persistence", lambda g: g.persistence_mode()),
    ],
)
def test_fault_not_supported(sim_gpus, what, call):
    sim_gpus("a40", faults=f"not_supported={what}")
    g = get_gpus()[0]
    with pytest.raises(GPUNotSupportedError, match="not supported on GPU 0"):
        call(g)
    assert guard().entries == []
    assert g.energy_mj() >= 0  # everything else still works


def test_fault_lost_after(sim_gpus):
    sim_gpus("2*a40", faults="lost_after=20@1")
    gpus = get_gpus()
    with pytest.raises(GPULostError, match="fell off the bus") as err:
        for _ in range(25):
            gpus[1].energy_mj()
    assert "GPU 1" in str(err.value)
    with pytest.raises(GPULostError):
        gpus[1].power_limit_mw()
    assert gpus[0].power_limit_mw() == 300_000  # the other GPU is fine
    monitor = ZeusMonitor(gpu_indices=[0])
    monitor.begin_window("w")
    assert monitor.end_window("w").gpu_energy[0] >= 0


def test_fault_lost_during_a_window(sim_gpus):
    sim_gpus("a40", faults="lost_after=9")
    monitor = ZeusMonitor()
    with pytest.raises(GPULostError, match="Reading the energy counter"):
        for i in range(10):
            monitor.begin_window(f"w{i}", sync_execution=False)


def test_fault_no_energy_counter_falls_back_to_sampling(sim_gpus):
    # GPU 0's counter is the reference the sampled GPU 1 is compared with: keep it exact, and GPU 1's power
    # reading the draw of the last interval (not the driver's update period and window).
    system = sim_gpus(
        "2*a40",
        faults="no_energy_counter@1",
        virtual_clock=True,
        ideal="energy_counter,power_window,sensor_gain",  # two boards, one exact sensor
    )
    gpus = get_gpus()
    assert gpus[0].supports_energy_counter and not gpus[1].supports_energy_counter
    system.run_step(0.05)  # GPU 1's last interval is busy when sampling starts
    monitor = ZeusMonitor(power_sample_interval_s=0.01)
    try:
        monitor.begin_window("w")
        for _ in range(5):
            system.run_step(0.02)
        m = monitor.end_window("w")
    finally:
        monitor.close()
    # The counter (whole mJ) and the sampled power agree: on the virtual clock the sampling error vanishes.
    assert m.gpu_energy[1] == pytest.approx(m.gpu_energy[0], abs=2e-3)


def test_fault_mig(sim_gpus):
    sim_gpus("2*a40", faults="mig@1")
    with pytest.raises(MIGNotSupportedError, match=r"GPU 1 .*MIG mode.*nvidia-smi -i 1 -mig 0"):
        get_gpus()


def test_fault_mig_outside_visible_devices_is_fine(sim_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    sim_gpus("2*a40", faults="mig@1")
    assert len(get_gpus()) == 1


# -- no GPU, no simulation ---------------------------------------------------------------------------------
def test_no_driver_and_no_simulation_names_the_switch(no_nvidia_driver):
    with pytest.raises(NVMLUnavailableError, match="ZEUS_CALLBACKS_SIMULATE=a40"):
        get_gpus()
    with pytest.raises(NVMLUnavailableError, match="ZEUS_CALLBACKS_SIMULATE"):
        ZeusMonitor()
