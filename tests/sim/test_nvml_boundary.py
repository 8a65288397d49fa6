"""The simulator answers at NVML's C boundary: what the package and Zeus call is nvidia-ml-py's own code."""

from __future__ import annotations

import ctypes
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path

import pynvml
import pytest

from zeus_callbacks import ZeusMonitor, sim
from zeus_callbacks.core.device.backend import active_backend
from zeus_callbacks.core.device.errors import GPUNoPermissionError
from zeus_callbacks.core.device.gpus import get_gpus
from zeus_callbacks.sim import fake_nvml, nvml_library
from zeus_callbacks.sim.nvml_library import SimulatedNVMLLibrary


def _nvidia_ml_py_file() -> Path:
    dist = importlib.metadata.distribution("nvidia-ml-py")
    (record,) = [f for f in dist.files or [] if str(f) == "pynvml.py"]
    return Path(record.locate()).resolve()


@pytest.fixture
def looked_up(monkeypatch) -> list[tuple[str, object]]:
    """Every (name, function) that pynvml's wrappers get from `_nvmlGetFunctionPointer`."""
    seen: list[tuple[str, object]] = []
    real = pynvml._nvmlGetFunctionPointer

    def recording(name):
        fn = real(name)
        seen.append((name, fn))
        return fn

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", recording)
    return seen


def test_the_package_calls_nvidia_ml_pys_pynvml_over_the_simulated_library(sim_gpus, looked_up):
    system = sim_gpus("2*a40", virtual_clock=True)
    backend = active_backend()
    assert backend.nvml is pynvml and sys.modules["pynvml"] is pynvml
    assert Path(pynvml.__file__).resolve() == _nvidia_ml_py_file()
    assert isinstance(pynvml.nvmlLib, SimulatedNVMLLibrary) and pynvml.nvmlLib.system is system
    gpus = get_gpus()
    assert isinstance(gpus[0].device.handle, pynvml.c_nvmlDevice_t)
    energy = gpus[0].energy_mj()
    assert energy == system.gpus[0].energy_mj()
    names = [name for name, _ in looked_up]
    for name in ("nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
                 "nvmlDeviceGetUUID", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetName",
                 "nvmlDeviceGetTotalEnergyConsumption"):  # fmt: skip
        assert name in names, names
    # Each function pynvml got is a C function pointer of the simulated library, and nothing else.
    for name, fn in looked_up:
        assert isinstance(fn, ctypes._CFuncPtr) and fn is getattr(pynvml.nvmlLib, name), name


def test_a_value_the_simulator_decides_reaches_the_package_through_the_c_call(
    sim_gpus, looked_up, monkeypatch
):
    sim_gpus("a40")
    gpu = get_gpus()[0]
    got = []

    def limit(handle):  # the simulator's semantics, beneath the callback
        got.append(handle)
        return 123_456

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetPowerManagementLimit", limit)
    looked_up.clear()
    assert gpu.power_limit_mw() == 123_456
    assert [name for name, _ in looked_up] == ["nvmlDeviceGetPowerManagementLimit"]
    assert got == [sim.simulated_gpu(gpu)]  # the callback mapped pynvml's handle back to the GPU


def test_errors_come_from_pynvmls_own_return_check(sim_gpus, monkeypatch):
    sim_gpus("a40", faults="no_cap_sys_admin")
    checked = []
    real = pynvml._nvmlCheckReturn

    def recording(ret):
        checked.append(ret)
        return real(ret)

    monkeypatch.setattr(pynvml, "_nvmlCheckReturn", recording)
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NoPermission) as refused:
        pynvml.nvmlDeviceSetPowerManagementLimit(h, 200_000)
    assert checked[-1] == pynvml.NVML_ERROR_NO_PERMISSION
    assert type(refused.value).__module__ == "pynvml" and str(refused.value) == "Insufficient Permissions"
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(7)
    assert checked[-1] == pynvml.NVML_ERROR_INVALID_ARGUMENT
    # The package's typed error comes from the same mapping.
    with pytest.raises(GPUNoPermissionError):
        get_gpus()[0].set_power_limit_mw(200_000)


def test_structures_are_filled_by_the_callbacks(sim_gpus):
    system = sim_gpus("t4,a40", faults="empty_clocks@1", virtual_clock=True)
    pynvml.nvmlInit()
    t4, a40 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    assert pynvml.nvmlDeviceGetName(t4) == "Tesla T4" and pynvml.nvmlDeviceGetUUID(a40) == system.gpus[1].uuid

    pci = pynvml.nvmlDeviceGetPciInfo(a40)
    assert isinstance(pci, pynvml.nvmlPciInfo_t) and pci.busId == system.gpus[1].pci_bus_id
    assert (pci.domain, pci.bus) == (0, int(system.gpus[1].pci_bus_id.split(":")[1], 16))

    memory = pynvml.nvmlDeviceGetMemoryInfo(a40)
    memory_v2 = pynvml.nvmlDeviceGetMemoryInfo(a40, version=pynvml.nvmlMemory_v2)
    assert isinstance(memory, pynvml.c_nvmlMemory_t) and isinstance(memory_v2, pynvml.c_nvmlMemory_v2_t)
    assert memory.total == memory_v2.total == system.gpus[1].spec.memory_bytes

    fields = pynvml.nvmlDeviceGetFieldValues(
        t4, [(pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU), pynvml.NVML_FI_DEV_ENERGY]
    )
    assert isinstance(fields[0], pynvml.c_nvmlFieldValue_t)
    assert [(f.fieldId, f.nvmlReturn) for f in fields] == [
        (pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_SUCCESS),
        (pynvml.NVML_FI_DEV_ENERGY, pynvml.NVML_ERROR_NOT_SUPPORTED),
    ]
    assert fields[0].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert fields[0].value.uiVal == int(system.gpus[0].power_mw()) and fields[0].timestamp > 0

    # NVML's two-call size protocol, in pynvml's own code: the count first, then the array.
    memory_clocks = pynvml.nvmlDeviceGetSupportedMemoryClocks(t4)
    assert memory_clocks == list(system.gpus[0].spec.memory_clocks_mhz)
    sm_clocks = pynvml.nvmlDeviceGetSupportedGraphicsClocks(t4, memory_clocks[0])
    assert sm_clocks == system.gpus[0].spec.supported_sm_clocks_mhz()
    assert pynvml.nvmlDeviceGetSupportedGraphicsClocks(a40, system.gpus[1].spec.memory_clocks_mhz[0]) == []
    assert pynvml.nvmlDeviceGetMigMode(a40) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2
    assert pynvml.nvmlDeviceGetTemperatureV(a40, pynvml.NVML_TEMPERATURE_GPU) > 0


def test_a_function_the_library_lacks_is_function_not_found_from_pynvml(sim_gpus):
    system = sim_gpus("a40")
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetBAR1MemoryInfo(h)
    # A driver older than nvmlDeviceGetArchitecture.
    nvml_library.attach(system, withheld=frozenset({"nvmlDeviceGetArchitecture"}))
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetArchitecture(h)
    assert "nvmlDeviceGetArchitecture" not in pynvml._nvmlGetFunctionPointer_cache
    assert pynvml.nvmlDeviceGetName(h) == "NVIDIA A40"


def test_handles_are_fake_pointers_mapped_back_to_their_gpus(sim_gpus):
    system = sim_gpus("2*a40")
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    addresses = [ctypes.cast(h, ctypes.c_void_p).value for h in handles]
    assert all(addresses) and len(set(addresses)) == 2
    assert [sim.simulated_gpu(h) for h in handles] == system.gpus
    assert sim.simulated_gpu(pynvml.nvmlDeviceGetHandleByUUID(system.gpus[1].uuid)) is system.gpus[1]
    sim_gpus("2*a40", seed=1)  # another node: the old handles name no GPU of it
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetName(handles[0])
    with pytest.raises(ValueError, match="not a handle of the simulated GPUs"):
        sim.simulated_gpu(handles[0])


def test_an_exception_raised_inside_a_call_is_raised_once_the_call_returns(sim_gpus, monkeypatch):
    """As a signal arriving during a driver call is handled right after it, never swallowed as success."""
    sim_gpus("a40")
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def interrupted(handle):
        raise KeyboardInterrupt

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetTotalEnergyConsumption", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    monkeypatch.undo()
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) >= 0


def _c_names(name: str) -> set[str]:
    """The C functions pynvml's wrapper `name` looks up, following wrappers that call other wrappers."""
    source = inspect.getsource(getattr(pynvml, name))
    found = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', source))
    if not found:
        for callee in set(re.findall(r"\b(nvml\w+)\(", source)) - {name}:
            if callable(getattr(pynvml, callee, None)):
                found |= _c_names(callee)
    return found


def test_every_function_of_the_simulators_nvml_is_offered_at_the_c_boundary():
    """Nothing the simulator answers is reachable only through the Python-level `fake_nvml`."""
    names = [n for n in vars(fake_nvml) if n.startswith("nvml") and callable(getattr(pynvml, n, None))]
    assert "nvmlDeviceGetTotalEnergyConsumption" in names
    missing = {n: sorted(_c_names(n) - nvml_library.offered_functions()) for n in names}
    assert {n: c for n, c in missing.items() if c} == {}


@pytest.mark.system
def test_zeus_measures_the_simulated_gpus_through_the_real_pynvml(sim_gpus):
    zeus_gpu = pytest.importorskip("zeus.device.gpu")
    import zeus.device.gpu.nvidia as zeus_nvidia
    from zeus.monitor import ZeusMonitor as ZeusZeusMonitor

    assert zeus_nvidia.pynvml is pynvml and sys.modules["pynvml"] is pynvml  # no module swapped in
    system = sim_gpus("2*a40", virtual_clock=True)
    zeus_gpu._gpus = None  # Zeus caches its GPUs and NVML's availability per process
    zeus_nvidia.nvml_is_available.cache_clear()
    try:
        theirs = ZeusZeusMonitor(gpu_indices=[0, 1], cpu_indices=[])
        ours = ZeusMonitor(gpu_indices=[0, 1])
        before = [g.energy_mj() for g in system.gpus]
        theirs.begin_window("step", sync_execution=False)
        ours.begin_window("step")
        system.run_step(2.0)
        mine = ours.end_window("step")
        measured = theirs.end_window("step", sync_execution=False)
        truth = {i: (int(g.energy_mj()) - int(before[i])) / 1000 for i, g in enumerate(system.gpus)}
        assert truth[0] > 0
        assert measured.gpu_energy == truth == mine.gpu_energy  # whole mJ of the counter, as NVML's
        assert zeus_gpu.get_gpus().get_name(1) == "NVIDIA A40"
        ours.close()
    finally:
        zeus_gpu._gpus = None
        zeus_nvidia.nvml_is_available.cache_clear()


def test_sim_disable_gives_pynvml_back_its_library(sim_gpus, no_nvidia_driver):
    sim_gpus("a40")
    assert pynvml.nvmlLib is not None
    sim.disable()
    assert pynvml.nvmlLib is None and nvml_library.installed() is None
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        pynvml.nvmlInit()  # the real driver's loader, which finds no driver on this machine


@pytest.mark.system
def test_a_real_run_leaves_pynvml_untouched(run_python):
    child = run_python(
        "import sys, pynvml\n"
        "from zeus_callbacks.core.device.gpus import get_gpus\n"
        "try:\n"
        "    get_gpus()\n"
        "except Exception as e:\n"
        "    print('no GPU:', type(e).__name__)\n"
        "print('library:', type(pynvml.nvmlLib).__name__)\n"
        "module = sys.modules.get('zeus_callbacks.sim.nvml_library')\n"
        "print('installed:', None if module is None else module.installed())\n"
    )
    assert child.returncode == 0, child.stderr
    assert "SimulatedNVMLLibrary" not in child.stdout and "installed: None" in child.stdout, child.stdout
