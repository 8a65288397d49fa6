"""A `pynvml`-shaped module backed by simulated GPUs: same function names, units and error classes.

The package's NVML layer (and Zeus, for side-by-side benchmarks) call this module exactly as they call
`pynvml`; errors are the real `pynvml.NVMLError` subclasses.
"""

from __future__ import annotations

from collections import namedtuple

import pynvml as _real

from zeus_callbacks.sim.system import SimulatedGPU, SimulatedSystem

# Re-export NVML constants and error classes so `fake_nvml.NVMLError_NoPermission` etc. exist.
for _name in dir(_real):
    if _name.startswith(("NVML_", "NVMLError")) or _name in ("nvmlFriendlyObjectToStruct",):
        globals()[_name] = getattr(_real, _name)
NVMLError = _real.NVMLError

SIMULATED = True  # lets callers label what they report

_system: SimulatedSystem | None = None
_initialized = 0

_MemoryInfo = namedtuple("_MemoryInfo", "total free used")


def attach(system: SimulatedSystem | None) -> None:
    """Make `system` the node this module answers for (None detaches)."""
    global _system, _initialized
    _system = system
    _initialized = 0


def system() -> SimulatedSystem | None:
    """The attached simulated node."""
    return _system


def _nvmlGetFunctionPointer(name: str):  # noqa: N802
    """Present because Zeus checks for it to tell the official bindings from an unofficial `pynvml`."""
    raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


def _gpu(handle: object, *, feature: str | None = None, setter: bool = False) -> SimulatedGPU:
    if not _initialized:
        raise _err(_real.NVML_ERROR_UNINITIALIZED)
    if not isinstance(handle, SimulatedGPU):
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    if handle.count_call():
        raise _err(_real.NVML_ERROR_GPU_IS_LOST)
    if feature is not None and feature in handle.faults.not_supported:
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
    if setter and handle.faults.no_permission:
        raise _err(_real.NVML_ERROR_NO_PERMISSION)
    return handle


# -- library --------------------------------------------------------------------------------------
def nvmlInit() -> None:  # noqa: N802 (NVML's names)
    global _initialized
    if _system is None:
        raise _err(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
    _initialized += 1


nvmlInitWithFlags = lambda flags=0: nvmlInit()  # noqa: E731


def nvmlShutdown() -> None:  # noqa: N802
    global _initialized
    if not _initialized:
        raise _err(_real.NVML_ERROR_UNINITIALIZED)
    _initialized -= 1


def nvmlSystemGetDriverVersion() -> str:  # noqa: N802
    return "simulated"


def nvmlDeviceGetCount() -> int:  # noqa: N802
    if not _initialized or _system is None:
        raise _err(_real.NVML_ERROR_UNINITIALIZED)
    return len(_system.gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> SimulatedGPU:  # noqa: N802
    count = nvmlDeviceGetCount()
    if not 0 <= index < count:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    return _system.gpus[index]  # type: ignore[union-attr]


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> SimulatedGPU:  # noqa: N802
    nvmlDeviceGetCount()
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    for g in _system.gpus:  # type: ignore[union-attr]
        if g.uuid == text:
            return g
    raise _err(_real.NVML_ERROR_NOT_FOUND)


# -- identity -------------------------------------------------------------------------------------
def nvmlDeviceGetUUID(handle) -> str:  # noqa: N802
    return _gpu(handle).uuid


def nvmlDeviceGetName(handle) -> str:  # noqa: N802
    return _gpu(handle).spec.name


def nvmlDeviceGetIndex(handle) -> int:  # noqa: N802
    return _gpu(handle).index


def nvmlDeviceGetArchitecture(handle) -> int:  # noqa: N802
    g = _gpu(handle)
    return _real.NVML_DEVICE_ARCH_PASCAL if g.faults.no_energy_counter else g.spec.architecture


def nvmlDeviceGetMigMode(handle) -> list[int]:  # noqa: N802
    on = _gpu(handle).faults.mig
    mode = _real.NVML_DEVICE_MIG_ENABLE if on else _real.NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMemoryInfo(handle) -> _MemoryInfo:  # noqa: N802
    total = _gpu(handle).spec.memory_bytes
    return _MemoryInfo(total, total, 0)


def nvmlDeviceGetC2cModeInfoV(handle):  # noqa: N802
    _gpu(handle)
    raise _err(_real.NVML_ERROR_NOT_SUPPORTED)


# -- energy and power -----------------------------------------------------------------------------
def nvmlDeviceGetTotalEnergyConsumption(handle) -> int:  # noqa: N802
    if _initialized and type(handle) is SimulatedGPU and handle.plain_reads:
        return int(handle.energy_mj())  # the monitor's hot path: no fault can apply
    g = _gpu(handle)
    if g.faults.no_energy_counter:
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
    return int(g.energy_mj())


def nvmlDeviceGetPowerUsage(handle) -> int:  # noqa: N802
    return int(_gpu(handle).power_mw())


def nvmlDeviceGetPowerManagementLimitConstraints(handle) -> list[int]:  # noqa: N802
    tr = _gpu(handle, feature="power").trace
    return [int(tr.min_power_limit_w * 1000), int(tr.max_power_limit_w * 1000)]


def nvmlDeviceGetPowerManagementDefaultLimit(handle) -> int:  # noqa: N802
    return int(_gpu(handle, feature="power").trace.max_power_limit_w * 1000)


def nvmlDeviceGetPowerManagementLimit(handle) -> int:  # noqa: N802
    return _gpu(handle, feature="power").power_limit_mw


nvmlDeviceGetEnforcedPowerLimit = nvmlDeviceGetPowerManagementLimit


def nvmlDeviceSetPowerManagementLimit(handle, limit: int) -> None:  # noqa: N802
    g = _gpu(handle, feature="power", setter=True)
    lo, hi = g.trace.min_power_limit_w * 1000, g.trace.max_power_limit_w * 1000
    if not lo <= int(limit) <= hi:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    g.set_power_limit_mw(int(limit))


# -- persistence ----------------------------------------------------------------------------------
def nvmlDeviceGetPersistenceMode(handle) -> int:  # noqa: N802
    on = _gpu(handle, feature="persistence").persistence
    return _real.NVML_FEATURE_ENABLED if on else _real.NVML_FEATURE_DISABLED


def nvmlDeviceSetPersistenceMode(handle, mode: int) -> None:  # noqa: N802
    _gpu(handle, feature="persistence", setter=True).set_persistence(mode == _real.NVML_FEATURE_ENABLED)


# -- clocks ---------------------------------------------------------------------------------------
def nvmlDeviceGetSupportedMemoryClocks(handle) -> list[int]:  # noqa: N802
    return list(_gpu(handle, feature="clocks").spec.memory_clocks_mhz)


def nvmlDeviceGetSupportedGraphicsClocks(handle, memoryClockMHz: int) -> list[int]:  # noqa: N802, N803
    g = _gpu(handle, feature="clocks")
    if memoryClockMHz not in g.spec.memory_clocks_mhz:
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    return g.spec.supported_sm_clocks_mhz()


def nvmlDeviceGetMaxClockInfo(handle, clock_type: int) -> int:  # noqa: N802
    g = _gpu(handle)
    return g.spec.max_sm_clock_mhz if clock_type != _real.NVML_CLOCK_MEM else g.spec.memory_clocks_mhz[0]


def nvmlDeviceGetClockInfo(handle, clock_type: int) -> int:  # noqa: N802
    g = _gpu(handle)
    if clock_type == _real.NVML_CLOCK_MEM:
        return g.spec.memory_clocks_mhz[0]
    rel, _ = g.operating_point()
    return int(g.spec.max_sm_clock_mhz / rel)


def nvmlDeviceSetGpuLockedClocks(handle, minGpuClockMHz: int, maxGpuClockMHz: int) -> None:  # noqa: N802, N803
    g = _gpu(handle, feature="clocks", setter=True)
    if not (g.spec.min_sm_clock_mhz <= minGpuClockMHz <= maxGpuClockMHz <= g.spec.max_sm_clock_mhz):
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
    g.lock_sm_clocks(int(minGpuClockMHz), int(maxGpuClockMHz))


def nvmlDeviceResetGpuLockedClocks(handle) -> None:  # noqa: N802
    _gpu(handle, feature="clocks", setter=True).reset_sm_clocks()


def nvmlDeviceSetMemoryLockedClocks(handle, minMemClockMHz: int, maxMemClockMHz: int) -> None:  # noqa: N802, N803
    _gpu(handle, feature="clocks", setter=True).set_memory_clocks_locked(True)


def nvmlDeviceResetMemoryLockedClocks(handle) -> None:  # noqa: N802
    _gpu(handle, feature="clocks", setter=True).set_memory_clocks_locked(False)


def nvmlDeviceGetTemperature(handle, sensor: int) -> int:  # noqa: N802
    _gpu(handle)
    return 40
